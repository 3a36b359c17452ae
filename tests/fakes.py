"""Shared stand-ins for the unit tests: command results, a recording session, a clock, and the
probe outputs / NodeContext a preflight check is judged on.

    result("gpu02", stdout="...")             a CommandResult as cluster/remote.py makes one
    RecordingSession()                        answers every run() with success and records it
    ScriptedSession({"node1": [r1, r2]})      answers run()/run_small() from per-node lists
    FakeClock()                               clock() and clock.sleep(s) without waiting
    probe_output("ibstat", fixture_text("ibstat", "108-...txt"))
    judge("infiniband", INVENTORY_YAML, node="n1", ibstat=...)   a check's Verdict

`judge` builds the context as cluster/preflight.py's evaluate_node does: the check's own probe
builders decide which outputs it reads; every probe not given is "command not found" (127).
Nothing here talks to a network or runs a command on a node.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from cluster.checks.base import NodeCheck, NodeContext, Verdict
from cluster.inventory import Inventory, loads
from cluster.probes import ProbeOutput
from cluster.remote import CommandResult

FIXTURES = Path(__file__).parent / "fixtures"


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


class RecordingSession:
    """Answers every command with success and records (time, node, command): no network.

    `fail_on`: a command containing this text fails on the head; `worker_delay`: seconds a
    worker's command takes. `stdins` records (node, stdin) per call.
    """

    def __init__(self, fail_on: str | None = None, worker_delay: float = 0.0):
        self.calls: list[tuple[float, str, str]] = []
        self.stdins: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self.fail_on = fail_on
        self.worker_delay = worker_delay

    def run(self, node, command, timeout=None, stdin=None):
        with self._lock:
            self.calls.append((time.monotonic(), node.name, command))
            self.stdins.append((node.name, stdin))
        if not node.is_head and self.worker_delay:
            time.sleep(self.worker_delay)
        failed = self.fail_on is not None and self.fail_on in command and node.is_head
        return CommandResult(node.name, command, 1 if failed else 0, "", "boom" if failed else "",
                             0.0, "failed" if failed else "ok")

    def fan_out(self, nodes, command, timeout=None, on_result=None, stdin=None):
        """Session.fan_out's contract, node by node: results in node order."""
        results = []
        for node in nodes:
            res = self.run(node, command(node) if callable(command) else command, timeout, stdin)
            if on_result is not None:
                on_result(res)
            results.append(res)
        return tuple(results)


class ScriptedSession:
    """Answers run()/run_small() per node from a list of CommandResults (the last repeats).

    Records (node name, command) in `calls`. `max_parallel` is what Session has.
    """

    max_parallel = 4

    def __init__(self, answers: Mapping[str, Iterable[CommandResult]]):
        self.answers = {node: list(results) for node, results in answers.items()}
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def run(self, node, command, timeout=None, stdin=None):
        with self._lock:
            self.calls.append((node.name, command))
            queue = self.answers[node.name]
            return queue.pop(0) if len(queue) > 1 else queue[0]

    run_small = run


