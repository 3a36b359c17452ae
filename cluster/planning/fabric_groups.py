"""The communication groups of a deployment's parallel layout: which ranks talk, on which nodes.

Pure (no Ray, no network). From the layout the app gets (a DeploySpec, or a plan file through
it) and the nodes that host its ranks:

    layout = Layout.from_spec(spec)                  # TP, PP, DP (MoE), EP, replicas
    slots = rank_slots(layout, nodes)                # every rank's node, IP and device index
    groups = layout_groups(layout, slots)            # the groups whose traffic the engine makes

Rank numbering is vLLM's: TP fastest, then PP, then DP (MoE: the DP attention ranks of one
engine), global rank = d * (PP * TP) + p * TP + t. Dense replicas are separate engines, each
with its own ranks 0 .. TP*PP-1 (`replica` tells them apart); they exchange no collective.

Groups (kinds are the `kind` keys of `fabric_proof`):
  tp  each TP group (TP ranks of one stage); always inside one node
  pp  each pair of neighbouring pipeline stages (rank t of stage p and of stage p+1)
  dp  MoE: the DP ranks of one (stage, TP rank), when it differs from its EP group
  ep  MoE: the expert-parallel group of one stage (DP x TP ranks)
Groups of one rank carry no traffic and are left out.

Placement follows the multi-node engine's (vLLM native multi-node: node rank n runs the
engine's ranks [n * local, (n + 1) * local), local = world / nnodes, nnodes the fewest nodes
that hold the engine: cluster/planning/gang.py `nodes_needed`, the rule the serving app's gang uses too;
MoE: whole DP ranks per node, as vLLM's data_parallel_size_local): each engine takes the first such nodes in order (the
head first, as the inventory lists them) that still have room; a node's room is its GPUs, on the
CPU build its CPUs (`slots_per_node`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.base.bounds import bound, check_int
from cluster.base.errors import UsageError
from cluster.base.results import Record
from cluster.planning.gang import nodes_needed

KINDS = ("tp", "pp", "dp", "ep")


@dataclass(frozen=True)
class Layout(Record):
    """The parallel layout of one deployment."""

    tp: int = 1
    pp: int = 1
    dp: int = 1                 # MoE: DP attention ranks of one engine (dense: 1)
    ep: bool = False
    replicas: int = 1           # dense: engines; MoE: engines of DP x TP x PP ranks each
    nnodes: int | None = None   # nodes one engine spans, when the deployment fixes it
                                # (cluster/serving/deploy.py engine_nodes); None: gang.nodes_needed

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "replicas"):
            check_int(getattr(self, name), f"layout {name}", lo=1, hi=bound("plan", "parallel_size"))
        if not self.ep and self.dp != 1:
            raise UsageError("a dense layout's data parallelism is replicas (dp must be 1)")
        n = self.nnodes
        if n is not None and (check_int(n, "layout nnodes", lo=1, hi=bound("plan", "nodes"))
                              and self.ranks_per_engine % n):
            raise UsageError(f"layout nnodes must divide the engine's "
                             f"{self.ranks_per_engine} ranks, got {n!r}")

    @classmethod
    def from_spec(cls, spec: Any) -> "Layout":
        """From cluster.serving.deploy.DeploySpec (what `cluster deploy` gives the app)."""
        return cls(tp=spec.tensor_parallel_size, pp=spec.pipeline_parallel_size,
                   dp=spec.data_parallel_size if spec.expert_parallel else 1,
                   ep=bool(spec.expert_parallel), replicas=spec.replicas)

    @classmethod
    def from_plan(cls, plan: Any) -> "Layout":
        """From cluster.planning.plan_file.PlanFile (the plan `cluster deploy --plan` turns into a spec)."""
        ep = bool(plan.enable_expert_parallel)
        return cls(tp=plan.tensor_parallel_size, pp=plan.pipeline_parallel_size,
                   dp=plan.data_parallel_size if ep else 1, ep=ep, replicas=plan.replicas)

    @property
    def ranks_per_engine(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class NodeSlots:
    """A node that can host ranks: its name, the IP Ray knows it by, how many ranks it takes."""

    name: str
    ip: str
    slots: int


@dataclass(frozen=True)
class RankSlot(Record):
    """Where one rank of one engine runs."""

    replica: int
    rank: int
    node: str
    ip: str
    device: int                 # the rank's index on its node (its GPU index on GPU nodes)


@dataclass(frozen=True)
class Group:
    """One communication group of one engine."""

    kind: str
    replica: int
    ranks: tuple[int, ...]
    members: tuple[RankSlot, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        seen: list[str] = []
        for m in self.members:
            if m.node not in seen:
                seen.append(m.node)
        return tuple(seen)

    @property
    def crosses_nodes(self) -> bool:
        return len(self.nodes) > 1

    @property
    def label(self) -> str:
        """`tp r0 [0,1]`: kind, replica and ranks, as messages name a group."""
        return f"{self.kind} r{self.replica} [{','.join(map(str, self.ranks))}]"

    def ranks_per_node(self) -> int:
        counts: dict[str, int] = {}
        for m in self.members:
            counts[m.node] = counts.get(m.node, 0) + 1
        return max(counts.values()) if counts else 0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "replica": self.replica, "ranks": list(self.ranks),
                "nodes": list(self.nodes), "members": [m.to_dict() for m in self.members]}


def slots_per_node(layout: Layout, device: str, resources: float) -> int:
    """Ranks one node takes: one per GPU on GPU nodes, one per CPU on the CPU build (a CPU
    worker binds a core), as cluster/serving/deploy.py's engine_nodes counts them: the engine's nodes
    come from `layout.nnodes` (what the deployment will span) or the fewest that hold it
    (cluster/planning/gang.py nodes_needed)."""
    return max(0, int(resources))


def rank_slots(layout: Layout, nodes: Sequence[NodeSlots]) -> tuple[RankSlot, ...]:
    """Every rank's node and device. Each engine takes the first `nodes_needed` nodes (in
    order) that still have room for world / nnodes ranks; node rank n runs the engine's ranks
    [n * local, (n + 1) * local).

    Raises UsageError when the nodes cannot hold the layout.
    """
    if not nodes:
        raise UsageError("no node to place the layout's ranks on")
    if max(n.slots for n in nodes) < 1:
        raise UsageError("no node has room for a rank of this layout")
    nnodes = layout.nnodes or nodes_needed(layout.tp, layout.pp, max(n.slots for n in nodes),
                                           dp=layout.dp)
    local = layout.ranks_per_engine // nnodes
    used = {n.name: 0 for n in nodes}
    out: list[RankSlot] = []
    for replica in range(layout.replicas):
        chosen = [n for n in nodes if n.slots - used[n.name] >= local][:nnodes]
        if len(chosen) < nnodes:
            raise UsageError(f"replica {replica} needs {nnodes} node(s) with room for {local} "
                             f"rank(s) each; {len(chosen)} are left")
        for node_rank, node in enumerate(chosen):
            for i in range(local):
                out.append(RankSlot(replica, node_rank * local + i, node.name, node.ip,
                                    used[node.name] + i))
            used[node.name] += local
    return tuple(out)


def global_rank(layout: Layout, d: int, p: int, t: int) -> int:
    """vLLM's rank of DP rank d, stage p, TP rank t."""
    return d * layout.pp * layout.tp + p * layout.tp + t


