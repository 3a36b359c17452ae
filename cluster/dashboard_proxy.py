"""A loopback-only HTTP proxy to the head's Ray dashboard that adds the head's Ray token.

`cluster dashboard` serves this on 127.0.0.1 (or another loopback address): every client
connection gets its own channel to the dashboard on the head (cluster/head_tunnel.py). Per
connection the proxy reads the request head (bounded: MAX_HEAD_BYTES, MAX_HEADER_LINES,
HEAD_TIMEOUT_S), and in token mode rewrites it: the browser's Authorization,
X-Ray-Authorization and Proxy-Authorization headers and its `ray-authentication-token` cookie
are dropped, `Authorization: Bearer <token>` is added (what Ray 2.60's token middleware reads
first, so the UI never gets a 401 and never shows "Authentication Token Required"), and
`Connection: close` is set unless the request is an upgrade (a websocket), so the next request
comes on a new connection and gets the header too. Then bytes are spliced both ways until the
dashboard ends its reply: streaming, chunked replies and websocket upgrades pass unchanged.
Without a token the request head is forwarded byte for byte.

The token lives only in this process's memory: it is never logged, printed or written, and no
cookie carrying it is ever sent to the browser by the proxy.
"""

from __future__ import annotations

import ipaddress
import re
import selectors
import socket
import threading
from dataclasses import dataclass
from typing import Callable

from cluster.errors import ClusterError, UsageError

MAX_HEAD_BYTES = 64 << 10
MAX_HEADER_LINES = 256
HEAD_TIMEOUT_S = 30.0
MAX_CLIENTS = 128
CHUNK = 64 << 10
TOKEN_COOKIE = "ray-authentication-token"
DROPPED = frozenset({b"authorization", b"x-ray-authorization", b"proxy-authorization"})

_REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}) ([\x21-\x7e]{1,16384}) "
                           rb"(HTTP/1\.[01])")
_HEADER = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}):([\x20-\x7e\x80-\xff\t]*)")


class BadRequest(ClusterError):
    """A request head the proxy will not forward; `status` is the HTTP answer it gets."""

    def __init__(self, status: int, reason: str):
        self.status = status
        self.reason = reason
        super().__init__(f"{status} {reason}")


def loopback_bind(text: str) -> str:
    """--bind ADDR: a loopback IP address (127.0.0.0/8 or ::1), else UsageError."""
    try:
        addr = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        raise UsageError(f"--bind {text!r}: not an IP address; the proxy binds only a loopback "
                         "address (127.0.0.0/8 or ::1)") from None
    if not addr.is_loopback:
        raise UsageError(f"--bind {text}: not a loopback address; the proxy carries the cluster's "
                         "token and binds only 127.0.0.0/8 or ::1 (use an SSH tunnel to reach "
                         "it from elsewhere)")
    return str(addr)


@dataclass(frozen=True)
class RequestHead:
    """A parsed HTTP/1.x request head (header names as sent, values as bytes)."""

    method: bytes
    target: bytes
    version: bytes
    headers: tuple[tuple[bytes, bytes], ...]

    def values(self, name: str) -> list[bytes]:
        key = name.encode().lower()
        return [v for k, v in self.headers if k.lower() == key]

    @property
    def is_upgrade(self) -> bool:
        tokens = {t.strip().lower() for v in self.values("connection") for t in v.split(b",")}
        return b"upgrade" in tokens and bool(self.values("upgrade"))


def parse_head(raw: bytes) -> RequestHead:
    """The request line and header lines of `raw` (without the blank line). BadRequest when
    malformed (obsolete line folding, bare LF, a header without a colon, too many lines)."""
    lines = raw.split(b"\r\n")
    if len(lines) - 1 > MAX_HEADER_LINES:
        raise BadRequest(431, "Request Header Fields Too Large")
    first = _REQUEST_LINE.fullmatch(lines[0])
    if first is None:
        raise BadRequest(400, "Bad Request")
    headers = []
    for line in lines[1:]:
        match = _HEADER.fullmatch(line)
        if match is None:
            raise BadRequest(400, "Bad Request")
        headers.append((match.group(1), match.group(2).strip(b" \t")))
    return RequestHead(first.group(1), first.group(2), first.group(3), tuple(headers))


def _without_token_cookie(value: bytes) -> bytes:
    kept = [part.strip() for part in value.split(b";")
            if part.strip() and part.strip().split(b"=", 1)[0].strip() != TOKEN_COOKIE.encode()]
    return b"; ".join(kept)


def rewrite_head(head: RequestHead, auth_header: str) -> bytes:
    """The request head to forward in token mode, ending with the blank line (pure)."""
    out = [b" ".join((head.method, head.target, head.version))]
    upgrade = head.is_upgrade
    for name, value in head.headers:
        key = name.lower()
        if key in DROPPED:
            continue
        if key == b"cookie":
            value = _without_token_cookie(value)
            if not value:
                continue
        if not upgrade and key in (b"connection", b"keep-alive"):
            continue
        out.append(name + b": " + value)
    if not upgrade:
        out.append(b"Connection: close")
    out.append(b"Authorization: " + auth_header.encode("ascii"))
    return b"\r\n".join(out) + b"\r\n\r\n"


