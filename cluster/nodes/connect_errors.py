"""Why a node could not be reached, named for what it is, and the one text of a jump host's
failure that every node behind it shares (made by remote.py, read back by cluster/report/fold.py).

A socket error is named by its errno (no route to host, network unreachable, connection
refused, timed out), also inside paramiko's NoValidConnectionsError, which wraps refused and
unroutable connects alike; an SSH server that accepted the TCP connection and never sent its
banner is "timed out waiting for the SSH banner". Stdlib only at import: the report layer
reads the shared-cause text without loading paramiko.
"""

from __future__ import annotations

import errno
import re
import socket
from dataclasses import dataclass

_BY_ERRNO = {errno.EHOSTUNREACH: "no route to host",
             errno.ENETUNREACH: "no route to host (network unreachable)",
             errno.ECONNREFUSED: "connection refused",
             errno.ETIMEDOUT: "connect timed out",
             errno.EHOSTDOWN: "no route to host (host is down)"}
BANNER_TIMED_OUT = "timed out waiting for the SSH banner: TCP connected, nothing answered"
BANNER_CLOSED = "closed before the SSH banner: TCP connected, then the far side hung up"
_BANNER = "Error reading SSH protocol banner"


def socket_failure(exc: BaseException) -> str | None:
    """What a failed TCP connect was (None when `exc` is not one): its errno's name, or each
    distinct one of the errors a NoValidConnectionsError wraps (one per address tried)."""
    wrapped = getattr(exc, "errors", None)
    if isinstance(exc, OSError) and isinstance(wrapped, dict) and wrapped:
        names = [socket_failure(e) or str(e) for e in wrapped.values()]
        return "; ".join(dict.fromkeys(names))
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "connect timed out"
    if isinstance(exc, OSError) and exc.errno in _BY_ERRNO:
        return _BY_ERRNO[exc.errno]
    return None


def banner_failure(exc: BaseException) -> str | None:
    """What paramiko's failed banner read was, after a TCP connect that succeeded: the SSH
    server never spoke (a timeout), or the connection closed first (EOF); None otherwise (a
    reset names itself in paramiko's message). The cause is the error's context."""
    if not str(exc).startswith(_BANNER):
        return None
    if isinstance(exc.__context__, (socket.timeout, TimeoutError)):
        return BANNER_TIMED_OUT
    if isinstance(exc.__context__, EOFError):
        return BANNER_CLOSED
    return None


# ---------------------------------------------------------------- the shared cause

_JUMP_DOWN = re.compile(r"jump host (?P<host>\S+) unreachable \((?P<cause>.+)\)\Z", re.S)


@dataclass(frozen=True)
class JumpHostDown:
    """A jump host this run could not reach: every node behind it fails with this one cause."""

    jump_host: str      # as the inventory names it: [user@]host[:port]
    cause: str

    @property
    def text(self) -> str:
        return f"jump host {self.jump_host} unreachable ({self.cause})"


def jump_host_down(text: str) -> JumpHostDown | None:
    """The shared cause a node's error text ends with (None when it has none)."""
    found = _JUMP_DOWN.search(text)
    return JumpHostDown(found["host"], found["cause"]) if found else None
