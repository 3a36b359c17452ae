"""What the running Ray cluster says about itself: nodes, versions and Serve apps, read on the head.

The dashboard is bound to 127.0.0.1 on the head by default (it has no authentication), so the
laptop usually cannot reach it. The query therefore runs the on-node program
cluster/node_programs/head_state.py on the head over SSH: it reads the dashboard's REST API
(`/api/version`, `/api/v0/nodes`, the state API, and `/api/serve/applications/`), and falls back
to the GCS client (`ray._raylet.GcsClient`) for the node table when the dashboard does not
answer (it starts a few seconds after the GCS).

Pure parts: `parse_state_output` (the program's document -> RayState) and `cluster_status`
(inventory + RayState -> the documented `cluster status --json` document).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from cluster.nodes.endpoints import dashboard_url, gcs_address, head_dashboard_base
from cluster.planning.gang import RANK_NAMESPACE, rank_actor_name
from cluster.nodes.inventory import Inventory, public_env
from cluster.node_programs import Call, document_of, failure, program_call, run_call
from cluster.nodes.shell import env_prefix

STATE_PROGRAM = "head_state"       # cluster/node_programs/head_state.py, run on the head
LABEL_NODE = "cluster-toolkit/node"
LABEL_GPU_MODEL = "cluster-toolkit/gpu-model"
RESOURCE_HOST_PREFIX = "host:"
RESOURCE_GPU_MODEL_PREFIX = "gpu_model:"



@dataclass(frozen=True)
class GcsNode:
    """One node as Ray's GCS knows it."""

    node_id: str
    ip: str
    alive: bool
    is_head: bool = False
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    start_time_ms: int = 0
    state_message: str | None = None

    @property
    def gpus(self) -> float:
        return float(self.resources.get("GPU", 0))

    @property
    def cpus(self) -> float:
        return float(self.resources.get("CPU", 0))

    @property
    def gpu_model(self) -> str | None:
        """The GPU model label this toolkit set, else a gpu_model:/accelerator_type: resource."""
        if self.labels.get(LABEL_GPU_MODEL):
            return self.labels[LABEL_GPU_MODEL]
        for key in sorted(self.resources):
            for prefix in (RESOURCE_GPU_MODEL_PREFIX, "accelerator_type:"):
                if key.startswith(prefix):
                    return key[len(prefix):]
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "ip": self.ip, "alive": self.alive,
                "is_head": self.is_head, "resources": dict(self.resources),
                "labels": dict(self.labels), "start_time_ms": self.start_time_ms,
                "state_message": self.state_message}


@dataclass(frozen=True)
class RayState:
    """The head's answer: where it came from, Ray's version, the node table, Serve details."""

    source: str | None                 # "dashboard" | "gcs" | None (nothing answered)
    ray_version: str | None
    nodes: tuple[GcsNode, ...] | None  # None when neither the dashboard nor the GCS answered
    serve: Mapping[str, Any] | None
    errors: tuple[str, ...] = ()
    rank_actors: tuple[Mapping[str, Any], ...] = ()   # multi-node engines' rank actors

    @property
    def answered(self) -> bool:
        return self.nodes is not None

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "ray_version": self.ray_version,
                "nodes": None if self.nodes is None else [n.to_dict() for n in self.nodes],
                "serve": self.serve, "rank_actors": [dict(a) for a in self.rank_actors],
                "errors": list(self.errors)}


# ---------------------------------------------------------------- the query (one SSH command)


def head_client_env(inventory: Inventory, auth_mode: str | None = None) -> str:
    """`env K=V ... ` for a Ray client command run on the head: the head's env less its
    secret-looking entries (a client needs none, and command lines show in ps and run logs),
    plus RAY_AUTH_MODE when given. '' when there is nothing to set."""
    env = public_env(inventory.head.env, inventory.secret_names)
    if auth_mode:
        env["RAY_AUTH_MODE"] = auth_mode
    return env_prefix(env)


def state_call(inventory: Inventory, include_serve: bool = True) -> Call:
    """The command (and its stdin) that prints the head's view of the cluster."""
    return program_call(inventory.ray.python, STATE_PROGRAM,
                        [head_dashboard_base(inventory), gcs_address(inventory), "1" if include_serve else "0"],
                        env_prefix=head_client_env(inventory))


