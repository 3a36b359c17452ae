"""Shared by the benchmark scripts: a private simulated cluster (scripts/simcluster) for one run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def simulated_cluster(nodes: int, prefix: str, subnet: int, keep: bool = False) -> Iterator:
    """Bring up `nodes` simulated nodes on their own prefix/subnet; yield the loaded inventory;
    tear them down afterwards unless keep."""
    from cluster import inventory

    env = {**os.environ, "SIMCLUSTER_PREFIX": prefix, "SIMCLUSTER_SUBNET": str(subnet),
           "SIMCLUSTER_DIR": f"/tmp/simcluster-{prefix}"}

    def simcluster(*args: str) -> None:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "simcluster"), *args], env=env,
                       check=True, stdout=subprocess.DEVNULL)

    simcluster("up", str(nodes))
    try:
        yield inventory.load(os.path.join(env["SIMCLUSTER_DIR"], "cluster.yaml"))
    finally:
        if not keep:
            simcluster("down")
