"""Fixtures for tests that run over real SSH against scripts/simcluster (docs/simcluster.md).

    def test_x(simcluster):                  # 3 nodes, default profile (h100-ib)
        r = simcluster.ssh("node2", "hostname")

    def test_y(simcluster_factory):          # any size and profiles
        c = simcluster_factory(4, {"node2": "h100-7gpu", "node4": "cpu"})
        c.freeze("node3"); ...; c.thaw("node3")

The factory is session-scoped: it reuses the running cluster when it already has the asked size and
profiles (`simcluster up` is idempotent and converges otherwise: it restarts only the nodes whose
profile changed, thaws frozen sshds, brings links back up and restarts dead nodes), and runs
`simcluster down` at the end of the session unless SIMCLUSTER_KEEP=1. SIMCLUSTER_DIR,
SIMCLUSTER_PREFIX and SIMCLUSTER_SUBNET select the instance (for parallel development).
Tests using these fixtures are skipped, with the reason, when not root, without `ip netns`, or
without /usr/sbin/sshd. Mark them @pytest.mark.integration.

Shared helpers are plain functions in tests/integration/integration_kit.py (import it by name,
`from integration_kit import ...`: pytest puts this folder on sys.path). Use them instead of
writing your own:

    cli = ClusterCli(timeout=600)                   # `python -m cluster -i INV ...`, from the repo
    cli_json = cli.json                             # (exit code, JSON doc) of `... --json`
    #   ClusterCli(env={...}, stdin=subprocess.DEVNULL, python=sys.executable,
    #              record=OUTPUTS.append-like hook, no_traceback=True)
    path = derive_inventory(sim, tmp_path_factory.mktemp("x"), ray={"num_cpus": 4},
                            nodes={"node2": {"env": {...}}}, every_node={...})
    with ray_up(cli, path, timeout=600, down_first=False):   # Ray up; `down --yes` always after
        yield path
    head_driver(path, SCRIPT)                       # a Ray driver on the head -> its RESULT json
    PYTHON, REPO, SMALL_NODE_RAY                    # the venv's python, the checkout, Ray sizes
    node_tiny_model(tiny_model_builder, "dense", needs=("vllm",))   # under /var/tmp (nodes see it)
    ProcessListWatch(SECRET), prom_query, wait_for_series, PROMETHEUS_PORT
    cluster_process(...)                            # from fakes: a CLI process left running

The tiny test models: the session fixture `tiny_model_builder` of tests/conftest.py
(`tiny_model_builder.build_tiny_model(dir, "dense")`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration_kit import SIMCLUSTER, ModuleRunDir, simcluster_unavailable, worker_simcluster_env

REPO = Path(__file__).resolve().parents[2]

# Under pytest-xdist (scripts/test), this worker's own simulated cluster: set before any
# fixture runs scripts/simcluster, which reads these variables.
os.environ.update(worker_simcluster_env(os.environ.get("PYTEST_XDIST_WORKER"), os.environ))


@pytest.fixture(scope="session", autouse=True)
def module_run_dirs(tmp_path_factory) -> Path:
    """Where the modules' ModuleRunDir folders go: this session's (or xdist worker's) base temp
    dir."""
    ModuleRunDir.root = tmp_path_factory.getbasetemp()
    return ModuleRunDir.root


@dataclass(frozen=True)
class SimNode:
    name: str
    ip: str
    profile: str


class SimCluster:
    """A running simulated cluster: its files, its nodes and the fault-injection verbs."""

    def __init__(self, factory: "SimClusterFactory", status: dict):
        self._factory = factory
        self.dir = Path(status["dir"])
        self.nodes = tuple(SimNode(n["name"], n["ip"], n["profile"]) for n in status["nodes"])

    @property
    def inventory_path(self) -> Path:
        return self.dir / "cluster.yaml"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def identity_file(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def node(self, name: str) -> SimNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def ssh(self, node: str, command: str, timeout: float = 60, connect_timeout: int = 5,
            check: bool = False) -> subprocess.CompletedProcess:
        """Run `command` on `node` with the OpenSSH client (strict host-key checking)."""
        return subprocess.run(
            ["ssh", "-F", str(self.ssh_config), "-o", f"ConnectTimeout={connect_timeout}", node, command],
            capture_output=True, text=True, timeout=timeout, check=check)

    def exec(self, node: str, *argv: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
        """Run argv inside the node's namespaces (no SSH): for assertions about the node."""
        return self._factory.run("exec", node, "--", *argv, timeout=timeout, check=check)

    def freeze(self, node: str, all_processes: bool = False) -> None:
        self._factory.run("freeze", node, *(["--all"] if all_processes else []))

    def thaw(self, node: str) -> None:
        self._factory.run("thaw", node)

    def link(self, node: str, state: str) -> None:
        self._factory.run("link", node, state)

    def kill(self, node: str) -> None:
        self._factory.run("kill", node)

    def firewall(self, node: str, *args: str) -> None:
        """A real nftables rule in the node's namespace: ("drop", "8076", "--from", "node4"), ("clear",)."""
        self._factory.run("firewall", node, *args)

    def status(self) -> dict:
        return json.loads(self._factory.run("status", "--json", check=False).stdout)

    def console_tail(self, node: str, lines: int = 40) -> str:
        """The last lines of the node's console.log (its sshd's log, LogLevel VERBOSE): for the
        message of an assertion about the node's SSH."""
        try:
            text = (self.dir / "nodes" / node / "console.log").read_text(errors="replace")
        except OSError as exc:
            return f"(no console.log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


class SimClusterFactory:
    """Brings the simulated cluster to a given size and profiles; tears it down at session end."""

    def __init__(self):
        self.used = False
        self.last_up_output = ""

    def run(self, *args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, str(SIMCLUSTER), *args], capture_output=True, text=True,
                           timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"simcluster {' '.join(args)} failed (exit {p.returncode}):\n"
                                 f"{p.stdout}{p.stderr}")
        return p

    def __call__(self, n: int = 3, profiles: dict[str, str] | None = None,
                 users: bool = False) -> SimCluster:
        """`users`: also the sudo test users fixer (NOPASSWD) and asker (sudo asks)."""
        self.used = True
        # --fresh: a node that an earlier test's commands changed (cluster fix) starts again
        # from its profile's state, as every test expects.
        args = ["up", str(n), "--fresh"] + (["--users"] if users else [])
        for node, profile in sorted((profiles or {}).items()):
            args += ["--profile", f"{node}={profile}"]
        self.last_up_output = self.run(*args).stdout
        return SimCluster(self, json.loads(self.run("status", "--json").stdout))

    def down(self) -> str:
        return self.run("down").stdout


@pytest.fixture(scope="session")
def simcluster_factory():
    reason = simcluster_unavailable()
    if reason:
        pytest.skip(reason)
    factory = SimClusterFactory()
    yield factory
    if factory.used and os.environ.get("SIMCLUSTER_KEEP") != "1":
        factory.down()


@pytest.fixture
def simcluster(simcluster_factory) -> SimCluster:
    """A 3-node cluster of the default profile, reused across tests (reset to that state)."""
    return simcluster_factory(3)
