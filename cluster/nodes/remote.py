"""Remote execution: run a command on many nodes in parallel over SSH (Fabric/paramiko) or locally.

A finished command is data (`CommandResult`, whatever its exit code). Only a node that cannot be
reached (connect timeout, refused, auth failure, host-key mismatch, lost connection) or that does
not answer in time is an error: `run` raises ConnectError / CommandTimeout, and `fan_out` turns
them into results with status "unreachable" / "timeout". Every node has its own deadline, so a
hung command or a frozen sshd on one node never blocks the others (Fabric's ThreadingGroup joins
its threads without a timeout, so it is not used here).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence, TypeVar

from cluster.base.errors import CommandTimeout, ConnectError
from cluster.nodes.inventory import Inventory, Node, SSHOptions
from cluster.nodes.channel_run import Finished, Reply, exchange_on_channel, run_on_channel
from cluster.nodes.connect_errors import JumpHostDown, banner_failure, socket_failure
from cluster.nodes.kept import HeadTail
from cluster.base.textsafe import terminal_safe_line
from cluster.base.threads import Call, parallel  # parallel: callers import it from here too
from cluster.base.waits import GaveUp, retry
# paramiko's and Fabric's private parts live in one adapter, pinned by tests/test_ssh_adapter.py
from cluster.nodes.ssh_adapter import HANDSHAKE_TIMEOUT_FACTOR, HANDSHAKE_UNFINISHED, share_host_keys
from cluster.nodes.ssh_adapter import indexed_host_keys as _indexed_host_keys
from cluster.nodes.ssh_adapter import quiet_transport_class as _quiet_transport_class
from cluster.nodes.ssh_adapter import shared_config_connection as _shared_config_connection

# paramiko's transport thread logs a hung sshd's banner timeout with a traceback at ERROR level,
# which Python's last-resort handler prints on stderr: the node's result already says why.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

OK, FAILED, UNREACHABLE, TIMEOUT = "ok", "failed", "unreachable", "timeout"
T = TypeVar("T")


@dataclass(frozen=True)
class CommandResult:
    """What one command did on one node. status: ok | failed | unreachable | timeout."""

    node: str
    command: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    status: str
    error: str | None = None
    cut: int = 0                # bytes of stdout + stderr dropped from their middles (kept.py)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def reached(self) -> bool:
        """The command ran to completion (whatever its exit code)."""
        return self.status in (OK, FAILED)

    def to_dict(self) -> dict:
        return {"node": self.node, "command": self.command, "status": self.status,
                "exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
                "duration_s": round(self.duration_s, 3), "error": self.error, "cut": self.cut}


@dataclass(frozen=True)
class Exchange:
    """A conversation with one command (Session.exchange): the replies it gave, each stamped with
    this machine's clock, and its CommandResult (stdout: the replies' lines, then what followed)."""

    replies: tuple[Reply, ...]
    result: CommandResult


CommandSpec = str | Callable[[Node], str]
ResultHook = Callable[[CommandResult], None]
EnoughReplies = Callable[[Reply], bool]


class Runner(Protocol):
    """Runs one command on one node. Raises ConnectError / CommandTimeout; never for exit codes."""

    def run(self, node: Node, command: str, timeout: float,
            stdin: str | None = None) -> CommandResult: ...

    def exchange(self, node: Node, command: str, asks: int, enough: EnoughReplies,
                 timeout: float, after: str | None = None) -> Exchange: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- local


def output_limit() -> int:
    """Bytes kept of one command's stdout, and of its stderr (node_output.command_bytes)."""
    from cluster.base.bounds import bound
    return int(bound("node_output", "command_bytes"))


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class LocalRunner:
    """Runs commands on this machine with bash, in their own process group (killed on timeout);
    each output stream is read as it comes and kept bounded (kept.HeadTail)."""

    def run(self, node: Node, command: str, timeout: float,
            stdin: str | None = None) -> CommandResult:
        start = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", command],
                                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        streams = (HeadTail(output_limit()), HeadTail(output_limit()))
        readers = [Call(lambda pipe=pipe, kept=kept: _drain(pipe, kept))
                   for pipe, kept in zip((proc.stdout, proc.stderr), streams)]
        if stdin is not None:
            Call(lambda: _feed(proc.stdin, stdin.encode("utf-8", "surrogateescape")))
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise CommandTimeout(node.name, timeout, command) from None
        for reader in readers:  # a child that outlived bash may hold the pipes: bounded wait
            reader.join(max(0.5, timeout - (time.monotonic() - start)))
        out, err = (kept.text(_decode) for kept in streams)
        code = proc.returncode
        return CommandResult(node.name, command, code, out, err, time.monotonic() - start,
                             OK if code == 0 else FAILED, cut=streams[0].cut + streams[1].cut)

    def exchange(self, node: Node, command: str, asks: int, enough: EnoughReplies,
                 timeout: float, after: str | None = None) -> Exchange:
        """Session.exchange on this machine: one run of `command` per ask, its stdin the ask's
        newline, its first line the reply (a process start here costs what an ask does).
        With `after` the command runs once, asked nothing (its stdin empty), its stdout cut
        before that line: the caller asks again on its own when it needs the replies."""
        if after is not None:
            res = self.run(node, command, timeout)
            return Exchange((), replace(res, stdout=output_before(res.stdout, after)))
        start = time.monotonic()
        replies: list[Reply] = []
        res = None
        for _ in range(max(1, asks)):
            sent = time.time()
            res = self.run(node, command, timeout, stdin="\n")
            received = time.time()
            if not res.ok or not res.stdout.strip():
                break
            replies.append(Reply(sent, res.stdout.splitlines()[0], received))
            if enough(replies[-1]):
                break
        stdout = "".join(r.line + "\n" for r in replies)
        return Exchange(tuple(replies), CommandResult(
            node.name, command, res.exit_code, stdout if res.ok else res.stdout, res.stderr,
            time.monotonic() - start, res.status, res.error, res.cut))

    def close(self) -> None:
        pass


