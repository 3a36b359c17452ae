"""Placement of GPU layouts on a simulated 2-node x 4-GPU Ray cluster (issue 7), no engine.

`cluster deploy --device gpu --placement-only` deploys serve_apps with `dry_run: true`: Serve
reserves the replica(s)' placement-group bundles on the nodes' GPU resources (registered from
the `small-4gpu` profile's fake nvidia-smi) and one probe actor per vLLM worker holds each
bundle's share; vLLM's CPU build cannot run the Ray GPU executor, so no engine starts. What is
checked comes from Ray's own tables, read by a driver on the head (GCS placement-group table,
state-API actor table), plus the deployed Serve config and the app's GET /v1/placement:

- dense TP 4 x PP 2: one placement group of 8 {GPU: 1, CPU} bundles, 4 per node, each pipeline
  stage's TP group inside one node (bundles 0-3 on one node, 4-7 on the other), 8 probe actors
  in that group (4 per node, 4 distinct GPU ids per node); engine args tensor_parallel_size 4,
  pipeline_parallel_size 2, distributed_executor_backend ray.
- MoE DP 8 + EP (issue 22 item 4, vLLM's multi-node DP layout, one engine launch per node):
  one replica, its placement group two STRICT_SPREAD bundles of {GPU: 4} (one per node); the
  replica (node rank 0) holds bundle 0, one real RankActor (node rank 1, dry run: no vLLM in
  it) holds bundle 1 on the other node with its 4 GPUs; node 0's engine args data_parallel_size
  8, data_parallel_size_local 4, data_parallel_address = the replica's node IP, the DP RPC port
  from the inventory's range, no start rank; the rank actor's the same with
  data_parallel_start_rank 4 and VLLM_HOST_IP = its own node; deploy JSON ranks [0, 1].

Run your own instance: SIMCLUSTER_PREFIX=plc SIMCLUSTER_SUBNET=8 SIMCLUSTER_DIR=/tmp/simcluster-plc.
Heavy (a dozen Ray workers on two nodes): a few minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from integration_kit import ClusterCli, derive_inventory, head_driver, node_tiny_model, ray_up

pytestmark = [pytest.mark.integration, pytest.mark.ray]

PROFILES = {"node1": "small-4gpu", "node2": "small-4gpu"}
DENSE_APP, MOE_APP = "plc-dense", "plc-moe"


cli = ClusterCli(timeout=900)
cli_json = cli.json


@pytest.fixture(scope="module")
def models(tiny_model_builder) -> dict[str, Path]:
    return {kind: node_tiny_model(tiny_model_builder, kind) for kind in ("dense", "moe")}


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    return simcluster_factory(2, PROFILES)


@pytest.fixture(scope="module")
def inv(sim, models, tmp_path_factory) -> Path:
    """Simcluster inventory + Ray settings for 4 fake GPUs per node; Ray up, always down after.

    num_cpus 9: the bundles are {GPU: 1, CPU: 1} with the replica's CPU in bundle 0, so the
    dense layout needs 5 + 4 CPUs and the MoE gang 8 + 8 (logical resources only)."""
    # 9 logical CPUs on a 2-core host: do not prestart 9 idle workers per node.
    path = derive_inventory(sim, tmp_path_factory.mktemp("placement-inv"), ray={"num_cpus": 9},
                            every_node={"env": {"RAY_prestart_worker_first_driver": "0"}},
                            short_drain=True, health_job=False)
    with ray_up(cli, path, timeout=900, down_first=True):
        try:
            yield path
        finally:
            for app in (MOE_APP, DENSE_APP):
                cli(path, "undeploy", app, "--yes", timeout=300)


# ---------------------------------------------------------------- Ray's tables, read on the head

TABLES = r'''
import json, ray
from ray.util.state import list_actors
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
pgs = {}
for pg_id, pg in ray.util.placement_group_table().items():
    if pg["state"] == "REMOVED":
        continue
    pgs[pg_id] = {"name": pg["name"], "state": pg["state"], "strategy": pg["strategy"],
                  "bundles": {int(i): dict(r) for i, r in pg["bundles"].items()},
                  "bundle_ips": {int(i): ip_of.get(n) for i, n in pg["bundles_to_node_id"].items()}}
actors = [{"class_name": a.class_name, "name": a.name, "node_ip": ip_of.get(a.node_id),
           "pg_id": a.placement_group_id, "pid": a.pid}
          for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=10000)]
print("RESULT " + json.dumps({"placement_groups": pgs, "actors": actors}))
'''


def ray_tables(inventory: Path, timeout: float = 300) -> dict:
    """Ray's placement-group table (GCS) and alive actors (state API), from a head driver run
    with the cluster's auth mode (as tests/integration/test_ray_cluster.py does)."""
    out = head_driver(inventory, TABLES, timeout)
    for pg in out["placement_groups"].values():  # JSON made the bundle indices str
        pg["bundles"] = {int(i): r for i, r in pg["bundles"].items()}
        pg["bundle_ips"] = {int(i): ip for i, ip in pg["bundle_ips"].items()}
    return out


