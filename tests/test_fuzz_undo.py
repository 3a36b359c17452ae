"""Hostile-input suite (Hypothesis) for `cluster fix --undo`'s record (cluster/remedy/fix_undo.py) and
the probe output split (cluster/inspection/probes.py): any bytes, any JSON, any mutation of a real record
either reads as a plan that names only the files and mount points the fixes own, or is refused
with one UsageError line; never another exception, never a path outside the allow-list. The
split never raises, keeps at most its bound per stream, and never returns a probe not asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.base.errors import UsageError
from cluster.remedy.fix_undo import read_record
from cluster.remedy.fixes import FSTAB, LIMITS_FILE, MODULES_LOAD_FILE, OWNED_FILES, OWNED_MOUNTS
from cluster.inspection.probes import Probe, split_probe_output

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
GOOD = [{"kind": "start", "nodes": ["n1", "n2"]},
        {"node": "n1", "check": "gpudirect", "kind": "file", "path": MODULES_LOAD_FILE,
         "before": None},
        {"node": "n2", "check": "shm", "kind": "mount", "target": "/dev/shm",
         "options": "rw,nosuid,nodev,size=65536k,inode64"},
        {"node": "n2", "check": "shm", "kind": "file", "path": FSTAB, "before": "# fstab\n"},
        {"node": "n1", "check": "memlock", "kind": "file", "path": LIMITS_FILE, "before": "x\n"},
        {"node": "n2", "check": "model", "kind": "model-files", "dir": "/models/m",
         "source": "n1", "created": ["a.safetensors"], "replaced": [],
         "restored_by_undo": False}]
OWNED = set().union(*OWNED_FILES.values())
MOUNTS = set().union(*OWNED_MOUNTS.values())

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=5), max_leaves=30)
HOSTILE_TEXT = st.sampled_from(["/etc/shadow", "../etc/fstab", "/etc/../etc/fstab", "etc/fstab",
                                "/etc//fstab", FSTAB + "\x00", FSTAB + "/", "/", "", "~root",
                                "/dev/shm/../../etc/sudoers", "size=1,exec", "size=1;id",
                                "\u202e/etc/fstab", "x" * 5000]) | st.text(max_size=30)


def outcome(tmp_path: Path, raw: bytes):
    """read_record's answer: the plan, or the refusal line (anything else fails the test)."""
    path = tmp_path / "fix-undo.json"
    path.write_bytes(raw)
    try:
        plan = read_record(path)
    except UsageError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 2000
        return None
    for f in plan.files:
        assert f.path in OWNED_FILES[f.check] and f.path in OWNED
    for m in plan.mounts:
        assert m.target in OWNED_MOUNTS[m.check] and m.target in MOUNTS
        assert m.size.rstrip("kKmMgG%").isdigit()
    return plan


def test_the_real_record_shape_reads_as_its_plan(tmp_path):
    plan = outcome(tmp_path, json.dumps({"entries": GOOD}).encode())
    assert [(f.node, f.path) for f in plan.files] == [("n1", LIMITS_FILE), ("n2", FSTAB),
                                                     ("n1", MODULES_LOAD_FILE)]
    assert [(m.node, m.size) for m in plan.mounts] == [("n2", "65536k")]
    assert plan.models[0].count == 1


@SETTINGS
@given(raw=st.binary(max_size=300))
def test_any_bytes_are_a_plan_or_one_refusal_line(tmp_path, raw):
    outcome(tmp_path, raw)


@SETTINGS
@given(doc=JSON)
def test_any_json_document_is_a_plan_or_one_refusal_line(tmp_path, doc):
    outcome(tmp_path, json.dumps(doc).encode())


@SETTINGS
@given(data=st.data())
def test_a_mutated_real_record_never_names_a_path_outside_the_allow_list(tmp_path, data):
    entries = json.loads(json.dumps(GOOD))
    for _ in range(data.draw(st.integers(1, 4))):
        e = data.draw(st.sampled_from(entries))
        key = data.draw(st.sampled_from(sorted(e) + ["extra"]))
        e[key] = data.draw(HOSTILE_TEXT | JSON)
    outcome(tmp_path, json.dumps({"entries": entries}).encode())


@pytest.mark.parametrize("raw", [b"[" * 200_000, b'{"entries": [' + b"[" * 50_000 + b"]",
                                 b'{"entries": NaN}', b'{"entries": [Infinity]}',
                                 b"\xef\xbb\xbf" + json.dumps({"entries": GOOD}).encode()])
def test_deep_nesting_nan_and_a_bom(tmp_path, raw):
    outcome(tmp_path, raw)


LINE = st.sampled_from(["@@cluster-probe@@ a begin", "@@cluster-probe@@ a end 0",
                        "@@cluster-probe@@ zz begin", "@@cluster-probe@@ a cut | 99 bytes cut",
                        "@@cluster-probe@@ a end x", "|out", "!err", "", "|\r\x1b[2J",
                        "@@cluster-probe@@ - no-tmp x"]) | st.text(max_size=20)


@SETTINGS
@given(lines=st.lists(LINE, max_size=40))
def test_the_probe_split_never_raises_nor_returns_a_probe_not_asked(lines):
    out = split_probe_output("\n".join(lines), [Probe("a", "x")])
    assert set(out) <= {"a"}
    for o in out.values():
        assert o.cut >= 0 and isinstance(o.stdout, str) and isinstance(o.stderr, str)
