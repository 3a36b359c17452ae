"""Read a Hugging Face model (config.json, safetensors) into the facts the planner needs.

`model_info_from_config(config_dict, ...)` is pure; `load_model_info(path)` reads a model
directory or a config.json file. The returned `ModelInfo` holds the shape (layers, heads, KV
heads, head_dim, hidden, intermediate, vocab), the serving dtype, the maximum length, the MoE
fields (experts, experts per token, expert size, shared experts, leading dense layers), the MLA
fields (kv_lora_rank, qk_rope_head_dim...), the attention pattern (sliding window, layer_types),
the quantization, a parameter count by part and the weight bytes:

- from model.safetensors.index.json `metadata.total_size` when present ("safetensors-index"),
- else from the headers of the *.safetensors files ("safetensors-headers"),
- else from the parameter count x bytes per weight ("parameter-count"; quantized linear layers
  at the bits of their method, embeddings and lm_head in the model dtype).

Example (Llama-3.1-70B config.json, no weights on disk):
    ModelInfo(name='llama-3.1-70b', num_layers=80, num_attention_heads=64, num_kv_heads=8,
              head_dim=128, dtype='bfloat16', weights_bytes=141107412992,
              weights_source='parameter-count', num_experts=0, kv_lora_rank=None, ...)
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from cluster.errors import PlanError, UsageError

DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "half": 2, "fp16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_DTYPE_NAMES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
                "fp16": "float16"}

# Model types whose MLP is not gated (two matrices instead of gate/up/down).
_UNGATED_MLP = {"gpt2", "gpt_neox", "opt", "falcon", "bloom", "gptj", "phi", "starcoder2",
                "gpt_bigcode", "mpt"}
# Model types whose sliding window alternates with full attention when layer_types is absent.
_INTERLEAVED_SLIDING = {"gemma2", "gemma3", "gemma3_text", "cohere2"}
# layer_types entries that keep no growing KV cache.
_NO_KV_LAYER_TYPES = {"linear_attention", "mamba", "mamba2", "conv", "recurrent"}
_FP8_BLOCKS = {"fp8", "fbgemm_fp8", "ptpc_fp8"}


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part of the model (whole model, all layers)."""

    embedding: int
    lm_head: int
    attention: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    router: int
    norms: int

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp
                + self.routed_experts + self.shared_experts + self.router + self.norms)

    @property
    def linear(self) -> int:
        """Decoder linear layers: what weight quantization applies to."""
        return self.attention + self.dense_mlp + self.routed_experts + self.shared_experts

    def to_dict(self) -> dict[str, int]:
        return {"embedding": self.embedding, "lm_head": self.lm_head, "attention": self.attention,
                "dense_mlp": self.dense_mlp, "routed_experts": self.routed_experts,
                "shared_experts": self.shared_experts, "router": self.router, "norms": self.norms,
                "total": self.total}


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's weight quantization (quantization_config)."""

    method: str
    bits: float | None          # bits per quantized weight incl. scales; None when unknown
    scope: str                  # "linear" (all decoder linears) or "experts" (routed experts only)
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "bits": self.bits, "scope": self.scope, "detail": self.detail}


