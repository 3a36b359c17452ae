"""Plan parallelism (TP/PP/DP/EP) and vLLM engine args from a model and the cluster's facts.

The planning itself is pure: `make_plan(model, cluster, options) -> Plan` (a frozen dataclass,
`Plan.to_dict()` is the JSON contract of `cluster plan --json`, docs/planner.md). Every decision
carries a reason line that names its rule ("R2 tp-in-node: ..."); a model that cannot be served
on the cluster raises PlanError with the numbers that show why.

`plan_alternatives(model, cluster, options, n)` gives the next n layouts the rules allow, each
a whole Plan with its trade-offs (`Plan.tradeoffs`, cluster/data/planner.yaml `tradeoffs`).

Around it, small adapters:
- `read_saved_run(path)` reads a saved preflight run through PreflightFacts.from_report (the
  one reading of what the report wrote) into SavedNodeFacts per node (GPUs, NVLink, the slowest
  Active IB port's rate, or the problem that rules it out);
  `ClusterFacts.from_saved_run(saved, source, only)` / `load_cluster_facts_from_report(path)`
  turn it into the planner's facts, `ClusterFacts.overridden(...)` puts flags in place of facts;
  `latest_preflight_report(run_root)` finds `<run_root>/*/preflight.json`, newest first. Input:
      {"facts": {"nodes": {"<node>": {"gpu_count": 8, "gpu_model": "NVIDIA H100 80GB HBM3",
                                      "gpu_memory_mib": 81559, "nvlink": true,
                                      "ib_ports": [{"state": "Active", "rate_gbps": 400}]}}}}
  (`nvlink` may be null: unknown; a node whose facts are missing or null is skipped).
- `predict_kv_cache_tokens(model, kv_cache_bytes, ...)`: KV tokens a given KV byte budget holds,
  the figure vLLM logs at start-up ("KV cache size: N tokens").
- `validate_engine_args(engine_args)`: the engine args through vLLM's own EngineArgs and CLI
  parser, when vLLM is importable; `validate_quietly` times it and keeps what vLLM prints or
  logs off the terminal.
Flags, options and report facts are checked against cluster/data/limits.yaml `plan:` (finite,
whole where a count is meant, in range) before any loop or allocation depends on them.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from cluster.base.bounds import bound, check_float, check_int
from cluster.base.errors import PlanError, UsageError
from cluster.inspection.node_summary import NodeFactsSummary, PreflightFacts, TooManyNodes
from cluster.planning.gang import gang_layout
from cluster.planning.modelinfo import DTYPE_BYTES, ModelInfo, read_json_file
from cluster.base.textsafe import safe_line
from cluster.base.yamlfile import packaged

GiB = 1024 ** 3
MiB = 1024 ** 2
KV_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
WORKLOADS = ("chat", "long-docs")


# ---------------------------------------------------------------- data (cluster/data/*.yaml)


@lru_cache(maxsize=1)
def planner_defaults() -> dict[str, Any]:
    """cluster/data/planner.yaml."""
    return packaged("planner.yaml")


@lru_cache(maxsize=1)
def _gpu_table() -> dict[str, dict[str, Any]]:
    return packaged("gpus.yaml")["gpus"]


def _gpu_key(name: str) -> str:
    key = name.casefold().strip()
    key = re.sub(r"^(nvidia|amd)\s+", "", key)
    return re.sub(r"[\s_\-]+", "", key)


@dataclass(frozen=True)
class GpuSpec:
    """Facts about a GPU model from cluster/data/gpus.yaml."""

    name: str
    memory_mib: int
    architecture: str
    fp8: bool
    nvlink: bool


def lookup_gpu(name: str | None) -> GpuSpec | None:
    """A GPU by the name nvidia-smi prints or an alias (case, spaces, dashes ignored)."""
    if not name:
        return None
    wanted = _gpu_key(name)
    for canonical, entry in _gpu_table().items():
        keys = [canonical, *(entry.get("aliases") or [])]
        if any(_gpu_key(k) == wanted for k in keys):
            return GpuSpec(canonical, int(entry["memory_mib"]), str(entry["architecture"]),
                           bool(entry["fp8"]), bool(entry["nvlink"]))
    return None


# ---------------------------------------------------------------- cluster facts


@dataclass(frozen=True)
class NodeGpus:
    """One node's GPU facts."""

    node: str
    gpu_count: int
    gpu_model: str
    gpu_memory_mib: int
    nvlink: bool | None = None
    ib_rate_gbps: float | None = None      # the slowest Active InfiniBand/RoCE port


@dataclass(frozen=True)
class SavedNodeFacts:
    """One node's facts as a saved preflight run holds them (preflight.json facts.nodes.<node>),
    read once and typed: every value checked (type, finite, in range); `problem` says why the
    node's GPU facts cannot be planned on (unreachable, no GPU count...), None when they can."""

    node: str
    reachable: bool
    gpu_count: int | None = None
    gpu_model: str | None = None
    gpu_names: tuple[str, ...] = ()
    gpu_memory_mib: int | None = None
    nvlink: bool | None = None
    ib_rate_gbps: float | None = None
    problem: str | None = None

    def gpus(self) -> NodeGpus | None:
        """The node's GPUs for the planner, None when its facts have a problem."""
        if self.problem is not None or self.gpu_count is None:
            return None
        return NodeGpus(self.node, self.gpu_count, self.gpu_model or "", self.gpu_memory_mib or 0,
                        self.nvlink, self.ib_rate_gbps)


def _number(value: Any, lo: float, hi: float) -> float | None:
    """A finite JSON number (not a bool) in [lo, hi], else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and lo <= value <= hi else None


def _ib_rate(facts: NodeFactsSummary) -> float | None:
    """The slowest Active port's rate (Gb/s), None without one."""
    rates = [r for p in facts.active_ib_ports[:256] if (r := _number(p.rate_gbps, 0, 1e6))]
    return min(rates) if rates else None


def saved_node_facts(name: str, facts: NodeFactsSummary) -> SavedNodeFacts:
    """The planner's reading of one node's facts (the preflight's, saved or just reported):
    every value checked (finite, in range), the problem that rules the node out named."""
    if facts.reachable is False:
        return SavedNodeFacts(name, False, problem="unreachable")
    count = facts.gpu_count
    if count is None or not 0 <= count <= bound("plan", "gpus_per_node"):
        shown = repr(count) if count is not None else facts.unreadable.get("gpu_count")
        why = "no GPU count" if shown is None else f"gpu_count {safe_line(shown, limit=40)}"
        return SavedNodeFacts(name, True, problem=why)
    model = facts.gpu_model
    mem = _number(facts.gpu_memory_mib, 1, bound("plan", "gpu_memory_gib") * 1024)
    if count > 0 and (model is None or mem is None):
        return SavedNodeFacts(name, True, count, problem="gpu_model/gpu_memory_mib missing or "
                                                         "out of range")
    names = tuple(safe_line(n, limit=80)
                  for n in (facts.gpu_names or ())[:bound("plan", "gpus_per_node")])
    return SavedNodeFacts(name, True, count, safe_line(model or "", limit=200), names,
                          int(mem) if mem is not None else 0, facts.nvlink, _ib_rate(facts))


