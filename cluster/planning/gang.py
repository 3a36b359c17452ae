"""One engine across nodes (a gang): which global vLLM ranks run on which node rank (pure).

vLLM's native multi-node mode (the mp executor with nnodes / node_rank / master_addr /
master_port; node ranks > 0 headless) gives node rank n the global ranks
[n * local, (n + 1) * local), local = world / nnodes, and global rank r is pipeline stage
r // tp, tensor rank r % tp. So with local a multiple of tp every stage's TP group sits inside
one node; with local < tp (e.g. TP 2 with one rank per node) the TP group spans nodes.

MoE (dp > 1: data-parallel attention + expert parallel) runs vLLM's multi-node DP layout
instead: one engine launch per node holding `dp_local` = local / (tp * pp) whole DP ranks;
node 0 (the replica) with data_parallel_size / data_parallel_size_local /
data_parallel_address / data_parallel_rpc_port, node n headless with
data_parallel_start_rank = n * dp_local (`node_engine_kwargs`). Global rank
d * (pp * tp) + p * tp + t, so node n again holds [n * local, (n + 1) * local).

    layout = gang_layout(tp=1, pp=2, nnodes=2)
    layout.nodes[1].ranks        -> (1,)       node rank 1 holds global rank 1 (stage 1)
    layout.nodes[1].stages       -> (1,)
    layout.tp_split              -> False      each stage's TP group inside one node
    nodes_needed(tp=2, pp=2, workers_per_node=2) -> 2
    moe = gang_layout(tp=1, pp=1, nnodes=2, dp=16)
    moe.dp_local, moe.nodes[1].dp_ranks          -> 8, (8, ..., 15)

`nodes_needed` is the one rule for how many nodes a layout takes: the serving app
(serve_apps/, through cluster/serving/deploy.py) and the fabric proof (cluster/planning/fabric_groups.py) both
use it. This module never imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.base.bounds import bound, check_int
from cluster.base.errors import UsageError
from cluster.base.results import Record

RANK_NAMESPACE = "cluster-gang"     # the Ray namespace of the rank actors (node ranks > 0)


def rank_actor_name(app: str, replica_id: str, rank: int) -> str:
    """The Ray name of a replica's node rank `rank` actor (serve_apps names it so; `cluster
    status` and the rollouts find it by it)."""
    return f"{app}/{replica_id}/rank{rank}"


@dataclass(frozen=True)
class NodeRank(Record):
    """One node of a gang: its node rank and the global vLLM ranks it runs."""

    node_rank: int
    ranks: tuple[int, ...]
    stages: tuple[int, ...]          # pipeline stages with a rank here
    tp_ranks: tuple[int, ...]        # tensor-parallel ranks here (per rank, same order)
    dp_ranks: tuple[int, ...] = (0,)  # MoE: the data-parallel ranks (engine cores) here


@dataclass(frozen=True)
class GangLayout:
    """DP x TP x PP of one engine over `nnodes` nodes, `local` ranks on each (dp > 1: MoE)."""

    tp: int
    pp: int
    nnodes: int
    dp: int = 1

    @property
    def moe_dp(self) -> bool:
        """True for vLLM's MoE data-parallel layout (DP engine cores, EP across them)."""
        return self.dp > 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def local(self) -> int:
        return self.world // self.nnodes

    @property
    def dp_local(self) -> int:
        """DP ranks per node (vLLM's data_parallel_size_local); 1 for a dense engine."""
        return self.local // (self.tp * self.pp) if self.moe_dp else 1

    @property
    def nodes(self) -> tuple[NodeRank, ...]:
        out = []
        per_dp = self.tp * self.pp
        for n in range(self.nnodes):
            ranks = tuple(range(n * self.local, (n + 1) * self.local))
            out.append(NodeRank(n, ranks, tuple(sorted({r % per_dp // self.tp for r in ranks})),
                                tuple(r % self.tp for r in ranks),
                                tuple(sorted({r // per_dp for r in ranks}))))
        return tuple(out)

    @property
    def tp_split(self) -> bool:
        """True when a stage's TP group spans nodes (all-reduce crosses the network)."""
        return self.local % self.tp != 0

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "nnodes": self.nnodes,
                "world": self.world, "local": self.local, "dp_local": self.dp_local,
                "tp_split": self.tp_split, "nodes": [n.to_dict() for n in self.nodes]}


def _count(value: Any, what: str, key: str) -> int:
    """A whole number from 1 to limits.yaml plan.<key>."""
    return check_int(value, what, lo=1, hi=bound("plan", key))


def _layout_name(tp: int, pp: int, dp: int) -> str:
    return f"DP {dp} x TP {tp} x PP {pp}" if dp > 1 else f"TP {tp} x PP {pp}"


def _world(tp: Any, pp: Any, dp: Any = 1) -> int:
    """DP x TP x PP, each a parallel size, at most plan.engine_ranks ranks in all."""
    tp, pp = _count(tp, "tensor_parallel_size", "parallel_size"), \
        _count(pp, "pipeline_parallel_size", "parallel_size")
    dp = _count(dp, "data_parallel_size", "parallel_size")
    world, most = dp * tp * pp, bound("plan", "engine_ranks")
    if world > most:
        raise UsageError(f"{_layout_name(tp, pp, dp)} = {world} ranks: at most {most}")
    return world


def gang_layout(tp: int, pp: int, nnodes: int, dp: int = 1) -> GangLayout:
    """The layout; raises UsageError when vLLM could not split DP x TP x PP over nnodes
    evenly, when a node would hold parts of two stages without holding whole TP groups, or
    (MoE, dp > 1) when a node would not hold whole DP ranks."""
    world = _world(tp, pp, dp)
    nnodes = _count(nnodes, "nnodes", "nodes")
    name = _layout_name(tp, pp, dp)
    if world % nnodes:
        raise UsageError(f"{name} = {world} ranks do not split evenly over "
                         f"{nnodes} nodes (vLLM gives every node world / nnodes ranks)")
    local = world // nnodes
    if dp > 1 and local % (tp * pp):
        raise UsageError(f"{name} over {nnodes} nodes: {local} ranks per node do not hold whole "
                         f"data-parallel ranks of TP x PP = {tp * pp} (vLLM's multi-node DP "
                         "runs whole DP ranks per node: data_parallel_size_local)")
    if local % tp and tp % local:
        raise UsageError(f"{local} ranks per node with TP {tp}: a node would hold parts of "
                         "two tensor-parallel groups; choose nnodes so that TP divides the "
                         "ranks per node (or the ranks per node divide TP)")
    return GangLayout(tp, pp, nnodes, dp)


def nodes_needed(tp: int, pp: int, workers_per_node: int, dp: int = 1) -> int:
    """The fewest nodes one engine (DP x TP x PP ranks; dp > 1 is MoE) takes when a node runs
    at most `workers_per_node` ranks: the first node count `gang_layout` accepts, preferring
    every stage's TP group inside one node (TP inside nodes, PP across them) and, when a TP
    group is larger than a node, whole nodes per TP group. The one rule of the serving app
    (through cluster/serving/deploy.py) and the fabric proof (cluster/planning/fabric_groups.py)."""
    per_node = _count(workers_per_node, "workers per node", "engine_ranks")
    world = _world(tp, pp, dp)
    counts = [n for n in range(1, min(world, bound("plan", "nodes")) + 1)
              if world % n == 0 and world // n <= per_node]
    for inside in (True, False):
        for nnodes in counts:
            local = world // nnodes
            if (local % tp == 0) != inside:
                continue
            try:
                gang_layout(tp, pp, nnodes, dp)
            except UsageError:
                continue
            return nnodes
    raise UsageError(f"{_layout_name(tp, pp, dp)}: does not fit nodes of {per_node} workers (no node count "
                     "splits it into whole tensor-parallel groups"
                     + (" and whole data-parallel ranks" if dp > 1 else "") + " per node)")


def node_engine_kwargs(layout: GangLayout, engine_kwargs: Mapping[str, Any], node_rank: int,
                       address: str, port: int) -> dict[str, Any]:
    """The vLLM engine kwargs of node rank `node_rank` (node rank > 0 runs headless):

    dense: nnodes, node_rank, master_addr = address, master_port = port (torch.distributed).
    MoE DP: data_parallel_size, data_parallel_size_local, data_parallel_address = address,
    data_parallel_rpc_port = port, enable_expert_parallel; node rank > 0 also
    data_parallel_start_rank = node_rank * dp_local. Node 0 gets no start rank: in vLLM a
    start rank on a non-headless launch switches it to hybrid load balancing, where its API
    serves only its own node's DP ranks (vllm/engine/arg_utils.py create_engine_config);
    without it vLLM infers rank 0 and serves every DP rank, remote ones included. `nnodes`
    is left out: it is the app's node count, not vLLM's (vLLM's DP layout runs with nnodes 1).
    """
    if not 0 <= node_rank < layout.nnodes:
        raise UsageError(f"node rank {node_rank}: the layout has {layout.nnodes} nodes")
    kwargs = dict(engine_kwargs)
    if not layout.moe_dp:
        kwargs.update(nnodes=layout.nnodes, node_rank=node_rank, master_addr=address,
                      master_port=port)
        return kwargs
    kwargs.pop("nnodes", None)
    kwargs.update(data_parallel_size=layout.dp, data_parallel_size_local=layout.dp_local,
                  data_parallel_address=address, data_parallel_rpc_port=port,
                  enable_expert_parallel=True)
    if node_rank > 0:
        kwargs["data_parallel_start_rank"] = node_rank * layout.dp_local
    return kwargs


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
