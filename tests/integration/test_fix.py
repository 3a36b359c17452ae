"""`cluster fix` over real SSH against simulated nodes whose state the fix commands really change
(the sim's modprobe, chronyc makestep, a real /dev/shm remount, limits.d read at login)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from integration_kit import ClusterCli, ModuleRunDir

pytestmark = pytest.mark.integration
RUN_DIR = ModuleRunDir("fix")

# node -> (profile, the check preflight fails there)
SCENARIO = {
    "node1": ("h100-ib", None),
    "node2": ("h100-no-peermem", "gpudirect"),
    "node3": ("small-shm", "shm"),
    "node4": ("h100-clock-off", "clock"),
    "node5": ("h100-memlock-64", "memlock"),
    "node6": ("h100-ib-port-down", "infiniband"),
}


cli = ClusterCli(timeout=400, env={"CLUSTER_RUN_DIR": RUN_DIR}, stdin=subprocess.DEVNULL,
                 python=sys.executable, no_traceback=True).json


def failures(inv: Path) -> dict[str, set[str]]:
    _, report = cli(inv, "preflight", "--no-clock-skew", "--no-reachability")
    out: dict[str, set[str]] = {}
    for r in report["results"]:
        if r["status"] in ("fail", "error") and r["node"]:
            out.setdefault(r["node"], set()).add(r["check"])
    return out


def node_file(c, node: str, path: str) -> str | None:
    p = c.exec(node, "cat", path)
    return p.stdout if p.returncode == 0 else None


def test_fix_repairs_what_it_can_converges_and_undoes(simcluster_factory):
    c = simcluster_factory(6, {n: p for n, (p, _) in SCENARIO.items() if n != "node1"})
    inv = c.inventory_path
    want = {n: {check} for n, (_, check) in SCENARIO.items() if check}
    assert failures(inv) == want
    fstab_before = node_file(c, "node3", "/etc/fstab")
    limits_before = node_file(c, "node5", "/etc/security/limits.d/90-cluster-memlock.conf")

    # Check mode changes nothing.
    code, plan = cli(inv, "fix", "--dry-run")
    assert code == 1 and plan["dry_run"]
    planned = {(r["node"], r["check"]) for r in plan["results"] if r["status"] == "planned"}
    assert planned == {("node2", "gpudirect"), ("node3", "shm"), ("node4", "clock"),
                       ("node5", "memlock")}
    assert failures(inv) == want

    # Fix: only the IB port is left, reported manual with what to look at next.
    code, done = cli(inv, "fix", "--yes")
    by = {(r["node"], r["check"]): r for r in done["results"]}
    assert code == 1, done
    for key in planned:
        assert by[key]["status"] == "changed", by[key]
        assert by[key]["before"] == "fail" and by[key]["after"] == "ok"
    manual = by[("node6", "infiniband")]
    assert manual["status"] == "manual" and "subnet manager" in manual["next_step"]
    assert failures(inv) == {"node6": {"infiniband"}}
    assert "nvidia_peermem" in node_file(c, "node2", "/etc/modules-load.d/cluster-peermem.conf")
    assert "/dev/shm" in node_file(c, "node3", "/etc/fstab")
    assert done["undo"] and Path(done["undo"]).is_file()

    # A second run changes nothing.
    code, again = cli(inv, "fix", "--yes")
    assert code == 1
    assert not [r for r in again["results"] if r["status"] in ("changed", "failed")]

    # Undo restores the files (modules and clock steps stay).
    code, undone = cli(inv, "fix", "--undo", str(Path(done["undo"]).parent), "--yes")
    assert code == 0, undone
    assert node_file(c, "node3", "/etc/fstab") == fstab_before
    assert node_file(c, "node5", "/etc/security/limits.d/90-cluster-memlock.conf") \
        == limits_before
    assert node_file(c, "node2", "/etc/modules-load.d/cluster-peermem.conf") is None
    after = failures(inv)
    assert after.get("node3") == {"shm"} and after.get("node5") == {"memlock"}
    assert "node2" not in after and "node4" not in after     # not undone, as it says


def test_a_non_root_user_fixes_through_sudo_and_a_password_prompt_fails(simcluster_factory):
    c = simcluster_factory(2, {"node1": "h100-no-peermem", "node2": "h100-no-peermem"},
                           users=True)
    for node in ("node1", "node2"):      # state left by an earlier test: start unloaded
        c.exec(node, "modprobe", "-r", "nvidia_peermem")   # absent: exit 1, fine
    assert failures(c.inventory_path) == {"node1": {"gpudirect"}, "node2": {"gpudirect"}}
    folder = Path(c.inventory_path).parent
    fixer, asker = folder / "cluster-fixer.yaml", folder / "cluster-asker.yaml"
    # asker: sudo wants a password -> failed, with that reason, nothing changed.
    code, asked = cli(asker, "fix", "--yes", "--nodes", "node2", "--checks", "gpudirect")
    assert code == 2
    (r,) = [r for r in asked["results"] if r["node"] == "node2" and r["check"] == "gpudirect"]
    assert r["status"] == "failed" and "passwordless sudo" in r["summary"]
    assert failures(c.inventory_path).get("node2") == {"gpudirect"}
    # fixer: passwordless sudo -> changed and verified.
    code, fixed = cli(fixer, "fix", "--yes", "--nodes", "node1", "--checks", "gpudirect")
    (r,) = [r for r in fixed["results"] if r["node"] == "node1" and r["check"] == "gpudirect"]
    assert code == 0 and r["status"] == "changed" and r["after"] == "ok", fixed
    assert "node1" not in failures(c.inventory_path)


def test_persistence_and_fabric_manager_are_fixed(simcluster_factory):
    c = simcluster_factory(2, {"node1": "h100-persistence-off", "node2": "h100-fm-stopped"})
    code, done = cli(c.inventory_path, "fix", "--yes", "--checks",
                     "persistence,fabricmanager")
    by = {(r["node"], r["check"]): r for r in done["results"]}
    assert code == 0, done
    assert by[("node1", "persistence")]["status"] == "changed"
    assert by[("node2", "fabricmanager")]["status"] == "changed"
    assert by[("node2", "fabricmanager")]["after"] == "ok"
    code, again = cli(c.inventory_path, "fix", "--yes", "--checks",
                      "persistence,fabricmanager")
    assert code == 0 and {r["status"] for r in again["results"]} == {"ok"}
