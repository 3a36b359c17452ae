"""The playbooks' plan / dry-run paths and their on_event sequences (drain, restart-node,
undeploy, tune), with the shared stand-ins: test_ray_plan's inventory, facts and
FakeRunner (fake nodes in a real Session), test_tune's FakeServe (an in-memory dashboard). Then the
recorded-run context: the inventory's secrets never land in a command's run directory."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.nodes import inventory
from cluster.ray.dashboard_api import DashboardReply
from cluster.base.errors import UsageError
from cluster.inspection.node_summary import PreflightFacts
from cluster.ray.ray_cluster import CHANGED
from cluster.ray.ray_state import GcsNode, RayState
from cluster.serving.tune import TuneSettings
from playbooks import drain, restart_node, tune, undeploy
from fakes import (DEPLOY_INVENTORY, IDS, IPS, RAY_INVENTORY as INV, TUNE_APP_CONFIG as ORIGINAL,
                   FakeRunner, FakeServe, ProgressLines, cluster_cli, closed_port, fake_bench,
                   inventory_of, node_facts as facts, write_inventory)
from fakes import fixture_text


def never(question: str) -> bool:
    raise AssertionError(f"asked although it must not: {question}")


# ---------------------------------------------------------------- drain / restart-node


def serve_with(replica_node: str, gpus: float = 1.0) -> dict:
    """One app of one replica (on replica_node) that needs `gpus` GPUs."""
    return {"applications": {"llama": {"status": "RUNNING", "deployments": {"LLMServer": {
        "status": "HEALTHY", "target_num_replicas": 1,
        "deployment_config": {"num_replicas": 1,
                              "ray_actor_options": {"num_cpus": 1, "num_gpus": gpus}},
        "replicas": [{"replica_id": "a", "state": "RUNNING",
                      "node_id": IDS[replica_node]}]}}}}}


def ray_view(serve: dict | None, gpus: float = 8.0) -> RayState:
    nodes = tuple(GcsNode(IDS[n], IPS[n], True, n == "gpu01", {"GPU": gpus, "CPU": 2.0})
                  for n in ("gpu01", "gpu02", "gpu03"))
    return RayState("dashboard", "2.60.0", nodes, serve)


@pytest.fixture
def head(monkeypatch):
    """The head's answers: a queue of RayStates for query_state (the last one repeats) and
    facts for the facts layer's gather. Returns the queue."""
    views: list[RayState] = []

    def query_state(session, inventory, include_serve=True):
        view = views.pop(0) if len(views) > 1 else views[0]
        return view, None

    def gather(session, inventory, nodes=None):
        names = [n.name for n in (nodes or inventory.nodes)]
        return {n: facts(n, running=True) for n in names}

    monkeypatch.setattr("playbooks.drain.query_state", query_state)
    monkeypatch.setattr("playbooks.drain.gather_facts", gather)
    monkeypatch.setattr("playbooks.restart_node.gather_facts", gather)
    return views


def test_drain_dry_run_plans_the_drain_command_and_changes_nothing(head):
    inv = inventory.loads(INV)
    head.append(ray_view(serve_with("gpu02")))
    nodes, events = FakeRunner(), ProgressLines()
    session = nodes.session(inv)
    out = drain.run(inv, session, drain.DrainOptions("gpu02", dry_run=True), never, events)
    assert (out.stopped, out.exit_code, out.node_id) == ("dry run", 0, IDS["gpu02"])
    assert out.capacity.ok and len(out.planned) == 1
    assert out.planned[0].startswith("[gpu01] $ ") and "drain-node" in out.planned[0]
    assert IDS["gpu02"] in out.planned[0]
    assert nodes.sent == [] and events == [] and out.steps == []


def test_drain_refused_when_the_others_cannot_carry_the_apps(head):
    inv = inventory.loads(INV)
    head.append(ray_view(serve_with("gpu02", gpus=9.0)))  # no other node has 9 GPUs
    nodes = FakeRunner()
    session = nodes.session(inv)
    out = drain.run(inv, session, drain.DrainOptions("gpu02"), never)
    assert out.exit_code == 2 and out.stopped.startswith("refused: gpu02 cannot be taken out")
    assert nodes.sent == []


def test_drain_runs_then_waits_for_the_replicas_to_move(head):
    inv = inventory.loads(INV)
    head += [ray_view(serve_with("gpu02")), ray_view(serve_with("gpu03"))]
    nodes, events, asked = FakeRunner(), ProgressLines(), []
    session = nodes.session(inv)
    out = drain.run(inv, session, drain.DrainOptions("gpu02"),
                    lambda q: asked.append(q) or True, events)
    assert len(asked) == 1 and "Drain gpu02" in asked[0] and "1 Serve replica(s)" in asked[0]
    assert [(s.node, "drain-node" in s.command) for s in nodes.sent] == [("gpu01", True)]
    assert events == ["draining gpu02", "waiting for Serve to move 1 replica(s) off gpu02"]
    assert [(s["step"], s["status"]) for s in out.steps] == [("drain", CHANGED),
                                                             ("move-replicas", CHANGED)]
    assert out.exit_code == 0 and out.stopped is None


def test_drain_not_confirmed_runs_nothing(head):
    inv = inventory.loads(INV)
    head.append(ray_view(serve_with("gpu02")))
    nodes = FakeRunner()
    session = nodes.session(inv)
    out = drain.run(inv, session, drain.DrainOptions("gpu02"), lambda q: False)
    assert (out.stopped, out.exit_code) == ("not confirmed", 2) and nodes.sent == []


