"""A loopback-only HTTP proxy to the head's Ray dashboard that adds the head's Ray token.

`cluster dashboard` serves this on 127.0.0.1 (or another loopback address): every client
connection gets its own channel to the dashboard on the head (cluster/nodes/head_tunnel.py). Per
connection the proxy reads the request head (bounded: MAX_HEAD_BYTES, MAX_HEADER_LINES,
HEAD_TIMEOUT_S) and lets it through its Gate (pure; before the head is asked):
  - Host: exactly one, naming the proxy itself (its bound address, 127.0.0.1, localhost or
    [::1]) with its own port; the target is origin-form (`/...`). A web page whose DNS name
    rebinds to 127.0.0.1 sends its own name: 403 (DNS rebinding).
  - the proxy's own per-run credential (not the Ray token; a random value made at start):
    the URL it prints carries `?token=CREDENTIAL`; a GET/HEAD with it is answered 302 to the
    same path without it, setting the cookie `cluster-dashboard-PORT` (HttpOnly,
    SameSite=Strict, Path=/); every other request must carry that cookie (compared in
    constant time), else 403. Another local account cannot read this process's output, so
    it cannot use the proxy.
  - Origin: a request that carries one must carry the proxy's own (`http://HOST:PORT` of an
    accepted Host; `null` is not); a state-changing request (any method but GET, HEAD,
    OPTIONS) must carry the proxy's own Origin, or, without one, a Referer of the proxy's own
    origin: a cross-site page cannot post to the job API.
The proxy's cookie is never forwarded. Then, in token mode, the request head is rewritten:
the browser's Authorization, X-Ray-Authorization and Proxy-Authorization headers and its
`ray-authentication-token` cookie are dropped, `Authorization: Bearer <token>` is added
(what Ray 2.60's token middleware reads first, so the UI never gets a 401 and never shows
"Authentication Token Required"), and
`Connection: close` is set unless the request is an upgrade (a websocket), so the next request
comes on a new connection and gets the header too. Then bytes are spliced both ways until the
dashboard ends its reply: streaming, chunked replies and websocket upgrades pass unchanged.
Without a token the request head is forwarded byte for byte, less the proxy's own cookie.

The Ray token lives only in this process's memory: it is never logged, printed or written, and
no cookie carrying it is ever sent to the browser by the proxy.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Callable

from cluster.base.errors import ClusterError, UsageError
from cluster.nodes.head_tunnel import CHUNK, splice

MAX_HEAD_BYTES = 64 << 10
MAX_HEADER_LINES = 256
HEAD_TIMEOUT_S = 30.0
MAX_CLIENTS = 128
TOKEN_COOKIE = "ray-authentication-token"
CREDENTIAL_PARAM = "token"                 # ?token=... in the URL the proxy prints
COOKIE_PREFIX = "cluster-dashboard-"       # + the port: two proxies keep their own cookies
SAFE_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS"})
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
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


def cookie_pairs(value: bytes) -> list[tuple[bytes, bytes]]:
    """The (name, value) pairs of one Cookie header (pure; pairs without `=` have value b"")."""
    pairs = []
    for part in value.split(b";"):
        name, _, val = part.strip().partition(b"=")
        if name.strip():
            pairs.append((name.strip(), val.strip()))
    return pairs


def _without_cookies(value: bytes, names: frozenset[bytes]) -> bytes:
    kept = [part.strip() for part in value.split(b";")
            if part.strip() and part.strip().split(b"=", 1)[0].strip() not in names]
    return b"; ".join(kept)


def rewrite_head(head: RequestHead, auth_header: str, own_cookie: str = "") -> bytes:
    """The request head to forward in token mode, ending with the blank line (pure): the
    browser's credentials and `own_cookie` (the proxy's) dropped, the Ray token added."""
    out = [b" ".join((head.method, head.target, head.version))]
    upgrade = head.is_upgrade
    dropped_cookies = frozenset({TOKEN_COOKIE.encode(), own_cookie.encode()} - {b""})
    for name, value in head.headers:
        key = name.lower()
        if key in DROPPED:
            continue
        if key == b"cookie":
            value = _without_cookies(value, dropped_cookies)
            if not value:
                continue
        if not upgrade and key in (b"connection", b"keep-alive"):
            continue
        out.append(name + b": " + value)
    if not upgrade:
        out.append(b"Connection: close")
    out.append(b"Authorization: " + auth_header.encode("ascii"))
    return b"\r\n".join(out) + b"\r\n\r\n"


def without_own_cookie(raw: bytes, own_cookie: str) -> bytes:
    """`raw` (a request head, no blank line) byte for byte, less the cookie `own_cookie` (pure)."""
    out = []
    for line in raw.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if out and colon and name.strip().lower() == b"cookie":
            value = _without_cookies(value, frozenset({own_cookie.encode()}))
            if not value:
                continue
            line = name + b": " + value
        out.append(line)
    return b"\r\n".join(out)


@dataclass(frozen=True)
class Refusal:
    """The answer to a request the Gate stops: status, reason, body, extra header lines."""

    status: int
    reason: str
    text: str
    headers: tuple[str, ...] = ()


@dataclass(frozen=True, repr=False)
class Gate:
    """Who may use the proxy (pure): its own Host names and port, its own Origin, and its
    per-run credential (`credential`, compared in constant time; never in repr)."""

    bind: str
    port: int
    credential: str

    def __repr__(self) -> str:
        return f"Gate(bind={self.bind!r}, port={self.port})"

    @property
    def cookie(self) -> str:
        return f"{COOKIE_PREFIX}{self.port}"

    @property
    def hosts(self) -> frozenset[bytes]:
        """The Host values accepted: each loopback name with the port (alone on port 80)."""
        own = f"[{self.bind}]" if ":" in self.bind else self.bind
        names = {own, *LOOPBACK_NAMES}
        out = {f"{n}:{self.port}" for n in names}
        if self.port == 80:
            out |= names
        return frozenset(h.encode() for h in out)

    @property
    def origins(self) -> frozenset[bytes]:
        return frozenset(b"http://" + h for h in self.hosts)

    def _matches(self, value: bytes) -> bool:
        return hmac.compare_digest(value, self.credential.encode())

    def check(self, head: RequestHead) -> Refusal | None:
        """None: forward the request; else the answer it gets instead."""
        return self._host(head) or self._credential(head) or self._origin(head)

    def _host(self, head: RequestHead) -> Refusal | None:
        hosts = head.values("host")
        if len(hosts) != 1:
            return Refusal(400, "Bad Request", "exactly one Host header is required")
        if hosts[0].lower() not in self.hosts:
            return Refusal(403, "Forbidden", "this proxy answers only its own loopback address "
                                             f"and port {self.port} (Host refused)")
        if not head.target.startswith(b"/") and not (head.method == b"OPTIONS"
                                                     and head.target == b"*"):
            return Refusal(400, "Bad Request", "only origin-form request targets (/path)")
        return None

    def _credential(self, head: RequestHead) -> Refusal | None:
        path, mark, query = head.target.partition(b"?")
        params = query.split(b"&") if mark else []
        given = [p.partition(b"=")[2] for p in params
                 if p.partition(b"=")[0] == CREDENTIAL_PARAM.encode()]
        if given:
            if head.method not in (b"GET", b"HEAD") or len(given) != 1 \
                    or not self._matches(given[0]):
                return Refusal(403, "Forbidden", "wrong or misplaced proxy credential")
            rest = [p for p in params if p.partition(b"=")[0] != CREDENTIAL_PARAM.encode()]
            if path.startswith((b"//", b"/\\")):   # never a redirect to another host
                path = b"/"
            location = (path + (b"?" + b"&".join(rest) if rest else b"")).decode("ascii")
            return Refusal(302, "Found", "logged in", (
                f"Location: {location}",
                f"Set-Cookie: {self.cookie}={self.credential}; HttpOnly; SameSite=Strict; "
                "Path=/",
                "Cache-Control: no-store"))
        cookies = [v for header in head.values("cookie") for k, v in cookie_pairs(header)
                   if k == self.cookie.encode()]
        if not any([self._matches(v) for v in cookies]):
            return Refusal(403, "Forbidden", "the proxy's credential is missing: open the URL "
                                             "`cluster dashboard` printed (it carries ?token=)")
        return None

    def _origin(self, head: RequestHead) -> Refusal | None:
        origins = head.values("origin")
        if len(origins) > 1 or (origins and origins[0].lower() not in self.origins):
            return Refusal(403, "Forbidden", "cross-origin request refused")
        if head.method in SAFE_METHODS or origins:
            return None
        referers = head.values("referer")
        if len(referers) == 1 and _origin_of(referers[0]) in self.origins:
            return None
        return Refusal(403, "Forbidden", "a state-changing request needs this proxy's own "
                                         "Origin (or Referer)")


def _origin_of(url: bytes) -> bytes | None:
    """scheme://host[:port] of an absolute http URL, lower-cased, or None."""
    match = re.match(rb"(http://[^/?#\s]+)(?:[/?#]|\Z)", url, re.IGNORECASE)
    return match.group(1).lower() if match else None


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


