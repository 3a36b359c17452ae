"""The model copy's on-node program (cluster/node_programs/model_copy.py) run for real on
loopback: manifest, serve, fetch and stop between two temporary directories, shipped the way
the playbook ships it (`python3 -c BOOT`, the program and its input on stdin)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket

import pytest

from fakes import closed_port as free_port, model_copy_fetch as fetch, model_copy_program as program, \
    relay_get

TAG = "t" + secrets.token_hex(4)


def make_model(root) -> dict[str, bytes]:
    files = {"config.json": b'{"model_type": "llama"}\n',
             "tokenizer.json": os.urandom(3000),
             "sub/model-00001-of-00001.safetensors": os.urandom(3 * (1 << 20) + 17)}
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return files


@pytest.fixture
def served(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = make_model(src)
    token = secrets.token_urlsafe(24)
    port = free_port()
    started = program("serve", "--dir", str(src), "--bind", "127.0.0.1", "--port", str(port),
                      "--for", "60", "--tag", TAG, data=token + "\n")
    assert started["port"] == port and started["pid"] > 1 and started["files"] == 3
    yield src, files, token, f"http://127.0.0.1:{port}"
    stopped = program("stop", "--pid", str(started["pid"]), "--tag", TAG)
    assert stopped["stopped"] == started["pid"] and stopped["gone"]


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    files = make_model(tmp_path)
    (tmp_path / "link.json").symlink_to(tmp_path / "config.json")
    (tmp_path / "dirlink").symlink_to(tmp_path / "sub")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "x.bin.part").write_bytes(b"half")
    doc = program("manifest", "--dir", str(tmp_path))
    by_path = {e["path"]: e for e in doc["files"]}
    assert set(by_path) == set(files) | {"link.json"}
    for path, data in files.items():
        assert by_path[path]["size"] == len(data)
        assert by_path[path]["sha256"] == hashlib.sha256(data).hexdigest()
    assert by_path["link.json"]["link"] is True and "link" not in by_path["config.json"]
    assert doc["skipped"] == {"dirlink": "a link to a directory (not followed)",
                              "dangling": "a link to nothing"}
    assert doc["partial"] == 1
    assert program("manifest", "--dir", str(tmp_path / "absent"))["exists"] is False
    assert "error" in program("manifest", "--dir", "relative/dir")


def test_a_full_copy_lands_verified_and_a_second_manifest_matches(served, tmp_path):
    src, files, token, url = served
    dst = tmp_path / "dst"
    entries = program("manifest", "--dir", str(src))["files"]
    doc = fetch(dst, url, token, entries)
    assert doc["ok"] == 3 and doc["failed"] == 0 and doc["bytes"] == sum(map(len, files.values()))
    for path, data in files.items():
        assert (dst / path).read_bytes() == data and not (dst / (path + ".part")).exists()
    assert program("manifest", "--dir", str(dst))["files"] == entries


def test_a_partial_part_file_is_resumed_with_a_range_request(served, tmp_path):
    src, files, token, url = served
    dst = tmp_path / "dst"
    big = "sub/model-00001-of-00001.safetensors"
    (dst / "sub").mkdir(parents=True)
    (dst / (big + ".part")).write_bytes(files[big][:1 << 20])
    entry = next(e for e in program("manifest", "--dir", str(src))["files"] if e["path"] == big)
    doc = fetch(dst, url, token, [entry])
    assert doc["files"] == [{"path": big, "status": "ok", "bytes": len(files[big]) - (1 << 20)}]
    assert (dst / big).read_bytes() == files[big]


def test_a_corrupted_source_is_caught_by_sha256_and_the_part_removed(served, tmp_path):
    src, files, token, url = served
    dst = tmp_path / "dst"
    entries = program("manifest", "--dir", str(src))["files"]
    (src / "tokenizer.json").write_bytes(os.urandom(3000))        # same size, other bytes
    doc = fetch(dst, url, token, entries)
    bad = [f for f in doc["files"] if f["status"] == "failed"]
    assert [f["path"] for f in bad] == ["tokenizer.json"] and "sha256" in bad[0]["reason"]
    assert not (dst / "tokenizer.json").exists() and not (dst / "tokenizer.json.part").exists()
    assert doc["ok"] == 2


def test_wrong_token_and_traversal_are_refused(served, tmp_path):
    src, files, token, url = served
    (tmp_path / "secret.txt").write_text("outside")
    wrong = ("x" if token[0] != "x" else "y") + token[1:]
    assert relay_get(url, wrong, "/config.json") == (403, b"")
    for path in ("/../secret.txt", "/%2e%2e/secret.txt", "/sub/../../secret.txt",
                 f"/{tmp_path}/secret.txt", "/nothing.json"):
        assert relay_get(url, token, path) == (404, b""), path
    assert relay_get(url, token, "/config.json") == (200, files["config.json"])
    entries = program("manifest", "--dir", str(src))["files"]
    doc = fetch(tmp_path / "dst", url, wrong, entries[:1])
    assert doc["failed"] == 1 and "HTTP 403 (bad signature)" in doc["files"][0]["reason"]


def test_fetch_refuses_paths_that_leave_the_directory(served, tmp_path):
    src, files, token, url = served
    good = {"size": 1, "sha256": "0" * 64}
    for path in ("../evil", "/etc/evil", "a//b", "./x", "x.part"):
        doc = fetch(tmp_path / "dst", url, token, [dict(good, path=path)])
        assert "refused path" in doc["error"], path
    dst = tmp_path / "dst"
    dst.mkdir(exist_ok=True)
    (tmp_path / "elsewhere").mkdir()
    (dst / "out").symlink_to(tmp_path / "elsewhere")
    entry = next(e for e in program("manifest", "--dir", str(src))["files"]
                 if e["path"] == "config.json")
    doc = fetch(dst, url, token, [dict(entry, path="out/config.json")])
    assert "a link or not a directory (not followed)" in doc["files"][0]["reason"]
    assert not (tmp_path / "elsewhere" / "config.json").exists()


def test_serve_reports_a_busy_port_and_stop_ignores_a_foreign_pid(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        doc = program("serve", "--dir", str(tmp_path), "--bind", "127.0.0.1", "--port", str(port),
                      "--for", "5", "--tag", TAG, data=secrets.token_urlsafe(24) + "\n")
    assert "cannot listen" in doc["error"]
    assert program("stop", "--pid", str(os.getpid()), "--tag", TAG) == {"stopped": None}
    assert "token" in program("serve", "--dir", str(tmp_path), "--bind", "127.0.0.1",
                              "--port", str(port), "--for", "5", "--tag", TAG,
                              data="short\n")["error"]


def test_an_unreachable_source_fails_fast_and_keeps_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_model(src)
    entries = program("manifest", "--dir", str(src))["files"]
    token = secrets.token_urlsafe(24)
    doc = fetch(tmp_path / "dst", f"http://127.0.0.1:{free_port()}", token, entries)
    reasons = [f["reason"] for f in doc["files"]]
    assert doc["failed"] == 3 and reasons[0].startswith("cannot download from 127.0.0.1:")
    assert all(r.startswith("not tried: cannot download") for r in reasons[1:])
    assert token not in json.dumps(doc)