def _rank_sets(layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, ranks) of one engine's groups, in a stable order."""
    L = layout
    sets: list[tuple[str, tuple[int, ...]]] = []
    for d in range(L.dp):
        for p in range(L.pp):
            sets.append(("tp", tuple(global_rank(L, d, p, t) for t in range(L.tp))))
    for d in range(L.dp):
        for p in range(L.pp - 1):
            for t in range(L.tp):
                sets.append(("pp", (global_rank(L, d, p, t), global_rank(L, d, p + 1, t))))
    if L.ep:
        ep_sets = []
        for p in range(L.pp):
            ep_sets.append(tuple(sorted(global_rank(L, d, p, t)
                                        for d in range(L.dp) for t in range(L.tp))))
        for p in range(L.pp):
            for t in range(L.tp):
                ranks = tuple(global_rank(L, d, p, t) for d in range(L.dp))
                if ranks not in ep_sets:
                    sets.append(("dp", ranks))
        sets.extend(("ep", r) for r in ep_sets)
    return [(kind, ranks) for kind, ranks in sets if len(ranks) > 1]


def layout_groups(layout: Layout, slots: Sequence[RankSlot]) -> tuple[Group, ...]:
    """The groups of every engine of the layout, with their members' nodes and devices."""
    where: Mapping[tuple[int, int], RankSlot] = {(s.replica, s.rank): s for s in slots}
    groups = []
    for replica in range(layout.replicas):
        for kind, ranks in _rank_sets(layout):
            try:
                members = tuple(where[(replica, r)] for r in ranks)
            except KeyError as exc:
                raise UsageError(f"rank {exc.args[0][1]} of replica {replica} has no slot") \
                    from None
            groups.append(Group(kind, replica, ranks, members))
    return tuple(groups)
