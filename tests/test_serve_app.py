"""The serving apps: pure placement/arg decisions, then real vLLM (CPU build) behind Ray Serve.

The heavy part starts one single-node Ray in this process (private temp dir, no dashboard),
deploys serve_apps.vllm_app with the tiny dense model and talks to it with the official
`openai` client: model list, completion, chat, streaming, wrong key -> 401, /metrics,
and dry-run placement of the GPU layouts (TP x PP and MoE DP + EP) on fake GPU resources.
Multi-node placement is checked on the simulated cluster, not here. TP 2 on two CPU bundles
('0|1') and a killed replica replaced by Serve run through `cluster deploy` on the simulated
cluster (tests/integration/test_deploy_e2e.py): not a second time here, each an engine start.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket

import pytest

from serve_apps.config import (
    AppConfigError,
    engine_kwargs_for,
    parse_app_args,
    replica_bundles,
    resolve_device,
    serve_deployment_options,
    tp_groups_split_across_nodes,
)

MODEL_ID = "tiny"
KEY_ENV = "CLUSTER_TEST_SERVE_KEY"
KEY = "test-key-4f0c1e"  # a test-only key, published to the test's own Ray


def _args(model_source="/models/m", **overrides):
    args = {"model_loading_config": {"model_id": MODEL_ID, "model_source": model_source}}
    args.update(overrides)
    return args


# ----------------------------------------------------------------------------- pure decisions

def test_gpu_tp4_pp2_bundles_pack_with_replica_in_bundle_0():
    config = parse_app_args(_args(engine_kwargs={"tensor_parallel_size": 4,
                                                 "pipeline_parallel_size": 2}))
    options = serve_deployment_options(config, "gpu")
    assert options["placement_group_strategy"] == "PACK"
    bundles = options["placement_group_bundles"]
    assert len(bundles) == 8
    assert bundles[0] == {"GPU": 1, "CPU": 2}  # worker 0 + the replica's own CPU
    assert all(b == {"GPU": 1, "CPU": 1} for b in bundles[1:])
    assert options["ray_actor_options"]["num_gpus"] == 0
    assert engine_kwargs_for(config, "gpu")["distributed_executor_backend"] == "ray"


def test_cpu_bundles_use_mp_executor_and_replica_claims_no_cpu():
    config = parse_app_args(_args(engine_kwargs={"tensor_parallel_size": 2}))
    assert replica_bundles(config, "cpu") == [{"CPU": 1}, {"CPU": 1}]
    kwargs = engine_kwargs_for(config, "cpu")
    assert kwargs["distributed_executor_backend"] == "mp"
    assert kwargs["model"] == "/models/m" and kwargs["served_model_name"] == [MODEL_ID]
    assert kwargs["enable_log_requests"] is False


def test_device_auto_follows_cluster_gpus():
    config = parse_app_args(_args())
    assert resolve_device(config, {"CPU": 8}) == "cpu"
    assert resolve_device(config, {"CPU": 8, "GPU": 8}) == "gpu"
    assert resolve_device(parse_app_args(_args(device="cpu")), {"GPU": 8}) == "cpu"


def test_request_logging_off_by_default_and_env_through_runtime_env():
    config = parse_app_args(_args(runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": 1}}))
    options = serve_deployment_options(config, "cpu")
    assert options["logging_config"]["enable_access_log"] is False
    assert options["ray_actor_options"]["runtime_env"]["env_vars"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert options["max_ongoing_requests"] >= 256


def test_moe_dp_is_one_replica_holding_every_dp_rank_of_its_node():
    """vLLM's DP layout: one engine of DP 8 on one node, one bundle of its 8 GPUs held by
    the replica (no Serve gang scheduling, no replica per DP rank)."""
    config = parse_app_args(_args(engine_kwargs={"data_parallel_size": 8,
                                                 "enable_expert_parallel": True},
                                  deployment_config={"num_replicas": 1}))
    options = serve_deployment_options(config, "gpu")
    assert options["num_replicas"] == 1
    assert "gang_scheduling_config" not in options
    assert options["placement_group_strategy"] == "STRICT_SPREAD"
    assert options["placement_group_bundles"] == [{"GPU": 8.0, "CPU": 9.0}]
    assert options["ray_actor_options"]["num_gpus"] == 8.0


@pytest.mark.parametrize("args, message", [
    (_args(engine_kwargs={"api_key": "x"}), "api_key_env"),
    (_args(engine_kwargs={"model": "x"}), "model_loading_config"),
    (_args(engine_kwargs={"tensor_parallel_size": 0}), "positive integer"),
    (_args(deployment_config={"placement_group_bundles": []}), "computed"),
    (_args(engine_kwargs={"tensor_parallel_size": 2},
           placement_group_config={"bundles": [{"GPU": 1}]}), "1 bundles"),
    (_args(api_key_env="not a name"), "NAME"),
    (_args(colour="blue"), "unknown app args"),
    ({"model_loading_config": {}}, "model_id"),
])
def test_bad_args_are_refused_with_the_field_named(args, message):
    with pytest.raises(AppConfigError, match=message):
        parse_app_args(args)


def test_ray_executor_refused_on_cpu():
    config = parse_app_args(_args(engine_kwargs={"distributed_executor_backend": "ray"}))
    with pytest.raises(AppConfigError, match="cannot run on cpu"):
        engine_kwargs_for(config, "cpu")


def test_args_round_trip():
    config = parse_app_args(_args(engine_kwargs={"tensor_parallel_size": 2}, api_key_env="K",
                                  placement_group_config={"bundle_per_worker": {"GPU": 1},
                                                          "strategy": "STRICT_PACK"}))
    assert parse_app_args(config.to_args()) == config


def test_stage_split_detection():
    assert tp_groups_split_across_nodes(["a"] * 4 + ["b"] * 4, 4, 2) == []
    assert tp_groups_split_across_nodes(["a", "b", "a", "b", "a", "b", "a", "b"], 4, 2) == []
    assert tp_groups_split_across_nodes(["a"] * 3 + ["b"] * 5, 4, 2) == [0]


def test_tiny_model_is_deterministic_and_idempotent(tiny_model, tiny_model_builder):
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["head_dim"] == 32 and config["vocab_size"] == 2048
    assert config["architectures"] == ["LlamaForCausalLM"]
    weights = next(tiny_model.glob("*.safetensors"))
    before = weights.stat().st_mtime_ns
    assert tiny_model_builder.build_tiny_model(tiny_model, "dense") == tiny_model
    assert weights.stat().st_mtime_ns == before


# ----------------------------------------------------------------------------- real Ray + vLLM

def _missing_heavy_deps() -> str | None:
    for module in ("ray", "vllm", "openai", "httpx"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable"
    if (os.cpu_count() or 1) < 2:
        return "needs 2 CPU cores"
    return None


heavy = pytest.mark.skipif(_missing_heavy_deps() is not None,
                           reason=_missing_heavy_deps() or "")
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
ENGINE_KWARGS = {"max_model_len": 512, "enforce_eager": True, "dtype": "bfloat16"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_instance(tmp_path_factory):
    """A private single-node Ray (2 CPUs, 4 fake GPUs for dry-run placement) with Serve."""
    import ray
    from ray import serve

    from serve_apps.api_key import publish_api_key

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    temp_dir = tmp_path_factory.mktemp("ray")
    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False,
             _temp_dir=str(temp_dir), log_to_driver=False)
    try:
        # The replicas started before this line: the key reaches them only via the GCS.
        publish_api_key(KEY_ENV, KEY)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _deploy(name: str, app) -> None:
    from ray import serve

    serve.run(app, name=name, route_prefix=f"/{name}" if name != "tiny" else "/")


def _engine_args() -> dict:
    return {"engine_kwargs": {**ENGINE_KWARGS, "tensor_parallel_size": 1},
            "runtime_env": {"env_vars": {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "auto"}},
            "api_key_env": KEY_ENV, "device": "cpu"}


@pytest.fixture(scope="module")
def tiny_endpoint(serve_instance, tiny_model):
    from ray import serve

    from serve_apps.vllm_app import build_app

    _deploy("tiny", build_app(_args(str(tiny_model), **_engine_args())))
    yield serve_instance
    serve.delete("tiny")


def _client(base_url: str, key: str = KEY):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _exercise_openai_api(base_url: str) -> None:
    client = _client(base_url)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]

    completion = client.completions.create(model=MODEL_ID, prompt="Hello cluster",
                                           max_tokens=12, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 12 and completion.choices[0].text

    chat = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8

    chunks = list(client.completions.create(model=MODEL_ID, prompt="Stream", max_tokens=10,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 5

    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "stream"}], max_tokens=10,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 10
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@heavy
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_openai_api_through_serve(tiny_endpoint):
    _exercise_openai_api(tiny_endpoint)


@heavy
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_wrong_or_missing_key_gets_401_and_metrics_count_tokens(tiny_endpoint):
    import httpx
    import openai

    with pytest.raises(openai.AuthenticationError) as err:
        _client(tiny_endpoint, key="wrong-key").models.list()
    assert err.value.status_code == 401
    assert httpx.post(f"{tiny_endpoint}/v1/completions",
                      json={"model": MODEL_ID, "prompt": "x"}).status_code == 401

    def generated() -> float:
        text = httpx.get(f"{tiny_endpoint}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total{"))

    before = generated()
    _client(tiny_endpoint).completions.create(model=MODEL_ID, prompt="count", max_tokens=7,
                                              extra_body={"ignore_eos": True})
    assert generated() - before == 7


@heavy
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_placement_report_and_replica_priority(tiny_endpoint):
    import httpx

    report = httpx.get(f"{tiny_endpoint}/v1/placement",
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert report["engine_kwargs"]["distributed_executor_backend"] == "mp"
    assert [b["resources"] for b in report["bundles"]] == [{"CPU": 1.0}]
    # Ray starts workers at nice 15; the replica lowers itself to 0 (we run as root here).
    if os.geteuid() == 0:
        assert report["replica"]["nice"] == 0
    assert KEY not in json.dumps(report)


@heavy
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_dry_run_places_tp2_pp2_workers_on_gpu_bundles(serve_instance):
    """A GPU layout on fake GPUs: bundles and one probe actor per worker, no engine."""
    import httpx
    from ray import serve

    from serve_apps.vllm_app import build_app

    args = _args("/nonexistent/model", engine_kwargs={"tensor_parallel_size": 2,
                                                      "pipeline_parallel_size": 2},
                 device="gpu", dry_run=True, api_key_env=KEY_ENV, replica_num_cpus=0,
                 placement_group_config={"bundle_per_worker": {"GPU": 1}, "strategy": "PACK"})
    _deploy("drydense", build_app(args))
    try:
        report = httpx.get(f"{serve_instance}/drydense/v1/placement",
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
        assert report["engine_kwargs"]["distributed_executor_backend"] == "ray"
        assert [b["resources"] for b in report["bundles"]] == [{"GPU": 1.0}] * 4
        assert sorted(p["bundle_index"] for p in report["probes"]) == [0, 1, 2, 3]
        assert len({g for p in report["probes"] for g in p["gpu_ids"]}) == 4
        assert httpx.post(f"{serve_instance}/drydense/v1/completions", json={},
                          headers={"Authorization": f"Bearer {KEY}"}).status_code == 503
    finally:
        serve.delete("drydense")


@heavy
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_dry_run_moe_dp2_ep_one_engine_on_its_node(serve_instance):
    """MoE DP 2 + EP on one node: one replica holding the node's 2-GPU bundle, its engine
    kwargs vLLM's DP layout (size 2, size_local 2, address = the replica's node, RPC port
    from the multi_node range, no start rank), no engine started."""
    import httpx
    import ray
    from ray import serve

    from serve_apps.vllm_app import build_moe_app

    args = _args("/nonexistent/moe", engine_kwargs={"data_parallel_size": 2},
                 device="gpu", dry_run=True, replica_num_cpus=0,
                 placement_group_config={"bundle_per_worker": {"GPU": 1}},
                 multi_node={"port_min": 31500, "port_max": 31509})
    _deploy("drymoe", build_moe_app(args))
    try:
        report = httpx.get(f"{serve_instance}/drymoe/v1/placement", timeout=30).json()
        kwargs = report["engine_kwargs"]
        assert (kwargs["data_parallel_size"], kwargs["data_parallel_size_local"]) == (2, 2)
        assert kwargs["enable_expert_parallel"] is True
        assert kwargs["data_parallel_address"] == report["replica"]["node_ip"]
        assert 31500 <= kwargs["data_parallel_rpc_port"] <= 31509
        assert "data_parallel_start_rank" not in kwargs
        node, = report["gang_nodes"]
        assert node["node_ip"] == report["replica"]["node_ip"] and not node["headless"]
        assert [b["resources"] for b in report["bundles"]] == [{"GPU": 2.0}]
        assert report["probes"] == []              # node rank 0's bundle is the replica's
        assert ray.available_resources().get("GPU", 0) == 2
    finally:
        serve.delete("drymoe")
