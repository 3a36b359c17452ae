#!/usr/bin/env python3
"""Rack-scale benchmark: `cluster preflight` and `cluster exec` at 1..1000 simulated nodes,
directly and through a bastion, against a baseline tree in the same run.

    .venv/bin/python scripts/bench_scale.py [--sizes 1,8,32,128,256] [--modes direct,bastion]
                                            [--baseline REV] [--rounds 1] [--profile DIR]
                                            [--profile-sizes 511]

For each size the simulated cluster (scripts/simcluster, stock OpenSSH limits on every sshd) is
brought up once per mode (`--bastion`: the nodes accept logins only from the bastion). Each CLI
run is a subprocess: wall time, the CLI's own CPU (user + system, from wait4's rusage: the
laptop's cost, not the nodes'), its peak RSS and its JSON size per node, plus how many results
were unreachable/error, and for preflight the length of its human report (the saved results
rendered as the command prints them without --json). With --baseline REV the same runs are
made, interleaved, with the CLI of git revision REV (a temporary worktree), and the table prints
the medians over the rounds and current/baseline ratios: the machine is shared and noisy, so
only same-run ratios mean anything. The simulated cluster is the caller's SIMCLUSTER_PREFIX /
_SUBNET / _DIR when set. Root and Linux only (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from simbench import (BLOCKING, THREAD_PROFILER, byte_compile,  # the benchmarks' shared part
                      thread_kinds_lines)

ROOT = Path(__file__).resolve().parent.parent
# The simulated cluster's instance: the caller's SIMCLUSTER_* when set (a shared machine: each
# engineer has their own prefix and subnet), else the benchmark's own.
PREFIX = os.environ.get("SIMCLUSTER_PREFIX", "bsc")
ENV = {**os.environ, "SIMCLUSTER_PREFIX": PREFIX,
       "SIMCLUSTER_SUBNET": os.environ.get("SIMCLUSTER_SUBNET", "30"),
       "SIMCLUSTER_DIR": os.environ.get("SIMCLUSTER_DIR", f"/tmp/simcluster-{PREFIX}")}
INVENTORY = Path(ENV["SIMCLUSTER_DIR"]) / "cluster.yaml"
COMMANDS = {"preflight": ["preflight", "--json"], "exec": ["exec", "--json", "--", "hostname"]}

# `--profile DIR`: each tree's CLI once more per size and mode, in-process under cProfile on
# every thread (each thread's own CPU clock: time spent waiting is not counted), the stats of
# all threads merged into DIR/<tree>-<command>-<nodes>-<mode>.pstats, each kind of thread's CPU
# (main, fan-out workers, paramiko's transports over TCP / over a jump host's channel) into
# <that>.threads.json; both printed, per node. argv: pstats path, CLI args...
PROFILE_CHILD = THREAD_PROFILER + r'''
import contextlib, io, json, sys
path, argv = sys.argv[1], sys.argv[2:]
from cluster import cli
with contextlib.redirect_stdout(io.StringIO()):
    code, stats, kinds = profiled(lambda: cli.main(argv))
stats.dump_stats(path)
with open(path + ".threads.json", "w") as out:
    json.dump(kinds, out)
'''
# The human report's length: the saved preflight results rendered by the tree's own
# `preflight` renderer (what the command prints without --json, at a COLUMNS-wide terminal),
# so the length is read without a second preflight. argv: the JSON document's path.
RENDER_CHILD = r'''
import json, sys
from cluster.base.results import CheckResult, Report, Status
from cluster.commands import preflight
doc = json.load(open(sys.argv[1]))
preflight.render(Report("preflight", tuple(
    CheckResult(r["check"], r["node"], Status(r["status"]), r["summary"], fix=r.get("fix"))
    for r in doc["results"])))
print("report: " + doc["run_dir"] + "/preflight.json")
'''
REPORT_COLUMNS = 120


@dataclass(frozen=True)
class Run:
    tree: str
    command: str
    nodes: int
    mode: str
    wall_s: float
    cpu_s: float
    rss_mib: float
    bad: int       # results unreachable / error / timeout
    exit_code: int
    json_bytes: int = 0
    report_lines: int | None = None   # preflight's human report, lines (None: not rendered)

    @property
    def json_kb_per_node(self) -> float:
        return self.json_bytes / 1024 / self.nodes

    @property
    def cpu_ms_per_node(self) -> float:
        return self.cpu_s * 1000 / self.nodes


def simcluster(*args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "simcluster"), *args], env=ENV,
                   check=True, stdout=subprocess.DEVNULL, timeout=1800)


def run_cli(tree: Path, label: str, command: str, nodes: int, mode: str) -> Run:
    env = {**os.environ, "PYTHONPATH": str(tree), "CLUSTER_RUN_DIR": tempfile.mkdtemp(
        prefix="bench-scale-runs-")}
    argv = [sys.executable, "-m", "cluster", "-i", str(INVENTORY), *COMMANDS[command]]
    start = time.monotonic()
    with open(os.devnull, "w") as err, tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - start
        out.seek(0)
        text = out.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    bad = nodes
    try:
        doc = json.loads(text)
        bads = [r for r in doc.get("results", [])
                if r.get("status") in ("unreachable", "error", "timeout")]
        bad = len(bads)
        if bads:
            first = bads[0]
            print(f"  {label} {command} {nodes} {mode}: {bad} bad, e.g. {first.get('node')}: "
                  f"{(first.get('summary') or first.get('error') or '')[:200]}", flush=True)
    except ValueError:
        pass
    lines = report_lines(tree, text) if command == "preflight" else None
    return Run(label, command, nodes, mode, wall, usage.ru_utime + usage.ru_stime,
               usage.ru_maxrss / 1024, bad, code, len(text.encode()), lines)


def report_lines(tree: Path, text: str) -> int | None:
    """Lines of the human report for this JSON document (RENDER_CHILD), or None if the tree
    could not render it (an older tree's renderer)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as doc:
        doc.write(text)
        doc.flush()
        env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": str(REPORT_COLUMNS),
               "TERM": "dumb"}
        proc = subprocess.run([sys.executable, "-c", RENDER_CHILD, doc.name], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=600, check=False)
    return len(proc.stdout.splitlines()) if proc.returncode == 0 else None


