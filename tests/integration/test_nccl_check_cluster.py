"""`cluster nccl-check` on a real 3-node Ray cluster on the simulated nodes (CPU only: gloo).

Nodes: node1 (head), node2, node3, all with the `cpu` profile (no nvidia-smi: Ray registers no
GPU), so NCCL can only be shown to refuse clearly; its verdict logic is tests/test_nccl_check.py.
The simcluster inventory is extended with what small simulated nodes need (docs/ray.md:
num_cpus, memory, object_store_memory). Heavy: ~2.5 GB while Ray runs, a few minutes on 2 cores.

Acceptance (issue 5, item 3): gloo runs one rank per node and reports the bandwidth; with
node3's link cut it fails naming node3, within the timeout. Always leaves the nodes without Ray.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest

from integration_kit import ClusterCli, derive_inventory, ray_up

pytestmark = [pytest.mark.integration, pytest.mark.ray]

PROFILES = {"node1": "cpu", "node2": "cpu", "node3": "cpu"}
CUT_TIMEOUT_S = 90


cli = ClusterCli(timeout=600)
cli_json = cli.json


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    return simcluster_factory(3, PROFILES)


@pytest.fixture(scope="module")
def inv(sim, tmp_path_factory) -> Path:
    """The simcluster inventory + small-node Ray settings, with Ray started on it."""
    path = derive_inventory(sim, tmp_path_factory.mktemp("nccl-check-inv"), health_job=False)
    with ray_up(cli, path, timeout=600):
        try:
            yield path
        finally:
            sim.link("node3", "up")          # a failed test must not leave node3 cut off


def job_on_dashboard(inventory: Path, job_id: str) -> dict:
    """The job as the head's dashboard lists it (GET /api/jobs/<id>, with the Ray token)."""
    from cluster.nodes import inventory as inventory_mod
    from cluster.nodes.remote import Session

    inv = inventory_mod.load(str(inventory))
    script = ("import json, os, urllib.request\n"
              "p = os.path.expanduser('~/.ray/auth_token')\n"
              "h = {'Authorization': 'Bearer ' + open(p).read().strip()} if os.path.isfile(p) else {}\n"
              f"r = urllib.request.urlopen(urllib.request.Request("
              f"'http://127.0.0.1:{inv.ray.dashboard_port}/api/jobs/{job_id}', headers=h), timeout=20)\n"
              "print('JOB ' + r.read().decode())\n")
    with Session(inv) as session:
        r = session.run(inv.head, shlex.join([inv.ray.python, "-c", script]), timeout=60)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("JOB ")), None)
    assert line, f"{r.status} {r.exit_code}\n{r.stdout}\n{r.stderr}"
    return json.loads(line[4:])


def test_gloo_runs_one_rank_per_node_and_reports_the_bandwidth(sim, inv):
    code, out = cli_json(inv, "nccl-check", "--backend", "gloo", "--size-mb", "16",
                         "--iters", "5", "--timeout", "180", timeout=400)
    assert code == 0, out["verdict"] + "\n" + "\n".join(out["problems"])
    assert out["status"] == "ok" and out["backend"] == "gloo" and out["transport"] == "TCP"
    assert out["ranks"] == 3 and out["nodes"] == ["node1", "node2", "node3"]
    ranks = out["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert [r["hostname"] for r in ranks] == ["node1", "node2", "node3"]   # one rank per node
    assert [r["ip"] for r in ranks] == [sim.node(n).ip for n in ("node1", "node2", "node3")]
    assert all(r["busbw_gbps"] > 0 and r["error"] is None for r in ranks)
    assert out["busbw_gbps"] > 0 and out["algbw_gbps"] > 0
    # both are rounded to 3 decimals (a few 0.01 GB/s under the suite's load: 0.054 vs 0.040)
    assert out["busbw_gbps"] == pytest.approx(out["algbw_gbps"] * 4 / 3, rel=0.01,
                                              abs=0.0005 + 0.0005 * 4 / 3)
    assert out["job_status"] == "SUCCEEDED" and out["job_id"].startswith("nccl-check-gloo-")
    run_dir = Path(out["run_dir"])
    assert json.loads((run_dir / "nccl-check.json").read_text())["busbw_gbps"] == out["busbw_gbps"]
    # the job's log says how it ended in one sentence for people (its result file is the answer)
    assert "all-reduce (gloo) ok over " in (run_dir / "job.log").read_text()
    # It ran as a Ray job: the head's dashboard knows it.
    job = job_on_dashboard(inv, out["job_id"])
    assert job["status"] == "SUCCEEDED" and job["metadata"]["cluster-toolkit"] == "nccl-check"
    # Nothing left behind on the head (the snippet's temporary directory is gone).
    left = sim.exec("node1", "sh", "-c", "ls -d /tmp/cluster-nccl-check-* 2>/dev/null || true")
    assert left.stdout.strip() == ""


def test_nccl_on_a_cpu_cluster_refuses_clearly(inv):
    code, out = cli_json(inv, "nccl-check", "--timeout", "120", timeout=300)
    assert code == 2 and out["status"] == "fail"
    assert "no node registered a GPU" in out["verdict"] and "gloo" in out["verdict"]


def test_a_node_with_its_link_cut_fails_the_check_by_name_within_the_timeout(sim, inv):
    sim.link("node3", "down")
    try:
        start = time.monotonic()
        code, out = cli_json(inv, "nccl-check", "--backend", "gloo", "--timeout",
                             str(CUT_TIMEOUT_S), timeout=CUT_TIMEOUT_S + 120)
        elapsed = time.monotonic() - start
    finally:
        sim.link("node3", "up")
    assert code == 2 and out["status"] == "fail", out["verdict"]
    assert out["failed_nodes"] == ["node3"], out["problems"]
    assert out["verdict"].startswith("FAIL (node3): node3")
    assert elapsed < CUT_TIMEOUT_S + 15, elapsed   # SSH connect and Python start on top of it
