"""One engine across nodes (a gang): which global vLLM ranks run on which node rank (pure).

vLLM's native multi-node mode (the mp executor with nnodes / node_rank / master_addr /
master_port; node ranks > 0 headless) gives node rank n the global ranks
[n * local, (n + 1) * local), local = world / nnodes, and global rank r is pipeline stage
r // tp, tensor rank r % tp. So with local a multiple of tp every stage's TP group sits inside
one node; with local < tp (e.g. TP 2 with one rank per node) the TP group spans nodes.

    layout = gang_layout(tp=1, pp=2, nnodes=2)
    layout.nodes[1].ranks        -> (1,)       node rank 1 holds global rank 1 (stage 1)
    layout.nodes[1].stages       -> (1,)
    layout.tp_split              -> False      each stage's TP group inside one node
    nodes_needed(tp=2, pp=2, workers_per_node=2) -> 2

The serving app (serve_apps/) and the fabric proof reuse this mapping; it never imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.bounds import bound, check_int
from cluster.errors import UsageError

RANK_NAMESPACE = "cluster-gang"     # the Ray namespace of the rank actors (node ranks > 0)


def rank_actor_name(app: str, replica_id: str, rank: int) -> str:
    """The Ray name of a replica's node rank `rank` actor (serve_apps names it so; `cluster
    status` and the rollouts find it by it)."""
    return f"{app}/{replica_id}/rank{rank}"


@dataclass(frozen=True)
class NodeRank:
    """One node of a gang: its node rank and the global vLLM ranks it runs."""

    node_rank: int
    ranks: tuple[int, ...]
    stages: tuple[int, ...]          # pipeline stages with a rank here
    tp_ranks: tuple[int, ...]        # tensor-parallel ranks here (per rank, same order)

    def to_dict(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, "ranks": list(self.ranks),
                "stages": list(self.stages), "tp_ranks": list(self.tp_ranks)}


@dataclass(frozen=True)
class GangLayout:
    """TP x PP of one engine over `nnodes` nodes, `local` ranks on each."""

    tp: int
    pp: int
    nnodes: int

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def local(self) -> int:
        return self.world // self.nnodes

    @property
    def nodes(self) -> tuple[NodeRank, ...]:
        out = []
        for n in range(self.nnodes):
            ranks = tuple(range(n * self.local, (n + 1) * self.local))
            out.append(NodeRank(n, ranks, tuple(sorted({r // self.tp for r in ranks})),
                                tuple(r % self.tp for r in ranks)))
        return tuple(out)

    @property
    def tp_split(self) -> bool:
        """True when a stage's TP group spans nodes (all-reduce crosses the network)."""
        return self.local % self.tp != 0

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "nnodes": self.nnodes, "world": self.world,
                "local": self.local, "tp_split": self.tp_split,
                "nodes": [n.to_dict() for n in self.nodes]}


def _count(value: Any, what: str, key: str) -> int:
    """A whole number from 1 to limits.yaml plan.<key>."""
    return check_int(value, what, lo=1, hi=bound("plan", key))


def _world(tp: Any, pp: Any) -> int:
    """TP x PP, each a parallel size, at most plan.engine_ranks ranks in all."""
    tp, pp = _count(tp, "tensor_parallel_size", "parallel_size"), \
        _count(pp, "pipeline_parallel_size", "parallel_size")
    world, most = tp * pp, bound("plan", "engine_ranks")
    if world > most:
        raise UsageError(f"TP {tp} x PP {pp} = {world} ranks: at most {most}")
    return world


def gang_layout(tp: int, pp: int, nnodes: int) -> GangLayout:
    """The layout; raises UsageError when vLLM could not split TP x PP over nnodes evenly, or
    when a node would hold parts of two stages without holding whole TP groups."""
    world = _world(tp, pp)
    nnodes = _count(nnodes, "nnodes", "nodes")
    if world % nnodes:
        raise UsageError(f"TP {tp} x PP {pp} = {world} ranks do not split evenly over "
                         f"{nnodes} nodes (vLLM gives every node world / nnodes ranks)")
    local = world // nnodes
    if local % tp and tp % local:
        raise UsageError(f"{local} ranks per node with TP {tp}: a node would hold parts of "
                         "two tensor-parallel groups; choose nnodes so that TP divides the "
                         "ranks per node (or the ranks per node divide TP)")
    return GangLayout(tp, pp, nnodes)


def nodes_needed(tp: int, pp: int, workers_per_node: int) -> int:
    """The fewest nodes one engine needs when a node runs at most `workers_per_node` ranks,
    keeping every stage's TP group inside one node (TP inside nodes, PP across them)."""
    world = _world(tp, pp)
    per_node = _count(workers_per_node, "workers per node", "engine_ranks")
    for nnodes in range(1, min(world, bound("plan", "nodes")) + 1):
        local = world // nnodes
        if world % nnodes == 0 and local <= per_node and local % tp == 0:
            return nnodes
    raise UsageError(f"TP {tp} x PP {pp}: a tensor-parallel group of {tp} does not fit nodes "
                     f"of {per_node} workers (give nnodes to split TP across nodes)")


def gang_bundles(layout: GangLayout, per_worker: Mapping[str, float],
                 replica_share: Mapping[str, float]) -> list[dict[str, float]]:
    """The placement-group bundles of one gang: one per node rank (STRICT_SPREAD puts them on
    distinct nodes; one bundle never spans nodes), node rank 0's with the replica's share."""
    bundles = []
    for node in layout.nodes:
        bundle = {k: float(v) * layout.local for k, v in per_worker.items() if v}
        if node.node_rank == 0:
            for key, value in replica_share.items():
                if value:
                    bundle[key] = bundle.get(key, 0.0) + float(value)
        bundles.append(bundle or {"CPU": 0.0})
    return bundles


def pick_port(lo: int, hi: int, taken: Sequence[int] | None = None,
              is_free=None) -> int:
    """The first port of [lo, hi] not in `taken` and free by `is_free(port)` (a bind test on
    the master node); raises UsageError when the range is used up."""
    taken_set = set(taken or ())
    for port in range(lo, hi + 1):
        if port in taken_set:
            continue
        if is_free is None or is_free(port):
            return port
    raise UsageError(f"no free port left in the gang port range {lo}-{hi} on this node "
                     "(ray.vllm_port_min / vllm_port_max in the inventory)")
