"""Day two on real Ray (issue 42): three simulated h100-ib nodes, `health.period_s: 5`, the health
job acting on what it reads. node2's GPU report is switched live to real captured output of a
GPU fallen off the bus (`scripts/simcluster state node2 gpu lost`: Xid 79 in dmesg, 7 GPUs in
nvidia-smi). One cluster, reused by the cases in order:

1. `health.act` at report for every class: the Xid changes nothing but the status (a report
   record, node2's readings), no node cordoned, no drain.
2. the default policy (gpu_lost: cordon) with two apps serving the tiny model (vLLM's CPU build,
   `--device cpu`: the nodes' GPUs are only what their tools print): a TP 1 x PP 2 gang across two
   nodes and a TP 1 app with 2 replicas, each under a steady streaming load (the bench client).
   The sick node is the gang's node other than the head (node2 when the gang took it). It is
   cordoned (Ray's drain) within one health period + 30 s of the switch, the record in `status
   --json`'s `health_actions` and the job's log; the gang is rebuilt on the two other nodes, its
   fabric proof (gloo) run there before its engine, and answers; the TP 1 app has 2 running
   replicas again, none on the sick node; failed requests over the whole event: 0 for the TP 1
   app, at most 2 % for the gang's app (the job rolls it: the new gang RUNNING before the old one
   stops); no process of the old gang is left on any node. Then
   `cluster uncordon` refused while the node's preflight fails, accepted with the GPU back, and
   the job lifts the cordon when the node rejoins under a new Ray node id. Then a rolling change
   of the TP 1 app's engine args (max_model_len 256 -> 224): its dry run shows the 2 steps and
   changes nothing; under the same load, each new replica RUNNING before an old one stops, 0
   failed requests, the new max_model_len served after (scripts/bench_roll.py measures the
   same change against a plain redeploy).

Printed figures: seconds from the switch to the cordon record, the move time, requests and
failures per app, the rebuilt gang's nodes. Engines: max_model_len 256, a 1 GiB KV cache each,
unbound on one OpenMP thread (integration_kit.UNBOUND_ENGINE_ENV says why: bound to core 1, the
rolling change's new replica stayed STARTING for 12 min; the gang's surge bound to core 0 ran past
a 900 s move wait). Ray
registers 4 CPUs per node so the old gang, the new one and both TP 1 replicas fit on the two
healthy nodes while the gang is replaced.
Heavy: ~6 vLLM starts on a 2-core machine (the gang compiles: PP needs compile mode), ~8 GB.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.alone]

from integration_kit import (PYTHON, REPO, ClusterCli, StreamingLoad,  # noqa: E402
                             UNBOUND_ENGINE_ENV, head_driver, node_tiny_model, process_tree,
                             served_max_model_len)

cli = ClusterCli(timeout=1200)
cli_json = cli.json

PERIOD_S = 5.0
NODES = ("node1", "node2", "node3")
KEY = "sk-day-two-3f8a61c2e7"      # a test-only key, set in the nodes' env at `ray start`
GANG, SMALL = "day2-gang", "day2-small"
REPORT_ALL = {c: "report" for c in ("gpu_lost", "ecc_uncorrectable", "gpu_missing",
                                    "ib_port_down", "clock_offset", "missed_periods")}


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    sim = simcluster_factory(3, {n: "h100-ib" for n in NODES})
    yield sim
    for node in NODES:
        sim._factory.run("state", node, "gpu", "ok", check=False)


@pytest.fixture(scope="module")
def base(sim, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("day-two")
    yield base
    path = base / "cluster.yaml"
    if path.exists():
        cli(path, "down", "--yes", timeout=300)


@pytest.fixture(scope="module")
def model(tiny_model_builder) -> Path:
    return node_tiny_model(tiny_model_builder, "dense", needs=("vllm", "openai"))


def write_inventory(sim, base: Path, act: dict | None) -> Path:
    doc = yaml.safe_load(sim.inventory_path.read_text())
    doc["ray"] = {"num_cpus": 4, "memory": 4 * 1024 ** 3, "object_store_memory": 256 * 1024 ** 2,
                  "python": PYTHON}
    for node in doc["nodes"]:
        # the replicas and the health job import this tree's serve_apps and cluster
        node.setdefault("env", {}).update(CLUSTER_API_KEY=KEY, PYTHONPATH=str(REPO))
    doc.setdefault("expectations", {})["gpus_per_node"] = 8
    doc["health"] = {"period_s": PERIOD_S, **({"act": act} if act else {})}
    doc["run_dir"] = str(base / "runs")
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def status_until(inv: Path, done, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        _, last = cli_json(inv, "status", "--window", "0")
        if done(last):
            return last
        time.sleep(1)
    raise AssertionError(f"status never got there: {json.dumps(last, indent=1)[-4000:]}")


def records(doc: dict, node: str, action: str) -> list[dict]:
    return [r for r in (doc.get("health_actions") or {}).get("records") or []
            if r["node"] == node and r["action"] == action]


def gpu_lost_seen(doc: dict) -> bool:
    h = (doc.get("health") or {}).get("node2") or {}
    return (h.get("gpu-health") or {}).get("status") == "fail"


def test_report_for_every_class_changes_nothing_but_the_status(sim, base):
    inv = write_inventory(sim, base, REPORT_ALL)
    code, up = cli_json(inv, "up", "--skip-preflight", "--yes")
    assert code == 0, json.dumps(up, indent=1)[-3000:]
    status_until(inv, lambda d: all(n in (d.get("health") or {}) for n in NODES), 180)
    sim._factory.run("state", "node2", "gpu", "lost")
    try:
        # (a switch between two probes of one reading shows in the next one: wait for both)
        doc = status_until(inv, lambda d: records(d, "node2", "report") and
                           d["health"]["node2"]["gpus"]["value"] == 7, 120)
        assert gpu_lost_seen(doc)
        assert {r["finding"] for r in records(doc, "node2", "report")} >= {"gpu_lost"}
        time.sleep(2 * PERIOD_S)       # two more periods: still nothing but the status
        _, doc = cli_json(inv, "status", "--window", "0")
        assert doc["health_actions"]["cordoned"] == {}
        assert not records(doc, "node2", "cordon") and not records(doc, "node2", "held")
        assert all(n["alive"] for n in doc["nodes"])
    finally:
        sim._factory.run("state", "node2", "gpu", "ok")


def deploy(inv: Path, model: Path, name: str, *layout: str, env: tuple[str, ...],
           max_len: int = 256) -> dict:
    """`cluster deploy --json` of the app, asserted RUNNING (with --dry-run in `layout`: exit 0)."""
    start = time.monotonic()
    env_args = [a for e in (*env, "VLLM_CPU_NUM_OF_RESERVED_CPU=0") for a in ("--env", e)]
    code, out = cli_json(inv, "deploy", "--model", str(model), *layout, "--name", name,
                         "--served-model-name", name, "--max-model-len", str(max_len),
                         "--device", "cpu", *env_args, "--yes", "--timeout", "900")
    print(f"\ndeploy {name} {' '.join(layout)}: {time.monotonic() - start:.0f} s")
    assert code == 0, json.dumps(out, indent=1)[-4000:]
    assert "--dry-run" in layout or out["status"] == "RUNNING", json.dumps(out, indent=1)[-4000:]
    return out


def app_of(doc: dict, name: str) -> dict:
    return ((doc.get("serve") or {}).get("applications") or {}).get(name) or {}


def running_replicas(doc: dict, name: str) -> list[dict]:
    return [r for r in app_of(doc, name).get("replicas") or [] if r["state"] == "RUNNING"]


def gang_nodes(replica: dict) -> list[str]:
    return [r["node"] for r in replica["ranks"]]


def gang_processes(sim, replica: dict) -> dict[str, dict[int, str]]:
    """node -> the processes of the gang replica's ranks (the replica, its engine core and
    worker; the rank actor, its `vllm serve --headless` and worker) on that node."""
    return {r["node"]: process_tree(sim, r["node"], {r["pid"]}) for r in replica["ranks"]}


HEAD_STATE = r"""
import json, ray
from ray.job_submission import JobSubmissionClient
ray.init(address="auto", logging_level="ERROR")
jobs = JobSubmissionClient()
health = sorted((j for j in jobs.list_jobs()
                 if (j.submission_id or "").startswith("cluster-health-")),
                key=lambda j: j.start_time or 0)      # the newest job last
