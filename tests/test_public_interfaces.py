"""cluster/ and serve_apps/ rely only on vLLM's, paramiko's and Fabric's public interfaces (issue 40
item 3): every import (inside functions too, and importlib / __import__ with a literal name) of a
vLLM module is on the documented list (cluster/data/public_interfaces.yaml, each entry with its
source), and a private paramiko / Fabric part is used nowhere but in the one adapter
(cluster/nodes/ssh_adapter.py, pinned by tests/test_ssh_adapter.py). Each check is shown to
catch a planted private use."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cluster.base.yamlfile import packaged

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("cluster", "serve_apps")
SSH_ADAPTER = Path("cluster/nodes/ssh_adapter.py")
SSH_PACKAGES = ("paramiko", "fabric", "invoke")
SELF_NAMES = ("self", "cls")


def _allowed() -> dict[str, dict]:
    return packaged("public_interfaces.yaml")["vllm"]


def _sources() -> list[tuple[Path, str]]:
    return [(p.relative_to(REPO), p.read_text()) for top in SCANNED
            for p in sorted((REPO / top).rglob("*.py"))]


def _top(module: str | None) -> str:
    return (module or "").split(".")[0]


def _literal_imports(tree: ast.AST):
    """(line, module) of importlib.import_module("x") / __import__("x") with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def vllm_violations(source: str, allowed: dict[str, dict]) -> list[str]:
    """Each vLLM import of `source` that the list does not allow, as 'line N: module[.name]'."""
    tree = ast.parse(source)
    out = []

    def check(line: int, module: str, name: str | None = None) -> None:
        entry = allowed.get(f"{module}.{name}") if name else None
        if entry is not None:
            return                                   # from vllm.v1.metrics import ray_wrappers
        entry = allowed.get(module)
        if entry is None or (name and entry.get("names") and name not in entry["names"]):
            out.append(f"line {line}: {module}" + (f" import {name}" if name else ""))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _top(alias.name) == "vllm":
                    check(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _top(node.module) == "vllm":
            for alias in node.names:
                check(node.lineno, node.module, alias.name)
    for line, module in _literal_imports(tree):
        if _top(module) == "vllm":
            check(line, module)
    return out


def _ssh_names(tree: ast.AST) -> set[str]:
    """Local names bound to paramiko / Fabric / invoke (modules or what was imported from them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if _top(a.name) in SSH_PACKAGES)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                _top(node.module) in SSH_PACKAGES:
            names.update(a.asname or a.name for a in node.names)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def ssh_violations(source: str) -> list[str]:
    """Private paramiko / Fabric use in a module that imports them: a private name imported
    from them, a subclass of one of their classes (it relies on their internals), or a private
    attribute read or set on anything but our own self / cls."""
    tree = ast.parse(source)
    ssh = _ssh_names(tree)
    if not ssh:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names]
            if _top(module or names[0]) in SSH_PACKAGES and (
                    any(_private(part) for part in (module or "").split(".")) or
                    any(_private(part) for n in names for part in n.split("."))):
                out.append(f"line {node.lineno}: private import {module or names}")
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                if _root(base) in ssh:
                    out.append(f"line {node.lineno}: class {node.name} subclasses "
                               f"{ast.unparse(base)}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and \
                _root(node) not in SELF_NAMES:
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


# ---------------------------------------------------------------- the list itself


def test_every_listed_vllm_module_says_where_it_is_public_and_what_it_is_for():
    allowed = _allowed()
    assert "vllm.engine.arg_utils" in allowed and "vllm.v1.engine.async_llm" in allowed
    for module, entry in allowed.items():
        assert _top(module) == "vllm", module
        assert entry.get("source") and entry.get("used"), module


# ---------------------------------------------------------------- the tree


def test_cluster_and_serve_apps_import_only_listed_vllm_modules():
    allowed = _allowed()
    found = {str(path): bad for path, text in _sources()
             if (bad := vllm_violations(text, allowed))}
    assert found == {}, found


def test_no_private_paramiko_or_fabric_use_outside_the_adapter():
    found = {str(path): bad for path, text in _sources()
             if path != SSH_ADAPTER and (bad := ssh_violations(text))}
    assert found == {}, found


def test_the_gang_builds_no_vllm_class_itself():
    """A further node's rank is vLLM's command line: gang.py imports no vLLM module at all."""
    tree = ast.parse((REPO / "serve_apps" / "gang.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
        [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if _top(m) == "vllm"], imported


# ---------------------------------------------------------------- the checks catch what they must


@pytest.mark.parametrize("source, caught", [
    ("def start():\n    from vllm.v1.executor.multiproc_executor import MultiprocExecutor\n",
     ["line 2: vllm.v1.executor.multiproc_executor import MultiprocExecutor"]),
    ("import vllm.v1.engine.utils as engine_utils\n", ["line 1: vllm.v1.engine.utils"]),
    ("from vllm import LLMEngine\n", ["line 1: vllm import LLMEngine"]),
    ("from vllm.v1 import engine\n", ["line 1: vllm.v1 import engine"]),
    ("import importlib\nimportlib.import_module('vllm.v1.engine.core')\n",
     ["line 2: vllm.v1.engine.core"]),
    ("from vllm.engine.arg_utils import AsyncEngineArgs\nfrom vllm import SamplingParams\n"
     "from vllm.v1.metrics import ray_wrappers\nimport vllm\n", [])])
def test_a_planted_private_vllm_import_is_caught(source, caught):
    assert vllm_violations(source, _allowed()) == caught


@pytest.mark.parametrize("source, caught", [
    ("import paramiko\nclass T(paramiko.Transport):\n    _active_check_timeout = 1.0\n",
     ["line 2: class T subclasses paramiko.Transport"]),
    ("from fabric import Connection\nclass C(Connection):\n    inline_ssh_env = None\n",
     ["line 2: class C subclasses Connection"]),
    ("import paramiko\ndef share(client, keys):\n    client._host_keys = keys\n",
     ["line 3: client._host_keys"]),
    ("from paramiko.hostkeys import _private_helper\n",
     ["line 1: private import paramiko.hostkeys"]),
    ("import paramiko\nclass Mine:\n    def f(self):\n        return self._lock, paramiko.SSHClient()\n",
     []),
    ("def f(client):\n    return client._host_keys\n", [])])      # no paramiko/Fabric here
def test_a_planted_private_paramiko_or_fabric_use_is_caught(source, caught):
    assert ssh_violations(source) == caught
