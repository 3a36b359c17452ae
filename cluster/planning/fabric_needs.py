"""`cluster plan`'s fabric needs: which groups of the plan's layout cross nodes, and the bus
bandwidth each kind of group needs, from the model's size and the layout (pure).

    needs = fabric_needs(model_info, plan, cluster_facts)
    needs["groups"] -> [{kind, groups, crossing_nodes, example_nodes, bytes_per_token,
                         needed_busbw_gbps, at_tokens_per_s}]     (per replica: they are alike)

Traffic per token (activations in the checkpoint dtype, vLLM's layer split):
  tp  two all-reduces of the hidden state per layer of the stage (attention and MLP outputs):
      2 x layers/PP x hidden x bytes; as nccl-tests' bus bandwidth: x 2(n-1)/n
  pp  the hidden state and the residual sent to the next stage: 2 x hidden x bytes
  ep  dispatch and combine of each token to its top-k experts per MoE layer of the stage:
      2 x MoE layers/PP x top-k x hidden x bytes (an upper bound: tokens whose expert is local
      stay)
  dp  MoE DP ranks sync a few scalars per step: latency-bound, no bandwidth need
At the plan's capacity estimate per replica (--tokens-per-s-per-gpu), else at the table's
plan_reference_tokens_per_s (cluster/data/fabric.yaml), a stated reference rate.
"""

from __future__ import annotations

import math
from typing import Any

from cluster.base.errors import UsageError
from cluster.planning.fabric_groups import Layout, NodeSlots, layout_groups, rank_slots
from cluster.planning.fabric_thresholds import load_table


def _bytes_per_token(kind: str, info: Any, layout: Layout, ranks: int) -> float:
    act = float(info.dtype_bytes)
    hidden = float(info.hidden_size)
    if kind == "tp":
        layers = math.ceil(info.num_layers / layout.pp)
        return 2.0 * layers * hidden * act * 2.0 * (ranks - 1) / ranks
    if kind == "pp":
        return 2.0 * hidden * act
    if kind == "ep":
        moe_layers = math.ceil((info.num_moe_layers or 0) / layout.pp)
        return 2.0 * moe_layers * max(1, info.experts_per_token) * hidden * act
    return 0.0


def fabric_needs(info: Any, plan: Any, facts: Any) -> dict[str, Any]:
    """The plan's groups by kind, which cross nodes, and the bandwidth they need."""
    ep = bool(plan.enable_expert_parallel)
    nodes = [NodeSlots(n.node, "", n.gpu_count) for n in facts.nodes if n.gpu_count > 0]
    try:
        # one replica's groups stand for all: replicas are alike (the first nodes in order)
        layout = Layout(tp=plan.tensor_parallel_size, pp=plan.pipeline_parallel_size,
                        dp=plan.data_parallel_size if ep else 1, ep=ep, replicas=1)
        groups = layout_groups(layout, rank_slots(layout, nodes))
    except UsageError as exc:
        return {"groups": [], "crossing_kinds": [], "note": f"groups not placed: {exc}"}
    capacity = getattr(plan, "capacity", None)
    if capacity is not None and capacity.tokens_per_s:
        rate, basis = capacity.tokens_per_s / max(1, plan.replicas), "the plan's capacity"
    else:
        rate = load_table().plan_reference_tokens_per_s
        basis = "cluster/data/fabric.yaml plan_reference_tokens_per_s"
    kinds: dict[str, dict[str, Any]] = {}
    for g in groups:
        entry = kinds.setdefault(g.kind, {"kind": g.kind, "groups": 0, "crossing_nodes": 0,
                                          "ranks": len(g.ranks), "example_nodes": []})
        entry["groups"] += 1
        if g.crosses_nodes:
            entry["crossing_nodes"] += 1
            if not entry["example_nodes"]:
                entry["example_nodes"] = list(g.nodes)
        elif not entry["example_nodes"]:
            entry["example_nodes"] = list(g.nodes)
    out = []
    for entry in kinds.values():
        per_token = _bytes_per_token(entry["kind"], info, layout, entry["ranks"])
        out.append(dict(entry, bytes_per_token=round(per_token),
                        needed_busbw_gbps=round(per_token * rate / 1e9, 4),
                        at_tokens_per_s=round(rate, 1)))
    crossing = [e["kind"] for e in out if e["crossing_nodes"]]
    return {"groups": out, "crossing_kinds": crossing, "rate_basis": basis}


def render(needs: dict[str, Any]) -> list[str]:
    """Lines for `cluster plan`'s text output."""
    if not needs.get("groups"):
        return [f"  fabric       {needs.get('note') or 'one rank per engine: no group'}"]
    lines = []
    for e in needs["groups"]:
        where = (f"{e['crossing_nodes']} of {e['groups']} cross nodes "
                 f"({' -> '.join(e['example_nodes'])})" if e["crossing_nodes"]
                 else f"{e['groups']} inside a node")
        lines.append(f"  fabric {e['kind']:<5} {where}; {e['bytes_per_token']:,} B/token -> "
                     f"{e['needed_busbw_gbps']:g} GB/s bus bandwidth at "
                     f"{e['at_tokens_per_s']:g} tokens/s")
    return lines
