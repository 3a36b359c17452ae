"""The facts layer (cluster/inspection/facts.py) and its on-node program (cluster/node_programs/node_facts.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Mapping

import pytest

from cluster.base.errors import ParseError
from cluster.inspection import facts
from cluster.nodes import inventory
from cluster.inspection.checks.node import NODE_CHECKS
from cluster.node_programs import node_facts as program
from cluster.inspection.preflight import evaluate_node, node_probes
from fakes import FakeRunner
from cluster.inspection.probes import NOT_FOUND, Probe, ProbeOutput, probe_script
from cluster.nodes.remote import CommandResult

INV = """\
nodes:
  - {name: n1, role: head, address: 10.0.0.1, node_ip: 10.0.0.1, env: {API_TOKEN: s3cret}}
  - {name: n2, address: 10.0.0.2, node_ip: 10.0.0.2}
  - {name: n3, address: 10.0.0.3, node_ip: 10.0.0.3}
"""
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def inv():
    return inventory.loads(INV)


def _out(name, stdout="", code=0, stderr=""):
    return ProbeOutput(name, name, code, stdout, stderr)


def _doc(**over):
    doc = {"python": "/usr/bin/python3", "python_version": "3.11.7", "ray_version": "2.60.0",
           "versions": {"python": "3.11.7", "ray": "2.60.0", "vllm": "0.32.0", "torch": None},
           "hostname": "n2", "auth_token": True, "memlock_session": None,
           "memlock_session_known": True, "processes": []}
    doc.update(over)
    return json.dumps(doc) + "\n"


def test_one_probe_per_name_and_every_run_reads_the_ray_facts(inv):
    node = inv.node("n2")
    names = [p.name for p in node_probes(node, inv, NODE_CHECKS)]
    assert len(names) == len(set(names))
    assert {"versions", "gpu-query", "ibstat", "ports"} <= set(names)
    assert [p.name for p in facts.probes_for(node, inv, facts.RAY_PROBES)] == \
        ["gpu-query", "versions"]


def test_the_gather_command_carries_no_secret(inv):
    command = facts.gather_command(inv.node("n1"), inv)
    assert "s3cret" not in command and "API_TOKEN" not in command


def test_facts_from_outputs_read_the_gpus_versions_and_raylet(inv):
    raylet = {"pid": 7, "kind": "raylet", "comm": "raylet", "memlock": None,
              "args": ["--node_id=abc", "--node_ip_address=10.0.0.2",
                       "--gcs-address=10.0.0.1:6379", "--static_resource_list=CPU,8,GPU,2"],
              "env": {"NCCL_SOCKET_IFNAME": "eth0"}}
    outputs = {"versions": _out("versions", _doc(processes=[raylet, {"pid": 9, "kind": "other",
                                                                      "comm": "ray::IDLE"}])),
               "gpu-query": _out("gpu-query", f"index, name, memory.total [MiB]\n0, {H100}, 81559\n"
                                              f"1, {H100}, 81559\n")}
    f = facts.facts_from_outputs(inv.node("n2"), outputs)
    assert f.usable and f.gpu_count == 2 and f.gpu_model == H100
    assert f.versions["vllm"] == "0.32.0" and f.versions["torch"] is None
    assert f.raylet.node_id == "abc" and f.raylet.resources == {"CPU": 8.0, "GPU": 2.0}
    assert f.raylet.memlock is None and f.ray_pids == (7, 9) and f.running
    assert f.memlock_session is None and f.auth_token


@pytest.mark.parametrize("versions_out, want", [
    (_out("versions", "", NOT_FOUND, "bash: /opt/venv/bin/python3: No such file or directory"),
     "python not found"),
    (_out("versions", "", 124), "timed out"),
    (_out("versions", "Traceback (most recent call last):\n", 1, "ImportError: x"), "exit 1"),
    (_out("versions", "[1, 2]\n"), "unreadable facts"),
    (_out("versions", "not json\n"), "unreadable facts"),
])
def test_unreadable_node_facts_are_an_error_never_a_guess(inv, versions_out, want):
    f = facts.facts_from_outputs(inv.node("n2"), {"versions": versions_out})
    assert f.reached and not f.usable and want in f.error


def test_an_unreached_node_and_a_probe_script_that_died(inv):
    down = CommandResult("n2", "x", None, "", "", 1.0, "unreachable", "connection refused")
    f = facts.node_facts(inv.node("n2"), down, [])
    assert not f.reached and f.error == "unreachable: connection refused"
    died = CommandResult("n2", "x", 137, "", "Killed\n", 1.0, "failed")
    f = facts.node_facts(inv.node("n2"), died, [Probe("versions", "x")])
    assert f.reached and "fact gathering failed (exit 137): Killed" in f.error


def test_the_real_probe_script_round_trip(inv):
    """probe_script's real output (bash here) -> the same NodeFacts as the outputs themselves."""
    doc = _doc()
    probes = [Probe("versions", f"printf %s '{doc.strip()}'"),
              Probe("gpu-query", "echo 'index, name'; echo '0, NVIDIA L4'")]
    p = subprocess.run(["bash", "-c", probe_script(probes)], capture_output=True, text=True,
                       timeout=60)
    f = facts.node_facts(inv.node("n2"), CommandResult("n2", "x", 0, p.stdout, "", 0.1, "ok"),
                         probes)
    assert f.usable and [g.name for g in f.gpus] == ["NVIDIA L4"] and f.ray_version == "2.60.0"


