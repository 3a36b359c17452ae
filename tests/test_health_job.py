"""The health job's pure parts (readings -> gauges/tags, the readings file, ages, bounds) and its
node reader run against the simulated profiles' real captured tool outputs (no Ray, no root)."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from cluster.inspection.node_summary import NodeFactsSummary

from cluster.ray import health_job as h
from cluster.nodes import inventory as inv_mod
from cluster import node_programs
from cluster.base.errors import InventoryError, ParseError
from cluster.ray_jobs import health_submit
from cluster.base.results import CheckResult, Evidence, Status
from fakes import simulated_tools_path

H100_HCAS = ["mlx5_0", "mlx5_10", "mlx5_11", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9"]


def _inventory(extra: str = "") -> inv_mod.Inventory:
    return inv_mod.loads("nodes:\n  - {name: node1, address: 198.18.0.1, ib_hcas: [%s]}\n"
                         "  - {name: node2, address: 198.18.0.2}\n%s" % (", ".join(H100_HCAS), extra))


# ---------------------------------------------------------------- inventory bounds


def test_health_options_default_and_bounds():
    assert _inventory().health == inv_mod.HealthOptions(enabled=True, period_s=180.0)
    assert _inventory("health: {period_s: 5, enabled: false}\n").health.period_s == 5.0
    for bad in ("health: {period_s: 4.9}", "health: {period_s: 3601}", "health: {period_s: .inf}",
                "health: {period_s: true}", "health: {period: 5}", "health: {enabled: 1}"):
        with pytest.raises(InventoryError):
            _inventory(bad + "\n")


# ---------------------------------------------------------------- readings and gauges


def _result(check: str, status: Status, data=None) -> CheckResult:
    return CheckResult(check, "node1", status, f"{check} {status.value}", Evidence(data=data))


def test_status_words_and_codes():
    assert [h.status_word(s) for s in Status] == ["ok", "warn", "fail", "unknown", "unknown"]
    assert h.STATUS_CODES == {"ok": 0, "warn": 1, "fail": 2, "unknown": 3}


def test_values_per_check_and_none_when_unknown():
    facts = NodeFactsSummary.from_dict({
        "gpu_count": 7, "clock_offset_s": 7.800260112,
        "ib_ports": [{"state": "Active"}, {"state": "Down"}, {"state": "Active"}],
        "peermem_loaded": True, "peermem_registered": []})
    got = {c: h.check_value(c, _result(c, Status.FAIL, {"fail": ["a", "b"], "warn": ["c"]}), facts)
           for c in h.HEALTH_CHECKS}
    assert got == {"gpus": 7.0, "clock": 7.800260112, "infiniband": 2.0, "gpudirect": 0.0,
                   "gpu-health": 3.0}
    assert h.check_value("gpu-health", _result("gpu-health", Status.OK), NodeFactsSummary()) == 0.0
    assert h.check_value("gpus", _result("gpus", Status.SKIP), facts) is None
    assert h.check_value("clock", _result("clock", Status.ERROR), facts) is None
    assert h.check_value("clock", _result("clock", Status.OK), NodeFactsSummary(clock_offset_s=math.nan)) is None


def test_readings_keep_only_health_checks_and_become_tagged_gauges():
    results = [_result("gpus", Status.OK), _result("shm", Status.FAIL),
               _result("clock", Status.SKIP)]
    readings = h.readings_from_results("node1", results, NodeFactsSummary(gpu_count=8),
                                       now=100.0)
    assert [(r.check, r.status, r.value) for r in readings] == [("gpus", "ok", 8.0),
                                                               ("clock", "unknown", None)]
    assert h.gauge_points(readings) == [
        ("cluster_health_status", 0.0, {"node": "node1", "check": "gpus"}),
        ("cluster_health_value", 8.0, {"node": "node1", "check": "gpus"}),
        ("cluster_health_status", 3.0, {"node": "node1", "check": "clock"})]


def test_unknown_readings_cover_every_check_with_the_reason():
    readings = h.unknown_readings("node2", "the node is not alive in Ray" + "x" * 500, 5.0)
    assert [r.check for r in readings] == list(h.HEALTH_CHECKS)
    assert all(r.status == "unknown" and r.value is None for r in readings)
    assert len(readings[0].summary) == h.MAX_SUMMARY
    assert {p[1] for p in h.gauge_points(readings)} == {3.0}


def test_a_reading_refuses_unknown_status_and_non_finite_numbers():
    with pytest.raises(ParseError):
        h.Reading("n", "gpus", "skip", None, "", 1.0)
    with pytest.raises(ParseError):
        h.Reading("n", "gpus", "ok", math.inf, "", 1.0)
    with pytest.raises(ParseError):
        h.Reading("n", "gpus", "ok", 1.0, "", math.nan)


# ---------------------------------------------------------------- the file and the ages


def _snapshot_text(now: float = 1000.0) -> str:
    readings = {"node1": {"clock": h.Reading("node1", "clock", "fail", 7.8, "clock 7.8 s off", now),
                          "gpus": h.Reading("node1", "gpus", "ok", 8.0, "8 x H100", now - 4)}}
    doc = h.readings_document(readings, {"period_s": 5.0, "submission_id": "cluster-health-x"},
                              written=now)
    return json.dumps(doc)


@pytest.mark.parametrize("period", [0.001, -5.0, 1e300, float("nan"), True])
def test_a_readings_file_with_a_period_no_job_could_run_reports_none(period):
    """The period `status` prints is the job's, read through the same bounds as the inventory's."""
    doc = json.loads(_snapshot_text())
    doc["period_s"] = period
    assert h.parse_readings(json.dumps(doc)).period_s is None


def test_file_round_trip_and_ages_from_the_heads_clock():
    snap = h.parse_readings(_snapshot_text())
    assert (snap.period_s, snap.submission_id, snap.written) == (5.0, "cluster-health-x", 1000.0)
    doc = h.health_doc(snap, now=1012.34)
    assert doc == {"node1": {
        "clock": {"status": "fail", "value": 7.8, "age_s": 12.3, "summary": "clock 7.8 s off"},
        "gpus": {"status": "ok", "value": 8.0, "age_s": 16.3, "summary": "8 x H100"}}}
    assert h.health_doc(snap, now=900.0)["node1"]["clock"]["age_s"] == 0.0   # head clock behind


@pytest.mark.parametrize("text", [
    "", "not json", "[]", json.dumps({"version": 2, "written": 1, "nodes": {}}),
    json.dumps({"version": 1, "nodes": {}}),
    json.dumps({"version": 1, "written": 1, "nodes": {"n": []}}),
    json.dumps({"version": 1, "written": 1, "nodes": {"n": {"gpus": {"status": "ok", "value": "8",
                                                                      "time": 1}}}}),
    json.dumps({"version": 1, "written": 1, "nodes": {"n": {"gpus": {"status": "odd", "time": 1}}}}),
    json.dumps({"version": 1, "written": 1, "nodes": {"n": {"gpus": {"status": "ok"}}}}),
])
def test_garbage_files_are_parse_errors(text):
    with pytest.raises(ParseError):
        h.parse_readings(text)


def test_file_bounds():
    with pytest.raises(ParseError):
        h.parse_readings(" " * (h.MAX_FILE_BYTES + 1))
    many = {f"n{i}": {} for i in range(h.MAX_NODES + 5)}
    doc = h.readings_document(many, {}, written=1.0)
    assert len(doc["nodes"]) == h.MAX_NODES


def _read_reply(text, now=1000.5, error=None) -> str:
    return json.dumps({"now": now, "text": text, "error": error}) + "\n"


def test_read_reply_gives_the_heads_time_then_the_file():
    now, text = h.parse_read_reply(json.loads(_read_reply(_snapshot_text())))
    assert now == 1000.5 and h.parse_readings(text).written == 1000.0
    assert h.parse_read_reply({"now": 3.0, "text": None, "error": None}) == (3.0, None)
    for bad in ({"now": None, "text": ""}, {"now": "1", "text": ""}, {"now": 1.0, "text": 5},
                {"now": 1.0, "text": None, "error": "PermissionError: no"}):
        with pytest.raises(ParseError):
            h.parse_read_reply(bad)


def test_status_reports_the_period_the_running_job_reports_not_the_inventorys():
    from fakes import FakeRunner
    inv = _inventory()                      # the laptop's inventory says 180 s
    session = FakeRunner({"node1": _read_reply(_snapshot_text())}).session(inv)
    status = h.read_health(session, inv)
    assert status.period_s == 5.0 and status.error is None     # the job was started with 5 s
    assert status.nodes["node1"]["clock"]["status"] == "fail"
    for stdout, why in (("nothing\n", "printed no JSON document"),
                        (_read_reply("", now=None), "no time"),
                        ('{"now": NaN, "text": ""}\n', "not a finite number")):
        bad = h.read_health(FakeRunner({"node1": stdout}).session(inv), inv)
        assert bad.nodes is None and bad.period_s is None and why in bad.error, bad.error
    empty = h.read_health(FakeRunner({"node1": _read_reply(None)}).session(inv), inv)
    assert (empty.nodes, empty.error) == ({}, None)


def test_one_period_bound_for_the_inventory_and_the_jobs_config():
    lo, hi = inv_mod.health_period_bounds()
    cfg = h.job_config(_inventory()).to_dict()
    for period in (lo, hi):
        assert h.JobConfig.from_dict({**cfg, "period_s": period}).period_s == period
        assert _inventory(f"health: {{period_s: {period}}}\n").health.period_s == period
    for period in (lo - 0.5, hi + 1):        # the job's config once took 1 s where the inventory refused it
        with pytest.raises(ParseError):
            h.JobConfig.from_dict({**cfg, "period_s": period})
        with pytest.raises(InventoryError):
            _inventory(f"health: {{period_s: {period}}}\n")


def test_the_read_program_reads_the_current_sessions_file_bounded(tmp_path):
    from cluster.ray_jobs import health_readings

    inv = _inventory("ray: {temp_dir: /var/tmp/ray}\n")
    assert h.read_args(inv) == ["/var/tmp/ray/session_latest/cluster-health.json",
                                str(h.MAX_FILE_BYTES)]
    path = tmp_path / h.READINGS_FILE
    assert health_readings.main([str(path), "8"])["text"] is None       # not written yet
    path.write_text("0123456789abc")
    assert health_readings.main([str(path), "8"])["text"] == "012345678"  # MAX + 1: too long
    link = tmp_path / "link.json"
    link.symlink_to(path)
    followed = health_readings.main([str(link), "8"])        # never through a link
    assert followed["text"] is None and "symbolic links" in followed["error"]


# ---------------------------------------------------------------- config and package


def test_job_config_has_no_secret_and_round_trips():
    inv = inv_mod.loads("nodes:\n  - {name: node1, address: 198.18.0.1, env: {API_KEY: s3cr3t-v4lue}}\n"
                        "health: {period_s: 5}\n")
    cfg = h.job_config(inv)
    text = json.dumps(cfg.to_dict())
    assert "s3cr3t" not in text and "API_KEY" not in text
    back = h.JobConfig.from_dict(json.loads(text))
    assert back == cfg and back.inventory().node("node1").ip == "198.18.0.1"
    assert back.node("not-in-inventory").ib_hcas == ()
    for bad in ({**cfg.to_dict(), "period_s": 0}, {**cfg.to_dict(), "nodes": []}, {}):
        with pytest.raises(ParseError):
            h.JobConfig.from_dict(bad)


def test_package_archive_is_the_package_and_reproducible(monkeypatch):
    archive = h.package_archive()
    later = time.time() + 1000
    monkeypatch.setattr(time, "time", lambda: later)     # gzip would stamp the time
    assert archive == h.package_archive()
    names = tarfile.open(fileobj=io.BytesIO(archive)).getnames()
    assert "cluster/ray_jobs/health_runner.py" in names and "cluster/data/expectations.yaml" in names
    assert not [n for n in names if "__pycache__" in n or not n.startswith("cluster/")]
    cfg = h.job_config(_inventory())
    assert h.code_digest(archive, cfg) != h.code_digest(archive + b"x", cfg)


def test_submit_program_unpacks_only_plain_files_under_cluster(tmp_path):
    target = health_submit._unpack(h.package_archive(), str(tmp_path))
    assert (Path(target) / Path(*h.__name__.split(".")[1:])).with_suffix(".py").is_file()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("cluster/../../etc/evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError):
        health_submit._unpack(buf.getvalue(), str(tmp_path / "b"))


def test_submit_call_carries_the_program_and_no_secret():
    inv = inv_mod.loads("nodes:\n  - {name: node1, address: 198.18.0.1, env: {HF_TOKEN: hf_abcdefgh}}\n")
    call = h.submit_call(inv, "ensure", archive=b"pkg")
    program, request = call.stdin.split("\n", 1)
    assert "def ensure" in json.loads(program)
    req = json.loads(request)
    assert req["action"] == "ensure" and req["config"]["period_s"] == 180.0
    assert "hf_abcdefgh" not in call.stdin and "HF_TOKEN" not in call.command


def test_step_from_reply():
    kept = h.step_from_reply({"action": "kept", "submission_id": "cluster-health-1"})
    assert (kept.status, kept.submission_id) == ("ok", "cluster-health-1")
    new = h.step_from_reply({"action": "submitted", "submission_id": "s", "job_status": "RUNNING",
                             "stopped": ["old"]})
    assert (new.status, new.stopped) == ("changed", ("old",))
    assert h.step_from_reply({"error": "ConnectionError: refused"}).status == "failed"


def test_ensure_job_reads_the_programs_one_document():
    from fakes import FakeRunner

    inv = _inventory()
    reply = json.dumps({"action": "kept", "submission_id": "cluster-health-1"}) + "\n"
    step = h.ensure_job(FakeRunner({"node1": reply}).session(inv), inv)
    assert (step.status, step.submission_id) == ("ok", "cluster-health-1")
    for stdout, why in (("Ray says hello\n" + reply, "printed no JSON document"),
                        (reply + reply, "more than one JSON document"), ("", "no output")):
        step = h.ensure_job(FakeRunner({"node1": stdout}).session(inv), inv)
        assert step.status == "failed" and why in step.message, step.message


# ---------------------------------------------------------------- the reader on real captures



@pytest.mark.parametrize("profile,clock,offset", [("h100-ib", "ok", 0.000260),
                                                  ("h100-clock-off", "fail", 7.800260112)])
def test_reader_judges_a_node_as_preflight_does(tmp_path, monkeypatch, profile, clock, offset):
    from cluster.ray_jobs.health_runner import read_node

    monkeypatch.setenv("PATH", simulated_tools_path(tmp_path, profile))
    cfg = h.job_config(_inventory("expectations: {gpus_per_node: 8}\n"))
    readings = {r.check: r for r in read_node(cfg, "node1")}
    assert set(readings) == set(h.HEALTH_CHECKS)
    assert (readings["gpus"].status, readings["gpus"].value) == ("ok", 8.0)
    assert readings["clock"].status == clock
    assert readings["clock"].value == pytest.approx(offset, rel=1e-3)
    assert (readings["infiniband"].status, readings["infiniband"].value) == ("ok", 8.0)
    assert readings["gpu-health"].status == "ok"


def test_submit_program_answers_one_document_whatever_its_libraries_print(tmp_path):
    """A library printing on fd 1 while the program works cannot mix into its one answer."""
    script = tmp_path / "noisy.py"
    script.write_text(node_programs.source("health_submit").replace(
        "def handle(req):", "def handle(req):\n    print('ray chatter'); os.write(1, b'C level\\n')"))
    p = subprocess.run([sys.executable, str(script)], input='{"action": "nope"}\n',
                       capture_output=True, text=True, timeout=60)
    assert json.loads(p.stdout) == {"error": "unknown action 'nope'"}
    assert "ray chatter" in p.stderr and "C level" in p.stderr


class _Job:
    def __init__(self, sid, status, digest):
        self.submission_id, self.status, self.message = sid, status, ""
        self.metadata = {"cluster-toolkit": "health", "digest": digest}


class _Client:
    """Records what the submit program asks of Ray's job API (a list of jobs it starts from)."""

    def __init__(self, jobs):
        self.jobs, self.calls = list(jobs), []

    def list_jobs(self):
        return list(self.jobs)

    def stop_job(self, sid):
        self.calls.append(("stop", sid))

    def submit_job(self, **kw):
        self.calls.append(("submit", kw["submission_id"], kw["runtime_env"], kw["metadata"]))
        self.jobs.append(_Job(kw["submission_id"], "RUNNING", kw["metadata"]["digest"]))
        return kw["submission_id"]

    def get_job_info(self, sid):
        return next(j for j in self.jobs if j.submission_id == sid)


