"""`cluster fix` steps: gather (preflight, read-only) -> plan (cluster/remedy/fixes.py, pure) -> dry run
-> confirm -> execute (per node in parallel, an undo record first) -> verify (preflight again on
the nodes touched), each check reported before -> after.

Result statuses, Ansible's vocabulary: ok (nothing to do), changed (fixed and verified),
failed (a command failed or the check still fails), skipped, unreachable, manual (no safe
automatic fix: the reason and the next diagnostic step). `undo` restores the files and mounts
a run changed (modules loaded and clock steps are not undone).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from shlex import quote
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from cluster.inspection.checks.node import NODE_CHECKS
from cluster.base.errors import UsageError
from cluster.remedy.fixes import FIXABLE, FixPlan, Step, as_root, plan_fixes
from cluster.nodes.inventory import Inventory, Node
from playbooks.preflight import run_preflight
from cluster.nodes.remote import Session, parallel
from cluster.base.results import Status
from playbooks.fix_model import copy_models
from playbooks.outcome import Confirm, OnEvent, Outcome, ignore, lines_to

UNDO_FILE = "fix-undo.json"
STEP_TIMEOUT_S = 120
_SUDO_PASSWORD = "a password is required"


@dataclass(frozen=True)
class FixResult:
    node: str | None
    check: str
    status: str                      # ok changed failed skipped unreachable manual planned
    summary: str
    before: str | None = None        # the check's status before
    after: str | None = None         # ... and after the fix
    commands: tuple[str, ...] = ()
    note: str | None = None
    next_step: str | None = None


@dataclass(frozen=True)
class FixOptions:
    nodes: tuple[Node, ...]
    checks: frozenset[str] | None = None      # --checks; None: every check with a fix
    dry_run: bool = False
    yes: bool = False                         # --yes: the fixes that need it may run
    run_dir: Path = Path(".")                 # where the undo record goes
    local_root: bool = False                  # this process is root (no sudo -n for local)


@dataclass(frozen=True)
class UndoOptions:
    record: Path                              # the fix-undo.json to put back
    local_root: bool = False
    dry_run: bool = False


@dataclass
class FixOutcome(Outcome):
    plan: FixPlan | None
    results: list[FixResult] = field(default_factory=list)
    restart_ray: list[str] = field(default_factory=list)
    dry_run: bool = False
    undo_file: str | None = None
    stopped: str | None = None

    @property
    def exit_code(self) -> int:
        statuses = {r.status for r in self.results}
        if statuses & {"failed", "unreachable"}:
            return 2
        if statuses & {"manual", "planned", "skipped"}:
            return 1
        return 0

    def to_dict(self) -> dict[str, Any]:
        return {"command": "fix", "exit_code": self.exit_code, "dry_run": self.dry_run,
                "results": [asdict(r) for r in self.results],
                "restart_ray": self.restart_ray, "undo": self.undo_file}


class UndoRecord:
    """What each change replaced, appended as it happens and written at once to the run dir."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.entries.append(entry)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"entries": self.entries}, indent=1) + "\n")
            tmp.replace(self.path)


# ---------------------------------------------------------------- gather + plan


def _checks(chosen: frozenset[str] | None):
    if chosen is None:
        return NODE_CHECKS
    wanted = set(chosen) | ({"versions"} if "versions" in chosen else set())
    return tuple(c for c in NODE_CHECKS if c.id in wanted)


def gather_and_plan(inventory: Inventory, session: Session, nodes: Sequence[Node],
                    chosen: frozenset[str] | None, yes: bool):
    report = run_preflight(inventory, session, nodes, checks=_checks(chosen),
                           measure_clock=False, reachability=False)
    plan = plan_fixes(report.results, report.facts.nodes, inventory, chosen, yes)
    return report, plan


def _unreachable(report) -> set[str]:
    return {n for n, f in report.facts.nodes.items() if not f.reachable}


