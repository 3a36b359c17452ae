"""Issue 39 (security round 4) item 5: every folder the toolkit writes on a node is private
(mkdtemp, or made 0700 and refused when it is a link, another user's or writable by others), and
no node program or Ray job names a fixed /tmp path.

The other local user is simulated by chown to uid 65534 (nobody): they made the predictable
folder (or file) first and planted a link in it; the toolkit must never write through it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.node_programs import _common, dashboard, prometheus, reach, source
from cluster.ray import dashboard_api
from cluster.ray_jobs import nccl_allreduce

NOBODY = 65534
REPO = Path(__file__).resolve().parents[1]
SCANNED = ("cluster/node_programs", "cluster/ray_jobs", "serve_apps")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def planted_folder(path: Path, link_name: str, target: Path) -> Path:
    """Another user's world-writable folder at `path` holding a link `link_name` -> target."""
    path.mkdir()
    os.symlink(target, path / link_name)
    os.lchown(path / link_name, NOBODY, NOBODY)
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o777)
    return path


# ---------------------------------------------------------------- the fabric proof's NCCL ranks


def _fake_collective(seen: list):
    """What NCCL does with NCCL_DEBUG_FILE (fopen, which follows links), and what it saw."""
    def collective(self, *args, **kwargs):
        path = os.environ["NCCL_DEBUG_FILE"].replace(
            "%h", socket.gethostname().split(".")[0]).replace("%p", str(os.getpid()))
        st = os.stat(os.path.dirname(path))
        seen.append((os.path.dirname(path), st.st_uid, st.st_mode & 0o777))
        with open(path, "a") as fh:
            fh.write("NCCL INFO Channel 00/0 : 0[0] -> 1[1] via NET/IB/0\n")
        return {"time_s": 1.0, "small_time_s": None, "torch": "x", "nccl": "2.23"}
    return collective


@pytest.fixture
def fake_nccl(monkeypatch):
    for key in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.setenv(key, "unset-by-the-test")      # restored after the test
    seen: list = []
    monkeypatch.setattr(nccl_allreduce.RankWorker, "_collective", _fake_collective(seen))
    return seen


def test_a_rank_never_writes_its_nccl_log_through_another_users_folder(tmp_path, fake_nccl):
    victim = tmp_path / "authorized_keys"
    victim.write_text("root's file\n")
    host = socket.gethostname().split(".")[0]
    link = f"nccl.{host}.{os.getpid()}.log"
    planted = planted_folder(tmp_path / "cluster-nccl-check-sid", link, victim)
    out = nccl_allreduce.RankWorker("nccl", str(planted)).run(0, 2, "127.0.0.1", 1, 4, 0, 1, 5.0)
    assert victim.read_text() == "root's file\n"
    assert os.listdir(planted) == [link] and os.readlink(planted / link) == str(victim)
    assert out["error"] and "refused" in out["error"] and out["nccl_log"] is None


def test_a_rank_keeps_its_nccl_log_in_a_folder_of_its_own_and_removes_it(tmp_path, fake_nccl):
    worker = nccl_allreduce.RankWorker("nccl", str(tmp_path))
    out = worker.run(0, 2, "127.0.0.1", 1, 4, 0, 1, 5.0)
    assert out["error"] is None and "via NET/IB/0" in out["nccl_log"]
    folder, uid, mode = fake_nccl[0]
    assert Path(folder).parent == tmp_path and uid == os.geteuid() and mode == 0o700
    assert not os.path.exists(folder) and os.listdir(tmp_path) == []
    kept = nccl_allreduce.RankWorker("nccl")              # the node's temp dir, a new folder
    out = kept.run(0, 2, "127.0.0.1", 1, 4, 0, 1, 5.0, keep_log=True)
    assert out["error"] is None and os.path.isdir(fake_nccl[1][0]) and fake_nccl[1][2] == 0o700
    kept.remove_log()
    assert not os.path.exists(fake_nccl[1][0])


# ---------------------------------------------------------------- reach: no pid file at all