def _request(digest="d1"):
    req = json.loads(h.submit_request(_inventory(), "ensure"))
    return dict(req, digest=digest)


def test_submit_program_keeps_the_matching_job_and_stops_the_others(monkeypatch):
    client = _Client([_Job("old", "RUNNING", "d0"), _Job("cur", "RUNNING", "d1"),
                      _Job("done", "FAILED", "d1")])
    monkeypatch.setattr(health_submit, "_client", lambda url: client)
    out = health_submit.ensure(_request("d1"))
    assert (out["action"], out["submission_id"], out["stopped"]) == ("kept", "cur", ["old"])
    assert client.calls == [("stop", "old")]


def test_submit_program_submits_the_package_when_nothing_matches(monkeypatch):
    client = _Client([_Job("old", "RUNNING", "d0")])
    monkeypatch.setattr(health_submit, "_client", lambda url: client)
    out = health_submit.ensure(_request("d1"))
    assert out["action"] == "submitted" and out["job_status"] == "RUNNING" and not out["error"]
    assert client.calls[0] == ("stop", "old")
    _, sid, runtime_env, metadata = client.calls[1]
    assert sid.startswith(h.SUBMISSION_PREFIX) and metadata["digest"] == "d1"
    assert runtime_env["py_modules"][0].endswith("/cluster")
    assert not Path(runtime_env["py_modules"][0]).exists()       # the temporary copy is gone