def output_before(stdout: str, line: str) -> str:
    """stdout up to the line `line` (all of it when there is none): what an exchange with
    `after=line` keeps of a command that printed its output, then that line, then replies."""
    at = ("\n" + stdout).find("\n" + line + "\n")
    return stdout if at < 0 else stdout[:at]


def _drain(pipe, kept: HeadTail) -> None:
    with pipe:
        for data in iter(lambda: pipe.read1(65536), b""):
            kept.add(data)


def _feed(pipe, data: bytes) -> None:
    try:
        with pipe:
            pipe.write(data)
    except (BrokenPipeError, OSError):
        pass                   # the command did not read all of its stdin


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=2)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- ssh


class SSHRunner:
    """Runs commands over SSH with Fabric, one reused connection per node for the run's lifetime.

    Host keys are checked against the inventory's known_hosts (or ~/.ssh/known_hosts); an
    unknown host is refused unless `accept_unknown_host_keys` is set; a changed key is always
    refused (paramiko's BadHostKeyException). The same policy holds on every hop.

    The inventory alone decides the route: ~/.ssh/config, /etc/ssh/ssh_config and Fabric's own
    config files are not read (a ProxyJump there would make Fabric build a hop of its own, with
    a policy that accepts any unknown key). A bastion is the inventory's `jump_host`.
    """

    def __init__(self, ssh: SSHOptions):
        self.ssh = ssh
        self._connections: dict[str, object] = {}
        self._jump_hosts: dict[tuple[str, str, int], JumpHost] = {}
        self._host_keys = None
        self._config = None
        self._lock = threading.RLock()  # connection() holds it while _gateway() takes it again
        self._opening: dict[str, threading.Lock] = {}  # one connect at a time per node
        self._identity_keys: dict[str, object] = {}  # identity file -> its key (None: unreadable)

    def _fabric_config(self):
        """One Fabric Config for every connection of the run (it is read, never changed).

        An explicit empty SSHConfig and lazy=True: no ssh_config or Fabric/invoke config file is
        loaded; gateway=False (not None) in each Connection stops Fabric looking for one there.
        """
        from fabric import Config
        from paramiko import SSHConfig

        with self._lock:
            if self._config is None:
                self._config = Config(ssh_config=SSHConfig(), lazy=True)
            return self._config

    def _known_host_keys(self):
        """(known keys, system keys) as paramiko HostKeys, read once per runner."""
        with self._lock:
            if self._host_keys is None:
                known, system = _indexed_host_keys(), _indexed_host_keys()
                if self.ssh.known_hosts:
                    path = os.path.expanduser(self.ssh.known_hosts)
                    if Path(path).is_file():
                        known.load(path)
                else:
                    default = os.path.expanduser("~/.ssh/known_hosts")
                    if Path(default).is_file():
                        system.load(default)
                self._host_keys = (known, system)
            return self._host_keys

    @property
    def _connect_budget(self) -> float:
        """Seconds one node may spend connecting, retries included (fan_out's deadline has it)."""
        return 2 * self.ssh.connect_timeout

    def _connect_kwargs(self, node: Node | None) -> dict:
        identity = (node.identity_file if node else None) or self.ssh.identity_file
        kwargs: dict = {"banner_timeout": self.ssh.connect_timeout,
                        "auth_timeout": self.ssh.connect_timeout,
                        "channel_timeout": self.ssh.connect_timeout,
                        "transport_factory": _nodelay_transport}
        if identity:
            path = os.path.expanduser(identity)
            key = self._identity_key(path)
            kwargs.update({"pkey": key} if key is not None else {"key_filename": [path]},
                          allow_agent=False, look_for_keys=False)
        return kwargs

    def _identity_key(self, path: str):
        """The identity file's key (and its `-cert.pub` when there is one), read once per runner.

        Handed a file name, paramiko reads and parses it again on every connect, once per key
        type it tries (an ed25519 key: three times), a fifth of a connect's CPU at rack scale.
        None when it cannot be read here (missing, encrypted, unknown type): the connect is then
        given the file name, so paramiko's own error reaches the report as before.
        """
        with self._lock:
            if path not in self._identity_keys:
                import paramiko

                try:
                    self._identity_keys[path] = paramiko.PKey.from_path(path)
                except Exception:  # OSError, ValueError, SSHException, UnknownKeyType...
                    self._identity_keys[path] = None
            return self._identity_keys[path]

    def _make(self, host: str, user: str | None, port: int, node: Node | None,
              gateway: object | None):
        conn = _shared_config_connection()(host, user=user, port=port, config=self._fabric_config(),
                          gateway=gateway if gateway is not None else False,
                          connect_timeout=max(1, int(round(self.ssh.connect_timeout))),
                          connect_kwargs=self._connect_kwargs(node))
        client = conn.client
        # One parsed known_hosts for the whole run, shared by every connection: loading it per
        # connection cost O(nodes) each, O(nodes^2) in all (11 ms a node at 128 nodes).
        share_host_keys(client, *self._known_host_keys())
        client.set_missing_host_key_policy(
            _AcceptForThisRun() if self.ssh.accept_unknown_host_keys else _RejectUnknown())
        return conn

    def _gateway(self, node: Node) -> "JumpHost | None":
        """The one shared connection to the node's jump host (made on first use)."""
        if not node.jump_host:
            return None
        user, _, hostport = node.jump_host.rpartition("@")
        host, _, port = hostport.partition(":")
        key = (user or node.user or "", host, int(port or 22))
        with self._lock:
            jump = self._jump_hosts.get(key)
            if jump is None:
                jump = JumpHost(lambda: self._make(host, key[0] or None, key[2], None, None),
                                f"jump host {node.jump_host}", self.ssh.connect_timeout,
                                self._connect_budget)
                self._jump_hosts[key] = jump
            return jump

    def jump_host_connecting(self, node: Node) -> bool:
        """The node has a jump host and it is not (yet) connected."""
        jump = self._gateway(node)
        return jump is not None and not jump.connected

    def connection(self, node: Node):
        with self._lock:
            conn = self._connections.get(node.name)
            if conn is None:
                conn = self._make(node.address, node.user, node.port, node, self._gateway(node))
                self._connections[node.name] = conn
            return conn

    def run(self, node: Node, command: str, timeout: float,
            stdin: str | None = None) -> CommandResult:
        """One command on a session channel of the node's Fabric connection, read by this
        thread alone (channel_run.py: no invoke Runner threads); each stream kept bounded
        (node_output.command_bytes, head and tail, the cut counted)."""
        return self._run_channel(node, command, timeout, stdin, output_limit())

    def exchange(self, node: Node, command: str, asks: int, enough: EnoughReplies,
                 timeout: float, after: str | None = None) -> Exchange:
        """A conversation with one command on one session channel (channel_run's
        exchange_on_channel): up to `asks` newlines sent, a line read back for each; each stream
        kept to SMALL_OUTPUT_MAX_BYTES, or to run()'s bound when the asking starts `after` the
        command's own output. Raises like run()."""
        limit = SMALL_OUTPUT_MAX_BYTES if after is None else output_limit()
        mark = None if after is None else after.encode("utf-8", "surrogateescape")
        replies, result = self._on_channel(node, command, timeout, lambda chan, deadline:
                                           exchange_on_channel(chan, command, asks, enough,
                                                               limit, deadline, mark))
        return Exchange(replies, result)

    def _run_channel(self, node: Node, command: str, timeout: float, stdin: str | None,
                     limit: int) -> CommandResult:
        data = None if stdin is None else stdin.encode("utf-8", "surrogateescape")
        return self._on_channel(node, command, timeout, lambda chan, deadline: (
            (), run_on_channel(chan, command, data, limit, deadline)))[1]

    def _on_channel(self, node: Node, command: str, timeout: float,
                    work: Callable[[object, float], tuple[tuple[Reply, ...], Finished]]
                    ) -> tuple[tuple[Reply, ...], CommandResult]:
        """`work(channel, deadline)` -> (replies, Finished) on a new session channel of the
        node's connection. A command timing out -> CommandTimeout (the connection is dropped: its
        session may be stuck); the session or connection breaking -> ConnectError."""
        start = time.monotonic()
        conn = self._open(node)
        try:
            chan = conn.transport.open_session(timeout=timeout)
        except Exception as exc:  # the session broke
            self._forget(node, conn)
            raise ConnectError(node.name, f"connection lost: {describe_connect_error(exc)}") \
                from None
        try:
            replies, done = work(chan, start + timeout)
            if done.exit_code == -1 and not conn.transport.is_active():  # the connection died
                raise EOFError("the SSH transport closed")
        except TimeoutError:  # socket.timeout too: a stdin or a channel request that hung
            self._forget(node, conn)
            raise CommandTimeout(node.name, timeout, command) from None
        except Exception as exc:
            self._forget(node, conn)
            raise ConnectError(node.name, f"connection lost: {describe_connect_error(exc)}") \
                from None
        finally:
            if not _close_channel(chan):    # the transport died under it: connect anew next time
                self._forget(node, conn)
        code = done.exit_code
        return replies, CommandResult(node.name, command, code, done.stdout, done.stderr,
                                      time.monotonic() - start, OK if code == 0 else FAILED,
                                      cut=done.cut)

    def transport(self, node: Node):
        """The paramiko Transport of the node's open connection (cluster/nodes/head_tunnel.py opens
        its direct-tcpip channels on it). Raises ConnectError like run()."""
        return self._open(node).transport

    def _open(self, node: Node):
        """The node's open connection; transient failures are retried within the connect budget.

        A reset before the banner, a banner timeout or an EOF (a MaxStartups drop by the node's
        or the bastion's sshd) is retried with jittered exponential backoff; an authentication
        failure, a host-key problem or a refused/unroutable connection is not.
        """
        with self._lock:
            opening = self._opening.setdefault(node.name, threading.Lock())

        def attempt():
            conn = self.connection(node)
            try:
                with opening:  # two threads opening one connection break paramiko's session
                    conn.open()
                    _quiet_when_idle(conn)
            except Exception:
                self._forget(node, conn)
                raise
            return conn

        try:
            return retrying(attempt, self._connect_budget, self.ssh.connect_timeout)
        except GaveUp as failed:  # paramiko/socket errors: all mean "unreachable"
            raise ConnectError(node.name, describe_connect_error(failed.error)
                               + failed.attempts_text) from None

    def _forget(self, node: Node, conn: object) -> None:
        """Drop (and close) `conn`, the node's connection that failed, when it is still the
        node's: another thread may have dropped it and connected anew since, and that
        connection is kept."""
        with self._lock:
            if self._connections.get(node.name) is not conn:
                return
            del self._connections[node.name]
        _close_quietly(conn)

    def close(self) -> None:
        with self._lock:
            conns = list(self._connections.values())
            self._connections.clear()
            jumps = list(self._jump_hosts.values())
            self._jump_hosts.clear()
        for conn in conns:
            _close_quietly(conn)
        for jump in jumps:
            jump.close()


