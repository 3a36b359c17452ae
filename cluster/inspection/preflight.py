"""Preflight's parts: the probes the checks need, the one gather of them (cluster/inspection/facts.py: one SSH
round trip per node) and the pure judgement of one node's facts. The sequencing (gather, judge,
cross-node checks, reachability) is the playbook playbooks/preflight.py.

run_preflight never raises for a node: an unreachable node or unreadable output is a result
with status error. The report's facts (per node: GPU count/model/memory, NVLink, IB ports,
versions...) feed `cluster up` and `cluster plan`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Sequence

from cluster.inspection.checks.base import NodeCheck, NodeContext, Verdict, judge
from cluster.inspection.checks.node import NODE_CHECKS
from cluster.nodes.inventory import Inventory, Node
from cluster.inspection.facts import RAY_PROBES, NodeFacts, ProbeBuilder, gather, probes_for
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.inspection.probes import Probe
from cluster.nodes.remote import Session
from cluster.base.results import CheckResult, Evidence, Status, tail, to_jsonable
from cluster.nodes.shell import without_heredocs

def node_probes(node: Node, inventory: Inventory, checks: Sequence[NodeCheck]) -> list[Probe]:
    """The probes the checks need on a node (with the facts every run reads), one per name."""
    return probes_for(node, inventory, tuple(RAY_PROBES) + check_probes(checks))


def check_probes(checks: Sequence[NodeCheck]) -> tuple:
    return tuple(build for check in checks for build in check.probes)


def gather_for(inventory: Inventory, session: Session, nodes: Sequence[Node] | None = None,
               checks: Sequence[NodeCheck] = NODE_CHECKS, on_node_done=None,
               more: Sequence[ProbeBuilder] = (), clock: bool = False) -> dict[str, NodeFacts]:
    """The facts the checks (and every later step of the run) read: one round trip per node;
    `more`: probes the run adds to that round trip (the reachability listeners); `clock`: the
    clock samples taken on it too (NodeFacts.clock)."""
    return gather(session, inventory, nodes, tuple(RAY_PROBES) + check_probes(checks)
                  + tuple(more), on_node_done=on_node_done, clock=clock)


def evaluate_node(node: Node, inventory: Inventory, checks: Sequence[NodeCheck],
                  facts: NodeFacts, seen: dict | None = None
                  ) -> tuple[list[CheckResult], NodeFactsSummary]:
    """Pure: one node's facts -> check results and the report's facts (what the checks read).

    `seen`: shared by the nodes of one report, it keeps each distinct evidence once: a node
    whose check shows the very evidence an earlier node's did points to that node instead."""
    if not facts.reached:
        why = facts.error or "unreachable"
        return [CheckResult(c.id, node.name, Status.ERROR, why,
                            Evidence(command=None, exit_code=None, output_tail=why))
                for c in checks], NodeFactsSummary(reachable=False)
    ctx = NodeContext.of(node, inventory, facts)
    results: list[CheckResult] = []
    stated: list[NodeFactsSummary] = []     # each check's facts, merged once at the end
    shown: dict[tuple, str] = {}     # (command, output tail) -> the check whose evidence has it
    names: dict = {}     # probe builder -> the name of its probe on this node (None: none)
    for check in checks:
        verdict = judge(check, ctx)
        stated.append(verdict.facts)
        evidence, data_text = _evidence(ctx, check, verdict, names)
        evidence = _once_per_report(evidence, data_text, check.id, node.name, seen) \
            if seen is not None else evidence
        results.append(CheckResult(check.id, node.name, verdict.status, verdict.summary,
                                   _once_per_node(evidence, check.id, shown), verdict.fix))
    return results, NodeFactsSummary(reachable=True).merged(*stated)


def _once_per_node(evidence: Evidence, check: str, shown: dict[tuple, str]) -> Evidence:
    """The evidence, its output tail replaced by a pointer when an earlier check of the node
    showed the same command's same tail."""
    if not evidence.output_tail or evidence.command is None:
        return evidence
    first = shown.setdefault((evidence.command, evidence.output_tail), check)
    if first == check:
        return evidence
    return replace(evidence, output_tail=f"(as in the {first} check)")


def _once_per_report(evidence: Evidence, data_text: str, check: str, node: str, seen: dict
                     ) -> Evidence:
    """The evidence, or a pointer to the first node whose same check showed the same command,
    exit code, output tail and data (a rack of identical nodes repeats the same outputs);
    data_text: its data as JSON (_data_text)."""
    if evidence.command is None and evidence.data is None:
        return evidence
    key = (check, evidence.command, evidence.exit_code, evidence.output_tail, data_text)
    first = seen.setdefault(key, node)
    if first == node:
        return evidence
    return Evidence(evidence.command, evidence.exit_code,
                    f"(as on {first})")


# Evidence bounds. A verdict that is not ok/skip keeps the end of its output and its parsed
# data; an ok or skip one (its summary says what was read) keeps a few lines and its data only
# while small: the run's nodes/<node>.log holds every output in full.
TAIL_LINES, TAIL_CHARS = 12, 1200
PASSED_TAIL_LINES, PASSED_TAIL_CHARS = 3, 240
PASSED_DATA_CHARS = 1024
_PASSED = (Status.OK, Status.SKIP)


def _data_text(data: object) -> str:
    """Evidence data as JSON, keys sorted: its size and its identity across nodes, encoded once."""
    return json.dumps(to_jsonable(data), sort_keys=True)


def _probe_name(build: ProbeBuilder, ctx: NodeContext, names: dict) -> str | None:
    """The name of the probe `build` makes for the node, built once per node (a node program's
    probe command is costly to build, and several checks list the same builder)."""
    if build not in names:
        probe = build(ctx.node, ctx.inventory)
        names[build] = None if probe is None else probe.name
    return names[build]


def _evidence(ctx: NodeContext, check: NodeCheck, verdict: Verdict, names: dict
              ) -> tuple[Evidence, str]:
    """The check's evidence on the node and its data's _data_text; `names`: _probe_name's, for
    the node."""
    wanted = [verdict.probe] if verdict.probe else \
        [_probe_name(b, ctx, names) for b in check.probes]
    outs = [ctx.outputs[n] for n in wanted if n is not None and n in ctx.outputs]
    passed = verdict.status in _PASSED
    data = verdict.data
    data_text = _data_text(data)
    if passed and data is not None and len(data_text) > PASSED_DATA_CHARS:
        data, data_text = None, _data_text(None)
    if not outs:
        return Evidence(data=data), data_text
    first = outs[0]
    lines, chars = (PASSED_TAIL_LINES, PASSED_TAIL_CHARS) if passed else (TAIL_LINES, TAIL_CHARS)
    # each command's own tail, the bound shared between them (the end of the last output alone
    # hid the others: acs showed ibstat's last lines, not lspci's)
    texts = [o.stdout + o.stderr for o in outs if (o.stdout + o.stderr).strip()]
    share = max(1, len(texts))
    shown = "\n".join(tail(t, lines=max(1, lines // share), chars=chars // share) for t in texts)
    return Evidence(command=" ; ".join(without_heredocs(o.command) for o in outs),
                    exit_code=first.exit_code, output_tail=shown, data=data), data_text
