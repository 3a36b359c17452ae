"""Security round 4 (issue 39), the file-system items, each reproduced with the real on-node
programs run here as root (the way a node runs them):

- item 1: model_copy.py's `--dir` (the compile cache's `<root>/torch_compile_cache/<hash>`, under
  the Ray user's home) is walked from / without following a link and without entering a
  directory another user may change; inside a user's directory it writes as that user, never
  as root, and ships only what that user can read; absurd sizes are refused before anything.
- item 3's last clause: a 0600 / 0640 weight keeps its mode on the receiving node.
- item 6: engine_logs.py never waits on a FIFO swapped in for a log, nor reads through a
  symbolic link at serve/.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fakes import closed_port, model_copy_fetch as fetch, model_copy_program as program

NOBODY = 65534
TAG = "r4" + secrets.token_hex(4)
ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the node programs run as root")


@pytest.fixture
def open_base():
    """A directory every user may traverse (0755, root's; tmp_path's parents are 0700), removed
    after the test."""
    base = Path(tempfile.mkdtemp(prefix="r4fs-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def served(tmp_path):
    """A source directory served on loopback: 0600, 0640 and 0755 files."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {"config.json": (b'{"model_type": "llama"}\n', 0o640),
             "sub/model.safetensors": (os.urandom(1 << 20), 0o600),
             "run.sh": (b"#!/bin/sh\n", 0o755)}
    for path, (data, mode) in files.items():
        (src / path).write_bytes(data)
        (src / path).chmod(mode)
    token = secrets.token_urlsafe(24)
    port = closed_port()
    started = program("serve", "--dir", str(src), "--bind", "127.0.0.1", "--port", str(port),
                      "--for", "60", "--tag", TAG, data=token + "\n")
    assert started.get("port") == port, started
    entries = program("manifest", "--dir", str(src))["files"]
    yield src, files, entries, token, f"http://127.0.0.1:{port}"
    program("stop", "--pid", str(started["pid"]), "--tag", TAG)


def _tree(root: Path) -> list[Path]:
    return [root] + sorted(root.rglob("*"))


# ---------------------------------------------------------------- item 1: the walk from /


@pytest.mark.parametrize("level", ["dir", "above"])
def test_a_link_at_or_above_dir_is_refused_and_nothing_lands_in_its_target(served, tmp_path,
                                                                            level):
    """The Ray user replaces the hash directory (or the one above it) by a link to /root/.ssh:
    root must not write the relayed files there (it did: they landed in the link's target)."""
    _src, _files, entries, token, url = served
    target = tmp_path / "root-ssh"
    target.mkdir(mode=0o700)
    cache = tmp_path / "home" / "ray" / ".cache" / "vllm" / "torch_compile_cache"
    cache.mkdir(parents=True)
    if level == "dir":
        (cache / "0123456789").symlink_to(target)
        dst = cache / "0123456789"
    else:
        (cache / "torch_aot_compile").symlink_to(target)
        dst = cache / "torch_aot_compile" / ("a" * 64)
    doc = fetch(dst, url, token, entries)
    assert "link" in doc.get("error", ""), doc
    assert list(target.rglob("*")) == []


def test_a_relay_into_a_linked_dir_is_refused(tmp_path):
    """The relay verb (what --stage-caches runs) refuses the same link before it starts."""
    target = tmp_path / "etc-cron.d"
    target.mkdir()
    (tmp_path / "hash").symlink_to(target)
    entry = {"path": "evil", "size": 3, "sha256": hashlib.sha256(b"x\n\n").hexdigest(),
             "mode": 0o644}
    doc = program("relay", "--dir", str(tmp_path / "hash"), "--bind", "127.0.0.1",
                  "--ports", str(closed_port()), "--for", "30", "--tag", TAG,
                  data=secrets.token_urlsafe(24) + "\n" + json.dumps(
                      {"files": [entry], "fetch": ["evil"],
                       "upstreams": [f"http://127.0.0.1:{closed_port()}"]}))
    if "pid" in doc:
        program("stop", "--pid", str(doc["pid"]), "--tag", TAG)
    assert "link" in doc.get("error", ""), doc
    assert list(target.rglob("*")) == []


