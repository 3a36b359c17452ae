"""Inventory (cluster.yaml): load, validate with file:line errors, resolve, select nodes.

Lookup order: -i/--inventory PATH, then $CLUSTER_INVENTORY, then ./cluster.yaml, then the
embedded default (one node `localhost`, run locally without SSH). Every value that can reach a
remote shell is either validated against a safe character set here or quoted with shlex where
it is used.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from cluster.base import yamlfile
from cluster.base.bounds import bound
from cluster.base.errors import InventoryError
from cluster.base.yamlfile import YamlDoc, dotted as _dotted, type_name as _type_name

ENV_VAR = "CLUSTER_INVENTORY"
DEFAULT_FILE = "cluster.yaml"
RUN_DIR_ENV = "CLUSTER_RUN_DIR"
EMBEDDED = "<embedded default>"
MAX_BYTES = 1 << 20                 # an inventory larger than 1 MiB is the wrong file
MAX_CONNECT_TIMEOUT = 600.0         # seconds
MAX_COMMAND_TIMEOUT = 86400.0       # seconds: a day

# Every pattern is anchored with \A ... \Z and used with fullmatch: `$` would accept "x\n".
# Character classes are spelled out ([0-9], not \d, which accepts every Unicode digit).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")
_USER_RE = re.compile(r"[a-z_][a-z0-9_.-]{0,31}\Z", re.IGNORECASE)
_IFACE_RE = re.compile(r"[\^=]?[A-Za-z0-9._:@-]{1,64}(?:,[\^=]?[A-Za-z0-9._:@-]{1,64}){0,63}\Z")
_HCA_RE = re.compile(r"[\^=]?[A-Za-z0-9._-]{1,64}(?::[0-9]{1,3})?\Z")
_PATH_RE = re.compile(r"[A-Za-z0-9._/~+@%=,:-]{1,4096}\Z")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
_DECIMAL_RE = re.compile(r"[-+]?(?:0|[1-9][0-9]*)\Z")
_CONTROL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
MAX_STRING = 4096
# Secret-looking env names: any name containing one of these (the historical rule) ...
_SECRET_KEY_RE = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
# ... or with one of these as a word (DB_PASS, X_AUTH, MY_SESSION, PRIVATE_PEM), unless the
# name ends in a word that says it is a setting, not a secret (RAY_AUTH_MODE).
_SECRET_WORDS = frozenset({"PASS", "PASSPHRASE", "AUTH", "AUTHORIZATION", "SESSION", "COOKIE",
                           "PRIVATE", "CREDENTIALS", "CREDS"})
_SETTING_WORDS = frozenset({"MODE", "ENABLED", "ENABLE", "DISABLED", "TYPE", "METHOD", "LEVEL",
                            "TIMEOUT", "PORT", "HOST", "DIR", "VERBOSE", "DEBUG"})
REDACTED = "***"
# ray.serve_ingress -> the value of RAY_SERVE_ENABLE_HA_PROXY in every node's `ray start` env.
SERVE_INGRESS = {"haproxy": "1", "proxy": "0"}
# ray.metrics: off, or prometheus (`cluster up` starts the head's own Prometheus binary).
METRICS = ("off", "prometheus")
# An http(s) URL: scheme, host[:port], an optional path; no credentials, spaces or quotes.
_URL_RE = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]{1,261}(?:/[A-Za-z0-9._~/%+=&?#-]{0,1024})?\Z")


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
    secret_names: tuple[str, ...] = ()      # the inventory's secrets.extra_names

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
    # The interpreter of the node programs that run as root (fix, model copy, cache staging):
    # an absolute path only root can change, never the Ray user's virtualenv (issue 39 item 2).
    root_python: str = "/usr/bin/python3"
    serve_ingress: str = "haproxy"      # haproxy | proxy (see SERVE_INGRESS)
    metrics: str = "off"                # off | prometheus (see METRICS: Prometheus on the head)
    prometheus_port: int = 9090         # the head's Prometheus, bound to its loopback
    vllm_port_min: int = 29500          # multi-node vLLM engines: master ports (torch
    vllm_port_max: int = 29599          #   distributed) come from this range, one per replica
    grafana_url: str | None = None      # an existing Grafana (RAY_GRAFANA_HOST)
    grafana_iframe_url: str | None = None   # what the browser loads (default: grafana_url)


ACT_CLASSES = ("gpu_lost", "ecc_uncorrectable", "gpu_missing", "ib_port_down", "clock_offset",
               "missed_periods")
ACT_ACTIONS = ("report", "cordon")
GANG_REBUILDS = ("surge", "restart")        # health.act.gang_rebuild
ACT_DATA = "health_act.yaml"                 # cluster/data/: the policy's defaults


@dataclass(frozen=True)
class ActPolicy:
    """`health.act`: what the health job does with a finding of each class (report | cordon), how
    many consecutive readings confirm one, and the guards' numbers (cluster/data/health_act.yaml
    merged with the inventory's keys; cluster/ray/health_act.py applies it)."""

    actions: Mapping[str, str]
    confirm: Mapping[str, int]
    ecc_xids: tuple[int, ...]
    max_cordons: int
    window_s: float
    missed_after: int
    move_wait_s: float
    drain_deadline_s: int
    max_records: int
    gang_rebuild: str = "surge"     # a gang with a rank on a cordoned node: surge | restart

    def to_dict(self) -> dict[str, Any]:
        return {"act": dict(self.actions), "confirm_readings": dict(self.confirm),
                "ecc_xids": list(self.ecc_xids), "max_cordons": self.max_cordons,
                "window_s": self.window_s, "missed_after": self.missed_after,
                "move_wait_s": self.move_wait_s, "drain_deadline_s": self.drain_deadline_s,
                "max_records": self.max_records, "gang_rebuild": self.gang_rebuild}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ActPolicy":
        """The data file's (or to_dict's) shape -> ActPolicy; InventoryError on a wrong value."""
        acts, confirm = raw.get("act"), raw.get("confirm_readings")
        if not isinstance(acts, Mapping) or not isinstance(confirm, Mapping):
            raise InventoryError("act and confirm_readings must be mappings", key="health.act")
        for c in ACT_CLASSES:
            if acts.get(c) not in ACT_ACTIONS:
                raise InventoryError(f"must be report or cordon, got {acts.get(c)!r}",
                                     key=f"health.act.{c}")
            if not _whole(confirm.get(c), 1, 100):
                raise InventoryError(f"must be a whole number in [1, 100], got "
                                     f"{confirm.get(c)!r}", key=f"health.act.confirm_readings.{c}")
        xids = raw.get("ecc_xids")
        if not isinstance(xids, list) or not all(_whole(x, 0, 100_000) for x in xids):
            raise InventoryError(f"must be a list of Xids, got {xids!r}", key="health.act.ecc_xids")
        if raw.get("gang_rebuild") not in GANG_REBUILDS:
            raise InventoryError(f"must be surge or restart, got {raw.get('gang_rebuild')!r}",
                                 key="health.act.gang_rebuild")
        numbers = {k: raw.get(k) for k in ("max_cordons", "window_s", "missed_after",
                                           "move_wait_s", "drain_deadline_s", "max_records")}
        for key, (lo, hi) in _act_number_bounds().items():
            if not _whole(numbers[key], lo, hi, integral=key not in ("window_s", "move_wait_s")):
                raise InventoryError(f"must be a number in [{lo:g}, {hi:g}], got "
                                     f"{numbers[key]!r}", key=f"health.act.{key}")
        return cls({c: str(acts[c]) for c in ACT_CLASSES},
                   {c: int(confirm[c]) for c in ACT_CLASSES}, tuple(int(x) for x in xids),
                   int(numbers["max_cordons"]), float(numbers["window_s"]),
                   int(numbers["missed_after"]), float(numbers["move_wait_s"]),
                   int(numbers["drain_deadline_s"]), int(numbers["max_records"]),
                   str(raw["gang_rebuild"]))


