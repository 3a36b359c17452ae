"""`cluster parse` end to end: a real `python -m cluster` subprocess on fixture files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent


def _fixture(kind: str, prefix: str) -> Path:
    (path,) = sorted((FIXTURES / kind).glob(f"{prefix}*.txt"))
    return path


def cluster_parse(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "cluster", "parse", *args], cwd=REPO, env=env,
                          input=stdin, capture_output=True, text=True, timeout=120)


def test_autodetects_several_kinds_and_exits_0() -> None:
    files = [_fixture("ibstat", "001"), _fixture("chronyc-tracking", "003"),
             _fixture("ntpq", "005"), _fixture("df-shm", "001"), _fixture("timedatectl", "001")]
    proc = cluster_parse("--json", *map(str, files))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [o["file"] for o in out] == [str(f) for f in files]
    assert [o["kind"] for o in out] == ["ibstat", "chronyc-tracking", "ntpq", "df-shm",
                                        "timedatectl"]
    assert all(set(o) == {"file", "kind", "data"} for o in out)
    ibstat, tracking, ntpq, df, tdc = (o["data"] for o in out)
    assert [p["state"] for p in ibstat["ports"]] == ["Active", "Active", "Down"]
    assert tracking["synchronized"] is True and tracking["offset_seconds"] == -0.000671486
    assert ntpq["offset_ms"] == -122.38
    assert df["size_bytes"] == 126 * 1024 ** 3
    assert (tdc["synchronized"], tdc["ntp_active"]) == (False, False)


def test_explicit_kind_and_stdin() -> None:
    text = _fixture("ulimit", "003").read_text()
    proc = cluster_parse("--kind", "ulimit", "--json", "-", stdin=text)
    assert proc.returncode == 0, proc.stderr
    (out,) = json.loads(proc.stdout)
    assert out == {"file": "-", "kind": "ulimit",
                   "data": {"memlock_kib": 64, "memlock_hard_kib": 64, "scope": "hard",
                            "source": "ulimit -a"}}


def test_garbage_file_gives_error_object_and_exit_2(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("hello, this is not the output of any tool\n")
    good = _fixture("lsmod", "001")
    proc = cluster_parse("--json", str(good), str(garbage))
    assert proc.returncode == 2
    ok, bad = json.loads(proc.stdout)
    assert ok["kind"] == "lsmod" and ok["data"]["nvidia_peermem"] is True
    assert bad["file"] == str(garbage) and bad["kind"] is None and "data" not in bad
    assert "could not recognise" in bad["error"]


def test_wrong_kind_is_an_error_with_that_kind() -> None:
    path = _fixture("ibdev2netdev", "003")
    proc = cluster_parse("--kind", "chronyc-sources", "--json", str(path))
    assert proc.returncode == 2
    (out,) = json.loads(proc.stdout)
    assert out["kind"] == "chronyc-sources" and "cannot parse chronyc-sources" in out["error"]


def test_missing_file_is_an_error_object(tmp_path: Path) -> None:
    proc = cluster_parse("--json", str(tmp_path / "nope.txt"))
    assert proc.returncode == 2
    (out,) = json.loads(proc.stdout)
    assert out["kind"] is None and "cannot read" in out["error"]


def test_unknown_kind_is_a_usage_error() -> None:
    proc = cluster_parse("--kind", "no-such-kind", str(_fixture("ntpq", "001")))
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.parametrize("kind,prefix,expect", [
    ("ibv_devinfo", "003", "Init"),
    ("chronyc-sources", "001", "169.254.169.123"),
    ("ibdev2netdev", "001", "enp157s0f0np0"),
])
def test_human_rendering(kind: str, prefix: str, expect: str) -> None:
    proc = cluster_parse(str(_fixture(kind, prefix)))
    assert proc.returncode == 0, proc.stderr
    assert f"{kind}:" in proc.stdout and expect in proc.stdout


def test_human_rendering_of_an_error_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = cluster_parse(str(empty))
    assert proc.returncode == 2
    assert "empty" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
