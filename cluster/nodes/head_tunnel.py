"""Speak TCP and HTTP to services on the head's loopback over the library's own SSH route.

`HeadTunnel.open(host, port)` is a paramiko direct-tcpip channel from the head to (host, port)
as the head sees it (its loopback: the dashboard, Prometheus, Serve's /metrics), opened on the
session's SSH connection to the head: the same route, bastion and strict host-key checks as
every command (cluster/nodes/remote.py). A local head gets a plain TCP socket.

`HeadTransport` is an httpx transport over such channels (one channel per pooled HTTP
connection), so library code reads those services with httpx:

    with Session(inv) as session, httpx.Client(transport=HeadTransport(HeadTunnel(session)),
                                               timeout=30) as http:
        http.get(f"http://127.0.0.1:{inv.ray.dashboard_port}/api/version")

The head's Ray token that the dashboard proxy adds is read by cluster/ray/head_token.py (through a
node program, which this transport layer does not know).
"""

from __future__ import annotations

import selectors
import socket
from typing import Iterator

import httpcore
import httpx

from cluster.base.errors import ConnectError, RemoteError, TunnelError
from cluster.nodes.inventory import Node
from cluster.nodes.remote import Session, describe_connect_error

class HeadTunnel:
    """Opens connected byte streams to TCP services of one node (the head by default)."""

    def __init__(self, session: Session, node: Node | None = None, timeout: float | None = None):
        self.session = session
        self.node = node or session.inventory.head
        self.timeout = timeout or session.inventory.ssh.connect_timeout

    def open(self, host: str, port: int, timeout: float | None = None):
        """A connected stream to host:port as the node sees it: a paramiko Channel (a local
        node: a socket), with settimeout / recv / sendall / shutdown_write / close.

        Raises ConnectError (the node's SSH unreachable) or TunnelError (the node refused the
        channel: nothing listens there, or its sshd forbids forwarding)."""
        if not (isinstance(port, int) and 0 < port < 65536):
            raise TunnelError(self.node.name, f"port {port!r} is not 1-65535")
        timeout = timeout or self.timeout
        if self.node.local:
            return _local_stream(self.node.name, host, port, timeout)
        import paramiko

        transport = self.session.runner_for(self.node).transport(self.node)
        try:
            chan = transport.open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0),
                                          timeout=timeout)
        except paramiko.ChannelException as exc:
            raise TunnelError(self.node.name, f"{_where(host, port)} refused the channel: "
                                              f"{exc.text or exc}") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectError(self.node.name, f"opening a channel to {_where(host, port)}: "
                                               f"{describe_connect_error(exc)}") from None
        return _Stream(chan)


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _local_stream(name: str, host: str, port: int, timeout: float):
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise TunnelError(name, f"{_where(host, port)}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _Stream(sock)


class _Stream:
    """A channel or socket behind one interface (shutdown_write is SHUT_WR on a socket)."""

    def __init__(self, conn):
        self.conn = conn

    def settimeout(self, timeout: float | None) -> None:
        self.conn.settimeout(timeout)

    def recv(self, size: int) -> bytes:
        return self.conn.recv(size)

    def sendall(self, data: bytes) -> None:
        self.conn.sendall(data)

    def fileno(self) -> int:
        """A descriptor that select() sees readable when data or the end arrives."""
        return self.conn.fileno()

    def shutdown_write(self) -> None:
        try:
            if isinstance(self.conn, socket.socket):
                self.conn.shutdown(socket.SHUT_WR)
            else:
                self.conn.shutdown_write()
        except (OSError, EOFError):
            pass

    def close(self) -> None:
        try:
            self.conn.close()
        except (OSError, EOFError):
            pass


# ---------------------------------------------------------------- httpx over channels


class _NetworkStream(httpcore.NetworkStream):
    def __init__(self, stream: _Stream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._stream.settimeout(timeout)
        try:
            return self._stream.recv(max_bytes)
        except socket.timeout:
            raise httpcore.ReadTimeout("no answer from the head in time") from None
        except (OSError, EOFError) as exc:
            raise httpcore.ReadError(str(exc) or type(exc).__name__) from None

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.settimeout(timeout)
        try:
            self._stream.sendall(buffer)
        except socket.timeout:
            raise httpcore.WriteTimeout("the head took no data in time") from None
        except (OSError, EOFError) as exc:
            raise httpcore.WriteError(str(exc) or type(exc).__name__) from None

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        raise httpcore.UnsupportedProtocol("https to a service on the head is not supported")


class _ChannelBackend(httpcore.NetworkBackend):
    def __init__(self, tunnel: HeadTunnel):
        self._tunnel = tunnel

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            return _NetworkStream(self._tunnel.open(host, port, timeout))
        except RemoteError as exc:
            raise httpcore.ConnectError(str(exc)) from None

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore.UnsupportedProtocol("unix sockets are not forwarded")


class HeadTransport(httpx.BaseTransport):
    """An httpx transport whose TCP connections are channels of a HeadTunnel (pooled,
    keep-alive; retries none). Errors are httpx's own (httpx.ConnectError, ReadTimeout...)."""

    def __init__(self, tunnel: HeadTunnel, max_connections: int = 8):
        self._pool = httpcore.ConnectionPool(network_backend=_ChannelBackend(tunnel),
                                             max_connections=max_connections, retries=0)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        req = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host,
                             port=request.url.port, target=request.url.raw_path),
            headers=request.headers.raw, content=request.stream,
            extensions=request.extensions)
        with _httpx_errors():
            resp = self._pool.handle_request(req)
        return httpx.Response(status_code=resp.status, headers=resp.headers,
                              stream=_ResponseStream(resp.stream), extensions=resp.extensions)

    def close(self) -> None:
        self._pool.close()


class _ResponseStream(httpx.SyncByteStream):
    def __init__(self, stream):
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _httpx_errors():
            yield from self._stream

    def close(self) -> None:
        if hasattr(self._stream, "close"):
            self._stream.close()


class _httpx_errors:
    """httpcore's exceptions as httpx's classes of the same name (httpx.TransportError else)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, httpx.HTTPError):
            return False
        if type(exc).__module__.startswith("httpcore"):
            mapped = getattr(httpx, type(exc).__name__, httpx.TransportError)
            if not (isinstance(mapped, type) and issubclass(mapped, httpx.TransportError)):
                mapped = httpx.TransportError
            raise mapped(str(exc)) from exc
        return False


CHUNK = 64 << 10        # one socket read of the splice and the dashboard proxy


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
