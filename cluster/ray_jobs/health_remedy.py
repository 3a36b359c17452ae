"""Runs ON the cluster inside the health job (cluster/ray_jobs/health_runner.py): after each
period's readings, applies `health.act` (cluster/ray/health_act.py, pure) and carries out its
cordons, so a sick node is taken out with the laptop closed.

A cordon is `cluster drain`'s drain (`ray drain-node`, reason preemption, the finding as its
message; rollout.drain_argv): the node takes no new work and Serve starts the replicas on it
elsewhere. A multi-node gang with a rank actor on the node is replaced as a whole: with
`health.act.gang_rebuild: surge` and room on the nodes that stay, Serve rolls its app (the new
gang, its placement group off the draining node, RUNNING before the old one stops); else the
rank actor is killed (its vLLM processes die with it: serve_apps/gang.py's PDEATHSIG), the
replica's watch fails the engine and Serve starts a new replica. A gang whose replica itself is
on the node is moved by Serve like any replica (its rank actors elsewhere end with it) and is
named among the gangs moved. A thread of the job then waits (at most `move_wait_s`) until no
replica or rank is left on the node and every app is RUNNING, and completes the record
(`moving` -> `moved` or
`not moved in time`, with how long that took); the readings go on every period meanwhile.

Every decision that is new while its finding lasts is a record (health_act.ActionRecord),
logged (the job's log in the Ray dashboard) and kept with the nodes cordoned now in
`cluster-health-actions.json` next to the readings file (replaced atomically, never through a
link). A cordoned node stays out until it rejoins Ray under a new node id (`cluster
restart-node` or `cluster uncordon`), which is recorded as `uncordoned`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Mapping

from cluster.ray.health_act import (CORDON, UNCORDONED, ActionRecord, ClusterView,
                                    actions_document, decide, new_decisions, observe, record_of)
from cluster.ray.health_job import ACTIONS_FILE, JobConfig, Reading, parse_actions
from cluster.ray.rollout import (app_demands, apps_not_running, drain_argv,
                                 gang_replicas_homed_on, gang_replicas_on, live_rank_holders,
                                 rank_holder, rebuild_config, replicas_on,
                                 room_for_replacements)

log = logging.getLogger("cluster.ray.health_job")
DRAIN_TIMEOUT_S = 120.0
MOVE_POLL_S = 3.0
MOVING = "moving"       # a cordon's outcome while the job waits for Serve to move its replicas
MAX_FILE_BYTES = 4 << 20


def write_atomic(path: str, doc: Mapping[str, Any]) -> None:
    """Replace `path` with the JSON document: a fresh file (O_EXCL | O_NOFOLLOW, Ray's session
    folder is writable by every local user), then rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    os.replace(tmp, path)


