"""cluster.nodes.shell: the env prefix, secrets on stdin, sudo and here-docs hand exact bytes to the
process through a real bash and run nothing else."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from cluster.remedy import fixes
from cluster import node_programs
from cluster.ray import ray_cluster, ray_state
from cluster.nodes import shell

DUMP = shlex.join([sys.executable, "-c", "import json, os, sys; print(json.dumps("
                   "{'env': dict(os.environ), 'stdin': sys.stdin.read()}))"])


@pytest.fixture()
def nasty(tmp_path):
    canary = tmp_path / "canary"
    return canary, {"SEMI": f"a; touch {canary}", "SUBST": f"$(touch {canary})",
                    "TICK": f"`touch {canary}`", "QUOTES": "it's \"x\"", "GLOB": "* ?",
                    "BACKSLASH": "a\\b", "SPACE": " lead trail "}


def _bash(command: str, stdin: str = "") -> dict:
    out = subprocess.run(["bash", "-c", command], input=stdin, capture_output=True, text=True,
                         timeout=30, check=True)
    return json.loads(out.stdout)


def test_the_helpers_are_the_ones_the_library_uses():
    assert ray_state.env_prefix is shell.env_prefix and ray_cluster.env_prefix is shell.env_prefix
    assert ray_cluster.SECRET_ENV_FROM_STDIN is shell.SECRET_ENV_FROM_STDIN
    # dashboard_api's request body now rides on the program's stdin (cluster/node_programs)
    assert node_programs.heredoc is shell.heredoc and fixes.as_root_command is shell.as_root_command


def test_env_prefix_hands_exact_values_and_runs_nothing(nasty):
    canary, env = nasty
    assert shell.env_prefix({}) == ""
    got = _bash(shell.env_prefix(env) + DUMP)["env"]
    assert {k: got[k] for k in env} == env and not canary.exists()


def test_secrets_come_from_stdin_not_argv(nasty):
    canary, env = nasty
    command = shell.SECRET_ENV_FROM_STDIN + " && " + DUMP
    assert not any(v in command for v in env.values())
    got = _bash(command, shell.export_lines(env))["env"]
    assert {k: got[k] for k in env} == env and not canary.exists()


def test_heredoc_body_arrives_verbatim_with_a_marker_not_in_it(nasty):
    canary, env = nasty
    body = "\n".join(env.values()) + "\nCLUSTER_EOF_\n$HOME"
    command = shell.heredoc(DUMP, body)
    marker = command.split("<<'", 1)[1].split("'", 1)[0]
    assert marker.startswith("CLUSTER_EOF_") and marker not in body
    assert _bash(command)["stdin"] == body + "\n" and not canary.exists()


def test_as_root_and_bash_commands_keep_the_command_one_word(nasty):
    canary, env = nasty
    inner = "echo " + shlex.quote(env["SEMI"])
    assert shlex.split(shell.bash_command(inner)) == ["bash", "-c", inner]
    assert shlex.split(shell.as_root_command(inner)) == ["sudo", "-n", "bash", "-c", inner]


def test_heredoc_is_the_same_command_for_the_same_body_and_steps_past_its_own_marker():
    body = "line one\nline two"
    assert shell.heredoc("cat", body) == shell.heredoc("cat", body)      # dry runs compare
    first = shell.heredoc("cat", body).split("<<'", 1)[1].split("'", 1)[0]
    hostile = body + "\n" + first                                     # holds that marker
    marker = shell.heredoc("cat", hostile).split("<<'", 1)[1].split("'", 1)[0]
    assert marker not in hostile
