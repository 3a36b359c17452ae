"""Serving a model on the Ray cluster: a plan (or flags) -> a Ray Serve config, then deploy it.

Pure part (no Ray, no network; the tests call it directly):
    spec_from_plan / spec_from_flags  -> DeploySpec (what to serve and how it is split)
    ClusterView.from_state            -> the alive Ray nodes and their resources
    runtime_env_vars                  -> vLLM/NCCL environment for the replicas
    build_application / serve_config  -> the Serve config dict (`serve deploy` / REST API shape)
    placement_preview                 -> the bundles Serve will reserve (serve_apps' own rules)
    app_state / log targets           -> Serve's status reply read for one application
    engine_core_error                 -> the exception vLLM's engine core died of, from log tails

Side-effecting part (takes a Session and a DashboardClient):
    check_nodes     model files and the API-key variable on every node that may host a bundle
                    (facts gathered by cluster/inspection/facts.py)
    deploy_app      PUT (merged with the other apps on the head)
    undeploy_app    PUT of the remaining apps
    collect_log_tails  the replica's Serve log and its worker's stderr, read on its node

The waits (until RUNNING, until gone) are playbooks/serve_wait.py's, on cluster/base/waits.py.

The API key never passes through here: only the NAME of the environment variable goes into the
app args; the value must be in the environment `ray start` gave each node (the inventory's
node `env:`), which Ray workers inherit.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from cluster.base.bounds import bound, check_int, reply_number
from cluster.nodes.endpoints import log_dir, url_host
from cluster.base.errors import UsageError
from cluster.base.results import Record
from cluster.planning.gang import gang_layout, nodes_needed
from cluster.nodes.inventory import Inventory, Node, is_secret_name
from cluster.planning.plan_file import SECRET_ENGINE_ARG_RE, SERVED_NAME_RE, PlanFile
from cluster.nodes.ray_env import fabric_env, uniform_fabric_env

DENSE_IMPORT_PATH = "serve_apps.vllm_app:build_app"
MOE_IMPORT_PATH = "serve_apps.vllm_app:build_moe_app"
DEVICES = ("auto", "gpu", "cpu")
EXECUTORS = ("auto", "native", "ray")
# A multi-node engine's step timeout (vLLM's default 300 s): the gang watch fails a broken
# gang within seconds; this bounds what the watch cannot see (a rank that answers but hangs).
GANG_EXECUTE_TIMEOUT_S = "60"
STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
DEFAULT_API_KEY_ENV = "CLUSTER_API_KEY"
DEFAULT_TIMEOUT_S = 900.0
DEFAULT_CPU_KVCACHE_GIB = "1"
RUNNING, DEPLOY_FAILED, DEPLOYING, UNHEALTHY, DELETING = (
    "RUNNING", "DEPLOY_FAILED", "DEPLOYING", "UNHEALTHY", "DELETING")

APP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ROUTE_PREFIX_RE = re.compile(r"^/(?:[A-Za-z0-9._~-]+(?:/[A-Za-z0-9._~-]+)*)?$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENGINE_ARG_RE = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
# Engine args that have their own flag, or that the app sets itself.
RESERVED_ENGINE_ARGS = ("model", "served_model_name", "tensor_parallel_size",
                        "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
                        "api_key", "distributed_executor_backend", "data_parallel_rank",
                        "data_parallel_address", "data_parallel_rpc_port", "nnodes",
                        "node_rank", "master_addr", "master_port")
# Per-node by nature: set at `ray start` from the inventory, never cluster-wide.
PER_NODE_ENV = ("VLLM_HOST_IP",)
# Engine args that mean nothing to vLLM's CPU backend (it sizes KV with VLLM_CPU_KVCACHE_SPACE).
GPU_ONLY_ENGINE_ARGS = ("gpu_memory_utilization",)


# ---------------------------------------------------------------- what to serve


@dataclass(frozen=True)
class DeploySpec:
    """One model to serve: the parallel layout, names, and serving options."""

    name: str
    model: str
    served_model_name: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1        # MoE: data-parallel attention ranks of one EP group
    replicas: int = 1                  # dense: engines (data parallel); MoE: EP groups
    expert_parallel: bool = False
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    placement_strategy: str | None = None
    api_key_env: str | None = DEFAULT_API_KEY_ENV
    route_prefix: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    request_logging: bool = False
    device: str = "auto"
    source: str = "flags"
    placement_only: bool = False       # serve_apps dry_run: probe actors in the bundles, no engine
    nnodes: int | None = None          # nodes one engine spans (None: the fewest that fit)
    executor: str = "auto"             # serve_apps executor: auto | native | ray
    stage_caches: bool = False         # compile caches staged to every node (cache_stage.py)

    @property
    def workers_per_replica(self) -> int:
        """vLLM workers (one GPU each on GPU nodes) of one engine: TP x PP (MoE: x DP)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def import_path(self) -> str:
        return MOE_IMPORT_PATH if self.expert_parallel else DENSE_IMPORT_PATH

    @property
    def route(self) -> str:
        return self.route_prefix or f"/{self.name}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model,
                "served_model_name": self.served_model_name,
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "data_parallel_size": self.data_parallel_size, "replicas": self.replicas,
                "expert_parallel": self.expert_parallel, "engine_kwargs": dict(self.engine_kwargs),
                "placement_strategy": self.placement_strategy, "api_key_env": self.api_key_env,
                "route_prefix": self.route, "env": dict(self.env),
                "request_logging": self.request_logging, "device": self.device,
                "source": self.source, "import_path": self.import_path,
                "placement_only": self.placement_only, "nnodes": self.nnodes,
                "executor": self.executor, "stage_caches": self.stage_caches}


