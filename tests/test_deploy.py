"""`cluster deploy` without a cluster: plan/flags -> Serve config (import path, args, runtime_env,
placement bundles, names, API key handling, logging defaults), the apps merge the dashboard's
PUT needs, Serve's status read for one app, the wait loop, log-tail commands and node checks."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from cluster.serving import deploy
from playbooks import serve_wait
from cluster.base.bounds import bound
from cluster.ray.dashboard_api import (DashboardClient, DashboardReply, merge_applications,
                                   parse_reply, redact_runtime_envs, reply_of)
from cluster import node_programs
from cluster.base.errors import UsageError
from cluster.nodes.inventory import loads as load_inventory
from cluster.planning.plan_file import parse_plan
from fakes import DEPLOY_MODEL, build_app, deploy_cluster_of
from fakes import DEPLOY_API_KEY as KEY_VALUE, DEPLOY_INVENTORY as INVENTORY, FakeClock, result as _result

MODEL = DEPLOY_MODEL


def inventory(text: str = INVENTORY):
    return load_inventory(text)


cluster_of = deploy_cluster_of
CPU2 = cluster_of(("10.0.0.1", 2, 0), ("10.0.0.2", 2, 0))
GPU2x4 = cluster_of(("10.0.0.1", 16, 4), ("10.0.0.2", 16, 4))
GPU2x8 = cluster_of(("10.0.0.1", 64, 8), ("10.0.0.2", 64, 8))


def build(spec, cluster=CPU2, device=None):
    return build_app(spec, cluster, device)


# ---------------------------------------------------------------- config generation


def test_deploy_flags_and_plan_files_read_the_planners_bounds():
    """One bound per key (cluster/data/limits.yaml plan:): what `cluster plan` writes,
    `cluster deploy` and a plan file accept, and nothing beyond."""
    top, least = bound("plan", "max_model_len"), bound("plan", "max_model_len_min")
    assert deploy.spec_from_flags(MODEL, max_model_len=top).engine_kwargs["max_model_len"] == top
    for wrong in (top + 1, least - 1):
        with pytest.raises(UsageError, match="--max-model-len"):
            deploy.spec_from_flags(MODEL, max_model_len=wrong)
    with pytest.raises(UsageError, match="--tp"):
        deploy.spec_from_flags(MODEL, tp=bound("plan", "parallel_size") + 1)
    plan = parse_plan(f"model: {MODEL}\nmax_model_len: {top}\n", "plan.yaml")
    assert plan.max_model_len == top


def test_flags_tp2_on_cpu_nodes_import_path_args_and_cpu_env():
    spec = deploy.spec_from_flags(MODEL, tp=2, max_model_len=512)
    app, notes, preview = build(spec)
    assert app["import_path"] == "serve_apps.vllm_app:build_app"
    assert app["name"] == "tiny" and app["route_prefix"] == "/tiny"
    args = app["args"]
    assert args["model_loading_config"] == {"model_id": "tiny", "model_source": MODEL}
    assert args["engine_kwargs"] == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                     "max_model_len": 512}
    assert args["device"] == "cpu" and args["deployment_config"] == {"num_replicas": 1}
    env = args["runtime_env"]["env_vars"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert all(isinstance(v, str) for v in env.values())
    assert preview["bundles_per_replica"] == [{"CPU": 1}, {"CPU": 1}]
    assert preview["strategy"] == "STRICT_PACK" and preview["num_replicas"] == 1


def test_cpu_tp1_leaves_vllm_thread_binding_automatic():
    env = build(deploy.spec_from_flags(MODEL))[0]["args"]["runtime_env"]["env_vars"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env


@pytest.mark.parametrize("cpus, workers, expected", [
    (2, 2, "0|1"), (8, 2, "0-3|4-7"), (4, 4, "0|1|2|3"), (7, 2, "0-2|3-5"), (3, 1, "0-2")])
def test_cpu_bind_list(cpus, workers, expected):
    assert deploy.cpu_bind_list(cpus, workers) == expected


def test_cpu_tp_larger_than_a_node_is_refused():
    with pytest.raises(UsageError, match="4 CPU workers need at least 4 CPUs"):
        build(deploy.spec_from_flags(MODEL, tp=4))


def test_gpu_tp4_pp2_bundles_pack_across_two_4gpu_nodes_with_nccl_env():
    spec = deploy.spec_from_flags(MODEL, tp=4, pp=2)
    app, _, preview = build(spec, GPU2x4)
    assert app["args"]["device"] == "gpu"
    bundles = preview["bundles_per_replica"]
    assert len(bundles) == 8  # TP x PP
    assert bundles[0] == {"GPU": 1, "CPU": 2}  # worker 0 + the replica's own CPU
    assert all(b == {"GPU": 1, "CPU": 1} for b in bundles[1:])
    assert preview["strategy"] == "PACK"  # 8 GPUs do not fit one 4-GPU node
    env = app["args"]["runtime_env"]["env_vars"]
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert not any(k.startswith("VLLM_CPU_") for k in env)
    assert "VLLM_HOST_IP" not in env  # per node: set at ray start


def test_gpu_tp_inside_one_node_is_strict_pack():
    _, _, preview = build(deploy.spec_from_flags(MODEL, tp=4, dp=2), GPU2x8)
    assert preview["strategy"] == "STRICT_PACK" and preview["num_replicas"] == 2
    assert len(preview["bundles_per_replica"]) == 4


def test_nccl_interfaces_that_differ_per_node_stay_out_of_runtime_env():
    head_eth0 = "nccl_socket_ifname: eth0,\n      gloo"
    inv = inventory(INVENTORY.replace(head_eth0, head_eth0.replace("eth0", "ib0"), 1))
    assert {n.nccl_socket_ifname for n in inv.nodes} == {"ib0", "eth0"}
    env = deploy.runtime_env_vars(deploy.spec_from_flags(MODEL), "gpu", GPU2x4, inv)
    assert "NCCL_SOCKET_IFNAME" not in env and env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_dense_plan_replicas_and_strategy_come_from_the_plan():
    from fakes import real_plan

    doc = real_plan("llama-3.1-70b-instruct")   # TP 4, 2 replicas, STRICT_PACK, 1 x 8 GPUs
    spec = deploy.spec_from_plan(parse_plan(yaml.safe_dump(doc), "plan.yaml"))
    app, notes, preview = build(spec, GPU2x8)
    args = app["args"]
    assert args["model_loading_config"]["model_id"] == doc["served_model_name"]
    assert args["model_loading_config"]["model_source"] == doc["model"]
    kw = args["engine_kwargs"]
    assert kw["tensor_parallel_size"] == 4 and kw["pipeline_parallel_size"] == 1
    assert kw["max_model_len"] == doc["max_model_len"]
    assert kw["gpu_memory_utilization"] == doc["gpu_memory_utilization"]
    assert "model" not in kw and "served_model_name" not in kw
    assert "data_parallel_size" not in kw  # dense: replicas are Serve replicas
    assert args["deployment_config"] == {"num_replicas": 2}
    assert preview["strategy"] == "STRICT_PACK" and len(preview["bundles_per_replica"]) == 4
    assert spec.source == "plan:plan.yaml"


def test_multi_node_dense_plan_tp8_pp2_is_one_native_engine_per_two_nodes():
    """The plan chooses vLLM's native multi-node engine for a replica larger than a node:
    one bundle of 8 GPUs per node rank, on distinct nodes; `--executor ray` keeps the old
    PACK layout (16 one-GPU bundles, vLLM's Ray executor)."""
    from fakes import real_plan

    doc = real_plan("llama-3.1-405b-instruct", nodes=2)
    assert doc["placement"]["executor"] == "native" and doc["placement"]["gang"]["nnodes"] == 2
    plan = parse_plan(yaml.safe_dump(doc), "plan.yaml")
    app, _, preview = build(deploy.spec_from_plan(plan), GPU2x8)
    assert app["args"]["engine_kwargs"]["nnodes"] == 2
    assert preview["strategy"] == "STRICT_SPREAD"
    assert [b["GPU"] for b in preview["bundles_per_replica"]] == [8, 8]
    _, _, preview = build(deploy.spec_from_plan(plan, executor="ray", nnodes=1), GPU2x8)
    assert preview["strategy"] == "PACK" and len(preview["bundles_per_replica"]) == 16


def test_moe_plan_dp_ep_uses_the_moe_app_one_engine_per_node():
    from fakes import real_plan

    doc = real_plan("mixtral-8x7b-instruct-v0.1")   # DP 8 + EP on one 8-GPU node
    spec = deploy.spec_from_plan(parse_plan(yaml.safe_dump(doc), "moe.yaml"))
    app, _, preview = build(spec, GPU2x8)
    assert app["import_path"] == "serve_apps.vllm_app:build_moe_app"
    kw = app["args"]["engine_kwargs"]
    assert kw["data_parallel_size"] == 8 and kw["enable_expert_parallel"] is True
    assert kw["tensor_parallel_size"] == 1 and "nnodes" not in kw
    assert preview["num_replicas"] == 1  # one replica = one engine of all 8 DP ranks
    assert "gang" not in preview
    assert preview["bundles_per_replica"] == [{"GPU": 8.0, "CPU": 9.0}]


def test_flags_dp_is_replicas_for_dense_and_ranks_with_expert_parallel():
    dense = deploy.spec_from_flags(MODEL, tp=2, dp=3)
    assert (dense.replicas, dense.data_parallel_size, dense.expert_parallel) == (3, 1, False)
    moe = deploy.spec_from_flags(MODEL, dp=4, expert_parallel=True)
    assert (moe.replicas, moe.data_parallel_size, moe.expert_parallel) == (1, 4, True)
    app, _, preview = build(moe, GPU2x4)
    assert app["args"]["engine_kwargs"]["enable_expert_parallel"] is True
    assert preview["num_replicas"] == 1 and preview["workers_per_replica"] == 4


def test_served_model_name_is_always_explicit():
    assert build(deploy.spec_from_flags(MODEL))[0]["args"]["model_loading_config"]["model_id"] \
        == "tiny"
    spec = deploy.spec_from_flags(MODEL, served_model_name="org/My-Model.v2")
    app = build(spec)[0]
    assert app["args"]["model_loading_config"]["model_id"] == "org/My-Model.v2"
    assert app["name"] == "org-My-Model.v2" and app["route_prefix"] == "/org-My-Model.v2"
    assert deploy.spec_from_flags(MODEL, name="chat", route_prefix="/v").route == "/v"
    with pytest.raises(UsageError):
        deploy.spec_from_flags(MODEL, served_model_name="has space")


def test_api_key_only_by_name_never_by_value(monkeypatch):
    monkeypatch.setenv("CLUSTER_API_KEY", KEY_VALUE)
    spec = deploy.spec_from_flags(MODEL, tp=2)
    inv = inventory()
    app, _ = deploy.build_application(spec, "cpu", CPU2, inv)
    text = deploy.render_config(deploy.serve_config(app, inv), spec.source, 8265)
    assert app["args"]["api_key_env"] == "CLUSTER_API_KEY"
    assert KEY_VALUE not in text and KEY_VALUE not in json.dumps(spec.to_dict())
    assert deploy.find_secrets(text, [KEY_VALUE]) == []
    assert deploy.find_secrets(text + KEY_VALUE, [KEY_VALUE]) == ["sk***"]
    for bad in ({"HF_TOKEN": "x"}, {"VLLM_API_KEY": "x"}, {"CLUSTER_API_KEY": "x"},
                {"AWS_SECRET_ACCESS_KEY": "x"}):
        with pytest.raises(UsageError, match="secrets never go"):
            deploy.spec_from_flags(MODEL, env=bad)
    with pytest.raises(UsageError, match="secrets never go|set by"):
        deploy.spec_from_flags(MODEL, engine_args={"api_key": "x"})
    with pytest.raises(UsageError, match="secrets never go"):
        deploy.spec_from_flags(MODEL, engine_args={"hf_token": "x"})
    with pytest.raises(UsageError, match="NAME of an environment variable"):
        deploy.spec_from_flags(MODEL, api_key_env="sk-123-not-a-name")
    assert build(deploy.spec_from_flags(MODEL, api_key_env=None))[0]["args"]["api_key_env"] \
        is None


def test_per_request_logging_is_off_by_default():
    from serve_apps.config import engine_kwargs_for, parse_app_args, serve_deployment_options

    app = build(deploy.spec_from_flags(MODEL))[0]
    assert app["args"]["enable_request_logging"] is False
    config = parse_app_args(app["args"])
    assert serve_deployment_options(config, "cpu")["logging_config"]["enable_access_log"] is False
    assert engine_kwargs_for(config, "cpu")["enable_log_requests"] is False
    on = build(deploy.spec_from_flags(MODEL, request_logging=True))[0]
    assert on["args"]["enable_request_logging"] is True


def test_user_env_and_engine_args_pass_through_and_are_checked():
    spec = deploy.spec_from_flags(MODEL, env={"VLLM_CPU_KVCACHE_SPACE": "4", "NCCL_DEBUG": "INFO"},
                                  engine_args={"enforce_eager": True, "dtype": "bfloat16"})
    app = build(spec)[0]
    assert app["args"]["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert app["args"]["engine_kwargs"]["enforce_eager"] is True
    for bad in ({"VLLM_HOST_IP": "1.2.3.4"}, {"1BAD": "x"}, {"X": "a\nb"}):
        with pytest.raises(UsageError):
            deploy.spec_from_flags(MODEL, env=bad)
    for bad in ({"tensor_parallel_size": 2}, {"model": "/x"}, {"Max-Len": 3},
                {"distributed_executor_backend": "ray"}):
        with pytest.raises(UsageError):
            deploy.spec_from_flags(MODEL, engine_args=bad)


def test_gpu_only_engine_args_are_dropped_on_cpu_with_a_note():
    spec = deploy.spec_from_flags(MODEL, engine_args={"gpu_memory_utilization": 0.9})
    app, notes, _ = build(spec)
    assert "gpu_memory_utilization" not in app["args"]["engine_kwargs"]
    assert any("gpu_memory_utilization" in n for n in notes)
    assert build(spec, GPU2x4)[0]["args"]["engine_kwargs"]["gpu_memory_utilization"] == 0.9


def test_model_path_must_be_absolute_and_plain():
    for bad in ("models/x", "~/models/x", "/m; reboot", "/m/$(id)"):
        with pytest.raises(UsageError):
            deploy.spec_from_flags(bad)
    assert deploy.spec_from_flags("/models/x/").model == "/models/x"


def test_plan_from_a_bare_config_json_serves_the_directory_and_relative_needs_model():
    from fakes import real_plan

    doc = real_plan("llama-3.1-8b")
    doc["model"] = doc["engine_args"]["model"] = "/models/llama/config.json"
    assert deploy.spec_from_plan(parse_plan(yaml.safe_dump(doc), "p")).model == "/models/llama"
    doc["model"] = doc["engine_args"]["model"] = "tests/model_configs/llama-3.1-8b.json"
    plan = parse_plan(yaml.safe_dump(doc), "p")
    with pytest.raises(UsageError, match="--model"):
        deploy.spec_from_plan(plan)
    assert deploy.spec_from_plan(plan, model="/srv/llama").model == "/srv/llama"


def test_serve_config_shape_and_yaml_round_trip():
    spec = deploy.spec_from_flags(MODEL, tp=2)
    inv = inventory()
    app, _ = deploy.build_application(spec, "cpu", CPU2, inv)
    config = deploy.serve_config(app, inv)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    text = deploy.render_config(config, "flags", 8265)
    assert text.startswith("# Ray Serve config written by `cluster deploy`")
    assert yaml.safe_load(text) == json.loads(json.dumps(config))


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed")
def test_ray_serve_accepts_the_config_schema():
    from ray.serve.schema import ServeDeploySchema

    inv = inventory()
    for spec, cluster in ((deploy.spec_from_flags(MODEL, tp=2), CPU2),
                          (deploy.spec_from_flags(MODEL, tp=4, pp=2), GPU2x4),
                          (deploy.spec_from_flags(MODEL, dp=8, expert_parallel=True), GPU2x8)):
        app, _ = deploy.build_application(spec, cluster.resolve_device("auto"), cluster, inv)
        text = deploy.render_config(deploy.serve_config(app, inv), "flags", 8265)
        schema = ServeDeploySchema.model_validate(yaml.safe_load(text))
        assert schema.applications[0].import_path == spec.import_path
        assert schema.http_options.port == 8000


def test_capacity_problems_name_what_cannot_be_scheduled():
    _, _, preview = build(deploy.spec_from_flags(MODEL, tp=4, pp=2), GPU2x4)
    assert deploy.capacity_problems(preview, GPU2x4) == []
    small = cluster_of(("10.0.0.1", 16, 4))
    msgs = deploy.capacity_problems(preview, small)
    assert msgs and "8 GPU" in msgs[0]
    _, _, strict = build(deploy.spec_from_flags(MODEL, tp=8), GPU2x8)   # STRICT_PACK there
    assert deploy.capacity_problems(strict, GPU2x4)[0].startswith("one replica needs 8 GPU")


def test_endpoint_url():
    inv = inventory()
    assert deploy.endpoint_url(inv, "/tiny") == "http://10.0.0.1:8000/tiny/v1"
    assert deploy.endpoint_url(inv, "/", 9000) == "http://10.0.0.1:9000/v1"


def test_device_auto_follows_gpu_resources():
    assert CPU2.resolve_device("auto") == "cpu" and GPU2x4.resolve_device("auto") == "gpu"
    assert GPU2x4.resolve_device("cpu") == "cpu"


# ---------------------------------------------------------------- merging with other apps


def _details(apps: dict, http=None) -> dict:
    out = {"controller_info": {"node_id": "n"}, "applications": apps,
           "proxy_location": "EveryNode"}
    if http:
        out["http_options"] = http
    return out


def _app(name, prefix, source="declarative"):
    return {"status": "RUNNING", "route_prefix": prefix, "source": source,
            "last_deployed_time_s": 100.0,
            "deployed_app_config": {"name": name, "route_prefix": prefix,
                                    "import_path": "x:app", "args": {"a": 1},
                                    "runtime_env": {"env_vars": {"K": "v"}}}}


def test_merge_keeps_other_declarative_apps_and_replaces_the_same_name():
    new = {"name": "b", "route_prefix": "/b", "import_path": "serve_apps.vllm_app:build_app"}
    details = _details({"a": _app("a", "/a"), "b": _app("b", "/b")},
                       http={"host": "0.0.0.0", "port": 8000})
    out = merge_applications(details, upsert=new, http_options={"host": "0.0.0.0", "port": 9})
    assert [a["name"] for a in out["body"]["applications"]] == ["a", "b"]
    assert out["body"]["applications"][0] == details["applications"]["a"]["deployed_app_config"]
    assert out["body"]["applications"][1] == new
    assert out["body"]["http_options"]["port"] == 8000  # Serve keeps what it started with
    assert out["kept"] == ["a"] and out["previous"]["last_deployed_time_s"] == 100.0
    assert out["error"] is None


def test_merge_on_a_fresh_cluster_sends_our_http_options():
    out = merge_applications({"applications": {}, "controller_info": {}},
                             upsert={"name": "a", "route_prefix": "/a"},
                             http_options={"host": "0.0.0.0", "port": 8000})
    assert out["body"] == {"applications": [{"name": "a", "route_prefix": "/a"}],
                           "http_options": {"host": "0.0.0.0", "port": 8000}}
    assert out["previous"] is None


def test_merge_remove_and_absent_and_conflicts():
    details = _details({"a": _app("a", "/a"), "b": _app("b", "/b"),
                        "imp": _app("imp", "/imp", source="imperative")})
    out = merge_applications(details, remove="a")
    assert [a["name"] for a in out["body"]["applications"]] == ["b"]
    assert out["untouched"] == ["imp"]
    assert merge_applications(details, remove="zzz")["body"] is None
    empty = merge_applications(_details({"a": _app("a", "/a")}), remove="a")
    assert empty["body"]["applications"] == []  # the last app: Serve keeps running, no app
    clash = merge_applications(details, upsert={"name": "c", "route_prefix": "/b"})
    assert clash["body"] is None and "route_prefix '/b'" in clash["error"]
    imperative = merge_applications(details, upsert={"name": "imp", "route_prefix": "/imp"})
    assert imperative["body"] is None and "serve.run" in imperative["error"]


def test_the_merge_runs_standalone_on_the_head():
    """The head program holds merge_applications: it must need nothing from the toolkit."""
    source = "from __future__ import annotations\n" + inspect.getsource(merge_applications)
    namespace: dict = {}
    exec(compile(source, "<head>", "exec"), namespace)  # noqa: S102 - our own source
    out = namespace["merge_applications"](_details({"a": _app("a", "/a")}),
                                          upsert={"name": "b", "route_prefix": "/b"})
    assert [a["name"] for a in out["body"]["applications"]] == ["a", "b"]
    ast.parse(node_programs.source("dashboard"))


def test_redaction_masks_env_values_everywhere():
    details = _details({"a": _app("a", "/a")})
    details["applications"]["a"]["deployments"] = {
        "d": {"deployment_config": {"ray_actor_options": {"runtime_env": {
            "env_vars": {"HF_TOKEN": "hf_secret"}, "pip": ["x"]}}}}}
    text = json.dumps(redact_runtime_envs(details))
    assert "hf_secret" not in text and '"v"' not in text and '"HF_TOKEN": "***"' in text
    assert '"pip": ["x"]' in text


def test_dashboard_command_carries_the_body_on_stdin_and_no_secret():
    inv = inventory()
    client = DashboardClient(session=None, inventory=inv)
    app = {"name": "a-unique-app", "route_prefix": "/a", "args": {"api_key_env": "CLUSTER_API_KEY"}}
    call = client.call("apply", {"upsert": app})
    argv_part, heredoc = call.command, call.stdin
    assert "a-unique-app" not in argv_part and '"name":"a-unique-app"' in heredoc
    assert KEY_VALUE not in call.command and KEY_VALUE not in call.stdin
    assert "NCCL_DEBUG=WARN" in argv_part  # non-secret head env still applies
    assert "http://127.0.0.1:8265" in argv_part


def test_parse_reply():
    line = '{"status": 200, "json": {"a": 1}, "merge": {"kept": ["x"]}}'
    reply = parse_reply(json.loads(line))
    assert reply.ok and reply.json == {"a": 1} and reply.merge == {"kept": ["x"]}
    nothing = reply_of(_result("gpu1", "nothing"), "gpu1")
    assert nothing.status is None and "printed no answer (exit 0): nothing" in nothing.error
    bad = DashboardReply(400, text="ValidationError(...)\nbad import path")
    assert not bad.ok and bad.describe() == "HTTP 400: bad import path"


# ---------------------------------------------------------------- Serve status for one app


def serve_details(status="RUNNING", dep_status="HEALTHY", message="", t=200.0, replicas=None,
                  dead=None, dep_message=""):
    return {"applications": {"tiny": {
        "status": status, "message": message, "route_prefix": "/tiny",
        "last_deployed_time_s": t,
        "deployments": {"vllm-tiny": {
            "status": dep_status, "message": dep_message, "target_num_replicas": 1,
            "replicas": replicas if replicas is not None else [
                {"replica_id": "r1", "state": "RUNNING", "node_ip": "10.0.0.2", "pid": 42,
                 "worker_id": "ab" * 28, "log_file_path": "/serve/replica_tiny_vllm-tiny_r1.log"}],
            "recent_dead_replicas": dead or []}}}}}


def test_app_state_reads_status_replicas_and_dead_ones():
    dead = [{"replica_id": "r0", "state": "STOPPED", "node_ip": "10.0.0.1", "pid": 7}]
    state = deploy.app_state(serve_details(dead=dead), "tiny")
    assert state.status == "RUNNING" and state.route_prefix == "/tiny"
    assert state.deployments["vllm-tiny"]["running_replicas"] == 1
    assert [(r.pid, r.dead) for r in state.replicas] == [(42, False), (7, True)]
    assert state.summary() == "RUNNING: vllm-tiny HEALTHY (1 RUNNING)"
    assert deploy.app_state(serve_details(), "other") is None
    assert deploy.app_state({}, "tiny") is None


@pytest.mark.parametrize("pid, t", [(True, float("nan")), (-3, float("inf")), (1 << 40, -1.0),
                                    (4.5, 1e300), ("42", "200")])
def test_app_state_reads_a_bogus_pid_or_deploy_time_as_missing(pid, t):
    """Serve's numbers are kept only when they are numbers in range (bounds.reply_number):
    a replica's pid names its log files in a command on the node."""
    replica = {"replica_id": "r1", "state": "RUNNING", "node_ip": "10.0.0.2", "pid": pid}
    state = deploy.app_state(serve_details(t=t, replicas=[replica]), "tiny")
    assert state.replicas[0].pid is None and state.last_deployed_time_s is None


def test_failure_reason_is_the_exception_line_without_colour_codes():
    msg = ("The deployment failed to start 3 times in a row. Error:\n\x1b[36mray::X\x1b[39m\n"
           "Traceback (most recent call last):\n  File x\n"
           "serve_apps.config.AppConfigError: engine_kwargs.bogus: not an argument of this vLLM")
    state = deploy.app_state(serve_details("DEPLOY_FAILED", "DEPLOY_FAILED",
                                           "Failed to update the deployments ['vllm-tiny'].",
                                           replicas=[], dep_message=msg), "tiny")
    reason = deploy.failure_reason(deploy.WaitOutcome(state, 30, False), 900)
    assert reason == ("DEPLOY_FAILED: vllm-tiny: serve_apps.config.AppConfigError: "
                      "engine_kwargs.bogus: not an argument of this vLLM")
    timed = deploy.failure_reason(deploy.WaitOutcome(state, 900, True), 900)
    assert timed.startswith("still DEPLOY_FAILED after 900 s")
    assert "never listed" in deploy.failure_reason(deploy.WaitOutcome(None, 5, True), 5)


ENGINE_FAILURES = Path(__file__).parent / "fixtures" / "vllm-engine-failure"


def test_engine_core_error_is_the_exception_the_engine_core_died_of():
    """Real logs of vLLM's own server (fixtures/vllm-engine-failure/SOURCE.md): a TP 2 step
    past its bound (the API side says only EngineDeadError), and a KV cache too small to start."""
    step = (ENGINE_FAILURES / "tp2-execute-model-timeout.log").read_text()
    assert "EngineDeadError" in step      # the API server's line, which says nothing of the cause
    assert deploy.engine_core_error([step]) == "TimeoutError: RPC call to execute_model timed out."
    kv = (ENGINE_FAILURES / "kv-cache-one-block.log").read_text()
    assert deploy.engine_core_error([kv]).startswith(
        "ValueError: No available memory for the cache blocks.")
    # the last one wins across tails (node order), a bare type only when nothing better
    assert deploy.engine_core_error([step, kv]).startswith("ValueError: No available memory")
    bare = "(EngineCore pid=7) ERROR 12-07 11:00:20 [core.py:1512] TimeoutError\n"
    assert deploy.engine_core_error([bare]) == "TimeoutError"
    assert deploy.engine_core_error([step + bare]) == \
        "TimeoutError: RPC call to execute_model timed out."


@pytest.mark.parametrize("text", [
    "", "no engine here\n", "(APIServer pid=1) ERROR 12-07 11:00:20 [x.py:1] ValueError: api side\n",
    "(EngineCore pid=1) ERROR 12-07 11:00:20 [core.py:1512]     raise ValueError(\n",
    "(EngineCore pid=1) ERROR 12-07 11:00:20 [multiproc_executor.py:315] Worker proc VllmWorker-0 "
    "died unexpectedly (exit code: None), shutting down executor.\n",
    "(EngineCore pid=1) INFO 12-07 11:00:20 [core.py:1] ValueError: only info\n",
    "(EngineCore pid=1) ERROR 12-07 11:00:20 [core.py:1512] " + "A" * 5000 + "Error: long\n",
    "\x00\xff" * 1000,
])
def test_engine_core_error_is_none_without_an_engine_core_exception_line(text):
    assert deploy.engine_core_error([text]) is None


def test_engine_core_error_runs_in_linear_time_on_a_hostile_tail():
    """A tail is bounded (60 lines a file), but a line may be long: each is cut at
    ENGINE_LINE_CAP before any pattern runs."""
    line = "(EngineCore pid=1) ERROR 1 2 [a] " + "a" * 10 ** 6 + "\n"
    assert deploy.engine_core_error([line * 3]) is None


def test_engine_failure_detail_names_the_step_bound_and_its_flag():
    detail = deploy.engine_failure_detail("TimeoutError: RPC call to execute_model timed out.",
                                          {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60"})
    assert detail.startswith("the engine core: TimeoutError: RPC call to execute_model")
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 60 s" in detail
    assert "--env VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=N" in detail
    assert "300 s" in deploy.engine_failure_detail("TimeoutError: RPC call to sample_tokens "
                                                   "timed out.", {})
    other = deploy.engine_failure_detail("ValueError: No available memory", {})
    assert other == "the engine core: ValueError: No available memory"


def test_with_engine_error_adds_the_engine_cores_error_once_with_the_apps_bound():
    step = (ENGINE_FAILURES / "tp2-execute-model-timeout.log").read_text()
    app = {"args": {"runtime_env": {"env_vars": {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60"}}}}
    said = deploy.with_engine_error("vllm-x: EngineDeadError", {"n1": "noise", "n2": step}, app)
    assert said.startswith("vllm-x: EngineDeadError; the engine core: TimeoutError: RPC call")
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 60 s" in said
    assert deploy.with_engine_error(said, {"n2": step}, app) == said        # said already
    assert deploy.with_engine_error("x", {"n1": "(no log files found)"}, app) == "x"
    assert "300 s" in deploy.with_engine_error("x", {"n2": step}, {})      # vLLM's own default


class ScriptedClient:
    """Stands in for DashboardClient.serve_details: answers from a list (the last repeats)."""

    def __init__(self, answers):
        self.answers = list(answers)

    def serve_details(self):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_wait_for_app_until_running_ignoring_the_old_version_and_hiccups():
    clock = FakeClock()
    client = ScriptedClient([serve_details("RUNNING", t=100.0),      # old version, ignored
                             RuntimeError("dashboard restarting"),
                             serve_details("DEPLOYING", "UPDATING", replicas=[]),
                             serve_details("RUNNING", t=200.0)])
    events = []
    out = serve_wait.wait_for_app(client, "tiny", 600, previous_time=100.0, poll_s=3,
                                  on_event=events.append, clock=clock, sleep=clock.sleep)
    assert out.running and not out.timed_out and out.waited_s == 9
    assert events == ["DEPLOYING: vllm-tiny UPDATING (no replicas)",
                      "RUNNING: vllm-tiny HEALTHY (1 RUNNING)"]
    assert out.errors == ("dashboard restarting",)


def test_wait_for_app_stops_on_deploy_failed_and_times_out():
    clock = FakeClock()
    failed = serve_wait.wait_for_app(
        ScriptedClient([serve_details("DEPLOY_FAILED", "DEPLOY_FAILED")]), "tiny", 600,
        clock=clock, sleep=clock.sleep)
    assert failed.state.status == "DEPLOY_FAILED" and not failed.timed_out
    clock = FakeClock()
    slow = serve_wait.wait_for_app(ScriptedClient([serve_details("DEPLOYING", "UPDATING")]),
                                   "tiny", 30, poll_s=5, clock=clock, sleep=clock.sleep)
    assert slow.timed_out and slow.state.status == "DEPLOYING" and slow.waited_s <= 30


def test_wait_until_gone():
    clock = FakeClock()
    out = serve_wait.wait_until_gone(
        ScriptedClient([serve_details("DELETING"), {"applications": {}}]), "tiny", 60,
        clock=clock, sleep=clock.sleep)
    assert not out.timed_out and out.state is None


# ---------------------------------------------------------------- logs and node checks


def test_log_tail_command_targets_the_replica_files_safely():
    inv = inventory()
    state = deploy.app_state(serve_details(dead=[{"replica_id": "r0", "state": "STOPPED",
                                                  "node_ip": "10.0.0.1", "pid": 7,
                                                  "log_file_path": "/serve/../../etc/passwd"}]),
                             "tiny")
    live, dead = state.replicas
    cmd = deploy.log_tail_command(inv, [live], "tiny")
    assert cmd.startswith("cd /tmp/ray/session_latest/logs ")
    assert "serve/replica_tiny_vllm-tiny_r1.log" in cmd and f"worker-{'ab' * 28}-*.err" in cmd
    unsafe = deploy.log_tail_command(inv, [dead], "tiny")
    assert "passwd" not in unsafe and "worker-*-7.err" in unsafe
    assert "serve/controller_*.log" in deploy.log_tail_command(inv, [], "tiny")


def _node_facts(node: str, model: str = "model", key: str | None = "set",
                reached: bool = True):
    """A node's facts as the facts layer reads them: the model-dir probe printed `model`, the
    node program found a raylet whose env has the API key `key` (None: no raylet)."""
    from cluster.inspection.facts import NodeFacts, facts_from_outputs
    from cluster.inspection.probes import ProbeOutput
    if not reached:
        return NodeFacts(node, reached=False, error="unreachable: connection refused")
    raylet = [{"pid": 7, "kind": "raylet", "comm": "raylet", "args": [], "env": {},
               "key_states": {"CLUSTER_API_KEY": key}}] if key is not None else []
    doc = json.dumps({"python": "/usr/bin/python3", "versions": {}, "processes": raylet})
    outputs = {"versions": ProbeOutput("versions", "x", 0, doc + "\n", ""),
               "model-dir": ProbeOutput("model-dir", "x", 0, model + "\n", "")}
    n = inventory().nodes[0]
    return replace(facts_from_outputs(n, outputs), node=node)


def _readiness(node: str, api_key_env: str | None, **facts):
    """The node's facts judged by deploy's checks, as check_nodes judges them."""
    from cluster.inspection.checks.deploy import deploy_checks
    inv = inventory()
    (where,) = [n for n in inv.nodes if n.name == node]
    return deploy.node_readiness(where, inv, _node_facts(node, **facts),
                                 deploy_checks(MODEL, api_key_env))


def test_node_checks_name_the_nodes_without_the_model_or_the_key():
    spec = deploy.spec_from_flags(MODEL, tp=2)
    checks = [_readiness("gpu1", spec.api_key_env, model="model", key="set"),
              _readiness("gpu2", spec.api_key_env, model="dir", key="unset")]
    out = deploy.judge_checks(checks, spec, CPU2)
    assert not out.ok
    model_problem, key_problem = out.problems
    assert "missing on gpu2" in model_problem and "gpu1" not in model_problem
    assert "$CLUSTER_API_KEY is not set in the Ray environment of gpu2 (unset)" in key_problem
    assert "--no-api-key" in key_problem
    ok = deploy.judge_checks(checks[:1], spec, CPU2)
    assert ok.ok
    open_spec = deploy.spec_from_flags(MODEL, api_key_env=None)
    assert deploy.judge_checks([_readiness("gpu1", None, model="model", key=None)], open_spec,
                               CPU2).ok
    no_raylet = _readiness("gpu1", "CLUSTER_API_KEY", model="model", key=None)
    assert no_raylet.key == "no-raylet"
    assert _readiness("gpu1", None, model="none").model_dir is False
    broken = _readiness("gpu1", None, model="Permission denied")
    assert broken.reached and broken.error.startswith("check failed: model directory probe")


def test_deploys_node_checks_are_checks_of_the_one_framework():
    """Issue 43 item 3: deploy had its own NodeCheck/Checks beside checks/base.py's. Its checks
    are now the framework's NodeChecks, judged by its `judge` with verdicts and probes."""
    from cluster.inspection.checks import base
    from cluster.inspection.checks.deploy import deploy_checks
    checks = deploy_checks(MODEL, "CLUSTER_API_KEY")
    assert all(isinstance(c, base.NodeCheck) for c in checks)
    assert [c.id for c in checks] == ["model-files", "api-key"]
    assert not hasattr(deploy, "NodeCheck") and not hasattr(deploy, "Checks")
    inv = inventory()
    facts = _node_facts("gpu1", model="dir", key="empty")
    ctx = base.NodeContext(inv.nodes[0], inv, facts.outputs, facts)
    verdicts = [base.judge(c, ctx) for c in checks]
    assert [(v.status.value, v.data) for v in verdicts] == [("fail", "dir"), ("fail", "empty")]


def test_node_checks_unreachable_and_no_ray():
    spec = deploy.spec_from_flags(MODEL)
    out = deploy.judge_checks([_readiness("gpu2", spec.api_key_env, reached=False)],
                              spec, deploy.ClusterView(()))
    assert any("no alive Ray node" in p for p in out.problems)
    assert any("could not check gpu2" in p for p in out.problems)


def test_node_check_command_quotes_and_never_carries_the_key_value(monkeypatch, tmp_path):
    import subprocess
    from cluster.inspection.facts import directory_probe, gather_command
    from cluster.inspection.probes import probe_script, split_probe_output
    monkeypatch.setenv("CLUSTER_API_KEY", KEY_VALUE)
    inv = inventory()
    cmd = gather_command(inv.nodes[0], inv,
                         deploy.node_check_builders("/models/with space", "CLUSTER_API_KEY"))
    assert KEY_VALUE not in cmd and "CLUSTER_API_KEY" in cmd
    # the model probe, run by bash here, on a path with a space and a quote
    model = tmp_path / "with space's"
    for make, want in ((lambda: None, "none"), (model.mkdir, "dir"),
                       (lambda: (model / "config.json").write_text("{}"), "model")):
        make()
        probe = directory_probe(str(model))(inv.nodes[0], inv)
        p = subprocess.run(["bash", "-c", probe_script([probe])], capture_output=True, text=True,
                           timeout=30)
        assert split_probe_output(p.stdout, [probe])["model-dir"].stdout.strip() == want




# ---------------------------------------------------------------- a dry run with no head (issue 41)


def _headless_inventory(tmp_path, facts: bool = True):
    """Two nodes behind a closed loopback port (no head, no SSH answers); with `facts` the
    latest preflight report under the run root says 2 x H100 each (what `cluster plan` reads)."""
    from fakes import closed_port, write_inventory

    port = closed_port()
    (tmp_path / "known_hosts").write_text("")
    if facts:
        run = tmp_path / "runs" / "20260101-000000-preflight"
        run.mkdir(parents=True)
        gpu = {"gpu_count": 2, "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory_mib": 81559,
               "nvlink": True}
        (run / "preflight.json").write_text(json.dumps(
            {"facts": {"nodes": {"node1": gpu, "node2": gpu}}}))
    return write_inventory(tmp_path, f"""\
ssh:
  known_hosts: {tmp_path}/known_hosts
  connect_timeout: 3
nodes:
  - {{name: node1, role: head, address: 127.0.0.1, port: {port}, local: false}}
  - {{name: node2, address: 127.0.0.2, port: {port}, local: false}}
run_dir: {tmp_path}/runs
""")


def _cli(tmp_path, *args):
    """`cluster ARGS` from tmp_path, importing this checkout's package (PYTHONPATH)."""
    import os

    from fakes import cluster_cli

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("CLUSTER_RUN_DIR", None)
    return cluster_cli(*args, cwd=tmp_path, env=env, timeout=180)


def _headless_deploy(tmp_path, *args):
    inv = _headless_inventory(tmp_path)
    return _cli(tmp_path, "-i", str(inv), "deploy", "--model", "/models/tiny", "--pp", "2",
                "--nnodes", "2", "--dry-run", *args)


def test_a_dry_run_with_no_head_shows_config_layout_proof_and_ports(tmp_path):
    """Before `cluster up`: the Serve config, the layout, the groups it would prove and the
    ports from the inventory and the latest preflight's facts, plus one line on what it could
    not check; the nodes SSH did not reach make it exit 1 (warnings), never 2."""
    p = _headless_deploy(tmp_path, "--json")
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    doc = json.loads(p.stdout)
    assert doc["status"] == "DRY_RUN" and doc["head"] == "unreachable"
    assert doc["device"] == "gpu" and "preflight report" in doc["cluster_source"]
    # the keys of a dry run with a head are all there
    for key in ("name", "endpoint", "config_path", "placement", "spec", "checks", "ports",
                "fabric_proof", "warnings", "notes", "previous"):
        assert key in doc, key
    assert doc["endpoint"] == "http://127.0.0.1:8000/tiny/v1"
    config = yaml.safe_load(open(doc["config_path"]).read())
    assert config["applications"][0]["route_prefix"] == "/tiny"
    (group,) = doc["fabric_proof"]["groups"]
    assert (group["kind"], group["nodes"], group["backend"]) == ("pp", ["node1", "node2"], "nccl")
    assert [p.get("port", p.get("ports")) for p in doc["ports"]][0] == "29500-29599"
    unchecked = " ".join(doc["unchecked"])
    for what in ("live capacity", "running apps", "Serve's state", "could not check node1"):
        assert what in unchecked, unchecked
    assert not doc["checks"]["problems"]


def test_a_dry_run_with_no_head_prints_the_plan_and_what_it_could_not_check(tmp_path):
    p = _headless_deploy(tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    out = p.stdout
    assert "no head answered" in out and "serve config: " in out, out
    assert "layout: TP 1 x PP 2 per replica over 2 node(s), 1 replica(s)" in out, out
    assert "fabric proof: dry run: would all-reduce on port 29500" in out, out
    assert "29500-29599/tcp" in out, out
    (line,) = [x for x in out.splitlines() if x.startswith("not checked without a head: ")]
    assert "live capacity" in line and "running apps" in line and "Serve's state" in line
    assert "dry run: would deploy tiny" in out, out


def test_without_a_dry_run_no_head_still_refuses(tmp_path):
    inv = _headless_inventory(tmp_path)
    p = _cli(tmp_path, "-i", str(inv), "deploy", "--model", "/models/tiny", "--yes")
    assert p.returncode == 2 and "the head did not answer" in p.stderr, p.stderr


def _as_running_record(doc: dict, replicas: dict) -> None:
    """A headless dry run's deploy.json turned into the record of a deploy that ended RUNNING
    with `replicas` (id -> node): what `cluster deploy` writes after a real deploy."""

    doc.update(status="RUNNING", dry_run=False, replicas=[
        {"replica_id": r, "node": n, "ranks": [{"rank": 0, "node": n}]}
        for r, n in replicas.items()])
    (Path(doc["run_dir"]) / "deploy.json").write_text(json.dumps(doc))


def test_a_dry_run_with_no_head_shows_the_roll_from_the_last_deploy_record(tmp_path):
    """No head: what runs is the app's last deploy record (deploy.json + its Serve config);
    a changed engine arg shows the roll's steps on its replicas, saying where they come from."""
    inv = _headless_inventory(tmp_path)
    base = ("-i", str(inv), "deploy", "--model", "/models/tiny", "--dp", "2", "--dry-run")
    p = _cli(tmp_path, *base, "--engine-arg", "max_num_seqs=8", "--json")
    first = json.loads(p.stdout)
    assert first["status"] == "DRY_RUN" and "roll" not in first, p.stdout[-2000:]
    _as_running_record(first, {"old-a": "node1", "old-b": "node2"})

    p = _cli(tmp_path, *base, "--engine-arg", "max_num_seqs=4", "--json")
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.stdout[-2000:], p.stderr)
    roll = json.loads(p.stdout)["roll"]
    assert [(s["start"], s["stop"]) for s in roll["steps"]] == [(1, ["old-a"]), (1, ["old-b"])]
    assert roll["old_replicas"] == ["old-a", "old-b"] and not roll["problems"]
    assert roll["source"].startswith(f"the last deploy record {first['run_dir']}/deploy.json")
    unchecked = " ".join(json.loads(p.stdout)["unchecked"])
    assert "the roll's steps come from the last deploy record" in unchecked, unchecked

    p = _cli(tmp_path, *base, "--engine-arg", "max_num_seqs=4")
    assert "rolling change: 2 step(s), 1 replica(s) at a time" in p.stdout, p.stdout
    assert "the steps come from the last deploy record" in p.stdout, p.stdout

    p = _cli(tmp_path, *base, "--engine-arg", "max_num_seqs=8", "--json")   # unchanged
    doc = json.loads(p.stdout)
    assert "roll" not in doc and any("no roll" in n for n in doc["notes"]), doc["notes"]


def test_the_last_deploy_record_passes_over_dry_runs_failures_links_and_other_apps(tmp_path):
    from playbooks.deploy import last_deploy_record

    def run(stamp, kind, serve_config=True, **doc):
        d = tmp_path / f"{stamp}-{kind}"
        d.mkdir()
        (d / f"{kind}.json").write_text(json.dumps({"name": "tiny", "dry_run": False, **doc}))
        if serve_config:
            (d / "serve_config.yaml").write_text(yaml.safe_dump({"applications": [
                {"name": "tiny", "args": {"stamp": stamp}}]}))
        return d

    assert last_deploy_record(tmp_path, "tiny") is None
    run("20260101-000001", "deploy", status="RUNNING")
    run("20260101-000002", "deploy", status="RUNNING", name="other")
    run("20260101-000003", "deploy", status="DRY_RUN", dry_run=True)
    run("20260101-000004", "deploy", status="DEPLOY_FAILED")
    run("20260101-000005", "deploy", serve_config=False, status="RUNNING")
    link = tmp_path / "20260101-000006-deploy"
    link.symlink_to(run("20250101-000000", "deploy", status="RUNNING"))
    found = last_deploy_record(tmp_path, "tiny")
    assert found.app["args"] == {"stamp": "20260101-000001"}
    assert found.path == tmp_path / "20260101-000001-deploy" / "deploy.json"
    run("20260101-000007", "undeploy", serve_config=False, status="ABSENT")
    assert last_deploy_record(tmp_path, "tiny").app["args"] == {"stamp": "20260101-000001"}
    run("20260101-000008", "undeploy", serve_config=False, status="REMOVED")
    assert last_deploy_record(tmp_path, "tiny") is None       # removed after: nothing runs