def parse_state_output(data: Mapping[str, Any]) -> RayState:
    """The head program's JSON document -> RayState (pure)."""
    nodes = None
    if data.get("nodes") is not None:
        nodes = tuple(_gcs_node(raw) for raw in data["nodes"])
    actors = data.get("rank_actors") or ()
    return RayState(source=data.get("source"), ray_version=data.get("ray_version"), nodes=nodes,
                    serve=data.get("serve"), errors=tuple(data.get("errors") or ()),
                    rank_actors=tuple(a for a in actors if isinstance(a, dict))[:MAX_RANK_ACTORS])


def state_of(result, head: str) -> RayState:
    """The state query's CommandResult -> RayState (unanswered, with the reason, when the
    program gave no document)."""
    got = document_of(result, STATE_PROGRAM)
    if isinstance(got, dict):
        return parse_state_output(got)
    why = ("the state query printed no result",) if got.reached else ()
    return RayState(None, None, None, None, why + (failure(got, f"head {head}"),))


def _gcs_node(raw: Mapping[str, Any]) -> GcsNode:
    resources = {str(k): float(v) for k, v in (raw.get("resources_total") or {}).items()}
    return GcsNode(node_id=str(raw.get("node_id") or ""),
                   ip=str(raw.get("node_ip") or raw.get("node_manager_address") or ""),
                   alive=str(raw.get("state", "")).upper() == "ALIVE",
                   is_head=bool(raw.get("is_head_node")),
                   resources=resources,
                   labels={str(k): str(v) for k, v in (raw.get("labels") or {}).items()},
                   start_time_ms=int(raw.get("start_time_ms") or 0),
                   state_message=raw.get("state_message"))


def query_state(session, inventory: Inventory, include_serve: bool = True,
                timeout: float = 60.0) -> tuple[RayState, Any]:
    """Run the state query on the head. Returns (RayState, the CommandResult)."""
    call = state_call(inventory, include_serve)
    result = run_call(session, inventory.head, call, timeout=timeout)
    return state_of(result, inventory.head.name), result


# ---------------------------------------------------------------- matching Ray to the inventory


MAX_RANK_ACTORS = 100000


def app_nnodes(app: Mapping[str, Any]) -> int:
    """engine_kwargs.nnodes of a Serve application's deployed args (1 when absent/odd)."""
    config = app.get("deployed_app_config") or {}
    args = config.get("args") if isinstance(config, Mapping) else None
    kwargs = (args or {}).get("engine_kwargs") if isinstance(args, Mapping) else None
    value = (kwargs or {}).get("nnodes", 1) if isinstance(kwargs, Mapping) else 1
    return value if isinstance(value, int) and not isinstance(value, bool) \
        and 1 <= value <= 1024 else 1


