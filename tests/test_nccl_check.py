"""`cluster nccl-check`, the pure parts: job arguments, the head command, collecting the head's
answer, expected bandwidth from preflight facts, and the verdict from collected results (NCCL
transport verdicts from real NCCL logs in tests/fixtures/nccl, fed back as per-rank logs).
The run on a real Ray cluster is tests/integration/test_nccl_check_cluster.py."""

from __future__ import annotations

import ast
import base64
import json
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from cluster.nodes import inventory as inventory_mod
from cluster.ray import nccl_check
from cluster import node_programs
from cluster.base.errors import UsageError
from cluster.ray.nccl_check import (CheckOptions, Expected, JobOutcome, expected_bandwidth, judge,
                                parse_head_output)
from cluster.nodes.remote import CommandResult
from cluster.base.results import Status
from cluster.inspection.node_summary import PreflightFacts
from cluster.ray_jobs import nccl_allreduce as job

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "nccl"

INVENTORY = """
nodes:
  - {name: gpu01, role: head, address: gpu01.example, node_ip: 10.0.0.1}
  - {name: gpu02, address: 10.0.0.2}
  - {name: gpu03, address: 10.0.0.3, env: {RAY_AUTH_MODE: token}}
ray:
  python: /opt/venv/bin/python
  dashboard_port: 8299
"""


@pytest.fixture
def inv():
    return inventory_mod.loads(INVENTORY, "test.yaml")


# ---------------------------------------------------------------- options and job arguments


def test_defaults_depend_on_the_backend():
    assert CheckOptions("nccl").size == 256 and CheckOptions("nccl").iterations == 20
    assert CheckOptions("gloo").size == 32 and CheckOptions("gloo").iterations == 10
    assert CheckOptions("gloo", size_mb=8, iters=3).size == 8


@pytest.mark.parametrize("kwargs", [dict(backend="mpi"), dict(size_mb=0), dict(iters=0),
                                    dict(warmup=-1), dict(timeout_s=5)])
def test_bad_options_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        CheckOptions(**kwargs)


@pytest.mark.parametrize("flag, key, beyond", [
    ("--size-mb", "size_mb_max", 1), ("--iters", "iters_max", 1), ("--warmup", "warmup_max", 1),
    ("--timeout", "timeout_s_max", 1), ("--timeout", "timeout_s_min", -1)])
def test_the_flags_and_the_job_options_share_one_bound(flag, key, beyond, capsys):
    """limits.yaml nccl_check: what the flag takes the options take, and one past it neither."""
    from cluster.base.bounds import bound
    from fakes import cluster_main

    edge = bound("nccl_check", key)
    field = {"--size-mb": "size_mb", "--iters": "iters", "--warmup": "warmup",
             "--timeout": "timeout_s"}[flag]
    assert getattr(CheckOptions(**{field: edge}), field) == edge
    with pytest.raises(UsageError, match=flag):
        CheckOptions(**{field: edge + beyond})
    code, _, err = cluster_main(capsys, "nccl-check", flag, str(edge + beyond))
    assert code == 2 and flag in err


def test_job_args_list_the_nodes_in_rank_order_with_their_ray_ips(inv):
    args = nccl_check.job_args(CheckOptions("gloo", size_mb=16, iters=4, warmup=1), inv.nodes)
    parsed = job.parse_args(args + ["--deadline", "1e10", "--log-dir", "/tmp/x",
                                    "--result-file", "/tmp/r.json"])
    assert parsed.backend == "gloo" and parsed.size_mb == 16 and parsed.iters == 4
    assert parsed.warmup == 1
    assert parsed.nodes == [{"name": "gpu01", "ip": "10.0.0.1"}, {"name": "gpu02", "ip": "10.0.0.2"},
                            {"name": "gpu03", "ip": "10.0.0.3"}]


def test_job_args_need_a_node():
    with pytest.raises(UsageError):
        nccl_check.job_args(CheckOptions("gloo"), [])


def test_entrypoint_rejects_bad_arguments():
    base = ["--backend", "gloo", "--size-mb", "1", "--iters", "1", "--deadline", "1",
            "--log-dir", "/tmp", "--result-file", "/tmp/r"]
    with pytest.raises(SystemExit):
        job.parse_args(base + ["--nodes", "[]"])
    with pytest.raises(SystemExit):
        job.parse_args(base + ["--nodes", '[{"name": "a"}]'])


