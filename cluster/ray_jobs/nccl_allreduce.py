"""The Ray job behind `cluster nccl-check`: a timed torch.distributed all-reduce across the cluster.

Runs ON the cluster as the entrypoint of a Ray job (so it shows in the Ray dashboard), started by
`cluster nccl-check` as `python nccl_allreduce.py ARGS` on the head. It needs only the standard
library, Ray and torch on the nodes; `cluster` is not imported, so the file is shipped as is to a
cluster where the toolkit is not installed (cluster/ray/nccl_check.py writes it to a temporary
directory on the head; the actor class travels by value, as classes of `__main__` do).

Steps, every one bounded by the deadline (--deadline, a Unix time on the head's clock):
  1. alive    every expected node (--nodes: [{"name", "ip"}], the inventory's) is alive in Ray;
              for NCCL, the GPUs each node registered.
  2. place    a placement group with one bundle per rank, each pinned to its node by Ray's
              `node:<ip>` resource: NCCL one {"GPU": 1} bundle per GPU (PACK), gloo one {"CPU": 1}
              bundle per node (STRICT_SPREAD). While it is pending, a node Ray declares dead
              ends the wait; after 15 s the nodes of the unplaced bundles get a tiny task each
              and a node that does not run it is named (cut off or hung, before Ray notices).
  3. start    one actor per bundle reports its host name, pid, node IP (VLLM_HOST_IP, else
              Ray's), GPU ids and interface env; ranks follow the --nodes order (then GPU id).
  4. run      rank 0 opens a TCPStore on its node IP (port chosen by the kernel), every rank
              joins (`init_process_group(store=...)`, timeout = what is left), checks one
              all-reduce for correctness, warms up, times --iters all-reduces of --size-mb MiB
              (float32 zeros, in place), destroys the group. NCCL ranks run with NCCL_DEBUG=INFO,
              NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH and NCCL_DEBUG_FILE=<D>/nccl.%h.%p.log, D the
              rank's own new folder (mkdtemp: 0700, owned by the rank) in --log-dir (default:
              the node's temp dir; refused when it is a link, owned by another user, or
              writable by others without the sticky bit), and return that file's text
              (bounded), then remove D: only a real collective makes NCCL >= 2.22 print its
              channel (transport) lines.
              While they run, Ray's node table is read every 3 s and the ranks are asked
              `phase()` every 5 s (answered from the actor's second thread); a rank that
              fails, dies, loses its node or misses two heartbeats gives the others 10 s,
              then the check ends.
  With --groups (the fabric proof) the ranks are the layout's rank slots and step 4 runs per
  group (run_groups); a placement that is still pending once its nodes answered a probe gives
  up at once (`placement_busy`: their resources are in use, e.g. by the app being replaced).
  A rank that fails, a dead actor, or a rank still running at the end is reported with its node;
  ranks still running are asked what they are doing (a silent one: its node is gone). The nodes
  to blame are the dead or silent ones first, then peers whose IP an error names (blame()).

Output: the full result as JSON in --result-file, the one answer, read back on the head by
cluster/ray_jobs/nccl_job.py; on stdout, for a person reading the job's log in the dashboard,
one summary sentence and a `PROBLEM` line per problem (nothing reads them by machine). Exit 0
when every rank finished, 1 otherwise (the job shows FAILED in the dashboard).

Result keys: ok, backend, world_size, size_bytes, iters, warmup, stage (where it ended: alive,
place, start, run, done), problems (sentences), failed_nodes (names), nodes ({name: {ip, alive,
gpus, ranks}}), notes, ranks ([{rank, node, ip, hostname, pid, gpu_ids, env, time_s,
algbw_gbps, busbw_gbps, error, phase, nccl_log, nccl_log_path}]), stage_s ({stage: seconds}),
versions ({ray, torch, nccl}); when ok also algbw_gbps, busbw_gbps and time_per_iter_s of the
collective (the slowest rank's time, as nccl-tests counts it; GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import sys
import tempfile
import time
import traceback
from typing import Any, Iterable, Mapping, Sequence

NCCL_LOG_MAX_BYTES = 4 << 20       # per rank; the head of the log holds init and channels
PROBE_TIMEOUT_S = 20.0             # a tiny task on a node that may be cut off
PROBE_AFTER_S = 15.0               # a pending placement group gets its nodes probed after this
POLL_S = 3.0                       # how often Ray's node table is read while waiting
FAIL_GRACE_S = 10.0                # the other ranks' time to finish once one rank failed
HEARTBEAT_S = 5.0                  # ranks still running are asked phase() this often
PHASE_QUERY_TIMEOUT_S = 5.0        # a rank's answer to phase()
CLEANUP_RESERVE_S = 8.0            # kept from every wait to report and clean up
ENV_KEYS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "VLLM_HOST_IP",
            "CUDA_VISIBLE_DEVICES", "NCCL_NET", "NCCL_IB_DISABLE")


# ---------------------------------------------------------------- pure helpers (unit-tested)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="timed torch.distributed all-reduce across a Ray cluster")
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--size-mb", type=float, required=True, help="all-reduce size in MiB")
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--deadline", type=float, required=True, help="Unix time to finish by")
    p.add_argument("--nodes", required=True, help='JSON list of {"name", "ip"}, in rank order')
    p.add_argument("--log-dir", default=None,
                   help="where each rank makes its private folder for its NCCL debug file "
                        "(default: the node's temp dir)")
    p.add_argument("--result-file", required=True)
    p.add_argument("--groups", default=None,
                   help="JSON {slots, groups, small_bytes, join_timeout_s}: run the all-reduce "
                        "per group of a deployment's layout (see run_groups)")
    args = p.parse_args(argv)
    args.nodes = json.loads(args.nodes)
    if args.groups is not None:
        args.groups = parse_groups(args.groups, p.error)
    if not isinstance(args.nodes, list) or not args.nodes or not all(
            isinstance(n, dict) and n.get("name") and n.get("ip") for n in args.nodes):
        p.error('--nodes must be a non-empty JSON list of {"name", "ip"}')
    if args.size_mb <= 0 or args.iters < 1 or args.warmup < 0:
        p.error("--size-mb must be > 0, --iters >= 1, --warmup >= 0")
    return args


def parse_groups(text: str, error: Any) -> dict:
    """--groups: {"slots": [{"node", "ip"}], "groups": [{"kind", "replica", "ranks",
    "members": [slot index], "port"}], "small_bytes", "join_timeout_s"} (checked)."""
    spec = json.loads(text)
    slots, groups = spec.get("slots"), spec.get("groups")
    if not isinstance(slots, list) or not slots or not all(
            isinstance(s, dict) and s.get("node") and s.get("ip") for s in slots):
        error('--groups: "slots" must be a non-empty list of {"node", "ip"}')
    if not isinstance(groups, list) or not groups:
        error('--groups: "groups" must be a non-empty list')
    for g in groups:
        members, port = g.get("members"), g.get("port")
        if not isinstance(members, list) or len(members) < 2 or not all(
                isinstance(m, int) and 0 <= m < len(slots) for m in members) or \
                len(set(members)) != len(members):
            error("--groups: every group has 2 or more distinct slot indices")
        if not isinstance(port, int) or not 1024 <= port <= 65535:
            error("--groups: every group has a port 1024..65535")
    rng = spec.get("port_range")
    if rng is not None and not (isinstance(rng, list) and len(rng) == 2 and all(
            isinstance(x, int) and 1024 <= x <= 65535 for x in rng) and rng[0] <= rng[1]):
        error("--groups: port_range must be [lo, hi] within 1024..65535")
    small = spec.get("small_bytes", 8192)
    join = spec.get("join_timeout_s", 60)
    if not isinstance(small, int) or not 4 <= small <= 1 << 30:
        error("--groups: small_bytes must be 4 .. 1 GiB")
    if not isinstance(join, (int, float)) or not 1 <= join <= 3600:
        error("--groups: join_timeout_s must be 1 .. 3600")
    spec["small_bytes"], spec["join_timeout_s"] = small, float(join)
    return spec


def size_bytes(size_mb: float) -> int:
    """MiB -> bytes, rounded down to whole float32 elements (at least one)."""
    return max(4, int(size_mb * (1 << 20)) // 4 * 4)


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2(n-1)/n (0 for a single rank)."""
    if world_size <= 1:
        return 0.0
    return algbw * 2.0 * (world_size - 1) / world_size