def replica_ranks(app_name: str, replica: Mapping[str, Any], nnodes: int,
                  actors: Sequence[Mapping[str, Any]], ip_of_node_id: Mapping[str, str],
                  name_of_ip: Mapping[str, str]) -> list[dict[str, Any]]:
    """[{rank, node, node_ip, pid, state}] of one replica: node rank 0 is the replica itself,
    node rank n its rank actor (state running / dead / missing) (pure)."""
    ip = replica.get("node_ip")
    state = str(replica.get("state") or "?")
    ranks = [{"rank": 0, "node": name_of_ip.get(ip), "node_ip": ip, "pid": replica.get("pid"),
              "state": "running" if state == "RUNNING" else state.lower()}]
    by_name: dict[str, Mapping[str, Any]] = {}
    for actor in actors:
        if actor.get("ray_namespace") not in (None, RANK_NAMESPACE):
            continue
        name = str(actor.get("name") or "")
        if name not in by_name or actor.get("state") == "ALIVE":
            by_name[name] = actor
    for rank in range(1, nnodes):
        actor = by_name.get(rank_actor_name(app_name, str(replica.get("replica_id")), rank))
        if actor is None:
            ranks.append({"rank": rank, "node": None, "node_ip": None, "pid": None,
                          "state": "missing"})
            continue
        actor_ip = ip_of_node_id.get(str(actor.get("node_id") or ""))
        pid = actor.get("pid")
        ranks.append({"rank": rank, "node": name_of_ip.get(actor_ip), "node_ip": actor_ip,
                      "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                      "state": "running" if actor.get("state") == "ALIVE" else "dead"})
    return ranks


def node_for_ip(nodes: Sequence[GcsNode], ip: str) -> GcsNode | None:
    """The GCS entry for an IP: the alive one (newest if several), else the newest dead one."""
    matches = [n for n in nodes if n.ip == ip]
    if not matches:
        return None
    matches.sort(key=lambda n: (n.alive, n.start_time_ms), reverse=True)
    return matches[0]


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def cluster_status(inventory: Inventory, state: RayState, head_reached: bool = True) -> dict:
    """The `cluster status --json` document (keys documented in docs/ray.md)."""
    head = inventory.head
    doc: dict[str, Any] = {
        "ray_version": state.ray_version,
        "dashboard_url": dashboard_url(inventory),
        "head": {"name": head.name, "ip": head.ip, "gcs_address": gcs_address(inventory),
                 "reachable": head_reached, "answered": state.answered,
                 "source": state.source},
        "nodes": [],
        "serve": {"applications": serve_applications(
            state.serve, state.rank_actors, {n.node_id: n.ip for n in state.nodes or ()},
            {n.ip: n.name for n in inventory.nodes})} if state.serve is not None else None,
        "missing": [],
        "errors": list(state.errors),
    }
    if not state.answered:
        doc["missing"] = [n.name for n in inventory.nodes]
        return doc
    by_ip = {n.ip: n for n in inventory.nodes}
    seen: set[str] = set()
    for node in inventory.nodes:
        entry = node_for_ip(state.nodes, node.ip)
        if entry is None or not entry.alive:
            doc["missing"].append(node.name)
        if entry is not None:
            doc["nodes"].append(_node_doc(node.name, entry))
            seen.add(entry.node_id)
    for entry in state.nodes:  # alive Ray nodes the inventory does not name
        if entry.alive and entry.node_id not in seen and entry.ip not in by_ip:
            doc["nodes"].append(_node_doc(None, entry))
    return doc


def _node_doc(name: str | None, entry: GcsNode) -> dict[str, Any]:
    return {"name": name, "node_id": entry.node_id, "alive": entry.alive, "ip": entry.ip,
            "is_head": entry.is_head, "gpus": _number(entry.gpus), "cpus": _number(entry.cpus),
            "gpu_model": entry.gpu_model,
            "resources": {k: _number(v) for k, v in sorted(entry.resources.items())},
            "labels": dict(entry.labels), "state_message": entry.state_message}


def serve_applications(details: Mapping[str, Any] | None,
                       rank_actors: Sequence[Mapping[str, Any]] = (),
                       ip_of_node_id: Mapping[str, str] | None = None,
                       name_of_ip: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Serve's instance details -> {app: {status, route_prefix, message, deployments,
    replicas: [{replica_id, deployment, state, node, node_ip, pid, ranks}], broken_ranks}}.
    broken_ranks: the ranks of a multi-node engine that are dead or missing while their
    replica is RUNNING (each takes the whole replica, so the app, down with it)."""
    apps: dict[str, Any] = {}
    ip_of_node_id, name_of_ip = ip_of_node_id or {}, name_of_ip or {}
    for name, app in ((details or {}).get("applications") or {}).items():
        deployments, replicas_doc, broken = {}, [], []
        nnodes = app_nnodes(app)
        for dname, dep in (app.get("deployments") or {}).items():
            replicas = dep.get("replicas") or []
            running = sum(1 for r in replicas if r.get("state") == "RUNNING")
            deployments[dname] = {"status": dep.get("status"), "message": dep.get("message") or "",
                                  "replicas": len(replicas), "running_replicas": running}
            for r in replicas:
                ranks = replica_ranks(name, r, nnodes, rank_actors, ip_of_node_id, name_of_ip)
                replicas_doc.append({"replica_id": r.get("replica_id"), "deployment": dname,
                                     "state": r.get("state"), "node": ranks[0]["node"],
                                     "node_ip": r.get("node_ip"), "pid": r.get("pid"),
                                     "ranks": ranks})
                if r.get("state") == "RUNNING":
                    broken += [{"replica_id": r.get("replica_id"), **rank} for rank in ranks[1:]
                               if rank["state"] != "running"]
        apps[name] = {"status": app.get("status"), "route_prefix": app.get("route_prefix"),
                      "message": app.get("message") or "", "deployments": deployments,
                      "nnodes": nnodes, "replicas": replicas_doc, "broken_ranks": broken}
    return apps


def status_exit_code(doc: Mapping[str, Any]) -> int:
    """0 when every inventory node is alive in Ray, 2 otherwise (head unreachable included)."""
    return 0 if doc["head"]["answered"] and not doc["missing"] else 2
