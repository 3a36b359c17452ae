"""The serving apps' arguments, validated, and the pure decisions made from them.

Nothing here imports Ray or vLLM: `cluster deploy --dry-run` (and the tests) can turn app args
into the placement bundles, the Serve deployment options and the vLLM engine kwargs on a
machine without either installed.

Args follow ray.serve.llm's LLMConfig field names, so a config reads the same to anyone who
knows that library:

    model_loading_config: {model_id: NAME, model_source: PATH}   # model_id = served_model_name
    engine_kwargs: {tensor_parallel_size: 2, max_model_len: 4096, ...}  # vLLM engine + frontend args
    deployment_config: {num_replicas: 1, max_ongoing_requests: 1024, ...}  # Serve deployment options
    placement_group_config: {bundle_per_worker: {GPU: 1, CPU: 1}, strategy: PACK}
    runtime_env: {env_vars: {VLLM_CPU_KVCACHE_SPACE: "1", NCCL_SOCKET_IFNAME: eth0}}
    api_key_env: SERVE_API_KEY          # NAME of the env var holding the key, never the key
    enable_request_logging: false       # per-request logs (Serve access log, vLLM request log)
    device: auto                        # auto | gpu | cpu
    process_priority: 0                 # nice value for the replica and its engine; null: leave
    replica_num_cpus: null              # CPUs the replica actor itself claims (default 1 GPU / 0 CPU)
    dry_run: false                      # no engine: place probe actors in the bundles instead
    executor: auto                      # auto | native | ray (see executor_backend)
    multi_node:                         # native multi-node engines (engine_kwargs.nnodes > 1)
      port_min: 29500                   # master / MoE DP RPC ports come from this range (inventory's
      port_max: 29599                   #   ray.vllm_port_min/max; firewalls can allow it)
      node_env: {198.18.4.2: {VLLM_HOST_IP: 198.18.4.2, GLOO_SOCKET_IFNAME: eth0}}
      watch_period_s: 1.0               # every rank is asked its state this often ...
      watch_timeout_s: 5.0              # ... and is dead when it does not answer in time

Executor (`executor`): "native" is vLLM's own multi-node mode: one engine process per node,
node rank 0 in the replica, the others headless in rank actors (serve_apps/gang.py); the
node split is engine_kwargs.nnodes (cluster/planning/gang.py maps ranks to nodes). It is what vLLM's
own multi-node guide runs (Ray is optional to vLLM since 2026), the only one that runs on the
CPU build (CpuPlatform has no Ray device key) and its master port comes from a fixed range.
"ray" is vLLM's Ray executor (one engine process, workers as actors in the bundles; GPU only).
Default "auto": native on CPU and whenever nnodes > 1; on GPU with nnodes 1 the Ray executor,
the path this project verified on GPU placement before the native one existed.

MoE (build_moe_app, engine_kwargs.data_parallel_size D > 1, expert parallel): always native,
vLLM's recommended multi-node DP layout: one replica = one engine of D DP ranks over nnodes
nodes, one engine launch per node (node 0 in the replica, serving every DP rank; node n a
headless rank actor with data_parallel_start_rank n x D / nnodes); the DP RPC port comes from
the same multi_node range (cluster/planning/gang.py node_engine_kwargs).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from cluster.base.errors import UsageError
from cluster.planning.gang import GangLayout, gang_bundles, gang_layout, node_engine_kwargs

DEVICES = ("auto", "gpu", "cpu")
STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
# Serve options this module computes; a user value would silently break placement.
COMPUTED_DEPLOYMENT_KEYS = ("placement_group_bundles", "placement_group_strategy",
                            "gang_scheduling_config")  # the last: no longer set, still refused
# Engine kwargs the app sets from other fields.
RESERVED_ENGINE_KEYS = ("model", "served_model_name", "data_parallel_rank",
                        "data_parallel_address", "data_parallel_rpc_port",
                        "data_parallel_size_local", "data_parallel_start_rank", "node_rank",
                        "master_addr", "master_port")
EXECUTORS = ("auto", "native", "ray")
MULTI_NODE_KEYS = ("port_min", "port_max", "node_env", "watch_period_s", "watch_timeout_s")
DEFAULT_PORT_RANGE = (29500, 29599)
DEFAULT_MAX_ONGOING_REQUESTS = 1024
KNOWN_KEYS = ("model_loading_config", "engine_kwargs", "deployment_config",
              "placement_group_config", "runtime_env", "api_key_env",
              "enable_request_logging", "device", "process_priority", "replica_num_cpus",
              "dry_run", "executor", "multi_node")


class AppConfigError(UsageError):
    """App args that cannot be served as given; the message names the field."""


@dataclass(frozen=True)
class AppConfig:
    """One served model: what to load, how to run vLLM, how Serve places it."""

    model_id: str
    model_source: str
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    deployment_config: Mapping[str, Any] = field(default_factory=dict)
    placement_group_config: Mapping[str, Any] | None = None
    runtime_env: Mapping[str, Any] = field(default_factory=dict)
    api_key_env: str | None = None
    enable_request_logging: bool = False
    device: str = "auto"
    process_priority: int | None = 0
    replica_num_cpus: float | None = None
    dry_run: bool = False
    executor: str = "auto"
    multi_node: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nnodes(self) -> int:
        """Nodes one engine spans in vLLM's native multi-node mode (1: one node)."""
        return int(self.engine_kwargs.get("nnodes", 1))

    @property
    def gang(self) -> GangLayout | None:
        """The node layout of one engine (None: a dense engine on one node). MoE DP + EP
        (data_parallel_size > 1) always has one: vLLM's DP layout, one engine launch per
        node (one node too)."""
        if self.nnodes <= 1 and self.data_parallel_size <= 1:
            return None
        return gang_layout(self.tensor_parallel_size, self.pipeline_parallel_size, self.nnodes,
                           self.data_parallel_size)

    @property
    def port_range(self) -> tuple[int, int]:
        return (int(self.multi_node.get("port_min", DEFAULT_PORT_RANGE[0])),
                int(self.multi_node.get("port_max", DEFAULT_PORT_RANGE[1])))

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size", 1))

    @property
    def pipeline_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("pipeline_parallel_size", 1))

    @property
    def data_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("data_parallel_size", 1))

    @property
    def workers_per_replica(self) -> int:
        """vLLM workers (one per device) of one engine: TP x PP (MoE: x DP)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def to_args(self) -> dict:
        """The args dict again (what a Serve config YAML holds)."""
        out: dict[str, Any] = {
            "model_loading_config": {"model_id": self.model_id, "model_source": self.model_source},
            "engine_kwargs": copy.deepcopy(dict(self.engine_kwargs)),
            "deployment_config": copy.deepcopy(dict(self.deployment_config)),
            "runtime_env": copy.deepcopy(dict(self.runtime_env)),
            "api_key_env": self.api_key_env,
            "enable_request_logging": self.enable_request_logging,
            "device": self.device,
            "process_priority": self.process_priority,
            "replica_num_cpus": self.replica_num_cpus,
            "dry_run": self.dry_run,
            "executor": self.executor,
            "multi_node": copy.deepcopy(dict(self.multi_node)),
        }
        if self.placement_group_config is not None:
            out["placement_group_config"] = copy.deepcopy(dict(self.placement_group_config))
        return out


def _mapping(args: Mapping, key: str) -> dict:
    value = args.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise AppConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    return copy.deepcopy(dict(value))


def _positive_int(kwargs: Mapping, key: str) -> None:
    value = kwargs.get(key, 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise AppConfigError(f"engine_kwargs.{key}: expected a positive integer, got {value!r}")


def _check_placement(pgc: Mapping, workers: int) -> None:
    unknown = set(pgc) - {"bundle_per_worker", "bundles", "strategy"}
    if unknown:
        raise AppConfigError(f"placement_group_config: unknown keys {sorted(unknown)}")
    if ("bundle_per_worker" in pgc) == ("bundles" in pgc):
        raise AppConfigError("placement_group_config: give exactly one of bundle_per_worker, bundles")
    strategy = pgc.get("strategy", "PACK")
    if strategy not in STRATEGIES:
        raise AppConfigError(f"placement_group_config.strategy: {strategy!r} not in {STRATEGIES}")
    if "bundles" in pgc:
        bundles = pgc["bundles"]
        if not isinstance(bundles, list) or not all(isinstance(b, Mapping) for b in bundles):
            raise AppConfigError("placement_group_config.bundles: expected a list of mappings")
        if len(bundles) != workers:
            raise AppConfigError(
                f"placement_group_config.bundles: {len(bundles)} bundles for "
                f"tensor_parallel_size x pipeline_parallel_size = {workers} workers")
    elif not isinstance(pgc["bundle_per_worker"], Mapping):
        raise AppConfigError("placement_group_config.bundle_per_worker: expected a mapping")


def parse_app_args(args: Mapping[str, Any]) -> AppConfig:
    """Validate the app args (a Serve config's `args:`) into an AppConfig."""
    if isinstance(args, AppConfig):
        return args
    if not isinstance(args, Mapping):
        raise AppConfigError(f"app args: expected a mapping, got {type(args).__name__}")
    unknown = set(args) - set(KNOWN_KEYS)
    if unknown:
        raise AppConfigError(f"unknown app args {sorted(unknown)}; known: {list(KNOWN_KEYS)}")
    loading = _mapping(args, "model_loading_config")
    model_id, model_source = loading.get("model_id"), loading.get("model_source")
    if not model_id or not isinstance(model_id, str):
        raise AppConfigError("model_loading_config.model_id: required (the served model name)")
    if model_source is None:
        model_source = model_id
    if not isinstance(model_source, str):
        raise AppConfigError("model_loading_config.model_source: expected a path or HF id")
    engine_kwargs = _mapping(args, "engine_kwargs")
    reserved = sorted(set(engine_kwargs) & set(RESERVED_ENGINE_KEYS))
    if reserved:
        raise AppConfigError(
            f"engine_kwargs: {reserved} are set by the app (model/served_model_name come from "
            "model_loading_config; data-parallel rank/address/port from the gang)")
    if "api_key" in engine_kwargs:
        raise AppConfigError("engine_kwargs.api_key: never put the key in args; name its "
                             "environment variable in api_key_env")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                "nnodes"):
        _positive_int(engine_kwargs, key)
    deployment_config = _mapping(args, "deployment_config")
    computed = sorted(set(deployment_config) & set(COMPUTED_DEPLOYMENT_KEYS))
    if computed:
        raise AppConfigError(f"deployment_config: {computed} are computed from "
                             "placement_group_config and engine_kwargs; set those instead")
    pgc = args.get("placement_group_config")
    if pgc is not None:
        pgc = _mapping(args, "placement_group_config")
    device = args.get("device") or "auto"
    if device not in DEVICES:
        raise AppConfigError(f"device: {device!r} not in {DEVICES}")
    api_key_env = args.get("api_key_env")
    if api_key_env is not None and (not isinstance(api_key_env, str) or not api_key_env.isidentifier()):
        raise AppConfigError("api_key_env: expected the NAME of an environment variable")
    priority = args.get("process_priority", 0)
    if priority is not None and (not isinstance(priority, int) or not -20 <= priority <= 19):
        raise AppConfigError(f"process_priority: expected a nice value -20..19 or null, got {priority!r}")
    replica_cpus = args.get("replica_num_cpus")
    if replica_cpus is not None and (not isinstance(replica_cpus, (int, float)) or replica_cpus < 0):
        raise AppConfigError(f"replica_num_cpus: expected a number >= 0, got {replica_cpus!r}")
    executor = args.get("executor") or "auto"
    if executor not in EXECUTORS:
        raise AppConfigError(f"executor: {executor!r} not in {EXECUTORS}")
    multi_node = _multi_node(_mapping(args, "multi_node"))
    config = AppConfig(
        executor=executor, multi_node=multi_node,
        model_id=model_id, model_source=model_source, engine_kwargs=engine_kwargs,
        deployment_config=deployment_config, placement_group_config=pgc,
        runtime_env=_mapping(args, "runtime_env"), api_key_env=api_key_env,
        enable_request_logging=bool(args.get("enable_request_logging", False)),
        device=device, process_priority=priority, replica_num_cpus=replica_cpus,
        dry_run=bool(args.get("dry_run", False)))
    if pgc is not None:
        _check_placement(pgc, config.workers_per_replica)
    try:
        config.gang  # noqa: B018 - validates nnodes against TP x PP
    except UsageError as exc:
        raise AppConfigError(f"engine_kwargs.nnodes: {exc}") from None
    if config.gang is not None and executor == "ray":
        raise AppConfigError("executor: ray places the workers itself (one engine process); "
                             "engine_kwargs.nnodes > 1 and MoE data_parallel_size > 1 run "
                             "vLLM's native multi-node mode: use executor native or auto")
    return config