def app_name_for(served_model_name: str) -> str:
    """A Serve application name (and default route) derived from the served model name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", served_model_name).strip("-._")[:63]
    return name or "model"


def _check_name(name: str) -> str:
    if not APP_NAME_RE.match(name):
        raise UsageError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (at most 63, "
                         "starting with a letter or digit)")
    return name


def _check_served(name: str) -> str:
    if not SERVED_NAME_RE.match(name):
        raise UsageError(f"served model name {name!r}: use letters, digits and ._:/@+- "
                         "(at most 128 characters)")
    return name


def _check_route(prefix: str | None) -> str | None:
    if prefix is not None and not ROUTE_PREFIX_RE.match(prefix):
        raise UsageError(f"--route-prefix {prefix!r}: a URL path such as /my-model "
                         "(letters, digits, ._~- and /, no trailing slash)")
    return prefix


def _check_model_path(path: str) -> str:
    if not path.startswith("/") or not re.match(r"^/[A-Za-z0-9._/+@%=,:-]*$", path):
        raise UsageError(f"model path {path!r}: give the absolute path of the model directory "
                         "on the nodes (no ~, no shell characters)")
    return path.rstrip("/") or "/"


def _check_api_key_env(name: str | None) -> str | None:
    if name is not None and not ENV_NAME_RE.match(name):
        raise UsageError(f"--api-key-env {name!r}: give the NAME of an environment variable "
                         "(the key itself never goes on the command line)")
    return name


def check_user_env(env: Mapping[str, str], api_key_env: str | None) -> dict[str, str]:
    """--env K=V pairs for the replicas: no secrets (they would be written into the YAML)."""
    out = {}
    for key, value in env.items():
        if not ENV_NAME_RE.match(key):
            raise UsageError(f"--env {key!r}: not an environment variable name")
        if key == api_key_env or is_secret_name(key):
            raise UsageError(f"--env {key}: secrets never go into the Serve config (it is "
                             "written to the run directory and shown by the dashboard); put it "
                             "in the nodes' `env:` in the inventory, set at `ray start`")
        if key in PER_NODE_ENV:
            raise UsageError(f"--env {key}: differs per node; the inventory sets it at "
                             "`ray start` on each node")
        if "\n" in value or "\0" in value:
            raise UsageError(f"--env {key}: the value must not contain newlines or NUL")
        out[key] = value
    return out


def check_engine_args(extra: Mapping[str, Any]) -> dict[str, Any]:
    """--engine-arg K=V pairs: vLLM's snake_case names, none that has its own flag."""
    out = {}
    for key, value in extra.items():
        if not ENGINE_ARG_RE.match(key):
            raise UsageError(f"--engine-arg {key!r}: use vLLM's snake_case argument names "
                             "(e.g. enforce_eager=true)")
        if key in RESERVED_ENGINE_ARGS:
            raise UsageError(f"--engine-arg {key}: set by `cluster deploy` itself (use --model, "
                             "--served-model-name, --tp, --pp, --dp, --expert-parallel, "
                             "--api-key-env)")
        if SECRET_ENGINE_ARG_RE.search(key):
            raise UsageError(f"--engine-arg {key}: secrets never go into the Serve config")
        out[key] = value
    return out


def _positive(value: int | None, flag: str) -> int:
    """A parallel size (--tp/--pp/--dp), 1 when not given."""
    if value is None:
        return 1
    return check_int(value, flag, lo=1, hi=bound("plan", "parallel_size"))


def spec_from_flags(model: str, *, tp: int | None = None, pp: int | None = None,
                    dp: int | None = None, expert_parallel: bool = False,
                    name: str | None = None, served_model_name: str | None = None,
                    max_model_len: int | None = None, engine_args: Mapping[str, Any] = (),
                    api_key_env: str | None = DEFAULT_API_KEY_ENV,
                    route_prefix: str | None = None, env: Mapping[str, str] = (),
                    request_logging: bool = False, device: str = "auto",
                    placement_only: bool = False, nnodes: int | None = None,
                    executor: str = "auto", stage_caches: bool = False) -> DeploySpec:
    """--model PATH [--tp N] [--pp N] [--dp N]: dense replicas = DP, or MoE DP+EP ranks."""
    model = _check_model_path(model)
    tp, pp, dp = _positive(tp, "--tp"), _positive(pp, "--pp"), _positive(dp, "--dp")
    served = _check_served(served_model_name or Path(model).name)
    kwargs = check_engine_args(dict(engine_args or {}))
    if max_model_len is not None:
        kwargs["max_model_len"] = _max_len(max_model_len)
    return _finish(DeploySpec(
        name=_check_name(name or app_name_for(served)), model=model, served_model_name=served,
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
        data_parallel_size=dp if expert_parallel else 1,
        replicas=1 if expert_parallel else dp, expert_parallel=expert_parallel,
        engine_kwargs=kwargs, api_key_env=api_key_env, route_prefix=route_prefix,
        env=dict(env or {}), request_logging=request_logging, device=device, source="flags",
        placement_only=placement_only, nnodes=nnodes, executor=executor,
        stage_caches=stage_caches))


