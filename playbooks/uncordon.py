"""`cluster uncordon NODE` as ordered steps: a node the health job cordoned (health.act) back.

preflight of that node (read-only: every node check, its clock) -> refused (exit 2, naming
the checks that fail) while one fails or cannot be judged -> the restart-node steps
(playbooks/restart_node.py: capacity, dry run, confirm, drain, `ray stop` / `ray start`, rejoin,
apps RUNNING). Ray has no "undrain": a drained node takes work again only as a new Ray node,
and the health job lifts its cordon when the node rejoins under a new node id.

Nothing is printed: the caller gets a RolloutOutcome and an `on_event` callback for progress.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.base.results import Status
from cluster.nodes.inventory import Inventory
from cluster.ray.ray_cluster import FAILED
from cluster.ray.rollout import worker
from cluster.nodes.remote import Session
from playbooks.drain import RolloutOutcome
from playbooks.outcome import Confirm, OnEvent, ignore, lines_to
from playbooks.preflight import run_preflight
from playbooks.restart_node import RestartOptions, restart_node

NOT_JUDGED = (Status.FAIL, Status.ERROR)


@dataclass(frozen=True)
class UncordonOptions(RestartOptions):
    pass


def run(inventory: Inventory, session: Session, options: UncordonOptions, confirm: Confirm,
        on_event: OnEvent = ignore) -> RolloutOutcome:
    node = worker(inventory, options.node)
    lines = lines_to(on_event)
    out = RolloutOutcome("uncordon", node.name)
    lines(f"preflight of {node.name}")
    report = run_preflight(inventory, session, [node], reachability=False)
    failing = [r for r in report.results if r.status in NOT_JUDGED]
    if failing:
        why = "; ".join(f"{r.check}: {r.summary}" for r in failing)[:1000]
        out.step("preflight", FAILED, why)
        return out.stop(f"refused: the preflight of {node.name} fails ({why}); fix it and run "
                        "uncordon again")
    out.step("preflight", "ok", f"every check of {node.name} passes or warns")
    return restart_node(session, inventory, node.name, dry_run=options.dry_run, confirm=confirm,
                        wait_s=options.wait_s, join_timeout_s=options.join_timeout_s,
                        on_event=lines, command="uncordon", out=out)