def _whole(value: Any, lo: float, hi: float, integral: bool = True) -> bool:
    """A finite number (an int when integral) in [lo, hi]; never a bool."""
    if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
        return False
    return math.isfinite(value) and lo <= value <= hi


def _act_number_bounds() -> dict[str, tuple[float, float]]:
    """health.act's numbers: [lo, hi] from cluster/data/limits.yaml (the waits: 1 s to a day)."""
    return {"max_cordons": (0, bound("health", "act_max_cordons_max")),
            "window_s": (1, bound("health", "act_window_s_max")),
            "missed_after": (1, bound("health", "act_missed_after_max")),
            "move_wait_s": (1, 86400), "drain_deadline_s": (1, 86400), "max_records": (1, 10000)}


def default_act_policy() -> ActPolicy:
    """The policy of cluster/data/health_act.yaml (no inventory override)."""
    return ActPolicy.from_dict(yamlfile.packaged(ACT_DATA))


@dataclass(frozen=True)
class HealthOptions:
    """The periodic health job `cluster up` starts (cluster/ray/health_job.py): on/off, its period,
    and what it does with what it reads (`act`)."""

    enabled: bool = True
    period_s: float = 180.0
    act: ActPolicy = field(default_factory=lambda: default_act_policy())


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
    secret_names: tuple[str, ...] = ()      # secrets.extra_names: more env names to treat as secret
    warnings: tuple[str, ...] = ()          # risky but valid settings (the CLI prints them)
    health: HealthOptions = field(default_factory=HealthOptions)

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
        if pattern is None:
            return self.nodes
        if not pattern.strip():
            raise InventoryError("an empty node pattern selects nothing (omit --nodes for "
                                 "every node)", path=self.path, key="--nodes")
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
        from cluster.base.results import to_jsonable

        nodes = []
        for n in self.nodes:
            d = to_jsonable(n)
            d.pop("secret_names", None)  # shown once, under "secrets"
            d["env"] = redact_env(n.env, self.secret_names) if redact else dict(n.env)
            d["ip"] = n.ip
            nodes.append(d)
        return {"path": self.path, "nodes": nodes, "ssh": to_jsonable(self.ssh),
                "ray": to_jsonable(self.ray), "expectations": to_jsonable(self.expectations),
                "model_path": self.model_path, "run_dir": self.run_dir,
                "secrets": {"extra_names": list(self.secret_names)},
                "health": to_jsonable(self.health),
                "warnings": list(self.warnings)}

    def secret_values(self) -> tuple[str, ...]:
        """The values of every node's secret-looking env entries (to scrub from run records)."""
        return tuple(sorted({v for n in self.nodes for k, v in n.env.items()
                             if len(v) >= 4 and is_secret_name(k, self.secret_names)}))


def is_secret_name(name: str, extra: Sequence[str] = ()) -> bool:
    """Env names whose values are secrets.

    A name containing KEY, TOKEN, SECRET, PASSWORD, PASSWD or CREDENTIAL; or one with PASS,
    AUTH, SESSION, COOKIE, PRIVATE, CREDS (...) as one of its `_`-separated words, unless its
    last word names a setting (RAY_AUTH_MODE, *_ENABLED, *_PORT ...); or one containing any of
    `extra` (an inventory's secrets.extra_names), case-insensitively.
    """
    return _secret_name(name, tuple(extra))