def test_human_status_folds_each_check_with_the_age_of_its_oldest_reading():
    from rich.console import Console

    from cluster.commands.status import _health_folded

    def r(status, value, age, summary):
        return {"status": status, "value": value, "age_s": age, "summary": summary}

    health = {f"node{i}": {"gpus": r("ok", 8, i, "8 x NVIDIA H100 80GB HBM3"),
                           "clock": r("ok", 0.00026, 2, "synchronized (chronyc tracking)")}
              for i in (1, 2, 3)}
    health["node2"]["clock"] = r("fail", 7.8, 4.4, "clock 7.8 s off (chronyc tracking)")
    console = Console(width=200, record=True)
    console.print(_health_folded(health, 5.0))
    lines = console.export_text().splitlines()
    assert any("gpus" in ln and "all 3 nodes" in ln and "(3 s ago)" in ln for ln in lines), lines
    assert any("fail" in ln and "node2" in ln and "7.8 s off" in ln and "(4 s ago)" in ln
               for ln in lines), lines
    assert any("2 nodes" in ln and "synchronized" in ln for ln in lines), lines


# ---------------------------------------------------------------- the driver's bookkeeping


class _Ref:
    def __init__(self, value):
        self.value = value


class _Actor:
    def __init__(self, ray, node_id, name):
        self.ray, self.node_id, self.name = ray, node_id, name
        self.read = self

    def remote(self):       # actor.read.remote()
        if self.name in self.ray.broken:
            return _Ref(RuntimeError("the actor died"))
        return _Ref([h.Reading(self.name, c, "ok", 1.0, f"{c} fine", 100.0)
                     for c in h.HEALTH_CHECKS])