def spec_from_plan(plan: PlanFile, *, model: str | None = None, name: str | None = None,
                   served_model_name: str | None = None, max_model_len: int | None = None,
                   engine_args: Mapping[str, Any] = (),
                   api_key_env: str | None = DEFAULT_API_KEY_ENV,
                   route_prefix: str | None = None, env: Mapping[str, str] = (),
                   request_logging: bool = False, device: str = "auto",
                   placement_only: bool = False, nnodes: int | None = None,
                   executor: str | None = None, stage_caches: bool = False) -> DeploySpec:
    """A validated plan file (cluster plan --out) -> DeploySpec; flags override its names."""
    kwargs = {k: v for k, v in plan.engine_args.items()
              if k not in ("model", "served_model_name", "tensor_parallel_size",
                           "pipeline_parallel_size", "data_parallel_size",
                           "enable_expert_parallel")}
    if plan.max_model_len is not None:
        kwargs.setdefault("max_model_len", plan.max_model_len)
    kwargs.update(check_engine_args(dict(engine_args or {})))
    if max_model_len is not None:
        kwargs["max_model_len"] = _max_len(max_model_len)
    served = _check_served(served_model_name or plan.served_model_name)
    ep = plan.enable_expert_parallel
    path = model or plan.model
    if path.endswith("/config.json"):  # planned from a bare config.json: serve its directory
        path = path[:-len("/config.json")]
    if model is None and not path.startswith("/"):
        raise UsageError(f"{plan.path}: model {plan.model!r} is not an absolute path on the "
                         "nodes: pass --model /path/on/the/nodes")
    return _finish(DeploySpec(
        name=_check_name(name or app_name_for(served)),
        model=_check_model_path(path), served_model_name=served,
        tensor_parallel_size=plan.tensor_parallel_size,
        pipeline_parallel_size=plan.pipeline_parallel_size,
        data_parallel_size=plan.data_parallel_size if ep else 1,
        replicas=plan.replicas, expert_parallel=ep, engine_kwargs=kwargs,
        placement_strategy=plan.placement_strategy, api_key_env=api_key_env,
        route_prefix=route_prefix, env=dict(env or {}), request_logging=request_logging,
        device=device, source=f"plan:{plan.path}", placement_only=placement_only,
        nnodes=nnodes if nnodes is not None else plan.nnodes,
        executor=executor or plan.executor or "auto",
        stage_caches=stage_caches or plan.stage_caches))


def _max_len(value: int) -> int:
    return check_int(value, "--max-model-len", lo=bound("plan", "max_model_len_min"),
                     hi=bound("plan", "max_model_len"))


def _finish(spec: DeploySpec) -> DeploySpec:
    if spec.device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {spec.device!r}")
    _check_route(spec.route_prefix)
    _check_api_key_env(spec.api_key_env)
    check_user_env(spec.env, spec.api_key_env)
    if spec.placement_strategy is not None and spec.placement_strategy not in STRATEGIES:
        raise UsageError(f"placement strategy {spec.placement_strategy!r} not in {STRATEGIES}")
    if spec.executor not in EXECUTORS:
        raise UsageError(f"--executor must be one of {', '.join(EXECUTORS)}, got {spec.executor!r}")
    if spec.nnodes is not None:
        if spec.executor == "ray" and spec.nnodes > 1:
            raise UsageError("--nnodes > 1 is vLLM's native multi-node mode; --executor ray "
                             "places the workers itself")
        gang_layout(spec.tensor_parallel_size, spec.pipeline_parallel_size, spec.nnodes,
                    spec.data_parallel_size)
    return spec


def engine_nodes(spec: DeploySpec, device: str, cluster: ClusterView) -> int:
    """Nodes one engine spans: --nnodes (or the plan's), else with the native executor (MoE
    DP + EP always: one engine launch per node) the fewest nodes whose smallest can hold each
    node's share (cluster.planning.gang.nodes_needed: TP inside nodes, PP across; MoE whole DP ranks
    per node), else 1 (vLLM's Ray executor spreads the workers itself)."""
    if spec.nnodes is not None:
        return spec.nnodes
    if not spec.expert_parallel and (spec.executor == "ray" or (spec.executor == "auto"
                                                                and device == "gpu")):
        return 1
    per_node = int(cluster.min_per_node("GPU" if device == "gpu" else "CPU"))
    if per_node < 1 or spec.workers_per_replica <= per_node:
        return 1
    try:
        nnodes = nodes_needed(spec.tensor_parallel_size, spec.pipeline_parallel_size, per_node,
                              dp=spec.data_parallel_size)
    except UsageError:
        return 1        # no split fits the nodes: the capacity check names it
    if gang_layout(spec.tensor_parallel_size, spec.pipeline_parallel_size, nnodes,
                   spec.data_parallel_size).tp_split:
        return 1        # TP across nodes only when asked (--nnodes): the capacity check says so
    return nnodes


# ---------------------------------------------------------------- the cluster as Ray sees it


@dataclass(frozen=True)
class RayNode:
    """One alive Ray node, matched to the inventory by IP (name None: not in the inventory)."""

    ip: str
    name: str | None
    cpus: float
    gpus: float
    is_head: bool = False
    gpu_model: str | None = None