def _number(m: Mapping, key: str, lo: float, hi: float) -> None:
    value = m.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not lo <= value <= hi or value != value:
        raise AppConfigError(f"multi_node.{key}: expected a number {lo:g}..{hi:g}, got {value!r}")


def _multi_node(m: dict) -> dict:
    """multi_node: the port range (1024..65535, first <= last), per-node env, watch bounds."""
    unknown = set(m) - set(MULTI_NODE_KEYS)
    if unknown:
        raise AppConfigError(f"multi_node: unknown keys {sorted(unknown)}")
    for key in ("port_min", "port_max"):
        value = m.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1024 <= value <= 65535):
            raise AppConfigError(f"multi_node.{key}: expected a port 1024..65535, got {value!r}")
    lo = m.get("port_min", DEFAULT_PORT_RANGE[0])
    hi = m.get("port_max", DEFAULT_PORT_RANGE[1])
    if lo > hi:
        raise AppConfigError(f"multi_node: port_min {lo} > port_max {hi}")
    _number(m, "watch_period_s", 0.1, 60.0)
    _number(m, "watch_timeout_s", 0.5, 120.0)
    node_env = m.get("node_env") or {}
    if not isinstance(node_env, Mapping) or not all(
            isinstance(ip, str) and isinstance(env, Mapping) and
            all(isinstance(k, str) and k.isidentifier() and isinstance(v, (str, int))
                for k, v in env.items())
            for ip, env in node_env.items()):
        raise AppConfigError("multi_node.node_env: expected {node_ip: {NAME: value}}")
    m["node_env"] = {ip: {k: str(v) for k, v in env.items()} for ip, env in node_env.items()}
    return m


