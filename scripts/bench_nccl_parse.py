#!/usr/bin/env python3
"""Benchmark: NCCL log parse throughput against `grep -c 'NCCL INFO'`, and memory while parsing.

Builds a log of >= 200 MB under a temporary directory by repeating the real fixture logs
(tests/fixtures/nccl/*.log), then times `grep -c 'NCCL INFO' FILE`,
`cluster.inspection.parsers.nccl.parse_file(FILE)` and `cluster parse --kind nccl --json FILE` end to end
(a fresh interpreter) alternately for several rounds and prints the median throughputs (MB/s,
by wall time and by CPU time) and their ratios (goal: parse >= 1/3 of grep's speed).

Memory: parse_file runs in a fresh child process on a small and on the big file; the growth of
the child's peak RSS (resource.getrusage) while parsing is printed for both: flat means the same
for 4x the data.

A repeated log is kind to the parser (it counts identical lines in C and handles each distinct
line once), so `--unique` also times a variant where every repetition carries its own srun-style
`N: ` prefix: no line repeats across repetitions, which is the parser's worst case.

`--long-lines` (issue 17) times the hostile inputs that were quadratic before: one character
repeated before ' NCCL INFO x', a WARN padded with spaces, 'Channel' followed by a run of digits,
and glued envelopes, each as files of lines of 1 KB to 50 MB (>= --long-mb MB per file), through
parse_file and parse; it prints seconds per MB and the ratio to the 1 KB lines (flat = linear).

Usage: python scripts/bench_nccl_parse.py [--size-mb 200] [--rounds 5] [--unique] [--keep DIR]
       python scripts/bench_nccl_parse.py --long-lines [--long-mb 20]
Prints ratios; makes no timed assertions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.inspection.checks.nccl import judge  # noqa: E402
from cluster.inspection.parsers import nccl  # noqa: E402
from simbench import byte_compile  # noqa: E402  (scripts/simbench.py: the benchmarks' shared part)

FIXTURES = ROOT / "tests" / "fixtures" / "nccl"
MB = 1_000_000


def build_log(path: Path, size_mb: float, *, unique: bool = False) -> tuple[int, int]:
    """Repeat the fixture logs until the file holds >= size_mb MB; (bytes, repetitions)."""
    pieces = []
    for p in sorted(FIXTURES.glob("*.log")):
        data = p.read_bytes()
        pieces.append(data if data.endswith(b"\n") else data + b"\n")
    period = b"".join(pieces)
    lines = period.split(b"\n")[:-1]
    reps = 0
    with open(path, "wb") as f:
        while f.tell() < size_mb * MB:
            if unique:
                tag = b"%d: " % reps
                f.write(b"\n".join(tag + line for line in lines) + b"\n")
            else:
                f.write(period)
            reps += 1
    return path.stat().st_size, reps


def _timed_child(argv: list[str]) -> tuple[float, float, bytes]:
    """(wall s, CPU s from wait4: user + system, stdout) of one child process."""
    import os

    with tempfile.TemporaryFile() as out:
        t = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - t
        out.seek(0)
        data = out.read()
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        raise SystemExit(f"{argv[0]} failed: exit {os.waitstatus_to_exitcode(status)}")
    return elapsed, usage.ru_utime + usage.ru_stime, data


def time_grep(path: Path) -> tuple[float, float]:
    """Wall and CPU time of `grep -c 'NCCL INFO' FILE` (output to a file: grep stops early on
    /dev/null)."""
    wall, cpu, _ = _timed_child(["grep", "-c", "NCCL INFO", str(path)])
    return wall, cpu


def time_parse(path: Path) -> tuple[float, float, nccl.NcclLog]:
    """Wall and CPU time of parse_file in this process."""
    t, c = time.perf_counter(), time.process_time()
    result = nccl.parse_file(path)
    return time.perf_counter() - t, time.process_time() - c, result


def time_cli(path: Path) -> tuple[float, float]:
    """Wall and CPU time of `cluster parse --kind nccl --json FILE` end to end (a fresh
    interpreter: start-up, imports, streaming, JSON)."""
    wall, cpu, out = _timed_child([sys.executable, "-m", "cluster", "parse", "--kind", "nccl",
                                   "--json", str(path)])
    json.loads(out)
    return wall, cpu


_CHILD = """
import gc, json, os, resource, sys, time
sys.path.insert(0, {root!r})
from cluster.inspection.parsers import nccl
gc.collect()
def rss_kib():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
before = rss_kib()
t = time.perf_counter()
r = nccl.parse_file({path!r})
elapsed = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"growth_kib": max(0, peak - before), "before_kib": before, "peak_kib": peak,
                  "lines": r.lines, "seconds": elapsed}}))
