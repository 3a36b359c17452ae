"""`cluster parse` end to end: a real `python -m cluster` subprocess on fixture files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import cluster_cli

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent


def _fixture(kind: str, prefix: str) -> Path:
    (path,) = sorted((FIXTURES / kind).glob(f"{prefix}*.txt"))
    return path


def cluster_parse(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return cluster_cli("parse", *args, env=env, input=stdin)


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


# ---- issue 17: bounded inputs, one-line errors, exit 2 -------------------------------------

def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("kind", [None, "nccl", "lsmod", "nvidia-smi-q"])
def test_dev_zero_is_refused_as_binary(kind: str | None) -> None:
    args = (["--kind", kind] if kind else []) + ["/dev/zero"]
    proc = cluster_parse(*args)
    _one_line_error(proc, "/dev/zero", "not text", "NUL")
    assert proc.stdout == ""


def test_dev_zero_with_json_is_an_error_object() -> None:
    proc = cluster_parse("--json", "/dev/zero")
    assert proc.returncode == 2
    (out,) = json.loads(proc.stdout)
    assert out["file"] == "/dev/zero" and "not text" in out["error"] and "data" not in out


def test_random_bytes_are_refused_as_binary(tmp_path: Path) -> None:
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(200_000))
    _one_line_error(cluster_parse("--kind", "lsmod", str(blob)), "not text")


def test_closed_stdin_is_a_clear_one_line_error() -> None:
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(["bash", "-c", f'exec "{sys.executable}" -m cluster parse - <&-'],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    _one_line_error(proc, "stdin", "closed")
    assert "internal error" not in proc.stderr


def test_empty_stdin_is_a_parse_error_not_a_crash() -> None:
    proc = cluster_parse("--json", "-", stdin="")
    assert proc.returncode == 2
    (out,) = json.loads(proc.stdout)
    assert "empty input" in out["error"]


def test_directory_is_a_read_error(tmp_path: Path) -> None:
    _one_line_error(cluster_parse(str(tmp_path)), "cannot read")


def test_hostile_long_line_through_the_cli(tmp_path: Path) -> None:
    """A 5 MB line of spaces after 'max locked memory' once took hours (cubic backtracking)."""
    path = tmp_path / "ulimit.txt"
    path.write_text("max locked memory " + " " * 5_000_000 + "x\n")
    proc = cluster_parse("--kind", "ulimit", "--json", str(path))
    assert proc.returncode == 2
    (out,) = json.loads(proc.stdout)
    assert "cannot parse ulimit" in out["error"]


def test_utf16_capture_is_decoded(tmp_path: Path) -> None:
    path = tmp_path / "lsmod-powershell.txt"
    path.write_bytes(_fixture("lsmod", "001").read_text().encode("utf-16"))
    proc = cluster_parse("--json", str(path))
    assert proc.returncode == 0, proc.stderr
    (out,) = json.loads(proc.stdout)
    assert out["kind"] == "lsmod" and out["data"]["nvidia_peermem"] is True


def test_ansible_capture_of_two_hosts_gives_one_object_per_host(tmp_path: Path) -> None:
    path = tmp_path / "ansible.txt"
    path.write_text("$ ansible gpu -m shell -a 'lsmod | grep nvidia_peermem'\n"
                    "n1 | CHANGED | rc=0 >>\nnvidia_peermem         16384  0\n"
                    "n2 | FAILED | rc=1 >>\nnon-zero return code\n")
    proc = cluster_parse("--json", str(path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [(o["host"], o["kind"], o["data"]["nvidia_peermem"]) for o in out] == [
        ("n1", "lsmod", True), ("n2", "lsmod", False)]


def _in_process(monkeypatch: pytest.MonkeyPatch, **caps: int):
    from cluster.commands import parse as parse_cmd

    for name, value in caps.items():
        monkeypatch.setattr(parse_cmd, name, value)
    return parse_cmd


def test_file_above_the_text_cap_is_refused_before_reading(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    parse_cmd = _in_process(monkeypatch, MAX_TEXT_BYTES=4096)
    path = tmp_path / "big.txt"
    path.write_text(_fixture("lsmod", "001").read_text() + "x" * 8192 + "\n")
    (out,) = parse_cmd.parse_path(str(path), "lsmod")
    assert out.get("input_error") and "larger than 4 KiB" in out["error"]


def test_log_above_the_log_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parse_cmd = _in_process(monkeypatch, MAX_LOG_BYTES=4096)
    path = tmp_path / "nccl.log"
    path.write_text("host:1:1 [0] NCCL INFO x\n" * 1000)
    (out,) = parse_cmd.parse_path(str(path), None)
    assert out.get("input_error") and "larger than 4 KiB" in out["error"]


def test_pipe_above_the_cap_stops_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream without an end (a pipe, a device) is read in chunks and cut at the cap."""
    import io
    import threading

    parse_cmd = _in_process(monkeypatch, MAX_TEXT_BYTES=3 * 1024 * 1024)
    read_fd, write_fd = os.pipe()

    def feed() -> None:
        line = b"nvidia_peermem         16384  0\n"
        try:
            with os.fdopen(write_fd, "wb") as w:
                for _ in range(10 * 1024 * 1024 // len(line)):
                    w.write(line)
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    stdin = io.TextIOWrapper(os.fdopen(read_fd, "rb"))
    monkeypatch.setattr(sys, "stdin", stdin)
    try:
        (out,) = parse_cmd.parse_path("-", "lsmod")
    finally:
        stdin.close()
    assert out.get("input_error") and "stdin is larger than 3 MiB" in out["error"]


def test_lines_past_the_cap_are_reported_as_truncated(tmp_path: Path) -> None:
    path = tmp_path / "ulimit.txt"
    path.write_text("max locked memory       (kbytes, -l) 64\n" + "x" * 10_000 + "\n")
    proc = cluster_parse("--json", "--kind", "ulimit", str(path))
    assert proc.returncode == 0, proc.stderr
    (out,) = json.loads(proc.stdout)
    assert out["truncated_lines"] == 1 and out["data"]["memlock_kib"] == 64
    text = cluster_parse("--kind", "ulimit", str(path))
    assert text.returncode == 0 and "read only up to that length" in text.stdout


NCCL = FIXTURES / "nccl"


@pytest.mark.parametrize("log, status, code", [
    ("001-sglang-2.27.5-roce-gdr-ofi-plugin-fallback.log", "ok", 0),
    ("027-vllm-h100-tp8-p2p-cumem.log", "warn", 1),
    ("005-aws-socket-no-ib-many-nodes.log", "fail", 2),               # NCCL on TCP sockets
    ("037-h100-5node-ib-completion-error4-vendor81.log", "fail", 2),  # IB completion errors
])
def test_parse_exits_by_the_verdicts_it_reads(log: str, status: str, code: int) -> None:
    """`cluster parse` follows the exit-code table every command does: a log whose verdict is
    FAIL (sockets where RDMA was expected, IB completion errors) exits 2, a WARN 1, human
    output and --json alike; several files exit by the worst."""
    for json_flag in (("--json",), ()):
        proc = cluster_parse(*json_flag, str(NCCL / log))
        assert proc.returncode == code, (log, proc.stdout[-400:], proc.stderr)
    doc = json.loads(cluster_parse("--json", str(NCCL / log)).stdout)
    assert doc[0]["data"]["status"] == status
    both = cluster_parse("--json", str(NCCL / log), str(_fixture("ibstat", "001")))
    assert both.returncode == code


def test_parse_help_documents_its_exit_codes() -> None:
    proc = cluster_cli("parse", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "Exit codes: 0" in text and "1 a verdict of warn" in text and "2 a verdict of fail" in text
