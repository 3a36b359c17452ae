"""`cluster up` refuses to start Ray on a worker whose runtime differs from the head's, naming the
node and both versions; --force starts it and says so (issue 40). Pure plans, then the playbook
on a fake cluster."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import fakes
from cluster.nodes import inventory
from cluster.ray.ray_cluster import KEEP, REFUSE, RESTART, SKIP, START, plan_up
from fakes import RAY_INVENTORY as INV, node_facts as facts

NAMES = ("gpu01", "gpu02", "gpu03")
SAME = {"python": "3.11.7", "ray": "2.60.0", "vllm": "0.32.0", "torch": "2.13.0+cu128"}


def with_versions(name: str, **kw) -> "fakes.NodeFacts":
    running = kw.pop("running", False)
    return facts(name, running=running, versions=dict(SAME, **kw))


@pytest.fixture
def inv():
    return inventory.loads(INV)


def test_a_worker_with_another_vllm_is_refused_naming_the_node_and_both_versions(inv):
    f = {n: with_versions(n) for n in NAMES}
    f["gpu03"] = with_versions("gpu03", vllm="0.31.0")
    plan = plan_up(inv, f, None)
    assert not plan.refused                       # the others start
    assert plan.action("gpu01").kind == START and plan.action("gpu02").kind == START
    refused = plan.action("gpu03")
    assert refused.kind == REFUSE and not refused.commands
    assert "vllm 0.31.0 (from /opt/venv/bin/python3), the head gpu01 has 0.32.0" in refused.reason
    assert "--force" in refused.reason
    assert "gpu03" not in {e.node for e in plan.expected}


def test_force_starts_it_and_says_so(inv):
    f = {n: with_versions(n) for n in NAMES}
    f["gpu02"] = with_versions("gpu02", torch="2.12.0+cu126")
    plan = plan_up(inv, f, None, force=True)
    assert plan.action("gpu02").kind == START and plan.action("gpu02").commands
    assert any(w.startswith("--force: Ray (re)started on gpu02 although its runtime differs")
               and "torch 2.12.0+cu126" in w and "2.13.0+cu128" in w for w in plan.warnings)


def test_a_worker_whose_ray_differs_is_refused_even_with_force(inv):
    f = {n: with_versions(n) for n in NAMES}
    f["gpu03"] = facts("gpu03", ray="2.59.0", versions=dict(SAME, ray="2.59.0"))
    plan = plan_up(inv, f, None, force=True)
    assert plan.refused and "gpu03: Ray 2.59.0" in plan.refused[0]
    assert "2.60.0" in plan.refused[0] and "--force does not override it" in plan.refused[0]
    assert all(a.kind == SKIP for a in plan.actions)


def test_a_running_member_with_another_runtime_is_kept_with_a_warning(inv):
    from cluster.ray.ray_state import GcsNode, RayState
    from fakes import IDS, IPS
    f = {n: facts(n, running=True, versions=dict(SAME)) for n in NAMES}
    f["gpu02"] = replace(f["gpu02"], versions=dict(SAME, vllm="0.31.0"))
    st = RayState("dashboard", "2.60.0", tuple(
        GcsNode(IDS[n], IPS[n], True, n == "gpu01", {"GPU": 8.0, "CPU": 2.0}) for n in NAMES),
        None)
    plan = plan_up(inv, f, st)
    assert plan.action("gpu02").kind == KEEP
    assert any("gpu02: runs a runtime that differs" in w and "0.31.0" in w
               for w in plan.warnings)


def test_a_restart_of_a_differing_worker_is_refused_too(inv):
    f = {n: with_versions(n, running=True) for n in NAMES}
    f["gpu01"] = facts("gpu01", versions=dict(SAME))     # the head not running: all restart
    f["gpu02"] = replace(f["gpu02"], versions=dict(SAME, vllm="0.31.0"))
    plan = plan_up(inv, f, None)
    assert plan.action("gpu03").kind == RESTART
    assert plan.action("gpu02").kind == REFUSE


def test_unknown_versions_are_no_difference(inv):
    f = {n: with_versions(n) for n in NAMES}
    f["gpu02"] = facts("gpu02", versions={"python": "3.11.7", "ray": "2.60.0"})
    assert plan_up(inv, f, None).action("gpu02").kind == START


# ---------------------------------------------------------------- the playbook, fake cluster


def _documents(monkeypatch, odd: str, **versions):
    """The fake nodes' node_facts.py documents, `odd` with these versions (and HAProxy)."""
    base = fakes.node_facts_document

    def document(hostname: str) -> str:
        doc = json.loads(base(hostname))
        doc["haproxy"] = "/opt/venv/bin/haproxy"
        if hostname == odd:
            doc["versions"].update(versions)
        return json.dumps(doc) + "\n"
    monkeypatch.setattr(fakes, "node_facts_document", document)


@pytest.mark.parametrize("force", [False, True])
def test_up_passes_force_to_the_plan(monkeypatch, force):
    from playbooks import ray_up
    inv = fakes.fake_inventory(3)
    _documents(monkeypatch, "n3", vllm="0.31.0")
    out = ray_up.run(inv, fakes.FakeRunner(respond=fakes.preflight_answers()).session(inv),
                     ray_up.UpOptions(skip_preflight=True, dry_run=True, force=force),
                     confirm=lambda q: True)
    action = out.plan.action("n3")
    if force:
        assert action.kind == START
        assert any("--force" in w and "vllm 0.31.0" in w for w in out.plan.warnings)
    else:
        assert action.kind == REFUSE and "vllm 0.31.0" in action.reason \
            and "the head n1 has 0.32.0" in action.reason
