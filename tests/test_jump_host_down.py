"""A dead jump host costs seconds, once (issue 41 item 5): connection errors named for what they
are (real exception objects), the bastion's failure shared by every node behind it (one attempt
sequence per run), folded into one line by the report, and --timeout bounding each node's whole
time. The CLI cases run against a loopback listener that accepts and never speaks."""

from __future__ import annotations

import errno
import json
import os
import socket

import paramiko
import pytest

from cluster.nodes import remote
from cluster.nodes.connect_errors import JumpHostDown, jump_host_down
from cluster.report.fold import compress, shared_causes
from fakes import SilentListener, cluster_cli, closed_port, inventory_of, write_inventory


def _raised_in(context: BaseException, error: BaseException) -> BaseException:
    """`error` raised while handling `context`, as paramiko raises its banner error."""
    try:
        try:
            raise context
        except BaseException:
            raise error
    except BaseException as exc:
        return exc


KEY, OTHER = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
NO_VALID = paramiko.ssh_exception.NoValidConnectionsError


@pytest.mark.parametrize("exc,named", [
    (OSError(errno.EHOSTUNREACH, "No route to host"), "no route to host"),
    (OSError(errno.ENETUNREACH, "Network is unreachable"),
     "no route to host (network unreachable)"),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "connection refused"),
    (socket.timeout("timed out"), "connect timed out"),
    (NO_VALID({("10.0.0.7", 22): OSError(errno.EHOSTUNREACH, "No route to host")}),
     "no route to host (Unable to connect to port 22 on 10.0.0.7)"),
    (NO_VALID({("10.0.0.7", 22): OSError(errno.ECONNREFUSED, "Connection refused")}),
     "connection refused (Unable to connect to port 22 on 10.0.0.7)"),
    (_raised_in(socket.timeout(), paramiko.SSHException("Error reading SSH protocol banner")),
     "timed out waiting for the SSH banner: TCP connected, nothing answered"),
    (_raised_in(EOFError(), paramiko.SSHException("Error reading SSH protocol banner")),
     "closed before the SSH banner: TCP connected, then the far side hung up"),
])
def test_connect_errors_are_named_for_what_they_are(exc, named):
    assert remote.describe_connect_error(exc) == named


def test_host_key_problems_are_named():
    mismatch = paramiko.BadHostKeyException("h", KEY, OTHER)
    assert remote.describe_connect_error(mismatch).startswith("host key mismatch for h")
    unknown = paramiko.SSHException("Server 'h' not found in known_hosts (it offered ...)")
    assert remote.describe_connect_error(unknown).startswith("unknown host key")


class _SilentConn:
    """A bastion connection whose banner never comes (what paramiko raises then)."""

    made = 0

    def __init__(self):
        _SilentConn.made += 1
        self.is_connected = False

    def open(self):
        raise _raised_in(socket.timeout(), paramiko.SSHException("Error reading SSH protocol banner"))

    def close(self):
        pass


def test_a_silent_bastion_costs_one_attempt_sequence_per_run(monkeypatch):
    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    _SilentConn.made = 0
    jump = remote.JumpHost(_SilentConn, "jump host ops@b", 1, 2)
    errors = []
    for _ in range(16):                 # 16 nodes behind it, one after another
        with pytest.raises(remote._JumpHostError) as raised:
            jump.open()
        errors.append(str(raised.value))
    first_sequence = _SilentConn.made
    assert first_sequence <= remote.MAX_CONNECT_ATTEMPTS and jump.connects == first_sequence
    assert len(set(errors)) == 1
    down = jump_host_down(errors[0])
    assert down == JumpHostDown("ops@b", down.cause)
    assert down.cause == ("timed out waiting for the SSH banner: TCP connected, nothing "
                          f"answered, after {first_sequence} attempts")


def test_the_shared_cause_folds_into_one_line_naming_the_nodes():
    errors = [(f"rb-{i:02d}", f"unreachable: rb-{i:02d}: jump host ops@10.1.0.9 unreachable "
               "(connection refused (Unable to connect to port 22 on 10.1.0.9))")
              for i in range(1, 17)]
    errors += [("gpu-1", "unreachable: gpu-1: connect timed out"), ("gpu-2", None)]
    [cause] = shared_causes(errors)
    assert cause.down.jump_host == "ops@10.1.0.9" and len(cause.nodes) == 16
    assert cause.line() == ("jump host ops@10.1.0.9 unreachable (connection refused (Unable to "
                            "connect to port 22 on 10.1.0.9)): 16 nodes behind it not checked: "
                            "rb-[01-16]")


def test_zero_padded_node_names_compress_keeping_their_width():
    assert compress([f"rb-{i:02d}" for i in range(1, 17)]) == "rb-[01-16]"
    assert compress(["rb-09", "rb-10", "rb-12", "rb-7"]) == "rb-[09-10,12],rb-7"


def _behind(folder, port: int, n: int = 16, connect_timeout: float = 1) -> str:
    nodes = "".join(f"  - {{name: rb-{i:02d}, address: 10.77.0.{i}, "
                    f"role: {'head' if i == 1 else 'worker'}}}\n" for i in range(1, n + 1))
    return str(write_inventory(folder, f"ssh:\n  connect_timeout: {connect_timeout}\n"
                                       f"  jump_host: ops@127.0.0.1:{port}\n"
                                       f"  accept_unknown_host_keys: true\nnodes:\n{nodes}"))


