"""Real Ray 2.60 on three simulated nodes: up / status / idempotent re-up / rejoin / down, env at
start time, version skew refused before any start, placement groups, the dashboard tunnel, a head
whose dashboard agent starts too late for its raylet (the head's start retried, the workers rejoin).

Nodes: node1 (head) and node2 with the `small-4gpu` profile (nvidia-smi lists 4 H100), node3 with
the `cpu` profile (no nvidia-smi). The simcluster inventory is extended with what small
simulated nodes need (testbed.md: --num-cpus, --memory, --object-store-memory).
Heavy: ~2.4 GB of memory and a few minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import shutil
import socket
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from fakes import cluster_process
from integration_kit import PYTHON, ClusterCli, derive_inventory, head_driver
from cluster.inspection.probes import probe_names

pytestmark = [pytest.mark.integration, pytest.mark.ray]

PROFILES = {"node1": "small-4gpu", "node2": "small-4gpu", "node3": "cpu"}
EXPECTED_GPUS = {"node1": 4, "node2": 4, "node3": 0}
MARK = "set-at-ray-start"
RAY_WORDS = ("raylet", "gcs_server", "ray::", "dashboard.py", "log_monitor", "default_worker",
             "runtime_env/agent", "dashboard/agent", "monitor.py", "ray.util.client.server")


cli = ClusterCli(timeout=600)
cli_json = cli.json


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    return simcluster_factory(3, PROFILES)


@pytest.fixture(scope="module")
def inv(sim, tmp_path_factory) -> Path:
    """The simcluster inventory + ray settings; node2 carries NCCL_SOCKET_IFNAME and a marker."""
    path = derive_inventory(sim, tmp_path_factory.mktemp("ray-inv"), nodes={
        "node2": {"nccl_socket_ifname": "=eth0", "env": {"CLUSTER_TEST_MARK": MARK}}})
    yield path
    cli(path, "down", "--yes", timeout=300)  # always leave the nodes without Ray


def ray_processes(sim, node: str) -> list[str]:
    """Ray processes inside the node's PID namespace (no SSH)."""
    p = sim.exec(node, "ps", "-eo", "pid=,args=", check=True)
    return [line.strip() for line in p.stdout.splitlines()
            if any(w in line for w in RAY_WORDS) and "ps -eo" not in line]


def node_ids(status: dict) -> dict[str, str]:
    return {n["name"]: n["node_id"] for n in status["nodes"] if n["alive"] and n["name"]}


def run_driver(sim, inventory: Path, script: str, timeout: float = 300) -> dict:
    """Run a Ray driver on the head (with the cluster's auth mode) and return its RESULT json."""
    return head_driver(inventory, script, timeout)


# ---------------------------------------------------------------- before anything runs


def test_version_skew_is_refused_before_any_ray_start(sim, inv, tmp_path):
    cli(inv, "down", "--yes", timeout=300)
    # node3's python finds a fake `ray` first (only the version probe sees it: nothing starts).
    sim.ssh("node3", "mkdir -p /tmp/fake-ray/ray && "
                     "echo '__version__ = \"2.9.9\"' > /tmp/fake-ray/ray/__init__.py", check=True)
    doc = yaml.safe_load(inv.read_text())
    for node in doc["nodes"]:
        if node["name"] == "node3":
            node["env"] = {"PYTHONPATH": "/tmp/fake-ray"}
    doc["run_dir"] = str(tmp_path / "runs")
    skewed = tmp_path / "skewed.yaml"
    skewed.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        code, out = cli_json(skewed, "up", "--skip-preflight", "--yes")
        assert code == 2
        assert out["plan"]["refused"], out["plan"]
        assert "node3" in out["plan"]["refused"][0] and "2.9.9" in out["plan"]["refused"][0]
        assert [s["status"] for s in out["steps"]] == ["skipped"] * 3
        for node in PROFILES:
            assert ray_processes(sim, node) == [], node
        logs = "".join(p.read_text() for p in Path(out["run_dir"]).glob("nodes/*.log"))
        assert "ray.scripts.scripts start" not in logs
    finally:
        sim.ssh("node3", "rm -rf /tmp/fake-ray")


