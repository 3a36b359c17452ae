"""A headless rank's command as the rank actor's child (serve_apps/gang.py HeadlessChild, issue 40
item 3), with a stand-in for `vllm serve --headless` that starts one process titled as vLLM
titles its workers: the rank is dead when that process or the command exits (saying which and
the command's last output line), stop leaves no process of it, and a SIGKILLed actor takes its
command with it (PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from serve_apps.gang import HeadlessChild, process_title

FAKE_VLLM = textwrap.dedent("""
    import subprocess, sys, time
    print("fake vllm", *sys.argv[1:], flush=True)
    worker = subprocess.Popen(["bash", "-c", "exec -a VLLM::Worker_PP1 sleep 300"])
    print("worker", worker.pid, flush=True)
    if "--exit" in sys.argv:
        print("RuntimeError: the last line", flush=True)
        sys.exit(3)
    worker.wait()
    time.sleep(300)
""")


def _eventually(check, what: str, within_s: float = 30.0):
    """Poll check() until it returns a true value (bounded); the value."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"not within {within_s} s: {what}")


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "vllm"
    path.write_text(FAKE_VLLM)
    return [sys.executable, str(path), "serve", "/m", "--headless"]


@pytest.fixture
def started(fake, tmp_path):
    out = os.open(tmp_path / "actor.log", os.O_WRONLY | os.O_CREAT, 0o600)
    child = HeadlessChild(fake, "vllm serve --headless (node rank 1)", out_fd=out)
    child.start()
    yield child
    child.stop(grace_s=1)
    os.close(out)


def test_the_rank_runs_while_its_vllm_process_lives_and_is_dead_when_it_exits(started, tmp_path):
    (worker,) = _eventually(started.worker_pids, "the worker titled VLLM::")
    assert process_title(worker).startswith("VLLM::Worker_PP1")
    assert started.problem() is None
    os.kill(worker, signal.SIGKILL)
    why = _eventually(started.problem, "the dead worker noticed")
    assert why == f"vllm serve --headless (node rank 1): vLLM process VLLM::Worker_PP1 (pid {worker}) exited"
    assert started.pid not in started.worker_pids()
    log = _eventually(lambda: (tmp_path / "actor.log").read_text(), "the output relayed")
    assert "fake vllm serve /m --headless" in log


def test_stop_leaves_no_process_of_the_command(started):
    (worker,) = _eventually(started.worker_pids, "the worker titled VLLM::")
    command = started.pid
    assert started.stop(grace_s=1) == [worker]
    _eventually(lambda: process_title(worker) is None and process_title(command) is None,
                "the command and its worker gone")


def test_a_command_that_exits_is_dead_with_its_code_and_last_line(fake, tmp_path):
    out = os.open(tmp_path / "actor.log", os.O_WRONLY | os.O_CREAT, 0o600)
    child = HeadlessChild(fake + ["--exit"], "vllm serve --headless (node rank 1)", out_fd=out)
    try:
        child.start()
        why = _eventually(child.problem, "the exit noticed")
        assert why.startswith("vllm serve --headless (node rank 1) exited with 3: ")
        _eventually(lambda: child.problem().endswith("RuntimeError: the last line"),
                    "the last line kept")
    finally:
        child.stop(grace_s=1)
        os.close(out)


def test_a_command_that_cannot_start_says_so():
    child = HeadlessChild(["/nonexistent/vllm", "serve"], "rank 1")
    with pytest.raises(OSError, match="could not start /nonexistent/vllm"):
        child.start()