def plan_results(plan: FixPlan, report, status_of_step: str = "planned") -> list[FixResult]:
    before = {(r.node, r.check): r for r in report.results}
    down = _unreachable(report)
    out: list[FixResult] = []
    for node, check in plan.ok:
        if check in FIXABLE and node is not None:
            out.append(FixResult(node, check, "ok", before[(node, check)].summary, "ok", "ok"))
    for s in plan.steps:
        b = before.get((s.node, s.check))
        out.append(FixResult(s.node, s.check, status_of_step, s.action,
                             b.status.value if b else None, None, _shown(s), s.note))
    for m in plan.manual:
        b = before.get((m.node, m.check))
        out.append(FixResult(m.node, m.check, "manual", m.reason,
                             b.status.value if b else None, None, (), None, m.next_step))
    for k in plan.skipped:
        status = "unreachable" if k.node in down else "skipped"
        out.append(FixResult(k.node, k.check, status, k.reason))
    return out


def _shown(step: Step) -> tuple[str, ...]:
    if step.check == "model":
        return (f"model_copy.py: manifest, serve on {step.source}, fetch on {step.node}, "
                f"verify by sha256",)
    return step.commands + tuple(f"write {w.path}" for w in step.writes)


# ---------------------------------------------------------------- execute


class StepFailed(Exception):
    def __init__(self, why: str, manual: tuple[str, str] | None = None):
        super().__init__(why)
        self.why = why
        self.manual = manual


def _why(result) -> str:
    text = (result.stderr or result.stdout or result.error or "").strip()
    if _SUDO_PASSWORD in text:
        return "sudo asks for a password on this node: `cluster fix` needs passwordless " \
               "sudo (NOPASSWD) for the SSH user, or log in as root"
    last = text.splitlines()[-1] if text else f"exit {result.exit_code}"
    return last[:300]


