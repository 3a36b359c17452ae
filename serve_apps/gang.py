"""The ranks of a multi-node engine: one Ray actor per further node, and the replica's watch.

vLLM's native multi-node mode (mp executor, nnodes / node_rank / master_addr / master_port):
the Serve replica is node rank 0 (it holds AsyncLLM and the API); each node rank > 0 is a
`RankActor` in the replica's own placement group (bundle i = node rank i, STRICT_SPREAD, so
every rank is on its own node) whose child process is vLLM's own command line,
`vllm serve MODEL --headless --nnodes N --node-rank R --master-addr A --master-port P ...`
with the same engine arguments as rank 0 (serve_apps/headless.py): its workers join rank 0's
torch.distributed group at master_addr:master_port. A MoE DP node (data_parallel_size > 1)
gets vLLM's data-parallel flags instead (`--data-parallel-size ... --data-parallel-start-rank
S`): its data_parallel_size_local engine cores hand-shake with node 0's engine client at
data_parallel_address:rpc_port. No vLLM class is built here: only its command line is used.

`HeadlessChild` runs that command: its own process group, SIGTERM when the actor's thread that
started it ends (PR_SET_PDEATHSIG; the command then ends every process below it:
serve_apps/vllm_cli.py), env as the actor's, its
output relayed to the actor's log (bounded); it is dead when the command exits or one of its
vLLM processes (the children it titles VLLM::..., the workers or the DP engine cores) exits;
stopping it ends its process group and every descendant (no orphans).

`Gang` (used by the replica) starts the rank actors before the replica's engine (rank 0 must
find them connecting), then watches them: every `period_s` each actor answers `status()`
within `timeout_s` or counts as dead (a stuck rank is a dead rank). A dead rank makes the
replica kill its own engine core and workers at once, so requests in flight and new ones get
vLLM's EngineDeadError (HTTP 500) instead of hanging until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
and check_health fails, so Serve replaces the replica with a new gang. Stopping the gang stops
each actor's command (its vLLM processes) and then the actor.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.base.textsafe import terminal_safe_line
from cluster.planning.gang import rank_actor_name
from serve_apps.config import reported_env
from serve_apps.headless import headless_command, vllm_command, vllm_flag_specs
from serve_apps.priority import set_process_priority
from serve_apps.vllm_cli import (children, descendants, die_with_parent,  # noqa: F401 (re-exported)
                                  kill_all, kill_descendants)

logger = logging.getLogger("ray.serve")

STARTING, RUNNING, DEAD, STOPPED = "starting", "running", "dead", "stopped"
PLACED = "placed"       # dry_run: the actor holds its bundle with its args, no vLLM started
STOP_GRACE_S = 5.0      # SIGTERM (vLLM shuts its workers down), then SIGKILL
LOG_CAP = 256 << 20     # bytes of the command's output relayed to the actor's log, at most
TAIL_LINES, TAIL_CHARS = 20, 500


def kill_tree(pid: int) -> list[int]:
    """SIGKILL pid's descendants, then pid; returns the pids signalled."""
    victims = descendants(pid) + [pid]
    kill_all(victims)
    return victims


