"""A rolling change under load (issue 42 item 4): real Ray 2.60 on two simulated CPU nodes, real
vLLM (CPU build) serving the tiny dense model, TP 1 with 2 replicas, a steady streaming load
from the bench client (cluster/serving/bench.py); `cluster deploy` with changed engine args
rolls with 0 failed requests and the new args are in effect after.

Then, for docs/serving.md "Rolling changes" (printed, not asserted), only with
CLUSTER_ROLL_COMPARE_PLAIN=1 (a measurement, ~4 min; CI leaves it out): the same kind of change
applied the way deploys did before the roll (the config PUT without the roll options: Serve's
default stops an old replica before its replacement starts), under the same load.

The body is one function, rolling_change_under_load(inventory, app name, model), so the day-two
module can call it on its own cluster (Ray up, every node's env carrying CLUSTER_API_KEY=KEY,
room for 3 single-CPU engines). Heavy: 2 nodes, 3 engines at the peak, ~11 min on a shared
2-core machine; run it with SIMCLUSTER_PREFIX/SUBNET/DIR of your own.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration_kit import (ClusterCli, NODE_MODELS, StreamingLoad, UNBOUND_ENGINE_ENV,
                             derive_inventory, node_tiny_model, ray_up)

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.vllm, pytest.mark.alone]

KEY = "sk-roll-5c1e7b29d4"
APP, SERVED = "roll", "tiny-roll"
PROFILES = {"node1": "cpu", "node2": "cpu"}


@pytest.fixture(scope="module")
def model(tiny_model_builder) -> Path:
    return node_tiny_model(tiny_model_builder, "dense", needs=("vllm", "openai"))


@pytest.fixture(scope="module")
def inv(simcluster_factory, model, tmp_path_factory) -> Path:
    sim = simcluster_factory(2, PROFILES)
    path = derive_inventory(sim, tmp_path_factory.mktemp("roll-inv"),
                            ray={"memory": 4 * 1024 ** 3},
                            every_node={"env": {"CLUSTER_API_KEY": KEY}})
    with ray_up(cli, path, timeout=600, down_first=True):
        yield path


ROLL_TIMEOUT_S = 1200        # the whole roll (two engine starts, one after the other)
cli = ClusterCli(timeout=ROLL_TIMEOUT_S + 300)


@dataclass(frozen=True)
class RollFigures:
    """What one rolling change and one plain redeploy did under the same load."""

    roll_requests: int
    roll_failed: int
    roll_s: float
    plain_requests: int | None = None         # None: the plain redeploy was not measured
    plain_failed: int | None = None
    plain_failed_kinds: dict | None = None
    plain_s: float | None = None


def _deploy(inv: Path, model: Path, app: str, max_len: int, *extra: str) -> tuple[int, dict]:
    args = ["deploy", "--model", str(model), "--dp", "2", "--name", app,
            "--served-model-name", SERVED, "--max-model-len", str(max_len),
            "--engine-arg", "enforce_eager=true", "--yes", "--timeout", str(ROLL_TIMEOUT_S)]
    for pair in UNBOUND_ENGINE_ENV:
        args += ["--env", pair]
    return cli.json(inv, *args, *extra)


def _max_model_len(endpoint: str) -> int:
    req = urllib.request.Request(endpoint + "/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as reply:
        return json.load(reply)["data"][0]["max_model_len"]


def _plain_redeploy(inv: Path, app: str, max_len: int) -> None:
    """The change as deploys applied it before the roll: the config PUT with Serve's default
    rollout (no surge), then wait for RUNNING."""
    from cluster.nodes import inventory as inventory_mod
    from cluster.nodes.remote import Session
    from cluster.ray.dashboard_api import DashboardClient
    from cluster.serving import deploy
    from playbooks.serve_wait import wait_for_app

    inventory = inventory_mod.load(str(inv))
    with Session(inventory) as session:
        client = DashboardClient(session, inventory)
        # env values as deployed (serve_details() masks them: a PUT of that would deploy masks)
        reply = client.request("GET", "/api/serve/applications/", redact=False)
        config = dict(reply.json["applications"][app]["deployed_app_config"])
        config.pop("deployments", None)
        config["args"] = dict(config["args"], engine_kwargs=dict(config["args"]["engine_kwargs"],
                                                                 max_model_len=max_len))
        before = deploy.app_state(client.serve_details(), app).last_deployed_time_s
        assert deploy.deploy_app(client, config, inventory).ok
        outcome = wait_for_app(client, app, ROLL_TIMEOUT_S, previous_time=before)
        if not outcome.running:
            tails = deploy.collect_log_tails(session, inventory, outcome.state)
            raise AssertionError(f"plain redeploy not RUNNING: {outcome.state}\n"
                                 + "\n".join(f"--- {n} ---\n{t}" for n, t in tails.items()))


def _under_load(endpoint: str, change) -> tuple[StreamingLoad, float]:
    """`change()` run under a steady streaming load (10 s of it before and after)."""
    with StreamingLoad(endpoint, SERVED, KEY, concurrency=2) as load:
        time.sleep(10)
        start = time.monotonic()
        change()
        took = time.monotonic() - start
        time.sleep(10)
    return load, took


def rolling_change_under_load(inv: Path, app: str, model: Path,
                              compare_plain: bool = False) -> RollFigures:
    """The whole check on a running cluster (`inv`: its inventory, Ray up): `app` deployed TP 1
    with 2 replicas, a dry run of a change shows two steps, the change rolls under load with 0
    failed requests and is in effect after; then (compare_plain) a plain redeploy under the
    same load, its failures counted (not asserted). The figures are printed and returned."""
    code, out = _deploy(inv, model, app, 512)
    assert code == 0, json.dumps(out, indent=1)[-3000:]
    endpoint = out["endpoint"]
    assert _max_model_len(endpoint) == 512

    code, dry = _deploy(inv, model, app, 448, "--dry-run")
    assert code == 0 and [(s["start"], len(s["stop"])) for s in dry["roll"]["steps"]] == [
        (1, 1), (1, 1)], json.dumps(dry.get("roll"), indent=1)

    result: dict = {}
    load, rolled_s = _under_load(endpoint, lambda: result.update(
        zip(("code", "out"), _deploy(inv, model, app, 448))))
    code, out = result["code"], result["out"]
    assert code == 0, json.dumps(out, indent=1)[-3000:]
    print(f"\nrolling change: {len(load.outcomes)} requests, {len(load.failed())} failed, "
          f"roll {rolled_s:.0f} s; steps {[s['what'] for s in out['roll']['steps']]}")
    assert load.outcomes and not load.failed(), [o.detail for o in load.failed()][:5]
    assert _max_model_len(endpoint) == 448
    assert not set(out["roll"]["old_replicas"]) & {r["replica_id"] for r in out["replicas"]}
    if not compare_plain:
        return RollFigures(len(load.outcomes), len(load.failed()), round(rolled_s, 1))

    plain, plain_s = _under_load(endpoint, lambda: _plain_redeploy(inv, app, 384))
    kinds: dict = {}
    for o in plain.failed():
        kinds[o.error_kind] = kinds.get(o.error_kind, 0) + 1
    print(f"plain redeploy (before the roll): {len(plain.outcomes)} requests, "
          f"{len(plain.failed())} failed {kinds}, {plain_s:.0f} s")
    assert _max_model_len(endpoint) == 384
    return RollFigures(len(load.outcomes), len(load.failed()), round(rolled_s, 1),
                       len(plain.outcomes), len(plain.failed()), kinds, round(plain_s, 1))


def test_a_rolling_change_under_load_fails_no_request(inv, model):
    rolling_change_under_load(inv, APP, model,
                              compare_plain=os.environ.get("CLUSTER_ROLL_COMPARE_PLAIN") == "1")
