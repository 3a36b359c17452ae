"""What a running engine's ranks really communicate over, read from their own init output (pure).

After `cluster deploy` sees the app RUNNING, the node-side collector
(cluster/node_programs/engine_logs.py) returns, per node, the distributed-init lines of the
logs Ray keeps there (the replica's and the rank actors' worker logs): NCCL's INIT/NET lines
(NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET, set by the deployment for its ranks) and, on the
CPU build, vLLM's process-group lines:

    world_size=2 rank=1 local_rank=0 distributed_init_method=tcp://198.18.5.1:29500 backend=gloo
    rank 1 in world size 2 is assigned as DP rank 0, PP rank 1, PCP rank 0, TP rank 0, ...

    readings = read_engine(groups, {"node1": [text, ...], "node2": [...]}, backend="nccl")
    readings[0].to_dict() -> {kind, ranks, nodes, transport, gdr, evidence, engine_ranks}
    mismatches(proof_groups, readings, expected_network="IB") -> ["pp r0 [0,1]: ... ", ...]

NCCL text goes through the project's parser (cluster/inspection/parsers/nccl.py) over the group's nodes'
texts; the evidence is the first line that shows the transport found (`via NET/IB/0/GDRDMA`,
`via NET/Socket/0`, `Using network Socket`, ...). Linear in the input; texts come bounded from
the collector.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from cluster.base.errors import ParseError

_INIT_RE = re.compile(r"world_size=(\d{1,7}) rank=(\d{1,7}) local_rank=(-?\d{1,7}) "
                      r"distributed_init_method=(\S{1,300}) backend=([A-Za-z0-9_:]{1,40})")
_ASSIGNED_RE = re.compile(r"rank (\d{1,7}) in world size (\d{1,7}) is assigned as DP rank "
                          r"(\d{1,7}), PP rank (\d{1,7}),(?: PCP rank \d{1,7},)? TP rank "
                          r"(\d{1,7})")
# The line that shows each transport, strongest first (channel lines, then the network chosen).
_EVIDENCE = {
    "IB_GDR": re.compile(r"via NET/IB[^\s]*/GDRDMA"),
    "IB": re.compile(r"via NET/IB|Using network IB"),
    "ROCE_GDR": re.compile(r"via NET/IB[^\s]*/GDRDMA"),
    "ROCE": re.compile(r"via NET/IB|Using network IB"),
    "SOCKET": re.compile(r"via NET/Socket|Using network Socket"),
    "OFI": re.compile(r"via NET/(?:AWS )?Libfabric|Using network (?:AWS )?Libfabric|NET/OFI"),
}
_INTRA_RE = re.compile(r"via (?:P2P/\S+|SHM\S*|NVLS)")
LINE_MAX = 1000


@dataclass(frozen=True)
class EngineRank:
    """One rank as the engine itself logged it."""

    rank: int
    world_size: int
    node: str
    backend: str | None = None
    init_method: str | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None
    line: str = ""


@dataclass(frozen=True)
class EngineReading:
    """What one group of the running engine communicates over."""

    kind: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    transport: str | None
    gdr: bool | None
    evidence: str | None
    engine_ranks: Mapping[int, str]          # rank -> node the engine logged it on
    expected_ranks: Mapping[int, str] | None = None   # rank -> node the proof placed it on

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks), "nodes": list(self.nodes),
                "transport": self.transport, "gdr": self.gdr, "evidence": self.evidence,
                "engine_ranks": {str(k): v for k, v in sorted(self.engine_ranks.items())}}


def _lines(texts: Sequence[str]):
    for text in texts:
        for line in text.splitlines():
            yield line[:LINE_MAX]


def engine_ranks(logs: Mapping[str, Sequence[str]], world_size: int | None = None
                 ) -> dict[int, dict[str, EngineRank]]:
    """rank -> {node: its process-group init line there} (the first per node). Only lines of
    an engine of `world_size` ranks count when it is given: several engines (replicas, other
    apps) log the same rank numbers."""
    found: dict[int, dict[str, EngineRank]] = {}
    assigned: dict[tuple[str, int], tuple[int, int]] = {}
    for node, texts in logs.items():
        for line in _lines(texts):
            m = _INIT_RE.search(line)
            if m:
                rank, world = int(m.group(2)), int(m.group(1))
                if world_size is None or world == world_size:
                    found.setdefault(rank, {}).setdefault(node, EngineRank(
                        rank, world, node, m.group(5), m.group(4), line=line.strip()))
                continue
            a = _ASSIGNED_RE.search(line)
            if a and (world_size is None or int(a.group(2)) == world_size):
                assigned.setdefault((node, int(a.group(1))), (int(a.group(4)), int(a.group(5))))
    out: dict[int, dict[str, EngineRank]] = {}
    for rank, per_node in found.items():
        out[rank] = {}
        for node, r in per_node.items():
            pp, tp = assigned.get((node, rank), (None, None))
            out[rank][node] = EngineRank(r.rank, r.world_size, node, r.backend, r.init_method,
                                         pp, tp, r.line)
    return out


def _where(per_node: Mapping[str, EngineRank], expected: str | None) -> EngineRank:
    """The line of the node the proof placed the rank on, else the first other one."""
    if expected in per_node:
        return per_node[expected]
    return next(iter(per_node.values()))


def _nccl_reading(texts: Sequence[str], crosses: bool) -> tuple[str | None, bool | None,
                                                                str | None]:
    from cluster.inspection.parsers.nccl import parse_texts

    if not any("NCCL" in t for t in texts):
        return None, None, None
    try:
        log = parse_texts(texts)
    except ParseError:
        return None, None, None
    if crosses:
        transport = log.inter_node_transport
        if transport in ("UNKNOWN", "NONE"):
            return None, log.gdr, None
        key = transport + ("_GDR" if log.gdr and transport in ("IB", "ROCE") else "")
        pattern = _EVIDENCE.get(key) or _EVIDENCE.get(transport)
        evidence = _first(texts, pattern) if pattern else None
        return transport, log.gdr, evidence
    intra = "+".join(log.intra_node_transports) or None
    return intra, None, _first(texts, _INTRA_RE) if intra else None


def _first(texts: Sequence[str], pattern: re.Pattern) -> str | None:
    for line in _lines(texts):
        if pattern.search(line):
            return line.strip()
    return None


def read_engine(groups: Sequence[Any], logs: Mapping[str, Sequence[str]],
                backend: str, world_size: int | None = None) -> tuple[EngineReading, ...]:
    """Per group (cluster.planning.fabric_groups.Group), what the engine's own lines show
    (`world_size`: the engine's ranks, to tell its lines from other engines')."""
    ranks = engine_ranks(logs, world_size)
    out = []
    for g in groups:
        texts = [t for node in g.nodes for t in logs.get(node, ())]
        placed = {m.rank: m.node for m in g.members}
        chosen = {r: _where(ranks[r], placed.get(r)) for r in g.ranks if r in ranks}
        seen = {r: line.node for r, line in chosen.items()}
        if backend == "gloo":
            lines = list(chosen.values())
            backends = {r.backend for r in lines}
            transport = "TCP" if lines and backends == {"gloo"} else (
                ",".join(sorted(b or "?" for b in backends)) or None)
            evidence = lines[-1].line if lines else None
            out.append(EngineReading(g.kind, tuple(g.ranks), tuple(g.nodes), transport, None,
                                     evidence, seen, placed))
            continue
        transport, gdr, evidence = _nccl_reading(texts, g.crosses_nodes)
        out.append(EngineReading(g.kind, tuple(g.ranks), tuple(g.nodes), transport, gdr,
                                 evidence, seen, placed))
    return tuple(out)


def placement_warnings(readings: Sequence[EngineReading]) -> list[str]:
    """Ranks the engine ran on another node than the proof tested (their transport there is
    not proven): Ray's placement decides where the engine runs."""
    out = []
    for r in readings:
        placed = r.expected_ranks or {}
        moved = {rank: node for rank, node in r.engine_ranks.items()
                 if placed.get(rank, node) != node}
        if moved:
            where = ", ".join(f"rank {k} on {v} (proven on {placed[k]})"
                              for k, v in sorted(moved.items()))
            out.append(f"{_label(r)}: the engine placed {where}: not proven there")
    return out