"""


def rss_growth(path: Path) -> dict:
    """Growth of a fresh interpreter's peak RSS (KiB, Linux) over its RSS before parse_file."""
    code = _CHILD.format(root=str(ROOT), path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def compare(path: Path, size: int, rounds: int, label: str) -> float:
    """Alternating rounds of grep, parse_file and the CLI; medians and ratios printed. Wall time
    and CPU time both: on a shared machine a process's wall time is mostly its wait for a core
    (grep's 0.12 s of CPU took 1.1 s at load 60), so the CPU ratio is the one to read there."""
    runs: dict[str, list[tuple[float, float]]] = {"grep": [], "parse_file": [], "cli": []}
    result = None
    for i in range(rounds):
        runs["grep"].append(time_grep(path))
        wall, cpu, result = time_parse(path)
        runs["parse_file"].append((wall, cpu))
        runs["cli"].append(time_cli(path))
        print(f"  round {i + 1}: " + "   ".join(
            f"{name} {r[-1][0]:.3f} s ({r[-1][1]:.3f} s CPU)" for name, r in runs.items()))
    med = {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r))
           for name, r in runs.items()}
    print(f"{label}:")
    for name, (wall, cpu) in med.items():
        shown = {"grep": "grep -c 'NCCL INFO'", "parse_file": "parse_file",
                 "cli": "cluster parse --kind nccl"}[name]
        print(f"  {shown:26}: median {wall:.3f} s wall = {size / MB / wall:8.1f} MB/s, "
              f"{cpu:.3f} s CPU = {size / MB / cpu:8.1f} MB/s")
    ratio = med["grep"][0] / med["cli"][0]
    for name in ("parse_file", "cli"):
        wall_ratio, cpu_ratio = med["grep"][0] / med[name][0], med["grep"][1] / med[name][1]
        print(f"  ratio {name + '/grep':16}: wall {wall_ratio:.3f}, CPU {cpu_ratio:.3f}  (goal >= 0.333: "
              f"{'met' if min(wall_ratio, cpu_ratio) >= 1 / 3 else 'NOT met'})")
    if result is not None:
        print(f"  parsed {result.lines} lines; verdict: {judge(result).verdict[:110]}...")
    return ratio


LONG_LINE_SIZES = (1_000, 10_000, 60_000, 100_000, 1_000_000, 10_000_000, 50_000_000)

