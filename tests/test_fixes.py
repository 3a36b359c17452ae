"""`cluster fix` planning (pure: results + facts -> steps) and the executor's undo record, run
for real on this machine against files under a temporary directory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from cluster.remedy import fixes
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.base.errors import UsageError
from cluster.remedy.fixes import FileWrite, Step, as_root, fstab_with_shm, plan_fixes
from cluster.node_programs import source
from cluster.nodes.inventory import loads
from cluster.nodes.remote import Session
from cluster.base.results import CheckResult, Status
from playbooks import fix as fix_playbook
from fakes import FakeRunner, cluster_main, write_inventory

INV = loads("""
nodes:
  - {name: n1, address: 10.0.0.1, role: head}
  - {name: n2, address: 10.0.0.2, user: admin}
""")


def result(check: str, status: Status = Status.FAIL, node: str | None = "n2",
           summary: str = "bad", fix: str | None = "look at it") -> CheckResult:
    return CheckResult(check, node, status, summary, None, fix)


def plan(results, facts=None, chosen=None, yes=False):
    typed = {n: NodeFactsSummary.from_dict(f) for n, f in (facts or {}).items()}
    return plan_fixes(results, typed, INV, chosen, yes)


def test_a_converged_node_plans_nothing():
    ok = [result(c, Status.OK) for c in ("gpudirect", "clock", "shm", "memlock", "persistence",
                                         "fabricmanager", "infiniband")]
    p = plan(ok)
    assert p.steps == () and p.manual == () and len(p.ok) == len(ok)


def test_gpudirect_loads_the_module_and_persists_it():
    (step,) = plan([result("gpudirect")], {"n2": {"peermem_loaded": False}}).steps
    assert step.commands == ("modprobe nvidia_peermem 2>/dev/null || modprobe nv_peer_mem",)
    (write,) = step.writes
    assert write.path == "/etc/modules-load.d/cluster-peermem.conf"
    once = write.new_text(None)
    assert once == "nvidia_peermem\n" and write.new_text(once) == once      # idempotent
    assert write.new_text("ib_umad\n") == "ib_umad\nnvidia_peermem\n"


def test_a_loaded_but_unregistered_module_is_manual():
    p = plan([result("gpudirect")], {"n2": {"peermem_loaded": True}})
    assert p.steps == () and p.manual[0].check == "gpudirect" and "OFED" in p.manual[0].next_step


def test_clock_step_on_a_node_running_ray_needs_yes():
    facts = {"n2": {"clock_source": "chronyc tracking", "ray_running": True}}
    assert plan([result("clock")], facts).steps == ()
    assert "--yes" in plan([result("clock")], facts).skipped[0].reason
    (step,) = plan([result("clock")], facts, yes=True).steps
    assert step.commands[-1] == "chronyc makestep" and step.note
    (step,) = plan([result("clock")], {"n2": {"clock_source": "timedatectl"}}).steps
    assert step.commands == ("timedatectl set-ntp true", "systemctl restart systemd-timesyncd")


def test_shm_remounts_at_the_expected_size_and_edits_fstab_idempotently():
    (step,) = plan([result("shm")]).steps
    size = INV.expectations["shm_min_bytes"]
    assert f"mount -o remount,size={size} /dev/shm" in step.commands[0]
    assert step.remounts == ("/dev/shm",) and step.manual_exit[0] == fixes.IN_CONTAINER_EXIT
    fstab = "UUID=1 / ext4 defaults 0 1\ntmpfs /dev/shm tmpfs defaults,size=64m 0 0\n"
    once = fstab_with_shm(fstab, size)
    assert once.count("/dev/shm") == 1 and f"size={size}" in once and "UUID=1" in once
    assert fstab_with_shm(once, size) == once
    assert "# tmpfs /dev/shm" in fstab_with_shm("# tmpfs /dev/shm x\n", size)   # comments kept


def test_memlock_writes_limits_and_names_a_ray_restart():
    (step,) = plan([result("memlock")], {"n2": {"ray_running": True}}).steps
    assert [w.path for w in step.writes] == [fixes.LIMITS_FILE, fixes.SYSTEMD_LIMITS_FILE]
    assert "memlock unlimited" in step.writes[0].content and "restart" in step.note.lower()


def test_everything_else_is_manual_with_the_checks_own_next_step():
    p = plan([result("infiniband", summary="mlx5_5 port 1 is Down",
                     fix="check cables/switch ports and the subnet manager"),
              result("gpus", summary="7 of 8 GPUs")])
    assert [(m.check, m.next_step) for m in p.manual] == [
        ("infiniband", "check cables/switch ports and the subnet manager"),
        ("gpus", "look at it")]


def test_versions_only_when_named():
    results = [result("ray-match", node="n2", summary="ray 2.59.0 differs from 2.60.0")]
    facts = {"n1": {"versions": {"ray": "2.60.0", "vllm": "0.32.0"}},
             "n2": {"versions": {"ray": "2.59.0", "vllm": "0.32.0"}}}
    p = plan(results, facts)
    assert p.steps == () and "--checks versions" in p.skipped[0].reason
    (step,) = plan(results, facts, chosen=frozenset({"versions"})).steps
    (command,) = step.commands
    assert "python3 -m pip install --no-input 'ray[serve]==2.60.0'" in command
    assert step.as_root is False           # pip of the Ray user's interpreter: never as root


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("sudo"), reason="needs root and sudo")
def test_the_versions_step_runs_pip_as_the_interpreters_owner_never_root(tmp_path):
    """Issue 39 item 2: `cluster fix --checks versions` ran `ray.python -m pip install` through
    sudo, so a .pth in the Ray user's virtualenv ran as root. The step now runs as the owner of
    the interpreter's directory (here uid 65534 while the SSH user is root)."""
    from cluster.remedy.fixes import as_interpreter_owner

    top = Path(tempfile.mkdtemp(prefix="cluster-owner-"))     # pytest's tmp is 0700: the
    try:                                                       # owner could not reach it
        top.chmod(0o755)
        venv_bin = top / "venv" / "bin"
        venv_bin.mkdir(parents=True, mode=0o755)
        python = venv_bin / "python"
        python.write_text("#!/bin/sh\nid -u\n")
        python.chmod(0o755)
        os.chown(venv_bin, 65534, 65534)
        command = as_interpreter_owner(str(python), f"{python} -m pip install x")
        p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60,
                           cwd="/")
    finally:
        shutil.rmtree(top)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["65534"]


