"""Values with shell metacharacters never reach a remote shell unquoted.

Every remote command the library generates (ray start / stop / the GCS wait / log tails from
cluster/ray/ray_cluster.py, the state query from cluster/ray/ray_state.py, the drain from
cluster/ray/rollout.py, deploy's node check and log tails, the preflight probe script) is built for an
inventory whose env values hold `; $() `` ' "`, spaces, backslashes and globs (newlines are rejected at load). Each value must
survive shlex.split as one literal word (`KEY=value`), and running the env prefix through a real
bash must hand the exact bytes to the process without running anything. Values that cannot be
quoted safely (names, addresses, interfaces, paths) are rejected when the inventory is loaded.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.inspection.facts import gather_command
from cluster.serving import deploy
from cluster.nodes import inventory
from cluster.ray import nccl_check, ray_cluster, ray_state, rollout
from cluster.base.errors import InventoryError
from cluster.inspection.preflight import NODE_CHECKS, node_probes
from cluster.inspection.probes import probe_script
from cluster.ray.ray_cluster import GPU
from cluster.nodes.ray_env import start_env
from fakes import write_inventory

NASTY = {
    "SEMI": "a; touch {canary}",
    "SUBST": "$(touch {canary})",
    "BACKTICK": "`touch {canary}`",
    "SQUOTE": "it's '$(touch {canary})'",
    "DQUOTE": 'say "hi" "$(touch {canary})"',
    "SPACES": "  two  words  ",
    "BACKSLASH": "back\\slash \\$(touch {canary})",
    "GLOB": "* ?[a-z]",
    "API_TOKEN": "tok;en $(touch {canary}) 'x'",
}


def _inventory(tmp_path: Path, canary: Path) -> inventory.Inventory:
    env = {k: v.format(canary=canary) for k, v in NASTY.items()}
    doc = {
        "nodes": [
            {"name": "node1", "role": "head", "address": "10.0.0.1", "env": env},
            {"name": "node2", "address": "10.0.0.2", "env": env,
             "nccl_socket_ifname": "=eth0", "ib_hcas": ["mlx5_0", "mlx5_1:1"]},
        ],
        "ray": {"python": sys.executable, "temp_dir": "/tmp/ray-x", "num_cpus": 2},
        "model": {"path": "/models/tiny-llama"},
    }
    path = write_inventory(tmp_path, json.dumps(doc))  # JSON is YAML
    return inventory.load(str(path))


@pytest.fixture
def canary(tmp_path) -> Path:
    return tmp_path / "canary-must-not-exist"


@pytest.fixture
def inv(tmp_path, canary):
    return _inventory(tmp_path, canary)


def _words(command: str) -> list[str]:
    words = shlex.split(command)
    assert words, command
    return words


def _assert_env_words(command: str, env: dict[str, str]) -> None:
    """Public entries are one literal word each; secret-looking ones are not on the line at all
    (they reach `ray start` on its stdin: see test_secret_env_reaches_the_process_via_stdin)."""
    words = _words(command)
    for key, value in env.items():
        if inventory.is_secret_name(key):
            # Neither raw nor shell-quoted: no word decodes to the value.
            assert value not in command and not any(value in w for w in words), \
                f"secret {key} on a command line: {command}"
            continue
        assert f"{key}={value}" in words, f"{key} did not survive as one word in: {command}"


def _generated_commands(inv) -> dict[str, str]:
    head, worker = inv.head, inv.node("node2")
    gpus = (GPU(0, "NVIDIA H100 80GB HBM3"), GPU(1, "NVIDIA H100 80GB HBM3"))
    replica = deploy.ReplicaInfo("dep", "r1", "RUNNING", worker.ip, 4242, "ab" * 14,
                                 "/tmp/ray/session_latest/logs/serve/replica_app_dep_r1.log")
    out = {
        "ray start (head)": ray_cluster.start_command(head, inv, gpus, "token"),
        "ray start (worker)": ray_cluster.start_command(worker, inv, gpus, "token"),
        "ray stop": ray_cluster.stop_command(inv),
        "gcs wait": ray_cluster.wait_for_gcs_command(inv),
        "log tail (head)": ray_cluster.log_tail_command(inv, head),
        "gather": gather_command(worker, inv),
        "state query": ray_state.state_call(inv, include_serve=True).command,
        "drain": rollout.drain_command(inv, "ab" * 28, "cluster drain node2; $(reboot)"),
        "deploy node check": gather_command(worker, inv, deploy.node_check_builders(
            "/models/tiny-llama", "CLUSTER_API_KEY")),
        "deploy log tail": deploy.log_tail_command(inv, [replica], "app"),
        "nccl-check (head)": nccl_check.head_call(inv, nccl_check.CheckOptions(backend="gloo"),
                                                  inv.nodes, "nccl-check-1").command,
    }
    for node in inv.nodes:
        out[f"preflight probes ({node.name})"] = probe_script(node_probes(node, inv, NODE_CHECKS))
    return out


def test_every_generated_command_parses_and_is_valid_bash(inv):
    for name, command in _generated_commands(inv).items():
        _words(command)
        syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert syntax.returncode == 0, (name, syntax.stderr, command)


def test_no_generated_command_carries_a_secret_value(inv):
    """Secret-looking env values (API_TOKEN here) reach processes on stdin, never on a command
    line: ps on the node and the run directory's command logs would show them."""
    secrets = [v for k, v in inv.head.env.items() if inventory.is_secret_name(k)]
    assert secrets
    for name, command in _generated_commands(inv).items():
        words = _words(command)
        for value in secrets:
            assert value not in command and not any(value in w for w in words), name