def _label(r: EngineReading) -> str:
    return f"{r.kind} [{','.join(map(str, r.ranks))}]"


def mismatches(proof_groups: Sequence[Mapping[str, Any]], readings: Sequence[EngineReading],
               expected_network: str | None, details: Sequence[Mapping[str, Any]] = ()
               ) -> list[str]:
    """Where the running engine's cross-node transport contradicts the proof or the inventory
    (empty: it does not): sockets where InfiniBand/RoCE is expected, or another inter-node
    transport or GDR state than the proof ran over (both lines given). Inside a node NCCL may
    pick another P2P path for the engine's own communicators: reported, not judged. A group
    the engine says nothing about is not a mismatch (see `unconfirmed`)."""
    problems = []
    proofs = {(tuple(p["ranks"]), p["kind"]): (p, d) for p, d in
              zip(proof_groups, list(details) + [{}] * (len(proof_groups) - len(details)))}
    for r in readings:
        if r.transport is None or len(r.nodes) < 2:
            continue
        if expected_network and r.transport == "SOCKET":
            want = "InfiniBand" if expected_network == "IB" else "RoCE"
            problems.append(f"{_label(r)}: the engine's channels go over sockets where the "
                            f"inventory expects {want}: {r.evidence}")
            continue
        proof, detail = proofs.get((r.ranks, r.kind), (None, {}))
        if not proof or proof.get("backend") != "nccl" or not proof.get("transport"):
            continue
        if (proof["transport"], bool(proof.get("gdr"))) != (r.transport, bool(r.gdr)):
            said = f"{proof['transport']}{'/GDR' if proof.get('gdr') else ''}"
            got = f"{r.transport}{'/GDR' if r.gdr else ''}"
            line = (detail or {}).get("evidence") or proof.get("verdict")
            problems.append(f"{_label(r)}: the proof ran over {said} ({line}) but the engine "
                            f"runs over {got}: {r.evidence}")
    return problems


