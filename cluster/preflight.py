"""Preflight: run every node check in parallel (one SSH round trip per node), then cross-node
checks, then TCP reachability between the nodes (three short fan-outs, cluster/reachability.py).

run_preflight never raises for a node: an unreachable node or unreadable output is a result
with status error. The report's facts (per node: GPU count/model/memory, NVLink, IB ports,
versions...) feed `cluster up` and `cluster plan`.
"""

from __future__ import annotations

from typing import Any, Sequence

from cluster.checks.base import NodeCheck, NodeContext, Verdict
from cluster.checks.cross import cross_node_checks, measure_skew
from cluster.checks.node import NODE_CHECKS
from cluster.errors import ParseError
from cluster.inventory import Inventory, Node
from cluster.probes import Probe, probe_script, split_probe_output
from cluster.reachability import run_reachability
from cluster.remote import CommandResult, Session
from cluster.results import CheckResult, Evidence, Report, Status, tail

PER_PROBE_TIMEOUT_S = 20


def node_probes(node: Node, inventory: Inventory, checks: Sequence[NodeCheck]) -> list[Probe]:
    probes: dict[str, Probe] = {}
    for check in checks:
        for build in check.probes:
            probe = build(node, inventory)
            if probe is not None:
                probes.setdefault(probe.name, probe)
    return list(probes.values())


def evaluate_node(node: Node, inventory: Inventory, checks: Sequence[NodeCheck],
                  result: CommandResult, probes: Sequence[Probe]) -> tuple[list[CheckResult], dict]:
    """Pure: one node's probe output -> check results and facts."""
    if not result.reached:
        why = result.error or result.status
        return [CheckResult(c.id, node.name, Status.ERROR, f"{result.status}: {why}",
                            Evidence(command=None, exit_code=None, output_tail=why))
                for c in checks], {"reachable": False}
    outputs = split_probe_output(result.stdout, probes)
    ctx = NodeContext(node, inventory, outputs)
    results: list[CheckResult] = []
    facts: dict[str, Any] = {"reachable": True}
    for check in checks:
        verdict = _judge(check, ctx)
        facts.update(verdict.facts)
        results.append(CheckResult(check.id, node.name, verdict.status, verdict.summary,
                                   _evidence(ctx, check, verdict), verdict.fix))
    return results, facts


def _judge(check: NodeCheck, ctx: NodeContext) -> Verdict:
    try:
        return check.evaluate(ctx)
    except ParseError as exc:
        return Verdict(Status.ERROR, f"could not read the output: {exc}")


def _evidence(ctx: NodeContext, check: NodeCheck, verdict: Verdict) -> Evidence:
    names = [verdict.probe] if verdict.probe else \
        [p.name for b in check.probes if (p := b(ctx.node, ctx.inventory)) is not None]
    outs = [ctx.outputs[n] for n in names if n in ctx.outputs]
    if not outs:
        return Evidence(data=verdict.data)
    first = outs[0]
    text = "".join(o.stdout + o.stderr for o in outs)
    return Evidence(command=" ; ".join(o.command for o in outs), exit_code=first.exit_code,
                    output_tail=tail(text, lines=15, chars=1500), data=verdict.data)


def run_preflight(inventory: Inventory, session: Session, nodes: Sequence[Node] | None = None,
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
