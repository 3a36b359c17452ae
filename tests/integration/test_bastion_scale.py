"""Rack scale through a bastion, over real SSH: one shared connection to the jump host, stock
OpenSSH limits on every sshd (MaxStartups 10:30:100), transient drops retried, authentication
failures and unknown keys never retried, and 128 nodes behind one bastion read cleanly.

Own simcluster instance (SIMCLUSTER_PREFIX=bst, subnet 14): `simcluster up N --bastion` puts an
sshd in front whose address is the only one the nodes accept logins from (AllowUsers root@IP), so
a run that reaches a node went through the bastion. Counts come from the sshds' own logs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from integration_kit import SIMCLUSTER, ClusterCli, ModuleRunDir, simcluster_unavailable

pytestmark = pytest.mark.integration

ENV = {**os.environ, "SIMCLUSTER_PREFIX": "bst", "SIMCLUSTER_SUBNET": "14",
       "SIMCLUSTER_DIR": os.path.join(tempfile.gettempdir(), "simcluster-bst")}
SIM_DIR = Path(ENV["SIMCLUSTER_DIR"])
BASTION_IP = "198.18.14.253"
RUN_DIR = ModuleRunDir("bastion-scale")


def sim(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SIMCLUSTER), *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


cli = ClusterCli(timeout=300, env={"CLUSTER_RUN_DIR": RUN_DIR}, python=sys.executable)


def log_of(node: str) -> str:
    return (SIM_DIR / "nodes" / node / "console.log").read_text(errors="replace")


def count(node: str, text: str) -> int:
    return log_of(node).count(text)


@pytest.fixture(scope="module")
def bastion_cluster():
    reason = simcluster_unavailable()
    if reason:
        pytest.skip(reason)
    sim("up", "4", "--bastion")
    yield SIM_DIR / "cluster.yaml"
    if os.environ.get("SIMCLUSTER_KEEP") != "1":
        sim("down")


def _variant(inv: Path, tmp_path: Path, **ssh_changes) -> Path:
    doc = yaml.safe_load(inv.read_text())
    for key, value in ssh_changes.items():
        if value is None:
            doc["ssh"].pop(key, None)
        else:
            doc["ssh"][key] = value
    out = tmp_path / "cluster.yaml"
    out.write_text(yaml.safe_dump(doc))
    return out


def test_every_node_through_one_bastion_connection(bastion_cluster):
    names = [f"node{i}" for i in range(1, 5)]
    accepted = "Accepted publickey for root"
    before = count("bastion", accepted)
    via = {n: count(n, f"{accepted} from {BASTION_IP}") for n in names}
    proc = cli(bastion_cluster, "exec", "--json", "--", "hostname")
    assert proc.returncode == 0, proc.stderr
    results = {r["node"]: r for r in json.loads(proc.stdout)["results"]}
    assert {n: r["stdout"].strip() for n, r in results.items()} == {n: n for n in names}
    assert count("bastion", accepted) - before == 1   # one SSH connection for all four nodes
    for n in names:                                    # each node saw the bastion's address
        assert count(n, f"{accepted} from {BASTION_IP}") - via[n] == 1


def test_preflight_through_the_bastion_reaches_every_node(bastion_cluster):
    proc = cli(bastion_cluster, "preflight", "--json")
    doc = json.loads(proc.stdout)
    bad = [r for r in doc["results"] if r["status"] == "error"]
    assert not bad, bad[:3]
    assert doc["exit_code"] in (0, 1), proc.stderr


def test_a_direct_route_is_refused_and_the_auth_failure_not_retried(bastion_cluster, tmp_path):
    inv = _variant(bastion_cluster, tmp_path, jump_host=None)
    refused = "not allowed because not listed in AllowUsers"
    before = count("node2", refused)
    proc = cli(inv, "exec", "--json", "--nodes", "node2", "--", "true", timeout=120)
    assert proc.returncode == 2
    result = json.loads(proc.stdout)["results"][0]
    assert result["status"] == "unreachable" and "authentication failed" in result["error"]
    assert "attempts" not in result["error"]
    assert count("node2", refused) - before == 1      # tried once, never again


def test_an_unknown_bastion_key_is_refused_not_retried(bastion_cluster, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("".join(line for line in (SIM_DIR / "known_hosts").read_text().splitlines(True)
                             if not line.startswith("bastion,")))
    inv = _variant(bastion_cluster, tmp_path, known_hosts=str(known))
    proc = cli(inv, "exec", "--json", "--nodes", "node1", "--", "true", timeout=120)
    assert proc.returncode == 2
    error = json.loads(proc.stdout)["results"][0]["error"]
    assert "jump host" in error and "unknown host key" in error and "SHA256:" in error
    assert "attempts" not in error


def _hold_every_startup_slot(ip: str, full: int = 100, tries: int = 5000) -> list[socket.socket]:
    """Open unauthenticated connections to an sshd until it holds `full` of them (each one got
    sshd's banner, not "Exceeded MaxStartups"): from then on sshd drops every new connect. Past
    MaxStartups' start sshd drops some of these too, at random, so the count is checked, not
    assumed (100 connects left it holding about 60). Bounded by `tries` connects."""
    held: list[socket.socket] = []
    for _ in range(tries):
        s = socket.create_connection((ip, 22), timeout=5)
        s.settimeout(5)
        try:
            banner = s.recv(64)
        except OSError:
            banner = b""
        if banner.startswith(b"SSH-"):
            held.append(s)
            if len(held) == full:
                return held
        else:
            s.close()
    for s in held:
        s.close()
    raise AssertionError(f"sshd at {ip} held only {len(held)} of {full} connections after {tries} connects")


def test_a_node_that_drops_the_first_connections_is_retried(bastion_cluster):
    """node3's sshd keeps OpenSSH's stock MaxStartups 10:30:100: with 100 unauthenticated
    connections held open it drops every new one; they are released 1.5 s after sshd dropped one
    of the client's connects (the CLI's start-up time does not decide the test), while the client
    retries with backoff inside its connect budget. The client's drops are told apart from the
    holders' by their source, the bastion's address (sshd logs every drop at LogLevel VERBOSE)."""
    client_drop = f"from [{BASTION_IP}]"

    def client_drops() -> int:
        return sum(client_drop in ln for ln in log_of("node3").splitlines() if "past MaxStartups" in ln)

    holders = _hold_every_startup_slot("198.18.14.3")
    dropped_before = client_drops()

    def release():
        # hold until sshd really dropped one of the client's connects (bounded: 60 s), then
        # 1.5 s more; the client must retry past the drops to succeed
        deadline = time.monotonic() + 60
        while client_drops() == dropped_before and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)
        for s in holders:
            s.close()

    releaser = threading.Thread(target=release)
    try:
        releaser.start()
        proc = cli(bastion_cluster, "exec", "--json", "--nodes", "node3", "--", "hostname",
                   timeout=120)
    finally:
        releaser.join()
        for s in holders:
            s.close()
    result = json.loads(proc.stdout)["results"][0]
    assert result["status"] == "ok" and result["stdout"].strip() == "node3", result
    assert client_drops() > dropped_before  # the client's connects really were dropped


@pytest.fixture(scope="module")
def rack_128():
    reason = simcluster_unavailable()
    if reason:
        pytest.skip(reason)
    sim("up", "128", "--bastion", "--profile", "node37=h100-no-peermem", timeout=900)
    yield SIM_DIR / "cluster.yaml"
    if os.environ.get("SIMCLUSTER_KEEP") != "1":
        sim("down", timeout=600)


def test_128_nodes_behind_a_stock_bastion(rack_128):
    """One preflight of 128 nodes through the bastion, read twice: the table a person sees
    fits a screen and names node37's missing peer memory with its fix; the JSON report it
    wrote to its run directory (the document `--json` prints, emit_json) says every node
    answered, none in error, only node37's gpudirect failing. Then one `exec` on all 128.
    (A whole preflight of this rack costs 40-60 s of the suite: the human and JSON views are
    one run, not two; --json's stdout is covered on small clusters.)"""
    proc = cli(rack_128, "preflight", timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) <= 64, proc.stdout     # 60 + issue 40's rows (runtime, contract, ...)
    for check in ("gpus", "driver", "nvlink", "infiniband", "gpudirect", "clock", "shm",
                  "memlock", "versions", "model", "ports"):
        assert any(line.startswith(check) for line in lines), (check, proc.stdout)
    fix = [line for line in lines if line.startswith("fix gpudirect")]
    assert fix and "node37" in fix[0] and "modprobe" in proc.stdout
    assert "node37" in next(line for line in lines if line.startswith("gpudirect"))

    assert any(line.startswith("report: ") for line in lines), proc.stdout
    report = max(Path(RUN_DIR).glob("*/preflight.json"), key=lambda p: p.stat().st_mtime)
    doc = json.loads(report.read_text())
    assert doc["exit_code"] == 2
    errors = [(r["node"], r["check"], r["summary"]) for r in doc["results"]
              if r["status"] == "error"]
    assert not errors, errors[:5]
    failing = {(r["node"], r["check"]) for r in doc["results"] if r["status"] == "fail"}
    assert failing == {("node37", "gpudirect")}, sorted(failing)[:5]
    assert {f"node{i}" for i in range(1, 129)} <= {r["node"] for r in doc["results"]}
    proc = cli(rack_128, "exec", "--json", "--", "hostname", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)["results"]
    assert len(results) == 128 and all(r["stdout"].strip() == r["node"] for r in results)


def test_a_checkout_under_tmp_is_seen_by_the_nodes(bastion_cluster, tmp_path_factory):
    """Nodes have a private /tmp: a venv (or checkout) under the host's /tmp is bound back into
    each node at the same path, so `scripts/demo` works from a checkout anywhere."""
    venv = Path(tempfile.mkdtemp(prefix="venv-under-tmp-", dir="/tmp"))
    (venv / "bin").mkdir()
    (venv / "bin" / "python3").symlink_to(os.path.realpath(sys.executable))
    env = {**ENV, "SIMCLUSTER_VENV": str(venv)}
    try:
        up = subprocess.run([sys.executable, str(SIMCLUSTER), "up", "4", "--bastion"],
                            capture_output=True, text=True, timeout=300, env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        inv = yaml.safe_load((SIM_DIR / "cluster.yaml").read_text())
        assert inv["ray"]["python"] == str(venv / "bin" / "python3")
        proc = cli(SIM_DIR / "cluster.yaml", "exec", "--json", "--",
                   f"{venv}/bin/python3 -c 'import sys; print(sys.version_info[0])'")
        assert proc.returncode == 0, proc.stdout[-2000:]
        assert {r["stdout"].strip() for r in json.loads(proc.stdout)["results"]} == {"3"}
    finally:
        sim("up", "4", "--bastion")  # back to the module's cluster (the repository's venv)
        subprocess.run(["rm", "-rf", str(venv)], check=False)