def resolve_device(config: AppConfig, cluster_resources: Mapping[str, float]) -> str:
    """'gpu' or 'cpu': the explicit device, else gpu when the cluster has GPU resources."""
    if config.device != "auto":
        return config.device
    return "gpu" if cluster_resources.get("GPU", 0) > 0 else "cpu"


def worker_bundles(config: AppConfig, device: str) -> list[dict[str, float]]:
    """One bundle per vLLM worker (TP x PP) of one replica, before the replica's own share."""
    pgc = config.placement_group_config or {}
    if "bundles" in pgc:
        return [dict(b) for b in pgc["bundles"]]
    if "bundle_per_worker" in pgc:
        per_worker = dict(pgc["bundle_per_worker"])
    else:
        per_worker = {"GPU": 1, "CPU": 1} if device == "gpu" else {"CPU": 1}
    return [dict(per_worker) for _ in range(config.workers_per_replica)]


def replica_actor_resources(config: AppConfig, device: str) -> dict[str, float]:
    """What the replica actor (API server + engine client) claims for itself.

    On GPU nodes one CPU for the HTTP/tokenizer side; on CPU the engine's workers hold the
    bundle CPUs and the replica claims none (a 2-core node could not fit TP 2 otherwise).
    """
    actor_options = config.deployment_config.get("ray_actor_options", {}) or {}
    default_cpus = 1 if device == "gpu" else 0
    cpus = config.replica_num_cpus
    if cpus is None:
        cpus = actor_options.get("num_cpus", default_cpus)
    resources = {"CPU": cpus, "GPU": actor_options.get("num_gpus", 0)}
    resources.update(actor_options.get("resources", {}) or {})
    if "memory" in actor_options:
        resources["memory"] = actor_options["memory"]
    return resources


