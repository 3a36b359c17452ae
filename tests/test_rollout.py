"""Rolling operations, pure parts: batches for --serial, the order and stop-on-failure of
serial up/down (with a recording executor), the apps' demand from Serve's details, and the
capacity verdict restart-node uses."""

from __future__ import annotations

import json

import pytest

from cluster.nodes import inventory
from cluster.ray import rollout
from playbooks import drain
from cluster.ray.ray_cluster import (CHANGED, FAILED, KEEP, RESTART, START, STOP, NodeAction,
                                 RayActionPlan, StepResult)
from fakes import write_inventory


@pytest.fixture
def inv(tmp_path):
    nodes = [{"name": "node1", "role": "head", "address": "10.0.0.1"}] + \
        [{"name": f"node{i}", "address": f"10.0.0.{i}"} for i in range(2, 7)]
    path = write_inventory(tmp_path, json.dumps({"nodes": nodes}))
    return inventory.load(str(path))


def test_batches():
    assert rollout.batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert rollout.batches([1, 2, 3], 0) == [[1, 2, 3]]
    assert rollout.batches([1, 2, 3], 5) == [[1, 2, 3]]
    assert rollout.batches([], 2) == []


class Recorder:
    """Stands in for execute_up/execute_down: records each call's changing nodes."""

    def __init__(self, fail: set[str] = frozenset()):
        self.calls: list[list[str]] = []
        self.fail = fail

    def __call__(self, plan, session, inventory, *rest):
        self.calls.append([a.node for a in plan.actions if a.changes])
        return tuple(StepResult(a.node, a.kind, (FAILED if a.node in self.fail else CHANGED)
                                if a.changes else "ok", "x") for a in plan.actions)


def _up_plan(inv, head_kind=KEEP):
    actions = [NodeAction("node1", head_kind, "h", ("start",) if head_kind != KEEP else ())]
    actions += [NodeAction(n.name, START, "w", ("start",)) for n in inv.workers]
    return RayActionPlan("up", tuple(actions))


def test_serial_up_runs_the_workers_in_batches_head_with_the_first(inv):
    rec = Recorder()
    steps = rollout.execute_up_serial(_up_plan(inv, START), None, inv, 2, execute=rec)
    assert rec.calls == [["node1", "node2", "node3"], ["node4", "node5"], ["node6"]]
    assert [s.node for s in steps] == ["node1", "node2", "node3", "node4", "node5", "node6"]
    assert all(s.status == CHANGED for s in steps)


def test_serial_up_stops_at_the_first_failed_batch(inv):
    rec = Recorder(fail={"node4"})
    steps = {s.node: s for s in rollout.execute_up_serial(_up_plan(inv), None, inv, 2,
                                                          execute=rec)}
    assert rec.calls == [["node2", "node3"], ["node4", "node5"]]
    assert steps["node4"].status == FAILED and steps["node5"].status == CHANGED
    assert steps["node6"].status == "skipped" and "batch 2 failed" in steps["node6"].message


def test_serial_zero_is_the_plain_parallel_run(inv):
    rec = Recorder()
    rollout.execute_up_serial(_up_plan(inv), None, inv, 0, execute=rec)
    assert rec.calls == [["node2", "node3", "node4", "node5", "node6"]]


def _down_plan(inv):
    actions = [NodeAction(n.name, STOP, "w", ("ray stop",)) for n in inv.workers]
    actions.append(NodeAction("node1", STOP, "h", ("ray stop",)))
    return RayActionPlan("down", tuple(actions))


def test_serial_down_workers_in_batches_then_the_head(inv):
    rec = Recorder()
    steps = rollout.execute_down_serial(_down_plan(inv), None, inv, 3, execute=rec)
    assert rec.calls == [["node2", "node3", "node4"], ["node5", "node6"], ["node1"]]
    assert len(steps) == 6


def test_serial_down_failure_keeps_the_head_running(inv):
    rec = Recorder(fail={"node2"})
    steps = {s.node: s for s in rollout.execute_down_serial(_down_plan(inv), None, inv, 2,
                                                            execute=rec)}
    assert rec.calls == [["node2", "node3"]]
    assert steps["node1"].status == "skipped" and steps["node6"].status == "skipped"


SERVE = {"applications": {
    "llama": {"status": "RUNNING", "deployments": {"LLMServer": {
        "status": "HEALTHY", "target_num_replicas": 2,
        "deployment_config": {"num_replicas": 2, "placement_group_strategy": "STRICT_PACK",
                              "placement_group_bundles": [{"CPU": 1, "GPU": 1}, {"GPU": 1}]},
        "replicas": [{"replica_id": "a", "state": "RUNNING", "node_id": "n2"},
                     {"replica_id": "b", "state": "RUNNING", "node_id": "n3"}]}}},
    "echo": {"status": "RUNNING", "deployments": {"Echo": {
        "status": "HEALTHY", "deployment_config": {"num_replicas": 1,
                                                   "ray_actor_options": {"num_cpus": 0.5}},
        "replicas": [{"replica_id": "c", "state": "RUNNING", "node_id": "n2"}]}}},
}}