@dataclass(frozen=True)
class ModelInfo:
    """What the planner needs to know about a model. Sizes are whole-model (unsharded)."""

    name: str
    path: str | None
    architecture: str | None
    model_type: str | None
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None
    vocab_size: int
    dtype: str                                # checkpoint dtype: bfloat16 / float16 / float32
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int | None = None
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    first_k_dense_replace: int = 0
    num_moe_layers: int = 0
    # MLA (kv_lora_rank is None: standard attention)
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    num_nextn_predict_layers: int = 0
    # attention pattern
    sliding_window: int | None = None         # active sliding window (None: none or disabled)
    num_sliding_layers: int | None = None     # None with a sliding window: interleaved, unknown
    layer_types: tuple[str, ...] = ()
    num_kv_layers: int = 0                    # layers that keep a KV cache
    # weights
    quantization: Quantization | None = None
    params: ParamCounts | None = None
    weights_bytes: int = 0
    weights_source: str = "parameter-count"
    expert_weights_bytes: int = 0             # routed experts' share of weights_bytes
    embedding_bytes: int = 0
    lm_head_bytes: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def dtype_bytes(self) -> float:
        return DTYPE_BYTES[self.dtype]

    @property
    def non_expert_weights_bytes(self) -> int:
        return self.weights_bytes - self.expert_weights_bytes

    @property
    def layer_weights_bytes(self) -> int:
        """Weights of the decoder layers (what pipeline stages split)."""
        return max(0, self.weights_bytes - self.embedding_bytes - self.lm_head_bytes)

    def kv_bytes_per_token(self, kv_dtype_bytes: float, tp: int = 1, layers: int | None = None) -> int:
        """KV-cache bytes for one token on one GPU of a TP group holding `layers` layers.

        Standard attention: 2 (K and V) x layers x kv_heads_per_gpu x head_dim x bytes, with
        kv_heads_per_gpu = num_kv_heads / tp, at least 1 (replicated when tp > kv heads).
        MLA: layers x (kv_lora_rank + qk_rope_head_dim) x bytes (the latent is not split by TP).
        tp=1 and layers=None give the whole model's bytes per token.
        """
        n_layers = self.num_kv_layers if layers is None else layers
        if self.is_mla:
            return int(n_layers * (self.kv_lora_rank + (self.qk_rope_head_dim or 0)) * kv_dtype_bytes)
        heads = max(1, self.num_kv_heads // tp)
        return int(2 * n_layers * heads * self.head_dim * kv_dtype_bytes)

    def attention_notes(self) -> tuple[str, ...]:
        """Human notes on the attention pattern (sliding window, hybrid layers, MLA)."""
        notes = []
        if self.is_mla:
            notes.append(f"MLA attention: KV cache holds the compressed latent "
                         f"(kv_lora_rank {self.kv_lora_rank} + qk_rope_head_dim "
                         f"{self.qk_rope_head_dim}) per layer, the same on every TP rank")
        if self.sliding_window:
            if self.num_sliding_layers is None:
                notes.append(f"sliding window {self.sliding_window} interleaved with full attention "
                             f"({self.model_type}); KV estimate counts every layer at full length "
                             f"(an upper bound)")
            elif self.num_sliding_layers >= self.num_kv_layers:
                notes.append(f"sliding window {self.sliding_window} on all {self.num_kv_layers} layers: "
                             f"a sequence keeps at most ~{self.sliding_window} tokens of KV, so real "
                             f"concurrency beyond that length is higher than the full-length estimate")
            else:
                notes.append(f"hybrid attention: {self.num_sliding_layers} sliding-window "
                             f"({self.sliding_window}) + {self.num_kv_layers - self.num_sliding_layers} "
                             f"full-attention layers; KV estimate counts every layer at full length "
                             f"(an upper bound; vLLM's hybrid allocator needs less)")
        no_kv = self.num_layers - self.num_kv_layers
        if no_kv > 0:
            notes.append(f"{no_kv} of {self.num_layers} layers keep no KV cache "
                         f"(linear attention / state-space); they are left out of the KV arithmetic")
        return tuple(notes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "path": self.path, "architecture": self.architecture,
            "model_type": self.model_type, "num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "dtype": self.dtype, "max_position_embeddings": self.max_position_embeddings,
            "num_experts": self.num_experts, "experts_per_token": self.experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "first_k_dense_replace": self.first_k_dense_replace,
            "num_moe_layers": self.num_moe_layers, "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim, "sliding_window": self.sliding_window,
            "num_sliding_layers": self.num_sliding_layers, "num_kv_layers": self.num_kv_layers,
            "quantization": self.quantization.to_dict() if self.quantization else None,
            "params": self.params.to_dict() if self.params else None,
            "weights_bytes": self.weights_bytes, "weights_source": self.weights_source,
            "expert_weights_bytes": self.expert_weights_bytes,
        }


# ---------------------------------------------------------------- pure: config -> ModelInfo


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


def _int(cfg: Mapping[str, Any], what: str, *keys: str, default: Any = None) -> int:
    v = _first(cfg, *keys, default=default)
    if v is None:
        raise PlanError(f"config.json has no {what} ({' / '.join(keys)})")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
        raise PlanError(f"config.json {keys[0]}: expected a whole number, got {v!r}")
    return int(v)


def _flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """Multimodal configs nest the language model in text_config / llm_config."""
    cfg = dict(config)
    if _first(cfg, "num_hidden_layers", "n_layer", "num_layers") is None:
        for key in ("text_config", "llm_config", "language_config"):
            inner = cfg.get(key)
            if isinstance(inner, Mapping):
                merged = dict(inner)
                for k in ("quantization_config", "torch_dtype", "dtype", "_name_or_path"):
                    if k in cfg and k not in merged:
                        merged[k] = cfg[k]
                if "architectures" in cfg:
                    merged["architectures"] = cfg["architectures"]
                return merged
    return cfg


def _normalize_dtype(value: Any) -> str:
    if value is None:
        return "bfloat16"
    name = str(value).replace("torch.", "").lower()
    name = _DTYPE_NAMES.get(name, name)
    if name not in ("bfloat16", "float16", "float32"):
        raise PlanError(f"config.json torch_dtype {value!r}: expected bfloat16, float16 or float32")
    return name


@lru_cache(maxsize=1)
def _quant_bits_table() -> dict[str, float]:
    data = yaml.safe_load(resources.files("cluster").joinpath("data/planner.yaml").read_text())
    return {str(k): float(v) for k, v in data["quantization_bits"].items()}


def parse_quantization(qc: Any) -> Quantization | None:
    """quantization_config -> Quantization (bits per quantized weight), None when absent."""
    if not isinstance(qc, Mapping) or not qc:
        return None
    table = _quant_bits_table()
    method = str(qc.get("quant_method") or qc.get("quant_algo") or "unknown").lower()
    if method in ("bitsandbytes", "bnb"):
        key = "bitsandbytes_8bit" if qc.get("load_in_8bit") or qc.get("_load_in_8bit") else "bitsandbytes_4bit"
        return Quantization(method, table[key], "linear", key)
    if method in ("awq", "awq_marlin", "gptq", "gptq_marlin", "auto-round", "intel/auto-round"):
        bits = float(qc.get("bits") or qc.get("w_bit") or 4)
        group = qc.get("group_size") or qc.get("q_group_size") or 128
        extra = (16 + bits) / group if isinstance(group, int) and group > 0 else 0.0
        return Quantization(method, bits + extra, "linear", f"{bits:g}-bit, group {group}")
    if method == "compressed-tensors":
        bits = []
        for group in (qc.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            if weights.get("num_bits"):
                bits.append(float(weights["num_bits"]))
        if bits:
            return Quantization(method, max(bits), "linear", f"{max(bits):g}-bit weights")
        return Quantization(method, None, "linear", "no weight bits in config_groups")
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if "FP4" in algo:
            return Quantization(method, table["nvfp4"], "linear", algo)
        if "FP8" in algo:
            return Quantization(method, table["fp8"], "linear", algo)
        return Quantization(method, None, "linear", algo or "unknown algo")
    if method == "mxfp4":
        return Quantization(method, table["mxfp4"], "experts", "MXFP4 experts, other weights bf16")
    if method in table:
        detail = method
        if method in _FP8_BLOCKS and qc.get("weight_block_size"):
            detail = f"{method}, blocks {qc['weight_block_size']}"
        return Quantization(method, table[method], "linear", detail)
    return Quantization(method, None, "linear", "unknown method")


def _moe_layer_flags(cfg: Mapping[str, Any], num_layers: int, num_experts: int) -> list[bool]:
    if num_experts <= 0:
        return [False] * num_layers
    if "n_routed_experts" in cfg or "first_k_dense_replace" in cfg:     # DeepSeek style
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        return [i >= first_dense and i % freq == 0 for i in range(num_layers)]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:       # Qwen MoE style
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    return [True] * num_layers                                           # Mixtral, gpt-oss...


def count_params(cfg: Mapping[str, Any], *, num_layers: int, hidden: int, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int | None, vocab: int, tie: bool,
                 num_experts: int, moe_inter: int | None, moe_flags: list[bool]) -> ParamCounts:
    """Parameter count by part from the config (dense, MoE and MLA formulas)."""
    model_type = str(cfg.get("model_type") or "")
    # attention, per layer
    if cfg.get("kv_lora_rank") is not None:
        r_kv = int(cfg["kv_lora_rank"])
        rope = int(cfg.get("qk_rope_head_dim") or 0)
        nope = int(cfg.get("qk_nope_head_dim") or 0)
        v_dim = int(cfg.get("v_head_dim") or nope)
        q_rank = cfg.get("q_lora_rank")
        if q_rank:
            q = hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
        else:
            q = hidden * heads * (nope + rope)
        kv = hidden * (r_kv + rope) + r_kv + r_kv * heads * (nope + v_dim)
        attn = q + kv + heads * v_dim * hidden
    else:
        attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
        if cfg.get("attention_bias") or model_type in ("qwen2", "qwen2_moe"):
            attn += heads * head_dim + 2 * kv_heads * head_dim
        if cfg.get("attention_bias"):
            attn += hidden
    mlp_mats = 2 if model_type in _UNGATED_MLP else 3
    inter = intermediate if intermediate is not None else 4 * hidden
    dense_layers = sum(1 for f in moe_flags if not f)
    moe_layers = num_layers - dense_layers
    expert = mlp_mats * hidden * (moe_inter or inter)
    shared = 0
    n_shared = int(cfg.get("n_shared_experts") or 0)
    if n_shared:
        shared = n_shared * mlp_mats * hidden * (moe_inter or inter)
    elif cfg.get("shared_expert_intermediate_size"):
        shared = mlp_mats * hidden * int(cfg["shared_expert_intermediate_size"]) + hidden
    embedding = vocab * hidden
    return ParamCounts(
        embedding=embedding,
        lm_head=0 if tie else vocab * hidden,
        attention=attn * num_layers,
        dense_mlp=dense_layers * mlp_mats * hidden * inter,
        routed_experts=moe_layers * num_experts * expert,
        shared_experts=moe_layers * shared,
        router=moe_layers * hidden * num_experts,
        norms=(2 * num_layers + 1) * hidden,
    )


def _estimated_bytes(params: ParamCounts, dtype_bytes: float, quant: Quantization | None) -> dict[str, float]:
    """Bytes by part: quantized linears at their bits, the rest at the model dtype."""
    def linear(count: int, is_expert: bool) -> float:
        if quant is None or quant.bits is None or (quant.scope == "experts" and not is_expert):
            return count * dtype_bytes
        return count * quant.bits / 8
    return {
        "embedding": params.embedding * dtype_bytes,
        "lm_head": params.lm_head * dtype_bytes,
        "experts": linear(params.routed_experts, True),
        "other": (linear(params.attention + params.dense_mlp + params.shared_experts, False)
                  + (params.router + params.norms) * dtype_bytes),
    }


def model_info_from_config(config: Mapping[str, Any], *, name: str, path: str | None = None,
                           measured_weights_bytes: int | None = None,
                           weights_source: str | None = None) -> ModelInfo:
    """Pure: a parsed config.json (+ measured weight bytes, if known) -> ModelInfo."""
    if not isinstance(config, Mapping):
        raise PlanError("config.json: expected a JSON object")
    cfg = _flatten(config)
    num_layers = _int(cfg, "layer count", "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int(cfg, "hidden size", "hidden_size", "n_embd", "d_model")
    heads = _int(cfg, "attention head count", "num_attention_heads", "n_head", "num_heads")
    if num_layers == 0 or hidden == 0 or heads == 0:
        raise PlanError("config.json: layers, hidden_size and num_attention_heads must be > 0")
    if cfg.get("multi_query") is True:
        kv_heads = 1
    else:
        kv_heads = _int(cfg, "KV head count", "num_key_value_heads", "num_kv_heads", "n_head_kv",
                        default=heads)
    head_dim = _int(cfg, "head_dim", "head_dim", default=hidden // heads)
    intermediate = _first(cfg, "intermediate_size", "ffn_hidden_size", "n_inner")
    intermediate = int(intermediate) if isinstance(intermediate, (int, float)) else None
    vocab = _int(cfg, "vocab size", "vocab_size", "padded_vocab_size")
    dtype = _normalize_dtype(_first(cfg, "torch_dtype", "dtype"))
    max_pos = _first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length",
                     "seq_length", "max_seq_len")
    max_pos = int(max_pos) if isinstance(max_pos, (int, float)) else None
    tie = bool(cfg.get("tie_word_embeddings", True))

    num_experts = int(_first(cfg, "n_routed_experts", "num_local_experts", "num_experts",
                             "moe_num_experts", default=0) or 0)
    experts_per_token = int(_first(cfg, "num_experts_per_tok", "experts_per_token", "moe_top_k",
                                   default=0) or 0)
    moe_inter = _first(cfg, "moe_intermediate_size")
    moe_inter = int(moe_inter) if num_experts and moe_inter else (intermediate if num_experts else None)
    moe_flags = _moe_layer_flags(cfg, num_layers, num_experts)

    kv_lora = cfg.get("kv_lora_rank")
    kv_lora = int(kv_lora) if kv_lora is not None else None

    layer_types = tuple(str(t) for t in (cfg.get("layer_types") or ()))
    if layer_types and len(layer_types) != num_layers:
        layer_types = ()
    num_kv_layers = num_layers - sum(1 for t in layer_types if t in _NO_KV_LAYER_TYPES)
    window = cfg.get("sliding_window")
    window = int(window) if isinstance(window, (int, float)) and window > 0 else None
    if cfg.get("use_sliding_window") is False:
        window = None
    n_sliding: int | None = None
    if window:
        if layer_types:
            n_sliding = sum(1 for t in layer_types if t == "sliding_attention")
            if n_sliding == 0:
                window = None
        elif str(cfg.get("model_type")) in _INTERLEAVED_SLIDING:
            n_sliding = None
        else:
            n_sliding = num_layers
    if window is None:
        n_sliding = None

    quant = parse_quantization(cfg.get("quantization_config") or config.get("quantization_config"))
    params = count_params(cfg, num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, intermediate=intermediate, vocab=vocab, tie=tie,
                          num_experts=num_experts, moe_inter=moe_inter, moe_flags=moe_flags)
    parts = _estimated_bytes(params, DTYPE_BYTES[dtype], quant)
    estimated = sum(parts.values())
    if measured_weights_bytes:
        total = int(measured_weights_bytes)
        source = weights_source or "measured"
        scale = total / estimated if estimated else 1.0
    else:
        total = int(math.ceil(estimated))
        source = "parameter-count"
        scale = 1.0
    archs = cfg.get("architectures") or []
    return ModelInfo(
        name=name, path=path,
        architecture=str(archs[0]) if archs else None,
        model_type=str(cfg["model_type"]) if cfg.get("model_type") else None,
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        vocab_size=vocab, dtype=dtype, max_position_embeddings=max_pos, tie_word_embeddings=tie,
        num_experts=num_experts, experts_per_token=experts_per_token,
        moe_intermediate_size=moe_inter,
        num_shared_experts=int(cfg.get("n_shared_experts") or (1 if cfg.get("shared_expert_intermediate_size") else 0)),
        shared_expert_intermediate_size=(int(cfg["shared_expert_intermediate_size"])
                                         if cfg.get("shared_expert_intermediate_size") else None),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        num_moe_layers=sum(moe_flags),
        kv_lora_rank=kv_lora,
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]) if cfg.get("qk_rope_head_dim") is not None else None,
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]) if cfg.get("qk_nope_head_dim") is not None else None,
        v_head_dim=int(cfg["v_head_dim"]) if cfg.get("v_head_dim") is not None else None,
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        sliding_window=window, num_sliding_layers=n_sliding, layer_types=layer_types,
        num_kv_layers=num_kv_layers,
        quantization=quant, params=params,
        weights_bytes=total, weights_source=source,
        expert_weights_bytes=int(parts["experts"] * scale),
        embedding_bytes=int(parts["embedding"] * scale),
        lm_head_bytes=int(parts["lm_head"] * scale),
    )