def test_dry_run_prints_commands_and_changes_nothing(sim, inv):
    p = cli(inv, "up", "--dry-run", "--skip-preflight")
    assert p.returncode == 0, p.stderr
    head = next(line for line in p.stdout.splitlines() if line.startswith("[node1] $ "))
    assert "--node-ip-address 198.18." in head and "--head" in head and "--num-gpus 4" in head
    assert "--num-cpus 2" in head and "--object-store-memory 268435456" in head
    worker = next(line for line in p.stdout.splitlines() if line.startswith("[node2] $ "))
    assert "NCCL_SOCKET_IFNAME==eth0" in worker and f"CLUSTER_TEST_MARK={MARK}" in worker
    node3 = next(line for line in p.stdout.splitlines() if line.startswith("[node3] $ "))
    assert "--num-gpus 0" in node3
    for node in PROFILES:
        assert ray_processes(sim, node) == [], node


def test_preflight_failures_stop_up_before_any_start(sim, inv):
    # the simulated nodes fail some checks (memlock; node3 has no nvidia-smi)
    code, out = cli_json(inv, "up", "--yes")
    assert code == 2 and out["stopped"].startswith("preflight failed")
    assert out["preflight"]["exit_code"] == 2 and out["steps"] == []
    for node in PROFILES:
        assert ray_processes(sim, node) == [], node


def test_status_says_when_the_head_is_unreachable(sim, inv, tmp_path):
    doc = yaml.safe_load(inv.read_text())
    doc["nodes"][0]["port"] = 2222  # nothing listens there: connection refused
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    code, status = cli_json(bad, "status")
    assert code == 2 and status["head"]["reachable"] is False
    assert "unreachable" in status["errors"][0] and status["missing"] == list(PROFILES)
    p = cli(bad, "status")
    assert p.returncode == 2 and "unreachable" in p.stdout


# ---------------------------------------------------------------- the lifecycle


def test_up_status_idempotent_rejoin(sim, inv):
    code, up = cli_json(inv, "up", "--skip-preflight", "--yes")
    assert code == 0, json.dumps(up, indent=1)[-4000:]

    code, status = cli_json(inv, "status")
    assert code == 0 and status["missing"] == []
    alive = {n["name"]: n for n in status["nodes"] if n["alive"]}
    assert set(alive) == set(PROFILES)
    for name, gpus in EXPECTED_GPUS.items():
        assert alive[name]["gpus"] == gpus and alive[name]["cpus"] == 2
        assert alive[name]["ip"] == sim.node(name).ip
        assert alive[name]["resources"][f"host:{name}"] == 1
    assert alive["node1"]["gpu_model"] == "NVIDIA-H100-80GB-HBM3"
    assert status["ray_version"] == "2.60.0"
    assert status["serve"] == {"applications": {}}
    before = node_ids(status)

    # a second up changes nothing: no ray stop, same node ids
    code, again = cli_json(inv, "up", "--skip-preflight", "--yes")
    assert code == 0 and again["changed"] is False
    assert [a["action"] for a in again["plan"]["actions"]] == ["keep"] * 3
    assert all(s["results"] == [] for s in again["steps"])
    assert node_ids(again["status"]) == before

    # a dead worker: only it is rejoined
    sim.exec("node3", "sh", "-c", "kill -9 $(pgrep -x raylet)", check=True)
    code, rejoin = cli_json(inv, "up", "--skip-preflight", "--yes")
    assert code == 0, json.dumps(rejoin, indent=1)[-4000:]
    kinds = {a["node"]: a["action"] for a in rejoin["plan"]["actions"]}
    assert kinds == {"node1": "keep", "node2": "keep", "node3": "restart"}
    assert {s["node"]: s["status"] for s in rejoin["steps"]} == \
        {"node1": "ok", "node2": "ok", "node3": "changed"}
    after = node_ids(rejoin["status"])
    assert after["node1"] == before["node1"] and after["node2"] == before["node2"]
    assert after["node3"] != before["node3"]
    code, status = cli_json(inv, "status")
    assert code == 0 and node_ids(status) == after

    # what `up` shows when a node does not register in time: the end of its Ray logs
    from cluster.nodes import inventory as inventory_mod
    from cluster.ray.ray_cluster import log_tail_command
    from cluster.nodes.remote import Session

    loaded = inventory_mod.load(str(inv))
    with Session(loaded) as session:
        r = session.run(loaded.node("node3"), log_tail_command(loaded, loaded.node("node3")))
    assert "==> /tmp/ray/session_latest/logs/raylet.out <==" in r.stdout