def test_checks_filter_and_unreachable_nodes():
    p = plan([result("shm"), result("memlock")], chosen=frozenset({"shm"}))
    assert [s.check for s in p.steps] == ["shm"]
    p = plan([result("shm", Status.ERROR, summary="unreachable: n2: no route")])
    assert p.steps == () and p.skipped[0].reason.startswith("unreachable")


def test_a_non_root_user_goes_through_sudo_without_a_password():
    n1, n2 = INV.nodes
    assert as_root("modprobe x", n2, INV, local_root=True) == "sudo -n bash -c 'modprobe x'"
    assert as_root("modprobe x", n1, INV, local_root=True) == "modprobe x"
    assert as_root("modprobe x", n1, INV, local_root=False).startswith("sudo -n")


def test_a_sudo_password_prompt_is_named_as_the_reason():
    class R:
        stderr, stdout, error, exit_code = "sudo: a password is required\n", "", None, 1
    assert "passwordless sudo" in fix_playbook._why(R())


def test_the_executor_records_what_it_replaces_and_undo_puts_it_back(tmp_path):
    inv = loads("nodes:\n  - {name: here, address: 127.0.0.1, local: true}\n")
    existing, created = tmp_path / "a.conf", tmp_path / "sub" / "b.conf"
    existing.write_text("old\n")
    step = Step("here", "memlock", "test", ("true",),
                (FileWrite(str(existing), "new\n"), FileWrite(str(created), "made\n")))
    undo = fix_playbook.UndoRecord(tmp_path / "fix-undo.json")
    with Session(inv) as session:
        runner = fix_playbook.NodeExecutor(inv, session, inv.nodes[0], undo, local_root=True)
        runner.apply(step)
        runner.apply(step)                                   # converged: writes nothing new
        assert existing.read_text() == "new\n" and created.read_text() == "made\n"
        entries = json.loads(undo.path.read_text())["entries"]
        assert [(e["path"], e["before"]) for e in entries] == [(str(existing), "old\n"),
                                                               (str(created), None)]
        # Undo restores only the files the fixes own (cluster/remedy/fixes.py): these test files are
        # not, so the record is refused whole and nothing is put back (the restore itself is
        # tests/integration/test_fix.py's, on a simulated node's /etc).
        with pytest.raises(UsageError, match="is not a file the memlock fix writes"):
            fix_playbook.undo(inv, session, fix_playbook.UndoOptions(undo.path, local_root=True),
                              lambda q: True)
    assert existing.read_text() == "new\n" and created.read_text() == "made\n"


