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

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from cluster.errors import UsageError

# What Plan.to_dict() writes (docs/planner.md), plus `validation` from `cluster plan --out`.
USED_KEYS = ("model", "served_model_name", "tensor_parallel_size", "pipeline_parallel_size",
             "data_parallel_size", "enable_expert_parallel", "replicas", "placement",
             "engine_args", "max_model_len", "validation")
INFO_KEYS = ("model_name", "expert_parallel_size", "gpus_per_replica", "gpus_used", "gpus_total",
             "kv_cache_dtype", "kv_bytes_per_token", "kv_bytes_per_token_per_gpu",
             "kv_cache_tokens", "total_kv_cache_tokens", "max_concurrency",
             "gpu_memory_utilization", "weights_bytes", "weights_source", "memory_per_gpu", "gpu",
             "capacity", "reasons", "warnings", "rules", "cluster_source")
KNOWN_KEYS = frozenset(USED_KEYS + INFO_KEYS)
STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
MAX_PARALLEL = 4096

SERVED_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
_ENGINE_KEY_RE = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
# The model path as `cluster plan` got it (deploy insists on an absolute path on the nodes,
# which --model can supply); no shell metacharacters.
_MODEL_PATH_RE = re.compile(r"^[A-Za-z0-9._/+@%=,:~-]+$")
# Engine args that would carry a secret (vLLM's api_key / hf_token, and look-alikes).
SECRET_ENGINE_ARG_RE = re.compile(r"(^|_)(api_keys?|token|secret|password|passwd)($|_)")


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

    @property
    def workers_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# ---------------------------------------------------------------- YAML with line numbers


