"""`cluster up` as ordered, idempotent steps.

preflight (read-only, unless skipped) and, at the same time, gather facts (read-only) -> the
head's view of Ray (read-only) -> plan (pure) -> [dry run stops here] -> confirm restarts ->
execute (stops, then the head and the workers) -> wait until every node is alive with its
GPUs/CPUs -> status -> with `ray.metrics: prometheus`, the head's Prometheus (probe, plan,
start or keep, verify: cluster/prometheus_head.py) and Ray's Grafana dashboards.

A step reports per node in Ansible's words: ok (nothing to do), changed (ran and succeeded),
failed, skipped, unreachable. Nothing is printed here: the caller gets an UpOutcome and an
`on_event` callback for progress lines.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from cluster import prometheus_head, ray_cluster
from cluster.inventory import Inventory
from cluster.ray_cluster import (CHANGED, FAILED, SKIPPED, UNREACHABLE, NodeFacts, Plan,
                                 StepResult, WaitResult)
from cluster.ray_state import RayState, cluster_status, query_state
from cluster.remote import Session
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


class _Background:
    """One call in a daemon thread; result() joins it and returns (or re-raises) its outcome."""

    def __init__(self, fn: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _gather_separately(session, inventory: Inventory) -> dict[str, NodeFacts]:
    with Session(inventory, hooks=session.hooks) as own:
        return ray_cluster.gather(own, inventory)


def run_preflight(inventory: Inventory, session) -> Report:
    """The lead's preflight (cluster.preflight.run_preflight); ImportError if not there yet."""
    from cluster.preflight import run_preflight as preflight  # noqa: WPS433 (optional module)

    return preflight(inventory, session)


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

    # 1. preflight, with the (read-only) fact gathering running beside it on its own SSH
    # connections (two threads opening one node's connection at once break paramiko's session)
    gathering = _Background(lambda: _gather_separately(session, inventory))
    if not options.skip_preflight:
        on_event("preflight")
        try:
            out.preflight = run_preflight(inventory, session)
        except ImportError as exc:
            out.preflight_error = (f"preflight is not available ({exc}); "
                                   "pass --skip-preflight to start without it")
        failed = out.preflight_error is not None or out.preflight.exit_code >= 2
        if failed and not options.force and not options.dry_run:
            out.stopped = "preflight failed (fix the failures or pass --force)" \
                if out.preflight_error is None else out.preflight_error
            out.facts = gathering.result()
            out.exit_code = 2
            return out

    # 2. facts (read-only) and the head's view
    on_event("gathering facts")
    out.facts = gathering.result()
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
