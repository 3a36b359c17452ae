"""A command on a bare SSH session channel (cluster/nodes/channel_run.py and SSHRunner.run),
against a paramiko SSH server in this process (tests/fakes.InProcessSSH, a socketpair): stdin
and its EOF, both streams read at once and kept bounded, exit codes, deadlines, a session or a
connection that breaks, and no reader threads or polling."""

from __future__ import annotations

import threading
import time

import pytest
from paramiko import Channel

from cluster.base.errors import CommandTimeout, ConnectError
from cluster.nodes import channel_run, remote
from cluster.nodes.inventory import Node, SSHOptions
from fakes import InProcessSSH

MB = 1 << 20
MARKS: list[float] = []      # when "output-then-clock" sent its mark line


def _read_stdin(chan) -> bytes:
    chunks = []
    for data in iter(lambda: chan.recv(32768), b""):
        chunks.append(data)
    return b"".join(chunks)


def _finish(chan, code: int | None) -> None:
    if code is not None:
        chan.send_exit_status(code)
    chan.close()


def handler(command: str, chan) -> None:
    """What the fake sshd does for each command."""
    if command == "hello":
        chan.sendall(b"out\n")
        chan.sendall_stderr(b"err\n")
        _finish(chan, 3)
    elif command == "cat":                       # stdin back on stdout, its size on stderr
        data = _read_stdin(chan)
        chan.sendall(data)
        chan.sendall_stderr(str(len(data)).encode())
        _finish(chan, 0)
    elif command == "wait-for-eof":              # exits only once its stdin is at its end
        _finish(chan, 0 if _read_stdin(chan) == b"" else 1)
    elif command.startswith("flood "):           # N MiB on each stream, interleaved
        for i in range(int(command.split()[1]) * 16):
            chan.sendall(bytes([65 + i % 26]) * (MB // 16))
            chan.sendall_stderr(bytes([97 + i % 26]) * (MB // 16))
        chan.sendall(b"END")
        _finish(chan, 0)
    elif command == "hang":
        time.sleep(30)
    elif command == "no-status":                 # killed by a signal: no exit-status message
        chan.sendall(b"partial")
        _finish(chan, None)
    elif command == "drop-connection":           # the node's sshd or the link goes away
        chan.sendall(b"partial")
        chan.get_transport().close()
    elif command == "clock":                     # a line per newline read, until EOF
        buffered = b""
        count = 0
        for data in iter(lambda: chan.recv(1024), b""):
            buffered += data
            while b"\n" in buffered:
                _, _, buffered = buffered.partition(b"\n")
                count += 1
                chan.sendall(b"%d.5\n" % (1000 + count))
                chan.sendall_stderr(b"e")
        chan.sendall(b"bye")
        _finish(chan, 0)
    elif command.startswith("output-then-clock"):   # its output (the mark line cut in two
        chunk = b"".join(b"|line %d\n" % i for i in range(4000))   # sends), then a clock
        chan.sendall(chunk)
        if "mark-first" not in command:
            chan.sendall(chunk + b"|last")
        time.sleep(0.2)
        MARKS.append(time.time())
        chan.sendall(b"" if "mark-first" in command else b"\n")
        chan.sendall(b"@@cl")
        chan.sendall(b"ock@@\n")
        handler("clock", chan)
        return
    elif command == "output-no-mark":
        chan.recv(1024) if chan.recv_ready() else None
        chan.sendall(b"|a\n|b\n@@clock@@ but not alone\n")
        _finish(chan, 0)
    elif command == "answer-once":               # one answer, then it ends (date failed)
        chan.recv(1024)
        chan.sendall(b"1.0\n")
        chan.sendall_stderr(b"date: broken\n")
        _finish(chan, 1)
    elif command == "silent":                    # reads its input, never answers
        _read_stdin(chan)
        time.sleep(30)
    elif command == "no-newline":                # answers with a line that never ends
        chan.recv(1024)
        chan.sendall(b"x" * (200 << 10))
        _read_stdin(chan)
        _finish(chan, 0)


@pytest.fixture
def ssh():
    server = InProcessSSH(handler)
    yield server
    server.close()


def _run(ssh, command, stdin=None, limit=MB, timeout_s=20.0):
    chan = ssh.client.open_session(timeout=10)
    try:
        return channel_run.run_on_channel(chan, command, stdin, limit,
                                          time.monotonic() + timeout_s)
    finally:
        chan.close()


def _exchange(ssh, command, asks=3, enough=lambda reply: False, limit=64 << 10, timeout_s=60.0,
              after=None):
    """(A deadline, not a timing: a loaded 2-core machine took over 20 s for 8,000 lines.)"""
    chan = ssh.client.open_session(timeout=10)
    try:
        return channel_run.exchange_on_channel(chan, command, asks, enough, limit,
                                               time.monotonic() + timeout_s, after)
    finally:
        chan.close()


def test_output_streams_and_exit_code(ssh):
    assert _run(ssh, "hello") == channel_run.Finished(3, "out\n", "err\n", 0)


def test_no_stdin_means_eof_at_once(ssh):
    """A command that reads its stdin ends (invoke's runner never closed it: it hung)."""
    assert _run(ssh, "wait-for-eof", timeout_s=5).exit_code == 0


@pytest.mark.parametrize("size", [7_000, 5 * MB])
def test_stdin_is_sent_whole_then_eof(ssh, size):
    """A program on stdin, small (sent inline) or larger than the server's 2 MiB window (sent
    from a thread while the caller reads the echo that opens the window again)."""
    data = bytes(range(256)) * (size // 256)
    done = _run(ssh, "cat", data, limit=8 * MB)
    assert done.exit_code == 0 and done.stderr == str(len(data)) and done.cut == 0
    assert done.stdout.encode("utf-8", "surrogateescape") == data.decode(
        "utf-8", "replace").encode("utf-8", "surrogateescape")


def test_both_streams_are_read_at_once_and_kept_bounded(ssh):
    """6 MiB on each stream, interleaved (three times paramiko's window: reading one stream
    to its end first would stall the other); each kept as its head and tail."""
    done = _run(ssh, "flood 6", limit=64 << 10)
    assert done.exit_code == 0
    assert done.cut == 2 * 6 * MB + 3 - 2 * (64 << 10)
    assert done.stdout.startswith("A" * 1000) and done.stdout.endswith("END")
    assert done.stderr.startswith("a" * 1000) and "bytes cut]" in done.stderr


@pytest.mark.parametrize("command", ["hang", "silent"])
def test_a_command_past_its_deadline_times_out(ssh, command):
    """A command that never ends (run), or one that never answers an ask (exchange)."""
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        if command == "hang":
            _run(ssh, command, timeout_s=0.5)
        else:
            _exchange(ssh, command, timeout_s=0.5)
    assert time.monotonic() - start < 10


def test_a_channel_closed_without_exit_status_is_minus_one(ssh):
    done = _run(ssh, "no-status")
    assert (done.exit_code, done.stdout) == (-1, "partial")


def test_an_exchange_is_one_line_per_ask_on_one_channel_then_eof(ssh):
    before = time.time()
    replies, done = _exchange(ssh, "clock", asks=3)
    assert [r.line for r in replies] == ["1001.5", "1002.5", "1003.5"]
    assert all(before <= r.sent_s <= r.received_s <= time.time() for r in replies)
    assert [r.sent_s for r in replies] == sorted(r.sent_s for r in replies)
    # EOF after the third ask ended the command: all it printed (the replies' lines, then what
    # came after them), its stderr, its status
    assert done == channel_run.Finished(0, "1001.5\n1002.5\n1003.5\nbye", "eee", 0)


def test_an_exchange_stops_asking_once_a_reply_is_enough(ssh):
    replies, done = _exchange(ssh, "clock", asks=5, enough=lambda r: r.line == "1002.5")
    assert [r.line for r in replies] == ["1001.5", "1002.5"] and done.exit_code == 0


def test_an_exchange_with_a_command_that_ends_early_keeps_what_it_said(ssh):
    replies, done = _exchange(ssh, "answer-once", asks=3)
    assert [r.line for r in replies] == ["1.0"]
    assert (done.exit_code, done.stderr) == (1, "date: broken\n")


def test_an_exchange_after_a_mark_asks_only_once_the_output_is_in(ssh):
    """The gather's conversation: its output (here 2 x 4000 lines, the mark line arriving in
    two pieces) is stdout, the asking starts only after the mark line, the replies are not
    stdout."""
    MARKS.clear()
    replies, done = _exchange(ssh, "output-then-clock", asks=2, limit=MB, after=b"@@clock@@")
    assert [r.line for r in replies] == ["1001.5", "1002.5"]
    assert MARKS and all(r.sent_s >= MARKS[0] for r in replies)
    lines = done.stdout.split("\n")       # (what it said after the replies is kept: "bye")
    assert len(lines) == 8002 and lines[0] == "|line 0" and lines[-2:] == ["|last", "bye"]
    assert "@@clock@@" not in done.stdout and "1001.5" not in done.stdout
    assert (done.exit_code, done.stderr, done.cut) == (0, "ee", 0)
    # the mark as the very first thing said: no output, the same conversation
    replies, done = _exchange(ssh, "output-then-clock mark-first", asks=1, limit=MB,
                              after=b"@@clock@@")
    assert [r.line for r in replies] == ["1001.5"] and done.stdout.count("\n") == 4000
    assert done.stdout.endswith("|line 3999\nbye")


def test_an_exchange_whose_mark_never_comes_asks_nothing(ssh):
    """A line that holds the mark but is not it, then the end: all of it is stdout, no ask;
    output past the limit without the mark stops the waiting too (bounded)."""
    replies, done = _exchange(ssh, "output-no-mark", asks=3, after=b"@@clock@@")
    assert replies == () and done.stdout == "|a\n|b\n@@clock@@ but not alone\n"
    replies, done = _exchange(ssh, "output-then-clock", asks=3, limit=32 << 10,
                              after=b"@@clock@@")
    assert replies == () and done.cut > 0 and len(done.stdout) < 100 << 10


def test_an_answer_without_a_newline_is_bounded_and_ends_the_asking(ssh):
    replies, done = _exchange(ssh, "no-newline", limit=64 << 10)
    assert replies == () and done.exit_code == 0
    assert done.cut > 0 and len(done.stdout) < 200 << 10


def test_ssh_runner_exchange_result_holds_the_replies(ssh, monkeypatch):
    runner, forgotten = _runner(ssh, monkeypatch)
    got = runner.exchange(NODE, "clock", 2, lambda r: False, timeout=20)
    assert [r.line for r in got.replies] == ["1001.5", "1002.5"]
    assert (got.result.status, got.result.stdout, got.result.stderr) == \
        ("ok", "1001.5\n1002.5\nbye", "ee")
    after = runner.exchange(NODE, "output-then-clock", 1, lambda r: False, timeout=20,
                            after="@@clock@@")
    assert [r.line for r in after.replies] == ["1001.5"]
    assert after.result.stdout.endswith("|line 3999\n|last\nbye") and after.result.ok
    with pytest.raises(CommandTimeout):
        runner.exchange(NODE, "silent", 2, lambda r: False, timeout=0.5)
    assert forgotten == ["n1"]


def test_one_command_starts_no_thread_and_never_polls(ssh, monkeypatch):
    """invoke's runner started 3 threads per command (stdout, stderr, stdin readers) and
    polled them; the caller's thread reads both streams, woken by the channel."""
    me, real_sleep, slept = threading.current_thread(), time.sleep, []

    def sleep(seconds):  # the fake sshd's threads may sleep; the caller's thread must not
        if threading.current_thread() is me:
            slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(channel_run, "Call", lambda *a, **k: pytest.fail("a thread started"))
    monkeypatch.setattr(time, "sleep", sleep)
    before = threading.active_count()
    assert _run(ssh, "cat", b"x" * 100_000, limit=MB).stderr == "100000"
    assert _run(ssh, "hello").exit_code == 3
    # the fake sshd's handler threads may still be ending; the client made none
    assert threading.active_count() <= before + 2 and slept == []


class _Conn:
    def __init__(self, transport):
        self.transport = transport


def _runner(ssh, monkeypatch):
    runner = remote.SSHRunner(SSHOptions())
    forgotten = []
    monkeypatch.setattr(runner, "_open", lambda node: _Conn(ssh.client))
    monkeypatch.setattr(runner, "_forget",
                        lambda node, conn: forgotten.append(node.name))
    return runner, forgotten


NODE = Node(name="n1", address="198.18.0.1")


def test_ssh_runner_result_and_cut(ssh, monkeypatch):
    runner, forgotten = _runner(ssh, monkeypatch)
    monkeypatch.setattr(remote, "output_limit", lambda: 64 << 10)
    res = runner.run(NODE, "flood 1", timeout=20, stdin=None)
    assert (res.status, res.exit_code, res.cut) == ("ok", 0, 2 * MB + 3 - 2 * (64 << 10))
    res = runner.run(NODE, "cat", timeout=20, stdin="secret\n")
    assert (res.stdout, res.stderr) == ("secret\n", "7")
    res = runner.run(NODE, "hello", timeout=20)
    assert (res.status, res.exit_code, res.stdout) == ("failed", 3, "out\n")
    assert forgotten == []


def test_ssh_runner_timeout_drops_the_connection(ssh, monkeypatch):
    runner, forgotten = _runner(ssh, monkeypatch)
    with pytest.raises(CommandTimeout):
        runner.run(NODE, "hang", timeout=0.5)
    assert forgotten == ["n1"]


class _ChannelsCannotClose:
    """The fake sshd's transport as the client sees it once its link is cut: a new channel
    opens and runs, but its close raises EOFError, as paramiko's does when its packetizer
    is closed before the channel is marked closed (seen with a node's link cut mid-gather)."""

    def __init__(self, transport):
        self._transport = transport

    def open_session(self, timeout=None):
        chan = self._transport.open_session(timeout=timeout)

        def close():
            Channel.close(chan)
            raise EOFError()

        chan.close = close
        return chan

    def is_active(self):
        return self._transport.is_active()


def _runner_whose_channels_cannot_close(ssh, monkeypatch):
    runner, forgotten = _runner(ssh, monkeypatch)
    monkeypatch.setattr(runner, "_open", lambda node: _Conn(_ChannelsCannotClose(ssh.client)))
    return runner, forgotten


def test_a_timeout_whose_channel_cannot_close_is_still_a_timeout(ssh, monkeypatch):
    """The close's EOFError must not replace the timeout: it ended a whole preflight as an
    internal error, every node's result lost, the listeners left on the nodes (2026-12-07)."""
    runner, forgotten = _runner_whose_channels_cannot_close(ssh, monkeypatch)
    with pytest.raises(CommandTimeout):
        runner.run(NODE, "hang", timeout=0.5)
    with pytest.raises(CommandTimeout):
        runner.exchange(NODE, "hang", asks=2, enough=lambda reply: False, timeout=0.5)
    assert set(forgotten) == {"n1"}


def test_an_answered_command_whose_channel_cannot_close_keeps_its_answer(ssh, monkeypatch):
    """The command answered, then its transport went: the answer stands, and the connection
    is forgotten so the next command connects anew."""
    runner, forgotten = _runner_whose_channels_cannot_close(ssh, monkeypatch)
    res = runner.run(NODE, "hello", timeout=20)
    assert (res.status, res.exit_code, res.stdout) == ("failed", 3, "out\n")
    assert forgotten == ["n1"]


def test_forgetting_a_dead_connection_spares_one_made_since():
    """A failure forgets the connection it happened on, not one another thread made since."""
    class Conn:
        closed = False

        def close(self):
            self.closed = True

    runner, old, new = remote.SSHRunner(SSHOptions()), Conn(), Conn()
    runner._connections["n1"] = new
    runner._forget(NODE, old)
    assert runner._connections == {"n1": new}
    runner._forget(NODE, new)
    assert runner._connections == {}
    for _ in range(100):        # closed in a daemon thread (a frozen sshd may block a close)
        if new.closed:
            break
        time.sleep(0.05)
    assert new.closed and not old.closed


def test_ssh_runner_lost_connection_is_a_connect_error(ssh, monkeypatch):
    runner, forgotten = _runner(ssh, monkeypatch)
    with pytest.raises(ConnectError, match="connection lost"):
        runner.run(NODE, "drop-connection", timeout=10)
    assert forgotten == ["n1"]
    with pytest.raises(ConnectError, match="connection lost"):  # the session cannot open
        runner.run(NODE, "hello", timeout=5)