def test_app_demands_from_serve_details():
    demands = rollout.app_demands(SERVE)
    assert [(d.app, d.gpus, d.cpus, d.strategy) for d in demands] == [
        ("llama", 2.0, 1.0, "STRICT_PACK"), ("llama", 2.0, 1.0, "STRICT_PACK"),
        ("echo", 0.0, 0.5, "PACK")]
    assert rollout.app_demands(None) == []
    assert [r["replica_id"] for r in rollout.replicas_on(SERVE, "n2")] == ["a", "c"]


def test_capacity_enough():
    cap = rollout.capacity_without(rollout.app_demands(SERVE),
                                   [("node1", {"CPU": 2, "GPU": 2}), ("node3", {"CPU": 2, "GPU": 2})])
    assert cap.ok and cap.needed_gpus == 4 and cap.available_gpus == 4
    assert "need 4 GPUs" in cap.summary()


def test_capacity_short_of_gpus_gives_the_numbers():
    cap = rollout.capacity_without(rollout.app_demands(SERVE), [("node1", {"CPU": 8, "GPU": 2})])
    assert not cap.ok
    assert cap.problems == ("GPUs: 4 needed, 2 on the other alive nodes",)


def test_capacity_totals_fit_but_strict_pack_does_not():
    """4 GPUs in total, but each replica needs 2 GPUs on one node: 1+1+1+1 cannot hold them."""
    cap = rollout.capacity_without(rollout.app_demands(SERVE),
                                   [(f"n{i}", {"CPU": 2, "GPU": 1}) for i in range(4)])
    assert not cap.ok and "fit on no remaining node" in cap.problems[0]


def test_capacity_strict_spread_needs_distinct_nodes():
    d = [rollout.Demand("a", "d", ({"GPU": 1}, {"GPU": 1}), "STRICT_SPREAD")]
    assert not rollout.capacity_without(d, [("n1", {"GPU": 2})]).ok
    assert rollout.capacity_without(d, [("n1", {"GPU": 1}), ("n2", {"GPU": 1})]).ok


def test_no_apps_always_fits():
    assert rollout.capacity_without([], []).ok


def test_drain_and_restart_refuse_the_head(inv):
    from cluster.base.errors import UsageError
    with pytest.raises(UsageError, match="head"):
        drain.drain(None, inv, "node1", dry_run=True, confirm=lambda q: True)


def test_a_rebuild_config_changes_the_code_version_and_nothing_the_app_serves():
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    live = {"name": "g", "import_path": "serve_apps.vllm_app:build", "route_prefix": "/g",
            "args": {"model": "m"}, "runtime_env": {"env_vars": {"A": "1"}},
            "deployments": [{"name": "LLM", "max_ongoing_requests": 4}]}
    new = rollout.rebuild_config(live, "LLM", 3, "node2@5")
    assert new["args"] == live["args"] and new["route_prefix"] == "/g"
    assert new["runtime_env"] == {"env_vars": {"A": "1", rollout.REBUILD_ENV: "node2@5"}}
    # one replica at a time, the new one started first (Serve's max_surge_percent)
    assert new["deployments"] == [{"name": "LLM", "max_ongoing_requests": 4,
                                   rollout.SURGE_KEY: 1, rollout.ROLLOUT_KEY: 0.5}]
    assert rollout.serve_surge(1, 3) == 1
    assert live["runtime_env"] == {"env_vars": {"A": "1"}}          # the input is not changed
    assert get_app_code_version(ServeApplicationSchema(**new)) != \
        get_app_code_version(ServeApplicationSchema(**live))
    again = rollout.rebuild_config(new, "LLM", 3, "node2@9")
    assert again["deployments"] == new["deployments"]               # one entry, not two


def test_room_for_a_replacement_counts_a_second_gang_beside_everything_running():
    details = {"applications": {"gang": {"deployments": {"LLM": {
        "target_num_replicas": 1,
        "deployment_config": {"placement_group_strategy": "STRICT_SPREAD",
                              "placement_group_bundles": [{"GPU": 1, "CPU": 1}, {"GPU": 1}]}}}},
        "small": {"deployments": {"LLM": {"target_num_replicas": 2, "deployment_config": {
            "ray_actor_options": {"num_gpus": 1}}}}}}}
    gang = [{"app": "gang", "deployment": "LLM"}]
    roomy = [("n1", {"GPU": 3, "CPU": 8}), ("n3", {"GPU": 3, "CPU": 8})]
    assert rollout.room_for_replacements(details, gang, roomy).ok
    tight = [("n1", {"GPU": 2, "CPU": 8}), ("n3", {"GPU": 2, "CPU": 8})]
    assert rollout.capacity_without(rollout.app_demands(details), tight).ok
    room = rollout.room_for_replacements(details, gang, tight)
    assert not room.ok and "GPUs: 6 needed, 4" in room.problems[0]
    one = [("n1", {"GPU": 8, "CPU": 8})]                    # STRICT_SPREAD needs two nodes
    assert not rollout.room_for_replacements(details, gang, one).ok