@functools.lru_cache(maxsize=4096)
def _secret_name(name: str, extra: tuple[str, ...]) -> bool:
    """is_secret_name, kept per (name, extra): every node's commands ask it of the same few
    names (27 times a node in a preflight)."""
    if _SECRET_KEY_RE.search(name):
        return True
    upper = name.upper()
    if any(e and e.upper() in upper for e in extra):
        return True
    words = [w for w in upper.split("_") if w]
    return bool(words) and words[-1] not in _SETTING_WORDS and \
        any(w in _SECRET_WORDS for w in words)


def public_env(env: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """The entries of env that are safe to put on a command line (no secret-looking names)."""
    return {k: v for k, v in env.items() if not is_secret_name(k, extra)}


def redact_env(env: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """Env with the values of secret-looking keys replaced by ***."""
    return {k: (REDACTED if is_secret_name(k, extra) else v) for k, v in env.items()}


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
    text = yamlfile.read_text(path, error=InventoryError, what="an inventory (cluster.yaml)",
                              max_bytes=MAX_BYTES)
    return loads(text, path=path)


def default_state_dir() -> Path:
    """Where runs of an inventory without a file go: $XDG_STATE_HOME/cluster (~/.local/state/cluster)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "cluster"


def embedded_default() -> Inventory:
    return loads(EMBEDDED_DEFAULT_YAML, path=EMBEDDED)


def template_text() -> str:
    """The commented template `cluster init` writes."""
    return yamlfile.packaged_text("cluster.template.yaml")


def default_expectations() -> dict[str, Any]:
    return yamlfile.packaged("expectations.yaml")


EMBEDDED_DEFAULT_YAML = """\
nodes:
  - name: localhost
    role: head
    address: localhost
    local: true
    node_ip: 127.0.0.1
"""


# ---------------------------------------------------------------- validation

_TOP_KEYS = {"nodes", "ssh", "ray", "expectations", "model", "model_path", "run_dir", "secrets",
             "health"}
_NODE_KEYS = {"name", "address", "role", "user", "port", "identity_file", "jump_host", "node_ip",
              "nccl_socket_ifname", "gloo_socket_ifname", "ib_hcas", "env", "local", "profile"}
_SSH_KEYS = {"user", "port", "identity_file", "known_hosts", "accept_unknown_host_keys",
             "connect_timeout", "command_timeout", "jump_host", "max_parallel"}
_MODEL_KEYS = {"path"}
_SECRETS_KEYS = {"extra_names"}


class _Validator:
    """Typed reads of the document's values; every refusal names file:line and the key path."""

    def __init__(self, doc: YamlDoc):
        self.doc = doc

    def mapping(self, value: Any, at: tuple, allowed: set[str] | None = None) -> dict:
        if not isinstance(value, dict):
            raise self.doc.fail(at, f"must be a mapping, got {_type_name(value)}")
        for key in value:
            if not isinstance(key, str):
                raise self.doc.fail(at + (key,), f"keys must be strings, got {_type_name(key)}")
            if allowed is not None and key not in allowed:
                raise self.doc.fail(at + (key,), f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return value

    def text(self, value: Any, at: tuple) -> str:
        """A string; a number is taken as written (`cuda_version: 12.10` is "12.10")."""
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise self.doc.fail(at, f"must be a string, got {_type_name(value)}")
        if isinstance(value, str):
            return value
        return self.doc.text(at) or str(value)

    def string(self, value: Any, at: tuple, pattern: re.Pattern | None = None,
               what: str = "value", optional: bool = True) -> str | None:
        if value is None:
            if optional:
                return None
            raise self.doc.fail(at, "is required")
        text = self.text(value, at)
        if not text:
            raise self.doc.fail(at, "must not be empty")
        if len(text) > MAX_STRING:
            raise self.doc.fail(at, f"longer than {MAX_STRING} characters")
        if pattern is not None and not pattern.fullmatch(text):
            raise self.doc.fail(at, f"invalid {what} {text[:80]!r} (unsafe or malformed characters)")
        return text

    def host(self, value: Any, at: tuple, what: str = "host address",
             ip_only: bool = False) -> str | None:
        text = self.string(value, at, None, what)
        if text is None:
            return None
        problem = host_problem(text, ip_only=ip_only)
        if problem:
            raise self.doc.fail(at, f"invalid {what} {text[:80]!r}: {problem}")
        return text

    def integer(self, value: Any, at: tuple, lo: int, hi: int, default: int | None) -> int | None:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.doc.fail(at, f"must be an integer, got {_shown(self.doc, value, at)}")
        written = self.doc.text(at)
        if written is not None and not _DECIMAL_RE.fullmatch(written):
            raise self.doc.fail(at, f"must be a decimal integer, got {written[:40]!r} "
                                    f"(YAML reads it as {value})")
        if not lo <= value <= hi:
            raise self.doc.fail(at, f"must be between {lo} and {hi}, got {value}")
        return value

    def number(self, value: Any, at: tuple, default: float | None, lo: float, hi: float,
               lo_open: bool = True) -> float | None:
        """A finite number in (lo, hi] (or [lo, hi] when lo_open is False)."""
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.doc.fail(at, f"must be a number, got {_shown(self.doc, value, at)}")
        if not math.isfinite(value):
            raise self.doc.fail(at, f"must be a finite number, got {value}")
        if value > hi or value < lo or (lo_open and value == lo):
            low = f"> {lo:g}" if lo_open else f">= {lo:g}"
            raise self.doc.fail(at, f"must be {low} and <= {hi:g}, got {value:g}")
        return float(value)

    def boolean(self, value: Any, at: tuple, default: bool | None) -> bool | None:
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.doc.fail(at, f"must be true or false, got {_shown(self.doc, value, at)}")
        return value

    def path(self, value: Any, at: tuple) -> str | None:
        return self.string(value, at, _PATH_RE, what="path")

    def choice(self, value: Any, at: tuple, allowed: Mapping[str, Any] | Sequence[str],
               default: str) -> str:
        if value is None:
            return default
        if not isinstance(value, str) or value not in allowed:
            raise self.doc.fail(at, f"must be one of {', '.join(allowed)}, "
                                    f"got {_shown(self.doc, value, at)}")
        return value


def _shown(doc: YamlDoc, value: Any, at: tuple) -> str:
    """A value's type, plus how it was written when that helps (`a date ('2020-01-01')`)."""
    written = doc.text(at)
    name = _type_name(value)
    if written is None or isinstance(value, (dict, list)):
        return name
    return f"{name} ({written[:40]!r})"


def host_problem(text: str, ip_only: bool = False) -> str | None:
    """Why text is not a usable host (None when it is): an IPv4/IPv6 address as `ipaddress`
    parses it, or (unless ip_only) an RFC 1123 host name."""
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        ipaddress.ip_address(bare)
        return None
    except ValueError:
        pass
    if ":" in bare or bare != text:
        return "not an IPv6 address"
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    if all(label.isdigit() for label in labels):
        return "not an IPv4 address (four ASCII numbers 0-255)"
    if ip_only:
        return "not an IP address"
    if len(text) > 253:
        return "a host name is at most 253 characters"
    if not all(_LABEL_RE.fullmatch(label) for label in labels):
        return "a host name is dot-separated labels of letters, digits and inner hyphens (RFC 1123)"
    if labels[-1].isdigit():
        return "the last label of a host name is not all digits"
    return None


def jump_host_problem(text: str) -> str | None:
    """Why text is not `[user@]host[:port]` (None when it is). IPv6 hops are not supported."""
    user, at, hostport = text.rpartition("@")
    if at and not _USER_RE.fullmatch(user):
        return f"invalid user name {user[:40]!r}"
    host, colon, port = hostport.partition(":")
    if colon:
        if not (port.isascii() and port.isdigit() and len(port) <= 5):
            return f"the port must be a number 1-65535, got {port[:20]!r}"
        if not 1 <= int(port) <= 65535:
            return f"the port must be 1-65535, got {int(port)}"
    if not host:
        return "no host"
    return host_problem(host)


def loads(text: str, path: str = "<string>") -> Inventory:
    """Parse and validate inventory text. Raises InventoryError naming file:line and key."""
    doc = yamlfile.parse(text, path=path, error=InventoryError, max_bytes=MAX_BYTES)
    v = _Validator(doc)
    top = v.mapping(doc.data, (), _TOP_KEYS)
    ssh = _ssh_options(v, top.get("ssh"))
    nodes = _nodes(v, top.get("nodes"), ssh)
    ray = _ray_options(v, top.get("ray"))
    expectations = _expectations(v, top.get("expectations"))
    model_path = _model_path(v, top)
    secret_names = _secret_names(v, top.get("secrets"))
    health = _health_options(v, top.get("health"))
    _refuse_port_collisions(v, ray, expectations)
    run_dir = v.path(top.get("run_dir"), ("run_dir",)) or "runs"
    base = Path(path).resolve().parent if Path(path).is_file() else None
    if os.environ.get(RUN_DIR_ENV):
        run_dir = os.environ[RUN_DIR_ENV]
    elif base is None and top.get("run_dir") is None:
        run_dir = str(default_state_dir() / "runs")
    if secret_names:
        nodes = tuple(dataclasses.replace(n, secret_names=secret_names) for n in nodes)
    if base is not None:
        ssh = dataclasses.replace(ssh, identity_file=_relative_to(base, ssh.identity_file),
                                  known_hosts=_relative_to(base, ssh.known_hosts))
        nodes = tuple(dataclasses.replace(n, identity_file=_relative_to(base, n.identity_file))
                      for n in nodes)
        run_dir = _relative_to(base, run_dir)
    inv = Inventory(path=path, nodes=nodes, ssh=ssh, ray=ray, expectations=expectations,
                    model_path=model_path, run_dir=run_dir, secret_names=secret_names,
                    health=health)
    return dataclasses.replace(inv, warnings=inventory_warnings(inv))


def inventory_warnings(inv: Inventory) -> tuple[str, ...]:
    """Valid but risky settings, one line each (the CLI prints them; `up` exits 1 on them)."""
    out = []
    host = inv.ray.dashboard_host
    if not is_loopback(host):
        out.append(f"{inv.path}: ray.dashboard_host: {host} exposes the Ray dashboard beyond this "
                   f"host, and it has no authentication (anyone who reaches port "
                   f"{inv.ray.dashboard_port} can run code on the cluster): keep 127.0.0.1 and "
                   "reach it with `cluster dashboard`")
    if _exists_not_dir(Path(inv.run_dir).expanduser()):
        out.append(f"{inv.path}: run_dir: {inv.run_dir} exists and is not a directory: "
                   "commands that record a run will refuse to start")
    return tuple(out)


def _exists_not_dir(path: Path) -> bool:
    try:
        return path.exists() and not path.is_dir()
    except OSError:  # unreadable parent: the run itself will say so
        return False


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


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
        connect_timeout=v.number(m.get("connect_timeout"), at + ("connect_timeout",), 10.0,
                                 0, MAX_CONNECT_TIMEOUT),
        command_timeout=v.number(m.get("command_timeout"), at + ("command_timeout",), 120.0,
                                 0, MAX_COMMAND_TIMEOUT),
        jump_host=_jump_host(v, m.get("jump_host"), at + ("jump_host",)),
        max_parallel=v.integer(m.get("max_parallel"), at + ("max_parallel",), 1, 1024, 32),
    )


def _jump_host(v: _Validator, raw: Any, at: tuple) -> str | None:
    text = v.string(raw, at, None, "jump host")
    if text is None:
        return None
    problem = jump_host_problem(text)
    if problem:
        raise v.doc.fail(at, f"invalid jump host {text[:80]!r} ([user@]host[:port]): {problem}")
    return text


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
    _refuse_same_machine(v, nodes, at)
    heads = [n for n in nodes if n.is_head]
    if len(heads) > 1:
        idx = [i for i, n in enumerate(nodes) if n.is_head][1]
        raise v.doc.fail(at + (idx, "role"), "more than one node has role head")
    if not heads:
        nodes[0] = dataclasses.replace(nodes[0], role="head")
    return tuple(nodes)


def _refuse_same_machine(v: _Validator, nodes: Sequence[Node], at: tuple) -> None:
    """Two entries for one machine are refused, naming both: the same SSH endpoint (address
    and port) or the same node_ip (Ray's address of the node). `local: true` nodes are reached
    without their address (this machine's runner): only their node_ip counts."""
    seen: dict[tuple, int] = {}
    for i, node in enumerate(nodes):
        keys = [] if node.local else [
            (("address", node.address, node.port), "address",
             f"address {node.address}" + (f" port {node.port}" if node.port != 22 else ""))]
        if node.node_ip is not None:
            keys.append((("node_ip", node.node_ip), "node_ip", f"node_ip {node.node_ip}"))
        for key, field_name, shown in keys:
            if key in seen:
                first = nodes[seen[key]]
                raise v.doc.fail(at + (i, field_name), f"duplicate {shown}: nodes {first.name!r} "
                                                       f"(nodes[{seen[key]}]) and {node.name!r} "
                                                       "name the same machine")
            seen[key] = i


def _node(v: _Validator, raw: Any, at: tuple, ssh: SSHOptions) -> Node:
    m = v.mapping(raw, at, _NODE_KEYS)
    name = v.string(m.get("name"), at + ("name",), _NAME_RE, "node name", optional=False)
    address = v.host(m["address"], at + ("address",)) if m.get("address") is not None else \
        _default_address(v, name, at)
    role = m.get("role", "worker")
    if role not in ("head", "worker"):
        raise v.doc.fail(at + ("role",), f"must be head or worker, got {_shown(v.doc, role, at + ('role',))}")
    local = v.boolean(m.get("local"), at + ("local",), False)  # only `local: true` runs here
    return Node(
        name=name,
        address=address,
        role=role,
        user=v.string(m.get("user"), at + ("user",), _USER_RE, "user name") or ssh.user,
        port=v.integer(m.get("port"), at + ("port",), 1, 65535, ssh.port),
        identity_file=v.path(m.get("identity_file"), at + ("identity_file",)) or ssh.identity_file,
        jump_host=_jump_host(v, m.get("jump_host"), at + ("jump_host",)) or ssh.jump_host,
        node_ip=v.host(m.get("node_ip"), at + ("node_ip",), "IP address", ip_only=True),
        nccl_socket_ifname=v.string(m.get("nccl_socket_ifname"), at + ("nccl_socket_ifname",),
                                    _IFACE_RE, "interface name"),
        gloo_socket_ifname=v.string(m.get("gloo_socket_ifname"), at + ("gloo_socket_ifname",),
                                    _IFACE_RE, "interface name"),
        ib_hcas=_hcas(v, m.get("ib_hcas"), at + ("ib_hcas",)),
        env=_env(v, m.get("env"), at + ("env",)),
        local=local,
        profile=v.string(m.get("profile"), at + ("profile",), _NAME_RE, "profile name"),
    )


def _default_address(v: _Validator, name: str, at: tuple) -> str:
    """A node without `address` is reached by its name, which must then be a host name."""
    problem = host_problem(name)
    if problem:
        raise v.doc.fail(at + ("name",), f"{name!r} is not a host name ({problem}): give the "
                                         "node an address")
    return name


def _env(v: _Validator, raw: Any, at: tuple) -> dict[str, str]:
    env: dict[str, str] = {}
    for key, value in v.mapping(raw or {}, at).items():
        if not _ENV_KEY_RE.fullmatch(key):
            raise v.doc.fail(at + (key,), "invalid environment variable name")
        if isinstance(value, (dict, list)) or value is None:
            raise v.doc.fail(at + (key,), "must be a string, number or boolean")
        if isinstance(value, float) and not math.isfinite(value):
            raise v.doc.fail(at + (key,), f"must be a finite number, got {value}")
        if isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, (str, int, float)):
            text = v.text(value, at + (key,))
        else:
            raise v.doc.fail(at + (key,), f"must be a string, number or boolean, "
                                          f"got {_shown(v.doc, value, at + (key,))}")
        if _CONTROL_RE.search(text):
            raise v.doc.fail(at + (key,), "must not contain newlines, NUL or control characters")
        if len(text) > 65536:
            raise v.doc.fail(at + (key,), "longer than 65536 characters")
        env[key] = text
    return env


def _hcas(v: _Validator, raw: Any, at: tuple) -> tuple[str, ...]:
    raw = raw or []
    if isinstance(raw, str):
        raw = [h for h in raw.split(",") if h]
    if not isinstance(raw, list):
        raise v.doc.fail(at, f"must be a list of HCA names, got {_type_name(raw)}")
    return tuple(v.string(h, at + (j,), _HCA_RE, "HCA name", optional=False)
                 for j, h in enumerate(raw))


_RAY_INT_KEYS = {"port": (1, 65535), "dashboard_port": (1, 65535),
                 "client_server_port": (1, 65535), "node_manager_port": (1, 65535),
                 "object_manager_port": (1, 65535), "min_worker_port": (1024, 65535),
                 "max_worker_port": (1024, 65535), "serve_port": (1, 65535),
                 "dashboard_agent_listen_port": (1024, 65535),
                 "dashboard_agent_grpc_port": (1024, 65535),
                 "runtime_env_agent_port": (1024, 65535), "metrics_export_port": (1024, 65535),
                 "prometheus_port": (1, 65535),
                 "vllm_port_min": (1024, 65535), "vllm_port_max": (1024, 65535),
                 "object_store_memory": (78643200, 1 << 50), "num_cpus": (1, 4096),
                 "memory": (1 << 20, 1 << 50)}


_RAY_PORTS = tuple(k for k in _RAY_INT_KEYS if k.endswith("port")
                   and k not in ("min_worker_port", "max_worker_port"))
_REPLICA_PORTS = ("expectations", "reachability", "serve_replica_ports")
_RELAY_PORTS = ("expectations", "model_relay", "ports")


def declared_ports(ray: RayOptions, expectations: Mapping[str, Any]
                   ) -> tuple[list[tuple[tuple, int]], list[tuple[tuple, int, int]]]:
    """(the fixed ports the inventory declares, as (key path, port); its port ranges, as
    (key path, first, last)), defaults included (pure)."""
    singles = [(("ray", k), getattr(ray, k)) for k in _RAY_PORTS]
    ranges = [(("ray", "min_worker_port"), ray.min_worker_port, ray.max_worker_port),
              (("ray", "vllm_port_min"), ray.vllm_port_min, ray.vllm_port_max)]
    relay = expectations.get("model_relay", {}).get("ports", ())
    if len(relay) == 2 and relay[0] <= relay[1]:
        ranges.append((_RELAY_PORTS, relay[0], relay[1]))
    replica = expectations["reachability"]["serve_replica_ports"]
    if len(replica) == 2 and replica[0] <= replica[1]:
        ranges.append((_REPLICA_PORTS, replica[0], replica[1]))
    return singles, ranges


def _port_name(at: tuple) -> str:
    if at == ("ray", "min_worker_port"):
        return "ray.min_worker_port..max_worker_port"
    if at == ("ray", "vllm_port_min"):
        return "ray.vllm_port_min..vllm_port_max"
    return _dotted(at)


def _refuse_port_collisions(v: _Validator, ray: RayOptions,
                            expectations: Mapping[str, Any]) -> None:
    """Two services on one port: one fails to start, or answers for the other. Every fixed
    port distinct, none inside a port range, the ranges apart; one line naming both keys (at
    the line of the one written, defaults count)."""
    singles, ranges = declared_ports(ray, expectations)

    def fail(first: tuple, second: tuple, what: str) -> Exception:
        at = second if v.doc.text(second) is not None or v.doc.text(first) is None else first
        return v.doc.fail(at, f"{_port_name(first)} and {_port_name(second)} {what}: every "
                              "port the inventory declares must be its own")

    seen: dict[int, tuple] = {}
    for at, port in singles:
        if port in seen:
            raise fail(seen[port], at, f"are both {port}")
        seen[port] = at
    for at, port in singles:
        for rat, lo, hi in ranges:
            if lo <= port <= hi:
                raise fail(at, rat, f"collide ({port} is inside {lo}-{hi})")
    for i, (a, alo, ahi) in enumerate(ranges):
        for b, blo, bhi in ranges[i + 1:]:
            if alo <= bhi and blo <= ahi:
                raise fail(a, b, f"overlap ({alo}-{ahi} and {blo}-{bhi})")


def _ray_options(v: _Validator, raw: Any) -> RayOptions:
    if raw is None:
        return RayOptions()
    at = ("ray",)
    allowed = set(_RAY_INT_KEYS) | {"dashboard_host", "temp_dir", "python", "root_python",
                                    "serve_ingress", "metrics", "grafana_url",
                                    "grafana_iframe_url"}
    m = v.mapping(raw, at, allowed)
    defaults = RayOptions()
    values: dict[str, Any] = {}
    for key, (lo, hi) in _RAY_INT_KEYS.items():
        values[key] = v.integer(m.get(key), at + (key,), lo, hi, getattr(defaults, key))
    values["dashboard_host"] = v.host(m.get("dashboard_host"), at + ("dashboard_host",),
                                      "bind address") or defaults.dashboard_host
    values["temp_dir"] = v.path(m.get("temp_dir"), at + ("temp_dir",))
    values["python"] = v.path(m.get("python"), at + ("python",)) or defaults.python
    values["root_python"] = v.path(m.get("root_python"), at + ("root_python",)) \
        or defaults.root_python
    if not values["root_python"].startswith("/"):
        raise v.doc.fail(at + ("root_python",), "must be an absolute path (root never looks "
                                                "an interpreter up on a PATH)")
    values["serve_ingress"] = v.choice(m.get("serve_ingress"), at + ("serve_ingress",),
                                       SERVE_INGRESS, defaults.serve_ingress)
    values["metrics"] = v.choice(_metrics_word(v, m.get("metrics"), at + ("metrics",)),
                                 at + ("metrics",), METRICS, defaults.metrics)
    for key in ("grafana_url", "grafana_iframe_url"):
        values[key] = _url(v, m.get(key), at + (key,))
    if values["grafana_iframe_url"] and not values["grafana_url"]:
        raise v.doc.fail(at + ("grafana_iframe_url",), "needs ray.grafana_url")
    values["grafana_iframe_url"] = values["grafana_iframe_url"] or values["grafana_url"]
    if values["min_worker_port"] > values["max_worker_port"]:
        raise v.doc.fail(at + ("min_worker_port",), "must not exceed max_worker_port")
    if values["vllm_port_min"] > values["vllm_port_max"]:
        raise v.doc.fail(at + ("vllm_port_min",), "must not exceed vllm_port_max")
    return RayOptions(**values)


def health_period_bounds() -> tuple[float, float]:
    """health.period_s bounds (seconds), from cluster/data/limits.yaml (one bound for every reader)."""
    return float(bound("health", "period_s_min")), float(bound("health", "period_s_max"))


def _health_options(v: _Validator, raw: Any) -> HealthOptions:
    if raw is None:
        return HealthOptions()
    at = ("health",)
    m = v.mapping(raw, at, {"enabled", "period_s", "act"})
    lo, hi = health_period_bounds()
    return HealthOptions(enabled=v.boolean(m.get("enabled"), at + ("enabled",), True),
                         period_s=v.number(m.get("period_s"), at + ("period_s",), 180.0, lo, hi,
                                           lo_open=False),
                         act=_act_policy(v, m.get("act")))


_ACT_INTS = ("max_cordons", "missed_after", "drain_deadline_s", "max_records")
_ACT_FLOATS = ("window_s", "move_wait_s")


def _act_policy(v: _Validator, raw: Any) -> ActPolicy:
    """`health.act`: {class: report|cordon, confirm_readings: {class: n}, gang_rebuild, max_cordons,
    window_s, missed_after, move_wait_s, drain_deadline_s, max_records} over the data file's
    defaults."""
    base = yamlfile.packaged(ACT_DATA)
    if raw is None:
        return ActPolicy.from_dict(base)
    at = ("health", "act")
    m = v.mapping(raw, at, set(ACT_CLASSES) | {"confirm_readings", "gang_rebuild", *_ACT_INTS,
                                                *_ACT_FLOATS})
    for c in ACT_CLASSES:
        base["act"][c] = v.choice(m.get(c), at + (c,), ACT_ACTIONS, base["act"][c])
    base["gang_rebuild"] = v.choice(m.get("gang_rebuild"), at + ("gang_rebuild",), GANG_REBUILDS,
                                    base["gang_rebuild"])
    confirm = m.get("confirm_readings")
    if confirm is not None:
        for c, n in v.mapping(confirm, at + ("confirm_readings",), set(ACT_CLASSES)).items():
            base["confirm_readings"][c] = v.integer(n, at + ("confirm_readings", c), 1, 100, None)
    bounds = _act_number_bounds()
    for key in _ACT_INTS:
        lo, hi = bounds[key]
        base[key] = v.integer(m.get(key), at + (key,), int(lo), int(hi), base[key])
    for key in _ACT_FLOATS:
        lo, hi = bounds[key]
        base[key] = v.number(m.get(key), at + (key,), base[key], lo, hi, lo_open=False)
    return ActPolicy.from_dict(base)


def _metrics_word(v: _Validator, value: Any, at: tuple) -> Any:
    """`metrics: off` as written (YAML 1.1 reads a bare off as false)."""
    written = (v.doc.text(at) or "").strip("'\"")
    return "off" if value is False and written.lower() == "off" else value


def _url(v: _Validator, value: Any, at: tuple) -> str | None:
    """An http(s) URL with a valid host and port (no credentials), trailing / dropped."""
    text = v.string(value, at, None, "URL")
    if text is None:
        return None
    if not _URL_RE.fullmatch(text):
        raise v.doc.fail(at, f"must be an http:// or https:// URL without credentials, "
                             f"got {text[:80]!r}")
    problem = _url_host_problem(text.split("://", 1)[1].split("/", 1)[0])
    if problem:
        raise v.doc.fail(at, f"invalid URL {text[:80]!r}: {problem}")
    return text.rstrip("/")


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def _url_host_problem(hostport: str) -> str | None:
    """Why a URL's `host[:port]` (an IPv6 host in brackets) is not usable, else None."""
    if hostport.startswith("["):
        if "]" not in hostport:
            return "an IPv6 address without its closing ]"
        host, _, rest = hostport.partition("]")
        if not _is_ipv6(host[1:]):
            return "brackets hold only an IPv6 address (write an IPv4 address without them)"
        host, port = host + "]", rest[1:] if rest.startswith(":") else None
        if rest and port is None:
            return "junk after the IPv6 address"
    else:
        host, colon, port = hostport.partition(":")
        port = port if colon else None
    if port is not None and not (port.isascii() and port.isdigit() and len(port) <= 5
                                 and 1 <= int(port) <= 65535):
        return f"the port must be a number 1-65535, got {port[:20]!r}"
    return host_problem(host) if host else "no host"


# ---------------------------------------------------------------- expectations

_TRI = (True, False, "auto")
_MAX_MS = 86_400_000.0      # a day, in milliseconds
# Every leaf of cluster/data/expectations.yaml: (kind, arguments). Kinds: text (a string or a
# number taken as written), int (lo, hi), number (lo, hi: finite, lo <= x <= hi), bool, tri
# (true/false/auto), choice (values), int_or (lo, hi, word), names (a list of short names),
# ints (a list of int lo..hi), texts (a list of strings).
# `nullable` says whether null (not checked) is allowed.
_EXPECT_SPEC: dict[str, tuple] = {
    "gpu_model": ("text", True), "gpus_per_node": ("int", True, 0, 4096),   # 0: not checked
    "driver_version": ("text", True), "cuda_version": ("text", True),
    "nvlink": ("bool", True),
    "infiniband.required": ("tri", False), "infiniband.link_layer": ("choice", True,
                                                                      ("InfiniBand", "Ethernet")),
    "infiniband.min_rate_gbps": ("number", True, 0.0, 1e6),
    "gpudirect_rdma": ("tri", False),
    "clock.max_offset_ms": ("number", False, 0.0, _MAX_MS),
    "clock.max_skew_ms": ("number", False, 0.0, _MAX_MS),
    "clock.warn_skew_ms": ("number", False, 0.0, _MAX_MS),
    "shm_min_bytes": ("int", False, 0, 1 << 50),
    "memlock_min_kib": ("int_or", False, 0, 1 << 50, "unlimited"),
    "versions_must_match": ("names", False),
    "runtime_imports": ("bool", False),
    "health.acs_fail_min_gpus": ("int", False, 1, 4096),
    "health.xid_fail": ("ints", False, 0, 100_000),
    "health.aer_fail_levels": ("texts", False),
    "health.ecc_uncorrectable_volatile_max": ("int", False, 0, 1 << 40),
    "health.ecc_uncorrectable_aggregate_max": ("int", False, 0, 1 << 40),
    "health.clock_reasons_warn": ("texts", False),
    "health.pcie_gen_check_pstates": ("texts", False),
    "health.nic_locality_warn": ("texts", False),
    "health.fabric_state_ok": ("text", False),
    "health.fabric_status_ok": ("text", False),
    "health.fabric_health_fail": ("texts", False),
    "health.fabric_health_warn": ("texts", False),
    "reachability.full_matrix_max_nodes": ("int", False, 2, 4096),
    "reachability.peers_per_node": ("int", False, 1, 64),
    "reachability.connect_timeout_s": ("number", False, 0.1, 30.0),
    "reachability.connects_in_flight": ("int", False, 1, 512),
    "reachability.probe_deadline_s": ("number", False, 1.0, 600.0),
    "reachability.worker_port_samples": ("int", False, 0, 32),
    "reachability.serve_replica_ports": ("ints", False, 1, 65535),
    "fix.model_copy_port": ("int", False, 1, 65535),
    "model_relay.ports": ("ints", False, 1, 65535),
    "model_relay.chain_max_nodes": ("int", False, 1, 100_000),
    "model_relay.tree_fanout": ("int", False, 2, 64),
    "fabric.interconnect": ("choice", False, ("auto", "infiniband", "roce", "any")),
    "fabric.nvlink_min_busbw_gbps": ("number", True, 0.0, 1e5),
    "fabric.network_min_busbw_gbps": ("number", True, 0.0, 1e5),
    "fabric.socket_min_busbw_gbps": ("number", True, 0.0, 1e5),
    "fabric.gloo_min_busbw_gbps": ("number", True, 0.0, 1e5),
    "fabric.size_mb": ("number", True, 0.001, 16384.0),
    "fabric.latency_kb": ("number", False, 0.004, 1024.0),
    "fabric.join_timeout_s": ("number", False, 5.0, 3600.0),
}
_COMPONENT_RE = re.compile(r"[a-z][a-z0-9_.-]{0,31}\Z")


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
        base[key] = _expectation(v, value, at + (key,))


def _expectation(v: _Validator, value: Any, at: tuple) -> Any:
    kind, nullable, *args = _EXPECT_SPEC[_dotted(at[1:])]
    if value is None:
        if nullable:
            return None
        raise v.doc.fail(at, "must be set (null is not allowed here)")
    if kind == "text":
        return v.string(value, at, None, "value")
    if kind == "int":
        return v.integer(value, at, args[0], args[1], None)
    if kind == "number":
        number = v.number(value, at, None, args[0], args[1], lo_open=False)
        return value if isinstance(value, int) else number
    if kind == "bool":
        return v.boolean(value, at, None)
    if kind == "tri":
        if value not in _TRI or (not isinstance(value, (bool, str))):
            raise v.doc.fail(at, f"must be true, false or auto, got {_shown(v.doc, value, at)}")
        return value
    if kind == "choice":
        return v.choice(value, at, args[0], args[0][0])
    if kind == "int_or":
        if value == args[2]:
            return value
        if isinstance(value, str):
            raise v.doc.fail(at, f"must be an integer or {args[2]}, got {value[:40]!r}")
        return v.integer(value, at, args[0], args[1], None)
    if kind == "ints":
        if not isinstance(value, list):
            raise v.doc.fail(at, f"must be a list of integers, got {_shown(v.doc, value, at)}")
        return [v.integer(x, at + (i,), args[0], args[1], None) for i, x in enumerate(value)]
    if kind == "texts":
        if not isinstance(value, list) or len(value) > 64:
            raise v.doc.fail(at, f"must be a list of at most 64 strings, got "
                                 f"{_shown(v.doc, value, at)}")
        return [v.string(x, at + (i,), None, "value", optional=False) for i, x in enumerate(value)]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise v.doc.fail(at, f"must be a list of names, got {_shown(v.doc, value, at)}")
    for i, name in enumerate(value):
        if not _COMPONENT_RE.fullmatch(name):
            raise v.doc.fail(at + (i,), f"invalid component name {name[:40]!r}")
    return list(value)


def _model_path(v: _Validator, top: dict) -> str | None:
    if "model" in top and top["model"] is not None:
        m = v.mapping(top["model"], ("model",), _MODEL_KEYS)
        return v.path(m.get("path"), ("model", "path"))
    return v.path(top.get("model_path"), ("model_path",))


def _secret_names(v: _Validator, raw: Any) -> tuple[str, ...]:
    """secrets.extra_names: env names (or parts of names) whose values are secrets too."""
    if raw is None:
        return ()
    at = ("secrets",)
    m = v.mapping(raw, at, _SECRETS_KEYS)
    names = m.get("extra_names")
    if names is None:
        return ()
    if not isinstance(names, list):
        raise v.doc.fail(at + ("extra_names",), f"must be a list of names, got {_type_name(names)}")
    return tuple(v.string(n, at + ("extra_names", i), _ENV_KEY_RE, "environment variable name",
                          optional=False) for i, n in enumerate(names))


def _relative_to(base: Path, value: str | None) -> str | None:
    """Paths in an inventory file are relative to the file's folder (~ is expanded later)."""
    if value is None or value.startswith(("~", "/")):
        return value
    return str(base / value)
