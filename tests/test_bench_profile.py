"""scripts/simbench.py's THREAD_PROFILER, the benchmarks' profiler (bench_scale's and
bench_preflight_client's --profile): every thread on its own CPU clock, so a thread's waiting is
not counted as its work, and each thread's CPU told by kind (main, fan-out workers, paramiko's
transports over TCP or over a jump host's channel)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import paramiko

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import simbench  # noqa: E402


def _profiler() -> dict:
    space: dict = {}
    exec(compile(simbench.THREAD_PROFILER, "THREAD_PROFILER", "exec"), space)
    return space


def _read_one_byte(fd: int) -> bytes:     # blocks in os.read: not a BLOCKING name
    return os.read(fd, 1)


def test_a_thread_waiting_is_not_counted_as_its_work():
    """cProfile's default clock is the wall clock: a thread blocked in a read for half a second
    was charged half a second of "CPU" (bench_preflight_client's --profile used it)."""
    profiled = _profiler()["profiled"]
    wait_s = 0.5
    r, w = os.pipe()

    def go():
        reader = threading.Thread(target=_read_one_byte, args=(r,), name="cluster-n1")
        reader.start()
        time.sleep(wait_s)          # the main thread's sleep is a blocking call: left out
        os.write(w, b"x")
        reader.join()
        return "done"

    try:
        result, stats, kinds = profiled(go)
    finally:
        os.close(r), os.close(w)
    assert result == "done"
    cpu, threads = kinds["fan-out workers (cluster-*)"]
    assert threads == 1
    assert cpu < wait_s / 2       # a few microseconds of CPU; the wall clock said wait_s
    assert any(name == "_read_one_byte" for _, _, name in stats.stats)


def test_threads_are_told_by_kind():
    thread_kind = _profiler()["thread_kind"]
    a, b = socket.socketpair()
    over_tcp = paramiko.Transport(a)

    class Channelish:   # a node's transport behind a bastion reads a channel, not a socket
        def settimeout(self, seconds):
            pass

    behind = paramiko.Transport(Channelish())
    try:
        assert thread_kind(threading.main_thread()) == "main thread"
        assert thread_kind(threading.Thread(name="cluster-node7-bounded")) == \
            "fan-out workers (cluster-*)"
        assert thread_kind(over_tcp) == "paramiko transport over TCP"
        assert thread_kind(behind) == "paramiko transport over a jump host channel"
        assert thread_kind(threading.Thread(name="ssh-stdin")) == "other: ssh-stdin"
        assert thread_kind(threading.Thread(name="Thread-12")) == "other: Thread-N"
    finally:
        over_tcp.close(), behind.close(), a.close(), b.close()


def test_the_lines_put_the_largest_kind_first_per_node():
    lines = simbench.thread_kinds_lines({"main thread": [0.5, 1], "paramiko transport over TCP":
                                         [1.0, 100]}, nodes=100)
    assert lines == ["    10.00 ms/node    100 threads  paramiko transport over TCP",
                     "     5.00 ms/node      1 threads  main thread"]
