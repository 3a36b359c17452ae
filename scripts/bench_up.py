#!/usr/bin/env python3
"""Benchmark: wall time of `cluster up` (with its preflight) vs Ray's own launcher (`ray up`).

Both bring the same 3 simulated nodes (scripts/simcluster, root only, own prefix/subnet) from no
Ray to "3 nodes alive", with the same per-node Ray resources (testbed.md: --num-cpus, --memory,
--object-store-memory) and the same auth mode:

  cluster   `cluster up --force --yes` (preflight runs; --force because the simulated nodes fail
            some checks, e.g. memlock): preflight, gather, plan, head, workers in parallel, wait
            until every node is alive with its GPUs. Timed until the command returns.
  ray up    `ray up -y` with the local provider (head_ip, worker_ips, auth ssh_user and
            ssh_private_key), which checks nothing; it returns after the head is up and its
            autoscaler then starts the workers. Timed until 3 nodes are alive (polled on the head,
            as `cluster status` does); the time `ray up` itself returned is printed too.
            `--autoscaler v1` (default) sets RAY_UP_enable_autoscaler_v2=0: with Ray 2.60's
            default autoscaler v2 the local provider starts only one of the two workers (measured
            here: the second never joined within 600 s), so v2 is not a usable baseline.

Between runs every node is taken down with `cluster down --yes` (`ray stop` inside each node).
Prints each run, the medians and ratio = cluster / ray-up (goal: <= 0.7), and one JSON line.
`ray up` needs rsync on this machine. The launcher writes ~/ray_bootstrap_{config.yaml,key.pem}
on the head, which on the simulated nodes is this machine's home: they are restored afterwards.

    .venv/bin/python scripts/bench_up.py [--rounds 1] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.nodes import inventory as inventory_mod  # noqa: E402
from cluster.ray import ray_cluster  # noqa: E402
from cluster.inspection.facts import gather as gather_facts  # noqa: E402
from cluster.ray.ray_state import query_state  # noqa: E402
from cluster.nodes.remote import Session  # noqa: E402

ENV = {"SIMCLUSTER_PREFIX": os.environ.get("SIMCLUSTER_PREFIX", "bup"),
       "SIMCLUSTER_SUBNET": os.environ.get("SIMCLUSTER_SUBNET", "3"),
       "SIMCLUSTER_DIR": os.environ.get("SIMCLUSTER_DIR", "/tmp/simcluster-bench-up")}
PROFILES = {"node1": "small-4gpu", "node2": "small-4gpu", "node3": "cpu"}
RAY = {"num_cpus": 2, "memory": 2 * 1024 ** 3, "object_store_memory": 256 * 1024 ** 2}
VENV_BIN = Path(sys.executable).parent
TIMEOUT_S = 600


def simcluster(*args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "simcluster"), *args],
                   env={**os.environ, **ENV}, check=True, stdout=subprocess.DEVNULL)


def cli(inventory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster", "-i", str(inventory), *args],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=str(ROOT))


def write_inventory(work: Path) -> Path:
    doc = yaml.safe_load((Path(ENV["SIMCLUSTER_DIR"]) / "cluster.yaml").read_text())
    doc["ray"] = dict(RAY, python=str(VENV_BIN / "python3"))
    doc["run_dir"] = str(work / "runs")
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def auth_mode(inv) -> str:
    with Session(inv) as session:
        return ray_cluster.cluster_auth_mode(inv, gather_facts(session, inv, [inv.head]))


def write_launcher_config(work: Path, inv, mode: str) -> Path:
    ray = f"{VENV_BIN}/ray"
    env = f"export RAY_AUTH_MODE={mode} RAY_USAGE_STATS_ENABLED=0;"
    res = (f"--num-cpus {RAY['num_cpus']} --memory {RAY['memory']} "
           f"--object-store-memory {RAY['object_store_memory']} --disable-usage-stats")
    config = {
        "cluster_name": f"bench-{ENV['SIMCLUSTER_PREFIX']}",
        "provider": {"type": "local", "head_ip": inv.head.ip,
                     "worker_ips": [n.ip for n in inv.workers]},
        "auth": {"ssh_user": "root", "ssh_private_key": inv.ssh.identity_file},
        "min_workers": len(inv.workers), "max_workers": len(inv.workers),
        "upscaling_speed": 1.0, "idle_timeout_minutes": 5,
        "file_mounts": {}, "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [],
        # Absolute paths: Ray runs these in login shells, where /etc/profile resets PATH.
        "head_start_ray_commands": [f"{env} {ray} stop",
                                    f"{env} ulimit -c unlimited; {ray} start --head --port=6379 "
                                    f"--autoscaling-config=~/ray_bootstrap_config.yaml {res}"],
        "worker_start_ray_commands": [f"{env} {ray} stop",
                                      f"{env} {ray} start --address=$RAY_HEAD_IP:6379 {res}"],
    }
    path = work / "launcher.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def alive_count(session, inv) -> int:
    state, _ = query_state(session, inv, include_serve=False, timeout=60)
    return sum(1 for n in state.nodes or () if n.alive)


class RunFailed(Exception):
    """One bring-up did not reach 3 alive nodes (recorded, the next round still runs)."""


def down(inv_path: Path) -> None:
    p = cli(inv_path, "down", "--yes")
    if p.returncode != 0:
        raise SystemExit(f"cluster down failed:\n{p.stdout}\n{p.stderr}")


def run_cluster_up(inv_path: Path) -> float:
    start = time.perf_counter()
    p = cli(inv_path, "up", "--force", "--yes", "--json")
    elapsed = time.perf_counter() - start
    out = json.loads(p.stdout) if p.stdout.strip() else {}
    alive = [n for n in (out.get("status") or {}).get("nodes", []) if n["alive"]]
    if p.returncode not in (0, 1) or len(alive) != 3:
        failed = [f"{s['node']}: {s['message']}" for s in out.get("steps", [])
                  if s["status"] not in ("ok", "changed")]
        raise RunFailed(f"cluster up exit {p.returncode} after {elapsed:.1f} s: "
                        + ("; ".join(failed) or p.stderr.strip()[-300:]))
    return elapsed


def run_ray_up(launcher: Path, inv, autoscaler: str) -> tuple[float, float]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_UP_enable_autoscaler_v2": "1" if autoscaler == "v2" else "0"}
    start = time.perf_counter()
    p = subprocess.run([str(VENV_BIN / "ray"), "up", "-y", "--no-config-cache",
                        "--disable-usage-stats", str(launcher)], capture_output=True, text=True,
                       timeout=TIMEOUT_S, env=env, cwd=str(launcher.parent))
    returned = time.perf_counter() - start
    if p.returncode != 0:
        last = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()][-1:]
        raise RunFailed(f"ray up exit {p.returncode} after {returned:.1f} s: "
                        + (last[0][-300:] if last else ""))
    with Session(inv) as session:
        while alive_count(session, inv) < 3:
            if time.perf_counter() - start > TIMEOUT_S:
                raise RunFailed("ray up: the workers did not join within "
                                f"{TIMEOUT_S} s (see the head's monitor.log)")
            time.sleep(1.0)
    return returned, time.perf_counter() - start


class HomeFiles:
    """Back up and restore the files `ray up` writes into the head's (= this machine's) home."""

    NAMES = ("ray_bootstrap_config.yaml", "ray_bootstrap_key.pem")

    def __init__(self, work: Path):
        self.home = Path.home()
        self.saved = work / "home-backup"
        self.saved.mkdir(exist_ok=True)
        self.existed = {n: (self.home / n).exists() for n in self.NAMES}
        for n, there in self.existed.items():
            if there:
                shutil.copy2(self.home / n, self.saved / n)

    def restore(self) -> None:
        for n, there in self.existed.items():
            if there:
                shutil.copy2(self.saved / n, self.home / n)
            else:
                (self.home / n).unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="leave the simulated cluster up")
    ap.add_argument("--autoscaler", choices=("v1", "v2"), default="v1",
                    help="the autoscaler `ray up` starts on the head (default v1, see above)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_up: skipped: the simulated cluster needs root", file=sys.stderr)
        return 0
    if not shutil.which("rsync"):
        print("bench_up: skipped: `ray up` needs rsync (apt-get install -y rsync)", file=sys.stderr)
        return 0
    profiles = [a for node, prof in PROFILES.items() for a in ("--profile", f"{node}={prof}")]
    simcluster("up", "3", *profiles)
    work = Path(tempfile.mkdtemp(prefix="bench-up-"))
    home = HomeFiles(work)
    ssh_dirs = set(Path(tempfile.gettempdir()).glob("ray_ssh_*"))  # ray up's ssh control dirs
    ours, theirs, theirs_returned, failures = [], [], [], []
    inv_path = write_inventory(work)
    try:
        inv = inventory_mod.load(str(inv_path))
        launcher = write_launcher_config(work, inv, auth_mode(inv))
        down(inv_path)
        for i in range(args.rounds):
            load = os.getloadavg()[0]
            try:
                t = run_cluster_up(inv_path)
                ours.append(t)
                print(f"round {i + 1} (load {load:.1f}): cluster up {t:.1f} s "
                      "(preflight included, 3 nodes alive)", flush=True)
            except RunFailed as exc:
                failures.append(str(exc))
                print(f"round {i + 1} (load {load:.1f}): FAILED {exc}", flush=True)
            down(inv_path)
            load = os.getloadavg()[0]
            try:
                returned, alive = run_ray_up(launcher, inv, args.autoscaler)
                theirs.append(alive)
                theirs_returned.append(returned)
                print(f"round {i + 1} (load {load:.1f}): ray up returned after {returned:.1f} s, "
                      f"3 nodes alive after {alive:.1f} s", flush=True)
            except RunFailed as exc:
                failures.append(str(exc))
                print(f"round {i + 1} (load {load:.1f}): FAILED {exc}", flush=True)
            down(inv_path)
    finally:
        final = cli(inv_path, "down", "--yes")  # whatever happened, no Ray is left on the nodes
        if final.returncode != 0:
            print(f"bench_up: cluster down failed:\n{final.stdout}", file=sys.stderr)
        home.restore()
        for made in set(Path(tempfile.gettempdir()).glob("ray_ssh_*")) - ssh_dirs:
            shutil.rmtree(made, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        for name in (f"cluster-bench-{ENV['SIMCLUSTER_PREFIX']}.state",
                     f"cluster-bench-{ENV['SIMCLUSTER_PREFIX']}.lock"):
            Path(tempfile.gettempdir(), "ray", name).unlink(missing_ok=True)
        if not args.keep:
            simcluster("down")
    if not ours or not theirs:
        print(f"bench_up: no complete pair of runs ({len(failures)} failed)", file=sys.stderr)
        return 2
    mine, ray_up = statistics.median(ours), statistics.median(theirs)
    ratio = mine / ray_up
    print(f"median: cluster up {mine:.1f} s, ray up (to 3 alive) {ray_up:.1f} s, "
          f"ratio {ratio:.2f} (goal <= 0.7: {'met' if ratio <= 0.7 else 'NOT met'})")
    print(json.dumps({"bench": "up", "rounds": args.rounds, "autoscaler": args.autoscaler,
                      "cluster_up_s": ours,
                      "ray_up_alive_s": theirs, "ray_up_returned_s": theirs_returned,
                      "failures": failures, "ratio": round(ratio, 3), "goal": 0.7}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
