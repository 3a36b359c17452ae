"""One node's reported facts (preflight.json `facts.nodes.<node>`) as one frozen dataclass.

The one typed vocabulary of what the per-node checks conclude about a node: a check's verdict
carries the facts it read (`NodeFactsSummary.of(gpu_count=8, ...)`), the preflight merges them
node by node, and the cross-node checks, the fixes, `cluster fix`'s playbook, the health job and
the planner read them as attributes. `to_dict` is where the JSON is written (the report's keys,
in the checks' order: a fact a check did not state is left out, one it stated as unknown is
null); `from_dict` is the typed reading of a saved run (every value checked, a wrong type is
unknown, never a crash).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping

from cluster.base.errors import ClusterError
from cluster.base.results import Record
from cluster.inspection.contract import Runtime

_MAX_ITEMS = 4096      # a saved run's lists and maps are read up to this many entries


@dataclass(frozen=True)
class IbPortFact(Record):
    """One InfiniBand/RoCE port as the infiniband check reports it."""

    ca: str
    port: int | None = None
    state: str | None = None
    rate_gbps: float | None = None
    link_layer: str | None = None

    @property
    def active(self) -> bool:
        return self.state == "Active"


@dataclass(frozen=True)
class ModelFile:
    """One key file of the model directory: its size and sha256."""

    size: int
    sha256: str


@dataclass(frozen=True)
class NodeFactsSummary:
    """A node's facts as its checks reported them; None: not stated (see `nulls`).

    The fields' order is the report's key order (the checks' order, NODE_CHECKS)."""

    reachable: bool | None = None
    gpu_count: int | None = None
    gpu_model: str | None = None
    gpu_names: tuple[str, ...] | None = None
    gpu_memory_mib: int | None = None
    gpu_bus_ids: tuple[str | None, ...] | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    nvlink: bool | None = None
    topology_nics: tuple[str, ...] | None = None
    ib_ports: tuple[IbPortFact, ...] | None = None
    peermem_loaded: bool | None = None
    peermem_registered: tuple[str, ...] | None = None
    clock_source: str | None = None
    clock_synchronized: bool | None = None
    clock_offset_s: float | None = None
    shm_bytes: int | None = None
    memlock_kib: int | str | None = None
    versions: Mapping[str, str | None] | None = None
    python_writable: tuple[str, ...] | None = None
    model_files: Mapping[str, ModelFile] | None = None
    model_bytes: int | None = None
    ray_running: bool | None = None
    runtime: Runtime | None = None
    contract_row: str | None = None
    contract_nearest: str | None = None
    persistence_off: bool | None = None
    nccl_ib_hca_order: Mapping[str, tuple[str, ...]] | None = None
    nearest_nic_relation: Mapping[str, str] | None = None
    mtu: int | None = None
    prometheus_binary: bool | None = None
    # the facts a check stated as unknown: written as null (None alone is "not stated")
    nulls: frozenset[str] = field(default=frozenset(), repr=False)
    # a saved run's values of the wrong type (fact -> the value's repr, bounded): read as None
    unreadable: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, **facts: Any) -> "NodeFactsSummary":
        """The facts a check states; one given as None is stated unknown (null in the JSON)."""
        return cls(**facts, nulls=frozenset(k for k, v in facts.items() if v is None))

    def merged(self, *later: "NodeFactsSummary") -> "NodeFactsSummary":
        """These facts with what each of `later` states in their place, in order (a node's
        checks' facts merged at once: one copy, not one a check)."""
        stated: dict[str, Any] = {}
        nulls = self.nulls
        for one in later:
            own = {f: getattr(one, f) for f in FACT_FIELDS
                   if getattr(one, f) is not None or f in one.nulls}
            if own:
                stated.update(own)
                nulls = (nulls - own.keys()) | one.nulls
        return replace(self, **stated, nulls=nulls) if stated else self

    def version(self, component: str) -> str | None:
        """The installed version of `component` (python, ray, vllm, torch, nccl), None when
        not installed or not known."""
        return (self.versions or {}).get(component) or None

    def model_print(self) -> tuple[tuple[str, int, str], ...]:
        """The model's key files as (name, size, sha256), sorted: equal on nodes that hold the
        same files."""
        return tuple(sorted((k, f.size, f.sha256) for k, f in (self.model_files or {}).items()))

    @property
    def active_ib_ports(self) -> tuple[IbPortFact, ...]:
        return tuple(p for p in self.ib_ports or () if p.active)

    @property
    def active_ib_rates(self) -> tuple[float, ...]:
        """The rates (Gb/s, as read) of the Active ports that report a positive one."""
        return tuple(p.rate_gbps for p in self.active_ib_ports
                     if p.rate_gbps is not None and p.rate_gbps > 0)

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON of these facts (preflight.json facts.nodes.<node>)."""
        from cluster.base.results import to_jsonable
        return {f: to_jsonable(getattr(self, f)) for f in FACT_FIELDS
                if getattr(self, f) is not None or f in self.nulls}

    @classmethod
    def from_dict(cls, raw: Any) -> "NodeFactsSummary":
        """The typed reading of a saved run's facts of one node: a value of the wrong type (or
        not finite) reads as not stated; unknown keys are ignored."""
        if not isinstance(raw, Mapping):
            return cls()
        values = {name: _READERS[name](raw[name]) for name in FACT_FIELDS if name in raw}
        nulls = frozenset(name for name in values if raw[name] is None)
        unreadable = {name: repr(raw[name])[:80] for name, v in values.items()
                      if v is None and raw[name] is not None}
        return cls(**values, nulls=nulls, unreadable=unreadable)


@dataclass(frozen=True)
class PreflightFacts:
    """A preflight report's facts (Report.facts): each node's, by name; JSON {"nodes": {...}}.

    `to_dict` writes them (preflight.json `facts`); `from_dict` / `from_report` are the one
    typed reading of a saved run's (the planner's, `cluster nccl-check --report`'s)."""

    nodes: Mapping[str, NodeFactsSummary]
    # a saved run's nodes whose facts are null or not an object: no facts (written as null)
    without_facts: frozenset[str] = field(default=frozenset(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": {n: None if n in self.without_facts else f.to_dict()
                          for n, f in self.nodes.items()}}

    @classmethod
    def from_dict(cls, raw: Any, *, only: Iterable[str] | None = None,
                  max_nodes: int | None = None) -> "PreflightFacts | None":
        """The typed reading of a saved run's facts ({"nodes": {node: facts}}), each node's by
        NodeFactsSummary.from_dict; None when `raw` holds no "nodes" object. `only`: read these
        nodes alone (the others are left out); `max_nodes`: TooManyNodes when the run holds
        more (counted before any is read)."""
        nodes = raw.get("nodes") if isinstance(raw, Mapping) else None
        if not isinstance(nodes, Mapping):
            return None
        if max_nodes is not None and len(nodes) > max_nodes:
            raise TooManyNodes(len(nodes), max_nodes)
        if only is not None:
            nodes = {n: nodes[n] for n in dict.fromkeys(only) if n in nodes}
        return cls({str(n): NodeFactsSummary.from_dict(f) for n, f in nodes.items()},
                   frozenset(str(n) for n, f in nodes.items() if not isinstance(f, Mapping)))

    @classmethod
    def from_report(cls, document: Any, *, only: Iterable[str] | None = None,
                    max_nodes: int | None = None) -> "PreflightFacts | None":
        """The facts of a saved preflight report (the document Report.to_dict() wrote: its
        "facts"), as `from_dict` reads them; None when it holds none."""
        return cls.from_dict(document.get("facts") if isinstance(document, Mapping) else None,
                             only=only, max_nodes=max_nodes)


