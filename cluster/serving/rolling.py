"""A rolling change of a running app: the ordered steps and the free capacity at each one (pure).

Ray Serve rolls a new version itself (ray/serve/_private/deployment_state.py): with the
deployment option `max_surge_percent` > 0 it starts the replacements first and stops an old
replica only once the running count exceeds the target (a new one is RUNNING: for our app, its
engine started and its warm-up generation answered); `rolling_update_percentage` bounds how many
old replicas stop at once. A multi-node engine is one Serve replica (one placement group over
its nodes), so a gang rolls as a whole. This module predicts those steps for a batch size
(`--max-unavailable N`: N replicas replaced at a time), places each step's new replicas in the
free capacity the cluster has then (the old ones still holding theirs) and says where a step
would not fit: the capacity gate before each step, decided before anything changes.

    plan_roll(old replicas, old footprint, new footprint, replicas, free per node, N) -> RollPlan
    serve_rollout(N, replicas) -> the two deployment options that make Serve take those steps
    failed_step(plan, old ids, Serve's state after) -> the first step that did not complete
    renamed(old config, new app) -> (old, new) deployment names when a change renames it
    replicas_of_record(deploy.json) -> the replicas a past deploy left running (a dry run
        without a head plans from them)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.base.errors import UsageError
from cluster.ray.rollout import (REBUILD_ENV, ROLLOUT_KEY, SURGE_KEY,  # noqa: F401
                                 serve_rollout, serve_surge)

RESOURCES = ("GPU", "CPU")
# Serve's app states that still hold replicas (a STOPPING one still holds its bundles).
HOLDING_STATES = ("STARTING", "PENDING_MIGRATION", "UPDATING", "RECOVERING", "RUNNING",
                  "STOPPING")


@dataclass(frozen=True)
class Footprint:
    """What one replica reserves: its placement group's bundles and their strategy."""

    bundles: tuple[Mapping[str, float], ...]
    strategy: str

    def total(self, resource: str) -> float:
        return sum(float(b.get(resource, 0)) for b in self.bundles)

    def without(self, resource: str) -> "Footprint":
        """The same reservation with `resource` not counted (a capacity that is not known)."""
        return Footprint(tuple({r: v for r, v in b.items() if r != resource}
                               for b in self.bundles), self.strategy)


@dataclass(frozen=True)
class Replica:
    """A running replica of the old version and the node of each of its bundles (one name:
    all of them on that node)."""

    replica_id: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class RollStep:
    """One step: start `start` new replicas (placed on `placed`), wait until each is RUNNING
    (warm-up answered), then stop the old replicas `stop`; the free capacity before and after."""

    index: int
    start: int
    stop: tuple[str, ...]
    placed: tuple[tuple[str, ...], ...]
    free_before: Mapping[str, float]
    free_after: Mapping[str, float]
    short: str | None = None          # why the new replicas do not fit (None: they do)

    @property
    def fits(self) -> bool:
        return self.short is None

    def describe(self) -> str:
        parts = []
        if self.start:
            where = "; ".join(",".join(dict.fromkeys(p)) for p in self.placed) or "?"
            parts.append(f"start {self.start} new replica(s) (on {where}) and wait until ready")
        if self.stop:
            parts.append(f"stop {', '.join(self.stop)}")
        return ", then ".join(parts) or "nothing"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.index, "start": self.start, "stop": list(self.stop),
                "placed": [list(p) for p in self.placed], "free_before": dict(self.free_before),
                "free_after": dict(self.free_after), "fits": self.fits, "short": self.short,
                "what": self.describe()}


@dataclass(frozen=True)
class RollPlan:
    """The ordered steps of one roll and the Serve options that make Serve take them."""

    batch: int
    steps: tuple[RollStep, ...]
    options: Mapping[str, Any]

    @property
    def problems(self) -> list[str]:
        return [f"roll step {s.index} of {len(self.steps)} ({s.describe()}) does not fit: "
                f"{s.short}" for s in self.steps if not s.fits]

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "serve_options": dict(self.options),
                "steps": [s.to_dict() for s in self.steps], "problems": self.problems}


