"""Ray Serve apps that serve a model with vLLM's own OpenAI server, in one hop.

Import paths for a Serve config (`serve deploy`, the dashboard's REST API):

    serve_apps.vllm_app:build_app       dense model: one replica = one engine on TP x PP
                                        bundles (PACK: a stage's TP group inside one node);
                                        replicas = data parallel.
    serve_apps.vllm_app:build_moe_app   MoE model: data-parallel attention + expert-parallel
                                        MoE layers; one replica = one engine of all DP ranks,
                                        one engine launch per node (vLLM's multi-node DP
                                        layout: node 0 in the replica, the others headless
                                        rank actors, cluster/planning/gang.py node_engine_kwargs).

Each replica is the HTTP ingress itself: it holds vLLM's AsyncLLM and serves vLLM's own
FastAPI app (the routes, request/response models, SSE streaming and /metrics of
`vllm serve`), built after the engine starts through Serve's late-bound ASGI ingress
(`__serve_build_asgi_app__`). There is no second deployment and no stream batching between
the proxy and the engine (ray.serve.llm's default path adds both; see docs/serving.md for
the measurements behind this choice). Config fields follow ray.serve.llm's LLMConfig names
(serve_apps/config.py).

Engine metrics: vLLM's stat loggers export through Ray's metrics too, tagged with the app
(serve_apps/engine_metrics.py), beside the app's own /metrics.

Extra route: GET /v1/placement (API-key guarded) reports where the replica, its bundles and
(dry_run) the probe actors landed, plus the engine kwargs it started with.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
import types
import typing
from typing import Any

import ray
from ray import serve
from ray.serve.deployment import Application
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group_table,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.planning.gang import RANK_NAMESPACE, pick_port
from serve_apps.api_key import KeyCheck, read_api_key
from serve_apps.gang import Gang, RankSpec, descendants, kill_tree, port_is_free
from serve_apps.gang_proof import gang_proof_plan, proof_problem, run_gang_proof
from serve_apps.priority import set_process_priority
from serve_apps.engine_metrics import stat_loggers
from serve_apps.config import (
    AppConfig,
    AppConfigError,
    deployment_name,
    engine_kwargs_for,
    gang_nodes,
    parse_app_args,
    resolve_device,
    serve_deployment_options,
    tp_groups_split_across_nodes,
    worker_bundles,
)

logger = logging.getLogger("ray.serve")

GANG_START_WAIT_S = 120.0
HEALTH_ENGINE_TIMEOUT_S = 20.0
# ~80 tokens: a real generation through every rank before the replica is ready; a long first
# prompt also avoids the CPU build's SIGILL on AMX CPUs when the first forward is short.
WARM_UP_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 6
WARM_UP_TOKENS = 4



# ----------------------------------------------------------------------------- placement

def _node_ips() -> dict[str, str]:
    return {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes() if n.get("Alive")}


def describe_placement_group(pg: PlacementGroup | None) -> list[dict[str, Any]]:
    """[{index, node_id, node_ip, resources}] for each bundle of pg ([] when not in a PG)."""
    if pg is None:
        return []
    table = placement_group_table(pg)
    ips = _node_ips()
    nodes = table.get("bundles_to_node_id", {})
    return [{"index": int(i), "node_id": nodes.get(i, ""), "node_ip": ips.get(nodes.get(i, ""), ""),
             "resources": dict(res)}
            for i, res in sorted(table.get("bundles", {}).items(), key=lambda kv: int(kv[0]))]


@ray.remote(num_cpus=0)
class BundleProbe:
    """Stands in for one vLLM worker in dry-run mode: holds its bundle share, says where it is."""

    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}


def _probe_options(bundle: dict[str, float]) -> dict[str, Any]:
    extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory") and v}
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    if extra:
        options["resources"] = extra
    return options


# ----------------------------------------------------------------------------- vLLM glue

def _config_type(annotation: Any) -> type | None:
    """The vLLM config dataclass inside a field annotation (X | None, Annotated[X, ...])."""
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        found = _config_type(arg)
        if found is not None:
            return found
    return None


def split_vllm_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine kwargs, frontend kwargs): vLLM's AsyncEngineArgs vs FrontendArgs fields,
    with config sub-dicts validated into vLLM's config classes as its CLI parser does."""
    from pydantic import TypeAdapter
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    engine_fields = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}
    frontend_fields = {f.name for f in dataclasses.fields(FrontendArgs)}
    engine, frontend = {}, {}
    for key, value in kwargs.items():
        if key in frontend_fields and key not in engine_fields:
            frontend[key] = value
        elif key in engine_fields:
            config_cls = _config_type(engine_fields[key].type) if isinstance(value, dict) else None
            engine[key] = TypeAdapter(config_cls).validate_python(value) if config_cls else value
        else:
            raise AppConfigError(f"engine_kwargs.{key}: not an argument of this vLLM "
                                 f"({getattr(__import__('vllm'), '__version__', '?')})")
    return engine, frontend


