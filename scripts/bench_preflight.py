#!/usr/bin/env python3
"""Benchmark: `cluster preflight` wall time on 1 vs 8 simulated nodes, and the ratio (goal <= 1.5).

Brings up its own 8-node simulated cluster (root only; private prefix/subnet), then alternates
preflight runs on 1 node and on all 8 through the library's own SSH path, and prints the medians
and their ratio. Preflight includes the cross-node clock sampling on 8 nodes (none on 1).

    sudo .venv/bin/python scripts/bench_preflight.py [--rounds 5] [--keep]
"""

from __future__ import annotations

import argparse
import statistics
import time

from simbench import simulated_cluster

from cluster.preflight import run_preflight
from cluster.remote import Session


def timed_preflight(inv, nodes) -> float:
    start = time.perf_counter()
    with Session(inv) as session:
        report = run_preflight(inv, session, nodes)
    elapsed = time.perf_counter() - start
    errors = [r for r in report.results if r.status.value == "error"]
    if errors:
        raise SystemExit(f"preflight errors: {errors[0].node}/{errors[0].check}: {errors[0].summary}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the simulated cluster up")
    args = ap.parse_args()
    with simulated_cluster(8, prefix="bpf", subnet=3, keep=args.keep) as inv:
        timed_preflight(inv, inv.nodes)  # warm-up
        one, eight = [], []
        for _ in range(args.rounds):
            one.append(timed_preflight(inv, inv.nodes[:1]))
            eight.append(timed_preflight(inv, inv.nodes[:8]))
        m1, m8 = statistics.median(one), statistics.median(eight)
        print(f"preflight: 1 node {m1:.2f} s (runs {', '.join(f'{x:.2f}' for x in one)})")
        print(f"preflight: 8 nodes {m8:.2f} s (runs {', '.join(f'{x:.2f}' for x in eight)})")
        print(f"ratio 8/1 = {m8 / m1:.2f} (goal <= 1.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
