#!/usr/bin/env python3
"""Ready time of the same PP 2 deployment (vLLM's compile mode, one stage per node) cold and
with a compile cache staged by `cluster deploy --stage-caches`, in the same run.

    scripts/bench_cache_stage.py -i CLUSTER.yaml --model /var/tmp/cluster-tiny-models/dense \
        [--rounds 1] [--cache-root /tmp/cluster-bench-cache]

Ray must be up on the inventory's nodes with the model on every node and the API key variable
(CLUSTER_API_KEY) in the nodes' env. Each round uses a fresh cache root of its own
(CACHE_ROOT-<random>, given to the replicas as VLLM_CACHE_ROOT with --env, on a path each node
holds privately: a simulated node's /tmp): nothing else's cache is read or removed.

    cold     deploy --stage-caches on the empty root: every rank compiles; after RUNNING the
             union of the ranks' caches is staged to every node
    staged   undeploy; the root is removed on the node that ran rank 0 (a replaced node); the
             same deploy again: the cache is staged back onto it before the start, every rank
             loads it (deploy --json: staged_cache true)

Prints per round the two ready times (waited_s: the PUT to RUNNING, what the engines' start
costs), the staging seconds, and the ratio staged / cold; then the medians. The roots are
removed on every node at the end (`cluster exec`).
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simbench import cli_json  # noqa: E402  (scripts/simbench.py: the benchmarks' shared part)

REPO = Path(__file__).resolve().parents[1]
APP = "bench-cache-pp2"
SERVED = "tiny-cache-bench"


def cli(inventory: str, *args: str, timeout: float = 1500) -> tuple[int, dict]:
    return cli_json(inventory, *args, timeout=timeout)


def deploy(inventory: str, model: str, root: str) -> dict:
    code, out = cli(inventory, "deploy", "--model", model, "--pp", "2", "--nnodes", "2",
                    "--name", APP, "--served-model-name", SERVED, "--max-model-len", "512",
                    "--env", f"VLLM_CACHE_ROOT={root}", "--stage-caches", "--yes",
                    "--timeout", "900")
    if code != 0 or out.get("status") != "RUNNING":
        raise SystemExit(f"deploy: {out.get('status')}: {out.get('error')}")
    return out


def undeploy(inventory: str) -> None:
    code, out = cli(inventory, "undeploy", APP, "--yes", timeout=300)
    if code != 0:
        raise SystemExit(f"undeploy: {out.get('status')}: {out.get('error')}")


def remove_root(inventory: str, root: str, node: str | None = None) -> None:
    where = ["--nodes", node] if node else []
    p = subprocess.run([sys.executable, "-m", "cluster", "-i", inventory, "exec", *where, "--",
                        "rm", "-rf", "--", root], capture_output=True, text=True,
                       cwd=str(REPO), timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"exec rm -rf {root}: exit {p.returncode}: {p.stderr.strip()[-300:]}")


def one_round(inventory: str, model: str, root: str) -> dict:
    cold = deploy(inventory, model, root)
    (replica,) = cold["replicas"]
    if replica.get("staged_cache") is not False:
        raise SystemExit(f"cold start: staged_cache {replica.get('staged_cache')!r}")
    rank0 = next(r["node"] for r in replica["ranks"] if r["rank"] == 0)
    undeploy(inventory)
    remove_root(inventory, root, rank0)
    warm = deploy(inventory, model, root)
    (replica,) = warm["replicas"]
    undeploy(inventory)
    if replica.get("staged_cache") is not True:
        raise SystemExit(f"staged start: staged_cache {replica.get('staged_cache')!r}: "
                         f"{replica.get('cache_detail')}")
    cache = warm["compile_cache"]
    return {"cold_s": cold["waited_s"], "staged_s": warm["waited_s"],
            "stage_before_s": cache["before_start"]["seconds"],
            "stage_after_cold_s": cold["compile_cache"]["after_start"]["seconds"],
            "bytes": cache["before_start"]["nodes"][rank0]["bytes"], "replaced": rank0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-i", "--inventory", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=1, choices=range(1, 11), metavar="1..10")
    ap.add_argument("--cache-root", default="/tmp/cluster-bench-cache",
                    help="prefix of each round's fresh VLLM_CACHE_ROOT (absolute, node-private)")
    args = ap.parse_args(argv)
    if not args.cache_root.startswith("/") or ".." in args.cache_root.split("/"):
        raise SystemExit("--cache-root must be an absolute path without '..'")
    rows = []
    roots = []
    try:
        for r in range(args.rounds):
            root = f"{args.cache_root.rstrip('/')}-{secrets.token_hex(4)}"
            roots.append(root)
            row = one_round(args.inventory, args.model, root)
            rows.append(row)
            print(f"round {r + 1}: ready cold {row['cold_s']:.1f} s, with a staged cache "
                  f"{row['staged_s']:.1f} s (ratio {row['staged_s'] / row['cold_s']:.2f}); "
                  f"staged {row['bytes'] / (1 << 20):.1f} MiB onto {row['replaced']} in "
                  f"{row['stage_before_s']:.1f} s before the start (the stage after the cold "
                  f"start: {row['stage_after_cold_s']:.1f} s)", flush=True)
    finally:
        for root in roots:
            remove_root(args.inventory, root)
    cold = statistics.median(r["cold_s"] for r in rows)
    staged = statistics.median(r["staged_s"] for r in rows)
    ratios = statistics.median(r["staged_s"] / r["cold_s"] for r in rows)
    print(f"median over {len(rows)} round(s): cold {cold:.1f} s, staged cache {staged:.1f} s, "
          f"ratio staged/cold {ratios:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