def read_saved_run(path: str | Path) -> tuple[SavedNodeFacts, ...]:
    """The typed reading of a saved preflight run's facts (preflight.json, read by
    PreflightFacts.from_report), node by node."""
    p = Path(path)
    data = read_json_file(p, "preflight report", max_bytes=bound("files", "preflight_report"))
    try:
        saved = PreflightFacts.from_report(data, max_nodes=bound("plan", "nodes"))
    except TooManyNodes as exc:
        raise PlanError(f"{p}: {exc.count:,} nodes in the preflight report, more than the "
                        f"{exc.limit:,} a plan handles") from None
    if saved is None:
        raise PlanError(f"{p}: no facts.nodes in the preflight report (expected "
                        '{"facts": {"nodes": {"<node>": {"gpu_count": ..., ...}}}})')
    return tuple(SavedNodeFacts(safe_line(name, limit=200), False, problem="no facts")
                 if name in saved.without_facts else
                 saved_node_facts(safe_line(name, limit=200), facts)
                 for name, facts in saved.nodes.items())


def _folded(skipped: Sequence[SavedNodeFacts]) -> tuple[str, ...]:
    """Skipped nodes, one line per reason: "unreachable: rb-01, rb-02 (2 nodes)"."""
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s.problem or "no facts", []).append(s.node)
    return tuple(f"{why}: {', '.join(names[:8])}" + (f" and {len(names) - 8} more" if len(names) > 8
                                                     else "") + f" ({len(names)} node(s))"
                 for why, names in by_reason.items())


@dataclass(frozen=True)
class ClusterFacts:
    """The GPU facts of the cluster: from a preflight report or from flags."""

    nodes: tuple[NodeGpus, ...]
    source: str = "flags"
    skipped: tuple[str, ...] = ()          # nodes without usable GPU facts (unreachable...)
    notes: tuple[str, ...] = ()            # facts worth a warning (mixed GPUs inside a node...)

    @classmethod
    def from_flags(cls, *, nodes: int = 1, gpus_per_node: int, gpu_model: str | None = None,
                   gpu_memory_gib: float | None = None, nvlink: bool | None = None,
                   ib_rate_gbps: float | None = None,
                   names: Sequence[str] = ()) -> "ClusterFacts":
        """Facts from flags alone; `names`: the inventory's node names (node1.. without)."""
        nodes = check_int(nodes, "--nodes", lo=1, hi=bound("plan", "nodes"))
        gpus_per_node = check_int(gpus_per_node, "--gpus-per-node", lo=1,
                                  hi=bound("plan", "gpus_per_node"))
        model, memory_mib = _gpu_of_flags(gpu_model, gpu_memory_gib)
        model = model or "unknown GPU"
        named = _node_names(names, nodes)
        return cls(tuple(NodeGpus(n, gpus_per_node, model, memory_mib, nvlink,
                                  _checked_rate(ib_rate_gbps)) for n in named), source="flags")

    @classmethod
    def from_saved_run(cls, saved: Sequence[SavedNodeFacts], source: str,
                       only: Sequence[str] | None = None) -> "ClusterFacts":
        """Facts from a saved preflight run's typed reading; `only`: the nodes to plan on (the
        inventory's), a node the run does not hold is skipped, the run's other nodes ignored.
        PlanError in one line when no node has GPU facts."""
        if only is not None:
            by_name = {s.node: s for s in saved}
            saved = [by_name.get(name) or SavedNodeFacts(name, False, problem="not in the run")
                     for name in dict.fromkeys(only)]
        usable = [(s, s.gpus()) for s in saved]
        nodes = tuple(g for _, g in usable if g is not None)
        skipped = _folded([s for s, g in usable if g is None])
        if not nodes:
            raise PlanError(f"{source}: no node with GPU facts ({'; '.join(skipped) or 'facts.nodes is empty'}): "
                            f"fix them and rerun `cluster preflight`, or pass --gpus-per-node G "
                            f"with --gpu-model NAME")
        notes = tuple(f"R7 mixed-gpus: node {s.node} mixes {', '.join(sorted(set(s.gpu_names))[:16])}; "
                      f"planned at its smallest GPU memory ({s.gpu_memory_mib} MiB)"
                      for s, g in usable if g is not None and len(set(s.gpu_names)) > 1)
        return cls(nodes, source=source, skipped=skipped, notes=notes)

    def overridden(self, *, nodes: int | None = None, gpus_per_node: int | None = None,
                   gpu_model: str | None = None, gpu_memory_gib: float | None = None,
                   nvlink: bool | None = None, ib_rate_gbps: float | None = None) -> "ClusterFacts":
        """These facts with each given flag in place of what was read (--nodes keeps the first
        N nodes, or adds nodes like the last one)."""
        given = {k: v for k, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node),
                                   ("--gpu-model", gpu_model), ("--gpu-memory-gib", gpu_memory_gib),
                                   ("--nvlink", nvlink), ("--ib-rate-gbps", ib_rate_gbps))
                 if v is not None}
        if not given:
            return self
        out = list(self.nodes)
        if nodes is not None:
            nodes = check_int(nodes, "--nodes", lo=1, hi=bound("plan", "nodes"))
            names = _node_names([n.node for n in out], nodes)
            out = [out[i] if i < len(out) else replace(out[-1], node=name)
                   for i, name in enumerate(names)]
        change: dict[str, Any] = {}
        if gpus_per_node is not None:
            change["gpu_count"] = check_int(gpus_per_node, "--gpus-per-node", lo=1,
                                            hi=bound("plan", "gpus_per_node"))
        if gpu_model is not None or gpu_memory_gib is not None:
            model, memory_mib = _gpu_of_flags(gpu_model, gpu_memory_gib)
            if model is not None:
                change["gpu_model"] = model
            change["gpu_memory_mib"] = memory_mib
        if nvlink is not None:
            change["nvlink"] = nvlink
        if ib_rate_gbps is not None:
            change["ib_rate_gbps"] = _checked_rate(ib_rate_gbps)
        out = [replace(n, **change) for n in out]
        return ClusterFacts(tuple(out), source=f"{self.source} + {', '.join(given)}",
                            skipped=self.skipped, notes=self.notes)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "skipped": list(self.skipped),
                "nodes": {n.node: {"gpu_count": n.gpu_count, "gpu_model": n.gpu_model,
                                   "gpu_memory_mib": n.gpu_memory_mib, "nvlink": n.nvlink,
                                   "ib_rate_gbps": n.ib_rate_gbps}
                          for n in self.nodes}}


def _gpu_of_flags(gpu_model: str | None, gpu_memory_gib: float | None) -> tuple[str | None, int]:
    """(GPU name, memory MiB) from --gpu-model / --gpu-memory-gib: the memory given, else the
    model's from gpus.yaml; UsageError for an unknown model without a memory."""
    spec = lookup_gpu(gpu_model)
    if gpu_memory_gib is not None:
        gpu_memory_gib = check_float(gpu_memory_gib, "--gpu-memory-gib", lo=0, lo_open=True,
                                     hi=bound("plan", "gpu_memory_gib"))
        memory_mib = max(1, int(round(gpu_memory_gib * 1024)))
    elif spec is not None:
        memory_mib = spec.memory_mib
    else:
        raise UsageError(f"unknown GPU model {gpu_model!r} (not in cluster/data/gpus.yaml): "
                         f"pass --gpu-memory-gib" if gpu_model else
                         "pass --gpu-model NAME or --gpu-memory-gib M with --gpus-per-node")
    return (spec.name if spec else gpu_model), memory_mib


def _checked_rate(rate: float | None) -> float | None:
    if rate is None:
        return None
    return check_float(rate, "--ib-rate-gbps", lo=0, lo_open=True, hi=bound("plan", "ib_rate_gbps"))


