"""`cluster nccl-check` as ordered steps.

options (backend, size, iterations, timeout, the nodes) -> gather (the facts layer: the
infiniband check's facts of every node, for the expected bandwidth; or those of a preflight
report the caller hands in) -> plan (pure, cluster/ray/nccl_check.py: the
job's head command) -> execute (submit the all-reduce as a Ray job on the head, wait for it
within the timeout) -> verify (judge: transport, GDR, bus bandwidth against the expected one,
every node's ranks present). Read-only on the nodes: no dry run, nothing to confirm.

`run_proof` is the same job over a deployment's layout (the fabric proof, cluster/planning/fabric_proof.py):
one all-reduce per group on the group's nodes and ports, judged per group.

Nothing is printed: the caller gets an NcclOutcome (the judged result, the job's output) and
an `on_event` callback for progress lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from cluster.ray import nccl_check
from cluster.base.bounds import bound
from cluster.inspection.node_summary import PreflightFacts
from cluster.nodes.inventory import Inventory, Node
from cluster.ray.nccl_check import CheckOptions, JobOutcome, NcclCheckResult
from cluster.node_programs import run_call
from cluster.nodes.remote import Session
from playbooks.outcome import Confirm, OnEvent, Outcome, ignore, lines_to, never_confirm


@dataclass(frozen=True)
class NcclOptions:
    check: CheckOptions
    nodes: tuple[Node, ...] = ()             # () : every inventory node
    preflight_facts: PreflightFacts | None = None    # a report's (None: gather them)
    submission_id: str | None = None
    facts_from_report: bool = False          # a report was handed in, even one without facts


@dataclass(frozen=True)
class NcclOutcome(Outcome):
    result: NcclCheckResult
    job: JobOutcome
    command_result: Any                      # the head command's CommandResult
    stopped = None

    @property
    def exit_code(self) -> int:
        return self.result.exit_code

    def to_dict(self) -> dict[str, Any]:
        return self.result.to_dict()


def ib_facts(inventory: Inventory, session: Session, nodes: Sequence[Node]) -> PreflightFacts:
    """Each node's infiniband check's facts (ib_ports), judged on the facts layer's gather (one
    round trip per node), typed as a preflight report's facts."""
    from cluster.inspection.checks.node import NODE_CHECKS
    from cluster.inspection.preflight import evaluate_node, gather_for

    checks = [c for c in NODE_CHECKS if c.id == "infiniband"]
    gathered = gather_for(inventory, session, nodes, checks)
    return PreflightFacts({n.name: evaluate_node(n, inventory, checks, gathered[n.name])[1]
                           for n in nodes})


def announce(options: NcclOptions, inventory: Inventory) -> str:
    """The line saying what is about to run."""
    c = options.check
    nodes = options.nodes or inventory.nodes
    return (f"{c.backend} all-reduce of {c.size:g} MiB x {c.iterations} over {len(nodes)} "
            f"node(s) as a Ray job on {inventory.head.name} (timeout {c.timeout_s:g} s)")


def run(inventory: Inventory, session: Session, options: NcclOptions, confirm: Confirm = never_confirm,
        on_event: OnEvent = ignore) -> NcclOutcome:
    """Submit the job on the head, wait for it, judge it (read-only: confirm is never asked)."""
    from cluster.nodes.endpoints import dashboard_url

    say = lines_to(on_event)

    check = options.check
    nodes: Sequence[Node] = list(options.nodes or inventory.nodes)
    sid = options.submission_id or nccl_check.new_submission_id(check.backend)
    call = nccl_check.head_call(inventory, check, nodes, sid)
    facts = options.preflight_facts
    if facts is None and not options.facts_from_report:
        say("gathering the nodes' InfiniBand facts")
        facts = ib_facts(inventory, session, nodes)
    say(announce(options, inventory))
    started = time.monotonic()
    result = run_call(session, inventory.head, call,
                      timeout=check.timeout_s + nccl_check.SSH_MARGIN_S)
    job = nccl_check.outcome_of(result, inventory.head.name, sid)
    ranked = nccl_check.nodes_with_ranks(job, [n.name for n in nodes])
    expected = nccl_check.expected_bandwidth(facts, ranked)
    judged = nccl_check.judge(check, job, expected, dashboard_url(inventory))
    timings = dict(judged.timings, total=round(time.monotonic() - started, 2))
    return NcclOutcome(replace(judged, timings=timings), job, result)


@dataclass(frozen=True)
class ProofOptions:
    plan: Any                                 # cluster.planning.fabric_proof.ProofPlan
    gpu_models: Mapping[str, Any] | None = None
    submission_id: str | None = None


@dataclass(frozen=True)
class ProofOutcome(Outcome):
    proof: Any                                # cluster.planning.fabric_proof.FabricProof
    job: JobOutcome
    command_result: Any
    stopped = None

    @property
    def exit_code(self) -> int:
        return {"ok": 0, "warn": 1}.get(self.proof.status.value, 2)

    def to_dict(self) -> dict[str, Any]:
        return {"fabric_proof": self.proof.to_dict()}


def run_proof(inventory: Inventory, session: Session, options: ProofOptions,
              confirm: Confirm = never_confirm, on_event: OnEvent = ignore) -> ProofOutcome:
    """Submit the layout's groups as one nccl-check job on the head, wait, judge each group
    (read-only: confirm is never asked)."""
    from cluster.planning import fabric_proof

    plan, gpu_models, say = options.plan, options.gpu_models, lines_to(on_event)

    check = CheckOptions(backend=plan.backend, size_mb=plan.size_mb, iters=plan.iters,
                         warmup=fabric_proof.WARMUP,
                         timeout_s=max(bound("nccl_check", "timeout_s_min"), plan.timeout_s))
    names = list(dict.fromkeys(s.node for s in plan.slots))
    nodes = [inventory.node(n) for n in names]
    facts = None
    if plan.backend == "nccl" and any(g.crosses_nodes for g in plan.groups):
        say("gathering the nodes' InfiniBand facts")
        facts = ib_facts(inventory, session, nodes)
    sid = options.submission_id or nccl_check.new_submission_id(f"proof-{plan.backend}")
    call = nccl_check.head_call(inventory, check, nodes, sid, args=fabric_proof.job_args(plan))
    say(f"fabric proof: {plan.backend} all-reduce on {len(plan.groups)} group(s) of the "
             f"layout over {len(nodes)} node(s), ports {plan.port_range[0]}-{plan.port_range[1]}"
             f" (timeout {check.timeout_s:g} s)")
    result = run_call(session, inventory.head, call,
                      timeout=check.timeout_s + nccl_check.SSH_MARGIN_S)
    job = nccl_check.outcome_of(result, inventory.head.name, sid)
    ctx = fabric_proof.Context.of(inventory, gpu_models, facts)
    return ProofOutcome(fabric_proof.judge_proof(plan, job, ctx), job, result)