class NodeExecutor:
    """Runs one node's steps in order as root (sudo -n when the SSH user is not root)."""

    def __init__(self, inventory: Inventory, session: Session, node: Node, undo: UndoRecord,
                 local_root: bool):
        self.inventory, self.session, self.node, self.undo = inventory, session, node, undo
        self.local_root = local_root

    def root(self, command: str, stdin: str | None = None):
        res = self.session.run(self.node, as_root(command, self.node, self.inventory,
                                                  self.local_root),
                               timeout=STEP_TIMEOUT_S, stdin=stdin)
        if not res.reached:
            raise StepFailed(f"{res.status}: {res.error}")
        return res

    def as_user(self, command: str):
        """A step command as the SSH user (Step.as_root False: it starts an interpreter a
        non-root user may change)."""
        res = self.session.run(self.node, command, timeout=STEP_TIMEOUT_S)
        if not res.reached:
            raise StepFailed(f"{res.status}: {res.error}")
        return res

    def fix_files(self, mode: str, request: dict[str, Any], count: int) -> list[dict[str, Any]]:
        """node_programs/fix_files.py MODE as root on this node (the one way a fix or an undo
        reads or changes a file: no link followed, atomic rename): its `count` answers, in the
        request's order, each {"status": "ok", ...} or why not."""
        from cluster.node_programs import document_of, program_call, run_call

        call = program_call(self.inventory.ray.root_python, "fix_files", [mode],
                            stdin=json.dumps(request),
                            wrap=lambda command: as_root(command, self.node, self.inventory,
                                                         self.local_root))
        res = run_call(self.session, self.node, call, timeout=STEP_TIMEOUT_S)
        if not res.reached:
            raise StepFailed(f"{res.status}: {res.error}")
        doc = document_of(res, "fix_files")
        answers = doc.get("ops" if mode == "apply" else "files") if isinstance(doc, dict) \
            else None
        if res.exit_code != 0 or not isinstance(answers, list) or len(answers) != count \
                or not all(isinstance(a, dict) for a in answers):
            raise StepFailed(f"fix_files {mode} failed: {_why(res)}")
        return answers

    def read(self, paths: Sequence[str]) -> list[str | None]:
        """Each file's text (None: absent), read as root through fix_files."""
        answers = self.fix_files("read", {"files": list(paths)}, len(paths))
        for path, a in zip(paths, answers):
            if a.get("status") != "ok" or not isinstance(a.get("text"), (str, type(None))):
                raise StepFailed(f"cannot read {path}: {a.get('why') or 'no text in the answer'}")
        return [a["text"] for a in answers]

    def write(self, step: Step) -> None:
        """The step's files whose text changes, each recorded (undo) before fix_files writes
        it; a converged file is left alone."""
        ops = []
        for w, current in zip(step.writes, self.read([w.path for w in step.writes])):
            new = w.new_text(current)
            if new != current:
                self.undo.add({"node": self.node.name, "check": step.check, "kind": "file",
                               "path": w.path, "before": current})
                ops.append({"op": "write", "path": w.path, "text": new})
        if not ops:
            return
        for op, a in zip(ops, self.fix_files("apply", {"ops": ops}, len(ops))):
            if a.get("status") != "ok":
                raise StepFailed(f"cannot write {op['path']}: {a.get('why')}")

    def record_mount(self, step: Step, target: str) -> None:
        # Mounts stacked on one point are listed oldest first: the last is the visible one.
        res = self.root(f"findmnt -no OPTIONS {quote(target)}")
        lines = res.stdout.strip().splitlines() if res.exit_code == 0 else []
        if lines:
            self.undo.add({"node": self.node.name, "check": step.check, "kind": "mount",
                           "target": target, "options": lines[-1].strip()})

    def apply(self, step: Step) -> None:
        check = self.root("true")
        if check.exit_code != 0:
            raise StepFailed(_why(check))
        for target in step.remounts:
            self.record_mount(step, target)
        for command in step.commands:
            res = self.root(command) if step.as_root else self.as_user(command)
            if res.exit_code != 0:
                if step.manual_exit and res.exit_code == step.manual_exit[0]:
                    raise StepFailed(step.manual_exit[1], (step.manual_exit[1],
                                                           step.manual_exit[2]))
                raise StepFailed(f"`{command}` failed: {_why(res)}")
        if step.writes:
            self.write(step)


def execute(inventory: Inventory, session: Session, plan: FixPlan, undo: UndoRecord,
            local_root: bool) -> dict[tuple[str, str], StepFailed | None]:
    """Each node's steps in order, nodes in parallel: (node, check) -> None (done) or why not."""
    by_name = {n.name: n for n in inventory.nodes}
    nodes = [by_name[name] for name in plan.nodes]

    def work(node: Node) -> dict[tuple[str, str], StepFailed | None]:
        runner = NodeExecutor(inventory, session, node, undo, local_root)
        done: dict[tuple[str, str], StepFailed | None] = {}
        for step in (s for s in plan.steps if s.node == node.name):
            try:
                runner.apply(step)
                done[(node.name, step.check)] = None
            except StepFailed as exc:
                done[(node.name, step.check)] = exc
        return done

    def late(node: Node):
        return {(node.name, s.check): StepFailed("no answer within the deadline")
                for s in plan.steps if s.node == node.name}

    deadline = STEP_TIMEOUT_S * (2 + 3 * max((sum(1 for s in plan.steps if s.node == n.name)
                                              for n in nodes), default=1))
    per_node = parallel(nodes, work, deadline, late, session.max_parallel)
    out: dict[tuple[str, str], StepFailed | None] = {}
    for d in per_node.values():
        out.update(d)
    return out


# ---------------------------------------------------------------- verify


