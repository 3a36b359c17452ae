"""The model relay (issue 27): its shape (pure), the status document's parser, the source
argument, and a real relay between directories of this machine (`local: true` nodes, each
its own directory, relay servers on loopback): a chain of three receivers, a receiver that
already holds some files, and a failing middle node bypassed by its successor (a node whose
link is cut mid-copy: tests/integration/test_model_pull.py)."""

from __future__ import annotations

import os
import socket

import pytest

from cluster.base.errors import ParseError, UsageError
from fakes import free_range, local_cluster, relay_all, relay_get, write_model
from cluster.nodes.inventory import loads
from cluster.remedy.model_relay import RelaySettings, fed_shape, parse_progress, relay_shape
from playbooks.model_pull import parse_source

SETTINGS = RelaySettings((8091, 8110), 4, 2)


def test_a_small_cluster_is_one_chain_and_upstreams_are_the_ancestors():
    shape = relay_shape("head", ["a", "b", "c"], SETTINGS)
    assert shape.kind == "chain" and shape.lines() == ["head -> a -> b -> c"]
    assert shape.upstreams("c") == ("b", "a", "head")
    assert shape.upstreams("c", skip=["b"]) == ("a", "head")
    assert shape.to_dict()["edges"][0] == {"from": "head", "to": "a"} and shape.depth == 3


def test_a_large_cluster_is_a_tree_of_the_fanout():
    targets = [f"n{i}" for i in range(1, 10)]
    shape = relay_shape("head", targets, SETTINGS)
    assert shape.kind == "tree" and shape.fanout == 2
    assert shape.lines()[:2] == ["head -> n1, n2", "n1 -> n3, n4"]
    assert shape.upstreams("n9") == ("n4", "n1", "head") and shape.depth == 3
    children = [p for _, p in shape.parent]
    assert max(children.count(p) for p in set(children)) == 2


def test_the_settings_refuse_a_reversed_port_range():
    with pytest.raises(UsageError):
        RelaySettings.from_expectations({"model_relay": {"ports": [9000, 8000],
                                                         "chain_max_nodes": 4,
                                                         "tree_fanout": 2}})


@pytest.mark.parametrize("doc", [None, [], {"state": "odd"}, {"state": "done", "bytes": -1},
                                 {"state": "done", "seconds": float("nan")},
                                 {"state": "done", "bytes": True},
                                 {"state": "done", "failed": "x"}])
def test_a_bad_status_document_is_a_parse_error(doc):
    with pytest.raises(ParseError):
        parse_progress(doc)


def test_a_status_document_reads_its_numbers_through_the_reply_bounds():
    """limits.yaml replies: relay_bytes_max / relay_seconds_max, the edges kept, one past refused."""
    from cluster.base.bounds import bound

    most, longest = bound("replies", "relay_bytes_max"), bound("replies", "relay_seconds_max")
    got = parse_progress({"state": "done", "bytes": most, "total": most, "seconds": longest})
    assert (got.bytes, got.seconds) == (most, float(longest))
    for doc in ({"state": "done", "bytes": most + 1}, {"state": "done", "seconds": longest + 1},
                {"state": "done", "files": 2.0}):
        with pytest.raises(ParseError):
            parse_progress(doc)


INV3 = loads("""
nodes:
  - {name: head, address: 10.0.0.1, role: head}
  - {name: w1, address: 10.0.0.2}
""")


@pytest.mark.parametrize("text, kind", [("head:/models/m", "node"), ("org/tiny-model", "hf"),
                                        ("gpt2", "hf")])
def test_the_source_forms(text, kind):
    assert parse_source(text, INV3).kind == kind


@pytest.mark.parametrize("text", ["nobody:/x", "head:relative", "/local/dir", "./dir",
                                  "org/../x", "a/b/c", "", "head:/x/../y"])
def test_bad_sources_are_refused(text):
    with pytest.raises(UsageError):
        parse_source(text, INV3)


