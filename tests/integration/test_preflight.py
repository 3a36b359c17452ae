"""`cluster preflight` over real SSH against simulated nodes whose tools print real captured outputs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from fakes import cluster_cli
from integration_kit import ClusterCli, ModuleRunDir

pytestmark = pytest.mark.integration
RUN_DIR = ModuleRunDir("preflight")

# node -> (profile, the failures preflight must report on that node and nothing else)
SCENARIO = {
    "node1": ("h100-ib", set()),
    "node2": ("h100-ib-port-down", {"infiniband"}),
    "node3": ("h100-no-peermem", {"gpudirect"}),
    "node4": ("h100-clock-off", {"clock"}),
    "node5": ("h100-driver-diff", {"driver-match"}),
    "node6": ("l40s-pcie", {"gpus"}),
    "node7": ("h100-7gpu", {"gpus"}),
}


# Run records go to a test folder, not into the simulated cluster's own directory.
_cli = ClusterCli(timeout=300, env={"CLUSTER_RUN_DIR": RUN_DIR}, python=sys.executable,
                  no_traceback=True)


def preflight(inv: Path, *extra: str) -> tuple[int, dict]:
    return _cli.json(inv, "preflight", *extra)


def test_each_misconfiguration_is_caught_and_nothing_else_fails(simcluster_factory):
    c = simcluster_factory(7, {n: p for n, (p, _) in SCENARIO.items() if n != "node1"})
    code, report = preflight(c.inventory_path)
    assert code == 2
    failures: dict[str, set] = {n: set() for n in SCENARIO}
    for r in report["results"]:
        if r["status"] in ("fail", "error") and r["node"]:
            failures[r["node"]].add(r["check"])
            assert r["fix"], f"{r['node']}/{r['check']} fails without saying how to fix it"
    assert failures == {n: want for n, (_, want) in SCENARIO.items()}
    by = {(r["node"], r["check"]): r for r in report["results"]}
    assert "mlx5_5 port 1 is Down" in by[("node2", "infiniband")]["summary"]
    assert "modprobe nvidia_peermem" in by[("node3", "gpudirect")]["fix"]
    assert "7.8" in by[("node4", "clock")]["summary"]
    assert "7 of 8 GPUs" in by[("node7", "gpus")]["summary"]
    assert "L40S" in by[("node6", "gpus")]["summary"]
    # The L40S node has no NVLink: recorded as a fact, not a failure; mixed models warn.
    assert by[("node6", "nvlink")]["status"] == "ok"
    assert report["facts"]["nodes"]["node6"]["nvlink"] is False
    assert report["facts"]["nodes"]["node1"]["nvlink"] is True
    assert by[("node6", "gpu-match")]["status"] == "warn"
    # Facts the planner reads.
    f1 = report["facts"]["nodes"]["node1"]
    assert (f1["gpu_count"], f1["gpu_model"], f1["gpu_memory_mib"]) == (8, "NVIDIA H100 80GB HBM3", 81559)
    assert report["facts"]["nodes"]["node7"]["gpu_count"] == 7
    # Evidence carries the command and the parsed data.
    ev = by[("node2", "infiniband")]["evidence"]
    assert ev["command"] == "ibstat" and ev["data"]["ports"]
    assert Path(report["run_dir"], "preflight.json").is_file()
    assert by[(None, "clock-skew")]["status"] == "ok"


# node -> (profile, {check: the status preflight must report}); every other result ok/skip.
HEALTH_SCENARIO = {
    "node1": ("h100-ib", {}),
    "node2": ("h100-acs", {"acs": "fail"}),
    "node3": ("h100-fm-stopped", {"fabricmanager": "fail"}),
    "node4": ("h100-xid79", {"gpu-health": "fail", "reachability": "fail"}),
    "node5": ("h100-remap-pending", {"gpu-health": "fail"}),
    "node6": ("h100-pcie-x8", {"pcie-link": "warn"}),
    "node7": ("h100-persistence-off", {"persistence": "warn"}),
    "node8": ("h100-nic-sys", {"nic-locality": "warn"}),
    "node9": ("h100-mtu-9000", {"mtu-match": "fail"}),
}


def test_each_health_problem_is_caught_and_nothing_else(simcluster_factory):
    c = simcluster_factory(9, {n: p for n, (p, _) in HEALTH_SCENARIO.items() if n != "node1"})
    c.firewall("node1", "drop", "8076", "--from", "node4")   # a real packet filter
    try:
        code, report = preflight(c.inventory_path)
    finally:
        c.firewall("node1", "clear")
    assert code == 2
    found = {n: {} for n in HEALTH_SCENARIO}
    for r in report["results"]:
        if r["status"] not in ("ok", "skip") and r["node"]:
            found[r["node"]][r["check"]] = r["status"]
            assert r["fix"], f"{r['node']}/{r['check']} says no fix"
    assert found == {n: want for n, (_, want) in HEALTH_SCENARIO.items()}
    by = {(r["node"], r["check"]): r for r in report["results"]}
    assert "Xid 79" in by[("node4", "gpu-health")]["summary"]
    assert "node1:8076 (node_manager_port) timed out" in by[("node4", "reachability")]["summary"]
    assert "x8 of x16" in by[("node6", "pcie-link")]["summary"]
    assert by[(None, "mtu-match")]["status"] == "fail"
    assert by[(None, "reachability")]["status"] == "fail"
    assert "node4 -> node1:8076" in by[(None, "reachability")]["summary"]
    # The NIC order per GPU is a fact for NCCL_IB_HCA.
    assert report["facts"]["nodes"]["node1"]["nearest_nic_relation"]["GPU0"] in ("PIX", "PXB")
    # The port open again: reachability passes.
    code, report = preflight(c.inventory_path, "--no-clock-skew", "--nodes", "node1,node4")
    by = {(r["node"], r["check"]): r for r in report["results"]}
    assert by[(None, "reachability")]["status"] == "ok", by[(None, "reachability")]["summary"]


def test_all_healthy_cluster_exits_0(simcluster_factory):
    c = simcluster_factory(3)
    code, report = preflight(c.inventory_path)
    bad = [(r["node"], r["check"], r["summary"]) for r in report["results"]
           if r["status"] not in ("ok", "skip")]
    assert code == 0, bad
    assert report["status"] == "ok"


def test_unreachable_node_is_error_others_checked(simcluster_factory):
    c = simcluster_factory(3)
    c.link("node3", "down")
    try:
        code, report = preflight(c.inventory_path, "--no-clock-skew")
    finally:
        c.link("node3", "up")
    assert code == 2
    node3 = [r for r in report["results"] if r["node"] == "node3"]
    assert node3 and all(r["status"] == "error" for r in node3)
    assert all(r["status"] in ("ok", "skip") for r in report["results"] if r["node"] == "node1")


def test_embedded_default_on_a_machine_without_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CLUSTER_INVENTORY"}
    env["CLUSTER_RUN_DIR"] = str(tmp_path / "runs")
    proc = cluster_cli("preflight", "--json", cwd=tmp_path, timeout=300, env=env, stdin=None)
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert report["inventory"] == "<embedded default>"
    gpu = {r["check"]: r for r in report["results"] if r["check"] in ("gpus", "driver", "nvlink")}
    for r in gpu.values():
        assert r["status"] in ("skip", "fail") and r["summary"]
    assert proc.returncode in (0, 1, 2)