def profile_cli(tree: Path, label: str, command: str, nodes: int, mode: str, folder: Path,
                top: int = 25) -> None:
    """PROFILE_CHILD for one tree; its top `top` functions by own CPU printed, then its CPU by
    kind of thread."""
    import pstats

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{label}-{command}-{nodes}-{mode}.pstats"
    env = {**os.environ, "PYTHONPATH": str(tree), "CLUSTER_RUN_DIR": tempfile.mkdtemp(
        prefix="bench-scale-runs-")}
    argv = [sys.executable, "-c", PROFILE_CHILD, str(path), "-i", str(INVENTORY),
            *COMMANDS[command]]
    subprocess.run(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=1800, check=False)
    if not path.exists():
        print(f"  profile {label} {command} {nodes} {mode}: no stats written", flush=True)
        return
    stats = pstats.Stats(str(path))
    rows = sorted(((tt, nc, func) for func, (_, nc, tt, _, _) in stats.stats.items()
                   if not any(word in func[2] for word in BLOCKING)), reverse=True)
    total = sum(tt for tt, _, _ in rows)
    print(f"profile {label} {command} {nodes} nodes {mode}: {total * 1000 / nodes:.1f} ms CPU "
          f"per node under the profiler (blocking calls left out); top by own time -> {path}")
    for tt, nc, (file, line, name) in rows[:top]:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        print(f"  {tt * 1000 / nodes:7.3f} ms/node {nc / nodes:8.1f} calls/node  {name}  {where}")
    threads = Path(f"{path}.threads.json")
    if threads.exists():
        print(f"profile {label} {command} {nodes} nodes {mode}: CPU by kind of thread (under the "
              "profiler, blocking calls left out)")
        print("\n".join(thread_kinds_lines(json.loads(threads.read_text()), nodes)))


def baseline_tree(rev: str) -> Path:
    target = Path(tempfile.mkdtemp(prefix="bench-scale-baseline-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(target), rev],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,8,32,128,256")
    ap.add_argument("--modes", default="direct,bastion")
    ap.add_argument("--commands", default="preflight,exec")
    ap.add_argument("--baseline", metavar="REV", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", metavar="DIR", type=Path,
                    help="also profile each tree once per size and mode (all threads' CPU, "
                         "cProfile) into DIR")
    ap.add_argument("--profile-sizes", metavar="N,N",
                    help="with --profile: only at these sizes (default: every size; a large "
                         "cluster's bring-up is long, so measure the sizes, profile one)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    modes = args.modes.split(",")
    commands = args.commands.split(",")
    profiled = set(sizes) if not args.profile_sizes else \
        {int(x) for x in args.profile_sizes.split(",")}
    if not all(1 <= n <= 1000 for n in sizes) or not set(modes) <= {"direct", "bastion"} \
            or not set(commands) <= set(COMMANDS) or not 1 <= args.rounds <= 10:
        ap.error("sizes 1..1000, modes direct|bastion, commands preflight|exec, rounds 1..10")
    trees = [("current", ROOT)]
    if args.baseline:
        trees.append(("baseline", baseline_tree(args.baseline)))
    for label, tree in trees:      # each CLI starts as an installed one would, from bytecode
        print(f"{label} tree byte-compiled: {byte_compile(tree)}", flush=True)
    runs: list[Run] = []
    try:
        for n in sizes:
            for mode in modes:
                simcluster("up", str(n), *(["--bastion"] if mode == "bastion" else []))
                for _ in range(args.rounds):
                    for command in commands:
                        for label, tree in trees:
                            run = run_cli(tree, label, command, n, mode)
                            runs.append(run)
                            print(f"{label:8} {command:9} {n:4} nodes {mode:7}: "
                                  f"{run.wall_s:7.2f} s wall, {run.cpu_ms_per_node:7.1f} ms CPU "
                                  f"per node, {run.rss_mib:6.0f} MiB, {run.json_kb_per_node:5.1f} "
                                  f"KB JSON per node, {run.bad} bad, exit {run.exit_code}"
                                  f"{_report(run)}",
                                  flush=True)
                if args.profile and n in profiled:
                    for command in commands:
                        for label, tree in trees:
                            profile_cli(tree, label, command, n, mode, args.profile)
    finally:
        # the teardown must finish even when interrupted (`timeout -s INT` signals the whole
        # process group, so a second SIGINT used to land in `down` and leave the nodes up)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        simcluster("down")
        for label, tree in trees:
            if label == "baseline":
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], check=False)
    print_table(runs, with_baseline=len(trees) > 1)
    return 0


