"""Issue 25 over real SSH against scripts/simcluster: a node tool that hangs or prints 160 MB
(installed on one node: its bin/ comes first on the node's PATH) costs only the checks that
read it, in bounded memory and log (items 11, 12); `cluster fix --undo` never writes through
a link planted on a node (item 5).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration_kit import ClusterCli, ModuleRunDir

pytestmark = pytest.mark.integration
RUN_DIR = ModuleRunDir("security-root")
cli = ClusterCli(timeout=400, env={"CLUSTER_RUN_DIR": RUN_DIR}, stdin=subprocess.DEVNULL,
                 python=sys.executable, no_traceback=True).json
NVIDIA_CHECKS = ("gpus", "driver", "nvlink")      # they read nvidia-smi's outputs
OTHER_CHECKS = ("clock", "memlock", "shm")        # they do not


@contextlib.contextmanager
def node_tool(sim, node: str, tool: str, script: str):
    """The node's bin/<tool> replaced by `script` for the block (the node sees its directory
    at /run/simcluster, first on its PATH), then put back."""
    path = sim.dir / "nodes" / node / "bin" / tool
    original = path.read_bytes()
    path.write_text(script)
    path.chmod(0o755)
    try:
        yield path
    finally:
        path.write_bytes(original)
        path.chmod(0o755)


def by_check(report: dict, node: str) -> dict[str, dict]:
    return {r["check"]: r for r in report["results"] if r["node"] == node}


def test_a_hung_nvidia_smi_costs_only_the_checks_that_read_it(simcluster_factory):
    sim = simcluster_factory(2)
    with node_tool(sim, "node2", "nvidia-smi", "#!/bin/sh\nexec sleep 600\n"):
        code, report = cli(sim.inventory_path, "preflight", "--no-clock-skew",
                           "--no-reachability")
    healthy, hung = by_check(report, "node1"), by_check(report, "node2")
    for check in NVIDIA_CHECKS:
        assert hung[check]["status"] == "error", hung[check]
        assert not hung[check]["summary"].startswith("timeout"), hung[check]
    assert "hung" in hung["gpus"]["summary"]
    for check in OTHER_CHECKS:                    # still judged, as on the healthy node
        assert hung[check]["status"] == healthy[check]["status"], (hung[check], healthy[check])
        assert hung[check]["status"] != "error"


BIG = 160_000_000
FLOOD = ("#!/bin/sh\nyes '|   0  NVIDIA H100 80GB HBM3          On  | 00000000:18:00.0 Off |"
         "                    0 |' | head -c %d\n" % BIG)


def test_160_mb_of_nvidia_smi_output_is_cut_said_and_not_judged(simcluster_factory):
    sim = simcluster_factory(2)
    with node_tool(sim, "node2", "nvidia-smi", FLOOD):
        code, report = cli(sim.inventory_path, "preflight", "--no-clock-skew",
                           "--no-reachability")
    flooded, healthy = by_check(report, "node2"), by_check(report, "node1")
    for check in NVIDIA_CHECKS:
        assert flooded[check]["status"] == "error", flooded[check]
        assert "bytes cut" in flooded[check]["summary"] or \
            "cut" in flooded[check]["summary"], flooded[check]
    for check in OTHER_CHECKS:
        assert flooded[check]["status"] == healthy[check]["status"]
    log = Path(report["run_dir"]) / "nodes" / "node2.log"
    assert log.stat().st_size < 16 << 20, log.stat().st_size       # was 152 MiB
    assert "bytes cut" in log.read_text(errors="replace")


def test_undo_never_writes_through_a_link_planted_on_the_node(simcluster_factory, tmp_path):
    sim = simcluster_factory(2)
    conf = "/etc/modules-load.d/cluster-peermem.conf"
    sim.exec("node2", "sh", "-c", f"echo 'root secret' > /etc/victim; rm -f {conf}; "
                                  f"ln -s /etc/victim {conf}; mkdir -p /tmp/elsewhere; "
                                  "rm -rf /etc/systemd/system.conf.d; "
                                  "ln -s /tmp/elsewhere /etc/systemd/system.conf.d", check=True)
    try:
        for path in (conf, "/etc/systemd/system.conf.d/90-cluster-memlock.conf"):
            check = "gpudirect" if path == conf else "memlock"
            record = tmp_path / f"{check}.json"
            record.write_text(json.dumps({"entries": [
                {"kind": "start", "nodes": ["node2"]},
                {"node": "node2", "check": check, "kind": "file", "path": path,
                 "before": "pwned\n"}]}))
            code, out = cli(sim.inventory_path, "fix", "--undo", str(record), "--yes")
            assert code == 2 and "symbolic link" in out["error"], out
            assert "nothing was changed" in out["error"]
        victim = sim.exec("node2", "cat", "/etc/victim").stdout
        assert victim == "root secret\n"
        assert sim.exec("node2", "ls", "-A", "/tmp/elsewhere").stdout == ""
    finally:
        sim.exec("node2", "sh", "-c", f"rm -f {conf} /etc/victim /etc/systemd/system.conf.d; "
                                      "rm -rf /tmp/elsewhere")
