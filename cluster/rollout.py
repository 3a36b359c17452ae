"""Rolling operations: nodes changed in batches (--serial N), Ray node drain with Serve replicas
moved off first, and restart of one worker's Ray only when the rest can carry the deployed apps.

Pure parts (batching, the apps' resource demand from Serve's details, the capacity verdict, the
drain command) are separate from the parts that run commands (drain, restart_node), which take
a Session like every other step (architecture.md: read, decide, then do).
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from cluster import ray_cluster
from cluster.facts import gather as gather_facts
from cluster.errors import UsageError
from cluster.inventory import Inventory, Node
from cluster.ray_cluster import (CHANGED, FAILED, KEEP, SKIPPED, UNREACHABLE, NodeAction, Plan,
                                 StepResult)
from cluster.ray_state import (GcsNode, RayState, gcs_address, head_client_env, node_for_ip,
                               query_state)
from cluster.remote import CommandResult

T = TypeVar("T")
Event = Callable[[str], None]

DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"   # Serve migrates replicas off preempted nodes
DEFAULT_DRAIN_DEADLINE_S = 600
DEFAULT_MOVE_WAIT_S = 600.0
DRAIN_TIMEOUT_S = 120.0


# ---------------------------------------------------------------- batches (--serial N)


def batches(items: Sequence[T], size: int) -> list[list[T]]:
    """items in consecutive batches of `size` (size <= 0: one batch with everything)."""
    items = list(items)
    if size <= 0 or size >= len(items):
        return [items] if items else []
    return [items[i:i + size] for i in range(0, len(items), size)]


def _keep(action: NodeAction) -> NodeAction:
    return NodeAction(action.node, KEEP, "not in this batch")


def _not_run_after(action: NodeAction, why: str) -> StepResult:
    return StepResult(action.node, action.kind, SKIPPED if action.changes
                      else action.status_if_not_run, why if action.changes else action.reason)


def _failed(step: StepResult) -> bool:
    return step.status in (FAILED, UNREACHABLE)


def execute_up_serial(plan: Plan, session, inventory: Inventory, serial: int,
                      stagger_s: float = 0.0, on_event: Event = lambda _: None,
                      execute: Callable[..., tuple[StepResult, ...]] | None = None
                      ) -> tuple[StepResult, ...]:
    """`cluster up --serial N`: the head (when it changes) with the first N changing workers,
    then the next N workers once the previous batch succeeded. A batch with a failure stops
    the rollout: the workers not yet touched are reported skipped."""
    execute = execute or ray_cluster.execute_up
    head = inventory.head.name
    changing = [a for a in plan.actions if a.node != head and a.changes]
    groups = batches(changing, serial)
    if plan.refused or len(groups) <= 1:
        return execute(plan, session, inventory, stagger_s, on_event)
    later = {a.node for g in groups[1:] for a in g}
    first = replace(plan, actions=tuple(a for a in plan.actions if a.node not in later))
    on_event(f"batch 1/{len(groups)}: {', '.join(a.node for a in groups[0])}")
    done = {s.node: s for s in execute(first, session, inventory, stagger_s, on_event)}
    stop_why = None
    if any(_failed(done[n]) or done[n].status == SKIPPED
           for n in [head] + [a.node for a in groups[0]]):
        stop_why = "not run: batch 1 failed (--serial stops on the first failure)"
    for i, group in enumerate(groups[1:], start=2):
        if stop_why:
            for a in group:
                done[a.node] = _not_run_after(a, stop_why)
            continue
        on_event(f"batch {i}/{len(groups)}: {', '.join(a.node for a in group)}")
        sub = replace(plan, actions=(_keep(plan.action(head)),) + tuple(group))
        for s in execute(sub, session, inventory, stagger_s, on_event):
            if s.node != head:
                done[s.node] = s
        if any(_failed(done[a.node]) for a in group):
            stop_why = f"not run: batch {i} failed (--serial stops on the first failure)"
    return tuple(done[a.node] for a in plan.actions)


def execute_down_serial(plan: Plan, session, inventory: Inventory, serial: int,
                        on_event: Event = lambda _: None,
                        execute: Callable[..., tuple[StepResult, ...]] | None = None
                        ) -> tuple[StepResult, ...]:
    """`cluster down --serial N`: workers N at a time, then the head. A failed batch stops the
    rollout (the head keeps running so the nodes left can still be seen and retried)."""
    execute = execute or ray_cluster.execute_down
    head = inventory.head.name
    changing = [a for a in plan.actions if a.node != head and a.changes]
    groups = batches(changing, serial)
    if len(groups) <= 1:
        return execute(plan, session, inventory, on_event)
    done: dict[str, StepResult] = {}
    for a in plan.actions:
        if a.node != head and not a.changes:
            done[a.node] = StepResult(a.node, a.kind, a.status_if_not_run, a.reason)
    stop_why = None
    for i, group in enumerate(groups, start=1):
        if stop_why:
            for a in group:
                done[a.node] = _not_run_after(a, stop_why)
            continue
        on_event(f"batch {i}/{len(groups)}: {', '.join(a.node for a in group)}")
        sub = replace(plan, actions=tuple(group) + (_keep(plan.action(head)),))
        for s in execute(sub, session, inventory, on_event):
            if s.node != head:
                done[s.node] = s
        if any(_failed(done[a.node]) for a in group):
            stop_why = f"not run: batch {i} failed (--serial stops on the first failure)"
    ha = plan.action(head)
    if stop_why:
        done[head] = _not_run_after(ha, stop_why)
    else:
        sub = replace(plan, actions=(ha,))
        done[head] = execute(sub, session, inventory, on_event)[0]
    return tuple(done[a.node] for a in plan.actions)


# ---------------------------------------------------------------- what the deployed apps need


@dataclass(frozen=True)
class Demand:
    """One replica of one deployment: its bundles (one bundle when it has no placement group)."""

    app: str
    deployment: str
    bundles: tuple[Mapping[str, float], ...]
    strategy: str = "PACK"

    @property
    def gpus(self) -> float:
        return sum(float(b.get("GPU", 0)) for b in self.bundles)

    @property
    def cpus(self) -> float:
        return sum(float(b.get("CPU", 0)) for b in self.bundles)


def app_demands(serve_details: Mapping[str, Any] | None) -> list[Demand]:
    """Serve's instance details (GET /api/serve/applications/) -> one Demand per target replica.

    A deployment with `placement_group_bundles` needs those bundles per replica; otherwise its
    `ray_actor_options` (num_cpus default 1, as Ray's actors in Serve, num_gpus default 0)."""
    out = []
    for app_name, app in ((serve_details or {}).get("applications") or {}).items():
        for dname, dep in (app.get("deployments") or {}).items():
            cfg = dep.get("deployment_config") or {}
            n = dep.get("target_num_replicas")
            if n is None:
                n = cfg.get("num_replicas")
            if n is None:
                n = len(dep.get("replicas") or [])
            bundles = cfg.get("placement_group_bundles")
            if bundles:
                bs = tuple({str(k): float(v) for k, v in b.items()} for b in bundles)
                strategy = str(cfg.get("placement_group_strategy") or "PACK")
            else:
                opts = cfg.get("ray_actor_options") or {}
                bs = ({"CPU": float(opts.get("num_cpus", 1) if opts.get("num_cpus")
                                    is not None else 1),
                       "GPU": float(opts.get("num_gpus") or 0)},)
                strategy = "PACK"
            out += [Demand(app_name, dname, bs, strategy) for _ in range(int(n or 0))]
    return out


@dataclass(frozen=True)
class Capacity:
    """Can the nodes that stay carry the apps? With the numbers either way."""

    ok: bool
    needed_gpus: float
    needed_cpus: float
    available_gpus: float
    available_cpus: float
    nodes: tuple[str, ...]
    problems: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "needed": {"GPU": self.needed_gpus, "CPU": self.needed_cpus},
                "available": {"GPU": self.available_gpus, "CPU": self.available_cpus},
                "nodes": list(self.nodes), "problems": list(self.problems)}

    def summary(self) -> str:
        return (f"the apps need {self.needed_gpus:g} GPUs and {self.needed_cpus:g} CPUs; "
                f"the other alive nodes ({', '.join(self.nodes) or 'none'}) have "
                f"{self.available_gpus:g} GPUs and {self.available_cpus:g} CPUs")


