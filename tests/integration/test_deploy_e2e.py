"""`cluster deploy` / `cluster undeploy` end to end: real Ray 2.60 on two simulated CPU nodes,
real vLLM (CPU build) serving the tiny dense model with TP 2, the official `openai` client.

Covers: refusals before anything is deployed (model missing on a node, API-key variable not in
the nodes' Ray environment); deploy TP 2 -> RUNNING, completions, chat, streaming, 401 on a
wrong or missing key, `cluster status` shows it; a second app keeps the first one untouched;
a failing app is reported with its exception and log tails; a killed replica is restarted by
Serve and requests succeed again; undeploy removes it and leaves no vLLM process behind.
The cluster runs the default ingress (ray.serve_ingress: haproxy). The module is also the
secrets check of the scripting issue: one up/deploy/bench/undeploy/down cycle, the process
list sampled all along, then every CLI output, run directory, Serve YAML and node Ray log
grepped for the API key.

The tiny model is built under /var/tmp (the simulated nodes share the host's filesystem except
/tmp, which is per node). Heavy: ~4.5 GB of memory and 5-10 minutes on a 2-core machine.
Run your own instance with SIMCLUSTER_PREFIX=dep SIMCLUSTER_SUBNET=4
SIMCLUSTER_DIR=/tmp/simcluster-dep.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from integration_kit import ClusterCli, NODE_MODELS, ProcessListWatch, derive_inventory, node_tiny_model, ray_up

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.vllm]

MODEL_DIR = NODE_MODELS / "dense"
KEY = "sk-e2e-3b9d1f7a0c"          # a test-only key, set in the nodes' env at `ray start`
SERVED = "tiny-dense"
APP = "tiny"
PROFILES = {"node1": "cpu", "node2": "cpu"}


CLI_OUTPUTS: list[str] = []   # every CLI run's argv, stdout and stderr: grepped for the key
cli = ClusterCli(timeout=1200, record=lambda p: CLI_OUTPUTS.append(
    "\n".join([" ".join(p.args), p.stdout, p.stderr])))
cli_json = cli.json


@pytest.fixture(scope="module")
def model(tiny_model_builder) -> Path:
    return node_tiny_model(tiny_model_builder, "dense", needs=("vllm", "openai"))


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    return simcluster_factory(2, PROFILES)


@pytest.fixture(scope="module")
def process_watch():
    with ProcessListWatch(KEY) as watch:
        yield watch


@pytest.fixture(scope="module")
def inv(sim, model, tmp_path_factory, process_watch) -> Path:
    """The simcluster inventory + small-node Ray settings + the API key in every node's env;
    Ray (re)started with it, stopped at the end."""
    path = derive_inventory(sim, tmp_path_factory.mktemp("deploy-inv"),
                            ray={"memory": 4 * 1024 ** 3},
                            every_node={"env": {"CLUSTER_API_KEY": KEY}}, short_drain=True,
                            shared_inductor=True, health_job=False)
    with ray_up(cli, path, timeout=600, down_first=True):   # a Ray left elsewhere lacks the env
        yield path


def serve_app(inv: Path, name: str):
    """(AppState or None) read through the toolkit's own dashboard client."""
    from cluster.serving import deploy
    from cluster.nodes import inventory as inventory_mod
    from cluster.ray.dashboard_api import DashboardClient
    from cluster.nodes.remote import Session

    inventory = inventory_mod.load(str(inv))
    with Session(inventory) as session:
        return deploy.app_state(DashboardClient(session, inventory).serve_details(), name)


def live_replicas(inv: Path, name: str) -> list:
    state = serve_app(inv, name)
    return [r for r in state.replicas if not r.dead] if state else []


def client(endpoint: str, key: str = KEY):
    import openai

    return openai.OpenAI(base_url=endpoint, api_key=key, timeout=180, max_retries=0)


def vllm_processes(sim, node: str) -> list[str]:
    p = sim.exec(node, "ps", "-eo", "pid=,args=", check=True)
    return [line.strip() for line in p.stdout.splitlines()
            if ("VLLM::" in line or "ServeReplica" in line) and "ps -eo" not in line]