@pytest.fixture
def silent_bastion():
    listener = SilentListener()
    yield listener
    listener.close()


def _cli(inv: str, tmp_path, *args: str):
    env = {**os.environ, "CLUSTER_RUN_DIR": str(tmp_path / "runs"), "COLUMNS": "100"}
    return cluster_cli("-i", inv, *args, env=env)


def test_128_nodes_behind_a_silent_bastion_share_its_one_attempt_sequence(silent_bastion,
                                                                          tmp_path):
    inv = _behind(tmp_path, silent_bastion.port, n=128, connect_timeout=0.5)
    with remote.Session(inventory_of(open(inv).read())) as session:
        results = session.fan_out(session.inventory.nodes, "true")
    assert silent_bastion.accepted <= remote.MAX_CONNECT_ATTEMPTS   # not one sequence a node
    assert {r.status for r in results} == {"unreachable"}
    assert len({jump_host_down(r.error) for r in results}) == 1


def test_preflight_behind_a_silent_bastion_is_one_line_and_json_keeps_each_node(silent_bastion,
                                                                                tmp_path):
    inv = _behind(tmp_path, silent_bastion.port)
    human = _cli(inv, tmp_path, "preflight")
    assert human.returncode == 2, human.stderr
    assert len(human.stdout.splitlines()) <= 20, human.stdout
    words = " ".join(human.stdout.split())
    assert words.count("jump host") == 1
    assert "16 nodes behind it not checked: rb-[01-16]" in words
    doc = json.loads(_cli(inv, tmp_path, "preflight", "--json").stdout)
    assert doc["exit_code"] == 2
    [cause] = doc["shared_causes"]
    assert cause["jump_host"] == f"ops@127.0.0.1:{silent_bastion.port}"
    assert cause["nodes"] == [f"rb-{i:02d}" for i in range(1, 17)]
    per_node = [r for r in doc["results"] if r["node"] is not None]
    assert per_node and all(jump_host_down(r["summary"]).cause == cause["cause"]
                            for r in per_node)


def test_a_refused_bastion_is_named_refused_in_exec(tmp_path):
    inv = _behind(tmp_path, closed_port())
    proc = _cli(inv, tmp_path, "exec", "--json", "--", "true")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 2 and doc["exit_code"] == 2
    assert all(r["shared_cause"]["cause"].startswith("connection refused")
               for r in doc["results"])
    human = _cli(inv, tmp_path, "exec", "--", "true")
    assert len(human.stdout.splitlines()) <= 20, human.stdout
    assert "16 nodes behind it not run: rb-[01-16]" in " ".join(human.stdout.split())


def test_up_on_a_few_nodes_behind_a_refused_bastion_prints_the_cause_once(tmp_path):
    """`up` reports its preflight as `preflight` does: a grid while it fits, but the nodes behind
    a dead jump host folded into one line, at any node count (a 4-node grid repeated it 19 x 4)."""
    inv = _behind(tmp_path, closed_port(), n=4)
    proc = _cli(inv, tmp_path, "up", "--yes")
    assert proc.returncode == 2, proc.stderr
    words = " ".join(proc.stdout.split())
    assert words.count("jump host") == 1, proc.stdout
    assert "4 nodes behind it not checked: rb-[01-04]" in words


@pytest.mark.parametrize("command", [["exec"], ["preflight"]])
def test_timeout_bounds_each_nodes_whole_time_the_jump_host_included(silent_bastion, tmp_path,
                                                                       command):
    inv = _behind(tmp_path, silent_bastion.port, n=4, connect_timeout=30)
    proc = _cli(inv, tmp_path, *command, "--timeout", "0.5", "--json",
                *(["--", "true"] if command == ["exec"] else []))
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == 2, proc.stderr
    [cause] = doc["shared_causes"]
    assert cause["cause"] == "not connected within 0.5 s" and len(cause["nodes"]) == 4


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "86401"])
def test_preflight_timeout_is_finite_and_in_range(tmp_path, value):
    proc = _cli(_behind(tmp_path, closed_port()), tmp_path, "preflight", "--timeout", value)
    assert proc.returncode == 2 and "argument --timeout: " in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_fold_makes_one_group_of_every_key_failed_behind_a_dead_jump_host():
    """What fix's and exec's folded tables read: 3 checks x 16 nodes behind one dead bastion."""
    from cluster.report.fold import JUMP_HOST_KEY, Row, fold

    rows = [Row(f"rb-{i:02d}", check, "error",
                f"unreachable: rb-{i:02d}: jump host ops@b unreachable (no route to host)")
            for check in ("gpus", "memlock", "clock") for i in range(1, 17)]
    rows.append(Row("gpu-1", "gpus", "ok", "8 x H100"))
    groups = fold(rows)
    assert [(g.key, g.status, g.count) for g in groups] == [(JUMP_HOST_KEY, "unreachable", 16),
                                                            ("gpus", "ok", 1)]
    assert groups[0].summary.startswith("jump host ops@b unreachable (no route to host)")