def test_a_directory_another_user_may_change_is_refused(served, open_base):
    """A component writable by others (not sticky) or owned by a third user: refused."""
    _src, _files, entries, token, url = served
    shared = open_base / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    doc = fetch(shared / "model", url, token, entries)
    assert "writable by its group or others" in doc.get("error", ""), doc
    assert not (shared / "model").exists()
    other = open_base / "other"
    other.mkdir()
    os.chown(other, NOBODY, NOBODY)
    (other / "rootdir").mkdir()                  # root's, inside nobody's: nobody can swap it
    doc = fetch(other / "rootdir" / "model", url, token, entries)
    assert "give the path one owner" in doc.get("error", ""), doc
    assert list((other / "rootdir").iterdir()) == []


@pytest.fixture
def private_user():
    """A throwaway user with its own group (a user private group), removed after the test."""
    if not shutil.which("useradd"):
        pytest.skip("no useradd here")
    name = "r4" + secrets.token_hex(4)
    subprocess.run(["useradd", "--user-group", "--no-create-home", name], check=True,
                   capture_output=True)
    try:
        import pwd
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def test_group_write_is_accepted_only_for_the_owners_private_group(served, open_base,
                                                                   private_user):
    """umask 002 homes (0775, the user's own group) are the user's alone; a 0775 directory of a
    group others share is not."""
    _src, files, entries, token, url = served
    uid, gid = private_user.pw_uid, private_user.pw_gid
    home = open_base / "home"
    home.mkdir()
    os.chown(home, uid, gid)
    home.chmod(0o775)
    doc = fetch(home / "cache", url, token, entries)
    assert doc.get("ok") == len(files), doc
    assert {p.lstat().st_uid for p in _tree(home / "cache")} == {uid}
    shared = open_base / "shared-group"
    shared.mkdir()
    os.chown(shared, uid, NOBODY)                 # nogroup: the primary group of several users
    shared.chmod(0o775)
    doc = fetch(shared / "cache", url, token, entries)
    assert "writable by its group" in doc.get("error", ""), doc
    assert not (shared / "cache").exists()


def test_inside_a_users_directory_the_copy_is_written_as_that_user(served, open_base):
    """A cache under the Ray user's home: every directory and file the fetch makes is the
    user's (the program became the user), none is root's; the modes are the source's."""
    _src, files, entries, token, url = served
    home = open_base / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    dst = home / ".cache" / "vllm" / "torch_compile_cache" / "0123456789"
    doc = fetch(dst, url, token, entries)
    assert doc.get("ok") == len(files), doc
    made = _tree(home / ".cache")
    assert len(made) == 4 + 1 + len(files)
    assert {p.lstat().st_uid for p in made} == {NOBODY}, [(p, p.lstat().st_uid) for p in made]
    for path, (data, mode) in files.items():
        assert (dst / path).read_bytes() == data
        assert stat.S_IMODE((dst / path).lstat().st_mode) == mode


def test_a_relay_into_the_ray_users_cache_writes_as_that_user(tmp_path, open_base):
    """--stage-caches' shape: the relay (playbooks/relay.py) into each node's cache directory
    under the user's home; every node's copy is the user's, the source's modes kept."""
    from fakes import local_cluster, relay_all, write_model

    names = ["src", "a", "b"]
    inv, dirs, _ = local_cluster(tmp_path, names)
    for n in names:
        home = open_base / n
        home.mkdir()
        os.chown(home, NOBODY, NOBODY)
        dirs[n] = home / ".cache" / "vllm" / "torch_compile_cache" / "0123456789"
    src = open_base / "staging"
    write_model(src, {"w.bin": os.urandom(3 << 20), "sub/meta.json": b"{}\n"})
    (src / "w.bin").chmod(0o640)
    dirs["src"].parent.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(src), str(dirs["src"])], check=True)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(open_base / "src")], check=True)
    _ref, _plans, report, _after = relay_all(inv, dirs, lambda node: str(dirs[node.name]), names)
    assert report.errors == {}, report.errors
    for n in names[1:]:
        made = _tree(open_base / n / ".cache")
        assert {p.lstat().st_uid for p in made} == {NOBODY}, n
        assert stat.S_IMODE((dirs[n] / "w.bin").lstat().st_mode) == 0o640
        assert (dirs[n] / "w.bin").read_bytes() == (src / "w.bin").read_bytes()


