"""remote.py's rack-scale pieces without a network: the retry policy (what is transient, the
budget), the shared jump host (one connect, a refusal remembered), and bounded fan-out (at most
max_parallel at once; a hung node frees its slot at its own deadline)."""

from __future__ import annotations

import threading
import time

import paramiko
import pytest

from cluster import remote, waits
from cluster.inventory import Node


@pytest.mark.parametrize("exc,transient", [
    (paramiko.SSHException("Error reading SSH protocol banner[Errno 104] reset"), True),
    (ConnectionResetError(104, "reset"), True),
    (EOFError(), True),
    (paramiko.SSHException("Timeout opening channel."), True),
    (paramiko.AuthenticationException("Authentication failed."), False),
    (paramiko.BadHostKeyException("h", paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()),
     False),
    (paramiko.SSHException("Server 'h' not found in known_hosts"), False),
    (TimeoutError(), False),
    (OSError(111, "Connection refused"), False),
])
def test_what_is_retried(exc, transient):
    assert remote.is_transient(exc) is transient


def test_retrying_until_success(monkeypatch):
    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    calls = []

    def attempt():
        calls.append(1)
        if len(calls) < 3:
            raise EOFError()
        return "conn"

    assert remote.retrying(attempt, budget_s=10, attempt_s=1) == "conn" and len(calls) == 3


def test_an_auth_failure_is_tried_once(monkeypatch):
    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    calls = []

    def attempt():
        calls.append(1)
        raise paramiko.AuthenticationException("denied")

    with pytest.raises(remote.GaveUp) as gave_up:
        remote.retrying(attempt, budget_s=10, attempt_s=1)
    assert len(calls) == 1 and gave_up.value.attempts == 1 and gave_up.value.attempts_text == ""


def test_retries_stop_when_the_budget_cannot_hold_another_attempt(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(remote.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(remote.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    def attempt():
        clock[0] += 1.0  # each try costs a second
        raise EOFError()

    with pytest.raises(remote.GaveUp) as gave_up:
        remote.retrying(attempt, budget_s=4, attempt_s=1)
    assert clock[0] <= 4 + 1 and gave_up.value.attempts >= 2


class _FakeConn:
    def __init__(self, error=None):
        self.error = error
        self.is_connected = False
        self.transport = None

    def open(self):
        if self.error:
            raise self.error
        self.is_connected = True

    def close(self):
        self.is_connected = False


def test_jump_host_connects_once_for_every_node():
    made = []
    jump = remote.JumpHost(lambda: made.append(_FakeConn()) or made[-1], "jump host b", 5, 10)
    threads = [threading.Thread(target=jump.open) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and jump.connects == 1


def test_jump_host_refusal_is_remembered_not_retried_per_node():
    made = []

    def make():
        made.append(_FakeConn(paramiko.AuthenticationException("denied")))
        return made[-1]

    jump = remote.JumpHost(make, "jump host b", 5, 10)
    for _ in range(5):
        with pytest.raises(remote._JumpHostError, match="authentication failed"):
            jump.open()
    assert len(made) == 1  # the bastion was asked once, not once per node


def _nodes(n):
    return [Node(name=f"n{i}", address=f"10.0.0.{i}") for i in range(1, n + 1)]


def test_fan_out_is_bounded_and_a_hung_node_frees_its_slot():
    running, peak = [0], [0]
    lock = threading.Lock()
    release = threading.Event()

    def work(node):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        if node.name == "n1":
            release.wait(30)  # hung
        else:
            time.sleep(0.01)
        with lock:
            running[0] -= 1
        return "ok"

    try:
        results = remote.parallel(_nodes(40), work, deadline_s=1.0,
                                  late=lambda n: "late", max_parallel=4)
    finally:
        release.set()
    assert results["n1"] == "late"
    assert all(results[f"n{i}"] == "ok" for i in range(2, 41))
    assert peak[0] <= 5  # 4 slots, plus the abandoned hung thread once its slot was freed


def test_a_late_result_is_not_overwritten():
    gate = threading.Event()

    def work(node):
        gate.wait(5)
        return "finished"

    results = remote.parallel(_nodes(1), work, deadline_s=0.2, late=lambda n: "late")
    gate.set()
    time.sleep(0.1)
    assert results == {"n1": "late"}


def test_making_a_connection_never_rewrites_the_shared_config(monkeypatch):
    """A new node's Connection must not re-merge the Config other nodes' threads are reading.

    invoke re-merges a Config (emptying its dict first) on every write; Fabric 3's Connection
    wrote `inline_ssh_env` into it, and at 128 nodes a node running a command now and then saw
    no `run` key at all.
    """
    import invoke.config

    from cluster.inventory import SSHOptions

    runner = remote.SSHRunner(SSHOptions())
    config = runner._fabric_config()
    merges = []
    real_merge = invoke.config.Config.merge
    monkeypatch.setattr(invoke.config.Config, "merge",
                        lambda self: (merges.append(self), real_merge(self))[1])
    conns = [runner._make(f"198.18.0.{i}", "root", 22, None, None) for i in range(1, 4)]
    assert [m for m in merges if m is config] == []
    assert config._modifications == {}
    assert all(c.config is config and c.inline_ssh_env is True for c in conns)


def test_an_in_memory_stdin_is_sent_in_chunks_not_byte_by_byte():
    """invoke reads a non-terminal stdin one byte per 10 ms: a 7 KB on-node program took 70 s."""
    import io

    cls = remote._event_driven_remote()
    runner = object.__new__(cls)
    text = io.StringIO("x" * 100_000)
    chunks = [runner.read_our_stdin(text) for _ in range(5)]
    assert [len(c) for c in chunks] == [32768, 32768, 32768, 1696, 0]