@dataclass(frozen=True)
class ClusterView:
    """The alive Ray nodes (what can host bundles) and the Serve port in use."""

    nodes: tuple[RayNode, ...]

    @classmethod
    def from_state(cls, inventory: Inventory, state) -> "ClusterView":
        """From cluster.ray.ray_state.RayState (nodes with IP, alive flag and resources)."""
        by_ip = {n.ip: n.name for n in inventory.nodes}
        nodes = []
        for entry in state.nodes or ():
            if entry.alive:
                nodes.append(RayNode(entry.ip, by_ip.get(entry.ip), entry.cpus, entry.gpus,
                                     entry.is_head, getattr(entry, "gpu_model", None)))
        return cls(tuple(nodes))

    @classmethod
    def from_inventory(cls, inventory: Inventory,
                       gpus: Mapping[str, tuple[int, str | None]]) -> "ClusterView":
        """Without a head (a dry run before `cluster up`): every inventory node as Ray would
        register it, its GPUs from `gpus` (node -> (count, model): the latest preflight's
        facts, else the inventory's expectations.gpus_per_node; 0 when unknown), its CPUs
        the inventory's ray.num_cpus (0 when not set: not known without Ray)."""
        cpus = float(inventory.ray.num_cpus or 0)
        return cls(tuple(RayNode(n.ip, n.name, cpus, float(gpus.get(n.name, (0, None))[0]),
                                 n.is_head, gpus.get(n.name, (0, None))[1])
                         for n in inventory.nodes))

    @property
    def has_gpus(self) -> bool:
        return any(n.gpus > 0 for n in self.nodes)

    def resolve_device(self, asked: str) -> str:
        """The device the app runs on: the asked one, else gpu when Ray has GPU resources."""
        if asked != "auto":
            return asked
        return "gpu" if self.has_gpus else "cpu"

    def max_per_node(self, resource: str) -> float:
        values = [n.gpus if resource == "GPU" else n.cpus for n in self.nodes]
        return max(values) if values else 0.0

    def min_per_node(self, resource: str) -> float:
        values = [n.gpus if resource == "GPU" else n.cpus for n in self.nodes
                  if (n.gpus if resource == "GPU" else n.cpus) > 0]
        return min(values) if values else 0.0

    def total(self, resource: str) -> float:
        return sum(n.gpus if resource == "GPU" else n.cpus for n in self.nodes)

    @property
    def unnamed(self) -> tuple[RayNode, ...]:
        return tuple(n for n in self.nodes if n.name is None)


# ---------------------------------------------------------------- the Serve config (pure)


