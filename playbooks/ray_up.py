"""`cluster up` as ordered, idempotent steps.

gather facts once (read-only, cluster/inspection/facts.py: one round trip per node, with the preflight's
probes unless it is skipped) -> preflight verdicts on those facts -> the head's view of Ray
(read-only) -> plan (pure) -> [dry run stops here] -> confirm restarts ->
execute (stops, then the head and the workers) -> wait until every node is alive with its
GPUs/CPUs -> status -> with `ray.metrics: prometheus`, the head's Prometheus (probe, plan,
start or keep, verify: playbooks/prometheus_head.py) and Ray's Grafana dashboards.

A step reports per node in Ansible's words: ok (nothing to do), changed (ran and succeeded),
failed, skipped, unreachable. Nothing is printed here: the caller gets an UpOutcome and an
`on_event` callback for typed progress events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from cluster.ray import ray_cluster
from cluster.ray.prometheus_head import enabled as prometheus_enabled
from cluster.nodes.inventory import Inventory
from cluster.ray.ray_cluster import (CHANGED, FAILED, SKIPPED, UNREACHABLE, NodeFacts,
                                 RayActionPlan, StepResult, WaitResult)
from cluster.ray.ray_state import RayState, cluster_status, query_state
from cluster.base.results import Report
from cluster.nodes.remote import Session
from playbooks.outcome import Confirm, OnEvent, Outcome, ignore, lines_to, step_exit_code

if TYPE_CHECKING:
    from cluster.inspection.reachability import Listeners

DEFAULT_WAIT_S = 240.0


@dataclass
class RayOutcome(Outcome):
    """What `up` and `down` share: the run's facts, the plan, each node's step (ok / changed /
    failed / skipped / unreachable) and the head's Prometheus step."""

    exit_code: int = 0
    stopped: str | None = None                 # why it stopped before/while executing
    facts: Mapping[str, NodeFacts] = field(default_factory=dict)
    plan: RayActionPlan | None = None
    steps: tuple[StepResult, ...] = ()
    prometheus: StepResult | None = None       # ray.metrics: prometheus only

    @property
    def changed(self) -> bool:
        return any(s.status == CHANGED for s in self.steps + self.extra_steps)

    @property
    def extra_steps(self) -> tuple[StepResult, ...]:
        """Steps after the nodes' (the head's Prometheus)."""
        return (self.prometheus,) if self.prometheus is not None else ()

    def steps_exit_code(self) -> int:
        return step_exit_code(s.status for s in self.steps + self.extra_steps)


def gated(out: RayOutcome, dry_run: bool, question: str | None, confirm: Confirm) -> bool:
    """Whether to execute the plan: not on a dry run (exit 0), not when the question that
    guards running work is not confirmed (exit 2)."""
    if dry_run:
        out.stop("dry run", 0)
        return False
    if question is not None and not confirm(question):
        out.stop("not confirmed")
        return False
    return True


@dataclass(frozen=True)
class UpOptions:
    skip_preflight: bool = False
    force: bool = False
    stagger_s: float = 0.0
    dry_run: bool = False
    wait_s: float = DEFAULT_WAIT_S
    serial: int = 0            # --serial N: workers N at a time (cluster/ray/rollout.py)


@dataclass
class UpOutcome(RayOutcome):
    """Everything `cluster up` learned and did; `exit_code` follows the CLI contract."""

    preflight: Report | None = None
    preflight_error: str | None = None
    state_before: RayState | None = None
    wait: WaitResult | None = None
    status: dict | None = None
    failed_logs: Mapping[str, str] = field(default_factory=dict)  # node -> end of its Ray logs
    health_job: Any = None                     # cluster.ray.health_job.JobStep, once Ray is up
    grafana: Mapping[str, str] = field(default_factory=dict)      # file name -> dashboard JSON
    grafana_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": "up", "exit_code": self.exit_code, "stopped": self.stopped,
            "changed": self.changed,
            "preflight": self.preflight.to_dict() if self.preflight else None,
            "preflight_error": self.preflight_error,
            "facts": {k: v.to_dict() for k, v in self.facts.items()},
            "plan": self.plan.to_dict() if self.plan else None,
            "steps": [s.to_dict() for s in self.steps],
            "wait": self.wait.to_dict() if self.wait else None,
            "failed_logs": dict(self.failed_logs),
            "status": self.status,
            "health_job": self.health_job.to_dict() if self.health_job else None,
            "prometheus": self.prometheus.to_dict() if self.prometheus else None,
            "grafana": {"files": sorted(self.grafana), "error": self.grafana_error},
        }


