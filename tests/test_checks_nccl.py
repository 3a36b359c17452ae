"""The NCCL log's judgement is a check (issue 43 item 3): cluster/inspection/parsers/nccl.py only
reads the log; cluster/inspection/checks/nccl.py gives the status, the findings and the verdict
sentence, the same as the parser gave on every labelled fixture before the move."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from cluster.base.results import Status
from cluster.inspection.checks import nccl as nccl_check
from cluster.inspection.parsers import nccl
from fakes import FIXTURES

LOGS = sorted((FIXTURES / "nccl").glob("*.log"))
RECORDED = yaml.safe_load((FIXTURES / "labels" / "nccl-verdicts.yaml").read_text())


def _strings(path: Path) -> list[str]:
    """Every string literal of a module, f-strings' literal parts included (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_the_parser_reads_and_does_not_judge():
    fields = {f.name for f in dataclasses.fields(nccl.NcclLog)}
    assert not fields & {"status", "verdict", "findings"}, "NcclLog carries a judgement"
    parser_strings = _strings(Path(nccl.__file__))
    statuses = {s.value for s in (Status.OK, Status.WARN, Status.FAIL)}
    assert not [s for s in parser_strings if s in statuses], \
        "the parser names a status (ok/warn/fail): judging belongs to checks/nccl.py"
    sentences = [s for s in _strings(Path(nccl_check.__file__)) if len(s) >= 24]
    assert sentences, "the check writes no verdict sentence"
    source = Path(nccl.__file__).read_text()
    assert not [s for s in sentences if s in source], "a verdict sentence is written in the parser"


def test_every_fixture_is_recorded():
    assert LOGS and {p.name for p in LOGS} == set(RECORDED)


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name[:3])
def test_the_check_gives_the_recorded_verdict(path: Path):
    judgement = nccl_check.judge(nccl.parse_file(path))
    want = RECORDED[path.name]
    assert judgement.verdict == want["verdict"]
    assert [f"{f.status.value}: {f.reason}" for f in judgement.findings] == want["findings"]
    assert judgement.verdict.startswith(judgement.status.value.upper() + ": ")


def test_judged_document_keeps_the_contract_order():
    log = nccl.parse_file(FIXTURES / "nccl" / "005-aws-socket-no-ib-many-nodes.log")
    doc = nccl_check.judged_document(log)
    keys = list(doc)
    at = keys.index("busbw_gbps")
    assert keys[at + 1:at + 3] == ["status", "verdict"]
    assert keys.index("findings") == keys.index("communicators") + 1
    assert [k for k in keys if k not in ("status", "verdict", "findings")] == list(log.to_dict())
    assert doc["status"] == "fail" and doc["findings"][0]["status"] == "fail"
    assert json.loads(json.dumps(doc)) == doc


def test_judged_logs_reads_ranks_as_one_log():
    text = (FIXTURES / "nccl" / "005-aws-socket-no-ib-many-nodes.log").read_text()
    half = len(text.splitlines()) // 2
    lines = text.splitlines()
    doc = nccl_check.judged_logs(["\n".join(lines[:half]), "\n".join(lines[half:])])
    assert doc is not None and doc["verdict"] == RECORDED["005-aws-socket-no-ib-many-nodes.log"]["verdict"]
    assert nccl_check.judged_logs(["no nccl here\n"]) is None