def capacity_without(demands: Sequence[Demand], remaining: Sequence[tuple[str, Mapping[str, float]]]
                     ) -> Capacity:
    """The verdict for running `demands` on `remaining` [(name, total resources)]. Pure.

    Totals first (GPU, CPU), then a first-fit-decreasing placement of the bundles: STRICT_PACK
    groups need one node for all their bundles, STRICT_SPREAD groups one node per bundle, other
    bundles go anywhere they fit (a conservative approximation of Ray's scheduler)."""
    need_g = sum(d.gpus for d in demands)
    need_c = sum(d.cpus for d in demands)
    have_g = sum(float(r.get("GPU", 0)) for _, r in remaining)
    have_c = sum(float(r.get("CPU", 0)) for _, r in remaining)
    names = tuple(n for n, _ in remaining)
    problems = []
    if need_g > have_g:
        problems.append(f"GPUs: {need_g:g} needed, {have_g:g} on the other alive nodes")
    if need_c > have_c:
        problems.append(f"CPUs: {need_c:g} needed, {have_c:g} on the other alive nodes")
    if not problems:
        free = [dict((k, float(v)) for k, v in r.items()) for _, r in remaining]
        for d in sorted(demands, key=lambda d: (d.gpus, d.cpus), reverse=True):
            if not _place(d, free):
                problems.append(f"{d.app}/{d.deployment}: a replica's bundles "
                                f"{[dict(b) for b in d.bundles]} ({d.strategy}) fit on no "
                                "remaining node")
                break
    return Capacity(not problems, need_g, need_c, have_g, have_c, names, tuple(problems))


