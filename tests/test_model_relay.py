"""The model relay (issue 27): its shape (pure), the status document's parser, the source
argument, and a real relay between directories of this machine (`local: true` nodes, each
its own directory, relay servers on loopback): a chain of three receivers, a receiver that
already holds some files, and a failing middle node bypassed by its successor (a node whose
link is cut mid-copy: tests/integration/test_model_pull.py)."""

from __future__ import annotations

import os
import socket

import pytest

from cluster.errors import ParseError, UsageError
from cluster.inventory import loads
from cluster.model_relay import RelaySettings, parse_progress, relay_shape
from cluster.model_sync import copy_plan
from cluster.remote import Session
from playbooks import fix_model
from playbooks.model_pull import parse_source, run_relay

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
    from cluster.bounds import bound

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
                                  "org/../x", "a/b/c", ""])
def test_bad_sources_are_refused(text):
    with pytest.raises(UsageError):
        parse_source(text, INV3)


# ---------------------------------------------------------------- a real relay on loopback


def free_range(n: int) -> tuple[int, int]:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            low = s.getsockname()[1]
        if low + n < 65535 and all(_free(p) for p in range(low, low + n)):
            return low, low + n - 1
    raise AssertionError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def local_cluster(tmp_path, names):
    low, high = free_range(12)
    nodes = "\n".join(f"  - {{name: {n}, address: 127.0.0.1, local: true"
                      f"{', role: head' if i == 0 else ''}}}" for i, n in enumerate(names))
    inv = loads(f"nodes:\n{nodes}\nmodel: {{path: {tmp_path}/unused}}\n"
                f"expectations: {{model_relay: {{ports: [{low}, {high}]}}}}\n")
    dirs = {n: tmp_path / n for n in names}
    return inv, dirs, lambda node: str(dirs[node.name])


def write_model(root, files):
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


FILES = {"config.json": b'{"model_type": "llama"}\n', "tokenizer.json": os.urandom(20000),
         "weights/model-00001-of-00002.safetensors": os.urandom(3 * (1 << 20) + 7),
         "weights/model-00002-of-00002.safetensors": os.urandom(2 * (1 << 20) + 1)}


def relay_all(inv, dirs, dir_of, names):
    with Session(inv) as session:
        found = fix_model.manifests(inv, session, inv.nodes, True, dir_of)
        ref = found[names[0]]
        plans = {n: copy_plan(n, ref, found[n]) for n in names[1:]}
        by = {n.name: n for n in inv.nodes}
        report = run_relay(inv, session, by[names[0]], ref, plans,
                           {n: by[n] for n in names[1:]}, True, dir_of)
        after = fix_model.manifests(inv, session, inv.nodes, True, dir_of)
    return ref, plans, report, after


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
    (["model", "pull", "/a/laptop/dir"], "not supported"),
    (["model", "pull", "nowhere:/x"], "no node named"),
    (["model", "pull", "src:/x", "--path", "relative"], "absolute"),
    (["model", "pull", "org/m", "--revision", "a b"], "--revision"),
    (["model", "pull", "src:/x", "--nodes", ""], "an empty value is not allowed")])
def test_bad_pull_arguments_are_one_line_and_exit_2(tmp_path, args, why):
    path = tmp_path / "cluster.yaml"
    path.write_text(f"nodes:\n  - {{name: src, address: 127.0.0.1, local: true, role: head}}\n"
                    f"  - {{name: a, address: 127.0.0.1, local: true}}\n"
                    f"model: {{path: {tmp_path}/m}}\nrun_dir: {tmp_path}/runs\n")
    p = cli(path, *args, "--json")
    assert p.returncode == 2 and why in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


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
