"""What the integration modules share: the `cluster` CLI in a subprocess, and an inventory
derived from the simulated cluster's with small-node Ray settings (optionally with Ray up).

    from integration_kit import PYTHON, ClusterCli, derive_inventory, ray_up

    cli = ClusterCli(timeout=900)                 # defaults for this module's calls
    p = cli(inv, "status")                        # subprocess.CompletedProcess
    code, doc = cli.json(inv, "status")           # appends --json; AssertionError if not JSON

    path = derive_inventory(sim, base, ray={"num_cpus": 9}, nodes={"node2": {"env": {...}}})
    with ray_up(cli, path):                       # `up --skip-preflight --yes`; always `down`
        ...

    model = node_tiny_model(tiny_model_builder, "dense", needs=("vllm",))   # nodes see /var/tmp
    with ProcessListWatch(SECRET) as watch: ...   # process lists sampled for a secret
    wait_for_series(inv, "up", ok)                # the head's Prometheus (PROMETHEUS_PORT)
    simcluster_unavailable()                      # why the simulated cluster cannot run, or None
    worker_simcluster_env("gw1", os.environ)      # the SIMCLUSTER_* of xdist worker gw1 ({}: none)

tests/integration/conftest.py documents the fixtures (simcluster, simcluster_factory); this
module holds plain helpers (import it by name: pytest puts tests/integration on sys.path). The
CLI itself runs through tests/fakes.py's cluster_cli, the suite's one subprocess runner.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest
import yaml

from cluster.node_programs._common import private_dir
from fakes import cluster_cli   # the one CLI runner (tests/fakes.py; tests/ is on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from simbench import StreamingLoad, served_max_model_len  # noqa: E402,F401  (the benchmarks' too)

REPO = Path(__file__).resolve().parents[2]
# The checkout's own virtualenv when it has one (the nodes run Ray from it), else this Python.
PYTHON = str(REPO / ".venv" / "bin" / "python3") if (REPO / ".venv").is_dir() else sys.executable
INHERIT = object()          # stdin: the test process's own

# What a simulated node can carry (docs/ray.md): 2 CPUs, 2 GiB, a 256 MiB object store.
# Where the tiny models live for the nodes: not /tmp, which is private to each simulated node.
NODE_MODELS = Path("/var/tmp/cluster-tiny-models")

SMALL_NODE_RAY: Mapping[str, Any] = {"num_cpus": 2, "memory": 2 * 1024 ** 3,
                                     "object_store_memory": 256 * 1024 ** 2, "python": PYTHON}


class ModuleRunDir(os.PathLike):
    """A test module's CLUSTER_RUN_DIR (`RUN_DIR = ModuleRunDir("fix")` at module level): the
    folder `module-runs/<name>` under pytest's base temp dir, made at its first use. pytest keeps
    the newest 3 base temp dirs, so a failed run's records stay to be read (CI's included) and
    then go; `tempfile.mkdtemp` at import had left a folder in /tmp per module per collection
    (491 by 2026-12-07). `root` is set by tests/integration/conftest.py's session fixture."""

    root: Path | None = None

    def __init__(self, name: str):
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
            raise ValueError(f"a module run dir's name: {name!r}")
        self.name = name

    def __fspath__(self) -> str:
        if ModuleRunDir.root is None:
            raise RuntimeError(f"ModuleRunDir({self.name!r}) used outside a pytest session")
        path = ModuleRunDir.root / "module-runs" / self.name
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def __str__(self) -> str:
        return self.__fspath__()