# ---------------------------------------------------------------- Serve's own roll settings


def with_roll_options(app: Mapping[str, Any], max_unavailable: int,
                      replicas: int) -> dict[str, Any]:
    """The app with its deployment's roll options in the config's `deployments:` overrides
    (lightweight options: outside the args, so they never change Serve's code version)."""
    from serve_apps.config import deployment_name

    _, options = serve_rollout(max_unavailable, replicas)
    model_id = app["args"]["model_loading_config"]["model_id"]
    return {**app, "deployments": [{"name": deployment_name(model_id), **options}]}


# ---------------------------------------------------------------- placing replicas (first fit)


def _sum(free: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    return {r: round(sum(float(n.get(r, 0)) for n in free.values()), 3) for r in RESOURCES}


def _fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(float(bundle.get(r, 0)) <= float(node.get(r, 0)) + 1e-9 for r in RESOURCES)


def _take(free: dict[str, dict[str, float]], node: str, bundle: Mapping[str, float]) -> None:
    for r in RESOURCES:
        free[node][r] = float(free[node].get(r, 0)) - float(bundle.get(r, 0))


def _give(free: dict[str, dict[str, float]], node: str, bundle: Mapping[str, float]) -> None:
    if node in free:
        for r in RESOURCES:
            free[node][r] = float(free[node].get(r, 0)) + float(bundle.get(r, 0))


def place(footprint: Footprint, free: dict[str, dict[str, float]]) -> tuple[str, ...] | None:
    """The node of each bundle of one replica in `free` (taken from it), or None (nothing taken)
    when it does not fit: STRICT_PACK all on one node, STRICT_SPREAD each on its own node,
    PACK one node when one holds it all else first fit, SPREAD first fit over distinct nodes
    first. Nodes in name order, so the plan is the same every time."""
    names = sorted(free)
    whole = {r: footprint.total(r) for r in RESOURCES}
    if footprint.strategy in ("STRICT_PACK", "PACK"):
        for name in names:
            if _fits(whole, free[name]):
                for b in footprint.bundles:
                    _take(free, name, b)
                return tuple(name for _ in footprint.bundles)
        if footprint.strategy == "STRICT_PACK":
            return None
    trial = {n: dict(v) for n, v in free.items()}
    chosen: list[str] = []
    for bundle in footprint.bundles:
        spread = footprint.strategy in ("SPREAD", "STRICT_SPREAD")
        order = ([n for n in names if n not in chosen] + ([] if footprint.strategy ==
                                                           "STRICT_SPREAD" else chosen)
                 if spread else names)
        node = next((n for n in order if _fits(bundle, trial[n])), None)
        if node is None:
            return None
        _take(trial, node, bundle)
        chosen.append(node)
    free.update(trial)
    return tuple(chosen)


def _short(footprint: Footprint, count: int, free: Mapping[str, Mapping[str, float]]) -> str:
    need = ", ".join(f"{footprint.total(r) * count:g} {r}" for r in RESOURCES
                     if footprint.total(r))
    have = "; ".join(f"{n} {', '.join(f'{v.get(r, 0):g} {r}' for r in RESOURCES)}"
                     for n, v in sorted(free.items()))
    return (f"{count} new replica(s) need {need} ({len(footprint.bundles)} bundle(s) each, "
            f"{footprint.strategy}) beside the running ones; free: {have or 'no node'}")


# ---------------------------------------------------------------- the steps


def plan_roll(old: Sequence[Replica], old_footprint: Footprint, new_footprint: Footprint,
              replicas: int, free: Mapping[str, Mapping[str, float]],
              max_unavailable: int = 1) -> RollPlan:
    """The steps Serve takes from the `old` replicas to `replicas` new ones, `max_unavailable`
    at a time, the new ones started before old ones stop. `free`: node -> the resources free
    now (the old replicas still hold theirs). Surplus old replicas (fewer wanted) stop first,
    as Serve does; extra new ones start in the first step with its batch."""
    batch, options = serve_rollout(max_unavailable, replicas)
    room = {n: {r: float(v.get(r, 0)) for r in RESOURCES} for n, v in free.items()}
    left = list(old)
    started = 0
    steps: list[RollStep] = []
    while left or started < replicas:
        before = _sum(room)
        surplus = len(left) - replicas if started == 0 else 0
        if surplus > 0:
            start = 0
        else:
            start = min(replicas - started, batch + max(replicas - len(left) - started, 0))
        placed, short = [], None
        for _ in range(start):
            where = place(new_footprint, room)
            if where is None:
                short = _short(new_footprint, start - len(placed), room)
                break
            placed.append(where)
        started += start
        stop = min(batch, max(len(left) + started - replicas, 0), len(left))
        gone, left = left[:stop], left[stop:]
        for replica in gone:
            nodes = replica.nodes if len(replica.nodes) == len(old_footprint.bundles) else \
                tuple(replica.nodes[:1]) * len(old_footprint.bundles)
            for node, bundle in zip(nodes, old_footprint.bundles):
                _give(room, node, bundle)
        steps.append(RollStep(len(steps) + 1, start, tuple(r.replica_id for r in gone),
                              tuple(placed), before, _sum(room), short))
        if short is not None or (start == 0 and stop == 0):
            break            # a step that cannot happen: the roll stops there
    return RollPlan(batch, tuple(steps), options)


# ---------------------------------------------------------------- from Serve's details


def app_changed(old_config: Mapping[str, Any] | None, new_app: Mapping[str, Any]) -> bool:
    """Whether Serve restarts the replicas: its code version hashes the import path, the
    runtime_env and the args (ray.serve._private.deploy_utils.get_app_code_version)."""
    if not old_config:
        return False

    def key(app: Mapping[str, Any]) -> str:
        return json.dumps({k: app.get(k) for k in ("import_path", "runtime_env", "args")},
                          sort_keys=True, default=str)
    return key(old_config) != key(new_app)


def keeping_rebuild(running: Mapping[str, Any] | None,
                    new_app: Mapping[str, Any]) -> Mapping[str, Any]:
    """The new app config with the running one's REBUILD_ENV (set by the health job's rebuild of
    a gang) when it has none of its own: a deploy of the same config then changes nothing, and a
    changed one rolls as it would have."""
    value = (((running or {}).get("runtime_env") or {}).get("env_vars") or {}).get(REBUILD_ENV)
    runtime_env = dict(new_app.get("runtime_env") or {})
    env = dict(runtime_env.get("env_vars") or {})
    if value is None or REBUILD_ENV in env:
        return new_app
    return {**new_app, "runtime_env": {**runtime_env, "env_vars": {**env, REBUILD_ENV: value}}}


def deployment_of(app: Mapping[str, Any] | None) -> str | None:
    """The Serve deployment name an app config makes (from its served model name)."""
    from serve_apps.config import deployment_name

    model_id = (((app or {}).get("args") or {}).get("model_loading_config") or {}).get(
        "model_id")
    return deployment_name(str(model_id)) if model_id else None


def renamed(old_config: Mapping[str, Any] | None,
            new_app: Mapping[str, Any]) -> tuple[str, str] | None:
    """(old, new) deployment names when the change renames the app's deployment (a new served
    model name): Serve deletes a deployment that is gone from the config and starts the new
    one beside it, so nothing rolls. None when the name stays (or nothing runs)."""
    old, new = deployment_of(old_config), deployment_of(new_app)
    return (old, new) if old and new and old != new else None


def replicas_of_record(record: Mapping[str, Any]) -> list[Replica]:
    """The replicas a deploy record (deploy.json of a deploy that ended RUNNING) lists, each
    with the nodes of its ranks (a single-node replica: its node)."""
    out = []
    for raw in record.get("replicas") or []:
        if not isinstance(raw, Mapping):
            continue
        nodes = tuple(str(r.get("node") or "?") for r in raw.get("ranks") or []
                      if isinstance(r, Mapping)) or (str(raw.get("node") or "?"),)
        out.append(Replica(str(raw.get("replica_id") or "?"), nodes))
    return out


def free_beside(total: Mapping[str, Mapping[str, float]], replicas: Sequence[Replica],
                footprint: Footprint) -> dict[str, dict[str, float]]:
    """node -> resources free: the totals less what `replicas` (of one footprint) reserve."""
    free = {n: {r: float(v.get(r, 0)) for r in RESOURCES} for n, v in total.items()}
    for replica in replicas:
        nodes = replica.nodes if len(replica.nodes) == len(footprint.bundles) else \
            tuple(replica.nodes[:1]) * len(footprint.bundles)
        for node, bundle in zip(nodes, footprint.bundles):
            if node in free:
                _take(free, node, bundle)
    return free


def old_replicas(details: Mapping[str, Any] | None, name: str,
                 node_names: Mapping[str, str]) -> list[Replica]:
    """The app's replicas that hold bundles now, each with its node (node_ip -> inventory name;
    an unknown IP is kept as it is)."""
    app = ((details or {}).get("applications") or {}).get(name) or {}
    out = []
    for dep in (app.get("deployments") or {}).values():
        for raw in dep.get("replicas") or []:
            if raw.get("state") in HOLDING_STATES:
                ip = str(raw.get("node_ip") or "?")
                out.append(Replica(str(raw.get("replica_id") or "?"),
                                   (node_names.get(ip, ip),)))
    return out


def free_capacity(total: Mapping[str, Mapping[str, float]], details: Mapping[str, Any] | None,
                  node_names: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """node -> resources free: the alive nodes' totals less what every app's live replicas
    reserve (Serve's deployment config: placement_group_bundles, else the actor's num_cpus and
    num_gpus), put on the replica's node (a bundle whose node Serve does not report: there
    too)."""
    free = {n: {r: float(v.get(r, 0)) for r in RESOURCES} for n, v in total.items()}
    for app in ((details or {}).get("applications") or {}).values():
        for dep in ((app or {}).get("deployments") or {}).values():
            bundles = footprint_of_deployment(dep).bundles
            for raw in dep.get("replicas") or []:
                if raw.get("state") not in HOLDING_STATES:
                    continue
                ip = str(raw.get("node_ip") or "")
                node = node_names.get(ip, ip)
                for bundle in bundles if node in free else ():
                    _take(free, node, bundle)
    return free


def footprint_of_deployment(dep: Mapping[str, Any]) -> Footprint:
    """One replica's reservation from Serve's deployment details."""
    config = dep.get("deployment_config") or {}
    bundles = config.get("placement_group_bundles")
    if not bundles:
        actor = config.get("ray_actor_options") or {}
        bundles = [{"CPU": float(actor.get("num_cpus") or 0),
                    "GPU": float(actor.get("num_gpus") or 0)}]
    return Footprint(tuple({r: float(b.get(r, 0)) for r in RESOURCES} for b in bundles),
                     str(config.get("placement_group_strategy") or "PACK"))


def footprint_of_preview(preview: Mapping[str, Any]) -> Footprint:
    """One replica's reservation from deploy.placement_preview (serve_apps' own rules)."""
    bundles = preview.get("bundles_per_replica") or [
        {"CPU": float((preview.get("replica_actor") or {}).get("num_cpus") or 0),
         "GPU": float((preview.get("replica_actor") or {}).get("num_gpus") or 0)}]
    return Footprint(tuple({r: float(b.get(r, 0)) for r in RESOURCES} for b in bundles),
                     str(preview.get("strategy") or "PACK"))


def failed_step(plan: RollPlan, old_ids: Sequence[str], state) -> int:
    """The first step that did not complete, from Serve's state when the wait ended
    (deploy.AppState): a step completed when as many new replicas RUNNING as the steps up to
    it started and its old replicas are gone."""
    live = [r for r in state.replicas if not r.dead] if state is not None else []
    running_new = sum(1 for r in live if r.state == "RUNNING" and r.replica_id not in old_ids)
    alive_old = {r.replica_id for r in live if r.replica_id in old_ids and r.state != "STOPPING"}
    started = 0
    for step in plan.steps:
        started += step.start
        if running_new < started or alive_old & set(step.stop):
            return step.index
    return len(plan.steps)