def bandwidths(nbytes: int, seconds_per_iter: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s, as nccl-tests) for one all-reduce of nbytes."""
    if seconds_per_iter <= 0:
        return 0.0, 0.0
    alg = nbytes / seconds_per_iter / 1e9
    return alg, bus_bandwidth(alg, world_size)


def bundles_for(backend: str, nodes: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[str], str]:
    """Placement group bundles, the node name of each bundle, and the strategy.

    `nodes`: [{"name", "ip", "gpus"}]. NCCL: one {"GPU": 1} bundle per GPU of each node (PACK);
    gloo: one {"CPU": 1} bundle per node (STRICT_SPREAD). Every bundle is pinned to its node by a
    sliver of Ray's built-in `node:<ip>` resource, so a missing node cannot be replaced by another.
    """
    bundles: list[dict] = []
    owners: list[str] = []
    for n in nodes:
        pin = {f"node:{n['ip']}": 0.001}
        if backend == "nccl":
            for _ in range(int(n.get("gpus") or 0)):
                bundles.append({"GPU": 1.0, **pin})
                owners.append(n["name"])
        else:
            bundles.append({"CPU": 1.0, **pin})
            owners.append(n["name"])
    return bundles, owners, ("PACK" if backend == "nccl" else "STRICT_SPREAD")


def bundles_for_slots(backend: str, slots: Sequence[Mapping[str, Any]]
                      ) -> tuple[list[dict], list[str], str]:
    """One bundle per rank slot of a layout ({"node", "ip"}), pinned to its node: {"GPU": 1}
    for NCCL, {"CPU": 1} for gloo (PACK: the pins place them)."""
    kind = "GPU" if backend == "nccl" else "CPU"
    bundles = [{kind: 1.0, f"node:{s['ip']}": 0.001} for s in slots]
    return bundles, [str(s["node"]) for s in slots], "PACK"


STORE_PORT_TRIES = 8


def store_ports(first: int, port_range: Sequence[int] | None) -> list[int]:
    """The ports a group's store tries: its own, then the next ones of the range (wrapping),
    at most STORE_PORT_TRIES."""
    if not port_range or len(port_range) != 2:
        return [first]
    lo, hi = int(port_range[0]), int(port_range[1])
    span = hi - lo + 1
    if span < 1 or not lo <= first <= hi:
        return [first]
    return [lo + (first - lo + i) % span for i in range(min(STORE_PORT_TRIES, span))]


def group_bandwidth(nbytes: int, iters: int, members: Sequence[Mapping[str, Any]]
                    ) -> dict[str, Any]:
    """A finished group's figures: algbw / busbw of the slowest member (nccl-tests'
    convention) and the small-message time per all-reduce (latency_us)."""
    world = len(members)
    slowest = max(float(m["time_s"]) for m in members)
    alg, bus = bandwidths(nbytes, slowest / iters, world)
    out = {"algbw_gbps": round(alg, 6), "busbw_gbps": round(bus, 6), "latency_us": None}
    small = [m.get("small_time_s") for m in members]
    if all(isinstance(t, (int, float)) for t in small):
        out["latency_us"] = round(max(small) / iters * 1e6, 2)
    return out


def assign_ranks(infos: Sequence[Mapping[str, Any]], node_order: Sequence[str]) -> list[int]:
    """Actor indices in rank order: nodes in `node_order`, then by first GPU id, then bundle."""
    order = {name: i for i, name in enumerate(node_order)}

    def key(i: int) -> tuple:
        info = infos[i]
        gpus = info.get("gpu_ids") or []
        first = min((int(g) for g in gpus if str(g).isdigit()), default=-1)
        return order.get(info.get("node"), len(order)), first, i

    return sorted(range(len(infos)), key=key)


def nodes_named_in(text: str, nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """Expected nodes whose IP appears in an error text (gloo/NCCL name the peer's address)."""
    out = []
    for n in nodes:
        ip = str(n["ip"])
        start = text.find(ip)
        while start >= 0:
            end = start + len(ip)
            before = text[start - 1] if start > 0 else " "
            after = text[end] if end < len(text) else " "
            if not (before.isdigit() or before == ".") and not (after.isdigit()):
                out.append(n["name"])
                break
            start = text.find(ip, end)
    return out


def blame(ranks: Sequence[Mapping[str, Any]], dead_nodes: Iterable[str],
          nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """The nodes to name for a failed run, most certain first.

    Dead (in Ray) nodes and nodes of ranks whose actor died or stopped answering come first;
    then nodes whose IP other ranks' errors name; only when nothing points anywhere, the nodes of
    every rank that failed or hung.
    """
    named: list[str] = []

    def add(name: str | None) -> None:
        if name and name not in named:
            named.append(name)

    for name in dead_nodes:
        add(name)
    for r in ranks:
        if r.get("phase") in ("actor-died", "no-answer"):
            add(r.get("node"))
    if not named:
        for r in ranks:
            if r.get("error"):
                for name in nodes_named_in(str(r["error"]), nodes):
                    if name != r.get("node"):
                        add(name)
    if not named:
        for r in ranks:
            if r.get("error") or r.get("phase") not in ("done",):
                add(r.get("node"))
    return named


# ---------------------------------------------------------------- the actor (one per rank)


class RankWorker:
    """One rank: reports where it runs, then joins the group and times the all-reduce.

    Runs with max_concurrency=2 so `phase()` answers while `run()` blocks in a collective.
    """

    def __init__(self, backend: str, log_dir: str | None = None):
        self.backend = backend
        self.log_parent = log_dir      # the rank's own folder (self.log_dir) is made in it
        self.log_dir: str | None = None
        self._phase = "created"
        self._phase_at = time.time()
        self._store = None

    def _set(self, phase: str) -> None:
        self._phase, self._phase_at = phase, time.time()

    def phase(self) -> dict:
        return {"phase": self._phase, "since_s": round(time.time() - self._phase_at, 1)}

    def info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        ip = os.environ.get("VLLM_HOST_IP") or ray.util.get_node_ip_address()
        try:
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        except Exception:
            gpu_ids = []
        return {"hostname": socket.gethostname(), "pid": os.getpid(), "ip": ip,
                "node_id": ctx.get_node_id(), "gpu_ids": gpu_ids,
                "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}}

    def open_store(self, world_size: int, timeout_s: float, port: int = 0) -> int:
        """Rank 0: the TCPStore every rank rendezvous at (`port`; 0: the kernel picks one)."""
        import datetime

        import torch.distributed as dist

        self._set("store")
        ip = os.environ.get("VLLM_HOST_IP") or _node_ip()
        self._store = dist.TCPStore(ip, int(port), world_size, True,
                                    timeout=datetime.timedelta(seconds=max(5.0, timeout_s)),
                                    wait_for_workers=False)
        return int(self._store.port)

    def run(self, rank: int, world_size: int, master_ip: str, master_port: int,
            nbytes: int, warmup: int, iters: int, timeout_s: float, small_nbytes: int = 0,
            keep_log: bool = False) -> dict:
        """One timed all-reduce run in a fresh process group. `small_nbytes`: also time `iters`
        all-reduces of that size (the latency). `keep_log`: read this run's part of the NCCL
        debug file and keep the file for the next run (a process has one NCCL debug file)."""
        out: dict[str, Any] = {"rank": rank, "error": None, "time_s": None, "nccl_log": None,
                               "nccl_log_path": None, "torch": None, "nccl": None,
                               "small_time_s": None}
        log_pattern = None
        try:
            if self.backend == "nccl":
                if self.log_dir is None:
                    self.log_dir = private_log_dir(self.log_parent)
                log_pattern = os.path.join(self.log_dir, "nccl.%h.%p.log")
                os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET,GRAPH",
                                  NCCL_DEBUG_FILE=log_pattern)
            out.update(self._collective(rank, world_size, master_ip, master_port, nbytes,
                                        warmup, iters, timeout_s, small_nbytes))
            self._set("done")
        except BaseException as exc:  # report every failure as data, with where it happened
            out["error"] = f"{self._phase}: {type(exc).__name__}: {exc}".strip()[:4000]
            out["traceback"] = traceback.format_exc()[-4000:]
        out["phase"] = self._phase
        if log_pattern:
            # NCCL expands %h to the host name cut at its first dot, %p to the pid.
            import glob

            found = sorted(glob.glob(os.path.join(glob.escape(self.log_dir),
                                                  f"nccl.*.{os.getpid()}.log")))
            path = found[0] if found else log_pattern.replace(
                "%h", socket.gethostname().split(".")[0]).replace("%p", str(os.getpid()))
            out["nccl_log_path"] = path
            if keep_log:
                out["nccl_log"], self._log_offset = _read_from(
                    path, getattr(self, "_log_offset", 0), NCCL_LOG_MAX_BYTES)
                self._log_path = path
            else:
                out["nccl_log"] = _read_head(path, NCCL_LOG_MAX_BYTES)
                self.remove_log()
        return out

    def remove_log(self) -> None:
        """The NCCL debug file of a kept log, and the rank's own folder."""
        path = getattr(self, "_log_path", None)
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass
        if self.log_dir is not None:
            try:
                os.rmdir(self.log_dir)
            except OSError:
                pass
            self.log_dir = None

    def _collective(self, rank: int, world_size: int, master_ip: str, master_port: int,
                    nbytes: int, warmup: int, iters: int, timeout_s: float,
                    small_nbytes: int = 0) -> dict:
        import datetime

        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=max(5.0, timeout_s))
        versions = {"torch": torch.__version__, "nccl": None}
        if self.backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda is not available in this Ray worker "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            torch.cuda.set_device(0)       # Ray made the bundle's GPU the only visible one
            device = torch.device("cuda", 0)
            try:
                versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:
                pass
        else:
            device = torch.device("cpu")
        self._set("join")
        store = self._store if rank == 0 else dist.TCPStore(
            master_ip, master_port, world_size, False, timeout=timeout)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        try:
            sync = torch.cuda.synchronize if self.backend == "nccl" else (lambda: None)
            self._set("check")
            probe = torch.full((1024,), float(rank + 1), dtype=torch.float32, device=device)
            dist.all_reduce(probe)
            sync()
            want = world_size * (world_size + 1) / 2.0
            got = float(probe[0].item())
            if abs(got - want) > 1e-3 * want:
                raise RuntimeError(f"all-reduce returned {got}, expected {want}")
            tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            self._set("warmup")
            for _ in range(warmup):
                dist.all_reduce(tensor)
            sync()
            dist.barrier()
            self._set("timed")
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(tensor)
            sync()
            elapsed = time.perf_counter() - start
            small_elapsed = None
            if small_nbytes:
                small = torch.zeros(max(1, small_nbytes // 4), dtype=torch.float32,
                                    device=device)
                self._set("latency")
                dist.all_reduce(small)
                sync()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(small)
                sync()
                small_elapsed = time.perf_counter() - start
            self._set("teardown")
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        return {"time_s": elapsed, "small_time_s": small_elapsed, "torch": versions["torch"],
                "nccl": versions["nccl"]}


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def private_log_dir(parent: str | None) -> str:
    """A new folder only this process's user can use (mkdtemp: 0700) in `parent` (None: the
    node's temp dir), which must be a real directory owned by root or this user that others
    cannot write, or only with the sticky bit (/tmp); else PermissionError."""
    parent = parent or tempfile.gettempdir()
    st = os.lstat(parent)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()) or (
            st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise PermissionError(f"refused --log-dir {parent}: a link, not a directory, owned by "
                              f"uid {st.st_uid} or writable by others (mode "
                              f"{st.st_mode & 0o7777:o})")
    return tempfile.mkdtemp(prefix="cluster-nccl-", dir=parent)


def _open_own(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _read_head(path: str, limit: int) -> str | None:
    try:
        with open(path, "rb", opener=_open_own) as fh:
            data = fh.read(limit)
    except OSError:
        return None
    try:
        os.unlink(path)
    except OSError:
        pass
    return data.decode("utf-8", "replace")


def _read_from(path: str, offset: int, limit: int) -> tuple[str | None, int]:
    """(the text from `offset`, at most `limit` bytes, the offset after it)."""
    try:
        with open(path, "rb", opener=_open_own) as fh:
            fh.seek(offset)
            data = fh.read(limit)
            end = fh.seek(0, os.SEEK_END)
    except OSError:
        return None, offset
    return data.decode("utf-8", "replace"), end


def _probe_node() -> dict:
    return {"hostname": socket.gethostname(), "pid": os.getpid()}


# ---------------------------------------------------------------- the driver


class Deadline:
    def __init__(self, at: float):
        self.at = at

    def left(self, reserve: float = CLEANUP_RESERVE_S) -> float:
        return max(0.0, self.at - time.time() - reserve)


def _alive_nodes() -> dict[str, dict]:
    """Ray's alive nodes by IP."""
    import ray

    return {n["NodeManagerAddress"]: n for n in ray.nodes() if n.get("Alive")}


def run_check(args: argparse.Namespace) -> dict:
    import ray
    from ray.util.placement_group import (placement_group, placement_group_table,
                                          remove_placement_group)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    deadline = Deadline(args.deadline)
    nbytes = size_bytes(args.size_mb)
    result: dict[str, Any] = {
        "ok": False, "backend": args.backend, "world_size": 0, "size_bytes": nbytes,
        "iters": args.iters, "warmup": args.warmup, "stage": "alive", "problems": [],
        "failed_nodes": [], "nodes": {}, "notes": [], "ranks": [], "stage_s": {},
        "versions": {"ray": ray.__version__, "torch": None, "nccl": None}}
    if args.groups:
        result["groups"] = []
    problems, failed = result["problems"], result["failed_nodes"]
    clock = time.time()

    def stage_done(name: str) -> None:
        nonlocal clock
        now = time.time()
        result["stage_s"][name] = round(now - clock, 2)
        clock = now

    # 1. alive ------------------------------------------------------------------------------
    alive = _alive_nodes()
    expected = []
    for n in args.nodes:
        entry = alive.get(n["ip"])
        gpus = int((entry or {}).get("Resources", {}).get("GPU", 0) or 0)
        result["nodes"][n["name"]] = {"ip": n["ip"], "alive": entry is not None, "gpus": gpus,
                                      "ranks": []}
        if entry is None:
            problems.append(f"{n['name']} ({n['ip']}) is not alive in Ray")
            failed.append(n["name"])
        else:
            expected.append({"name": n["name"], "ip": n["ip"], "gpus": gpus})
    if failed:
        stage_done("alive")
        return result
    if args.backend == "nccl":
        for n in expected:
            if n["gpus"] == 0:
                result["notes"].append(f"{n['name']} registered no GPU in Ray: no NCCL rank there")
        if not any(n["gpus"] for n in expected):
            problems.append("no node registered a GPU in Ray: NCCL needs GPUs "
                            "(use --backend gloo on a CPU cluster)")
            stage_done("alive")
            return result
    stage_done("alive")

    # 2. place ------------------------------------------------------------------------------
    result["stage"] = "place"
    if args.groups:
        bundles, owners, strategy = bundles_for_slots(args.backend, args.groups["slots"])
    else:
        bundles, owners, strategy = bundles_for(args.backend, expected)
    result["world_size"] = len(bundles)
    pg = placement_group(bundles, strategy=strategy, name=f"nccl-check-{os.getpid()}")
    actors: list[Any] = []
    try:
        if not _wait_placed(pg, owners, expected, deadline, result, placement_group_table,
                            busy_gives_up=bool(args.groups)):
            stage_done("place")
            return result
        stage_done("place")

        # 3. start --------------------------------------------------------------------------
        result["stage"] = "start"
        opts = {"num_cpus": 1, "num_gpus": 0} if args.backend == "gloo" else \
            {"num_cpus": 0, "num_gpus": 1}
        cls = ray.remote(RankWorker)
        for i in range(len(bundles)):
            actors.append(cls.options(
                max_concurrency=2, max_restarts=0, **opts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i)).remote(
                        args.backend, args.log_dir))
        info_refs = [a.info.remote() for a in actors]
        done, pending = ray.wait(info_refs, num_returns=len(info_refs),
                                 timeout=deadline.left())
        infos: list[dict] = []
        for i, ref in enumerate(info_refs):
            rec = {"bundle": i, "node": owners[i], "ip": _ip_of(owners[i], expected)}
            if ref in done:
                try:
                    rec.update(ray.get(ref))
                    rec["node"] = owners[i]
                except Exception as exc:
                    rec.update(error=f"start: {type(exc).__name__}: {_first_line(exc)}",
                               phase="actor-died")
            else:
                rec.update(error="start: the actor did not start before the deadline",
                           phase="no-answer")
            infos.append(rec)
        stage_done("start")
        if any(r.get("error") for r in infos):
            result["ranks"] = infos
            _fail_ranks(result, infos, expected)
            return result

        # 4. run ----------------------------------------------------------------------------
        result["stage"] = "run"
        if args.groups:
            run_groups(args, actors, infos, expected, deadline, result)
            stage_done("run")
            return result
        order = assign_ranks(infos, [n["name"] for n in expected])
        world = len(order)
        rank_of = {idx: r for r, idx in enumerate(order)}
        master = infos[order[0]]
        left = deadline.left()
        try:
            port = ray.get(actors[order[0]].open_store.remote(world, left),
                           timeout=max(1.0, min(left, 60.0)))
        except Exception as exc:
            rec = dict(master, rank=0, phase="store",
                       error=f"store: {type(exc).__name__}: {_first_line(exc)}")
            result["ranks"] = [rec]
            _fail_ranks(result, [rec], expected)
            return result
        left = deadline.left()
        refs = [actors[i].run.remote(rank_of[i], world, master["ip"], port, nbytes,
                                     args.warmup, args.iters, max(5.0, left - 5.0))
                for i in range(len(actors))]
        outcomes = _wait_ranks(refs, actors, [infos[i]["ip"] for i in range(len(refs))],
                               deadline)
        reports, _stuck = _rank_reports(refs, outcomes, actors)
        ranks: list[dict] = []
        for i, report in enumerate(reports):
            rec = dict(infos[i], rank=rank_of[i])
            rec.update(report)
            ranks.append(rec)
        ranks.sort(key=lambda r: r["rank"])
        stage_done("run")
        result["ranks"] = ranks
        for r in ranks:
            result["nodes"][r["node"]]["ranks"].append(r["rank"])
            if r.get("torch"):
                result["versions"]["torch"] = r["torch"]
            if r.get("nccl"):
                result["versions"]["nccl"] = r["nccl"]
        if any(r.get("error") or r.get("time_s") is None for r in ranks):
            _fail_ranks(result, ranks, expected)
            return result
        for r in ranks:
            alg, bus = bandwidths(nbytes, r["time_s"] / args.iters, world)
            r["algbw_gbps"], r["busbw_gbps"] = round(alg, 3), round(bus, 3)
        # nccl-tests' convention: the slowest rank's time is the collective's time.
        slowest = max(r["time_s"] for r in ranks)
        alg, bus = bandwidths(nbytes, slowest / args.iters, world)
        result["time_per_iter_s"] = slowest / args.iters
        result["algbw_gbps"], result["busbw_gbps"] = round(alg, 3), round(bus, 3)
        result["ok"] = True
        result["stage"] = "done"
        return result
    finally:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        try:
            remove_placement_group(pg)
        except Exception:
            pass


def run_groups(args: argparse.Namespace, actors: Sequence[Any], infos: Sequence[dict],
               expected: Sequence[Mapping[str, Any]], deadline: Deadline, result: dict) -> None:
    """The all-reduce of every group of the layout, one group after the other, each in its own
    process group whose store listens on the group's port on its first member's node. A group
    whose ranks do not all join within join_timeout_s cannot form: its members' errors say
    where they stopped. Fills result["groups"]; ok when every group completed."""
    import ray

    spec = args.groups
    nbytes = size_bytes(args.size_mb)
    join = spec["join_timeout_s"]
    out = result["groups"] = []
    for index, group in enumerate(spec["groups"]):
        members = list(group["members"])
        world = len(members)
        rec: dict[str, Any] = {"index": index, "kind": group.get("kind"),
                               "replica": group.get("replica"), "ranks": group.get("ranks"),
                               "port": group["port"], "ok": False, "problems": [],
                               "members": []}
        out.append(rec)
        left = deadline.left()
        if left <= join:
            rec["problems"].append(f"not run: {left:.0f} s left before the deadline")
            continue
        master = infos[members[0]]
        rec["master"] = {"node": master["node"], "ip": master["ip"]}
        port, tried = None, []
        for candidate in store_ports(group["port"], spec.get("port_range")):
            try:
                port = ray.get(actors[members[0]].open_store.remote(world, join, candidate),
                               timeout=min(left, 60.0))
                break
            except Exception as exc:       # in use (an engine of the app being replaced...)
                tried.append(f"{candidate}: {_first_line(exc)}")
        if port is None:
            rec["problems"].append(f"the store on {master['node']} ({master['ip']}) could not "
                                   f"listen on a port of the range: {'; '.join(tried[:3])}")
            continue
        rec["port"] = port
        refs = [actors[m].run.remote(i, world, master["ip"], port, nbytes, args.warmup,
                                     args.iters, join, spec["small_bytes"], True)
                for i, m in enumerate(members)]
        budget = Deadline(min(deadline.at, time.time() + join + max(30.0, join) + CLEANUP_RESERVE_S))
        outcomes = _wait_ranks(refs, [actors[m] for m in members],
                               [infos[m]["ip"] for m in members], budget)
        reports, stuck = _rank_reports(refs, outcomes, [actors[m] for m in members])
        for i, report in enumerate(reports):
            info = infos[members[i]]
            m = {"rank": i, "slot": members[i], "node": info["node"], "ip": info["ip"],
                 "gpu_ids": info.get("gpu_ids") or [], "hostname": info.get("hostname")}
            m.update({k: v for k, v in report.items() if k != "traceback"})
            rec["members"].append(m)
            if m.get("torch"):
                result["versions"]["torch"] = m["torch"]
            if m.get("nccl"):
                result["versions"]["nccl"] = m["nccl"]
        done = [m for m in rec["members"] if not m.get("error") and m.get("time_s") is not None]
        if len(done) == world:
            rec.update(group_bandwidth(nbytes, args.iters, done), ok=True)
            continue
        blamed = blame(rec["members"], [], expected)
        rec["failed_nodes"] = blamed
        for m in rec["members"]:
            if m.get("error"):
                rec["problems"].append(f"rank {m['rank']} on {m['node']}: {m['error']}")
        if stuck and len(stuck) == world:
            break          # every rank hung: the later groups would only wait as long
    for a in actors:
        try:
            ray.get(a.remove_log.remote(), timeout=5)
        except Exception:
            pass
    result["ok"] = bool(out) and all(g["ok"] for g in out) and len(out) == len(spec["groups"])
    if result["ok"]:
        result["stage"] = "done"


def _ip_of(name: str, expected: Sequence[Mapping[str, Any]]) -> str | None:
    return next((n["ip"] for n in expected if n["name"] == name), None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # Ray wraps the remote traceback; its last line is the original exception.
    return (lines[-1] if lines else type(exc).__name__)[:1000]


def _wait_ranks(refs: Sequence[Any], actors: Sequence[Any], ips: Sequence[str | None],
                deadline: Deadline) -> dict:
    """Collect the ranks' results ({ref: result dict or the exception}) until all are in or the
    deadline.

    While waiting, Ray's node table is read every POLL_S and the ranks still running are asked
    `phase()` every HEARTBEAT_S (the actor answers from its second thread while the first is
    blocked in a collective). Once a rank has failed, its actor died, a node holding a rank left
    Ray, or a rank missed two heartbeats in a row (its node is cut off: Ray itself notices only
    after its health checks fail, ~30-60 s), the others get FAIL_GRACE_S to finish (they are
    usually blocked on the missing peer) instead of waiting for their collective timeout.
    """
    import ray

    outcomes: dict = {}
    pending = list(refs)
    index = {ref: i for i, ref in enumerate(refs)}
    misses = [0] * len(refs)
    grace_until: float | None = None
    next_beat = time.time() + HEARTBEAT_S
    while pending:
        left = deadline.left()
        if grace_until is not None:
            left = min(left, grace_until - time.time())
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(POLL_S, left))
        failed = False
        for ref in ready:
            try:
                outcomes[ref] = ray.get(ref)
                failed = failed or bool(outcomes[ref].get("error"))
            except Exception as exc:
                outcomes[ref] = exc
                failed = True
        if grace_until is None and not failed and pending:
            alive = _alive_nodes()
            failed = any(ip not in alive for ip in ips if ip)
        if grace_until is None and not failed and pending and time.time() >= next_beat:
            which = [index[r] for r in pending]
            beats = [actors[i].phase.remote() for i in which]
            answered, _ = ray.wait(beats, num_returns=len(beats),
                                   timeout=min(PHASE_QUERY_TIMEOUT_S, max(0.5, deadline.left())))
            for i, beat in zip(which, beats):
                misses[i] = 0 if beat in answered else misses[i] + 1
            failed = any(misses[i] >= 2 for i in which)
            next_beat = time.time() + HEARTBEAT_S
        if failed and grace_until is None:
            grace_until = time.time() + FAIL_GRACE_S
    return outcomes


def _rank_reports(refs: Sequence[Any], outcomes: Mapping[Any, Any],
                  actors: Sequence[Any]) -> tuple[list[dict], list[int]]:
    """What each rank's run (refs[i], on actors[i]) came to: its result, the death of its actor,
    or, still running at the deadline, the phase it is in; and the indexes of those still running."""
    stuck = [i for i, ref in enumerate(refs) if ref not in outcomes]
    phases = dict(zip(stuck, _ask_phases([actors[i] for i in stuck]))) if stuck else {}
    reports = []
    for i, ref in enumerate(refs):
        if ref not in outcomes:
            reports.append(dict(phases[i]))
        elif isinstance(outcomes[ref], BaseException):
            value = outcomes[ref]
            reports.append({"error": f"run: {type(value).__name__}: {_first_line(value)}",
                            "phase": "actor-died"})
        else:
            reports.append(dict(outcomes[ref]))
    return reports, stuck


def _ask_phases(actors: Sequence[Any]) -> list[dict]:
    """What ranks still running at the deadline are doing (asked all at once); a rank that does
    not answer within PHASE_QUERY_TIMEOUT_S is on a node that is gone or hung."""
    import ray

    refs = [a.phase.remote() for a in actors]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=PHASE_QUERY_TIMEOUT_S)
    out = []
    for ref in refs:
        state = None
        if ref in done:
            try:
                state = ray.get(ref)
            except Exception:
                state = None
        if state is None:
            out.append({"phase": "no-answer",
                        "error": f"run: no answer from the rank within "
                                 f"{PHASE_QUERY_TIMEOUT_S:g} s (its node is gone or hung)"})
        else:
            out.append({"phase": state["phase"],
                        "error": f"run: still in '{state['phase']}' after "
                                 f"{state['since_s']:g} s when the check gave up"})
    return out


def _fail_ranks(result: dict, ranks: Sequence[Mapping[str, Any]],
                expected: Sequence[Mapping[str, Any]]) -> None:
    alive = _alive_nodes()
    dead = [n["name"] for n in expected if n["ip"] not in alive]
    for name in dead:
        result["nodes"][name]["alive"] = False
    named = blame(ranks, dead, expected)
    result["failed_nodes"][:] = named
    for name in dead:
        result["problems"].append(f"{name} ({_ip_of(name, expected)}) is no longer alive in Ray")
    # The blamed nodes' ranks first: the verdict leads with the first problem.
    for r in sorted(ranks, key=lambda r: named.index(r["node"]) if r.get("node") in named
                    else len(named)):
        if r.get("error"):
            label = f"rank {r['rank']}" if r.get("rank") is not None else f"bundle {r['bundle']}"
            result["problems"].append(f"{label} on {r['node']}: {r['error']}")


def _wait_placed(pg: Any, owners: Sequence[str], expected: Sequence[Mapping[str, Any]],
                 deadline: Deadline, result: dict, table_fn: Any,
                 busy_gives_up: bool = False) -> bool:
    """Wait for the placement group; give up early when a node it needs is dead or silent.

    A healthy group is ready within seconds. While it is pending, Ray's node table is read every
    POLL_S (a node Ray declared dead ends the wait), and once, after PROBE_AFTER_S, the nodes of
    the unplaced bundles are sent a tiny task: a node that does not run it is cut off or hung,
    even while Ray still lists it as alive. A node that answers but cannot give its bundle keeps
    the wait going until the deadline (its resources may be freed). False: `result` says why.
    """
    import ray

    ref = pg.ready()
    started = time.time()
    silent: list[str] = []
    probed = False
    while True:
        left = deadline.left(reserve=CLEANUP_RESERVE_S + PROBE_TIMEOUT_S)
        if left <= 0:
            break
        ready, _ = ray.wait([ref], timeout=min(POLL_S, left))
        if ready:
            return True
        alive = _alive_nodes()
        if any(n["ip"] not in alive for n in expected):
            break
        if not probed and time.time() - started >= PROBE_AFTER_S:
            probed = True
            silent = _probe_nodes([n for n in expected if n["name"] in
                                   _suspects(pg, owners, expected, table_fn)[0]], deadline)
            if silent or busy_gives_up:
                break       # the fabric proof: answering nodes whose resources are in use
    suspects, state = _suspects(pg, owners, expected, table_fn)
    alive = _alive_nodes()
    dead = [name for name in suspects if _ip_of(name, expected) not in alive]
    if not dead and not silent:
        silent = _probe_nodes([n for n in expected if n["name"] in suspects], deadline)
    _report_placement(result, expected, suspects, dead, silent, state)
    return False


def _suspects(pg: Any, owners: Sequence[str], expected: Sequence[Mapping[str, Any]],
              table_fn: Any) -> tuple[list[str], str]:
    """Nodes of the bundles not placed yet (every node when that is not shown), the group state."""
    try:
        table = table_fn(pg) or {}
    except Exception:
        table = {}
    placed = {int(k) for k, node_id in (table.get("bundles_to_node_id") or {}).items()
              if node_id and node_id.strip("0")}
    names = [n["name"] for n in expected]
    # Unplaced bundles point at their nodes; a group stuck with every bundle assigned (a node
    # that stopped answering the commit) points nowhere: then every node is a suspect.
    suspects = sorted({owners[i] for i in range(len(owners)) if i not in placed},
                      key=names.index) or names
    return suspects, str(table.get("state", "?"))


def _probe_nodes(nodes: Sequence[Mapping[str, Any]], deadline: Deadline) -> list[str]:
    """Names of the nodes that do not run a tiny pinned task within PROBE_TIMEOUT_S."""
    import ray

    if not nodes:
        return []
    fn = ray.remote(num_cpus=0)(_probe_node)
    refs = {n["name"]: fn.options(resources={f"node:{n['ip']}": 0.001}).remote() for n in nodes}
    wait = min(PROBE_TIMEOUT_S, max(1.0, deadline.left(reserve=2.0)))
    done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait)
    silent = []
    for name, ref in refs.items():
        if ref not in done:
            silent.append(name)
            continue
        try:
            ray.get(ref)
        except Exception:
            silent.append(name)
    for ref in refs.values():
        try:
            ray.cancel(ref, force=True)
        except Exception:
            pass
    return silent