class ClusterCli:
    """`python -m cluster -i INVENTORY ARGS...` run from the checkout, output captured.

    timeout: seconds per call (a call may pass its own); env: variables added to this
    process's environment; stdin: subprocess's stdin (INHERIT: the test's own); python: the
    interpreter; record: called with every CompletedProcess (to grep outputs for secrets
    later); no_traceback: json() asserts stderr holds no Python traceback.
    """

    def __init__(self, timeout: float = 600, env: Mapping[str, str] | None = None,
                 stdin: Any = INHERIT, python: str = PYTHON,
                 record: Callable[[subprocess.CompletedProcess], None] | None = None,
                 no_traceback: bool = False):
        self.timeout = timeout
        self.env = dict(env or {})       # str or os.PathLike values (ModuleRunDir)
        self.stdin = stdin
        self.python = python
        self.record = record
        self.no_traceback = no_traceback

    def __call__(self, inventory: Path | str, *args: str, timeout: float | None = None,
                 env: Mapping[str, str] | None = None, stdin: Any = INHERIT
                 ) -> subprocess.CompletedProcess:
        stdin = self.stdin if stdin is INHERIT else stdin
        p = cluster_cli("-i", str(inventory), *args, cwd=REPO, python=self.python,
                        timeout=self.timeout if timeout is None else timeout,
                        env={**os.environ, **{k: os.fspath(v) for k, v in self.env.items()},
                             **(env or {})},
                        stdin=None if stdin is INHERIT else stdin)
        if self.record is not None:
            self.record(p)
        return p

    def json(self, inventory: Path | str, *args: str, **kw: Any) -> tuple[int, dict]:
        """(exit code, the JSON document) of `ARGS... --json`."""
        p = self(inventory, *args, "--json", **kw)
        if self.no_traceback:
            assert "Traceback" not in p.stderr, p.stderr[-3000:]
        try:
            return p.returncode, json.loads(p.stdout)
        except ValueError:
            raise AssertionError(f"cluster {' '.join(args)}: exit {p.returncode}\n{p.stdout}\n"
                                 f"{p.stderr}") from None


# Serve's HAProxy ingress (the inventory's default) keeps a stopping replica reachable for Ray's
# RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, 30 s, so that a load balancer in front can
# deregister it, and Serve force-kills it at 35 s: every undeploy and every replica a redeploy
# replaces cost ~35 s on the simulated cluster (2 s with this env; measured 2026-12-07: an
# undeploy 37.6 -> 9.6 s). The product keeps Ray's 30 s. Test clusters whose tests do not
# measure requests across a replica's stop (test_day_two's rolls do: it keeps Ray's window)
# take 2 s through the inventory's node env, read by Serve on the node at `ray start`.
SHORT_DRAIN_ENV: Mapping[str, str] = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}

# A TP >= 2 engine of vLLM's CPU build compiles one function with torch's inductor even with
# enforce_eager (VocabParallelEmbedding's get_masked_input_and_mask is a torch.compile'd
# function): the first generation on a node builds a precompiled header and the C++ kernel under
# /tmp/torchinductor_<user>. A simulated node's /tmp is its own and starts empty, so every test
# cluster paid it again on every node (2026-12-07: the gang's TP 2 replica's 4-token warm-up took
# 34.8 s on fresh nodes, 4.1 s on nodes that had compiled it). Test clusters that run TP >= 2
# engines share one inductor cache on the host, SHARED_INDUCTOR_DIR (inductor locks and renames
# its entries: ranks of one machine share it the same way). The precompiled header stays in each
# node's /tmp (torch keeps it under the temp dir whatever this variable says): that function's
# first call took 17.4 s cold, 9.4 s with this cache warm and the header not, 1.6 s with both
# warm (one process, 2 threads). vLLM's compile mode sets this variable itself (VLLM_CACHE_ROOT),
# so the compile-cache tests are unchanged. A real node keeps its /tmp: it compiles once. The
# nodes run what inductor finds there (pickles, shared objects) as root and /var/tmp is writable
# by every user, so derive_inventory takes the folder only as this user's private one
# (node_programs' private_dir: made 0700; a link, another user's folder or one others can write
# is refused).
SHARED_INDUCTOR_DIR = Path("/var/tmp/cluster-test-inductor")
SHARED_INDUCTOR_ENV: Mapping[str, str] = {"TORCHINDUCTOR_CACHE_DIR": str(SHARED_INDUCTOR_DIR)}


# `cluster up` starts the periodic health job (inventory `health:`), a Ray job with a reader actor
# a node: on a 2-node simulated cluster it cost ~13 s of CPU in its first minute and 0.035
# cores after (measured 2026-12-07: up + 60 s idle, 39.0 s of CPU with it, 22.8 s without; up
# ran 6 s longer). Modules whose tests do not read it (engines, proofs, placement) leave it out
# with health_job=False; the product's default, and the modules that test up/down (test_ray_cluster,
# test_faults, test_metrics) or the job itself (test_health_job_cluster, test_day_two), keep it.
NO_HEALTH_JOB: Mapping[str, Any] = {"enabled": False}