def _node_names(names: Sequence[str], count: int) -> list[str]:
    """`count` node names: the given ones first, then node<i> names not taken."""
    out = list(dict.fromkeys(names))[:count]
    i = 0
    while len(out) < count:
        i += 1
        if f"node{i}" not in out:
            out.append(f"node{i}")
    return out


def latest_preflight_report(run_root: str | Path = "runs") -> Path | None:
    """The newest `<run_root>/*/preflight.json` (run directories are named by start time)."""
    from cluster.report.rundir import latest_report

    return latest_report(run_root, "preflight.json")


def load_cluster_facts_from_report(path: str | Path, only: Sequence[str] | None = None
                                   ) -> ClusterFacts:
    """Cluster facts from a preflight JSON report (shape in the module docstring); `only`: the
    inventory's node names (the plan's nodes, in its order)."""
    return ClusterFacts.from_saved_run(read_saved_run(path), str(path), only)


# ---------------------------------------------------------------- options and plan


@dataclass(frozen=True)
class PlanOptions:
    """What the admin asks for; None means the default from cluster/data/planner.yaml."""

    max_model_len: int | None = None
    min_concurrency: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    workload: str | None = None
    tokens_per_s_per_gpu: float | None = None
    served_model_name: str | None = None


@dataclass(frozen=True)
class MemoryBudget:
    """One GPU of the chosen layout (the worst pipeline stage), GiB."""

    total_gib: float
    utilization: float
    usable_gib: float
    weights_gib: float
    overhead_gib: float
    kv_gib: float

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Placement:
    """How replicas land on nodes: one GPU per Ray bundle."""

    replicas: int
    gpus_per_replica: int
    nodes_per_replica: int
    strategy: str
    replica_nodes: tuple[tuple[tuple[str, int], ...], ...]   # per replica: (node, GPUs)
    tp: int = 1
    pp: int = 1
    expert_parallel: bool = False
    dp: int = 1                      # MoE: DP attention ranks of one engine

    def gang(self) -> dict[str, Any] | None:
        """A replica larger than a node: vLLM's native multi-node layout (which ranks on
        which node rank, cluster.planning.gang; MoE: which DP ranks), or None (one node, or a split
        vLLM cannot run)."""
        if self.nodes_per_replica <= 1:
            return None
        try:
            return gang_layout(self.tp, self.pp, self.nodes_per_replica,
                               self.dp if self.expert_parallel else 1).to_dict()
        except UsageError:
            return None

    def executor(self) -> tuple[str, str]:
        """(executor, why) for `cluster deploy --plan` (serve_apps' `executor`)."""
        if self.expert_parallel:
            return "native", ("MoE DP + EP: vLLM's multi-node data-parallel layout, one engine "
                              f"launch per node ({self.nodes_per_replica} node(s)): node 0 in "
                              "the replica serves every DP rank, the others headless rank "
                              "actors (data_parallel_start_rank)")
        if self.gang() is not None:
            return "native", (f"one engine over {self.nodes_per_replica} nodes: vLLM's native "
                              "multi-node mode (node rank 0 in the replica, the others headless "
                              "rank actors), what vLLM's own multi-node guide runs")
        if self.nodes_per_replica > 1:
            return "ray", (f"TP {self.tp} x PP {self.pp} does not split evenly into whole "
                           f"TP groups over {self.nodes_per_replica} nodes; vLLM's Ray "
                           "executor places the workers")
        return "auto", "one node per replica"

    def bundles_per_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for replica in self.replica_nodes:
            for node, n in replica:
                out[node] = out.get(node, 0) + n
        return out

    def to_dict(self) -> dict[str, Any]:
        executor, why = self.executor()
        return {"replicas": self.replicas, "gpus_per_replica": self.gpus_per_replica,
                "nodes_per_replica": self.nodes_per_replica, "bundle": {"GPU": 1},
                "strategy": self.strategy, "bundles_per_node": self.bundles_per_node(),
                "replica_nodes": [dict(r) for r in self.replica_nodes],
                "executor": executor, "executor_reason": why, "gang": self.gang()}


@dataclass(frozen=True)
class Capacity:
    """Capacity ≈ GPUs × C × utilization (tokens/s, input + output)."""

    gpus: int
    tokens_per_s_per_gpu: float
    utilization: float
    tokens_per_s: float
    tokens_per_s_range: tuple[float, float]

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "utilization": self.utilization, "tokens_per_s": round(self.tokens_per_s, 1),
                "tokens_per_s_range": [round(x, 1) for x in self.tokens_per_s_range]}


@dataclass(frozen=True)
class Plan:
    """The serving plan. `to_dict()` is the documented JSON/YAML contract."""

    model_name: str
    model_path: str | None
    served_model_name: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    expert_parallel_size: int
    replicas: int
    gpus_per_replica: int
    gpus_used: int
    gpus_total: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    kv_cache_tokens: int
    max_concurrency: float
    max_model_len: int
    gpu_memory_utilization: float
    weights_bytes: int
    weights_source: str
    memory: MemoryBudget
    gpu: Mapping[str, Any]
    engine_args: Mapping[str, Any]
    placement: Placement
    capacity: Capacity | None
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]
    rules: tuple[str, ...]
    cluster_source: str = "flags"
    layout: str = ""                       # "TP 8 × PP 2", "TP 1 × DP 16 with EP 16"
    tradeoffs: tuple[str, ...] = ()        # what this layout gives up (planner.yaml tradeoffs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_path,
            "model_name": self.model_name,
            "served_model_name": self.served_model_name,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "enable_expert_parallel": self.enable_expert_parallel,
            "expert_parallel_size": self.expert_parallel_size,
            "replicas": self.replicas,
            "gpus_per_replica": self.gpus_per_replica,
            "gpus_used": self.gpus_used,
            "gpus_total": self.gpus_total,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
            "kv_cache_tokens": self.kv_cache_tokens,
            "total_kv_cache_tokens": self.kv_cache_tokens * self._instances(),
            "max_concurrency": self.max_concurrency,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "weights_bytes": self.weights_bytes,
            "weights_source": self.weights_source,
            "memory_per_gpu": self.memory.to_dict(),
            "gpu": dict(self.gpu),
            "engine_args": dict(self.engine_args),
            "placement": self.placement.to_dict(),
            "capacity": self.capacity.to_dict() if self.capacity else None,
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "rules": list(self.rules),
            "cluster_source": self.cluster_source,
            "layout": self.layout,
            "tradeoffs": list(self.tradeoffs),
        }

    def _instances(self) -> int:
        """Engine instances that each hold kv_cache_tokens (DP ranks × replicas for DP+EP)."""
        if self.enable_expert_parallel:
            return self.data_parallel_size * self.replicas
        return self.replicas


# ---------------------------------------------------------------- pure helpers


def kv_dtype_bytes(name: str, model_dtype: str) -> float:
    """Bytes per KV element: fp8 variants 1, auto = the serving dtype."""
    if name.startswith("fp8"):
        return 1
    return DTYPE_BYTES[model_dtype]