def app_tables(inventory: Path, app: str, want_replicas: int, timeout: float = 180,
               want_probes: int = 8) -> dict:
    """The tables once the app's replicas and their probes (or rank actors) are all ALIVE
    and PGs CREATED."""
    deadline = time.monotonic() + timeout
    while True:
        t = ray_tables(inventory)
        replicas = [a for a in t["actors"] if a["class_name"].startswith(f"ServeReplica:{app}:")]
        pg_ids = {a["pg_id"] for a in replicas}
        probes = [a for a in t["actors"] if a["class_name"] in ("BundleProbe", "RankActor")
                  and a["pg_id"] in pg_ids]
        pgs = {i: pg for i, pg in t["placement_groups"].items() if i in pg_ids}
        ready = (len(replicas) == want_replicas and len(probes) == want_probes
                 and pgs and all(pg["state"] == "CREATED" for pg in pgs.values()))
        if ready or time.monotonic() > deadline:
            return {"replicas": replicas, "probes": probes, "pgs": pgs, "all": t}
        time.sleep(5)


def placement_reports(endpoint: str, node_ips: list[str], want_ranks: int,
                      timeout: float = 120) -> dict:
    """GET /placement through every node's Serve proxy (each prefers its node's replicas)
    until `want_ranks` replicas (by pid) have answered."""
    import httpx

    head_ip = endpoint.split("//", 1)[1].split(":", 1)[0]
    urls = [endpoint.replace(f"//{head_ip}:", f"//{ip}:", 1) + "/placement" for ip in node_ips]
    reports: dict = {}
    deadline = time.monotonic() + timeout
    while len(reports) < want_ranks and time.monotonic() < deadline:
        for url in urls:
            try:
                r = httpx.get(url, timeout=30)
                if r.status_code == 200:
                    report = r.json()
                    reports[report["replica"]["pid"]] = report
            except httpx.HTTPError:
                time.sleep(1)
    return reports


def undeploy(inventory: Path, app: str) -> None:
    code, out = cli_json(inventory, "undeploy", app, "--yes", timeout=400)
    assert code == 0 and out["status"] in ("REMOVED", "ABSENT"), json.dumps(out, indent=1)


# ---------------------------------------------------------------- the test