def derive_inventory(sim, base: Path, ray: Mapping[str, Any] | None = None,
                     nodes: Mapping[str, Mapping[str, Any]] | None = None,
                     every_node: Mapping[str, Any] | None = None,
                     ray_defaults: Mapping[str, Any] = SMALL_NODE_RAY,
                     short_drain: bool = False, shared_inductor: bool = False,
                     health_job: bool = True) -> Path:
    """base/cluster.yaml: the simulated cluster's inventory with `ray:` = ray_defaults | ray,
    run_dir base/runs, the keys of `every_node` set on every node and those of nodes[name] on
    that node (a value replaces the inventory's). short_drain: SHORT_DRAIN_ENV joins every
    node's env; shared_inductor: SHARED_INDUCTOR_ENV (an env entry of the test's own wins).
    health_job False: `health: NO_HEALTH_JOB` (`cluster up` starts no health job)."""
    doc = yaml.safe_load(Path(sim.inventory_path).read_text())
    doc["ray"] = {**ray_defaults, **(ray or {})}
    doc["run_dir"] = str(base / "runs")
    if not health_job:
        doc["health"] = {**(doc.get("health") or {}), **NO_HEALTH_JOB}
    if shared_inductor:
        private_dir(SHARED_INDUCTOR_DIR)
    test_env = {**(SHORT_DRAIN_ENV if short_drain else {}),
                **(SHARED_INDUCTOR_ENV if shared_inductor else {})}
    for node in doc["nodes"]:
        node.update(every_node or {})
        node.update((nodes or {}).get(node["name"], {}))
        if test_env:
            node["env"] = {**test_env, **(node.get("env") or {})}
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@contextlib.contextmanager
def ray_up(cli: ClusterCli, inventory: Path, timeout: float = 600,
           down_first: bool = False) -> Iterator[Path]:
    """Ray started on the inventory's nodes (`up --skip-preflight --yes`, asserted exit 0) for
    the block; `down --yes` at the end whatever happened. down_first: stop a Ray left from
    elsewhere first (it would lack this inventory's env)."""
    try:
        if down_first:
            cli(inventory, "down", "--yes", timeout=300)
        p = cli(inventory, "up", "--skip-preflight", "--yes", timeout=timeout)
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        yield inventory
    finally:
        cli(inventory, "down", "--yes", timeout=300)


def head_driver(inventory: Path | str, script: str, timeout: float = 300) -> dict:
    """Run a Python Ray driver on the head (over the toolkit's own SSH session, with the
    cluster's auth mode) and return the JSON of its `RESULT {...}` line."""
    import shlex

    from cluster.nodes import inventory as inventory_mod
    from cluster.ray import ray_cluster
    from cluster.inspection.facts import gather as gather_facts
    from cluster.nodes.remote import Session

    inv = inventory_mod.load(str(inventory))
    with Session(inv) as session:
        facts = gather_facts(session, inv, [inv.head])
        mode = ray_cluster.cluster_auth_mode(inv, facts)
        command = (f"cd /tmp && env RAY_AUTH_MODE={mode} RAY_USAGE_STATS_ENABLED=0 "
                   + shlex.join([inv.ray.python, "-c", script]))
        r = session.run(inv.head, command, timeout=timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"driver failed ({r.status}, exit {r.exit_code}):\n{r.stdout[-3000:]}\n"
                         f"{r.stderr[-3000:]}")


SIMCLUSTER = REPO / "scripts" / "simcluster"


SSHD = Path("/usr/sbin/sshd")


# scripts/test runs the heavy lane on pytest-xdist workers (gw0, gw1, ...). Each worker gets a
# simulated cluster of its own (docs/simcluster.md: prefix, subnet and directory select the
# instance), unless the caller chose one: two workers never share nodes, Ray or files. Subnets
# 100 + N stay clear of the fixed instances some modules bring up themselves (bst: 14).
XDIST_SUBNET_BASE = 100


def worker_simcluster_env(worker: str | None, environ) -> dict[str, str]:
    """The SIMCLUSTER_* variables for xdist worker `worker` ("gw3"), or {} outside xdist or
    when the caller already set any of them."""
    match = re.fullmatch(r"gw(\d{1,3})", worker or "")
    if match is None or any(k in environ for k in ("SIMCLUSTER_PREFIX", "SIMCLUSTER_SUBNET",
                                                   "SIMCLUSTER_DIR")):
        return {}
    index = int(match.group(1))
    if XDIST_SUBNET_BASE + index > 253:
        raise ValueError(f"xdist worker {worker}: no simulated-cluster subnet left")
    return {"SIMCLUSTER_PREFIX": f"gw{index}", "SIMCLUSTER_SUBNET": str(XDIST_SUBNET_BASE + index),
            "SIMCLUSTER_DIR": os.path.join(tempfile.gettempdir(), f"simcluster-gw{index}")}