def _fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v)


def _take(bundle: Mapping[str, float], free: dict[str, float]) -> None:
    for k, v in bundle.items():
        free[k] = free.get(k, 0.0) - v


def _merged(bundles: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def _place(d: Demand, free: list[dict[str, float]]) -> bool:
    if d.strategy == "STRICT_PACK":
        whole = _merged(d.bundles)
        for node in free:
            if _fits(whole, node):
                _take(whole, node)
                return True
        return False
    trial = [dict(n) for n in free]
    used: set[int] = set()
    for b in d.bundles:
        spots = [i for i, n in enumerate(trial) if _fits(b, n)
                 and not (d.strategy == "STRICT_SPREAD" and i in used)]
        if not spots:
            return False
        _take(b, trial[spots[0]])
        used.add(spots[0])
    free[:] = trial
    return True


# ---------------------------------------------------------------- drain


def drain_command(inventory: Inventory, node_id: str, message: str,
                  deadline_s: int = DEFAULT_DRAIN_DEADLINE_S, auth_mode: str | None = None) -> str:
    """`ray drain-node` run on the head (Ray's GCS DrainNode RPC, the API autoscaler v2 and
    KubeRay use): the node takes no new work and Serve starts replacement replicas elsewhere
    before stopping the ones on it. The env is the head's (token auth, like `cluster status`)."""
    if not all(c in "0123456789abcdefABCDEF" for c in node_id) or not node_id:
        raise UsageError(f"not a Ray node id: {node_id!r}")
    # The client needs the cluster's token-auth mode (as `ray start` got it), no secrets.
    return head_client_env(inventory, auth_mode) + shlex.join(
        ray_cluster.ray_cli(inventory) + [
            "drain-node", "--address", gcs_address(inventory), "--node-id", node_id,
            "--reason", DRAIN_REASON, "--reason-message", message,
            "--deadline-remaining-seconds", str(int(deadline_s))]) + " </dev/null"


def replicas_on(serve_details: Mapping[str, Any] | None, node_id: str) -> list[dict[str, Any]]:
    """Serve replicas (any state but stopped) on the node: [{app, deployment, replica_id, state}]."""
    out = []
    for app_name, app in ((serve_details or {}).get("applications") or {}).items():
        for dname, dep in (app.get("deployments") or {}).items():
            for r in dep.get("replicas") or []:
                if r.get("node_id") == node_id and r.get("state") not in ("STOPPING",):
                    out.append({"app": app_name, "deployment": dname,
                                "replica_id": r.get("replica_id"), "state": r.get("state")})
    return out


def apps_not_running(serve_details: Mapping[str, Any] | None) -> list[str]:
    return [f"{name}: {app.get('status')}"
            for name, app in ((serve_details or {}).get("applications") or {}).items()
            if app.get("status") != "RUNNING"]


@dataclass
class RolloutOutcome:
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
                "results": [r.to_dict() for r in self.results]}

    def step(self, name: str, status: str, message: str, **extra: Any) -> None:
        self.steps.append({"step": name, "status": status, "message": message, **extra})

    def stop(self, why: str, code: int = 2) -> "RolloutOutcome":
        self.stopped, self.exit_code = why, code
        return self


def _worker(inventory: Inventory, name: str) -> Node:
    node = inventory.node(name)
    if node.is_head:
        raise UsageError(f"{name} is the head: it holds the GCS and the Serve controller; "
                         "draining or restarting it stops the cluster (use `cluster down` / `up`)")
    return node


def _state(session, inventory: Inventory) -> RayState:
    state, _ = query_state(session, inventory, include_serve=True)
    return state


def _remaining(state: RayState, inventory: Inventory, node: GcsNode
               ) -> list[tuple[str, Mapping[str, float]]]:
    names = {n.ip: n.name for n in inventory.nodes}
    return [(names.get(n.ip, n.ip), n.resources) for n in state.nodes or ()
            if n.alive and n.node_id != node.node_id]


