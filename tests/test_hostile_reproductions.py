"""Every reproduction of the hostile-input issue, as a user would run it: the real CLI in a
subprocess, with a wall-clock guard (a hang fails the test instead of the suite) and a memory
cap (an unbounded allocation fails instead of swapping). Each must end in one stderr line and
exit 2 (or, where the input is valid, a correct result), never a traceback or exit 1.
The modules' own tests cover each class in depth; this file is the acceptance list."""

from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path

import pytest

from fakes import cluster_cli, write_inventory

pytestmark = pytest.mark.acceptance
ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "model_configs"
MEMORY_CAP = 3 << 30     # bytes of address space for one CLI run
GUARD_S = 60             # far above what a bounded run needs; a hang is what it catches


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def cli(*args: str, stdin=subprocess.DEVNULL, cwd: Path | None = None,
        env: dict | None = None) -> subprocess.CompletedProcess:
    return cluster_cli(*args, cwd=cwd or ROOT, stdin=stdin, timeout=GUARD_S,
                       preexec_fn=_limit_memory,
                       env={**os.environ, "CLUSTER_INVENTORY": "", **(env or {})})


def one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])


inventory = write_inventory


def model(tmp_path: Path, **changes) -> Path:
    config = json.loads((MODELS / "llama-3.1-8b.json").read_text())
    config.update(changes)
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---------------------------------------------------------------- 1. super-linear patterns


@pytest.mark.parametrize("kind,text", [
    ("nccl", "a" * 5_000_000 + " NCCL INFO x\n"),
    ("nccl", "host:1:2 [0] NCCL WARN" + " " * 5_000_000 + "x\n"),
    ("nccl", "host:1:2 [0] NCCL INFO Channel " + "1" * 5_000_000 + "\n"),
    ("nvidia-smi-q", "x" + "   ...   x" * 100_000 + "\n"),
])
def test_long_lines_are_read_in_linear_time(tmp_path, kind, text):
    path = tmp_path / "input.txt"
    path.write_text(text)
    proc = cli("parse", "--kind", kind, "--json", str(path))
    assert proc.returncode in (0, 1, 2), proc.stderr       # its verdict: ok, warn or fail
    assert "Traceback" not in proc.stderr
    json.loads(proc.stdout)


# ---------------------------------------------------------------- 2. unbounded resources


def test_nested_alias_inventory_is_refused(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n"
        for i in range(8))
    text = bomb + "nodes:\n  - name: n1\n    address: 10.0.0.1\n    ib_hcas: *i\n"
    path = inventory(tmp_path, text)
    one_line_exit_2(cli("-i", str(path), "inventory"), "alias")


def test_dev_zero_as_input_ends_at_once():
    one_line_exit_2(cli("parse", "/dev/zero"))
    one_line_exit_2(cli("-i", "/dev/zero", "inventory"))


@pytest.mark.parametrize("flags", [["--gpus-per-node", "1000000000"], ["--nodes", "1000000000"],
                                   ["--nodes", "0"], ["--gpu-memory-gib", "nan"],
                                   ["--gpu-memory-gib", "inf"], ["--gpu-memory-gib", "1e300"],
                                   ["--tokens-per-s-per-gpu", "nan"]])
def test_plan_flags_out_of_range(tmp_path, flags):
    one_line_exit_2(cli("plan", "--model", str(model(tmp_path)), "--json", *flags), "error")


@pytest.mark.parametrize("flags", [["--timeout", "inf"], ["--duration", "inf"]])
def test_bench_waits_are_capped(flags):
    one_line_exit_2(cli("bench", "--url", "http://127.0.0.1:9", "--model", "m", *flags))


def test_nan_connect_timeout_is_refused(tmp_path):
    path = inventory(tmp_path, "ssh:\n  connect_timeout: .nan\nnodes:\n  - name: n1\n"
                               "    address: 10.0.0.1\n")
    one_line_exit_2(cli("-i", str(path), "inventory"), "connect_timeout")


# ---------------------------------------------------------------- 3. crashes on odd input


@pytest.mark.parametrize("base,key,raw", [
    ("qwen3-30b-a3b.json", "num_experts", '"eight"'),
    ("qwen3-30b-a3b.json", "num_experts_per_tok", "[2]"),
    ("qwen3-30b-a3b.json", "moe_intermediate_size", "Infinity"),
    ("mixtral-8x7b-instruct-v0.1.json", "num_local_experts", "NaN"),
    ("deepseek-v3.json", "kv_lora_rank", "-1"),
    ("llama-3.1-8b.json", "num_hidden_layers", "1000000000000000000"),
    ("llama-3.1-8b.json", "num_hidden_layers", "1e400"),
    ("llama-3.1-8b.json", "layer_types", "7"),
])
def test_odd_model_config_values(tmp_path, base, key, raw):
    config = json.loads((MODELS / base).read_text())
    config[key] = "@@VALUE@@"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config).replace('"@@VALUE@@"', raw))
    one_line_exit_2(cli("plan", "--model", str(folder), "--json"))


def test_deep_json_config(tmp_path):
    folder = tmp_path / "deep"
    folder.mkdir()
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    one_line_exit_2(cli("plan", "--model", str(folder)))


@pytest.mark.parametrize("content,needle", [
    ("nodes: [{name: a, address: 10.0.0.1}]\n".encode("utf-16"), "utf-16"),
    (b"nodes: [{name: \xff\xfe\xfa}]\n", "utf-8"),
    ("x:\n" + "".join("  " * i + "- \n" for i in range(1, 300)), ""),
])
def test_undecodable_or_deep_inventories(tmp_path, content, needle):
    one_line_exit_2(cli("-i", str(inventory(tmp_path, content)), "inventory"), needle)


