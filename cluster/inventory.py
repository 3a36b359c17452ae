"""Inventory (cluster.yaml): load, validate with file:line errors, resolve, select nodes.

Lookup order: -i/--inventory PATH, then $CLUSTER_INVENTORY, then ./cluster.yaml, then the
embedded default (one node `localhost`, run locally without SSH). Every value that can reach a
remote shell is either validated against a safe character set here or quoted with shlex where
it is used.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from cluster.errors import InventoryError

ENV_VAR = "CLUSTER_INVENTORY"
DEFAULT_FILE = "cluster.yaml"
RUN_DIR_ENV = "CLUSTER_RUN_DIR"
EMBEDDED = "<embedded default>"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*\.?"
                      r"|\d{1,3}(?:\.\d{1,3}){3}|\[?[0-9A-Fa-f:]+\]?)$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$", re.IGNORECASE)
_IFACE_RE = re.compile(r"^[\^=]?[A-Za-z0-9._:@-]+(?:,[\^=]?[A-Za-z0-9._:@-]+)*$")
_HCA_RE = re.compile(r"^[\^=]?[A-Za-z0-9._-]+(?::\d+)?$")
_PATH_RE = re.compile(r"^[A-Za-z0-9._/~+@%=,:-]+$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_KEY_RE = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
REDACTED = "***"
# ray.serve_ingress -> the value of RAY_SERVE_ENABLE_HA_PROXY in every node's `ray start` env.
SERVE_INGRESS = {"haproxy": "1", "proxy": "0"}


@dataclass(frozen=True)
class SSHOptions:
    """Cluster-wide SSH settings (per-node user/port/identity/jump host override them)."""

    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    known_hosts: str | None = None
    accept_unknown_host_keys: bool = False
    connect_timeout: float = 10.0
    command_timeout: float = 120.0
    jump_host: str | None = None
    max_parallel: int = 32


@dataclass(frozen=True)
class Node:
    """One server: how to reach it and what Ray/NCCL must use on it."""

    name: str
    address: str
    role: str = "worker"
    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    jump_host: str | None = None
    node_ip: str | None = None
    nccl_socket_ifname: str | None = None
    gloo_socket_ifname: str | None = None
    ib_hcas: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    local: bool = False
    profile: str | None = None

    @property
    def is_head(self) -> bool:
        return self.role == "head"

    @property
    def ip(self) -> str:
        """The IP Ray and NCCL must use on this node."""
        return self.node_ip or self.address


@dataclass(frozen=True)
class RayOptions:
    """Ray ports and start options (fixed ports avoid the intermittent-startup class of failures).

    serve_ingress: how HTTP reaches the Serve replicas. "haproxy" (default): Serve's HAProxy
    ingress (RAY_SERVE_ENABLE_HA_PROXY=1 at `ray start`), which forwards each connection to the
    replica's own HTTP server; "proxy": Serve's Python proxy actor on every node. Measured in
    docs/serving.md: only the HAProxy ingress keeps streaming at vLLM's own speed at c=16.
    """

    port: int = 6379
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265
    client_server_port: int = 10001
    node_manager_port: int = 8076
    object_manager_port: int = 8077
    min_worker_port: int = 10002
    max_worker_port: int = 10999
    dashboard_agent_listen_port: int = 52365
    dashboard_agent_grpc_port: int = 8078
    runtime_env_agent_port: int = 8079
    metrics_export_port: int = 8080
    object_store_memory: int | None = None
    num_cpus: int | None = None
    memory: int | None = None
    temp_dir: str | None = None
    serve_port: int = 8000
    python: str = "python3"
    serve_ingress: str = "haproxy"      # haproxy | proxy (see SERVE_INGRESS)


@dataclass(frozen=True)
class Inventory:
    """The resolved cluster description. `expectations` holds defaults merged with overrides."""

    path: str
    nodes: tuple[Node, ...]
    ssh: SSHOptions
    ray: RayOptions
    expectations: Mapping[str, Any]
    model_path: str | None = None
    run_dir: str = "runs"

    @property
    def head(self) -> Node:
        return next(n for n in self.nodes if n.is_head)

    @property
    def workers(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if not n.is_head)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise InventoryError(f"no node named {name!r}", path=self.path, key="nodes")

    def select(self, pattern: str | None) -> tuple[Node, ...]:
        """Nodes whose name matches a comma-separated list of glob patterns (or 'head'/'workers')."""
        if not pattern:
            return self.nodes
        chosen: list[Node] = []
        for part in (p.strip() for p in pattern.split(",") if p.strip()):
            for n in self.nodes:
                hit = (part == "head" and n.is_head) or (part == "workers" and not n.is_head) \
                    or fnmatch.fnmatchcase(n.name, part)
                if hit and n not in chosen:
                    chosen.append(n)
        if not chosen:
            raise InventoryError(f"no node matches {pattern!r}", path=self.path, key="--nodes")
        return tuple(chosen)

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        from cluster.results import to_jsonable

        nodes = []
        for n in self.nodes:
            d = to_jsonable(n)
            d["env"] = redact_env(n.env) if redact else dict(n.env)
            d["ip"] = n.ip
            nodes.append(d)
        return {"path": self.path, "nodes": nodes, "ssh": to_jsonable(self.ssh),
                "ray": to_jsonable(self.ray), "expectations": to_jsonable(self.expectations),
                "model_path": self.model_path, "run_dir": self.run_dir}


def is_secret_name(name: str) -> bool:
    """Env names whose values are secrets (KEY, TOKEN, SECRET, PASSWORD, CREDENTIAL)."""
    return bool(_SECRET_KEY_RE.search(name))


def public_env(env: Mapping[str, str]) -> dict[str, str]:
    """The entries of env that are safe to put on a command line (no secret-looking names)."""
    return {k: v for k, v in env.items() if not is_secret_name(k)}


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Env with the values of secret-looking keys replaced by ***."""
    return {k: (REDACTED if _SECRET_KEY_RE.search(k) else v) for k, v in env.items()}


