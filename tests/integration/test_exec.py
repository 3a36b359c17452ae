"""`cluster exec` over real SSH (the library's Fabric path) against the simulated cluster."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from integration_kit import ClusterCli, ModuleRunDir

from cluster.nodes import inventory as inventory_mod
from cluster.nodes.remote import Session

pytestmark = pytest.mark.integration
RUN_DIR = ModuleRunDir("exec")


# Run records go to a test folder, not into the simulated cluster's own directory.
cluster_cli = ClusterCli(timeout=120, env={"CLUSTER_RUN_DIR": RUN_DIR}, python=sys.executable)


def test_exec_hostname_json(simcluster):
    proc = cluster_cli(simcluster.inventory_path, "exec", "--json", "--", "hostname")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["status"] == "ok" and data["exit_code"] == 0
    by_node = {r["node"]: r for r in data["results"]}
    assert set(by_node) == {"node1", "node2", "node3"}
    for name, r in by_node.items():
        assert r["status"] == "ok" and r["exit_code"] == 0
        assert r["stdout"].strip() == name  # each node's own hostname, not the laptop's
        assert r["address"] == simcluster.node(name).ip
    run_dir = Path(data["run_dir"])
    assert (run_dir / "exec.json").is_file() and (run_dir / "nodes" / "node2.log").is_file()
    assert "node2" in (run_dir / "nodes" / "node2.log").read_text()


def test_exec_failed_command_is_data_exit_2(simcluster):
    proc = cluster_cli(simcluster.inventory_path, "exec", "--json", "--nodes", "node1,node3",
                       "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert proc.returncode == 2
    data = json.loads(proc.stdout)
    assert [r["node"] for r in data["results"]] == ["node1", "node3"]
    for r in data["results"]:
        assert (r["status"], r["exit_code"], r["stdout"], r["stderr"]) == ("failed", 7, "out\n", "err\n")


def test_exec_table_for_people(simcluster):
    proc = cluster_cli(simcluster.inventory_path, "exec", "--", "uname -n | tr a-z A-Z")
    assert proc.returncode == 0, proc.stderr
    assert "NODE1" in proc.stdout and "3/3 nodes ok" in proc.stdout


@pytest.mark.parametrize("fault", ["freeze", "link-down"])
def test_hung_or_cut_node_is_unreachable_within_timeout(simcluster_factory, fault):
    c = simcluster_factory(3)
    if fault == "freeze":
        c.freeze("node2")
    else:
        c.link("node2", "down")
    try:
        start = time.monotonic()
        proc = cluster_cli(c.inventory_path, "exec", "--json", "--timeout", "5", "--", "hostname")
        elapsed = time.monotonic() - start
    finally:
        c.thaw("node2") if fault == "freeze" else c.link("node2", "up")
    assert proc.returncode == 2, proc.stderr
    data = json.loads(proc.stdout)
    by_node = {r["node"]: r for r in data["results"]}
    assert by_node["node1"]["status"] == by_node["node3"]["status"] == "ok"
    assert by_node["node2"]["status"] in ("unreachable", "timeout")
    assert by_node["node2"]["error"]
    # connect timeout is 5 s in the simulated inventory: bounded, not hung
    assert elapsed < 60, f"took {elapsed:.1f} s"


def test_host_key_mismatch_refused(simcluster, tmp_path):
    # A known_hosts where node2's line carries another host's key: a changed key.
    lines = simcluster.known_hosts.read_text().splitlines()
    key_of = {}
    for line in filter(str.strip, lines):
        hosts, key = line.split(None, 1)
        for host in hosts.split(","):
            key_of[host] = (hosts, key)
    ip1, ip2 = simcluster.node("node1").ip, simcluster.node("node2").ip
    assert key_of[ip1][1] != key_of[ip2][1], "nodes must have distinct host keys"
    bad = tmp_path / "known_hosts"
    bad.write_text("\n".join(f"{key_of[ip2][0]} {key_of[ip1][1]}" if l.startswith(key_of[ip2][0] + " ")
                             else l for l in lines) + "\n")
    text = simcluster.inventory_path.read_text().replace(str(simcluster.known_hosts), str(bad))
    inv_file = tmp_path / "cluster.yaml"
    inv_file.write_text(text)
    proc = cluster_cli(inv_file, "exec", "--json", "--", "true")
    assert proc.returncode == 2
    by_node = {r["node"]: r for r in json.loads(proc.stdout)["results"]}
    assert by_node["node2"]["status"] == "unreachable"
    assert "host key mismatch" in by_node["node2"]["error"]
    assert by_node["node1"]["status"] == "ok"


def test_unknown_host_refused_by_default_accepted_when_asked(simcluster, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    base = simcluster.inventory_path.read_text().replace(str(simcluster.known_hosts), str(empty))
    strict = tmp_path / "strict.yaml"
    strict.write_text(base)
    proc = cluster_cli(strict, "exec", "--json", "--nodes", "node1", "--", "true")
    assert proc.returncode == 2
    assert "unknown host key" in json.loads(proc.stdout)["results"][0]["error"]
    lenient = tmp_path / "lenient.yaml"
    lenient.write_text(base.replace("ssh:\n", "ssh:\n  accept_unknown_host_keys: true\n", 1))
    proc = cluster_cli(lenient, "exec", "--json", "--nodes", "node1", "--", "true")
    assert proc.returncode == 0, proc.stdout
    assert empty.read_text() == ""  # accepted for this run, never written


def test_connections_are_reused_within_a_run(simcluster):
    inv = inventory_mod.load(str(simcluster.inventory_path))
    with Session(inv) as s:
        first = s.fan_out(inv.nodes, "echo $PPID", timeout=20)
        second = s.fan_out(inv.nodes, "true", timeout=20)
        assert all(r.ok for r in first + second)
        assert len(s._ssh._connections) == len(inv.nodes)
        transports = {n: c.transport for n, c in s._ssh._connections.items()}
        s.fan_out(inv.nodes, "true", timeout=20)
        assert transports == {n: c.transport for n, c in s._ssh._connections.items()}


def test_connections_send_without_nagle_delay(simcluster):
    # Small SSH packets must not wait for the peer's delayed ACK (~40 ms a command otherwise).
    import socket

    inv = inventory_mod.load(str(simcluster.inventory_path))
    with Session(inv) as s:
        assert all(r.ok for r in s.fan_out(inv.nodes, "true", timeout=20))
        for conn in s._ssh._connections.values():
            assert conn.transport.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_shell_metacharacters_in_argv_are_quoted(simcluster, tmp_path):
    marker = tmp_path / "pwned"
    proc = cluster_cli(simcluster.inventory_path, "exec", "--json", "--nodes", "node1", "--",
                       "echo", f"a; touch {marker}", "$(id)")
    assert proc.returncode == 0
    out = json.loads(proc.stdout)["results"][0]["stdout"]
    assert out == f"a; touch {marker} $(id)\n"
    assert not marker.exists()