def test_a_local_path_is_one_that_exists_here_or_starts_with_a_slash_dot_or_tilde(
        tmp_path, monkeypatch):
    """scp's ambiguity settled: a path that exists on the laptop (even `head:x` or `org/m`),
    or one starting with / ./ ../ ~, is local; then NODE:PATH; then a repo id."""
    (tmp_path / "org" / "m").mkdir(parents=True)
    (tmp_path / "head:x").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for text in ("org/m", "head:x", "./org", "../" + tmp_path.name, "~/org", str(tmp_path)):
        got = parse_source(text, INV3)
        assert got.kind == "local" and os.path.isabs(got.path), (text, got)
    assert parse_source("~/org", INV3).path == str((tmp_path / "org").resolve())
    assert parse_source("head:/x", INV3).kind == "node"
    assert parse_source("org/other", INV3).kind == "hf"


def test_fed_shape_puts_the_laptop_in_front_of_the_first_node_only():
    shape = fed_shape("laptop", "head", ["a", "b"], SETTINGS)
    assert shape.lines() == ["laptop -> head -> a -> b"] and shape.source == "laptop"
    assert shape.upstreams("head") == ("laptop",) and shape.depth == 3
    tree = fed_shape("laptop", "head", [f"n{i}" for i in range(1, 10)], SETTINGS)
    assert tree.kind == "tree" and tree.lines()[:2] == ["laptop -> head", "head -> n1, n2"]


# ---------------------------------------------------------------- a real relay on loopback


FILES = {"config.json": b'{"model_type": "llama"}\n', "tokenizer.json": os.urandom(20000),
         "weights/model-00001-of-00002.safetensors": os.urandom(3 * (1 << 20) + 7),
         "weights/model-00002-of-00002.safetensors": os.urandom(2 * (1 << 20) + 1)}


def test_a_chain_relays_every_file_verified_and_a_holder_sends_only_what_is_missing(tmp_path):
    names = ["src", "a", "b", "c"]
    inv, dirs, dir_of = local_cluster(tmp_path, names)
    write_model(dirs["src"], FILES)
    write_model(dirs["b"], {"tokenizer.json": FILES["tokenizer.json"]})
    ref, plans, report, after = relay_all(inv, dirs, dir_of, names)
    assert report.shape.lines() == ["src -> a -> b -> c"]
    assert report.errors == {}, report.errors
    for n in names[1:]:
        p = report.progress[n]
        assert p.state == "done" and p.verified and p.bytes == plans[n].bytes, (n, p)
        assert after[n].fingerprint == ref.fingerprint
        for path, data in FILES.items():
            assert (dirs[n] / path).read_bytes() == data
    assert "tokenizer.json" not in {f.path for f in plans["b"].files}


def test_a_node_that_cannot_take_the_files_is_bypassed_and_reported(tmp_path):
    """b holds a file where the weights' directory goes: its weights fail, it answers 404 for
    them, c re-attaches to a for those files, completes and verifies; b is reported failed."""
    names = ["src", "a", "b", "c"]
    inv, dirs, dir_of = local_cluster(tmp_path, names)
    write_model(dirs["src"], FILES)
    os.makedirs(dirs["b"])
    (dirs["b"] / "weights").write_text("a file where b needs a directory\n")
    ref, plans, report, after = relay_all(inv, dirs, dir_of, names)
    assert report.progress["b"].state == "failed" and report.progress["b"].failed
    assert report.progress["c"].state == "done" and report.progress["c"].verified
    assert after["c"].fingerprint == ref.fingerprint
    assert after["a"].fingerprint == ref.fingerprint


# ---------------------------------------------------------------- the command


def cli(inv, *args: str):
    from fakes import cluster_cli
    return cluster_cli("-i", str(inv), *args)


@pytest.mark.parametrize("args, why", [
    (["model", "pull", ""], "an empty value is not allowed"),
    (["model", "pull", "/a/laptop/dir"], "not a directory on this machine"),
    (["model", "pull", "./nowhere"], "not a directory on this machine"),
    (["model", "pull", "nowhere:/x"], "no node named"),
    (["model", "pull", "src:/x", "--path", "relative"], "absolute"),
    (["model", "pull", "org/m", "--revision", "a b"], "--revision"),
    (["model", "pull", "src:/x", "--nodes", ""], "an empty value is not allowed"),
    (["model", "pull", "src:/x/../../etc", "--path", "/tmp/m"], "'..' component"),
    (["model", "pull", "src:/x", "--path", "/tmp/m/../../etc"], "'..' component"),
    (["model", "pull", "src:/x", "--path", "/tmp/m/.."], "'..' component")])