def _reach(*args: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-", *args], input=source("reach"),
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_reach_listener_writes_nothing_where_another_user_planted_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    tag = "t5plant" + os.urandom(3).hex()
    planted = Path("/tmp") / f"cluster-reach-{tag}.pid"          # yesterday's pid file name
    os.symlink(victim, planted)
    try:
        up = _reach("listen", "--ports", str(_free_port()), "--for", "20", "--tag", tag)
        try:
            assert up["pid"]
        finally:
            down = _reach("stop", "--tag", tag)
        assert down == {"stopped": up["pid"], "gone": True}
        assert victim.read_text() == "keep\n" and os.readlink(planted) == str(victim)
    finally:
        os.unlink(planted)


def test_reach_stop_never_signals_another_users_process_that_names_the_run(tmp_path):
    tag = "t5other" + os.urandom(3).hex()
    other = subprocess.Popen(["/bin/sh", "-c", "sleep 60; exit 0", "listen", "--tag", tag],
                             user=NOBODY, start_new_session=True)
    try:
        assert _reach("stop", "--tag", tag) == {"stopped": None}
        assert other.poll() is None
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()


# ---------------------------------------------------------------- the serve apply lock


def test_the_serve_lock_is_in_the_users_home_never_a_shared_tmp_path():
    assert dashboard_api.LOCK_FILE.startswith("~/")


def test_the_serve_lock_is_never_opened_in_another_users_folder(tmp_path):
    victim = tmp_path / "made-through-the-link"
    planted = planted_folder(tmp_path / "shared", "apply.lock", victim)
    out = dashboard.main(["apply", "http://127.0.0.1:9", "2", str(planted / "apply.lock")],
                         json.dumps({"remove": "a"}), env={}, proc=str(tmp_path))
    assert not victim.exists() and out["error"].startswith("PermissionError: refused")
    own = tmp_path / "home" / ".cache" / "cluster" / "apply.lock"
    out = dashboard.main(["apply", "http://127.0.0.1:9", "2", str(own)],
                         json.dumps({"remove": "a"}), env={}, proc=str(tmp_path))
    assert out["error"].startswith("URLError") and own.is_file()    # locked, then no dashboard
    assert os.stat(own.parent).st_mode & 0o777 == 0o700 and os.stat(own).st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- the head's Prometheus


def test_prometheus_start_refuses_another_users_folder_in_rays_temp_dir(tmp_path, capsys):
    root = tmp_path / "ray"
    root.mkdir()
    os.chmod(root, 0o777)                          # as Ray leaves /tmp/ray
    victim = tmp_path / "made-through-the-link"
    planted_folder(root / prometheus.OWN_DIR, "prometheus.log", victim)
    with pytest.raises(SystemExit) as exc:
        prometheus.main(["start", "--root", str(root), "--binary", "/bin/true",
                         "--config", "x", "--wait", "0"])
    assert "refused" in str(exc.value) and not victim.exists()
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------- the shared helper


def test_private_dir_makes_0700_tightens_its_own_and_refuses_links_and_others(tmp_path):
    made = _common.private_dir(str(tmp_path / "new"))
    assert os.stat(made).st_mode & 0o777 == 0o700
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)                          # an earlier makedirs left it readable
    _common.private_dir(str(mine))
    assert os.stat(mine).st_mode & 0o777 == 0o700
    os.symlink(mine, tmp_path / "link")
    writable = tmp_path / "writable"
    writable.mkdir()
    os.chmod(writable, 0o770)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    for refused in ("link", "writable", "theirs"):
        with pytest.raises(PermissionError, match="refused"):
            _common.private_dir(str(tmp_path / refused))
    assert os.stat(writable).st_mode & 0o777 == 0o770 and os.stat(theirs).st_uid == NOBODY
    with pytest.raises(FileExistsError):
        _common.create_private(str(tmp_path / "link"))


# ---------------------------------------------------------------- no fixed /tmp path on a node


TMP_PATH = re.compile(r"(?<![\w.~-])/(?:var/)?tmp(?:/|$)|/dev/shm(?:/|$)")


def _docstrings(tree: ast.AST) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _is_call_to(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and (
        getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name)


def fixed_tmp_paths(text: str, name: str = "<source>") -> list[str]:
    """Where the source names a fixed temporary path: a string with /tmp, /var/tmp or /dev/shm
    in it (docstrings aside), or a name joined to the temp dir (gettempdir()) by hand."""
    tree = ast.parse(text)
    docs = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs and TMP_PATH.search(node.value):
            hits.append(f"{name}:{node.lineno}: {node.value[:60]!r}")
        if _is_call_to(node, "join") and node.args and _is_call_to(node.args[0], "gettempdir"):
            hits.append(f"{name}:{node.lineno}: a path joined to gettempdir()")
    return hits


def test_the_scanner_catches_planted_fixed_tmp_paths():
    planted = '''
"""A docstring may say /tmp/ray is Ray's default."""
import os, tempfile
PID = "/tmp/cluster-reach-%s.pid"
LOCK = f"/var/tmp/{os.getpid()}.lock"
SHM = "/dev/shm/x"
def log_dir(sid):
    return os.path.join(tempfile.gettempdir(), "cluster-nccl-check-" + sid)
ok = tempfile.mkdtemp(prefix="cluster-")
'''
    hits = fixed_tmp_paths(planted)
    assert sorted(h.split(":")[1] for h in hits) == ["4", "5", "6", "8"], hits


def test_no_node_program_ray_job_or_serve_app_names_a_fixed_tmp_path():
    files = sorted(p for d in SCANNED for p in (REPO / d).glob("*.py"))
    assert len(files) > 20
    hits = [h for p in files for h in fixed_tmp_paths(p.read_text(), str(p.relative_to(REPO)))]
    assert hits == []
