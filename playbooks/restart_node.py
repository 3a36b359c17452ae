"""`cluster restart-node NODE` as ordered steps.

gather facts (read-only: the node is reachable, its GPUs) -> plan (pure: the `ray stop` and the
`ray start` that `cluster up` would run) -> drain (playbooks/drain.py: capacity check, dry run,
confirm, `ray drain-node`, replicas moved) -> execute (stop, start) -> verify (the node is alive
again with its GPUs/CPUs, every Serve app RUNNING).

Nothing is printed: the caller gets a RolloutOutcome and an `on_event` callback for progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cluster.ray import ray_cluster
from cluster.inspection.facts import gather as gather_facts
from cluster.nodes.inventory import Inventory
from cluster.ray.ray_cluster import CHANGED, FAILED, KEEP, NodeAction, RayActionPlan
from cluster.ray.ray_state import node_for_ip
from cluster.ray.rollout import DEFAULT_MOVE_WAIT_S, apps_not_running, worker
from cluster.nodes.remote import Session
from playbooks.drain import RolloutOutcome, WorkerOptions, drain, ray_view
from playbooks.outcome import Confirm, OnEvent, ignore, lines_to

Event = Callable[[str], None]
DEFAULT_JOIN_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class RestartOptions(WorkerOptions):
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S


def run(inventory: Inventory, session: Session, options: RestartOptions, confirm: Confirm,
        on_event: OnEvent = ignore) -> RolloutOutcome:
    return restart_node(session, inventory, options.node, dry_run=options.dry_run,
                        confirm=confirm, wait_s=options.wait_s,
                        join_timeout_s=options.join_timeout_s, on_event=lines_to(on_event))


def restart_node(session: Session, inventory: Inventory, name: str, *, dry_run: bool,
                 confirm: Callable[[str], bool], wait_s: float = DEFAULT_MOVE_WAIT_S,
                 join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S, on_event: Event = lambda _: None,
                 command: str = "restart-node", out: RolloutOutcome | None = None
                 ) -> RolloutOutcome:
    """Drain a worker, `ray stop` on it, start it with the command `cluster up` would run,
    wait until it is alive again with its GPUs/CPUs and the apps are RUNNING."""
    node = worker(inventory, name)
    facts = gather_facts(session, inventory)
    stop = ray_cluster.stop_command(inventory)
    f = facts[name]
    if not f.usable:
        out = out or RolloutOutcome(command, name)
        return out.stop(f"{name} unreachable or unusable: {f.error}")
    auth = ray_cluster.cluster_auth_mode(inventory, facts)
    start = ray_cluster.start_command(node, inventory, f.gpus, auth)
    drained = drain(session, inventory, name, dry_run=dry_run, confirm=confirm, wait_s=wait_s,
                    on_event=on_event, command=command)
    if out is not None:             # a caller's earlier steps (uncordon's preflight) come first
        drained.steps[:0] = out.steps
    out = drained
    out.planned += [f"[{name}] $ {stop}", f"[{name}] $ {start}"]
    if out.stopped:
        return out
    on_event(f"restarting Ray on {name}")
    action = NodeAction(name, ray_cluster.RESTART, "restart-node", (stop, start))
    plan = RayActionPlan("up", (NodeAction(inventory.head.name, KEEP, "kept"), action))
    steps = ray_cluster.execute_up(plan, session, inventory, 0.0, on_event)
    step = next(s for s in steps if s.node == name)
    out.results += list(step.results)
    out.step("restart", step.status, step.message)
    if step.status != CHANGED:
        return out.stop(f"ray stop/start on {name} failed: {step.message}")
    expected = (ray_cluster.ExpectedNode(name, node.ip, f.gpu_count, inventory.ray.num_cpus),)
    wait = ray_cluster.wait_for_nodes(session, inventory, expected, join_timeout_s,
                                      on_event=on_event)
    if not wait.ok:
        out.step("rejoin", FAILED, "; ".join(f"{k}: {v}" for k, v in wait.problems.items()),
                 log_tails=dict(wait.log_tails))
        return out.stop(f"{name} did not rejoin within {join_timeout_s:g} s")
    entry = node_for_ip(wait.state.nodes, node.ip)
    out.new_node_id = entry.node_id if entry else None
    out.step("rejoin", CHANGED, f"{name} alive again as node {(out.new_node_id or '?')[:12]} "
             f"with {f.gpu_count} GPU(s)")
    state = ray_view(session, inventory)
    bad = apps_not_running(state.serve) if state.serve is not None else []
    if bad:
        out.step("verify", FAILED, "apps not RUNNING: " + "; ".join(bad))
        return out.stop("apps not healthy after the restart")
    out.step("verify", "ok", "every inventory node alive; every Serve app RUNNING")
    return out
