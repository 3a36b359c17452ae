"""Rolling operations: nodes changed in batches (--serial N), Ray node drain with Serve replicas
moved off first, and restart of one worker's Ray only when the rest can carry the deployed apps.

Pure parts only (batching, the apps' resource demand from Serve's details, the capacity verdict,
the drain command) plus the serial executors of up/down; the drain and
restart-node orchestrations (and their RolloutOutcome) are playbooks/drain.py and
playbooks/restart_node.py.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from cluster.ray import ray_cluster
from cluster.base.errors import UsageError
from cluster.nodes.inventory import Inventory, Node
from cluster.ray.ray_cluster import (FAILED, KEEP, SKIPPED, UNREACHABLE, NodeAction, RayActionPlan,
                                 StepResult)
from cluster.ray.ray_state import GcsNode, RayState, gcs_address, head_client_env
from cluster.nodes.shell import SECRET_ENV_FROM_STDIN

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


def execute_up_serial(plan: RayActionPlan, session, inventory: Inventory, serial: int,
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


def execute_down_serial(plan: RayActionPlan, session, inventory: Inventory, serial: int,
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


# ---------------------------------------------------------------- Serve's own roll settings

# The deployment options Serve reads for a roll (ray.serve.config.DeploymentConfig): with a
# surge, Serve starts the replacements first and stops an old replica only once a new one runs.
SURGE_KEY, ROLLOUT_KEY = "max_surge_percent", "rolling_update_percentage"
# An env var of the app's runtime_env that the health job sets to rebuild an app's replicas: the
# runtime_env is part of Serve's code version (deploy_utils.get_app_code_version), so a new value
# restarts every replica, rolling, and changes nothing else.
REBUILD_ENV = "CLUSTER_REBUILD"


def serve_surge(percent: int, target: int) -> int:
    """Replicas Serve starts beyond the target for max_surge_percent (its integer ceiling)."""
    return (percent * target + 99) // 100


def serve_rollout(batch: int, target: int) -> tuple[int, dict[str, Any]]:
    """(the batch Serve will really use, {max_surge_percent, rolling_update_percentage}) so that
    Serve replaces `batch` replicas at a time, the new ones started first. The surge is a whole
    percent of the target, so above 100 replicas the batch may round up."""
    if target < 1 or batch < 1:
        raise UsageError(f"a roll needs at least one replica and a batch of one (got {target} "
                         f"replicas, batch {batch})")
    batch = min(batch, target)
    percent = next(p for p in range(1, 101) if serve_surge(p, target) >= batch)
    real = serve_surge(percent, target)
    # rollout_size = max(int(fraction * target), 1): half a replica above keeps int() exact
    fraction = min(1.0, (real + 0.5) / target)
    return real, {SURGE_KEY: percent, ROLLOUT_KEY: round(fraction, 6)}


def rebuild_config(app_config: Mapping[str, Any], deployment: str, replicas: int,
                   nonce: str) -> dict[str, Any]:
    """An app's deployed config (Serve's `deployed_app_config`) that makes Serve replace every
    replica one at a time, each replacement RUNNING before an old one stops: REBUILD_ENV set to
    `nonce` in its runtime_env, the surge options on `deployment` (kept: its other overrides).
    Pure."""
    _, options = serve_rollout(1, max(1, replicas))
    runtime_env = dict(app_config.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), REBUILD_ENV: nonce}
    overrides = [dict(d) for d in app_config.get("deployments") or []]
    mine = next((d for d in overrides if d.get("name") == deployment), None)
    if mine is None:
        overrides.append({"name": deployment, **options})
    else:
        mine.update(options)
    return {**app_config, "runtime_env": runtime_env, "deployments": overrides}


def room_for_replacements(serve_details: Mapping[str, Any] | None,
                          replacing: Sequence[Mapping[str, Any]],
                          remaining: Sequence[tuple[str, Mapping[str, float]]]) -> Capacity:
    """Whether the nodes that stay carry every app's replicas plus one more replica of each
    gang being replaced (`replacing`: [{app, deployment}]), started before the old one stops.
    The old replicas are counted whole on the nodes that stay (conservative). Pure."""
    demands = app_demands(serve_details)
    extra = []
    for g in replacing:
        like = next((d for d in demands if d.app == g["app"] and d.deployment == g["deployment"]),
                    None)
        if like is not None:
            extra.append(like)
    return capacity_without(demands + extra, remaining)


# ---------------------------------------------------------------- drain


def drain_command(inventory: Inventory, node_id: str, message: str,
                  deadline_s: int = DEFAULT_DRAIN_DEADLINE_S, auth_mode: str | None = None) -> str:
    """`ray drain-node` run on the head (Ray's GCS DrainNode RPC, the API autoscaler v2 and
    KubeRay use): the node takes no new work and Serve starts replacement replicas elsewhere
    before stopping the ones on it. The env is the head's (token auth, like `cluster status`)."""
    # The client needs the cluster's token-auth mode (as `ray start` got it) and, when the
    # inventory's env gives the token, that env from stdin (run_node_command), never argv.
    secrets = SECRET_ENV_FROM_STDIN + " && " if ray_cluster.secret_env_stdin(inventory.head) \
        else ""
    return secrets + head_client_env(inventory, auth_mode) + shlex.join(
        drain_argv(ray_cluster.ray_cli(inventory), gcs_address(inventory), node_id, message,
                   deadline_s)) + " </dev/null"


