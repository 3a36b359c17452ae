"""The fabric proof (cluster/planning/fabric_proof.py): the layout's groups -> the job's arguments, and the
job's per-group results -> verdicts (cannot form, sockets where IB is expected, no GDR, below
the threshold), with real NCCL logs from the fixtures as the ranks' debug output."""

from __future__ import annotations

import json

import pytest

from cluster.serving import deploy
from cluster.planning import fabric_proof
from cluster.nodes.inventory import loads as load_inventory
from cluster.ray.nccl_check import JobOutcome
from cluster.ray.ray_state import GcsNode, RayState
from cluster.base.results import Status
from cluster.inspection.node_summary import IbPortFact, NodeFactsSummary, PreflightFacts
from fakes import fixture_text
from cluster.ray_jobs import nccl_allreduce as job

IB_GDR_LOG = "041-ray-vllm-deepseek-16rank-ib-gdrdma-truncated-lines.log"
SOCKET_LOG = "009-pytorch-lightning-2.11.4-nccl-net-socket-dgx-a100.log"

CPU_INV = """
nodes:
  - {name: node1, role: head, address: 198.18.5.1}
  - {name: node2, address: 198.18.5.2}
ray: {vllm_port_min: 29600, vllm_port_max: 29601}
expectations: {fabric: {join_timeout_s: 15}}
"""
GPU_INV = """
nodes:
  - {name: gpu1, role: head, address: 10.0.0.1, ib_hcas: [mlx5_0]}
  - {name: gpu2, address: 10.0.0.2, ib_hcas: [mlx5_0]}
"""


def _cluster(inv, *nodes, model=None):
    state = RayState("dashboard", "2.60.0", tuple(
        GcsNode(f"id{i}", ip, True, i == 0,
                {"CPU": cpus, "GPU": gpus, **({f"accelerator_type:{model}": 1} if model else {})})
        for i, (ip, cpus, gpus) in enumerate(nodes)), None)
    return deploy.ClusterView.from_state(inv, state)


def _cpu_plan(tp=1, pp=2):
    inv = load_inventory(CPU_INV)
    view = _cluster(inv, ("198.18.5.1", 4, 0), ("198.18.5.2", 4, 0))
    spec = deploy.spec_from_flags("/models/tiny", tp=tp, pp=pp, nnodes=2)   # one engine, 2 nodes
    return inv, fabric_proof.plan_proof(spec, "cpu", view, inv,
                                        nnodes=deploy.engine_nodes(spec, "cpu", view))


def _gpu_plan(tp=1, pp=2):
    inv = load_inventory(GPU_INV)
    view = _cluster(inv, ("10.0.0.1", 64, 1), ("10.0.0.2", 64, 1), model="H100")
    spec = deploy.spec_from_flags("/models/tiny", tp=tp, pp=pp)
    return inv, fabric_proof.plan_proof(spec, "gpu", view, inv)


def _outcome(groups, ok=True):
    return JobOutcome("proof-1", True, "SUCCEEDED" if ok else "FAILED", None,
                      {"ok": ok, "groups": groups})


def test_cpu_tp1_pp2_plan_is_one_cross_node_gloo_group_on_the_inventory_port():
    inv, plan = _cpu_plan()
    view = plan.to_dict()
    assert view["backend"] == "gloo" and view["port_range"] == [29600, 29601]
    assert view["groups"] == [{"kind": "pp", "replica": 0, "ranks": [0, 1],
                               "nodes": ["node1", "node2"], "devices": [0, 0],
                               "crosses_nodes": True, "port": 29600}]


def test_job_args_round_trip_through_the_entrypoint_parser():
    _, plan = _cpu_plan()
    args = fabric_proof.job_args(plan) + ["--deadline", "1e10", "--log-dir", "/tmp/x",
                                          "--result-file", "/tmp/r"]
    parsed = job.parse_args(args)
    assert parsed.backend == "gloo"
    assert [n["name"] for n in parsed.nodes] == ["node1", "node2"]
    assert parsed.groups["slots"] == [{"node": "node1", "ip": "198.18.5.1"},
                                      {"node": "node2", "ip": "198.18.5.2"}]
    assert parsed.groups["groups"][0]["members"] == [0, 1]
    assert parsed.groups["groups"][0]["port"] == 29600
    assert parsed.groups["join_timeout_s"] == 15.0