class TooManyNodes(ClusterError):
    """A saved run holds more nodes than its reader takes."""

    def __init__(self, count: int, limit: int):
        self.count, self.limit = count, limit
        super().__init__(f"{count:,} nodes in the saved run, more than the {limit:,} read")


FACT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(NodeFactsSummary)
                                     if f.name not in ("nulls", "unreadable"))


# ---------------------------------------------------------------- reading a saved run


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return v


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _strs(v: Any) -> tuple[str, ...] | None:
    return tuple(s for s in v[:_MAX_ITEMS] if isinstance(s, str)) if isinstance(v, list) else None


def _optional_strs(v: Any) -> tuple[str | None, ...] | None:
    return tuple(s if isinstance(s, str) else None for s in v[:_MAX_ITEMS]) \
        if isinstance(v, list) else None


def _map(v: Any, value: Callable[[Any], Any]) -> dict[str, Any] | None:
    if not isinstance(v, Mapping):
        return None
    items = list(v.items())[:_MAX_ITEMS]
    return {k: value(x) for k, x in items if isinstance(k, str)}


def _versions(v: Any) -> dict[str, str | None] | None:
    return _map(v, _str)


def _ib_port(v: Any) -> IbPortFact | None:
    if not isinstance(v, Mapping):
        return None
    return IbPortFact(_str(v.get("ca")) or "", _int(v.get("port")), _str(v.get("state")),
                      _number(v.get("rate_gbps")), _str(v.get("link_layer")))


def _ib_ports(v: Any) -> tuple[IbPortFact, ...] | None:
    if not isinstance(v, list):
        return None
    return tuple(p for p in (_ib_port(x) for x in v[:_MAX_ITEMS]) if p is not None)


def _model_files(v: Any) -> dict[str, ModelFile] | None:
    files = _map(v, lambda f: ModelFile(f["size"], f["sha256"])
                 if isinstance(f, Mapping) and _int(f.get("size")) is not None
                 and isinstance(f.get("sha256"), str) else None)
    return None if files is None else {k: f for k, f in files.items() if f is not None}


def _runtime(v: Any) -> Runtime | None:
    if not isinstance(v, Mapping):
        return None
    return Runtime(*(_str(v.get(k)) for k in ("python", "ray", "vllm", "torch", "cuda", "nccl")))


def _memlock(v: Any) -> int | str | None:
    return v if v == "unlimited" else _int(v)


def _hca_order(v: Any) -> dict[str, tuple[str, ...]] | None:
    order = _map(v, _strs)
    return None if order is None else {k: o for k, o in order.items() if o is not None}


def _relations(v: Any) -> dict[str, str] | None:
    found = _map(v, _str)
    return None if found is None else {k: r for k, r in found.items() if r is not None}


_READERS: dict[str, Callable[[Any], Any]] = {
    "reachable": _bool, "gpu_count": _int, "gpu_model": _str, "gpu_names": _strs,
    "gpu_memory_mib": _number, "gpu_bus_ids": _optional_strs, "driver_version": _str,
    "cuda_version": _str, "nvlink": _bool, "topology_nics": _strs, "ib_ports": _ib_ports,
    "peermem_loaded": _bool, "peermem_registered": _strs, "clock_source": _str,
    "clock_synchronized": _bool, "clock_offset_s": _number, "shm_bytes": _int,
    "memlock_kib": _memlock, "versions": _versions, "python_writable": _strs,
    "model_files": _model_files, "model_bytes": _int, "ray_running": _bool, "runtime": _runtime,
    "contract_row": _str, "contract_nearest": _str, "persistence_off": _bool,
    "nccl_ib_hca_order": _hca_order, "nearest_nic_relation": _relations, "mtu": _int,
    "prometheus_binary": _bool,
}
