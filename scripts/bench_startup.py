#!/usr/bin/env python3
"""CLI start-up: `cluster --help`, `cluster parse --help`, `cluster inventory --json` (embedded
default) against a bare interpreter importing PyYAML, measured in the same run.

    .venv/bin/python scripts/bench_startup.py [--runs 15]

Each command runs --runs times, interleaved with the baseline; the median wall time of each and
its ratio to the baseline's median are printed (the machine is noisy: only same-run ratios
count). Every scripted call pays this start-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ("bare: python -c 'import yaml'", [sys.executable, "-c", "import yaml"])
COMMANDS = (
    ("cluster --help", [sys.executable, "-m", "cluster", "--help"]),
    ("cluster parse --help", [sys.executable, "-m", "cluster", "parse", "--help"]),
    ("cluster inventory --json", [sys.executable, "-m", "cluster", "inventory", "--json"]),
)


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "CLUSTER_INVENTORY": ""}, check=False)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    if not 1 <= args.runs <= 1000:
        ap.error("--runs 1..1000")
    times: dict[str, list[float]] = {name: [] for name, _ in (BASELINE, *COMMANDS)}
    for _ in range(args.runs):
        for name, argv in (BASELINE, *COMMANDS):
            times[name].append(timed(argv))
    base = statistics.median(times[BASELINE[0]])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:34} median {median * 1000:7.1f} ms   x{median / base:5.2f} of the bare run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
