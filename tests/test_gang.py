"""Multi-node engines (issue 22), the pure parts: layout -> node ranks (cluster/planning/gang.py), the
app's gang placement and executor choice (serve_apps/config.py), `cluster deploy`'s args for a
gang (cluster/serving/deploy.py), and the replica/rank join behind `cluster status` (ray_state)."""

from __future__ import annotations

import pytest

from cluster.serving import deploy
from cluster.base.errors import UsageError
from cluster.planning.gang import gang_bundles, gang_layout, nodes_needed, pick_port
from cluster.nodes.inventory import loads as load_inventory
from cluster.ray.ray_state import rank_actor_name, serve_applications
from serve_apps.config import (AppConfigError, engine_kwargs_for, parse_app_args,
                               serve_deployment_options)
from fakes import DEPLOY_MODEL as MODEL, build_app, deploy_cluster_of as cluster_of

CPU2 = cluster_of(("10.0.0.1", 2, 0), ("10.0.0.2", 2, 0))
GPU2x4 = cluster_of(("10.0.0.1", 16, 4), ("10.0.0.2", 16, 4))


def build(spec, cluster=CPU2, device=None):
    return build_app(spec, cluster, device)

# ---------------------------------------------------------------- cluster/planning/gang.py


def test_pp2_over_two_nodes_puts_one_stage_on_each():
    layout = gang_layout(tp=1, pp=2, nnodes=2)
    assert [(n.node_rank, n.ranks, n.stages) for n in layout.nodes] == [(0, (0,), (0,)),
                                                                         (1, (1,), (1,))]
    assert not layout.tp_split


