"""`cluster status` as a read-only playbook.

gather (the head's view: Ray's nodes, version and Serve apps via node_programs/head_state.py;
two /metrics samples of each app with a running replica, cluster/serving/serving_health.py; the health
job's latest readings, cluster/ray/health_job.py) -> judge (pure: cluster/ray/ray_state.cluster_status
matches Ray's nodes to the inventory; an app out of capacity or a broken rank of a multi-node
replica or a node the health job cordoned is a warning) -> StatusOutcome (the status.json document and its exit code).

Nothing changes anywhere: no plan, no dry run, nothing to confirm. Nothing is printed: the CLI
(cluster/commands/status.py) renders the document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.ray.health_job import HealthStatus, read_health
from cluster.nodes.inventory import Inventory
from cluster.ray.prometheus_head import metrics_doc
from cluster.ray.ray_state import cluster_status, query_state, status_exit_code
from cluster.nodes.remote import Session
from playbooks.outcome import (EXIT_FAIL, EXIT_OK, EXIT_WARN, Confirm, OnEvent, Outcome,
                               ignore, never_confirm)


@dataclass(frozen=True)
class StatusOptions:
    window_s: float | None = None     # --window: seconds between the two /metrics samples


@dataclass
class StatusOutcome(Outcome):
    """status.json's document; exit 0 every inventory node alive, 1 a serving warning or a
    broken rank, 2 a node missing or the head not answering."""

    doc: dict[str, Any] = field(default_factory=dict)
    exit_code: int = EXIT_FAIL
    stopped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.doc)


def run(inventory: Inventory, session: Session, options: StatusOptions = StatusOptions(),
        confirm: Confirm = never_confirm, on_event: OnEvent = ignore) -> StatusOutcome:
    """Read-only: confirm is never asked."""
    state, result = query_state(session, inventory, include_serve=True)
    serving = sample_serving(session, inventory, state, options.window_s)
    health = read_health(session, inventory) if state.answered else HealthStatus(None)
    doc = cluster_status(inventory, state, head_reached=result.reached)
    doc["health"] = health.nodes
    doc["health_period_s"] = health.period_s   # what the running job reports, not this inventory
    doc["health_actions"] = health.actions     # health.act: the nodes cordoned, the records
    doc["errors"] += [health.error] if health.error else []
    doc.setdefault("dashboard", {})["metrics"] = metrics_doc(inventory)
    code = attach_serving(doc, serving, status_exit_code(doc))
    if code == EXIT_OK and (broken_ranks(doc) or cordoned_nodes(doc)):
        code = EXIT_WARN
    attach_transport(doc, inventory)
    return StatusOutcome(doc, code)


def cordoned_nodes(doc: dict) -> list[str]:
    """The nodes the health job cordoned (health.act) and nothing brought back yet."""
    return sorted((doc.get("health_actions") or {}).get("cordoned") or {})


def broken_ranks(doc: dict) -> list[tuple[str, dict]]:
    """(app, rank) for every dead or missing rank of a RUNNING multi-node replica."""
    apps = (doc.get("serve") or {}).get("applications") or {}
    return [(name, rank) for name, app in apps.items() for rank in app.get("broken_ranks") or []]


def attach_transport(doc: dict, inv: Inventory) -> None:
    """serve.applications[app].engine_transport: what the app's last deployment confirmed from
    its ranks' own init lines (cluster/serving/engine_transport.py), when it read them."""
    from cluster.serving.engine_transport import confirmed_by_app

    apps = (doc.get("serve") or {}).get("applications") or {}
    if not apps:
        return
    for name, found in confirmed_by_app(inv.run_dir, list(apps)).items():
        apps[name]["engine_transport"] = found


def sample_serving(session: Session, inv: Inventory, state, window_s: float | None) -> dict:
    """{app: ServingHealth} for the apps with a running replica ({} when none)."""
    from cluster.serving.serving_health import load_thresholds, sample_serving as sample

    if not state.answered or state.serve is None:
        return {}
    thresholds = load_thresholds()
    window = window_s if window_s is not None else thresholds.window_s
    return sample(session, inv, state.serve, window, thresholds)


def attach_serving(doc: dict, serving: dict, code: int) -> int:
    """serve.applications[app].serving = the health JSON; exit 1 (from 0) on a warning."""
    apps = (doc.get("serve") or {}).get("applications") or {}
    for name, app in apps.items():
        health = serving.get(name)
        app["serving"] = health.to_dict() if health is not None else None
    warned = any(h.status == "warn" for h in serving.values())
    return EXIT_WARN if code == EXIT_OK and warned else code