def test_a_probe_after_the_others_starts_once_they_have_ended(tmp_path):
    """The real script through bash: the late probe sees what the slow first one left (the
    reachability listener must not bind ports before the ports check lists them), and both
    outputs come back under their names."""
    from cluster.inspection.probes import split_probe_output
    flag = tmp_path / "first-done"
    probes = [Probe("late", f"test -e {flag} && echo saw-it || echo too-early",
                    after_the_others=True),
              Probe("slow", f"sleep 0.6; touch {flag}; echo slow-done")]
    p = subprocess.run(["bash", "-c", probe_script(probes)], capture_output=True, text=True,
                       timeout=60)
    outs = split_probe_output(p.stdout, probes)
    assert outs["slow"].stdout.strip() == "slow-done"
    assert outs["late"].stdout.strip() == "saw-it" and outs["late"].exit_code == 0


def test_version_skew_is_judged_against_the_head_else_the_majority():
    versions = {"n1": {"ray": "2.60.0", "vllm": "0.32.0"}, "n2": {"ray": "2.60.0", "vllm": "0.31.0"},
                "n3": {"ray": "2.59.0", "vllm": None}}
    skew = facts.version_skew(versions, "n1", ("ray", "vllm"))
    assert skew == (facts.Skew("n3", "ray", "2.59.0", "2.60.0"),
                    facts.Skew("n2", "vllm", "0.31.0", "0.32.0"))
    # no head value: the majority is the reference
    assert facts.version_skew({"a": {"ray": "1"}, "b": {"ray": "2"}, "c": {"ray": "2"}}, "h",
                              ("ray",)) == (facts.Skew("a", "ray", "1", "2"),)
    assert facts.version_skew(versions, "n1", ("torch",)) == ()


def test_the_ports_check_reads_ray_running_from_the_node_facts(inv):
    """One 'is Ray running' reading: the raylet in node_facts.py's process list."""
    raylet = {"pid": 7, "kind": "raylet", "comm": "raylet", "args": [], "env": {}}
    listing = "LISTEN 0 4096 0.0.0.0:6379 0.0.0.0:*\n"
    ports = [c for c in NODE_CHECKS if c.id == "ports"]
    for processes, want in (([raylet], "Ray is running"), ([], "ports Ray needs are taken")):
        f = facts.facts_from_outputs(inv.node("n1"), {
            "versions": _out("versions", _doc(processes=processes)),
            "ports": _out("ports", listing)})
        results, _ = evaluate_node(inv.node("n1"), inv, ports, f)
        assert want in results[0].summary


