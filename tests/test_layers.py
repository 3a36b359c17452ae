"""The folder layout is the architecture: cluster/ and playbooks/ import only down the layers.

LAYERS (low to high) is the one table of the layers docs/architecture.md names. Every Python file
of cluster/ and playbooks/ belongs to exactly one layer (the longest matching entry); the import
graph (ast, every import statement: module level, in functions, under TYPE_CHECKING) has no
cycle and no import from a lower layer to a higher one. Inside a layer, BELOW_IN_LAYER orders
packages the same way: the transport (cluster/nodes) does not import the programs shipped over
it and their runner (cluster/node_programs). Other same-layer imports are allowed (the graph
stays acyclic). A new module fails here until it is placed: put it in the package of its
layer (or name it in LAYERS).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("cluster/__init__.py", "cluster/base", "cluster/data")),
    ("nodes", ("cluster/nodes", "cluster/node_programs")),
    ("report", ("cluster/report",)),
    ("inspection", ("cluster/inspection",)),
    ("planning", ("cluster/planning",)),
    ("remedy", ("cluster/remedy",)),
    ("ray", ("cluster/ray", "cluster/ray_jobs")),
    ("serving", ("cluster/serving",)),
    ("playbooks", ("playbooks",)),
    ("cli", ("cluster/cli.py", "cluster/__main__.py", "cluster/commands")),
)
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
# (lower entry, higher entry) of one layer: the lower never imports the higher.
BELOW_IN_LAYER = (("cluster/nodes", "cluster/node_programs"),)
# Packages that share a layer with the layer's own package, whose docstring gives the rule.
SHARED_PACKAGES = {"cluster/data", "cluster/node_programs", "cluster/ray_jobs"}


def layer_of(rel: str) -> str | None:
    """The layer of a repository-relative .py path: its longest matching LAYERS entry."""
    best, length = None, -1
    for name, entries in LAYERS:
        for entry in entries:
            if (rel == entry or rel.startswith(entry + "/")) and len(entry) > length:
                best, length = name, len(entry)
    return best


def entry_of(rel: str) -> str | None:
    """The LAYERS entry a repository-relative .py path belongs to (the longest that matches)."""
    found = [e for _, entries in LAYERS for e in entries if rel == e or rel.startswith(e + "/")]
    return max(found, key=len, default=None)


def module_files(repo: Path = REPO) -> dict[str, str]:
    """{dotted module: repository-relative path} of every .py file in cluster/ and playbooks/."""
    out = {}
    for top in ("cluster", "playbooks"):
        for p in sorted((repo / top).rglob("*.py")):
            rel = p.relative_to(repo)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = rel.as_posix()
    return out


def imported(module: str, path: str, tree: ast.AST, known: dict[str, str]) -> set[str]:
    """The modules of `known` that one module's import statements name (relative ones resolved)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            subs = [f"{origin}.{a.name}" for a in node.names]
            # `from PKG import mod` names the module; PKG itself only for a name it defines.
            targets = subs + ([origin] if any(s not in known for s in subs) else [])
        else:
            continue
        found.update(t for t in targets if t in known and t != module)
    return found


def import_graph(repo: Path = REPO) -> tuple[dict[str, str], dict[str, set[str]]]:
    known = module_files(repo)
    graph = {m: imported(m, p, ast.parse((repo / p).read_text(), p), known)
             for m, p in known.items()}
    return known, graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward(known: dict[str, str], graph: dict[str, set[str]]) -> list[str]:
    """Each import from a lower layer (or a lower entry of one layer) to a higher one, as
    'a (layer) -> b (layer)' ('a (layer: entry) -> b (layer: entry)' inside one layer)."""
    out = []
    for module, targets in sorted(graph.items()):
        mine, my_entry = layer_of(known[module]), entry_of(known[module])
        for target in sorted(targets):
            theirs, their_entry = layer_of(known[target]), entry_of(known[target])
            if mine and theirs and RANK[theirs] > RANK[mine]:
                out.append(f"{module} ({mine}) -> {target} ({theirs})")
            elif (my_entry, their_entry) in BELOW_IN_LAYER:
                out.append(f"{module} ({mine}: {my_entry}) -> {target} ({theirs}: {their_entry})")
    return out