SMALL_OUTPUT_MAX_BYTES = 64 << 10     # each stream of an exchange (clock samples)


MAX_CONNECT_ATTEMPTS = 8



def connect_deadline_s(connect_timeout: float) -> float:
    """The longest one node's connect may take, retries included: the connect budget (2 x
    connect_timeout), then the last attempt's TCP connect, key exchange and authentication."""
    return connect_timeout * (2 + 1 + HANDSHAKE_TIMEOUT_FACTOR + 1)


def retrying(attempt: Callable[[], "T"], budget_s: float, attempt_s: float) -> "T":
    """attempt() until it succeeds, retrying transient connect failures (waits.retry: jittered
    backoff, within budget_s and MAX_CONNECT_ATTEMPTS). Raises GaveUp with the last error."""
    return retry(attempt, retryable=is_transient, budget_s=budget_s, attempt_s=attempt_s,
                 max_attempts=MAX_CONNECT_ATTEMPTS)


# "Negotiation failed.": paramiko's words when its transport died in the key exchange without
# saying why; "No existing session": its words when the exchange had not finished by the
# timeout (QuietTransport names that itself: HANDSHAKE_UNFINISHED). Both come from a loaded or
# dropping sshd, never from a key, algorithm or auth problem.
_TRANSIENT_TEXT = ("Error reading SSH protocol banner", "Connection reset by peer",
                   "Socket is closed", "EOF during negotiation", "Timeout opening channel",
                   "No existing session", "Negotiation failed.", HANDSHAKE_UNFINISHED)


