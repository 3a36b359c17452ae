"""Shared by the benchmark scripts: a private simulated cluster (scripts/simcluster) for one run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def byte_compile(tree: Path = ROOT) -> str:
    """The tree's modules compiled into __pycache__ (what `pip install` does for a wheel), so a
    CLI's start-up is timed as a user's would be (with PYTHONDONTWRITEBYTECODE=1 every run would
    compile its modules from source); "ok" or why not."""
    import compileall

    ok = all([compileall.compile_dir(str(tree / package), quiet=1)
              for package in ("cluster", "playbooks")])
    return "ok" if ok else "some modules failed to compile (timed from source)"


def instance_dir(prefix: str) -> str:
    return f"/tmp/simcluster-{prefix}"


def node_cpu_seconds(prefix: str) -> float:
    """CPU seconds (user + system) used so far on the instance's nodes: each node's PID-1 sshd and
    its descendants once reaped (a session's processes count when it ends)."""
    state = json.loads(Path(instance_dir(prefix), "state.json").read_text())
    ticks = 0
    for rec in state["nodes"].values():
        stat = Path(f"/proc/{rec['sshd_pid']}/stat").read_text()
        ticks += sum(int(x) for x in stat.rsplit(")", 1)[1].split()[11:15])  # u, s, cu, cs time
    return ticks / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def simulated_cluster(nodes: int, prefix: str, subnet: int, keep: bool = False) -> Iterator:
    """Bring up `nodes` simulated nodes on their own prefix/subnet; yield the loaded inventory;
    tear them down afterwards unless keep."""
    from cluster.nodes import inventory

    env = {**os.environ, "SIMCLUSTER_PREFIX": prefix, "SIMCLUSTER_SUBNET": str(subnet),
           "SIMCLUSTER_DIR": instance_dir(prefix)}

    def simcluster(*args: str) -> None:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "simcluster"), *args], env=env,
                       check=True, stdout=subprocess.DEVNULL)

    simcluster("up", str(nodes))
    try:
        yield inventory.load(os.path.join(env["SIMCLUSTER_DIR"], "cluster.yaml"))
    finally:
        if not keep:
            simcluster("down")


def cli_json(inventory: str, *args: str, timeout: float) -> tuple[int, dict]:
    """`cluster -i INVENTORY ARGS --json` from the checkout: (exit code, its document); no
    document is one line and exit (the benchmark cannot go on)."""
    p = subprocess.run([sys.executable, "-m", "cluster", "-i", inventory, *args, "--json"],
                       capture_output=True, text=True, cwd=str(ROOT), timeout=timeout)
    try:
        return p.returncode, json.loads(p.stdout)
    except ValueError:
        raise SystemExit(f"cluster {args[0]}: exit {p.returncode}: {p.stderr.strip()[-500:]}")