def predict_kv_cache_tokens(model: ModelInfo, kv_cache_bytes: int, *, kv_cache_dtype: str = "auto",
                            dtype: str | None = None, tensor_parallel_size: int = 1,
                            pipeline_parallel_size: int = 1, block_size: int | None = None,
                            max_model_len: int | None = None) -> int:
    """KV tokens one engine holds when each GPU (or CPU worker) has `kv_cache_bytes` for KV.

    Tokens come in whole blocks: blocks = bytes // (block_size × per-GPU bytes per token). With
    max_model_len, the figure is vLLM's own start-up number: max concurrency (blocks per
    request = ceil(max_model_len / block_size)) × max_model_len.
    """
    block = block_size or int(planner_defaults()["defaults"]["block_size"])
    kv_b = kv_dtype_bytes(kv_cache_dtype, dtype or model.dtype)
    layers = math.ceil(model.num_kv_layers / pipeline_parallel_size)
    per_token = model.kv_bytes_per_token(kv_b, tp=tensor_parallel_size, layers=layers)
    if per_token <= 0 or kv_cache_bytes <= 0:
        return 0
    blocks = int(kv_cache_bytes // (per_token * block))
    if max_model_len:
        per_request = math.ceil(max_model_len / block)
        return int(blocks / per_request * max_model_len)
    return blocks * block


@dataclass(frozen=True)
class _Hardware:
    gpus_per_node: int
    node_names: tuple[str, ...]
    memory_mib: int
    gpu_name: str
    architecture: str | None
    fp8_ok: bool
    bf16_ok: bool
    nvlink: bool
    notes: tuple[str, ...]
    warnings: tuple[str, ...]
    ib_rate_gbps: float | None = None     # the slowest known InfiniBand/RoCE port rate

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


def summarize_cluster(cluster: ClusterFacts) -> _Hardware:
    """One homogeneous view: the smallest GPU, the smallest count per node (R7 mixed-gpus)."""
    gpu_nodes = [n for n in cluster.nodes if n.gpu_count > 0]
    if not gpu_nodes:
        raise PlanError(f"no GPUs in the cluster facts ({cluster.source})")
    notes, warnings = [], []
    for s in cluster.skipped:
        warnings.append(f"node skipped, no GPU facts: {s}")
    warnings.extend(cluster.notes)
    smallest = min(gpu_nodes, key=lambda n: n.gpu_memory_mib)
    models = sorted({n.gpu_model for n in gpu_nodes})
    if len(models) > 1:
        by_model = ", ".join(f"{m} ({sum(1 for n in gpu_nodes if n.gpu_model == m)} node(s))" for m in models)
        warnings.append(f"R7 mixed-gpus: {by_model}; planning every group at the smallest GPU, "
                        f"{smallest.gpu_model} ({smallest.gpu_memory_mib / 1024:.1f} GiB)")
    counts = sorted({n.gpu_count for n in gpu_nodes})
    if len(counts) > 1:
        warnings.append(f"GPU counts per node differ ({', '.join(map(str, counts))}): "
                        f"planning with {counts[0]} per node")
    specs = {m: lookup_gpu(m) for m in models}
    spec = specs[smallest.gpu_model]
    fp8_ok = all(s is not None and s.fp8 for s in specs.values())
    archs = sorted({s.architecture for s in specs.values() if s is not None})
    bf16_archs = set(planner_defaults()["bf16_architectures"])
    bf16_ok = all(s is None or s.architecture in bf16_archs for s in specs.values())
    measured = [n.nvlink for n in gpu_nodes]
    if all(v is True for v in measured):
        nvlink = True
    elif any(v is False for v in measured):
        nvlink = False
    else:
        typical = [s.nvlink if s else None for s in specs.values()]
        if all(t is True for t in typical):
            nvlink = True
            notes.append(f"NVLink not measured; assumed from the GPU model ({', '.join(models)}: NVLink)")
        else:
            nvlink = False
            if any(t is None for t in typical):
                warnings.append("NVLink unknown (not measured, GPU model not in gpus.yaml): "
                                "assuming none (PCIe) -- pass --nvlink yes|no")
            else:
                notes.append(f"NVLink not measured; assumed from the GPU model ({', '.join(models)}: PCIe)")
    return _Hardware(
        gpus_per_node=counts[0],
        node_names=tuple(n.node for n in gpu_nodes),
        memory_mib=smallest.gpu_memory_mib,
        gpu_name=smallest.gpu_model,
        architecture=spec.architecture if spec else (archs[0] if archs else None),
        fp8_ok=fp8_ok, bf16_ok=bf16_ok, nvlink=nvlink,
        notes=tuple(notes), warnings=tuple(warnings),
        ib_rate_gbps=min((n.ib_rate_gbps for n in gpu_nodes if n.ib_rate_gbps), default=None),
    )


@dataclass(frozen=True)
class _Layout:
    tp: int
    pp: int
    dp: int                  # DP ranks inside one expert-parallel group (1 without EP)
    ep: bool
    rule: str

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        if self.ep:
            return f"TP {self.tp} × DP {self.dp} with EP {self.tp * self.dp}"
        if self.pp > 1:
            return f"TP {self.tp} × PP {self.pp}"
        return f"TP {self.tp}"


@dataclass(frozen=True)
class _Fit:
    layout: _Layout
    utilization: float
    usable: float            # bytes
    weights: float           # bytes per GPU (worst stage)
    overhead: float
    kv_budget: float
    kv_per_token_gpu: int
    kv_tokens: int
    needed_tokens: int

    @property
    def fits_weights(self) -> bool:
        return self.kv_budget > 0

    @property
    def fits(self) -> bool:
        return self.kv_budget > 0 and self.kv_tokens >= self.needed_tokens

    def why_not(self) -> str:
        g = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
        if not self.fits_weights:
            return (f"{g(self.weights)} weights + {g(self.overhead)} overhead per GPU > "
                    f"{g(self.usable)} usable ({self.utilization:.2f} × GPU)")
        return (f"leaves {g(self.kv_budget)} KV per GPU = {self.kv_tokens:,} tokens < "
                f"{self.needed_tokens:,} needed")


def _heads_ok(model: ModelInfo, tp: int) -> bool:
    if model.num_attention_heads % tp:
        return False
    kv = model.num_kv_heads
    return kv % tp == 0 or tp % kv == 0


def _overhead_bytes(gpus_per_instance: int) -> float:
    o = planner_defaults()["runtime_overhead_gib"]
    gib = float(o["activations"]) + float(o["cuda_graphs"]) + float(o["non_torch"])
    if gpus_per_instance > 1:
        gib += float(o["comm_buffers_multi_gpu"])
    return gib * GiB


def _weights_per_gpu(model: ModelInfo, layout: _Layout) -> float:
    """Worst pipeline stage: its share of the layers + the embedding or lm_head, over TP;
    with EP the routed experts are spread over TP × DP GPUs."""
    total_layers = model.num_layers
    stage_layers = math.ceil(total_layers / layout.pp)
    experts = model.expert_weights_bytes if layout.ep else 0
    layer_bytes = model.layer_weights_bytes - experts
    if layout.pp == 1:
        edge = model.embedding_bytes + model.lm_head_bytes
    else:
        edge = max(model.embedding_bytes, model.lm_head_bytes)
    per_gpu = (layer_bytes * stage_layers / total_layers + edge) / layout.tp
    if layout.ep:
        per_gpu += experts * stage_layers / total_layers / (layout.tp * layout.dp)
    return per_gpu


def _evaluate(model: ModelInfo, hw: _Hardware, layout: _Layout, *, util: float | None,
              kv_b: float, block: int, needed_tokens: int) -> _Fit:
    gpus_per_instance = layout.gpus
    d = planner_defaults()["defaults"]
    if util is None:
        util = float(d["gpu_memory_utilization"] if gpus_per_instance == 1
                     else d["gpu_memory_utilization_multi_gpu"])
    usable = util * hw.memory_mib * MiB
    weights = _weights_per_gpu(model, layout)
    overhead = _overhead_bytes(gpus_per_instance)
    kv_budget = usable - weights - overhead
    per_token = model.kv_bytes_per_token(kv_b, tp=layout.tp,
                                         layers=math.ceil(model.num_kv_layers / layout.pp))
    tokens = int(kv_budget // (per_token * block)) * block if kv_budget > 0 and per_token > 0 else 0
    return _Fit(layout, util, usable, weights, overhead, kv_budget, per_token, tokens, needed_tokens)


def _candidates(model: ModelInfo, hw: _Hardware) -> list[_Layout]:
    """Layouts in preference order; the first that fits wins."""
    g, n_nodes = hw.gpus_per_node, hw.num_nodes
    tp_set = [int(t) for t in planner_defaults()["defaults"]["tensor_parallel_candidates"]]
    out = [_Layout(1, 1, 1, False, "R1 fits-one-gpu")]
    if model.is_moe:
        sizes = []
        if g > 1:
            if g <= model.num_experts:
                sizes.append(g)
            else:
                fitting = [s for s in (8, 4, 2) if s <= model.num_experts and g % s == 0]
                sizes += fitting[:1]
        sizes += [g * k for k in range(2, n_nodes + 1) if g * k <= model.num_experts]
        for size in sizes:
            for tp in [1, *tp_set]:
                if tp <= min(size, g) and size % tp == 0 and _heads_ok(model, tp):
                    out.append(_Layout(tp, 1, size // tp, True, "R6 moe-dp-ep"))
    valid_tp = [tp for tp in tp_set if tp <= g and _heads_ok(model, tp)] if hw.nvlink else []
    out += [_Layout(tp, 1, 1, False, "R2 tp-in-node") for tp in valid_tp]
    # Pipeline over the node's GPUs: always without NVLink (R3); with NVLink only where no valid
    # TP can use that many GPUs (R5: the GPU count does not divide the model). PP sizes divide
    # the node so that no GPU is left out of a replica.
    pp_rule = "R5 uneven-pp" if hw.nvlink else "R3 no-nvlink-pp"
    largest_tp = max(valid_tp, default=1)
    out += [_Layout(1, pp, 1, False, pp_rule) for pp in range(2, g + 1)
            if g % pp == 0 and pp > largest_tp and pp <= model.num_layers]
    for k in range(2, n_nodes + 1):
        if hw.nvlink and g in tp_set and _heads_ok(model, g):
            if k <= model.num_layers:
                out.append(_Layout(g, k, 1, False, "R4 multi-node-tp-pp"))
        elif g * k <= model.num_layers:
            out.append(_Layout(1, g * k, 1, False, pp_rule))
    return out


def _placement(hw: _Hardware, layout: _Layout) -> Placement:
    g = hw.gpus_per_node
    size = layout.gpus
    replicas: list[tuple[tuple[str, int], ...]] = []
    if size <= g:
        per_node = g // size
        for node in hw.node_names:
            replicas += [((node, size),)] * per_node
        nodes_per = 1
    else:
        nodes_per = math.ceil(size / g)
        names = list(hw.node_names)
        for i in range(len(names) // nodes_per):
            chunk = names[i * nodes_per:(i + 1) * nodes_per]
            replicas.append(tuple((node, g) for node in chunk))
    strategy = "STRICT_PACK" if nodes_per == 1 else "PACK"
    return Placement(len(replicas), size, nodes_per, strategy, tuple(replicas),
                     tp=layout.tp, pp=layout.pp, expert_parallel=layout.ep, dp=layout.dp)


def all2all_backend(hw: _Hardware, layout: _Layout, nodes_per_replica: int,
                    workload: str) -> tuple[str, str]:
    """(vLLM all2all_backend, reason) of a MoE DP + EP layout (R15 all2all): DeepEP where the
    GPUs run it (planner.yaml all2all.architectures), low-latency kernels for a decode-heavy
    workload, high-throughput ones for a prefill-heavy one; vLLM's default otherwise."""
    a2a = planner_defaults()["all2all"]
    default = str(a2a["default"])
    where = f"{hw.gpu_name} ({hw.architecture or 'unknown architecture'})"
    if hw.architecture not in a2a["architectures"]:
        return default, (f"R15 all2all: {default} (vLLM's default): DeepEP kernels need "
                         f"{'/'.join(a2a['architectures'])} GPUs, the cluster has {where}")
    chosen = a2a["workloads"].get(workload)
    if not chosen:
        return default, (f"R15 all2all: {default} (vLLM's default): workload {workload} names "
                         "no DeepEP mode")
    span = (f"; across {nodes_per_replica} nodes DeepEP needs NVSHMEM over RDMA (GPUDirect: "
            "`cluster preflight`, `cluster nccl-check`)" if nodes_per_replica > 1 else "")
    return str(chosen["backend"]), (f"R15 all2all: {chosen['backend']} on {where}: "
                                    f"{chosen['why']} (workload {workload}){span}")


def _tradeoffs(hw: _Hardware, lay: _Layout, placement: Placement,
               a2a: tuple[str, str] | None) -> tuple[str, ...]:
    """What the layout gives up: its rule's line (planner.yaml tradeoffs), the traffic that
    crosses nodes when one engine spans them, DeepEP's NVSHMEM need."""
    data = planner_defaults()
    out = [str(data["tradeoffs"][lay.rule.split(" ")[0]])]
    if placement.nodes_per_replica > 1:
        kinds = ("expert all-to-all" if lay.ep else "pipeline" if lay.tp <= hw.gpus_per_node
                 else "tensor-parallel all-reduce")
        out.append(str(data["spans_nodes"]).format(nodes=placement.nodes_per_replica, kinds=kinds))
    if a2a is not None and a2a[0].startswith("deepep"):
        out.append(f"all2all_backend {a2a[0]}: {data['deepep']}")
    return tuple(out)


def _fmt_gib(b: float) -> str:
    return f"{b / GiB:.1f} GiB"


def _resolve_serving_dtype(model: ModelInfo, hw: _Hardware, reasons: list, warnings: list) -> str:
    if model.dtype == "float32":
        dtype = "bfloat16" if hw.bf16_ok else "float16"
        reasons.append(f"R12 dtype: checkpoint is float32; serving in {dtype} (never fp32 for serving; "
                       f"{'bf16 on Ampere and newer' if hw.bf16_ok else 'fp16 before Ampere'})")
    elif model.dtype == "bfloat16" and not hw.bf16_ok:
        dtype = "float16"
        warnings.append(f"R12 dtype: {hw.gpu_name} ({hw.architecture}) has no bf16: serving the bf16 "
                        f"checkpoint in float16 (watch for overflow)")
        reasons.append("R12 dtype: float16 (bf16 not supported before Ampere)")
    else:
        dtype = model.dtype
        reasons.append(f"R12 dtype: {dtype} (the checkpoint's dtype)")
    q = model.quantization
    if q is not None:
        if q.bits is None:
            estimate = (": weights counted at the model dtype, an upper bound"
                        if model.weights_source == "parameter-count" else ": weights as measured on disk")
            warnings.append(f"R12 quantization: unknown method {q.method!r}{estimate}")
        else:
            reasons.append(f"R12 quantization: pre-quantized weights, {q.method} ({q.detail}, "
                           f"{q.bits:g} bits per {'expert ' if q.scope == 'experts' else ''}weight); "
                           f"vLLM reads quantization_config itself")
        fp8_weights = q.method in ("fp8", "fbgemm_fp8", "ptpc_fp8") or (q.bits == 8 and "FP8" in q.detail.upper())
        if fp8_weights and not hw.fp8_ok:
            warnings.append(f"R12 quantization: FP8 weights need Hopper/Ada/MI300; {hw.gpu_name} "
                            f"({hw.architecture}) runs them only through slower weight-only kernels")
    return dtype


def _resolve_kv_dtype(asked: str, serving_dtype: str, hw: _Hardware, reasons: list,
                      warnings: list) -> str:
    if asked not in KV_DTYPE_CHOICES:
        raise UsageError(f"--kv-cache-dtype {asked!r}: choose from {', '.join(KV_DTYPE_CHOICES)}")
    if asked == "auto":
        reasons.append(f"R8 kv-cache-dtype: auto = {serving_dtype} "
                       f"({int(DTYPE_BYTES[serving_dtype])} bytes per element)")
        return "auto"
    if hw.fp8_ok:
        reasons.append(f"R8 kv-cache-dtype: {asked} on {hw.gpu_name} ({hw.architecture}): 1 byte per "
                       f"element, half the KV memory of {serving_dtype}; some attention backends lack "
                       f"fp8 and get slower: A/B test")
        return asked
    why = f"{hw.gpu_name} ({hw.architecture or 'unknown architecture'})"
    reasons.append(f"R8 kv-cache-dtype: {asked} refused: {why} has no FP8 (only Hopper, Ada, "
                   f"Blackwell, MI300); kv_cache_dtype stays auto ({serving_dtype})")
    warnings.append(f"R8 kv-cache-dtype: {asked} refused on {why}; planned with auto ({serving_dtype})")
    return "auto"


def _no_fit_error(model: ModelInfo, hw: _Hardware, fits: Sequence[_Fit], min_conc: int,
                  max_len: int) -> PlanError:
    where = (f"{hw.num_nodes} node(s) × {hw.gpus_per_node} × {hw.gpu_name} "
             f"({hw.memory_gib:.1f} GiB{', NVLink' if hw.nvlink else ', no NVLink'})")
    best = max(fits, key=lambda f: (f.kv_budget > 0, f.kv_tokens, f.kv_budget))
    lines = [f"{model.name} does not fit {where}: weights {_fmt_gib(model.weights_bytes)} "
             f"({model.weights_source})."]
    lines.append(f"Best layout tried, {best.layout.describe()} on {best.layout.gpus} GPU(s): "
                 f"{best.why_not()}.")
    if best.fits_weights:
        lines.append(f"Needed: {min_conc} sequences × {max_len:,} tokens; lower --max-model-len or "
                     f"--min-concurrency, or use --kv-cache-dtype fp8 where supported.")
    else:
        per_gpu = best.usable - best.overhead
        need = math.ceil(model.weights_bytes / per_gpu) if per_gpu > 0 else 0
        lines.append(f"Weights alone need at least {need} GPUs of {hw.memory_gib:.1f} GiB "
                     f"(cluster has {hw.total_gpus}).")
    return PlanError(" ".join(lines))


def _checked_options(options: PlanOptions) -> PlanOptions:
    """Options with every number checked: whole/finite and inside cluster/data/limits.yaml."""
    if options.max_model_len is not None:
        check_int(options.max_model_len, "--max-model-len", lo=bound("plan", "max_model_len_min"),
                  hi=bound("plan", "max_model_len"))
    if options.min_concurrency is not None:
        check_int(options.min_concurrency, "--min-concurrency", lo=1,
                  hi=bound("plan", "min_concurrency"))
    if options.gpu_memory_utilization is not None:
        check_float(options.gpu_memory_utilization, "--gpu-memory-utilization", lo=0, hi=1,
                    lo_open=True)
    if options.tokens_per_s_per_gpu is not None:
        check_float(options.tokens_per_s_per_gpu, "--tokens-per-s-per-gpu", lo=0, lo_open=True,
                    hi=bound("plan", "tokens_per_s_per_gpu"))
    if options.served_model_name is not None:
        name = options.served_model_name
        if not isinstance(name, str) or not name or safe_line(name) != name or len(name) > 200:
            raise UsageError(f"--served-model-name {name!r}: expected a name without control "
                             f"characters, at most 200 characters")
    return options


def make_plan(model: ModelInfo, cluster: ClusterFacts, options: PlanOptions = PlanOptions()) -> Plan:
    """Pure: model facts + cluster facts + options -> Plan (or PlanError with the numbers)."""
    plan = _plan(model, cluster, options, 0)
    assert plan is not None       # pick 0 is the first fit, or _plan raised PlanError
    return plan


def plan_alternatives(model: ModelInfo, cluster: ClusterFacts, options: PlanOptions,
                      count: int) -> tuple[Plan, ...]:
    """The next `count` layouts the rules allow after make_plan's (each a whole Plan): first
    the best fitting layout of each other rule, then the remaining fits in preference order."""
    count = check_int(count, "--alternatives", lo=0, hi=bound("plan", "alternatives"))
    out = []
    for pick in range(1, count + 1):
        plan = _plan(model, cluster, options, pick)
        if plan is None:
            break
        out.append(plan)
    return tuple(out)


def _ranked(fits: Sequence[_Fit]) -> list[_Fit]:
    """Fitting layouts in the order alternatives are offered: the chosen (first) one, the first
    of each other rule, then the rest in candidate order."""
    if not fits:
        return []
    first_of_rule: dict[str, _Fit] = {}
    for f in fits[1:]:
        if f.layout.rule != fits[0].layout.rule:
            first_of_rule.setdefault(f.layout.rule, f)
    lead = [fits[0], *first_of_rule.values()]
    return lead + [f for f in fits[1:] if f not in lead]


def _plan(model: ModelInfo, cluster: ClusterFacts, options: PlanOptions, pick: int) -> Plan | None:
    """The plan of the pick-th layout in _ranked order (0: the first that fits); None when
    fewer layouts fit."""
    data = planner_defaults()
    d = data["defaults"]
    hw = summarize_cluster(cluster)
    reasons: list[str] = []
    warnings: list[str] = list(hw.warnings)

    options = _checked_options(options)
    # R11 max-model-len
    model_max = model.max_position_embeddings
    cap = int(d["max_model_len_cap"])
    if options.max_model_len is not None:
        if options.max_model_len < 1:
            raise UsageError("--max-model-len must be at least 1")
        if model_max is not None and options.max_model_len > model_max:
            raise PlanError(f"--max-model-len {options.max_model_len:,} exceeds {model.name}'s maximum "
                            f"of {model_max:,} tokens (max_position_embeddings)")
        max_len = options.max_model_len
        reasons.append(f"R11 max-model-len: {max_len:,} (asked; model maximum "
                       f"{model_max:,} tokens)" if model_max else f"R11 max-model-len: {max_len:,} (asked)")
    else:
        max_len = min(cap, model_max) if model_max else cap
        reasons.append(f"R11 max-model-len: {max_len:,} = min({cap:,}, model maximum "
                       f"{model_max:,}): clamp to what the workload needs, it multiplies each "
                       f"sequence's KV reservation" if model_max else
                       f"R11 max-model-len: {max_len:,} (model maximum unknown)")
    min_conc = options.min_concurrency if options.min_concurrency is not None else int(d["min_concurrency"])
    if min_conc < 1:
        raise UsageError("--min-concurrency must be at least 1")
    util_asked = options.gpu_memory_utilization
    if util_asked is not None and not 0 < util_asked <= 1:
        raise UsageError("--gpu-memory-utilization must be in (0, 1]")
    workload = options.workload or str(d["workload"])
    if workload not in data["workloads"]:
        raise UsageError(f"--workload {workload!r}: choose from {', '.join(data['workloads'])}")

    serving_dtype = _resolve_serving_dtype(model, hw, reasons, warnings)
    kv_name = _resolve_kv_dtype(options.kv_cache_dtype, serving_dtype, hw, reasons, warnings)
    kv_b = kv_dtype_bytes(kv_name, serving_dtype)
    block = int(d["block_size"])
    needed = min_conc * max_len

    # parallelism: first layout that fits (pick > 0: an alternative)
    tried = [_evaluate(model, hw, layout, util=util_asked, kv_b=kv_b, block=block,
                       needed_tokens=needed) for layout in _candidates(model, hw)]
    fits = [f for f in tried if f.fits]
    if not fits:
        raise _no_fit_error(model, hw, tried, min_conc, max_len)
    ranked = _ranked(fits)
    if pick >= len(ranked):
        return None
    chosen = ranked[pick]
    lay = chosen.layout
    if pick == 0:
        for f in tried[:tried.index(chosen)]:
            reasons.append(f"{f.layout.rule}: {f.layout.describe()} rejected: {f.why_not()}")
    placement = _placement(hw, lay)
    where = f"{hw.gpu_name} ({hw.memory_gib:.1f} GiB)"
    if lay.rule.startswith("R1"):
        extra = " (MoE, fits one GPU: no expert parallelism needed)" if model.is_moe else ""
        reasons.append(f"R1 fits-one-gpu: {_fmt_gib(chosen.weights)} weights fit one {where}{extra}: "
                       f"TP 1, PP 1; the other GPUs serve replicas: DP {placement.replicas} "
                       f"({placement.replicas} Serve replicas)")
    elif lay.rule.startswith("R2"):
        reasons.append(f"R2 tp-in-node: does not fit one GPU; TP {lay.tp} is the smallest of "
                       f"{'/'.join(map(str, d['tensor_parallel_candidates']))} that fits one node and "
                       f"divides {model.num_attention_heads} attention / {model.num_kv_heads} KV heads"
                       + (f" (KV heads replicated: {lay.tp} > {model.num_kv_heads})"
                          if lay.tp > model.num_kv_heads and not model.is_mla else "")
                       + f"; DP {placement.replicas}: {placement.replicas} replica(s) of {lay.gpus} GPUs")
    elif lay.rule.startswith("R3"):
        reasons.append(f"R3 no-nvlink-pp: no NVLink between the GPUs ({hw.gpu_name}): pipeline "
                       f"parallel instead of tensor parallel: TP 1, PP {lay.pp} "
                       f"({math.ceil(model.num_layers / lay.pp)} layers per stage); DP {placement.replicas}")
    elif lay.rule.startswith("R4"):
        reasons.append(f"R4 multi-node-tp-pp: does not fit one node; TP {lay.tp} = GPUs per node "
                       f"(all-reduce stays on NVLink), PP {lay.pp} = nodes (only activations cross "
                       f"the network); DP {placement.replicas}")
    elif lay.rule.startswith("R5"):
        reasons.append(f"R5 uneven-pp: no TP in {'/'.join(map(str, d['tensor_parallel_candidates']))} "
                       f"that fits within {hw.gpus_per_node} GPUs per node divides "
                       f"{model.num_attention_heads} attention / {model.num_kv_heads} KV heads: TP 1, "
                       f"PP {lay.pp} over the GPUs; DP {placement.replicas}")
    elif lay.rule.startswith("R6"):
        reasons.append(f"R6 moe-dp-ep: MoE ({model.num_experts} experts, {model.experts_per_token} per "
                       f"token) needs more than one GPU: data-parallel attention (DP {lay.dp}, TP "
                       f"{lay.tp}) + expert parallel MoE layers (enable_expert_parallel, EP = TP × DP = "
                       f"{lay.tp * lay.dp}: {model.num_experts / (lay.tp * lay.dp):g} experts per GPU); "
                       f"{placement.replicas} such group(s)"
                       + ("; set GLOO_SOCKET_IFNAME to the Ethernet control interface on IB clusters"
                          if placement.nodes_per_replica > 1 else ""))
        if not hw.nvlink:
            warnings.append("R6 moe-dp-ep: no NVLink: the expert all-to-all crosses PCIe")
    if placement.replicas * lay.gpus < hw.total_gpus:
        idle = hw.total_gpus - placement.replicas * lay.gpus
        reasons.append(f"placement: {idle} GPU(s) left idle ({hw.total_gpus} GPUs, "
                       f"{lay.gpus} per replica)")
    a2a = all2all_backend(hw, lay, placement.nodes_per_replica, workload) \
        if lay.ep and lay.dp > 1 else None
    if a2a is not None:
        reasons.append(a2a[1])
    reasons.extend(f"note: {n}" for n in hw.notes)

    # R10 gpu-memory-utilization
    mem = MemoryBudget(hw.memory_gib, chosen.utilization, chosen.usable / GiB, chosen.weights / GiB,
                       chosen.overhead / GiB, chosen.kv_budget / GiB)
    util_why = ("asked" if util_asked is not None else
                "one GPU per replica (vLLM default)" if lay.gpus == 1 else
                f"{lay.gpus} GPUs serve one replica: CUDA graphs and communication buffers need headroom")
    reasons.append(f"R10 gpu-memory-utilization {chosen.utilization:.2f} ({util_why}): usable "
                   f"{mem.usable_gib:.1f} of {mem.total_gib:.1f} GiB per GPU = weights "
                   f"{mem.weights_gib:.1f} + runtime overhead {mem.overhead_gib:.1f} + KV "
                   f"{mem.kv_gib:.1f} GiB")

    # R13 kv arithmetic
    kv_whole = model.kv_bytes_per_token(kv_b)
    if model.is_mla:
        formula = (f"{model.num_kv_layers} layers × ({model.kv_lora_rank} kv_lora_rank + "
                   f"{model.qk_rope_head_dim} qk_rope_head_dim) × {kv_b:g} B")
    else:
        formula = (f"2 × {model.num_kv_layers} layers × {model.num_kv_heads} KV heads × "
                   f"{model.head_dim} head_dim × {kv_b:g} B")
    share = []
    if lay.tp > 1 and not model.is_mla:
        share.append(f"{max(1, model.num_kv_heads // lay.tp)} KV head(s) per GPU at TP {lay.tp}")
    if lay.pp > 1:
        share.append(f"{math.ceil(model.num_kv_layers / lay.pp)} layers per stage at PP {lay.pp}")
    concurrency = round(chosen.kv_tokens / max_len, 2)
    reasons.append(f"R13 kv-cache: {formula} = {kv_whole:,} B/token; per GPU "
                   f"{chosen.kv_per_token_gpu:,} B/token"
                   + (f" ({', '.join(share)})" if share else "")
                   + f"; {mem.kv_gib:.1f} GiB KV per GPU holds {chosen.kv_tokens:,} tokens per "
                   f"{'DP rank' if lay.ep else 'replica'} = {concurrency:g} sequences of "
                   f"{max_len:,} tokens (min {min_conc})")
    reasons.extend(f"R13 kv-cache: {n}" for n in model.attention_notes())

    # R9 workload
    wl = data["workloads"][workload]
    reasons.append(f"R9 workload {workload}: max_num_seqs {wl['max_num_seqs']}, max_num_batched_tokens "
                   f"{wl['max_num_batched_tokens']} ({wl['why']}); find the knee with a stepwise load test")

    # R14 capacity
    capacity = None
    gpus_used = placement.replicas * lay.gpus
    if options.tokens_per_s_per_gpu is not None:
        if options.tokens_per_s_per_gpu <= 0:
            raise UsageError("--tokens-per-s-per-gpu must be > 0")
        c = data["capacity"]
        u, (lo, hi) = float(c["utilization"]), c["utilization_range"]
        cap_tps = gpus_used * options.tokens_per_s_per_gpu * u
        capacity = Capacity(gpus_used, options.tokens_per_s_per_gpu, u, cap_tps,
                            (gpus_used * options.tokens_per_s_per_gpu * float(lo),
                             gpus_used * options.tokens_per_s_per_gpu * float(hi)))
        reasons.append(f"R14 capacity: {gpus_used} GPUs × {options.tokens_per_s_per_gpu:g} tokens/s × "
                       f"{u:.2f} = {cap_tps:,.0f} tokens/s (input + output; run at {lo:.0%}-{hi:.0%}, "
                       f"scale out beyond)")

    served = options.served_model_name or model.name
    engine_args = {
        "model": model.path,
        "served_model_name": served,
        "tensor_parallel_size": lay.tp,
        "pipeline_parallel_size": lay.pp,
        "data_parallel_size": lay.dp if lay.ep else 1,
        "enable_expert_parallel": lay.ep,
        "max_model_len": max_len,
        "gpu_memory_utilization": round(chosen.utilization, 4),
        "kv_cache_dtype": kv_name,
        "max_num_seqs": int(wl["max_num_seqs"]),
        "max_num_batched_tokens": int(wl["max_num_batched_tokens"]),
        "dtype": serving_dtype,
    }
    if a2a is not None:
        engine_args["all2all_backend"] = a2a[0]
    rules = tuple(dict.fromkeys(r.split(" ")[0] for r in reasons + warnings
                                if re.match(r"R\d+ ", r) and " rejected: " not in r))
    return Plan(
        model_name=model.name, model_path=model.path, served_model_name=served,
        tensor_parallel_size=lay.tp, pipeline_parallel_size=lay.pp,
        data_parallel_size=lay.dp if lay.ep else placement.replicas,
        enable_expert_parallel=lay.ep, expert_parallel_size=lay.tp * lay.dp if lay.ep else 1,
        replicas=placement.replicas, gpus_per_replica=lay.gpus, gpus_used=gpus_used,
        gpus_total=hw.total_gpus,
        kv_cache_dtype=kv_name, kv_bytes_per_token=kv_whole,
        kv_bytes_per_token_per_gpu=chosen.kv_per_token_gpu,
        kv_cache_tokens=chosen.kv_tokens, max_concurrency=concurrency, max_model_len=max_len,
        gpu_memory_utilization=round(chosen.utilization, 4),
        weights_bytes=model.weights_bytes, weights_source=model.weights_source, memory=mem,
        gpu={"model": hw.gpu_name, "memory_gib": round(hw.memory_gib, 2),
             "architecture": hw.architecture, "nvlink": hw.nvlink, "fp8": hw.fp8_ok,
             "nodes": hw.num_nodes, "gpus_per_node": hw.gpus_per_node,
             "ib_rate_gbps": hw.ib_rate_gbps},
        engine_args=engine_args, placement=placement, capacity=capacity,
        reasons=tuple(reasons), warnings=tuple(warnings), rules=rules,
        cluster_source=cluster.source, layout=lay.describe(),
        tradeoffs=_tradeoffs(hw, lay, placement, a2a),
    )


# ---------------------------------------------------------------- vLLM's own validation


@dataclass(frozen=True)
class EngineArgsCheck:
    """Result of validating engine args with vLLM: ok, invalid, or skipped (no vLLM)."""

    status: str
    detail: str
    vllm_version: str | None = None
    seconds: float | None = None          # how long the check took (None: not run)
    silenced_lines: int = 0               # third-party output lines kept off the terminal

    @property
    def ok(self) -> bool:
        return self.status != "invalid"

    def line(self) -> str:
        """One line for a terminal: what ran, how long it took, or why it was skipped."""
        took = f" in {self.seconds:.1f} s" if self.seconds is not None else ""
        return f"validation: {self.status}{took}: {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail, "vllm_version": self.vllm_version,
                "seconds": None if self.seconds is None else round(self.seconds, 2),
                "silenced_lines": self.silenced_lines}


SKIPPED_BY_FLAG = EngineArgsCheck("skipped", "--no-validate")


def validate_quietly(engine_args: Mapping[str, Any]) -> EngineArgsCheck:
    """validate_engine_args timed, with what vLLM and its imports print or log (Triton's "CPU
    backend" note, Python warnings, vLLM's logger) kept off the terminal: file descriptors 1
    and 2 point at a temporary file while it runs, Python warnings are caught; the lines it
    caught are counted, never shown. Our own verdict is the returned value."""
    import contextlib
    import io
    import logging
    import os
    import sys
    import tempfile
    import time
    import warnings

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    start = time.monotonic()
    text = io.StringIO()
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings(record=True) as caught, \
            contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        warnings.simplefilter("always")
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            check = validate_engine_args(engine_args)
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            logging.getLogger("vllm").setLevel(logging.ERROR)   # nothing of it later either
        sink.seek(0)
        lines = len(sink.read(1 << 20).splitlines()) + len(caught) + \
            len(text.getvalue().splitlines())
    return replace(check, seconds=time.monotonic() - start, silenced_lines=lines)


def _cli_argv(kwargs: Mapping[str, Any]) -> list[str]:
    argv: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def validate_engine_args(engine_args: Mapping[str, Any], *, create_config: bool = False) -> EngineArgsCheck:
    """Validate with vLLM's EngineArgs (names) and its CLI parser (values: types, choices).

    `model` (and the display-only served_model_name) stay out of the name/value checks, so no
    model is needed on disk. With create_config=True and the model path on disk, vLLM also
    builds its full engine config (reads config.json; slower).
    """
    try:
        import vllm
        from vllm.engine.arg_utils import EngineArgs
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot check"
        return EngineArgsCheck("skipped", f"vLLM not importable ({type(exc).__name__}: {exc})")
    version = getattr(vllm, "__version__", None)
    kwargs = {k: v for k, v in engine_args.items() if k not in ("model",)}
    try:
        EngineArgs(**kwargs)
    except TypeError as exc:
        return EngineArgsCheck("invalid", f"vLLM EngineArgs rejects a name: {exc}", version)
    except Exception as exc:  # noqa: BLE001
        return EngineArgsCheck("invalid", f"vLLM EngineArgs: {type(exc).__name__}: {exc}", version)
    try:
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:
            from vllm.utils import FlexibleArgumentParser  # older vLLM

        class _Raising(FlexibleArgumentParser):
            def error(self, message):  # noqa: D401 - argparse hook
                raise ValueError(message)

        parser = EngineArgs.add_cli_args(_Raising(prog="vllm", exit_on_error=False))
        cli = {k: v for k, v in kwargs.items() if k != "served_model_name"}
        parser.parse_args(_cli_argv(cli))
    except (ValueError, argparse.ArgumentError) as exc:
        return EngineArgsCheck("invalid", f"vLLM argument parser: {exc}", version)
    if create_config:
        model = engine_args.get("model")
        if model and Path(str(model)).exists():
            try:
                EngineArgs(model=str(model), **kwargs).create_engine_config()
            except Exception as exc:  # noqa: BLE001
                return EngineArgsCheck("invalid", f"vLLM engine config: {type(exc).__name__}: {exc}",
                                       version)
            return EngineArgsCheck("ok", f"vLLM {version}: EngineArgs, argument parser and engine "
                                         f"config accept the args", version)
    return EngineArgsCheck("ok", f"vLLM {version}: EngineArgs and its argument parser accept the args",
                           version)