def test_entrypoint_refuses_bad_groups():
    base = ["--backend", "gloo", "--size-mb", "1", "--iters", "1", "--deadline", "1",
            "--nodes", '[{"name": "a", "ip": "1.1.1.1"}]', "--log-dir", "/x",
            "--result-file", "/y"]
    bad = {"slots": [{"node": "a", "ip": "1"}], "groups": [{"members": [0, 0], "port": 29500}]}
    with pytest.raises(SystemExit):
        job.parse_args(base + ["--groups", json.dumps(bad)])
    bad = {"slots": [{"node": "a", "ip": "1"}, {"node": "b", "ip": "2"}],
           "groups": [{"members": [0, 1], "port": 80}]}
    with pytest.raises(SystemExit):
        job.parse_args(base + ["--groups", json.dumps(bad)])
    bad = {"slots": [{"node": "a", "ip": "1"}, {"node": "b", "ip": "2"}],
           "groups": [{"members": [0, 1], "port": 29500}], "port_range": [29600, 29500]}
    with pytest.raises(SystemExit):
        job.parse_args(base + ["--groups", json.dumps(bad)])


def test_group_bandwidth_is_the_slowest_members_and_latency():
    members = [{"time_s": 1.0, "small_time_s": 0.001}, {"time_s": 2.0, "small_time_s": 0.002}]
    got = job.group_bandwidth(8 << 20, 10, members)
    assert got["algbw_gbps"] == pytest.approx((8 << 20) / 0.2 / 1e9, rel=1e-3)
    assert got["busbw_gbps"] == pytest.approx(got["algbw_gbps"], rel=1e-3)   # 2 ranks: x1
    assert got["latency_us"] == 200.0


def test_gloo_group_above_and_below_the_floor():
    inv, plan = _cpu_plan()
    ctx = fabric_proof.Context.of(inv)
    good = fabric_proof.judge_proof(plan, _outcome([{"index": 0, "ok": True, "busbw_gbps": 0.5,
                                                      "latency_us": 120.0, "members": []}]), ctx)
    g = good.to_dict()["groups"][0]
    assert set(g) == {"kind", "ranks", "nodes", "backend", "transport", "gdr", "busbw_gbps",
                      "threshold_gbps", "verdict"}
    assert g["transport"] == "TCP" and g["backend"] == "gloo" and g["busbw_gbps"] == 0.5
    assert g["threshold_gbps"] == pytest.approx(0.01) and good.ok
    assert g["verdict"].startswith("OK: pp r0 [0,1] on node1 -> node2")
    slow = fabric_proof.judge_proof(plan, _outcome([{"index": 0, "ok": True, "busbw_gbps": 0.001,
                                                      "members": []}]), ctx)
    assert not slow.ok and "below its threshold" in slow.verdict


def test_group_that_cannot_form_names_its_nodes_and_port():
    inv, plan = _cpu_plan()
    raw = {"index": 0, "ok": False, "port": 29600, "problems": [
        "rank 0 on node1: join: DistStoreError: wait timeout after 15000ms, keys: /0//cpu//0/1",
        "rank 1 on node2: join: DistNetworkError: The client socket has timed out after "
        "15000ms while trying to connect to (198.18.5.1, 29600)."]}
    proof = fabric_proof.judge_proof(plan, _outcome([raw], ok=False),
                                     fabric_proof.Context.of(inv))
    assert proof.status == Status.FAIL
    verdict = proof.to_dict()["groups"][0]["verdict"]
    assert "node1 -> node2" in verdict and "port 29600" in verdict
    assert "TCP port 29600 on node1 must be reachable from node2" in verdict
    assert "cannot form on port 29600: rank 1 on node2: join: DistNetworkError" in verdict


def test_job_without_groups_fails_every_group():
    inv, plan = _cpu_plan()
    out = JobOutcome("proof-1", False, None, None, None, errors=("head unreachable",))
    proof = fabric_proof.judge_proof(plan, out, fabric_proof.Context.of(inv))
    assert proof.status == Status.FAIL and "head unreachable" in proof.verdict