class _FakeRay:
    """What the driver calls of Ray: remote actors placed by node id, wait, get, kill."""

    def __init__(self):
        self.placed, self.killed, self.broken = [], [], set()

    def remote(self, **options):
        assert options == {"num_cpus": 0, "max_restarts": 0}
        ray = self

        class _Class:
            def __init__(self, cls):
                self.cls = cls

            def options(self, scheduling_strategy):
                node_id = scheduling_strategy.node_id
                assert scheduling_strategy.soft is False

                class _Maker:
                    def remote(_, config, name):
                        h.JobConfig.from_dict(config)
                        ray.placed.append((node_id, name))
                        return _Actor(ray, node_id, name)
                return _Maker()
        return _Class

    def wait(self, refs, num_returns, timeout):
        return list(refs), []

    def get(self, ref):
        if isinstance(ref.value, Exception):
            raise ref.value
        return ref.value

    def kill(self, actor):
        self.killed.append(actor.node_id)


ID1, ID2, ID3 = ("%02x" % i * 28 for i in (1, 2, 3))    # Ray node ids: 28 bytes in hex


def _statuses(path):
    snap = h.parse_readings(Path(path).read_text())
    return {n: {c: r.status for c, r in checks.items()} for n, checks in snap.readings.items()}


def test_driver_places_readers_and_follows_nodes_that_leave_join_or_fail(tmp_path):
    from cluster.ray_jobs.health_runner import Driver

    ray = _FakeRay()
    path = tmp_path / "cluster-health.json"
    driver = Driver(ray, h.job_config(_inventory("health: {period_s: 5}\n")), str(path), "sid")
    ok = {c: "ok" for c in h.HEALTH_CHECKS}
    unknown = {c: "unknown" for c in h.HEALTH_CHECKS}

    driver.place({ID1: "node1", ID2: "node2"})
    driver.round(wait_s=1)
    driver.write()
    assert ray.placed == [(ID1, "node1"), (ID2, "node2")]
    assert _statuses(path) == {"node1": ok, "node2": ok}

    driver.place({ID1: "node1"})                      # node2 left Ray
    driver.write()
    assert ray.killed == [ID2] and _statuses(path)["node2"] == unknown
    assert "not alive" in h.parse_readings(path.read_text()).readings["node2"]["gpus"].summary

    driver.place({ID1: "node1", ID3: "node2"})      # it rejoined under a new node id
    ray.broken.add("node1")                             # and node1's reader died
    driver.round(wait_s=1)
    driver.write()
    assert ray.placed[-1] == (ID3, "node2") and _statuses(path) == {"node1": unknown,
                                                                      "node2": ok}
    driver.place({ID1: "node1", ID3: "node2"})      # a new reader on node1 next round
    assert ray.placed[-1] == (ID1, "node1") and ray.killed == [ID2, ID1]
