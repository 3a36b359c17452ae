#!/usr/bin/env python3
"""Benchmark: the client side of `cluster preflight --json` at N fake nodes, CPU per node and
JSON per node, against a baseline git revision in the same run (issue 24: the laptop's cost of
a rack-scale preflight, without a rack).

The CLI runs for real (inventory, run record, Session and its threads, hooks, report, JSON);
only the SSH runner is replaced: every node answers from the measured tree's own
tests/fakes.py (FakeRunner with preflight_answers, or an older tree's FakeClusterSession: so
each tree is asked in its own protocol; real captured tool outputs, the node-facts document,
reach.py's answers), so what is measured is the client's own Python work (parsing, checks,
cross-node checks, reachability planning, the run record, JSON) - not paramiko's crypto or the
network. nvidia-smi -q is the simulated nodes' full 584-line report, not the 31-line fixture. Each (tree, size) runs in a fresh
interpreter, alternating trees, `--rounds` times; medians and current/baseline ratios printed.

    .venv/bin/python scripts/bench_preflight_client.py [--sizes 3,127,255] [--baseline REV]
                                                       [--rounds 3] [--profile N]
`--profile N`: a cProfile of the current tree at N nodes instead, every thread on its own CPU clock
(top 30 by own time, then the CPU by kind of thread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from simbench import THREAD_PROFILER, thread_kinds_lines  # the benchmarks' shared part

ROOT = Path(__file__).resolve().parent.parent
# Every tree (the baseline too) is given this tree's simulated node's nvidia-smi -q report.
REAL_Q_DIR = ROOT / "scripts" / "simcluster_profiles" / "h100-ib"

# Runs in the child: argv = [tests dir, nodes, profile?, folder of the nvidia-smi -q report];
# prints one JSON line.
CHILD = THREAD_PROFILER + r'''
import contextlib, io, json, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import fakes
import cluster.nodes.remote as remote
n, profile = int(sys.argv[2]), sys.argv[3] == "1"
if hasattr(fakes, "preflight_answers"):     # the tree's one fake of the nodes: a Runner
    # nvidia-smi -q as a simulated node prints it (584 lines, 8 GPUs; the test fixture has 31):
    # its parse is the largest single parse of a real preflight
    real_q = (sys.argv[4], "nvidia-smi-q.txt")   # (a folder, not a fixture kind: Path joins it)
    runner = fakes.FakeRunner(respond=fakes.preflight_answers(
        {**fakes.NODE_FIXTURES, "nvidia-smi-q": real_q}))
    remote.SSHRunner = lambda ssh: runner
else:                                       # a baseline tree from before FakeRunner
    fake = fakes.FakeClusterSession(fakes.fake_inventory(n))

    class FakeRunner:
        def __init__(self, ssh):
            pass
        def run(self, node, command, timeout, stdin=None):
            return fake.run(node, command)
        def exchange(self, node, command, asks, enough, timeout, after=None):
            # (a baseline tree older than the gather's clock conversation never passes `after`)
            return fake.exchange(node, command, asks, enough, timeout,
                                 **({} if after is None else {"after": after}))
        def close(self):
            pass

    remote.SSHRunner = FakeRunner
from cluster import cli
d = tempfile.mkdtemp(prefix="bench-client-")
lines = ["nodes:"] + [f"  - {{name: n{i}, address: 198.18.{i // 250}.{i % 250 + 1}"
                      f"{', role: head' if i == 1 else ''}}}" for i in range(1, n + 1)]
open(f"{d}/inv.yaml", "w").write("\n".join(lines) + f"\nrun_dir: {d}/runs\n")
out = io.StringIO()
def go():
    with contextlib.redirect_stdout(out):
        return cli.main(["-i", f"{d}/inv.yaml", "preflight", "--json"])
if profile:
    _, stats, kinds = profiled(go)
    stats.stream = sys.stderr
    stats.sort_stats("tottime").print_stats(30)
    print(json.dumps({"kinds": kinds}))
    raise SystemExit(0)
t = time.process_time()
code = go()
cpu = time.process_time() - t
print(json.dumps({"cpu_s": cpu, "bytes": len(out.getvalue()), "exit": code}))
'''


def run_child(tree: Path, nodes: int, profile: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tree / "tests"), str(nodes),
                           "1" if profile else "0", str(REAL_Q_DIR)], cwd=tree, env=env,
                          capture_output=True,
                          text=True, timeout=1800)
    if profile:
        sys.stdout.write(proc.stderr)
        try:
            kinds = json.loads(proc.stdout.strip().splitlines()[-1])["kinds"]
        except (ValueError, IndexError, KeyError):
            raise SystemExit(f"{tree}: no profile ({proc.stderr.strip()[-300:]})") from None
        print(f"CPU by kind of thread (under the profiler, on each thread's CPU clock, blocking "
              f"calls left out), {nodes} nodes:")
        print("\n".join(thread_kinds_lines(kinds, nodes)))
        return {}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"{tree}: no result ({proc.stderr.strip()[-300:]})") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="3,127,255")
    ap.add_argument("--baseline", metavar="REV")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=int, metavar="N")
    args = ap.parse_args()
    if args.profile:
        if not 1 <= args.profile <= 2000:
            ap.error("--profile: 1..2000 nodes")
        run_child(ROOT, args.profile, profile=True)
        return 0
    sizes = [int(x) for x in args.sizes.split(",")]
    if not all(1 <= n <= 2000 for n in sizes) or not 1 <= args.rounds <= 10:
        ap.error("sizes 1..2000, rounds 1..10")
    trees = [("current", ROOT)]
    base = None
    if args.baseline:
        base = Path(tempfile.mkdtemp(prefix="bench-client-baseline-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                        args.baseline], check=True, capture_output=True)
        trees.append(("baseline", base))
    try:
        for n in sizes:
            got: dict[str, list[dict]] = {label: [] for label, _ in trees}
            for _ in range(args.rounds):
                for label, tree in trees:
                    got[label].append(run_child(tree, n))
            row = {}
            for label, runs in got.items():
                ms = statistics.median(r["cpu_s"] for r in runs) * 1000 / n
                kb = statistics.median(r["bytes"] for r in runs) / 1024 / n
                row[label] = (ms, kb)
                print(f"{label:8} {n:5} nodes: {ms:6.1f} ms CPU per node, {kb:6.1f} KB JSON per "
                      f"node (exit {runs[-1]['exit']})", flush=True)
            if "baseline" in row:
                (ms, kb), (bms, bkb) = row["current"], row["baseline"]
                print(f"ratio    {n:5} nodes: CPU {ms / bms:.2f}x, JSON {kb / bkb:.2f}x "
                      "(current / baseline)", flush=True)
    finally:
        if base is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                           check=False, capture_output=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