def cpu_bind_list(cpus: int, workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` engines' workers sharing `cpus` cores: '0|1',
    '0-3|4-7'. vLLM's automatic binding needs one NUMA node per worker and fails otherwise."""
    if workers < 1 or cpus < workers:
        raise UsageError(f"{workers} CPU workers need at least {workers} CPUs on one node; "
                         f"the nodes register {cpus}")
    per = cpus // workers
    ranges = []
    for i in range(workers):
        lo, hi = i * per, (i + 1) * per - 1
        ranges.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return "|".join(ranges)


def runtime_env_vars(spec: DeploySpec, device: str, cluster: ClusterView,
                     inventory: Inventory) -> dict[str, str]:
    """Environment for the replicas and the engine processes they start (runtime_env).

    Cluster-wide values only: per-node ones (VLLM_HOST_IP, differing NCCL interfaces) are set
    at `ray start` from the inventory. Flags (--env) win over these defaults.
    """
    nnodes = engine_nodes(spec, device, cluster)
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           # The model is a local directory, checked on every node: never reach for the Hub.
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KVCACHE_GIB
        workers = spec.workers_per_replica // nnodes     # the workers on each node
        if workers > 1 or nnodes > 1:
            cpus = int(cluster.min_per_node("CPU"))
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_list(cpus, workers)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    else:
        env.update(uniform_fabric_env(inventory))
        # The ranks' own init lines (transport per channel) for the post-start reading
        # (cluster/serving/engine_transport.py): INIT and NET only, printed once per communicator.
        env["NCCL_DEBUG"] = "INFO"
        env["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    if nnodes > 1:
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = GANG_EXECUTE_TIMEOUT_S
    env.update(check_user_env(spec.env, spec.api_key_env))
    return env


def multi_node_args(inventory: Inventory) -> dict[str, Any]:
    """The app's multi_node args: the inventory's gang port range and every node's env."""
    r = inventory.ray
    return {"port_min": r.vllm_port_min, "port_max": r.vllm_port_max,
            "node_env": {n.ip: fabric_env(n) for n in inventory.nodes}}


def placement_strategy(spec: DeploySpec, device: str, cluster: ClusterView) -> str:
    """The plan's strategy, else STRICT_PACK when one replica fits a node (TP inside a node),
    else PACK (pipeline stages spill to other nodes, each stage's TP group kept together)."""
    if spec.placement_strategy:
        return spec.placement_strategy
    resource = "GPU" if device == "gpu" else "CPU"
    per_node = cluster.max_per_node(resource)
    if per_node and spec.workers_per_replica > per_node:
        return "PACK"
    return "STRICT_PACK"


def engine_kwargs_for(spec: DeploySpec, device: str,
                      nnodes: int = 1) -> tuple[dict[str, Any], list[str]]:
    """(engine kwargs for the app args, notes on what was dropped or set)."""
    kwargs: dict[str, Any] = {"tensor_parallel_size": spec.tensor_parallel_size,
                              "pipeline_parallel_size": spec.pipeline_parallel_size}
    if nnodes > 1:
        kwargs["nnodes"] = nnodes
    if spec.expert_parallel:
        kwargs["data_parallel_size"] = spec.data_parallel_size
        kwargs["enable_expert_parallel"] = True
    notes = []
    for key, value in spec.engine_kwargs.items():
        if device == "cpu" and key in GPU_ONLY_ENGINE_ARGS:
            notes.append(f"engine arg {key}={value!r} dropped on CPU (the KV cache size is "
                         "VLLM_CPU_KVCACHE_SPACE there)")
            continue
        kwargs[key] = value
    return kwargs, notes


def build_application(spec: DeploySpec, device: str, cluster: ClusterView,
                      inventory: Inventory) -> tuple[dict[str, Any], list[str]]:
    """The `applications:` entry for this model (import_path + args) and notes.

    Args follow serve_apps.config (ray.serve.llm's LLMConfig names). The env goes into
    args.runtime_env, which the app applies to its replicas' actor options: a Serve app-level
    runtime_env would NOT reach a deployment that sets its own runtime_env.
    """
    if device not in ("cpu", "gpu"):
        raise UsageError(f"device must be cpu or gpu here, got {device!r}")
    nnodes = engine_nodes(spec, device, cluster)
    kwargs, notes = engine_kwargs_for(spec, device, nnodes)
    per_worker = {"GPU": 1, "CPU": 1} if device == "gpu" else {"CPU": 1}
    args: dict[str, Any] = {
        "model_loading_config": {"model_id": spec.served_model_name,
                                 "model_source": spec.model},
        "engine_kwargs": kwargs,
        "deployment_config": {"num_replicas": spec.replicas},
        "placement_group_config": {"bundle_per_worker": per_worker,
                                   "strategy": placement_strategy(spec, device, cluster)},
        "runtime_env": {"env_vars": runtime_env_vars(spec, device, cluster, inventory)},
        "api_key_env": spec.api_key_env,
        "enable_request_logging": spec.request_logging,
        "device": device,
        "executor": spec.executor,
    }
    if nnodes > 1:
        args["multi_node"] = multi_node_args(inventory)
        layout = gang_layout(spec.tensor_parallel_size, spec.pipeline_parallel_size, nnodes,
                             spec.data_parallel_size)
        port = "DP RPC" if layout.moe_dp else "master"
        notes.append(f"multi-node engine: {nnodes} nodes x {layout.local} ranks (vLLM native"
                     + (f", {layout.dp_local} DP ranks per node" if layout.moe_dp else "")
                     + f", {port} port from {inventory.ray.vllm_port_min}-"
                     f"{inventory.ray.vllm_port_max})" +
                     ("; a stage's TP group spans nodes" if layout.tp_split else ""))
    if spec.placement_only:
        args["dry_run"] = True
        notes.append("placement only: probe actors hold the bundles, no engine starts and "
                     "completions answer 503")
    app = {"name": spec.name, "route_prefix": spec.route, "import_path": spec.import_path,
           "args": args}
    return app, notes


def http_options(inventory: Inventory) -> dict[str, Any]:
    return {"host": "0.0.0.0", "port": inventory.ray.serve_port}


def serve_config(app: Mapping[str, Any], inventory: Inventory) -> dict[str, Any]:
    """A complete Serve config (ServeDeploySchema) holding this one application."""
    return {"proxy_location": "EveryNode", "http_options": http_options(inventory),
            "applications": [dict(app)]}


CONFIG_HEADER = """\
# Ray Serve config written by `cluster deploy` ({source}).
# `cluster deploy` sends it to the dashboard's REST API merged with the apps already running.
# To apply it by hand on the head:  serve deploy serve_config.yaml --address http://127.0.0.1:{port}
#   (careful: that REPLACES every other declaratively deployed application).
# The API key is not here: args.api_key_env names the variable the replicas read from the
# environment `ray start` gave each node.
"""


def render_config(config: Mapping[str, Any], source: str, dashboard_port: int) -> str:
    return CONFIG_HEADER.format(source=source, port=dashboard_port) + \
        yaml.safe_dump(json.loads(json.dumps(config)), sort_keys=False, allow_unicode=True)


def find_secrets(text: str, secrets: Sequence[str]) -> list[str]:
    """Secret values that occur in text (masked for the message)."""
    return [s[:2] + "***" for s in secrets if s and len(s) >= 4 and s in text]


def validate_args(app: Mapping[str, Any]):
    """serve_apps' own validation of the args (pure); returns its AppConfig."""
    from serve_apps.config import parse_app_args

    return parse_app_args(app["args"])


def placement_preview(app: Mapping[str, Any]) -> dict[str, Any]:
    """What Serve will reserve per replica, by serve_apps' own rules (no Ray needed)."""
    from serve_apps.config import serve_deployment_options

    config = validate_args(app)
    device = app["args"]["device"]
    options = serve_deployment_options(config, device)
    out = {"num_replicas": options.get("num_replicas"),
           "bundles_per_replica": options.get("placement_group_bundles"),
           "strategy": options.get("placement_group_strategy"),
           "workers_per_replica": config.workers_per_replica,
           "replica_actor": {"num_cpus": options["ray_actor_options"].get("num_cpus"),
                             "num_gpus": options["ray_actor_options"].get("num_gpus")}}
    if options.get("gang_scheduling_config"):
        out["gang"] = options["gang_scheduling_config"]
    return out


def capacity_problems(preview: Mapping[str, Any], cluster: ClusterView) -> list[str]:
    """Why the replicas could never be scheduled on these nodes (empty: they can)."""
    bundles = preview.get("bundles_per_replica") or []
    replicas = preview.get("num_replicas") or 1
    problems = []
    if preview.get("strategy") == "STRICT_SPREAD" and len(bundles) > len(cluster.nodes):
        problems.append(f"one replica spans {len(bundles)} nodes (one bundle per node rank, "
                        f"STRICT_SPREAD); Ray has {len(cluster.nodes)} alive node(s)")
    for resource in ("GPU", "CPU"):
        biggest = max((float(b.get(resource, 0)) for b in bundles), default=0.0)
        if preview.get("strategy") == "STRICT_SPREAD" and biggest > cluster.max_per_node(resource):
            problems.append(f"a node rank needs {biggest:g} {resource} on one node; the largest "
                            f"node has {cluster.max_per_node(resource):g}")
    for resource in ("GPU", "CPU"):
        need = sum(float(b.get(resource, 0)) for b in bundles)
        if not need:
            continue
        if preview.get("strategy") in ("STRICT_PACK",) and need > cluster.max_per_node(resource):
            problems.append(f"one replica needs {need:g} {resource} on one node (STRICT_PACK); "
                            f"the largest node has {cluster.max_per_node(resource):g}")
        elif need * replicas > cluster.total(resource):
            problems.append(f"{replicas} replica(s) need {need * replicas:g} {resource}; the "
                            f"alive nodes have {cluster.total(resource):g} in all")
    return problems


def endpoint_url(inventory: Inventory, route_prefix: str, port: int | None = None) -> str:
    """The OpenAI base URL of a deployment on the head's Serve HTTP port."""
    host = url_host(inventory.head.ip)
    prefix = "" if route_prefix == "/" else route_prefix
    return f"http://{host}:{port or inventory.ray.serve_port}{prefix}/v1"


# ---------------------------------------------------------------- checks on the nodes

@dataclass(frozen=True)
class NodeReadiness:
    """One node as deploy's checks (cluster/inspection/checks/deploy.py) found it."""

    node: str
    reached: bool
    model: bool = False
    model_dir: bool = False
    key: str | None = None            # set | empty | unset | no-raylet | None (not asked)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "reached": self.reached, "model": self.model,
                "model_dir": self.model_dir, "api_key": self.key, "error": self.error}


@dataclass(frozen=True)
class DeployReadiness:
    """Pre-deploy checks over the nodes that may host a bundle."""

    nodes: tuple[NodeReadiness, ...]
    problems: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()     # without a head: what could not be checked (not refused)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        d = {"ok": self.ok, "problems": list(self.problems), "warnings": list(self.warnings),
             "nodes": [n.to_dict() for n in self.nodes]}
        if self.unchecked:
            d["unchecked"] = list(self.unchecked)
        return d


def node_check_builders(spec_model: str, api_key_env: str | None) -> tuple:
    """The facts deploy's checks read on a node (cluster/inspection/facts.py): the model
    directory and, from the node program, whether the raylet's env (Ray workers inherit it) has
    the API-key variable set; never its value."""
    from cluster.inspection.checks.deploy import deploy_checks
    from cluster.inspection.facts import node_program_probe
    return tuple(b for c in deploy_checks(spec_model, api_key_env) for b in c.probes) \
        + ((node_program_probe,) if not api_key_env else ())


def node_readiness(node: Node, inventory: Inventory, facts, checks: Sequence) -> NodeReadiness:
    """One node's facts judged by deploy's checks (the framework's NodeChecks) -> NodeReadiness."""
    from cluster.inspection.checks.base import NodeContext, judge
    from cluster.inspection.checks.deploy import API_KEY, MODEL_FILES
    if not facts.reached:
        return NodeReadiness(node.name, False, error=facts.error)
    ctx = NodeContext.of(node, inventory, facts)
    verdicts = {c.id: judge(c, ctx) for c in checks}
    model = verdicts[MODEL_FILES]
    if model.data is None:
        return NodeReadiness(node.name, True, error=model.summary)
    key = verdicts.get(API_KEY)
    if key is not None and key.data is None:
        return NodeReadiness(node.name, True, error=key.summary)
    return NodeReadiness(node.name, True, model.data == "model", model.data in ("model", "dir"),
                         key.data if key is not None else None)


def judge_checks(checks: Sequence[NodeReadiness], spec: DeploySpec,
                 cluster: ClusterView, *, without_head: bool = False) -> DeployReadiness:
    """Pure: the per-node results -> problems (deploy refused) and warnings. `without_head`
    (a dry run before `cluster up`): a node SSH did not reach, and the API-key variable where
    no raylet runs yet, are listed in `unchecked` instead of refused."""
    problems, warnings, unchecked = [], [], []
    if not cluster.nodes:
        problems.append("no alive Ray node: start Ray first (`cluster up`)")
    unreached = [c for c in checks if not c.reached or c.error]
    if unreached:
        what = ", ".join(f"{c.node} ({c.error})" for c in unreached)
        (unchecked if without_head else problems).append("could not check " + what)
    no_raylet = [c.node for c in checks if c.reached and not c.error and c.key == "no-raylet"]
    if without_head and spec.api_key_env and no_raylet:
        unchecked.append(f"${spec.api_key_env} in the Ray environment of "
                         f"{', '.join(no_raylet)} (no raylet runs there yet: `cluster up` sets "
                         "it from the inventory's node env)")
        checks_keyed = [c for c in checks if c.node not in no_raylet]
    else:
        checks_keyed = list(checks)
    missing = [c.node for c in checks if c.reached and not c.error and not c.model]
    if missing:
        what = "no config.json in" if any(c.model_dir for c in checks if c.node in missing) \
            else "no directory"
        problems.append(f"model {spec.model} is missing on {', '.join(missing)} ({what} "
                        f"{spec.model}): every node that may host a bundle needs the same files "
                        "at the same path")
    if spec.api_key_env:
        bad = {c.node: c.key for c in checks_keyed
               if c.reached and not c.error and c.key != "set"}
        if bad:
            detail = ", ".join(f"{n} ({k})" for n, k in bad.items())
            problems.append(
                f"${spec.api_key_env} is not set in the Ray environment of {detail}: put it in "
                f"each node's `env:` in the inventory and restart Ray (`cluster down --yes && "
                f"cluster up --yes`), so the replicas inherit it; or deploy an open endpoint "
                f"with --no-api-key")
    if cluster.unnamed:
        warnings.append("Ray nodes outside the inventory were not checked: "
                        + ", ".join(n.ip for n in cluster.unnamed))
    return DeployReadiness(tuple(checks), tuple(problems), tuple(warnings), tuple(unchecked))


