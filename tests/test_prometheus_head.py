"""`ray.metrics: prometheus`: inventory validation (one line, exit 2), the head's start env
and its drift check, the pure plan, the step against a recording session, the on-node program
(real Prometheus on this machine's loopback when Debian's package is installed, through the
library's local runner), the head-only preflight check and `status`'s dashboard.metrics."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.nodes import inventory
from cluster.ray import prometheus_head, ray_cluster
from cluster.inspection.checks.base import NodeContext
from cluster.inspection.checks.metrics import evaluate_prometheus, prometheus_probe
from cluster.base.errors import InventoryError
from cluster.ray.prometheus_head import KEEP, REFUSE, RESTART, START, Probe, Running, plan
from cluster.inspection.probes import ProbeOutput
from cluster.inspection.facts import RayletInfo
from cluster.ray.ray_cluster import CHANGED, FAILED, OK
from cluster.nodes.ray_env import start_env
from cluster.ray.ray_state import GcsNode, RayState
from cluster.nodes.remote import CommandResult
from cluster.base.results import Status
from fakes import FakeRunner, cluster_cli, write_inventory
from playbooks import prometheus_head as bringup

REPO = Path(__file__).resolve().parents[1]
BASE = """\
nodes:
  - name: head
    role: head
    address: 10.0.0.1
  - name: w1
    address: 10.0.0.2
