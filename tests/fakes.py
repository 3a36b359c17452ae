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