@pytest.mark.timeout(2400)
def test_dense_tp4_pp2_and_moe_dp8_ep_placement_on_two_4gpu_nodes(sim, inv, models):
    """(1) dense TP 4 x PP 2, (2) MoE DP 8 + EP, on the same two simulated 4-GPU nodes."""
    ips = {sim.node(n).ip for n in PROFILES}
    timings = {}

    # (1) dense: TP 4 x PP 2 -> one PG of 8 GPU bundles, one TP group (pipeline stage) per node
    start = time.monotonic()
    code, out = cli_json(inv, "deploy", "--model", str(models["dense"]), "--tp", "4", "--pp", "2",
                         "--name", DENSE_APP, "--device", "gpu", "--placement-only",
                         "--no-api-key", "--yes", "--timeout", "600")
    timings["dense_deploy_s"] = round(time.monotonic() - start, 1)
    assert code == 0 and out["status"] == "RUNNING", json.dumps(out, indent=1)[-4000:]
    assert out["device"] == "gpu"
    assert out["placement"]["bundles_per_replica"] == [{"GPU": 1, "CPU": 2}] + [{"GPU": 1, "CPU": 1}] * 7
    app = yaml.safe_load(Path(out["config_path"]).read_text())["applications"][0]
    assert app["import_path"] == "serve_apps.vllm_app:build_app"
    assert app["args"]["dry_run"] is True and app["args"]["device"] == "gpu"
    assert app["args"]["engine_kwargs"]["tensor_parallel_size"] == 4
    assert app["args"]["engine_kwargs"]["pipeline_parallel_size"] == 2

    t = app_tables(inv, DENSE_APP, want_replicas=1)
    assert len(t["replicas"]) == 1, json.dumps(t["all"], indent=1)[-4000:]
    assert len(t["pgs"]) == 1, t["pgs"]
    (pg_id, pg), = t["pgs"].items()
    assert pg["state"] == "CREATED" and pg["strategy"] == "PACK"
    assert sorted(pg["bundles"]) == list(range(8))
    assert all(pg["bundles"][i].get("GPU") == 1.0 for i in range(8)), pg["bundles"]
    nodes_by_bundle = [pg["bundle_ips"][i] for i in range(8)]
    assert set(nodes_by_bundle) == ips, nodes_by_bundle
    # each pipeline stage's TP group (bundles 0-3, 4-7) inside one node, the stages on two nodes
    assert len(set(nodes_by_bundle[:4])) == 1 and len(set(nodes_by_bundle[4:])) == 1
    assert nodes_by_bundle[0] != nodes_by_bundle[4]
    # the replica sits in bundle 0's node (next to vLLM's rank 0); 8 probes, 4 per node, in the PG
    assert t["replicas"][0]["node_ip"] == nodes_by_bundle[0]
    assert Counter(p["node_ip"] for p in t["probes"]) == {ip: 4 for ip in ips}

    reports = placement_reports(out["endpoint"], sorted(ips), want_ranks=1)
    assert len(reports) == 1, reports
    (report,) = reports.values()
    kwargs = report["engine_kwargs"]
    assert kwargs["tensor_parallel_size"] == 4 and kwargs["pipeline_parallel_size"] == 2
    assert kwargs["distributed_executor_backend"] == "ray"
    assert report["dry_run"] is True and report["device"] == "gpu"
    assert report["worker_bundle_indices"] == list(range(8))
    assert sorted(p["bundle_index"] for p in report["probes"]) == list(range(8))
    for p in report["probes"]:  # the probe in bundle i runs on bundle i's node
        assert p["node_ip"] == nodes_by_bundle[p["bundle_index"]]
    for ip in ips:  # 4 distinct GPUs held on each node
        assert len({g for p in report["probes"] if p["node_ip"] == ip for g in p["gpu_ids"]}) == 4

    undeploy(inv, DENSE_APP)
    deadline = time.monotonic() + 120
    while pg_id in ray_tables(inv)["placement_groups"] and time.monotonic() < deadline:
        time.sleep(3)
    assert pg_id not in ray_tables(inv)["placement_groups"], "the dense PG outlived undeploy"

    # (2) MoE: DP 8 + EP -> one engine launch per node: the replica (node rank 0) + a rank actor
    start = time.monotonic()
    code, out = cli_json(inv, "deploy", "--model", str(models["moe"]), "--dp", "8",
                         "--expert-parallel", "--name", MOE_APP, "--device", "gpu",
                         "--placement-only", "--no-api-key", "--yes", "--timeout", "900",
                         timeout=1200)
    timings["moe_deploy_s"] = round(time.monotonic() - start, 1)
    assert code == 0 and out["status"] == "RUNNING", json.dumps(out, indent=1)[-4000:]
    assert out["placement"]["num_replicas"] == 1 and "gang" not in out["placement"]
    assert out["placement"]["strategy"] == "STRICT_SPREAD"
    assert [b["GPU"] for b in out["placement"]["bundles_per_replica"]] == [4.0, 4.0]
    app = yaml.safe_load(Path(out["config_path"]).read_text())["applications"][0]
    assert app["import_path"] == "serve_apps.vllm_app:build_moe_app"
    kw = app["args"]["engine_kwargs"]
    assert (kw["data_parallel_size"], kw["nnodes"], kw["enable_expert_parallel"]) == (8, 2, True)
    assert app["args"]["dry_run"] is True
    lo, hi = app["args"]["multi_node"]["port_min"], app["args"]["multi_node"]["port_max"]

    t = app_tables(inv, MOE_APP, want_replicas=1, timeout=300, want_probes=1)
    assert len(t["replicas"]) == 1 and len(t["probes"]) == 1, json.dumps(t["all"], indent=1)[-4000:]
    (pg_id, pg), = t["pgs"].items()
    assert pg["strategy"] == "STRICT_SPREAD" and sorted(pg["bundles"]) == [0, 1]
    assert all(pg["bundles"][i].get("GPU") == 4.0 for i in (0, 1)), pg["bundles"]
    node0, node1 = pg["bundle_ips"][0], pg["bundle_ips"][1]
    assert {node0, node1} == ips
    replica, rank_actor = t["replicas"][0], t["probes"][0]
    assert replica["node_ip"] == node0 and replica["pg_id"] == pg_id
    assert rank_actor["class_name"] == "RankActor" and rank_actor["node_ip"] == node1
    assert rank_actor["pg_id"] == pg_id and rank_actor["name"].startswith(f"{MOE_APP}/")

    reports = placement_reports(out["endpoint"], sorted(ips), want_ranks=1, timeout=180)
    (report,) = reports.values()
    k0 = report["engine_kwargs"]
    assert (k0["data_parallel_size"], k0["data_parallel_size_local"]) == (8, 4)
    assert k0["data_parallel_address"] == node0 == report["replica"]["node_ip"]
    assert lo <= k0["data_parallel_rpc_port"] <= hi
    assert "data_parallel_start_rank" not in k0 and "nnodes" not in k0
    assert k0["distributed_executor_backend"] == "mp" and k0["enable_expert_parallel"] is True
    (ranked,) = report["rank_actors"]       # the rank actor's own account, on its node
    assert ranked["node_rank"] == 1 and ranked["node_ip"] == node1
    assert ranked["state"] == "placed" and len(set(ranked["gpu_ids"])) == 4
    k1 = ranked["engine_kwargs"]
    assert k1["data_parallel_start_rank"] == 4 and k1["data_parallel_size_local"] == 4
    assert k1["data_parallel_address"] == node0
    assert k1["data_parallel_rpc_port"] == k0["data_parallel_rpc_port"]
    assert ranked["env"]["VLLM_HOST_IP"] == node1
    (rep,) = out["replicas"]                 # deploy JSON: the replica's ranks
    assert [(r["rank"], r["node_ip"], r["state"]) for r in rep["ranks"]] == [
        (0, node0, "running"), (1, node1, "running")]

    undeploy(inv, MOE_APP)
    code, down = cli_json(inv, "down", "--yes", timeout=300)
    assert code == 0, json.dumps(down, indent=1)[-3000:]
    print(f"\nplacement timings: {timings}")