def check_nodes(session, inventory: Inventory, spec: DeploySpec,
                cluster: ClusterView, *, without_head: bool = False) -> DeployReadiness:
    """Model files and the API-key variable on every alive inventory node: deploy's checks
    (cluster/inspection/checks/deploy.py) on the facts layer's one round trip per node
    (cluster/inspection/facts.py); `without_head`: judge_checks'."""
    from cluster.inspection.checks.deploy import deploy_checks
    from cluster.inspection.facts import gather
    alive = {n.name for n in cluster.nodes if n.name is not None}
    nodes = [n for n in inventory.nodes if n.name in alive]  # inventory order
    facts = gather(session, inventory, nodes,
                   node_check_builders(spec.model, spec.api_key_env)) if nodes else {}
    judged = deploy_checks(spec.model, spec.api_key_env)
    checks = [node_readiness(n, inventory, facts[n.name], judged) for n in nodes]
    return judge_checks(checks, spec, cluster, without_head=without_head)


# ---------------------------------------------------------------- Serve's answer for one app


@dataclass(frozen=True)
class ReplicaInfo(Record):
    deployment: str
    replica_id: str
    state: str
    node_ip: str | None
    pid: int | None
    worker_id: str | None
    log_file_path: str | None
    dead: bool = False


@dataclass(frozen=True)
class AppState:
    """One application as Serve reports it (GET /api/serve/applications/)."""

    name: str
    status: str
    message: str
    route_prefix: str | None
    last_deployed_time_s: float | None
    deployments: Mapping[str, Mapping[str, Any]]
    replicas: tuple[ReplicaInfo, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "message": self.message,
                "route_prefix": self.route_prefix,
                "last_deployed_time_s": self.last_deployed_time_s,
                "deployments": {k: dict(v) for k, v in self.deployments.items()},
                "replicas": [r.to_dict() for r in self.replicas]}

    def summary(self) -> str:
        """One line: status, then replica states per deployment."""
        parts = []
        for name, dep in self.deployments.items():
            states: dict[str, int] = {}
            for r in self.replicas:
                if r.deployment == name and not r.dead:
                    states[r.state] = states.get(r.state, 0) + 1
            shown = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "no replicas"
            parts.append(f"{name} {dep.get('status')} ({shown})")
        return f"{self.status}" + (f": {'; '.join(parts)}" if parts else "")