ENV_AND_PLACEMENT = r'''
import json, os, ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}

@ray.remote(num_cpus=0)
def env_here():
    return {"ip": ray.util.get_node_ip_address(),
            **{k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                                              "VLLM_HOST_IP", "CLUSTER_TEST_MARK")}}

out = {"driver_env": os.environ.get("CLUSTER_TEST_MARK"),
       "node2": ray.get(env_here.options(resources={"host:node2": 0.01}).remote(), timeout=120)}
for name, shape in (("pack8x1", [{"GPU": 1}] * 8), ("pack2x4", [{"GPU": 4}] * 2)):
    pg = placement_group(shape, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    bundles = placement_group_table(pg)["bundles_to_node_id"]
    out[name] = [ip_of[n] for _, n in sorted(bundles.items())]
    remove_placement_group(pg)
print("RESULT " + json.dumps(out))
'''


def _accepted(sim, node: str) -> int:
    """SSH logins sshd accepted on the node so far (its own log)."""
    log = sim.dir / "nodes" / node / "console.log"
    return log.read_text(errors="replace").count("Accepted publickey for")


def _logged_commands(log: Path) -> list[str]:
    """The commands of a run directory's node log (cluster/report/rundir.py: `=== ...`, `$ CMD` (may
    span lines), then `! error` / `--- stdout` / `--- stderr` sections)."""
    commands = []
    for entry in log.read_text().split("\n=== "):
        _, _, rest = entry.partition("\n$ ")
        for end in ("\n! ", "\n--- stdout", "\n--- stderr"):
            rest = rest.split(end, 1)[0]
        commands.append(rest)
    return commands


def test_up_opens_one_ssh_session_per_node_and_gathers_once(sim, inv):
    """`cluster up` with its preflight, on a running cluster: one SSH connection per node for the
    whole run (sshd's own log), and the facts gathered in one round trip per node that carries
    both the preflight's probes and the node-facts program (the run directory's command log)."""
    runs = Path(yaml.safe_load(inv.read_text())["run_dir"])
    before_runs = set(runs.glob("*-up")) if runs.is_dir() else set()
    before = {n: _accepted(sim, n) for n in PROFILES}
    code, up = cli_json(inv, "up", "--force", "--yes")
    assert code in (0, 1, 2) and up["plan"] is not None, json.dumps(up, indent=1)[-3000:]
    assert [a["action"] for a in up["plan"]["actions"]] == ["keep"] * 3
    assert {n: _accepted(sim, n) - before[n] for n in PROFILES} == {n: 1 for n in PROFILES}
    (run,) = set(runs.glob("*-up")) - before_runs
    for name in PROFILES:
        commands = _logged_commands(run / "nodes" / f"{name}.log")
        gathers = [c for c in commands if "@@cluster-probe@@" in c]
        assert len(gathers) == 1, [c[:100] for c in commands]
        names = probe_names(gathers[0])
        assert "versions" in names                                  # node_facts.py
        assert "gpu-query" in names
        assert "ibstat" in names                                    # a preflight probe
    checks = {r["check"] for r in up["preflight"]["results"]}
    assert {"gpus", "versions", "ports"} <= checks
    ports = {r["node"]: r for r in up["preflight"]["results"] if r["check"] == "ports"}
    assert all("Ray is running" in ports[n]["summary"] for n in PROFILES)


