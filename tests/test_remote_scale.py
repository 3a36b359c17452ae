"""remote.py's rack-scale pieces without a network: the retry policy (what is transient, the
budget), the shared jump host (one connect, a refusal remembered), and bounded fan-out (at most
max_parallel at once; a hung node frees its slot at its own deadline)."""

from __future__ import annotations

import threading
import time

import paramiko
import pytest

from cluster.nodes import remote
from cluster.base import waits
from cluster.nodes.inventory import Node


@pytest.mark.parametrize("exc,transient", [
    (paramiko.SSHException("Error reading SSH protocol banner[Errno 104] reset"), True),
    (ConnectionResetError(104, "reset"), True),
    (EOFError(), True),
    (paramiko.SSHException("Timeout opening channel."), True),
    (paramiko.SSHException("No existing session"), True),     # kex unfinished at the timeout
    (paramiko.SSHException(remote.HANDSHAKE_UNFINISHED + " within 15 s"), True),
    (paramiko.SSHException("Negotiation failed."), True),
    (paramiko.SSHException("Incompatible ssh peer (no acceptable kex algorithm)"), False),
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

    from cluster.nodes.inventory import SSHOptions

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


def _known_hosts(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "known_hosts"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _host_key_lines(count: int) -> list[str]:
    """known_hosts lines: plain names, several names on a line, a [host]:port, a hashed name,
    a host with two key types, a repeated line."""
    ecdsa = [paramiko.ECDSAKey.generate() for _ in range(4)]
    rsa = paramiko.RSAKey.generate(1024)
    hashed = paramiko.HostKeys.hash_host("hidden.example")
    lines = [f"node{i},198.18.0.{i % 250} {ecdsa[i % 4].get_name()} {ecdsa[i % 4].get_base64()}"
             for i in range(count)]
    lines += [f"[jump.example]:2222 {ecdsa[1].get_name()} {ecdsa[1].get_base64()}",
              f"{hashed} {ecdsa[2].get_name()} {ecdsa[2].get_base64()}",
              f"node3 {rsa.get_name()} {rsa.get_base64()}",
              f"node3 {ecdsa[0].get_name()} {ecdsa[0].get_base64()}",
              lines[5]]
    return lines


def _answer(found) -> dict | None:
    return None if found is None else {t: found[t].asbytes() for t in found.keys()}


def test_indexed_host_keys_answer_what_paramikos_lookup_answers(tmp_path):
    """The shared known_hosts' lookup by index gives paramiko's own answers (strict host-key
    checking rests on it): names on any line, ports, hashed names, two key types, repeats."""
    lines = _host_key_lines(40)
    path = _known_hosts(tmp_path, lines)
    ours, theirs = remote._indexed_host_keys(), paramiko.HostKeys()
    ours.load(path)
    theirs.load(path)
    names = ["node0", "node3", "node39", "198.18.0.7", "[jump.example]:2222", "jump.example",
             "hidden.example", "node40", "unknown", "", lines[-4].split()[0]]
    for name in names:
        assert _answer(ours.lookup(name)) == _answer(theirs.lookup(name)), name
        found = ours.lookup(name)
        if found is not None:
            assert found.keys() == list(theirs.lookup(name).keys()), name
            key = theirs.lookup(name)[found.keys()[0]]
            assert ours.check(name, key) and theirs.check(name, key)
    other = paramiko.ECDSAKey.generate()
    assert not ours.check("node0", other) and not theirs.check("node0", other)
    for table in (ours, theirs):          # an accepted key (accept_unknown_host_keys), a new one
        table.add("new.example", other.get_name(), other)
        table.add("node0", other.get_name(), other)
    for name in ("new.example", "node0", "node1"):
        assert _answer(ours.lookup(name)) == _answer(theirs.lookup(name)), name


def test_a_host_key_lookup_does_not_scan_every_known_host(tmp_path, monkeypatch):
    """paramiko compared the name with every known_hosts line on every lookup (a few per
    connection): O(nodes) per connect, O(nodes^2) for a rack. Only hashed lines are compared."""
    lines = _host_key_lines(1000)
    ours = remote._indexed_host_keys()
    ours.load(_known_hosts(tmp_path, lines))
    compared = []
    real = paramiko.HostKeys._hostname_matches
    monkeypatch.setattr(paramiko.HostKeys, "_hostname_matches",
                        lambda self, name, entry: compared.append(1) or real(self, name, entry))
    assert ours.lookup("node999") is not None and ours.lookup("node1000") is None
    assert len(compared) == 2            # the one hashed line, once per lookup


def test_an_open_connection_wakes_rarely_when_idle():
    """Once connected, the reader thread's socket timeout is IDLE_CHECK_S, not QuietTransport's
    connect-time second: every idle connection woke once a second for the whole run."""
    timeouts = []

    class Sock:
        def settimeout(self, seconds):
            timeouts.append(seconds)

    class Transport:
        sock = Sock()

        def is_active(self):
            return True

    class Conn:
        transport = Transport()

    remote._quiet_when_idle(Conn())
    # at 5 s every idle connection still cost ~26 us of CPU a second through a bastion: at
    # 1,000 nodes and a 391 s preflight about 10 ms a node, growing with the node count
    assert timeouts == [remote.IDLE_CHECK_S] and remote.IDLE_CHECK_S >= 60
    assert remote._quiet_transport_class()._active_check_timeout == 1.0


def test_closing_an_idle_connection_ends_its_reader_at_once(monkeypatch):
    """The reader of an idle TCP connection blocks for IDLE_CHECK_S; closing the connection
    wakes it (the socket shut down first), so the thread and the node's sshd session end on
    close, not an idle check later (a closed fd does not wake a thread blocked on it)."""
    monkeypatch.setattr(remote, "IDLE_CHECK_S", 3600.0)

    class IdleFromTheStart(remote._quiet_transport_class()):
        _active_check_timeout = 3600.0    # the reader blocks long from its first read on

    sock, server = _slow_sshd(delay_after_banner_s=0.0)
    transport = IdleFromTheStart(sock)

    class Conn:
        def __init__(self):
            self.transport = transport

        def close(self):
            self.transport.close()

    try:
        transport.start_client(timeout=10)
        conn = Conn()
        remote._quiet_when_idle(conn)
        assert transport.sock.gettimeout() == 3600.0 and transport.is_alive()
        remote._close(conn)
        transport.join(30)        # the bound is generous: "at once" is "well before an hour"
        assert not transport.is_alive()
    finally:
        transport.close(), server.close()


def _write_key(path, key) -> str:
    key.write_private_key_file(str(path))
    return str(path)


def test_the_identity_file_is_read_once_per_run(tmp_path, monkeypatch):
    """Given a file name, paramiko read and parsed the key again on every connect, once per key
    type it tried: the runner reads it once and hands every connect the key itself."""
    from cluster.nodes.inventory import SSHOptions

    path = _write_key(tmp_path / "id_ecdsa", paramiko.ECDSAKey.generate())
    reads = []
    real = paramiko.PKey.from_path
    monkeypatch.setattr(paramiko.PKey, "from_path",
                        staticmethod(lambda p, password=None: reads.append(p) or real(p, password)))
    runner = remote.SSHRunner(SSHOptions(identity_file=path))
    kwargs = [runner._connect_kwargs(Node(name=f"n{i}", address=f"198.18.0.{i}"))
              for i in range(1, 4)]
    assert reads == [path]
    assert all(k["pkey"] is kwargs[0]["pkey"] and "key_filename" not in k for k in kwargs)
    assert kwargs[0]["pkey"].asbytes() == paramiko.ECDSAKey.from_private_key_file(path).asbytes()
    assert all(k["allow_agent"] is False and k["look_for_keys"] is False for k in kwargs)


@pytest.mark.parametrize("content", [None, "not a key\n", "encrypted"])
def test_an_identity_file_that_cannot_be_read_goes_to_paramiko_by_name(tmp_path, content):
    """Missing, garbage or passphrase-protected: the connect is given the file name, so
    paramiko's own error (the one users search for) reaches the report."""
    from cluster.nodes.inventory import SSHOptions

    path = tmp_path / "id_key"
    if content == "encrypted":
        paramiko.ECDSAKey.generate().write_private_key_file(str(path), password="secret")
    elif content is not None:
        path.write_text(content)
    runner = remote.SSHRunner(SSHOptions(identity_file=str(path)))
    kwargs = runner._connect_kwargs(None)
    assert kwargs["key_filename"] == [str(path)] and "pkey" not in kwargs


def test_a_servers_debug_message_is_read_but_only_escaped_when_logged(caplog):
    """sshd sends SSH_MSG_DEBUG for each authorized_keys option; paramiko escapes it byte by
    byte to log it at DEBUG. The quiet transport still consumes it, and logs it when asked."""
    import logging
    import socket

    a, b = socket.socketpair()
    try:
        transport = remote._quiet_transport_class()(a)
        escaped = []
        real = paramiko.util.safe_string
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(paramiko.util, "safe_string", lambda s: escaped.append(s) or real(s))
            for level in (logging.INFO, logging.DEBUG):
                message = paramiko.Message()
                message.add_boolean(False)
                message.add_string(b"restrict: port forwarding disabled")
                message.add_string(b"")
                message.rewind()
                transport.logger.setLevel(level)
                with caplog.at_level(level, logger=transport.logger.name):
                    transport._parse_debug(message)
                assert message.get_remainder() == b""
        assert escaped == [b"restrict: port forwarding disabled"]
        assert "port forwarding disabled" in caplog.text
    finally:
        a.close()
        b.close()


def _relay(src, dst, delay_after_banner_s: float) -> None:
    """Bytes from src to dst: the first line at once, the rest once delay_after_banner_s has
    passed (an sshd that answers its banner and is then starved of CPU)."""
    held, start, banner_sent = b"", time.monotonic(), False
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            if not banner_sent and b"\n" in held + data:
                line, _, rest = (held + data).partition(b"\n")
                dst.sendall(line + b"\n")
                banner_sent, held, data = True, b"", rest
                time.sleep(max(0.0, start + delay_after_banner_s - time.monotonic()))
            if banner_sent:
                dst.sendall(data)
            else:
                held += data
    except OSError:
        pass
    finally:
        dst.close()


def _slow_sshd(delay_after_banner_s: float):
    """A client socket whose far end is a real paramiko server behind a relay that holds the
    server's bytes after its banner for delay_after_banner_s."""
    import socket

    client, relay_in = socket.socketpair()
    relay_out, server_sock = socket.socketpair()
    server = paramiko.Transport(server_sock)
    server.add_server_key(paramiko.ECDSAKey.generate())
    threading.Thread(target=_relay, args=(relay_out, relay_in, delay_after_banner_s),
                     daemon=True).start()
    threading.Thread(target=_relay, args=(relay_in, relay_out, 0.0), daemon=True).start()
    server.start_server(event=threading.Event(), server=paramiko.ServerInterface())
    return client, server


def test_a_key_exchange_slower_than_the_connect_timeout_still_completes():
    """An sshd that answered its banner is there: its key exchange gets HANDSHAKE_TIMEOUT_FACTOR
    x the connect timeout (a head whose Ray processes spin after its GCS died, on 2 cores, took
    more than the 5 s connect timeout in CI and was called unreachable). paramiko alone returns
    from start_client with the exchange unfinished and then fails with "No existing session"."""
    timeout = 0.3
    sock, server = _slow_sshd(delay_after_banner_s=timeout * 1.5)
    transport = remote._quiet_transport_class()(sock)
    try:
        transport.banner_timeout = timeout
        transport.start_client(timeout=timeout)
        assert transport.is_active() and transport.initial_kex_done
        assert transport.get_remote_server_key() is not None
    finally:
        transport.close(), server.close()


def test_a_key_exchange_that_never_finishes_is_named_and_the_transport_closed():
    import socket

    a, b = socket.socketpair()
    b.sendall(b"SSH-2.0-OpenSSH_9.2p1 starved\r\n")   # a banner, then nothing more
    transport = remote._quiet_transport_class()(a)
    try:
        transport.banner_timeout = 0.2
        with pytest.raises(paramiko.SSHException) as caught:
            transport.start_client(timeout=0.2)
        text = str(caught.value)
        assert remote.HANDSHAKE_UNFINISHED in text and "within 0.6 s" in text, text
        assert not transport.is_active() and remote.is_transient(caught.value)
        assert "overloaded" in remote.describe_connect_error(caught.value)
    finally:
        transport.close(), b.close()


def test_the_fan_out_deadline_holds_the_longest_connect():
    """connect budget 2 x, then the last attempt's TCP connect 1 x, key exchange
    HANDSHAKE_TIMEOUT_FACTOR x and authentication 1 x the connect timeout."""
    assert remote.connect_deadline_s(5.0) == 5.0 * (4 + remote.HANDSHAKE_TIMEOUT_FACTOR)
