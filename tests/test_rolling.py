"""Rolling changes of a running app (issue 42 item 4): the pure step planner
(cluster/serving/rolling.py), Serve's roll options, and the deploy playbook's roll: the steps
shown by a dry run, the capacity gate, a failed step stopping the roll with the old replicas
serving (a fake Serve from the kit)."""

from __future__ import annotations

import pytest

from fakes import DEPLOY_INVENTORY, FIXTURES, FakeRollingServe, cluster_main, inventory_of

from cluster.serving import rolling
from cluster.serving.rolling import Footprint, Replica

CPU2 = Footprint(({"CPU": 2.0},), "STRICT_PACK")


def _free(**nodes):
    return {n: {"CPU": float(c), "GPU": 0.0} for n, c in nodes.items()}


# ---------------------------------------------------------------- the planner (pure)


def test_one_at_a_time_each_new_replica_starts_before_an_old_one_stops():
    old = [Replica("a", ("n1",)), Replica("b", ("n2",))]
    plan = rolling.plan_roll(old, CPU2, CPU2, 2, _free(n1=2, n2=2), max_unavailable=1)
    assert [(s.start, s.stop) for s in plan.steps] == [(1, ("a",)), (1, ("b",))]
    assert plan.problems == [] and plan.batch == 1
    # step 1 places its new replica in the free room, then a's 2 CPUs come back on n1
    assert plan.steps[0].placed == (("n1",),)
    assert plan.steps[0].free_before == {"GPU": 0.0, "CPU": 4.0}
    assert plan.steps[0].free_after == {"GPU": 0.0, "CPU": 4.0}
    assert plan.options == {"max_surge_percent": 1, "rolling_update_percentage": 0.75}


def test_max_unavailable_two_needs_room_for_two_new_replicas_beside_the_old():
    old = [Replica("a", ("n1",)), Replica("b", ("n2",))]
    plan = rolling.plan_roll(old, CPU2, CPU2, 2, _free(n1=2, n2=0), max_unavailable=2)
    assert plan.steps[0].start == 2 and not plan.steps[0].fits
    assert plan.problems and "roll step 1 of 1" in plan.problems[0]
    assert "2 new replica(s) need 4 CPU" in plan.problems[0] or "need 2 CPU" in plan.problems[0]
    # the same with room for both: one step
    ok = rolling.plan_roll(old, CPU2, CPU2, 2, _free(n1=2, n2=2), max_unavailable=2)
    assert [(s.start, s.stop) for s in ok.steps] == [(2, ("a", "b"))] and not ok.problems


def test_no_room_for_a_new_replica_refuses_the_first_step():
    old = [Replica("a", ("n1",)), Replica("b", ("n2",))]
    plan = rolling.plan_roll(old, CPU2, CPU2, 2, _free(n1=1, n2=1), max_unavailable=1)
    assert len(plan.steps) == 1 and not plan.steps[0].fits
    assert "beside the running ones; free: n1 0 GPU, 1 CPU; n2 0 GPU, 1 CPU" in plan.steps[0].short


def test_fewer_replicas_stop_the_surplus_first_and_more_start_with_the_first_batch():
    old = [Replica(x, ("n1",)) for x in "abc"]
    down = rolling.plan_roll(old, CPU2, CPU2, 1, _free(n1=0, n2=2), max_unavailable=1)
    assert [(s.start, s.stop) for s in down.steps] == [(0, ("a",)), (0, ("b",)), (1, ("c",))]
    up = rolling.plan_roll(old[:1], CPU2, CPU2, 3, _free(n1=2, n2=4), max_unavailable=1)
    # Serve starts the missing replicas and the surge at once (target - current + surge)
    assert [(s.start, s.stop) for s in up.steps] == [(3, ("a",))]