def is_transient(exc: BaseException) -> bool:
    """A connection failure worth another try: the far side dropped us before or in the banner.

    Never an authentication failure, a host-key mismatch or an unknown host key (retrying those
    would only hammer the node or hide a real problem), nor a refused or timed-out TCP connect.
    """
    import paramiko

    if isinstance(exc, (paramiko.AuthenticationException, paramiko.BadHostKeyException)):
        return False
    if isinstance(exc, paramiko.SSHException) and "known_hosts" in str(exc):
        return False
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, EOFError)):
        return True
    if isinstance(exc, paramiko.SSHException):
        return any(text in str(exc) for text in _TRANSIENT_TEXT)
    return False


class JumpHost:
    """One SSH connection to a bastion, shared by every node behind it (as ProxyJump + a control
    master): each node's connection is a direct-tcpip channel over this one transport.

    Fabric's Connection takes it as its `gateway` (it calls open() and transport.open_channel());
    open() connects once, under a lock, retrying transient failures like a node's connect, and
    reconnects if the transport died. The bastion's host key is checked like any node's.
    """

    def __init__(self, make: Callable[[], object], label: str, channel_timeout: float,
                 budget: float):
        self._make = make
        self.label = label
        self._channel_timeout = channel_timeout
        self._budget = budget
        self._conn = None
        self._refused: str | None = None  # why the run's attempt sequence failed
        self._closed = False
        self._lock = threading.Lock()
        self.connects = 0  # how many SSH connections were made to the bastion (tests read it)

    def open(self) -> None:
        """Connect once for every node. When the attempt sequence fails (refused, no route,
        timed out, a silent sshd, authentication, host key), the failure is remembered for the
        run and given to every later node at once ("jump host X unreachable (why)",
        connect_errors.JumpHostDown): the bastion costs one sequence per run, not one a node."""
        with self._lock:
            if self._refused is not None:  # a new error each time: raised in many threads
                raise _JumpHostError(self._refused)
            if self._conn is not None and self._conn.is_connected:
                return

            def attempt():
                conn = self._make()
                self.connects += 1
                try:
                    conn.open()
                    _quiet_when_idle(conn)
                except Exception:
                    _close_quietly(conn)
                    raise
                return conn

            try:
                conn = retrying(attempt, self._budget, self._channel_timeout)
            except GaveUp as failed:
                after = f", after {failed.attempts} attempts" if failed.attempts > 1 else ""
                # the run's one attempt sequence is spent, whatever the cause: every node
                # behind this bastion gets its failure at once instead of a sequence of its own
                self._refused = (f"{self.label} unreachable "
                                 f"({describe_connect_error(failed.error)}{after})")
                raise _JumpHostError(self._refused) from None
            if self._closed:  # the session ended while we connected
                _close_quietly(conn)
                raise _JumpHostError(f"{self.label}: the run is over")
            self._conn = conn

    @property
    def connected(self) -> bool:
        conn = self._conn
        return conn is not None and bool(conn.is_connected)

    @property
    def transport(self) -> "_ChannelOpener":
        conn = self._conn
        if conn is None or conn.transport is None:
            raise _JumpHostError(f"{self.label}: not connected")
        return _ChannelOpener(conn.transport, self._channel_timeout, self.label)

    def close(self) -> None:
        """Close without waiting for a connect in progress (it sees _closed and gives up)."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            _close_quietly(conn)


class _JumpHostError(Exception):
    """The bastion itself could not be reached (the message names it and why)."""


class _ChannelOpener:
    """What Fabric calls `gateway.transport`: opens a node's channel with a timeout."""

    def __init__(self, transport, timeout: float, label: str):
        self._transport = transport
        self._timeout = timeout
        self._label = label

    def open_channel(self, kind: str, dest_addr=None, src_addr=None):
        import paramiko

        try:
            return self._transport.open_channel(kind, dest_addr, src_addr, timeout=self._timeout)
        except paramiko.ChannelException as exc:
            raise _JumpHostError(f"{self._label} could not open a channel to "
                                 f"{dest_addr[0]}:{dest_addr[1]}: {exc.text or exc}") from exc