def test_a_file_the_directorys_owner_cannot_read_is_never_shipped(open_base):
    """Root's 0600 file inside the user's cache directory: the manifest (and the server) run
    as the user, so it is skipped, not hashed and listed."""
    cache = open_base / "cache"
    cache.mkdir()
    (cache / "ok.bin").write_bytes(b"the user's own bytes\n")
    (cache / "root-only.bin").write_bytes(b"root's secret\n")
    (cache / "root-only.bin").chmod(0o600)
    os.chown(cache, NOBODY, NOBODY)
    os.chown(cache / "ok.bin", NOBODY, NOBODY)
    doc = program("manifest", "--dir", str(cache))
    assert [e["path"] for e in doc["files"]] == ["ok.bin"], doc
    assert "root-only.bin" in doc["skipped"]


def test_absurd_sizes_are_refused_before_anything_is_made(open_base):
    """A listing of 32 TiB files: refused whole, no directory made."""
    dst = open_base / "dst"
    entry = {"path": "x", "size": 1 << 45, "sha256": "0" * 64, "mode": 0o644}
    doc = fetch(dst, f"http://127.0.0.1:{closed_port()}", secrets.token_urlsafe(24), [entry])
    assert "bad file entry" in doc.get("error", ""), doc
    assert not dst.exists()


# ---------------------------------------------------------------- item 3: modes kept


@pytest.mark.parametrize("umask", [0o077, 0o000])
def test_a_0600_or_0640_weight_keeps_its_mode_whatever_the_umask(served, tmp_path, umask):
    _src, files, entries, token, url = served
    dst = tmp_path / "dst"
    old = os.umask(umask)
    try:
        doc = fetch(dst, url, token, entries)
    finally:
        os.umask(old)
    assert doc.get("ok") == len(files), doc
    for path, (_data, mode) in files.items():
        assert stat.S_IMODE((dst / path).lstat().st_mode) == mode, path


def test_a_relayed_0600_weight_stays_0600_on_every_node(tmp_path):
    """Through the laptop's relay (playbooks/relay.py) on loopback nodes."""
    from fakes import local_cluster, relay_all, write_model

    names = ["src", "a", "b"]
    inv, dirs, dir_of = local_cluster(tmp_path, names)
    write_model(dirs["src"], {"w.safetensors": os.urandom(4096), "config.json": b"{}\n"})
    (dirs["src"] / "w.safetensors").chmod(0o600)
    (dirs["src"] / "config.json").chmod(0o640)
    _ref, _plans, report, _after = relay_all(inv, dirs, dir_of, names)
    assert report.errors == {}, report.errors
    for n in names[1:]:
        assert stat.S_IMODE((dirs[n] / "w.safetensors").lstat().st_mode) == 0o600
        assert stat.S_IMODE((dirs[n] / "config.json").lstat().st_mode) == 0o640


# ---------------------------------------------------------------- item 6: engine logs


def _collector(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=20, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _ray_logs(root: Path) -> tuple[Path, Path]:
    session = root / "ray" / "session_2026-12-01_22-00-00_000000_1"
    (session / "logs").mkdir(parents=True)
    (root / "ray" / "session_latest").symlink_to(session.name)
    return root / "ray" / "session_latest" / "logs", session / "logs"


def test_a_fifo_swapped_in_for_a_log_is_skipped_without_waiting(tmp_path):
    """The listing saw a regular file; by the open it is a FIFO with no writer: the reader
    returns at once with nothing (it blocked until the SSH timeout before)."""
    _latest, real = _ray_logs(tmp_path)
    os.mkfifo(real / "worker-0a-01-42.err")
    code = ("import sys, os; from cluster.node_programs import engine_logs as e\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "print(e.kept_lines(fd, 'worker-0a-01-42.err', 100)"
            " if e.kept_lines.__code__.co_argcount == 3"
            " else e.kept_lines(os.path.join(sys.argv[1], 'worker-0a-01-42.err'), 100))")
    try:
        res = _collector(code, str(real))
    except subprocess.TimeoutExpired:
        pytest.fail("engine_logs waited on a FIFO")
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr


def test_a_linked_serve_directory_is_not_followed(tmp_path):
    from cluster.node_programs import source

    latest, real = _ray_logs(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "replica_x.log").write_text("NCCL INFO Using network IB (from elsewhere)\n")
    (real / "serve").symlink_to(elsewhere)
    (real / "worker-0a-01-42.err").write_text("NCCL INFO Using network Socket\n")
    res = subprocess.run([sys.executable, "-", str(latest), "0"], input=source("engine_logs"),
                         capture_output=True, text=True, timeout=60)
    doc = json.loads(res.stdout)
    assert doc["error"] is None and [f["path"] for f in doc["files"]] == ["worker-0a-01-42.err"]
