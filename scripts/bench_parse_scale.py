#!/usr/bin/env python3
"""Benchmark: parse time per MB of every parser kind, from 1 KB to 50 MB, normal and long lines.

For each kind, three shapes of input are built from its real fixtures (tests/fixtures/<kind>/):
  1KB-lines   the fixture's lines, each padded to about 1 KB with `x   x   ...` (the baseline shape)
  fixture     the fixture text repeated (lines as the tool prints them)
  one-line    ONE line of the whole size: the fixture's first line then `x   x   ...   x`
              (the reproductions of issue 17: for nvidia-smi-q `x   ...   x` alone, for
              nccl 'a' * N + ' NCCL INFO x')
at sizes from 1 KB to --max-mb (default 50 MB for nccl and nvidia-smi-q, the kinds the issue
names; --others-max-mb, default 8, for the rest). Each measurement is parse(kind, text) through
the registry, as `cluster parse --kind KIND` calls it (nccl: parse_lines over the text, as the
CLI streams a pipe), timed in a forked child of this process (so a parser that hangs is cut
at --timeout seconds and reported as such, not waited for); sizes up to 4 MB are run --repeat
times (default 3) and the fastest run is kept, to damp the noise of a shared machine.

Children are forked after every parser has run once here (modules imported, patterns compiled).
Printed: a table of ms/MB and the ratio to the baseline, the kind's 1KB-lines ms/MB at 1 MB,
measured in this same run. Flat per-MB time means ratios that stay near 1 (or fall, as fixed
costs spread) from 1 KB to 50 MB; a super-linear parser shows ratios growing with the size.
Makes no timed assertions.

Usage: python scripts/bench_parse_scale.py [--kinds nccl,lsmod] [--max-mb 50]
       [--others-max-mb 8] [--timeout 60]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.inspection import parsers  # noqa: E402
from cluster.base.errors import ParseError  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
KB, MB = 1024, 1024 * 1024
FILLER = "x   "
SIZES = (1 * KB, 16 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 50 * MB)
BASELINE_SIZE = 1 * MB
FULL_KINDS = ("nccl", "nvidia-smi-q")


def fixture_text(kind: str) -> str:
    paths = sorted(p for p in (FIXTURES / kind).iterdir() if p.suffix in (".txt", ".log"))
    return max((p.read_text(encoding="utf-8", errors="replace") for p in paths[:4]), key=len)


def build(kind: str, shape: str, size: int) -> str:
    text = fixture_text(kind)
    lines = [ln for ln in text.splitlines() if ln.strip()] or ["x"]
    if shape == "one-line":
        if kind == "nccl":
            return "a" * max(0, size - 12) + " NCCL INFO x"
        head = "" if kind == "nvidia-smi-q" else lines[0] + " "
        return head + FILLER * max(0, (size - len(head) - 1) // len(FILLER)) + "x"
    if shape == "1KB-lines":
        padded = [(ln + " " + FILLER * 256)[:KB - 1] for ln in lines]
        block = "\n".join(padded) + "\n"
    else:
        block = text if text.endswith("\n") else text + "\n"
    return (block * (size // len(block) + 1))[:size]


def _measure(kind: str, shape: str, size: int, conn) -> None:
    text = build(kind, shape, size)
    start = time.perf_counter()
    outcome = "ok"
    try:
        if kind == "nccl":
            parsers.load(kind).parse_lines(text.splitlines(keepends=True))
        else:
            parsers.parse(kind, text)
    except ParseError:
        outcome = "ParseError"
    except Exception as exc:  # report, don't hide
        outcome = f"{type(exc).__name__}"
    conn.send((time.perf_counter() - start, len(text.encode()), outcome))
    conn.close()


def measure(kind: str, shape: str, size: int, timeout: float,
            repeat: int = 1) -> tuple[float | None, int, str]:
    """(the fastest of `repeat` runs' seconds or None on timeout, bytes, outcome), each parse
    in a forked child (the minimum is the least disturbed by other work on the machine)."""
    best: tuple[float | None, int, str] | None = None
    for _ in range(max(1, repeat)):
        got = _measure_once(kind, shape, size, timeout)
        if got[0] is None:
            return got
        if best is None or got[0] < best[0]:
            best = got
    return best


def _measure_once(kind: str, shape: str, size: int, timeout: float) -> tuple[float | None, int, str]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_measure, args=(kind, shape, size, child))
    proc.start()
    child.close()
    if parent.poll(timeout):
        seconds, nbytes, outcome = parent.recv()
        proc.join()
        return seconds, nbytes, outcome
    proc.kill()
    proc.join()
    return None, size, f"timeout > {timeout:g} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(k for k in parsers.KINDS),
                    help="comma-separated kinds (default: every kind)")
    ap.add_argument("--max-mb", type=float, default=50.0, help="largest size for nccl, nvidia-smi-q")
    ap.add_argument("--others-max-mb", type=float, default=8.0, help="largest size for other kinds")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per measurement")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per size up to 4 MB, the fastest kept (one run above)")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    for kind in kinds:   # warm up in this process: imports, compiled patterns (children inherit)
        try:
            parsers.parse(kind, fixture_text(kind))
        except ParseError:
            pass
    print(f"{'kind':<27} {'shape':<10} {'size':>8} {'ms':>10} {'ms/MB':>9} {'ratio':>7}  outcome")
    for kind in kinds:
        limit = (args.max_mb if kind in FULL_KINDS else args.others_max_mb) * MB
        base_s, base_b, _ = measure(kind, "1KB-lines", BASELINE_SIZE, args.timeout, args.repeat)
        baseline = base_s * 1000 / (base_b / MB) if base_s else None
        for shape in ("1KB-lines", "fixture", "one-line"):
            slow = False
            for size in SIZES:
                if size > limit:
                    break
                if slow:
                    print(f"{kind:<27} {shape:<10} {_size(size):>8} {'-':>10} {'-':>9} {'-':>7}  "
                          "skipped (the smaller size ran out of time)")
                    continue
                seconds, nbytes, outcome = measure(kind, shape, size, args.timeout,
                                                   args.repeat if size <= 4 * MB else 1)
                if seconds is None:
                    slow = True
                    print(f"{kind:<27} {shape:<10} {_size(size):>8} {'-':>10} {'-':>9} {'-':>7}  "
                          f"{outcome}")
                    continue
                per_mb = seconds * 1000 / (nbytes / MB)
                ratio = f"{per_mb / baseline:.2f}" if baseline else "-"
                print(f"{kind:<27} {shape:<10} {_size(nbytes):>8} {seconds * 1000:>10.1f} "
                      f"{per_mb:>9.1f} {ratio:>7}  {outcome}", flush=True)
    print(f"\nratio = ms/MB / (the kind's 1KB-lines ms/MB at {_size(BASELINE_SIZE)}, this run)")
    return 0


def _size(n: int) -> str:
    return f"{n / MB:.0f}MB" if n >= MB else f"{n / KB:.0f}KB"


if __name__ == "__main__":
    sys.exit(main())
