"""Prometheus on the head (inventory `ray.metrics: prometheus`), the pure parts: the commands
of the on-node program, the probe's answer read, and the plan (keep / start / restart /
refuse). The probe -> plan -> execute -> verify step `cluster up` / `cluster down` run is
playbooks/prometheus_head.py's (the head's `ray start` env that points Ray's dashboard at it
is in cluster/nodes/ray_env.py).

The head runs its own `prometheus` binary (Debian's package), detached, bound to its loopback
(127.0.0.1:<ray.prometheus_port>), with the config Ray's dashboard generates for the latest
session (<temp dir>/session_latest/metrics/prometheus/prometheus.yml, which reads the
service-discovery file Ray keeps of every node's metrics agent), storage and log under
<temp dir>/cluster-prometheus/. The on-node side is cluster/node_programs/prometheus.py, run
and read through the one runner (cluster/node_programs/__init__.py).

Idempotent: Prometheus already running with this session's config, on this port, answering
/-/ready, is kept. `down` stops it by its pid file, only when that pid is our prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from cluster.nodes import endpoints
from cluster.nodes.inventory import Inventory
from cluster.base.errors import ProgramError
from cluster.node_programs import Call, program_call, read_document
from cluster.nodes.remote import CommandResult

ACTION = "prometheus"
RETENTION = "2d"                 # a short retention: the head's disk is not a metrics store
CONFIG_WAIT_S = 60.0             # Ray's dashboard writes the config shortly after `ray start`
READY_WAIT_S = 60.0
DASHBOARDS_WAIT_S = 10.0         # the dashboard rewrites its Grafana files when it (re)starts
PROBE_TIMEOUT_S = CONFIG_WAIT_S + 30
START_TIMEOUT_S = READY_WAIT_S + 30
STOP_TIMEOUT_S = 40.0
PROGRAM = "prometheus"           # cluster/node_programs/prometheus.py, run on the head

KEEP, START, RESTART, REFUSE = "keep", "start", "restart", "refuse"


def enabled(inventory: Inventory) -> bool:
    return inventory.ray.metrics == "prometheus"


def prometheus_url(inventory: Inventory) -> str | None:
    """Prometheus's URL on the head (its loopback), or None when metrics are off."""
    return endpoints.prometheus_url(inventory.ray)


def metrics_doc(inventory: Inventory) -> dict[str, Any]:
    """`cluster status --json`'s dashboard.metrics."""
    return {"prometheus_url": prometheus_url(inventory), "grafana_url": inventory.ray.grafana_url}


def program(inventory: Inventory, verb: str, *args: str) -> Call:
    """`<ray.python> - VERB --root R ARGS` with the program on stdin."""
    return program_call(inventory.ray.python, PROGRAM, [verb, "--root", endpoints.ray_temp_dir(inventory),
                                                        *args])


def probe_call(inventory: Inventory, wait_s: float = CONFIG_WAIT_S) -> Call:
    return program(inventory, "probe", "--port", str(inventory.ray.prometheus_port),
                   "--wait", f"{wait_s:g}")


def start_call(inventory: Inventory, binary: str, config: str) -> Call:
    return program(inventory, "start", "--port", str(inventory.ray.prometheus_port),
                   "--binary", binary, "--config", config, "--retention", RETENTION,
                   "--wait", f"{READY_WAIT_S:g}")


def stop_call(inventory: Inventory) -> Call:
    return program(inventory, "stop")


def dashboards_call(inventory: Inventory) -> Call:
    return program(inventory, "dashboards", "--wait", f"{DASHBOARDS_WAIT_S:g}")


# ---------------------------------------------------------------- probe result and plan (pure)


@dataclass(frozen=True)
class Running:
    pid: int
    config: str | None
    listen: str | None
    ready: bool


@dataclass(frozen=True)
class Probe:
    """What the head has: the binary, Ray's config for this session, our Prometheus."""

    binary: str | None
    config: str | None
    running: Running | None


@dataclass(frozen=True)
class PromPlan:
    kind: str                        # keep | start | restart | refuse
    reason: str
    calls: tuple[Call, ...] = ()

    @property
    def commands(self) -> tuple[str, ...]:
        return tuple(c.command for c in self.calls)


def parse_doc(result: CommandResult) -> dict | None:
    """The program's JSON document (the one reader), None when it gave none."""
    try:
        return read_document(result, PROGRAM)
    except ProgramError:
        return None


def parse_probe(doc: Mapping[str, Any]) -> Probe:
    run = doc.get("running")
    running = None
    if isinstance(run, dict) and isinstance(run.get("pid"), int):
        running = Running(run["pid"], _text(run.get("config")), _text(run.get("listen")),
                          run.get("ready") is True)
    return Probe(_text(doc.get("binary")), _text(doc.get("config")), running)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def plan(inventory: Inventory, probe: Probe) -> PromPlan:
    """Keep a ready Prometheus with this session's config on our port; else (re)start it."""
    listen = f"127.0.0.1:{inventory.ray.prometheus_port}"
    if probe.binary is None:
        return PromPlan(REFUSE, "no prometheus binary on the head's PATH (Debian/Ubuntu: "
                                "apt-get install prometheus)")
    if probe.config is None:
        return PromPlan(REFUSE, "Ray wrote no Prometheus config under "
                                f"{endpoints.session_dir(inventory)}/metrics/prometheus/ "
                                "(is the head's dashboard running?)")
    start = start_call(inventory, probe.binary, probe.config)
    run = probe.running
    if run is None:
        return PromPlan(START, f"start Prometheus on {listen}", (start,))
    if run.config == probe.config and run.listen == listen and run.ready:
        return PromPlan(KEEP, f"Prometheus running (pid {run.pid}) on {listen} with this "
                              "session's config")
    why = ("not answering /-/ready" if run.config == probe.config and run.listen == listen
           else f"running with {run.config} on {run.listen}")
    return PromPlan(RESTART, f"Prometheus (pid {run.pid}) {why}: restart it on {listen}",
                    (stop_call(inventory), start))