def test_a_binary_file_as_inventory():
    one_line_exit_2(cli("-i", "/bin/ls", "inventory"))


@pytest.mark.parametrize("text,needle", [
    ("ssh:\n  command_timeout: .inf\n", "command_timeout"),
    ("expectations:\n  shm_min_bytes: .inf\n", "shm_min_bytes"),
    ("nodes:\n  - name: a\n    address: 10.0.0.1\n    port: 2020-13-45\n", "nodes[0].port"),
])
def test_infinite_or_misparsed_values(tmp_path, text, needle):
    if "nodes" not in text:
        text += "nodes:\n  - name: a\n    address: 10.0.0.1\n"
    path = inventory(tmp_path, text)
    proc = cli("-i", str(path), "inventory")
    one_line_exit_2(proc, needle)
    assert proc.stderr.startswith(f"cluster inventory: {path}:")


def test_run_dir_that_is_a_file(tmp_path):
    path = inventory(tmp_path, "run_dir: /etc/passwd\nnodes:\n  - name: a\n    address: 127.0.0.1\n")
    one_line_exit_2(cli("-i", str(path), "exec", "--", "true"), "/etc/passwd")


def test_runs_with_a_list_as_run_json(tmp_path):
    run = tmp_path / "runs" / "20260101-000000-000000-exec"
    run.mkdir(parents=True)
    (run / "run.json").write_text("[1, 2, 3]")
    path = inventory(tmp_path, "run_dir: runs\nnodes:\n  - name: a\n    address: 127.0.0.1\n")
    proc = cli("-i", str(path), "runs", "--json")
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr
    assert any("error" in r for r in json.loads(proc.stdout)["runs"])


def test_bench_bad_url():
    one_line_exit_2(cli("bench", "--url", "http://[::1", "--model", "m"))


def test_parse_stdin_closed():
    proc = cluster_cli("parse", "-", cwd=ROOT, timeout=GUARD_S)
    one_line_exit_2(proc)
    assert "None parser" not in proc.stderr


# ---------------------------------------------------------------- 4. wrong answers


@pytest.mark.parametrize("changes,needle", [
    ({"max_position_embeddings": -5}, "max_position_embeddings"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 7}, "num_key_value_heads"),
    ({"num_key_value_heads": 64}, "num_key_value_heads"),
    ({"num_local_experts": -8}, "num_local_experts"),
])
def test_inconsistent_model_configs_are_refused(tmp_path, changes, needle):
    one_line_exit_2(cli("plan", "--model", str(model(tmp_path, **changes)), "--json"), needle)


# ---------------------------------------------------------------- 5. validators


@pytest.mark.parametrize("node,needle", [
    ('{name: "x\\n", address: 10.0.0.1}', "name"),
    ("{name: a, address: 127.0.0.١}", "address"),
    ("{name: a, address: 10.0.0.1, port: ２２}", "port"),
    ("{name: a, address: 999.999.999.999}", "address"),
    ("{name: a, address: 10.0.0.1, jump_host: 'host:99999'}", "jump_host"),
    ("{name: a, address: 10.0.0.1, jump_host: 'host:0'}", "jump_host"),
])
def test_validators_mean_what_they_say(tmp_path, node, needle):
    path = inventory(tmp_path, f"nodes:\n  - {node}\n")
    one_line_exit_2(cli("-i", str(path), "inventory"), needle)


@pytest.mark.parametrize("expect,needle", [
    ('nvlink: "yes"', "nvlink"), ("infiniband:\n    required: maybe", "required"),
    ("clock:\n    max_offset_ms: .nan", "max_offset_ms"),
])
def test_expectations_are_strict(tmp_path, expect, needle):
    path = inventory(tmp_path, f"expectations:\n  {expect}\nnodes:\n  - name: a\n"
                               "    address: 10.0.0.1\n")
    one_line_exit_2(cli("-i", str(path), "inventory"), needle)


# ---------------------------------------------------------------- 6. security


def test_ssh_config_proxyjump_is_not_followed(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host 127.0.0.2\n  ProxyJump user@127.0.0.3:2223\n")
    (home / ".ssh" / "known_hosts").write_text("")
    path = inventory(tmp_path, "ssh:\n  connect_timeout: 2\nnodes:\n  - name: a\n"
                               "    address: 127.0.0.2\n    port: 1\n    local: false\n")
    proc = cli("-i", str(path), "exec", "--json", "--", "true", env={"HOME": str(home)})
    result = json.loads(proc.stdout)["results"][0]
    assert proc.returncode == 2 and result["status"] == "unreachable"
    assert "127.0.0.3" not in result["error"] and "2223" not in result["error"]


def test_dashboard_on_all_interfaces_is_a_warning(tmp_path):
    path = inventory(tmp_path, "ray:\n  dashboard_host: 0.0.0.0\nnodes:\n  - name: a\n"
                               "    address: 127.0.0.1\n")
    proc = cli("-i", str(path), "inventory", "--json")
    assert proc.returncode == 1 and "dashboard" in proc.stderr.lower()
    assert json.loads(proc.stdout)["warnings"]


def test_secret_looking_names_are_redacted(tmp_path):
    env = "".join(f"      {name}: value-{name.lower()}\n" for name in
                  ("DB_PASS", "PROXY_AUTH", "WEB_SESSION", "GCP_CREDENTIALS", "SSH_PRIVATE"))
    path = inventory(tmp_path, f"nodes:\n  - name: a\n    address: 127.0.0.1\n    env:\n{env}")
    proc = cli("-i", str(path), "inventory", "--json")
    assert proc.returncode == 0
    assert "value-" not in proc.stdout