def _answer(conn: socket.socket, status: int, reason: str, text: str,
            headers: tuple[str, ...] = ()) -> None:
    body = (text + "\n").encode("utf-8", "replace")
    extra = "".join(h + "\r\n" for h in headers)
    try:
        conn.settimeout(5)
        conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                     f"{extra}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body)
    except OSError:
        pass


class DashboardProxy:
    """A threaded loopback HTTP proxy: `open_upstream()` gives a connected stream to the
    dashboard for each client connection (HeadTunnel.open's streams: settimeout, recv,
    sendall, shutdown_write, fileno, close); `auth_header` (None: forward unchanged) is added
    to every request that passes the Gate. start() binds (UsageError when the port is taken)
    and makes the per-run credential; `login_url` carries it; stop() ends it."""

    def __init__(self, open_upstream: Callable[[], object], auth_header: str | None,
                 bind: str = "127.0.0.1", port: int = 0, max_clients: int = MAX_CLIENTS):
        self._open_upstream = open_upstream
        self._auth_header = auth_header
        self.bind = loopback_bind(bind)
        self._port = port
        self._slots = threading.BoundedSemaphore(max_clients)
        self._sock: socket.socket | None = None
        self._stopped = threading.Event()
        self.gate: Gate | None = None

    def __repr__(self) -> str:  # never the header: it holds the token
        return f"DashboardProxy(bind={self.bind!r}, port={self.port})"

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1] if self._sock else self._port

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.port}"

    @property
    def login_url(self) -> str:
        """The URL to open: the proxy's own credential in its query (never the Ray token)."""
        return f"{self.url}/?{CREDENTIAL_PARAM}={self.gate.credential}"

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
        self.gate = Gate(self.bind, self.port, secrets.token_urlsafe(32))
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
        refusal = self.gate.check(head)
        if refusal is not None:
            _answer(conn, refusal.status, refusal.reason,
                    f"cluster dashboard proxy: {refusal.text}", refusal.headers)
            return
        forward = without_own_cookie(raw, self.gate.cookie) + b"\r\n\r\n" \
            if self._auth_header is None \
            else rewrite_head(head, self._auth_header, self.gate.cookie)
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