# ---------------------------------------------------------------- I/O: a model dir or config.json


def safetensors_data_bytes(path: Path) -> int:
    """Tensor bytes in one .safetensors file, from its header (8-byte length + JSON)."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise PlanError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > 100 * 1024 * 1024:
            raise PlanError(f"{path}: safetensors header of {length} bytes is implausible")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise PlanError(f"{path}: unreadable safetensors header ({exc})") from None
    end = 0
    for key, entry in header.items():
        if key == "__metadata__" or not isinstance(entry, Mapping):
            continue
        offsets = entry.get("data_offsets") or [0, 0]
        end = max(end, int(offsets[1]))
    return end


def measured_weights(model_dir: Path) -> tuple[int | None, str | None]:
    """(bytes, source) from the index's metadata.total_size, else the safetensors headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        except (OSError, ValueError) as exc:
            raise PlanError(f"{index}: unreadable ({exc})") from None
        if isinstance(total, (int, float)) and total > 0:
            return int(total), "safetensors-index"
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return sum(safetensors_data_bytes(f) for f in files), "safetensors-headers"
    return None, None


def load_model_info(path: str | Path) -> ModelInfo:
    """Read a model directory (config.json + weights) or a bare config.json file."""
    p = Path(path).expanduser()
    if p.is_dir():
        config_file, model_dir, name = p / "config.json", p, p.resolve().name
    elif p.is_file():
        config_file, model_dir = p, p.parent
        name = p.parent.resolve().name if p.name == "config.json" else p.stem
    else:
        raise UsageError(f"--model {path}: no such model directory or config.json")
    if not config_file.is_file():
        raise UsageError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{config_file}: not valid JSON ({exc})") from None
    try:
        measured, source = measured_weights(model_dir) if p.is_dir() or p.name == "config.json" else (None, None)
        return model_info_from_config(config, name=name, path=str(p),
                                      measured_weights_bytes=measured, weights_source=source)
    except PlanError as exc:
        raise PlanError(f"{config_file}: {exc}") from None