log = jobs.get_job_logs(health[-1].submission_id)[-6000:] if health else ""
from ray import serve
status = serve.status()
apps = {n: {"status": str(a.status), "message": a.message[-800:],
            "deployments": {d: {"status": str(x.status), "message": x.message[-800:],
                                "replicas": {str(k): v for k, v in x.replica_states.items()}}
                            for d, x in a.deployments.items()}}
        for n, a in status.applications.items()}
print("RESULT " + json.dumps({"apps": apps, "health_log": log}))
"""


def head_report(inv: Path) -> str:
    """Serve's apps and the health job's log tail, from the head (what a failed move shows)."""
    try:
        doc = head_driver(inv, HEAD_STATE, timeout=120)
    except Exception as exc:          # the report of a failure never hides the failure
        return f"(head state not read: {exc})"
    return json.dumps(doc["apps"], indent=1) + "\n--- health job log ---\n" + doc["health_log"]


def answers(endpoint: str, name: str) -> bool:
    import openai

    try:
        reply = openai.OpenAI(base_url=endpoint, api_key=KEY, timeout=60, max_retries=0) \
            .completions.create(model=name, prompt="a fox and a river", max_tokens=8)
    except openai.APIError:
        return False
    return bool(reply.choices)


def test_a_lost_gpu_cordons_the_node_within_a_period_and_uncordon_brings_it_back(sim, base, model):
    # the default policy (gpu_lost: cordon, gang_rebuild: surge); the move took 442 s on 2 shared
    # cores (2026-12-06): more time than the default 600 s leaves on a loaded machine
    inv = write_inventory(sim, base, {"move_wait_s": 900})
    code, up = cli_json(inv, "up", "--skip-preflight", "--yes")   # a new job with the policy
    assert code == 0 and up["health_job"]["status"] == "changed", up["health_job"]
    status_until(inv, lambda d: all(((d.get("health") or {}).get(n) or {}).get(
        "gpu-health", {}).get("status") == "ok" for n in NODES), 120)

    gang = deploy(inv, model, GANG, "--pp", "2", "--nnodes", "2", env=UNBOUND_ENGINE_ENV)
    small = deploy(inv, model, SMALL, "--dp", "2", "--engine-arg", "enforce_eager=true",
                   env=UNBOUND_ENGINE_ENV)
    _, doc = cli_json(inv, "status", "--window", "0")
    (old_gang,) = running_replicas(doc, GANG)
    sick = "node2" if "node2" in gang_nodes(old_gang) else \
        next(n for n in gang_nodes(old_gang) if n != "node1")
    healthy = sorted(set(NODES) - {sick})
    old = gang_processes(sim, old_gang)
    assert all(old.values()), old
    print(f"gang {GANG} on {gang_nodes(old_gang)}, {SMALL} on "
          f"{[r['node'] for r in running_replicas(doc, SMALL)]}; {sick} turns sick")

    with StreamingLoad(gang["endpoint"], GANG, KEY) as gang_load, \
            StreamingLoad(small["endpoint"], SMALL, KEY) as small_load:
        time.sleep(20)
        sim._factory.run("state", sick, "gpu", "lost")
        switched = time.time()
        doc = status_until(inv, lambda d: records(d, sick, "cordon"), PERIOD_S + 30 + 60)
        rec = records(doc, sick, "cordon")[-1]
        took = rec["time"] - switched
        assert took <= PERIOD_S + 30, (took, rec)
        assert rec["finding"] == "gpu_lost" and "Xid 79" in rec["evidence"], rec
        doc = status_until(inv, lambda d: records(d, sick, "cordon")[-1]["outcome"] != "moving",
                           960)
        rec = records(doc, sick, "cordon")[-1]
        print(f"cordon record: {json.dumps(rec)}")
        assert rec["outcome"] == "moved", f"{json.dumps(rec)}\n{head_report(inv)}"
        assert f"{GANG}/{old_gang['replica_id']}" in rec["gangs_moved"], rec
        # a rank on the sick node: the job rolled the app, the new gang RUNNING before the old
        # stopped; the replica itself on it: Serve's own move off a draining node (new first too)
        rank_there = any("rank" in g for g in rec["replicas_moved"]
                         if g["replica_id"] == old_gang["replica_id"])
        assert rec["gang_rebuild"] == ("surge" if rank_there else ""), rec
        doc = status_until(inv, lambda d: len(running_replicas(d, SMALL)) == 2 and len(
            running_replicas(d, GANG)) == 1 and app_of(d, GANG)["broken_ranks"] == [], 300)
        answered = answers(gang["endpoint"], GANG)
        time.sleep(20)                                # the load on the rebuilt apps
    (new_gang,) = running_replicas(doc, GANG)
    print(f"day two: {sick} cordoned {took:.1f} s after its GPU was lost (period {PERIOD_S:g} s); "
          f"move {rec['move_s']:.0f} s; gang rebuilt on {gang_nodes(new_gang)}; "
          f"{GANG}: {gang_load.figures()}; {SMALL}: {small_load.figures()}")
    assert new_gang["replica_id"] != old_gang["replica_id"] and answered
    assert sorted(gang_nodes(new_gang)) == healthy, new_gang
    assert all(r["node"] != sick for r in running_replicas(doc, SMALL)), app_of(doc, SMALL)
    assert gang_load.outcomes
    assert small_load.outcomes and not small_load.failed(), small_load.figures()
    for node, procs in old.items():                   # the sick node's included
        left = set(procs) & set(process_tree(sim, node, set(procs)))
        assert not left, f"{node}: processes of the replaced gang left: {procs}"
    assert doc["health_actions"]["cordoned"][sick]["finding"] == "gpu_lost"
    code, _ = cli_json(inv, "status", "--window", "0")
    assert code == 1                                  # a cordoned node is a warning
    assert f"cordoned by the health job: {sick}" in cli(inv, "status", "--window", "0").stdout

    code, refused = cli_json(inv, "uncordon", sick, "--yes")
    assert code == 2 and f"preflight of {sick} fails" in refused["stopped"], refused

    sim._factory.run("state", sick, "gpu", "ok")
    code, back = cli_json(inv, "uncordon", sick, "--yes")
    assert code == 0, json.dumps(back, indent=1)[-3000:]
    doc = status_until(inv, lambda d: records(d, sick, "uncordoned"), 120)
    assert doc["health_actions"]["cordoned"] == {}
    # issue 42 item 5: at most 2 % of the gang app's requests fail over the whole event (break
    # before make failed 119 of 236, 2026-12-06: every request of the ~150 s rebuild)
    assert len(gang_load.failed()) <= 0.02 * len(gang_load.outcomes), gang_load.figures()

    # then a rolling change of the TP 1 app's engine args under the same load: its dry run shows
    # the two steps (one new replica started, one old stopped, each), changing nothing; the
    # change fails no request and is in effect after (scripts/bench_roll.py measures it against
    # a plain redeploy)
    assert served_max_model_len(small["endpoint"], SMALL, KEY) == 256
    dry = deploy(inv, model, SMALL, "--dp", "2", "--engine-arg", "enforce_eager=true",
                 "--dry-run", env=UNBOUND_ENGINE_ENV, max_len=224)
    assert [(s["start"], len(s["stop"])) for s in dry["roll"]["steps"]] == [(1, 1), (1, 1)], \
        json.dumps(dry.get("roll"), indent=1)
    assert served_max_model_len(small["endpoint"], SMALL, KEY) == 256
    with StreamingLoad(small["endpoint"], SMALL, KEY) as roll_load:
        time.sleep(5)
        rolled = deploy(inv, model, SMALL, "--dp", "2", "--engine-arg", "enforce_eager=true",
                        env=UNBOUND_ENGINE_ENV, max_len=224)
        time.sleep(5)
    steps = [s["what"] for s in (rolled.get("roll") or {}).get("steps") or []]
    print(f"rolling change of {SMALL}'s max_model_len: {roll_load.figures()}; steps {steps}")
    assert len(steps) == 2, json.dumps(rolled.get("roll"), indent=1)
    assert not set(rolled["roll"]["old_replicas"]) & {r["replica_id"] for r in rolled["replicas"]}
    assert roll_load.outcomes and not roll_load.failed(), roll_load.figures()
    assert served_max_model_len(small["endpoint"], SMALL, KEY) == 224