def test_restart_node_dry_run_plans_drain_stop_and_start(head):
    inv = inventory.loads(INV)
    head.append(ray_view(serve_with("gpu02")))
    nodes, events = FakeRunner(), ProgressLines()
    session = nodes.session(inv)
    out = restart_node.run(inv, session, restart_node.RestartOptions("gpu02", dry_run=True),
                           never, events)
    assert (out.command, out.stopped, out.exit_code) == ("restart-node", "dry run", 0)
    assert [line.split(" $ ")[0] for line in out.planned] == ["[gpu01]", "[gpu02]", "[gpu02]"]
    assert "drain-node" in out.planned[0] and " stop" in out.planned[1]
    assert "start" in out.planned[2] and "--address" in out.planned[2]
    assert nodes.sent == [] and events == []


def test_drain_and_restart_refuse_the_head_before_asking_anything(head):
    inv = inventory.loads(INV)
    head.append(ray_view(None))
    with pytest.raises(UsageError, match="is the head"):
        drain.run(inv, FakeRunner().session(inv), drain.DrainOptions("gpu01", dry_run=True), never)
    with pytest.raises(UsageError, match="is the head"):
        restart_node.run(inv, FakeRunner().session(inv), restart_node.RestartOptions("gpu01"), never)


def _preflight_of(status):
    """run_preflight's stand-in: one result of `status` per check asked of the node."""
    from cluster.base.results import CheckResult, Report, Status

    def run_preflight(inventory, session, nodes, reachability=True, **_):
        assert [n.name for n in nodes] == ["gpu02"] and reachability is False
        return Report("preflight", (CheckResult("gpus", "gpu02", Status.OK, "8 x H100"),
                                    CheckResult("gpu-health", "gpu02", getattr(Status, status),
                                                "Xid 79 (GPU has fallen off the bus)")))
    return run_preflight


def test_uncordon_refuses_while_the_nodes_preflight_fails(head, monkeypatch):
    from playbooks import uncordon

    inv = inventory.loads(INV)
    head.append(ray_view(serve_with("gpu03")))
    monkeypatch.setattr("playbooks.uncordon.run_preflight", _preflight_of("FAIL"))
    nodes = FakeRunner()
    session = nodes.session(inv)
    out = uncordon.run(inv, session, uncordon.UncordonOptions("gpu02"), never)
    assert out.exit_code == 2 and out.stopped.startswith("refused: the preflight of gpu02 fails")
    assert "gpu-health: Xid 79" in out.stopped and nodes.sent == []
    with pytest.raises(UsageError, match="is the head"):
        uncordon.run(inv, session, uncordon.UncordonOptions("gpu01"), never)


def test_uncordon_with_a_passing_preflight_plans_restart_nodes_steps(head, monkeypatch):
    from playbooks import uncordon

    inv = inventory.loads(INV)
    head.append(ray_view(serve_with("gpu03")))
    monkeypatch.setattr("playbooks.uncordon.run_preflight", _preflight_of("WARN"))
    out = uncordon.run(inv, FakeRunner().session(inv), uncordon.UncordonOptions("gpu02", dry_run=True),
                       never)
    assert (out.command, out.stopped, out.exit_code) == ("uncordon", "dry run", 0)
    assert [s["step"] for s in out.steps] == ["preflight"]
    assert "drain-node" in out.planned[0] and " stop" in out.planned[1]


# ---------------------------------------------------------------- undeploy


class FakeServeRemoving(FakeServe):
    """FakeServe plus remove_application (the app is gone at once)."""

    removed: list[str]

    def remove_application(self, name):
        self.removed = getattr(self, "removed", []) + [name]
        self.gone = True
        return DashboardReply(200, merge={"previous": {"status": self.status}})

    def _details(self):
        return {"applications": {}} if getattr(self, "gone", False) else super()._details()


def test_undeploy_dry_run_and_absent_change_nothing():
    serve = FakeServeRemoving(ORIGINAL)
    events = ProgressLines()
    out = undeploy.run(None, None, undeploy.UndeployOptions("tiny", dry_run=True), never,
                       events, client=serve)
    assert out.doc["status"] == "DRY_RUN" and out.exit_code == 0
    assert out.doc["previous"]["status"] == "RUNNING" and out.doc["remaining"] == []
    assert not getattr(serve, "removed", []) and events == []
    out = undeploy.run(None, None, undeploy.UndeployOptions("other"), never, client=serve)
    assert (out.doc["status"], out.exit_code, out.doc["previous"]) == ("ABSENT", 0, None)
    assert out.doc["remaining"] == ["tiny"]


def test_undeploy_asks_removes_and_waits_until_gone():
    serve = FakeServeRemoving(ORIGINAL)
    events = ProgressLines()
    start = undeploy.UndeployOutcome.start(undeploy.UndeployOptions("tiny"), "/runs/x")
    out = undeploy.run(None, None, undeploy.UndeployOptions("tiny"), lambda q: "tiny" in q,
                       events, out=start, client=serve)
    assert out is start and serve.removed == ["tiny"]
    assert out.doc["status"] == "REMOVED" and out.exit_code == 0
    assert list(out.to_dict())[:4] == ["name", "status", "run_dir", "dry_run"]
    assert events == ["removing tiny through the dashboard"]
    cancelled = undeploy.run(None, None, undeploy.UndeployOptions("tiny"), lambda q: False,
                             client=FakeServeRemoving(ORIGINAL))
    assert (cancelled.doc["status"], cancelled.exit_code) == ("CANCELLED", 2)