def rank_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A headless rank's engine kwargs as given (its command line writes config dicts as JSON):
    the engine arguments only (checked by split_vllm_kwargs), no frontend ones."""
    engine = split_vllm_kwargs(dict(kwargs))[0]
    return {k: v for k, v in kwargs.items() if k in engine}


@ray.remote(num_cpus=0)
def _engine_config_on_gpu(engine_kwargs: dict[str, Any]):
    """Resolve vLLM's config where a GPU is visible (the replica itself holds none)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    return AsyncEngineArgs(**engine_kwargs).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER)


def _import_vllm_app_builders():
    try:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app as build_vllm_app
    except ImportError:  # older vLLM layout
        from vllm.entrypoints.openai.api_server import build_app as build_vllm_app
        from vllm.entrypoints.openai.api_server import init_app_state
    return build_vllm_app, init_app_state


# ----------------------------------------------------------------------------- the deployment

class VLLMServer:
    """One replica: vLLM's AsyncLLM plus vLLM's OpenAI FastAPI app as the Serve ingress."""

    async def __init__(self, args: dict[str, Any]):
        self._config: AppConfig = parse_app_args(args)
        config = self._config
        self._device = config.device if config.device != "auto" else resolve_device(
            config, ray.cluster_resources())
        self._engine = None
        self._gang: Gang | None = None
        self._warm_up_s: float | None = None
        self._args: argparse.Namespace | None = None
        self._probes: list[Any] = []
        self._probe_report: list[dict[str, Any]] = []
        self._proof: dict[str, Any] | None = None
        self._gang_plan: list[dict[str, Any]] = []
        self._rank_report: list[dict[str, Any]] = []
        self._priority_note = (set_process_priority(config.process_priority)
                               if config.process_priority is not None else "left as Ray set it")
        self._api_key = read_api_key(config.api_key_env) if config.api_key_env else None
        if self._api_key is None:
            logger.warning("No api_key_env: the OpenAI API of %r is open to anyone who can "
                           "reach the Serve port", config.model_id)

        ctx = serve.get_replica_context()
        self._pg = get_current_placement_group()
        self._bundles = describe_placement_group(self._pg)
        self._kwargs = engine_kwargs_for(config, self._device)
        self._worker_bundle_indices = list(range(len(self._bundles)))
        self._check_stage_placement()

        if config.dry_run:
            if config.gang is not None:
                # the real rank actors in their bundles with their args, no vLLM in them
                await self._start_ranks(ctx, start_engines=False)
                self._rank_report = await self._gang.started_with(GANG_START_WAIT_S)
            else:
                await self._start_probes()
        else:
            guard = None
            if config.gang is not None:
                await self._prove_gang_fabric()
                await self._start_ranks(ctx)
                # Children of this process (the engine core and its workers) die if a rank
                # dies before the engine is up; from_vllm_config then raises.
                guard = self._gang.guard_start(
                    lambda why: [kill_tree(pid) for pid in descendants(os.getpid())])
            try:
                self._start_engine()
            finally:
                if guard is not None:
                    guard.set()
            if self._gang is not None and self._gang.error:
                raise RuntimeError(f"multi-node engine broken at start: {self._gang.error}")
            await self._warm_up()
            if self._gang is not None:
                self._gang.watch(self._on_gang_failure)
        logger.info("Replica of %r ready: device %s, %s", config.model_id,
                    self._device, self._priority_note)

    async def _prove_gang_fabric(self) -> None:
        """The fabric proof of this gang's layout on its own nodes before any rank or engine
        starts (serve_apps/gang_proof.py); a failed group fails the replica."""
        plan = gang_proof_plan(self._config, self._bundles, self._device)
        if plan is None:
            return
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        result = await asyncio.get_running_loop().run_in_executor(
            None, run_gang_proof, self._pg, plan, self._bundles, gpu_ids)
        why = proof_problem(plan, result)
        self._proof = {"backend": plan.backend, "ok": why is None, "problem": why,
                       "groups": [{k: g.get(k) for k in ("kind", "ranks", "ok", "busbw_gbps")}
                                  for g in result.get("groups") or []]}
        if why:
            raise RuntimeError(why)
        logger.info("fabric proof of the gang of %r: %s", self._config.model_id, self._proof)

    async def _start_ranks(self, ctx, start_engines: bool = True) -> None:
        """Node rank 0 is this replica; start the headless node ranks first (in bundles
        1..n-1 of this replica's group, each with its node's env), then our engine.
        start_engines False (dry_run): the rank actors hold their bundles, no vLLM."""
        config, layout = self._config, self._config.gang
        ip = ray.util.get_node_ip_address()
        lo, hi = config.port_range
        port = pick_port(lo, hi, is_free=lambda p: port_is_free(ip, p))
        nodes = gang_nodes(config, self._bundles, self._kwargs, ip, port)
        self._gang_plan = [n.to_dict() for n in nodes]
        self._kwargs = dict(nodes[0].engine_kwargs)
        os.environ.update((config.multi_node.get("node_env") or {}).get(ip, {}))
        specs = [RankSpec(n.node_rank, n.bundle_index, n.resources, n.env,
                          rank_engine_kwargs(n.engine_kwargs),
                          nice=config.process_priority) for n in nodes[1:]]
        tag = getattr(ctx, "replica_tag", None) or f"pid{os.getpid()}"
        self._gang = Gang(self._pg, specs,
                          period_s=float(config.multi_node.get("watch_period_s", 1.0)),
                          timeout_s=float(config.multi_node.get("watch_timeout_s", 5.0)),
                          app=ctx.app_name, replica_id=tag, namespace=RANK_NAMESPACE,
                          start_engines=start_engines)
        self._gang.start()
        await self._gang.wait_started(GANG_START_WAIT_S)
        logger.info("gang of %r: master %s:%d, %d node ranks started, layout %s",
                    config.model_id, ip, port, len(specs), layout.to_dict())

    async def _warm_up(self) -> None:
        """One real generation (through every rank of a gang) before the replica is ready."""
        from vllm import SamplingParams

        start = time.monotonic()
        params = SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0)
        async for _ in self._engine.generate(WARM_UP_PROMPT, params, f"warm-up-{os.getpid()}"):
            pass
        self._warm_up_s = round(time.monotonic() - start, 3)
        logger.info("warm-up generation of %r took %.2f s", self._config.model_id,
                    self._warm_up_s)

    def _engine_core_pids(self) -> list[int]:
        client = getattr(self._engine, "engine_core", None)
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", []) or [] if p.pid]

    def _on_gang_failure(self, why: str) -> None:
        """A rank is gone: kill our engine core and its workers now, so every request in
        flight and every new one fails with EngineDeadError instead of hanging on the dead
        peer; check_health then fails and Serve replaces this replica (a new gang)."""
        killed = [pid for core in self._engine_core_pids() for pid in kill_tree(core)]
        logger.error("gang of %r broken (%s): killed engine core and workers %s",
                     self._config.model_id, why, killed)
        gang = self._gang
        if gang is not None:
            asyncio.get_running_loop().run_in_executor(None, gang.stop)

    def ranks(self) -> list[dict[str, Any]]:
        """[{rank, node_ip, pid, state}]: node rank 0 (this replica) and the rank actors."""
        alive = self._engine is not None and not getattr(self._engine, "errored", False)
        me = {"rank": 0, "node_ip": ray.util.get_node_ip_address(),
              "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
              "engine_core_pids": self._engine_core_pids(),
              "state": "placed" if self._config.dry_run else
              "running" if alive and not (self._gang and self._gang.error) else "dead"}
        return [me] + (self._gang.ranks() if self._gang is not None else [])

    def _check_stage_placement(self) -> None:
        nodes = [self._bundles[i]["node_id"] for i in self._worker_bundle_indices
                 if i < len(self._bundles)]
        config = self._config
        if len(nodes) != config.workers_per_replica or config.gang is not None:
            return      # a gang's node split is cluster.planning.gang's layout, logged at start
        split = tp_groups_split_across_nodes(nodes, config.tensor_parallel_size,
                                             config.pipeline_parallel_size)
        if split:
            logger.warning("Pipeline stage(s) %s of %r have their tensor-parallel group split "
                           "across nodes (bundle nodes %s): all-reduce will cross the network",
                           split, config.model_id, nodes)

    async def _start_probes(self) -> None:
        per_worker = worker_bundles(self._config, self._device)
        for slot, index in enumerate(self._worker_bundle_indices):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=index,
                placement_group_capture_child_tasks=False)
            probe = BundleProbe.options(scheduling_strategy=strategy,
                                        **_probe_options(per_worker[slot])).remote()
            self._probes.append((index, probe))
        for index, probe in self._probes:
            where = await probe.where.remote()
            self._probe_report.append({"bundle_index": index, **where})

    def _start_engine(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_kwargs, frontend_kwargs = split_vllm_kwargs(self._kwargs)
        engine_args = AsyncEngineArgs(**engine_kwargs)
        # A gang's replica (node rank 0, native mp executor) holds its node's whole bundle,
        # GPUs included (Ray set CUDA_VISIBLE_DEVICES): it resolves the config itself. With
        # vLLM's Ray executor the replica holds no GPU, so a task in bundle 0 resolves it.
        if self._device == "gpu" and self._config.gang is None:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg,
                placement_group_bundle_index=self._worker_bundle_indices[0])
            vllm_config = ray.get(_engine_config_on_gpu.options(
                num_gpus=0.001, scheduling_strategy=strategy,
                runtime_env=self._config.runtime_env or None).remote(engine_kwargs))
            vllm_config.parallel_config.placement_group = self._pg
            # vLLM caches device capability per process; this process holds no GPU, so let
            # it re-read (ray.serve.llm does the same before starting the engine).
            from vllm.platforms import current_platform
            cache_clear = getattr(current_platform.get_device_capability, "cache_clear", None)
            if cache_clear is not None:
                cache_clear()
        else:
            vllm_config = engine_args.create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER)
        # Engine metrics through Ray's metrics (app-tagged) and on the app's own /metrics.
        self._engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config, usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=stat_loggers(),
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats)
        # vLLM's frontend reads one flat namespace of frontend + engine args, like its CLI.
        self._args = argparse.Namespace(**(vars(FrontendArgs(**frontend_kwargs))
                                           | vars(engine_args)))

    def placement(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        shown = {k: v for k, v in self._kwargs.items() if not hasattr(v, "__dataclass_fields__")}
        return {
            "model_id": self._config.model_id,
            "device": self._device,
            "dry_run": self._config.dry_run,
            "replica": {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                        "pid": os.getpid(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                        "priority": self._priority_note},
            "bundles": self._bundles,
            "worker_bundle_indices": self._worker_bundle_indices,
            "probes": self._probe_report,
            "ranks": self.ranks() if self._config.gang is not None else [],
            "gang_nodes": self._gang_plan,
            "fabric_proof": self._proof,
            "rank_actors": self._rank_report,
            "warm_up_s": self._warm_up_s,
            "engine_kwargs": json.loads(json.dumps(shown, default=str)),
        }

    async def __serve_build_asgi_app__(self):
        app = await (self._build_vllm_app() if self._engine is not None else self._build_dry_app())
        if self._api_key is not None:
            # vLLM's build_app builds the middleware stack eagerly; drop it so Starlette
            # rebuilds it with the key check as the outermost layer (as ray.serve.llm does).
            app.middleware_stack = None
            app.add_middleware(KeyCheck, tokens=[self._api_key])
        placement = self.placement
        app.add_api_route("/v1/placement", lambda: placement(), methods=["GET"])
        return app

    async def _build_vllm_app(self):
        build_vllm_app, init_app_state = _import_vllm_app_builders()
        supported_tasks = await self._engine.get_supported_tasks()
        app = build_vllm_app(self._args, supported_tasks, self._engine.model_config)
        await init_app_state(self._engine, app.state, self._args, supported_tasks)
        # vLLM's engine-error handler flips `should_exit` on the uvicorn server its own
        # launcher keeps here. Serve runs no uvicorn loop; check_health restarts us instead.
        app.state.server = types.SimpleNamespace(should_exit=False)
        return app

    async def _build_dry_app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        model_id = self._config.model_id

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": model_id, "object": "model",
                                                "owned_by": "cluster-dry-run"}]}

        @app.get("/health")
        async def health():
            return {}

        async def no_engine():
            return JSONResponse(status_code=503, content={"error": {
                "message": f"{model_id} is deployed with dry_run: placement only, no engine",
                "type": "ServiceUnavailable", "code": 503}})

        for path in ("/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, no_engine, methods=["POST"])
        return app

    async def check_health(self) -> None:
        """Healthy only while every rank answers (bounded: a stuck rank is dead) and the
        engine answers its own health check in time."""
        if self._gang is not None:
            why = await self._gang.problem()
            if why:
                if self._gang.error is None:
                    self._gang.error = why
                    self._on_gang_failure(why)
                raise RuntimeError(f"multi-node engine broken: {why}")
        if self._engine is not None:
            await asyncio.wait_for(self._engine.check_health(), HEALTH_ENGINE_TIMEOUT_S)

    async def __del__(self):
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.shutdown()
        gang, self._gang = getattr(self, "_gang", None), None
        if gang is not None:
            gang.stop()
        for _, probe in getattr(self, "_probes", []):
            ray.kill(probe)


VLLMDeployment = serve.deployment(serve.ingress()(VLLMServer), name="VLLMServer")


# ----------------------------------------------------------------------------- builders

def _cluster_resources() -> dict[str, float]:
    return ray.cluster_resources() if ray.is_initialized() else {}


def bind_app(config: AppConfig) -> Application:
    """The Serve application for a validated config (device resolved here, once)."""
    device = resolve_device(config, _cluster_resources())
    config = dataclasses.replace(config, device=device)
    options = serve_deployment_options(config, device)
    name = options.pop("name", None) or deployment_name(config.model_id)
    return VLLMDeployment.options(name=name, **options).bind(config.to_args())


def build_app(args: dict[str, Any]) -> Application:
    """Dense model: one engine per replica on TP x PP bundles; more replicas = data parallel."""
    config = parse_app_args(args)
    if config.data_parallel_size > 1:
        raise AppConfigError(
            "engine_kwargs.data_parallel_size > 1 is vLLM's MoE data parallelism "
            "(serve_apps.vllm_app:build_moe_app); a dense model scales out with "
            "deployment_config.num_replicas")
    return bind_app(config)


def build_moe_app(args: dict[str, Any]) -> Application:
    """MoE model: DP attention ranks + expert parallel; one replica = one engine of all DP
    ranks (one engine launch per node: node 0 in the replica, the others rank actors)."""
    config = parse_app_args(args)
    engine_kwargs = dict(config.engine_kwargs)
    engine_kwargs.setdefault("enable_expert_parallel", True)
    return bind_app(dataclasses.replace(config, engine_kwargs=engine_kwargs))
