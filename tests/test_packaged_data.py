"""cluster/data/*.yaml through the one packaged-data loader (cluster/base/yamlfile.packaged)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cluster.base import yamlfile

CLUSTER = Path(yamlfile.__file__).parents[1]          # the cluster package
DATA = CLUSTER / "data"
DATA_FILES = sorted(p.name for p in DATA.glob("*.yaml"))


def test_the_data_files_are_found():
    """The parametrized test below runs once per file: none found would run it not at all
    (it did when yamlfile.py moved into cluster/base/ and this path still pointed beside it)."""
    assert {"expectations.yaml", "limits.yaml", "gpus.yaml"} <= set(DATA_FILES)


@pytest.mark.parametrize("name", DATA_FILES)
def test_every_data_file_reads_with_the_bounded_parser(name):
    assert isinstance(yamlfile.packaged(name), dict)


def test_each_caller_gets_its_own_copy():
    first = yamlfile.packaged("expectations.yaml")
    first.clear()
    assert yamlfile.packaged("expectations.yaml")


def test_no_module_reads_the_package_data_its_own_way():
    """Only yamlfile.py opens cluster/data (importlib.resources) or calls yaml.safe_load."""
    found = []
    for path in sorted(CLUSTER.rglob("*.py")):
        if path.name == "yamlfile.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                    (node.attr == "files" and isinstance(node.value, ast.Name)
                     and node.value.id == "resources")
                    or (node.attr in ("safe_load", "load") and isinstance(node.value, ast.Name)
                        and node.value.id == "yaml")):
                found.append(f"{path.relative_to(CLUSTER.parent)}:{node.lineno}")
    assert found == []