def test_bad_pull_arguments_are_one_line_and_exit_2(tmp_path, args, why):
    path = tmp_path / "cluster.yaml"
    path.write_text(f"nodes:\n  - {{name: src, address: 127.0.0.1, local: true, role: head}}\n"
                    f"  - {{name: a, address: 127.0.0.1, local: true}}\n"
                    f"model: {{path: {tmp_path}/m}}\nrun_dir: {tmp_path}/runs\n")
    p = cli(path, *args, "--json")
    assert p.returncode == 2 and why in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert not list(tmp_path.glob("runs/*/nodes/*")), "a node was asked before the refusal"


def test_a_failure_after_progress_is_one_line_on_stderr_and_the_progress_is_in_the_run(tmp_path):
    """The pull reports progress (the manifests) and then fails (the source holds nothing):
    stderr is the error line alone, without --json too (no terminal: progress goes to the
    run's events.log only)."""
    path = tmp_path / "cluster.yaml"
    path.write_text(f"nodes:\n  - {{name: src, address: 127.0.0.1, local: true, role: head}}\n"
                    f"  - {{name: a, address: 127.0.0.1, local: true}}\n"
                    f"model: {{path: {tmp_path}/m}}\nrun_dir: {tmp_path}/runs\n")
    p = cli(path, "model", "pull", f"src:{tmp_path}/empty")
    assert p.returncode == 2 and "holds no files" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    events = list(tmp_path.glob("runs/*/events.log"))
    assert len(events) == 1 and "model: manifests on src" in events[0].read_text()