def verify(inventory: Inventory, session: Session, plan: FixPlan,
           done: dict[tuple[str, str], StepFailed | None], report) -> list[FixResult]:
    before = {(r.node, r.check): r for r in report.results}
    touched = sorted({n for (n, _), why in done.items() if why is None})
    by_name = {n.name: n for n in inventory.nodes}
    after: dict[tuple[str | None, str], Any] = {}
    if touched:
        checks = {s.check for s in plan.steps}
        again = run_preflight(inventory, session, [by_name[n] for n in touched],
                              checks=_checks(frozenset(checks)), measure_clock=False,
                              reachability=False)
        after = {(r.node, r.check): r for r in again.results}
        if "versions" in checks:
            for r in again.results:
                if r.node and r.check.endswith("-match"):
                    prev = after.get((r.node, "versions"))
                    if prev is None or r.status.severity > prev.status.severity:
                        after[(r.node, "versions")] = r
    out: list[FixResult] = []
    for s in plan.steps:
        key = (s.node, s.check)
        b = before.get(key)
        was = b.status.value if b else None
        why = done.get(key, StepFailed("not run"))
        if why is not None:
            if why.manual:
                out.append(FixResult(s.node, s.check, "manual", why.manual[0], was, was,
                                     _shown(s), s.note, why.manual[1]))
            else:
                out.append(FixResult(s.node, s.check, "failed", why.why, was, was, _shown(s),
                                     s.note))
            continue
        a = after.get(key)
        now = a.status.value if a else None
        if a is not None and a.status in (Status.OK, Status.SKIP):
            out.append(FixResult(s.node, s.check, "changed", f"{s.action}: {a.summary}", was,
                                 now, _shown(s), s.note))
        else:
            out.append(FixResult(s.node, s.check, "failed",
                                 f"still failing after the fix: "
                                 f"{a.summary if a else 'not re-checked'}", was, now,
                                 _shown(s), s.note))
    return out


def _model_results(inventory: Inventory, session: Session, plan: FixPlan, report,
                   undo: UndoRecord, local_root: bool, on_event) -> list[FixResult]:
    """The model steps (playbooks/fix_model.py), verified there by a second manifest."""
    steps = [s for s in plan.steps if s.check == "model"]
    if not steps:
        return []
    before = {(r.node, r.check): r for r in report.results}
    by_node = {s.node: s for s in steps}
    out = []
    for o in copy_models(inventory, session, steps, undo, local_root, on_event):
        s = by_node[o.node]
        b = before.get((s.node, "model-match")) or before.get((s.node, "model"))
        out.append(FixResult(s.node, "model", o.status, o.summary, b.status.value if b else None,
                             o.after, _shown(s), s.note))
    return out


# ---------------------------------------------------------------- the playbook


def run(inventory: Inventory, session: Session, options: FixOptions, confirm: Confirm,
        on_event: OnEvent = ignore) -> FixOutcome:
    nodes, chosen, dry_run = options.nodes, options.checks, options.dry_run
    local_root, say = options.local_root, lines_to(on_event)
    if chosen is not None:
        known = {c.id for c in NODE_CHECKS}
        unknown = sorted(set(chosen) - known)
        if unknown:
            raise UsageError(f"--checks: unknown check(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(known))})")
    say(f"gathering facts on {len(nodes)} node(s)")
    report, plan = gather_and_plan(inventory, session, nodes, chosen, options.yes)
    outcome = FixOutcome(plan, dry_run=dry_run)
    planned = plan_results(plan, report)
    if dry_run or not plan.steps:
        outcome.results = planned
        return outcome
    nodes_n = len(plan.nodes)
    if not confirm(f"Apply {len(plan.steps)} fix(es) on {nodes_n} node(s)?"):
        outcome.results = [r if r.status != "planned" else
                           FixResult(r.node, r.check, "skipped", "not confirmed", r.before)
                           for r in planned]
        return outcome
    undo = UndoRecord(options.run_dir / UNDO_FILE)
    undo.add({"kind": "start", "nodes": plan.nodes})
    outcome.undo_file = str(undo.path)
    say(f"applying {len(plan.steps)} fix(es) on {nodes_n} node(s)")
    rest = dataclasses.replace(plan, steps=tuple(s for s in plan.steps if s.check != "model"))
    done = execute(inventory, session, rest, undo, local_root) if rest.steps else {}
    copied = _model_results(inventory, session, plan, report, undo, local_root, say)
    say("verifying")
    verified = verify(inventory, session, rest, done, report) + copied
    outcome.results = [r for r in planned if r.status != "planned"] + verified
    outcome.restart_ray = ray_restarts(plan.steps, verified)
    return outcome