def gather_facts(session: Session, inventory: Inventory, with_preflight: bool
                 ) -> tuple[dict[str, NodeFacts], Listeners | None]:
    """The run's facts, once: with the preflight's probes and its reachability listeners
    (started in the gather: no listen command) unless the preflight is skipped."""
    from cluster.inspection.preflight import gather_for
    from playbooks.preflight import gather_with_listeners

    if not with_preflight:
        return gather_for(inventory, session, checks=()), None
    return gather_with_listeners(inventory, session, list(inventory.nodes))


def run_preflight(inventory: Inventory, session: Session, facts: Mapping[str, NodeFacts],
                  listeners: Listeners | None = None) -> Report:
    """The preflight's verdicts on the run's facts (plus its cross-node and reachability steps,
    which stop what is left of the listeners the gather started)."""
    from playbooks import preflight

    return preflight.run(inventory, session, preflight.PreflightOptions(
        facts=facts, listeners=listeners)).report


def head_view(session: Session, inventory: Inventory,
              facts: Mapping[str, NodeFacts]) -> RayState | None:
    """The head's GCS view, when a GCS runs on the head (None otherwise: nothing to ask)."""
    hf = facts.get(inventory.head.name)
    if hf is None or not hf.usable or hf.gcs_port is None:
        return None
    state, _ = query_state(session, inventory, include_serve=False)
    return state


def run(inventory: Inventory, session: Session, options: UpOptions, confirm: Confirm,
        on_event: OnEvent = ignore) -> UpOutcome:
    out, say = UpOutcome(), lines_to(on_event)

    # 1. facts (read-only), once: one round trip per node serves the preflight and the plan
    say("gathering facts")
    out.facts, listeners = gather_facts(session, inventory,
                                        with_preflight=not options.skip_preflight)
    if not options.skip_preflight:
        say("preflight")
        out.preflight = run_preflight(inventory, session, out.facts, listeners)
        if out.preflight.exit_code >= 2 and not options.force and not options.dry_run:
            out.stopped = "preflight failed (fix the failures or pass --force)"
            out.exit_code = 2
            return out

    # 2. the head's view
    out.state_before = head_view(session, inventory, out.facts)

    # 3. plan (pure)
    out.plan = ray_cluster.plan_up(inventory, out.facts, out.state_before, options.force)
    if out.plan.refused:
        out.steps = ray_cluster.execute_up(out.plan, session, inventory)
        return out.stop("plan refused")

    # 4. [dry run stops here]; confirm what kills running work
    question = ("Restart Ray on " + "; ".join(out.plan.confirmations)
                + ". Running Ray work there will be killed. Continue?"
                ) if out.plan.confirmations else None
    if not gated(out, options.dry_run, question, confirm):
        return out

    # 5. execute
    if options.serial > 0:
        from cluster.ray.rollout import execute_up_serial
        out.steps = execute_up_serial(out.plan, session, inventory, options.serial,
                                      options.stagger_s, say)
    else:
        out.steps = ray_cluster.execute_up(out.plan, session, inventory, options.stagger_s,
                                           say)

    # 6. wait / verify (also on a plan that changed nothing: proves the cluster is healthy);
    # nodes whose start failed cannot register: their logs are read at once
    failed = {s.node for s in out.steps if s.status in (FAILED, UNREACHABLE, SKIPPED)}
    head_step = next(s for s in out.steps if s.node == inventory.head.name)
    expected = tuple(e for e in out.plan.expected if e.node not in failed)
    if head_step.status not in (FAILED, UNREACHABLE) and expected:
        say("waiting for the nodes to register")
        out.wait = ray_cluster.wait_for_nodes(session, inventory, expected, options.wait_s,
                                              on_event=say)
        if out.wait.state is not None:
            out.status = cluster_status(inventory, out.wait.state)
    started_and_failed = [s.node for s in out.steps if s.status == FAILED and s.results]
    if started_and_failed:
        out.failed_logs = ray_cluster.log_tails(session, inventory, started_and_failed)

    if out.wait is not None and out.wait.ok:   # the periodic health job: started or kept
        from cluster.ray.health_job import ensure_job
        say("health job")
        out.health_job = ensure_job(session, inventory)

    if prometheus_enabled(inventory) and head_step.status not in (FAILED, UNREACHABLE):
        _metrics(out, session, inventory, say)

    if out.steps_exit_code() or out.wait is None or not out.wait.ok:
        out.exit_code = 2
    elif out.plan.warnings or out.grafana_error or (out.health_job is not None
                                                    and out.health_job.status == FAILED):
        out.exit_code = 1
    else:
        out.exit_code = 0
    return out


def _metrics(out: UpOutcome, session: Session, inventory: Inventory,
             say: Callable[[str], None]) -> None:
    """The head's Prometheus (kept, started or restarted), then Ray's Grafana dashboards."""
    from playbooks import prometheus_head

    out.prometheus = prometheus_head.up(session, inventory, say)
    out.grafana, out.grafana_error = prometheus_head.dashboards(session, inventory)
