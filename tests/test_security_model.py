"""Issue 25 items 2, 3 and 14, reproduced on loopback against the model copy's on-node program
(cluster/node_programs/model_copy.py, shipped as the playbook ships it): the target never
writes through a planted link or hard link, the source serves no file from outside the model
directory, modes stay sane, and a fetch stops at the manifest's size."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fakes import closed_port as free_port, model_copy_fetch as fetch, model_copy_program as program, \
    relay_get

TAG = "t" + secrets.token_hex(4)

CONFIG = b'{"model_type": "llama"}\n'


def entry_for(data: bytes, path: str = "config.json", mode: int = 0o644) -> dict:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "mode": mode}


@pytest.fixture
def source(tmp_path):
    """A model directory with a secret next to it, served on loopback; yields a helper."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes(CONFIG)
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0::/root:/bin/bash\n")
    started = []

    def start() -> tuple[str, str, dict]:
        token = secrets.token_urlsafe(24)
        port = free_port()
        doc = program("serve", "--dir", str(src), "--bind", "127.0.0.1", "--port", str(port),
                      "--for", "60", "--tag", TAG, data=token + "\n")
        assert doc["pid"] > 1, doc
        started.append(doc["pid"])
        return token, f"http://127.0.0.1:{port}", doc

    yield src, secret, start
    for pid in started:
        program("stop", "--pid", str(pid), "--tag", TAG)


# ------------------------------------------------------------------ item 2: the target side


def test_a_planted_part_link_is_not_written_through(source, tmp_path):
    src, _, start = source
    token, url, _ = start()
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA admin\n")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.json.part").symlink_to(victim)
    doc = fetch(dst, url, token, [entry_for(CONFIG)])
    assert doc["ok"] == 1, doc
    assert victim.read_text() == "ssh-ed25519 AAAA admin\n"
    assert (dst / "config.json").read_bytes() == CONFIG and not (dst / "config.json").is_symlink()


def test_a_planted_part_hard_link_is_not_appended_to(source, tmp_path):
    src, _, start = source
    token, url, _ = start()
    victim = tmp_path / "sudoers"
    victim.write_text("root ALL=(ALL) ALL\n")
    dst = tmp_path / "dst"
    dst.mkdir()
    os.link(victim, dst / "config.json.part")
    doc = fetch(dst, url, token, [entry_for(CONFIG)])
    assert victim.read_text() == "root ALL=(ALL) ALL\n"
    assert doc["ok"] == 1 and (dst / "config.json").read_bytes() == CONFIG, doc


def test_a_link_at_the_final_name_is_replaced_not_followed(source, tmp_path):
    src, _, start = source
    token, url, _ = start()
    victim = tmp_path / "shadow"
    victim.write_text("untouched\n")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.json").symlink_to(victim)
    assert fetch(dst, url, token, [entry_for(CONFIG)])["ok"] == 1
    assert victim.read_text() == "untouched\n" and not (dst / "config.json").is_symlink()


def test_a_parent_directory_link_refuses_the_file(source, tmp_path):
    src, _, start = source
    (src / "sub").mkdir()
    (src / "sub" / "w.bin").write_bytes(b"weights")
    token, url, _ = start()
    dst = tmp_path / "dst"
    dst.mkdir()
    (tmp_path / "etc").mkdir()
    (dst / "sub").symlink_to(tmp_path / "etc")
    doc = fetch(dst, url, token, [entry_for(b"weights", "sub/w.bin")])
    assert doc["failed"] == 1 and "not followed" in doc["files"][0]["reason"]
    assert list((tmp_path / "etc").iterdir()) == []


# ------------------------------------------------------------------ item 3: the source side


def test_a_link_leaving_the_model_directory_is_neither_listed_nor_served(source, tmp_path):
    src, secret, start = source
    (src / "tokenizer.json").symlink_to(secret)
    (src / "inside.json").symlink_to(src / "config.json")
    listed = program("manifest", "--dir", str(src))
    assert {e["path"] for e in listed["files"]} == {"config.json", "inside.json"}
    assert "leaving the model directory" in listed["skipped"]["tokenizer.json"]
    token, url, served = start()
    assert "tokenizer.json" in served["skipped"]
    assert relay_get(url, token, "/tokenizer.json") == (404, b"")
    assert relay_get(url, token, "/inside.json") == (200, CONFIG)


def test_a_file_swapped_for_a_link_after_the_walk_is_not_served(source, tmp_path):
    src, secret, start = source
    token, url, _ = start()
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(secret)
    assert relay_get(url, token, "/config.json") == (404, b"")


