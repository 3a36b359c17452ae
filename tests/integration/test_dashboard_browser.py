"""The Ray dashboard in a real browser through `cluster dashboard` (issue 18 item 1).

A simulated 2-node cluster (the `small-4gpu` profile: fake nvidia-smi, 4 GPUs a node) in Ray
token mode, `cluster up`, one Serve app deployed with `cluster deploy --placement-only` (the
real serve_apps app, its GPU bundles reserved, no engine), then `cluster dashboard --port 0
--url-only` as a subprocess and headless Chromium (tests/integration/browser.py) on
<url>/#/serve: the Serve page lists the app and shows no "Authentication Token Required".
The control: the same page through a plain `ssh -L` tunnel (tunnel_argv, no token) shows the
token prompt, so the check can fail. Then the token is looked for everywhere it must not be:
every file under the run directory, the browser's profile (no cookie carries it), the argv of
every process this test started (sampled while they ran) and the command's stdout/stderr.
Screenshots are kept in $CLUSTER_TEST_OUTPUT (default .test-output/).

Token mode (issue 25 item 1): a test-only token in every node's inventory env (RAY_AUTH_TOKEN,
secret: it reaches `ray start` on stdin) and no RAY_AUTH_MODE: `cluster up` must choose token
mode from it and say so. The laptop side runs with HOME in a temporary folder, so whatever
~/.ray this machine has plays no part; the simulated nodes share the host's /root, and a
~/.ray/auth_token there must not win over the token Ray was started with either.

The proxy's own credential (issue 25 item 6): the browser opens the URL the command printed
(`?token=` the proxy's credential, not the Ray token), which the proxy turns into its cookie;
the bare URL without it shows the proxy's refusal (a control).

The fixtures (`scenario`, `dashboard`) are module-scoped so later checks (Prometheus through the
tunnel) can join the same cluster. Run your own instance: SIMCLUSTER_PREFIX=dash
SIMCLUSTER_SUBNET=40 SIMCLUSTER_DIR=/tmp/simcluster-dash. Heavy: Ray on two nodes, a few
minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from browser import Browser, chromium_unavailable, visible_text
from fakes import cluster_process
from integration_kit import PYTHON, SHORT_DRAIN_ENV, ClusterCli, ProcessListWatch, node_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.ray]

PROFILES = {"node1": "small-4gpu", "node2": "small-4gpu"}
APP = "dash-serve-app"
PROMPT = "Authentication Token Required"
AUTH_LINE = "Ray auth: token (from RAY_AUTH_TOKEN in node1's inventory env)"
REFUSED = "the proxy's credential is missing"
LAPTOP_HOME: dict[str, str] = {}    # HOME for the CLI: set once by the scenario fixture


def laptop_env() -> dict[str, str]:
    return dict(os.environ, **LAPTOP_HOME)


CLI = ClusterCli(timeout=900)


def cli(inventory: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return CLI(inventory, *args, timeout=timeout, env=LAPTOP_HOME)


def page(login_url: str, fragment: str) -> str:
    """The login URL (the proxy's credential in its query) opening a page of the UI."""
    return f"{login_url}#{fragment}"


class ArgvWatch(ProcessListWatch):
    """ProcessListWatch's sampler thread, over the command lines of this test's own processes
    only (descendants of pytest); `seen` counts the distinct processes sampled (a control)."""

    PERIOD_S = 0.5

    def __init__(self, secret: str):
        super().__init__(secret)
        self.seen: set[int] = set()

    def sample(self) -> None:
        parents: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
                parents[int(stat.parent.name)] = int(text.rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        me = os.getpid()
        for pid in parents:
            p, hops = pid, 0
            while p in parents and p != me and hops < 64:
                p, hops = parents[p], hops + 1
            if p != me or pid == me:
                continue
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            self.seen.add(pid)
            if self.secret.encode() in argv:
                self.hits.append(argv.replace(b"\0", b" ").decode("utf-8", "replace")[:300])


@dataclass
class Scenario:
    """The running cluster: inventory, run directory, the token (for leak checks), the app."""

    sim: object
    inventory: Path
    run_dir: Path
    token: str
    app: str
    watch: ArgvWatch
    outputs: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def model(tiny_model_builder) -> Path:
    return node_tiny_model(tiny_model_builder, "dense")


@pytest.fixture(scope="module")
def sim(simcluster_factory):
    reason = chromium_unavailable()
    if reason:
        pytest.skip(reason)
    return simcluster_factory(2, PROFILES)


@pytest.fixture(scope="module")
def scenario(sim, model, tmp_path_factory):
    """Ray up in token mode on the two nodes with APP deployed (placement only); undeployed
    and down at the end."""
    base = tmp_path_factory.mktemp("dash-inv")
    doc = yaml.safe_load(sim.inventory_path.read_text())
    doc["ray"] = {"num_cpus": 4, "memory": 2 * 1024 ** 3,
                  "object_store_memory": 256 * 1024 ** 2, "python": PYTHON}
    doc["run_dir"] = str(base / "runs")
    home = tmp_path_factory.mktemp("laptop-home")
    LAPTOP_HOME["HOME"] = str(home)
    assert not (home / ".ray").exists()
    token = secrets.token_hex(32)
    for node in doc["nodes"]:
        node["env"] = {"RAY_prestart_worker_first_driver": "0", "RAY_AUTH_TOKEN": token,
                       **SHORT_DRAIN_ENV}
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with ArgvWatch(token) as watch:
        run = Scenario(sim, path, base / "runs", token, APP, watch)
        cli(path, "down", "--yes", timeout=300)
        try:
            p = cli(path, "up", "--skip-preflight", "--yes", timeout=900)
            run.outputs.append(p.stdout + p.stderr)
            assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
            assert AUTH_LINE in p.stdout, p.stdout[-4000:]
            p = cli(path, "status", "--json", timeout=300)   # reads the cluster with the token
            run.outputs.append(p.stdout + p.stderr)
            assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
            assert json.loads(p.stdout)["head"]["source"] == "dashboard", p.stdout[-4000:]
            p = cli(path, "deploy", "--model", str(model), "--tp", "1", "--name", APP,
                    "--device", "gpu", "--placement-only", "--no-api-key", "--yes",
                    "--timeout", "600", "--json", timeout=900)
            run.outputs.append(p.stdout + p.stderr)
            assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
            assert json.loads(p.stdout)["status"] == "RUNNING"
            yield run
        finally:
            cli(path, "undeploy", APP, "--yes", timeout=300)
            cli(path, "down", "--yes", timeout=300)


class DashboardProcess:
    """`cluster dashboard --port 0 --url-only` running; stop() ends it (SIGTERM) once."""

    def __init__(self, inventory: Path):
        self.proc = cluster_process("-i", str(inventory), "dashboard", "--port", "0",
                                    "--url-only", python=PYTHON, env=laptop_env())
        self.url = self.proc.stdout.readline().strip()
        self.result: tuple[int, str, str] | None = None

    def stop(self) -> tuple[int, str, str]:
        if self.result is None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            out, err = self.proc.communicate(timeout=60)
            self.result = (self.proc.returncode, self.url + "\n" + out, err)
        return self.result


@pytest.fixture(scope="module")
def dashboard(scenario):
    run = DashboardProcess(scenario.inventory)
    try:
        assert run.url.startswith("http://127.0.0.1:"), run.stop()
        yield run
    finally:
        run.stop()


def token_free(scenario: Scenario) -> bool:
    """No command output of the scenario carries the Ray token."""
    return all(scenario.token not in text for text in scenario.outputs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, limit_s: float = 60) -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"ssh -L exited {proc.returncode}: {proc.stderr.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"ssh -L did not listen on {port} within {limit_s:g} s")


# ---------------------------------------------------------------- the tests


def test_the_serve_page_lists_the_app_without_a_token_prompt(scenario, dashboard, tmp_path):
    assert "?token=" in dashboard.url and scenario.token not in dashboard.url
    with Browser(tmp_path / "proxy") as browser:
        dom = browser.dom(page(dashboard.url, "/serve"))
        browser.screenshot(page(dashboard.url, "/serve"), "dashboard-serve-through-proxy")
    text = visible_text(dom)
    assert PROMPT not in dom, text[:3000]
    assert scenario.app in text, text[:3000]
    assert scenario.token not in dom
    for path in browser.profile.rglob("*"):   # no cookie or cache entry holds the token
        if path.is_file():
            assert scenario.token.encode() not in path.read_bytes(), path


def test_without_the_proxys_credential_the_browser_gets_the_refusal(scenario, dashboard,
                                                                    tmp_path):
    """The control of the credential: the bare proxy URL (no ?token=, a fresh profile)."""
    bare = dashboard.url.split("?", 1)[0]
    with Browser(tmp_path / "bare") as browser:
        dom = browser.dom(f"{bare}#/serve")
    text = visible_text(dom)
    assert REFUSED in text and scenario.app not in text, text[:3000]


def test_a_plain_tunnel_without_the_token_shows_the_prompt(scenario, tmp_path):
    """The control: the check above can fail (same page, same browser, no token added)."""
    from cluster.nodes import inventory as inventory_mod
    from cluster.commands.dashboard import tunnel_argv

    port = _free_port()
    proc = subprocess.Popen(tunnel_argv(inventory_mod.load(str(scenario.inventory)), port),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_listening(port, proc)
        with Browser(tmp_path / "plain") as browser:
            dom = browser.dom(f"http://127.0.0.1:{port}/#/serve")
            browser.screenshot(f"http://127.0.0.1:{port}/#/serve", "dashboard-serve-plain-tunnel")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert PROMPT in visible_text(dom), visible_text(dom)[:3000]


def test_the_token_is_in_no_file_argv_or_output(scenario, dashboard):
    code, out, err = dashboard.stop()
    assert code == 0, err
    assert out.strip() == dashboard.url           # --url-only: the URL and nothing else
    assert AUTH_LINE in scenario.outputs[0] and token_free(scenario)
    token = scenario.token
    assert token not in out and token not in err
    for text in scenario.outputs:
        assert token not in text
    scenario.watch.sample()
    assert scenario.watch.hits == []
    assert len(scenario.watch.seen) > 3           # the sampler saw our processes at all
    files = [p for p in scenario.run_dir.rglob("*") if p.is_file()]
    assert files, "no run directory was written"
    for path in files:
        assert token.encode() not in path.read_bytes(), path