def read_head(conn: socket.socket, limit: int = MAX_HEAD_BYTES,
              timeout: float = HEAD_TIMEOUT_S) -> tuple[bytes, bytes]:
    """(the request head without its blank line, the bytes read after it) from a client.
    BadRequest(431) past `limit` bytes, BadRequest(408) after `timeout` seconds, EOFError when
    the client closed first."""
    import time

    deadline = time.monotonic() + timeout
    buf = b""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            if end > limit:
                raise BadRequest(431, "Request Header Fields Too Large")
            return buf[:end], buf[end + 4:]
        if len(buf) > limit:
            raise BadRequest(431, "Request Header Fields Too Large")
        left = deadline - time.monotonic()
        if left <= 0:
            raise BadRequest(408, "Request Timeout")
        conn.settimeout(left)
        try:
            data = conn.recv(CHUNK)
        except socket.timeout:
            raise BadRequest(408, "Request Timeout") from None
        if not data:
            raise EOFError("the client closed before its request head ended")
        buf += data


def _answer(conn: socket.socket, status: int, reason: str, text: str) -> None:
    body = (text + "\n").encode("utf-8", "replace")
    try:
        conn.settimeout(5)
        conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    except OSError:
        pass


def splice(client: socket.socket, upstream) -> None:
    """Copy bytes both ways until the upstream ends (its reply is complete) or either side
    fails. A client that half-closes gets the rest of the reply."""
    client.settimeout(None)
    upstream.settimeout(None)
    sel = selectors.DefaultSelector()
    try:
        sel.register(client, selectors.EVENT_READ, "client")
        sel.register(upstream.fileno(), selectors.EVENT_READ, "upstream")
        while True:
            for key, _ in sel.select():
                if key.data == "upstream":
                    data = upstream.recv(CHUNK)
                    if not data:
                        return
                    client.sendall(data)
                else:
                    data = client.recv(CHUNK)
                    if data:
                        upstream.sendall(data)
                    else:
                        upstream.shutdown_write()
                        sel.unregister(client)
    except (OSError, EOFError):
        return
    finally:
        sel.close()


class DashboardProxy:
    """A threaded loopback HTTP proxy: `open_upstream()` gives a connected stream to the
    dashboard for each client connection (HeadTunnel.open's streams: settimeout, recv,
    sendall, shutdown_write, fileno, close); `auth_header` (None: forward unchanged) is added
    to every request. start() binds (UsageError when the port is taken), stop() ends it."""

    def __init__(self, open_upstream: Callable[[], object], auth_header: str | None,
                 bind: str = "127.0.0.1", port: int = 0, max_clients: int = MAX_CLIENTS):
        self._open_upstream = open_upstream
        self._auth_header = auth_header
        self.bind = loopback_bind(bind)
        self._port = port
        self._slots = threading.BoundedSemaphore(max_clients)
        self._sock: socket.socket | None = None
        self._stopped = threading.Event()

    def __repr__(self) -> str:  # never the header: it holds the token
        return f"DashboardProxy(bind={self.bind!r}, port={self.port})"

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1] if self._sock else self._port

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.port}"

    def start(self) -> "DashboardProxy":
        family = socket.AF_INET6 if ":" in self.bind else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.bind, self._port))
        except OSError as exc:
            sock.close()
            raise UsageError(f"cannot listen on {self.bind}:{self._port}: "
                             f"{exc.strerror or exc}: pick another with --port (0: any free "
                             "port)") from None
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="dashboard-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept_loop(self) -> None:
        sock = self._sock
        while not self._stopped.is_set() and sock is not None:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                _answer(conn, 503, "Service Unavailable", "too many connections to the proxy")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="dashboard-proxy-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        finally:
            self._slots.release()
            try:
                conn.close()
            except OSError:
                pass

    def _handle(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            raw, rest = read_head(conn)
            head = parse_head(raw)
        except BadRequest as exc:
            _answer(conn, exc.status, exc.reason, f"cluster dashboard proxy: {exc.reason}")
            return
        except (EOFError, OSError):
            return
        forward = raw + b"\r\n\r\n" if self._auth_header is None \
            else rewrite_head(head, self._auth_header)
        try:
            upstream = self._open_upstream()
        except ClusterError as exc:
            _answer(conn, 502, "Bad Gateway", f"cluster dashboard proxy: {exc}")
            return
        try:
            upstream.settimeout(HEAD_TIMEOUT_S)
            upstream.sendall(forward + rest)
        except (OSError, EOFError) as exc:
            upstream.close()
            _answer(conn, 502, "Bad Gateway", f"cluster dashboard proxy: {exc}")
            return
        try:
            splice(conn, upstream)
        finally:
            upstream.close()