def test_a_gang_rolls_as_a_whole_on_distinct_nodes():
    gang = Footprint(({"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0, "CPU": 1.0}), "STRICT_SPREAD")
    old = [Replica("g", ("n1", "n2"))]
    free = {n: {"GPU": 1.0, "CPU": 2.0} for n in ("n1", "n2", "n3", "n4")}
    for n in ("n1", "n2"):
        free[n]["GPU"] = 0.0
    plan = rolling.plan_roll(old, gang, gang, 1, free, max_unavailable=1)
    assert [(s.start, s.stop, s.placed) for s in plan.steps] == [(1, ("g",), (("n3", "n4"),))]
    assert plan.steps[0].free_after["GPU"] == 2.0        # g's two GPUs back on n1 and n2
    short = rolling.plan_roll(old, gang, gang, 1, {k: v for k, v in free.items() if k != "n4"})
    assert short.problems


@pytest.mark.parametrize("batch,target", [(1, 2), (1, 7), (3, 7), (2, 2), (1, 1), (5, 100)])
def test_serve_options_make_serve_replace_the_batch(batch, target):
    from ray.serve._private.config import DeploymentConfig

    real, options = rolling.serve_rollout(batch, target)
    config = DeploymentConfig(num_replicas=target, **options)   # Serve's own validation
    # Serve's formulas (deployment_state._surge_replicas_to_start, _rollout_size)
    assert (config.max_surge_percent * target + 99) // 100 == real == batch
    assert max(int(config.rolling_update_percentage * target), 1) == batch


def test_free_capacity_takes_every_apps_live_replicas_off_their_nodes():
    details = {"applications": {"x": {"deployments": {"d": {
        "deployment_config": {"placement_group_bundles": [{"CPU": 1}, {"CPU": 1}]},
        "replicas": [{"state": "RUNNING", "node_ip": "10.0.0.1"},
                     {"state": "STOPPING", "node_ip": "10.0.0.2"},
                     {"state": "DEAD", "node_ip": "10.0.0.2"}]}}}}}
    free = rolling.free_capacity({"gpu1": {"CPU": 4}, "gpu2": {"CPU": 4}}, details,
                                 {"10.0.0.1": "gpu1", "10.0.0.2": "gpu2"})
    assert free == {"gpu1": {"GPU": 0.0, "CPU": 2.0}, "gpu2": {"GPU": 0.0, "CPU": 2.0}}


# ---------------------------------------------------------------- the deploy playbook's roll


@pytest.fixture
def two_nodes(monkeypatch):
    """Two alive CPU nodes of 4 CPUs; the node checks pass."""
    from cluster.ray.ray_state import GcsNode, RayState
    from cluster.serving import deploy as lib

    state = RayState("dashboard", "2.60.0", tuple(
        GcsNode(f"id{i}", ip, True, i == 0, {"CPU": 4.0, "GPU": 0.0})
        for i, ip in enumerate(("10.0.0.1", "10.0.0.2"))), None)
    monkeypatch.setattr("cluster.ray.ray_state.query_state",
                        lambda session, inv, include_serve=False: (state, None))
    monkeypatch.setattr("playbooks.deploy._replica_ranks", lambda session, inv, name: [])

    def check_nodes(session, inv, spec, cluster):
        checks = [lib.NodeReadiness(n.name, True, True, True, "set") for n in inv.nodes]
        return lib.judge_checks(checks, spec, cluster)

    monkeypatch.setattr(lib, "check_nodes", check_nodes)
    monkeypatch.setattr(lib, "collect_log_tails", lambda session, inv, state: {})


def _run(serve, *, replicas=2, engine_args=None, dry_run=False, max_unavailable=1,
         served_model_name=None, replace=False):
    from cluster.serving import deploy as lib
    from playbooks import deploy

    spec = lib.spec_from_flags("/models/tiny", dp=replicas, name="tiny",
                               served_model_name=served_model_name, engine_args=engine_args or {})
    options = deploy.DeployOptions(spec, timeout_s=5, dry_run=dry_run,
                                   max_unavailable=max_unavailable, rollback_timeout_s=5,
                                   replace=replace)
    return deploy.run(inventory_of(DEPLOY_INVENTORY), None, options, lambda q: True,
                      client=serve)


def _running_config(**engine_args):
    """The config `tiny` runs with (as this deploy writes it), its engine args changed."""
    from cluster.serving import deploy as lib
    from cluster.serving.deploy import ClusterView, RayNode

    spec = lib.spec_from_flags("/models/tiny", dp=2, engine_args=engine_args)
    cluster = ClusterView((RayNode("10.0.0.1", "gpu1", 4.0, 0.0, True),
                           RayNode("10.0.0.2", "gpu2", 4.0, 0.0)))
    app, _ = lib.build_application(spec, "cpu", cluster, inventory_of(DEPLOY_INVENTORY))
    return app


OLD = {"old-a": "10.0.0.1", "old-b": "10.0.0.2"}


def test_a_changed_config_rolls_with_serves_surge_options(two_nodes):
    serve = FakeRollingServe(_running_config(max_num_seqs=8), OLD, [{"CPU": 1.0}])
    out = _run(serve, engine_args={"max_num_seqs": 4})
    assert out.exit_code == 0 and out.doc["status"] == "RUNNING"
    put = serve.puts[-1]
    assert put["deployments"] == [{"name": "vllm-tiny", "max_surge_percent": 1,
                                   "rolling_update_percentage": 0.75}]
    roll = out.doc["roll"]
    assert [(s["start"], s["stop"]) for s in roll["steps"]] == [(1, ["old-a"]), (1, ["old-b"])]
    assert roll["old_replicas"] == ["old-a", "old-b"] and roll["failed_step"] is None


def test_an_unchanged_config_is_no_roll(two_nodes):
    serve = FakeRollingServe(_running_config(max_num_seqs=4), OLD, [{"CPU": 1.0}])
    out = _run(serve, engine_args={"max_num_seqs": 4})
    assert out.exit_code == 0 and "roll" not in out.doc


def test_a_dry_run_shows_the_steps_and_the_capacity_at_each(two_nodes):
    serve = FakeRollingServe(_running_config(max_num_seqs=8), OLD, [{"CPU": 1.0}])
    out = _run(serve, engine_args={"max_num_seqs": 4}, dry_run=True)
    assert out.exit_code == 0 and out.doc["status"] == "DRY_RUN" and serve.puts == []
    steps = out.doc["roll"]["steps"]
    assert [s["free_before"]["CPU"] for s in steps] == [6.0, 6.0]
    assert steps[0]["what"].startswith("start 1 new replica(s) (on gpu1) and wait until ready")


def test_the_capacity_gate_refuses_a_roll_that_cannot_start_a_new_replica(two_nodes):
    serve = FakeRollingServe(_running_config(max_num_seqs=8), OLD, [{"CPU": 4.0}])
    out = _run(serve, engine_args={"max_num_seqs": 4})
    assert out.exit_code == 2 and out.doc["status"] == "REFUSED" and serve.puts == []
    assert "roll step 1 of 1" in out.doc["error"] and "free: gpu1 0 GPU, 0 CPU" in out.doc["error"]


def test_a_failed_step_stops_the_roll_and_puts_the_old_config_back(two_nodes):
    first = _running_config(max_num_seqs=8)
    serve = FakeRollingServe(first, OLD, [{"CPU": 1.0}], fail_new=True)
    out = _run(serve, engine_args={"max_num_seqs": 4})
    assert out.exit_code == 2 and out.doc["status"] == "ROLL_FAILED"
    assert out.doc["error"].startswith("roll step 1 of 2 failed (start 1 new replica(s)")
    assert "the previous config is back and RUNNING (2 old replica(s) serving)" in out.doc["error"]
    assert out.doc["roll"]["failed_step"] == 1 and out.doc["roll"]["rolled_back"] is True
    assert len(serve.puts) == 2 and serve.puts[1]["args"] == first["args"]
    # the config put back is the one deployed, env values as written (Serve's details mask them)
    assert first["args"]["runtime_env"]["env_vars"] and "***" not in str(serve.puts[1])
    assert [r["replica_id"] for r in serve.replicas] == ["old-a", "old-b"]


def test_a_failed_step_names_what_the_engine_core_died_of(two_nodes, monkeypatch):
    """The replicas' log tails hold the engine core's own error (a real one: fixtures/
    vllm-engine-failure); the one line of the failure names it, with the step bound it ran past
    and the flag that sets it."""
    from cluster.serving import deploy as lib

    tail = (FIXTURES / "vllm-engine-failure" / "tp2-execute-model-timeout.log").read_text()
    monkeypatch.setattr(lib, "collect_log_tails", lambda session, inv, state: {"gpu1": tail})
    serve = FakeRollingServe(_running_config(max_num_seqs=8), OLD, [{"CPU": 1.0}], fail_new=True)
    out = _run(serve, engine_args={"max_num_seqs": 4})
    assert out.exit_code == 2 and out.doc["status"] == "ROLL_FAILED"
    assert "the engine core: TimeoutError: RPC call to execute_model timed out." in out.doc["error"]
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s" in out.doc["error"]
    assert "\n" not in out.doc["error"]


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_new_served_model_name_is_refused_as_a_roll_without_replace(two_nodes, dry_run):
    """A new served model name renames the Serve deployment: Serve would stop every old replica
    while the new ones start, so no roll: refused (exit 2, nothing PUT) unless --replace."""
    serve = FakeRollingServe(_running_config(max_num_seqs=8), OLD, [{"CPU": 1.0}])
    out = _run(serve, engine_args={"max_num_seqs": 8}, served_model_name="tiny-v2",
               dry_run=dry_run)
    assert out.exit_code == 2 and out.doc["status"] == "REFUSED" and serve.puts == []
    assert "Serve deployment vllm-tiny is replaced whole by vllm-tiny-v2" in out.doc["error"]
    assert "give --replace" in out.doc["error"] and "roll" not in out.doc
    assert out.doc["replaced"] == {"old_deployment": "vllm-tiny",
                                   "new_deployment": "vllm-tiny-v2", "replace": False}


def test_replace_applies_a_new_served_model_name_as_a_whole_replacement(two_nodes):
    serve = FakeRollingServe(_running_config(max_num_seqs=8), OLD, [{"CPU": 1.0}])
    out = _run(serve, served_model_name="tiny-v2", replace=True, engine_args={"max_num_seqs": 8})
    assert out.exit_code == 0 and out.doc["status"] == "RUNNING" and "roll" not in out.doc
    assert serve.puts[-1]["args"]["model_loading_config"]["model_id"] == "tiny-v2"
    assert any("replaced whole" in w and "--replace" in w for w in out.doc["warnings"])


def test_replace_is_a_deploy_flag(capsys):
    code, out, err = cluster_main(capsys, "deploy", "--help")
    assert code == 0 and "--replace" in out


def test_failed_step_counts_the_steps_serve_finished():
    from cluster.serving.deploy import AppState, ReplicaInfo

    old = [Replica("a", ("n1",)), Replica("b", ("n2",))]
    plan = rolling.plan_roll(old, CPU2, CPU2, 2, _free(n1=2, n2=2))

    def state(*reps):
        return AppState("tiny", "DEPLOY_FAILED", "", "/tiny", 1.0, {}, tuple(
            ReplicaInfo("d", r, s, None, None, None, None) for r, s in reps))
    assert rolling.failed_step(plan, ["a", "b"], state(("a", "RUNNING"), ("b", "RUNNING"),
                                                       ("n1", "STARTING"))) == 1
    assert rolling.failed_step(plan, ["a", "b"], state(("b", "RUNNING"), ("n1", "RUNNING"),
                                                       ("n2", "STARTING"))) == 2


@pytest.mark.parametrize("value", ["0", "-1", "nan", "5000"])
def test_max_unavailable_is_validated(capsys, value):
    code, out, err = cluster_main(capsys, "deploy", "--model", "/models/tiny",
                                  "--max-unavailable", value, "--dry-run")
    assert code == 2 and "--max-unavailable" in err and "Traceback" not in err
    assert "unrecognized" not in err            # the flag exists and its value was refused


def test_a_deploy_keeps_the_health_jobs_rebuild_value_so_the_same_config_changes_nothing():
    from cluster.ray.rollout import REBUILD_ENV, rebuild_config

    app = {"name": "g", "import_path": "serve_apps.vllm_app:build", "args": {"model": "m"},
           "runtime_env": {"env_vars": {"A": "1"}}}
    running = rebuild_config(app, "LLM", 1, "node2@5")          # the health job rolled it
    assert rolling.app_changed(running, app)                     # without the carry: a roll
    kept = rolling.keeping_rebuild(running, app)
    assert not rolling.app_changed(running, kept)
    assert kept["runtime_env"]["env_vars"] == {"A": "1", REBUILD_ENV: "node2@5"}
    changed = {**app, "args": {"model": "m2"}}
    assert rolling.app_changed(running, rolling.keeping_rebuild(running, changed))
    assert rolling.keeping_rebuild(None, app) is app and rolling.keeping_rebuild(app, app) is app
