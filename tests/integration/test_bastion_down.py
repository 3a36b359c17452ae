"""A dead jump host costs seconds, once (issue 41 item 5, its acceptance case), over real SSH.

One simulated cluster with a bastion (`simcluster up 1 --bastion`), reused by every case: the
bastion frozen (its sshd stopped: TCP accepted, no banner ever), its link down, its SSH port
closed. Behind it an inventory of 16 nodes (rb-01..rb-16, and 128 for the bound at rack scale)
that the run can only reach through the bastion: every one is reported within
connect_timeout x attempts + 10 s, the human report is at most 20 lines with the cause once,
the exit code is 2 and every node's --json record carries the shared cause.

Own instance (prefix and subnet derived from the worker's, so it never meets the shared one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from integration_kit import SIMCLUSTER, ClusterCli, ModuleRunDir, simcluster_unavailable

pytestmark = pytest.mark.integration

_BASE_SUBNET = int(os.environ.get("SIMCLUSTER_SUBNET", "0"))
ENV = {**os.environ,
       "SIMCLUSTER_PREFIX": (os.environ.get("SIMCLUSTER_PREFIX", "sim") + "j")[:7],
       "SIMCLUSTER_SUBNET": str(_BASE_SUBNET + 100 if _BASE_SUBNET < 100 else _BASE_SUBNET - 50),
       "SIMCLUSTER_DIR": os.environ.get("SIMCLUSTER_DIR",
                                        os.path.join(tempfile.gettempdir(), "simcluster"))
       + "-jump"}
SIM_DIR = Path(ENV["SIMCLUSTER_DIR"])
BASTION_IP = f"198.18.{ENV['SIMCLUSTER_SUBNET']}.253"
CONNECT_TIMEOUT = 2
cli = ClusterCli(timeout=300, env={"CLUSTER_RUN_DIR": ModuleRunDir("bastion-down"),
                                   "COLUMNS": "100"}, python=sys.executable)


def sim(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SIMCLUSTER), *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def bastion():
    reason = simcluster_unavailable()
    if reason:
        pytest.skip(reason)
    sim("up", "1", "--bastion")
    yield yaml.safe_load((SIM_DIR / "cluster.yaml").read_text())
    if os.environ.get("SIMCLUSTER_KEEP") != "1":
        sim("down")


def behind(doc: dict, folder: Path, n: int, port: int = 22) -> Path:
    """The simulated cluster's SSH settings, `n` nodes behind its bastion (on `port`)."""
    ssh = dict(doc["ssh"], connect_timeout=CONNECT_TIMEOUT,
               jump_host=f"root@{BASTION_IP}" + ("" if port == 22 else f":{port}"))
    nodes = [{"name": f"rb-{i:0{len(str(n))}d}",
              "address": f"198.18.{ENV['SIMCLUSTER_SUBNET']}.{i}",    # n <= 250
              "role": "head" if i == 1 else "worker"} for i in range(1, n + 1)]
    path = folder / f"behind-{n}-{port}.yaml"
    path.write_text(yaml.safe_dump({"ssh": ssh, "nodes": nodes}))
    return path


def bound_s(cause: str) -> float:
    """connect_timeout x attempts + 10 s: the attempts the bastion's one sequence made."""
    made = re.search(r"after (\d+) attempts", cause)
    return CONNECT_TIMEOUT * (int(made.group(1)) if made else 1) + 10


def timed(inventory: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = cli(inventory, *args)
    return proc, time.monotonic() - start


def check_dead_bastion(inventory: Path, n: int, named: tuple[str, ...]) -> None:
    doc_proc, took = timed(inventory, "preflight", "--json")
    doc = json.loads(doc_proc.stdout)
    assert doc_proc.returncode == 2 and doc["exit_code"] == 2, doc_proc.stderr
    [cause] = doc["shared_causes"]
    assert cause["cause"].startswith(named), cause
    assert len(cause["nodes"]) == n
    assert took <= bound_s(cause["cause"]), (took, cause)
    per_node = [r for r in doc["results"] if r["node"] is not None]
    assert {r["node"] for r in per_node} == set(cause["nodes"])
    assert all(cause["cause"] in r["summary"] and BASTION_IP in r["summary"] for r in per_node)
    human, took = timed(inventory, "preflight")
    assert human.returncode == 2, human.stderr
    assert took <= bound_s(cause["cause"]), took
    lines = human.stdout.splitlines()
    assert len(lines) <= 20, human.stdout
    words = " ".join(human.stdout.split())
    assert words.count(f"jump host root@{BASTION_IP}") == 1, human.stdout
    assert f"{n} nodes behind it not checked" in words


def test_a_silent_bastion_is_reported_once_within_the_bound(bastion, tmp_path):
    sim("freeze", "bastion")
    try:
        check_dead_bastion(behind(bastion, tmp_path, 16), 16,
                           ("timed out waiting for the SSH banner",))
        exec_proc, took = timed(behind(bastion, tmp_path, 128), "exec", "--json", "--", "true")
        doc = json.loads(exec_proc.stdout)
        assert exec_proc.returncode == 2 and len(doc["results"]) == 128
        [cause] = doc["shared_causes"]
        assert took <= bound_s(cause["cause"]), (took, cause)
        assert all(r["status"] == "unreachable" and r["shared_cause"]["cause"] == cause["cause"]
                   for r in doc["results"])
    finally:
        sim("thaw", "bastion")


def test_a_bastion_whose_port_is_closed_is_named_refused(bastion, tmp_path):
    check_dead_bastion(behind(bastion, tmp_path, 16, port=2222), 16, ("connection refused",))


def test_a_bastion_that_is_down_is_named_unreachable(bastion, tmp_path):
    sim("link", "bastion", "down")
    try:
        check_dead_bastion(behind(bastion, tmp_path, 16), 16,
                           ("no route to host", "connect timed out"))
    finally:
        sim("link", "bastion", "up")
