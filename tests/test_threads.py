"""cluster.base.threads: Call, Calls / run_all and parallel keep their deadlines and hand a call's
exception to the caller (no thread traceback)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from cluster.nodes import remote
from cluster.base import threads
from cluster.base.errors import RemoteError
from cluster.base.threads import Call, Calls, parallel, run_all


def _items(n: int):
    return [SimpleNamespace(name=f"n{i}") for i in range(1, n + 1)]


def test_remote_and_ray_cluster_use_the_one_helper():
    from cluster.ray import ray_cluster
    from playbooks import ray_up

    assert remote.parallel is threads.parallel
    assert ray_cluster.Calls is Calls and ray_cluster.run_all is run_all
    # ray_up gathers once (the facts layer): no background gathering thread is left to run
    assert not hasattr(ray_cluster, "_Parallel") and not hasattr(ray_up, "_Background")
    assert "threading" not in vars(ray_up)


def test_call_returns_its_value_and_reraises_its_error():
    assert Call(lambda: 41 + 1).result() == 42

    def boom():
        raise RemoteError("n1", "gone")

    with pytest.raises(RemoteError, match="gone"):
        Call(boom).result()


def test_call_still_running_has_no_result_yet():
    gate = threading.Event()
    call = Call(lambda: gate.wait(5) and "done")
    assert call.result(0.05) is None and not call.finished
    gate.set()
    assert call.result() == "done" and call.finished


def test_calls_wait_until_a_deadline_and_each_after_its_delay():
    gate = threading.Event()
    order: list[str] = []
    lock = threading.Lock()

    def note(name, value):
        with lock:
            order.append(name)
        return value

    calls = Calls([(0.0, lambda: gate.wait(5) and "hung"), (0.0, lambda: note("first", 1)),
                   (0.2, lambda: note("second", 2))])
    assert calls.wait(1, 5) == 1 and calls.wait(2, 5) == 2
    assert calls.wait(0, 0.01) is None          # its deadline has passed: no result
    assert order == ["first", "second"]
    gate.set()
    assert calls.wait(0, 5) == "hung"


def test_run_all_gives_none_for_what_misses_the_deadline():
    gate = threading.Event()
    try:
        assert run_all([(0.0, lambda: "a"), (0.0, lambda: gate.wait(5))], 0.2) == ["a", None]
    finally:
        gate.set()


def test_parallel_raises_a_call_error_after_the_others_ended():
    finished: list[str] = []

    def work(item):
        if item.name == "n2":
            raise RemoteError(item.name, "broken")
        finished.append(item.name)
        return "ok"

    with pytest.raises(RemoteError, match="broken"):
        parallel(_items(5), work, deadline_s=5, late=lambda i: "late", max_parallel=2)
    assert sorted(finished) == ["n1", "n3", "n4", "n5"]


def test_parallel_keys_and_bounds():
    running, peak = [0], [0]
    lock = threading.Lock()

    def work(item):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        with lock:
            running[0] -= 1
        return item.name.upper()

    out = parallel(_items(12), work, 5, lambda i: None, max_parallel=3,
                   key=lambda i: i.name + "!")
    assert out == {f"n{i}!": f"N{i}" for i in range(1, 13)} and peak[0] <= 3
    assert parallel([], work, 5, lambda i: None) == {}
