#!/usr/bin/env python3
"""Node output bounds: `cluster preflight` against a simulated node whose nvidia-smi prints
160 MB (or hangs), client peak RSS, node log size, wall time and the checks judged, for this
checkout and a baseline revision in the same run (issue 25 items 11 and 12).

    SIMCLUSTER_PREFIX=.. SIMCLUSTER_SUBNET=.. SIMCLUSTER_DIR=.. \\
        scripts/bench_node_output.py [--baseline REV] [--bytes 160000000]

Brings up 2 simulated nodes (scripts/simcluster, left running with --keep), replaces node2's
bin/nvidia-smi for each case and puts it back. The baseline is `git archive REV` in a
temporary directory (no worktree).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIMCLUSTER = ROOT / "scripts" / "simcluster"
JUDGED_ELSEWHERE = ("clock", "memlock", "shm")

MEASURE = ("import json, resource, subprocess, sys, time\n"
           "t = time.monotonic(); p = subprocess.run(sys.argv[1:], capture_output=True)\n"
           "print(json.dumps({'wall': time.monotonic() - t, 'code': p.returncode, "
           "'rss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
           "'out': p.stdout.decode(errors='replace')}))\n")


def tools(size: int) -> dict[str, str]:
    """node2's nvidia-smi: `flood` prints `size` bytes for the plain table (the other argument
    lists answer as recorded), `hang` never answers."""
    recorded = 'exec "$(dirname "$0")/nvidia-smi.recorded" "$@"'
    return {"flood": "#!/bin/sh\n[ $# -gt 0 ] && " + recorded + "\n"
                     "yes '|   0  NVIDIA H100 80GB HBM3   On  | 00000000:18:00.0 Off "
                     f"|' | head -c {size}\n",
            "hang": "#!/bin/sh\nexec sleep 600\n"}


def simcluster(*args: str) -> str:
    return subprocess.run([sys.executable, str(SIMCLUSTER), *args], check=True,
                          capture_output=True, text=True).stdout


COMMANDS = {"preflight": ("preflight", "--json", "--no-clock-skew", "--no-reachability"),
            "exec": ("exec", "--json", "--nodes", "node2", "--", "nvidia-smi")}


def run_cli(tree: Path, inventory: Path, run_dir: Path, command: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), CLUSTER_RUN_DIR=str(run_dir))
    p = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "cluster", "-i",
                        str(inventory), *COMMANDS[command]], capture_output=True, text=True,
                       cwd=tree, env=env, timeout=900)
    m = json.loads(p.stdout)
    report = json.loads(m.pop("out"))
    node2 = {r.get("check"): r["status"] for r in report["results"] if r["node"] == "node2"}
    log = Path(report["run_dir"]) / "nodes" / "node2.log"
    return dict(m, log_mib=log.stat().st_size / 2 ** 20 if log.exists() else 0.0,
                judged=sum(node2.get(c) not in (None, "error") for c in JUDGED_ELSEWHERE))


def baseline_tree(rev: str) -> Path:
    target = Path(tempfile.mkdtemp(prefix="bench-node-output-baseline-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REV")
    ap.add_argument("--bytes", type=int, default=160_000_000)
    ap.add_argument("--keep", action="store_true", help="leave the simulated nodes running")
    args = ap.parse_args(argv)
    if not 1 <= args.bytes <= 10 ** 10:
        ap.error("--bytes: 1 to 10^10")
    simcluster("up", "2")
    sim_dir = Path(json.loads(simcluster("status", "--json"))["dir"])
    trees = [("current", ROOT)] + ([("baseline", baseline_tree(args.baseline))]
                                   if args.baseline else [])
    tool = sim_dir / "nodes" / "node2" / "bin" / "nvidia-smi"
    original = tool.read_bytes()
    shutil.copy2(tool, tool.with_name("nvidia-smi.recorded"))
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-node-output-runs-") as runs:
            for case, script in tools(args.bytes).items():
                tool.write_text(script)
                tool.chmod(0o755)
                for command in COMMANDS if case == "flood" else ("preflight",):
                    for label, tree in trees:
                        r = run_cli(tree, sim_dir / "cluster.yaml", Path(runs), command)
                        rows.append((f"{case} {command}", label, r))
                        print(f"{case:5} {command:9} {label:8}: exit {r['code']}, "
                              f"{r['wall']:6.1f} s, client peak RSS "
                              f"{r['rss_kib'] / 1024:7.1f} MiB, node2 log "
                              f"{r['log_mib']:8.2f} MiB"
                              + (f", node2's clock/memlock/shm judged {r['judged']}/3"
                                 if command == "preflight" else ""), flush=True)
                        time.sleep(1)
    finally:
        tool.write_bytes(original)
        tool.chmod(0o755)
        tool.with_name("nvidia-smi.recorded").unlink(missing_ok=True)
        for label, tree in trees:
            if label == "baseline":
                shutil.rmtree(tree, ignore_errors=True)
        if not args.keep:
            simcluster("down")
    if args.baseline:
        for case in dict.fromkeys(c for c, _, _ in rows):
            cur = next(r for c, l, r in rows if c == case and l == "current")
            base = next(r for c, l, r in rows if c == case and l == "baseline")
            print(f"{case:15} current/baseline: RSS {cur['rss_kib'] / base['rss_kib']:.2f}, log "
                  f"{cur['log_mib'] / max(base['log_mib'], 1e-9):.3f}, wall "
                  f"{cur['wall'] / base['wall']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
