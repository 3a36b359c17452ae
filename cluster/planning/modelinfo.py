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

Every field is checked where it is read (right type, bools are not numbers, finite, inside
cluster/data/limits.yaml `model:`; KV heads divide the attention heads; sizes positive), and the
files are read with size caps, without NaN/Infinity and with deep nesting refused
(`read_json_file`, `loads_json`): a config that breaks any of this is a PlanError naming the
key and the value, never another exception.

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
from pathlib import Path
from typing import Any, Mapping

from cluster.base.bounds import bound, check_float, check_int
from cluster.base.errors import ClusterError, PlanError, UsageError
from cluster.base.results import Record
from cluster.base.textsafe import safe_line
from cluster.base.yamlfile import packaged

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
class Quantization(Record):
    """A checkpoint's weight quantization (quantization_config)."""

    method: str
    bits: float | None          # bits per quantized weight incl. scales; None when unknown
    scope: str                  # "linear" (all decoder linears) or "experts" (routed experts only)
    detail: str


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
#
# Every field is checked where it is read: of the right type (bools are not numbers), finite,
# and in the range of cluster/data/limits.yaml `model:`; the message names the key and value.


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


def _found(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any] | None:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return k, v
    return None


def _int(cfg: Mapping[str, Any], what: str, *keys: str, default: int | None = None,
         lo: int = 1, limit: str | None = None) -> int:
    """The first of `keys` present, as a whole number in [lo, limits.yaml model.<limit>]."""
    hit = _found(cfg, keys)
    if hit is None:
        if default is None:
            raise PlanError(f"config.json has no {what} ({' / '.join(keys)})")
        return default
    key, value = hit
    return check_int(value, f"config.json {key}", lo=lo, hi=bound("model", limit or keys[0]),
                     error=PlanError, integral_float=True)


def _opt_int(cfg: Mapping[str, Any], *keys: str, lo: int = 1, limit: str) -> int | None:
    """Like _int for an optional field: None when absent (null)."""
    hit = _found(cfg, keys)
    if hit is None:
        return None
    key, value = hit
    return check_int(value, f"config.json {key}", lo=lo, hi=bound("model", limit),
                     error=PlanError, integral_float=True)