# ---------------------------------------------------------------- tune


def _tune_options(tmp_path, dry_run=False, **kw) -> tune.TuneOptions:
    settings = TuneSettings("tiny", "max_num_batched_tokens", (512, 1024), concurrency=4,
                            requests=8, warmup_requests=0, output_len=32, **kw)
    return tune.TuneOptions(settings, tmp_path, dry_run=dry_run)


def test_tune_dry_run_reads_the_app_and_its_key_and_deploys_nothing(tmp_path):
    serve = FakeServe(ORIGINAL)
    secrets: list[str] = []
    out = tune.run(inventory.loads(INV), None, _tune_options(tmp_path, dry_run=True), never,
                   on_secret=secrets.append, environ={"CLUSTER_API_KEY": "sk-tune-secret"},
                   client=serve)
    assert out.doc["status"] == "DRY_RUN" and out.exit_code == 0
    assert out.doc["endpoint"] == "http://10.0.0.1:8000/tiny/v1" and out.doc["api_key_env"] == "CLUSTER_API_KEY"
    assert secrets == ["sk-tune-secret"] and serve.puts == []
    assert "sk-tune-secret" not in json.dumps(out.to_dict())


def test_tune_without_the_key_here_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="export CLUSTER_API_KEY"):
        tune.run(inventory.loads(INV), None, _tune_options(tmp_path, dry_run=True), never, environ={},
                 client=FakeServe(ORIGINAL))


def test_tune_sweeps_after_confirming_and_reports_each_step(tmp_path):
    serve = FakeServe(ORIGINAL)
    bench = fake_bench({512: 10, 1024: 30})
    bench.serve = serve
    events = ProgressLines()
    out = tune.run(inventory.loads(INV), None, _tune_options(tmp_path),
                   lambda q: "2 time(s)" in q, events, environ={"CLUSTER_API_KEY": "sk-x-1234"}, client=serve,
                   bench=bench)
    assert out.doc["status"] == "DONE" and out.exit_code == 0
    assert out.doc["recommendation"]["value"] == 1024
    assert out.doc["json_path"] == str(tmp_path / "tune.json")
    assert events[0] == "[1/2] max_num_batched_tokens=512: deploying"
    assert "applying the original config (max_num_batched_tokens=None)" in events
    assert events.index("max_num_batched_tokens=1024: deploying".join(("[2/2] ", ""))) < \
        events.index("applying the original config (max_num_batched_tokens=None)")
    assert serve.config == ORIGINAL
    cancelled = tune.run(inventory.loads(INV), None, _tune_options(tmp_path), lambda q: False,
                         environ={"CLUSTER_API_KEY": "sk-x-1234"}, client=FakeServe(ORIGINAL))
    assert (cancelled.doc["status"], cancelled.exit_code) == ("CANCELLED", 2)


@pytest.mark.parametrize("tail, said", [
    (fixture_text("vllm-engine-failure", "kv-cache-one-block.log"),
     "; the engine core: ValueError: No available memory for the cache blocks."),
    ("(no log files found)", None)])
def test_a_value_that_fails_to_deploy_says_what_its_engine_core_died_of(tmp_path, monkeypatch,
                                                                         tail, said):
    """The replicas' log tails (a real capture of vLLM's server: a KV cache too small for one
    block) name the engine core's own error in the failed point's one line; tails without one
    leave Serve's reason as it is."""
    read = []

    def tails(session, inv, state):
        read.append(state.name)
        return {"node1": tail}

    monkeypatch.setattr("cluster.serving.deploy.collect_log_tails", tails)
    serve = FakeServe(ORIGINAL, fail={1024})
    bench = fake_bench({512: 10})
    bench.serve = serve
    out = tune.run(inventory.loads(INV), None, _tune_options(tmp_path), lambda q: True,
                   environ={"CLUSTER_API_KEY": "sk-x-1234"}, client=serve, bench=bench)
    failed = [p for p in out.doc["points"] if p["value"] == 1024]
    assert [p["status"] for p in failed] == ["deploy_failed"] and read == ["tiny"]
    error = failed[0]["error"]           # Serve's reason from the stand-in: its status
    if said is None:
        assert error == "DEPLOY_FAILED"
    else:
        assert error.startswith("DEPLOY_FAILED" + said) and "\n" not in error, error


# ---------------------------------------------------------------- deploy


class FakeDashboard:
    """Serve behind the DashboardClient methods deploy uses: nothing deployed until the PUT,
    then the app RUNNING."""

    def __init__(self):
        self.puts: list[dict] = []

    def serve_details(self):
        apps = {}
        if self.puts:
            apps[self.puts[-1]["name"]] = {"status": "RUNNING", "last_deployed_time_s": 1.0,
                                           "route_prefix": self.puts[-1]["route_prefix"],
                                           "deployments": {}}
        return {"http_options": {"port": 8000}, "applications": apps}

    def apply_application(self, app, http_options=None):
        self.puts.append(copy.deepcopy(dict(app)))
        return DashboardReply(200, merge={"previous": None, "http_options": http_options})


