#!/usr/bin/env python3
"""Benchmark: `cluster preflight` wall time on 1 vs 8 simulated nodes, and the ratio (goal <= 1.5).

Brings up its own 8-node simulated cluster (root only; private prefix/subnet), then alternates
preflight runs on 1 node and on all 8 through the library's own SSH path, and prints the medians
and their ratio. Preflight includes the cross-node clock sampling on 8 nodes (none on 1).
It also prints the median CPU seconds of a run, on the simulated nodes (their sshds, shells and
tools) and in this client: all of it shares this machine's cores, so an 8-node run cannot take
less than (nodes + client CPU) / cores, whereas real nodes each bring their own CPUs.

    sudo .venv/bin/python scripts/bench_preflight.py [--rounds 5] [--keep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from simbench import node_cpu_seconds, simulated_cluster

from playbooks.preflight import run_preflight
from cluster.nodes.remote import Session


PREFIX = "bpf"
SETTLE_S = 0.3  # lets each node's sshd reap the run's session processes before its CPU is read


def timed_preflight(inv, nodes) -> tuple[float, float, float]:
    """(wall seconds, node CPU seconds, client CPU seconds) of one preflight."""
    nodes_cpu, client_cpu = node_cpu_seconds(PREFIX), time.process_time()
    start = time.perf_counter()
    with Session(inv) as session:
        report = run_preflight(inv, session, nodes)
    elapsed = time.perf_counter() - start
    client_cpu = time.process_time() - client_cpu
    time.sleep(SETTLE_S)
    errors = [r for r in report.results if r.status.value == "error"]
    if errors:
        raise SystemExit(f"preflight errors: {errors[0].node}/{errors[0].check}: {errors[0].summary}")
    return elapsed, node_cpu_seconds(PREFIX) - nodes_cpu, client_cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the simulated cluster up")
    args = ap.parse_args()
    with simulated_cluster(8, prefix=PREFIX, subnet=3, keep=args.keep) as inv:
        timed_preflight(inv, inv.nodes)  # warm-up
        runs: dict[int, list[tuple[float, float, float]]] = {1: [], 8: []}
        for _ in range(args.rounds):
            for n in runs:
                runs[n].append(timed_preflight(inv, inv.nodes[:n]))
        medians = {}
        for n, rs in runs.items():
            wall, nodes_cpu, client_cpu = (statistics.median(col) for col in zip(*rs))
            medians[n] = wall
            print(f"preflight: {n} node{'s' if n > 1 else ''} {wall:.2f} s "
                  f"(runs {', '.join(f'{r[0]:.2f}' for r in rs)}); CPU per run: nodes "
                  f"{nodes_cpu:.2f} s, client {client_cpu:.2f} s, on {os.cpu_count()} cores")
        print(f"ratio 8/1 = {medians[8] / medians[1]:.2f} (goal <= 1.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
