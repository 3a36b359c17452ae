"""Fabric thresholds as data: cluster/data/fabric.yaml rows -> the bus bandwidth a group must reach.

Pure apart from the cached read of the table:

    table = load_table()                                   # validated rows
    th = threshold_for(table, backend="nccl", crosses=True, transport="IB_GDR",
                       gpu_model="NVIDIA H100 80GB HBM3", ranks=2, ranks_per_node=1,
                       port_rates_gbps=[400.0], overrides=inv.expectations["fabric"])
    th.gbps        -> 0.8 x 0.95 x 400 / 8 = 38.0      (None: no row applies)
    meets(12.0, th) -> False

`transport_key(...)` names the row transport of a measured group (IB_GDR, IB, ROCE_GDR, ROCE,
SOCKET, NVLINK, TCP...). The inventory's `expectations: fabric:` overrides a threshold by
scope (nvlink_min_busbw_gbps, network_min_busbw_gbps, socket_min_busbw_gbps,
gloo_min_busbw_gbps), and says what cross-node groups must run over (`interconnect`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

from cluster.base.errors import UsageError
from cluster.base.results import Record
from cluster.base.yamlfile import ValueTextError, packaged, parse_value

SCOPES = ("intra_node", "inter_node", "any")
BACKENDS = ("nccl", "gloo")
INTERCONNECTS = ("auto", "infiniband", "roce", "any")
_URL_RE = re.compile(r"^https://[A-Za-z0-9.-]+/[^\s]*\Z")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}\Z")


@dataclass(frozen=True)
class Row:
    """One published figure for a kind of link."""

    id: str
    backend: str
    scope: str
    transport: str
    gpus: tuple[str, ...]
    ranks: tuple[int, int]
    reference_gbps: float | None
    line_rate_efficiency: float | None
    source: str
    note: str


@dataclass(frozen=True)
class Table:
    pass_fraction: float
    rows: tuple[Row, ...]
    plan_reference_tokens_per_s: float = 1000.0


@dataclass(frozen=True)
class Threshold(Record):
    """What a group must reach (gbps None: no row applies, not judged on bandwidth)."""

    gbps: float | None
    row: str | None
    basis: str
    source: str | None = None


def _number(value: Any, what: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not lo <= value <= hi:
        raise UsageError(f"fabric table: {what} must be a number in [{lo:g}, {hi:g}], "
                         f"got {value!r}")
    return float(value)


def _row(raw: Any, i: int) -> Row:
    if not isinstance(raw, dict):
        raise UsageError(f"fabric table: row {i} must be a mapping")
    rid = raw.get("id")
    if not isinstance(rid, str) or not _ID_RE.match(rid):
        raise UsageError(f"fabric table: row {i} has no valid id")
    if raw.get("backend") not in BACKENDS or raw.get("scope") not in SCOPES:
        raise UsageError(f"fabric table: {rid}: backend must be one of {BACKENDS}, scope one "
                         f"of {SCOPES}")
    transport, source = raw.get("transport"), raw.get("source")
    if not isinstance(transport, str) or not re.match(r"^[A-Z_]{2,20}\Z", transport):
        raise UsageError(f"fabric table: {rid}: transport must be an upper-case name")
    if not isinstance(source, str) or not _URL_RE.match(source):
        raise UsageError(f"fabric table: {rid}: every row names its public source (https URL)")
    gpus = raw.get("gpus") or []
    ranks = raw.get("ranks")
    if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
        raise UsageError(f"fabric table: {rid}: gpus must be a list of names")
    if not (isinstance(ranks, list) and len(ranks) == 2):
        raise UsageError(f"fabric table: {rid}: ranks must be [lo, hi]")
    lo, hi = (int(_number(r, f"{rid}.ranks", 1, 1e6)) for r in ranks)
    ref, eff = raw.get("reference_gbps"), raw.get("line_rate_efficiency")
    if (ref is None) == (eff is None):
        raise UsageError(f"fabric table: {rid}: give reference_gbps or line_rate_efficiency")
    return Row(rid, raw["backend"], raw["scope"], transport, tuple(gpus), (lo, hi),
               None if ref is None else _number(ref, f"{rid}.reference_gbps", 0, 1e5),
               None if eff is None else _number(eff, f"{rid}.line_rate_efficiency", 0, 1),
               source, str(raw.get("note") or ""))


def parse_table(text: str) -> Table:
    """Validate the table's text (cluster/data/fabric.yaml's shape)."""
    try:
        data = parse_value(text, "fabric table")
    except ValueTextError as exc:
        raise UsageError(str(exc)) from None
    return table_of(data)


def table_of(data: Any) -> Table:
    """The table from its parsed YAML (cluster/data/fabric.yaml's shape)."""
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise UsageError("fabric table: expected pass_fraction and rows")
    rows = tuple(_row(r, i) for i, r in enumerate(data["rows"]))
    if len({r.id for r in rows}) != len(rows):
        raise UsageError("fabric table: row ids must be unique")
    return Table(_number(data.get("pass_fraction"), "pass_fraction", 0.01, 1), rows,
                 _number(data.get("plan_reference_tokens_per_s", 1000), "plan_reference_"
                         "tokens_per_s", 1, 1e9))


@lru_cache(maxsize=1)
def load_table() -> Table:
    """cluster/data/fabric.yaml."""
    return table_of(packaged("fabric.yaml"))


def transport_key(backend: str, crosses: bool, inter_node: str | None, gdr: bool | None,
                  nvlink: bool | None = True) -> str | None:
    """The row transport of a measured group: gloo -> TCP; NCCL inside a node -> NVLINK (when
    the GPUs have NVLink, else PCIE); across nodes the parser's inter-node transport, with
    _GDR when GPUDirect RDMA was seen (None when the log did not show it)."""
    if backend == "gloo":
        return "TCP"
    if not crosses:
        return "NVLINK" if nvlink else "PCIE"
    name = (inter_node or "UNKNOWN").upper()
    if name in ("IB_GDR", "ROCE_GDR"):
        return name
    if name in ("IB", "ROCE"):
        return name + ("_GDR" if gdr else "")
    if name == "SOCKET":
        return "SOCKET"
    return None


def _override(overrides: Mapping[str, Any] | None, backend: str, crosses: bool,
              transport: str | None) -> tuple[str, float] | None:
    if not overrides:
        return None
    if backend == "gloo":
        key = "gloo_min_busbw_gbps"
    elif not crosses:
        key = "nvlink_min_busbw_gbps"
    elif transport == "SOCKET":
        key = "socket_min_busbw_gbps"
    else:
        key = "network_min_busbw_gbps"
    value = overrides.get(key)
    return (key, float(value)) if value is not None else None


def _gpu_matches(row: Row, gpu_model: str | None) -> bool:
    if not row.gpus:
        return True
    if not gpu_model:
        return False
    from cluster.planning.planner import lookup_gpu

    spec = lookup_gpu(gpu_model)
    name = spec.name if spec else gpu_model
    return name in row.gpus


def find_row(table: Table, *, backend: str, crosses: bool, transport: str | None,
             gpu_model: str | None, ranks: int, ranks_per_node: int) -> Row | None:
    """The first row for this kind of group (None: the table has no figure for it)."""
    scope = "inter_node" if crosses else "intra_node"
    count = ranks if crosses else ranks_per_node
    for row in table.rows:
        if row.backend != backend or row.scope not in (scope, "any"):
            continue
        if row.transport != transport or not _gpu_matches(row, gpu_model):
            continue
        if row.ranks[0] <= count <= row.ranks[1]:
            return row
    return None


def threshold_for(table: Table, *, backend: str, crosses: bool, transport: str | None,
                  gpu_model: str | None, ranks: int, ranks_per_node: int,
                  port_rates_gbps: Sequence[float] = (),
                  overrides: Mapping[str, Any] | None = None) -> Threshold:
    """The bus bandwidth (GB/s) this group must reach, and why."""
    forced = _override(overrides, backend, crosses, transport)
    if forced:
        key, value = forced
        return Threshold(value, None, f"expectations.fabric.{key}")
    row = find_row(table, backend=backend, crosses=crosses, transport=transport,
                   gpu_model=gpu_model, ranks=ranks, ranks_per_node=ranks_per_node)
    if row is None:
        what = f"{backend} {transport or 'unknown transport'}"
        return Threshold(None, None, f"no row in cluster/data/fabric.yaml for {what}"
                                     + (f" on {gpu_model}" if gpu_model else ""))
    frac = table.pass_fraction
    if row.reference_gbps is not None:
        gbps = round(frac * row.reference_gbps, 4)
        return Threshold(gbps, row.id, f"{frac:g} x {row.reference_gbps:g} GB/s ({row.id})",
                         row.source)
    rates = sorted((float(r) for r in port_rates_gbps if r and r > 0), reverse=True)
    ports = rates[:max(1, ranks_per_node)]
    if not ports:
        return Threshold(None, row.id, f"{row.id}: no active port rate known for the group's "
                                       "nodes (run `cluster preflight`)", row.source)
    line = sum(ports) / 8.0
    gbps = round(frac * row.line_rate_efficiency * line, 4)
    rate = "+".join(f"{r:g}" for r in ports)
    return Threshold(gbps, row.id, f"{frac:g} x {row.line_rate_efficiency:g} x {rate} Gb/s "
                                   f"/ 8 ({row.id})", row.source)


def meets(busbw_gbps: float | None, threshold: Threshold) -> bool | None:
    """True / False against the threshold; None when there is no threshold or no number."""
    if threshold.gbps is None or busbw_gbps is None:
        return None
    return busbw_gbps >= threshold.gbps


def expected_network(expectations: Mapping[str, Any], any_node_lists_hcas: bool) -> str | None:
    """What cross-node NCCL groups must run over: "IB", "ROCE" or None (anything)."""
    fabric = expectations.get("fabric") or {}
    asked = fabric.get("interconnect", "auto")
    if asked == "infiniband":
        return "IB"
    if asked == "roce":
        return "ROCE"
    if asked == "any":
        return None
    ib = expectations.get("infiniband") or {}
    required = ib.get("required", "auto")
    if required is True or (required == "auto" and any_node_lists_hcas):
        return "ROCE" if ib.get("link_layer") == "Ethernet" else "IB"
    return None