@pytest.fixture
def deploy_cluster(monkeypatch):
    """Two alive CPU nodes in Ray; every node has the model and the key (the checks' verdicts
    are tested in test_deploy.py: here they are judged from fixed NodeChecks)."""
    from cluster.serving import deploy as lib

    state = RayState("dashboard", "2.60.0", tuple(
        GcsNode(f"id{i}", ip, True, i == 0, {"CPU": 4.0, "GPU": 0.0})
        for i, ip in enumerate(("10.0.0.1", "10.0.0.2"))), None)
    monkeypatch.setattr("cluster.ray.ray_state.query_state",
                        lambda session, inv, include_serve=False: (state, None))

    def check_nodes(session, inv, spec, cluster):
        checks = [lib.NodeReadiness(n.name, True, True, True, "set") for n in inv.nodes]
        return lib.judge_checks(checks, spec, cluster)

    monkeypatch.setattr(lib, "check_nodes", check_nodes)


def _deploy_options(**kw):
    from cluster.serving import deploy as lib
    from playbooks import deploy

    return deploy.DeployOptions(lib.spec_from_flags("/models/tiny"), timeout_s=5, **kw)


def test_deploy_dry_run_writes_the_config_checks_and_deploys_nothing(deploy_cluster):
    from playbooks import deploy

    dash, events, written = FakeDashboard(), ProgressLines(), {}
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), None, _deploy_options(dry_run=True), never,
                     events, write_config=lambda n, t: written.setdefault(n, t) and Path(n),
                     client=dash)
    assert out.doc["status"] == "DRY_RUN" and out.exit_code == 0 and dash.puts == []
    assert out.doc["config_path"] == "serve_config.yaml" and "applications" in written[
        "serve_config.yaml"]
    assert out.doc["device"] == "cpu" and out.doc["checks"]["ok"]
    assert out.doc["endpoint"] == "http://10.0.0.1:8000/tiny/v1"
    assert events == ["checking /models/tiny and $CLUSTER_API_KEY on 2 node(s)"]


def test_deploy_refuses_a_config_holding_a_secret(deploy_cluster):
    from cluster.base.errors import DeployError
    from playbooks import deploy

    with pytest.raises(DeployError, match="secret values"):
        deploy.run(inventory_of(DEPLOY_INVENTORY), None, _deploy_options(secrets=("/models/tiny",)), never,
                   client=FakeDashboard())


def test_deploy_puts_the_app_and_waits_for_running(deploy_cluster):
    from playbooks import deploy

    dash, events = FakeDashboard(), ProgressLines()
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), None, _deploy_options(), never, events,
                     client=dash)
    assert out.doc["status"] == "RUNNING" and out.exit_code == 0
    assert [p["name"] for p in dash.puts] == ["tiny"] and out.doc["config_path"] is None
    assert events[:3] == ["checking /models/tiny and $CLUSTER_API_KEY on 2 node(s)",
                          "deploying tiny (serve_apps.vllm_app:build_app) through the dashboard",
                          "waiting up to 5 s for tiny to be RUNNING"]


# ---------------------------------------------------------------- nccl-check


def test_nccl_check_submits_one_head_command_and_judges_a_silent_head():
    from cluster.ray.nccl_check import CheckOptions
    from playbooks import nccl_check

    inv = inventory.loads(INV)
    nodes, events = FakeRunner(), ProgressLines()
    session = nodes.session(inv)
    options = nccl_check.NcclOptions(CheckOptions(backend="gloo", timeout_s=60),
                                     preflight_facts=PreflightFacts({}),  # a report's
                                     submission_id="nccl-check-gloo-test")
    out = nccl_check.run(inv, session, options, never, events)
    assert nodes.nodes() == ["gpu01"]                   # one command, on the head
    assert nodes.sent[0].stdin                                    # the program on stdin
    assert len(events) == 1 and events[0].startswith("gloo all-reduce of ")
    assert events[0].endswith("over 3 node(s) as a Ray job on gpu01 (timeout 60 s)")
    assert out.exit_code == 2 and out.result.status.value == "fail"  # no document came back
    assert out.to_dict()["exit_code"] == 2 and "total" in out.result.timings


def test_nccl_check_without_a_report_gathers_the_ib_facts_first():
    """No preflight report: the facts layer reads every node (one round trip each), then the
    job runs on the head; facts that say nothing about IB give no expectation, never a guess."""
    from cluster.inspection.facts import NODE_PROGRAM
    from cluster.ray.nccl_check import CheckOptions
    from cluster.inspection.probes import probe_names
    from playbooks import nccl_check

    inv = inventory.loads(INV)
    nodes, events = FakeRunner(), ProgressLines()
    session = nodes.session(inv)
    options = nccl_check.NcclOptions(CheckOptions(backend="gloo", timeout_s=60),
                                     submission_id="nccl-check-gloo-test")
    out = nccl_check.run(inv, session, options, never, events)
    asked = nodes.nodes()
    assert sorted(asked[:3]) == ["gpu01", "gpu02", "gpu03"] and asked[3:] == ["gpu01"]
    assert all(name in probe_names(command)
               for command in nodes.commands()[:3] for name in ("ibstat", NODE_PROGRAM))
    assert events[0] == "gathering the nodes' InfiniBand facts"
    assert out.result.expected.gbps is None