def test_a_failing_command_fails_the_step_with_its_message(tmp_path):
    inv = loads("nodes:\n  - {name: here, address: 127.0.0.1, local: true}\n")
    undo = fix_playbook.UndoRecord(tmp_path / "u.json")
    with Session(inv) as session:
        runner = fix_playbook.NodeExecutor(inv, session, inv.nodes[0], undo, local_root=True)
        with pytest.raises(fix_playbook.StepFailed, match="no such module"):
            runner.apply(Step("here", "gpudirect", "t", ("echo no such module >&2; exit 1",)))
        with pytest.raises(fix_playbook.StepFailed) as exc:
            runner.apply(Step("here", "shm", "t", ("exit 42",),
                              manual_exit=(42, "a container", "use --shm-size")))
        assert exc.value.manual == ("a container", "use --shm-size")


def _paths_ok(sent):
    """A FakeRunner's respond for `cluster fix --undo`: the read-only path check says every
    path is a plain file; any other command (a restore) is answered ok."""
    doc = {"files": [{"status": "ok"}], "dirs": []} if "check" in sent.command else {"ops": []}
    return json.dumps(doc) + "\n"


def test_undo_answered_no_at_the_terminal_restores_nothing(tmp_path, monkeypatch, capsys):
    """The old CLI asked "Restore what ... changed?" and went on whatever the answer was."""
    from cluster.remedy.fixes import LIMITS_FILE

    inv = write_inventory(tmp_path, f"run_dir: {tmp_path}/runs\n"
                                    "nodes:\n  - {name: n1, address: 198.18.70.9}\n")
    run = tmp_path / "runs" / "fix-1"
    run.mkdir(parents=True)
    (run / "fix-undo.json").write_text(json.dumps({"entries": [
        {"kind": "start", "nodes": ["n1"]},
        {"node": "n1", "check": "memlock", "kind": "file", "path": LIMITS_FILE,
         "before": "x\n"}]}))
    nodes = FakeRunner(respond=_paths_ok)     # behind the CLI's own Session: its SSH runner
    monkeypatch.setattr("cluster.nodes.remote.SSHRunner", lambda ssh: nodes)
    monkeypatch.setattr("cluster.commands._common.interactive", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    code, out, err = cluster_main(capsys, "-i", str(inv), "fix", "--undo", str(run), "--json")
    calls = nodes.commands()
    assert len(calls) == 1 and "check" in calls[0], calls      # the path check, no restore
    doc = json.loads(out)
    assert [(r["node"], r["status"], r["summary"]) for r in doc["results"]] == [
        ("n1", "skipped", "not confirmed")]
    assert code == 1


# A write into a file by the shell: `>`/`>>` not to /dev/null or a descriptor, or a command
# that copies, moves or links a file into place.
_SHELL_WRITE = re.compile(r"(?<![<>0-9&])>>?\s*(?!&|/dev/null\b)\S|[0-9]>>?\s*(?!&|/dev/null\b)"
                          r"[^\s&]|(?:^|[;&|({]\s*|\s)(?:mv|cp|tee|dd|ln|install|truncate)\s"
                          r"|sed\s+-i")


class _FixFilesNode:
    """A FakeRunner's respond for a fix run: answers the fix_files program
    (cluster/node_programs/fix_files.py) as a node where none of the files exists yet and every
    write succeeds, and any other command with exit 0; keeps each fix_files request."""

    def __init__(self):
        self.fix_files: list[tuple[str, str, dict]] = []      # (node, mode, request)
        self._program = json.dumps(source("fix_files")) + "\n"

    def __call__(self, sent):
        if not (sent.stdin or "").startswith(self._program):
            return None
        mode = shlex.split(shlex.split(sent.command)[-1])[-1]       # sudo -n bash -c '... MODE'
        request = json.loads(sent.stdin[len(self._program):])
        self.fix_files.append((sent.node, mode, request))
        answers = [{"status": "ok", "text": None} for _ in request.get("files", [])] \
            if mode == "read" else [{"status": "ok"} for _ in request.get("ops", [])]
        key = "ops" if mode == "apply" else "files"
        return json.dumps({key: answers}) + "\n"


def test_a_full_fix_plan_writes_node_files_only_through_fix_files(tmp_path):
    """Issue 43 item 2: `cluster fix` built `cat > tmp; mv -f tmp path || cat tmp > path` on the
    laptop while undo used fix_files.py (no link followed, atomic rename). Every fixer's step is
    executed here against a session that records each command: no command but the fix_files
    program's writes a file, and every file the plan writes reaches it with its new text."""
    fixers = ("gpudirect", "clock", "shm", "memlock", "persistence", "fabricmanager")
    facts = {"n2": {"peermem_loaded": False, "clock_source": "chronyc tracking",
                    "ray_running": True}}
    fix_plan = plan([result(c, summary="not running") for c in fixers], facts, yes=True)
    assert sorted(s.check for s in fix_plan.steps) == sorted(fixers)
    node = _FixFilesNode()
    nodes = FakeRunner(respond=node)
    undo = fix_playbook.UndoRecord(tmp_path / "fix-undo.json")
    done = fix_playbook.execute(INV, nodes.session(INV), fix_plan, undo, local_root=False)
    assert done == {("n2", c): None for c in fixers}
    writers = [(cmd, why.group(0)) for cmd in nodes.commands()
               if (why := _SHELL_WRITE.search(cmd))]
    assert writers == []
    written = {op["path"]: op["text"] for _, mode, req in node.fix_files if mode == "apply"
               for op in req["ops"]}
    wanted = {w.path: w.new_text(None) for s in fix_plan.steps for w in s.writes}
    assert written == wanted and len(wanted) == 4
    read = [p for _, mode, req in node.fix_files if mode == "read" for p in req["files"]]
    assert sorted(read) == sorted(wanted)
    before = [e["path"] for e in json.loads(undo.path.read_text())["entries"]]
    assert sorted(before) == sorted(wanted)


def test_the_shell_write_pattern_sees_the_old_executors_write():
    old = ("mkdir -p /etc && cat > /etc/x.tmp && chmod 644 /etc/x.tmp && "
           "{ mv -f /etc/x.tmp /etc/x 2>/dev/null || { cat /etc/x.tmp > /etc/x; }; }")
    assert _SHELL_WRITE.search(old)
    assert _SHELL_WRITE.search("echo x >>/etc/x") and _SHELL_WRITE.search("echo x | tee /etc/x")
    for harmless in ("modprobe a 2>/dev/null || modprobe b", "command -v x >/dev/null",
                     "echo bad >&2; exit 1", "if [ 1 -gt 0 ]; then true; fi"):
        assert not _SHELL_WRITE.search(harmless), harmless


def test_whether_ray_must_restart_is_the_steps_typed_field_not_its_note():
    (memlock,) = plan([result("memlock")], {"n2": {"ray_running": True}}).steps
    assert memlock.restarts_ray is True
    (idle,) = plan([result("memlock")], {"n2": {"ray_running": False}}).steps
    assert idle.restarts_ray is False
    (clock,) = plan([result("clock")], {"n2": {"ray_running": True}}, yes=True).steps
    assert "Ray" in clock.note and clock.restarts_ray is False
    quiet = dataclasses.replace(memlock, note=None)
    changed = [fix_playbook.FixResult("n2", s.check, "changed", "done")
               for s in (quiet, clock)]
    assert fix_playbook.ray_restarts((quiet, clock), changed) == ["n2"]
    assert fix_playbook.ray_restarts((quiet,), [dataclasses.replace(changed[0],
                                                                   status="failed")]) == []


def test_fix_files_reads_a_file_but_never_through_a_link(tmp_path):
    """The executor reads what it replaces through fix_files.py too (it was `cat` as root)."""
    inv = loads("nodes:\n  - {name: here, address: 127.0.0.1, local: true}\n")
    plain, target = tmp_path / "plain.conf", tmp_path / "target.conf"
    plain.write_text("kept\n")
    target.write_text("secret\n")
    (tmp_path / "link.conf").symlink_to(target)
    undo = fix_playbook.UndoRecord(tmp_path / "u.json")
    with Session(inv) as session:
        runner = fix_playbook.NodeExecutor(inv, session, inv.nodes[0], undo, local_root=True)
        assert runner.read([str(plain), str(tmp_path / "absent.conf")]) == ["kept\n", None]
        with pytest.raises(fix_playbook.StepFailed, match="symbolic link"):
            runner.read([str(tmp_path / "link.conf")])
        with pytest.raises(fix_playbook.StepFailed, match="symbolic link"):
            runner.apply(Step("here", "memlock", "t", (),
                              (FileWrite(str(tmp_path / "link.conf"), "new\n"),)))
    assert target.read_text() == "secret\n" and (tmp_path / "link.conf").is_symlink()
