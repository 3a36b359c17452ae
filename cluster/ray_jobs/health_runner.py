"""Runs ON the cluster as the health job's entrypoint (`python -m cluster.ray_jobs.health_runner
CONFIG_JSON`), with this package shipped as the job's runtime_env `py_modules`: nothing of the
toolkit needs to be installed on a node (see cluster/ray/health_job.py for the laptop side).

Every period the driver (on the head) lists the alive Ray nodes, keeps one reader actor on each
(NodeAffinitySchedulingStrategy, no CPU), asks each for a reading and then:
  - sets the gauges `cluster_health_status` / `cluster_health_value` (ray.util.metrics, tags
    node and check) for every reading;
  - replaces `<temp dir>/session_<current>/cluster-health.json` atomically (the latest readings).
A reader runs the preflight probes of HEALTH_CHECKS on its node (cluster.inspection.probes, LocalRunner)
and judges them with the preflight verdicts (cluster.inspection.preflight.evaluate_node). A node that
leaves Ray turns unknown and its reader is dropped; one that joins (or rejoins under a new node
id) gets a new reader; a reader that dies or does not answer within READ_TIMEOUT_S is replaced.
One node's error never ends the job; it ends when the cluster is gone (Ray's job supervisor
also kills it when Ray stops).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Mapping

from cluster.ray.health_job import (GAUGE_STATUS, GAUGE_TAGS, GAUGE_VALUE, HEALTH_CHECKS, JobConfig,
                                Reading, gauge_points, readings_document, readings_from_results,
                                unknown_readings, READINGS_FILE)
from cluster.ray_jobs.health_remedy import Remedy, actions_path, write_atomic

log = logging.getLogger("cluster.ray.health_job")
READ_TIMEOUT_S = 90.0          # a reader's probes are bounded by 20 s each (preflight)
PROBE_TIMEOUT_S = 20.0
GCS_FAILURES_TO_EXIT = 10      # consecutive failed node listings: the cluster is gone
HOST_RESOURCE = "host:"


def read_node(config: JobConfig, name: str) -> list[Reading]:
    """One reading per health check on this machine (runs in the reader actor)."""
    from cluster.inspection.checks.node import NODE_CHECKS
    from cluster.base.errors import CommandTimeout
    from cluster.inspection.facts import node_facts, probes_for
    from cluster.inspection.preflight import check_probes, evaluate_node
    from cluster.inspection.probes import probe_script
    from cluster.nodes.remote import LocalRunner

    inventory, node = config.inventory(), config.node(name)
    checks = [c for c in NODE_CHECKS if c.id in HEALTH_CHECKS]
    # the health checks' own probes only (no node-facts program: none of them reads it)
    probes = probes_for(node, inventory, check_probes(checks))
    now = time.time()
    try:
        result = LocalRunner().run(node, probe_script(probes, PROBE_TIMEOUT_S),
                                   timeout=READ_TIMEOUT_S - 10)
    except CommandTimeout:
        return list(unknown_readings(name, "the probes did not finish in time", now))
    results, facts = evaluate_node(node, inventory, checks, node_facts(node, result, probes))
    return list(readings_from_results(name, results, facts, now, config.expectations,
                                      config.act.ecc_xids))


def node_name(node: Mapping[str, Any], config: JobConfig) -> str:
    """The inventory name of a Ray node: its `host:<name>` resource, else its IP's node."""
    for key in (node.get("Resources") or {}):
        if key.startswith(HOST_RESOURCE):
            return key[len(HOST_RESOURCE):]
    ip = node.get("NodeManagerAddress")
    for name, n in config.nodes.items():
        if n.get("ip") == ip:
            return name
    return str(ip)