# ---------------------------------------------------------------- refused before deploying


def test_model_missing_on_a_node_is_refused_naming_it(sim, inv, model):
    # /tmp is per node: a copy there exists on node1 only.
    r = sim.ssh("node1", f"rm -rf /tmp/only-here && cp -r {model} /tmp/only-here", timeout=60)
    assert r.returncode == 0, r.stderr
    code, out = cli_json(inv, "deploy", "--model", "/tmp/only-here", "--name", "missing",
                         "--yes")
    assert code == 2 and out["status"] == "REFUSED"
    assert "missing on node2" in out["error"] and "node1," not in out["error"]
    assert serve_app(inv, "missing") is None


def test_api_key_variable_missing_from_the_ray_env_is_refused(inv, model):
    code, out = cli_json(inv, "deploy", "--model", str(model), "--api-key-env", "OTHER_KEY",
                         "--dry-run")
    assert code == 2 and out["status"] == "REFUSED"
    assert "$OTHER_KEY is not set in the Ray environment of node1 (unset), node2 (unset)" \
        in out["error"]


def test_dry_run_writes_the_config_and_deploys_nothing(inv, model):
    code, out = cli_json(inv, "deploy", "--model", str(model), "--tp", "2", "--name", APP,
                         "--dry-run")
    assert code == 0 and out["status"] == "DRY_RUN"
    config = yaml.safe_load(Path(out["config_path"]).read_text())
    assert config["applications"][0]["args"]["engine_kwargs"]["tensor_parallel_size"] == 2
    assert serve_app(inv, APP) is None


# ---------------------------------------------------------------- deploy TP 2 and use it


@pytest.fixture(scope="module")
def deployed(inv, model) -> dict:
    start = time.monotonic()
    code, out = cli_json(inv, "deploy", "--model", str(model), "--tp", "2", "--name", APP,
                         "--served-model-name", SERVED, "--max-model-len", "512",
                         "--engine-arg", "enforce_eager=true", "--yes", "--timeout", "900")
    out["measured_s"] = round(time.monotonic() - start, 1)
    print(f"\ndeploy TP 2: {out['measured_s']} s (waited {out.get('waited_s')} s for RUNNING)")
    assert code == 0, json.dumps(out, indent=1)[-4000:]
    return out


