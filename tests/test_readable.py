"""Readable at 80 columns and in a pipe (issue 41 item 7): tables never break an identifier
mid-word, `parse` of an nvidia-smi report is a per-GPU table, the NCCL panel leads with its
verdict and leaves out empty fields, the main commands' --help ends with examples, and the CLI
completes in bash and zsh."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from cluster.base.results import CheckResult, Report, Status

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent

NODES = [f"rack-b-gpu-node-{i:04d}" for i in range(1, 17)]
IPS = [f"10.200.131.{100 + i}" for i in range(1, 17)]
MODEL = "NVIDIA-H100-80GB-HBM3"
HCAS = [f"mlx5_bond_{i}" for i in range(8)]
IDENTIFIERS = [*NODES, *IPS, MODEL, *HCAS]
_CELL_EDGES = re.compile(r"[\s│┃║|,]+")


def broken(text: str, identifiers=IDENTIFIERS) -> list[tuple[str, str]]:
    """(identifier, piece) for every piece of an identifier left on a line without the rest of
    it: a word that is a part of an identifier, but not the whole and not cut with an ellipsis."""
    out = []
    for line in text.splitlines():
        for word in _CELL_EDGES.split(line):
            word = word.strip(",;:()[]")
            if len(word) < 5 or word.endswith("…"):
                continue
            out += [(ident, word) for ident in identifiers if word != ident and word in ident]
    return out


def render80(*renderables) -> str:
    console = Console(width=80, file=io.StringIO(), force_terminal=False, color_system=None)
    for r in renderables:
        console.print(r)
    return console.file.getvalue()


def _report(nodes: list[str]) -> Report:
    results = []
    for node, ip in zip(nodes, IPS):
        results += [
            CheckResult("gpus", node, Status.OK, f"8 x {MODEL} on {node}"),
            CheckResult("ib", node, Status.FAIL, f"HCAs {','.join(HCAS)} down; node ip {ip}",
                        fix=f"check the cables of {HCAS[0]} on {node}"),
        ]
    results.append(CheckResult("reachability", None, Status.WARN,
                               f"{nodes[0]} cannot reach {IPS[1]} on 6379"))
    return Report("preflight", tuple(results))


@pytest.mark.parametrize("nodes", [2, 16])
def test_preflight_at_80_columns_breaks_no_identifier(monkeypatch, nodes):
    from cluster.commands import preflight

    console = Console(width=80, file=io.StringIO(), force_terminal=False, color_system=None)
    monkeypatch.setattr(preflight, "stdout", console)
    preflight.render(_report(NODES[:nodes]))
    text = console.file.getvalue()
    assert broken(text) == [], text
    assert "rack-b-gpu-node-0001" in text or "rack-b-gpu-node-0…" in text


def test_report_and_folded_tables_at_80_columns_break_no_identifier():
    from cluster.report.fold import Row, fold
    from cluster.report.render import folded_table, report_table

    report = _report(NODES)
    groups = fold(Row(r.node, r.check, r.status.value, r.summary, r.fix)
                  for r in report.results if r.node)
    text = render80(report_table(report), folded_table(groups, len(NODES)))
    assert broken(text) == [], text
    assert all(h in text for h in HCAS), "a list wraps between its items, none is lost"


def test_inventory_table_at_80_columns_breaks_no_identifier(monkeypatch, tmp_path):
    import argparse

    from cluster.commands import inventory

    lines = ["ssh:", "  user: ops", "  jump_host: ops@bastion-rack-b.example.net",
             "nodes:"]
    for i, (name, ip) in enumerate(zip(NODES[:4], IPS)):
        lines += [f"  - name: {name}", f"    address: {ip}", f"    node_ip: {ip}",
                  f"    ib_hcas: [{', '.join(HCAS)}]"]
        if i == 0:
            lines.append("    role: head")
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n")
    console = Console(width=80, file=io.StringIO(), force_terminal=False, color_system=None)
    monkeypatch.setattr(inventory, "stdout", console)
    code = inventory.run(argparse.Namespace(inventory=str(path), json=False))
    text = console.file.getvalue()
    assert code in (0, 1), text
    assert broken(text) == [], text


def _parsed80(kind: str, name: str) -> str:
    from cluster.commands import parse

    (result,) = parse.parse_path(str(FIXTURES / kind / name), None)
    return render80(parse._render(result))


def test_parse_of_an_nvidia_smi_report_is_a_per_gpu_table_at_80_columns():
    text = _parsed80("nvidia-smi", "105-550-h100-hbm3-persistence-on-72gb-used-root-prompt.txt")
    lines = text.splitlines()
    assert len(lines) < 25, text                     # it was 100+ lines, a header char per line
    header = next(line for line in lines if " name " in line)
    assert all(col in header for col in ("gpu", "mem MiB", "util%", "temp", "power W", "bus id"))
    gpu0 = next(line for line in lines if "00000000:19:00.0" in line)
    assert "72790/81559" in gpu0 and "145/700" in gpu0, text
    assert any("00000000:3B:00.0" in line for line in lines), text
    assert broken(text, ["00000000:19:00.0", "00000000:3B:00.0", "72790/81559"]) == [], text


def test_the_nccl_panel_leads_with_the_verdict_and_leaves_out_empty_fields():
    text = _parsed80("nccl", "037-h100-5node-ib-completion-error4-vendor81.log")
    inside = [line.strip("│ ") for line in text.splitlines()[1:]]
    assert inside[0].startswith("FAIL: NCCL errors"), text
    for empty in ("nccl_version", "n_ranks ", "gdr ", "ib_hcas", "busbw_gbps", "env", "notes"):
        assert not any(line.startswith(empty) for line in inside), (empty, text)
    assert "inter_node_transport" in text and "empty field(s) left out" in text
    assert text.index("findings") < text.index("errors (2)"), text


MAIN = ("preflight", "fix", "up", "plan", "deploy", "bench", "status")


def _help(command: str) -> str:
    from fakes import cluster_cli

    proc = cluster_cli(command, "--help", env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("command", MAIN)
def test_main_commands_help_ends_with_examples_that_parse(command):
    import shlex

    from cluster import cli

    text = _help(command)
    lines = text.rstrip("\n").splitlines()
    assert all(len(line) <= 80 for line in lines), text
    start = max(i for i, line in enumerate(lines) if line == "examples:")
    examples = [line.strip() for line in lines[start + 1:]]
    assert 2 <= len(examples) <= 3 and all(e.startswith(f"cluster {command}") for e in examples)
    for example in examples:
        words = []
        for word in shlex.split(example, comments=True)[1:]:
            if word in (">", "|"):
                break
            words.append(word)
        args = cli._parse(cli.build_parser(words), words)    # a usage error raises
        assert args.command == command


def _complete(tmp_path: Path, line: str) -> list[str]:
    """What the shell gets from `cluster` for `line` with the cursor at its end (argcomplete's
    protocol: _ARGCOMPLETE, COMP_LINE, COMP_POINT; the answer goes to a file here)."""
    out = tmp_path / "completions"
    env = {**os.environ, "PYTHONPATH": str(REPO), "_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": "\n",
           "COMP_LINE": line, "COMP_POINT": str(len(line)), "COMP_TYPE": "9",
           "_ARGCOMPLETE_STDOUT_FILENAME": str(out)}
    from fakes import cluster_cli

    proc = cluster_cli(cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    return out.read_text().split()


@pytest.mark.parametrize("line, expect", [
    ("cluster pre", ["preflight"]),
    ("cluster plan --mo", ["--model"]),
    ("cluster -i cluster.yaml dep", ["deploy"]),
    ("cluster deploy --pl", ["--placement-only", "--plan"]),
])
def test_the_cli_completes_commands_and_flags(tmp_path, line, expect):
    assert sorted(_complete(tmp_path, line)) == expect


@pytest.mark.parametrize("shell, needle", [("bash", "complete "), ("zsh", "compdef")])
def test_completion_prints_the_shell_code(shell, needle):
    from fakes import cluster_cli

    proc = cluster_cli("completion", shell)
    assert proc.returncode == 0, proc.stderr
    assert needle in proc.stdout and "cluster" in proc.stdout


def test_listing_the_commands_imports_no_completion_code():
    code = ("import sys\nfrom cluster import cli\ntry:\n    cli.main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('argcomplete' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout + proc.stderr