def drain_argv(ray_cli: Sequence[str], gcs: str, node_id: str, message: str,
               deadline_s: int) -> list[str]:
    """`ray drain-node`'s argv (the one drain of `cluster drain` and the health job's cordon)."""
    if not all(c in "0123456789abcdefABCDEF" for c in node_id) or not node_id:
        raise UsageError(f"not a Ray node id: {node_id!r}")
    return list(ray_cli) + ["drain-node", "--address", gcs, "--node-id", node_id,
                            "--reason", DRAIN_REASON, "--reason-message", message,
                            "--deadline-remaining-seconds", str(int(deadline_s))]


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


def gang_replicas_on(serve_details: Mapping[str, Any] | None,
                     rank_actors: Sequence[Mapping[str, Any]], node_id: str
                     ) -> list[dict[str, Any]]:
    """Replicas of multi-node engines whose node rank > 0 (a rank actor) is on the node, the
    replica itself elsewhere: each loses its whole engine with the node.
    [{app, deployment, replica_id, state, rank}] (pure)."""
    replicas = {}
    for app_name, app in ((serve_details or {}).get("applications") or {}).items():
        for dname, dep in (app.get("deployments") or {}).items():
            for r in dep.get("replicas") or []:
                replicas[(app_name, str(r.get("replica_id")))] = (dname, r)
    out = []
    for actor in rank_actors:
        if actor.get("node_id") != node_id or actor.get("state") != "ALIVE":
            continue
        app_name, _, rest = str(actor.get("name") or "").partition("/")
        replica_id, _, rank = rest.rpartition("/rank")
        found = replicas.get((app_name, replica_id))
        if found is None or not rank.isdigit():
            continue
        dname, r = found
        if r.get("node_id") == node_id or r.get("state") in ("STOPPING",):
            continue    # the replica itself is on the node: replicas_on lists it
        out.append({"app": app_name, "deployment": dname, "replica_id": replica_id,
                    "state": r.get("state"), "rank": int(rank)})
    return out


def rank_holder(actor: Mapping[str, Any]) -> str:
    """`app/replica id` of the replica a rank actor belongs to (its name is
    `app/replica id/rankN`: serve_apps/gang.py)."""
    return str(actor.get("name") or "").rpartition("/rank")[0]


def live_rank_holders(rank_actors: Sequence[Mapping[str, Any]]) -> set[str]:
    """`app/replica id` of every replica with an ALIVE rank actor."""
    return {rank_holder(a) for a in rank_actors if a.get("state") == "ALIVE"}


def gang_replicas_homed_on(serve_details: Mapping[str, Any] | None,
                           rank_actors: Sequence[Mapping[str, Any]], node_id: str
                           ) -> list[dict[str, Any]]:
    """Replicas of multi-node engines that are themselves on the node (node rank 0) with a
    live rank actor elsewhere: Serve moves the replica, and its ranks go with it.
    [{app, deployment, replica_id, state}] (pure)."""
    holders = live_rank_holders(rank_actors)
    return [r for r in replicas_on(serve_details, node_id)
            if f"{r['app']}/{r['replica_id']}" in holders]


def replicas_lost_with(state: RayState, node_id: str) -> list[dict[str, Any]]:
    """Every replica that goes down with the node: its own, and the multi-node replicas
    holding a rank there (those carry `rank`)."""
    return replicas_on(state.serve, node_id) + gang_replicas_on(state.serve, state.rank_actors,
                                                                node_id)


def apps_not_running(serve_details: Mapping[str, Any] | None) -> list[str]:
    return [f"{name}: {app.get('status')}"
            for name, app in ((serve_details or {}).get("applications") or {}).items()
            if app.get("status") != "RUNNING"]


def worker(inventory: Inventory, name: str) -> Node:
    """The inventory worker `name`; UsageError for the head (draining it stops the cluster)."""
    node = inventory.node(name)
    if node.is_head:
        raise UsageError(f"{name} is the head: it holds the GCS and the Serve controller; "
                         "draining or restarting it stops the cluster (use `cluster down` / `up`)")
    return node


def remaining_nodes(state: RayState, inventory: Inventory, node: GcsNode
                    ) -> list[tuple[str, Mapping[str, float]]]:
    """(name, resources) of the alive Ray nodes other than `node`: what must carry the apps."""
    names = {n.ip: n.name for n in inventory.nodes}
    return [(names.get(n.ip, n.ip), n.resources) for n in state.nodes or ()
            if n.alive and n.node_id != node.node_id]
