"""The ranks of a multi-node engine: one Ray actor per further node, and the replica's watch.

vLLM's native multi-node mode (mp executor, nnodes / node_rank / master_addr / master_port):
the Serve replica is node rank 0 (it holds AsyncLLM and the API); each node rank > 0 is a
`RankActor` in the replica's own placement group (bundle i = node rank i, STRICT_SPREAD, so
every rank is on its own node) doing what `vllm serve --headless` does: build the engine
config with headless=True and run `MultiprocExecutor(cfg, monitor_workers=False)` whose
workers join rank 0's torch.distributed group at master_addr:master_port. A MoE DP node
(data_parallel_size > 1) does what `vllm serve --headless --data-parallel-start-rank S` does
instead: `CoreEngineProcManager` runs its data_parallel_size_local engine cores (DP ranks
S..), which hand-shake with node 0's engine client at data_parallel_address:rpc_port.

`Gang` (used by the replica) starts the rank actors before the replica's engine (rank 0 must
find them connecting), then watches them: every `period_s` each actor answers `status()`
within `timeout_s` or counts as dead (a stuck rank is a dead rank). A dead rank makes the
replica kill its own engine core and workers at once, so requests in flight and new ones get
vLLM's EngineDeadError (HTTP 500) instead of hanging until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
and check_health fails, so Serve replaces the replica with a new gang. Stopping the gang stops
each actor's executor (its vLLM workers) and then the actor.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.planning.gang import rank_actor_name
from serve_apps.config import reported_env
from serve_apps.priority import set_process_priority

logger = logging.getLogger("ray.serve")

STARTING, RUNNING, DEAD, STOPPED = "starting", "running", "dead", "stopped"
PLACED = "placed"       # dry_run: the actor holds its bundle with its args, no vLLM started
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a forked vLLM worker: SIGKILL when the thread that forked it ends (the executor's
    thread of this actor), so no worker outlives its rank actor, even a SIGKILLed one."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (children first), read from /proc; [] when unreadable."""
    out, todo = [], [pid]
    while todo and len(out) < 4096:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read(65536).split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def kill_tree(pid: int) -> list[int]:
    """SIGKILL pid's descendants, then pid; returns the pids signalled."""
    victims = descendants(pid) + [pid]
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return victims


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)
class RankActor:
    """One headless node rank of a multi-node vLLM engine."""

    def __init__(self, node_rank: int, engine_kwargs: dict[str, Any], env: Mapping[str, str],
                 nice: int | None = None, start_engine: bool = True):
        os.environ.update({k: str(v) for k, v in env.items()})
        self._env_keys = sorted(env)
        self._engine_kwargs = dict(engine_kwargs)
        os.register_at_fork(after_in_child=_die_with_parent)
        # Ray starts actors at nice 15; the replica (node rank 0) runs at process_priority:
        # a rank left at 15 starves against its peers (measured: PP 2 at ~1/30 the speed).
        self._priority = set_process_priority(nice) if nice is not None else "left as Ray set it"
        self._node_rank = node_rank
        self._state = STARTING
        self._error: str | None = None
        self._executor = None
        self._started = time.time()
        if not start_engine:
            self._state = PLACED
            return
        self._thread = threading.Thread(target=self._run, args=(dict(engine_kwargs),),
                                        daemon=True, name=f"vllm-node-rank-{node_rank}")
        self._thread.start()

    def _run(self, engine_kwargs: dict[str, Any]) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.executor.multiproc_executor import MultiprocExecutor

            config = AsyncEngineArgs(**engine_kwargs).create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
            parallel = config.parallel_config
            if parallel.data_parallel_size > 1:
                self._run_dp_engines(config, engine_kwargs)
                return
            logger.info("node rank %d: headless executor, master %s:%s, world %d",
                        self._node_rank, parallel.master_addr, parallel.master_port,
                        parallel.world_size)
            self._executor = MultiprocExecutor(config, monitor_workers=False)
            self._state = RUNNING
            self._executor.start_worker_monitor(inline=True)   # returns when a worker died
            if self._state == RUNNING:
                self._fail("a vLLM worker of node rank %d exited" % self._node_rank)
        except BaseException as exc:  # noqa: BLE001 - reported through status()
            self._fail(f"{type(exc).__name__}: {exc}"[:2000])

    def _run_dp_engines(self, config, engine_kwargs: dict[str, Any]) -> None:
        """MoE DP: this node's engine cores, as vLLM's run_headless starts them."""
        from vllm.utils.network_utils import get_tcp_uri
        from vllm.v1.engine.utils import CoreEngineProcManager
        from vllm.v1.executor import Executor

        parallel = config.parallel_config
        address = get_tcp_uri(parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port)
        logger.info("node rank %d: %d headless DP engine(s) from DP rank %d, handshake %s",
                    self._node_rank, parallel.data_parallel_size_local,
                    parallel.data_parallel_rank, address)
        self._executor = CoreEngineProcManager(
            local_engine_count=parallel.data_parallel_size_local,
            start_index=parallel.data_parallel_rank, local_start_index=0, vllm_config=config,
            local_client=False, handshake_address=address,
            executor_class=Executor.get_class(config),
            log_stats=not engine_kwargs.get("disable_log_stats", False))
        self._state = RUNNING
        self._executor.monitor_engine_liveness()            # returns when an engine died
        if self._state == RUNNING:
            self._fail("a vLLM DP engine of node rank %d exited" % self._node_rank)

    def _fail(self, why: str) -> None:
        if self._state != STOPPED:
            self._state, self._error = DEAD, why
            logger.error("node rank %d dead: %s", self._node_rank, why)

    def _worker_pids(self) -> list[tuple[int, bool, int | None]]:
        """(pid, alive, exit code) of the executor's workers (MoE DP: the engine cores)."""
        procs = [w.proc for w in getattr(self._executor, "workers", None) or []]
        procs += list(getattr(self._executor, "processes", None) or [])
        return [(p.pid, p.is_alive(), p.exitcode) for p in procs]

    def status(self) -> dict[str, Any]:
        workers = self._worker_pids()
        dead = [(pid, code) for pid, alive, code in workers if not alive]
        if dead and self._state == RUNNING:
            self._fail(f"vLLM worker pid {dead[0][0]} exited with {dead[0][1]}")
        return {"node_rank": self._node_rank, "state": self._state, "error": self._error,
                "pid": os.getpid(), "worker_pids": [pid for pid, _, _ in workers],
                "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "nice": os.getpriority(os.PRIO_PROCESS, 0), "priority": self._priority,
                "started_at": self._started}

    def started_with(self) -> dict[str, Any]:
        """What this rank was started with, as it sees it: its node, GPUs (the devices of its
        bundle), the env it was given and the engine kwargs it hands to vLLM."""
        return {"node_rank": self._node_rank, "state": self._state,
                "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "env": reported_env({k: os.environ.get(k) for k in self._env_keys}),
                "engine_kwargs": {k: v if isinstance(v, (str, int, float, bool, type(None)))
                                  else str(v) for k, v in self._engine_kwargs.items()}}

    def stop(self) -> list[int]:
        """Stop the executor and its workers (SIGKILL what is left); returns their pids."""
        self._state = STOPPED
        pids = [pid for pid, _, _ in self._worker_pids()]
        executor, self._executor = self._executor, None
        if executor is not None:
            try:
                executor.shutdown()
            except Exception:  # noqa: BLE001 - the workers are killed below anyway
                logger.exception("node rank %d: executor shutdown", self._node_rank)
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return pids