def test_a_killed_actor_takes_its_command_with_it(fake):
    """The actor process is SIGKILLed (ray.kill, OOM): its command gets SIGKILL too."""
    actor = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from serve_apps.gang import HeadlessChild
        child = HeadlessChild({fake!r}, "rank 1")
        child.start()
        print(child.pid, flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    seen = []
    try:
        while not any(line.startswith("worker ") for line in seen):
            seen.append(actor.stdout.readline())     # its pid, the command's relayed lines
        command = int(seen[0])
        assert process_title(command) is not None
    finally:
        actor.kill()
        actor.wait()
    _eventually(lambda: process_title(command) is None, "the command gone with its actor")
    # the stand-in's worker has no vLLM death pipe to follow its parent: end it here
    os.kill(int(next(line for line in seen if line.startswith("worker ")).split()[1]),
            signal.SIGKILL)


def test_the_launchers_direct_children_die_with_it_and_their_own_forks_do_not():
    """serve_apps.vllm_cli ties what it forks (vLLM's workers) to itself: a SIGKILLed command
    leaves no worker, whatever vLLM's own shutdown does; a worker's own forks are left alone."""
    script = textwrap.dedent("""
        import os, time
        from serve_apps.vllm_cli import tie_forks_to_this_process
        tie_forks_to_this_process()
        child = os.fork()
        if child == 0:
            grandchild = os.fork()
            if grandchild == 0:
                time.sleep(300)
                os._exit(0)
            print(os.getpid(), grandchild, flush=True)
            time.sleep(300)
            os._exit(0)
        time.sleep(300)
    """)
    command = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        child, grandchild = map(int, command.stdout.readline().split())
    finally:
        command.kill()
        command.wait()
    try:
        _eventually(lambda: process_title(child) is None, "the command's child gone with it")
        assert process_title(grandchild) is not None
    finally:
        for pid in (child, grandchild):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _launcher_like(body: str) -> subprocess.Popen:
    """A process that sets itself up as serve_apps.vllm_cli does, then runs `body` (it prints
    the pid of what it started)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import atexit, os, subprocess, sys, time
        from serve_apps.vllm_cli import kill_descendants, watch_parent
        watch_parent(os.getppid(), period_s=0.05)
        atexit.register(kill_descendants)
        worker = subprocess.Popen(["sleep", "300"])     # spawned: no fork hook reaches it
        print(os.getpid(), worker.pid, flush=True)
    """) + textwrap.dedent(body)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_the_launcher_ends_its_workers_when_its_actor_is_gone():
    """The actor is SIGKILLed and the command outlives it (PDEATHSIG is SIGTERM, vLLM may be
    slow to act on it): the command's watch sees its parent change and SIGKILLs its workers."""
    actor = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, subprocess, sys, textwrap, time
        command = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=os.environ)
        time.sleep(300)
    """), textwrap.dedent("""
        import os, signal, subprocess, time
        from serve_apps.vllm_cli import watch_parent
        signal.signal(signal.SIGTERM, signal.SIG_IGN)          # a command slow to stop
        watch_parent(os.getppid(), period_s=0.05)
        worker = subprocess.Popen(["sleep", "300"])
        print(os.getpid(), worker.pid, flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        command, worker = map(int, actor.stdout.readline().split())
    finally:
        actor.kill()
        actor.wait()
    try:
        _eventually(lambda: process_title(worker) is None and process_title(command) is None,
                    "the command and its worker gone after the actor")
    finally:
        for pid in (command, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_launcher_ends_its_workers_when_it_exits():
    command = _launcher_like("sys.exit(0)\n")
    _, worker = map(int, command.stdout.readline().split())
    command.wait()
    try:
        _eventually(lambda: process_title(worker) is None, "the worker gone with its command")
    finally:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_sigkilled_launcher_leaves_no_worker():
    """Ray SIGKILLs a dead actor's children, the launcher among them: no code of it runs then,
    so its guard (started first) SIGKILLs the launcher's process group, the spawned workers in it."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, subprocess, time
        from serve_apps.vllm_cli import guard_process_group
        guard = guard_process_group()
        worker = subprocess.Popen(["sleep", "300"])     # spawned: no fork hook reaches it
        print(guard, worker.pid, flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    guard, worker = map(int, launcher.stdout.readline().split())
    assert process_title(guard) is not None and process_title(worker) is not None
    launcher.kill()
    launcher.wait()
    try:
        _eventually(lambda: process_title(worker) is None and process_title(guard) is None,
                    "the worker and the guard gone after the launcher's SIGKILL")
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