def unconfirmed(readings: Sequence[EngineReading]) -> list[str]:
    """Groups the engine's logs said nothing about (a note, not a failure)."""
    return [f"{r.kind} [{','.join(map(str, r.ranks))}]" for r in readings if r.transport is None]


def logs_of(documents: Mapping[str, Any]) -> dict[str, list[str]]:
    """node -> texts, from the collector's documents (cluster/node_programs/engine_logs.py);
    a node whose document is missing or malformed gives no text."""
    out: dict[str, list[str]] = {}
    for node, doc in documents.items():
        files = doc.get("files") if isinstance(doc, Mapping) else None
        texts = []
        for f in files if isinstance(files, list) else ():
            lines = f.get("lines") if isinstance(f, Mapping) else None
            if isinstance(lines, list):
                texts.append("\n".join(str(x)[:LINE_MAX] for x in lines[:10000]) + "\n")
        out[node] = texts
    return out


RUNS_SCANNED = 200               # the newest run directories `confirmed_by_app` looks into
DEPLOY_DOC_MAX = 8 << 20


def deploy_records(run_root: str) -> Iterator[tuple[Any, Any]]:
    """(path, document) of the newest run directories' deploy.json files, newest first (an
    unreadable or oversized one skipped; the document is unchecked JSON)."""
    from pathlib import Path

    from cluster.base.errors import ClusterError
    from cluster.planning.modelinfo import read_json_file

    runs = sorted((p for p in Path(run_root).glob("*/deploy.json") if not p.is_symlink()),
                  key=lambda p: p.parent.name, reverse=True)[:RUNS_SCANNED]
    for path in runs:
        try:
            yield path, read_json_file(path, "deploy record", max_bytes=DEPLOY_DOC_MAX)
        except ClusterError:
            continue


def confirmed_by_app(run_root: str, apps: Sequence[str]) -> dict[str, dict[str, Any]]:
    """app -> the transport its last deployment confirmed ({"groups": ["pp [0,1]: TCP", ...],
    "deployed_from": run dir}), from the newest deploy.json of each app that read its ranks'
    init lines (`cluster status` shows it). Apps without one are left out."""
    wanted = set(apps)
    out: dict[str, dict[str, Any]] = {}
    for path, doc in deploy_records(run_root):
        if wanted <= set(out):
            break
        name = doc.get("name") if isinstance(doc, Mapping) else None
        readings = doc.get("engine_transport") if isinstance(doc, Mapping) else None
        if name not in wanted or name in out or not isinstance(readings, list):
            continue
        groups = []
        for r in readings[:64]:
            if isinstance(r, Mapping) and isinstance(r.get("ranks"), list):
                over = r.get("transport") or "not confirmed"
                gdr = "/GDR" if r.get("gdr") else ""
                groups.append(f"{r.get('kind')} [{','.join(map(str, r['ranks'][:16]))}]: "
                              f"{over}{gdr}")
        out[name] = {"groups": groups, "status": doc.get("status"),
                     "deployed_from": str(path.parent)}
    return out
