"""The fabric proof on a real 2-node Ray cluster on the simulated nodes (CPU build: gloo).

Nodes: node1 (head) and node2, `cpu` profile. The layout is TP 1 x PP 2 (one stage per node):
its one group is the pair of neighbouring stages, rank 0 on node1, rank 1 on node2.

Acceptance (issue 23): `cluster nccl-check --layout PLAN` proves exactly that group with gloo on
the inventory's port range, without deploying; `cluster deploy --dry-run` shows the group it
would prove; with node2's traffic to node1 dropped on that port range (nftables in node1's
namespace), `cluster deploy` refuses before any engine starts (exit 2), naming the pair of nodes
and the port, and Serve holds no application afterwards. Heavy: Ray on two nodes, a few
minutes on 2 cores. The firewall is cleared and Ray stopped whatever happens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from integration_kit import ClusterCli, derive_inventory, ray_up

pytestmark = [pytest.mark.integration, pytest.mark.ray]

PROFILES = {"node1": "cpu", "node2": "cpu"}
PORTS = (29500, 29509)

cli = ClusterCli(timeout=600)
cli_json = cli.json


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    return simcluster_factory(2, PROFILES)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model directory the deploy's node checks accept (the nodes share /var/tmp); no engine
    ever loads it here: the proof refuses first."""
    path = Path("/var/tmp") / f"cluster-proof-{tmp_path_factory.getbasetemp().name}" / "tiny"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return path


@pytest.fixture(scope="module")
def inv(sim, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("fabric-proof-inv")
    path = derive_inventory(sim, base, ray={"vllm_port_min": PORTS[0],
                                            "vllm_port_max": PORTS[1]}, health_job=False)
    doc = yaml.safe_load(path.read_text())
    doc["expectations"] = {"fabric": {"join_timeout_s": 15}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with ray_up(cli, path, timeout=600):
        try:
            yield path
        finally:
            sim.firewall("node1", "clear")


@pytest.fixture(scope="module")
def plan(tmp_path_factory, model_dir) -> Path:
    path = tmp_path_factory.mktemp("fabric-proof-plan") / "plan.yaml"
    path.write_text(f"model: {model_dir}\ntensor_parallel_size: 1\npipeline_parallel_size: 2\n"
                    "replicas: 1\nplacement: {gang: {nnodes: 2}}\n")
    return path


PP_PAIR = {"kind": "pp", "ranks": [0, 1], "nodes": ["node1", "node2"], "backend": "gloo"}


def test_layout_proof_runs_the_pp_pair_with_gloo_on_the_port_range(inv, plan):
    code, out = cli_json(inv, "nccl-check", "--layout", str(plan), timeout=400)
    proof = out["fabric_proof"]
    assert code == 0, proof["verdict"]
    assert len(proof["groups"]) == 1
    group = proof["groups"][0]
    assert {k: group[k] for k in PP_PAIR} == PP_PAIR
    assert group["transport"] == "TCP" and group["gdr"] is None
    assert group["busbw_gbps"] > group["threshold_gbps"] > 0
    assert group["verdict"].startswith("OK: pp r0 [0,1] on node1 -> node2 over TCP")
    assert proof["details"][0]["port"] == PORTS[0]
    assert proof["details"][0]["latency_us"] > 0
    assert out["plan"]["groups"][0]["port"] == PORTS[0]


def test_deploy_dry_run_shows_the_groups_it_would_prove(inv, model_dir):
    code, out = cli_json(inv, "deploy", "--model", str(model_dir), "--pp", "2", "--nnodes", "2",
                         "--device", "cpu", "--no-api-key", "--dry-run", timeout=300)
    assert code == 0, out.get("error")
    assert out["status"] == "DRY_RUN" and out["fabric_proof"]["status"] == "planned"
    group = out["fabric_proof"]["groups"][0]
    assert {k: group[k] for k in PP_PAIR} == PP_PAIR
    assert group["busbw_gbps"] is None


def test_firewall_on_the_port_range_refuses_the_deployment_naming_nodes_and_port(
        sim, inv, model_dir):
    sim.firewall("node1", "drop", f"{PORTS[0]}-{PORTS[1]}", "--from", "node2")
    try:
        code, out = cli_json(inv, "deploy", "--model", str(model_dir), "--pp", "2",
                             "--nnodes", "2", "--device", "cpu", "--no-api-key", "--yes", timeout=500)
    finally:
        sim.firewall("node1", "clear")
    assert code == 2, out
    assert out["status"] == "REFUSED" and "apply" not in out
    assert "node1 -> node2" in out["error"] and f"port {PORTS[0]}" in out["error"]
    assert f"TCP port {PORTS[0]} on node1 must be reachable from node2" in out["error"]
    group = out["fabric_proof"]["groups"][0]
    assert group["nodes"] == ["node1", "node2"] and group["busbw_gbps"] is None
    code, status = cli_json(inv, "status", timeout=120)
    apps = (status.get("serve") or {}).get("applications") or {}
    assert "tiny" not in apps, apps          # nothing was deployed