IDLE_CHECK_S = 120.0


def _quiet_when_idle(conn) -> None:
    """An open connection's reader thread wakes every IDLE_CHECK_S when nothing arrives.

    paramiko's reader wakes on its socket's timeout only to notice a close or a pending rekey
    (data wakes it at once, and so does a close: closing a jump host's channel wakes it, and
    _close shuts a TCP socket down first; a rekey asked by the sending side is seen at the next
    packet read, and a peer reading our data sends window adjustments; no keepalive is set). At
    connect time the timeout stays short (the banner and handshake timeouts are counted in its
    steps). Once connected, each wake-up of an idle connection cost ~100 us of the laptop's CPU
    (26 us a node-second through a bastion at 5 s, measured): nodes x the run's wall time, which
    itself grows with the nodes, about 10 ms a node at 1,000 nodes; at 120 s it is a few wake-ups
    a run. The timeout stays finite: a transport closed some other way still ends its thread."""
    transport = conn.transport
    if transport is not None and transport.is_active():
        transport.sock.settimeout(IDLE_CHECK_S)


def _nodelay_transport(sock, **kwargs):
    """paramiko's Transport over a socket with Nagle's algorithm off.

    An SSH command is a few small request/reply packets; with Nagle on, each small write that
    follows an unacknowledged one waits for the peer's delayed ACK (40 ms on Linux), which made
    every command (and the key exchange, several times) cost ~40 ms more. OpenSSH's own client
    sets TCP_NODELAY too. A jump host's channel (not a socket) is left as it is.
    """
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport = _quiet_transport_class()(sock, **kwargs)
    options = transport.get_security_options()
    # AES-GCM first: its tag is checked inside `cryptography`, where the CTR ciphers' HMAC is
    # compared byte by byte in Python (paramiko's constant_time_bytes_eq), a large share of the
    # laptop's CPU at rack scale. The others stay, after it, for servers without GCM.
    gcm = tuple(c for c in options.ciphers if c.endswith("-gcm@openssh.com"))
    options.ciphers = gcm + tuple(c for c in options.ciphers if c not in gcm)
    return transport


