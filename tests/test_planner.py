"""cluster plan: model facts, KV arithmetic and the planning rules, on real model configs.

The configs in tests/model_configs are the real config.json values of well-known models (sources
in tests/model_configs/SOURCES.md). The clusters are the common ones: 1x8 H100 80GB, 2x8 H100,
1x8 H200, 8x L40S PCIe, 8x A100 80GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import struct
from pathlib import Path

import pytest
import yaml

from cluster.base.errors import PlanError, UsageError
from cluster.planning.modelinfo import load_model_info, model_info_from_config, parse_quantization
from cluster.planning.planner import (ClusterFacts, NodeGpus, PlanOptions, latest_preflight_report,
                             load_cluster_facts_from_report, lookup_gpu, make_plan,
                             predict_kv_cache_tokens)

from fakes import PLAN_CLUSTERS, model_config, plan_cluster, plan_for  # noqa: E402

CONFIGS = Path(__file__).parent / "model_configs"
GiB = 1024 ** 3

CLUSTERS = PLAN_CLUSTERS
model, cluster = model_config, plan_cluster


def rule_reason(plan, rule: str) -> str:
    hits = [r for r in plan.reasons
            if r.startswith((rule + " ", rule + ":")) and " rejected: " not in r]
    assert hits, f"no {rule} reason in {plan.reasons}"
    return hits[0]


# ---------------------------------------------------------------- model facts


@pytest.mark.parametrize("name, published", [
    ("llama-3.1-8b", 8.03e9),
    ("llama-3.1-70b-instruct", 70.6e9),
    ("llama-3.1-405b-instruct", 405.9e9),
    ("qwen2.5-72b-instruct", 72.7e9),
    ("mixtral-8x7b-instruct-v0.1", 46.7e9),
    ("deepseek-v3", 671e9),
    ("qwen3-30b-a3b", 30.5e9),
    ("mistral-7b-v0.1", 7.24e9),
    ("qwen2.5-7b-instruct-awq", 7.62e9),
])
def test_parameter_count_from_config_matches_the_published_size(name, published):
    params = model(name).params
    assert abs(params.total / published - 1) < 0.01, f"{params.total / 1e9:.2f}B"


def test_moe_fields_of_deepseek_v3_mixtral_and_qwen3_moe():
    ds = model("deepseek-v3")
    assert (ds.num_experts, ds.experts_per_token, ds.moe_intermediate_size) == (256, 8, 2048)
    assert (ds.num_shared_experts, ds.first_k_dense_replace, ds.num_moe_layers) == (1, 3, 58)
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.q_lora_rank) == (512, 64, 1536)
    mx = model("mixtral-8x7b-instruct-v0.1")
    assert (mx.num_experts, mx.experts_per_token, mx.moe_intermediate_size) == (8, 2, 14336)
    assert mx.num_moe_layers == 32 and not mx.is_mla
    qw = model("qwen3-30b-a3b")
    assert (qw.num_experts, qw.experts_per_token, qw.moe_intermediate_size) == (128, 8, 768)
    assert qw.num_shared_experts == 0 and qw.num_moe_layers == 48


def test_head_dim_from_config_wins_over_hidden_over_heads():
    qw = model("qwen3-30b-a3b")                        # hidden 2048 / 32 heads = 64, config: 128
    assert qw.head_dim == 128
    assert model("llama-3.1-70b-instruct").head_dim == 8192 // 64


def test_quantization_configs_set_the_weight_bytes():
    bf16 = model("llama-3.1-8b")
    fp8 = model("llama-3.1-8b-instruct-fp8")
    assert fp8.quantization.method == "fp8" and fp8.quantization.bits == 8
    # linears at 1 byte, embeddings + lm_head (2 x 128256 x 4096) still at 2 bytes
    linear = bf16.params.linear
    assert fp8.weights_bytes == pytest.approx(bf16.weights_bytes - linear, rel=0.001)
    awq = model("qwen2.5-7b-instruct-awq")
    assert awq.quantization.method == "awq"
    assert awq.quantization.bits == pytest.approx(4 + 20 / 128)
    assert 5.0 * GiB < awq.weights_bytes < 5.5 * GiB
    ds = model("deepseek-v3")
    assert ds.quantization.method == "fp8"
    assert 600 * GiB < ds.weights_bytes < 640 * GiB      # FP8 experts + bf16 embeddings
    assert parse_quantization({"quant_method": "mxfp4"}).scope == "experts"
    assert parse_quantization({"quant_method": "bitsandbytes", "load_in_4bit": True}).bits == 4.5
    assert parse_quantization({"quant_method": "something-new"}).bits is None
    assert parse_quantization(None) is None


def test_sliding_window_and_hybrid_layers_are_noted():
    mistral = model("mistral-7b-v0.1")
    assert mistral.sliding_window == 4096 and mistral.num_sliding_layers == 32
    assert any("sliding window 4096 on all 32 layers" in n for n in mistral.attention_notes())
    qwen = model("qwen2.5-72b-instruct")                 # sliding_window set, use_sliding_window false
    assert qwen.sliding_window is None and qwen.attention_notes() == ()
    plan = plan_for("mistral-7b-v0.1", "1x8-h100")
    assert any(r.startswith("R13 kv-cache: sliding window 4096") for r in plan.reasons)
    # layer_types (gpt-oss / Gemma style); a synthetic 4-layer config
    hybrid = model_info_from_config({
        "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 512, "vocab_size": 1000, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }, name="hybrid")
    assert hybrid.num_sliding_layers == 2
    assert "hybrid attention: 2 sliding-window (128) + 2 full-attention layers" in hybrid.attention_notes()[0]
    linear = model_info_from_config({
        "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 512, "vocab_size": 1000,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    }, name="linear")
    assert linear.num_kv_layers == 1
    assert linear.kv_bytes_per_token(2) == 2 * 1 * 2 * 64 * 2


def test_weights_from_safetensors_index_total_size(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "llama-3.1-8b.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 16060522496}, "weight_map": {}}))
    info = load_model_info(tmp_path)
    assert (info.weights_bytes, info.weights_source) == (16060522496, "safetensors-index")
    assert info.name == tmp_path.name


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = 2 * math.prod(shape)                      # BF16: 2 bytes per element
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)
    return offset


def test_weights_from_safetensors_headers_without_an_index(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
        "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "tie_word_embeddings": False}))
    size = _write_safetensors(tmp_path / "model.safetensors",
                              {"a": ("BF16", [2048, 128]), "b": ("BF16", [128])})
    info = load_model_info(tmp_path)
    assert (info.weights_bytes, info.weights_source) == (size, "safetensors-headers")
    assert info.max_position_embeddings == 2048


def test_bad_model_inputs_are_typed_errors(tmp_path):
    with pytest.raises(UsageError, match="no such model"):
        load_model_info(tmp_path / "missing")
    with pytest.raises(UsageError, match="no config.json"):
        load_model_info(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_model_info(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(PlanError, match="layer count"):
        load_model_info(tmp_path)


# ---------------------------------------------------------------- KV arithmetic (exact)


def test_kv_bytes_per_token_standard_attention_domain_example():
    # 80 layers, 8 KV heads, head_dim 128, bf16 -> 2*80*8*128*2 = 327,680 B/token
    m = model("llama-3.1-70b-instruct")
    assert m.kv_bytes_per_token(2) == 327_680
    assert 2048 * 327_680 / GiB == pytest.approx(0.625)
    assert 32_768 * 327_680 / GiB == pytest.approx(10.0)
    assert m.kv_bytes_per_token(1) == 163_840                      # fp8 halves it


def test_kv_bytes_per_token_mla_is_the_latent_not_split_by_tp():
    ds = model("deepseek-v3")
    assert ds.kv_bytes_per_token(2) == 61 * (512 + 64) * 2 == 70_272
    assert ds.kv_bytes_per_token(2, tp=8) == 70_272
    assert ds.kv_bytes_per_token(1) == 35_136


def test_kv_share_per_gpu_under_tp_and_pp_with_kv_heads_replicated():
    m = model("llama-3.1-405b-instruct")
    assert m.kv_bytes_per_token(2, tp=8) == 2 * 126 * 1 * 128 * 2
    assert m.kv_bytes_per_token(2, tp=8, layers=63) == 2 * 63 * 1 * 128 * 2
    qw = model("qwen3-30b-a3b")                                    # 4 KV heads
    assert qw.kv_bytes_per_token(2, tp=8) == qw.kv_bytes_per_token(2, tp=4) == 2 * 48 * 1 * 128 * 2


def test_predict_kv_cache_tokens_for_a_byte_budget():
    m = model("llama-3.1-8b")                                      # 131,072 B/token
    assert predict_kv_cache_tokens(m, 10 * GiB) == 81_920
    assert predict_kv_cache_tokens(m, 10 * GiB, kv_cache_dtype="fp8") == 163_840
    assert predict_kv_cache_tokens(m, 10 * GiB + 131_072 * 5) == 81_920     # whole 16-token blocks
    assert predict_kv_cache_tokens(m, 10 * GiB, tensor_parallel_size=2) == 163_840
    assert predict_kv_cache_tokens(m, 10 * GiB, pipeline_parallel_size=2) == 163_840
    # vLLM's start-up figure: max concurrency (blocks per request) x max_model_len
    assert predict_kv_cache_tokens(m, 10 * GiB, max_model_len=8192) == 81_920
    assert predict_kv_cache_tokens(m, 10 * GiB, max_model_len=1000) == int(5120 / 63 * 1000)
    assert predict_kv_cache_tokens(m, 0) == 0


def test_plan_kv_numbers_follow_from_the_memory_budget():
    plan = plan_for("llama-3.1-70b-instruct", "1x8-h100")
    mem = plan.memory
    assert mem.usable_gib == pytest.approx(mem.weights_gib + mem.overhead_gib + mem.kv_gib)
    assert plan.kv_bytes_per_token == 327_680
    assert plan.kv_bytes_per_token_per_gpu == 81_920                # TP 4: 2 KV heads per GPU
    assert plan.kv_cache_tokens == int(mem.kv_gib * GiB // (81_920 * 16)) * 16
    assert plan.max_concurrency == round(plan.kv_cache_tokens / 8192, 2)
    assert "R13 kv-cache: 2 × 80 layers × 8 KV heads × 128 head_dim × 2 B = 327,680 B/token" \
        in rule_reason(plan, "R13")


# ---------------------------------------------------------------- the rules, table-driven

TABLE = [
    # model, cluster, tp, pp, dp, expert parallel, rule
    ("llama-3.1-8b", "1x8-h100", 1, 1, 8, False, "R1"),
    ("llama-3.1-8b", "2x8-h100", 1, 1, 16, False, "R1"),
    ("llama-3.1-8b", "8x-l40s", 1, 1, 8, False, "R1"),
    ("qwen2.5-7b-instruct-awq", "8x-l40s", 1, 1, 8, False, "R1"),
    ("llama-3.1-70b-instruct", "1x8-h100", 4, 1, 2, False, "R2"),
    ("llama-3.1-70b-instruct", "1x8-h200", 2, 1, 4, False, "R2"),
    ("llama-3.1-70b-instruct", "8x-a100", 4, 1, 2, False, "R2"),
    ("llama-3.1-70b-instruct", "2x8-h100", 4, 1, 4, False, "R2"),
    ("qwen2.5-72b-instruct", "1x8-h100", 4, 1, 2, False, "R2"),
    ("qwen2.5-72b-instruct", "1x8-h200", 2, 1, 4, False, "R2"),
    ("llama-3.1-405b-instruct", "1x8-h200", 8, 1, 1, False, "R2"),
    ("llama-3.1-70b-instruct", "8x-l40s", 1, 8, 1, False, "R3"),
    ("qwen2.5-72b-instruct", "8x-l40s", 1, 8, 1, False, "R3"),
    ("llama-3.1-405b-instruct", "2x8-h100", 8, 2, 1, False, "R4"),
    ("mixtral-8x7b-instruct-v0.1", "1x8-h100", 1, 1, 8, True, "R6"),
    ("mixtral-8x7b-instruct-v0.1", "8x-a100", 1, 1, 8, True, "R6"),
    ("mixtral-8x7b-instruct-v0.1", "1x8-h200", 1, 1, 8, False, "R1"),
    ("deepseek-v3", "1x8-h200", 1, 1, 8, True, "R6"),
    ("deepseek-v3", "2x8-h100", 1, 1, 16, True, "R6"),
    ("qwen3-30b-a3b", "1x8-h100", 1, 1, 8, False, "R1"),
    ("qwen3-30b-a3b", "8x-l40s", 1, 1, 8, True, "R6"),
]


@pytest.mark.parametrize("model_name, cluster_name, tp, pp, dp, ep, rule", TABLE)
def test_parallelism_table(model_name, cluster_name, tp, pp, dp, ep, rule):
    plan = plan_for(model_name, cluster_name)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.data_parallel_size,
            plan.enable_expert_parallel) == (tp, pp, dp, ep)
    assert rule in plan.rules
    assert plan.kv_cache_tokens >= 8 * plan.max_model_len
    args = plan.engine_args
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"],
            args["enable_expert_parallel"]) == (tp, pp, ep)
    assert args["data_parallel_size"] == (dp if ep else 1)
    assert plan.gpus_used <= plan.gpus_total
    if ep:
        assert plan.expert_parallel_size == tp * dp
    rule_reason(plan, rule)


def test_r1_fits_one_gpu_rest_are_replicas():
    plan = plan_for("llama-3.1-8b", "1x8-h100")
    assert plan.replicas == 8 and plan.gpus_per_replica == 1
    assert plan.gpu_memory_utilization == 0.90
    assert "the other GPUs serve replicas: DP 8" in rule_reason(plan, "R1")
    assert plan.placement.bundles_per_node() == {"node1": 8}


def test_r1_moe_that_fits_one_gpu_needs_no_expert_parallel():
    plan = plan_for("qwen3-30b-a3b", "1x8-h100")
    assert not plan.enable_expert_parallel and plan.expert_parallel_size == 1
    assert "MoE, fits one GPU" in rule_reason(plan, "R1")


def test_r2_smallest_tp_that_fits_with_the_rejected_smaller_one_explained():
    plan = plan_for("llama-3.1-70b-instruct", "1x8-h100")
    rejected = [r for r in plan.reasons if " rejected: " in r]
    assert rejected[0].startswith("R1 fits-one-gpu: TP 1 rejected: 131.4 GiB weights")
    assert rejected[1].startswith("R2 tp-in-node: TP 2 rejected: 65.7 GiB weights + 2.5 GiB")
    assert "TP 4 is the smallest of 2/4/8" in rule_reason(plan, "R2")
    assert plan.gpu_memory_utilization == 0.85
    assert [dict(r) for r in plan.placement.replica_nodes] == [{"node1": 4}, {"node1": 4}]


def test_r2_kv_heads_replicated_when_tp_exceeds_kv_heads():
    # Qwen3-30B-A3B has 4 KV heads; as a dense plan on 16 GiB GPUs it needs TP 8
    info = model("qwen3-30b-a3b")
    facts = ClusterFacts.from_flags(gpus_per_node=8, gpu_memory_gib=16, nvlink=True)
    dense = dataclasses.replace(info, num_experts=0, expert_weights_bytes=0)
    plan = make_plan(dense, facts, PlanOptions(max_model_len=4096))
    assert plan.tensor_parallel_size == 8
    assert "KV heads replicated: 8 > 4" in rule_reason(plan, "R2")
    assert plan.kv_bytes_per_token_per_gpu == 2 * 48 * 1 * 128 * 2


def test_r3_no_nvlink_uses_pipeline_instead_of_tensor_parallel():
    plan = plan_for("llama-3.1-70b-instruct", "8x-l40s")
    assert "no NVLink" in rule_reason(plan, "R3")
    assert not any(r.startswith("R2 ") for r in plan.reasons)
    # the same GPUs with NVLink get tensor parallel instead
    tp_plan = make_plan(model("llama-3.1-70b-instruct"), cluster("8x-l40s", nvlink=True), PlanOptions())
    assert tp_plan.tensor_parallel_size == 8 and tp_plan.pipeline_parallel_size == 1


def test_r4_across_nodes_tp_is_gpus_per_node_and_pp_is_nodes():
    plan = plan_for("llama-3.1-405b-instruct", "2x8-h100")
    assert "TP 8 = GPUs per node" in rule_reason(plan, "R4")
    assert plan.placement.nodes_per_replica == 2
    assert plan.placement.bundles_per_node() == {"node1": 8, "node2": 8}
    assert plan.kv_bytes_per_token_per_gpu == 2 * 63 * 1 * 128 * 2


def test_r5_gpu_count_that_does_not_divide_the_model_gets_tp1_and_pp():
    # 3 GPUs per node: TP 2 does not fit, TP 4/8 do not exist there -> TP 1, PP 3
    plan = make_plan(model("llama-3.1-70b-instruct"),
                     ClusterFacts.from_flags(gpus_per_node=3, gpu_model="H100"), PlanOptions())
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 3)
    assert "R5" in plan.rules and "TP 1, PP 3" in rule_reason(plan, "R5")


def test_r6_moe_data_parallel_attention_plus_expert_parallel():
    plan = plan_for("deepseek-v3", "1x8-h200")
    reason = rule_reason(plan, "R6")
    assert "EP = TP × DP = 8" in reason and "256 experts" in reason
    assert plan.engine_args["enable_expert_parallel"] is True
    assert plan.engine_args["data_parallel_size"] == 8
    assert plan.kv_bytes_per_token_per_gpu == 70_272                 # MLA latent per DP rank
    two_groups = plan_for("mixtral-8x7b-instruct-v0.1", "2x8-h100")
    assert two_groups.replicas == 2 and two_groups.data_parallel_size == 8
    across = plan_for("deepseek-v3", "2x8-h100")
    assert "GLOO_SOCKET_IFNAME" in rule_reason(across, "R6")
    assert any("expert all-to-all crosses PCIe" in w for w in plan_for("qwen3-30b-a3b", "8x-l40s").warnings)


def test_r7_mixed_gpu_models_plan_for_the_smallest_and_warn():
    facts = ClusterFacts((NodeGpus("a", 8, "NVIDIA A100-SXM4-80GB", 81920, True),
                          NodeGpus("b", 8, "NVIDIA L40S", 46068, False)))
    plan = make_plan(model("llama-3.1-8b"), facts, PlanOptions())
    assert plan.memory.total_gib == pytest.approx(46068 / 1024)
    assert any(w.startswith("R7 mixed-gpus:") and "NVIDIA L40S" in w for w in plan.warnings)
    assert plan.gpu["nvlink"] is False


@pytest.mark.parametrize("cluster_name, arch", [("8x-a100", "ampere")])
def test_r8_fp8_kv_on_ampere_is_refused_and_never_emitted(cluster_name, arch):
    plan = plan_for("qwen2.5-72b-instruct", cluster_name, kv_cache_dtype="fp8")
    assert plan.kv_cache_dtype == "auto" and plan.engine_args["kv_cache_dtype"] == "auto"
    assert "fp8" not in json.dumps(plan.engine_args)
    assert f"({arch}) has no FP8" in rule_reason(plan, "R8")
    assert any("fp8 refused" in w for w in plan.warnings)
    assert plan.kv_bytes_per_token == 327_680
    old = make_plan(model("llama-3.1-8b"), ClusterFacts.from_flags(gpus_per_node=4, gpu_model="T4"),
                    PlanOptions(kv_cache_dtype="fp8", max_model_len=2048))
    assert old.engine_args["kv_cache_dtype"] == "auto" and "(turing) has no FP8" in rule_reason(old, "R8")


@pytest.mark.parametrize("cluster_name", ["1x8-h100", "1x8-h200", "8x-l40s"])
def test_r8_fp8_kv_on_hopper_and_ada_halves_the_kv_bytes(cluster_name):
    auto = plan_for("llama-3.1-70b-instruct", cluster_name)
    fp8 = plan_for("llama-3.1-70b-instruct", cluster_name, kv_cache_dtype="fp8")
    assert fp8.engine_args["kv_cache_dtype"] == "fp8" and not fp8.warnings
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    if (fp8.tensor_parallel_size, fp8.pipeline_parallel_size) == \
            (auto.tensor_parallel_size, auto.pipeline_parallel_size):
        assert fp8.kv_cache_tokens == pytest.approx(2 * auto.kv_cache_tokens, rel=0.001)


def test_r9_scheduler_defaults_by_workload():
    chat = plan_for("llama-3.1-8b", "1x8-h100")
    docs = plan_for("llama-3.1-8b", "1x8-h100", workload="long-docs")
    assert (chat.engine_args["max_num_seqs"], chat.engine_args["max_num_batched_tokens"]) == (256, 8192)
    assert (docs.engine_args["max_num_seqs"], docs.engine_args["max_num_batched_tokens"]) == (64, 2048)
    assert "R9 workload long-docs" in rule_reason(docs, "R9")
    with pytest.raises(UsageError):
        plan_for("llama-3.1-8b", "1x8-h100", workload="batch")


def test_r10_utilization_defaults_and_override():
    assert plan_for("llama-3.1-8b", "1x8-h100").gpu_memory_utilization == 0.90
    assert plan_for("llama-3.1-70b-instruct", "1x8-h100").gpu_memory_utilization == 0.85
    # TP 2 needs 65.7 GiB weights + 2.5 GiB per GPU: over 0.85 x 79.6 GiB, under 0.95 x 79.6 GiB
    default = plan_for("llama-3.1-70b-instruct", "1x8-h100", min_concurrency=2)
    asked = plan_for("llama-3.1-70b-instruct", "1x8-h100", min_concurrency=2, gpu_memory_utilization=0.95)
    assert default.tensor_parallel_size == 4
    assert asked.gpu_memory_utilization == 0.95 and asked.engine_args["gpu_memory_utilization"] == 0.95
    assert asked.tensor_parallel_size == 2 and "(asked)" in rule_reason(asked, "R10")
    with pytest.raises(UsageError):
        plan_for("llama-3.1-8b", "1x8-h100", gpu_memory_utilization=1.5)


def test_r11_max_model_len_default_and_limits():
    assert plan_for("llama-3.1-8b", "1x8-h100").max_model_len == 8192
    small = model_info_from_config(json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
                                   | {"max_position_embeddings": 4096}, name="short")
    assert make_plan(small, cluster("1x8-h100")).max_model_len == 4096
    assert plan_for("llama-3.1-8b", "1x8-h100", max_model_len=32768).max_model_len == 32768
    with pytest.raises(PlanError, match="exceeds mixtral-8x7b-instruct-v0.1's maximum of 32,768"):
        plan_for("mixtral-8x7b-instruct-v0.1", "1x8-h100", max_model_len=65536)


def test_r12_dtype_and_quantized_weights():
    plan = plan_for("deepseek-v3", "1x8-h200")
    assert plan.engine_args["dtype"] == "bfloat16"
    assert "pre-quantized weights, fp8" in rule_reason(plan, "R12 quantization")
    fp8_on_ampere = plan_for("llama-3.1-8b-instruct-fp8", "8x-a100")
    assert any("FP8 weights need Hopper/Ada" in w for w in fp8_on_ampere.warnings)
    fp32 = model_info_from_config(json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
                                  | {"torch_dtype": "float32"}, name="fp32")
    assert make_plan(fp32, cluster("1x8-h100")).engine_args["dtype"] == "bfloat16"
    assert make_plan(fp32, ClusterFacts.from_flags(gpus_per_node=8, gpu_model="V100")
                     ).engine_args["dtype"] == "float16"
    odd = model_info_from_config(json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
                                 | {"quantization_config": {"quant_method": "new-thing"}}, name="odd")
    assert any("unknown method 'new-thing'" in w for w in make_plan(odd, cluster("1x8-h100")).warnings)


def test_r14_capacity_estimate_when_a_per_gpu_figure_is_given():
    plan = plan_for("llama-3.1-405b-instruct", "2x8-h100", tokens_per_s_per_gpu=1200)
    assert plan.capacity.tokens_per_s == pytest.approx(16 * 1200 * 0.8)
    assert plan.capacity.tokens_per_s_range == pytest.approx((16 * 1200 * 0.70, 16 * 1200 * 0.85))
    assert "16 GPUs × 1200 tokens/s × 0.80" in rule_reason(plan, "R14")
    assert plan_for("llama-3.1-8b", "1x8-h100").capacity is None


# ---------------------------------------------------------------- impossible requests


@pytest.mark.parametrize("model_name, cluster_name, numbers", [
    ("llama-3.1-405b-instruct", "1x8-h100", ["756.0 GiB", "94.5 GiB weights", "67.7 GiB usable",
                                             "at least 12 GPUs"]),
    ("deepseek-v3", "1x8-h100", ["626.8 GiB", "67.7 GiB usable"]),
    ("deepseek-v3", "8x-a100", ["68.0 GiB usable"]),
    ("llama-3.1-405b-instruct", "8x-l40s", ["38.2 GiB usable"]),
])
def test_model_that_does_not_fit_raises_with_the_numbers(model_name, cluster_name, numbers):
    with pytest.raises(PlanError) as exc:
        plan_for(model_name, cluster_name)
    for n in numbers:
        assert n in str(exc.value)


def test_kv_cache_too_small_for_min_concurrency_raises_with_the_numbers():
    with pytest.raises(PlanError) as exc:
        make_plan(model("llama-3.1-8b"), ClusterFacts.from_flags(gpus_per_node=1, gpu_model="L4"),
                  PlanOptions(max_model_len=131072, min_concurrency=8))
    msg = str(exc.value)
    assert "tokens <" in msg and "1,048,576 needed" in msg and "--max-model-len" in msg


# ---------------------------------------------------------------- cluster facts


def test_gpu_lookup_by_nvidia_smi_name_and_alias():
    assert lookup_gpu("NVIDIA H100 80GB HBM3").architecture == "hopper"
    assert lookup_gpu("h100").name == "NVIDIA H100 80GB HBM3"
    assert lookup_gpu("NVIDIA A100-SXM4-80GB").fp8 is False
    assert lookup_gpu("l40s").nvlink is False
    assert lookup_gpu("Quantum GPU 9000") is None
    with pytest.raises(UsageError, match="--gpu-memory-gib"):
        ClusterFacts.from_flags(gpus_per_node=8, gpu_model="Quantum GPU 9000")
    assert ClusterFacts.from_flags(gpus_per_node=8, gpu_model="Quantum GPU 9000",
                                   gpu_memory_gib=40).nodes[0].gpu_memory_mib == 40960


def _report(root: Path, run: str, nodes: dict) -> Path:
    path = root / run / "preflight.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"command": "preflight", "status": "ok", "results": [],
                                "facts": {"nodes": nodes}}))
    return path


def test_facts_from_the_newest_preflight_report(tmp_path):
    h100 = {"reachable": True, "gpu_count": 8, "gpu_model": "NVIDIA H100 80GB HBM3",
            "gpu_memory_mib": 81559, "nvlink": True}
    _report(tmp_path, "20250101-100000-000000-preflight", {"old": {**h100, "gpu_count": 4}})
    newest = _report(tmp_path, "20250102-100000-000000-preflight",
                     {"gpu1": h100, "gpu2": h100, "down": {"reachable": False}})
    assert latest_preflight_report(tmp_path) == newest
    facts = load_cluster_facts_from_report(newest)
    assert [n.node for n in facts.nodes] == ["gpu1", "gpu2"] and facts.skipped == ("unreachable: down (1 node(s))",)
    plan = make_plan(model("llama-3.1-405b-instruct"), facts, PlanOptions())
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (8, 2)
    assert plan.placement.bundles_per_node() == {"gpu1": 8, "gpu2": 8}
    assert any("node skipped" in w for w in plan.warnings)
    assert latest_preflight_report(tmp_path / "nowhere") is None


def test_report_facts_nvlink_null_falls_back_to_the_gpu_model(tmp_path):
    path = _report(tmp_path, "r1", {"n": {"gpu_count": 8, "gpu_model": "NVIDIA L40S",
                                          "gpu_memory_mib": 46068, "nvlink": None}})
    plan = make_plan(model("llama-3.1-70b-instruct"), load_cluster_facts_from_report(path), PlanOptions())
    assert plan.pipeline_parallel_size == 8 and "R3" in plan.rules


def test_report_without_facts_is_a_plan_error(tmp_path):
    path = tmp_path / "preflight.json"
    path.write_text(json.dumps({"results": []}))
    with pytest.raises(PlanError, match="no facts.nodes"):
        load_cluster_facts_from_report(path)
    path.write_text(json.dumps({"facts": {"nodes": {"a": {"reachable": False}}}}))
    with pytest.raises(PlanError, match="no node with GPU facts"):
        load_cluster_facts_from_report(path)


# ---------------------------------------------------------------- JSON contract and CLI

CONTRACT_KEYS = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                 "enable_expert_parallel", "kv_bytes_per_token", "kv_cache_tokens", "max_concurrency",
                 "weights_bytes", "engine_args", "reasons", "warnings"}
ENGINE_ARG_KEYS = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                   "enable_expert_parallel", "max_model_len", "gpu_memory_utilization",
                   "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens", "dtype"}


def test_plan_dict_has_the_contract_keys():
    d = plan_for("deepseek-v3", "1x8-h200").to_dict()
    assert CONTRACT_KEYS <= d.keys()
    assert ENGINE_ARG_KEYS <= d["engine_args"].keys()
    assert d["model"].endswith("deepseek-v3.json") and d["served_model_name"] == "deepseek-v3"
    assert d["kv_bytes_per_token_per_gpu"] == 70_272 and "placement" in d
    json.dumps(d)


def _run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from cluster.commands import plan as plan_cmd
    parser = argparse.ArgumentParser(prog="cluster")
    plan_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    code = args.handler(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_plan_from_flags(capsys):
    code, out, _ = _run_cli(["--model", str(CONFIGS / "llama-3.1-70b-instruct.json"), "--nodes", "1",
                             "--gpus-per-node", "8", "--gpu-model", "NVIDIA H100 80GB HBM3",
                             "--json", "--no-validate"], capsys)
    assert code == 0
    d = json.loads(out)
    assert CONTRACT_KEYS <= d.keys() and d["tensor_parallel_size"] == 4
    assert d["validation"]["status"] == "skipped"


def test_cli_impossible_request_exits_2_with_the_numbers(capsys):
    code, out, err = _run_cli(["--model", str(CONFIGS / "llama-3.1-405b-instruct.json"),
                               "--gpus-per-node", "8", "--gpu-model", "H100", "--no-validate"], capsys)
    assert code == 2 and out == ""
    assert "does not fit" in err and "94.5 GiB weights" in err


def test_cli_refused_fp8_is_a_warning_exit_1_and_the_yaml_plan_for_deploy(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    code, out, _ = _run_cli(["--model", str(CONFIGS / "qwen2.5-72b-instruct.json"), "--gpus-per-node",
                             "8", "--gpu-model", "A100", "--kv-cache-dtype", "fp8", "--out",
                             str(out_file), "--served-model-name", "qwen72", "--no-validate"], capsys)
    assert code == 1
    assert "warnings:" in out and "fp8 refused" in out and "TP 4" in out
    doc = yaml.safe_load(out_file.read_text())
    assert doc["model"].endswith("qwen2.5-72b-instruct.json")
    assert doc["served_model_name"] == "qwen72" and doc["engine_args"]["served_model_name"] == "qwen72"
    assert doc["engine_args"]["kv_cache_dtype"] == "auto"


def test_cli_reads_facts_from_the_run_root(capsys, tmp_path):
    _report(tmp_path, "20250102-100000-000000-preflight",
            {"n1": {"gpu_count": 8, "gpu_model": "NVIDIA H200", "gpu_memory_mib": 143771, "nvlink": True}})
    code, out, _ = _run_cli(["--model", str(CONFIGS / "deepseek-v3.json"), "--run-root", str(tmp_path),
                             "--json", "--no-validate"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["enable_expert_parallel"] is True and d["cluster_source"].endswith("preflight.json")


def test_cli_without_facts_or_with_partial_flags_exits_2(capsys, tmp_path):
    code, _, err = _run_cli(["--model", str(CONFIGS / "llama-3.1-8b.json"), "--run-root",
                             str(tmp_path), "--no-validate"], capsys)
    assert code == 2 and "no cluster facts" in err
    code, _, err = _run_cli(["--model", str(CONFIGS / "llama-3.1-8b.json"), "--gpu-model", "H100",
                             "--no-validate"], capsys)
    assert code == 2 and "--gpus-per-node is required" in err


def test_plan_is_registered_in_the_cli():
    from cluster.cli import COMMANDS
    assert ("plan", "plan") in COMMANDS
