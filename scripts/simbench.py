"""Shared by the benchmark scripts: a private simulated cluster (scripts/simcluster) for one run,
the CLI's JSON, the thread profiler, a steady streaming load and the served max_model_len
(tests/integration use those two too)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# Pasted into a benchmark's child process (its tree may be a baseline's, so it is text, not an
# import): `profiled(fn)` calls fn() with every thread under cProfile on the thread's own CPU
# clock (time.thread_time: time a thread waits is not counted, as it would be by the default
# wall clock) and returns (fn's result, the merged pstats.Stats, {thread kind: [CPU s, threads]}).
# A kind: the main thread, the fan-out workers (threads named cluster-*), paramiko's transports
# over a TCP socket (a direct node's, or the bastion's) or over a jump host's channel (a node's
# behind a bastion), and the rest by name. A kind's CPU leaves out the BLOCKING calls, as the
# printed tops do: they block with the GIL released, and a thread's CPU clock mis-attributes
# their time when they end in a timeout exception (paramiko's reader threads).
BLOCKING = ("recv", "wait", "acquire", "select", "poll", "sleep")
THREAD_PROFILER = f"BLOCKING_CALLS = {BLOCKING!r}\n" + r'''
import cProfile as _cProfile, pstats as _pstats, re as _re, socket as _socket
import threading as _threading, time as _time

def thread_kind(thread):
    if thread is _threading.main_thread():
        return "main thread"
    if thread.name.startswith("cluster-"):
        return "fan-out workers (cluster-*)"
    sock = getattr(thread, "sock", None)
    if sock is not None and callable(getattr(thread, "open_session", None)):
        return ("paramiko transport over TCP" if isinstance(sock, _socket.socket)
                else "paramiko transport over a jump host channel")
    return "other: " + _re.sub(r"[0-9]+", "N", thread.name)

def _own_cpu(stats):
    return sum(tt for func, (_, _, tt, _, _) in stats.stats.items()
               if not any(word in func[2] for word in BLOCKING_CALLS))

def profiled(fn):
    profiles = []

    def start(*_):
        profile = _cProfile.Profile(_time.thread_time)
        profiles.append((thread_kind(_threading.current_thread()), profile))
        profile.enable()

    _threading.setprofile(start)
    main = _cProfile.Profile(_time.thread_time)
    main.enable()
    try:
        result = fn()
    finally:
        main.disable()
        _threading.setprofile(None)
    stats = _pstats.Stats(main)
    kinds = {"main thread": [_own_cpu(stats), 1]}     # before the other threads are added
    for kind, profile in profiles:
        one = _pstats.Stats(profile)
        stats.add(one)
        got = kinds.setdefault(kind, [0.0, 0])
        got[0] += _own_cpu(one)
        got[1] += 1
    return result, stats, kinds
'''


def thread_kinds_lines(kinds: dict, nodes: int) -> list[str]:
    """THREAD_PROFILER's {kind: [CPU s, threads]} as lines, the largest first, per node."""
    return [f"  {cpu * 1000 / nodes:7.2f} ms/node {count:6} threads  {kind}"
            for kind, (cpu, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0])]


def byte_compile(tree: Path = ROOT) -> str:
    """The tree's modules compiled into __pycache__ (what `pip install` does for a wheel), so a
    CLI's start-up is timed as a user's would be (with PYTHONDONTWRITEBYTECODE=1 every run would
    compile its modules from source); "ok" or why not."""
    import compileall

    ok = all([compileall.compile_dir(str(tree / package), quiet=1)
              for package in ("cluster", "playbooks")])
    return "ok" if ok else "some modules failed to compile (timed from source)"


def instance_dir(prefix: str) -> str:
    return f"/tmp/simcluster-{prefix}"


def node_cpu_seconds(prefix: str) -> float:
    """CPU seconds (user + system) used so far on the instance's nodes: each node's PID-1 sshd and
    its descendants once reaped (a session's processes count when it ends)."""
    state = json.loads(Path(instance_dir(prefix), "state.json").read_text())
    ticks = 0
    for rec in state["nodes"].values():
        stat = Path(f"/proc/{rec['sshd_pid']}/stat").read_text()
        ticks += sum(int(x) for x in stat.rsplit(")", 1)[1].split()[11:15])  # u, s, cu, cs time
    return ticks / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def simulated_cluster(nodes: int, prefix: str, subnet: int, keep: bool = False) -> Iterator:
    """Bring up `nodes` simulated nodes on their own prefix/subnet; yield the loaded inventory;
    tear them down afterwards unless keep."""
    from cluster.nodes import inventory

    env = {**os.environ, "SIMCLUSTER_PREFIX": prefix, "SIMCLUSTER_SUBNET": str(subnet),
           "SIMCLUSTER_DIR": instance_dir(prefix)}

    def simcluster(*args: str) -> None:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "simcluster"), *args], env=env,
                       check=True, stdout=subprocess.DEVNULL)

    simcluster("up", str(nodes))
    try:
        yield inventory.load(os.path.join(env["SIMCLUSTER_DIR"], "cluster.yaml"))
    finally:
        if not keep:
            simcluster("down")


def cli_json(inventory: str, *args: str, timeout: float) -> tuple[int, dict]:
    """`cluster -i INVENTORY ARGS --json` from the checkout: (exit code, its document); no
    document is one line and exit (the benchmark cannot go on)."""
    p = subprocess.run([sys.executable, "-m", "cluster", "-i", inventory, *args, "--json"],
                       capture_output=True, text=True, cwd=str(ROOT), timeout=timeout)
    try:
        return p.returncode, json.loads(p.stdout)
    except ValueError:
        raise SystemExit(f"cluster {args[0]}: exit {p.returncode}: {p.stderr.strip()[-500:]}")


class StreamingLoad:
    """A steady streaming load on one app (cluster/serving/bench.py's client, `concurrency` at
    a time) in a thread until the block ends; every request's outcome is kept (.outcomes)."""

    def __init__(self, endpoint: str, model: str, api_key: str, concurrency: int = 1,
                 output_len: int = 16):
        from cluster.serving.bench import BenchConfig

        self.config = BenchConfig(url=endpoint, model=model, concurrency=(concurrency,),
                                  requests=4 * concurrency, prompt_len=16, output_len=output_len,
                                  api_key=api_key, timeout_s=300)
        self.outcomes: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from cluster.serving.bench import run_bench

        while not self._stop.is_set():
            run_bench(self.config, on_request=lambda _c, o: self.outcomes.append(o))

    def __enter__(self) -> "StreamingLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=600)

    def failed(self) -> list:
        return [o for o in self.outcomes if not o.ok]

    def failed_kinds(self) -> dict[str, int]:
        """error kind -> how many requests failed with it."""
        kinds: dict[str, int] = {}
        for o in self.failed():
            kinds[o.error_kind] = kinds.get(o.error_kind, 0) + 1
        return kinds

    def figures(self) -> str:
        share = 100.0 * len(self.failed()) / max(1, len(self.outcomes))
        return (f"{len(self.outcomes)} requests, {len(self.failed())} failed ({share:.1f} %) "
                f"{self.failed_kinds()}")


def served_max_model_len(endpoint: str, model: str, api_key: str) -> int:
    """The max_model_len the app's engine serves `model` with (its OpenAI /models)."""
    req = urllib.request.Request(endpoint + "/models", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=60) as reply:
        (entry,) = [m for m in json.load(reply)["data"] if m["id"] == model]
    return int(entry["max_model_len"])
