"""The env `ray start` gives a node: one table from inventory fields to variables.

`START_ENV` is the one home of the mapping: each managed variable, the inventory field (or
policy) it comes from, and how its value is derived. Every direction reads it: the start env
itself (`start_env`), the node's fabric env handed to vLLM ranks (`fabric_env`), the
cluster-wide defaults of a deployment's runtime_env (`uniform_fabric_env`), the facts probe's
list of variables to report (`MANAGED_ENV`) and, in reverse, the field named when an inventory
`env:` entry is overridden (`field_of`, `env_conflicts`). Pure; imports only the inventory and
the head's endpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from cluster.nodes.endpoints import prometheus_url
from cluster.nodes.inventory import SERVE_INGRESS, Inventory, Node, RayOptions


@dataclass(frozen=True)
class StartSettings:
    """The cluster-wide inputs of a node's start env beside the node itself."""

    auth_mode: str | None = None                    # token | disabled; None: not set
    serve_ingress: str = RayOptions.serve_ingress


@dataclass(frozen=True)
class EnvVar:
    """One managed variable: its name, the inventory field (or policy) it follows, its value
    for a node (None: not set), and whether it belongs to the node's fabric (the network env
    vLLM ranks get too) and differs by node by nature (VLLM_HOST_IP is always the node's IP)."""

    name: str
    field: str
    value: Callable[[Node, StartSettings], str | None]
    fabric: bool = False
    per_node: bool = False


START_ENV: tuple[EnvVar, ...] = (
    EnvVar("NCCL_SOCKET_IFNAME", "nccl_socket_ifname",
           lambda node, _: node.nccl_socket_ifname or None, fabric=True),
    EnvVar("GLOO_SOCKET_IFNAME", "gloo_socket_ifname",
           lambda node, _: node.gloo_socket_ifname or None, fabric=True),
    EnvVar("NCCL_IB_HCA", "ib_hcas", lambda node, _: ",".join(node.ib_hcas) or None, fabric=True),
    EnvVar("VLLM_HOST_IP", "node_ip", lambda node, _: node.ip, fabric=True, per_node=True),
    EnvVar("RAY_USAGE_STATS_ENABLED", "usage-stats policy", lambda node, _: "0"),
    EnvVar("RAY_AUTH_MODE", "head's auth mode", lambda node, s: s.auth_mode or None),
    EnvVar("RAY_SERVE_ENABLE_HA_PROXY", "ray.serve_ingress",
           lambda node, s: SERVE_INGRESS[s.serve_ingress]),
)

# The inventory env entries handed only to `cluster model pull`'s hub download (on its stdin),
# never to `ray start`: every Ray job and model code on the node would read them from its env.
PULL_ONLY_ENV: tuple[str, ...] = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def ray_visible_env(env: Mapping[str, str]) -> dict[str, str]:
    """The inventory env less PULL_ONLY_ENV: what `ray start` (and so every Ray worker) gets."""
    return {k: v for k, v in env.items() if k not in PULL_ONLY_ENV}


# What a Ray start env must carry (the variables this toolkit sets, beside the inventory's env).
MANAGED_ENV: tuple[str, ...] = tuple(v.name for v in START_ENV)
_BY_NAME: Mapping[str, EnvVar] = {v.name: v for v in START_ENV}


_INGRESS_ENV = next(v.name for v in START_ENV if v.field == "ray.serve_ingress")


def field_of(name: str) -> str:
    """The inventory field (or policy) a managed variable follows."""
    return _BY_NAME[name].field


def managed_env(node: Node, settings: StartSettings,
                variables: Sequence[EnvVar] = START_ENV) -> dict[str, str]:
    """The managed variables that have a value on this node."""
    env = {}
    for var in variables:
        value = var.value(node, settings)
        if value is not None:
            env[var.name] = value
    return env


FABRIC_ENV: tuple[EnvVar, ...] = tuple(v for v in START_ENV if v.fabric)


def fabric_env(node: Node) -> dict[str, str]:
    """The node's own network env for Ray workers and vLLM ranks: NCCL/GLOO interfaces,
    HCAs, VLLM_HOST_IP = the node's IP."""
    return managed_env(node, StartSettings(), FABRIC_ENV)


