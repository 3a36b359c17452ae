"""The health job on real Ray, two simulated h100-ib nodes, `health.period_s: 5`: after `up`,
`status --json` shows every check of both nodes; a second `up` keeps the job; node2's clock
switched in place to the h100-clock-off capture (7.8 s fast) turns its clock check fail with
that offset within two periods; the gauges are on the head's metrics endpoint for both nodes
and, where a `prometheus` binary is installed (`ray.metrics: prometheus`), in the head's
Prometheus; `down` leaves no job process. Heavy: ~2 GB of memory and a few minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import shlex
import shutil
import time
from pathlib import Path

import pytest
import yaml

from cluster.ray.health_job import HEALTH_CHECKS

pytestmark = [pytest.mark.integration, pytest.mark.ray]

from integration_kit import PROMETHEUS_PORT, PYTHON, ClusterCli, wait_for_series  # noqa: E402

cli = ClusterCli(timeout=1200)
cli_json = cli.json

PERIOD_S = 5.0
PROMETHEUS = shutil.which("prometheus") is not None    # ray.metrics: prometheus when it can run
NODES = ("node1", "node2")
OFFSET_S = 7.800260112          # h100-clock-off's `chronyc tracking`: System time 7.800260112 s fast
METRICS_SNIPPET = r'''
import sys, urllib.request
print(urllib.request.urlopen("http://%s:%s/metrics" % (sys.argv[1], sys.argv[2]), timeout=10)
      .read().decode("utf-8", "replace"))
'''


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    return simcluster_factory(2, {"node1": "h100-ib", "node2": "h100-ib"})


@pytest.fixture(scope="module")
def inv(sim, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("health-inv")
    doc = yaml.safe_load(sim.inventory_path.read_text())
    doc["ray"] = {"num_cpus": 2, "memory": 2 * 1024 ** 3, "object_store_memory": 256 * 1024 ** 2,
                  "python": PYTHON}
    if PROMETHEUS:
        doc["ray"].update(metrics="prometheus", prometheus_port=PROMETHEUS_PORT)
    doc["health"] = {"period_s": PERIOD_S}
    doc["run_dir"] = str(base / "runs")
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    yield path
    cli(path, "down", "--yes", timeout=300)
    sim._factory.run("state", "node2", "clock", "synced", check=False)


def wait_for_health(inv: Path, done, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        _, last = cli_json(inv, "status", "--window", "0")
        if done(last.get("health") or {}):
            return last
        time.sleep(1)
    raise AssertionError(f"health never got there: {json.dumps(last, indent=1)[-4000:]}")


def gauges_on_head(sim, inv_path: Path) -> str:
    doc = yaml.safe_load(inv_path.read_text())
    head = next(n for n in doc["nodes"] if n.get("role") == "head")
    port = doc["ray"].get("metrics_export_port", 8080)
    p = sim.ssh("node1", shlex.join([PYTHON, "-c", METRICS_SNIPPET, head["node_ip"], str(port)]))
    return p.stdout


def _all_checks(health: dict) -> bool:
    return all(set(health.get(n, {})) == set(HEALTH_CHECKS) for n in NODES)


def test_health_job_reads_every_node_and_follows_a_drifting_clock(sim, inv):
    code, up = cli_json(inv, "up", "--skip-preflight", "--yes")
    assert code == 0, json.dumps(up, indent=1)[-3000:]
    job = up["health_job"]
    assert job["status"] in ("changed", "ok") and job["submission_id"], job

    doc = wait_for_health(inv, _all_checks, timeout=180)
    health = doc["health"]
    for node in NODES:
        assert health[node]["gpus"]["status"] == "ok" and health[node]["gpus"]["value"] == 8
        assert health[node]["infiniband"] == {**health[node]["infiniband"], "status": "ok", "value": 8}
        assert health[node]["clock"]["status"] == "ok"
        assert abs(health[node]["clock"]["value"]) < 0.001
        assert all(0 <= c["age_s"] < 120 for c in health[node].values())

    code, again = cli_json(inv, "up", "--skip-preflight", "--yes")
    assert code == 0 and again["health_job"]["status"] == "ok", again["health_job"]
    assert again["health_job"]["submission_id"] == job["submission_id"]

    human = cli(inv, "status", "--window", "0")
    assert "Node health" in human.stdout and "clock" in human.stdout and "s ago" in human.stdout

    sim._factory.run("state", "node2", "clock", "offset")
    switched = time.time()
    doc = wait_for_health(inv, lambda h: h.get("node2", {}).get("clock", {}).get("status") == "fail",
                          timeout=120)
    clock = doc["health"]["node2"]["clock"]
    assert clock["value"] == pytest.approx(OFFSET_S, rel=1e-6)
    read_at = time.time() - clock["age_s"]
    # within two periods of the switch (+ the time one reading takes on this loaded machine)
    assert read_at - switched <= 2 * PERIOD_S + 15, (read_at - switched, clock)
    assert doc["health"]["node1"]["clock"]["status"] == "ok"

    deadline = time.monotonic() + 90
    while True:
        text = gauges_on_head(sim, inv)
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_cluster_health_status{")]
        seen = {(n, c) for ln in lines for n in NODES for c in HEALTH_CHECKS
                if f'node="{n}"' in ln and f'check="{c}"' in ln}
        fail_line = [ln for ln in lines if 'node="node2"' in ln and 'check="clock"' in ln]
        if len(seen) == 2 * len(HEALTH_CHECKS) and fail_line and fail_line[0].endswith(" 2.0"):
            break
        assert time.monotonic() < deadline, "\n".join(lines) or text[-2000:]
        time.sleep(3)

    if PROMETHEUS:   # the same series in the head's Prometheus (Ray's scrape of every agent)
        def tagged(series):
            return {(x["metric"].get("node"), x["metric"].get("check")): x["value"][1]
                    for x in series}
        want = {(n, c) for n in NODES for c in HEALTH_CHECKS}
        series = wait_for_series(inv, "ray_cluster_health_status",
                                 lambda s: set(tagged(s)) >= want and
                                 tagged(s).get(("node2", "clock")) == "2")
        assert set(tagged(series)) >= want and tagged(series)[("node2", "clock")] == "2", series

    code, down = cli_json(inv, "down", "--yes", timeout=300)
    assert code == 0, down
    for node in NODES:
        ps = sim.exec(node, "ps", "-eo", "args=", check=True).stdout
        assert "health_job" not in ps and "HealthReader" not in ps, ps