# ---------------------------------------------------------------- lookup


def resolve_path(explicit: str | None, cwd: str | None = None) -> str | None:
    """The inventory file to use, or None for the embedded default."""
    if explicit:
        return explicit
    env = os.environ.get(ENV_VAR)
    if env:
        return env
    candidate = Path(cwd or os.getcwd()) / DEFAULT_FILE
    if candidate.is_file():
        return str(candidate)
    return None


def load(explicit: str | None = None, cwd: str | None = None) -> Inventory:
    """Resolve and load the inventory (the embedded localhost default when none is found)."""
    path = resolve_path(explicit, cwd)
    if path is None:
        return embedded_default()
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InventoryError(f"cannot read: {exc.strerror or exc}", path=path) from None
    return loads(text, path=path)


def default_state_dir() -> Path:
    """Where runs of an inventory without a file go: $XDG_STATE_HOME/cluster (~/.local/state/cluster)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "cluster"


def embedded_default() -> Inventory:
    return loads(EMBEDDED_DEFAULT_YAML, path=EMBEDDED)


def template_text() -> str:
    """The commented template `cluster init` writes."""
    return resources.files("cluster.data").joinpath("cluster.template.yaml").read_text()


def default_expectations() -> dict[str, Any]:
    text = resources.files("cluster.data").joinpath("expectations.yaml").read_text()
    return yaml.safe_load(text)


EMBEDDED_DEFAULT_YAML = """\
nodes:
  - name: localhost
    role: head
    address: localhost
    local: true
    node_ip: 127.0.0.1
