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
- MoE DP 8 + EP: 8 gang-scheduled rank replicas (ServeReplica actors, 4 per node), their probe
  actors 4 per node, all in the gang's placement group(s) of 8 GPU bundles in all; engine args
  data_parallel_size 8, enable_expert_parallel true, ranks 0-7 sharing rank 0's DP address.

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
                            every_node={"env": {"RAY_prestart_worker_first_driver": "0"}})
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


def app_tables(inventory: Path, app: str, want_replicas: int, timeout: float = 180) -> dict:
    """The tables once the app's replicas and their probes are all ALIVE and PGs CREATED."""
    deadline = time.monotonic() + timeout
    while True:
        t = ray_tables(inventory)
        replicas = [a for a in t["actors"] if a["class_name"].startswith(f"ServeReplica:{app}:")]
        pg_ids = {a["pg_id"] for a in replicas}
        probes = [a for a in t["actors"] if a["class_name"] == "BundleProbe"
                  and a["pg_id"] in pg_ids]
        pgs = {i: pg for i, pg in t["placement_groups"].items() if i in pg_ids}
        ready = (len(replicas) == want_replicas and len(probes) == 8
                 and pgs and all(pg["state"] == "CREATED" for pg in pgs.values()))
        if ready or time.monotonic() > deadline:
            return {"replicas": replicas, "probes": probes, "pgs": pgs, "all": t}
        time.sleep(5)


def placement_reports(endpoint: str, node_ips: list[str], want_ranks: int,
                      timeout: float = 120) -> dict:
    """GET /placement through every node's Serve proxy (each prefers its node's replicas)
    until every DP rank (or the one replica, rank None) has answered."""
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
                    reports[report["dp_rank"]] = report
            except httpx.HTTPError:
                time.sleep(1)
    return reports


def undeploy(inventory: Path, app: str) -> None:
    code, out = cli_json(inventory, "undeploy", app, "--yes", timeout=400)
    assert code == 0 and out["status"] in ("REMOVED", "ABSENT"), json.dumps(out, indent=1)


# ---------------------------------------------------------------- the test


@pytest.mark.timeout(2400)
def test_dense_tp4_pp2_and_moe_dp8_ep_placement_on_two_4gpu_nodes(sim, inv, models):
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
    assert list(reports) == [None], reports
    report = reports[None]
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

    # (2) MoE: DP 8 + EP -> 8 gang-scheduled rank replicas, 4 per node
    start = time.monotonic()
    code, out = cli_json(inv, "deploy", "--model", str(models["moe"]), "--dp", "8",
                         "--expert-parallel", "--name", MOE_APP, "--device", "gpu",
                         "--placement-only", "--no-api-key", "--yes", "--timeout", "900",
                         timeout=1200)
    timings["moe_deploy_s"] = round(time.monotonic() - start, 1)
    assert code == 0 and out["status"] == "RUNNING", json.dumps(out, indent=1)[-4000:]
    assert out["placement"]["num_replicas"] == 8
    assert out["placement"]["gang"]["gang_size"] == 8
    app = yaml.safe_load(Path(out["config_path"]).read_text())["applications"][0]
    assert app["import_path"] == "serve_apps.vllm_app:build_moe_app"
    assert app["args"]["engine_kwargs"]["data_parallel_size"] == 8
    assert app["args"]["engine_kwargs"]["enable_expert_parallel"] is True
    assert app["args"]["dry_run"] is True

    t = app_tables(inv, MOE_APP, want_replicas=8, timeout=300)
    assert len(t["replicas"]) == 8, json.dumps(t["all"], indent=1)[-4000:]
    assert Counter(a["node_ip"] for a in t["replicas"]) == {ip: 4 for ip in ips}
    assert Counter(p["node_ip"] for p in t["probes"]) == {ip: 4 for ip in ips}
    bundles = [(pg_id, i, pg["bundle_ips"][i], pg["bundles"][i])
               for pg_id, pg in t["pgs"].items() for i in sorted(pg["bundles"])]
    assert len(bundles) == 8 and all(b[3].get("GPU") == 1.0 for b in bundles), bundles
    assert Counter(b[2] for b in bundles) == {ip: 4 for ip in ips}
    # gang-scheduled: every rank replica in the gang's placement group (one for the 8 ranks)
    assert len(t["pgs"]) == 1 and all(a["pg_id"] in t["pgs"] for a in t["replicas"]), t["pgs"]

    reports = placement_reports(out["endpoint"], sorted(ips), want_ranks=8, timeout=180)
    assert sorted(reports) == list(range(8)), sorted(reports)
    address = reports[0]["engine_kwargs"]["data_parallel_address"]
    for rank, report in reports.items():
        kwargs = report["engine_kwargs"]
        assert kwargs["data_parallel_size"] == 8 and kwargs["data_parallel_rank"] == rank
        assert kwargs["enable_expert_parallel"] is True
        assert kwargs["distributed_executor_backend"] == "ray"
        assert kwargs["data_parallel_address"] == address
        assert len(report["probes"]) == 1 and report["probes"][0]["gpu_ids"]
    assert Counter(r["replica"]["node_ip"] for r in reports.values()) == {ip: 4 for ip in ips}

    undeploy(inv, MOE_APP)
    code, down = cli_json(inv, "down", "--yes", timeout=300)
    assert code == 0, json.dumps(down, indent=1)[-3000:]
    print(f"\nplacement timings: {timings}")
