"""`cluster down` as ordered, idempotent steps.

gather (read-only) -> plan (pure: stop only nodes with Ray processes, workers first, then the
head) -> [dry run stops here] -> confirm -> execute (`ray stop` on each node, which stops only
that node's Ray processes; with `ray.metrics: prometheus` the head's Prometheus too) -> verify
(gather again: no Ray process may be left).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from cluster.ray import ray_cluster
from cluster.ray.prometheus_head import enabled as prometheus_enabled
from cluster.inspection.facts import gather as gather_facts
from cluster.nodes.inventory import Inventory
from cluster.ray.ray_cluster import CHANGED, FAILED
from playbooks.outcome import Confirm, OnEvent, ignore, lines_to
from playbooks.ray_up import RayOutcome, gated
from cluster.base.waits import poll
from cluster.nodes.remote import Session


VERIFY_ATTEMPTS = 4
VERIFY_PAUSE_S = 3.0


@dataclass(frozen=True)
class DownOptions:
    dry_run: bool = False
    serial: int = 0            # --serial N: workers N at a time (cluster/ray/rollout.py)


@dataclass
class DownOutcome(RayOutcome):
    leftovers: Mapping[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"command": "down", "exit_code": self.exit_code, "stopped": self.stopped,
                "changed": self.changed,
                "facts": {k: v.to_dict() for k, v in self.facts.items()},
                "plan": self.plan.to_dict() if self.plan else None,
                "steps": [s.to_dict() for s in self.steps],
                "leftovers": dict(self.leftovers),
                "prometheus": self.prometheus.to_dict() if self.prometheus else None}


def run(inventory: Inventory, session: Session, options: DownOptions, confirm: Confirm,
        on_event: OnEvent = ignore) -> DownOutcome:
    out, say = DownOutcome(), lines_to(on_event)
    say("gathering facts")
    out.facts = gather_facts(session, inventory)
    out.plan = ray_cluster.plan_down(inventory, out.facts)
    question = ("Stop Ray on " + ", ".join(a.node for a in out.plan.actions if a.changes)
                + "? Running Ray work (Serve apps, jobs) will be killed."
                ) if out.plan.confirmations else None
    if not gated(out, options.dry_run, question, confirm):
        return out
    if options.serial > 0:  # --serial N: workers N at a time (cluster/ray/rollout.py)
        from cluster.ray.rollout import execute_down_serial
        out.steps = execute_down_serial(out.plan, session, inventory, options.serial, say)
    else:
        out.steps = ray_cluster.execute_down(out.plan, session, inventory, say)
    if prometheus_enabled(inventory) and out.facts[inventory.head.name].reached:
        from playbooks import prometheus_head

        out.prometheus = prometheus_head.down(session, inventory, say)
    if not out.plan.changes:
        out.exit_code = out.steps_exit_code()
        return out

    # verify: nothing of Ray may be left on the nodes that were reached (processes that are
    # still exiting get a few seconds)
    say("verifying")
    stopped = [inventory.node(s.node) for s in out.steps if s.status == CHANGED]
    after = poll(lambda: gather_facts(session, inventory, stopped),
                 lambda got: not any(f.usable and f.running for f in got.values()),
                 timeout_s=VERIFY_ATTEMPTS * VERIFY_PAUSE_S, interval_s=VERIFY_PAUSE_S,
                 max_attempts=VERIFY_ATTEMPTS).value or {}
    steps = []
    for step in out.steps:
        f = after.get(step.node)
        if f is not None and f.usable and f.running:
            out.leftovers[step.node] = list(f.ray_processes)
            step = replace(step, status=FAILED,
                           message=f"{len(f.ray_pids)} Ray processes left: "
                                   + ", ".join(f.ray_processes[:8]))
        steps.append(step)
    out.steps = tuple(steps)
    out.exit_code = out.steps_exit_code()
    return out

