#!/usr/bin/env python3
"""`cluster bench` against a PP 2 engine across two nodes (vLLM native multi-node, one stage
per node) and a TP 1 engine on one node, in the same run, rounds interleaved.

    scripts/bench_gang.py -i CLUSTER.yaml --model /var/tmp/cluster-tiny-models/dense \
        [--rounds 3] [--concurrency 1,4] [--requests 24] [--keep]

Ray must be up on the inventory's nodes (`cluster up`) with the model on every node and the
API key variable (CLUSTER_API_KEY) in the nodes' env and in this process's env. Deploys
`bench-pp2` (`--pp 2 --nnodes 2`, vLLM's compile mode: PP needs it on the CPU build) and
`bench-tp1` (`--tp 1`), runs `cluster bench --json` on each per round and concurrency, prints
per-app medians and the median of the paired ratios pp2 / tp1 (the baseline is the one-node
engine measured in the same rounds), then undeploys both (unless --keep). Traffic goes only to
the inventory's head (the Serve endpoint `cluster deploy` reports).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simbench import cli_json  # noqa: E402  (scripts/simbench.py: the benchmarks' shared part)

REPO = Path(__file__).resolve().parents[1]
APPS = {"bench-pp2": ["--pp", "2", "--nnodes", "2"], "bench-tp1": ["--tp", "1"]}
SERVED = "tiny-bench"


def cli(inventory: str, *args: str, timeout: float = 1200) -> tuple[int, dict]:
    return cli_json(inventory, *args, timeout=timeout)


def deploy(inventory: str, name: str, model: str) -> dict:
    code, out = cli(inventory, "deploy", "--model", model, *APPS[name], "--name", name,
                    "--served-model-name", SERVED, "--max-model-len", "512", "--yes",
                    "--timeout", "900")
    if code != 0:
        raise SystemExit(f"deploy {name}: {out.get('status')}: {out.get('error')}")
    ranks = [(r["rank"], r["node"]) for r in out["replicas"][0]["ranks"]]
    print(f"{name}: RUNNING after {out.get('waited_s')} s, ranks {ranks}", flush=True)
    return out


def bench(inventory: str, endpoint: str, concurrency: int, requests: int) -> dict:
    code, out = cli(inventory, "bench", "--url", endpoint, "--model", SERVED, "--concurrency",
                    str(concurrency), "--requests", str(requests), "--prompt-len", "64",
                    "--output-len", "64", "--api-key-env", "CLUSTER_API_KEY")
    (level,) = out["levels"]
    if level["ok"] != requests:
        raise SystemExit(f"bench {endpoint} c={concurrency}: {level['ok']}/{requests} ok, "
                         f"errors {level['errors']}")
    return level


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-i", "--inventory", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3, choices=range(1, 21), metavar="1..20")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=24, choices=range(1, 1001), metavar="1..1000")
    ap.add_argument("--keep", action="store_true", help="leave both apps deployed")
    args = ap.parse_args(argv)
    if not os.environ.get("CLUSTER_API_KEY"):
        raise SystemExit("set CLUSTER_API_KEY (the key the nodes' env holds)")
    levels = [int(c) for c in args.concurrency.split(",")]
    if not all(1 <= c <= 256 for c in levels):
        raise SystemExit("--concurrency: integers 1..256")
    endpoints = {name: deploy(args.inventory, name, args.model)["endpoint"] for name in APPS}
    try:
        seen: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for c in levels:
                for name in (list(APPS) if r % 2 == 0 else list(APPS)[::-1]):
                    level = bench(args.inventory, endpoints[name], c, args.requests)
                    seen.setdefault((name, c), []).append(level)
                    print(f"round {r + 1} c={c} {name}: {level['output_tokens_per_s']:.0f} "
                          f"tok/s, TTFT p50 {level['ttft_ms']['p50']} ms, e2e p50 "
                          f"{level['e2e_ms']['p50']} ms", flush=True)
        print("\n| app | c | output tok/s (median) | TTFT p50 ms | e2e p50 ms | pp2/tp1 tok/s "
              "(median of paired ratios) |")
        print("|---|---|---|---|---|---|")
        for c in levels:
            ratios = [p["output_tokens_per_s"] / t["output_tokens_per_s"]
                      for p, t in zip(seen[("bench-pp2", c)], seen[("bench-tp1", c)])]
            for name in APPS:
                got = seen[(name, c)]
                med = statistics.median(x["output_tokens_per_s"] for x in got)
                ttft = statistics.median(x["ttft_ms"]["p50"] for x in got)
                e2e = statistics.median(x["e2e_ms"]["p50"] for x in got)
                ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" \
                    if name == "bench-pp2" else "baseline"
                print(f"| {name} | {c} | {med:.0f} | {ttft:.0f} | {e2e:.0f} | {ratio} |")
    finally:
        if not args.keep:
            for name in APPS:
                cli(args.inventory, "undeploy", name, "--yes", timeout=300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
