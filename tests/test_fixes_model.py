"""`cluster fix --checks model`: the copy plan (pure: manifests -> reference and files per node),
the opt-in fixer in plan_fixes, and the playbook's copy run for real between two directories of
this machine (two `local: true` nodes, each given its own directory)."""

from __future__ import annotations

import hashlib
import json
import os
import socket

import pytest

from cluster.base.errors import ParseError
from cluster.remedy.fixes import Step, plan_fixes
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.nodes.inventory import loads
from cluster.remedy.model_sync import (FileEntry, Manifest, copy_plan, parse_manifest, reference_node,
                                still_different)
from cluster.nodes.remote import Session
from cluster.base.results import CheckResult, Status
from playbooks import fix as fix_playbook
from playbooks import fix_model

INV = loads("""
nodes:
  - {name: n1, address: 10.0.0.1, role: head}
  - {name: n2, address: 10.0.0.2}
  - {name: n3, address: 10.0.0.3}
model: {path: /models/m}
""")
SHA = {c: c * 64 for c in "abcdef"}


def entry(path: str, size: int = 1, sha: str = "a") -> FileEntry:
    return FileEntry(path, size, SHA[sha])


def manifest(*files: FileEntry) -> Manifest:
    return Manifest(True, tuple(files))


def typed(facts: dict) -> dict:
    """Each node's facts as the preflight reports them (typed)."""
    return {n: NodeFactsSummary.from_dict(f) for n, f in facts.items()}


def test_parse_manifest_checks_every_field():
    doc = {"exists": True, "files": [{"path": "config.json", "size": 3, "sha256": "a" * 64}],
           "skipped": {"d": "a link to a directory (not followed)"}, "partial": 1}
    m = parse_manifest(doc)
    assert m.files == (FileEntry("config.json", 3, "a" * 64),) and m.skipped == ("d",)
    for bad in ({"error": "x"}, [], {"exists": 1, "files": []},
                dict(doc, files=[{"path": "../x", "size": 3, "sha256": "a" * 64}]),
                dict(doc, files=[{"path": "x", "size": True, "sha256": "a" * 64}]),
                dict(doc, files=[{"path": "x", "size": -1, "sha256": "a" * 64}]),
                dict(doc, files=[{"path": "x", "size": 1, "sha256": "A" * 64}]),
                dict(doc, files=doc["files"] * 2), dict(doc, partial=True)):
        with pytest.raises(ParseError):
            parse_manifest(bad)


def test_the_reference_is_the_majority_and_the_head_on_a_tie():
    a, b = manifest(entry("x")).fingerprint, manifest(entry("x", sha="b")).fingerprint
    assert reference_node({"n1": a, "n2": b, "n3": b}, "n1") == "n2"
    assert reference_node({"n1": a, "n2": b}, "n1") == "n1"
    assert reference_node({"n2": a, "n3": b}, "n1", ["n1", "n2", "n3"]) == "n2"
    assert reference_node({}, "n1") is None


def test_copy_plan_lists_missing_and_differing_files_and_keeps_extras():
    ref = manifest(entry("config.json"), entry("a.safetensors", 10), entry("sub/b", 5))
    mine = manifest(entry("config.json"), entry("a.safetensors", 10, "b"), entry("mine.txt"))
    plan = copy_plan("n3", ref, mine)
    assert [f.path for f in plan.files] == ["a.safetensors", "sub/b"]
    assert plan.replaced == ("a.safetensors",) and plan.extra == ("mine.txt",)
    assert plan.bytes == 15
    assert copy_plan("n3", ref, ref).files == ()
    assert still_different(ref, mine) == ("a.safetensors", "sub/b")


def model_facts(**nodes):
    return {n: {"model_files": {k: {"size": 1, "sha256": SHA[v]} for k, v in files.items()}}
            for n, files in nodes.items()}


def test_model_is_opt_in_and_copies_from_the_majority_node():
    results = [CheckResult("model", "n1", Status.OK, "ok"),
               CheckResult("model", "n2", Status.OK, "ok"),
               CheckResult("model", "n3", Status.FAIL, "/models/m does not exist"),
               CheckResult("model-match", None, Status.FAIL, "differ"),
               CheckResult("model-match", "n1", Status.FAIL, "differ: config.json")]
    facts = model_facts(n1={"config.json": "b"}, n2={"config.json": "a"}) | {"n3": {}}
    unnamed = plan_fixes(results, typed(facts), INV, None, False)
    assert unnamed.steps == () and unnamed.manual == ()
    assert {(s.node, s.check) for s in unnamed.skipped} == {("n1", "model"), ("n3", "model")}
    assert all("--checks model" in s.reason for s in unnamed.skipped)
    named = plan_fixes(results, typed(facts), INV, frozenset({"model"}), False)
    assert [(s.node, s.check, s.source) for s in named.steps] == [("n3", "model", "n2"),
                                                                 ("n1", "model", "n2")]
    assert "undo does not restore" in named.steps[0].note and named.ok == (("n2", "model"),)
    assert plan_fixes(results, typed(facts), INV, frozenset({"shm"}), False).skipped == ()


def test_no_good_copy_anywhere_is_manual():
    results = [CheckResult("model", "n3", Status.FAIL, "/models/m does not exist")]
    p = plan_fixes(results, {"n3": {}}, INV, frozenset({"model"}), False)
    assert p.steps == () and p.manual[0].check == "model" and "by hand" in p.manual[0].next_step