def ray_restarts(steps: Sequence[Step], results: Sequence[FixResult]) -> list[str]:
    """The nodes where a changed step needs Ray restarted to take hold (Step.restarts_ray)."""
    changed = {(r.node, r.check) for r in results if r.status == "changed"}
    return sorted({s.node for s in steps if s.restarts_ray and (s.node, s.check) in changed})


# ---------------------------------------------------------------- undo


def undo(inventory: Inventory, session: Session, options: UndoOptions, confirm: Confirm,
         on_event: OnEvent = ignore) -> FixOutcome:
    """Put back the files and mounts a fix run changed, newest first.

    The record is read strictly (cluster/remedy/fix_undo.py: only the files and mount points the
    fixes own; anything else refuses it whole, UsageError) and every path is checked on its
    node, no link followed (node_programs/fix_files.py), before anything changes on any node:
    a link anywhere refuses the whole undo. With `dry_run` it stops there and lists, per node,
    every file it would write or remove and every mount it would restore; otherwise it asks
    (confirm) and changes nothing unless the answer is yes."""
    from cluster.remedy.fix_undo import read_record

    record, local_root, dry_run = options.record, options.local_root, options.dry_run
    plan = read_record(record)
    by_name = {n.name: n for n in inventory.nodes}
    outcome = FixOutcome(None, dry_run=dry_run)
    nodes = [by_name[n] for n in plan.nodes if n in by_name]
    for name in (n for n in plan.nodes if n not in by_name):
        outcome.results.append(FixResult(name, "undo", "skipped",
                                         f"{name} is not in the inventory"))
    checked = _check_paths(inventory, session, plan, nodes)
    refused = [(n, why) for n, why in checked.items() if why and not why.startswith("no answer")]
    if refused:
        node, why = refused[0]
        raise UsageError(f"--undo {record}: refused: on {node}: {why} (undo never writes "
                         f"through a link); nothing was changed on any node")
    reachable = [n for n in nodes if checked.get(n.name) is None]
    for n in nodes:
        if checked.get(n.name) is not None:
            outcome.results.append(FixResult(n.name, "undo", "unreachable", checked[n.name]))
    if dry_run:
        outcome.results += _undo_preview(plan, {n.name for n in reachable})
    elif not confirm(f"Restore what {record.parent.name} changed?"):
        outcome.stopped = "not confirmed"
        outcome.results += [FixResult(r.node, r.check, "skipped", "not confirmed")
                            for r in _undo_preview(plan, {n.name for n in reachable})]
    else:
        lines_to(on_event)(f"restoring on {len(reachable)} node(s)")
        work = parallel(reachable, lambda n: _undo_node(inventory, session, n, plan, local_root),
                        STEP_TIMEOUT_S * (2 + len(plan.mounts)) + 30,
                        lambda n: [FixResult(n.name, "undo", "failed",
                                             "no answer within the deadline")],
                        session.max_parallel)
        for n in reachable:
            outcome.results += work[n.name]
        outcome.results.append(FixResult(None, "undo", "ok", "modules loaded, services enabled "
                                                             "and clock steps are not undone"))
    for m in plan.models:
        outcome.results.append(FixResult(m.node, "model", "skipped",
                                         f"{m.count} model file(s) copied into {m.dir} are not "
                                         f"restored (undo does not restore model files; the "
                                         f"record lists them)"))
    return outcome


