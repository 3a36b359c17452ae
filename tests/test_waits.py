"""cluster/base/waits.py: the one bounded poll/retry helper (deadline, interval, attempts, typed
timeout error), on a fake clock."""

from __future__ import annotations

import math

import pytest

from cluster.base import waits
from cluster.base.errors import ClusterError
from tests.fakes import FakeClock


def test_poll_returns_as_soon_as_the_condition_holds():
    clock = FakeClock()
    values = iter([1, 2, 3, 4])
    seen = []
    got = waits.poll(lambda: next(values), lambda v: v == 3, timeout_s=60, interval_s=2,
                     on_value=seen.append, clock=clock, sleep=clock.sleep)
    assert got.done and got.value == 3 and got.attempts == 3 and seen == [1, 2, 3]
    assert got.elapsed_s == 4


def test_poll_stops_when_another_interval_does_not_fit():
    clock = FakeClock()
    got = waits.poll(lambda: "no", lambda v: False, timeout_s=10, interval_s=3,
                     clock=clock, sleep=clock.sleep)
    # tries at 0, 3, 6, 9; at 9 another 3 s would pass the deadline
    assert got.timed_out and got.attempts == 4 and clock.now == 9 and got.value == "no"
    with pytest.raises(waits.WaitTimeout) as err:
        got.value_or_raise("the app")
    assert isinstance(err.value, ClusterError) and "the app" in str(err.value)
    assert "10 s" in str(err.value) and err.value.attempts == 4


def test_poll_attempts_are_bounded_even_with_a_zero_interval():
    clock = FakeClock()
    got = waits.poll(lambda: 0, lambda v: False, timeout_s=5, interval_s=0, max_attempts=7,
                     clock=clock, sleep=clock.sleep)
    assert got.timed_out and got.attempts == 7
    calls = []
    got = waits.poll(lambda: calls.append(1), lambda v: False, timeout_s=1e9, interval_s=0,
                     clock=clock, sleep=clock.sleep)
    assert got.attempts == len(calls) == waits.MAX_POLL_ATTEMPTS


def test_poll_with_max_attempts_ends_before_its_deadline():
    clock = FakeClock()
    got = waits.poll(lambda: 0, lambda v: False, timeout_s=1000, interval_s=3, max_attempts=4,
                     clock=clock, sleep=clock.sleep)
    assert got.attempts == 4 and clock.now == 9


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, "5", True])
def test_poll_refuses_a_timeout_that_is_not_a_finite_number(bad):
    with pytest.raises(ValueError):
        waits.poll(lambda: 0, lambda v: True, timeout_s=bad, interval_s=1)


def test_a_probe_error_is_the_callers():
    def probe():
        raise OSError("boom")
    with pytest.raises(OSError):
        waits.poll(probe, lambda v: True, timeout_s=5, interval_s=1)


def test_retry_is_bounded_by_attempts():
    clock = FakeClock()
    calls = []

    def attempt():
        calls.append(1)
        raise EOFError()
    with pytest.raises(waits.GaveUp) as gave_up:
        waits.retry(attempt, retryable=lambda e: True, budget_s=1e6, attempt_s=1,
                    max_attempts=5, pause=lambda n: 1.0, clock=clock, sleep=clock.sleep)
    assert len(calls) == 5 and gave_up.value.attempts == 5
    assert gave_up.value.attempts_text == " (after 5 attempts)"


def test_retry_returns_the_first_success_and_passes_a_fatal_error_at_once():
    clock = FakeClock()
    tries = iter([EOFError(), "conn"])

    def attempt():
        t = next(tries)
        if isinstance(t, Exception):
            raise t
        return t
    assert waits.retry(attempt, retryable=lambda e: True, budget_s=10, attempt_s=1,
                       max_attempts=3, pause=lambda n: 0.5, clock=clock, sleep=clock.sleep) == "conn"
    with pytest.raises(waits.GaveUp) as gave_up:
        waits.retry(lambda: (_ for _ in ()).throw(PermissionError("no")),
                    retryable=lambda e: not isinstance(e, PermissionError), budget_s=10,
                    attempt_s=1, max_attempts=3, clock=clock, sleep=clock.sleep)
    assert gave_up.value.attempts == 1 and isinstance(gave_up.value.error, PermissionError)


def test_backoff_pause_is_jittered_exponential_and_capped():
    pauses = [waits.backoff_pause(n) for n in range(1, 10)]
    assert 0.05 <= pauses[0] <= 0.15 and all(p <= 3.0 for p in pauses)


def test_no_hand_written_poll_loop_is_left():
    """Every wait of the laptop's code goes through waits.poll / waits.retry: nothing else
    sleeps, but a threaded call's start delay (threads.py) and bench's back-off inside its
    load loop. On-node programs and the Ray jobs (cluster/node_programs/, cluster/ray_jobs/:
    stdlib only or run on the cluster) are not the laptop's code."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    allowed = {"cluster/base/waits.py", "cluster/base/threads.py", "cluster/serving/bench.py"}
    sleeping = set()
    for path in [*root.glob("cluster/**/*.py"), *root.glob("playbooks/*.py")]:
        name = path.relative_to(root).as_posix()
        if name.startswith(("cluster/node_programs/", "cluster/ray_jobs/")):
            continue
        if "sleep(" in path.read_text():
            sleeping.add(name)
    assert sleeping <= allowed, sorted(sleeping - allowed)