def replica_bundles(config: AppConfig, device: str) -> list[dict[str, float]]:
    """Serve's placement_group_bundles: the replica's share merged into bundle 0.

    The replica actor is scheduled into bundle 0, so it sits on the node of the first
    pipeline stage, next to the worker that vLLM gives global rank 0. A multi-node engine
    has one bundle per node rank instead (cluster.planning.gang.gang_bundles; STRICT_SPREAD).
    """
    layout = config.gang
    if layout is not None:
        return gang_bundles(layout, worker_bundles(config, device)[0],
                            replica_actor_resources(config, device))
    bundles = worker_bundles(config, device)
    own = replica_actor_resources(config, device)
    first = dict(bundles[0])
    for key, value in own.items():
        first[key] = first.get(key, 0) + value
    merged = [first] + [dict(b) for b in bundles[1:]]
    return [{k: v for k, v in b.items() if v} or {"CPU": 0} for b in merged]


def placement_strategy(config: AppConfig) -> str:
    return (config.placement_group_config or {}).get("strategy", "PACK")


def native_executor(config: AppConfig, device: str) -> bool:
    """True when the replica runs vLLM's own mp executor (native; one node or many), False
    for vLLM's Ray executor. auto: native across nodes (and on CPU), Ray on one GPU node."""
    if config.executor == "native" or config.gang is not None:
        return True
    if config.executor == "ray":
        if device == "cpu":
            raise AppConfigError("executor: ray cannot run on CPU (vLLM's CPU platform has no "
                                 "Ray device key); use native or auto")
        return False
    return device == "cpu"