# ---------------------------------------------------------------- the copy, for real


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_pair() -> int:
    """A port p with p + 1 free too (the relay's range for a reference and one target)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise AssertionError("no two free ports")


def local_pair(tmp_path):
    port = free_pair()
    inv = loads(f"""
nodes:
  - {{name: ref, address: 127.0.0.1, local: true, role: head}}
  - {{name: dst, address: 127.0.0.1, local: true}}
model: {{path: {tmp_path}/unused}}
expectations: {{model_relay: {{ports: [{port}, {port + 1}]}}}}
""")
    dirs = {"ref": tmp_path / "ref", "dst": tmp_path / "dst"}
    return inv, dirs, lambda node: str(dirs[node.name])


def write_model(root, files):
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


def test_the_playbook_copies_node_to_node_records_paths_and_converges(tmp_path):
    inv, dirs, dir_of = local_pair(tmp_path)
    files = {"config.json": b"{}\n", "tokenizer.json": os.urandom(500),
             "weights/model-00001.safetensors": os.urandom((1 << 20) + 3)}
    write_model(dirs["ref"], files)
    write_model(dirs["dst"], {"config.json": b'{"old": 1}\n', "notes.txt": b"mine"})
    (dirs["dst"] / "weights").mkdir()
    (dirs["dst"] / "weights" / "model-00001.safetensors.part").write_bytes(
        files["weights/model-00001.safetensors"][:4096])         # an interrupted earlier run
    undo = fix_playbook.UndoRecord(tmp_path / "fix-undo.json")
    step = Step("dst", "model", "copy", source="ref")
    events: list[str] = []
    with Session(inv) as session:
        (out,) = fix_model.copy_models(inv, session, [step], undo, True, events.append,
                                       dir_of=dir_of)
        assert out.status == "changed" and out.after == "ok", out.summary
        assert "copied 3 file(s)" in out.summary and "1 replaced" in out.summary
        assert "notes.txt" in out.summary                        # extras kept, named
        for path, data in files.items():
            assert (dirs["dst"] / path).read_bytes() == data
        assert (dirs["dst"] / "notes.txt").read_bytes() == b"mine"
        (entry_,) = [e for e in json.loads(undo.path.read_text())["entries"]
                     if e["kind"] == "model-files"]
        assert entry_["replaced"] == ["config.json"] and entry_["source"] == "ref"
        assert sorted(entry_["created"]) == ["tokenizer.json", "weights/model-00001.safetensors"]
        (again,) = fix_model.copy_models(inv, session, [step], undo, True, dir_of=dir_of)
        assert again.status == "ok" and again.summary.startswith("nothing to copy")
        outcome = fix_playbook.undo(inv, session,
                                    fix_playbook.UndoOptions(undo.path, local_root=True),
                                    lambda q: True)
    assert outcome.results[-1].status == "skipped" and "not restored" in outcome.results[-1].summary
    assert (dirs["dst"] / "tokenizer.json").exists()


def test_a_busy_port_fails_every_target_with_the_reason(tmp_path):
    inv, dirs, dir_of = local_pair(tmp_path)
    write_model(dirs["ref"], {"config.json": b"{}\n"})
    low, high = inv.expectations["model_relay"]["ports"]
    with socket.socket() as s, socket.socket() as t, Session(inv) as session:
        s.bind(("127.0.0.1", low))
        s.listen(1)
        t.bind(("127.0.0.1", high))
        t.listen(1)
        (out,) = fix_model.copy_models(inv, session, [Step("dst", "model", "c", source="ref")],
                                       fix_playbook.UndoRecord(tmp_path / "u.json"), True,
                                       dir_of=dir_of)
    assert out.status == "failed" and "cannot listen" in out.summary
    assert not (dirs["dst"] / "config.json").exists()


def test_a_missing_reference_directory_fails_without_serving(tmp_path):
    inv, dirs, dir_of = local_pair(tmp_path)
    with Session(inv) as session:
        (out,) = fix_model.copy_models(inv, session, [Step("dst", "model", "c", source="ref")],
                                       fix_playbook.UndoRecord(tmp_path / "u.json"), True,
                                       dir_of=dir_of)
    assert out.status == "failed" and "no reference manifest" in out.summary


def test_fix_run_with_one_node_and_no_copy_anywhere_is_manual(tmp_path):
    inv = loads(f"nodes:\n  - {{name: here, address: 127.0.0.1, local: true}}\n"
                f"model: {{path: {tmp_path}/absent}}\n")
    with Session(inv) as session:
        outcome = fix_playbook.run(inv, session, fix_playbook.FixOptions(
            tuple(inv.nodes), frozenset({"model"}), False, True, tmp_path, True), lambda q: True)
    (r,) = [r for r in outcome.results if r.check == "model"]
    assert r.status == "manual" and "no node among those checked" in r.summary
    assert outcome.exit_code == 1


def test_sha_of_the_copied_bytes_matches_the_reference_manifest(tmp_path):
    inv, dirs, dir_of = local_pair(tmp_path)
    data = os.urandom(2 * (1 << 20) + 1)
    write_model(dirs["ref"], {"config.json": b"{}\n", "w.bin": data})
    with Session(inv) as session:
        found = fix_model.manifests(inv, session, inv.nodes, True, dir_of)
    assert found["dst"].exists is False
    assert found["ref"].by_path["w.bin"].sha256 == hashlib.sha256(data).hexdigest()
