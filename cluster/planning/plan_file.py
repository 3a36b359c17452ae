"""Load and validate a plan file (`cluster plan --out plan.yaml`) for `cluster deploy`.

A malformed plan gives one PlanFileError naming file:line and the key (like the inventory
loader), never a traceback. Only what deploy uses is checked strictly (model path, names,
parallel sizes, replicas, engine args, placement strategy); the planner's informational keys
(reasons, memory, capacity, ...) are accepted as long as they are known keys, so a typo such
as `tensor_paralel_size` is caught instead of silently ignored.

    plan = load_plan("plan.yaml")        # -> PlanFile (frozen)
    plan.engine_args["max_model_len"]
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from cluster.base import yamlfile
from cluster.base.bounds import bound
from cluster.base.errors import UsageError
from cluster.base.yamlfile import YamlDoc as _Doc, type_name as _type_name

# What Plan.to_dict() writes (docs/planner.md), plus `validation` from `cluster plan --out`.
USED_KEYS = ("model", "served_model_name", "tensor_parallel_size", "pipeline_parallel_size",
             "data_parallel_size", "enable_expert_parallel", "replicas", "placement",
             "engine_args", "max_model_len", "validation", "stage_caches")
INFO_KEYS = ("model_name", "expert_parallel_size", "gpus_per_replica", "gpus_used", "gpus_total",
             "kv_cache_dtype", "kv_bytes_per_token", "kv_bytes_per_token_per_gpu",
             "kv_cache_tokens", "total_kv_cache_tokens", "max_concurrency",
             "gpu_memory_utilization", "weights_bytes", "weights_source", "memory_per_gpu", "gpu",
             "capacity", "reasons", "warnings", "rules", "cluster_source", "fabric", "layout",
             "tradeoffs", "node_commands", "alternatives")
KNOWN_KEYS = frozenset(USED_KEYS + INFO_KEYS)
STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
MAX_BYTES = 1 << 20    # a plan is a few KB

SERVED_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}\Z")
_ENGINE_KEY_RE = re.compile(r"^[a-z_][a-z0-9_]{0,63}\Z")
# The model path as `cluster plan` got it (deploy insists on an absolute path on the nodes,
# which --model can supply); no shell metacharacters.
_MODEL_PATH_RE = re.compile(r"^[A-Za-z0-9._/+@%=,:~-]{1,4096}\Z")
# Engine args that would carry a secret (vLLM's api_key / hf_token, and look-alikes).
SECRET_ENGINE_ARG_RE = re.compile(r"(^|_)(api_keys?|token|secret|password|passwd|passphrase|"
                                 r"credentials?|private_key|auth)($|_)")


class PlanFileError(UsageError):
    """A plan file that cannot be deployed; the message is `path:line: key: why`."""

    def __init__(self, message: str, *, path: str, line: int | None = None,
                 key: str | None = None):
        self.path, self.line, self.key, self.reason = path, line, key, message
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")


@dataclass(frozen=True)
class PlanFile:
    """The parts of a plan that `cluster deploy` uses (validated)."""

    path: str
    model: str
    served_model_name: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    replicas: int
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    placement_strategy: str | None = None
    max_model_len: int | None = None
    nnodes: int | None = None          # placement.gang.nnodes: one engine over nodes (native)
    executor: str | None = None        # placement.executor: auto | native | ray
    stage_caches: bool = False         # deploy stages vLLM's compile caches (--stage-caches)

    @property
    def workers_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# ---------------------------------------------------------------- validation


def _positive_int(doc: _Doc, value: Any, at: tuple, default: int | None = None,
                  hi: int | None = None) -> int:
    """A whole number from 1 to `hi` (default: limits.yaml plan.parallel_size)."""
    if value is None and default is not None:
        return default
    hi = bound("plan", "parallel_size") if hi is None else hi
    if isinstance(value, bool) or not isinstance(value, int):
        raise doc.fail(at, f"must be a positive integer, got {_type_name(value)}"
                            + (f" {value!r}" if isinstance(value, (str, float)) else ""))
    if not 1 <= value <= hi:
        raise doc.fail(at, f"must be between 1 and {hi}, got {value}")
    return value


def _string(doc: _Doc, value: Any, at: tuple, pattern: re.Pattern, what: str) -> str:
    if not isinstance(value, str):
        raise doc.fail(at, f"must be a string ({what}), got {_type_name(value)}")
    if not pattern.match(value):
        raise doc.fail(at, f"invalid {what} {value[:80]!r}")
    return value


def _engine_value_ok(value: Any, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    if value is None or isinstance(value, (str, int, bool)):
        return True
    if isinstance(value, list):
        return all(_engine_value_ok(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _engine_value_ok(v, depth + 1) for k, v in value.items())
    return False


def _engine_args(doc: _Doc, raw: Any, top: Mapping[str, Any]) -> dict[str, Any]:
    at = ("engine_args",)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise doc.fail(at, f"must be a mapping of vLLM engine args, got {_type_name(raw)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not _ENGINE_KEY_RE.match(key):
            raise doc.fail(at + (key,), "engine arg names are vLLM's snake_case names")
        if SECRET_ENGINE_ARG_RE.search(key):
            raise doc.fail(at + (key,), "secrets never go into the plan: name the key's "
                                         "environment variable with `cluster deploy --api-key-env`")
        if not _engine_value_ok(value):
            raise doc.fail(at + (key,), f"unsupported value {_type_name(value)} (engine args are "
                                        "strings, finite numbers, booleans, lists and mappings)")
        out[key] = value
    # The plan repeats some values at the top level; they must agree.
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                 "max_model_len", "served_model_name"):
        if name in out and name in top and top[name] is not None and out[name] != top[name]:
            raise doc.fail(at + (name,), f"{out[name]!r} disagrees with the top-level "
                                          f"{name}: {top[name]!r}")
    if "model" in out and top.get("model") is not None and out["model"] != top["model"]:
        raise doc.fail(at + ("model",), f"{out['model']!r} disagrees with the top-level "
                                         f"model: {top['model']!r}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if name in out:
            _positive_int(doc, out[name], at + (name,))
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if name in out:
            _positive_int(doc, out[name], at + (name,), hi=1 << 24)
    if "max_model_len" in out:
        _max_len(doc, out["max_model_len"], at + ("max_model_len",))
    if "gpu_memory_utilization" in out:
        u = out["gpu_memory_utilization"]
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise doc.fail(at + ("gpu_memory_utilization",),
                            f"must be a number in (0, 1], got {u!r}")
    if "enable_expert_parallel" in out and not isinstance(out["enable_expert_parallel"], bool):
        raise doc.fail(at + ("enable_expert_parallel",), "must be true or false")
    return out


def _max_len(doc: _Doc, value: Any, at: tuple) -> int:
    lo, hi = bound("plan", "max_model_len_min"), bound("plan", "max_model_len")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise doc.fail(at, f"must be an integer between {lo} and {hi}, got {value!r}")
    return value


def _placement_strategy(doc: _Doc, raw: Any) -> str | None:
    at = ("placement",)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise doc.fail(at, f"must be a mapping, got {_type_name(raw)}")
    strategy = raw.get("strategy")
    if strategy is None:
        return None
    if strategy not in STRATEGIES:
        raise doc.fail(at + ("strategy",), f"must be one of {', '.join(STRATEGIES)}, "
                                            f"got {strategy!r}")
    bundle = raw.get("bundle")
    if bundle is not None:
        if not isinstance(bundle, dict) or not bundle:
            raise doc.fail(at + ("bundle",), "must be a mapping of resource: amount")
        for name, amount in bundle.items():
            if not isinstance(name, str) or isinstance(amount, bool) or \
                    not isinstance(amount, (int, float)) or not math.isfinite(amount) \
                    or not 0 < amount <= 1e6:
                raise doc.fail(at + ("bundle", name), "resource amounts must be positive numbers")
    return strategy


EXECUTORS = ("auto", "native", "ray")


def _gang(doc: _Doc, raw: Any) -> tuple[int | None, str | None]:
    """(placement.gang.nnodes, placement.executor) of a plan (None, None when absent)."""
    if not isinstance(raw, dict):
        return None, None
    executor = raw.get("executor")
    if executor is not None and executor not in EXECUTORS:
        raise doc.fail(("placement", "executor"), f"must be one of {', '.join(EXECUTORS)}, "
                                                  f"got {executor!r}")
    gang = raw.get("gang")
    if gang is None:
        return None, executor
    if not isinstance(gang, dict):
        raise doc.fail(("placement", "gang"), f"must be a mapping, got {_type_name(gang)}")
    nnodes = _positive_int(doc, gang.get("nnodes"), ("placement", "gang", "nnodes"), 1)
    return nnodes, executor


def _size(doc: _Doc, top: Mapping[str, Any], at: tuple) -> int | None:
    """A size the plan repeats (gpus_per_replica, ...): None when absent, else a whole number."""
    cur: Any = top
    for key in at:
        cur = cur.get(key) if isinstance(cur, dict) else None
    if cur is None:
        return None
    return _positive_int(doc, cur, at, hi=1 << 24)


def _sizes_agree(doc: _Doc, top: Mapping[str, Any], tp: int, pp: int, dp: int,
                 replicas: int, ep: bool, nnodes: int | None) -> None:
    """A hand-edited plan whose sizes disagree is refused here, naming the fields and their
    values, before any node is contacted: TP x PP (x DP with EP) is the GPUs of one replica
    (gpus_per_replica, placement.gpus_per_replica), times replicas the GPUs used; EP spans
    TP x DP; a dense plan's data_parallel_size is its replicas; placement.gang.nnodes splits
    the ranks of one engine evenly (cluster.planning.gang)."""
    from cluster.planning.gang import gang_layout

    world = tp * pp * dp
    layout = f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}" + (
        f" x data_parallel_size {dp}" if ep else "")
    for at in (("gpus_per_replica",), ("placement", "gpus_per_replica")):
        got = _size(doc, top, at)
        if got is not None and got != world:
            raise doc.fail(at, f"{got} disagrees with {layout} = {world} (the GPUs one replica "
                               "uses)")
    placed = _size(doc, top, ("placement", "replicas"))
    if placed is not None and placed != replicas:
        raise doc.fail(("placement", "replicas"), f"{placed} disagrees with the top-level "
                                                  f"replicas: {replicas}")
    used = _size(doc, top, ("gpus_used",))
    if used is not None and used != world * replicas:
        raise doc.fail(("gpus_used",), f"{used} disagrees with {layout} = {world} GPUs per "
                                       f"replica x replicas {replicas} = {world * replicas}")
    total = _size(doc, top, ("gpus_total",))
    if used is not None and total is not None and used > total:
        raise doc.fail(("gpus_used",), f"{used} is more than gpus_total {total}")
    ep_size = _size(doc, top, ("expert_parallel_size",))
    want = tp * dp if ep else 1
    if ep_size is not None and ep_size != want:
        why = (f"tensor_parallel_size {tp} x data_parallel_size {dp} = {want}" if ep
               else "1 (enable_expert_parallel is false)")
        raise doc.fail(("expert_parallel_size",), f"{ep_size} disagrees with {why}")
    if not ep and top.get("data_parallel_size") is not None and \
            top["data_parallel_size"] != replicas:
        raise doc.fail(("data_parallel_size",), f"{top['data_parallel_size']} disagrees with "
                                                f"replicas {replicas} (a dense plan's data "
                                                "parallelism is its Serve replicas)")
    if nnodes is not None:
        try:
            gang_layout(tp, pp, nnodes, dp)
        except UsageError as exc:
            raise doc.fail(("placement", "gang", "nnodes"),
                           f"{nnodes} with {layout}: {exc}") from None


def parse_plan(text: str, path: str = "<plan>") -> PlanFile:
    """Validate plan text. Raises PlanFileError naming path:line and key."""
    doc = yamlfile.parse(text, path=path, error=PlanFileError, max_bytes=MAX_BYTES,
                         empty="the file is empty (write one with `cluster plan --out`)")
    top = doc.data
    if not isinstance(top, dict):
        raise doc.fail((), f"must be a mapping (a plan from `cluster plan --out`), "
                            f"got {_type_name(top)}")
    for key in top:
        if not isinstance(key, str):
            raise doc.fail((str(key),), "keys must be strings")
        if key not in KNOWN_KEYS:
            close = [k for k in KNOWN_KEYS if _similar(k, key)]
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise doc.fail((key,), f"unknown key{hint}; a plan holds the keys "
                                    "`cluster plan --out` writes (docs/planner.md)")
    if top.get("model") is None:
        raise doc.fail(("model",), "is required: the model directory on the nodes")
    model = _string(doc, top["model"], ("model",), _MODEL_PATH_RE, "model path")
    served = top.get("served_model_name")
    if served is None:
        p = Path(model.rstrip("/"))
        served = p.parent.name if p.name == "config.json" else p.name
        if not SERVED_NAME_RE.match(served):
            raise doc.fail(("served_model_name",), "is required (the model directory's name "
                                                    f"{served!r} is not a usable name)")
    else:
        served = _string(doc, served, ("served_model_name",), SERVED_NAME_RE,
                         "served model name")
    tp = _positive_int(doc, top.get("tensor_parallel_size"), ("tensor_parallel_size",), 1)
    pp = _positive_int(doc, top.get("pipeline_parallel_size"), ("pipeline_parallel_size",), 1)
    dp = _positive_int(doc, top.get("data_parallel_size"), ("data_parallel_size",), 1)
    replicas = _positive_int(doc, top.get("replicas"), ("replicas",), 1)
    ep = top.get("enable_expert_parallel", False)
    if ep is None:
        ep = False
    if not isinstance(ep, bool):
        raise doc.fail(("enable_expert_parallel",), f"must be true or false, got {ep!r}")
    max_len = top.get("max_model_len")
    if max_len is not None:
        max_len = _max_len(doc, max_len, ("max_model_len",))
    engine_args = _engine_args(doc, top.get("engine_args"), top)
    if ep and engine_args.get("data_parallel_size", dp) != dp:
        raise doc.fail(("engine_args", "data_parallel_size"),
                        f"{engine_args['data_parallel_size']!r} disagrees with the top-level "
                        f"data_parallel_size: {dp} (expert parallel)")
    if not ep and engine_args.get("data_parallel_size", 1) != 1:
        raise doc.fail(("engine_args", "data_parallel_size"),
                        "must be 1 for a dense model (replicas are separate engines)")
    strategy = _placement_strategy(doc, top.get("placement"))
    nnodes, executor = _gang(doc, top.get("placement"))
    _sizes_agree(doc, top, tp, pp, dp if ep else 1, replicas, ep, nnodes)
    validation = top.get("validation")
    if validation is not None:
        if not isinstance(validation, dict):
            raise doc.fail(("validation",), f"must be a mapping, got {_type_name(validation)}")
        if validation.get("status") == "invalid":
            raise doc.fail(("validation", "status"),
                            f"vLLM rejected these engine args when planning: "
                            f"{str(validation.get('detail') or '')[:200]}")
    stage = top.get("stage_caches", False)
    if not isinstance(stage, bool):
        raise doc.fail(("stage_caches",), f"must be true or false, got {stage!r}")
    return PlanFile(path=path, model=model, served_model_name=served, tensor_parallel_size=tp,
                    pipeline_parallel_size=pp, data_parallel_size=dp, enable_expert_parallel=ep,
                    replicas=replicas, engine_args=engine_args, placement_strategy=strategy,
                    max_model_len=max_len, nnodes=nnodes, executor=executor,
                    stage_caches=stage)


def load_plan(path: str | Path) -> PlanFile:
    """Read and validate a plan file. Raises PlanFileError (one line: path[:line]: why)."""
    name = str(path)
    text = yamlfile.read_text(path, error=PlanFileError, what="a plan file", max_bytes=MAX_BYTES)
    return parse_plan(text, name)


def _similar(a: str, b: str) -> bool:
    """A one-edit typo (insert, delete or replace one character)."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))