def port_is_free(host: str, port: int) -> bool:
    """A bind test on this node (the master node): True when nothing listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class RankSpec:
    """What one rank actor gets: its node rank, placement bundle and resources, env, and its
    node's vLLM engine kwargs (cluster.planning.gang.node_engine_kwargs)."""

    node_rank: int
    bundle_index: int
    resources: Mapping[str, float]
    env: Mapping[str, str]
    engine_kwargs: Mapping[str, Any]
    nice: int | None = 0


class Gang:
    """The replica's view of its further node ranks: start, watch, stop."""

    def __init__(self, pg, ranks: list[RankSpec], period_s: float = 1.0,
                 timeout_s: float = 5.0, app: str = "gang", replica_id: str = "",
                 namespace: str | None = None, start_engines: bool = True):
        self._pg = pg
        self._start_engines = start_engines
        self._healthy = RUNNING if start_engines else PLACED
        self._app, self._replica_id = app, replica_id
        self._namespace = namespace
        self._specs = ranks
        self._actors: list[tuple[RankSpec, Any]] = []
        self._period_s = period_s
        self._timeout_s = timeout_s
        self._last: dict[int, dict[str, Any]] = {}
        self.error: str | None = None
        self.failed_rank: int | None = None
        self._watch_task: asyncio.Task | None = None

    def start(self) -> None:
        for spec in self._specs:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=spec.bundle_index,
                placement_group_capture_child_tasks=False)
            options: dict[str, Any] = {"num_cpus": spec.resources.get("CPU", 0),
                                       "num_gpus": spec.resources.get("GPU", 0),
                                       "scheduling_strategy": strategy,
                                       "runtime_env": {"env_vars": dict(spec.env)},
                                       "name": rank_actor_name(self._app, self._replica_id,
                                                               spec.node_rank)}
            if self._namespace:
                options["namespace"] = self._namespace
            actor = RankActor.options(**options).remote(spec.node_rank, dict(spec.engine_kwargs),
                                                        spec.env, spec.nice, self._start_engines)
            self._actors.append((spec, actor))

    async def wait_started(self, timeout_s: float) -> None:
        """Every rank actor is alive and its executor starting (it waits for rank 0)."""
        for spec, actor in self._actors:
            status = await asyncio.wait_for(actor.status.remote(), timeout_s)
            self._last[spec.node_rank] = status
            if status["state"] == DEAD:
                raise RuntimeError(f"node rank {spec.node_rank} failed to start: "
                                   f"{status['error']}")

    async def problem(self) -> str | None:
        """Why the gang is not whole (None: every rank answered and runs)."""
        if self.error:
            return self.error
        for spec, actor in self._actors:
            why = None
            try:
                status = await asyncio.wait_for(actor.status.remote(), self._timeout_s)
            except asyncio.TimeoutError:
                why = f"node rank {spec.node_rank} did not answer within {self._timeout_s:g} s"
            except ray.exceptions.RayError as exc:
                why = f"node rank {spec.node_rank} actor is gone: {type(exc).__name__}"
            else:
                self._last[spec.node_rank] = status
                if status["state"] != self._healthy:
                    why = (f"node rank {spec.node_rank} on {status['node_ip']}: "
                           f"{status['state']} ({status['error']})")
            if why:
                self.failed_rank = spec.node_rank
                return why
        return None

    def guard_start(self, on_failure) -> threading.Event:
        """While the replica's engine starts (a blocking call), poll the ranks from a thread;
        a rank that dies then would leave rank 0 waiting at the process-group rendezvous, so
        call on_failure(reason) (it kills the starting engine). Set the event to stop."""
        done = threading.Event()

        def poll():
            while not done.wait(self._period_s * 2):
                for spec, actor in self._actors:
                    try:
                        status = ray.get(actor.status.remote(), timeout=self._timeout_s * 2)
                    except Exception as exc:  # noqa: BLE001 - gone or stuck: both fatal
                        why = f"node rank {spec.node_rank} lost while starting: {exc}"[:500]
                    else:
                        why = None if status["state"] in (STARTING, RUNNING) else \
                            f"node rank {spec.node_rank} failed while starting: {status['error']}"
                    if why and not done.is_set():
                        self.error, self.failed_rank = why, spec.node_rank
                        logger.error("gang broken: %s", why)
                        on_failure(why)
                        return
        threading.Thread(target=poll, daemon=True, name="gang-start-guard").start()
        return done

    def watch(self, on_failure) -> None:
        """Check the ranks every period_s in the running loop; on the first problem call
        on_failure(reason) once and stop watching."""
        async def loop():
            while self.error is None:
                await asyncio.sleep(self._period_s)
                why = await self.problem()
                if why:
                    self.error = why
                    logger.error("gang broken: %s", why)
                    on_failure(why)
        self._watch_task = asyncio.get_running_loop().create_task(loop())

    async def started_with(self, timeout_s: float) -> list[dict[str, Any]]:
        """Each rank actor's own account of its node, devices, env and engine kwargs."""
        return [await asyncio.wait_for(actor.started_with.remote(), timeout_s)
                for _, actor in self._actors]

    def ranks(self) -> list[dict[str, Any]]:
        """[{rank, node_ip, pid, worker_pids, state}] of the node ranks > 0 (last seen)."""
        out = []
        for spec, _ in self._actors:
            last = self._last.get(spec.node_rank, {})
            out.append({"rank": spec.node_rank, "node_ip": last.get("node_ip", ""),
                        "node_id": last.get("node_id", ""), "pid": last.get("pid"),
                        "worker_pids": last.get("worker_pids", []),
                        "state": DEAD if spec.node_rank == self.failed_rank
                        else last.get("state", STARTING)})
        return out

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every rank's executor (bounded), then kill the actors."""
        if self._watch_task is not None:
            self._watch_task.cancel()
        refs = [actor.stop.remote() for _, actor in self._actors]
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - killed below
                pass
        for _, actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []
