"""The scripting contract, checked over the CLI's explicit registry (cluster/cli.py COMMANDS):

- every command that changes nodes has --dry-run and --yes;
- without a terminal a confirmation never prompts: it is an error (exit 2) unless --yes;
- every command that reports has --json;
- exit codes: 0 ok, 1 warnings, 2 failures / bad usage / bad inventory, never a traceback;
- every command that contacts nodes writes a run directory (run.json, per-node logs, its JSON
  report), and `cluster runs --json` lists it.

The run-directory check drives each node command for real against an inventory whose nodes are
SSH endpoints on a closed loopback port (connection refused at once: no network beyond loopback).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import cli
from cluster.commands import _common
from cluster.base.errors import UsageError
from fakes import closed_port as _closed_port, cluster_cli, write_inventory

REPO = Path(__file__).resolve().parents[1]

# Commands that change nodes (those of them that exist in the registry are checked).
CHANGING = {"up", "down", "deploy", "undeploy", "tune", "drain", "restart-node", "fix",
            "uncordon"}
# Commands exempt from --json, with the reason.
NO_JSON = {"dashboard": "an interactive SSH tunnel that runs until Ctrl-C; it prints one URL",
           "completion": "prints shell code for eval, no report"}
# Commands that contact nodes -> argv that reaches the nodes (each must write a run directory).
NODE_COMMANDS = {
    "exec": ["--", "true"],
    "preflight": ["--no-clock-skew"],
    "fix": ["--yes"],
    "up": ["--skip-preflight", "--yes"],
    "down": ["--yes"],
    "status": [],
    "deploy": ["--model", "/models/tiny", "--yes"],
    "undeploy": ["some-app", "--yes"],
    "nccl-check": [],
    "drain": ["node2", "--yes"],
    "restart-node": ["node2", "--yes"],
    "uncordon": ["node2", "--yes"],
    "model": ["pull", "node1:/models/m", "--path", "/models/m"],
}
# Local commands: no node is contacted, no run directory (the reason is their whole job).
LOCAL_ONLY = {"init", "inventory", "runs", "parse", "plan", "bench", "dashboard", "completion"}


def registry() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name, _module in cli.COMMANDS}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_every_command_is_classified():
    names = set(registry())
    unclassified = names - set(NODE_COMMANDS) - LOCAL_ONLY - {"tune"}
    assert not unclassified, f"classify these commands in this test: {sorted(unclassified)}"


@pytest.mark.parametrize("name", sorted(CHANGING))
def test_changing_commands_have_dry_run_and_yes(name):
    parsers = registry()
    if name not in parsers:
        pytest.skip(f"`cluster {name}` is not in cluster/cli.py COMMANDS")
    assert {"--dry-run", "--yes"} <= options(parsers[name])


@pytest.mark.parametrize("name", [n for n, _ in cli.COMMANDS])
def test_every_reporting_command_has_json(name):
    if name in NO_JSON:
        pytest.skip(NO_JSON[name])
    assert "--json" in options(registry()[name])


@pytest.mark.parametrize("name", ["up", "down"])
def test_rolling_commands_have_serial(name):
    assert "--serial" in options(registry()[name])


def test_confirm_without_terminal_never_prompts(monkeypatch):
    monkeypatch.setattr(_common, "interactive", lambda: False)
    monkeypatch.setattr("builtins.input", lambda *_: pytest.fail("prompted without a terminal"))
    with pytest.raises(UsageError, match="pass --yes"):
        _common.confirm("Stop Ray on node2?", yes=False)
    assert _common.confirm("Stop Ray on node2?", yes=True) is True


def test_confirmation_through_the_cli_with_stdin_not_a_tty(tmp_path):
    """A real command that must ask (init over an existing file asks nothing: it needs --force;
    confirm() is the only prompt): run a subprocess whose stdin is /dev/null and check the
    question becomes exit 2 with one line naming --yes."""
    code = ("import sys\n"
            "from cluster.cli import main\n"
            "from cluster.commands import _common\n"
            "import argparse\n"
            "def run(args):\n"
            "    _common.confirm('Restart Ray on node2?', args.yes)\n"
            "    return 0\n"
            "from cluster import cli\n"
            "orig = cli.build_parser\n"
            "def build(*args):\n"
            "    p = orig()  # every command registered, plus 'ask'\n"
            "    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))\n"
            "    q = sub.add_parser('ask'); _common.add_changing(q); q.set_defaults(handler=run)\n"
            "    return p\n"
            "cli.build_parser = build\n"
            "sys.exit(main(sys.argv[1:]))\n")
    no = subprocess.run([sys.executable, "-c", code, "ask"], cwd=REPO, stdin=subprocess.DEVNULL,
                        capture_output=True, text=True, timeout=60)
    assert no.returncode == 2 and "pass --yes" in no.stderr and "Traceback" not in no.stderr
    yes = subprocess.run([sys.executable, "-c", code, "ask", "--yes"], cwd=REPO,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert yes.returncode == 0, yes.stderr


@pytest.mark.parametrize("argv", [
    ["no-such-command"],
    ["up", "--serial", "-1"],
    ["down", "--serial", "x"],
    ["up", "--stagger", "-1"],
    ["drain"],
    ["exec"],
    ["fix", "--checks", "shm;reboot"],
    ["fix", "--checks", ""],
    ["fix", "--checks", "nosuchcheck", "--dry-run"],
])
def test_bad_usage_exits_2_without_traceback(tmp_path, argv):
    p = cluster_cli(*argv, cwd=tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr


def test_bad_inventory_exits_2_with_one_line(tmp_path):
    bad = write_inventory(tmp_path, "nodes:\n  - name: 'a;reboot'\n")
    for command in ("status", "up", "drain", "restart-node"):
        args = [command] + (["node2"] if command in ("drain", "restart-node") else [])
        p = cluster_cli("-i", str(bad), *args, "--json", cwd=tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr
        assert f"{bad}:2" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_help_of_every_command_exits_0(tmp_path):
    for name, _ in cli.COMMANDS:
        p = cluster_cli(name, "--help", cwd=tmp_path)
        assert p.returncode == 0, (name, p.stderr)


@pytest.fixture
def unreachable_inventory(tmp_path) -> Path:
    port = _closed_port()
    (tmp_path / "known_hosts").write_text("")
    inv = write_inventory(tmp_path, f"""\
                 ssh:
                   known_hosts: {tmp_path}/known_hosts
                   connect_timeout: 3
                 nodes:
                   - name: node1
                     role: head
                     address: 127.0.0.1
                     port: {port}
                     local: false
                   - name: node2
                     address: 127.0.0.2
                     port: {port}
                     local: false
                     env:
                       HF_TOKEN: hf_contract_token_value
                 run_dir: {tmp_path}/runs
                 """)
    return inv


@pytest.mark.parametrize("name", sorted(NODE_COMMANDS))
def test_node_commands_write_a_run_directory_and_exit_2_when_unreachable(
        name, unreachable_inventory, tmp_path):
    if name not in registry():
        pytest.skip(f"`cluster {name}` is not registered")
    env = {**os.environ, "CLUSTER_API_KEY": "sk-contract-api-key"}
    env.pop("CLUSTER_RUN_DIR", None)
    p = cluster_cli("-i", str(unreachable_inventory), name, "--json", *NODE_COMMANDS[name],
             cwd=tmp_path, env=env, timeout=180)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    json.loads(p.stdout)  # --json: one JSON document on stdout, even on failure
    runs = sorted((tmp_path / "runs").glob("*"))
    assert len(runs) == 1, f"{name} wrote {len(runs)} run directories"
    run = runs[0]
    meta = json.loads((run / "run.json").read_text())
    assert meta["exit_code"] == 2 and meta["finished"]
    reports = [f for f in run.glob("*.json") if f.name != "run.json"]
    assert reports, f"{name}: no JSON report in {run}"
    logs = list((run / "nodes").glob("*.log"))
    assert logs, f"{name}: no per-node command log in {run}"
    assert "unreachable" in "".join(f.read_text() for f in logs)
    for f in run.rglob("*"):
        if f.is_file():
            text = f.read_text()
            assert "hf_contract_token_value" not in text and "sk-contract-api-key" not in text, f
    assert "hf_contract_token_value" not in p.stdout + p.stderr
    listed = cluster_cli("-i", str(unreachable_inventory), "runs", "--json", cwd=tmp_path, env=env)
    assert listed.returncode == 0
    assert [r["path"] for r in json.loads(listed.stdout)["runs"]] == [str(run)]
