#!/usr/bin/env python3
"""Benchmark: wall time of a `sleep 2` fan-out to 1 and to 8 simulated nodes, and their ratio.

Brings up its own simulated cluster (scripts/simcluster, root only) on a private prefix/subnet,
runs the fan-out through the library's own SSH path (Fabric/paramiko), alternating 1-node and
8-node rounds, and prints the medians and the ratio (goal: <= 1.3). "cold" opens new SSH
connections each round (what one `cluster exec` does); "warm" reuses them.

    sudo .venv/bin/python scripts/bench_exec.py [--rounds 5] [--keep]
"""

from __future__ import annotations

import argparse
import statistics
import time

from simbench import simulated_cluster

from cluster.nodes.remote import Session


def timed_fan_out(inv, nodes, reuse: Session | None) -> float:
    session = reuse or Session(inv)
    start = time.perf_counter()
    results = session.fan_out(nodes, "sleep 2", timeout=30)
    elapsed = time.perf_counter() - start
    if reuse is None:
        session.close()
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"fan-out failed: {bad[0].node}: {bad[0].status} {bad[0].error}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the simulated cluster up")
    args = ap.parse_args()
    with simulated_cluster(8, prefix="bex", subnet=2, keep=args.keep) as inv:
        one, eight = inv.nodes[:1], inv.nodes[:8]
        timed_fan_out(inv, eight, None)  # warm-up: caches, ARP
        cold1, cold8, warm1, warm8 = [], [], [], []
        with Session(inv) as warm:
            timed_fan_out(inv, eight, warm)
            for _ in range(args.rounds):
                cold1.append(timed_fan_out(inv, one, None))
                cold8.append(timed_fan_out(inv, eight, None))
                warm1.append(timed_fan_out(inv, one, warm))
                warm8.append(timed_fan_out(inv, eight, warm))
        for label, a, b in (("cold (new SSH connections)", cold1, cold8),
                            ("warm (reused connections)", warm1, warm8)):
            m1, m8 = statistics.median(a), statistics.median(b)
            print(f"{label}: 1 node {m1:.3f} s, 8 nodes {m8:.3f} s, ratio {m8 / m1:.3f} "
                  f"(goal <= 1.3) [rounds {args.rounds}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
