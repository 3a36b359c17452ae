#!/usr/bin/env python3
"""A change of a running app's engine args under a steady streaming load: `cluster deploy`'s
rolling change against the same change applied as deploys did before the roll (the baseline:
the Serve config PUT with Serve's default rollout, an old replica stopped before its replacement
starts), in the same run, rounds interleaved.

    scripts/bench_roll.py -i CLUSTER.yaml --model /var/tmp/cluster-tiny-models/dense \
        [--rounds 1] [--concurrency 2] [--env NAME=VALUE ...] [--keep]

Ray must be up on the inventory's nodes (`cluster up`) with the model on every node and the API
key variable (CLUSTER_API_KEY) in the nodes' env and in this process's env. Deploys `bench-roll`
(TP 1, 2 replicas, enforce_eager, max_model_len 512), then per round a rolling change and a plain
redeploy, each to a new max_model_len, each under the bench client's streaming load
(cluster/serving/bench.py, `--concurrency` at a time, 10 s of it before and after the change).
Prints per change the requests, the failed ones by kind and the seconds, then the ratios roll /
plain; undeploys (unless --keep). On simulated nodes that share the machine's cores, pass
`--env VLLM_CPU_OMP_THREADS_BIND=nobind --env OMP_NUM_THREADS=1` (tests/integration/
integration_kit.py UNBOUND_ENGINE_ENV says why). Traffic goes only to the inventory's head.
The rolling change's own contract (0 failed requests, the new args in effect after) is asserted
by tests/integration/test_day_two.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simbench import StreamingLoad, cli_json, served_max_model_len  # noqa: E402  (scripts/simbench.py: the benchmarks' shared part)

APP, SERVED, KEY_ENV = "bench-roll", "tiny-roll", "CLUSTER_API_KEY"
CHANGE_TIMEOUT_S = 1200     # one change: two engine starts, one after the other
LENGTHS = (448, 384, 320, 256)   # max_model_len of each change in turn (the deploy uses 512)


@dataclass(frozen=True)
class ChangeFigures:
    """What one change did under the load."""

    how: str                 # "roll" or "plain"
    requests: int
    failed: int
    failed_kinds: dict
    took_s: float


def deploy(inventory: str, model: str, max_len: int, env: list[str]) -> dict:
    args = ["deploy", "--model", model, "--dp", "2", "--name", APP, "--served-model-name", SERVED,
            "--max-model-len", str(max_len), "--engine-arg", "enforce_eager=true", "--yes",
            "--timeout", str(CHANGE_TIMEOUT_S)]
    for pair in env:
        args += ["--env", pair]
    code, out = cli_json(inventory, *args, timeout=CHANGE_TIMEOUT_S + 300)
    if code != 0:
        raise SystemExit(f"deploy {APP} (max_model_len {max_len}): {out.get('status')}: "
                         f"{out.get('error') or out.get('stopped')}")
    return out


def plain_redeploy(inventory_path: str, max_len: int) -> None:
    """The change as deploys applied it before the roll: the config PUT with Serve's default
    rollout (no surge), then the wait for RUNNING."""
    from cluster.nodes import inventory as inventory_mod
    from cluster.nodes.remote import Session
    from cluster.ray.dashboard_api import DashboardClient
    from cluster.serving import deploy as deploy_mod
    from playbooks.serve_wait import wait_for_app

    inventory = inventory_mod.load(inventory_path)
    with Session(inventory) as session:
        client = DashboardClient(session, inventory)
        # env values as deployed (serve_details() masks them: a PUT of that would deploy masks)
        reply = client.request("GET", "/api/serve/applications/", redact=False)
        config = dict(reply.json["applications"][APP]["deployed_app_config"])
        config.pop("deployments", None)
        config["args"] = dict(config["args"], engine_kwargs=dict(config["args"]["engine_kwargs"],
                                                                 max_model_len=max_len))
        before = deploy_mod.app_state(client.serve_details(), APP).last_deployed_time_s
        if not deploy_mod.deploy_app(client, config, inventory).ok:
            raise SystemExit("plain redeploy: the dashboard refused the config")
        if not wait_for_app(client, APP, CHANGE_TIMEOUT_S, previous_time=before).running:
            raise SystemExit(f"plain redeploy: {APP} not RUNNING within {CHANGE_TIMEOUT_S} s")


def under_load(how: str, endpoint: str, api_key: str, concurrency: int, change) -> ChangeFigures:
    with StreamingLoad(endpoint, SERVED, api_key, concurrency) as load:
        time.sleep(10)
        start = time.monotonic()
        change()
        took = time.monotonic() - start
        time.sleep(10)
    figures = ChangeFigures(how, len(load.outcomes), len(load.failed()), load.failed_kinds(),
                            round(took, 1))
    print(f"{how}: {figures.requests} requests, {figures.failed} failed {figures.failed_kinds}, "
          f"{figures.took_s:.0f} s", flush=True)
    return figures


def ratio(a: float, b: float) -> str:
    return f"x{a / b:.2f}" if b else "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-i", "--inventory", required=True)
    ap.add_argument("--model", required=True, help="the model directory on every node")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of (roll, plain), 1-2 (default 1)")
    ap.add_argument("--concurrency", type=int, default=2, help="streams of the load, 1-32 (default 2)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="engine env for `cluster deploy --env` (repeatable)")
    ap.add_argument("--keep", action="store_true", help="leave the app deployed")
    args = ap.parse_args(argv)
    if not 1 <= args.rounds <= len(LENGTHS) // 2 or not 1 <= args.concurrency <= 32:
        ap.error("--rounds takes 1-2, --concurrency 1-32")
    api_key = os.environ.get(KEY_ENV)
    if not api_key:
        raise SystemExit(f"set {KEY_ENV} in this process's env (the nodes' key)")

    out = deploy(args.inventory, args.model, 512, args.env)
    endpoint = out["endpoint"]
    print(f"{APP}: RUNNING after {out.get('waited_s')} s at {endpoint}", flush=True)
    figures: list[ChangeFigures] = []
    lengths = iter(LENGTHS)
    try:
        for _ in range(args.rounds):
            new = next(lengths)
            figures.append(under_load("roll", endpoint, api_key, args.concurrency,
                                      lambda: deploy(args.inventory, args.model, new, args.env)))
            if served_max_model_len(endpoint, SERVED, api_key) != new:
                raise SystemExit(f"roll: max_model_len is not {new} after the change")
            new = next(lengths)
            figures.append(under_load("plain", endpoint, api_key, args.concurrency,
                                      lambda: plain_redeploy(args.inventory, new)))
            if served_max_model_len(endpoint, SERVED, api_key) != new:
                raise SystemExit(f"plain redeploy: max_model_len is not {new} after the change")
    finally:
        if not args.keep:
            cli_json(args.inventory, "undeploy", APP, "--yes", timeout=600)
    total = {how: [sum(getattr(f, k) for f in figures if f.how == how)
                   for k in ("requests", "failed", "took_s")] for how in ("roll", "plain")}
    (rr, rf, rs), (pr, pf, ps) = total["roll"], total["plain"]
    # requests a second over each load's whole span (the change and its 20 s around it)
    rate = ratio(rr / (rs + 20 * args.rounds), pr / (ps + 20 * args.rounds))
    print(f"roll / plain: failed {rf} / {pf} of {rr} / {pr} requests; requests a second {rate}; "
          f"change time {ratio(rs, ps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
