"""The `vllm serve` command line of each node of a plan's engine, ready to paste (pure).

An engine within one node is one line: `vllm serve MODEL` + the plan's engine args. An engine
over several nodes (cluster/planning/gang.py) needs per-node flags, the ones vLLM's own
multi-node guides use, built by gang.node_engine_kwargs:

    TP/PP over nodes:  --nnodes N --node-rank R --master-addr A --master-port P
                       (node rank > 0 also --headless)
    MoE DP over nodes: --data-parallel-size D --data-parallel-size-local L
                       --data-parallel-address A --data-parallel-rpc-port P --enable-expert-parallel
                       (node rank > 0 also --headless --data-parallel-start-rank R*L; node 0 has
                       no start rank: with one vLLM switches to hybrid load balancing)

A is the replica's first node's address (the inventory's node_ip, else its address; the node's
name without an inventory), P from cluster/data/planner.yaml node_commands (vLLM's defaults).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from cluster.base.errors import UsageError
from cluster.planning.gang import gang_layout, node_engine_kwargs
from cluster.planning.planner import Plan, planner_defaults

NOT_ON_THE_LINE = ("model",)     # the model is vllm serve's positional argument


@dataclass(frozen=True)
class NodeCommand:
    """One node's `vllm serve` line of one replica."""

    replica: int
    node: str
    node_rank: int
    argv: tuple[str, ...]
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def to_dict(self) -> dict[str, Any]:
        return {"replica": self.replica, "node": self.node, "node_rank": self.node_rank,
                "argv": list(self.argv), "command": self.command}


def flags(engine_args: Mapping[str, Any]) -> list[str]:
    """vLLM command-line flags of engine args (a false switch and None are left out: vLLM's
    defaults)."""
    out: list[str] = []
    for key, value in engine_args.items():
        if key in NOT_ON_THE_LINE or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def _argv(model: str, kwargs: Mapping[str, Any], headless: bool) -> tuple[str, ...]:
    return ("vllm", "serve", model, *(["--headless"] if headless else []), *flags(kwargs))


def node_commands(plan: Plan, addresses: Mapping[str, str] | None = None) -> tuple[NodeCommand, ...]:
    """Every node's line, replica by replica; one node per replica: one line per replica's
    node. `addresses`: node name -> the address other nodes reach it at."""
    addresses = addresses or {}
    model = str(plan.engine_args.get("model") or plan.model_path or plan.model_name)
    if model.endswith("/config.json"):
        model = model[:-len("/config.json")]         # vLLM serves the directory
    ports = planner_defaults()["node_commands"]
    place = plan.placement
    out: list[NodeCommand] = []
    for i, replica in enumerate(place.replica_nodes, start=1):
        nodes = [node for node, _ in replica]
        if len(nodes) == 1:
            out.append(NodeCommand(i, nodes[0], 0, _argv(model, plan.engine_args, False),
                                   dict(plan.engine_args)))
            continue
        layout = _gang(plan, len(nodes))
        if layout is None:
            continue
        address = addresses.get(nodes[0], nodes[0])
        port = int(ports["data_parallel_rpc_port"] if layout.moe_dp else ports["master_port"])
        for rank, node in enumerate(nodes):
            kwargs = node_engine_kwargs(layout, plan.engine_args, rank, address, port)
            out.append(NodeCommand(i, node, rank, _argv(model, kwargs, rank > 0), kwargs))
    return tuple(out)


def _gang(plan: Plan, nnodes: int):
    """The gang layout of a replica over nnodes, None where vLLM's native multi-node mode
    cannot split it (the Ray executor places those workers: no per-node line)."""
    place = plan.placement
    try:
        return gang_layout(place.tp, place.pp, nnodes, place.dp if place.expert_parallel else 1)
    except UsageError:
        return None


def render(commands: Sequence[NodeCommand]) -> list[str]:
    """The lines for a terminal: replica 1's node lines in full, the other replicas folded into
    one line (the same with their own nodes and first node's address)."""
    if not commands:
        return []
    first = [c for c in commands if c.replica == 1]
    lines = [f"  vllm serve   {c.node} (node rank {c.node_rank}): {c.command}" for c in first]
    if len(first) == 1:
        lines = [f"  vllm serve   {first[0].command}"]
    rest = sorted({c.replica for c in commands} - {1})
    if rest:
        lines.append(f"               replicas {rest[0]}..{rest[-1]}: the same on their own nodes"
                     + (" (their first node's address)" if len(first) > 1 else "")
                     + "; --json lists every line")
    return lines