def test_the_node_program_here_prints_one_document():
    path = Path(program.__file__)
    p = subprocess.run([sys.executable, str(path), "PATH"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert set(doc["versions"]) == {"python", "ray", "vllm", "torch", "nccl"}
    assert all(p["pid"] != doc.get("pid") for p in doc["processes"])


def test_the_node_program_reads_ray_processes_from_proc(tmp_path):
    def proc(pid, comm, argv, environ=b"", limits=None):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "comm").write_text(comm + "\n")
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "environ").write_bytes(environ)
        if limits:
            (d / "limits").write_text(limits)
    proc(10, "raylet", ["/x/raylet", "--node_id=n", "--gcs-address=1.2.3.4:6379", "plain"],
         b"NCCL_SOCKET_IFNAME=eth0\0API_TOKEN=s3cret\0",
         "Limit Soft Hard Units\nMax locked memory 65536 65536 bytes\n")
    proc(11, "python3", ["python3", "-u", "/x/ray/dashboard/agent.py"])
    proc(12, "bash", ["bash", "-c", "python3 -c '# cluster-node-facts'"])   # the program itself
    proc(13, "sshd", ["sshd: root"])
    (tmp_path / "self").mkdir()
    found = {p["pid"]: p for p in program.ray_processes({"NCCL_SOCKET_IFNAME"}, str(tmp_path))}
    assert set(found) == {10, 11}
    assert found[10]["args"] == ["--node_id=n", "--gcs-address=1.2.3.4:6379"]
    assert found[10]["env"] == {"NCCL_SOCKET_IFNAME": "eth0"}       # only the asked keys
    assert found[10]["memlock"] == 65536 and found[11]["kind"] == "other"
    # asked for presence only (deploy's API key): the state, never the value
    asked = {p["pid"]: p for p in program.ray_processes(set(), str(tmp_path),
                                                         presence=("API_TOKEN", "NOPE"))}
    assert asked[10]["key_states"] == {"API_TOKEN": "set", "NOPE": "unset"}
    assert "s3cret" not in json.dumps(asked)


def test_auth_token_presence_never_the_token(tmp_path):
    token = tmp_path / "tok"
    token.write_text("abc")
    assert program.auth_token_present({"RAY_AUTH_TOKEN_PATH": str(token)})
    assert not program.auth_token_present({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "none"),
                                           "HOME": str(tmp_path)})
    assert program.auth_token_present({"RAY_AUTH_TOKEN": "x"})


def test_parse_only_kinds_are_exactly_those_no_check_or_fact_reads():
    """Every parser either feeds a check/fact or is documented as parse-only (PARSE_ONLY)."""
    import re
    from cluster.inspection import parsers
    import importlib

    def source(module: str) -> Path:      # by module name, wherever the layout puts its file
        return Path(importlib.import_module(module).__file__).resolve()
    readers = [source("cluster.inspection.facts"), source("cluster.remedy.fixes"), source("cluster.ray.nccl_check"),
               *sorted(source("cluster.inspection.checks").parent.glob("*.py")),
               *sorted(source("playbooks").parent.glob("*.py"))]
    text = "\n".join(p.read_text() for p in readers)
    used = {kind for kind, module in parsers.MODULES.items()
            if re.search(rf"\b{module}\b", text)}
    assert set(parsers.PARSE_ONLY) == set(parsers.MODULES) - used


def test_the_preflight_playbook_judges_handed_in_facts_without_another_round_trip(inv):
    """`cluster up` gathers once and hands the facts to the preflight: no second gather."""
    from playbooks import preflight
    outputs = {"versions": _out("versions", _doc()),
               "gpu-query": _out("gpu-query", f"index, name\n0, {H100}\n")}
    gathered = {n.name: facts.facts_from_outputs(n, outputs) for n in inv.nodes}
    checks = tuple(c for c in NODE_CHECKS if c.id in ("gpus", "versions"))
    nodes = FakeRunner()
    report = preflight.run(inv, nodes.session(inv), preflight.PreflightOptions(
        checks=checks, measure_clock=False, reachability=False, facts=gathered)).report
    assert nodes.sent == []          # the facts were handed in: no command reached a node
    by = {(r.check, r.node): r for r in report.results}
    assert by[("gpus", "n2")].summary == f"1 x {H100}"
    assert by[("versions", "n3")].status.value == "ok"
    assert report.facts.nodes["n1"].version("ray") == "2.60.0"
    assert {r.check for r in report.results if r.node is None} >= {"ray-match", "vllm-match"}


@pytest.mark.parametrize("memlock, pid, resource", [
    ("64 KiB", True, "CPU,nan,GPU,inf"), (1.5, -3, "CPU,-2"), ([1], "7", "CPU,1e999")])