def test_head_command_runs_the_program_with_the_inventory_python(inv):
    call = nccl_check.head_call(inv, CheckOptions("gloo"), inv.nodes, "nccl-check-x",
                                script="print('entrypoint')\n")
    argv = __import__("shlex").split(call.command)
    assert argv[0] == "/opt/venv/bin/python" and argv[1] == "-"
    assert call.stdin == node_programs.source(nccl_check.HEAD_PROGRAM)  # the program, on stdin
    cfg = json.loads(argv[2])
    assert cfg["base"] == "http://127.0.0.1:8299"      # the dashboard on the head's loopback
    assert cfg["submission_id"] == "nccl-check-x"
    assert base64.b64decode(cfg["script_b64"]).decode() == "print('entrypoint')\n"
    assert cfg["timeout_s"] == nccl_check.DEFAULT_TIMEOUT_S
    assert "--nodes" in cfg["args"] and cfg["python"] == "/opt/venv/bin/python"


def test_head_snippet_and_entrypoint_compile_and_the_entrypoint_needs_no_toolkit():
    compile(node_programs.source(nccl_check.HEAD_PROGRAM), "<head program>", "exec")
    tree = ast.parse(nccl_check.ENTRYPOINT.read_text())
    top = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module.split(".")[0])
    # Shipped as a file to the head: stdlib + ray + torch only, never the toolkit.
    assert "cluster" not in top and "playbooks" not in top
    module_level = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import)
                    for a in n.names}
    assert not module_level & {"ray", "torch"}