def locate(session, inventory: Inventory, name: str, out: RolloutOutcome
           ) -> tuple[RayState, GcsNode] | None:
    """The head's view and the node's alive entry, or None (out says why, exit 2)."""
    node = _worker(inventory, name)
    state = _state(session, inventory)
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


def wait_moved(session, inventory: Inventory, node_id: str, wait_s: float,
               on_event: Event, poll_s: float = 3.0) -> tuple[bool, list[dict], RayState]:
    """Poll until no Serve replica is on the node and every app is RUNNING (at most wait_s)."""
    end = time.monotonic() + wait_s
    last = ""
    while True:
        state = _state(session, inventory)
        left = replicas_on(state.serve, node_id) if state.answered else [{"state": "unknown"}]
        pending = apps_not_running(state.serve) if state.serve is not None else ["serve: no answer"]
        if not left and not pending:
            return True, left, state
        msg = f"{len(left)} replica(s) still on the node; apps not running: {pending or 'none'}"
        if msg != last:
            on_event(msg)
            last = msg
        if time.monotonic() + poll_s > end:
            return False, left, state
        time.sleep(poll_s)


def drain(session, inventory: Inventory, name: str, *, dry_run: bool, confirm: Callable[[str], bool],
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
    out.capacity = capacity_without(demands, _remaining(state, inventory, entry))
    head_facts = gather_facts(session, inventory, [inventory.head])
    auth = ray_cluster.cluster_auth_mode(inventory, head_facts)
    cmd = drain_command(inventory, entry.node_id, f"cluster {command} {name}", deadline_s, auth)
    out.planned.append(f"[{inventory.head.name}] $ {cmd}")
    if check_capacity and not out.capacity.ok:
        return out.stop(f"refused: {name} cannot be taken out: {out.capacity.summary()} ("
                        + "; ".join(out.capacity.problems) + ")")
    if dry_run:
        return out.stop("dry run", 0)
    replicas = replicas_on(state.serve, entry.node_id)
    if not confirm(f"Drain {name} (Ray node {entry.node_id[:12]}): it takes no new work and "
                   f"{len(replicas)} Serve replica(s) move to other nodes. Continue?"):
        return out.stop("not confirmed")
    on_event(f"draining {name}")
    r = session.run(inventory.head, cmd, timeout=DRAIN_TIMEOUT_S)
    out.results.append(r)
    if not r.ok:
        detail = (r.stderr.strip() or r.stdout.strip() or r.error or "").splitlines()[-1:]
        out.step("drain", FAILED, f"ray drain-node: {r.status} (exit {r.exit_code}): "
                 + " ".join(detail))
        return out.stop("drain not accepted")
    out.step("drain", CHANGED, f"drain accepted for node {entry.node_id[:12]}")
    out.moved_replicas = replicas
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


def restart_node(session, inventory: Inventory, name: str, *, dry_run: bool,
                 confirm: Callable[[str], bool], wait_s: float = DEFAULT_MOVE_WAIT_S,
                 join_timeout_s: float = 240.0, on_event: Event = lambda _: None
                 ) -> RolloutOutcome:
    """Drain a worker, `ray stop` on it, start it with the command `cluster up` would run,
    wait until it is alive again with its GPUs/CPUs and the apps are RUNNING."""
    node = _worker(inventory, name)
    facts = gather_facts(session, inventory)
    stop = ray_cluster.stop_command(inventory)
    f = facts[name]
    if not f.usable:
        out = RolloutOutcome("restart-node", name)
        return out.stop(f"{name} unreachable or unusable: {f.error}")
    auth = ray_cluster.cluster_auth_mode(inventory, facts)
    start = ray_cluster.start_command(node, inventory, f.gpus, auth)
    out = drain(session, inventory, name, dry_run=dry_run, confirm=confirm, wait_s=wait_s,
                on_event=on_event, command="restart-node")
    out.planned += [f"[{name}] $ {stop}", f"[{name}] $ {start}"]
    if out.stopped:
        return out
    on_event(f"restarting Ray on {name}")
    action = NodeAction(name, ray_cluster.RESTART, "restart-node", (stop, start))
    plan = Plan("up", (NodeAction(inventory.head.name, KEEP, "kept"), action))
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
    state = _state(session, inventory)
    bad = apps_not_running(state.serve) if state.serve is not None else []
    if bad:
        out.step("verify", FAILED, "apps not RUNNING: " + "; ".join(bad))
        return out.stop("apps not healthy after the restart")
    out.step("verify", "ok", "every inventory node alive; every Serve app RUNNING")
    return out


def dumps(outcome: RolloutOutcome) -> str:
    return json.dumps(outcome.to_dict(), indent=2)