def test_hostile_node_documents_give_unknowns_never_a_crash(inv, memlock, pid, resource):
    """Wrong types and non-finite numbers in a node's document are dropped or 'unknown'."""
    from cluster.ray.ray_cluster import memlock_drift
    procs = [{"pid": pid, "kind": "raylet", "comm": "raylet"},
             {"pid": 8, "kind": "raylet", "comm": "raylet", "memlock": memlock,
              "args": [f"--static_resource_list={resource}"]}]
    f = facts.facts_from_outputs(inv.node("n2"), {"versions": _out("versions", _doc(
        processes=procs, memlock_session=memlock, memlock_session_known="yes"))})
    assert f.usable and f.ray_pids == (8,) and f.raylet.pid == 8
    assert f.raylet.memlock == "unknown" and f.memlock_session == "unknown"
    assert all(v >= 0 and v != float("inf") for v in f.raylet.resources.values())
    assert memlock_drift("n2", f) is None


# ---------------------------------------------------------------- each fact parsed once


def _counting_parsers(monkeypatch) -> dict[str, int]:
    """Wrap every tool fact's parser (and the node-facts document's reader) with a call counter."""
    import importlib

    from cluster.inspection.checks import node as node_checks

    calls: dict[str, int] = {}

    def counted(name, parse):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return parse(*args, **kwargs)
        return wrapper

    parsers = {f.parser for f in vars(facts).values() if isinstance(f, facts.ToolFact) and f.parser}
    for parser in parsers:
        module = importlib.import_module(f"cluster.inspection.parsers.{parser}")
        monkeypatch.setattr(module, "parse", counted(parser, module.parse))
    document = counted("node-facts", facts.program_document)
    monkeypatch.setattr(facts, "program_document", document)
    if hasattr(node_checks, "program_document"):   # the checks' own import of it, if any
        monkeypatch.setattr(node_checks, "program_document", document)
    return calls


def test_a_preflight_parses_each_tool_fact_once_per_node(monkeypatch):
    """A 3-node preflight over real captured outputs: every tool output that a check, the
    facts or a cross-node check reads is parsed once per node, however many read it
    (nvidia-smi -q: fabricmanager, gpu-health, pcie-link; the GPU query: the facts, gpus, acs;
    ibstat: infiniband, acs, nic-locality; the topology: nvlink, nic-locality)."""
    from fakes import FakeRunner, fake_inventory, preflight_answers
    from playbooks.preflight import run_preflight

    calls = _counting_parsers(monkeypatch)
    inv = fake_inventory(3, "ib_hcas: [mlx5_0]")
    report = run_preflight(inv, FakeRunner(respond=preflight_answers()).session(inv))
    assert {r.node for r in report.results if r.node} == {"n1", "n2", "n3"}
    assert not [r for r in report.results if r.status.value == "error"]
    read = {"nvidia_smi_q", "nvidia_smi_query", "ibstat", "nvidia_smi_topo", "nvidia_smi",
            "node-facts", "lspci", "dmesg", "fabricmanager", "ip_addr", "chronyc_tracking",
            "df_shm", "ulimit", "lsmod"}
    assert read <= set(calls)
    # the program reader reads two answers per node: node_facts.py's and its --imports'
    assert calls == {name: 6 if name == "node-facts" else 3 for name in calls}


def test_the_fake_sessions_probe_answer_reads_as_the_real_scripts_output():
    """preflight_answers writes the probe script's output in Python (fast at 255 nodes): it
    must split exactly as what the real script prints through bash."""
    from fakes import probe_answer, probe_script_output
    from cluster.inspection.probes import Probe, split_probe_output
    outputs = {"a": (0, "line 1\nline 2\n"), "b": (127, ""), "c": (3, "no newline at the end")}
    probes = [Probe(n, "true") for n in outputs]
    real = split_probe_output(probe_script_output(outputs), probes)
    fake = split_probe_output(probe_answer({n: (c, t, "") for n, (c, t) in outputs.items()}), probes)
    assert {n: (o.exit_code, o.stdout) for n, o in fake.items()} == \
        {n: (o.exit_code, o.stdout) for n, o in real.items()}