def _report_placement(result: dict, expected: Sequence[Mapping[str, Any]], suspects: Sequence[str],
                      dead: Sequence[str], silent: Sequence[str], state: str) -> None:
    need = "one GPU per bundle" if result["backend"] == "nccl" else "one CPU"
    for name in dead:
        result["nodes"][name]["alive"] = False
        result["problems"].append(f"{name} ({_ip_of(name, expected)}) is no longer alive in Ray")
    for name in silent:
        result["problems"].append(
            f"{name} ({_ip_of(name, expected)}) did not run a task within {PROBE_TIMEOUT_S:g} s: "
            f"unreachable from the head or hung (Ray still lists it as alive)")
    busy = [] if (dead or silent) else list(suspects)
    result["placement_busy"] = busy
    for name in busy:
        result["problems"].append(
            f"{name}: its bundle ({need}) could not be reserved in time (placement group "
            f"{state}); are its resources taken by other work (`cluster status`)?")
    result["failed_nodes"][:] = list(dead) + [n for n in silent if n not in dead] + busy


def summary(result: Mapping[str, Any]) -> str:
    """One sentence for the job's log: how the check ended."""
    if result.get("ok"):
        bw = result.get("busbw_gbps")
        return (f"all-reduce ({result.get('backend')}) ok over {result.get('world_size')} ranks"
                + (f": bus bandwidth {bw:g} GB/s" if isinstance(bw, (int, float)) else ""))
    failed = ", ".join(result.get("failed_nodes") or ()) or "no node named"
    return (f"all-reduce ({result.get('backend')}) failed at stage {result.get('stage')} "
            f"({failed}); {len(result.get('problems') or ())} problem(s)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.time()
    try:
        import ray

        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", logging_level="WARNING")
        result = run_check(args)
    except Exception as exc:
        result = {"ok": False, "backend": args.backend, "stage": "driver",
                  "problems": [f"driver: {type(exc).__name__}: {exc}"], "failed_nodes": [],
                  "traceback": traceback.format_exc()[-4000:]}
    result["driver_s"] = round(time.time() - started, 2)
    tmp = args.result_file + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, args.result_file)
    print(summary(result), flush=True)
    for p in result.get("problems", []):
        print("PROBLEM " + p, flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
