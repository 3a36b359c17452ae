"""scripts/field_kit: it captures the command lines preflight runs (the same strings), writes a
bundle with a manifest, and reads every capture with the project's parsers. The node's tools are
small scripts printing real captured outputs (tests/fixtures), as on the simulated cluster; the
all-reduce runs for real with torch.distributed over gloo (the CPU build has no NCCL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.inspection.checks.node import NODE_CHECKS
from cluster.nodes.inventory import load

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "scripts"))
import field_kit  # noqa: E402

TOOLS = {
    "nvidia-smi": {"": "nvidia-smi/001-a100-80gb-pcie-550-partial.txt",
                   "topo -m": "nvidia-smi-topo/001-h100-8gpu-nv18-9nic-tabs.txt"},
    "ibstat": {"": "ibstat/001-cx7-roce-200g-active-plus-cx6dx-down.txt"},
    "lsmod": {"": "lsmod/001-nvidia-peermem-loaded-gdrdrv.txt"},
    "chronyc": {"tracking": "chronyc-tracking/001-stratum3-synced-fast-0.26ms.txt"},
}


def _tool_dir(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, answers in TOOLS.items():
        cases = "\n".join(f'  "{args}") exec cat {FIXTURES / rel} ;;' for args, rel in answers.items())
        script = f'#!/bin/sh\ncase "$*" in\n{cases}\n  *) echo "no such option: $*" >&2; exit 2 ;;\nesac\n'
        path = bin_dir / tool
        path.write_text(script)
        path.chmod(0o755)
    return bin_dir


def test_every_static_preflight_probe_is_captured_verbatim():
    inv = load(None)
    node = inv.nodes[0]
    commands = {c.command for c in field_kit.CAPTURES}
    static = [p for check in NODE_CHECKS for build in check.probes
              if (p := build(node, inv)) is not None
              and p.name not in ("versions", "runtime-imports", "model", "ports")]
    assert static, "no static probes found"
    for probe in static:
        assert probe.command in commands, f"field kit lacks preflight's {probe.name}: {probe.command}"


def test_capture_names_are_unique_and_kinds_are_parser_kinds():
    from cluster.inspection import parsers

    names = [c.name for c in field_kit.CAPTURES]
    assert len(names) == len(set(names))
    known = set(parsers.KINDS) | {"lspci", "dmesg", "fabricmanager", "ip-addr"}
    assert {c.kind for c in field_kit.CAPTURES if c.kind} <= known


def _run_kit(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    bundle = tmp_path / "bundle"
    env = dict(os.environ, PATH=f"{_tool_dir(tmp_path)}:/usr/bin:/bin", PYTHON=sys.executable)
    proc = subprocess.run([str(ROOT / "scripts" / "field_kit"), "--out", str(bundle), *args],
                          capture_output=True, text=True, env=env, timeout=280, cwd=tmp_path)
    return proc, bundle


def test_bundle_manifest_and_verdicts_from_real_outputs(tmp_path):
    proc, bundle = _run_kit(tmp_path, "--no-allreduce")
    assert proc.returncode == 1, proc.stderr  # tools missing here (ibv_devinfo...) -> warnings
    manifest = json.loads((bundle / "manifest.json").read_text())
    by_name = {c["name"]: c for c in manifest["commands"]}
    assert set(by_name) == {c.name for c in field_kit.CAPTURES}
    assert by_name["nvidia-smi"]["exit_code"] == 0
    assert (bundle / "nvidia-smi.txt").read_text() == \
        (FIXTURES / TOOLS["nvidia-smi"][""]).read_text()
    assert by_name["ibv_devinfo"]["exit_code"] == 127
    rows = {r["name"]: r for r in json.loads((bundle / "parse.json").read_text())}
    assert rows["nvidia-smi"]["status"] == "read"
    assert rows["nvidia-smi"]["data"]["driver_version"] == "550.90.12"
    assert rows["lsmod"]["status"] == "read"
    assert rows["chrony"]["status"] == "read"
    assert rows["gpu-query"]["status"] in ("unreadable", "missing")  # nvidia-smi rejects the flags
    assert rows["ibv_devinfo"]["status"] == "missing"
    assert "nccl-allreduce" not in rows
    assert "nvidia-smi" in proc.stdout and "bundle:" in proc.stdout
    versions = json.loads((bundle / "versions.json").read_text())
    assert versions["python"] and "torch" in versions


def test_refuses_an_existing_bundle_folder(tmp_path):
    (tmp_path / "bundle").mkdir()
    proc, _ = _run_kit(tmp_path, "--no-allreduce")
    assert proc.returncode == 2 and "cannot create" in proc.stderr


@pytest.mark.torch
def test_real_allreduce_over_gloo(tmp_path):
    pytest.importorskip("torch")
    proc, bundle = _run_kit(tmp_path, "--backend", "gloo", "--nproc", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads((bundle / "allreduce.json").read_text())
    assert result["exit_code"] == 0
    assert result["result"]["correct"] is True and result["result"]["world_size"] == 2
    rows = {r["name"]: r for r in json.loads((bundle / "parse.json").read_text())}
    assert rows["nccl-allreduce"]["status"] == "skipped"
