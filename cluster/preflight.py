"""Preflight's parts: the probes the checks need, the one gather of them (cluster/facts.py: one SSH
round trip per node) and the pure judgement of one node's facts. The sequencing (gather, judge,
cross-node checks, reachability) is the playbook playbooks/preflight.py.

run_preflight never raises for a node: an unreachable node or unreadable output is a result
with status error. The report's facts (per node: GPU count/model/memory, NVLink, IB ports,
versions...) feed `cluster up` and `cluster plan`.
"""

from __future__ import annotations

from typing import Any, Sequence

from cluster.checks.base import NodeCheck, NodeContext, Verdict
from cluster.checks.node import NODE_CHECKS
from cluster.errors import ParseError
from cluster.inventory import Inventory, Node
from cluster.facts import RAY_PROBES, NodeFacts, gather, probes_for
from cluster.probes import Probe
from cluster.remote import Session
from cluster.results import CheckResult, Evidence, Status, tail

def node_probes(node: Node, inventory: Inventory, checks: Sequence[NodeCheck]) -> list[Probe]:
    """The probes the checks need on a node (with the facts every run reads), one per name."""
    return probes_for(node, inventory, tuple(RAY_PROBES) + check_probes(checks))


def check_probes(checks: Sequence[NodeCheck]) -> tuple:
    return tuple(build for check in checks for build in check.probes)


def gather_for(inventory: Inventory, session: Session, nodes: Sequence[Node] | None = None,
               checks: Sequence[NodeCheck] = NODE_CHECKS, on_node_done=None) -> dict[str, NodeFacts]:
    """The facts the checks (and every later step of the run) read: one round trip per node."""
    return gather(session, inventory, nodes, tuple(RAY_PROBES) + check_probes(checks),
                  on_node_done=on_node_done)


def evaluate_node(node: Node, inventory: Inventory, checks: Sequence[NodeCheck],
                  facts: NodeFacts) -> tuple[list[CheckResult], dict]:
    """Pure: one node's facts -> check results and the report's facts."""
    if not facts.reached:
        why = facts.error or "unreachable"
        return [CheckResult(c.id, node.name, Status.ERROR, why,
                            Evidence(command=None, exit_code=None, output_tail=why))
                for c in checks], {"reachable": False}
    ctx = NodeContext(node, inventory, facts.outputs, facts)
    results: list[CheckResult] = []
    report_facts: dict[str, Any] = {"reachable": True}
    for check in checks:
        verdict = _judge(check, ctx)
        report_facts.update(verdict.facts)
        results.append(CheckResult(check.id, node.name, verdict.status, verdict.summary,
                                   _evidence(ctx, check, verdict), verdict.fix))
    return results, report_facts


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
