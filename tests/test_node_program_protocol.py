"""The one node-program protocol (issue 24 item 2), enforced over the laptop's code (cluster/ and
playbooks/, less the code that runs on the nodes): a program is shipped by the one runner and
its answer decoded by the one reader (cluster/node_programs/__init__.py); nobody else decodes
JSON that came from a node, reaches for the shipping parts (BOOT, the program's source), or
speaks a private marker-line protocol; the Ray jobs' programs live in cluster/ray_jobs/."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

import cluster.ray_jobs as ray_jobs
from cluster.node_programs import declare_programs, declared_programs, program_path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path("cluster/node_programs/__init__.py")
ON_NODE = (Path("cluster/node_programs"), Path("cluster/ray_jobs"))   # the programs themselves
PARSERS = Path("cluster/inspection/parsers")         # pure parsers of tool text (their own errors)
# JSON that never came from a node program, each with why: decoding it is not reading an answer.
LOCAL_JSON = {
    ("cluster/planning/modelinfo.py", "loads_json"): "Hugging Face config files (the laptop's or a hub's)",
    ("cluster/report/rundir.py", "RunDir.finish"): "the laptop's own run directories",
    ("cluster/report/rundir.py", "read_run"): "the laptop's own run directories",
    ("cluster/serving/bench.py", "_error_message"): "the OpenAI endpoint's HTTP replies (bench's client)",
    ("cluster/serving/bench.py", "SseReader._chunk"): "the OpenAI endpoint's server-sent events",
    ("cluster/ray/health_job.py", "parse_readings"):
        "the health job's readings file format (the text health_readings.py answers with)",
    ("cluster/ray/health_job.py", "parse_actions"):
        "the health job's actions file format (the text health_readings.py answers with)",
}
SHIPPING = {"BOOT", "with_input", "source", "_one_document", "_DECODER"}
DECODERS = {"loads", "load", "raw_decode", "JSONDecoder"}


def laptop_modules() -> list[Path]:
    out = []
    for top in ("cluster", "playbooks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel == RUNNER or any(rel.is_relative_to(d) for d in ON_NODE + (PARSERS,)):
                continue
            out.append(rel)
    return out


@functools.lru_cache(maxsize=None)
def tree_of(rel: Path) -> ast.Module:
    return ast.parse((ROOT / rel).read_text())


class _Scope(ast.NodeVisitor):
    """Every call with the qualified name of the function it is in."""

    def __init__(self):
        self.stack: list[str] = []
        self.calls: list[tuple[str, ast.Call]] = []

    def _scoped(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node):
        self.calls.append((".".join(self.stack), node))
        self.generic_visit(node)


def _callee(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    return f.id if isinstance(f, ast.Name) else ""


def _round_trip(call: ast.Call) -> bool:
    """json.loads(json.dumps(x)) (or of a scrub of it): a deep copy, nothing decoded."""
    return any(isinstance(n, ast.Call) and _callee(n) in ("dumps", "to_json")
               for a in call.args for n in ast.walk(a))


def json_decodes(rel: Path) -> list[tuple[str, int]]:
    scope = _Scope()
    scope.visit(tree_of(rel))
    found = []
    for where, call in scope.calls:
        f = call.func
        named = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
            f.value.id == "json" and f.attr in DECODERS
        if (named or _callee(call) == "raw_decode") and not _round_trip(call):
            found.append((where, call.lineno))
    return found


def test_no_module_decodes_remote_json_but_the_one_reader():
    stray = [f"{rel}:{line} in {where or '<module>'}" for rel in laptop_modules()
             for where, line in json_decodes(rel) if (str(rel), where) not in LOCAL_JSON]
    assert not stray, "decode a program's answer with cluster.node_programs.parse_answer / " \
                      "read_document (or list why this JSON is no node's answer): " + \
                      ", ".join(stray)


def test_the_allowed_local_json_readers_still_exist():
    """An allow-list entry whose function is gone would hide a new reader of that name."""
    present = {(str(rel), where) for rel in laptop_modules() for where, _ in json_decodes(rel)}
    assert set(LOCAL_JSON) <= present, set(LOCAL_JSON) - present


def test_only_the_runner_touches_the_shipping_parts():
    stray = []
    for rel in laptop_modules():
        for node in ast.walk(tree_of(rel)):
            if isinstance(node, ast.ImportFrom) and node.module == "cluster.node_programs":
                stray += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name in SHIPPING]
            if isinstance(node, ast.Attribute) and node.attr in SHIPPING and \
                    isinstance(node.value, ast.Name) and node.value.id == "node_programs":
                stray.append(f"{rel}:{node.lineno} uses node_programs.{node.attr}")
            # a Call's parts handed to session.run by hand: run_call does that, once
            if isinstance(node, ast.Call) and _callee(node) == "run" and any(
                    isinstance(k.value, ast.Attribute) and k.value.attr == "stdin"
                    for k in node.keywords if k.arg == "stdin"):
                stray.append(f"{rel}:{node.lineno} runs a program call past run_call")
    assert not stray, stray


def test_no_private_marker_line_protocol():
    """A program answers with its one JSON document, not with a tagged line in its output
    (probes.py's framing of many tool outputs in one SSH trip is the facts layer's, not a
    program answer)."""
    stray = []
    for rel in laptop_modules() + sorted(p.relative_to(ROOT) for d in ON_NODE
                                         for p in (ROOT / d).glob("*.py")):
        if rel == Path("cluster/inspection/probes.py"):
            continue
        for node in tree_of(rel).body:
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                stray += [f"{rel}:{node.lineno} {n}" for n in names if "MARKER" in n]
    assert not stray, stray


def test_the_ray_jobs_live_together_and_say_so():
    assert "Ray job" in ray_jobs.__doc__
    here = Path(ray_jobs.__file__).parent
    for name in ray_jobs.ENTRYPOINTS + ray_jobs.PROGRAMS:
        assert (here / f"{name}.py").is_file(), name
    for name in ray_jobs.ENTRYPOINTS:              # run by Ray, never shipped as a program
        with pytest.raises(ValueError):
            program_path(name)
    assert program_path("nccl_job").parent == here
    stems = [p.stem for d in ON_NODE for p in (ROOT / d).glob("*.py") if p.stem != "__init__"]
    assert len(stems) == len(set(stems)), "a program's name is unique over both folders"
    for old in ("playbooks/nccl_allreduce.py", "cluster/health_runner.py",
                "cluster/node_programs/nccl_job.py", "cluster/node_programs/health_submit.py"):
        assert not (ROOT / old).exists(), old


# ---- the programs are a declared registry, not files found by path (issue 43 item 5)


def test_every_program_file_is_declared_and_every_declared_program_is_its_file():
    files = {p.stem: p.resolve() for d in ON_NODE for p in (ROOT / d).glob("*.py")
             if not p.stem.startswith("_")
             and p.stem not in ray_jobs.ENTRYPOINTS + ray_jobs.ENTRYPOINT_MODULES}
    assert {name: path.resolve() for name, path in declared_programs().items()} == files


def test_the_runner_does_not_find_the_ray_jobs_programs_by_path():
    """cluster/node_programs (layer nodes) knows only its own programs; cluster/ray_jobs declares
    its own, and importing cluster.ray (every caller of them) declares them."""
    probe = ("from cluster.node_programs import program_path\n"
             "try:\n    program_path('nccl_job')\nexcept ValueError:\n    print('undeclared')\n"
             "import cluster.ray\nprint(program_path('nccl_job').parent.name)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["undeclared", "ray_jobs"], out.stderr


def test_a_name_names_one_file(tmp_path):
    assert declare_programs(ROOT / "cluster" / "ray_jobs", ("nccl_job",)) == ("nccl_job",)
    with pytest.raises(ValueError, match="declared twice"):
        declare_programs(tmp_path, ("nccl_job",))
    for bad in ("_common", "no-such", "../x"):
        with pytest.raises(ValueError):
            declare_programs(tmp_path, (bad,))
    with pytest.raises(ValueError, match="not a declared"):
        program_path("never_declared")
