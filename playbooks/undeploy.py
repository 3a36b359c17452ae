"""`cluster undeploy NAME` as ordered steps.

gather (read-only: Serve's applications through the dashboard) -> plan (pure: the app is
absent, nothing to do; or it goes and the others stay) -> [dry run stops here] -> confirm ->
execute (the dashboard's PUT with the remaining apps, merged on the head) -> verify (poll until
Serve no longer lists the app).

Nothing is printed: the caller gets an UndeployOutcome (the undeploy.json document) and an
`on_event` callback for progress lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from cluster.serving import deploy
from cluster.nodes.inventory import Inventory
from cluster.nodes.remote import Session
from playbooks.outcome import Confirm, DocOutcome, OnEvent, ignore, lines_to
from playbooks.serve_wait import wait_until_gone

DEFAULT_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class UndeployOptions:
    name: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    dry_run: bool = False


class UndeployOutcome(DocOutcome):
    """undeploy.json's fields as they are learned."""

    @classmethod
    def start(cls, options: UndeployOptions, run_dir: str) -> "UndeployOutcome":
        return cls({"name": options.name, "status": None, "run_dir": run_dir,
                    "dry_run": options.dry_run})


def run(inventory: Inventory, session: Session, options: UndeployOptions, confirm: Confirm,
        on_event: OnEvent = ignore, *, out: UndeployOutcome | None = None,
        client=None) -> UndeployOutcome:
    """Fills `out` (given by a caller that records a partial outcome on an error) and returns
    it. `client`: the dashboard (default cluster.ray.dashboard_api.DashboardClient)."""
    out = out if out is not None else UndeployOutcome.start(options, "")
    if client is None:
        from cluster.ray.dashboard_api import DashboardClient
        client = DashboardClient(session, inventory)
    doc, name, say = out.doc, options.name, lines_to(on_event)

    details = client.serve_details()
    before = deploy.app_state(details, name)
    others = sorted(n for n in (details.get("applications") or {}) if n != name)
    doc.update(previous=before.to_dict() if before else None, remaining=others)
    if before is None:
        doc["status"] = "ABSENT"
        out.exit_code = 0
        return out
    if options.dry_run:
        doc["status"] = "DRY_RUN"
        out.exit_code = 0
        return out
    if not confirm(f"Remove application {name!r} ({before.status}); "
                   f"{len(others)} other app(s) keep running?"):
        doc["status"] = "CANCELLED"
        return out

    say(f"removing {name} through the dashboard")
    applied = deploy.undeploy_app(client, name)
    doc["apply"] = applied.to_dict()
    if not applied.ok:
        doc.update(status="FAILED", error=applied.error)
        return out
    gone = wait_until_gone(client, name, options.timeout_s, on_event=say)
    doc["waited_s"] = round(gone.waited_s, 1)
    if gone.timed_out:
        doc.update(status=gone.state.status if gone.state else "UNKNOWN",
                   error=f"still listed after {options.timeout_s:g} s")
        return out
    doc["status"] = "REMOVED"
    out.exit_code = 0
    return out