class FakeClock:
    """A monotonic clock that only moves when sleep() is called."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


# ---------------------------------------------------------------- probe outputs and checks

MISSING = dict(exit_code=127, stderr="bash: line 1: x: command not found\n")
TIMED_OUT = dict(exit_code=124)


def probe_output(name: str, stdout: str = "", exit_code: int = 0, stderr: str = "",
                 command: str | None = None) -> ProbeOutput:
    """What split_probe_output gives for one probe."""
    return ProbeOutput(name, command or name, exit_code, stdout, stderr)


def probe_script_output(outputs: Mapping[str, tuple[int, str]]) -> str:
    """What the gather command prints when each probe NAME printed TEXT and exited CODE: the
    real cluster/probes.py script, run here by bash, its probes printing those texts."""
    import shlex
    import subprocess

    from cluster.probes import Probe, probe_script
    probes = [Probe(name, f"printf %s {shlex.quote(text)}; exit {code}")
              for name, (code, text) in outputs.items()]
    return subprocess.run(["bash", "-c", probe_script(probes)], capture_output=True,
                          timeout=60).stdout.decode()


def probe_answer(outputs: Mapping[str, tuple[int, str, str]]) -> str:
    """What cluster/probes.py's script prints when each probe NAME exited CODE having printed
    STDOUT and STDERR (no stream over the cap), written here without running bash: the fast
    stand-in for probe_script_output where hundreds of nodes answer."""
    from cluster.probes import _ERR, _MARK, _OUT

    def stream(text: str, prefix: str) -> str:
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return "".join(f"{prefix}{line}\n" for line in lines) + "\n"

    return "".join(f"{_MARK} {name} begin\n{stream(out, _OUT)}{stream(err, _ERR)}{_MARK} {name} end {code}\n"
                   for name, (code, out, err) in outputs.items())


def node_checks() -> dict[str, NodeCheck]:
    from cluster.checks.node import NODE_CHECKS
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
        "versions": {"python": "3.11.7", "ray": "2.60.0", "vllm": "0.32.0", "torch": "2.9.0",
                     "nccl": "2.27.3"},
        "hostname": hostname, "auth_token": True, "memlock_session": None,
        "memlock_session_known": True, "processes": []}) + "\n"


class FakeClusterSession:
    """Session.run/run_small/fan_out for N fake nodes, answering what a preflight sends: the
    probe script (each probe's real captured output, NODE_FIXTURES; a probe without one is
    "command not found"), `date` for the clock samples and cluster/node_programs/reach.py's
    listen/probe/stop (every connect succeeds). No network; `calls` counts commands."""

    max_parallel = 16

    def __init__(self, inventory: Inventory,
                 fixtures: Mapping[str, tuple[str, str]] = NODE_FIXTURES):
        self.inventory = inventory
        self.texts = {probe: fixture_text(*where) for probe, where in fixtures.items()}
        self.calls = 0
        self._lock = threading.Lock()

    def run(self, node, command, timeout=None, stdin=None):
        with self._lock:
            self.calls += 1
        if "@@cluster-probe@@" in command:
            return result(node.name, self._probes(node, command), command=command)
        if command.startswith("date "):
            return result(node.name, f"{time.time():.9f}\n", command=command)
        return result(node.name, self._reach(command), command=command)

    run_small = run

    def fan_out(self, nodes, command, timeout=None, on_result=None, stdin=None):
        results = []
        for node in nodes:
            res = self.run(node, command(node) if callable(command) else command, timeout, stdin)
            if on_result is not None:
                on_result(res)
            results.append(res)
        return tuple(results)

    def _probes(self, node, command: str) -> str:
        from cluster.probes import probe_names
        answers = {}
        for name in probe_names(command):
            text = node_facts_document(node.name) if name == "versions" else self.texts.get(name)
            answers[name] = (0, text, "") if text is not None else \
                (127, "", "bash: x: command not found\n")
        return probe_answer(answers)

    @staticmethod
    def _reach(command: str) -> str:
        import json
        import shlex
        words = shlex.split(command)
        args = words[words.index("-") + 1:] if "-" in words else words
        flag = lambda name: args[args.index(name) + 1] if name in args else ""  # noqa: E731
        if "listen" in args:
            ports = [int(p) for p in flag("--ports").split(",") if p]
            return json.dumps({"listening": ports, "busy": [], "failed": [], "pid": 1}) + "\n"
        if "probe" in args:
            targets = {f"{hp.split(':')[0]}:{port}": "ok" for hp in flag("--targets").split(",")
                       if hp for port in hp.split(":")[1].split("+")}
            return json.dumps({"results": targets}) + "\n"
        return json.dumps({"stopped": True}) + "\n"


def fake_inventory(n: int, node_extra: str = "") -> Inventory:
    """An inventory of n nodes (n1 the head) on the simulated clusters' addresses; `node_extra`:
    more YAML flow-mapping entries for every node (`ib_hcas: [mlx5_0]`)."""
    extra = f", {node_extra}" if node_extra else ""
    lines = ["nodes:"] + [f"  - {{name: n{i}, address: 198.18.{i // 250}.{i % 250 + 1}"
                          f"{', role: head' if i == 1 else ''}{extra}}}" for i in range(1, n + 1)]
    return loads("\n".join(lines) + "\n")
