"""`cluster preflight` as ordered, read-only steps.

gather (every node's probes in one SSH round trip per node, in parallel) -> judge (pure,
cluster/preflight.evaluate_node: check results and facts per node) -> cross-node checks (the
clocks sampled from here, versions, ...) -> TCP reachability between the reachable nodes on
Ray's ports (cluster/reachability.py). Read-only: no plan, no dry run, nothing to confirm.

Nothing is printed: the caller gets the Report and an `on_node_done` callback per node gathered.
Never raises for a node: an unreachable node or unreadable output is a result with status error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from cluster.checks.base import NodeCheck
from cluster.checks.cross import cross_node_checks, measure_skew
from cluster.checks.node import NODE_CHECKS
from cluster.inventory import Inventory, Node
from cluster.preflight import PER_PROBE_TIMEOUT_S, evaluate_node, node_probes
from cluster.probes import probe_script
from cluster.reachability import run_reachability
from cluster.results import CheckResult, Report


@dataclass(frozen=True)
class PreflightOptions:
    nodes: tuple[Node, ...] = ()                 # () : every inventory node
    checks: tuple[NodeCheck, ...] = NODE_CHECKS
    measure_clock: bool = True
    reachability: bool = True


def run(inventory: Inventory, session, options: PreflightOptions = PreflightOptions(),
        on_node_done: Callable[..., None] | None = None) -> Report:
    return run_preflight(inventory, session, options.nodes or None, options.checks,
                         options.measure_clock, on_node_done, options.reachability)


def run_preflight(inventory: Inventory, session, nodes: Sequence[Node] | None = None,
                  checks: Sequence[NodeCheck] = NODE_CHECKS, measure_clock: bool = True,
                  on_node_done=None, reachability: bool = True) -> Report:
    nodes = list(nodes or inventory.nodes)
    probes = {n.name: node_probes(n, inventory, checks) for n in nodes}
    per_node_timeout = PER_PROBE_TIMEOUT_S * 2 + 30
    raw = session.fan_out(nodes, lambda n: probe_script(probes[n.name], PER_PROBE_TIMEOUT_S),
                          timeout=per_node_timeout, on_result=on_node_done)
    results: list[CheckResult] = []
    facts: dict[str, dict] = {}
    for node, res in zip(nodes, raw):
        node_results, node_facts = evaluate_node(node, inventory, checks, res, probes[node.name])
        results += node_results
        facts[node.name] = node_facts
    reachable = [n for n in nodes if facts[n.name].get("reachable")]
    skew = measure_skew(session, reachable) if measure_clock and len(reachable) > 1 else None
    cluster_facts = {n: f for n, f in facts.items() if f.get("reachable")}
    results += cross_node_checks(cluster_facts, inventory, skew)
    if reachability and len(reachable) > 1:
        results += run_reachability(inventory, session, reachable)
    return Report("preflight", tuple(results), {"nodes": facts})