def test_deploy_tp2_is_running_with_an_explicit_name_and_no_key_on_disk(deployed):
    out = deployed
    assert out["status"] == "RUNNING" and out["name"] == APP
    assert out["served_model_name"] == SERVED
    assert out["endpoint"].endswith(f":8000/{APP}/v1") and "198.18." in out["endpoint"]
    assert out["placement"]["bundles_per_replica"] == [{"CPU": 1}, {"CPU": 1}]
    text = Path(out["config_path"]).read_text()
    args = yaml.safe_load(text)["applications"][0]["args"]
    assert args["api_key_env"] == "CLUSTER_API_KEY" and args["enable_request_logging"] is False
    assert args["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    for f in Path(out["run_dir"]).rglob("*"):
        if f.is_file():
            assert KEY not in f.read_text(errors="replace"), f


def test_openai_client_completions_chat_streaming(deployed):
    c = client(deployed["endpoint"])
    assert SERVED in [m.id for m in c.models.list().data]
    completion = c.completions.create(model=SERVED, prompt="Hello", max_tokens=16)
    assert completion.usage.completion_tokens == 16 and completion.choices[0].text
    chat = c.chat.completions.create(model=SERVED, max_tokens=16,
                                     messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 16
    chunks = list(c.chat.completions.create(model=SERVED, max_tokens=16, stream=True,
                                            messages=[{"role": "user", "content": "hi"}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(chunks) > 2 and text


def test_wrong_or_missing_api_key_gets_401(deployed):
    import httpx
    import openai

    with pytest.raises(openai.AuthenticationError) as err:
        client(deployed["endpoint"], key="sk-wrong").completions.create(
            model=SERVED, prompt="x", max_tokens=1)
    assert err.value.status_code == 401
    reply = httpx.post(deployed["endpoint"] + "/completions", timeout=60,
                       json={"model": SERVED, "prompt": "x", "max_tokens": 1})
    assert reply.status_code == 401


def test_cluster_status_shows_the_app_running(inv, deployed):
    code, status = cli_json(inv, "status")
    assert code == 0
    app = status["serve"]["applications"][APP]
    assert app["status"] == "RUNNING" and app["route_prefix"] == f"/{APP}"


def test_requests_go_through_serve_haproxy_ingress(sim, deployed):
    """ray.serve_ingress defaults to haproxy: `cluster up` started Ray with
    RAY_SERVE_ENABLE_HA_PROXY=1, so Serve runs HAProxy in front of the replicas."""
    found = {}
    for node in PROFILES:
        ps = sim.exec(node, "ps", "-eww", "-o", "args=", check=True).stdout
        found[node] = [line for line in ps.splitlines() if "haproxy" in line.split(" ")[0]]
    assert any(found.values()), found


# Another local user tries the node's HAProxy admin socket(s) (prints one line a socket).
ADMIN_SOCKET_PROBE = r"""
import socket, sys
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(path)
        s.sendall(b"show info\n")
        print("answered", path, s.recv(64)[:40])
    except OSError as exc:
        print("refused", path, type(exc).__name__)
"""


def test_haproxy_keeps_its_files_private_and_no_other_user_drives_its_admin_socket(sim, deployed):
    """Security: Ray's default put Serve's HAProxy config and its `level admin` socket (mode 666)
    in /tmp/haproxy-serve, where any local user could repoint the replicas' servers or take the
    listener; `up` exports the paths into a `mktemp -d` folder of its own (0700), in /run for
    root (the simulated nodes' SSH user)."""
    seen = 0
    for node in PROFILES:
        ps = sim.exec(node, "ps", "-eww", "-o", "args=", check=True).stdout
        configs = [line.split(" -f ", 1)[1].split()[0] for line in ps.splitlines()
                   if "haproxy" in line.split(" ")[0] and " -f " in line]
        if not configs:
            continue
        seen += 1
        folders = {str(Path(c).parent.parent) for c in configs}     # <folder>/<node id>/haproxy.cfg
        assert all(f.startswith("/run/cluster-hap.") for f in folders), configs
        assert sim.exec(node, "test", "-e", "/tmp/haproxy-serve").returncode != 0
        for folder in folders:
            mode = sim.exec(node, "stat", "-c", "%a %U %F", folder, check=True).stdout.split()
            assert mode == ["700", "root", "directory"], (folder, mode)
        sockets = sim.exec(node, "sh", "-c", "ls /run/cluster-hap.*/*/admin.sock",
                           check=True).stdout.split()
        assert sockets
        probe = sim.exec(node, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                         "python3", "-c", ADMIN_SOCKET_PROBE, *sockets)
        lines = probe.stdout.splitlines()
        assert len(lines) == len(sockets) and all(l.startswith("refused ") for l in lines), \
            (probe.stdout, probe.stderr)
        assert "PermissionError" in lines[0], lines
    assert seen, "no HAProxy ingress process on any node"


def test_cluster_bench_through_the_endpoint(inv, deployed):
    p = cli(inv, "bench", "--url", deployed["endpoint"], "--model", SERVED, "--concurrency", "2",
            "--requests", "6", "--prompt-len", "8", "--output-len", "16",
            "--api-key-env", "CLUSTER_API_KEY", "--json", env={"CLUSTER_API_KEY": KEY})
    code, out = p.returncode, json.loads(p.stdout)
    assert code == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (level,) = out["levels"]
    assert level["ok"] == 6 and level["output_tokens"] == 6 * 16


def test_a_second_app_keeps_the_first_untouched(inv, deployed):
    before = [(r.replica_id, r.pid) for r in live_replicas(inv, APP)]
    code, out = cli_json(inv, "deploy", "--model", str(MODEL_DIR), "--tp", "2", "--name",
                         "probe", "--placement-only", "--yes", "--timeout", "300")
    assert code == 0, out
    assert out["apply"]["kept"] == [APP]
    assert serve_app(inv, APP).status == "RUNNING"
    code, removed = cli_json(inv, "undeploy", "probe", "--yes")
    assert code == 0 and removed["status"] == "REMOVED" and removed["remaining"] == [APP]
    assert [(r.replica_id, r.pid) for r in live_replicas(inv, APP)] == before
    assert client(deployed["endpoint"]).completions.create(
        model=SERVED, prompt="Hi", max_tokens=4).usage.completion_tokens == 4


def test_a_failing_app_is_reported_with_its_exception_and_logs(inv, deployed):
    code, out = cli_json(inv, "deploy", "--model", str(MODEL_DIR), "--name", "broken",
                         "--engine-arg", "not_an_engine_arg=1", "--yes", "--timeout", "600")
    try:
        assert code == 2 and out["status"] == "DEPLOY_FAILED", out.get("error")
        assert "not_an_engine_arg" in out["error"]
        assert out["log_tails"] and any("replica_broken" in t for t in out["log_tails"].values())
        assert serve_app(inv, APP).status == "RUNNING"
    finally:
        cli(inv, "undeploy", "broken", "--yes")


def test_a_killed_replica_is_restarted_and_serves_again(sim, inv, deployed):
    """Also fault (e) of the scripting issue: the replica is killed while `cluster bench` runs;
    the failed requests are counted by kind (none lost, none hanging) and the app recovers."""
    from cluster.serving.bench import BenchConfig, run_bench

    (old,) = live_replicas(inv, APP)
    node = next(n.name for n in sim.nodes if n.ip == old.node_ip)
    # The tiny model generates a whole answer long before the client has read it; a stream the
    # replica already finished still drains to the client from socket buffers after a kill. So
    # the replica is first stopped (SIGSTOP): the streams it finished drain, each worker then
    # sends its next request into the stopped replica and waits; once no request has finished
    # for 3 s, every worker's request is stuck there, and SIGKILL must fail them.
    # Enough requests that the bench cannot end before the kill (the rest run on the new replica).
    # A request sent after the kill waits in Serve's proxy until the replacement is ready: on 2
    # shared cores in the heavy lane that took more than 120 s (2026-12-06: 4 such requests ended
    # as `timeout` at 120 s, in CI and here), so each request may take 300 s; a hang is still
    # caught by the bench's end bound below (the rest take well under a second each).
    config = BenchConfig(url=deployed["endpoint"], model=SERVED, concurrency=(4,), prompt_len=16,
                         output_len=64, requests=120, timeout_s=300, api_key=KEY)
    finished: list[float] = []
    outcome: dict = {}
    load = threading.Thread(target=lambda: outcome.update(
        result=run_bench(config, on_request=lambda c, o: finished.append(time.monotonic()))),
        daemon=True)
    load.start()
    deadline = time.monotonic() + 300
    while not finished and time.monotonic() < deadline:
        time.sleep(0.1)
    assert finished, "no request finished before the kill"
    sim.exec(node, "kill", "-STOP", str(old.pid), check=True)
    stopped_at = time.monotonic()
    while time.monotonic() - max(finished[-1], stopped_at) < 3 and \
            time.monotonic() - stopped_at < 60:
        time.sleep(0.1)
    assert load.is_alive() and len(finished) < config.requests, "the bench ended before the kill"
    start = time.monotonic()
    sim.exec(node, "kill", "-9", str(old.pid))  # Serve's health check may have been first
    gone = False
    while not gone and time.monotonic() - start < 30:
        gone = sim.exec(node, "kill", "-0", str(old.pid)).returncode != 0
        time.sleep(0.2)
    assert gone, f"replica process {old.pid} on {node} still alive after kill -9"
    load.join(timeout=900)              # the replacement's start (<= 300 s) and ~110 quick requests
    assert not load.is_alive(), "bench hung after the replica died"
    level = outcome["result"].levels[0]
    assert level.requests == config.requests
    assert level.ok + sum(level.errors.values()) == config.requests
    assert sum(level.errors.values()) > 0, \
        f"requests in flight on the killed replica must fail: {level.to_dict()}"
    assert set(level.errors) <= {"dropped", "connection_error", "incomplete_stream", "http_502",
                                 "http_503", "http_500"}, level.errors
    assert outcome["result"].exit_code == 2
    new = None
    while time.monotonic() - start < 900:
        running = [r for r in live_replicas(inv, APP)
                   if r.state == "RUNNING" and r.replica_id != old.replica_id]
        if running and serve_app(inv, APP).status == "RUNNING":
            new = running[0]
            break
        time.sleep(5)
    assert new is not None, "Serve did not bring a new replica to RUNNING"
    restarted_s = time.monotonic() - start
    c = client(deployed["endpoint"])
    for attempt in range(10):
        try:
            reply = c.completions.create(model=SERVED, prompt="again", max_tokens=8)
            break
        except Exception:  # the proxy may still route to the dead replica for a moment
            if attempt == 9:
                raise
            time.sleep(5)
    assert reply.usage.completion_tokens == 8
    print(f"\nreplica killed on {node} during a bench ({level.ok} ok, errors {level.errors}); "
          f"new replica {new.replica_id} on {new.node_ip} RUNNING after {restarted_s:.0f} s")


def test_undeploy_removes_it_and_leaves_no_engine(sim, inv, deployed):
    code, out = cli_json(inv, "undeploy", APP, "--yes", timeout=300)
    assert code == 0 and out["status"] == "REMOVED", out
    assert serve_app(inv, APP) is None
    code, status = cli_json(inv, "status")
    assert APP not in status["serve"]["applications"]
    deadline = time.monotonic() + 60
    while any(vllm_processes(sim, n) for n in PROFILES) and time.monotonic() < deadline:
        time.sleep(2)
    assert not any(vllm_processes(sim, n) for n in PROFILES)
    code, again = cli_json(inv, "undeploy", APP, "--yes")
    assert code == 0 and again["status"] == "ABSENT"


def test_the_api_key_appears_nowhere_after_the_full_cycle(sim, inv, process_watch):
    """up (the inv fixture) / deploy / bench / undeploy / down: the key never reached a command
    line on any node or the laptop, a CLI output, the run directory (command logs, reports,
    the Serve YAML) or Ray's logs on the nodes."""
    p = cli(inv, "down", "--yes", timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    process_watch.sample()
    assert process_watch.samples >= 60, "the process list was hardly sampled"
    assert process_watch.env_holders >= 1, "the sampler never saw the Ray processes holding the key"
    assert process_watch.hits == [], process_watch.hits[:5]
    commands = " ".join(CLI_OUTPUTS)
    for step in (" up ", " deploy ", " bench ", " undeploy ", " down "):
        assert step in commands, f"the cycle lacks `cluster{step}`"
    leaked = [o.splitlines()[0] for o in CLI_OUTPUTS if KEY in o]
    assert leaked == [], leaked
    run_dir = Path(yaml.safe_load(inv.read_text())["run_dir"])
    files = [f for f in run_dir.rglob("*") if f.is_file()]
    assert any(f.suffix in (".yaml", ".yml") and "serve" in f.read_text(errors="replace")
               for f in files), "no Serve config in the run directories"
    assert [str(f) for f in files if KEY.encode() in f.read_bytes()] == []
    for node in PROFILES:
        logs = sim.exec(node, "sh", "-c", "ls -d /tmp/ray/session_*/logs | head -1")
        assert logs.returncode == 0 and logs.stdout.strip(), f"{node}: no Ray logs to search"
        grep = sim.exec(node, "grep", "-rlF", "--", KEY, "/tmp/ray", timeout=120)
        assert grep.returncode == 1, f"{node}: key in Ray's files: {grep.stdout[:500]}"