class _RejectUnknown:
    """Refuse a host whose key is not in known_hosts, naming the key's fingerprint to check."""

    def missing_host_key(self, client, hostname, key) -> None:
        import paramiko

        raise paramiko.SSHException(
            f"Server {hostname!r} not found in known_hosts (it offered {key.get_name()} "
            f"{key_fingerprint(key)})")


class _AcceptForThisRun:
    """Accept an unknown host key for this run only (kept in memory, never written to a file).

    Used only with ssh.accept_unknown_host_keys: true. A key that differs from a known one is
    still refused by paramiko (BadHostKeyException) before any policy is asked.
    """

    def missing_host_key(self, client, hostname, key) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)


def _close_channel(chan) -> bool:
    """Close a session channel; False when that failed. paramiko's close sends the channel's
    close message, which raises (EOFError, a socket error) once the transport is gone: a link cut
    after the command's answer, or the error already being raised. It must never replace
    either: that EOFError ended a whole preflight, every node's result with it."""
    try:
        chan.close()
    except Exception:  # noqa: BLE001 - EOFError, OSError, SSHException: the transport is gone
        return False
    return True


def _close_quietly(conn) -> None:
    # Closing a connection to a frozen sshd can block: do it in a daemon thread.
    Call(lambda: _close(conn))


def _close(conn) -> None:
    """Fabric's close, then paramiko's: after a failed connect Fabric never set its transport and
    skips client.close(), which left the socket and the transport thread alive. A TCP socket is
    shut down first: its reader thread, blocked for up to IDLE_CHECK_S, wakes at once (a closed
    fd does not wake a thread blocked on it; a jump host's channel wakes its reader on close)."""
    _wake_reader(conn)
    for close in (getattr(conn, "close", None), getattr(getattr(conn, "client", None), "close",
                                                        None)):
        try:
            if close is not None:
                close()
        except Exception:
            pass


