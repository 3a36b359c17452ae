"""`cluster up` as ordered, idempotent steps.

gather facts once (read-only, cluster/facts.py: one round trip per node, with the preflight's
probes unless it is skipped) -> preflight verdicts on those facts -> the head's view of Ray
(read-only) -> plan (pure) -> [dry run stops here] -> confirm restarts ->
execute (stops, then the head and the workers) -> wait until every node is alive with its
GPUs/CPUs -> status -> with `ray.metrics: prometheus`, the head's Prometheus (probe, plan,
start or keep, verify: cluster/prometheus_head.py) and Ray's Grafana dashboards.

A step reports per node in Ansible's words: ok (nothing to do), changed (ran and succeeded),
failed, skipped, unreachable. Nothing is printed here: the caller gets an UpOutcome and an
`on_event` callback for progress lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from cluster import prometheus_head, ray_cluster
from cluster.inventory import Inventory
from cluster.ray_cluster import (CHANGED, FAILED, SKIPPED, UNREACHABLE, NodeFacts, Plan,
                                 StepResult, WaitResult)
from cluster.ray_state import RayState, cluster_status, query_state
from cluster.results import Report

DEFAULT_WAIT_S = 240.0


@dataclass(frozen=True)
class UpOptions:
    skip_preflight: bool = False
    force: bool = False
    stagger_s: float = 0.0
    dry_run: bool = False
    wait_s: float = DEFAULT_WAIT_S
    serial: int = 0            # --serial N: workers N at a time (cluster/rollout.py)


@dataclass
class UpOutcome:
    """Everything `cluster up` learned and did; `exit_code` follows the CLI contract."""

    exit_code: int = 0
    stopped: str | None = None                 # why it stopped before/while executing
    preflight: Report | None = None
    preflight_error: str | None = None
    facts: Mapping[str, NodeFacts] = field(default_factory=dict)
    state_before: RayState | None = None
    plan: Plan | None = None
    steps: tuple[StepResult, ...] = ()
    wait: WaitResult | None = None
    status: dict | None = None
    failed_logs: Mapping[str, str] = field(default_factory=dict)  # node -> end of its Ray logs
    health_job: Any = None                     # cluster.health_job.JobStep, once Ray is up
    prometheus: StepResult | None = None       # ray.metrics: prometheus only
    grafana: Mapping[str, str] = field(default_factory=dict)      # file name -> dashboard JSON
    grafana_error: str | None = None

    @property
    def changed(self) -> bool:
        return any(s.status == CHANGED for s in self.steps + self.extra_steps)

    @property
    def extra_steps(self) -> tuple[StepResult, ...]:
        """Steps after the nodes' (the head's Prometheus)."""
        return (self.prometheus,) if self.prometheus is not None else ()

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


def gather_facts(session, inventory: Inventory, with_preflight: bool) -> dict[str, NodeFacts]:
    """The run's facts, once: with the preflight's probes too unless it is skipped."""
    from cluster.checks.node import NODE_CHECKS
    from cluster.preflight import gather_for

    return gather_for(inventory, session, checks=NODE_CHECKS if with_preflight else ())


def run_preflight(inventory: Inventory, session, facts: Mapping[str, NodeFacts]) -> Report:
    """The preflight's verdicts on the run's facts (plus its cross-node and reachability steps)."""
    from playbooks.preflight import run_preflight as preflight

    return preflight(inventory, session, facts=facts)


def head_view(session, inventory: Inventory, facts: Mapping[str, NodeFacts]) -> RayState | None:
    """The head's GCS view, when a GCS runs on the head (None otherwise: nothing to ask)."""
    hf = facts.get(inventory.head.name)
    if hf is None or not hf.usable or hf.gcs_port is None:
        return None
    state, _ = query_state(session, inventory, include_serve=False)
    return state


def run(inventory: Inventory, session, options: UpOptions,
        confirm: Callable[[str], bool],
        on_event: Callable[[str], None] = lambda _: None) -> UpOutcome:
    out = UpOutcome()

    # 1. facts (read-only), once: one round trip per node serves the preflight and the plan
    on_event("gathering facts")
    out.facts = gather_facts(session, inventory, with_preflight=not options.skip_preflight)
    if not options.skip_preflight:
        on_event("preflight")
        out.preflight = run_preflight(inventory, session, out.facts)
        if out.preflight.exit_code >= 2 and not options.force and not options.dry_run:
            out.stopped = "preflight failed (fix the failures or pass --force)"
            out.exit_code = 2
            return out

    # 2. the head's view
    out.state_before = head_view(session, inventory, out.facts)

    # 3. plan (pure)
    out.plan = ray_cluster.plan_up(inventory, out.facts, out.state_before)
    if out.plan.refused:
        out.stopped = "plan refused"
        out.steps = ray_cluster.execute_up(out.plan, session, inventory)
        out.exit_code = 2
        return out
    if options.dry_run:
        out.stopped = "dry run"
        out.exit_code = 0
        return out

    # 4. confirm what kills running work
    if out.plan.confirmations:
        question = ("Restart Ray on " + "; ".join(out.plan.confirmations)
                    + ". Running Ray work there will be killed. Continue?")
        if not confirm(question):
            out.stopped = "not confirmed"
            out.exit_code = 2
            return out

    # 5. execute
    if options.serial > 0:
        from cluster.rollout import execute_up_serial
        out.steps = execute_up_serial(out.plan, session, inventory, options.serial,
                                      options.stagger_s, on_event)
    else:
        out.steps = ray_cluster.execute_up(out.plan, session, inventory, options.stagger_s,
                                           on_event)

    # 6. wait / verify (also on a plan that changed nothing: proves the cluster is healthy);
    # nodes whose start failed cannot register: their logs are read at once
    failed = {s.node for s in out.steps if s.status in (FAILED, UNREACHABLE, SKIPPED)}
    head_step = next(s for s in out.steps if s.node == inventory.head.name)
    expected = tuple(e for e in out.plan.expected if e.node not in failed)
    if head_step.status not in (FAILED, UNREACHABLE) and expected:
        on_event("waiting for the nodes to register")
        out.wait = ray_cluster.wait_for_nodes(session, inventory, expected, options.wait_s,
                                              on_event=on_event)
        if out.wait.state is not None:
            out.status = cluster_status(inventory, out.wait.state)
    started_and_failed = [s.node for s in out.steps if s.status == FAILED and s.results]
    if started_and_failed:
        out.failed_logs = ray_cluster.log_tails(session, inventory, started_and_failed)

    if out.wait is not None and out.wait.ok:   # the periodic health job: started or kept
        from cluster.health_job import ensure_job
        on_event("health job")
        out.health_job = ensure_job(session, inventory)

    if prometheus_head.enabled(inventory) and head_step.status not in (FAILED, UNREACHABLE):
        _metrics(out, session, inventory, on_event)

    bad = [s for s in out.steps + out.extra_steps if s.status in (FAILED, UNREACHABLE)]
    if bad or (out.wait is not None and not out.wait.ok) or out.wait is None:
        out.exit_code = 2
    elif out.plan.warnings or out.grafana_error or (out.health_job is not None
                                                    and out.health_job.status == FAILED):
        out.exit_code = 1
    else:
        out.exit_code = 0
    return out


def _metrics(out: UpOutcome, session, inventory: Inventory, on_event: Callable[[str], None]) -> None:
    """The head's Prometheus (kept, started or restarted), then Ray's Grafana dashboards."""
    out.prometheus = prometheus_head.up(session, inventory, on_event)
    out.grafana, out.grafana_error = prometheus_head.dashboards(session, inventory)