def test_nccl_check_with_a_report_without_facts_gathers_nothing():
    """A --report that holds no facts is read as none (no expectation), never a reason to gather."""
    from cluster.ray.nccl_check import CheckOptions
    from playbooks import nccl_check

    inv = inventory.loads(INV)
    nodes = FakeRunner()
    options = nccl_check.NcclOptions(CheckOptions(backend="gloo", timeout_s=60),
                                     preflight_facts=None, facts_from_report=True,
                                     submission_id="nccl-check-gloo-test")
    out = nccl_check.run(inv, nodes.session(inv), options, never, ProgressLines())
    assert nodes.nodes() == ["gpu01"]                   # the job alone, on the head
    assert out.result.expected.basis == "no preflight facts (run `cluster preflight` first)"


# ---------------------------------------------------------------- the recorded-run context


def test_start_run_scrubs_the_longest_secret_first(tmp_path):
    import argparse

    from cluster.commands._common import recorded_run

    inv = inventory.loads(f"""\
nodes:
  - name: n1
    role: head
    address: 127.0.0.1
    env: {{HF_TOKEN: abcd, OTHER_TOKEN: abcdefgh}}
run_dir: {tmp_path}/runs
""")
    run = recorded_run(argparse.Namespace(json=True), "test", inv)
    assert run.scrub("x abcdefgh y abcd") == "x *** y ***"
    run.add_secret("sk-later-key")
    run.record.write_text("t.txt", "key sk-later-key")
    assert (run.path / "t.txt").read_text() == "key ***"
    run.add_secret("abcdefghijkl")  # added last, holds both: still masked whole
    assert run.scrub("abcdefghijkl") == "***"


SECRET = "hf_recordedrun_secret"


@pytest.mark.parametrize("name,extra", [
    ("preflight", ["--no-clock-skew", "--no-reachability"]),
    ("exec", ["--", "echo", SECRET]),
    ("nccl-check", ["--timeout", "30"]),
    ("drain", ["node2", "--yes"]),
    ("undeploy", ["app", "--yes"]),
])
def test_inventory_secrets_never_land_in_the_run_directory(name, extra, tmp_path):
    """The inventory lives in a folder named like its secret: its path reaches run.json
    (argv, inventory) and the reports; exec also runs the secret on the command line."""
    port = closed_port()
    folder = tmp_path / SECRET
    folder.mkdir()
    (folder / "known_hosts").write_text("")
    inv = write_inventory(folder, f"""\
               ssh: {{known_hosts: {folder}/known_hosts, connect_timeout: 3}}
               nodes:
                 - {{name: node1, role: head, address: 127.0.0.1, port: {port}, local: false}}
                 - name: node2
                   address: 127.0.0.2
                   port: {port}
                   local: false
                   env: {{HF_TOKEN: {SECRET}}}
               run_dir: {tmp_path}/runs
               """)
    env = dict(os.environ)
    env.pop("CLUSTER_RUN_DIR", None)
    env.pop("HF_TOKEN", None)
    p = cluster_cli("-i", str(inv), name, "--json", *extra, cwd=tmp_path, env=env, timeout=180)
    assert "Traceback" not in p.stderr and p.returncode == 2, (p.returncode, p.stderr[-2000:])
    runs = list((tmp_path / "runs").glob("*"))
    assert len(runs) == 1
    meta = json.loads((runs[0] / "run.json").read_text())
    assert meta["inventory"] == str(inv).replace(SECRET, "***")
    files = [f for f in runs[0].rglob("*") if f.is_file()]
    assert len(files) >= 3  # run.json, a report, a node log
    for f in files:
        assert SECRET not in f.read_text(), f
    assert SECRET not in p.stdout + p.stderr


# ---------------------------------------------------------------- deploy: the fabric proof


def _head_document(result: dict) -> str:
    """What the head program (cluster/ray_jobs/nccl_job.py) prints for a finished job."""
    import base64
    import json
    import zlib

    return json.dumps({"submission_id": "proof", "submitted": True, "status": "SUCCEEDED",
                       "message": None, "errors": [], "logs_tail": "", "timed_out": False,
                       "result_z": base64.b64encode(zlib.compress(
                           json.dumps(result).encode())).decode()})


def proof_nodes(result: dict, engine_lines: dict | None = None) -> FakeRunner:
    """Nodes whose head answers the proof job with `result` and whose engine_logs program
    gives `engine_lines` (node -> lines); every other command succeeds quietly."""
    engine_lines = engine_lines or {}

    def respond(sent):
        if "submission_id" in sent.command:
            return _head_document(result)
        if "engine_logs LOGS_DIR" in str(sent.stdin or ""):
            return json.dumps({"dir": "/tmp/ray/session_latest/logs",
                               "files": [{"path": "worker-a-01-1.err",
                                          "lines": engine_lines.get(sent.node, [])}],
                               "truncated": False, "error": None})
        return None
    return FakeRunner(respond=respond)


def _pp2_options(**kw):
    from cluster.serving import deploy as lib
    from playbooks import deploy

    return deploy.DeployOptions(lib.spec_from_flags("/models/tiny", pp=2, nnodes=2), timeout_s=5, **kw)


FAILED_GROUP = {"ok": False, "groups": [{"index": 0, "ok": False, "port": 29500, "problems": [
    "rank 1 on gpu2: run: DistStoreError: Timed out after 61 seconds waiting for clients"]}]}
GOOD_GROUP = {"ok": True, "groups": [{"index": 0, "ok": True, "busbw_gbps": 0.4,
                                      "latency_us": 90.0, "members": []}]}