def _bool(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise PlanError(f"config.json {key}: expected true or false, got {_short(value)}")
    return value


def _flag(cfg: Mapping[str, Any], key: str) -> bool | None:
    """An optional boolean: true, false or None (absent/null); anything else is refused."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, bool):
        raise PlanError(f"config.json {key}: expected true or false, got {_short(value)}")
    return value


def _str(value: Any, key: str) -> str | None:
    """An optional string field, control characters removed (it reaches the terminal)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise PlanError(f"config.json {key}: expected a string, got {_short(value)}")
    return safe_line(value, limit=200)


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply>"
    return safe_line(text if len(text) <= 60 else text[:57] + "...")


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
    if not isinstance(value, str):
        raise PlanError(f"config.json torch_dtype {_short(value)}: expected bfloat16, float16 or "
                        f"float32")
    name = value.replace("torch.", "").lower()
    name = _DTYPE_NAMES.get(name, name)
    if name not in ("bfloat16", "float16", "float32"):
        raise PlanError(f"config.json torch_dtype {_short(value)}: expected bfloat16, float16 or "
                        f"float32")
    return name


@lru_cache(maxsize=1)
def _quant_bits_table() -> dict[str, float]:
    data = packaged("planner.yaml")
    return {str(k): float(v) for k, v in data["quantization_bits"].items()}


def _bits(value: Any, key: str) -> float:
    return check_float(value, f"config.json quantization_config.{key}", lo=0, lo_open=True,
                       hi=bound("model", "quantization_bits"), error=PlanError)


def _mapping(value: Any, key: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PlanError(f"config.json {key}: expected an object, got {_short(value)}")
    return value


def _block_size(value: Any) -> str:
    if not isinstance(value, list) or not 1 <= len(value) <= 4:
        raise PlanError(f"config.json quantization_config.weight_block_size: expected a list of "
                        f"1 to 4 whole numbers, got {_short(value)}")
    sizes = [check_int(v, "config.json quantization_config.weight_block_size", lo=1,
                       hi=bound("model", "group_size"), error=PlanError) for v in value]
    return str(sizes)


def parse_quantization(qc: Any) -> Quantization | None:
    """quantization_config -> Quantization (bits per quantized weight), None when absent."""
    if qc is not None and not isinstance(qc, Mapping):
        raise PlanError(f"config.json quantization_config: expected an object, got {_short(qc)}")
    if not qc:
        return None
    table = _quant_bits_table()
    raw_method = qc.get("quant_method") or qc.get("quant_algo") or "unknown"
    method = (_str(raw_method, "quantization_config.quant_method") or "unknown").lower()
    if method in ("bitsandbytes", "bnb"):
        key = "bitsandbytes_8bit" if qc.get("load_in_8bit") or qc.get("_load_in_8bit") else "bitsandbytes_4bit"
        return Quantization(method, table[key], "linear", key)
    if method in ("awq", "awq_marlin", "gptq", "gptq_marlin", "auto-round", "intel/auto-round"):
        bits_key = "bits" if qc.get("bits") is not None else "w_bit"
        raw_bits = qc.get(bits_key)
        bits = 4.0 if raw_bits is None or raw_bits == 0 else _bits(raw_bits, bits_key)
        group_key = "group_size" if qc.get("group_size") is not None else "q_group_size"
        raw_group = qc.get(group_key)
        group = 128 if raw_group is None or raw_group == 0 else check_int(
            raw_group, f"config.json quantization_config.{group_key}", lo=-1,
            hi=bound("model", "group_size"), error=PlanError)
        extra = (16 + bits) / group if group > 0 else 0.0
        return Quantization(method, bits + extra, "linear", f"{bits:g}-bit, group {group}")
    if method == "compressed-tensors":
        bits = []
        for name, group in _mapping(qc.get("config_groups"), "quantization_config.config_groups").items():
            where = f"quantization_config.config_groups.{safe_line(name, limit=40)}"
            weights = _mapping(_mapping(group, where).get("weights"), f"{where}.weights")
            if weights.get("num_bits"):
                bits.append(_bits(weights["num_bits"], "config_groups.*.weights.num_bits"))
        if bits:
            return Quantization(method, max(bits), "linear", f"{max(bits):g}-bit weights")
        return Quantization(method, None, "linear", "no weight bits in config_groups")
    if method == "modelopt":
        algo = (_str(qc.get("quant_algo", ""), "quantization_config.quant_algo") or "").upper()
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
            detail = f"{method}, blocks {_block_size(qc['weight_block_size'])}"
        return Quantization(method, table[method], "linear", detail)
    return Quantization(method, None, "linear", "unknown method")


def _layer_list(cfg: Mapping[str, Any], key: str, num_layers: int) -> list[int]:
    value = cfg.get(key) or []
    if not isinstance(value, list) or len(value) > num_layers:
        raise PlanError(f"config.json {key}: expected a list of at most {num_layers} layer "
                        f"indexes, got {_short(value)}")
    return [check_int(v, f"config.json {key}", lo=0, hi=num_layers, error=PlanError) for v in value]


def _moe_layer_flags(cfg: Mapping[str, Any], num_layers: int, num_experts: int) -> list[bool]:
    if num_experts <= 0:
        return [False] * num_layers
    if "n_routed_experts" in cfg or "first_k_dense_replace" in cfg:     # DeepSeek style
        first_dense = _opt_int(cfg, "first_k_dense_replace", lo=0, limit="num_layers") or 0
        freq = _opt_int(cfg, "moe_layer_freq", lo=0, limit="num_layers") or 1
        return [i >= first_dense and i % freq == 0 for i in range(num_layers)]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:       # Qwen MoE style
        step = _opt_int(cfg, "decoder_sparse_step", lo=0, limit="num_layers") or 1
        dense = set(_layer_list(cfg, "mlp_only_layers", num_layers))
        return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    return [True] * num_layers                                           # Mixtral, gpt-oss...


@dataclass(frozen=True)
class _Mla:
    """Validated MLA fields (DeepSeek-style compressed KV)."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int | None
    qk_nope_head_dim: int | None
    v_head_dim: int | None


def _mla(cfg: Mapping[str, Any]) -> _Mla | None:
    kv_lora = _opt_int(cfg, "kv_lora_rank", lo=1, limit="lora_rank")
    if kv_lora is None:
        return None
    return _Mla(kv_lora, _opt_int(cfg, "q_lora_rank", lo=0, limit="lora_rank") or None,
                _opt_int(cfg, "qk_rope_head_dim", lo=0, limit="lora_rank"),
                _opt_int(cfg, "qk_nope_head_dim", lo=0, limit="lora_rank"),
                _opt_int(cfg, "v_head_dim", lo=0, limit="lora_rank"))


def count_params(cfg: Mapping[str, Any], *, num_layers: int, hidden: int, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int | None, vocab: int, tie: bool,
                 num_experts: int, moe_inter: int | None, moe_flags: list[bool]) -> ParamCounts:
    """Parameter count by part from the config (dense, MoE and MLA formulas)."""
    model_type = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else ""
    bias = _bool(cfg, "attention_bias", False)
    # attention, per layer
    mla = _mla(cfg)
    if mla is not None:
        r_kv = mla.kv_lora_rank
        rope = mla.qk_rope_head_dim or 0
        nope = mla.qk_nope_head_dim or 0
        v_dim = mla.v_head_dim if mla.v_head_dim is not None else nope
        q_rank = mla.q_lora_rank
        if q_rank:
            q = hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
        else:
            q = hidden * heads * (nope + rope)
        kv = hidden * (r_kv + rope) + r_kv + r_kv * heads * (nope + v_dim)
        attn = q + kv + heads * v_dim * hidden
    else:
        attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
        if bias or model_type in ("qwen2", "qwen2_moe"):
            attn += heads * head_dim + 2 * kv_heads * head_dim
        if bias:
            attn += hidden
    mlp_mats = 2 if model_type in _UNGATED_MLP else 3
    inter = intermediate if intermediate is not None else 4 * hidden
    dense_layers = sum(1 for f in moe_flags if not f)
    moe_layers = num_layers - dense_layers
    expert = mlp_mats * hidden * (moe_inter or inter)
    shared = 0
    n_shared = _opt_int(cfg, "n_shared_experts", lo=0, limit="num_experts") or 0
    shared_inter = _opt_int(cfg, "shared_expert_intermediate_size", lo=0, limit="intermediate_size")
    if n_shared:
        shared = n_shared * mlp_mats * hidden * (moe_inter or inter)
    elif shared_inter:
        shared = mlp_mats * hidden * shared_inter + hidden
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


def _heads(cfg: Mapping[str, Any], heads: int) -> int:
    """KV heads, checked to divide the attention heads (whole query groups)."""
    if _flag(cfg, "multi_query") is True:
        return 1
    keys = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
    kv_heads = _int(cfg, "KV head count", *keys, default=heads, lo=1, limit="num_attention_heads")
    if heads % kv_heads:
        key = (_found(cfg, keys) or (keys[0], kv_heads))[0]
        raise PlanError(f"config.json {key} {kv_heads} does not divide num_attention_heads {heads}: "
                        f"grouped-query attention needs a whole number of query heads per KV head")
    return kv_heads


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    value = cfg.get("layer_types")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise PlanError(f"config.json layer_types: expected a list of strings, got {_short(value)}")
    if len(value) != num_layers:
        return ()
    return tuple(safe_line(t, limit=64) for t in value)


def _window(cfg: Mapping[str, Any]) -> int | None:
    value = cfg.get("sliding_window")
    if value is None or value is False:
        return None
    hi = bound("model", "sliding_window")
    window = check_int(value, "config.json sliding_window", lo=-hi, hi=hi, error=PlanError,
                       integral_float=True)
    return window if window > 0 else None


def _architecture(cfg: Mapping[str, Any]) -> str | None:
    archs = cfg.get("architectures")
    if archs is None or archs == []:
        return None
    if isinstance(archs, str):
        return _str(archs, "architectures")
    if not isinstance(archs, list):
        raise PlanError(f"config.json architectures: expected a list of names, got {_short(archs)}")
    return _str(archs[0], "architectures[0]")


def model_info_from_config(config: Mapping[str, Any], *, name: str, path: str | None = None,
                           measured_weights_bytes: int | None = None,
                           weights_source: str | None = None) -> ModelInfo:
    """Pure: a parsed config.json (+ measured weight bytes, if known) -> ModelInfo.

    Raises PlanError naming the key and value of the first field that is not a number of the
    right type and range (cluster/data/limits.yaml `model:`) or that contradicts another.
    """
    if not isinstance(config, Mapping):
        raise PlanError("config.json: expected a JSON object")
    cfg = _flatten(config)
    num_layers = _int(cfg, "layer count", "num_hidden_layers", "n_layer", "num_layers",
                      limit="num_layers")
    hidden = _int(cfg, "hidden size", "hidden_size", "n_embd", "d_model", limit="hidden_size")
    heads = _int(cfg, "attention head count", "num_attention_heads", "n_head", "num_heads",
                 limit="num_attention_heads")
    kv_heads = _heads(cfg, heads)
    if _found(cfg, ("head_dim",)) is None and hidden < heads:
        raise PlanError(f"config.json hidden_size {hidden} is smaller than num_attention_heads "
                        f"{heads} and there is no head_dim")
    head_dim = _int(cfg, "head_dim", "head_dim", default=hidden // heads, limit="head_dim")
    intermediate = _opt_int(cfg, "intermediate_size", "ffn_hidden_size", "n_inner",
                            limit="intermediate_size")
    vocab = _int(cfg, "vocab size", "vocab_size", "padded_vocab_size", limit="vocab_size")
    dtype = _normalize_dtype(_first(cfg, "torch_dtype", "dtype"))
    max_pos = _opt_int(cfg, "max_position_embeddings", "n_positions", "max_sequence_length",
                       "seq_length", "max_seq_len", limit="max_position_embeddings")
    tie = _bool(cfg, "tie_word_embeddings", True)

    num_experts = _int(cfg, "expert count", "n_routed_experts", "num_local_experts", "num_experts",
                       "moe_num_experts", default=0, lo=0, limit="num_experts")
    experts_per_token = _int(cfg, "experts per token", "num_experts_per_tok", "experts_per_token",
                             "moe_top_k", default=0, lo=0, limit="num_experts")
    if num_experts and experts_per_token > num_experts:
        raise PlanError(f"config.json num_experts_per_tok {experts_per_token} exceeds the "
                        f"{num_experts} experts")
    moe_inter = _opt_int(cfg, "moe_intermediate_size", lo=0, limit="intermediate_size")
    moe_inter = (moe_inter or intermediate) if num_experts else None
    moe_flags = _moe_layer_flags(cfg, num_layers, num_experts)
    mla = _mla(cfg)

    layer_types = _layer_types(cfg, num_layers)
    num_kv_layers = num_layers - sum(1 for t in layer_types if t in _NO_KV_LAYER_TYPES)
    window = _window(cfg)
    if _flag(cfg, "use_sliding_window") is False:
        window = None
    n_sliding: int | None = None
    model_type = _str(cfg.get("model_type"), "model_type") or None
    if window:
        if layer_types:
            n_sliding = sum(1 for t in layer_types if t == "sliding_attention")
            if n_sliding == 0:
                window = None
        elif model_type in _INTERLEAVED_SLIDING:
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
    if estimated > bound("model", "weights_bytes"):
        raise PlanError(f"config.json: the shape gives {estimated:.3g} bytes of weights, beyond "
                        f"any servable model ({bound('model', 'weights_bytes'):.3g})")
    if measured_weights_bytes:
        total = check_int(measured_weights_bytes, "measured weights bytes", lo=1,
                          hi=bound("model", "weights_bytes"), error=PlanError)
        source = weights_source or "measured"
        scale = total / estimated if estimated else 1.0
    else:
        total = int(math.ceil(estimated))
        source = "parameter-count"
        scale = 1.0
    shared_inter = _opt_int(cfg, "shared_expert_intermediate_size", lo=0, limit="intermediate_size")
    n_shared = _opt_int(cfg, "n_shared_experts", lo=0, limit="num_experts") or 0
    return ModelInfo(
        name=safe_line(name, limit=200), path=path,
        architecture=_architecture(cfg),
        model_type=model_type,
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        vocab_size=vocab, dtype=dtype, max_position_embeddings=max_pos, tie_word_embeddings=tie,
        num_experts=num_experts, experts_per_token=experts_per_token,
        moe_intermediate_size=moe_inter,
        num_shared_experts=n_shared or (1 if shared_inter else 0),
        shared_expert_intermediate_size=shared_inter or None,
        first_k_dense_replace=_opt_int(cfg, "first_k_dense_replace", lo=0, limit="num_layers") or 0,
        num_moe_layers=sum(moe_flags),
        kv_lora_rank=mla.kv_lora_rank if mla else None,
        q_lora_rank=mla.q_lora_rank if mla else None,
        qk_rope_head_dim=mla.qk_rope_head_dim if mla else None,
        qk_nope_head_dim=mla.qk_nope_head_dim if mla else None,
        v_head_dim=mla.v_head_dim if mla else None,
        num_nextn_predict_layers=_opt_int(cfg, "num_nextn_predict_layers", lo=0,
                                          limit="num_layers") or 0,
        sliding_window=window, num_sliding_layers=n_sliding, layer_types=layer_types,
        num_kv_layers=num_kv_layers,
        quantization=quant, params=params,
        weights_bytes=total, weights_source=source,
        expert_weights_bytes=int(parts["experts"] * scale),
        embedding_bytes=int(parts["embedding"] * scale),
        lm_head_bytes=int(parts["lm_head"] * scale),
    )


# ---------------------------------------------------------------- I/O: a model dir or config.json


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number (JSON has no NaN or Infinity)")


def read_json_file(path: Path, what: str, *, max_bytes: int,
                   error: type[ClusterError] = PlanError) -> Any:
    """A JSON file read with a size cap; NaN/Infinity and too deep nesting refused as `error`."""
    try:
        with path.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:
        raise error(f"{path}: {what} is larger than {max_bytes:,} bytes: refused")
    return loads_json(raw, f"{path}: {what}", error=error)


def loads_json(raw: bytes | str, what: str, *, error: type[ClusterError] = PlanError) -> Any:
    """json.loads without NaN/Infinity; undecodable, invalid or too deeply nested -> `error`."""
    try:
        text = raw.decode("utf-8-sig") if isinstance(raw, bytes) else raw
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise error(f"{what} is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{what} is not valid JSON ({safe_line(exc, limit=200)})") from None


def _offset_end(entry: Mapping[str, Any], key: str, path: Path) -> int:
    offsets = entry.get("data_offsets")
    if offsets is None:
        return 0
    hi = bound("model", "weights_bytes")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise PlanError(f"{path}: tensor {safe_line(key, limit=80)!r}: data_offsets must be "
                        f"[begin, end], got {_short(offsets)}")
    begin, end = (check_int(v, f"{path}: tensor {safe_line(key, limit=80)!r} data_offsets",
                            lo=0, hi=hi, error=PlanError) for v in offsets)
    if begin > end:
        raise PlanError(f"{path}: tensor {safe_line(key, limit=80)!r}: data_offsets {offsets} "
                        f"end before they begin")
    return end


def safetensors_data_bytes(path: Path) -> int:
    """Tensor bytes in one .safetensors file, from its header (8-byte length + JSON)."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise PlanError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > bound("files", "safetensors_header"):
                raise PlanError(f"{path}: safetensors header of {length} bytes is implausible")
            raw = f.read(length)
    except OSError as exc:
        raise PlanError(f"{path}: unreadable ({exc.strerror or exc})") from None
    header = loads_json(raw, f"{path}: safetensors header")
    if not isinstance(header, Mapping):
        raise PlanError(f"{path}: safetensors header is not a JSON object")
    end = 0
    for key, entry in header.items():
        if key == "__metadata__" or not isinstance(entry, Mapping):
            continue
        end = max(end, _offset_end(entry, key, path))
    return end


def measured_weights(model_dir: Path) -> tuple[int | None, str | None]:
    """(bytes, source) from the index's metadata.total_size, else the safetensors headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        doc = read_json_file(index, "safetensors index", max_bytes=bound("files", "index_json"))
        if not isinstance(doc, Mapping):
            raise PlanError(f"{index}: expected a JSON object")
        metadata = doc.get("metadata")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise PlanError(f"{index}: metadata: expected an object, got {_short(metadata)}")
        total = (metadata or {}).get("total_size")
        if total is not None:
            return check_int(total, f"{index}: metadata.total_size", lo=1,
                             hi=bound("model", "weights_bytes"), error=PlanError,
                             integral_float=True), "safetensors-index"
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
        raise UsageError(f"--model {safe_line(path, limit=300)}: no such model directory or "
                         f"config.json")
    if not config_file.is_file():
        raise UsageError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    config = read_json_file(config_file, "config.json", max_bytes=bound("files", "config_json"))
    try:
        measured, source = measured_weights(model_dir) if p.is_dir() or p.name == "config.json" else (None, None)
        return model_info_from_config(config, name=name, path=str(p),
                                      measured_weights_bytes=measured, weights_source=source)
    except PlanError as exc:
        raise PlanError(f"{config_file}: {exc}") from None