def test_the_split_finds_its_markers_without_a_pattern_over_the_whole_output(monkeypatch):
    """split_probe_output jumps from one marker line to the next with str.find (a pattern
    anchored at line starts tested every character of a node's ~40 KB): the same markers as
    the lines, split on newlines only, that start with the marker, and the same outputs."""
    from fakes import probe_answer
    from cluster.inspection import probes as probes_module
    from cluster.inspection.probes import Probe, split_probe_output

    class NoPattern:
        def __getattr__(self, name):
            raise AssertionError("a pattern ran over the whole output")

    monkeypatch.setattr(probes_module, "_MARK_LINE", NoPattern(), raising=False)
    answer = probe_answer({"a": (0, "x @@cluster-probe@@ a end 9\nline 2\n", "warn\r\n"),
                           "b": (127, "", ""), "c": (3, "no newline at the end", "")})
    outs = split_probe_output(answer, [Probe(n, "true") for n in "abc"])
    assert {n: (o.exit_code, o.stdout, o.stderr) for n, o in outs.items()} == {
        "a": (0, "x @@cluster-probe@@ a end 9\nline 2\n", "warn\r\n"), "b": (127, "", ""),
        "c": (3, "no newline at the end\n", "")}
    mark = "@@cluster-probe@@"
    for text in ("", mark, f"{mark} a\n", f"x{mark}\n{mark} b\r\n\n{mark}", f"\n\n{mark}{mark}\n"):
        starts = [i for i, _ in enumerate(text) if text.startswith(mark, i)
                  and (i == 0 or text[i - 1] == "\n")]
        assert [start for start, _ in probes_module._marker_lines(text)] == starts
        assert all(text[start:stop] == text[start:].split("\n")[0]
                   for start, stop in probes_module._marker_lines(text))


# ---------------------------------------------------------------- facts are read typed (issue 43)


def test_every_reading_a_check_gets_is_its_parsers_frozen_dataclass():
    """What the checks, fixes and `up`'s plan read of a tool's output is the parser's frozen
    dataclass (no dict view at the facts boundary): a reading indexed as a dict raises."""
    import dataclasses

    from fakes import FakeRunner, fake_inventory, preflight_answers
    from cluster.inspection.preflight import gather_for

    inv = fake_inventory(1, "ib_hcas: [mlx5_0]")
    node = gather_for(inv, FakeRunner(respond=preflight_answers()).session(inv))["n1"]
    read = [f for f in vars(facts).values() if isinstance(f, facts.ToolFact) and f.parser]
    assert {f.parser for f in read} >= {"nvidia_smi_query", "ibstat", "nvidia_smi_q", "lsmod"}
    for fact in read:
        if fact.name not in node.outputs or not node.outputs[fact.name].stdout.strip():
            continue
        reading = node.reading(fact)
        assert dataclasses.is_dataclass(reading) and not isinstance(reading, Mapping), fact.name
        assert type(reading).__dataclass_params__.frozen, fact.name
        with pytest.raises(TypeError):
            reading["gpus"]   # noqa: B018 - the dict view is gone
    assert node.gpus and all(isinstance(g, facts.GPU) and g.bus_id for g in node.gpus)


CHECK_SOURCES = ("cluster/inspection/checks", "cluster/remedy")