def test_deploy_dry_run_shows_the_groups_it_would_prove(deploy_cluster):
    from playbooks import deploy

    nodes = FakeRunner()
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), nodes.session(inventory_of(DEPLOY_INVENTORY)), _pp2_options(dry_run=True), never,
                     client=FakeDashboard())
    assert out.doc["status"] == "DRY_RUN" and nodes.sent == []
    proof = out.doc["fabric_proof"]
    assert proof["status"] == "planned"
    assert proof["groups"] == [{"kind": "pp", "ranks": [0, 1], "nodes": ["gpu1", "gpu2"],
                                "backend": "gloo", "transport": None, "gdr": None,
                                "busbw_gbps": None, "threshold_gbps": None,
                                "verdict": "dry run: would all-reduce on port 29500"}]


def test_deploy_dry_run_lists_the_ports_the_layout_opens_between_nodes(deploy_cluster):
    """PP 2 over 2 nodes: the master port range, node rank 0's message queue, the ranks' gloo
    rendezvous, and the proof's own port between the nodes it joins (issue 39 item 7)."""
    from cluster.serving import deploy as lib
    from playbooks import deploy

    out = deploy.run(inventory_of(DEPLOY_INVENTORY), FakeRunner().session(inventory_of(DEPLOY_INVENTORY)),
                     _pp2_options(dry_run=True), never, client=FakeDashboard())
    ports = out.doc["ports"]
    assert ports[0] == {"ports": "29500-29599", "proto": "tcp",
                        "between": "node rank 1 -> node rank 0",
                        "what": "torch.distributed TCPStore (master_port, picked at start)"}
    assert [p.get("port", p.get("ports")) for p in ports] == [
        "29500-29599", "ephemeral", "ephemeral", 29500]
    assert ports[-1]["between"] == "gpu2 -> gpu1" and "fabric proof" in ports[-1]["what"]
    single = deploy.DeployOptions(lib.spec_from_flags("/models/tiny"), timeout_s=5, dry_run=True)
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), FakeRunner().session(inventory_of(DEPLOY_INVENTORY)), single, never,
                     client=FakeDashboard())
    assert out.doc["status"] == "DRY_RUN" and out.doc["ports"] == []


def test_the_proof_places_ranks_where_the_engine_will_run_them(deploy_cluster):
    """Without --nnodes, PP 2 on nodes of 4 CPUs runs as one engine on one node (the
    multi-node engine's own rule, deploy.engine_nodes): the proof tests that pair inside the
    node, not a cross-node pair the engine will never use."""
    from cluster.serving import deploy as lib
    from playbooks import deploy

    options = deploy.DeployOptions(lib.spec_from_flags("/models/tiny", pp=2), timeout_s=5,
                                   dry_run=True)
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), FakeRunner().session(inventory_of(DEPLOY_INVENTORY)), options, never,
                     client=FakeDashboard())
    (group,) = out.doc["fabric_proof"]["groups"]
    assert (group["kind"], group["ranks"]) == ("pp", [0, 1])
    assert len(set(group["nodes"])) == 1, group


def test_deploy_refuses_on_a_failed_proof_and_deploys_nothing(deploy_cluster):
    from playbooks import deploy

    dash = FakeDashboard()
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), proof_nodes(FAILED_GROUP).session(inventory_of(DEPLOY_INVENTORY)), _pp2_options(), never,
                     client=dash)
    assert out.exit_code == 2 and out.doc["status"] == "REFUSED" and dash.puts == []
    assert "gpu1 -> gpu2" in out.doc["error"] and "port 29500" in out.doc["error"]
    assert out.doc["fabric_proof"]["status"] == "fail"


def test_deploy_force_deploys_despite_the_failed_proof_and_says_so(deploy_cluster):
    from playbooks import deploy

    dash = FakeDashboard()
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), proof_nodes(FAILED_GROUP).session(inventory_of(DEPLOY_INVENTORY)), _pp2_options(force=True),
                     never, client=dash)
    assert out.exit_code == 0 and [p["name"] for p in dash.puts] == ["tiny"]
    assert any("--force deploys anyway" in w for w in out.doc["warnings"])


def test_deploy_proves_then_deploys_and_no_verify_skips(deploy_cluster):
    from playbooks import deploy

    dash, nodes = FakeDashboard(), proof_nodes(GOOD_GROUP)
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), nodes.session(inventory_of(DEPLOY_INVENTORY)),
                     _pp2_options(), never, client=dash)
    assert out.exit_code == 0 and out.doc["fabric_proof"]["status"] == "ok"
    assert out.doc["fabric_proof"]["groups"][0]["transport"] == "TCP"
    # one job on the head, then the ranks' init lines read on the groups' nodes
    asked = nodes.nodes()
    assert asked[0] == "gpu1" and sorted(asked[1:]) == ["gpu1", "gpu2"]
    assert out.doc["engine_transport"][0]["transport"] is None      # no init line: a warning
    assert any("not confirmed" in w for w in out.doc["warnings"])
    dash, nodes = FakeDashboard(), proof_nodes(FAILED_GROUP)
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), nodes.session(inventory_of(DEPLOY_INVENTORY)),
                     _pp2_options(verify=False), never,
                     client=dash)
    assert out.exit_code == 0 and nodes.sent == [] and "fabric_proof" not in out.doc
    assert "fabric proof skipped (--no-verify)" in out.doc["notes"]


GLOO_INIT = ("INFO parallel_state.py:1208] world_size=2 rank={r} local_rank=0 "
             "distributed_init_method=tcp://10.0.0.1:29500 backend=gloo")


