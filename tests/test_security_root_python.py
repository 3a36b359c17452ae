"""Issue 39 (security round 4), items 2 and 4: nothing of a virtualenv a non-root user can write
runs as root (node programs as root are `python -I -S`, stdlib-only; the hub pull runs as the
SSH user; preflight warns when a non-root user can change ray.python), and the hub token
travels only over https, only to the pull, and is never cut into a leaking prefix.

The venv tests build a throwaway virtualenv in tmp_path whose site-packages carries a .pth
file, a sitecustomize and a usercustomize that each write a marker (the Ray user who owns the
inventory's ray.python), and run the real root call sites' commands with bash here, in a
working directory holding a planted json.py and with PYTHONPATH pointing at it.
"""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from cluster.base.errors import RemoteError
from cluster.base.results import Status
from cluster.nodes.inventory import loads
from cluster.nodes.remote import CommandResult
from fakes import FakeRunner, check_probes, cluster_cli, judge, probe_output

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO))       # this checkout's package, from any cwd
TOKEN = "zq9Kx7TokenValueForTheHub0123456789"
MARKERS = ("pth", "sitecustomize", "usercustomize", "cwd-json")


def hostile_venv(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(python, site-packages, the planted cwd): a venv whose site runs code, a cwd whose
    json.py does; each writes tmp_path/ran-KIND."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120, capture_output=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import site;print(site.getsitepackages()[0])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    write = "open({!r}, 'w').close()"
    (site / "evil.pth").write_text("import os; " + write.format(str(tmp_path / "ran-pth")) + "\n")
    (site / "sitecustomize.py").write_text(write.format(str(tmp_path / "ran-sitecustomize")))
    (site / "usercustomize.py").write_text(write.format(str(tmp_path / "ran-usercustomize")))
    home = tmp_path / "home"
    home.mkdir()
    (home / "json.py").write_text(write.format(str(tmp_path / "ran-cwd-json")))
    return python, site, home


def ran(tmp_path: Path) -> list[str]:
    return [m for m in MARKERS if (tmp_path / f"ran-{m}").exists()]


def local_inventory(python: Path | str, env: dict | None = None, user: str | None = None,
                    root_python: Path | str | None = None):
    node = {"name": "here", "address": "127.0.0.1", "local": True, "role": "head"}
    if env:
        node["env"] = env
    if user:
        node["user"] = user
    ray = {"python": str(python)}
    if root_python is not None:
        ray["root_python"] = str(root_python)
    return loads(json.dumps({"nodes": [node], "ray": ray}))


def run_here(cwd: Path) -> FakeRunner:
    """Nodes that run each command with bash here, in `cwd`, with PYTHONPATH = cwd (the
    attacker's)."""
    def respond(sent):
        start = time.monotonic()
        p = subprocess.run(["bash", "-c", sent.command], input=sent.stdin or "",
                           capture_output=True, text=True, timeout=120, cwd=cwd,
                           env=dict(os.environ, PYTHONPATH=str(cwd)))
        return CommandResult(sent.node, sent.command, p.returncode, p.stdout, p.stderr,
                             time.monotonic() - start, "ok")
    return FakeRunner(respond=respond)


# ---------------------------------------------------------------- item 2: root runs no site


def test_root_never_starts_the_ray_users_interpreter(tmp_path):
    """Root's node programs run with ray.root_python (default /usr/bin/python3, only root can
    change it), never ray.python: -S keeps a venv's site-packages out, but not a changed
    interpreter, pyvenv.cfg or stdlib of a venv the Ray user owns."""
    from cluster.remedy.model_sync import Manifest
    from playbooks.relay import manifests

    python, _site, home = hostile_venv(tmp_path)
    inv = local_inventory(python)
    assert inv.ray.root_python == "/usr/bin/python3"
    nodes = run_here(home)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    got = manifests(inv, nodes.session(inv), [inv.head], True, lambda n: str(model))
    assert isinstance(got["here"], Manifest), got
    assert nodes.sent and not [c for c in nodes.commands() if str(python) in c]
    assert all(c.startswith("/usr/bin/python3 -I -S ") for c in nodes.commands())
    assert ran(tmp_path) == []


def test_a_relative_root_python_is_refused():
    from cluster.base.errors import InventoryError
    from cluster.node_programs import program_call

    with pytest.raises(InventoryError, match="root_python: must be an absolute path"):
        local_inventory("/venv/bin/python", root_python="python3")
    with pytest.raises(ValueError, match="absolute interpreter path"):
        program_call("python3", "fix_files", ["check"], stdin="{}", wrap=lambda c: c)


def test_root_node_programs_run_none_of_a_user_writable_virtualenvs_code(tmp_path):
    """Defence in depth: even with a hostile venv as ray.root_python, the relay's manifest (as
    root through playbooks/relay.py) and fix_files (as root through fixes.as_root) answer, and
    nothing planted in its site-packages ran (`-I -S`)."""
    from cluster.node_programs import document_of, program_call, run_call
    from cluster.remedy.fixes import as_root
    from cluster.remedy.model_sync import Manifest
    from playbooks.relay import manifests

    python, _site, home = hostile_venv(tmp_path)
    inv = local_inventory(python, root_python=python)
    node = inv.head
    nodes = run_here(home)
    session = nodes.session(inv)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    got = manifests(inv, session, [node], True, lambda n: str(model))
    assert isinstance(got["here"], Manifest), got
    assert [f.path for f in got["here"].files] == ["config.json"]
    call = program_call(str(python), "fix_files", ["check"],
                        stdin=json.dumps({"files": [str(tmp_path / "x")], "dirs": []}),
                        wrap=lambda command: as_root(command, node, inv, True))
    doc = document_of(run_call(session, node, call), "fix_files")
    assert isinstance(doc, dict) and doc.get("files"), doc
    assert all(" -I -S " in c for c in nodes.commands()), nodes.commands()
    assert ran(tmp_path) == []


def test_the_planted_code_does_run_without_the_root_flags(tmp_path):
    """The test's attack is real: the same venv run as a plain (non-root) program call runs
    the .pth and sitecustomize (so the test above can fail)."""
    from cluster.node_programs import program_call, run_call

    python, _site, home = hostile_venv(tmp_path)
    inv = local_inventory(python)
    run_call(run_here(home).session(inv), inv.head, program_call(str(python), "reach", ["--help"]))
    assert {"pth", "sitecustomize"} <= set(ran(tmp_path))


def test_a_wrapped_program_is_isolated_and_one_with_third_party_imports_never_runs_as_root():
    import cluster.ray_jobs  # noqa: F401  (declares the on-head programs)
    from cluster.node_programs import AS_ROOT_FLAGS, declared_programs, node_imports, program_call

    names = sorted(declared_programs())
    assert "hf_pull" in names and "model_copy" in names
    for name in names:
        try:
            call = program_call("/venv/bin/python", name, ["x"], stdin="",
                                wrap=lambda c: "sudo -n bash -c " + c)
        except ValueError as exc:
            assert node_imports(name), name
            assert "never runs as root" in str(exc)
            continue
        assert not node_imports(name), name
        assert call.command.startswith("sudo -n bash -c /venv/bin/python " +
                                       " ".join(AS_ROOT_FLAGS) + " -c "), call.command
    with pytest.raises(ValueError):
        program_call("/venv/bin/python", "hf_pull", [], "{}", wrap=lambda c: c)


ROOT_WRAPPERS = {"as_root", "as_root_command", "root_wrap"}
# Where a root wrapper may be called other than as a program call's wrap=: its own definition,
# and `cluster fix`'s step runner (NodeExecutor.root: shell steps, never a python; checked).
WRAPPER_HOMES = {("cluster/remedy/fixes.py", "as_root"), ("playbooks/relay.py", "root_wrap"),
                 ("playbooks/fix.py", "root")}


def _called(func) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def test_every_root_call_site_runs_a_program_only_through_program_calls_wrap():
    """A scan of every module: a root wrapper is called only inside a `wrap=` argument (which
    program_call turns into `python -I -S`, stdlib only) or in its own home; and the commands
    `cluster fix` runs as root through NodeExecutor.root never name a python."""
    offenders, shell_steps = [], []
    for path in sorted([*(REPO / "cluster").rglob("*.py"), *(REPO / "playbooks").glob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text())
        safe: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "wrap":
                safe |= {id(n) for n in ast.walk(node.value)}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (rel, node.name) in WRAPPER_HOMES:
                safe |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _called(node.func)
            if name in ROOT_WRAPPERS and id(node) not in safe:
                offenders.append(f"{rel}:{node.lineno} {name}")
            if rel == "playbooks/fix.py" and name == "root" and node.args:
                shell_steps.append(ast.unparse(node.args[0]))
    assert offenders == []
    assert shell_steps and not [s for s in shell_steps if "python" in s.lower()]


def test_the_hub_pull_runs_as_the_ssh_user_never_through_sudo():
    """huggingface_hub is the node's (writable by the Ray user): the pull gets no sudo, site on."""
    from playbooks.model_pull import PullOptions, hub_download

    inv = loads(json.dumps({"ssh": {"user": "ray"}, "ray": {"python": "/home/ray/venv/bin/python"},
                            "nodes": [{"name": "n1", "address": "198.51.100.1", "role": "head",
                                       "env": {"HF_TOKEN": TOKEN}}]}))
    answer = CommandResult("n1", "", 0, '{"dir": "/m", "files": 1, "bytes": 1}\n', "", 0.1, "ok")
    nodes = FakeRunner(answer)
    got = hub_download(inv, nodes.session(inv), inv.head, "org/name", PullOptions("org/name"),
                       "/m", False)
    assert got["files"] == 1
    (sent,) = nodes.sent
    command, stdin = sent.command, sent.stdin
    assert "sudo" not in command and " -S " not in command, command
    assert command.startswith("/home/ray/venv/bin/python -c ")
    assert TOKEN not in command and TOKEN in stdin


# ---------------------------------------------------------------- item 2: preflight


def test_preflight_warns_when_a_non_root_user_can_change_ray_root_python(tmp_path):
    """The versions check warns when a non-root user can change ray.root_python (here a venv:
    its pyvenv.cfg decides the stdlib even under -S), naming what and why; nothing of a
    root-made venv is named, and a user's ray.python alone is no warning (root never runs
    it)."""
    python, site, _home = hostile_venv(tmp_path)
    venv = python.parent.parent
    inv = local_inventory(python, root_python=python)

    def verdict():
        command = check_probes("versions", inv, "here")["versions"]
        p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
        return judge("versions", inv, versions=probe_output("versions", p.stdout,
                                                               p.returncode, p.stderr, command))

    before = verdict()
    assert str(site) not in before.summary and "root runs" not in before.summary, before
    os.chown(site, 65534, 65534)              # site-packages: never read under -S
    assert "root runs" not in verdict().summary
    os.chown(venv, 65534, 65534)              # the Ray user ('nobody' here) owns the venv
    after = verdict()
    assert after.status is Status.WARN, after
    assert f"{venv} (uid 65534)" in after.summary and "root runs" in after.summary
    assert "only root can change" in after.fix
    os.chown(venv, 0, 0)
    os.chmod(venv, 0o777)                     # or everyone may write it
    assert "(everyone)" in verdict().summary
    user_venv = local_inventory(python)       # the Ray user's own ray.python, root's default
    command = check_probes("versions", user_venv, "here")["versions"]
    p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    plain = judge("versions", user_venv, versions=probe_output("versions", p.stdout,
                                                                p.returncode, p.stderr, command))
    assert "root runs" not in plain.summary, plain


# ---------------------------------------------------------------- item 4: the hub token


def _dry_pull(tmp_path: Path, endpoint: str, *flags: str) -> subprocess.CompletedProcess:
    inv = tmp_path / "cluster.yaml"
    inv.write_text(json.dumps({"nodes": [{"name": "here", "address": "127.0.0.1", "local": True,
                                          "role": "head", "env": {"HF_ENDPOINT": endpoint,
                                                                  "HF_TOKEN": TOKEN}}],
                               "run_dir": str(tmp_path / "runs")}))
    return cluster_cli("model", "pull", "org/name", "--path", str(tmp_path / "m"), "--dry-run",
                       *flags, cwd=tmp_path, env=ENV)


@pytest.mark.parametrize("endpoint,flags", [
    ("http://198.51.100.7:8080", ()),                        # a mirror over plain http
    ("http://198.51.100.7:8080", ("--allow-http-endpoint",)),  # the flag is for loopback only
    ("http://127.0.0.1:8080", ()),                           # loopback, but no flag
    ("https://user:pw@mirror.example", ()),                  # credentials in the URL
    ("ftp://mirror.example", ()),
])
def test_a_clear_text_hf_endpoint_is_refused_before_anything_runs(tmp_path, endpoint, flags):
    p = _dry_pull(tmp_path, endpoint, *flags)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "HF_ENDPOINT" in lines[0] and "Traceback" not in p.stderr
    assert TOKEN not in p.stdout + p.stderr


@pytest.mark.parametrize("endpoint,flags", [("https://mirror.example/hub", ()),
                                            ("http://127.0.0.1:8080", ("--allow-http-endpoint",)),
                                            ("http://[::1]:8080", ("--allow-http-endpoint",))])
def test_https_or_flagged_loopback_http_is_accepted(tmp_path, endpoint, flags):
    p = _dry_pull(tmp_path, endpoint, *flags)
    assert p.returncode == 0, (p.stdout, p.stderr)


def _hf_pull_main(doc: dict, monkeypatch, snapshot_download) -> dict:
    from cluster.node_programs import hf_pull

    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        types.SimpleNamespace(snapshot_download=snapshot_download))
    monkeypatch.setattr(os, "environ", dict(os.environ))
    return hf_pull.main(io.StringIO(json.dumps(doc)))


def test_the_node_side_refuses_an_http_endpoint_before_the_library_sees_the_token(monkeypatch):
    seen = []
    got = _hf_pull_main({"repo": "org/name", "dir": "/nonexistent/m", "token": TOKEN,
                         "endpoint": "http://198.51.100.7"}, monkeypatch,
                        lambda *a, **kw: seen.append(kw))
    assert seen == [] and "https" in got["error"]


def _leaks(text: str) -> list[str]:
    return [TOKEN[:k] for k in range(4, len(TOKEN) + 1) if TOKEN[:k] in text]


def test_a_token_straddling_the_cut_leaves_no_prefix_in_the_error(monkeypatch):
    """The library's message holds the token across character 400: scrubbed before the cut."""
    def boom(*_a, **_kw):
        raise RuntimeError("x" * 370 + TOKEN + " was refused")

    got = _hf_pull_main({"repo": "org/name", "dir": "/nonexistent/m", "token": TOKEN}, monkeypatch,
                        boom)
    assert got["error"].startswith("RuntimeError: xxx") and _leaks(got["error"]) == []


def test_the_laptop_scrubs_the_nodes_error_before_cutting_it():
    from playbooks.model_pull import PullOptions, hub_download

    inv = loads(json.dumps({"nodes": [{"name": "n1", "address": "198.51.100.1", "role": "head",
                                       "env": {"HF_TOKEN": TOKEN}}]}))
    for error in ("y" * 360 + TOKEN, "y" * 50 + TOKEN + "z" * 400, "y" * 300 + TOKEN[:12]):
        answer = CommandResult("n1", "", 0, json.dumps({"error": error}) + "\n", "", 0.1, "ok")
        with pytest.raises(RemoteError) as caught:
            hub_download(inv, FakeRunner(answer).session(inv), inv.head, "org/name",
                         PullOptions("org/name"), "/m", False)
        assert _leaks(str(caught.value)) == [], str(caught.value)


def test_the_hub_token_never_rides_into_ray_start():
    """HF_TOKEN (and its older name) is the pull's only: not in `ray start`'s env nor on the
    stdin its secret exports come from (every Ray worker would inherit it)."""
    from cluster.nodes.ray_env import start_env
    from cluster.ray.ray_cluster import secret_env_stdin

    inv = loads(json.dumps({"nodes": [{"name": "n1", "address": "198.51.100.1", "role": "head",
                                       "env": {"HF_TOKEN": TOKEN, "HUGGING_FACE_HUB_TOKEN": TOKEN,
                                               "WANDB_API_KEY": "wb-value-1234"}}]}))
    env = start_env(inv.head, ray=inv.ray)
    assert "HF_TOKEN" not in env and "HUGGING_FACE_HUB_TOKEN" not in env
    assert env["WANDB_API_KEY"] == "wb-value-1234"
    stdin = secret_env_stdin(inv.head)
    assert TOKEN not in stdin and "WANDB_API_KEY" in stdin