# name -> line of (about) `size` characters: the reproductions of issue 17 item 1
LONG_LINE_CASES = {
    "a* + NCCL INFO (head)": lambda size: "a" * max(1, size - 12) + " NCCL INFO x",
    "WARN + spaces (tail junk)": lambda size: "h:1:1 [0] misc/socket.cc:1 NCCL WARN x" + " " * max(1, size - 40) + "y",
    "Channel + digits (channel)": lambda size: ("h:1:1 [0] NCCL INFO Channel 00/0 : " + "7" * max(1, size - 60)
                                                + "[0] -> 1[1] via NET/IB/0"),
    "WARN 1:1:1 (normalising)": lambda size: "h:1:1 [0] x.cc:1 NCCL WARN " + "1:" * max(1, (size - 27) // 2),
    "glued envelopes": lambda size: "h:1:1 [0] NCCL INFO x " * max(1, size // 22),
}


def long_lines(total_mb: float, workdir: Path) -> None:
    """Seconds per MB for each hostile line shape, from 1 KB to 50 MB lines."""
    print(f"long lines: seconds per MB (files of >= {total_mb:g} MB; ratio to 1 KB lines; "
          f"lines over {nccl.LINE_MAX} chars are read up to that length)")
    for name, make in LONG_LINE_CASES.items():
        base = None
        print(f"  {name}")
        for size in LONG_LINE_SIZES:
            line = make(size) + "\n"
            reps = max(1, int(total_mb * MB) // len(line))
            path = workdir / "long.log"
            # an srun-style "N: " prefix makes every line distinct: no line is handled only once
            text = "".join(f"{i}: {line}" for i in range(reps))
            path.write_text(text)
            nbytes = path.stat().st_size
            timings = []
            for fn, arg in ((nccl.parse_file, path), (nccl.parse, text)):
                t = time.perf_counter()
                try:
                    r = fn(arg)
                    out = f"{judge(r).status.value}, {r.lines_truncated} cut"
                except nccl.ParseError:
                    out = "ParseError"
                timings.append(time.perf_counter() - t)
            del text
            per_mb = [t / (nbytes / MB) for t in timings]
            base = base or per_mb
            print(f"    {size:>10,} B x {reps:>6}: parse_file {per_mb[0] * 1000:8.2f} ms/MB "
                  f"({per_mb[0] / base[0]:5.2f}x)   parse {per_mb[1] * 1000:8.2f} ms/MB "
                  f"({per_mb[1] / base[1]:5.2f}x)   -> {out}")
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=200.0, help="size of the built log (default 200)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (default 5)")
    ap.add_argument("--unique", action="store_true",
                    help="also time a log where no line repeats across repetitions")
    ap.add_argument("--keep", metavar="DIR", help="build the logs in DIR and keep them")
    ap.add_argument("--long-lines", action="store_true",
                    help="only time the hostile long-line inputs (seconds per MB, 1 KB to 50 MB lines)")
    ap.add_argument("--long-mb", type=float, default=20.0,
                    help="size of each long-line file in MB (default 20; a 50 MB line makes 50)")
    args = ap.parse_args(argv)
    if args.long_lines:
        workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-nccl-long-"))
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            long_lines(args.long_mb, workdir)
        finally:
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        return 0
    if shutil.which("grep") is None:
        print("grep not found", file=sys.stderr)
        return 2

    print(f"cluster/ byte-compiled: {byte_compile()} (an installed package has its .pyc files)")
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-nccl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        big = workdir / "nccl-repeated.log"
        size, reps = build_log(big, args.size_mb)
        small = workdir / "nccl-repeated-quarter.log"
        small_size, _ = build_log(small, args.size_mb / 4)
        n_logs = len(list(FIXTURES.glob("*.log")))
        print(f"log: {big}  {size / MB:.1f} MB ({n_logs} fixture logs repeated {reps}x)")
        compare(big, size, args.rounds, "repeated fixtures")

        print("memory (fresh interpreter, peak RSS growth while parse_file runs):")
        for path, sz in ((small, small_size), (big, size)):
            m = rss_growth(path)
            print(f"  {sz / MB:7.1f} MB file: +{m['growth_kib'] / 1024:6.1f} MiB "
                  f"(RSS {m['before_kib'] / 1024:.1f} MiB before, peak {m['peak_kib'] / 1024:.1f} MiB; "
                  f"{m['lines']} lines, {m['seconds']:.2f} s)")

        if args.unique:
            uniq = workdir / "nccl-unique.log"
            usize, _ = build_log(uniq, args.size_mb, unique=True)
            print(f"log: {uniq}  {usize / MB:.1f} MB (every repetition prefixed 'N: ', no line repeats)")
            compare(uniq, usize, max(1, min(args.rounds, 3)), "no repeated lines (worst case)")
            m = rss_growth(uniq)
            print(f"  memory: +{m['growth_kib'] / 1024:.1f} MiB peak RSS growth "
                  f"(RSS {m['before_kib'] / 1024:.1f} MiB before, peak {m['peak_kib'] / 1024:.1f} MiB)")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