def test_deploy_confirms_the_transport_from_the_ranks_init_lines(deploy_cluster):
    from playbooks import deploy

    lines = {"gpu1": [GLOO_INIT.format(r=0)], "gpu2": [GLOO_INIT.format(r=1)]}
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), proof_nodes(GOOD_GROUP, lines).session(inventory_of(DEPLOY_INVENTORY)), _pp2_options(), never,
                     client=FakeDashboard())
    assert out.exit_code == 0, out.doc.get("error")
    got = out.doc["engine_transport"][0]
    assert got["transport"] == "TCP" and got["engine_ranks"] == {"0": "gpu1", "1": "gpu2"}
    assert "backend=gloo" in got["evidence"]


def test_deploy_names_ranks_the_engine_placed_elsewhere(deploy_cluster):
    from playbooks import deploy

    lines = {"gpu1": [GLOO_INIT.format(r=0), GLOO_INIT.format(r=1)]}
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), proof_nodes(GOOD_GROUP, lines).session(inventory_of(DEPLOY_INVENTORY)), _pp2_options(), never,
                     client=FakeDashboard())
    assert out.exit_code == 0
    assert any("rank 1 on gpu1 (proven on gpu2)" in w for w in out.doc["warnings"])


SOCKET_LINE = ("gpu1:124172:124172 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via "
               "NET/Socket/0")


def test_deploy_fails_when_the_engine_runs_on_sockets_where_ib_is_expected(monkeypatch,
                                                                           deploy_cluster):
    from playbooks import deploy

    inv = inventory_of(DEPLOY_INVENTORY)                  # its nodes list ib_hcas: InfiniBand expected
    lines = {"gpu1": [SOCKET_LINE]}
    monkeypatch.setattr("cluster.planning.fabric_proof.backend_for", lambda device: "nccl")
    good = {"ok": True, "groups": [{"index": 0, "ok": True, "busbw_gbps": 45.0, "members": [
        {"rank": 0, "nccl_log": fixture_text("nccl", "041-ray-vllm-deepseek-16rank-ib-"
                                                      "gdrdma-truncated-lines.log")}]}]}
    out = deploy.run(inv, proof_nodes(good, lines).session(inv), _pp2_options(force=True), never,
                     client=FakeDashboard())
    assert out.exit_code == 2 and out.doc["status"] == "TRANSPORT_MISMATCH"
    assert "sockets where the inventory expects InfiniBand" in out.doc["error"]
    assert "via NET/Socket/0" in out.doc["error"]


def test_placement_only_deploys_have_no_proof(deploy_cluster):
    from cluster.serving import deploy as lib
    from playbooks import deploy

    nodes = proof_nodes(FAILED_GROUP)
    options = deploy.DeployOptions(lib.spec_from_flags("/models/tiny", pp=2,
                                                       placement_only=True), timeout_s=5)
    out = deploy.run(inventory_of(DEPLOY_INVENTORY), nodes.session(inventory_of(DEPLOY_INVENTORY)),
                     options, never, client=FakeDashboard())
    assert out.exit_code == 0 and nodes.sent == [] and "fabric_proof" not in out.doc
    assert "fabric proof skipped: placement only, no engine starts" in out.doc["notes"]


# ---------------------------------------------------------------- one playbook shape

PLAYBOOKS = {"deploy": "run", "drain": "run", "fix": "run", "fix (undo)": "undo",
             "model_pull": "run", "nccl_check": "run", "nccl_check (proof)": "run_proof",
             "preflight": "run", "ray_down": "run", "ray_up": "run", "restart_node": "run",
             "status": "run", "uncordon": "run", "tune": "run", "undeploy": "run"}
NOT_PLAYBOOKS = {"__init__", "outcome", "relay", "fix_model", "cache_stage", "serve_wait",
                 "prometheus_head"}


@pytest.mark.parametrize("name", sorted(PLAYBOOKS))
def test_every_playbook_has_the_one_shape(name):
    """run(inventory, session, options, confirm, on_event) -> an Outcome; the session a
    Session (issue 43 item 4: a typed session, the tests' fake nodes behind a real one);
    options a frozen dataclass; anything else keyword-only."""
    import dataclasses
    import importlib
    import inspect
    import typing

    from cluster.nodes.inventory import Inventory
    from cluster.nodes.remote import Session
    from playbooks.outcome import Outcome

    module = importlib.import_module(f"playbooks.{name.split()[0]}")
    run = getattr(module, PLAYBOOKS[name])
    params = list(inspect.signature(run).parameters.values())
    assert [p.name for p in params[:5]] == ["inventory", "session", "options", "confirm",
                                            "on_event"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[5:]), params[5:]
    hints = typing.get_type_hints(run)
    assert hints["inventory"] is Inventory
    assert hints.get("session") is Session, hints.get("session")
    options = hints["options"]
    assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen
    assert issubclass(hints["return"], Outcome)


def test_the_shape_list_names_every_playbook_module():
    names = {p.stem for p in (Path(__file__).parent.parent / "playbooks").glob("*.py")}
    assert names - NOT_PLAYBOOKS == {n.split()[0] for n in PLAYBOOKS}