def _nccl_group(log_name, busbw):
    text = fixture_text("nccl", log_name)
    return {"index": 0, "ok": True, "busbw_gbps": busbw, "latency_us": 30.0,
            "members": [{"rank": 0, "node": "gpu1", "nccl_log": text},
                        {"rank": 1, "node": "gpu2", "nccl_log": ""}]}


def test_nccl_ib_gdr_group_passes_and_socket_group_fails_where_ib_expected():
    inv, plan = _gpu_plan()
    ib = PreflightFacts({n: NodeFactsSummary(ib_ports=(IbPortFact("mlx5_0", 1, "Active", 400),))
                         for n in ("gpu1", "gpu2")})
    ctx = fabric_proof.Context.of(inv, {"gpu1": "H100", "gpu2": "H100"}, ib)
    assert ctx.expected_network == "IB" and ctx.gdr_required
    good = fabric_proof.judge_proof(plan, _outcome([_nccl_group(IB_GDR_LOG, 45.0)]), ctx)
    g = good.to_dict()["groups"][0]
    assert (g["transport"], g["gdr"]) == ("IB", True)
    assert g["threshold_gbps"] == pytest.approx(0.8 * 0.95 * 50) and good.ok
    low = fabric_proof.judge_proof(plan, _outcome([_nccl_group(IB_GDR_LOG, 20.0)]), ctx)
    assert not low.ok and "below its threshold" in low.verdict
    sock = fabric_proof.judge_proof(plan, _outcome([_nccl_group(SOCKET_LOG, 45.0)]), ctx)
    s = sock.to_dict()["groups"][0]
    assert s["transport"] == "SOCKET" and not sock.ok
    assert "sockets where the inventory expects InfiniBand" in s["verdict"]
    assert "gpu1, gpu2" in s["verdict"]


def test_socket_group_not_failed_when_the_inventory_expects_any():
    inv = load_inventory(GPU_INV + "expectations: {fabric: {interconnect: any}, "
                                   "gpudirect_rdma: false}\n")
    _, plan = _gpu_plan()
    ctx = fabric_proof.Context.of(inv, {"gpu1": "H100"})
    proof = fabric_proof.judge_proof(plan, _outcome([_nccl_group(SOCKET_LOG, 45.0)]), ctx)
    assert proof.ok, proof.verdict


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, True, "12"])
def test_a_non_finite_or_odd_figure_from_the_job_is_no_figure(bad):
    inv, plan = _cpu_plan()
    proof = fabric_proof.judge_proof(plan, _outcome([{"index": 0, "ok": True,
                                                       "busbw_gbps": bad, "members": []}]),
                                     fabric_proof.Context.of(inv))
    g = proof.to_dict()["groups"][0]
    assert g["busbw_gbps"] is None and "no bus bandwidth figure" in g["verdict"]
    assert proof.status == Status.WARN


def test_resources_in_use_leave_the_groups_not_proven_not_failed():
    inv, plan = _cpu_plan()
    out = JobOutcome("proof-1", True, "FAILED", None, {
        "ok": False, "stage": "place", "groups": [], "placement_busy": ["node1"],
        "failed_nodes": ["node1"], "problems": ["node1: its bundle (one CPU) could not be "
                                                "reserved in time (placement group PENDING)"]})
    proof = fabric_proof.judge_proof(plan, out, fabric_proof.Context.of(inv))
    assert proof.status == Status.WARN and proof.ok
    assert proof.verdict.startswith("WARN: pp r0 [0,1] on node1 -> node2 not proven")
    assert "CPUs on node1 are in use" in proof.verdict


def test_store_ports_try_the_next_ports_of_the_range():
    assert job.store_ports(29500, [29500, 29599])[:3] == [29500, 29501, 29502]
    assert len(job.store_ports(29500, [29500, 29599])) == job.STORE_PORT_TRIES
    assert job.store_ports(29601, [29600, 29601]) == [29601, 29600]
    assert job.store_ports(80, [29600, 29601]) == [80]
    assert job.store_ports(29600, None) == [29600]
