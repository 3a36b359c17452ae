#!/usr/bin/env python3
"""Benchmark: parse time per MB of the nvidia-smi -q / table / topo parsers, 1 KB to 50 MB lines.

Issue 17: a 1 MB line of `x   ...   x` ran for minutes in the -q key-value pattern. For each
hostile shape (a long `x   ...   x` line, a long `key   :   value` line, long table cells,
a long topo row) and each size, times detect() + parse() of the three parsers and prints the
seconds per MB and its ratio to the 100 KB size (1 KB is dominated by call overhead): flat
(about 1 or below) means linear time. A real
report repeated to the same sizes is timed as well.

Usage: python scripts/bench_parsers_nvidia.py [--max-mb 50] [--rounds 3]
Prints ratios; makes no timed assertions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.base.errors import ParseError  # noqa: E402
from cluster.inspection.parsers import nvidia_smi, nvidia_smi_q, nvidia_smi_topo  # noqa: E402

MB = 1_000_000
FIXTURE = ROOT / "tests" / "fixtures" / "nvidia-smi-q" / "001-a100-sxm4-ecc-remapped-rows-pending.txt"


def shapes(size: int) -> dict[str, str]:
    half = max(size // 2 - 2, 1)
    return {
        "x_spaces_x": "x" + " " * half + "x" + " " * half + "x",
        "key_colon_value": "    Key" + " " * half + ":" + " " * half + "v",
        "table_cell": "| 0 " + " " * half + "x |00000000:01:00.0 Off|  0 |\n",
        "topo_row": "GPU0 GPU1\nGPU0 X " + "NV1 " * (size // 4),
        "report_repeated": (FIXTURE.read_text() * (size // 2000 + 1))[:size],
    }


def timed(module, text: str, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        module.detect(text)
        try:
            module.parse(text)
        except ParseError:
            pass
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sizes = [s for s in (1_000, 100_000, 1 * MB, 10 * MB, 50 * MB) if s <= args.max_mb * MB]
    modules = {"nvidia-smi-q": nvidia_smi_q, "nvidia-smi": nvidia_smi,
               "nvidia-smi-topo": nvidia_smi_topo}
    print(f"{'shape':16s} {'parser':16s} " + " ".join(f"{s / MB:>10.3f}MB" for s in sizes)
          + "   (s/MB (ratio to 100 KB; 1 KB is call overhead))")
    for shape in shapes(1):
        for kind, module in modules.items():
            per_mb = []
            for size in sizes:
                text = shapes(size)[shape]
                per_mb.append(timed(module, text, args.rounds) / (len(text) / MB))
            base = (per_mb[1] if len(per_mb) > 1 else per_mb[0]) or 1e-12   # 1 KB: overhead
            cells = " ".join(f"{v:.3f} ({v / base:.1f})".rjust(12) for v in per_mb)
            print(f"{shape:16s} {kind:16s} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