def _replica(deployment: str, raw: Mapping[str, Any], dead: bool) -> ReplicaInfo:
    return ReplicaInfo(deployment=deployment, replica_id=str(raw.get("replica_id") or ""),
                       state=str(raw.get("state") or "?"), node_ip=raw.get("node_ip"),
                       pid=reply_number(raw.get("pid"), lo=1, hi=bound("replies", "pid_max"),
                                        integer=True),
                       worker_id=raw.get("worker_id"), log_file_path=raw.get("log_file_path"),
                       dead=dead)


def app_state(details: Mapping[str, Any] | None, name: str) -> AppState | None:
    """The named app from Serve's instance details, or None when Serve does not list it."""
    app = ((details or {}).get("applications") or {}).get(name)
    if app is None:
        return None
    deployments, replicas = {}, []
    for dname, dep in (app.get("deployments") or {}).items():
        live = dep.get("replicas") or []
        deployments[dname] = {"status": dep.get("status"), "message": dep.get("message") or "",
                              "replicas": len(live),
                              "running_replicas": sum(1 for r in live
                                                      if r.get("state") == RUNNING),
                              "target_num_replicas": dep.get("target_num_replicas")}
        replicas += [_replica(dname, r, False) for r in live]
        replicas += [_replica(dname, r, True) for r in dep.get("recent_dead_replicas") or []]
    return AppState(name=name, status=str(app.get("status") or "?"),
                    message=app.get("message") or "", route_prefix=app.get("route_prefix"),
                    last_deployed_time_s=reply_number(app.get("last_deployed_time_s"), lo=0,
                                                      hi=bound("replies", "epoch_s_max")),
                    deployments=deployments, replicas=tuple(replicas))


# ---------------------------------------------------------------- deploy, wait, undeploy


@dataclass(frozen=True)
class WaitOutcome:
    """How a wait for an app ended (playbooks/serve_wait.py): its last state, the seconds,
    whether it timed out, the dashboard's last errors."""

    state: AppState | None
    waited_s: float
    timed_out: bool
    errors: tuple[str, ...] = ()

    @property
    def running(self) -> bool:
        return self.state is not None and self.state.status == RUNNING


@dataclass(frozen=True)
class ApplyOutcome:
    """What the PUT did: ok, the other apps kept, the effective HTTP options, or why not."""

    ok: bool
    kept: tuple[str, ...] = ()
    untouched: tuple[str, ...] = ()
    http_options: Mapping[str, Any] | None = None
    previous: Mapping[str, Any] | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "kept": list(self.kept), "untouched": list(self.untouched),
                "http_options": dict(self.http_options or {}) or None,
                "previous": dict(self.previous) if self.previous else None,
                "error": self.error}


def _apply_outcome(reply, what: str) -> ApplyOutcome:
    merge = reply.merge or {}
    error = merge.get("error")
    if error is None and not reply.ok and not (what == "remove" and merge.get("previous") is None
                                               and reply.error is None):
        error = f"{what} through the dashboard failed: {reply.describe()}"
    return ApplyOutcome(ok=error is None, kept=tuple(merge.get("kept") or ()),
                        untouched=tuple(merge.get("untouched") or ()),
                        http_options=merge.get("http_options"), previous=merge.get("previous"),
                        error=error)


def deploy_app(client, app: Mapping[str, Any], inventory: Inventory) -> ApplyOutcome:
    """PUT the app merged with the other declarative apps (on the head, under a lock)."""
    return _apply_outcome(client.apply_application(app, http_options(inventory)), "deploy")


def undeploy_app(client, name: str) -> ApplyOutcome:
    """PUT the remaining apps (the named one removed)."""
    return _apply_outcome(client.remove_application(name), "remove")


# ---------------------------------------------------------------- logs of failed replicas

_LOG_PATH_RE = re.compile(r"^/?[A-Za-z0-9._/-]+$")
_HEX_RE = re.compile(r"^[0-9a-fA-F]{8,64}$")


