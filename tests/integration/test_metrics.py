"""`ray.metrics: prometheus` end to end: real Ray 2.60 on two simulated CPU nodes, the head's
own Prometheus (Debian's package), the tiny vLLM app, Prometheus's HTTP API read from the test
through the library's SSH route to the head's loopback (cluster/nodes/head_tunnel.py).

Covers: `up` starts Prometheus (changed) with RAY_PROMETHEUS_HOST in the head's Ray env, a
second `up` changes nothing (Prometheus kept, same pid, no drift warning); Ray's Grafana
dashboards (Serve and LLM included) are written to the run directory; Prometheus has Ray's
node metrics for every node (ray_node_cpu_utilization by each node's IP) and the replica's
vLLM engine metrics through Ray (running/waiting requests, KV-cache use) tagged with the
app; the app's own /metrics keeps working (`cluster status` reads it); `status --json`
reports dashboard.metrics; `down` stops Prometheus.

Heavy: ~4.5 GB of memory and 5-10 minutes on a 2-core machine. Run your own instance with
SIMCLUSTER_PREFIX=metrics SIMCLUSTER_SUBNET=44 SIMCLUSTER_DIR=/tmp/simcluster-metrics.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.vllm]

from integration_kit import (PROMETHEUS_PORT as PORT, PYTHON, REPO, ClusterCli,  # noqa: E402
                             node_tiny_model, wait_for_series)

cli = ClusterCli(timeout=1200)
cli_json = cli.json

APP = "tinym"
SERVED = "tiny-metrics"
PROFILES = {"node1": "cpu", "node2": "cpu"}


@pytest.fixture(scope="module")
def model(tiny_model_builder) -> Path:
    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus binary (scripts/bootstrap installs Debian's package)")
    return node_tiny_model(tiny_model_builder, "dense", needs=("vllm", "openai"))


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    return simcluster_factory(2, PROFILES)


@pytest.fixture(scope="module")
def inv(sim, model, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("metrics-inv")
    doc = yaml.safe_load(sim.inventory_path.read_text())
    doc["ray"] = {"num_cpus": 2, "memory": 4 * 1024 ** 3,
                  "object_store_memory": 256 * 1024 ** 2, "python": PYTHON,
                  "metrics": "prometheus", "prometheus_port": PORT}
    doc["run_dir"] = str(base / "runs")
    for node in doc["nodes"]:
        node["env"] = {"PYTHONPATH": str(REPO)}   # the replicas import this tree's serve_apps
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    cli(path, "down", "--yes", timeout=300)
    yield path
    cli(path, "down", "--yes", timeout=300)


@pytest.fixture(scope="module")
def first_up(inv) -> dict:
    code, out = cli_json(inv, "up", "--skip-preflight", "--yes", timeout=900)
    assert code == 0, json.dumps(out, indent=1)[-4000:]
    return out


def test_up_starts_prometheus_with_ray_pointed_at_it(first_up, inv):
    step = first_up["prometheus"]
    assert step["status"] == "changed", step
    assert f"127.0.0.1:{PORT}" in step["message"]
    head = first_up["plan"]["actions"][0]
    assert f"RAY_PROMETHEUS_HOST=http://127.0.0.1:{PORT}" in head["commands"][-1]
    grafana = first_up["grafana"]
    assert grafana["error"] is None
    files = set(grafana["files"])
    assert {"serve_grafana_dashboard.json", "serve_llm_grafana_dashboard.json",
            "default_grafana_dashboard.json"} <= files, files
    for name in files:
        json.loads((Path(grafana["dir"]) / name).read_text())


def test_second_up_keeps_prometheus_and_sees_no_drift(first_up, inv):
    code, out = cli_json(inv, "up", "--skip-preflight", "--yes", timeout=900)
    assert code == 0, json.dumps(out, indent=1)[-4000:]
    assert out["changed"] is False and out["plan"]["warnings"] == []
    assert out["prometheus"]["status"] == "ok", out["prometheus"]
    pid = first_up["prometheus"]["message"].split("pid ")[-1].split(",")[0]
    assert f"pid {pid})" in out["prometheus"]["message"]


def test_prometheus_has_every_nodes_ray_metrics(first_up, inv, sim):
    ips = {n.ip for n in sim.nodes}
    series = wait_for_series(inv, "ray_node_cpu_utilization",
                             lambda s: ips <= {x["metric"].get("instance", "").split(":")[0]
                                               for x in s})
    seen = {x["metric"].get("instance", "").split(":")[0] for x in series}
    assert ips <= seen, (ips, series[:4])


@pytest.fixture(scope="module")
def deployed(first_up, inv, model) -> dict:
    code, out = cli_json(inv, "deploy", "--model", str(model), "--name", APP,
                         "--served-model-name", SERVED, "--max-model-len", "512",
                         "--engine-arg", "enforce_eager=true", "--no-api-key", "--yes",
                         "--timeout", "900")
    assert code == 0, json.dumps(out, indent=1)[-4000:]
    return out


def test_replica_engine_metrics_reach_prometheus_tagged_with_the_app(deployed, inv):
    import openai

    client = openai.OpenAI(base_url=deployed["endpoint"], api_key="none", timeout=180,
                           max_retries=0)
    client.completions.create(model=SERVED, prompt="hello", max_tokens=4)
    for name in ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
                 "ray_vllm_kv_cache_usage_perc"):
        series = wait_for_series(inv, f'{name}{{application="{APP}"}}', bool)
        assert series, name
        labels = series[0]["metric"]
        assert labels["application"] == APP and labels["model_name"] == SERVED
        assert labels.get("ReplicaId") and labels.get("deployment"), labels


def test_status_reports_metrics_and_reads_the_apps_own_metrics(deployed, inv):
    code, out = cli_json(inv, "status", "--window", "0")
    assert code in (0, 1), out
    assert out["dashboard"]["metrics"] == {"prometheus_url": f"http://127.0.0.1:{PORT}",
                                           "grafana_url": None}
    serving = out["serve"]["applications"][APP]["serving"]
    assert serving is not None and serving["status"] != "error", serving
    assert serving["running"] is not None


def test_down_stops_prometheus(deployed, inv, sim):
    code, out = cli_json(inv, "down", "--yes", timeout=300)
    assert code == 0, json.dumps(out, indent=1)[-4000:]
    assert out["prometheus"]["status"] == "changed", out["prometheus"]
    left = sim.exec("node1", "ps", "-eo", "comm=", check=True).stdout.split()
    assert "prometheus" not in left
    code, again = cli_json(inv, "down", "--yes", timeout=300)
    assert code == 0 and again["prometheus"]["status"] == "ok"