def test_modes_keep_a_private_file_private_and_drop_setuid(source, tmp_path):
    src, _, start = source
    (src / "private.key").write_bytes(b"k" * 32)
    os.chmod(src / "private.key", 0o600)
    (src / "run.sh").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o4777)
    listed = {e["path"]: e for e in program("manifest", "--dir", str(src))["files"]}
    assert listed["private.key"]["mode"] == 0o600 and listed["run.sh"]["mode"] == 0o755
    token, url, _ = start()
    dst = tmp_path / "dst"
    doc = fetch(dst, url, token, list(listed.values()))
    assert doc["ok"] == 3, doc
    assert stat.S_IMODE((dst / "private.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((dst / "run.sh").stat().st_mode) == 0o755


# ------------------------------------------------------------------ item 14: the size bound


class Hostile(BaseHTTPRequestHandler):
    """Replies to any GET with `body_mib` MiB (no Content-Length, or a false one)."""

    body_mib = 64
    length: str | None = None
    sent = 0

    def log_message(self, *_):
        pass

    def do_GET(self):
        self.send_response(200)
        if self.length is not None:
            self.send_header("Content-Length", self.length)
        self.end_headers()
        block = b"A" * (1 << 20)
        try:
            for _ in range(self.body_mib):
                self.wfile.write(block)
                type(self).sent += len(block)
        except OSError:
            pass


@pytest.fixture
def hostile():
    servers = []

    def start(**attrs) -> str:
        handler = type("H", (Hostile,), dict(attrs, sent=0))
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_fetch_stops_at_the_manifest_size(hostile, tmp_path):
    url = hostile()
    dst = tmp_path / "dst"
    data = b"A" * 10
    doc = fetch(dst, url, secrets.token_urlsafe(24), [entry_for(data, "tiny.json")])
    assert doc["ok"] == 1 and doc["bytes"] == 10, doc
    assert (dst / "tiny.json").read_bytes() == data
    other = fetch(dst, url, secrets.token_urlsafe(24), [entry_for(b"B" * 10, "b.json")])
    assert other["failed"] == 1 and "sha256" in other["files"][0]["reason"]
    assert not (dst / "b.json.part").exists() and not (dst / "b.json").exists()


def test_a_false_content_length_is_refused_before_writing(hostile, tmp_path):
    url = hostile(length=str(300 << 20))
    dst = tmp_path / "dst"
    doc = fetch(dst, url, secrets.token_urlsafe(24), [entry_for(b"A" * 10, "tiny.json")])
    assert doc["failed"] == 1 and "the manifest expects 10" in doc["files"][0]["reason"], doc
    part = dst / "tiny.json.part"
    assert not part.exists() or part.stat().st_size == 0


class Stalling(BaseHTTPRequestHandler):
    """Sends the first half of the file, then nothing (a source that hangs)."""

    data = b""

    def log_message(self, *_):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.data)))
        self.end_headers()
        self.wfile.write(self.data[:len(self.data) // 2])
        self.wfile.flush()
        threading.Event().wait(20)


def test_on_a_timeout_the_part_is_kept_within_the_size_and_a_rerun_resumes(source, tmp_path):
    src, _, start = source
    data = os.urandom(4096)
    (src / "w.bin").write_bytes(data)
    handler = type("S", (Stalling,), {"data": data})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dst = tmp_path / "dst"
    try:
        doc = program("fetch", "--dir", str(dst), "--url",
                      f"http://127.0.0.1:{server.server_address[1]}", "--for", "3",
                      data=secrets.token_urlsafe(24) + "\n"
                      + json.dumps({"files": [entry_for(data, "w.bin")]}))
    finally:
        server.shutdown()
        server.server_close()
    assert doc["failed"] == 1, doc
    assert (dst / "w.bin.part").read_bytes() == data[:2048]       # kept: a rerun resumes
    token, url, _ = start()
    again = fetch(dst, url, token, [entry_for(data, "w.bin")])
    assert again["ok"] == 1 and again["bytes"] == 2048, again
    assert (dst / "w.bin").read_bytes() == data


def test_the_server_binds_only_an_address_not_a_name(tmp_path):
    for bind in ("localhost", "", "0.0.0.0.0"):
        doc = program("serve", "--dir", str(tmp_path), "--bind", bind, "--port",
                      str(free_port()), "--for", "5", "--tag", TAG,
                      data=secrets.token_urlsafe(24) + "\n")
        assert "bad --bind" in doc["error"], bind