class Driver:
    """The job's loop state: readers per node id, pending reads, the latest readings."""

    def __init__(self, ray: Any, config: JobConfig, path: str, submission_id: str | None):
        from ray.util.metrics import Gauge

        self.ray, self.config, self.path, self.sid = ray, config, path, submission_id
        self.readers: dict[str, tuple[str, Any]] = {}          # node id -> (name, actor)
        self.pending: dict[str, tuple[Any, float]] = {}        # node id -> (ref, since)
        self.latest: dict[str, dict[str, Reading]] = {}
        self.this_round: dict[str, list[Reading]] = {}         # the period's readings (act)
        self.gauges = {GAUGE_STATUS: Gauge(GAUGE_STATUS, "health check status per node: 0 ok, "
                                           "1 warn, 2 fail, 3 unknown", tag_keys=GAUGE_TAGS),
                       GAUGE_VALUE: Gauge(GAUGE_VALUE, "health check value per node (GPUs, clock "
                                          "offset s, IB ports Active, peer memory, GPU problems)",
                                          tag_keys=GAUGE_TAGS)}
        self.reader_class = ray.remote(num_cpus=0, max_restarts=0)(HealthReader)

    def place(self, alive: Mapping[str, str]) -> None:
        """Readers for new nodes, none for those gone (their readings turn unknown)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        now = time.time()
        for node_id in list(self.readers):
            if node_id not in alive:
                name, actor = self.readers.pop(node_id)
                self.pending.pop(node_id, None)
                self._kill(actor)
                if name not in alive.values():
                    self.record(unknown_readings(name, "the node is not alive in Ray", now))
        for node_id, name in alive.items():
            if node_id not in self.readers:
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                actor = self.reader_class.options(scheduling_strategy=strategy).remote(
                    self.config.to_dict(), name)
                self.readers[node_id] = (name, actor)

    def round(self, wait_s: float) -> None:
        """Ask every reader without a read in flight, collect what answers within wait_s."""
        now = time.time()
        for node_id, (name, actor) in self.readers.items():
            if node_id not in self.pending:
                self.pending[node_id] = (actor.read.remote(), now)
        refs = {ref: node_id for node_id, (ref, _) in self.pending.items()}
        if refs:
            ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
            for ref in ready:
                self.collect(refs[ref], ref)
        for node_id, (ref, since) in list(self.pending.items()):
            if time.time() - since > READ_TIMEOUT_S:
                self.replace(node_id, f"the reader did not answer within {READ_TIMEOUT_S:g} s")

    def collect(self, node_id: str, ref: Any) -> None:
        self.pending.pop(node_id, None)
        name = self.readers[node_id][0]
        try:
            self.record(self.ray.get(ref))
        except Exception as exc:  # the reader died or raised: a new one next round
            self.replace(node_id, f"the reader failed: {type(exc).__name__}: "
                                  f"{str(exc).strip()[:200]}", name)

    def replace(self, node_id: str, why: str, name: str | None = None) -> None:
        name_actor = self.readers.pop(node_id, None)
        self.pending.pop(node_id, None)
        if name_actor is not None:
            self._kill(name_actor[1])
            name = name_actor[0]
        if name is not None:
            self.record(unknown_readings(name, why, time.time()))

    def _kill(self, actor: Any) -> None:
        try:
            self.ray.kill(actor)
        except Exception:
            pass

    def record(self, readings) -> None:
        for r in readings:
            self.latest.setdefault(r.node, {})[r.check] = r
            self.this_round.setdefault(r.node, []).append(r)
        for gauge, value, tags in gauge_points(readings):
            self.gauges[gauge].set(value, tags=tags)

    def take_round(self) -> dict[str, list[Reading]]:
        """The readings recorded since the last call (one period's), for health.act."""
        out, self.this_round = self.this_round, {}
        return out

    def write(self) -> None:
        # Ray makes its session folder writable by every local user: never open a name someone
        # may have planted there (a link), only a file this call creates
        write_atomic(self.path, readings_document(self.latest, {"period_s": self.config.period_s,
                                                                "submission_id": self.sid},
                                                  time.time()))


class HealthReader:
    """The actor on one node (made remote by Driver): reads that node's health checks."""

    def __init__(self, config: Mapping[str, Any], name: str):
        self.config, self.name = JobConfig.from_dict(config), name

    def read(self) -> list[Reading]:
        return read_node(self.config, self.name)


def alive_nodes(ray: Any, config: JobConfig) -> dict[str, str]:
    return {n["NodeID"]: node_name(n, config) for n in ray.nodes() if n.get("Alive")}


def node_resources(ray: Any, config: JobConfig) -> dict[str, dict[str, float]]:
    """The alive Ray nodes' total resources by inventory name (the capacity guard's input)."""
    return {node_name(n, config): {str(k): float(v) for k, v in (n.get("Resources") or {}).items()}
            for n in ray.nodes() if n.get("Alive")}


def session_path(temp_dir: str) -> str:
    """The readings file in the current Ray session's directory (resolved once, at start)."""
    return os.path.join(os.path.realpath(os.path.join(temp_dir, "session_latest")), READINGS_FILE)


def submission_id() -> str | None:
    """This job's submission id, from the job config Ray's supervisor hands the entrypoint."""
    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("metadata")
        return str(meta["job_submission_id"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = JobConfig.from_dict(json.loads(argv[1]))
    import ray

    ray.init(address="auto", logging_level=logging.WARNING, log_to_driver=False)
    sid = submission_id()
    driver = Driver(ray, config, session_path(config.temp_dir), sid)
    remedy = Remedy(ray, config, actions_path(driver.path))
    log.info("health job: every %g s, readings in %s, actions in %s (health.act: %s)",
             config.period_s, driver.path, remedy.path,
             ", ".join(f"{c} {a}" for c, a in config.act.actions.items()))
    failures = 0
    alive: dict[str, str] = {}
    while True:
        started = time.monotonic()
        try:
            alive = alive_nodes(ray, config)
            driver.place(alive)
            failures = 0
        except Exception as exc:  # the GCS did not answer this time
            failures += 1
            log.warning("listing Ray's nodes failed (%d): %s", failures, exc)
            if failures >= GCS_FAILURES_TO_EXIT:
                return 1
        try:
            driver.round(wait_s=min(config.period_s, READ_TIMEOUT_S))
            driver.write()
        except Exception as exc:  # never end on one round's error
            log.warning("health round failed: %s: %s", type(exc).__name__, exc)
        try:
            remedy.after_round(driver.take_round(), alive, node_resources(ray, config))
        except Exception as exc:  # nor on one act's error
            log.warning("health act failed: %s: %s", type(exc).__name__, exc)
        time.sleep(max(0.0, config.period_s - (time.monotonic() - started)))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