def _check_paths(inventory: Inventory, session: Session, plan, nodes: Sequence[Node]
                 ) -> dict[str, str | None]:
    """Per node: None (every path it names is a regular file, a directory for mounts, or
    absent, with no link on the way), else why not (read-only, as the SSH user)."""
    from cluster.base.errors import ProgramError
    from cluster.node_programs import run_program

    def check(node: Node) -> str | None:
        files = [f.path for f in plan.files if f.node == node.name]
        dirs = [m.target for m in plan.mounts if m.node == node.name]
        try:
            doc = run_program(session, node, "fix_files", ["check"], timeout=STEP_TIMEOUT_S,
                              stdin=json.dumps({"files": files, "dirs": dirs}))
        except ProgramError as exc:
            return f"no answer from the path check: {exc}" if not exc.reached else \
                f"the path check failed: {exc}"
        answers = list(doc.get("files") or []) + list(doc.get("dirs") or [])
        if len(answers) != len(files) + len(dirs):
            return "the path check answered for other paths than asked"
        for path, a in zip(files + dirs, answers):
            if not isinstance(a, dict) or a.get("status") != "ok":
                return str(a.get("why") if isinstance(a, dict) else a) or path
        return None

    return parallel(nodes, check, STEP_TIMEOUT_S + 30,
                    lambda n: "no answer within the deadline", session.max_parallel)


def _file_action(f) -> tuple[str, str]:
    if f.before is None:
        return f"remove {f.path}", f"remove {f.path} (it did not exist before the fix)"
    return f"write {f.path}", f"write {f.path} back ({len(f.before.encode())} bytes)"


def _undo_preview(plan, nodes: set[str]) -> list[FixResult]:
    out = []
    for f in plan.files:
        if f.node in nodes:
            command, summary = _file_action(f)
            out.append(FixResult(f.node, f.check, "planned", summary, commands=(command,)))
    for m in plan.mounts:
        if m.node in nodes:
            out.append(FixResult(m.node, m.check, "planned",
                                 f"remount {m.target} with size={m.size}",
                                 commands=(_remount(m),)))
    return out


def _remount(m) -> str:
    return f"mount -o remount,size={quote(m.size)} {quote(m.target)}"


def _undo_node(inventory: Inventory, session: Session, node: Node, plan, local_root: bool
               ) -> list[FixResult]:
    """One node's restores as root: its files through fix_files.py (no link followed), then
    its mounts."""
    files = [f for f in plan.files if f.node == node.name]
    out: list[FixResult] = []
    runner = NodeExecutor(inventory, session, node, UndoRecord(Path("/dev/null")), local_root)
    if files:
        ops = [{"op": "remove", "path": f.path} if f.before is None else
               {"op": "write", "path": f.path, "text": f.before} for f in files]
        try:
            answers = runner.fix_files("apply", {"ops": ops}, len(ops))
        except StepFailed as exc:
            answers = [{"status": "failed", "why": exc.why}] * len(files)
        for f, a in zip(files, answers):
            if a.get("status") == "ok":
                out.append(FixResult(node.name, f.check, "changed",
                                     f"removed {f.path} (it did not exist before)"
                                     if f.before is None else f"restored {f.path}"))
            else:
                out.append(FixResult(node.name, f.check, "failed",
                                     f"cannot restore {f.path}: {a.get('why')}"))
    for m in (m for m in plan.mounts if m.node == node.name):
        try:
            res = runner.root(_remount(m))
            status, summary = ("changed", f"remounted {m.target} with size={m.size}") \
                if res.exit_code == 0 else ("failed", f"cannot remount {m.target}: {_why(res)}")
        except StepFailed as exc:
            status, summary = "failed", exc.why
        out.append(FixResult(node.name, m.check, status, summary))
    return out
