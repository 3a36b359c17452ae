"""`cluster drain NODE` as ordered steps.

locate the worker in the head's view (read-only) -> plan (pure: the capacity the other alive
nodes keep for the deployed apps, the `ray drain-node` command) -> [dry run stops here] ->
confirm -> execute (`ray drain-node` on the head) -> verify (poll until Serve has moved every
replica off the node and every app is RUNNING again).

Nothing is printed: the caller gets a RolloutOutcome and an `on_event` callback for progress.
restart-node (playbooks/restart_node.py) runs the same steps before restarting the node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.ray import ray_cluster
from cluster.inspection.facts import gather as gather_facts
from cluster.nodes.inventory import Inventory
from cluster.ray.ray_cluster import CHANGED, FAILED
from cluster.ray.ray_state import GcsNode, RayState, node_for_ip, query_state
from cluster.nodes.remote import CommandResult, Session
from cluster.ray.rollout import (DEFAULT_DRAIN_DEADLINE_S, DEFAULT_MOVE_WAIT_S, DRAIN_TIMEOUT_S,
                             Capacity, app_demands, apps_not_running, capacity_without,
                             drain_command, remaining_nodes, replicas_lost_with, worker)
from cluster.base.waits import poll
from playbooks.outcome import Confirm, OnEvent, Outcome, ignore, lines_to

Event = Callable[[str], None]   # the progress lines of the steps below (run() types them)


@dataclass
class RolloutOutcome(Outcome):
    """What drain / restart-node found and did; `exit_code` follows the CLI contract."""

    command: str
    node: str
    exit_code: int = 0
    stopped: str | None = None
    node_id: str | None = None
    capacity: Capacity | None = None
    planned: list[str] = field(default_factory=list)    # the commands, in order (dry run)
    steps: list[dict[str, Any]] = field(default_factory=list)
    moved_replicas: list[dict[str, Any]] = field(default_factory=list)
    new_node_id: str | None = None
    results: list[CommandResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "node": self.node, "exit_code": self.exit_code,
                "stopped": self.stopped, "node_id": self.node_id,
                "capacity": self.capacity.to_dict() if self.capacity else None,
                "planned": self.planned, "steps": self.steps,
                "moved_replicas": self.moved_replicas, "new_node_id": self.new_node_id,
                "apps_losing_replicas": sorted({r["app"] for r in self.moved_replicas}),
                "gang_replicas": [r for r in self.moved_replicas if "rank" in r],
                "results": [r.to_dict() for r in self.results]}

    def step(self, name: str, status: str, message: str, **extra: Any) -> None:
        self.steps.append({"step": name, "status": status, "message": message, **extra})


@dataclass(frozen=True)
class WorkerOptions:
    """One worker taken out: drain and restart-node."""

    node: str
    dry_run: bool = False
    wait_s: float = DEFAULT_MOVE_WAIT_S     # for the Serve replicas to move off it


@dataclass(frozen=True)
class DrainOptions(WorkerOptions):
    deadline_s: int = DEFAULT_DRAIN_DEADLINE_S


def run(inventory: Inventory, session: Session, options: DrainOptions, confirm: Confirm,
        on_event: OnEvent = ignore) -> RolloutOutcome:
    return drain(session, inventory, options.node, dry_run=options.dry_run, confirm=confirm,
                 wait_s=options.wait_s, deadline_s=options.deadline_s,
                 on_event=lines_to(on_event))


def ray_view(session: Session, inventory: Inventory) -> RayState:
    """The head's view of Ray with Serve's details (read-only)."""
    state, _ = query_state(session, inventory, include_serve=True)
    return state


def locate(session: Session, inventory: Inventory, name: str, out: RolloutOutcome
           ) -> tuple[RayState, GcsNode] | None:
    """The head's view and the node's alive entry, or None (out says why, exit 2)."""
    node = worker(inventory, name)
    state = ray_view(session, inventory)
    if not state.answered:
        out.stop("the head does not answer: " + "; ".join(state.errors))
        return None
    entry = node_for_ip(state.nodes, node.ip)
    if entry is None or not entry.alive:
        out.stop(f"{name} is not alive in Ray ({node.ip}): nothing to drain "
                 "(`cluster up` rejoins it)")
        return None
    out.node_id = entry.node_id
    return state, entry


def wait_moved(session: Session, inventory: Inventory, node_id: str, wait_s: float,
               on_event: Event, poll_s: float = 3.0) -> tuple[bool, list[dict], RayState]:
    """Poll until no Serve replica is on the node and every app is RUNNING (at most wait_s)."""
    last = [""]

    def probe() -> tuple[RayState, list[dict], list]:
        state = ray_view(session, inventory)
        left = replicas_lost_with(state, node_id) if state.answered else [{"state": "unknown"}]
        pending = apps_not_running(state.serve) if state.serve is not None else ["serve: no answer"]
        return state, left, pending

    def report(value) -> None:
        _, left, pending = value
        msg = f"{len(left)} replica(s) still on the node; apps not running: {pending or 'none'}"
        if (left or pending) and msg != last[0]:
            on_event(msg)
            last[0] = msg

    got = poll(probe, lambda v: not v[1] and not v[2], timeout_s=wait_s, interval_s=poll_s,
               on_value=report)
    state, left, _ = got.value
    return got.done, left, state


def drain(session: Session, inventory: Inventory, name: str, *, dry_run: bool,
          confirm: Callable[[str], bool],
          wait_s: float = DEFAULT_MOVE_WAIT_S, deadline_s: int = DEFAULT_DRAIN_DEADLINE_S,
          on_event: Event = lambda _: None, command: str = "drain",
          check_capacity: bool = True) -> RolloutOutcome:
    """Drain a worker: capacity check, ask, `ray drain-node`, then wait until Serve has moved
    every replica off it and the apps are RUNNING again."""
    out = RolloutOutcome(command, name)
    found = locate(session, inventory, name, out)
    if found is None:
        return out
    state, entry = found
    demands = app_demands(state.serve)
    out.capacity = capacity_without(demands, remaining_nodes(state, inventory, entry))
    head_facts = gather_facts(session, inventory, [inventory.head])
    auth = ray_cluster.cluster_auth_mode(inventory, head_facts)
    cmd = drain_command(inventory, entry.node_id, f"cluster {command} {name}", deadline_s, auth)
    out.planned.append(f"[{inventory.head.name}] $ {cmd}")
    if check_capacity and not out.capacity.ok:
        return out.stop(f"refused: {name} cannot be taken out: {out.capacity.summary()} ("
                        + "; ".join(out.capacity.problems) + ")")
    replicas = replicas_lost_with(state, entry.node_id)
    out.moved_replicas = replicas
    gangs = sorted({r["app"] for r in replicas if "rank" in r})
    if dry_run:
        return out.stop("dry run", 0)
    lose = (f"; multi-node app(s) {', '.join(gangs)} lose a whole replica (a rank runs "
            "there) until Serve starts a new gang" if gangs else "")
    if not confirm(f"Drain {name} (Ray node {entry.node_id[:12]}): it takes no new work and "
                   f"{len(replicas)} Serve replica(s) move to other nodes{lose}. Continue?"):
        return out.stop("not confirmed")
    on_event(f"draining {name}")
    r = ray_cluster.run_node_command(session, inventory.head, cmd, DRAIN_TIMEOUT_S)
    out.results.append(r)
    if not r.ok:
        detail = (r.stderr.strip() or r.stdout.strip() or r.error or "").splitlines()[-1:]
        out.step("drain", FAILED, f"ray drain-node: {r.status} (exit {r.exit_code}): "
                 + " ".join(detail))
        return out.stop("drain not accepted")
    out.step("drain", CHANGED, f"drain accepted for node {entry.node_id[:12]}")
    if not demands:
        out.step("move-replicas", "ok", "no Serve application: nothing to move")
        return out
    on_event(f"waiting for Serve to move {len(replicas)} replica(s) off {name}")
    moved, left, _ = wait_moved(session, inventory, entry.node_id, wait_s, on_event)
    if not moved:
        out.step("move-replicas", FAILED, f"after {wait_s:g} s: {len(left)} replica(s) still on "
                 f"{name}, or an app is not RUNNING", left=left)
        return out.stop("replicas not moved in time")
    out.step("move-replicas", CHANGED, f"{len(replicas)} replica(s) moved off {name}; "
             "every app RUNNING")
    return out