def test_tp4_pp2_over_two_nodes_keeps_each_tp_group_inside_a_node():
    layout = gang_layout(tp=4, pp=2, nnodes=2)
    assert [n.ranks for n in layout.nodes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [n.stages for n in layout.nodes] == [(0,), (1,)]
    assert [n.tp_ranks for n in layout.nodes] == [(0, 1, 2, 3), (0, 1, 2, 3)]
    assert not layout.tp_split and layout.local == 4


def test_tp2_one_rank_per_node_splits_the_tp_group():
    layout = gang_layout(tp=2, pp=1, nnodes=2)
    assert [n.tp_ranks for n in layout.nodes] == [(0,), (1,)]
    assert layout.tp_split


@pytest.mark.parametrize("tp, pp, nnodes, why", [
    (1, 3, 2, "do not split evenly"), (4, 3, 2, "parts of two tensor-parallel groups"),
    (0, 1, 1, "tensor_parallel_size"), (1, 1, True, "nnodes"), (1, 2, 2000, "nnodes")])
def test_layouts_vllm_cannot_run_are_refused(tp, pp, nnodes, why):
    with pytest.raises(UsageError, match=why):
        gang_layout(tp, pp, nnodes)


def test_a_gang_takes_the_parallel_sizes_deploy_and_plan_files_take():
    """One bound per key (limits.yaml plan.parallel_size, plan.nodes)."""
    from cluster.base.bounds import bound

    most = bound("plan", "parallel_size")
    assert gang_layout(most, 1, 1).world == most
    with pytest.raises(UsageError, match="tensor_parallel_size"):
        gang_layout(most + 1, 1, 1)
    with pytest.raises(UsageError, match="pipeline_parallel_size"):
        nodes_needed(1, most + 1, 8)
    with pytest.raises(UsageError, match="nnodes"):
        gang_layout(1, 1, bound("plan", "nodes") + 1)


@pytest.mark.parametrize("tp, pp, per_node, expected", [
    (1, 2, 2, 1), (1, 2, 1, 2), (4, 2, 4, 2), (8, 4, 8, 4), (2, 4, 4, 2)])
def test_nodes_needed_keeps_tp_inside_nodes(tp, pp, per_node, expected):
    assert nodes_needed(tp, pp, per_node) == expected


def test_nodes_needed_spans_whole_nodes_with_a_tp_group_larger_than_a_node():
    """TP 4 on 2-worker nodes: 2 whole nodes per TP group, as gang_layout runs it (and as
    the fabric proof places it: one rule)."""
    assert nodes_needed(4, 1, 2) == 2
    assert gang_layout(4, 1, 2).tp_split


def test_nodes_needed_refuses_what_no_node_count_splits():
    with pytest.raises(UsageError, match="does not fit"):
        nodes_needed(3, 1, 2, dp=2)         # 2 ranks per node never hold a DP rank of TP 3


def test_gang_bundles_one_per_node_rank_with_the_replica_share_in_bundle_0():
    layout = gang_layout(tp=4, pp=2, nnodes=2)
    assert gang_bundles(layout, {"GPU": 1, "CPU": 1}, {"CPU": 1}) == [
        {"GPU": 4.0, "CPU": 5.0}, {"GPU": 4.0, "CPU": 4.0}]


def test_pick_port_skips_taken_and_busy_ports_and_says_when_the_range_is_used_up():
    assert pick_port(29500, 29503, taken=[29500], is_free=lambda p: p != 29501) == 29502
    with pytest.raises(UsageError, match="29500-29501"):
        pick_port(29500, 29501, is_free=lambda p: False)


# ---------------------------------------------------------------- serve_apps/config.py


def _gang_args(**engine):
    return {"model_loading_config": {"model_id": "m", "model_source": "/m"},
            "engine_kwargs": {"pipeline_parallel_size": 2, "nnodes": 2, **engine},
            "multi_node": {"port_min": 29500, "port_max": 29510,
                           "node_env": {"10.0.0.2": {"VLLM_HOST_IP": "10.0.0.2"}}}}


def test_a_gang_is_strict_spread_one_bundle_per_node_and_the_replica_holds_bundle_0():
    config = parse_app_args(_gang_args())
    options = serve_deployment_options(config, "cpu")
    assert options["placement_group_strategy"] == "STRICT_SPREAD"
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert options["ray_actor_options"]["num_cpus"] == 1.0
    assert options["health_check_period_s"] == 5
    assert engine_kwargs_for(config, "cpu")["distributed_executor_backend"] == "mp"


def test_a_gpu_gang_replica_claims_its_nodes_gpus():
    config = parse_app_args(_gang_args(tensor_parallel_size=4))
    options = serve_deployment_options(config, "gpu")
    assert options["placement_group_bundles"] == [{"GPU": 4.0, "CPU": 5.0},
                                                  {"GPU": 4.0, "CPU": 4.0}]
    assert options["ray_actor_options"]["num_gpus"] == 4.0
    assert engine_kwargs_for(config, "gpu")["distributed_executor_backend"] == "mp"


@pytest.mark.parametrize("change, why", [
    ({"executor": "ray"}, "native multi-node"),
    ({"engine_kwargs": {"pipeline_parallel_size": 3, "nnodes": 2}}, "do not split"),
    ({"engine_kwargs": {"master_port": 1}}, "set by the app"),
    ({"multi_node": {"port_min": 30000, "port_max": 29000}}, "port_min 30000 > port_max"),
    ({"multi_node": {"port_min": 80}}, "1024..65535"),
    ({"multi_node": {"watch_timeout_s": float("nan")}}, "watch_timeout_s"),
    ({"multi_node": {"node_env": {"10.0.0.2": {"bad name": "x"}}}}, "node_env"),
    ({"executor": "threads"}, "executor")])
def test_gang_args_that_cannot_run_are_refused(change, why):
    args = _gang_args()
    args.update(change)
    with pytest.raises(AppConfigError, match=why):
        parse_app_args(args)


def test_auto_executor_is_ray_on_one_gpu_node_and_native_on_cpu():
    one = {"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"tensor_parallel_size": 2}}
    assert engine_kwargs_for(parse_app_args(one), "gpu")["distributed_executor_backend"] == "ray"
    assert engine_kwargs_for(parse_app_args(one), "cpu")["distributed_executor_backend"] == "mp"
    native = dict(one, executor="native")
    assert engine_kwargs_for(parse_app_args(native), "gpu")["distributed_executor_backend"] == "mp"


# ---------------------------------------------------------------- cluster deploy


def test_deploy_pp2_nnodes2_on_cpu_writes_a_gang_with_each_nodes_env():
    spec = deploy.spec_from_flags(MODEL, pp=2, nnodes=2)
    app, notes, preview = build(spec)
    args = app["args"]
    assert args["engine_kwargs"]["nnodes"] == 2 and args["executor"] == "auto"
    assert args["multi_node"]["port_min"] == 29500 and args["multi_node"]["port_max"] == 29599
    assert args["multi_node"]["node_env"]["10.0.0.2"] == {
        "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1", "VLLM_HOST_IP": "10.0.0.2"}
    env = args["runtime_env"]["env_vars"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"    # one worker on each 2-CPU node
    assert env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "60"
    assert preview["strategy"] == "STRICT_SPREAD" and len(preview["bundles_per_replica"]) == 2
    assert any("multi-node engine: 2 nodes x 1 ranks" in n for n in notes)


def test_deploy_picks_the_fewest_nodes_when_a_cpu_engine_is_larger_than_a_node():
    app = build(deploy.spec_from_flags(MODEL, tp=2, pp=2))[0]
    assert app["args"]["engine_kwargs"]["nnodes"] == 2
    app = build(deploy.spec_from_flags(MODEL, tp=2), cluster_of(("10.0.0.1", 2, 0)))[0]
    assert "nnodes" not in app["args"]["engine_kwargs"]


def test_deploy_on_one_gpu_node_keeps_vllms_ray_executor_unless_native_is_asked():
    app = build(deploy.spec_from_flags(MODEL, tp=4), GPU2x4)[0]
    assert "nnodes" not in app["args"]["engine_kwargs"] and "multi_node" not in app["args"]
    app = build(deploy.spec_from_flags(MODEL, tp=4, pp=2, nnodes=2), GPU2x4)[0]
    assert app["args"]["engine_kwargs"]["nnodes"] == 2


@pytest.mark.parametrize("kwargs, why", [
    ({"pp": 3, "nnodes": 2}, "do not split"), ({"pp": 2, "nnodes": 2, "executor": "ray"},
                                               "--executor ray"),
    ({"executor": "x"}, "--executor")])
def test_deploy_refuses_gang_flags_vllm_cannot_run(kwargs, why):
    with pytest.raises(UsageError, match=why):
        deploy.spec_from_flags(MODEL, **kwargs)


def test_engine_args_cannot_set_the_gang_keys():
    with pytest.raises(UsageError, match="set by `cluster deploy`"):
        deploy.spec_from_flags(MODEL, engine_args={"master_port": 1})


def test_inventory_vllm_port_range_is_validated():
    base = "nodes: [{name: a, role: head, address: 10.0.0.1}]\n"
    inv = load_inventory(base + "ray: {vllm_port_min: 31500, vllm_port_max: 31510}\n")
    assert (inv.ray.vllm_port_min, inv.ray.vllm_port_max) == (31500, 31510)
    for bad in ("{vllm_port_min: 30010, vllm_port_max: 30000}", "{vllm_port_min: 10500}",
                "{vllm_port_max: 70000}"):
        with pytest.raises(Exception, match="vllm_port"):
            load_inventory(base + f"ray: {bad}\n")


# ---------------------------------------------------------------- cluster status: ranks


def _details(replica_state="RUNNING"):
    return {"applications": {"gang": {
        "status": "RUNNING", "route_prefix": "/gang",
        "deployed_app_config": {"args": {"engine_kwargs": {"nnodes": 2}}},
        "deployments": {"vllm-m": {"status": "HEALTHY", "replicas": [
            {"replica_id": "r1", "state": replica_state, "node_ip": "10.0.0.1", "pid": 11}]}}}}}


def test_status_lists_both_ranks_of_a_gang_replica():
    actors = [{"name": rank_actor_name("gang", "r1", 1), "state": "ALIVE", "pid": 22,
               "node_id": "n2", "ray_namespace": "cluster-gang"}]
    app = serve_applications(_details(), actors, {"n2": "10.0.0.2"},
                             {"10.0.0.1": "gpu1", "10.0.0.2": "gpu2"})["gang"]
    assert app["replicas"][0]["ranks"] == [
        {"rank": 0, "node": "gpu1", "node_ip": "10.0.0.1", "pid": 11, "state": "running"},
        {"rank": 1, "node": "gpu2", "node_ip": "10.0.0.2", "pid": 22, "state": "running"}]
    assert app["broken_ranks"] == []


def test_status_names_a_dead_or_missing_rank_and_the_replica_it_takes_down():
    dead = [{"name": rank_actor_name("gang", "r1", 1), "state": "DEAD", "pid": 22,
             "node_id": "n2", "ray_namespace": "cluster-gang"}]
    app = serve_applications(_details(), dead, {"n2": "10.0.0.2"}, {"10.0.0.2": "gpu2"})["gang"]
    assert [(b["replica_id"], b["rank"], b["node"], b["state"]) for b in app["broken_ranks"]] \
        == [("r1", 1, "gpu2", "dead")]
    app = serve_applications(_details(), [], {}, {})["gang"]
    assert [(b["rank"], b["state"]) for b in app["broken_ranks"]] == [(1, "missing")]
    # a replica still starting has no broken ranks yet
    assert serve_applications(_details("STARTING"), [], {}, {})["gang"]["broken_ranks"] == []


def test_capacity_check_counts_a_gang_per_node_rank():
    spec = deploy.spec_from_flags(MODEL, tp=2, pp=2, nnodes=2)
    _, _, preview = build(spec)
    assert deploy.capacity_problems(preview, CPU2) == []
    one_node = cluster_of(("10.0.0.1", 2, 0))
    assert any("spans 2 nodes" in p for p in deploy.capacity_problems(preview, one_node))
    small = cluster_of(("10.0.0.1", 1, 0), ("10.0.0.2", 1, 0))
    assert any("needs 2 CPU on one node" in p for p in deploy.capacity_problems(preview, small))


# ---------------------------------------------------------------- rollouts know gangs


def _gang_details():
    """App `gang` (replica r1 on node n1, its node rank 1 on n2, STRICT_SPREAD 2 x 2 CPU)
    and app `single` (one replica on n2)."""
    return {"applications": {
        "gang": {"status": "RUNNING", "deployments": {"vllm-m": {
            "target_num_replicas": 1,
            "deployment_config": {"placement_group_bundles": [{"CPU": 2}, {"CPU": 2}],
                                  "placement_group_strategy": "STRICT_SPREAD"},
            "replicas": [{"replica_id": "r1", "state": "RUNNING", "node_id": "n1"}]}}},
        "single": {"status": "RUNNING", "deployments": {"vllm-s": {
            "target_num_replicas": 1,
            "deployment_config": {"placement_group_bundles": [{"CPU": 1}]},
            "replicas": [{"replica_id": "s1", "state": "RUNNING", "node_id": "n2"}]}}}}}


RANKS = ({"name": rank_actor_name("gang", "r1", 1), "state": "ALIVE", "node_id": "n2",
          "pid": 7, "ray_namespace": "cluster-gang"},
         {"name": rank_actor_name("gang", "r0", 1), "state": "DEAD", "node_id": "n2",
          "pid": 5, "ray_namespace": "cluster-gang"})


def test_draining_a_node_with_a_remote_rank_names_the_app_losing_a_whole_replica():
    from cluster.ray.ray_state import RayState
    from cluster.ray.rollout import gang_replicas_on, replicas_lost_with
    from playbooks.drain import RolloutOutcome

    assert gang_replicas_on(_gang_details(), RANKS, "n2") == [
        {"app": "gang", "deployment": "vllm-m", "replica_id": "r1", "state": "RUNNING",
         "rank": 1}]
    assert gang_replicas_on(_gang_details(), RANKS, "n1") == []
    state = RayState("dashboard", "2.60.0", (), _gang_details(), rank_actors=RANKS)
    out = RolloutOutcome("drain", "node2")
    out.moved_replicas = replicas_lost_with(state, "n2")
    doc = out.to_dict()
    assert doc["apps_losing_replicas"] == ["gang", "single"]
    assert [r["replica_id"] for r in doc["gang_replicas"]] == ["r1"]


def test_capacity_check_counts_every_bundle_of_a_gang_on_distinct_nodes():
    from cluster.ray.rollout import app_demands, capacity_without

    demands = app_demands(_gang_details())
    gang = [d for d in demands if d.app == "gang"]
    assert gang[0].cpus == 4 and gang[0].strategy == "STRICT_SPREAD"
    # 6 CPUs are left in all, but the gang's two bundles need two distinct nodes
    verdict = capacity_without(gang, [("node1", {"CPU": 6})])
    assert not verdict.ok and "fit on no remaining node" in verdict.problems[0]
    assert capacity_without(gang, [("node1", {"CPU": 2}), ("node3", {"CPU": 2})]).ok


def test_dense_dp2_of_pp2_gangs_is_two_replicas_each_its_own_strict_spread_group():
    spec = deploy.spec_from_flags(MODEL, pp=2, dp=2, nnodes=2)
    app, _, preview = build(spec, cluster_of(("10.0.0.1", 2, 0), ("10.0.0.2", 2, 0),
                                             ("10.0.0.3", 2, 0), ("10.0.0.4", 2, 0)))
    assert app["args"]["deployment_config"] == {"num_replicas": 2}
    assert preview["num_replicas"] == 2 and preview["strategy"] == "STRICT_SPREAD"
    # Serve reserves one placement group per replica: these bundles, each on its own node
    assert preview["bundles_per_replica"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert "gang" not in preview      # not MoE gang scheduling: replicas are independent
    assert deploy.capacity_problems(preview, CPU2) == []


def test_rank_join_ignores_hostile_actor_fields():
    actors = [{"name": rank_actor_name("gang", "r1", 1), "state": "ALIVE", "pid": "1; rm",
               "node_id": ["x"], "ray_namespace": "cluster-gang"},
              {"name": 7, "state": None, "pid": True, "node_id": None, "ray_namespace": "other"}]
    (replica,) = serve_applications(_details(), actors, {}, {})["gang"]["replicas"]
    assert replica["ranks"][1] == {"rank": 1, "node": None, "node_ip": None, "pid": None,
                                   "state": "running"}


# ---------------------------------------------------------------- a replaced gang (issue 42 item 3)


def _bundles(*ips):
    return [{"index": i, "node_id": f"id-{ip}", "node_ip": ip, "resources": {"CPU": 1.0}}
            for i, ip in enumerate(ips)]


def test_a_new_gang_proves_the_groups_of_its_own_nodes_before_its_engine():
    from serve_apps.gang_proof import gang_proof_plan, proof_args, slot_options

    config = parse_app_args(_gang_args())
    # the gang rebuilt on node1 and node3 (node2 cordoned): the proof is of those two nodes
    plan = gang_proof_plan(config, _bundles("10.0.0.1", "10.0.0.3"), "cpu")
    assert plan.backend == "gloo"
    assert [(g.kind, g.nodes) for g in plan.groups] == [("pp", ("10.0.0.1", "10.0.0.3"))]
    assert all(29500 <= p <= 29510 for p in plan.ports)
    assert [o["bundle_index"] for o in slot_options(plan, _bundles("10.0.0.1", "10.0.0.3"), [])] \
        == [0, 1]
    args = proof_args(plan, 1e10)            # what nccl_allreduce.run_groups runs
    assert args.backend == "gloo" and args.groups["groups"][0]["members"] == [0, 1]
    assert [n["ip"] for n in args.nodes] == ["10.0.0.1", "10.0.0.3"]


def test_a_gpu_gang_proof_gives_bundle_0_the_replicas_gpus_and_the_others_one_gpu_each():
    from serve_apps.gang_proof import gang_proof_plan, slot_options

    config = parse_app_args(_gang_args(tensor_parallel_size=2))
    bundles = _bundles("10.0.0.1", "10.0.0.3")
    plan = gang_proof_plan(config, bundles, "gpu")
    assert plan.backend == "nccl"
    assert {(g.kind, g.nodes) for g in plan.groups} >= {("tp", ("10.0.0.1",)),
                                                         ("tp", ("10.0.0.3",))}
    options = slot_options(plan, bundles, ["4", "5"])
    assert [(o["bundle_index"], o["num_gpus"], o["env"]) for o in options] == [
        (0, 0, {"CUDA_VISIBLE_DEVICES": "4"}), (0, 0, {"CUDA_VISIBLE_DEVICES": "5"}),
        (1, 1, {}), (1, 1, {})]


def test_a_failed_group_of_the_proof_fails_the_replica_naming_the_group_and_its_nodes():
    from serve_apps.gang_proof import gang_proof_plan, proof_problem

    plan = gang_proof_plan(parse_app_args(_gang_args()), _bundles("10.0.0.1", "10.0.0.3"), "cpu")
    assert proof_problem(plan, {"ok": True, "groups": [{"ok": True}]}) is None
    why = proof_problem(plan, {"ok": False, "groups": [
        {"ok": False, "problems": ["rank 1 on 10.0.0.3: join: timed out"]}]})
    assert why.startswith("fabric proof of the new gang failed: pp r0 [0,1] on 10.0.0.1, "
                          "10.0.0.3 (gloo): rank 1 on 10.0.0.3: join: timed out"), why
    assert "not run" in proof_problem(plan, {"ok": False, "groups": [],
                                             "problems": ["RuntimeError: no worker"]})


@pytest.mark.ray
def test_ray_places_no_new_gang_bundle_on_a_draining_node():
    """What the replacement of a gang on a cordoned node relies on (issue 42 item 3): Ray leaves
    a node it drains (the health job's cordon: `ray drain-node`, reason preemption) out of new
    placement groups, so a new gang's STRICT_SPREAD group lands on the other nodes only."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2
    from ray.util.placement_group import (placement_group, placement_group_table,
                                          remove_placement_group)

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        workers = [cluster.add_node(num_cpus=1, resources={"rank": 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
            workers[1].node_id, autoscaler_pb2.DrainNodeReason.Value(
                "DRAIN_NODE_REASON_PREEMPTION"), "cluster health: gpu_lost", 0)
        assert accepted, why
        gang = placement_group([{"rank": 1}, {"rank": 1}], strategy="STRICT_SPREAD")
        assert not gang.wait(10)                  # two nodes needed, one left: pending
        remove_placement_group(gang)
        for _ in range(3):
            one = placement_group([{"rank": 1}])
            assert one.wait(30)
            assert placement_group_table(one)["bundles_to_node_id"][0] == workers[0].node_id
            remove_placement_group(one)
    finally:
        ray.shutdown()
        cluster.shutdown()