ray:
"""
ON = BASE + "  metrics: prometheus\n"
CFG = "/tmp/ray/session_2026-12-01_10-00-00_1_1/metrics/prometheus/prometheus.yml"


def inv(text: str = ON):
    return inventory.loads(text, path="c.yaml")


# ---------------------------------------------------------------- inventory


@pytest.mark.parametrize("extra, message", [
    ("  metrics: yes\n", "c.yaml:8: ray.metrics: must be one of off, prometheus, got a boolean"),
    ("  metrics: grafana\n", "c.yaml:8: ray.metrics: must be one of off, prometheus"),
    ("  metrics: [prometheus]\n", "c.yaml:8: ray.metrics: must be one of off, prometheus"),
    ("  prometheus_port: 0\n", "c.yaml:8: ray.prometheus_port: must be between 1 and 65535"),
    ("  prometheus_port: 65536\n", "ray.prometheus_port: must be between 1 and 65535"),
    ("  prometheus_port: 9e3\n", "ray.prometheus_port: must be an integer"),
    ("  prometheus_port: 0x2382\n", "ray.prometheus_port: must be a decimal integer"),
    ("  grafana_url: ftp://g:3000\n", "c.yaml:8: ray.grafana_url: must be an http:// or https://"),
    ("  grafana_url: http://admin:pw@g:3000\n", "ray.grafana_url: must be an http:// or https://"),
    ("  grafana_url: 'http://g:3000/a b'\n", "ray.grafana_url: must be an http:// or https://"),
    ("  grafana_url: \"http://g:3000/\\n\"\n", "ray.grafana_url: must be an http:// or https://"),
    ("  grafana_url: http://g:0\n", "ray.grafana_url: invalid URL 'http://g:0': the port must"),
    ("  grafana_url: http://g:99999\n", "the port must be a number 1-65535"),
    ("  grafana_url: http://1.2.3\n", "not an IPv4 address"),
    ("  grafana_url: http://[::1\n", "ray.grafana_url: invalid URL"),
    ("  grafana_url: 3000\n", "ray.grafana_url: must be an http:// or https://"),
    ("  grafana_iframe_url: http://g:3000\n", "c.yaml:8: ray.grafana_iframe_url: needs ray.grafana_url"),
    ("  prometheus: true\n", "c.yaml:8: ray.prometheus: unknown key"),
])
def test_bad_metrics_settings_are_refused_with_file_line_and_key(extra, message):
    with pytest.raises(InventoryError) as err:
        inventory.loads(BASE + extra, path="c.yaml")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_metrics_defaults_and_values():
    off = inv(BASE + "  port: 6379\n").ray
    assert (off.metrics, off.prometheus_port, off.grafana_url, off.grafana_iframe_url) == \
        ("off", 9090, None, None)
    assert inv(BASE + "  metrics: off\n").ray.metrics == "off"   # YAML 1.1's bare off
    r = inv(ON + "  prometheus_port: 19090\n  grafana_url: https://grafana.example.org:3000/\n").ray
    assert (r.metrics, r.prometheus_port) == ("prometheus", 19090)
    assert r.grafana_url == r.grafana_iframe_url == "https://grafana.example.org:3000"
    r = inv(ON + "  grafana_url: http://[fd00::5]:3000\n"
                 "  grafana_iframe_url: https://g.example.org/grafana\n").ray
    assert (r.grafana_url, r.grafana_iframe_url) == ("http://[fd00::5]:3000",
                                                     "https://g.example.org/grafana")


def test_a_bad_value_is_one_line_on_stderr_and_exit_2(tmp_path):
    path = write_inventory(tmp_path, BASE + "  metrics: grafana\n")
    p = cluster_cli("-i", str(path), "inventory", env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "ray.metrics" in p.stderr


def test_the_template_names_the_metrics_settings():
    text = inventory.template_text()
    assert "metrics: prometheus" in text and "prometheus_port" in text and "grafana_url" in text
    inventory.loads(text.replace("# metrics: prometheus", "metrics: prometheus"), path="t.yaml")


# ---------------------------------------------------------------- start env and drift


def test_only_the_heads_ray_start_gets_the_prometheus_and_grafana_hosts():
    i = inv(ON + "  prometheus_port: 19090\n  grafana_url: http://10.0.0.9:3000\n")
    head = ray_cluster.start_command(i.head, i, ())
    assert "RAY_PROMETHEUS_HOST=http://127.0.0.1:19090" in head
    assert "RAY_GRAFANA_HOST=http://10.0.0.9:3000" in head
    assert "RAY_GRAFANA_IFRAME_HOST=http://10.0.0.9:3000" in head
    worker = ray_cluster.start_command(i.workers[0], i, ())
    assert "RAY_PROMETHEUS_HOST" not in worker and "RAY_GRAFANA" not in worker
    off = inv(BASE + "  port: 6379\n")
    assert "RAY_PROMETHEUS_HOST" not in ray_cluster.start_command(off.head, off, ())
    # gather reads the variable from the running raylet's env (to compare it)
    from cluster.inspection.facts import gather_command
    assert "RAY_PROMETHEUS_HOST" in gather_command(i.head, i)


def _healthy(i, head_env):
    gcs = f"{i.head.ip}:{i.ray.port}"
    raylet = RayletInfo(pid=100, node_id="aa" * 28, node_ip=i.head.ip, gcs_address=gcs,
                        env=head_env)
    return ray_cluster.NodeFacts("head", reached=True, python="/usr/bin/python3",
                                 python_version="3.11.7", ray_version="2.60.0",
                                 nvidia_smi="missing", raylet=raylet, gcs_port=i.ray.port,
                                 ray_pids=(100,))


def test_a_head_started_with_prometheus_host_is_not_drift_and_one_without_is():
    i = inv(ON)
    from cluster.nodes.ray_env import SERVE_HAPROXY_FILES

    with_env = {**start_env(i.head, "disabled", i.ray.serve_ingress, i.ray),   # + what the
                **{k: "/tmp/cluster-hap.Ab3dE6gH/x" for k in SERVE_HAPROXY_FILES}}  # prefix exports
    state = RayState("dashboard", "2.60.0", (
        GcsNode("aa" * 28, i.head.ip, True, True, {"CPU": 2.0}),), None)
    assert ray_cluster._drift(i, i.head, _healthy(i, with_env), state, "disabled") == []
    without = {k: v for k, v in with_env.items() if k != "RAY_PROMETHEUS_HOST"}
    drift = ray_cluster._drift(i, i.head, _healthy(i, without), state, "disabled")
    assert any("RAY_PROMETHEUS_HOST=None" in d for d in drift), drift


# ---------------------------------------------------------------- plan (pure)


def test_plan_keeps_starts_restarts_or_refuses():
    i = inv(ON)
    ready = Running(42, CFG, "127.0.0.1:9090", True)
    assert plan(i, Probe(None, CFG, None)).kind == REFUSE
    refused = plan(i, Probe("/usr/bin/prometheus", None, None))
    assert refused.kind == REFUSE and "session_latest/metrics/prometheus" in refused.reason
    start = plan(i, Probe("/usr/bin/prometheus", CFG, None))
    assert start.kind == START and len(start.commands) == 1
    keep = plan(i, Probe("/usr/bin/prometheus", CFG, ready))
    assert keep.kind == KEEP and keep.commands == () and "pid 42" in keep.reason
    other_session = Running(42, CFG.replace("10-00-00", "11-00-00"), "127.0.0.1:9090", True)
    for running in (other_session, Running(42, CFG, "127.0.0.1:9091", True),
                    Running(42, CFG, "127.0.0.1:9090", False)):
        again = plan(i, Probe("/usr/bin/prometheus", CFG, running))
        assert again.kind == RESTART and len(again.commands) == 2
        assert " stop " in again.commands[0] and " start " in again.commands[1]


def test_the_start_command_binds_loopback_with_rays_config_and_a_short_retention():
    i = inv(ON + "  prometheus_port: 19090\n  temp_dir: /data/ray\n  python: /opt/venv/bin/python3\n")
    command = plan(i, Probe("/usr/bin/prometheus", CFG, None)).commands[0]
    assert command.startswith("/opt/venv/bin/python3 - start --root /data/ray ")
    assert "--port 19090" in command and f"--config {CFG}" in command
    assert "--binary /usr/bin/prometheus" in command
    assert f"--retention {prometheus_head.RETENTION}" in command
    assert prometheus_head.probe_call(i).command.startswith("/opt/venv/bin/python3 - probe --root "
                                                       "/data/ray --port 19090")


# ---------------------------------------------------------------- the step (a fake head in a real Session)


def head_answers(replies) -> FakeRunner:
    """Nodes whose head answers each verb of the program with a canned JSON document (or a
    CommandResult); the program itself must come on stdin."""
    def respond(sent):
        assert sent.stdin is not None and "def main" in sent.stdin  # the program goes on stdin
        doc = replies[_verb(sent)]
        return doc if isinstance(doc, CommandResult) else json.dumps(doc) + "\n"
    return FakeRunner(respond=respond)


def _verb(sent) -> str:
    return sent.command.split(" - ", 1)[1].split()[0]


def verbs(nodes: FakeRunner) -> list[str]:
    return [_verb(sent) for sent in nodes.sent]


def test_up_starts_then_keeps_and_reports_a_failed_start():
    i = inv(ON)
    probe_none = {"binary": "/usr/bin/prometheus", "config": CFG, "running": None}
    s = head_answers({"probe": probe_none, "start": {"pid": 7, "ready": True}})
    step = bringup.up(s.session(i), i)
    assert (step.status, verbs(s)) == (CHANGED, ["probe", "start"])
    assert "pid 7" in step.message
    running = {"pid": 7, "config": CFG, "listen": "127.0.0.1:9090", "ready": True}
    s = head_answers({"probe": dict(probe_none, running=running)})
    step = bringup.up(s.session(i), i)
    assert (step.status, verbs(s)) == (OK, ["probe"])
    s = head_answers({"probe": probe_none, "start": {"pid": 7, "ready": False, "exit_code": 1,
                                                  "log_tail": "err: bind: address in use\n"}})
    step = bringup.up(s.session(i), i)
    assert step.status == FAILED and "address in use" in step.message
    s = head_answers({"probe": dict(probe_none, binary=None)})
    assert bringup.up(s.session(i), i).status == FAILED
    broken = CommandResult("head", "x", 1, "", "Traceback...\nOSError: boom\n", 0.1, "failed")
    step = bringup.up(head_answers({"probe": broken}).session(i), i)
    assert step.status == FAILED and "OSError: boom" in step.message


def test_down_reports_stopped_or_nothing():
    i = inv(ON)
    assert bringup.down(head_answers({"stop": {"stopped": 7}}).session(i), i).status == CHANGED
    assert bringup.down(head_answers({"stop": {"stopped": None}}).session(i), i).status == OK


def test_dashboards_keep_only_plain_json_names():
    i = inv(ON)
    s = head_answers({"dashboards": {"dir": "/x", "dashboards": {
        "serve_grafana_dashboard.json": "{}", "../evil.json": "{}", ".hidden.json": "{}",
        "notes.txt": "x"}}})
    found, error = bringup.dashboards(s.session(i), i)
    assert error is None and list(found) == ["serve_grafana_dashboard.json"]
    found, error = bringup.dashboards(
        head_answers({"dashboards": {"dir": "/x", "dashboards": {}}}).session(i), i)
    assert found == {} and "no Grafana dashboard under /x" in error


# ---------------------------------------------------------------- the on-node program, for real


def _program(*args: str) -> dict:
    from cluster.node_programs import source

    p = subprocess.run([sys.executable, "-", *args], input=source("prometheus"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_stop_never_kills_a_pid_that_is_not_our_prometheus(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "cluster-prometheus").mkdir()
        (tmp_path / "cluster-prometheus" / "prometheus.pid").write_text(f"{sleeper.pid}\n")
        doc = _program("stop", "--root", str(tmp_path))
        assert doc == {"stopped": None, "stale_pid": sleeper.pid}
        assert sleeper.poll() is None
        assert not (tmp_path / "cluster-prometheus" / "prometheus.pid").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_dashboards_read_regular_files_only_and_wait_out_ray_rewriting_them(tmp_path):
    """Ray's dashboard removes and rewrites its Grafana folder when it starts (the CI failure:
    a file listed, then gone): the read waits for the folder; a link is never followed."""
    import threading

    d = tmp_path / "session_1" / "metrics" / "grafana" / "dashboards"
    (tmp_path / "session_latest").symlink_to(tmp_path / "session_1")
    secret = tmp_path / "secret.json"
    secret.write_text("root only")

    def rewrite():
        d.mkdir(parents=True)
        (d / "default_grafana_dashboard.json").write_text('{"title": "Default"}')
        (d / "planted.json").symlink_to(secret)

    later = threading.Timer(1.0, rewrite)
    later.start()
    try:
        doc = _program("dashboards", "--root", str(tmp_path), "--wait", "30")
    finally:
        later.join()
    assert doc["dashboards"] == {"default_grafana_dashboard.json": '{"title": "Default"}'}
    assert _program("dashboards", "--root", str(tmp_path / "none"),
                    "--wait", "0")["dashboards"] == {}


def _session_config(root: Path, session: str) -> Path:
    """A Ray-like session dir with Ray's Prometheus config (Ray's own template)."""
    from ray.dashboard.modules.metrics.templates import PROMETHEUS_YML_TEMPLATE

    d = root / session / "metrics" / "prometheus"
    d.mkdir(parents=True)
    cfg = d / "prometheus.yml"
    cfg.write_text(PROMETHEUS_YML_TEMPLATE.format(
        prom_metrics_service_discovery_file_path=str(root / session / "sd.json")))
    latest = root / "session_latest"
    if latest.is_symlink():
        latest.unlink()
    latest.symlink_to(root / session)
    return cfg


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="no prometheus binary (scripts/bootstrap installs Debian's package)")
def test_real_prometheus_start_keep_restart_on_a_new_session_and_stop(tmp_path):
    from cluster.nodes.remote import Session

    root = tmp_path / "ray"
    cfg = _session_config(root, "session_1")
    port = _free_port()
    i = inventory.loads(
        "nodes:\n  - name: localhost\n    role: head\n    address: localhost\n"
        f"    local: true\n    node_ip: 127.0.0.1\nray:\n  metrics: prometheus\n"
        f"  prometheus_port: {port}\n  temp_dir: {root}\n  python: {sys.executable}\n",
        path="local.yaml")
    with Session(i) as session:
        try:
            first = bringup.up(session, i)
            assert first.status == CHANGED, first.message
            pid = int((root / "cluster-prometheus" / "prometheus.pid").read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert f"--web.listen-address=127.0.0.1:{port}".encode() in cmdline
            assert f"--config.file={cfg}".encode() in cmdline
            again = bringup.up(session, i)
            assert again.status == OK and f"pid {pid}" in again.message
            _session_config(root, "session_2")
            moved = bringup.up(session, i)
            assert moved.status == CHANGED and "session_1" in moved.message
            new_pid = int((root / "cluster-prometheus" / "prometheus.pid").read_text())
            assert new_pid != pid and not _alive(pid)
        finally:
            stopped = bringup.down(session, i)
        assert stopped.status == CHANGED and not _alive(new_pid)
        assert bringup.down(session, i).status == OK


# ---------------------------------------------------------------- preflight and status


def _ctx(i, node, outputs):
    return NodeContext(node, i, outputs)


def test_preflight_checks_the_binary_on_the_head_only_when_metrics_are_on():
    i = inv(ON)
    off = inv(BASE + "  port: 6379\n")
    assert prometheus_probe(i.workers[0], i) is None
    assert prometheus_probe(off.head, off) is None
    probe = prometheus_probe(i.head, i)
    missing = ProbeOutput("prometheus", probe.command, 127, "", "")
    v = evaluate_prometheus(_ctx(i, i.head, {"prometheus": missing}))
    assert v.status is Status.FAIL and "apt-get install prometheus" in v.fix
    found = ProbeOutput("prometheus", probe.command, 0,
                        "prometheus, version 2.42.0+ds (branch: debian/sid)\n", "")
    v = evaluate_prometheus(_ctx(i, i.head, {"prometheus": found}))
    assert v.status is Status.OK and "2.42.0" in v.summary
    assert evaluate_prometheus(_ctx(i, i.workers[0], {})).status is Status.SKIP
    assert evaluate_prometheus(_ctx(off, off.head, {})).status is Status.SKIP


def test_status_metrics_doc():
    assert prometheus_head.metrics_doc(inv(BASE + "  port: 6379\n")) == \
        {"prometheus_url": None, "grafana_url": None}
    assert prometheus_head.metrics_doc(inv(ON + "  grafana_url: http://g:3000\n")) == \
        {"prometheus_url": "http://127.0.0.1:9090", "grafana_url": "http://g:3000"}


# ---------------------------------------------------------------- the Serve app's engine metrics


@pytest.mark.vllm
def test_engine_metrics_carry_the_app_tags_and_vllms_own_logger_comes_last():
    pytest.importorskip("vllm")
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    from serve_apps import engine_metrics

    loggers = engine_metrics.stat_loggers()
    assert issubclass(loggers[0], RayPrometheusStatLogger) and loggers[-1] is PrometheusStatLogger
    gauge = loggers[0]._gauge_cls("vllm:num_requests_running", "doc", ["model_name", "engine"])
    assert gauge.metric._tag_keys == ("model_name", "engine", "ReplicaId", "application",
                                      "deployment")
    assert gauge.metric._default_tags == {"application": "", "deployment": ""}  # not in Serve
    labelled = gauge.labels("tiny", "0")
    assert labelled._tags == {"model_name": "tiny", "engine": "0", "ReplicaId": ""}
    labelled.set(3)  # every tag key has a value (Ray refuses a missing one)
    with pytest.raises(ValueError):
        gauge.labels("tiny")


@pytest.mark.parametrize("wait", ["nan", "inf"])
def test_a_wait_that_is_not_a_finite_number_is_refused_in_one_line(wait, tmp_path):
    from cluster.node_programs import source

    p = subprocess.run([sys.executable, "-", "dashboards", "--root", str(tmp_path),
                        f"--wait={wait}"], input=source("prometheus"), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines()[-1] == "prometheus: error: --wait: expected a finite number of seconds"