def test_command_module_imports_no_ray_or_torch():
    code = ("import sys, cluster.cli; cluster.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray','torch','vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    names = [name for name, _ in __import__("cluster.cli").cli.COMMANDS]
    assert "nccl-check" in names


# ---------------------------------------------------------------- the entrypoint's pure helpers


def test_bus_bandwidth_is_nccl_tests_formula():
    assert job.bus_bandwidth(10.0, 2) == pytest.approx(10.0)
    assert job.bus_bandwidth(10.0, 8) == pytest.approx(17.5)
    assert job.bus_bandwidth(10.0, 1) == 0.0
    alg, bus = job.bandwidths(2 * 10 ** 9, 0.5, 4)
    assert alg == pytest.approx(4.0) and bus == pytest.approx(6.0)
    assert job.size_bytes(1) == 1 << 20 and job.size_bytes(0.000001) == 4


def test_bundles_pin_every_rank_to_its_node():
    nodes = [{"name": "a", "ip": "10.0.0.1", "gpus": 2}, {"name": "b", "ip": "10.0.0.2", "gpus": 0},
             {"name": "c", "ip": "10.0.0.3", "gpus": 1}]
    bundles, owners, strategy = job.bundles_for("nccl", nodes)
    assert strategy == "PACK" and owners == ["a", "a", "c"]
    assert bundles[0] == {"GPU": 1.0, "node:10.0.0.1": 0.001}
    assert bundles[2] == {"GPU": 1.0, "node:10.0.0.3": 0.001}
    bundles, owners, strategy = job.bundles_for("gloo", nodes)
    assert strategy == "STRICT_SPREAD" and owners == ["a", "b", "c"]
    assert bundles[1] == {"CPU": 1.0, "node:10.0.0.2": 0.001}


def test_ranks_follow_the_node_order_then_the_gpu_id():
    infos = [{"node": "b", "gpu_ids": ["1"]}, {"node": "a", "gpu_ids": ["3"]},
             {"node": "b", "gpu_ids": ["0"]}, {"node": "a", "gpu_ids": ["0"]}]
    assert job.assign_ranks(infos, ["a", "b"]) == [3, 1, 2, 0]


NODES = [{"name": "node1", "ip": "198.18.5.1"}, {"name": "node2", "ip": "198.18.5.2"},
         {"name": "node3", "ip": "198.18.5.3"}, {"name": "node13", "ip": "198.18.5.13"}]


def test_blame_names_dead_and_silent_nodes_first():
    ranks = [{"rank": 0, "node": "node1", "phase": "join", "error": "run: still in 'join'"},
             {"rank": 1, "node": "node2", "phase": "no-answer", "error": "run: no answer"}]
    assert job.blame(ranks, ["node3"], NODES) == ["node3", "node2"]


def test_blame_names_the_peer_an_error_points_at():
    ranks = [{"rank": 0, "node": "node1", "phase": "join",
              "error": "RuntimeError: Connection closed by peer [198.18.5.3]:41234"},
             {"rank": 1, "node": "node2", "phase": "done", "error": None}]
    assert job.blame(ranks, [], NODES) == ["node3"]      # not node13 (198.18.5.13)
    assert job.nodes_named_in("peer 198.18.5.13:99", NODES) == ["node13"]


def test_blame_falls_back_to_the_failing_ranks():
    ranks = [{"rank": 0, "node": "node1", "phase": "check", "error": "RuntimeError: wrong sum"},
             {"rank": 1, "node": "node2", "phase": "done", "error": None}]
    assert job.blame(ranks, [], NODES) == ["node1"]


# ---------------------------------------------------------------- collecting the head's answer


def _head_stdout(result: dict | None, **extra) -> str:
    payload = {"submission_id": "nccl-check-gloo-1", "submitted": True, "status": "SUCCEEDED",
               "message": "Job finished successfully.", "logs_tail": "", "errors": [],
               "timed_out": False, "waited_s": 12.0, "entrypoint": "python x.py",
               "result_z": base64.b64encode(zlib.compress(json.dumps(result).encode())).decode()
               if result is not None else None}
    payload.update(extra)
    return payload


def test_parse_head_output_reads_the_compressed_result():
    out = parse_head_output(_head_stdout({"ok": True, "ranks": []}))
    assert out.submitted and out.status == "SUCCEEDED" and out.result == {"ok": True, "ranks": []}


def test_parse_head_output_reads_no_result_from_the_job_log():
    """The result file is the entrypoint's one answer: its log lines are for a person."""
    logs = "hello\nall-reduce (gloo) failed at stage run\nPROBLEM x\n"
    out = parse_head_output(_head_stdout(None, logs_tail=logs, status="FAILED"))
    assert out.result is None and out.logs_tail == logs


def test_parse_head_output_refuses_an_unreadable_or_oversized_result(monkeypatch):
    for packed, why in (("not base64!", "unreadable packed document"),
                        (base64.b64encode(b"plain").decode(), "unreadable packed document"),
                        (base64.b64encode(zlib.compress(b'{"ok": NaN}')).decode(), "NaN"),
                        (base64.b64encode(zlib.compress(b"[1]")).decode(), "not an object")):
        out = parse_head_output(_head_stdout(None, result_z=packed))
        assert out.result is None and why in out.errors[-1], out.errors
    monkeypatch.setattr(nccl_check, "RESULT_MAX_BYTES", 1000)
    bomb = base64.b64encode(zlib.compress(b'{"x": "' + b"0" * 10_000_000 + b'"}')).decode()
    out = parse_head_output(_head_stdout(None, result_z=bomb))
    assert out.result is None and "over 1000 bytes" in out.errors[-1]


def test_parse_head_output_without_marker():
    result = CommandResult("gpu01", "cmd", 1, "", "Traceback ...\n", 0.1, "failed")
    out = nccl_check.outcome_of(result, "gpu01", "nccl-check-x")
    assert not out.submitted and out.result is None and "no nccl-check result" in out.errors[0]
    assert out.submission_id == "nccl-check-x" and out.errors[1] == "exit 1: Traceback ..."
    lost = CommandResult("gpu01", "cmd", None, "", "", 0.1, "unreachable", "gpu01: refused")
    out = nccl_check.outcome_of(lost, "gpu01", "nccl-check-x")
    assert out.errors == ("head gpu01 unreachable: gpu01: refused",)


# ---------------------------------------------------------------- expected bandwidth


def _ports(n: int, rate: int = 400, down: int = 0) -> list[dict]:
    return [{"ca": f"mlx5_{i}", "port": 1, "state": "Down" if i < down else "Active",
             "rate_gbps": rate, "link_layer": "InfiniBand"} for i in range(n)]


def _facts(nodes: dict) -> PreflightFacts:
    """A saved report's facts, read as the command reads them (the one typed reading)."""
    return PreflightFacts.from_dict({"nodes": nodes})


def test_expected_is_ib_rate_times_active_nics_of_the_slowest_node():
    facts = _facts({"gpu01": {"ib_ports": _ports(8)}, "gpu02": {"ib_ports": _ports(8, down=1)}})
    exp = expected_bandwidth(facts, ["gpu01", "gpu02"])
    assert exp.per_node == {"gpu01": 400.0, "gpu02": 350.0}
    assert exp.gbps == 350.0 and "7 x 400 Gb/s" in exp.basis and "gpu02" in exp.basis


def test_no_expectation_without_facts():
    assert expected_bandwidth(None, ["a"]).gbps is None
    exp = expected_bandwidth(_facts({"a": {"ib_ports": _ports(2)}, "b": {"reachable": True}}),
                             ["a", "b"])
    assert exp.gbps is None and "b" in exp.basis


# ---------------------------------------------------------------- judging: gloo


def _gloo_result(nodes=("node1", "node2", "node3"), busbw=1.2) -> dict:
    ranks = [{"rank": i, "node": n, "hostname": n, "ip": f"198.18.5.{i + 1}", "pid": 100 + i,
              "gpu_ids": [], "time_s": 0.5, "algbw_gbps": 0.9, "busbw_gbps": busbw, "error": None,
              "phase": "done"} for i, n in enumerate(nodes)]
    return {"ok": True, "backend": "gloo", "world_size": len(nodes), "size_bytes": 32 << 20,
            "stage": "done", "problems": [], "failed_nodes": [], "notes": [], "ranks": ranks,
            "nodes": {n: {"ip": "x", "alive": True, "gpus": 0, "ranks": [i]}
                      for i, n in enumerate(nodes)},
            "algbw_gbps": 0.9, "busbw_gbps": busbw, "stage_s": {"run": 3.0},
            "versions": {"ray": "2.60.0", "torch": "2.13.0"}}


def _outcome(result: dict | None, **kw) -> JobOutcome:
    base = dict(submission_id="nccl-check-1", submitted=True, status="SUCCEEDED", message=None,
                result=result)
    base.update(kw)
    return JobOutcome(**base)


def test_gloo_on_three_nodes_reports_the_bandwidth():
    res = judge(CheckOptions("gloo"), _outcome(_gloo_result()))
    assert res.status is Status.OK and res.exit_code == 0
    d = res.to_dict()
    assert d["backend"] == "gloo" and d["ranks"] == 3 and d["nodes"] == ["node1", "node2", "node3"]
    assert d["busbw_gbps"] == 1.2 and d["algbw_gbps"] == 0.9 and d["transport"] == "TCP"
    assert d["expected_gbps"] is None and d["gdr"] is None and d["nccl"] is None
    assert d["verdict"].startswith("OK: 3 nodes, 3 ranks, gloo") and "1.2 GB/s" in d["verdict"]
    for key in ("size_mb", "status", "per_rank", "job_id", "run_dir", "failed_nodes"):
        assert key in d
    assert len(d["per_rank"]) == 3 and d["per_rank"][2]["node"] == "node3"


def test_gloo_on_one_node_warns():
    res = judge(CheckOptions("gloo"), _outcome(_gloo_result(nodes=("node1",))))
    assert res.status is Status.WARN and res.exit_code == 1
    assert "nothing crossed the network" in res.verdict


def test_a_node_missing_from_ray_fails_naming_it():
    result = {"ok": False, "backend": "gloo", "stage": "alive", "world_size": 0,
              "problems": ["node3 (198.18.5.3) is not alive in Ray"], "failed_nodes": ["node3"],
              "ranks": [], "nodes": {}}
    res = judge(CheckOptions("gloo"), _outcome(result, status="FAILED"))
    assert res.status is Status.FAIL and res.exit_code == 2
    assert res.failed_nodes == ("node3",)
    assert res.verdict.startswith("FAIL (node3): node3 (198.18.5.3) is not alive in Ray")


def test_a_rank_that_died_fails_naming_its_node():
    result = _gloo_result()
    result.update(ok=False, stage="run", failed_nodes=["node2"],
                  problems=["rank 1 on node2: run: ActorDiedError: the actor died"])
    result["ranks"][1].update(error="run: ActorDiedError: the actor died", phase="actor-died",
                              time_s=None, busbw_gbps=None)
    res = judge(CheckOptions("gloo"), _outcome(result, status="FAILED"))
    assert res.status is Status.FAIL and res.failed_nodes == ("node2",)
    assert "node2" in res.verdict and res.busbw_gbps is None


def test_a_job_that_could_not_be_submitted_fails():
    out = JobOutcome("nccl-check-1", False, None, None, None,
                     errors=("submit to http://127.0.0.1:8265: URLError: refused",))
    res = judge(CheckOptions("gloo"), out)
    assert res.status is Status.FAIL and "could not be submitted" in res.verdict


def test_a_job_stopped_at_the_timeout_without_result_fails():
    res = judge(CheckOptions("gloo"), _outcome(None, status="STOPPED", timed_out=True))
    assert res.status is Status.FAIL and "timeout" in res.verdict


# ---------------------------------------------------------------- judging: NCCL from real logs

_ENVELOPE = re.compile(r"([^\s:()]+):(\d+):\d+ \[\d+\] NCCL")


def rank_logs_of(fixture: str) -> list[dict]:
    """A real multi-process NCCL log split back into per-process logs (what each rank's
    NCCL_DEBUG_FILE holds); lines without an envelope stay with the previous process."""
    per: dict[tuple, list[str]] = {}
    current = None
    for line in (FIXTURES / fixture).read_text(errors="replace").splitlines():
        m = _ENVELOPE.search(line)
        if m:
            current = (m.group(1), m.group(2))
        per.setdefault(current, []).append(line)
    if None in per and len(per) > 1:
        first = next(k for k in per if k is not None)
        per[first] = per.pop(None) + per[first]
    return [{"rank": i, "node": key[0] if key else "n", "hostname": key[0] if key else "n",
             "pid": int(key[1]) if key else 0, "time_s": 0.1, "error": None, "phase": "done",
             "nccl_log": "\n".join(lines) + "\n"}
            for i, (key, lines) in enumerate(per.items())]


def _nccl_result(ranks: list[dict], busbw: float, nodes: list[str] | None = None) -> dict:
    nodes = nodes or sorted({r["node"] for r in ranks})
    return {"ok": True, "backend": "nccl", "world_size": len(ranks), "size_bytes": 256 << 20,
            "stage": "done", "problems": [], "failed_nodes": [], "notes": [], "ranks": ranks,
            "nodes": {n: {} for n in nodes}, "algbw_gbps": busbw / 1.875, "busbw_gbps": busbw}


def _expected(gbps: float) -> Expected:
    return Expected(gbps, f"8 x 400 Gb/s = {gbps:g} GB/s", {})


def test_nccl_ib_with_gdr_at_full_speed_is_ok():
    ranks = rank_logs_of("041-ray-vllm-deepseek-16rank-ib-gdrdma-truncated-lines.log")
    assert len({r["node"] for r in ranks}) == 2 and len(ranks) > 2
    res = judge(CheckOptions("nccl"), _outcome(_nccl_result(ranks, 380.0)), _expected(400.0))
    assert res.transport == "IB" and res.gdr is True
    assert res.status is Status.OK, res.verdict
    assert res.bandwidth_ratio == pytest.approx(0.95)
    d = res.to_dict()
    assert d["nccl_status"] == "ok" and d["expected_gbps"] == 400.0 and d["busbw_gbps"] == 380.0
    assert "95% of the expected 400 GB/s" in d["verdict"]
    assert "NCCL log: Inter-node traffic uses InfiniBand" in d["verdict"]


def test_nccl_below_half_the_expected_bandwidth_warns():
    ranks = rank_logs_of("041-ray-vllm-deepseek-16rank-ib-gdrdma-truncated-lines.log")
    res = judge(CheckOptions("nccl"), _outcome(_nccl_result(ranks, 120.0)), _expected(400.0))
    assert res.status is Status.WARN and res.exit_code == 1
    assert "30% of the expected 400 GB/s" in res.verdict


def test_nccl_socket_fallback_between_nodes_fails():
    ranks = rank_logs_of("009-pytorch-lightning-2.11.4-nccl-net-socket-dgx-a100.log")
    assert {r["node"] for r in ranks} == {"gpu01", "gpu02"}
    res = judge(CheckOptions("nccl"), _outcome(_nccl_result(ranks, 2.0)), _expected(25.0))
    assert res.transport == "SOCKET" and res.gdr is False
    assert res.status is Status.FAIL and res.exit_code == 2
    assert "Socket" in res.verdict or "SOCKET" in res.verdict


def test_nccl_ib_without_gdr_warns():
    ranks = rank_logs_of("039-64rank-ibext-v8-plugin-channels.log")
    result = _nccl_result(ranks, 300.0, nodes=["a", "b"])
    for r, node in zip(ranks, ["a", "b"] * len(ranks)):
        r["node"] = node
    res = judge(CheckOptions("nccl"), _outcome(result), _expected(400.0))
    assert res.transport == "IB" and res.gdr is False
    assert res.status is Status.WARN


def test_nccl_without_debug_logs_warns_that_the_transport_is_unproven():
    ranks = [dict(r, nccl_log=None) for r in rank_logs_of("009-pytorch-lightning-2.11.4-nccl-net-socket-dgx-a100.log")]
    res = judge(CheckOptions("nccl"), _outcome(_nccl_result(ranks, 20.0)), _expected(25.0))
    assert res.status is Status.WARN and res.transport is None
    assert any("no NCCL debug log" in n for n in res.notes)


def test_nccl_failure_still_parses_what_the_logs_show():
    ranks = rank_logs_of("009-pytorch-lightning-2.11.4-nccl-net-socket-dgx-a100.log")
    ranks[1].update(error="run: RuntimeError: NCCL error", phase="check", time_s=None)
    result = _nccl_result(ranks, 0.0)
    result.update(ok=False, stage="run", failed_nodes=["gpu02"],
                  problems=["rank 1 on gpu02: run: RuntimeError: NCCL error"])
    res = judge(CheckOptions("nccl"), _outcome(result, status="FAILED"), _expected(25.0))
    assert res.status is Status.FAIL and res.failed_nodes == ("gpu02",)
    assert res.transport == "SOCKET" and res.nccl is not None


def test_nccl_on_one_node_reports_no_network_expectation():
    ranks = rank_logs_of("029-vllm-tp2-p2p-ipc-read-trees.log")
    for r in ranks:
        r["node"] = "gpu01"
    res = judge(CheckOptions("nccl"), _outcome(_nccl_result(ranks, 150.0)), _expected(400.0))
    assert res.bandwidth_ratio is None and res.transport == "NONE"
    assert any("NVLink/PCIe" in n for n in res.notes)


@pytest.mark.parametrize("content, words", [
    (b'{"facts": NaN}', "NaN is not a number"), (b"\xd2\x00\xff", "not valid JSON"),
    (b"[" * 100000, "nested too deeply")])
def test_a_hostile_report_is_one_usage_error(tmp_path, content, words):
    """--report goes through the planner's bounded JSON reader (cap, no NaN, bounded depth)."""
    from cluster.commands.nccl_check import _preflight_facts
    from cluster.base.errors import UsageError
    path = tmp_path / "preflight.json"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=words):
        _preflight_facts(str(path))
    path.write_text('{"facts": {"nodes": {}}}')
    assert _preflight_facts(str(path)) == (PreflightFacts({}), str(path))
    path.write_text('{"command": "preflight"}')          # a report without facts: none read
    assert _preflight_facts(str(path)) == (None, str(path))


def test_each_ranks_report_is_its_result_or_its_actors_death():
    """The all-reduce job reads every rank's run the same way for nccl-check and the fabric proof."""
    died = RuntimeError("Traceback (Ray wraps it)\nworker died")
    reports, stuck = job._rank_reports(["r0", "r1"], {"r0": {"time_s": 1.5, "traceback": "t"},
                                                      "r1": died}, [object(), object()])
    assert stuck == []
    assert reports == [{"time_s": 1.5, "traceback": "t"},
                       {"error": "run: RuntimeError: worker died", "phase": "actor-died"}]