def test_the_dry_run_prints_the_chain_and_copies_nothing(tmp_path):
    names = ["src", "a", "b"]
    write_model(tmp_path / "source", FILES)
    nodes = "\n".join(f"  - {{name: {n}, address: 127.0.0.1, local: true"
                      f"{', role: head' if i == 0 else ''}}}" for i, n in enumerate(names))
    path = tmp_path / "cluster.yaml"
    path.write_text(f"nodes:\n{nodes}\nmodel: {{path: {tmp_path}/dest}}\n"
                    f"run_dir: {tmp_path}/runs\n")
    p = cli(path, "model", "pull", f"src:{tmp_path}/source", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "relay: chain (fan-out 1, depth 2) from src" in p.stdout
    assert "src -> a -> b" in p.stdout and "planned" in p.stdout
    assert not (tmp_path / "dest").exists()


def test_a_hub_dry_run_downloads_nothing_and_plans_every_node(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(f"nodes:\n  - {{name: h, address: 127.0.0.1, local: true, role: head}}\n"
                    f"  - {{name: a, address: 127.0.0.1, local: true}}\n"
                    f"model: {{path: {tmp_path}/dest}}\nrun_dir: {tmp_path}/runs\n")
    p = cli(path, "model", "pull", "some-org/tiny-model", "--dry-run", "--json")
    import json

    doc = json.loads(p.stdout)
    assert p.returncode == 0 and doc["shape"]["edges"] == [{"from": "h", "to": "a"}], doc
    assert doc["nodes"]["a"]["status"] == "planned" and not (tmp_path / "dest").exists()


# ---------------------------------------------------------------- a directory on the laptop


def laptop_dir(tmp_path):
    """FILES, a link to a secret outside the directory and a link to a file inside it."""
    root = tmp_path / "laptop-model"
    write_model(root, FILES)
    secret = tmp_path / "outside-secret.txt"
    secret.write_text("not for the nodes\n")
    os.symlink(secret, root / "leak.txt")
    os.symlink("config.json", root / "alias.json")
    return root


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_the_laptop_server_serves_the_walked_files_only_with_the_token_and_never_a_link_out(
        tmp_path):
    from cluster.remedy.laptop_feed import LaptopServer

    root = laptop_dir(tmp_path)
    token = "t" * 20 + "-secret_0123456789"
    with LaptopServer(str(root), token) as server:
        base = f"http://127.0.0.1:{server.port}"
        assert relay_get(base, token, "/config.json") == (200, FILES["config.json"])
        assert relay_get(base, token, "/tokenizer.json", "bytes=10-") == \
            (206, FILES["tokenizer.json"][10:])
        assert relay_get(base, token, "/leak.txt")[0] == 404            # the link leaving
        assert relay_get(base, token, "/../outside-secret.txt")[0] == 404
        assert relay_get(base, "x" * len(token), "/config.json")[0] == 403    # a wrong key
        assert get(f"{base}/{token}/config.json")[0] == 403              # the old token URL
        assert get(f"{base}/config.json")[0] == 403
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            pass
        assert server.files == len(FILES) + 1                             # + alias.json
    with pytest.raises(OSError):                                          # closed with the run
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_a_laptop_directory_lands_identical_and_the_link_out_nowhere(tmp_path):
    """`cluster model pull PATH` from this machine: the dry run's shape over three nodes
    (laptop -> head -> a -> b), then a real pull to one `local: true` node (its relay reaches
    the laptop's loopback server directly; the SSH remote forward and the relay on to the
    other nodes: tests/integration/test_model_pull.py)."""
    import json

    root = laptop_dir(tmp_path)
    low, high = free_range(12)
    names = ["head", "a", "b"]
    nodes = "\n".join(f"  - {{name: {n}, address: 127.0.0.1, local: true"
                      f"{', role: head' if i == 0 else ''}}}" for i, n in enumerate(names))
    path = tmp_path / "cluster.yaml"
    path.write_text(f"nodes:\n{nodes}\nrun_dir: {tmp_path}/runs\n"
                    f"expectations: {{model_relay: {{ports: [{low}, {high}]}}}}\n")
    p = cli(path, "model", "pull", str(root), "--path", f"{tmp_path}/dest", "--dry-run")
    assert p.returncode == 1 and "laptop -> head -> a -> b" in p.stdout, p.stdout + p.stderr
    assert "from laptop" in p.stdout and "leak.txt" in p.stdout       # the skipped link, noted
    assert not (tmp_path / "dest").exists()
    p = cli(path, "model", "pull", str(root), "--path", f"{tmp_path}/dest", "--nodes", "head",
            "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == 1 and doc["shape"]["edges"] == [{"from": "laptop", "to": "head"}], \
        (p.stdout, p.stderr)
    r = doc["nodes"]["head"]
    assert r["status"] == "copied" and r["verified"] and r["bytes"] > 5 << 20, r
    for path_, data in FILES.items():
        assert (tmp_path / "dest" / path_).read_bytes() == data
    assert (tmp_path / "dest" / "alias.json").read_bytes() == FILES["config.json"]
    assert not (tmp_path / "dest" / "alias.json").is_symlink()
    assert not os.path.lexists(tmp_path / "dest" / "leak.txt")
    assert "not for the nodes" not in p.stdout


def test_a_fetch_that_hangs_up_mid_file_prints_nothing_on_the_clis_stderr(tmp_path, capfd):
    """A node's fetch cut off while the laptop streams (a reset, as on Ctrl-C): socketserver
    would print the handler's traceback on stderr; the laptop server keeps quiet."""
    import struct
    import time

    from cluster.node_programs.model_copy import auth_headers
    from cluster.remedy.laptop_feed import LaptopServer

    root = tmp_path / "big"
    write_model(root, {"w.bin": os.urandom(8 << 20)})
    token = "k" * 40
    with LaptopServer(str(root), token) as server:
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            auth = "".join(f"{k}: {v}\r\n" for k, v in auth_headers(token, "/w.bin").items())
            s.sendall(f"GET /w.bin HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()                                  # RST while the server writes
        time.sleep(2)
        assert relay_get(f"http://127.0.0.1:{server.port}", token, "/w.bin", "bytes=0-9")[0] \
            == 206                                     # still serving
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