def test_after_running_the_ranks_logs_are_read_once_for_the_cache_and_the_proof():
    """One engine_logs fan-out over the union of the cache's rank nodes and the proof's group
    nodes, each node once; both readers get the texts from it."""
    from types import SimpleNamespace

    from fakes import FakeRunner, fake_inventory, result
    from playbooks import cache_stage, deploy as deploy_playbook

    inv = fake_inventory(3)
    line = "(Worker_TP0 pid=7) INFO Using cache directory: /root/.cache/vllm/torch_compile_cache/"
    docs = {n.name: result(n.name, json.dumps({"files": [{"lines": [line + f"0123456789/rank_"
                                                                      f"{i}_0/backbone"]}]}))
            for i, n in enumerate(inv.nodes)}
    nodes = FakeRunner(docs)
    session = nodes.session(inv)
    replicas = [{"ranks": [{"rank": 0, "node": "n1"}, {"rank": 1, "node": "n2"}]}]
    ranks = cache_stage.rank_nodes(list(inv.nodes), replicas)
    plan = SimpleNamespace(slots=[SimpleNamespace(node="n2"), SimpleNamespace(node="n3")])
    said: list[str] = []
    logs = deploy_playbook._engine_logs(inv, session, ranks, plan, 1000.0, said.append)
    assert sorted(nodes.nodes()) == ["n1", "n2", "n3"]
    assert all("engine_logs" in s.stdin for s in nodes.sent)
    assert sorted(logs) == ["n1", "n2", "n3"] and "rank_1_0" in logs["n2"][0]
    assert said == ["reading the ranks' log lines on n1, n2, n3"]
    assert deploy_playbook._engine_logs(inv, session, [], None, 1000.0, said.append) == {}
    assert len(nodes.sent) == 3


# ---------------------------------------------------------------- deploy --dry-run with no head (issue 41)


@pytest.fixture
def no_head(monkeypatch):
    """The head does not answer; every node is reached by SSH (no raylet runs: Ray is not up)
    and has the model unless the test says otherwise (`missing`)."""
    from cluster.serving import deploy as lib

    state = RayState(None, None, None, None, ("head gpu1 unreachable: connection refused",))
    monkeypatch.setattr("cluster.ray.ray_state.query_state",
                        lambda session, inv, include_serve=False: (state, None))
    missing: set[str] = set()
    asked = []

    def check_nodes(session, inv, spec, cluster, without_head=False):
        asked.append(without_head)
        checks = [lib.NodeReadiness(n.name, True, n.name not in missing, True, "no-raylet")
                  for n in inv.nodes]
        return lib.judge_checks(checks, spec, cluster, without_head=without_head)

    monkeypatch.setattr(lib, "check_nodes", check_nodes)
    return missing, asked


class NoDashboard:
    def serve_details(self):
        raise AssertionError("a dry run with no head must not ask the dashboard")


def _gpu_inventory(extra: str = "") -> str:
    return DEPLOY_INVENTORY + "expectations: {gpus_per_node: 4, gpu_model: NVIDIA H100 80GB HBM3}\n" \
        + "run_dir: /nonexistent/runs\n" + extra


def test_deploy_dry_run_with_no_head_plans_on_the_inventory_and_exits_0(no_head):
    from cluster.serving import deploy as lib
    from playbooks import deploy

    _, asked = no_head
    options = deploy.DeployOptions(lib.spec_from_flags("/models/tiny", tp=4, pp=2, nnodes=2),
                                   timeout_s=5, dry_run=True)
    out = deploy.run(inventory.loads(_gpu_inventory()), None, options, never,
                     client=NoDashboard())
    doc = out.doc
    assert (doc["status"], out.exit_code, asked) == ("DRY_RUN", 0, [True])
    assert doc["head"] == "unreachable" and "connection refused" in doc["head_error"]
    assert doc["cluster_source"] == "the inventory's expectations.gpus_per_node"
    assert doc["device"] == "gpu" and doc["endpoint"] == "http://10.0.0.1:8000/tiny/v1"
    assert doc["placement"]["num_replicas"] == 1 and doc["previous"] is None
    kinds = {g["kind"] for g in doc["fabric_proof"]["groups"]}
    assert "pp" in kinds and doc["ports"], doc
    assert doc["unchecked"][:3] == list(deploy.WITHOUT_HEAD)
    assert any("$CLUSTER_API_KEY in the Ray environment of gpu1, gpu2" in u
               for u in doc["unchecked"]), doc["unchecked"]
    assert doc["checks"]["ok"]


def test_deploy_dry_run_with_no_head_still_refuses_a_missing_model(no_head):
    from cluster.serving import deploy as lib
    from playbooks import deploy

    missing, _ = no_head
    missing.add("gpu2")
    options = deploy.DeployOptions(lib.spec_from_flags("/models/tiny"), timeout_s=5,
                                   dry_run=True)
    out = deploy.run(inventory.loads(_gpu_inventory()), None, options, never,
                     client=NoDashboard())
    assert (out.doc["status"], out.exit_code) == ("REFUSED", 2)
    assert "missing on gpu2" in out.doc["error"]


def test_deploy_dry_run_with_no_head_and_no_gpu_facts_says_so(no_head):
    from cluster.serving import deploy as lib
    from playbooks import deploy

    options = deploy.DeployOptions(lib.spec_from_flags("/models/tiny"), timeout_s=5,
                                   dry_run=True)
    out = deploy.run(inventory.loads(DEPLOY_INVENTORY + "run_dir: /nonexistent/runs\n"), None,
                     options, never, client=NoDashboard())
    assert (out.doc["status"], out.exit_code, out.doc["device"]) == ("DRY_RUN", 0, "cpu")
    assert any(u.startswith("the GPUs of gpu1, gpu2 (no preflight facts") for u in
               out.doc["unchecked"]), out.doc["unchecked"]