"""


# ---------------------------------------------------------------- parsing with line numbers


class _Doc:
    """A parsed YAML document plus the line of every key path, for file:line errors."""

    def __init__(self, text: str, path: str):
        self.path = path
        self.lines: dict[tuple, int] = {}
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            line = mark.line + 1 if mark is not None else None
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise InventoryError(f"YAML syntax error: {problem}", path=path, line=line,
                                 key="(yaml)") from None
        if root is None:
            raise InventoryError("the file is empty", path=path, line=1, key="(document)")
        self._index(root, ())
        try:
            self.data = yaml.safe_load(text)
        except yaml.YAMLError as exc:  # pragma: no cover - compose already caught syntax errors
            raise InventoryError(f"YAML error: {exc}", path=path) from None

    def _index(self, node: yaml.Node, at: tuple) -> None:
        self.lines[at] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                key = key_node.value
                if key in seen:
                    raise InventoryError(f"duplicate key (first at line {seen[key]})",
                                         path=self.path, line=key_node.start_mark.line + 1,
                                         key=_dotted(at + (key,)))
                seen[key] = key_node.start_mark.line + 1
                self.lines[at + (key,)] = key_node.start_mark.line + 1
                self._index(value_node, at + (key,))
                self.lines[at + (key,)] = key_node.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._index(item, at + (i,))

    def fail(self, at: tuple, message: str) -> InventoryError:
        probe = at
        while probe and probe not in self.lines:
            probe = probe[:-1]
        return InventoryError(message, path=self.path, line=self.lines.get(probe),
                              key=_dotted(at))


def _dotted(at: tuple) -> str:
    out = ""
    for part in at:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


# ---------------------------------------------------------------- validation

_TOP_KEYS = {"nodes", "ssh", "ray", "expectations", "model", "model_path", "run_dir"}
_NODE_KEYS = {"name", "address", "role", "user", "port", "identity_file", "jump_host", "node_ip",
              "nccl_socket_ifname", "gloo_socket_ifname", "ib_hcas", "env", "local", "profile"}
_SSH_KEYS = {"user", "port", "identity_file", "known_hosts", "accept_unknown_host_keys",
             "connect_timeout", "command_timeout", "jump_host", "max_parallel"}
_MODEL_KEYS = {"path"}


class _Validator:
    def __init__(self, doc: _Doc):
        self.doc = doc

    def mapping(self, value: Any, at: tuple, allowed: set[str] | None = None) -> dict:
        if not isinstance(value, dict):
            raise self.doc.fail(at, f"must be a mapping, got {_type_name(value)}")
        for key in value:
            if not isinstance(key, str):
                raise self.doc.fail(at + (key,), "keys must be strings")
            if allowed is not None and key not in allowed:
                raise self.doc.fail(at + (key,), f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return value

    def string(self, value: Any, at: tuple, pattern: re.Pattern | None = None,
               what: str = "value", optional: bool = True) -> str | None:
        if value is None:
            if optional:
                return None
            raise self.doc.fail(at, "is required")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise self.doc.fail(at, f"must be a string, got {_type_name(value)}")
        text = str(value)
        if not text:
            raise self.doc.fail(at, "must not be empty")
        if pattern is not None and not pattern.match(text):
            raise self.doc.fail(at, f"invalid {what} {text!r} (unsafe or malformed characters)")
        return text

    def integer(self, value: Any, at: tuple, lo: int, hi: int, default: int | None) -> int | None:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.doc.fail(at, f"must be an integer, got {_type_name(value)}")
        if not lo <= value <= hi:
            raise self.doc.fail(at, f"must be between {lo} and {hi}, got {value}")
        return value

    def number(self, value: Any, at: tuple, default: float) -> float:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.doc.fail(at, f"must be a positive number, got {value!r}")
        return float(value)

    def boolean(self, value: Any, at: tuple, default: bool) -> bool:
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.doc.fail(at, f"must be true or false, got {value!r}")
        return value

    def path(self, value: Any, at: tuple) -> str | None:
        return self.string(value, at, _PATH_RE, what="path")

    def choice(self, value: Any, at: tuple, allowed: Mapping[str, Any] | Sequence[str],
               default: str) -> str:
        if value is None:
            return default
        if not isinstance(value, str) or value not in allowed:
            raise self.doc.fail(at, f"must be one of {', '.join(allowed)}, got {value!r}")
        return value


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", int: "an integer",
            float: "a number", bool: "a boolean", type(None): "nothing"}.get(type(value),
                                                                              type(value).__name__)


def loads(text: str, path: str = "<string>") -> Inventory:
    """Parse and validate inventory text. Raises InventoryError naming file:line and key."""
    doc = _Doc(text, path)
    v = _Validator(doc)
    top = v.mapping(doc.data, (), _TOP_KEYS)
    ssh = _ssh_options(v, top.get("ssh"))
    nodes = _nodes(v, top.get("nodes"), ssh)
    ray = _ray_options(v, top.get("ray"))
    expectations = _expectations(v, top.get("expectations"))
    model_path = _model_path(v, top)
    run_dir = v.path(top.get("run_dir"), ("run_dir",)) or "runs"
    base = Path(path).resolve().parent if Path(path).is_file() else None
    if os.environ.get(RUN_DIR_ENV):
        run_dir = os.environ[RUN_DIR_ENV]
    elif base is None and top.get("run_dir") is None:
        run_dir = str(default_state_dir() / "runs")
    if base is not None:
        ssh = dataclasses.replace(ssh, identity_file=_relative_to(base, ssh.identity_file),
                                  known_hosts=_relative_to(base, ssh.known_hosts))
        nodes = tuple(dataclasses.replace(n, identity_file=_relative_to(base, n.identity_file))
                      for n in nodes)
        run_dir = _relative_to(base, run_dir)
    return Inventory(path=path, nodes=nodes, ssh=ssh, ray=ray, expectations=expectations,
                     model_path=model_path, run_dir=run_dir)


def _ssh_options(v: _Validator, raw: Any) -> SSHOptions:
    if raw is None:
        return SSHOptions()
    at = ("ssh",)
    m = v.mapping(raw, at, _SSH_KEYS)
    return SSHOptions(
        user=v.string(m.get("user"), at + ("user",), _USER_RE, "user name"),
        port=v.integer(m.get("port"), at + ("port",), 1, 65535, 22),
        identity_file=v.path(m.get("identity_file"), at + ("identity_file",)),
        known_hosts=v.path(m.get("known_hosts"), at + ("known_hosts",)),
        accept_unknown_host_keys=v.boolean(m.get("accept_unknown_host_keys"),
                                           at + ("accept_unknown_host_keys",), False),
        connect_timeout=v.number(m.get("connect_timeout"), at + ("connect_timeout",), 10.0),
        command_timeout=v.number(m.get("command_timeout"), at + ("command_timeout",), 120.0),
        jump_host=v.string(m.get("jump_host"), at + ("jump_host",), _JUMP_RE, "jump host"),
        max_parallel=v.integer(m.get("max_parallel"), at + ("max_parallel",), 1, 1024, 32),
    )


_LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1")
_JUMP_RE = re.compile(r"^(?:[a-z_][a-z0-9_.-]*@)?[A-Za-z0-9.-]+(?::\d{1,5})?$", re.IGNORECASE)


def _nodes(v: _Validator, raw: Any, ssh: SSHOptions) -> tuple[Node, ...]:
    at = ("nodes",)
    if raw is None:
        raise v.doc.fail(at, "is required: a list of nodes")
    if not isinstance(raw, list) or not raw:
        raise v.doc.fail(at, "must be a non-empty list of nodes")
    nodes: list[Node] = []
    names: dict[str, int] = {}
    for i, item in enumerate(raw):
        node = _node(v, item, at + (i,), ssh)
        if node.name in names:
            raise v.doc.fail(at + (i, "name"), f"duplicate node name {node.name!r} "
                                               f"(also nodes[{names[node.name]}])")
        names[node.name] = i
        nodes.append(node)
    heads = [n for n in nodes if n.is_head]
    if len(heads) > 1:
        idx = [i for i, n in enumerate(nodes) if n.is_head][1]
        raise v.doc.fail(at + (idx, "role"), "more than one node has role head")
    if not heads:
        nodes[0] = dataclasses.replace(nodes[0], role="head")
    return tuple(nodes)


def _node(v: _Validator, raw: Any, at: tuple, ssh: SSHOptions) -> Node:
    m = v.mapping(raw, at, _NODE_KEYS)
    name = v.string(m.get("name"), at + ("name",), _NAME_RE, "node name", optional=False)
    address = v.string(m.get("address", name), at + ("address",), _HOST_RE, "host address")
    role = m.get("role", "worker")
    if role not in ("head", "worker"):
        raise v.doc.fail(at + ("role",), f"must be head or worker, got {role!r}")
    local = v.boolean(m.get("local"), at + ("local",), False)  # default: localhost runs locally
    env_raw = m.get("env") or {}
    env = {}
    for key, value in v.mapping(env_raw, at + ("env",)).items():
        if not _ENV_KEY_RE.match(key):
            raise v.doc.fail(at + ("env", key), "invalid environment variable name")
        if isinstance(value, (dict, list)) or value is None:
            raise v.doc.fail(at + ("env", key), "must be a string, number or boolean")
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if "\n" in text or "\0" in text:
            raise v.doc.fail(at + ("env", key), "must not contain newlines or NUL")
        env[key] = text
    hcas_raw = m.get("ib_hcas") or []
    if isinstance(hcas_raw, str):
        hcas_raw = [h for h in hcas_raw.split(",") if h]
    if not isinstance(hcas_raw, list):
        raise v.doc.fail(at + ("ib_hcas",), f"must be a list of HCA names, got {_type_name(hcas_raw)}")
    hcas = tuple(v.string(h, at + ("ib_hcas", j), _HCA_RE, "HCA name", optional=False)
                 for j, h in enumerate(hcas_raw))
    return Node(
        name=name,
        address=address,
        role=role,
        user=v.string(m.get("user"), at + ("user",), _USER_RE, "user name") or ssh.user,
        port=v.integer(m.get("port"), at + ("port",), 1, 65535, ssh.port),
        identity_file=v.path(m.get("identity_file"), at + ("identity_file",)) or ssh.identity_file,
        jump_host=v.string(m.get("jump_host"), at + ("jump_host",), _JUMP_RE, "jump host")
        or ssh.jump_host,
        node_ip=v.string(m.get("node_ip"), at + ("node_ip",), _HOST_RE, "IP address"),
        nccl_socket_ifname=v.string(m.get("nccl_socket_ifname"), at + ("nccl_socket_ifname",),
                                    _IFACE_RE, "interface name"),
        gloo_socket_ifname=v.string(m.get("gloo_socket_ifname"), at + ("gloo_socket_ifname",),
                                    _IFACE_RE, "interface name"),
        ib_hcas=hcas,
        env=env,
        local=local if m.get("local") is not None else address in _LOCAL_ADDRESSES,
        profile=v.string(m.get("profile"), at + ("profile",), _NAME_RE, "profile name"),
    )


_RAY_INT_KEYS = {"port": (1, 65535), "dashboard_port": (1, 65535),
                 "client_server_port": (1, 65535), "node_manager_port": (1, 65535),
                 "object_manager_port": (1, 65535), "min_worker_port": (1024, 65535),
                 "max_worker_port": (1024, 65535), "serve_port": (1, 65535),
                 "dashboard_agent_listen_port": (1024, 65535),
                 "dashboard_agent_grpc_port": (1024, 65535),
                 "runtime_env_agent_port": (1024, 65535), "metrics_export_port": (1024, 65535),
                 "object_store_memory": (78643200, 1 << 50), "num_cpus": (1, 4096),
                 "memory": (1 << 20, 1 << 50)}


def _ray_options(v: _Validator, raw: Any) -> RayOptions:
    if raw is None:
        return RayOptions()
    at = ("ray",)
    allowed = set(_RAY_INT_KEYS) | {"dashboard_host", "temp_dir", "python", "serve_ingress"}
    m = v.mapping(raw, at, allowed)
    defaults = RayOptions()
    values: dict[str, Any] = {}
    for key, (lo, hi) in _RAY_INT_KEYS.items():
        values[key] = v.integer(m.get(key), at + (key,), lo, hi, getattr(defaults, key))
    values["dashboard_host"] = v.string(m.get("dashboard_host"), at + ("dashboard_host",),
                                        _HOST_RE, "bind address") or defaults.dashboard_host
    values["temp_dir"] = v.path(m.get("temp_dir"), at + ("temp_dir",))
    values["python"] = v.path(m.get("python"), at + ("python",)) or defaults.python
    values["serve_ingress"] = v.choice(m.get("serve_ingress"), at + ("serve_ingress",),
                                       SERVE_INGRESS, defaults.serve_ingress)
    if values["min_worker_port"] > values["max_worker_port"]:
        raise v.doc.fail(at + ("min_worker_port",), "must not exceed max_worker_port")
    return RayOptions(**values)


def _expectations(v: _Validator, raw: Any) -> dict[str, Any]:
    merged = default_expectations()
    if raw is None:
        return merged
    _merge_checked(v, merged, raw, ("expectations",))
    return merged


def _merge_checked(v: _Validator, base: dict, override: Any, at: tuple) -> None:
    v.mapping(override, at, set(base))
    for key, value in override.items():
        if isinstance(base[key], dict):
            _merge_checked(v, base[key], value, at + (key,))
            continue
        default = base[key]
        if default is None:
            default = _NULL_DEFAULT_KINDS.get(_dotted(at[1:] + (key,)))
        if default is not None and value is not None and not _same_kind(default, value):
            raise v.doc.fail(at + (key,), f"must be {_type_name(default)}, got {_type_name(value)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise v.doc.fail(at + (key,), f"must not be negative, got {value}")
        base[key] = copy.deepcopy(value)


# Expectations whose default is null, with an example value of the type they take.
_NULL_DEFAULT_KINDS: dict[str, Any] = {
    "gpu_model": "NVIDIA H100 80GB HBM3", "gpus_per_node": 8, "driver_version": "550.54.15",
    "cuda_version": "12.4", "nvlink": True, "infiniband.min_rate_gbps": 400,
}


def _same_kind(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) == isinstance(value, bool) or \
            isinstance(default, str) or isinstance(value, str)
    if isinstance(default, (int, float)) and isinstance(value, (int, float)):
        return True
    if isinstance(default, str):
        return isinstance(value, (str, int, float))
    return type(default) is type(value)


def _model_path(v: _Validator, top: dict) -> str | None:
    if "model" in top and top["model"] is not None:
        m = v.mapping(top["model"], ("model",), _MODEL_KEYS)
        return v.path(m.get("path"), ("model", "path"))
    return v.path(top.get("model_path"), ("model_path",))


def _relative_to(base: Path, value: str | None) -> str | None:
    """Paths in an inventory file are relative to the file's folder (~ is expanded later)."""
    if value is None or value.startswith(("~", "/")):
        return value
    return str(base / value)