def uniform_fabric_env(inventory: Inventory) -> dict[str, str]:
    """The fabric variables every node of the inventory sets to the same value (a deployment's
    cluster-wide defaults; the per-node ones come from `ray start`)."""
    env = {}
    for var in FABRIC_ENV:
        if var.per_node:
            continue
        values = {var.value(node, StartSettings()) for node in inventory.nodes}
        value = values.pop() if len(values) == 1 else None
        if value:
            env[var.name] = value
    return env


# Serve's HAProxy ingress keeps its config, lock, server state and two unix sockets in
# /tmp/haproxy-serve/<node id>/ by default, a folder made with the umask (0755) in /tmp: its admin
# socket (`level admin`, mode 666) answered any local user, who could repoint the replicas'
# servers at a listener of their own (the requests and their API keys) or take the listening
# socket, and a user who made /tmp/haproxy-serve first owned the folder of the config that
# HAProxy, run as the Ray user, loads (Lua included). `ray start` gets these paths in a new
# folder of its own instead, made by `mktemp -d` (0700, a name no one can guess or take first):
# in /run when the Ray user is root (no one else writes there, and nothing ages it away: a /tmp
# cleaner that removed an idle folder would let another user make the now-known name again),
# else in the sticky /tmp (no one else can rename it). Ray adds the node id below it
# (haproxy.py `_per_node`). Neither, or a failed mktemp, refuses the start (exit 3, one line).
SERVE_HAPROXY_DIR_NAME = "cluster-hap.XXXXXXXX"
SERVE_HAPROXY_DIR_PARENTS = ("/run", "/tmp")     # root's, anyone's
SERVE_HAPROXY_FILES: Mapping[str, str] = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}
# HAProxy 2.8 refuses a stats socket path over 97 bytes (room for its .<pid>.tmp); Ray's admin
# socket is <folder>/<56-hex node id>/admin.sock: 93 bytes from either parent.
SERVE_HAPROXY_SOCKET_MAX = 97
SERVE_HAPROXY_REFUSED_EXIT = 3
# The HAProxy paths a running raylet is asked for: the admin socket's and the config's (a Ray
# started before they were exported keeps Ray's /tmp default: `up` says so). Two, not five: the
# probe's command line is evidence of ~10 checks a node (the preflight JSON's size); an
# inventory entry for any of the five is warned on the laptop (serve_haproxy_env_conflicts).
SERVE_HAPROXY_CHECKED: tuple[str, ...] = ("RAY_SERVE_HAPROXY_SOCKET_PATH",
                                          "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC")
# The running raylet's variables the facts probe reports.
REPORTED_ENV: tuple[str, ...] = MANAGED_ENV + SERVE_HAPROXY_CHECKED


def serve_haproxy_dir_prefix(serve_ingress: str) -> str:
    """The shell words before a node's `ray start` (ending in " && ") that make the HAProxy
    ingress's private folder and export SERVE_HAPROXY_FILES into it; "" for the Python proxy
    ingress. Constant text: no inventory value reaches it."""
    if serve_ingress != "haproxy":
        return ""
    exports = " ".join(f'{name}="$h{"/" + leaf if leaf else ""}"'
                       for name, leaf in SERVE_HAPROXY_FILES.items())
    return ('{ if [ "$(id -u)" = 0 ] && [ -d /run ] && [ -O /run ]; then b=/run; '
            'elif [ -d /tmp ] && [ -k /tmp ]; then b=/tmp; else b=; fi; '
            f'[ -n "$b" ] && h=$(mktemp -d "$b/{SERVE_HAPROXY_DIR_NAME}") '
            '|| { echo "cluster: no private folder for Serve\'s HAProxy files (mktemp -d in /run '
            'as root, else in a sticky /tmp); or set ray.serve_ingress: proxy" >&2; '
            f'exit {SERVE_HAPROXY_REFUSED_EXIT}; }}; }} && export {exports} && ')