def process_title(pid: int) -> str | None:
    """The command line of pid as ps shows it (vLLM retitles its processes), None when gone
    or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read(4096)
    except OSError:
        return None
    if stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] in (b"Z", b"X"):
        return None
    return cmdline.replace(b"\0", b" ").decode("utf-8", "replace").strip()


class HeadlessChild:
    """One command (vLLM's `vllm serve ... --headless`) as this process's child: started,
    watched (the command and the vLLM processes it starts), stopped with its whole tree."""

    def __init__(self, command: Sequence[str], label: str,
                 title_prefix: str | None = None, out_fd: int = 1):
        self._command = list(command)
        self._label = label
        self._prefix = (title_prefix or os.environ.get("VLLM_PROCESS_NAME_PREFIX") or
                        "VLLM") + "::"
        self._out_fd = out_fd
        self._proc: subprocess.Popen | None = None
        self._started = threading.Event()
        self._error: str | None = None
        self._stopping = False
        self._seen: dict[int, str] = {}
        self._lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the command from a thread of its own that lives as long as the command (its
        PDEATHSIG is tied to that thread); returns once it runs (raises OSError if it cannot)."""
        threading.Thread(target=self._run, daemon=True, name=f"{self._label}-child").start()
        if not self._started.wait(timeout_s) or self._proc is None:
            raise OSError(f"{self._label}: could not start {self._command[0]}: {self._error}")

    def _run(self) -> None:
        try:
            self._proc = subprocess.Popen(
                self._command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent(os.getpid(), signal.SIGTERM),
                close_fds=True)
        except OSError as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            self._started.set()
            return
        self._started.set()
        self._relay(self._proc.stdout)
        self._proc.wait()

    def _relay(self, pipe) -> None:
        """Copy the command's output to our log (LOG_CAP bytes at most, then a note), keeping
        its last lines for the error; returns at end of output."""
        written, partial = 0, b""
        while True:
            try:
                chunk = os.read(pipe.fileno(), 65536)
            except OSError:
                break
            if not chunk:
                break
            if written < LOG_CAP:
                out = chunk[:LOG_CAP - written]
                written += len(out)
                if written >= LOG_CAP:
                    out += b"\n[%s: output beyond %d bytes not logged]\n" % (
                        self._label.encode(), LOG_CAP)
                try:
                    os.write(self._out_fd, out)
                except OSError:
                    pass
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()[-4096:]
            for line in lines:
                if line.strip():
                    self._tail.append(terminal_safe_line(
                        line.decode("utf-8", "replace"))[:TAIL_CHARS])
        pipe.close()

    def worker_pids(self) -> list[int]:
        """The vLLM processes the command started (its children titled VLLM::...) that are
        alive now; each one seen is remembered, so a later exit is noticed."""
        proc = self._proc
        if proc is None:
            return []
        alive = []
        for pid in children(proc.pid):
            title = process_title(pid)
            if title and title.startswith(self._prefix):
                alive.append(pid)
                with self._lock:
                    self._seen.setdefault(pid, title.split()[0])
        return alive

    def problem(self) -> str | None:
        """Why the command is dead (None: it runs and every vLLM process it started lives)."""
        proc = self._proc
        if proc is None:
            return self._error
        code = proc.poll()
        if code is not None:
            last = self._tail[-1] if self._tail else "no output"
            return f"{self._label} exited with {code}: {last}"
        alive = set(self.worker_pids())
        with self._lock:
            gone = [(pid, title) for pid, title in self._seen.items() if pid not in alive]
        if gone:
            pid, title = gone[0]
            return f"{self._label}: vLLM process {title} (pid {pid}) exited"
        return None

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[int]:
        """SIGTERM the command's process group (vLLM stops its workers), SIGKILL whatever is
        left of it after grace_s, and reap it; returns the vLLM pids it had."""
        proc = self._proc
        if proc is None:
            return []
        pids = sorted(set(self.worker_pids()) | set(self._seen))
        tree = descendants(proc.pid)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(grace_s)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        kill_all(set(tree) | set(descendants(proc.pid)))
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        return pids


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)
class RankActor:
    """One headless node rank of a multi-node vLLM engine: `vllm serve --headless` as its child."""

    def __init__(self, node_rank: int, engine_kwargs: dict[str, Any], env: Mapping[str, str],
                 nice: int | None = None, start_engine: bool = True):
        os.environ.update({k: str(v) for k, v in env.items()})
        self._env_keys = sorted(env)
        self._engine_kwargs = dict(engine_kwargs)
        # Ray starts actors at nice 15; the replica (node rank 0) runs at process_priority:
        # a rank left at 15 starves against its peers (measured: PP 2 at ~1/30 the speed).
        # The command inherits it.
        self._priority = set_process_priority(nice) if nice is not None else "left as Ray set it"
        self._node_rank = node_rank
        self._state = STARTING
        self._error: str | None = None
        self._child: HeadlessChild | None = None
        self._command: list[str] = []
        self._started = time.time()
        if not start_engine:
            self._state = PLACED
            return
        try:
            self._command = headless_command(vllm_command(), engine_kwargs, vllm_flag_specs())
            logger.info("node rank %d: %s", node_rank, " ".join(self._command))
            child = HeadlessChild(self._command, f"vllm serve --headless (node rank {node_rank})")
            child.start()
            self._child, self._state = child, RUNNING
        except Exception as exc:  # noqa: BLE001 - reported through status()
            self._fail(f"{type(exc).__name__}: {exc}"[:2000])

    def _fail(self, why: str) -> None:
        if self._state != STOPPED:
            self._state, self._error = DEAD, why
            logger.error("node rank %d dead: %s", self._node_rank, why)

    def status(self) -> dict[str, Any]:
        child = self._child
        if child is not None and self._state == RUNNING:
            why = child.problem()
            if why:
                self._fail(why)
        return {"node_rank": self._node_rank, "state": self._state, "error": self._error,
                "pid": os.getpid(), "command_pid": child.pid if child else None,
                "worker_pids": child.worker_pids() if child else [],
                "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "nice": os.getpriority(os.PRIO_PROCESS, 0), "priority": self._priority,
                "started_at": self._started}

    def started_with(self) -> dict[str, Any]:
        """What this rank was started with, as it sees it: its node, GPUs (the devices of its
        bundle), the env it was given, the engine kwargs and vLLM command line it runs."""
        return {"node_rank": self._node_rank, "state": self._state,
                "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "env": reported_env({k: os.environ.get(k) for k in self._env_keys}),
                "engine_kwargs": {k: v if isinstance(v, (str, int, float, bool, type(None)))
                                  else str(v) for k, v in self._engine_kwargs.items()},
                "command": list(self._command)}

    def stop(self) -> list[int]:
        """Stop the command and its vLLM processes (SIGKILL what is left); returns their pids."""
        self._state = STOPPED
        child, self._child = self._child, None
        pids = child.stop() if child is not None else []
        kill_descendants()
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