def executor_backend(config: AppConfig, device: str) -> str:
    """vLLM's distributed_executor_backend for this app: "mp" for the native executor, "ray"
    for vLLM's Ray executor (see native_executor). Always explicit: inside a placement group
    vLLM would pick the Ray executor by itself, which fails on CPU."""
    requested = config.engine_kwargs.get("distributed_executor_backend")
    wanted = "mp" if native_executor(config, device) else "ray"
    if requested is not None and requested != wanted:
        raise AppConfigError(
            f"engine_kwargs.distributed_executor_backend={requested!r} cannot run on {device} "
            f"with executor {config.executor!r} (the app uses {wanted!r}; vLLM's CPU platform "
            "has no Ray executor): set the app's `executor` instead")
    return wanted


def engine_kwargs_for(config: AppConfig, device: str) -> dict[str, Any]:
    """The AsyncEngineArgs/frontend kwargs one replica hands to vLLM (before DP rank info)."""
    kwargs = copy.deepcopy(dict(config.engine_kwargs))
    kwargs["model"] = config.model_source
    kwargs["served_model_name"] = [config.model_id]
    kwargs["distributed_executor_backend"] = executor_backend(config, device)
    kwargs.setdefault("enable_log_requests", config.enable_request_logging)
    # Engine stats feed /metrics (vllm:*); they are periodic, not per request.
    kwargs.setdefault("disable_log_stats", False)
    return kwargs


def deployment_name(model_id: str) -> str:
    """The Serve deployment's name of a model (the laptop names it in the config's
    `deployments:` overrides, e.g. a roll's surge options)."""
    return "vllm-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", model_id).strip("-")


def num_serve_replicas(config: AppConfig) -> int | str | None:
    """Serve replicas: one per engine; a MoE engine holds all DP ranks of its EP group."""
    return config.deployment_config.get("num_replicas")


def serve_deployment_options(config: AppConfig, device: str) -> dict[str, Any]:
    """Options for serve.deployment(...).options(**these) of one model's deployment."""
    options = copy.deepcopy(dict(config.deployment_config))
    options.setdefault("max_ongoing_requests", DEFAULT_MAX_ONGOING_REQUESTS)
    # Startup of a large model takes minutes; Serve's default health-check timeout is 30 s.
    options.setdefault("health_check_timeout_s", 120)
    logging_config = dict(options.get("logging_config") or {})
    logging_config.setdefault("enable_access_log", config.enable_request_logging)
    options["logging_config"] = logging_config
    actor_options = dict(options.get("ray_actor_options") or {})
    own = replica_actor_resources(config, device)
    if config.gang is not None:
        # Node rank 0: the replica's engine core starts that node's workers itself, so it
        # holds the whole bundle (on GPU nodes Ray then sets CUDA_VISIBLE_DEVICES for it);
        # a stuck or dead rank must fail the health check quickly.
        own = replica_bundles(config, device)[0]
        options.setdefault("health_check_period_s", 5)
    actor_options["num_cpus"] = own.get("CPU", 0)
    actor_options["num_gpus"] = own.get("GPU", 0)
    runtime_env = copy.deepcopy(dict(actor_options.get("runtime_env") or {}))
    for key, value in config.runtime_env.items():
        if key == "env_vars":
            env = dict(runtime_env.get("env_vars") or {})
            env.update({k: str(v) for k, v in (value or {}).items()})
            runtime_env["env_vars"] = env
        else:
            runtime_env[key] = copy.deepcopy(value)
    if runtime_env:
        actor_options["runtime_env"] = runtime_env
    options["ray_actor_options"] = actor_options
    options["placement_group_bundles"] = replica_bundles(config, device)
    replicas = num_serve_replicas(config)
    if replicas is not None:
        options["num_replicas"] = replicas
    if config.gang is not None:
        options["placement_group_strategy"] = "STRICT_SPREAD"
    else:
        options["placement_group_strategy"] = placement_strategy(config)
    return options


# The env a placement report shows of a rank: the fabric variables from the inventory only (an
# app env may hold anything a hand-written Serve config put there).
REPORTED_ENV_PREFIXES = ("VLLM_HOST_IP", "NCCL_", "GLOO_", "CUDA_VISIBLE_DEVICES")


def reported_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """The fabric part of a rank's env, for /v1/placement."""
    return {k: v for k, v in env.items() if k.startswith(REPORTED_ENV_PREFIXES)}


@dataclass(frozen=True)
class GangNode:
    """One node of a replica's engine: where it runs (its bundle) and what it starts with."""

    node_rank: int
    bundle_index: int
    node_id: str
    node_ip: str
    resources: Mapping[str, float]
    env: Mapping[str, str]               # the app's env, then the node's own (inventory)
    engine_kwargs: Mapping[str, Any]     # cluster.planning.gang.node_engine_kwargs
    headless: bool                       # node rank > 0: a rank actor, no API

    def to_dict(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, "bundle_index": self.bundle_index,
                "node_id": self.node_id, "node_ip": self.node_ip,
                "resources": dict(self.resources), "env": reported_env(self.env),
                "engine_kwargs": dict(self.engine_kwargs), "headless": self.headless}


def gang_nodes(config: AppConfig, bundles: list[Mapping[str, Any]],
               engine_kwargs: Mapping[str, Any], address: str, port: int) -> list[GangNode]:
    """Every node of one replica's engine from its placement group's bundles (as
    serve_apps.vllm_app describe_placement_group lists them: index, node_id, node_ip,
    resources): node rank n runs in bundle n with its node's env and engine kwargs; node rank
    0 is the replica itself at `address` (its node's IP), the master / DP RPC `port`.
    Raises AppConfigError when the bundles do not give every node rank its own node."""
    layout = config.gang
    if layout is None:
        raise AppConfigError("not a multi-node engine (engine_kwargs.nnodes 1, no MoE DP)")
    if len(bundles) != layout.nnodes:
        raise AppConfigError(f"{len(bundles)} bundles for a gang of {layout.nnodes} nodes")
    node_ids = [b["node_id"] for b in bundles]
    if len(set(node_ids)) != len(node_ids):
        raise AppConfigError(f"the gang's bundles share nodes ({node_ids}): they must be "
                             "STRICT_SPREAD, one node rank per node")
    if bundles[0]["node_ip"] != address:
        raise AppConfigError(f"node rank 0 is the replica at {address}, but bundle 0 is on "
                             f"{bundles[0]['node_ip']}")
    node_env = config.multi_node.get("node_env") or {}
    app_env = {k: str(v) for k, v in (config.runtime_env.get("env_vars") or {}).items()}
    return [GangNode(node.node_rank, node.node_rank, str(bundle["node_id"]),
                     str(bundle["node_ip"]), dict(bundle["resources"]),
                     {**app_env, **node_env.get(bundle["node_ip"], {})},
                     node_engine_kwargs(layout, engine_kwargs, node.node_rank, address, port),
                     node.node_rank > 0)
            for node, bundle in zip(layout.nodes, bundles)]


def tp_groups_split_across_nodes(bundle_nodes: list[str], tp: int, pp: int) -> list[int]:
    """Pipeline stages whose TP group would straddle nodes, given each bundle's node.

    vLLM's Ray executor orders workers by node (the driver's node first), then gives
    consecutive ranks to a TP group. A stage's TP group sits in one node exactly when the
    per-node bundle counts, taken in that order, cut at multiples of tp.
    """
    if len(bundle_nodes) != tp * pp:
        raise AppConfigError(f"{len(bundle_nodes)} bundles for TP {tp} x PP {pp}")
    first = bundle_nodes[0] if bundle_nodes else None
    ordered = sorted(bundle_nodes, key=lambda n: (n != first, n))
    return [stage for stage in range(pp)
            if len(set(ordered[stage * tp:(stage + 1) * tp])) > 1]