class _Doc:
    """The parsed document plus the line of every key path."""

    def __init__(self, text: str, path: str):
        self.path = path
        self.lines: dict[tuple, int] = {}
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise PlanFileError(f"YAML syntax error: {problem}", path=path,
                                line=mark.line + 1 if mark is not None else None) from None
        if root is None:
            raise PlanFileError("the file is empty (write one with `cluster plan --out`)",
                                path=path, line=1)
        self._index(root, ())
        try:
            self.data = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:
            # compose accepts some things construction refuses (an unknown tag, a bad date).
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise PlanFileError(f"YAML error: {problem}", path=path,
                                line=mark.line + 1 if mark is not None else None) from None

    def _index(self, node: yaml.Node, at: tuple) -> None:
        # Paths are kept as strings: `1: x` is the key 1 once loaded but "1" in the node tree.
        self.lines.setdefault(tuple(map(str, at)), node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                line = key_node.start_mark.line + 1
                if key is not None and key in seen:
                    raise self.error(at + (key,), f"duplicate key (first at line {seen[key]})",
                                     line=line)
                if key is not None:
                    seen[key] = line
                    self.lines[tuple(map(str, at + (key,)))] = line
                    self._index(value_node, at + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._index(item, at + (i,))

    def error(self, at: tuple, message: str, line: int | None = None) -> PlanFileError:
        probe = tuple(map(str, at))
        while probe and probe not in self.lines:
            probe = probe[:-1]
        return PlanFileError(message, path=self.path,
                             line=line if line is not None else self.lines.get(probe),
                             key=_dotted(at))


def _dotted(at: tuple) -> str:
    out = ""
    for part in at:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", int: "an integer",
            float: "a number", bool: "a boolean", type(None): "nothing"}.get(
                type(value), type(value).__name__)


# ---------------------------------------------------------------- validation


def _positive_int(doc: _Doc, value: Any, at: tuple, default: int | None = None,
                  hi: int = MAX_PARALLEL) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise doc.error(at, f"must be a positive integer, got {_type_name(value)}"
                            + (f" {value!r}" if isinstance(value, (str, float)) else ""))
    if not 1 <= value <= hi:
        raise doc.error(at, f"must be between 1 and {hi}, got {value}")
    return value


def _string(doc: _Doc, value: Any, at: tuple, pattern: re.Pattern, what: str) -> str:
    if not isinstance(value, str):
        raise doc.error(at, f"must be a string ({what}), got {_type_name(value)}")
    if not pattern.match(value):
        raise doc.error(at, f"invalid {what} {value[:80]!r}")
    return value


def _engine_value_ok(value: Any, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if value is None or isinstance(value, (str, int, float, bool)):
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
        raise doc.error(at, f"must be a mapping of vLLM engine args, got {_type_name(raw)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not _ENGINE_KEY_RE.match(key):
            raise doc.error(at + (key,), "engine arg names are vLLM's snake_case names")
        if SECRET_ENGINE_ARG_RE.search(key):
            raise doc.error(at + (key,), "secrets never go into the plan: name the key's "
                                         "environment variable with `cluster deploy --api-key-env`")
        if not _engine_value_ok(value):
            raise doc.error(at + (key,), f"unsupported value {_type_name(value)}")
        out[key] = value
    # The plan repeats some values at the top level; they must agree.
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                 "max_model_len", "served_model_name"):
        if name in out and name in top and top[name] is not None and out[name] != top[name]:
            raise doc.error(at + (name,), f"{out[name]!r} disagrees with the top-level "
                                          f"{name}: {top[name]!r}")
    if "model" in out and top.get("model") is not None and out["model"] != top["model"]:
        raise doc.error(at + ("model",), f"{out['model']!r} disagrees with the top-level "
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
            raise doc.error(at + ("gpu_memory_utilization",),
                            f"must be a number in (0, 1], got {u!r}")
    if "enable_expert_parallel" in out and not isinstance(out["enable_expert_parallel"], bool):
        raise doc.error(at + ("enable_expert_parallel",), "must be true or false")
    return out


def _max_len(doc: _Doc, value: Any, at: tuple) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 16 <= value <= 1 << 24:
        raise doc.error(at, f"must be an integer between 16 and {1 << 24}, got {value!r}")
    return value


def _placement_strategy(doc: _Doc, raw: Any) -> str | None:
    at = ("placement",)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise doc.error(at, f"must be a mapping, got {_type_name(raw)}")
    strategy = raw.get("strategy")
    if strategy is None:
        return None
    if strategy not in STRATEGIES:
        raise doc.error(at + ("strategy",), f"must be one of {', '.join(STRATEGIES)}, "
                                            f"got {strategy!r}")
    bundle = raw.get("bundle")
    if bundle is not None:
        if not isinstance(bundle, dict) or not bundle:
            raise doc.error(at + ("bundle",), "must be a mapping of resource: amount")
        for name, amount in bundle.items():
            if not isinstance(name, str) or isinstance(amount, bool) or \
                    not isinstance(amount, (int, float)) or amount <= 0:
                raise doc.error(at + ("bundle", name), "resource amounts must be positive numbers")
    return strategy


def parse_plan(text: str, path: str = "<plan>") -> PlanFile:
    """Validate plan text. Raises PlanFileError naming path:line and key."""
    doc = _Doc(text, path)
    top = doc.data
    if not isinstance(top, dict):
        raise doc.error((), f"must be a mapping (a plan from `cluster plan --out`), "
                            f"got {_type_name(top)}")
    for key in top:
        if not isinstance(key, str):
            raise doc.error((str(key),), "keys must be strings")
        if key not in KNOWN_KEYS:
            close = [k for k in KNOWN_KEYS if _similar(k, key)]
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise doc.error((key,), f"unknown key{hint}; a plan holds the keys "
                                    "`cluster plan --out` writes (docs/planner.md)")
    if top.get("model") is None:
        raise doc.error(("model",), "is required: the model directory on the nodes")
    model = _string(doc, top["model"], ("model",), _MODEL_PATH_RE, "model path")
    served = top.get("served_model_name")
    if served is None:
        p = Path(model.rstrip("/"))
        served = p.parent.name if p.name == "config.json" else p.name
        if not SERVED_NAME_RE.match(served):
            raise doc.error(("served_model_name",), "is required (the model directory's name "
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
        raise doc.error(("enable_expert_parallel",), f"must be true or false, got {ep!r}")
    max_len = top.get("max_model_len")
    if max_len is not None:
        max_len = _max_len(doc, max_len, ("max_model_len",))
    engine_args = _engine_args(doc, top.get("engine_args"), top)
    if ep and engine_args.get("data_parallel_size", dp) != dp:
        raise doc.error(("engine_args", "data_parallel_size"),
                        f"{engine_args['data_parallel_size']!r} disagrees with the top-level "
                        f"data_parallel_size: {dp} (expert parallel)")
    if not ep and engine_args.get("data_parallel_size", 1) != 1:
        raise doc.error(("engine_args", "data_parallel_size"),
                        "must be 1 for a dense model (replicas are separate engines)")
    strategy = _placement_strategy(doc, top.get("placement"))
    validation = top.get("validation")
    if validation is not None:
        if not isinstance(validation, dict):
            raise doc.error(("validation",), f"must be a mapping, got {_type_name(validation)}")
        if validation.get("status") == "invalid":
            raise doc.error(("validation", "status"),
                            f"vLLM rejected these engine args when planning: "
                            f"{str(validation.get('detail') or '')[:200]}")
    return PlanFile(path=path, model=model, served_model_name=served, tensor_parallel_size=tp,
                    pipeline_parallel_size=pp, data_parallel_size=dp, enable_expert_parallel=ep,
                    replicas=replicas, engine_args=engine_args, placement_strategy=strategy,
                    max_model_len=max_len)


def load_plan(path: str | Path) -> PlanFile:
    """Read and validate a plan file. Raises PlanFileError (one line: path[:line]: why)."""
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except IsADirectoryError:
        raise PlanFileError("is a directory, not a plan file", path=name) from None
    except OSError as exc:
        raise PlanFileError(f"cannot read: {exc.strerror or exc}", path=name) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise PlanFileError("not UTF-8 text (is this a plan file?)", path=name, line=line) from None
    if "\0" in text:
        raise PlanFileError("contains NUL bytes (is this a plan file?)", path=name,
                            line=text[:text.index("\0")].count("\n") + 1)
    return parse_plan(text, name)


def _similar(a: str, b: str) -> bool:
    """A one-edit typo (insert, delete or replace one character)."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))