def test_env_values_are_one_literal_word_in_ray_start(inv):
    for node in inv.nodes:
        command = ray_cluster.start_command(node, inv, (), "disabled")
        _assert_env_words(command, node.env)
        words = _words(command)
        assert words[words.index("--node-ip-address") + 1] == node.ip


def test_env_values_are_one_literal_word_in_the_head_queries(inv):
    _assert_env_words(ray_state.state_call(inv).command, inv.head.env)
    drain = rollout.drain_command(inv, "ab" * 28, "msg; $(reboot) `x` 'q'")
    _assert_env_words(drain, inv.head.env)
    words = _words(drain)
    assert words[words.index("--reason-message") + 1] == "msg; $(reboot) `x` 'q'"


def test_drain_refuses_a_node_id_that_is_not_hex(inv):
    from cluster.base.errors import UsageError
    with pytest.raises(UsageError):
        rollout.drain_command(inv, "abc; reboot", "x")


def _environ_behind(wrap, stdin: str | None = None) -> dict[str, str]:
    """The environment a Python process sees when run by a real bash as wrap(its command)."""
    dump = shlex.join([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"])
    p = subprocess.run(["bash", "-c", wrap(dump)], input=stdin, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_bash_hands_the_exact_values_to_the_process_and_runs_nothing(inv, canary):
    """The env prefix `ray start` gets, executed by a real bash in front of a Python that
    prints its environment: every value arrives byte for byte, the canary is never created."""
    node = inv.node("node2")
    env = start_env(node, "token")
    got = _environ_behind(lambda dump: ray_cluster.env_prefix(env) + dump)
    for key, value in env.items():
        assert got[key] == value, key
    assert not canary.exists()


def test_secret_env_reaches_the_process_via_stdin(inv, canary):
    """The start command sources secret env from stdin (Session.run sends it, no log records
    it): a real bash hands the exact values to the process and executes none of them."""
    node = inv.node("node2")
    secret = {k: v for k, v in node.env.items() if inventory.is_secret_name(k)}
    assert secret, "the nasty inventory must hold a secret-looking name"
    got = _environ_behind(lambda dump: ray_cluster.SECRET_ENV_FROM_STDIN + " && " + dump,
                          stdin=ray_cluster.secret_env_stdin(node))
    for key, value in secret.items():
        assert got[key] == value, key
    assert not canary.exists()
    start = ray_cluster.start_command(node, inv, (), "disabled")
    assert ray_cluster.SECRET_ENV_FROM_STDIN in start
    assert all(v not in start for v in secret.values())


def test_state_query_through_bash_runs_nothing(tmp_path, canary):
    """The whole status query (head env prefix + program) run locally against closed loopback
    ports (the dashboard's and the GCS's: no traffic leaves this machine): it reaches no Ray
    but never executes a value."""
    doc = json.loads(Path(_inventory(tmp_path, canary).path).read_text())
    doc["nodes"][0].update(address="127.0.0.1", node_ip="127.0.0.1")
    doc["ray"].update(port=1, dashboard_port=2)
    (tmp_path / "local.yaml").write_text(json.dumps(doc))
    local = inventory.load(str(tmp_path / "local.yaml"))
    call = ray_state.state_call(local, include_serve=False)
    assert "10.0.0." not in call.command + call.stdin
    p = subprocess.run(["bash", "-c", call.command], input=call.stdin, capture_output=True, text=True,
                       timeout=120)
    assert not canary.exists()
    assert json.loads(p.stdout)["nodes"] is None  # the program ran, and found no Ray


@pytest.mark.parametrize("field, value", [
    ("name", "node;reboot"), ("name", "$(id)"), ("address", "10.0.0.1 && id"),
    ("address", "`id`"), ("node_ip", "1.2.3.4;id"), ("nccl_socket_ifname", "eth0;id"),
    ("gloo_socket_ifname", "$(id)"), ("user", "root;id"), ("identity_file", "/k ey"),
    ("jump_host", "b;id"),
])
def test_unquotable_fields_are_rejected_at_load(tmp_path, field, value):
    node = {"name": "node1", "role": "head", "address": "10.0.0.1", field: value}
    path = write_inventory(tmp_path, json.dumps({"nodes": [node]}))
    with pytest.raises(InventoryError):
        inventory.load(str(path))


def test_env_values_with_newlines_are_rejected_at_load(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps({"nodes": [{"name": "n", "env": {"X": "a\nreboot"}}]}))
    with pytest.raises(InventoryError, match="newlines"):
        inventory.load(str(path))


@pytest.mark.parametrize("key", ["A;B", "$(id)", "A B", "1X", "A-B"])
def test_env_names_must_be_identifiers(tmp_path, key):
    path = write_inventory(tmp_path, json.dumps({"nodes": [{"name": "n", "env": {key: "v"}}]}))
    with pytest.raises(InventoryError):
        inventory.load(str(path))


def test_ray_python_and_model_path_with_metacharacters_are_rejected(tmp_path):
    for doc in ({"nodes": [{"name": "n"}], "ray": {"python": "python3; id"}},
                {"nodes": [{"name": "n"}], "model": {"path": "/m/$(id)"}},
                {"nodes": [{"name": "n"}], "ray": {"temp_dir": "/tmp/a b"}}):
        path = write_inventory(tmp_path, json.dumps(doc))
        with pytest.raises(InventoryError):
            inventory.load(str(path))