def simcluster_unavailable() -> str | None:
    """Why the simulated cluster cannot run here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "simcluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "simcluster needs root (network namespaces, bridge, mounts); run the tests as root"
    if not shutil.which("ip"):
        return "simcluster needs iproute2 (`ip netns`)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` fails here: {probe.stderr.strip()}"
    for tool in ("unshare", "nsenter", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"simcluster needs `{tool}` (util-linux / openssh-client)"
    if not os.access(SSHD, os.X_OK):
        return f"simcluster needs {SSHD} (apt-get install -y openssh-server)"
    return None


class ProcessListWatch:
    """Samples every process's command line (the host's `ps` sees the simulated nodes' PID
    namespaces too) until stopped; keeps the lines holding the key. As a positive control it
    also counts processes whose *environment* holds it (Ray on the nodes must: it reads the key
    from there), which proves the sampler sees the nodes' processes at all."""

    PERIOD_S = 1.0
    LIMIT_S = 3 * 3600.0

    def __init__(self, secret: str):
        self.secret = secret
        self.hits: list[str] = []
        self.samples = 0
        self.env_holders = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProcessListWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        end = time.monotonic() + self.LIMIT_S
        while not self._stop.is_set() and time.monotonic() < end:
            self.sample()
            self._stop.wait(self.PERIOD_S)

    def sample(self) -> None:
        ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True)
        self.hits += [line for line in ps.stdout.splitlines() if self.secret in line]
        holders = 0
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                holders += self.secret.encode() in environ.read_bytes()
            except OSError:
                continue
        self.env_holders = max(self.env_holders, holders)
        self.samples += 1


PROMETHEUS_PORT = 19090


SCRAPE_WAIT_S = 240.0


def prom_query(inv: Path, query: str) -> list[dict]:
    """Prometheus's /api/v1/query on the head's loopback, over the library's SSH route."""
    import httpx

    from cluster.nodes import inventory as inventory_mod
    from cluster.nodes.head_tunnel import HeadTransport, HeadTunnel
    from cluster.nodes.remote import Session

    inventory = inventory_mod.load(str(inv))
    with Session(inventory) as session, \
            httpx.Client(transport=HeadTransport(HeadTunnel(session)), timeout=30) as http:
        reply = http.get(f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query", params={"query": query})
    reply.raise_for_status()
    body = reply.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for_series(inv: Path, query: str, ok, limit_s: float = SCRAPE_WAIT_S) -> list[dict]:
    """Poll (bounded) until ok(series) holds; the last series either way."""
    end = time.monotonic() + limit_s
    series: list[dict] = []
    while True:
        series = prom_query(inv, query)
        if ok(series) or time.monotonic() > end:
            return series
        time.sleep(5)


def node_tiny_model(builder, kind: str = "dense", needs: tuple[str, ...] = ()) -> Path:
    """The tiny model `kind` under NODE_MODELS (built once; the session fixture
    tiny_model_builder), the test skipped when torch/transformers/tokenizers or one of `needs`
    (modules the test itself uses: vllm, openai...) is not installed."""
    for needed in ("torch", "transformers", "tokenizers", *needs):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"this test needs {needed}, not installed")
    return builder.build_tiny_model(NODE_MODELS / kind, kind)


# CPU engines of simulated nodes, as `cluster deploy --env` pairs: unbound, one OpenMP thread each.
# The simulated nodes share the machine's cores, and vLLM binds every TP 1 engine to the same one:
# an engine starting on a core that serving engines' workers busy-poll got ~3 % of it and its
# replica stayed STARTING for 12 min (test_day_two, 2026-12-06). Real nodes have cores of their own.
UNBOUND_ENGINE_ENV = ("VLLM_CPU_OMP_THREADS_BIND=nobind", "OMP_NUM_THREADS=1")


def process_tree(sim, node: str, roots: set[int]) -> dict[int, str]:
    """pid -> command line of `roots` and every descendant of them on the simulated node (its
    own PID namespace, read with `ps` inside it)."""
    p = sim.exec(node, "ps", "-eo", "pid=,ppid=,args=", check=True)
    parent, args = {}, {}
    for line in p.stdout.splitlines():
        pid, ppid, cmd = (line.split(None, 2) + [""])[:3]
        parent[int(pid)], args[int(pid)] = int(ppid), cmd
    out = {}
    for pid in args:
        walk, seen = pid, set()
        while walk and walk not in seen:
            if walk in roots:
                out[pid] = args[pid]
                break
            seen.add(walk)
            walk = parent.get(walk, 0)
    return out
