#!/usr/bin/env python3
"""Benchmark: `cluster model pull` through the pipelined relay vs one source serving every node
(today's `fix --checks model` before the relay), against the physical limit, in one run.

A private simulated cluster of --nodes nodes, every link shaped both ways to --rate with a real
token bucket (`simcluster link NODE rate`), --mib MiB of random files on node1. Three figures:

    limit       size / rate: one copy over one link (what a perfect pipeline approaches)
    relay       `cluster model pull node1:SRC` (a chain node to node)
    one-source  the same pull with the relay's shape forced to a star (every node from node1:
                node1's link carries N-1 copies)

Prints each time with its ratio to the limit, and the relay's speed-up over one source. The
issue's acceptance: relay <= 1.3 x limit + a fixed start-up (manifests, starts, verification).

    sudo scripts/bench_model_pull.py [--nodes 8] [--mib 512] [--rate 16mbps]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simbench import ROOT, instance_dir, simulated_cluster  # noqa: E402

SRC = "/tmp/bench-model/src"


def simcluster(env: dict, *args: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "simcluster"), *args], env=env,
                          check=True, capture_output=True, text=True, timeout=900).stdout


def rate_bytes(text: str) -> float:
    units = {"mbps": 1e6, "kbps": 1e3, "gbps": 1e9, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[:-len(unit)]) * factor
    raise SystemExit(f"--rate {text!r}: use e.g. 16mbps (bytes/s) or 100mbit")


def pull(inv: Path, path: str) -> tuple[float, dict]:
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "cluster", "-i", str(inv), "model", "pull",
                        f"node1:{SRC}", "--path", path, "--json"], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=7200, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - start
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        raise SystemExit(f"model pull failed (exit {p.returncode}): {p.stderr[-2000:]}")
    bad = {n: r for n, r in doc["nodes"].items() if not r["verified"]}
    if p.returncode != 0 or bad:
        raise SystemExit(f"model pull exit {p.returncode}, not verified: {bad}")
    return wall, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rate", default="16mbps", help="tc units: 16mbps = 16 MB/s each way")
    ap.add_argument("--prefix", default="bmp")
    ap.add_argument("--subnet", type=int, default=41)
    args = ap.parse_args()
    if not 2 <= args.nodes <= 64 or not 1 <= args.mib <= 65536:
        raise SystemExit("--nodes 2..64, --mib 1..65536")
    rate = rate_bytes(args.rate)
    env = {**os.environ, "SIMCLUSTER_PREFIX": args.prefix, "SIMCLUSTER_SUBNET": str(args.subnet),
           "SIMCLUSTER_DIR": instance_dir(args.prefix)}
    with simulated_cluster(args.nodes, args.prefix, args.subnet) as inventory:
        names = [n.name for n in inventory.nodes]
        for name in names:
            simcluster(env, "link", name, "rate", args.rate)
        half = args.mib // 2
        simcluster(env, "exec", "node1", "--", "sh", "-c",
                   f"rm -rf /tmp/bench-model && mkdir -p {SRC} && "
                   f"echo '{{}}' > {SRC}/config.json && "
                   f"head -c {half << 20} /dev/urandom > {SRC}/model-00001.safetensors && "
                   f"head -c {(args.mib - half) << 20} /dev/urandom > {SRC}/model-00002.safetensors")
        base = Path(tempfile.mkdtemp(prefix="bench-model-pull-"))
        doc = yaml.safe_load(Path(inventory.path).read_text())
        doc["run_dir"] = str(base / "runs")
        relay_inv = base / "relay.yaml"
        relay_inv.write_text(yaml.safe_dump(doc, sort_keys=False))
        doc["expectations"] = {"model_relay": {"chain_max_nodes": 1, "tree_fanout": 64}}
        star_inv = base / "star.yaml"
        star_inv.write_text(yaml.safe_dump(doc, sort_keys=False))
        size = (args.mib << 20) + 3
        limit = size / rate
        relay_s, relay_doc = pull(relay_inv, "/tmp/bench-model/relay")
        star_s, star_doc = pull(star_inv, "/tmp/bench-model/star")
        for name in names:
            simcluster(env, "link", name, "rate", "off")
    receivers = args.nodes - 1
    relay_copy = max(r["seconds"] for r in relay_doc["nodes"].values())
    star_copy = max(r["seconds"] for r in star_doc["nodes"].values())
    print(f"model pull of {args.mib} MiB from node1 to {receivers} nodes, every link "
          f"{rate / 1e6:g} MB/s each way (tc tbf)")
    print(f"  limit (size / rate)      {limit:8.1f} s   1.00x")
    print(f"  relay ({relay_doc['shape']['kind']:<5})            {relay_s:8.1f} s   "
          f"{relay_s / limit:.2f}x of the limit; the copy itself (slowest node) "
          f"{relay_copy:.1f} s = {relay_copy / limit:.2f}x, start-up and verification "
          f"{relay_s - relay_copy:.1f} s")
    print(f"  one source (star)        {star_s:8.1f} s   {star_s / limit:.2f}x of the limit "
          f"(ideal {receivers:.2f}x); the copy itself {star_copy:.1f} s = "
          f"{star_copy / limit:.2f}x")
    print(f"  relay speed-up over one source: {star_s / relay_s:.2f}x wall, "
          f"{star_copy / relay_copy:.2f}x copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