def _wake_reader(conn) -> None:
    sock = getattr(getattr(conn, "transport", None), "sock", None)
    if isinstance(sock, socket.socket):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected, or closed already
            pass


def key_fingerprint(key) -> str:
    """OpenSSH's fingerprint of a host key: SHA256:<unpadded base64 of the key blob's digest>."""
    import base64
    import hashlib

    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def describe_connect_error(exc: BaseException) -> str:
    """One line naming why a node could not be reached (control characters escaped)."""
    return terminal_safe_line(_describe_connect_error(exc))


def _describe_connect_error(exc: BaseException) -> str:
    import paramiko

    if isinstance(exc, _JumpHostError):
        return str(exc)
    if isinstance(exc, paramiko.BadHostKeyException):
        return (f"host key mismatch for {exc.hostname} (expected {exc.expected_key.get_name()} "
                f"{key_fingerprint(exc.expected_key)}, got {exc.key.get_name()} "
                f"{key_fingerprint(exc.key)}): refused; if the host was reinstalled, check the "
                "new key's fingerprint out of band and update known_hosts")
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return (f"unknown host key ({exc}); add it to known_hosts "
                "(or set ssh.accept_unknown_host_keys: true)")
    if isinstance(exc, paramiko.AuthenticationException):
        return f"authentication failed: {exc}"
    failure = socket_failure(exc)
    if failure is not None:
        where = exc.strerror if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError) \
            else None
        return f"{failure} ({where})" if where else failure
    banner = banner_failure(exc)
    if banner is not None:
        return banner
    if isinstance(exc, paramiko.SSHException):
        return f"SSH error: {exc or type(exc).__name__}"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- session and fan-out


