#!/usr/bin/env python3
"""Benchmark: the inventory loader's time per MB is flat from 1 KB to its 1 MiB cap (linear time),
and hostile files (nested aliases, deep nesting, a flat list of tiny values) end quickly.

    PYTHONPATH=. python scripts/bench_yaml_loader.py

Prints seconds per MB for growing realistic inventories and the ratio to the smallest size
(about 1 when linear), then the time each hostile input takes to be refused.
"""

from __future__ import annotations

import time

from cluster.nodes import inventory
from cluster.base.errors import InventoryError


def realistic(nodes: int) -> str:
    return "nodes:\n" + "".join(
        f"  - {{name: n{i}, address: 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}, port: 22, "
        f"ib_hcas: [mlx5_0, mlx5_1], env: {{NCCL_DEBUG: INFO}}}}\n" for i in range(nodes))


def hostile() -> dict[str, str]:
    laughs = ["nodes:", "  - name: a", "    ib_hcas: &l0 [x, x, x, x, x, x, x, x, x]"]
    laughs += [f"    env{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return {"billion laughs (665 bytes)": "\n".join(laughs) + "\n",
            "flow nesting 100k": "nodes: " + "[" * 100_000 + "]" * 100_000 + "\n",
            "block nesting 5k": "nodes:\n  " + "- " * 5000 + "x\n",
            "flat list ~1 MiB": "nodes: [" + "x," * 500_000 + "]\n"}


def timed(text: str) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        inventory.loads(text, path="bench.yaml")
        outcome = "loaded"
    except InventoryError as exc:
        outcome = exc.reason[:60]
    return time.perf_counter() - start, outcome


def main() -> None:
    base = None
    print(f"{'size':>10} {'s/MB':>8} {'ratio':>6}")
    for nodes in (10, 100, 1000, 8000):
        text = realistic(nodes)
        seconds = min(timed(text)[0] for _ in range(3 if nodes < 8000 else 1))
        per_mb = seconds / (len(text) / 1e6)
        base = base or per_mb
        print(f"{len(text):>10} {per_mb:>8.2f} {per_mb / base:>6.2f}")
    for name, text in hostile().items():
        seconds, outcome = timed(text)
        print(f"{name:>28}: {seconds:6.2f} s  {outcome}")


if __name__ == "__main__":
    main()