def log_tail_command(inventory: Inventory, replicas: Sequence[ReplicaInfo], app: str,
                     lines: int = 60) -> str:
    """Shell command printing the tails of these replicas' Serve logs and worker stderr/stdout
    (or, with no replica known, the Serve controller log) on one node."""
    files: list[str] = []
    for r in replicas:
        if r.log_file_path and _LOG_PATH_RE.match(r.log_file_path) and ".." not in r.log_file_path:
            files.append(shlex.quote(r.log_file_path.lstrip("/")))
        if r.worker_id and _HEX_RE.match(r.worker_id):
            files += [f"worker-{r.worker_id}-*.err", f"worker-{r.worker_id}-*.out"]
        elif r.pid:
            files += [f"worker-*-{int(r.pid)}.err", f"worker-*-{int(r.pid)}.out"]
    if not files:
        files = ["serve/controller_*.log"]
    directory = shlex.quote(log_dir(inventory))
    return (f"cd {directory} 2>/dev/null || {{ echo 'no Ray logs in '{directory}; exit 0; }}; "
            f"for f in {' '.join(files)}; do [ -f \"$f\" ] || continue; "
            f"echo \"==> $f <==\"; tail -n {int(lines)} \"$f\"; done")


def collect_log_tails(session, inventory: Inventory, state: AppState | None,
                      lines: int = 60) -> dict[str, str]:
    """node name -> log tails of the app's replicas there (the head's controller log when Serve
    lists no replica: the app failed before any started)."""
    by_ip = {n.ip: n for n in inventory.nodes}
    groups: dict[str, list[ReplicaInfo]] = {}
    for r in (state.replicas if state else ()):
        node = by_ip.get(r.node_ip or "")
        if node is not None and (r.dead or r.state != RUNNING):
            groups.setdefault(node.name, []).append(r)
    if not groups:
        groups = {inventory.head.name: []}
    nodes = [inventory.node(name) for name in groups]
    name = state.name if state else ""
    results = session.fan_out(nodes, lambda n: log_tail_command(inventory, groups[n.name], name,
                                                                lines), timeout=30)
    return {n.name: (r.stdout.strip() or "(no log files found)") if r.reached
            else f"({r.status}: {r.error})" for n, r in zip(nodes, results)}


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in _ANSI_RE.sub("", text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# vLLM prefixes each of its processes' log lines; the engine core's last words name the
# exception it died of, where the API side only says EngineDeadError ("See stack trace (above)"):
#   (EngineCore pid=26616) ERROR 12-07 11:00:20 [core.py:1512] TimeoutError: RPC call to execute_model timed out.
_ENGINE_LINE_RE = re.compile(r"\(EngineCore\w{0,16} pid=\d{1,10}\) ERROR \S{1,16} \S{1,16} \[[^\]\s]{1,80}\] ")
_EXCEPTION_NAME_RE = re.compile(r"[A-Za-z_][\w.]{0,200}")
_EXCEPTION_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt")
ENGINE_LINE_CAP = 2000          # characters of a log line looked at


def engine_core_error(tails: Sequence[str]) -> str | None:
    """`Type: message` of the last exception line the vLLM engine core logged in these log
    tails (one with a message over a bare `Type`), or None when it logged none."""
    found: str | None = None
    for tail in tails:
        for raw in tail.splitlines():
            line = _ANSI_RE.sub("", raw[:ENGINE_LINE_CAP]).strip()
            m = _ENGINE_LINE_RE.match(line)
            if not m:
                continue
            rest = line[m.end():]
            name, _, message = rest.partition(": ")
            if not _EXCEPTION_NAME_RE.fullmatch(name) or \
                    not name.rsplit(".", 1)[-1].endswith(_EXCEPTION_SUFFIXES):
                continue
            if message.strip() or found is None or ": " not in found:
                found = rest[:500]
    return found


def engine_failure_detail(error: str, env: Mapping[str, str]) -> str:
    """What to add to a failed deploy's one line from the engine core's own error: the error,
    and for a step that ran past vLLM's step bound, the bound and the flag that sets it."""
    detail = f"the engine core: {error}"
    if error.startswith("TimeoutError: RPC call to") and "timed out" in error:
        bound = env.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300")
        detail += (f" (an engine step ran past VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, {bound} s: a rank "
                   "stuck or starved of CPU; `--env VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=N` sets it)")
    return detail


def with_engine_error(error: str, tails: Mapping[str, str], app: Mapping[str, Any]) -> str:
    """A failed deploy's one line `error`, with what the engine core died of (engine_failure_detail)
    added when the replicas' log tails (node -> text) hold its error and the line does not already
    say it; `app`: the Serve app config that failed (its runtime_env's env_vars set the bounds)."""
    engine_error = engine_core_error(list(tails.values()))
    if not engine_error or engine_error in error:
        return error
    env = ((app.get("args") or {}).get("runtime_env") or {}).get("env_vars") or {}
    return f"{error}; {engine_failure_detail(engine_error, env)}"


def failure_reason(outcome: WaitOutcome, timeout_s: float) -> str:
    """One line: why the app is not RUNNING (the exception a replica died of, when Serve has
    it: the last line of the deployment's message, which holds the constructor's traceback)."""
    state = outcome.state
    if state is None:
        why = "; ".join(outcome.errors[-1:]) or "Serve never listed the application"
        return f"not RUNNING after {outcome.waited_s:.0f} s: {why}"
    parts = [f"{name}: {_last_line(d.get('message', ''))}"
             for name, d in state.deployments.items() if _last_line(d.get("message", ""))]
    if not parts and _last_line(state.message):
        parts = [_last_line(state.message)]
    detail = "; ".join(parts)[:600]
    if outcome.timed_out:
        return f"still {state.status} after {timeout_s:.0f} s" + (f": {detail}" if detail else "")
    return state.status + (f": {detail}" if detail else "")