class Session:
    """The runners of one CLI run: local nodes run locally, the others over reused SSH connections.

    Use as a context manager; `hook` is called with every CommandResult (run records, progress).
    `runner`, when given, runs every node's commands (a Runner: the tests' fake nodes).
    `node_time_s` (exec/preflight --timeout): each call's whole time on a node, connecting
    (through its jump host too) included; a node past it is a "timeout" result at that moment.
    """

    def __init__(self, inventory: Inventory, hooks: Sequence[ResultHook] = (),
                 node_time_s: float | None = None, runner: Runner | None = None):
        self.inventory = inventory
        self.hooks = list(hooks)
        self.node_time_s = node_time_s
        self._local = LocalRunner()
        self._ssh = SSHRunner(inventory.ssh)
        self._runner = runner       # one runner for every node (the tests' fake nodes)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._ssh.close()
        if self._runner is not None:
            self._runner.close()

    def runner_for(self, node: Node) -> Runner:
        if self._runner is not None:
            return self._runner
        return self._local if node.local else self._ssh

    @property
    def command_timeout(self) -> float:
        return self.inventory.ssh.command_timeout

    def run(self, node: Node, command: str, timeout: float | None = None,
            stdin: str | None = None) -> CommandResult:
        """Run one command; unreachable/timeout become results (never raises for a node).

        `stdin` is sent to the command's standard input and never recorded: the way to hand a
        node a secret without putting it on a command line (visible in `ps`) or in run logs.
        """
        return self._call(node, command, timeout,
                          lambda runner, t: runner.run(node, command, t, stdin=stdin))

    def exchange(self, node: Node, command: str, asks: int, enough: EnoughReplies,
                 timeout: float | None = None, after: str | None = None) -> Exchange:
        """A conversation with one command: up to `asks` times a newline to its stdin and the
        line it prints back (stopping once `enough(reply)`), each reply stamped with this
        machine's clock when the ask left and when the answer came; then EOF. Over SSH that is
        one session channel for all the asks (a clock sample costs a round trip, not a
        command). Like run, it never raises for a node: no reply and a result saying why.

        `after`: the asking starts once the command printed that line (its output before the
        line is the result's stdout; a runner that cannot converse then returns no replies)."""
        replies: list[tuple[Reply, ...]] = []

        def call(runner: Runner, t: float) -> CommandResult:
            got = runner.exchange(node, command, asks, enough, t, after)
            replies.append(got.replies)
            return got.result

        result = self._call(node, command, timeout, call)
        return Exchange(replies[0] if replies else (), result)

    def _call(self, node: Node, command: str, timeout: float | None,
              call: Callable[[Runner, float], CommandResult]) -> CommandResult:
        timeout = timeout or self.command_timeout
        if self.node_time_s is not None:
            timeout = min(timeout, self.node_time_s)
        start = time.monotonic()
        try:
            result = self._within_node_time(node, command, lambda: call(self.runner_for(node),
                                                                         timeout))
        except CommandTimeout as exc:
            result = CommandResult(node.name, command, None, "", "", time.monotonic() - start,
                                   TIMEOUT, str(exc))
        except ConnectError as exc:
            result = CommandResult(node.name, command, None, "", "", time.monotonic() - start,
                                   UNREACHABLE, str(exc))
        for hook in self.hooks:
            hook(result)
        return result

    def _within_node_time(self, node: Node, command: str,
                          call: Callable[[], CommandResult]) -> CommandResult:
        """call(), or CommandTimeout once node_time_s has passed (its thread abandoned: a
        connect, a jump host's included, has timeouts of its own that end it later)."""
        if self.node_time_s is None:
            return call()
        running = Call(call, name=f"cluster-{node.name}-bounded")
        if not running.join(self.node_time_s):
            if not node.local and self._ssh.jump_host_connecting(node):
                # its bastion: the cause every node behind it shares (one line in the report)
                raise ConnectError(node.name, JumpHostDown(
                    node.jump_host, f"not connected within {self.node_time_s:g} s").text)
            raise CommandTimeout(node.name, self.node_time_s, command)
        return running.result(0)

    def fan_out(self, nodes: Iterable[Node], command: CommandSpec, timeout: float | None = None,
                on_result: ResultHook | None = None,
                stdin: str | None = None) -> tuple[CommandResult, ...]:
        """Run a command (or a per-node command builder) on all nodes in parallel.

        `stdin`, when given, is sent to every node's command (never recorded), e.g. the text of
        an on-node program run as `python3 - ARGS`.

        Returns results in node order. At most ssh.max_parallel nodes are worked on at once; each
        has its own deadline from its start (connect + command timeout + a grace period); a node
        that has not answered by then is reported as "timeout" while its thread is abandoned, so
        the fan-out always returns in bounded time.
        """
        return tuple(got.result for got in self._fan_out(
            nodes, command, timeout, on_result,
            lambda node, cmd, t: Exchange((), self.run(node, cmd, t, stdin=stdin))))

    def fan_out_exchange(self, nodes: Iterable[Node], command: CommandSpec, asks: int,
                         enough: EnoughReplies, after: str | None = None,
                         timeout: float | None = None,
                         on_result: ResultHook | None = None) -> tuple[Exchange, ...]:
        """Session.exchange on all nodes in parallel, as fan_out runs commands (at most
        ssh.max_parallel at once, each node its own deadline, Exchanges in node order); a node
        past its deadline has no replies and a "timeout" result."""
        return self._fan_out(nodes, command, timeout, on_result, lambda node, cmd, t:
                             self.exchange(node, cmd, asks, enough, t, after))

    def _fan_out(self, nodes: Iterable[Node], command: CommandSpec, timeout: float | None,
                 on_result: ResultHook | None,
                 call: Callable[[Node, str, float], Exchange]) -> tuple[Exchange, ...]:
        nodes = list(nodes)
        timeout = timeout or self.command_timeout
        commands = {n.name: command(n) if callable(command) else command for n in nodes}

        def work(node: Node) -> Exchange:
            got = call(node, commands[node.name], timeout)
            if on_result is not None:
                on_result(got.result)
            return got

        def late(node: Node) -> Exchange:
            res = CommandResult(
                node.name, commands[node.name], None, "", "", timeout, TIMEOUT,
                f"{node.name}: no answer within the deadline ({timeout:g} s command timeout "
                "+ connect time): the node or its sshd may be hung")
            if on_result is not None:
                on_result(res)
            return Exchange((), res)

        # the longest connect, retries included, + the command's timeout + a grace period;
        # with node_time_s, _call itself ends each node's call by then
        deadline = (self.node_time_s + 5 if self.node_time_s is not None
                    else timeout + connect_deadline_s(self.inventory.ssh.connect_timeout) + 5)
        results = parallel(nodes, work, deadline, late, self.max_parallel)
        return tuple(results[n.name] for n in nodes)

    @property
    def max_parallel(self) -> int:
        """How many nodes are worked on at once (ssh.max_parallel)."""
        return self.inventory.ssh.max_parallel


