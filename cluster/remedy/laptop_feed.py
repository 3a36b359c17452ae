"""A directory on the laptop fed to one node for `cluster model pull PATH` (issue 27): the
laptop serves it with the nodes' own bounded file server, and that node reaches it through an
SSH remote port forward over the inventory's route.

    LaptopServer(root, token)      node_programs/model_copy.py's serve side, in this process,
                                   bound to 127.0.0.1 on an ephemeral port: the files the walk
                                   of `root` found (regular files whose real path is inside it;
                                   a link leaving it, a device, a fifo are not served), at
                                   /<path>, with Range, to loopback peers only and only for
                                   requests signed with the token (HMAC, model_copy.py
                                   `Signatures`); each request reopens the walked inode
                                   without following links.
    RemoteForward(session, node, port)
                                   the node's sshd listens on the node's loopback (an ephemeral
                                   port, `tcpip-forward`) and every connection there comes back
                                   over the node's SSH connection (the same transport as its
                                   commands: bastion, strict host keys) to the laptop's
                                   127.0.0.1:port. A `local: true` node reaches the server
                                   directly.
    laptop_manifest(root)          model_copy.py's manifest of `root`, computed here.

The token is made by the caller (the relay's per-run secret key) and only ever travels on the
relay programs' stdin: never in a request, argv, logs or output. Both live
for one copy: `with` closes them on every path (an error, Ctrl-C).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from cluster.base.errors import RemoteError, UsageError
from cluster.nodes.inventory import Node
from cluster.remedy.model_sync import Manifest, parse_manifest
from cluster.base.threads import Call

LOOPBACK = "127.0.0.1"
MAX_CHANNELS = 16                    # forwarded connections at once (the fetch uses one)
MANIFEST_SECONDS = 3600


def _model_copy():
    from cluster.node_programs import model_copy
    return model_copy


def laptop_manifest(root: str) -> Manifest:
    """The manifest of a directory on this machine (UsageError when there is none)."""
    mc = _model_copy()
    try:
        doc = mc.manifest({"--dir": root, "--for": str(MANIFEST_SECONDS)}, None)
    except (mc.Refused, OSError) as exc:
        raise UsageError(f"{root}: {exc}") from None
    return parse_manifest(doc)


class LaptopServer:
    """model_copy.py's file server over `root`, on the laptop's loopback, in a thread."""

    def __init__(self, root: str, token: str):
        mc = _model_copy()
        real = os.path.realpath(root)
        try:
            files, _skipped, _ = mc.walk(real)
            self._board = mc.Board(real, real)
        except (mc.Refused, OSError) as exc:
            raise UsageError(f"{root}: {exc}") from None
        for path, found in files.items():
            self._board.offer(path, found)
        self._server, error = mc.listen(LOOPBACK, [0], self._board, token,
                                        frozenset(mc.LOOPBACK_PEERS))
        if self._server is None:
            os.close(self._board.rootfd)
            raise UsageError(f"cannot serve {root} on this machine: {error['error']}")
        # socketserver prints a request's exception with its traceback on stderr (a node's
        # fetch that hangs up mid-file, Ctrl-C): the CLI's stderr is for its one error line
        self._server.handle_error = lambda request, client_address: None
        self.port = self._server.server_address[1]
        self.files = len(files)
        self._thread = Call(lambda: self._server.serve_forever(poll_interval=0.5),
                            name="laptop-feed-server")

    def __enter__(self) -> "LaptopServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        os.close(self._board.rootfd)


class RemoteForward:
    """The node's loopback port forwarded over its SSH connection to the laptop's
    127.0.0.1:`target`; `url` is the server as the node reaches it."""

    def __init__(self, session, node: Node, target: int, timeout: float | None = None):
        self.node = node
        self._session = session
        self._target = target
        self._timeout = timeout or session.inventory.ssh.connect_timeout
        self._transport = None
        self._port: int | None = None
        self._slots = threading.BoundedSemaphore(MAX_CHANNELS)
        self._channels: set = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._port if self._port else self._target}"

    def __enter__(self) -> "RemoteForward":
        if not self.node.local:
            self._open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _open(self) -> None:
        import paramiko

        transport = self._session.runner_for(self.node).transport(self.node)
        asked = Call(lambda: transport.request_port_forward(LOOPBACK, 0, handler=self._accept),
                     name=f"forward-{self.node.name}")
        if not asked.join(self._timeout * 2):
            raise RemoteError(self.node.name, "no answer to the remote port forward request "
                                              f"within {self._timeout * 2:g} s")
        try:
            port = asked.result()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise RemoteError(self.node.name, f"its sshd refused a remote port forward on its "
                                              f"loopback ({exc}; AllowTcpForwarding?)") from None
        if type(port) is not int or not 0 < port < 65536:
            raise RemoteError(self.node.name, f"the remote forward's port {port!r} is not 1-65535")
        self._transport, self._port = transport, port

    def _accept(self, channel, origin, server) -> None:
        """paramiko's transport thread hands over one forwarded connection: bridged in a thread
        of its own (never blocking the transport), at most MAX_CHANNELS at once."""
        if self._closed or not self._slots.acquire(blocking=False):
            channel.close()
            return
        with self._lock:
            self._channels.add(channel)
        Call(lambda: self._bridge(channel), name=f"forward-{self.node.name}-channel")

    def _bridge(self, channel) -> None:
        from cluster.nodes.head_tunnel import _local_stream, splice

        try:
            upstream = _local_stream(self.node.name, LOOPBACK, self._target, self._timeout)
        except Exception:
            self._done(channel)
            return
        try:
            splice(channel, upstream)
        finally:
            upstream.close()
            self._done(channel)

    def _done(self, channel) -> None:
        with self._lock:
            self._channels.discard(channel)
        try:
            channel.close()
        except Exception:
            pass
        self._slots.release()

    def close(self) -> None:
        """Cancel the forward (the node's sshd stops listening) and end every bridged
        connection; quiet on a transport that already died."""
        self._closed = True
        transport, self._transport = self._transport, None
        if transport is not None and transport.is_active():
            cancel = Call(lambda: transport.cancel_port_forward(LOOPBACK, self._port),
                          name=f"forward-{self.node.name}-cancel")
            cancel.join(self._timeout)
        with self._lock:
            channels = list(self._channels)
        for channel in channels:
            try:
                channel.close()
            except Exception:
                pass

