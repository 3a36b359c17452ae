"""health.act: the inventory's policy, the finding classes read from real captures, the pure
policy and each of its guards (each test fails without its guard), the records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.base.errors import InventoryError
from cluster.nodes import inventory as inv_mod
from cluster.ray import health_act as act
from cluster.ray import health_job as h
from cluster.ray.rollout import Demand
from fakes import simulated_tools_path



def _inventory(extra: str = "") -> inv_mod.Inventory:
    return inv_mod.loads("nodes:\n  - {name: node1, address: 198.18.0.1, role: head}\n"
                         "  - {name: node2, address: 198.18.0.2}\n"
                         "  - {name: node3, address: 198.18.0.3}\n%s" % extra)


# ---------------------------------------------------------------- the inventory's health.act


def test_defaults_cordon_lost_gpus_and_ecc_and_report_the_rest():
    policy = _inventory().health.act
    assert policy.actions == {"gpu_lost": "cordon", "ecc_uncorrectable": "cordon",
                              "gpu_missing": "report", "ib_port_down": "report",
                              "clock_offset": "report", "missed_periods": "report"}
    assert policy.confirm["gpu_lost"] == 1 and policy.confirm["gpu_missing"] == 2
    assert policy.max_cordons == 1 and policy.window_s == 3600.0


def test_the_inventory_overrides_each_key_and_keeps_the_other_defaults():
    policy = _inventory("health:\n  act: {gpu_lost: report, clock_offset: cordon, max_cordons: 2,"
                        " window_s: 60, confirm_readings: {gpu_missing: 3}}\n").health.act
    assert policy.actions["gpu_lost"] == "report" and policy.actions["clock_offset"] == "cordon"
    assert policy.actions["ecc_uncorrectable"] == "cordon"
    assert (policy.max_cordons, policy.window_s, policy.confirm["gpu_missing"]) == (2, 60.0, 3)
    assert policy.confirm["gpu_lost"] == 1


@pytest.mark.parametrize("bad", ["{gpu_lost: drain}", "{gpu_gone: cordon}", "{max_cordons: -1}",
                                 "{max_cordons: 1.5}", "{window_s: .inf}", "{window_s: 0}",
                                 "{missed_after: 0}", "{confirm_readings: {gpu_lost: 0}}",
                                 "{confirm_readings: {nope: 1}}", "[cordon]", "{move_wait_s: true}"])
def test_a_wrong_act_value_names_its_key(bad):
    with pytest.raises(InventoryError, match="health.act"):
        _inventory(f"health:\n  act: {bad}\n")


def test_the_job_config_carries_the_policy_both_ways():
    inv = _inventory("health:\n  act: {gpu_missing: cordon}\n")
    cfg = h.JobConfig.from_dict(h.job_config(inv).to_dict())
    assert cfg.act == inv.health.act and cfg.head == "node1"


# ---------------------------------------------------------------- finding classes on real captures



@pytest.mark.parametrize("profile,classes", [("h100-ib", set()),
                                             ("h100-xid79", {"gpu_lost"}),
                                             ("h100-gpu-lost", {"gpu_lost", "gpu_missing"}),
                                             ("h100-7gpu", {"gpu_missing"}),
                                             ("h100-remap-pending", {"ecc_uncorrectable"}),
                                             ("h100-clock-off", {"clock_offset"})])
def test_the_reader_names_the_finding_classes_of_real_captures(tmp_path, monkeypatch, profile,
                                                               classes):
    from cluster.ray_jobs.health_runner import read_node

    monkeypatch.setenv("PATH", simulated_tools_path(tmp_path, profile))
    cfg = h.job_config(_inventory("expectations: {gpus_per_node: 8}\n"))
    readings = read_node(cfg, "node2")
    seen = act.observe("node2", "id2", readings, 0.0)
    assert set(seen.findings) == classes
    if profile == "h100-xid79":
        assert "Xid 79" in seen.findings["gpu_lost"]
    # the findings survive the readings file
    doc = h.readings_document({"node2": {r.check: r for r in readings}}, {}, 1.0)
    back = h.parse_readings(__import__("json").dumps(doc)).readings["node2"]
    assert set(act.observe("node2", "id2", back.values(), 0.0).findings) == classes


@pytest.mark.parametrize("profile,ib,classes", [
    ("h100-ib-port-down", "{required: true}", {"ib_port_down"}),
    # every port Active, the check fails for their rate: a slow link, not a port down
    ("h100-ib", "{required: true, min_rate_gbps: 800}", set())])
def test_an_ib_port_down_is_a_port_not_active_not_any_failed_ib_check(tmp_path, monkeypatch,
                                                                       profile, ib, classes):
    from cluster.ray_jobs.health_runner import read_node

    monkeypatch.setenv("PATH", simulated_tools_path(tmp_path, profile))
    cfg = h.job_config(_inventory(f"expectations: {{gpus_per_node: 8, infiniband: {ib}}}\n"))
    readings = {r.check: r for r in read_node(cfg, "node2")}
    assert readings["infiniband"].status == "fail", readings["infiniband"]
    assert set(act.observe("node2", "id2", readings.values(), 0.0).findings) == classes
    if classes:
        assert "Down" in act.observe("node2", "id2", readings.values(), 0.0).findings[
            "ib_port_down"]


# ---------------------------------------------------------------- the policy and its guards


GPU8 = {"GPU": 8.0, "CPU": 64.0}


def _obs(node: str, *classes: str, t: float = 0.0, node_id: str | None = None,
         missed: bool = False) -> act.Observation:
    return act.Observation(node, node_id or f"id-{node}", t,
                           {c: f"evidence of {c}" for c in classes}, missed,
                           "the node is not alive in Ray" if missed else "")


def _view(**kw) -> act.ClusterView:
    base = dict(now=1000.0, head="node1", nodes={"node1": GPU8, "node2": GPU8, "node3": GPU8})
    base.update(kw)
    return act.ClusterView(**base)


POLICY = inv_mod.default_act_policy()


def _actions(decisions):
    return {(d.node, d.finding): d.action for d in decisions}


def test_a_lost_gpu_is_cordoned_on_its_first_reading():
    out = act.decide({"node2": [_obs("node2", "gpu_lost")]}, _view(), POLICY)
    assert _actions(out) == {("node2", "gpu_lost"): "cordon"}


def test_a_transient_class_waits_for_its_second_consecutive_reading():
    policy = inv_mod.ActPolicy.from_dict({**POLICY.to_dict(),
                                          "act": {**POLICY.actions, "gpu_missing": "cordon"}})
    once = {"node2": [_obs("node2"), _obs("node2", "gpu_missing")]}
    assert act.decide(once, _view(), policy) == ()
    gap = {"node2": [_obs("node2", "gpu_missing"), _obs("node2"), _obs("node2", "gpu_missing")]}
    assert act.decide(gap, _view(), policy) == ()
    twice = {"node2": [_obs("node2", "gpu_missing"), _obs("node2", "gpu_missing")]}
    assert _actions(act.decide(twice, _view(), policy)) == {("node2", "gpu_missing"): "cordon"}
    # a reading of the node under another Ray node id (it rejoined) does not count
    moved = {"node2": [_obs("node2", "gpu_missing", node_id="old"), _obs("node2", "gpu_missing")]}
    assert act.decide(moved, _view(), policy) == ()


def test_never_the_head():
    out = act.decide({"node1": [_obs("node1", "gpu_lost")]}, _view(), POLICY)
    assert _actions(out) == {("node1", "gpu_lost"): "held"}
    assert "never the head" in out[0].reason


def test_at_most_max_cordons_within_the_window():
    both = {"node2": [_obs("node2", "gpu_lost")], "node3": [_obs("node3", "gpu_lost")]}
    out = act.decide(both, _view(nodes={f"node{i}": GPU8 for i in range(1, 5)}), POLICY)
    assert _actions(out) == {("node2", "gpu_lost"): "cordon", ("node3", "gpu_lost"): "held"}
    assert "rate limit" in out[1].reason
    # an earlier cordon inside the window counts; one outside does not
    one = {"node3": [_obs("node3", "gpu_lost")]}
    assert _actions(act.decide(one, _view(cordon_times=(900.0,)), POLICY)) == {
        ("node3", "gpu_lost"): "held"}
    assert _actions(act.decide(one, _view(cordon_times=(1000.0 - 3600.0,)), POLICY)) == {
        ("node3", "gpu_lost"): "cordon"}


def test_never_when_the_nodes_left_cannot_hold_the_apps_and_says_what_is_short():
    gang = Demand("big", "LLM", ({"GPU": 8.0, "CPU": 1.0},) * 2, "STRICT_SPREAD")
    out = act.decide({"node3": [_obs("node3", "gpu_lost")]},
                     _view(demands=(gang, Demand("small", "LLM", ({"GPU": 8.0, "CPU": 1.0},)))),
                     POLICY)
    assert _actions(out) == {("node3", "gpu_lost"): "held"}
    assert out[0].reason.startswith("capacity:") and "GPUs: 24 needed, 16" in out[0].reason
    # with room on the nodes left, the same finding cordons
    out = act.decide({"node3": [_obs("node3", "gpu_lost")]}, _view(demands=(gang,)), POLICY)
    assert _actions(out) == {("node3", "gpu_lost"): "cordon"}
    # a node cordoned before is no room either
    out = act.decide({"node3": [_obs("node3", "gpu_lost")]},
                     _view(demands=(gang,), cordoned=frozenset({"node2"}), cordon_times=(-9999.0,)),
                     POLICY)
    assert _actions(out) == {("node3", "gpu_lost"): "held"} and "capacity" in out[0].reason


def test_report_classes_and_cordoned_nodes_change_nothing():
    report_all = inv_mod.ActPolicy.from_dict({**POLICY.to_dict(), "act": {
        c: "report" for c in inv_mod.ACT_CLASSES}})
    out = act.decide({"node2": [_obs("node2", "gpu_lost", "ecc_uncorrectable")] * 2}, _view(),
                     report_all)
    assert _actions(out) == {("node2", "gpu_lost"): "report",
                             ("node2", "ecc_uncorrectable"): "report"}
    assert act.decide({"node2": [_obs("node2", "gpu_lost")]},
                      _view(cordoned=frozenset({"node2"})), POLICY) == ()


def test_ib_port_down_acts_only_on_a_node_holding_a_cross_node_gang_rank():
    policy = inv_mod.ActPolicy.from_dict({**POLICY.to_dict(), "act": {
        **POLICY.actions, "ib_port_down": "cordon"}})
    hist = {"node2": [_obs("node2", "ib_port_down"), _obs("node2", "ib_port_down")]}
    assert _actions(act.decide(hist, _view(), policy)) == {("node2", "ib_port_down"): "report"}
    assert _actions(act.decide(hist, _view(gang_nodes=frozenset({"node2"})), policy)) == {
        ("node2", "ib_port_down"): "cordon"}


def test_missed_periods_count_whole_periods_without_a_reading():
    hist = [_obs("node2", missed=True)] * 2
    assert act.decide({"node2": hist}, _view(), POLICY) == ()
    out = act.decide({"node2": hist + [_obs("node2", missed=True)]}, _view(), POLICY)
    assert _actions(out) == {("node2", "missed_periods"): "report"}
    assert "3 period" in out[0].evidence


def test_a_decision_is_recorded_once_while_its_finding_lasts():
    d = act.decide({"node2": [_obs("node2", "clock_offset")] * 2}, _view(), POLICY)
    new, seen = act.new_decisions(d, frozenset())
    assert new == d
    again, seen = act.new_decisions(d, seen)
    assert again == ()
    _, seen = act.new_decisions((), seen)           # it cleared
    assert act.new_decisions(d, seen)[0] == d        # and came back: recorded again


def test_records_round_trip_through_the_actions_file():
    import json

    rec = act.ActionRecord("node2", "gpu_lost", "gpu-health: Xid 79", "cordon", "health.act",
                           5.0, "id2", "moved", ({"app": "a", "replica_id": "r"},), ("g",), 12.34)
    doc = act.actions_document([rec] * 3, {"node2": {"node_id": "id2", "time": 5.0}}, 6.0, 2)
    back = h.parse_actions(json.dumps(doc))
    assert len(back["records"]) == 2 and back["records"][0]["move_s"] == 12.3
    assert back["cordoned"] == {"node2": {"node_id": "id2", "time": 5.0}}
    assert "1 replica(s), 1 gang(s) moved in 12.3 s" in rec.line()


# ---------------------------------------------------------------- the loop in the job (no Ray)


NODE_ID = {f"node{i}": ("%02x" % i) * 28 for i in (1, 2, 3)}


class _Ctx:
    gcs_address = "127.0.0.1:6379"


class _Ray:
    """What the remedy calls of Ray: the GCS address, named actors, kill."""

    def __init__(self):
        self.killed = []

    def get_runtime_context(self):
        return _Ctx()

    def get_actor(self, name, namespace=None):
        return (name, namespace)

    def kill(self, actor):
        self.killed.append(actor)
        for hook in getattr(self, "on_kill", ()):
            hook(actor)


class _Cluster:
    """Serve's details and the rank actors as the dashboard answers them; a drain moves every
    replica and rank off the drained node (what Serve does), after `moves_after` reads."""

    def __init__(self, gang_on: str = "node2", gang_home: str = "node1"):
        def rep(rid, node):
            return {"replica_id": rid, "node_id": NODE_ID[node], "state": "RUNNING"}
        self.serve = {"applications": {
            "small": {"status": "RUNNING", "deployments": {"LLM": {
                "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_gpus": 1}},
                "replicas": [rep("s1", "node2"), rep("s2", "node3")]}}},
            "gang": {"status": "RUNNING", "deployments": {"LLM": {
                "deployment_config": {"num_replicas": 1, "placement_group_strategy":
                                      "STRICT_SPREAD", "placement_group_bundles":
                                      [{"GPU": 1, "CPU": 1}, {"GPU": 1}]},
                "replicas": [rep("g1", gang_home)]}}}}}
        self.ranks = [{"name": "gang/g1/rank1", "state": "ALIVE", "pid": 1,
                       "node_id": NODE_ID[gang_on], "ray_namespace": "ranks"}]
        self.drained, self.rolled = [], []
        self.reads, self.replaced_at = 0, 0
        self.roll_answer = (True, "rolled")

    def serve_and_ranks(self):
        self.reads += 1
        if self.reads == self.replaced_at:      # Serve has replaced the broken gang's replica
            self.serve["applications"]["gang"]["deployments"]["LLM"]["replicas"][0][
                "replica_id"] = "g2"
        return json.loads(json.dumps(self.serve)), [dict(a) for a in self.ranks]

    def roll(self, app, deployment, nonce):
        """Serve rolls the app: its gang's new replica runs (from the next read on) before the
        old one stops."""
        self.rolled.append((app, deployment, nonce))
        if self.roll_answer[0]:
            self.replaced_at = self.replaced_at or self.reads + 1
        return self.roll_answer

    def drain(self, gcs, node_id, message, deadline_s):
        self.drained.append((gcs, node_id, message, deadline_s))
        for app in self.serve["applications"].values():
            for dep in app["deployments"].values():
                for r in dep["replicas"]:
                    if r["node_id"] == node_id:
                        r["node_id"] = NODE_ID["node1"]
        for a in self.ranks:
            if a["node_id"] == node_id:
                a["node_id"] = NODE_ID["node3"]
        return True, "accepted"


def _readings(node, *classes, status="fail"):
    return [h.Reading(node, "gpu-health", status, 1.0, "x", 0.0,
                      tuple((c, f"Xid 79 on 0000:3d:00 ({c})") for c in classes))]


def _remedy(tmp_path, extra="", start=lambda work, name: work(), cluster=None):
    from cluster.ray_jobs.health_remedy import Remedy

    cluster = cluster or _Cluster()
    ray = _Ray()
    # Serve replaces a gang's replica once its rank actor is killed (from the next read on)
    ray.on_kill = (lambda actor: setattr(cluster, "replaced_at",
                                         cluster.replaced_at or cluster.reads + 1),)
    cfg = h.job_config(_inventory(extra))
    remedy = Remedy(ray, cfg, str(tmp_path / h.ACTIONS_FILE), reads=cluster,
                    drain=cluster.drain, roll=cluster.roll, clock=lambda: 1000.0,
                    sleep=lambda s: None, start=start)
    return remedy, cluster, ray


ALIVE = {NODE_ID[n]: n for n in ("node1", "node2", "node3")}
RESOURCES = {n: {"GPU": 8.0, "CPU": 64.0} for n in ("node1", "node2", "node3")}
# room for the apps on the two nodes that stay (2 small + 2 gang GPUs), none for a second gang
TIGHT = {n: {"GPU": 2.0, "CPU": 64.0} for n in ("node1", "node2", "node3")}


def test_a_lost_gpu_drains_the_node_replaces_its_gang_and_keeps_a_record(tmp_path):
    import json as _json

    remedy, cluster, ray = _remedy(tmp_path)
    done = remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    assert [(r.node, r.action, r.outcome) for r in done] == [("node2", "cordon", "moving")]
    assert [(r.action, r.outcome) for r in remedy.records] == [("cordon", "moved")]
    assert remedy.records[0].move_s is not None
    (gcs, node_id, message, _), = cluster.drained
    assert node_id == NODE_ID["node2"] and message.startswith("cluster health: gpu_lost: ")
    # room for a second gang: Serve rolls the app, the new gang RUNNING before the old stops
    assert cluster.rolled == [("gang", "LLM", "node2@1000")] and ray.killed == []
    assert done[0].gangs_moved == ("gang/g1",) and done[0].gang_rebuild == "surge"
    assert {r["replica_id"] for r in done[0].replicas_moved} == {"s1", "g1"}
    doc = h.parse_actions((tmp_path / h.ACTIONS_FILE).read_text())
    assert doc["cordoned"]["node2"]["node_id"] == NODE_ID["node2"]
    assert doc["records"][0]["evidence"].startswith("gpu-health: Xid 79")
    # the next period: still sick, already cordoned: no second drain, no second record
    assert remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES) == []
    assert len(cluster.drained) == 1
    # a job restarted with the same file keeps the cordon
    again, cluster2, _ = _remedy(tmp_path)
    again.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    assert cluster2.drained == []
    # the node rejoins under a new node id (restart-node / uncordon): the cordon is lifted
    back = dict(ALIVE)
    del back[NODE_ID["node2"]]
    back["ff" * 28] = "node2"
    done = again.after_round({"node2": _readings("node2", status="ok")}, back, RESOURCES)
    assert [(r.node, r.action) for r in done] == [("node2", "uncordoned")]
    assert _json.loads((tmp_path / h.ACTIONS_FILE).read_text())["cordoned"] == {}


def test_without_room_for_a_second_gang_its_rank_is_killed_and_the_record_says_why(tmp_path):
    remedy, cluster, ray = _remedy(tmp_path)
    done = remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, TIGHT)
    assert [(r.action, r.outcome) for r in done] == [("cordon", "moving")]
    assert cluster.rolled == []
    assert ray.killed == [("gang/g1/rank1", "ranks")]          # the gang replaced as a whole
    assert done[0].gang_rebuild.startswith("restart: no room for a second gang beside the first")
    assert "GPU" in done[0].gang_rebuild
    assert [(r.outcome, r.gangs_moved) for r in remedy.records] == [("moved", ("gang/g1",))]


def test_gang_rebuild_restart_kills_the_rank_even_with_room(tmp_path):
    remedy, cluster, ray = _remedy(tmp_path, "health:\n  act: {gang_rebuild: restart}\n")
    done = remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    assert cluster.rolled == [] and ray.killed == [("gang/g1/rank1", "ranks")]
    assert done[0].gang_rebuild == "restart: health.act.gang_rebuild is restart"


def test_a_refused_roll_falls_back_to_killing_the_rank(tmp_path):
    remedy, cluster, ray = _remedy(tmp_path)
    cluster.roll_answer = (False, "PUT 500: boom")
    done = remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    assert cluster.rolled == [("gang", "LLM", "node2@1000")]
    assert ray.killed == [("gang/g1/rank1", "ranks")]
    assert done[0].gang_rebuild == "restart: the roll was refused: gang: PUT 500: boom"


def test_a_gang_whose_replica_is_on_the_sick_node_is_named_moved_and_left_to_serve(tmp_path):
    # node rank 0 (the replica) on node2, its rank 1 on node1 (CI, 2026-12-06: gangs_moved was [])
    remedy, cluster, ray = _remedy(tmp_path, cluster=_Cluster(gang_on="node1", gang_home="node2"))
    done = remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    assert [(r.node, r.action) for r in done] == [("node2", "cordon")]
    assert done[0].gangs_moved == ("gang/g1",)
    assert {r["replica_id"] for r in done[0].replicas_moved} == {"s1", "g1"}
    assert ray.killed == []          # Serve moves the replica; its rank on node1 ends with it


def test_readings_go_on_while_a_cordoned_nodes_replicas_are_moving(tmp_path):
    pending = []
    remedy, cluster, _ = _remedy(tmp_path, start=lambda work, name: pending.append(work))
    done = remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    assert [(r.action, r.outcome) for r in done] == [("cordon", "moving")]
    assert len(pending) == 1                      # the wait for Serve is not in the period
    doc = h.parse_actions((tmp_path / h.ACTIONS_FILE).read_text())
    assert doc["records"][0]["outcome"] == "moving" and doc["records"][0]["move_s"] is None
    # the next period reads and decides while the move is pending: node3 is held (max_cordons)
    done = remedy.after_round({"node3": _readings("node3", "gpu_lost")}, ALIVE, RESOURCES)
    assert [(r.node, r.action) for r in done] == [("node3", "held")]
    pending.pop()()                               # the move ends: the record is completed
    doc = h.parse_actions((tmp_path / h.ACTIONS_FILE).read_text())
    assert [(r["node"], r["action"], r["outcome"]) for r in doc["records"]] == [
        ("node2", "cordon", "moved"), ("node3", "held", "")]
    assert doc["records"][0]["move_s"] >= 0 and doc["cordoned"].keys() == {"node2"}


def test_a_gang_is_moved_only_once_serve_has_replaced_its_replica(tmp_path):
    pending = []
    remedy, cluster, _ = _remedy(tmp_path, start=lambda work, name: pending.append(work))
    remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    # the old gang's replica (rank 0 on node1, nothing of it on node2 once its rank actor is
    # killed) is still listed for two more reads: the move is not done before it is replaced
    cluster.replaced_at = cluster.reads + 3
    pending.pop()()
    assert cluster.reads == cluster.replaced_at
    assert [(r.outcome, r.gangs_moved) for r in remedy.records] == [("moved", ("gang/g1",))]


def test_with_report_for_every_class_the_same_xid_changes_nothing_but_a_record(tmp_path):
    every = ", ".join(f"{c}: report" for c in inv_mod.ACT_CLASSES)
    remedy, cluster, ray = _remedy(tmp_path, f"health:\n  act: {{{every}}}\n")
    done = remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    assert [(r.node, r.action) for r in done] == [("node2", "report")]
    assert cluster.drained == [] and ray.killed == []


def test_a_refused_drain_is_held_and_not_counted_as_a_cordon(tmp_path):
    remedy, cluster, _ = _remedy(tmp_path)
    remedy.drain = lambda *a: (False, "node is the head or already dead")
    done = remedy.after_round({"node2": _readings("node2", "gpu_lost")}, ALIVE, RESOURCES)
    assert [(r.action, r.outcome) for r in done] == [
        ("held", "drain refused: node is the head or already dead")]
    assert remedy.cordoned == {} and remedy.cordon_times == []


# ---------------------------------------------------------------- what `cluster status` shows


def test_status_reads_the_records_and_the_cordoned_nodes_beside_the_readings(tmp_path):
    from fakes import FakeRunner
    from cluster.ray_jobs import health_readings
    from playbooks.status import cordoned_nodes

    inv = _inventory("ray: {temp_dir: /var/tmp/ray}\n")
    args = h.read_args(inv, actions=True)
    assert args[2] == "/var/tmp/ray/session_latest/" + h.ACTIONS_FILE
    rec = act.ActionRecord("node2", "gpu_lost", "gpu-health: Xid 79", "cordon", "health.act",
                           5.0, "id2", "moved", (), (), 3.0)
    text = json.dumps(act.actions_document([rec], {"node2": {"node_id": "id2", "time": 5.0,
                                                             "finding": "gpu_lost"}}, 6.0, 10))
    # the program on the head reads both files, never through a link
    (tmp_path / "r.json").write_text("")
    (tmp_path / "a.json").write_text(text)
    (tmp_path / "l.json").symlink_to(tmp_path / "a.json")
    reply = health_readings.main([str(tmp_path / "r.json"), "100000", str(tmp_path / "a.json")])
    assert reply["actions_text"] == text
    linked = health_readings.main([str(tmp_path / "r.json"), "100000", str(tmp_path / "l.json")])
    assert linked["actions_text"] is None and "symbolic links" in linked["actions_error"]
    session = FakeRunner({"node1": json.dumps(reply) + "\n"}).session(inv)
    status = h.read_health(session, inv)
    assert status.error is None and status.nodes == {}
    assert status.actions["records"][0]["evidence"] == "gpu-health: Xid 79"
    assert cordoned_nodes({"health_actions": status.actions}) == ["node2"]
    none = {"now": 1.0, "text": None, "error": None, "actions_text": None, "actions_error": None}
    quiet = h.read_health(FakeRunner({"node1": json.dumps(none)}).session(inv), inv)
    assert quiet.actions == {"cordoned": {}, "records": []}
    assert cordoned_nodes({"health_actions": quiet.actions}) == []
