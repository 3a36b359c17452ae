"""Issue 25 (security round 3), items 1, 4, 6, 7, 13 and 16: regression tests, each failing on
the code before the fix (7abd054).

1   `cluster up` chooses token auth when the head's Ray token is given in the inventory's `env:`
    (RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH), says which source decided it (never the value), and
    every on-head client finds the token the running Ray was started with.
4   the dashboard proxy answers only its own loopback Host names with its own port (DNS
    rebinding).
6   the proxy's own per-run credential (?token= in the printed URL, then an HttpOnly
    SameSite=Strict cookie); requests without it get 403.
7   state-changing requests need the proxy's own Origin (or Referer).
13  `cluster bench`: bounded decompression, bounded streaming statistics.
16  inventory numbers: no base 60, no underscores, no non-ASCII digits; colliding ports; an
    IPv4 address in brackets.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from cluster import inventory, ray_cluster, rollout
from cluster.node_programs import _common
from cluster.ray_cluster import REFUSE, START, plan_up
from cluster.shell import SECRET_ENV_FROM_STDIN
from fakes import RecordingSession
from test_ray_plan import INV, facts

TOKEN = "5f1e0c9a" * 8


# ---------------------------------------------------------------- 1: the auth mode `up` picks


def _with_env(text: str, node: str, env: str) -> str:
    """INV with `env` (a YAML flow mapping) given to `node`."""
    return text.replace(f"  - name: {node}\n", f"  - name: {node}\n    env: {env}\n", 1)


def _auth_mode(command: str) -> str | None:
    found = re.findall(r"\bRAY_AUTH_MODE=(\w+)", command)
    return found[-1] if found else None


@pytest.mark.parametrize("var,value", [("RAY_AUTH_TOKEN", TOKEN),
                                       ("RAY_AUTH_TOKEN_PATH", "/etc/ray/token")])
def test_a_token_in_the_heads_inventory_env_gives_token_mode_and_says_so(var, value):
    inv = inventory.loads(_with_env(INV, "gpu01", f"{{{var}: {value}}}"))
    f = {n: facts(n, auth_token=(n != "gpu01")) for n in ("gpu01", "gpu02", "gpu03")}
    plan = plan_up(inv, f, None)
    head = plan.action("gpu01")
    assert head.kind == START and _auth_mode(head.commands[0]) == "token"
    assert _auth_mode(plan.action("gpu02").commands[0]) == "token"
    assert plan.auth.mode == "token" and var in plan.auth.source and "gpu01" in plan.auth.source
    assert value not in plan.auth.source and value not in head.commands[0]
    assert plan.to_dict()["auth"] == {"mode": "token", "source": plan.auth.source}


def test_the_source_of_each_choice_is_named():
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    off = plan_up(inventory.loads(INV), f, None).auth
    assert off.mode == "disabled" and "no Ray token" in off.source
    found = plan_up(inventory.loads(INV), dict(f, gpu01=facts("gpu01", auth_token=True)),
                    None).auth
    assert found.mode == "token" and "~/.ray/auth_token" in found.source
    explicit = plan_up(inventory.loads(_with_env(INV, "gpu01", "{RAY_AUTH_MODE: disabled, "
                                                 f"RAY_AUTH_TOKEN: {TOKEN}}}")), f, None).auth
    assert explicit.mode == "disabled" and "RAY_AUTH_MODE" in explicit.source


def test_a_worker_whose_token_is_in_its_inventory_env_is_not_refused():
    text = _with_env(_with_env(INV, "gpu01", f"{{RAY_AUTH_TOKEN: {TOKEN}}}"), "gpu03",
                     f"{{RAY_AUTH_TOKEN: {TOKEN}}}")
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}   # the probe never sees the env
    plan = plan_up(inventory.loads(text), f, None)
    assert plan.action("gpu03").kind == START
    assert _auth_mode(plan.action("gpu03").commands[0]) == "token"
    assert plan.action("gpu02").kind == REFUSE and "token" in plan.action("gpu02").reason


def test_the_drain_client_gets_the_inventory_token_on_stdin_never_argv():
    inv = inventory.loads(_with_env(INV, "gpu01", f"{{RAY_AUTH_TOKEN: {TOKEN}}}"))
    cmd = rollout.drain_command(inv, "ab" * 28, "msg", auth_mode="token")
    assert cmd.startswith(SECRET_ENV_FROM_STDIN) and TOKEN not in cmd
    session = RecordingSession()
    ray_cluster.run_node_command(session, inv.head, cmd, 10)
    assert TOKEN in session.stdins[-1][1]


def _proc(root: Path, procs: dict[int, tuple[str, dict[str, str], str]],
          own_ns: str = "pid:[4026531836]") -> str:
    """A fake /proc: pid -> (comm, environ, PID namespace link); `self` in `own_ns`."""
    for pid, (comm, env, ns) in procs.items():
        d = root / str(pid)
        (d / "ns").mkdir(parents=True)
        (d / "comm").write_text(comm + "\n")
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()))
        os.symlink(ns, d / "ns" / "pid")
    (root / "self" / "ns").mkdir(parents=True)
    os.symlink(own_ns, root / "self" / "ns" / "pid")
    return str(root)


def test_on_the_head_the_running_rays_token_wins_over_a_default_file_it_did_not_read(tmp_path):
    """`ray start` got RAY_AUTH_TOKEN from the inventory (on its stdin): a client on the head
    (status, deploy, health job, nccl-check) must use that token, not ~/.ray/auth_token."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("stale-default-file\n")
    proc = _proc(tmp_path / "proc", {
        20: ("gcs_server", {"RAY_AUTH_TOKEN": "started-with"}, "pid:[4026531836]")})
    env = {"HOME": str(home)}
    assert _common.auth_token(env, scan_ray=True, proc=proc) == "started-with"
    assert _common.find_token(env, scan_ray=True, proc=proc)[1] == "ray process 20 RAY_AUTH_TOKEN"
    assert _common.auth_token(env, proc=proc) == "stale-default-file"       # no scan: the file
    assert _common.auth_token(dict(env, RAY_AUTH_TOKEN="mine"), scan_ray=True, proc=proc) == "mine"


def test_another_pid_namespaces_ray_is_not_this_nodes(tmp_path):
    """A simulated node's (or a container's) Ray is another cluster's: its token is not used."""
    proc = _proc(tmp_path / "proc", {
        30: ("raylet", {"RAY_AUTH_TOKEN": "other-cluster"}, "pid:[4026532999]")})
    assert _common.auth_token({"HOME": str(tmp_path / "nobody")}, scan_ray=True, proc=proc) \
        is None


def test_every_on_head_client_scans_for_the_running_rays_token():
    """The programs that talk to the head's Ray with its token (status, nccl-check, the
    health job; deploy's dashboard program already did) read it as _common.find_token does."""
    from cluster.node_programs import source
    for name in ("head_state", "nccl_job", "health_submit", "dashboard"):
        text = source(name)
        assert re.search(r"auth_token\([^)]*scan_ray=True", text.split("def find_token")[-1]), \
            name
