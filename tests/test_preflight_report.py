"""The preflight report's size and evidence (issue 24.7b): bounded tails, each distinct evidence
once, the shipped program's text left out; over a fake cluster answering with real captures."""

from __future__ import annotations

import pytest

from cluster.report.render import to_json
from cluster.nodes.shell import heredoc, without_heredocs
from fakes import FakeRunner, fake_inventory, preflight_answers
from playbooks.preflight import run_preflight

KB = 1024


def _report(n: int) -> dict:
    inv = fake_inventory(n, "ib_hcas: [mlx5_0]")
    return run_preflight(inv, FakeRunner(respond=preflight_answers()).session(inv)).to_dict()


def _result(doc: dict, node: str, check: str) -> dict:
    return next(r for r in doc["results"] if r["node"] == node and r["check"] == check)


@pytest.mark.parametrize("nodes", [3, 32])
def test_the_report_is_at_most_12_kb_per_node(nodes):
    """Compact JSON (what a rack-scale report is written as). The captures make six checks
    fail on every node, so the first node's evidence is the long kind."""
    import json

    doc = _report(nodes)
    # a few nodes: 14 KB each since the runtime rows (runtime, contract, torch-cuda: issue 40),
    # ~1.5 KB a node; a rack repeats its evidence as pointers and stays within 12 KB a node
    assert len(json.dumps(doc)) <= (14 if nodes < 10 else 12) * KB * nodes
    assert len(to_json(doc)) <= (18 if nodes < 10 else 12) * KB * nodes   # indented when small


def test_a_failing_check_keeps_its_evidence_and_a_repeat_points_to_the_first_node():
    doc = _report(3)
    first, again = _result(doc, "n1", "memlock"), _result(doc, "n2", "memlock")
    assert first["status"] == again["status"] == "fail"
    assert "max locked memory" in first["evidence"]["output_tail"]
    assert first["evidence"]["data"]["memlock_kib"] == 64
    assert again["evidence"]["output_tail"] == "(as on n1)"
    assert again["evidence"]["command"] == first["evidence"]["command"] == "ulimit -l"
    assert again["summary"] == first["summary"]


def test_a_check_of_several_commands_shows_the_end_of_each():
    """acs reads lspci, the GPU query and ibstat: its tail holds lspci's ACSCtl lines, not only
    ibstat's last lines."""
    tail = _result(_report(3), "n1", "acs")["evidence"]["output_tail"]
    assert "ACSCtl:" in tail and "Physical state: Disabled" in tail


def test_the_versions_evidence_names_the_program_without_its_text():
    command = _result(_report(3), "n1", "versions")["evidence"]["command"]
    assert "here-document of" in command and "import json" not in command
    assert len(command) < 2000


def test_without_heredocs_leaves_out_only_the_bodies_heredoc_wrote():
    shipped = heredoc("python3 - a", "print(1)\nprint(2)", prefix="CLUSTER_PROGRAM_")
    shown = without_heredocs(f"A=1; {shipped}; echo done")
    assert shown.startswith("A=1; python3 - a <<'CLUSTER_PROGRAM_")
    assert shown.endswith("' [here-document of 2 lines, 17 characters, not shown]; echo done")
    assert without_heredocs("cat <<'X'\nbody\nX") == "cat <<'X'\nbody\nX"   # not ours: as is
    assert without_heredocs("<<'CLUSTER_EOF_1'\nno end") == "<<'CLUSTER_EOF_1'\nno end"