def read_existing(path: str) -> dict[str, Any] | None:
    """The actions file a previous run of the job left (its cordons stay), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        text = fh.read(MAX_FILE_BYTES + 1).decode("utf-8", "replace")
    try:
        return parse_actions(text) if len(text) <= MAX_FILE_BYTES else None
    except Exception:
        return None


class ClusterReads:
    """What the remedy reads of the cluster: Serve's details and the rank actors (the head's
    dashboard REST, as `cluster status` reads them: cluster/node_programs/head_state.py)."""

    def __init__(self, dashboard: str):
        self.dashboard = dashboard

    def serve_and_ranks(self) -> tuple[dict | None, list[dict]]:
        from cluster.node_programs.head_state import Budget, fetcher, rank_actors
        from cluster.node_programs._common import auth_token

        get = fetcher(self.dashboard, auth_token(os.environ, scan_ray=True), Budget(40.0))
        return get("/api/serve/applications/", 30), rank_actors(get)


def run_drain(gcs: str, node_id: str, message: str, deadline_s: int) -> tuple[bool, str]:
    """`ray drain-node` (the CLI `cluster drain` runs on the head), the token in the env only."""
    from cluster.node_programs._common import auth_token

    env = dict(os.environ)
    token = auth_token(env, scan_ray=True)
    if token:
        env["RAY_AUTH_TOKEN"] = token
        env.setdefault("RAY_AUTH_MODE", "token")
    argv = drain_argv([sys.executable, "-m", "ray.scripts.scripts"], gcs, node_id, message,
                      deadline_s)
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=DRAIN_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{type(exc).__name__}: {exc}"[:300]
    tail = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:]
    return p.returncode == 0, " ".join(tail)[:300]


def roll_app(dashboard: str, app: str, deployment: str, nonce: str) -> tuple[bool, str]:
    """Serve replaces every replica of `app`, each new one RUNNING before an old one stops
    (rollout.rebuild_config on the config Serve runs now), through the same GET + merge + PUT
    and lock as `cluster deploy` (node_programs/dashboard.py)."""
    from cluster.node_programs.dashboard import SERVE_APPLY_LOCK, Dashboard, apply
    from cluster.node_programs._common import auth_token

    def edit(details):
        live = ((details.get("applications") or {}).get(app) or {})
        config = live.get("deployed_app_config")
        if live.get("source") != "declarative" or not isinstance(config, dict):
            raise ValueError(f"app {app} was not deployed from a config: nothing to roll")
        target = (live.get("deployments") or {}).get(deployment) or {}
        replicas = target.get("target_num_replicas") or len(target.get("replicas") or []) or 1
        return rebuild_config(config, deployment, int(replicas), nonce)

    out: dict[str, Any] = {}
    try:
        api = Dashboard(dashboard, 30.0, auth_token(os.environ, scan_ray=True))
        apply(api, {}, out, SERVE_APPLY_LOCK, edit=edit)
    except Exception as exc:     # the dashboard, the lock, a config not from `cluster deploy`
        return False, f"{type(exc).__name__}: {exc}"[:300]
    if out.get("error") or out.get("status") != 200:
        return False, f"PUT {out.get('status')}: {out.get('error') or out.get('text')}"[:300]
    return True, "rolled"


def replica_names(serve: Mapping[str, Any]) -> list[str]:
    """`app/replica id` of every replica Serve lists (any state)."""
    return [f"{app_name}/{r.get('replica_id')}"
            for app_name, app in ((serve or {}).get("applications") or {}).items()
            for dep in (app.get("deployments") or {}).values()
            for r in dep.get("replicas") or []]


def start_thread(work: Callable[[], None], name: str) -> None:
    threading.Thread(target=work, daemon=True, name=name).start()


class Remedy:
    """The policy's state across periods and its execution (one per health job)."""

    def __init__(self, ray: Any, config: JobConfig, path: str, reads: Any = None,
                 drain: Callable[..., tuple[bool, str]] = run_drain,
                 roll: Callable[[str, str, str], tuple[bool, str]] | None = None,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep,
                 start: Callable[[Callable[[], None], str], None] = start_thread):
        self.ray, self.config, self.policy, self.path = ray, config, config.act, path
        self.reads = reads if reads is not None else ClusterReads(config.dashboard)
        self.drain, self.clock, self.sleep, self.start = drain, clock, sleep, start
        self.roll = roll if roll is not None else (
            lambda app, dep, nonce: roll_app(config.dashboard, app, dep, nonce))
        self.lock = threading.Lock()      # records and the file: the period's and a move's
        keep = max(max(self.policy.confirm.values()), self.policy.missed_after) + 1
        self.history: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=keep))
        self.cordoned: dict[str, dict[str, Any]] = {}
        self.cordon_times: list[float] = []
        self.seen: frozenset = frozenset()
        self.records: list[ActionRecord] = []
        self.move_started: dict[str, float] = {}    # a node being moved: when (monotonic)
        old = read_existing(path)
        if old:
            self.cordoned = {str(n): dict(c) for n, c in old["cordoned"].items()
                             if isinstance(c, dict)}
            self.cordon_times = [float(c["time"]) for c in self.cordoned.values()
                                 if isinstance(c.get("time"), (int, float))]

    # ------------------------------------------------------------ one period

    def after_round(self, readings: Mapping[str, list[Reading]], alive: Mapping[str, str],
                    resources: Mapping[str, Mapping[str, float]]) -> list[ActionRecord]:
        """The period's readings ({name: readings}), the alive Ray nodes ({node id: name}) and
        their resources ({name: totals}) -> the records of what was decided and done. A cordon's
        record is `moving` until its move ends (a thread: _finish_move)."""
        with self.lock:
            done = self._decide_and_act(readings, alive, resources)
        for r in done:
            if r.outcome == MOVING:
                self.start(lambda r=r: self._finish_move(r), f"health-move-{r.node}")
        return done

    def _decide_and_act(self, readings, alive, resources) -> list[ActionRecord]:
        now = self.clock()
        ids = {name: node_id for node_id, name in alive.items()}
        done = self._lifted(ids, now)
        for name, node_readings in readings.items():
            self.history[name].append(observe(name, ids.get(name, ""), node_readings, now))
        serve, ranks = self._serve_state()
        view = ClusterView(now, self.config.head,
                           {n: r for n, r in resources.items() if n in ids},
                           frozenset(self.cordoned), tuple(self.cordon_times),
                           tuple(app_demands(serve)), self._gang_nodes(serve, ranks, alive))
        fresh, self.seen = new_decisions(
            decide({n: list(h) for n, h in self.history.items()}, view, self.policy), self.seen)
        for d in fresh:
            if d.action == CORDON:
                staying = [(n, r) for n, r in view.nodes.items()
                           if n != d.node and n not in self.cordoned]
                done.append(self._cordon(d, ids.get(d.node, ""), serve, ranks, staying))
            else:
                done.append(record_of(d, now, ids.get(d.node)))
        for r in done:
            log.warning("health act: %s", r.line())
        self.records += done
        self.records = self.records[-self.policy.max_records:]
        self.write()
        return done

    def _lifted(self, ids: Mapping[str, str], now: float) -> list[ActionRecord]:
        """Cordoned nodes back in Ray under a new node id (restart-node / uncordon)."""
        out = []
        for name, c in list(self.cordoned.items()):
            if name in ids and ids[name] != c.get("node_id"):
                del self.cordoned[name]
                self.history.pop(name, None)
                out.append(ActionRecord(name, str(c.get("finding", "")), "", UNCORDONED,
                                        "the node rejoined Ray under a new node id", now,
                                        ids[name]))
        return out

    def _serve_state(self) -> tuple[dict | None, list[dict]]:
        try:
            return self.reads.serve_and_ranks()
        except Exception as exc:   # no Serve (no app deployed) or the dashboard did not answer
            log.info("serve state not read: %s: %s", type(exc).__name__, str(exc)[:200])
            return None, []

    @staticmethod
    def _gang_nodes(serve, ranks, alive: Mapping[str, str]) -> frozenset[str]:
        """Nodes holding a rank of a cross-node gang: its rank actors' and its replica's."""
        out = set()
        for node_id, name in alive.items():
            if gang_replicas_on(serve, ranks, node_id):
                out.add(name)
        holders = live_rank_holders(ranks)
        for app_name, app in ((serve or {}).get("applications") or {}).items():
            for dep in (app.get("deployments") or {}).values():
                for r in dep.get("replicas") or []:
                    if f"{app_name}/{r.get('replica_id')}" in holders and r.get("node_id") in alive:
                        out.add(alive[r["node_id"]])
        return frozenset(out)

    # ------------------------------------------------------------ a cordon

    def _cordon(self, d, node_id: str, serve, ranks, staying) -> ActionRecord:
        now = self.clock()
        base = record_of(d, now, node_id or None)
        if not node_id:
            return _with(base, outcome="not in Ray: nothing to drain")
        gcs = self.ray.get_runtime_context().gcs_address
        ok, why = self.drain(gcs, node_id, f"cluster health: {d.finding}: {d.evidence}"[:300],
                             self.policy.drain_deadline_s)
        if not ok:
            return _with(base, action="held", outcome=f"drain refused: {why}")
        self.cordoned[d.node] = {"node_id": node_id, "time": now, "finding": d.finding}
        self.cordon_times.append(now)
        lost = replicas_on(serve, node_id)
        gangs = gang_replicas_on(serve, ranks, node_id)
        homed = gang_replicas_homed_on(serve, ranks, node_id)   # Serve moves these (in `lost`)
        self.move_started[d.node] = time.monotonic()
        rebuild, rolled = self._rebuild(gangs, serve, staying, f"{d.node}@{now:.0f}")
        self._kill_ranks([a for a in ranks if rank_holder(a).partition("/")[0] not in rolled],
                         node_id)
        return _with(base, outcome=MOVING, replicas_moved=tuple(lost + gangs),
                     gangs_moved=tuple(sorted({f"{g['app']}/{g['replica_id']}"
                                               for g in gangs + homed})), gang_rebuild=rebuild)

    def _rebuild(self, gangs, serve, staying, nonce: str) -> tuple[str, frozenset]:
        """Replace the gangs with a rank on the node make before break when the nodes that stay
        hold one more of each beside everything running (Serve rolls each such app: a new
        replica, its placement group off the draining node, RUNNING before the old stops);
        else break before make (their ranks killed: Serve replaces the failed replicas).
        -> (how, for the record; the apps rolled)."""
        if not gangs:
            return "", frozenset()
        if self.policy.gang_rebuild != "surge":
            return "restart: health.act.gang_rebuild is restart", frozenset()
        room = room_for_replacements(serve, gangs, staying)
        if not room.ok:
            return f"restart: no room for a second gang beside the first: " \
                   f"{'; '.join(room.problems)}"[:300], frozenset()
        rolled, failed = set(), []
        for app, dep in sorted({(g["app"], g["deployment"]) for g in gangs}):
            ok, why = self.roll(app, dep, nonce)
            if ok:
                rolled.add(app)
            else:
                failed.append(f"{app}: {why}")
        if failed:
            return f"restart: the roll was refused: {'; '.join(failed)}"[:300], frozenset(rolled)
        return "surge", frozenset(rolled)

    def _finish_move(self, moving: ActionRecord) -> None:
        """(In its own thread) wait for the move, then complete the cordon's record."""
        moved = self._wait_moved(moving.node_id or "", frozenset(moving.gangs_moved))
        with self.lock:
            started = self.move_started.pop(moving.node, time.monotonic())
            done = _with(moving, outcome="moved" if moved else "not moved in time",
                         move_s=time.monotonic() - started)
            log.warning("health act: %s", done.line())
            self.records = [done if r is moving else r for r in self.records]
            self.write()

    def _kill_ranks(self, ranks, node_id: str) -> None:
        """The rank actors on the node: killed, so their gangs are replaced as wholes."""
        for a in ranks:
            if a.get("node_id") != node_id or a.get("state") != "ALIVE":
                continue
            try:
                self.ray.kill(self.ray.get_actor(a["name"], namespace=a.get("ray_namespace")))
            except Exception as exc:   # gone already
                log.info("rank actor %s: %s", a.get("name"), exc)

    def _wait_moved(self, node_id: str, gangs: frozenset = frozenset()) -> bool:
        """Until nothing of Serve is left on the node, no replica of the replaced gangs
        (`app/replica id`: their rank 0 may be on another node) is left, and every app is
        RUNNING: at most move_wait_s, and at most one read per MOVE_POLL_S of it."""
        deadline = time.monotonic() + self.policy.move_wait_s
        for _ in range(int(self.policy.move_wait_s / MOVE_POLL_S) + 1):
            serve, ranks = self._serve_state()
            if serve is not None and not replicas_on(serve, node_id) \
                    and not gang_replicas_on(serve, ranks, node_id) \
                    and not gangs & set(replica_names(serve)) \
                    and not apps_not_running(serve):
                return True
            if time.monotonic() >= deadline:
                break
            self.sleep(MOVE_POLL_S)
        return False

    def write(self) -> None:
        write_atomic(self.path, actions_document(self.records, self.cordoned, self.clock(),
                                                 self.policy.max_records))


def _with(r: ActionRecord, **changes: Any) -> ActionRecord:
    return dataclasses.replace(r, **changes)


def actions_path(readings_path: str) -> str:
    return os.path.join(os.path.dirname(readings_path), ACTIONS_FILE)

