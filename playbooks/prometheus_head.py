"""The head's Prometheus bring-up for `cluster up` / `cluster down` (inventory `ray.metrics:
prometheus`): probe the head, plan (pure, cluster/ray/prometheus_head.py: keep / start / restart /
refuse), run the plan, verify it answers /-/ready; stop only our own; Ray's Grafana dashboards.
A step of playbooks/ray_up.py and ray_down.py, reported as one StepResult in the step
vocabulary (ok / changed / failed / unreachable).
"""

from __future__ import annotations

from typing import Callable

from cluster.nodes.inventory import Inventory
from cluster.node_programs import run_call
from cluster.ray.prometheus_head import (ACTION, KEEP, PROBE_TIMEOUT_S, READY_WAIT_S, REFUSE,
                                     START_TIMEOUT_S, STOP_TIMEOUT_S, dashboards_call, parse_doc,
                                     parse_probe, plan, probe_call, stop_call)
from cluster.ray.ray_cluster import CHANGED, FAILED, OK, UNREACHABLE, StepResult
from cluster.nodes.remote import CommandResult, Session


Event = Callable[[str], None]


def _failed(head: str, results: list[CommandResult], why: str) -> StepResult:
    last = results[-1] if results else None
    status = UNREACHABLE if last is not None and last.status == "unreachable" else FAILED
    return StepResult(head, ACTION, status, why, tuple(results))


def _why(result: CommandResult) -> str:
    out = (result.stderr.strip() or result.stdout.strip() or result.error or "").splitlines()
    return f"{result.status} (exit {result.exit_code}): " + " | ".join(out[-3:])


def up(session: Session, inventory: Inventory, on_event: Event = lambda _: None) -> StepResult:
    """Probe the head, plan, run the plan, verify: one StepResult (ok/changed/failed)."""
    head = inventory.head
    on_event("checking Prometheus on the head")
    probed = run_call(session, head, probe_call(inventory), timeout=PROBE_TIMEOUT_S)
    doc = parse_doc(probed)
    if doc is None:
        return _failed(head.name, [probed], "cannot probe Prometheus: " + _why(probed))
    action = plan(inventory, parse_probe(doc))
    if action.kind == REFUSE:
        return StepResult(head.name, ACTION, FAILED, action.reason, (probed,))
    if action.kind == KEEP:
        return StepResult(head.name, ACTION, OK, action.reason, (probed,))
    on_event(action.reason)
    results = [probed]
    for call in action.calls:
        timeout = START_TIMEOUT_S if " start " in f" {call.command} " else STOP_TIMEOUT_S
        r = run_call(session, head, call, timeout=timeout)
        results.append(r)
        if parse_doc(r) is None:
            return _failed(head.name, results, _why(r))
    started = parse_doc(results[-1]) or {}
    if not started.get("ready"):
        tail = str(started.get("log_tail") or "").strip().splitlines()[-3:]
        return _failed(head.name, results,
                       f"Prometheus (pid {started.get('pid')}) did not answer /-/ready within "
                       f"{READY_WAIT_S:g} s (exit {started.get('exit_code')}): "
                       + " | ".join(tail))
    return StepResult(head.name, ACTION, CHANGED,
                      f"{action.reason}: pid {started.get('pid')}, ready", tuple(results))


def down(session: Session, inventory: Inventory, on_event: Event = lambda _: None) -> StepResult:
    """Stop our Prometheus on the head (ok when none runs)."""
    head = inventory.head
    on_event("stopping Prometheus on the head")
    r = run_call(session, head, stop_call(inventory), timeout=STOP_TIMEOUT_S)
    doc = parse_doc(r)
    if doc is None:
        return _failed(head.name, [r], "cannot stop Prometheus: " + _why(r))
    if doc.get("stopped") is None:
        return StepResult(head.name, ACTION, OK, "no Prometheus of ours running", (r,))
    how = " (killed after SIGTERM)" if doc.get("killed") else ""
    return StepResult(head.name, ACTION, CHANGED, f"Prometheus (pid {doc['stopped']}) "
                                                  f"stopped{how}", (r,))


def dashboards(session: Session, inventory: Inventory) -> tuple[dict[str, str], str | None]:
    """({file name: JSON text}, error): Ray's generated Grafana dashboards on the head."""
    r = run_call(session, inventory.head, dashboards_call(inventory), timeout=60)
    doc = parse_doc(r)
    if doc is None:
        return {}, "cannot read Ray's Grafana dashboards: " + _why(r)
    found = doc.get("dashboards")
    if not isinstance(found, dict) or not found:
        return {}, f"Ray wrote no Grafana dashboard under {doc.get('dir')}"
    return {name: text for name, text in found.items()
            if isinstance(name, str) and _safe_name(name) and isinstance(text, str)}, None


def _safe_name(name: str) -> bool:
    return name.endswith(".json") and "/" not in name and not name.startswith(".") \
        and len(name) <= 128