def serve_haproxy_folders() -> tuple[str, ...]:
    """The prefixes of the folders serve_haproxy_dir_prefix makes ("/run/cluster-hap.", ...)."""
    name = SERVE_HAPROXY_DIR_NAME.rstrip("X")
    return tuple(f"{parent}/{name}" for parent in SERVE_HAPROXY_DIR_PARENTS)


def serve_haproxy_drift(running_env: Mapping[str, str]) -> str | None:
    """Why a running Ray's HAProxy files are not in a folder serve_haproxy_dir_prefix made
    (None: they are, or Ray runs Serve's Python proxy)."""
    if running_env.get(_INGRESS_ENV) != SERVE_INGRESS["haproxy"]:
        return None
    folders = serve_haproxy_folders()
    bad = [k for k in SERVE_HAPROXY_CHECKED
           if not str(running_env.get(k) or "").startswith(folders)]
    if not bad:
        return None
    return ("Ray runs Serve's HAProxy with " + ", ".join(bad) + " outside a private "
            + " or ".join(f + "*" for f in folders) + " folder (Ray's default is "
            "/tmp/haproxy-serve, whose admin socket answers every local user)")


def serve_haproxy_env_conflicts(node: Node, serve_ingress: str) -> list[str]:
    """Inventory env entries that replace the private folder of Serve's HAProxy files."""
    if serve_ingress != "haproxy":
        return []
    return [f"{node.name}: env {k}={node.env[k]!r} replaces the private folder `ray start` "
            "makes for Serve's HAProxy files (docs/security.md)"
            for k in SERVE_HAPROXY_FILES if k in node.env]


def head_env(ray: RayOptions) -> dict[str, str]:
    """RAY_PROMETHEUS_HOST (and RAY_GRAFANA_HOST / RAY_GRAFANA_IFRAME_HOST when the inventory
    names a Grafana) for the head's `ray start`: Ray's dashboard reads them at start."""
    env: dict[str, str] = {}
    url = prometheus_url(ray)
    if url:
        env["RAY_PROMETHEUS_HOST"] = url
    if ray.grafana_url:
        env["RAY_GRAFANA_HOST"] = ray.grafana_url
        env["RAY_GRAFANA_IFRAME_HOST"] = ray.grafana_iframe_url or ray.grafana_url
    return env


def start_env(node: Node, auth_mode: str | None = None,
              serve_ingress: str = RayOptions.serve_ingress,
              ray: RayOptions | None = None) -> dict[str, str]:
    """The env `ray start` gets on a node: the inventory's env (less PULL_ONLY_ENV: the hub
    token is the pull's only), then the managed variables.

    Set at start time so every Ray worker process on the node inherits them (env exported later
    never reaches Ray workers: vllm#6803). VLLM_HOST_IP is always the node's IP (vllm#7815).
    RAY_AUTH_MODE (when given) is the cluster-wide token-auth mode: `ray start --head` turns
    token auth on by itself when the head has ~/.ray/auth_token, `ray start --address` does not,
    so every node gets it explicitly. RAY_SERVE_ENABLE_HA_PROXY follows the inventory's
    ray.serve_ingress (Serve reads it in the controller and on every node at import time).
    With `ray` given, the head also gets RAY_PROMETHEUS_HOST / RAY_GRAFANA_* (ray.metrics,
    cluster/ray/prometheus_head.py), read by Ray's dashboard at start.
    """
    env = ray_visible_env(node.env)
    env.update(managed_env(node, StartSettings(auth_mode, serve_ingress)))
    if ray is not None and node.is_head:
        env.update(head_env(ray))
    return env


def env_conflicts(node: Node, serve_ingress: str = RayOptions.serve_ingress) -> list[str]:
    """Inventory env entries the dedicated fields override, or that replace the private folder
    of Serve's HAProxy files (reported as plan warnings)."""
    out = []
    final = start_env(node, node.env.get("RAY_AUTH_MODE"), serve_ingress)
    for key in MANAGED_ENV:
        if key in node.env and node.env[key] != final[key]:
            out.append(f"{node.name}: env {key}={node.env[key]!r} is overridden by "
                       f"{final[key]!r} (from the node's {field_of(key)})")
    return out + serve_haproxy_env_conflicts(node, serve_ingress)