def _fact_reads_by_name(path: Path) -> list[str]:
    """Lines of `path` that read a node's output by a probe's name (`ctx.output("ibstat")`,
    `ctx.outputs[...]` / `.outputs.get(...)`) or index a fact's reading as a dict
    (`ctx.reading(X)["..."]`, `ctx.reading(X).get(...)`)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "outputs":
            found.append(f"{path}:{node.lineno} .outputs")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "output" and node.args \
                and isinstance(node.args[0], ast.Constant):
            found.append(f"{path}:{node.lineno} output({node.args[0].value!r})")
        inner = node.value if isinstance(node, ast.Subscript) else \
            node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "get" else None
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) \
                and inner.func.attr in ("reading", "document"):
            found.append(f"{path}:{node.lineno} a reading read as a dict")
    return found


def test_no_check_or_fix_reads_an_output_by_probe_name_or_a_reading_as_a_dict():
    root = Path(__file__).resolve().parent.parent
    files = [p for d in CHECK_SOURCES for p in sorted((root / d).glob("*.py"))
             if p.name != "base.py"]    # NodeContext itself: the one reader of outputs
    files += [root / "cluster/inspection/reachability.py", root / "cluster/serving/deploy.py"]
    assert len(files) > 8
    assert [line for p in files for line in _fact_reads_by_name(p)] == []


def test_a_check_asks_for_a_fact_never_a_probe_name():
    from cluster.inspection.checks.base import NodeContext

    inv = inventory.loads("nodes:\n  - {name: n1, address: 10.0.0.1, role: head}\n")
    ctx = NodeContext(inv.nodes[0], inv, {}, facts.NodeFacts("n1", reached=True))
    with pytest.raises(TypeError, match="not the probe name 'ibstat'"):
        ctx.output("ibstat")
    with pytest.raises(ParseError, match="no output for 'ibstat'"):
        ctx.output(facts.IBSTAT)


# ---------------------------------------------------------------- the reported facts, typed

REPORTED_FACT_READERS = ("cluster/inspection/checks", "cluster/remedy", "cluster/planning",
                         "cluster/ray/health_job.py", "cluster/ray/nccl_check.py",
                         "cluster/ray/ray_cluster.py", "cluster/commands/nccl_check.py",
                         "cluster/commands/plan.py", "playbooks")
IB_PORT_KEYS = ("ca", "port", "state", "rate_gbps", "link_layer")     # IbPortFact's fields


def _reported_facts_read_by_key(path: Path) -> list[str]:
    """Lines of `path` that read a reported fact by its JSON key (`f["gpu_model"]`,
    `ctx.facts.get("ray_running")`, `(ib_facts or {}).get("nodes")`), a saved report's facts
    by hand (`data.get("facts")`: PreflightFacts.from_report reads them), an IB port as a dict
    (`p.get("state")`, `port["rate_gbps"]`) or node_facts.py's document as a dict
    (`.document()`)."""
    import ast

    from cluster.inspection.node_summary import FACT_FIELDS

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        key = node.slice if isinstance(node, ast.Subscript) else \
            node.args[0] if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "get" and node.args else None
        receiver = node.value if isinstance(node, ast.Subscript) else \
            node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            else None
        said = ast.unparse(receiver) if receiver is not None else ""
        key = key.value if isinstance(key, ast.Constant) else None
        if key in FACT_FIELDS + ("nodes",) and (said.endswith(("facts", "facts or {}"))
                                                or said == "f" or "facts.get(" in said):
            found.append(f"{path}:{node.lineno} [{key!r}]")
        elif key == "facts":
            found.append(f"{path}:{node.lineno} a report's facts read by hand")
        elif key in IB_PORT_KEYS and (said in ("p", "port") or said.endswith("ports")):
            found.append(f"{path}:{node.lineno} an IB port's [{key!r}]")
        if isinstance(node, ast.Attribute) and node.attr == "document":
            found.append(f"{path}:{node.lineno} .document")
    return found


def test_no_check_fix_playbook_or_planner_reads_a_reported_fact_as_a_dict():
    root = Path(__file__).resolve().parent.parent
    files = [p for entry in REPORTED_FACT_READERS for p in
             (sorted((root / entry).glob("*.py")) if (root / entry).is_dir() else [root / entry])]
    assert len(files) > 40
    assert [line for p in files for line in _reported_facts_read_by_key(p)] == []


def test_the_reported_facts_are_typed_from_the_checks_to_the_fixes_and_the_planner(tmp_path):
    """What the checks report of a node is one frozen NodeFactsSummary (no dict view): the
    report holds it, the fixes get it, and a saved run's JSON reads back (PreflightFacts.
    from_report, the one reader) as the same typed facts, which write the same JSON; the
    planner and nccl-check read a saved run through it."""
    import dataclasses
    import json as _json

    from fakes import FakeRunner, fake_inventory, preflight_answers
    from cluster.commands.nccl_check import _preflight_facts
    from cluster.inspection.node_summary import NodeFactsSummary, PreflightFacts
    from cluster.planning.planner import read_saved_run
    from cluster.remedy.fixes import FixContext
    from playbooks.preflight import run_preflight

    inv = fake_inventory(2, "ib_hcas: [mlx5_0]")
    report = run_preflight(inv, FakeRunner(respond=preflight_answers()).session(inv),
                           reachability=False)
    node = report.facts.nodes["n1"]
    assert isinstance(node, NodeFactsSummary) and type(node).__dataclass_params__.frozen
    with pytest.raises(TypeError):
        node["gpu_count"]   # noqa: B018 - the dict view is gone
    assert [f.name for f in dataclasses.fields(FixContext) if f.name == "facts"] == ["facts"]
    assert FixContext.__annotations__["facts"] in (NodeFactsSummary, "NodeFactsSummary")
    assert not hasattr(facts.NodeFacts, "document")
    saved_run = _json.loads(_json.dumps(report.to_dict()))        # preflight.json as written
    assert PreflightFacts.from_report(saved_run) == report.facts
    assert PreflightFacts.from_report(saved_run).to_dict() == saved_run["facts"]
    # (the capture has no GPU memory: the planner needs it)
    saved_run["facts"]["nodes"]["n1"]["gpu_memory_mib"] = 81559
    saved_run["facts"]["nodes"]["n2"] = None                      # a node the run holds nothing of
    path = tmp_path / "preflight.json"
    path.write_text(_json.dumps(saved_run))
    read = PreflightFacts.from_report(saved_run)
    assert read.to_dict() == saved_run["facts"] and read.without_facts == {"n2"}
    assert _preflight_facts(str(path)) == (read, str(path))
    planned, without = read_saved_run(path)
    assert (planned.gpu_count, planned.gpu_model, planned.ib_rate_gbps) == \
        (node.gpu_count, node.gpu_model, min(p.rate_gbps for p in node.active_ib_ports))
    assert (without.node, without.reachable, without.problem) == ("n2", False, "no facts")
    assert PreflightFacts.from_report({"facts": {"nodes": [1]}}) is None


def test_a_saved_run_is_read_within_its_bounds(tmp_path, monkeypatch):
    """The planner counts a run's nodes before it reads any (a huge report costs no typed
    reading); nccl-check --report reads the nodes it checks, not the whole run."""
    import json as _json

    from cluster.base.bounds import bound
    from cluster.base.errors import PlanError
    from cluster.commands.nccl_check import _preflight_facts
    from cluster.inspection.node_summary import NodeFactsSummary
    from cluster.planning.planner import read_saved_run

    read: list[int] = []
    real = NodeFactsSummary.from_dict.__func__
    monkeypatch.setattr(NodeFactsSummary, "from_dict",
                        classmethod(lambda cls, raw: read.append(1) or real(cls, raw)))
    port = {"ca": "mlx5_0", "port": 1, "state": "Active", "rate_gbps": 400}
    path = tmp_path / "preflight.json"
    many = bound("plan", "nodes") + 1
    path.write_text(_json.dumps({"facts": {"nodes": {f"n{i}": {"ib_ports": [port]}
                                                     for i in range(many)}}}))
    with pytest.raises(PlanError, match=f"{many:,} nodes in the preflight report"):
        read_saved_run(path)
    assert read == []
    facts, _ = _preflight_facts(str(path), ["n7", "n3", "absent"])
    assert list(facts.nodes) == ["n7", "n3"] and len(read) == 2
    assert facts.nodes["n7"].active_ib_ports[0].rate_gbps == 400


def test_a_saved_runs_wrong_types_read_as_unknown_never_a_crash():
    from cluster.inspection.node_summary import NodeFactsSummary
    got = NodeFactsSummary.from_dict({"gpu_count": True, "mtu": "9000", "nvlink": None,
                                      "clock_offset_s": float("nan"), "ib_ports": [1, {"ca": 3}],
                                      "versions": {"ray": 2, "vllm": "0.32.0"}, "x": 1})
    assert (got.gpu_count, got.mtu, got.clock_offset_s) == (None, None, None)
    assert got.unreadable["gpu_count"] == "True" and got.to_dict()["nvlink"] is None
    assert got.versions == {"ray": None, "vllm": "0.32.0"} and got.ib_ports[0].ca == ""
    assert "x" not in got.to_dict() and "mtu" not in got.to_dict()


def test_component_versions_give_each_known_component_its_values_reference_and_skews():
    """One reading per component for the cross-node check and version_skew alike."""
    versions = {"n1": {"ray": "2.60.0", "vllm": None}, "n2": {"ray": "2.59.0"},
                "n3": {"ray": "2.60.0", "vllm": "0.32.0"}}
    ray, vllm = facts.component_versions(versions, "n1", ("ray", "torch", "vllm"))
    assert (ray.component, dict(ray.values), ray.reference) == (
        "ray", {"n1": "2.60.0", "n2": "2.59.0", "n3": "2.60.0"}, "2.60.0")
    assert ray.skews() == (facts.Skew("n2", "ray", "2.59.0", "2.60.0"),)
    # the head does not know vllm: the only node that does is the reference, nothing differs
    assert (dict(vllm.values), vllm.reference, vllm.skews()) == ({"n3": "0.32.0"}, "0.32.0", ())
    assert facts.version_skew(versions, "n1", ("ray", "torch", "vllm")) == ray.skews()