def test_every_module_has_a_layer():
    unplaced = [p for p in module_files().values() if layer_of(p) is None]
    assert not unplaced, f"place these in the package of their layer (or in LAYERS): {unplaced}"


def test_imports_only_go_down_the_layers():
    known, graph = import_graph()
    assert not upward(known, graph)


def test_the_import_graph_has_no_cycle():
    _, graph = import_graph()
    assert not cycles(graph)


def test_every_package_says_its_job():
    """Each package's __init__.py has a docstring; each layer package says what it may import."""
    silent, no_rule = [], []
    layer_packages = {e for _, entries in LAYERS for e in entries if not e.endswith(".py")}
    for top in ("cluster", "playbooks"):
        for init in sorted((REPO / top).rglob("__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            rel = init.parent.relative_to(REPO).as_posix()
            if not doc.strip():
                silent.append(rel)
            elif rel in layer_packages - SHARED_PACKAGES and "May import" not in doc:
                no_rule.append(rel)
    assert not silent and not no_rule, (silent, no_rule)


def test_the_architecture_page_names_every_layer_in_order():
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^\d+\. \*\*(\w+)\*\*", section, re.M)
    assert named == [name for name, _ in LAYERS]


# The checks above can fail: each helper judged on a made-up tree.
@pytest.fixture()
def tree(tmp_path):
    def make(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            p = tmp_path / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return tmp_path
    return make


def test_a_function_level_upward_import_and_its_cycle_are_found(tree):
    repo = tree({"cluster/__init__.py": "", "cluster/inspection/__init__.py": "",
                 "cluster/ray/__init__.py": "",
                 "cluster/inspection/facts.py": "def f():\n    from cluster.ray import ray_cluster\n",
                 "cluster/ray/ray_cluster.py": "from cluster.inspection.facts import f\n"})
    known, graph = import_graph(repo)
    assert upward(known, graph) == ["cluster.inspection.facts (inspection) -> "
                                    "cluster.ray.ray_cluster (ray)"]
    assert cycles(graph) == [["cluster.inspection.facts", "cluster.ray.ray_cluster"]]


def test_relative_imports_resolve_and_a_same_layer_cycle_is_found(tree):
    repo = tree({"cluster/__init__.py": "", "cluster/ray/__init__.py": "",
                 "cluster/ray/a.py": "from . import b\n",
                 "cluster/ray/b.py": "from .a import x\n"})
    known, graph = import_graph(repo)
    assert graph["cluster.ray.a"] == {"cluster.ray.b"} and graph["cluster.ray.b"] == {"cluster.ray.a"}
    assert not upward(known, graph)
    assert cycles(graph) == [["cluster.ray.a", "cluster.ray.b"]]


def test_the_transport_importing_a_node_program_is_upward(tree):
    """cluster/nodes and cluster/node_programs share a layer, but the transport sits below the
    programs shipped over it: the way nodes/head_tunnel.py once read the head's Ray token."""
    repo = tree({"cluster/__init__.py": "", "cluster/nodes/__init__.py": "",
                 "cluster/node_programs/__init__.py": "from cluster.nodes.shell import q\n",
                 "cluster/nodes/shell.py": "q = 1\n",
                 "cluster/nodes/head_tunnel.py": "def f():\n    from cluster.node_programs import run_raw\n"})
    known, graph = import_graph(repo)
    assert upward(known, graph) == ["cluster.nodes.head_tunnel (nodes: cluster/nodes) -> "
                                    "cluster.node_programs (nodes: cluster/node_programs)"]