def test_env_at_start_time_and_gpu_placement(sim, inv):
    code, up = cli_json(inv, "up", "--skip-preflight", "--yes")
    assert code == 0, json.dumps(up, indent=1)[-4000:]
    out = run_driver(sim, inv, ENV_AND_PLACEMENT)
    # the variables reached a task on node2 only through `ray start` (the driver never had them)
    assert out["driver_env"] is None
    assert out["node2"] == {"ip": sim.node("node2").ip, "NCCL_SOCKET_IFNAME": "=eth0",
                            "GLOO_SOCKET_IFNAME": "eth0", "VLLM_HOST_IP": sim.node("node2").ip,
                            "CLUSTER_TEST_MARK": MARK}
    gpu_nodes = {sim.node("node1").ip, sim.node("node2").ip}
    assert {ip: out["pack8x1"].count(ip) for ip in gpu_nodes} == {ip: 4 for ip in gpu_nodes}
    assert sorted(out["pack2x4"]) == sorted(gpu_nodes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_tunnel(sim, inv):
    code, up = cli_json(inv, "up", "--skip-preflight", "--yes")
    assert code == 0
    port = _free_port()
    proc = cluster_process("-i", str(inv), "dashboard", "--port", str(port), python=PYTHON,
                           stdin=None)
    try:
        url = proc.stdout.readline().strip()
        base = f"http://127.0.0.1:{port}"
        # the printed URL carries the proxy's own per-run credential (issue 25 item 6)
        assert url.startswith(base + "/?token="), proc.stderr.read() if proc.poll() else url
        assert httpx.get(f"{base}/api/version", timeout=30).status_code == 403   # without it
        with httpx.Client(follow_redirects=True, timeout=30) as browser:
            assert browser.get(url).status_code == 200          # the credential -> its cookie
            version = browser.get(f"{base}/api/version").json()  # the proxy adds the Ray token
        assert version["ray_version"] == "2.60.0"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_down_leaves_no_ray_process(sim, inv):
    code, down = cli_json(inv, "down", "--yes", timeout=300)
    assert code == 0, json.dumps(down, indent=1)[-4000:]
    for node in PROFILES:
        assert ray_processes(sim, node) == [], node
    code, again = cli_json(inv, "down", "--yes", timeout=300)
    assert code == 0 and again["changed"] is False
    code, status = cli_json(inv, "status")
    assert code == 2 and status["head"]["answered"] is False
    assert status["missing"] == list(PROFILES)


# A sitecustomize on the head's PYTHONPATH (the inventory's env for node1, so only `ray start` there
# sees it) that holds Ray's dashboard agent back DELAY_S the first time it starts: the raylet waits
# 15 s for the agent's port file and aborts (as on CI's loaded machine, 2026-12-07), `ray start
# --head` fails with "timed out during startup". The marker file is in the head's private /tmp.
LATE_AGENT = """import os, time
try:
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read(4096).split(b"\\0")
except OSError:
    argv = []
if any(a.endswith(b"dashboard/agent.py") for a in argv):
    marker = "/tmp/late-agent-{token}"
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep({delay})
"""


def test_a_head_whose_agent_starts_late_is_started_again_and_the_workers_rejoin(sim,
                                                                                tmp_path_factory):
    token = uuid.uuid4().hex
    site = Path("/var/tmp") / f"cluster-test-late-agent-{token}"   # outside the nodes' own /tmp
    site.mkdir(mode=0o755)
    try:
        (site / "sitecustomize.py").write_text(LATE_AGENT.format(token=token, delay=40))
        path = derive_inventory(sim, tmp_path_factory.mktemp("late-agent-inv"),
                                nodes={"node1": {"env": {"PYTHONPATH": str(site)}}})
        cli(path, "down", "--yes", timeout=300)
        try:
            code, up = cli_json(path, "up", "--skip-preflight", "--yes", timeout=900)
            assert code == 0, json.dumps(up, indent=1)[-4000:]
            steps = {s["node"]: s for s in up["steps"]}
            head = steps["node1"]
            assert head["status"] == "changed" and head["retried"] is True, head["message"]
            assert "retried once after a Ray startup timeout" in head["message"]
            first = [r for r in head["results"] if "--head" in r["command"]][0]
            assert "timed out during startup" in first["stdout"] + first["stderr"]
            for worker in ("node2", "node3"):
                assert steps[worker]["status"] == "changed", steps[worker]["message"]
                assert "started again after the head's retry" in steps[worker]["message"]
            assert set(node_ids(up["status"])) == set(PROFILES)
        finally:
            cli(path, "down", "--yes", timeout=300)
    finally:
        shutil.rmtree(site, ignore_errors=True)