def print_table(runs: list[Run], with_baseline: bool) -> None:
    print()
    head = f"{'command':9} {'nodes':>5} {'mode':7} {'wall s':>7} {'CPU ms/node':>11} " \
           f"{'marginal':>8} {'RSS MiB':>7} {'bad':>4} {'KB/node':>7} {'lines':>5}"
    if with_baseline:
        head += f" | {'base ms/node':>12} {'base marg':>9} {'base bad':>8} {'CPU ratio':>9} " \
                f"{'marg ratio':>10} {'wall ratio':>10}"
    print(head)
    keys = sorted({(r.command, r.nodes, r.mode) for r in runs},
                  key=lambda k: (k[0], k[1], k[2]))
    for command, n, mode in keys:
        mine = [r for r in runs if (r.command, r.nodes, r.mode, r.tree) ==
                (command, n, mode, "current")]
        base = [r for r in runs if (r.command, r.nodes, r.mode, r.tree) ==
                (command, n, mode, "baseline")]
        cur = median_run(mine)
        cur_marg = marginal(runs, cur)
        line = f"{command:9} {n:5} {mode:7} {cur.wall_s:7.2f} {cur.cpu_ms_per_node:11.1f} " \
               f"{_ms(cur_marg):>8} {cur.rss_mib:7.0f} {max(r.bad for r in mine):4} " \
               f"{cur.json_kb_per_node:7.1f} {_lines(mine):>5}"
        if base:
            b = median_run(base)
            b_marg = marginal(runs, b)
            ratio = f"{cur_marg / b_marg:10.2f}" if cur_marg and b_marg else f"{'-':>10}"
            line += f" | {b.cpu_ms_per_node:12.1f} {_ms(b_marg):>9} {max(r.bad for r in base):8} " \
                    f"{cur.cpu_s / b.cpu_s:9.2f} {ratio} {cur.wall_s / b.wall_s:10.2f}"
        print(line)
    print("\nMedians over the rounds. CPU ms/node: the CLI's CPU / nodes; "
          "marginal: (CPU - CPU at 1 node) / (nodes - 1), "
          "the per-node cost without the start-up (imports, inventory); KB/node: --json's size; "
          f"lines: preflight's human report at {REPORT_COLUMNS} columns (the longest round)")


def marginal(runs: list[Run], run: Run) -> float | None:
    """Per-node CPU above the same tree/command/mode's 1-node run (ms), or None."""
    ones = [r for r in runs if (r.tree, r.command, r.mode, r.nodes) ==
            (run.tree, run.command, run.mode, 1)]
    if run.nodes <= 1 or not ones:
        return None
    one = median_run(ones)
    return (run.cpu_s - one.cpu_s) * 1000 / (run.nodes - 1)


def median_run(runs: list[Run]) -> Run:
    """The run of median CPU (the lower middle one of an even count): rounds interleave the
    trees on a shared machine, so the median, not the best, is what a tree costs."""
    ranked = sorted(runs, key=lambda r: r.cpu_s)
    return ranked[(len(ranked) - 1) // 2]


def _lines(runs: list[Run]) -> str:
    """The longest human report of these runs, or "-" when none was rendered."""
    counts = [r.report_lines for r in runs if r.report_lines is not None]
    return str(max(counts)) if counts else "-"


def _report(run: Run) -> str:
    return "" if run.report_lines is None else f", human report {run.report_lines} lines"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    sys.exit(main())
