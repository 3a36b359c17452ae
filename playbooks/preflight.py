"""`cluster preflight` as ordered, read-only steps.

gather (the facts layer: every node's probes in one SSH round trip per node, in parallel; or the
run's facts handed in, as `cluster up` does) -> judge (pure, cluster/inspection/preflight.evaluate_node) ->
cross-node checks (clocks sampled from here on the gather's channels, versions, drivers, MTU, model) -> TCP reachability
between the reachable nodes (cluster/inspection/reachability.py). Read-only: no plan, no dry run, nothing
to confirm. Nothing is printed: the caller gets a PreflightOutcome (the Report: `to_dict()`,
`exit_code`) and a NodeDone event per node gathered. Never raises for a node: an unreachable
node or unreadable output is a result with status error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from cluster.inspection.checks.base import NodeCheck
from cluster.inspection.checks.cross import cross_node_checks
from cluster.inspection.clock import ClockSample, measure_skew
from cluster.inspection.checks.node import NODE_CHECKS
from cluster.inspection.facts import NodeFacts
from cluster.inspection.node_summary import NodeFactsSummary, PreflightFacts
from cluster.nodes.inventory import Inventory, Node
from cluster.inspection.preflight import evaluate_node, gather_for
from cluster.inspection.reachability import (Listeners, gathered_listen_docs, plan_listeners,
                                              run_reachability, started, stop_listeners)
from cluster.nodes.remote import Session
from cluster.base.results import CheckResult, Report
from playbooks.outcome import Confirm, NodeDone, OnEvent, Outcome, ignore, never_confirm


@dataclass(frozen=True)
class PreflightOptions:
    nodes: tuple[Node, ...] = ()                 # (): every inventory node
    checks: tuple[NodeCheck, ...] = NODE_CHECKS
    measure_clock: bool = True
    reachability: bool = True
    facts: Mapping[str, NodeFacts] | None = None  # the run's facts when gathered already (up)
    listeners: Listeners | None = None            # started in that gather (gather_with_listeners)


@dataclass(frozen=True)
class PreflightOutcome(Outcome):
    report: Report
    stopped = None

    @property
    def exit_code(self) -> int:
        return self.report.exit_code

    def to_dict(self) -> dict:
        return self.report.to_dict()


def run(inventory: Inventory, session: Session, options: PreflightOptions = PreflightOptions(),
        confirm: Confirm = never_confirm, on_event: OnEvent = ignore) -> PreflightOutcome:
    """Read-only: confirm is never asked; on_event gets a NodeDone per node gathered."""
    return PreflightOutcome(run_preflight(
        inventory, session, options.nodes or None, options.checks, options.measure_clock,
        lambda result: on_event(NodeDone(result)), options.reachability, options.facts,
        options.listeners))


def gather_with_listeners(inventory: Inventory, session: Session, nodes: Sequence[Node],
                          checks: Sequence[NodeCheck] = NODE_CHECKS, on_node_done=None,
                          reachability: bool = True, measure_clock: bool = True
                          ) -> tuple[dict[str, NodeFacts], Listeners | None]:
    """The preflight's gather: the facts, and the reachability listeners started in it (after
    its other probes: no command of their own) when there are peers to probe, and the clock
    samples taken on its channels (no command of their own either) when there is a skew to
    measure. `cluster up` gathers so too and hands both to run_preflight, which stops what is
    left of the listeners."""
    listeners = plan_listeners(inventory, session, nodes) \
        if reachability and len(nodes) > 1 else None
    try:
        facts = gather_for(inventory, session, nodes, checks, on_node_done,
                           (listeners.probe,) if listeners else (),
                           clock=measure_clock and len(nodes) > 1)
    except BaseException:
        if listeners:    # which ones started is not known: every node that may have one
            _stop_after_error(session, nodes, listeners, set(listeners.served))
        raise
    return facts, listeners


def _stop_after_error(session: Session, nodes: Sequence[Node], listeners: Listeners,
                      names: set[str]) -> None:
    """stop_listeners while an error ends the run: a listener left holds Ray's ports on its
    node for its whole lifetime (minutes), so the next `cluster up` fails there. A failure of
    the stop itself does not replace the run's error."""
    try:
        stop_listeners(session, nodes, listeners.tag, names)
    except Exception:  # noqa: BLE001 - the run's own error is the one raised
        pass


def clock_samples(session: Session, nodes: Sequence[Node],
                  facts: Mapping[str, NodeFacts]) -> dict[str, ClockSample]:
    """Each node's clock sample: the one its gather took, else one measured now (facts
    gathered without samples, a node whose gather conversation gave no answer)."""
    samples = {n.name: facts[n.name].clock for n in nodes if facts[n.name].clock is not None
               and facts[n.name].clock.offset_s is not None}
    missing = [n for n in nodes if n.name not in samples]
    if missing:
        samples |= measure_skew(session, missing)
    return {n.name: samples[n.name] for n in nodes}


def run_preflight(inventory: Inventory, session: Session, nodes: Sequence[Node] | None = None,
                  checks: Sequence[NodeCheck] = NODE_CHECKS, measure_clock: bool = True,
                  on_node_done=None, reachability: bool = True,
                  facts: Mapping[str, NodeFacts] | None = None,
                  listeners: Listeners | None = None) -> Report:
    """Every check on every node, then the cross-node checks and the reachability matrix.

    `facts`: the run's facts when the caller gathered them already (`cluster up` gathers once
    for the preflight and its plan, with `listeners` started in that gather when it used
    gather_with_listeners); otherwise they are gathered here, the listeners with them."""
    nodes = list(nodes or inventory.nodes)
    if facts is None:
        facts, listeners = gather_with_listeners(inventory, session, nodes, checks,
                                                 on_node_done, reachability, measure_clock)
    elif reachability and listeners is None and len(nodes) > 1:
        raise ValueError("reachability needs the listeners its gather started: gather the "
                         "facts with gather_with_listeners")
    listen_docs = gathered_listen_docs(facts, nodes) if listeners else None
    try:
        results: list[CheckResult] = []
        report_facts: dict[str, NodeFactsSummary] = {}
        seen: dict = {}      # each distinct evidence once per report
        for node in nodes:
            node_results, node_report = evaluate_node(node, inventory, checks,
                                                      facts[node.name], seen)
            results += node_results
            report_facts[node.name] = node_report
        reachable = [n for n in nodes if report_facts[n.name].reachable]
        skew = clock_samples(session, reachable, facts) if measure_clock and len(reachable) > 1 \
            else None
        cluster_facts = {n: f for n, f in report_facts.items() if f.reachable}
        results += cross_node_checks(cluster_facts, inventory, skew)
    except BaseException:
        if listeners:
            _stop_after_error(session, nodes, listeners, started(listen_docs))
        raise
    if reachability and len(reachable) > 1:
        results += run_reachability(inventory, session, reachable, listeners, listen_docs)
    elif listeners:
        stop_listeners(session, nodes, listeners.tag, started(listen_docs))
    return Report("preflight", tuple(results), PreflightFacts(report_facts))
