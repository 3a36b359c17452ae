"""One command on one SSH session channel (paramiko), its output read by the calling thread.

`run_on_channel(chan, command, stdin, limit, deadline)` starts the command, sends its stdin (the
whole of it, then EOF; EOF at once when there is none), reads stdout and stderr as they come,
each kept bounded (kept.HeadTail: head and tail, the middle's bytes counted), and waits for the
exit status, all by `deadline` (time.monotonic()); past it, TimeoutError.

Why not invoke's Runner (Fabric's Connection.run): it starts a thread per stream and per stdin
for every command and polls them; at rack scale, through a bastion, a node's preflight is a
handful of commands, and those threads (their start, their wake-ups and the GIL they fight for
with every connection's transport thread) were a large share of the laptop's CPU per node. Here
one event wakes the caller when either stream has data or the channel closed: no thread, no
polling. Only a stdin larger than the server's open window (a few MB) is sent from a thread of
its own, so that its wait for the window never stops the reads that open it.

`exchange_on_channel(chan, command, asks, enough, limit, deadline)` holds a conversation with one
command instead: it sends a newline, waits for the line the command prints back, and so on up to
`asks` times (or until `enough(reply)`), each Reply stamped with this machine's clock when the ask
left and when its answer came; then EOF, and the command's end as above. A clock sample is one
such ask: three samples are three round trips on one channel, not three commands (each a channel
open, an exec request, an exit status and a close: most of a node's packets at rack scale).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from cluster.base.threads import Call
from cluster.nodes.kept import HeadTail

READ_BYTES = 1 << 16     # per recv: paramiko hands over what is buffered, up to this
DRAIN_READS = 64         # per stream and pass: 4 MiB, twice paramiko's 2 MiB receive window


@dataclass(frozen=True)
class Finished:
    """What the command left: its exit status (-1 when the channel closed without one, e.g. the
    command was killed by a signal or the connection died), its decoded output, bytes cut."""

    exit_code: int
    stdout: str
    stderr: str
    cut: int


class _Wakeup:
    """The event paramiko's two stream buffers of a channel set when data arrives or they close.

    paramiko also clears a buffer's event when a read empties that buffer, which would lose a
    wake-up the other stream gave meanwhile; so clear() from paramiko does nothing, and the
    reader re-arms the event itself before it drains both streams (a wake-up is never lost, at
    worst one is spurious)."""

    def __init__(self):
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        pass

    def is_set(self) -> bool:
        return self._event.is_set()

    def rearm(self) -> None:
        self._event.clear()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)


@dataclass(frozen=True)
class Reply:
    """One answer of a conversation (exchange_on_channel): the line the command printed (its
    newline removed), and this machine's clock (time.time()) just before the ask left and when
    the answer had arrived."""

    sent_s: float
    line: str
    received_s: float

    @property
    def round_trip_s(self) -> float:
        return self.received_s - self.sent_s


def run_on_channel(chan, command: str, stdin: bytes | None, limit: int,
                   deadline: float) -> Finished:
    """Run `command` on the open session channel `chan`; its output bounded to `limit` bytes a
    stream. Raises TimeoutError past `deadline`; paramiko's / socket errors pass through (the
    session broke). The caller closes the channel."""
    wake = _start(chan, command, deadline)
    _send_stdin(chan, stdin)
    return _finish(chan, wake, HeadTail(limit), HeadTail(limit), deadline)


def exchange_on_channel(chan, command: str, asks: int, enough: Callable[[Reply], bool],
                        limit: int, deadline: float, after: bytes | None = None
                        ) -> tuple[tuple[Reply, ...], Finished]:
    """Start `command`, then up to `asks` times: send a newline and wait for the line it prints
    back (stopping early once `enough(reply)`); then EOF, and wait for its end. The replies, and
    what it left (its stdout, the replies' lines included, bounded like run_on_channel's; its
    stderr; its exit status). A command that
    ends, or prints `limit` bytes without a newline, ends the asking. Raises TimeoutError past
    `deadline`, like run_on_channel; the caller closes the channel.

    `after`: the asking starts once the command printed this line (a command's output, then
    its conversation: the preflight's gather and its clock samples on one channel); stdout is
    then what came before that line, the replies' lines left out. A command that ends, or
    prints `limit` bytes, without it is asked nothing."""
    wake = _start(chan, command, deadline)
    out, err = HeadTail(limit), HeadTail(limit)
    replies: list[Reply] = []
    pending = b""
    if after is not None:
        pending = _read_past(chan, wake, after, out, err, limit, deadline)
        if pending is None:
            asks, pending = 0, b""
    while len(replies) < asks and not (chan.eof_received or chan.closed):
        sent = time.time()
        try:
            chan.sendall(b"\n")
        except OSError:   # the command ended and its channel closed meanwhile
            break
        line, pending = _read_line(chan, wake, pending, err, limit, deadline)
        if line is None:
            break
        reply = Reply(sent, line.decode("utf-8", "replace"), time.time())
        if after is None:
            out.add(line + b"\n")
        replies.append(reply)
        if enough(reply):
            break
    chan.shutdown_write()
    out.add(pending)
    return tuple(replies), _finish(chan, wake, out, err, deadline)


def _read_past(chan, wake: _Wakeup, mark: bytes, out: HeadTail, err: HeadTail, limit: int,
               deadline: float) -> bytes | None:
    """stdout up to the line `mark` kept in `out`; what came after that line, or None when the
    command ended, or printed `limit` bytes, without it (all it printed is in `out` then).
    Each read is searched once, from where the line could begin (linear in the output)."""
    line = b"\n" + mark + b"\n"
    seen = bytearray(b"\n")     # a leading newline: the mark may be the very first line
    while True:
        wake.rearm()
        ended = chan.eof_received or chan.closed
        _drain_stream(chan.recv_stderr_ready, chan.recv_stderr, err)
        if chan.recv_ready():
            start = max(0, len(seen) - len(line) + 1)
            seen += chan.recv(READ_BYTES)
            at = seen.find(line, start)
            if at >= 0:
                out.add(bytes(seen[1:at + 1]))
                return bytes(seen[at + len(line):])
            if len(seen) > limit:
                out.add(bytes(seen[1:]))
                return None
            continue
        if ended:
            out.add(bytes(seen[1:]))
            return None
        left = deadline - time.monotonic()
        if left <= 0 or not wake.wait(left):
            raise TimeoutError("no answer by the deadline")


def _read_line(chan, wake: _Wakeup, pending: bytes, err: HeadTail, limit: int,
               deadline: float) -> tuple[bytes | None, bytes]:
    """(one line of stdout without its newline, what came after it), or (None, what came) when
    the command ended first or `limit` bytes came without a newline. stderr is kept as it comes
    (a command that writes there never stalls on the window)."""
    while b"\n" not in pending:
        if len(pending) >= limit:
            return None, pending
        wake.rearm()
        ended = chan.eof_received or chan.closed
        _drain_stream(chan.recv_stderr_ready, chan.recv_stderr, err)
        if chan.recv_ready():
            pending += chan.recv(READ_BYTES)
            continue
        if ended:
            return None, pending
        left = deadline - time.monotonic()
        if left <= 0 or not wake.wait(left):
            raise TimeoutError("no answer by the deadline")
    line, _, rest = pending.partition(b"\n")
    return line, rest


def _start(chan, command: str, deadline: float) -> _Wakeup:
    """The channel's wake-up event set, its timeout at the deadline, the command started."""
    wake = _Wakeup()
    chan.in_buffer.set_event(wake)
    chan.in_stderr_buffer.set_event(wake)
    chan.settimeout(max(0.001, deadline - time.monotonic()))
    chan.exec_command(command)
    return wake


def _finish(chan, wake: _Wakeup, out: HeadTail, err: HeadTail, deadline: float) -> Finished:
    """Both streams read to their end (bounded), then the exit status, by the deadline."""
    while True:
        wake.rearm()
        ended = chan.eof_received or chan.closed  # nothing arrives after it: drained below
        _drain(chan, out, err)
        if ended and not (chan.recv_ready() or chan.recv_stderr_ready()):
            break
        left = deadline - time.monotonic()
        if left <= 0 or not (ended or wake.wait(left)):
            raise TimeoutError("no end of output by the deadline")
    if not chan.status_event.wait(max(0.0, deadline - time.monotonic())):
        raise TimeoutError("no exit status by the deadline")
    return Finished(chan.recv_exit_status(), _text(out), _text(err), out.cut + err.cut)


def _send_stdin(chan, stdin: bytes | None) -> None:
    """stdin then EOF: inline when the server's window holds all of it (sendall cannot block
    then), else from a thread (sendall waits for window adjustments, which need our reads)."""
    if not stdin:
        chan.shutdown_write()
    elif len(stdin) <= chan.out_window_size:
        chan.sendall(stdin)
        chan.shutdown_write()
    else:
        Call(lambda: _send_all_then_eof(chan, stdin), name="ssh-stdin")


def _send_all_then_eof(chan, data: bytes) -> None:
    try:
        chan.sendall(data)
        chan.shutdown_write()
    except OSError:  # the command ended (or the channel closed) before reading all of it
        pass


def _drain(chan, out: HeadTail, err: HeadTail) -> None:
    """What both streams hold now, at most DRAIN_READS reads each (a stream that never stops
    neither starves the other nor keeps the caller from its deadline)."""
    _drain_stream(chan.recv_ready, chan.recv, out)
    _drain_stream(chan.recv_stderr_ready, chan.recv_stderr, err)


def _drain_stream(ready, recv, kept: HeadTail) -> None:
    for _ in range(DRAIN_READS):
        if not ready():
            break
        kept.add(recv(READ_BYTES))


def _text(kept: HeadTail) -> str:
    return kept.text(lambda data: data.decode("utf-8", "replace"))
