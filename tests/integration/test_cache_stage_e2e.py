"""Compile-cache staging (issue 27 item 2) end to end: one 2-node simulated cluster, one Ray,
real vLLM (CPU build) serving the tiny dense model as ONE PP 2 engine across both nodes (vLLM's
compile mode: PP needs it on CPU), each node with its own VLLM_CACHE_ROOT (its private /tmp).

1. `cluster deploy --pp 2 --nnodes 2 --stage-caches` on empty caches: the replica's
   staged_cache is false and its ranks' own lines say they compiled; after RUNNING the union
   of the two nodes' caches (each holds its own stage's rank_<r>_0) is staged to both: every
   node verified, and the two cache trees are file for file identical (sha256 on the nodes).
2. undeploy; the cache of the node that ran rank 0 is deleted (a replaced node); the same
   deploy again: before the start the cache is staged back onto it from the other node
   (verified), the replica's staged_cache is true and every rank's lines say it loaded.
The two ready times (waited_s) are printed with their ratio (scripts/bench_cache_stage.py
measures the same; docs/serving.md has the figures).

Heavy: 2 PP 2 starts (60-100 s each on 2 cores), ~5 GB of memory, 6-10 minutes.
Run your own instance with SIMCLUSTER_PREFIX/SUBNET/DIR set (see test_deploy_e2e.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from integration_kit import ClusterCli, derive_inventory, node_tiny_model, ray_up

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.vllm]

KEY = "sk-cache-5a0c7e21f4"        # a test-only key, set in the nodes' env at `ray start`
SERVED = "tiny-cache"
APP = "cache-pp2"
CACHE_ROOT = "/tmp/vllm-cache"      # /tmp is private to each simulated node
PROFILES = {"node1": "cpu", "node2": "cpu"}
TREE = (f"cd {CACHE_ROOT}/torch_compile_cache 2>/dev/null && find . -type f ! -name '*.lock' "
        "! -name '*.tmp' -exec sha256sum {} + | sort -k2")

cli = ClusterCli(timeout=1200, no_traceback=True)


@pytest.fixture(scope="module")
def model(tiny_model_builder) -> Path:
    return node_tiny_model(tiny_model_builder, "dense", needs=("vllm",))


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    return simcluster_factory(2, PROFILES)


@pytest.fixture(scope="module")
def inv(sim, model, tmp_path_factory) -> Path:
    path = derive_inventory(sim, tmp_path_factory.mktemp("cache-inv"),
                            ray={"memory": 4 * 1024 ** 3},
                            every_node={"env": {"CLUSTER_API_KEY": KEY,
                                                "VLLM_CACHE_ROOT": CACHE_ROOT}})
    for node in PROFILES:
        sim.exec(node, "rm", "-rf", CACHE_ROOT, check=True)
    with ray_up(cli, path, timeout=600, down_first=True):
        yield path


def deploy(inv: Path, model: Path) -> dict:
    start = time.monotonic()
    code, out = cli.json(inv, "deploy", "--model", str(model), "--pp", "2", "--nnodes", "2",
                         "--name", APP, "--served-model-name", SERVED, "--max-model-len", "512",
                         "--stage-caches", "--yes", "--timeout", "900")
    out["measured_s"] = round(time.monotonic() - start, 1)
    assert code == 0 and out["status"] == "RUNNING", json.dumps(out, indent=1)[-5000:]
    return out


def undeploy(inv: Path) -> None:
    code, out = cli.json(inv, "undeploy", APP, "--yes", timeout=300)
    assert code == 0 and out["status"] == "REMOVED", out


def tree(sim, node: str) -> list[str]:
    """`sha256  ./path` of every cache file on the node (vLLM's lock and temp files left out)."""
    return sim.exec(node, "sh", "-c", TREE, timeout=60).stdout.splitlines()


def ranks_of(out: dict) -> dict[int, str]:
    (replica,) = out["replicas"]
    return {r["rank"]: r["node"] for r in replica["ranks"]}


def test_cold_start_then_a_replaced_node_starts_from_the_staged_cache(sim, inv, model, capsys):
    cold = deploy(inv, model)
    (replica,) = cold["replicas"]
    cache = cold["compile_cache"]
    assert replica["staged_cache"] is False, replica
    seen = {(r["rank"], r["node"]): r["state"] for r in replica["cache_ranks"]}
    assert sorted(seen) == sorted(ranks_of(cold).items()), replica
    assert set(seen.values()) == {"compiled"}, replica
    assert cache["before_start"]["dirs"] == [], cache["before_start"]
    after = cache["after_start"]
    assert {n: (r["status"], r["verified"]) for n, r in after["nodes"].items()} == \
        {n: ("copied", True) for n in PROFILES}, after
    trees = {n: tree(sim, n) for n in PROFILES}
    assert trees["node1"] == trees["node2"], trees
    held = "\n".join(trees["node1"])
    assert "/rank_0_0/" in held and "/rank_1_0/" in held, held[-2000:]

    undeploy(inv)
    replaced = ranks_of(cold)[0]
    sim.exec(replaced, "rm", "-rf", CACHE_ROOT, check=True)
    assert tree(sim, replaced) == []
    warm = deploy(inv, model)
    before = warm["compile_cache"]["before_start"]
    assert before["dirs"] == cache["dirs"], before
    assert (before["nodes"][replaced]["status"], before["nodes"][replaced]["verified"]) == \
        ("copied", True), before
    (replica,) = warm["replicas"]
    seen = {(r["rank"], r["node"]): r for r in replica["cache_ranks"]}
    assert sorted(seen) == sorted(ranks_of(warm).items()), replica
    states = {r["state"] for r in seen.values()}
    with capsys.disabled():     # the measurement of issue 27 item 2, in the suite's own log
        print(f"\n[cache stage] PP 2 ready after the PUT: cold {cold['waited_s']} s, with the "
              f"staged cache {warm['waited_s']} s (ratio "
              f"{warm['waited_s'] / cold['waited_s']:.2f}); the ranks {sorted(states)}; "
              f"staging before the start {before['seconds']} s; whole deploy "
              f"{cold['measured_s']} s vs {warm['measured_s']} s; load {os.getloadavg()[0]:.0f}")
    if states == {"loaded"}:
        assert replica["staged_cache"] is True, replica
    else:
        # vLLM 0.32's CPU build fails to load its own AOT artifact on a second start ('function'
        # object has no attribute 'finalize_loading'; tests/fixtures/vllm-compile-cache), staged
        # or not: each rank recompiles, says why, and the replica must not claim a staged start.
        assert replica["staged_cache"] is False, replica
        assert all(r["state"] == "compiled" and r["note"].startswith("load failed")
                   for r in seen.values()), replica
        assert "compiled: " in replica["cache_detail"], replica
    undeploy(inv)
