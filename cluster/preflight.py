"""Preflight's pure parts: the probes each node needs for the chosen checks, and one node's
probe output judged into check results and facts (evaluate_node).

The sequencing (one SSH round trip per node, then cross-node checks, then TCP reachability
between the nodes) is playbooks/preflight.py. An unreachable node or unreadable output is a
result with status error, never an exception. The report's facts (per node: GPU count/model/
memory, NVLink, IB ports, versions...) feed `cluster up` and `cluster plan`.
"""

from __future__ import annotations

from typing import Any, Sequence

from cluster.checks.base import NodeCheck, NodeContext, Verdict
from cluster.errors import ParseError
from cluster.inventory import Inventory, Node
from cluster.probes import Probe, split_probe_output
from cluster.remote import CommandResult
from cluster.results import CheckResult, Evidence, Status, tail

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
