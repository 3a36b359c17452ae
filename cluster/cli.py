"""The `cluster` command line: parse arguments, dispatch to a subcommand, turn errors into exit codes.

Only the CLI layer (this module and cluster/commands/) prints or exits. Every subcommand
returns an exit code: 0 all ok, 1 warnings only, 2 any failure, error or bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Sequence

from cluster import __version__
from cluster.report import crash_log
from cluster.base.errors import ClusterError
from cluster.base.flags import path_value
from cluster.base.textsafe import terminal_safe_line

# Explicit registry: (subcommand, module under cluster.commands). Each module has
# register(subparsers) -> None, which sets `handler` (args -> int) on its parser.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("init", "init"),
    ("inventory", "inventory"),
    ("exec", "exec_cmd"),
    ("preflight", "preflight"),
    ("fix", "fix"),
    ("runs", "runs"),
    ("parse", "parse"),
    ("up", "up"),
    ("down", "down"),
    ("status", "status"),
    ("dashboard", "dashboard"),
    ("plan", "plan"),
    ("bench", "bench"),
    ("deploy", "deploy"),
    ("undeploy", "undeploy"),
    ("nccl-check", "nccl_check"),
    ("tune", "tune"),
    ("drain", "drain"),
    ("restart-node", "restart_node"),
    ("model", "model"),
)


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (argparse already uses 2 for usage errors; its own
    error() prints the whole usage block first). `cluster CMD --help` still shows the usage."""

    def error(self, message: str):  # noqa: D401 - argparse's name
        self.exit(2, f"{self.prog}: error: {terminal_safe_line(message)} "
                     f"(see `{self.prog} --help`)\n")


# One line each for `cluster --help`, so that listing the commands imports none of them
# (tests/test_cli_guard.py checks these against each module's own help).
HELP: dict[str, str] = {
    "init": "write a commented cluster.yaml template",
    "inventory": "show the resolved inventory (secrets redacted)",
    "exec": "run a command on nodes in parallel",
    "preflight": "check drivers, GPUs, NVLink, IB, GPUDirect, clocks, /dev/shm, memlock, "
                 "versions, model files",
    "fix": "repair what preflight found (check mode, idempotent, undo record)",
    "runs": "list past runs and where their records are",
    "parse": "parse captured outputs of node diagnostics (nvidia-smi, ibstat, chronyc, NCCL "
             "logs, ...)",
    "up": "start (or repair) the Ray cluster: head, then workers; idempotent",
    "down": "stop Ray on every node (workers first, then the head); idempotent",
    "status": "Ray nodes, GPUs, version and Serve applications, read on the head",
    "dashboard": "serve the head's Ray dashboard on this machine's loopback, the Ray token "
                 "added, and print its local URL",
    "plan": "plan TP/PP/DP/EP and vLLM engine args for a model on this cluster",
    "bench": "load-test an OpenAI-compatible endpoint (TTFT, ITL, latency, tokens/s)",
    "deploy": "serve a model on the Ray cluster (Ray Serve + vLLM, OpenAI API)",
    "undeploy": "remove a Serve application (the others keep running)",
    "nccl-check": "prove the real inter-node transport and bandwidth with an all-reduce",
    "tune": "sweep an engine arg of a deployed app (redeploy + bench per value) and recommend one",
    "drain": "drain a worker: no new Ray work there, Serve replicas moved off first",
    "restart-node": "drain a worker, restart its Ray, rejoin and verify (rolling restart)",
    "model": "model weights on every node: pull once, relay node to node",
}


class _Version(argparse.Action):
    """`cluster --version`: the toolkit's version and the version contract's tested combination
    (cluster/data/versions.yaml, read only when asked; a malformed one is a ClusterError)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from cluster.inspection.contract import load_contract
        contract = load_contract()
        print(f"cluster {__version__}\ntested with: {contract.tested_line()}")
        parser.exit(0)


def chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named in argv (skipping the global options), or None."""
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-i", "--inventory"):
            i += 2
            continue
        if word.startswith("-"):
            i += 1
            continue
        return word
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. With argv, only the command it names is imported and registered in
    full (the others get a one-line entry from HELP): `cluster --help`, `cluster parse` and
    friends start without importing every command's dependencies. Without argv, all are."""
    only = chosen_command(argv) if argv is not None else None
    lazy = argv is not None
    parser = _Parser(
        prog="cluster",
        description="Turn bare-metal GPU servers into a verified Ray cluster serving vLLM.",
        epilog="Exit codes: 0 ok, 1 warnings only, 2 failures, errors or bad usage.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="the toolkit's version and the tested runtime combination")
    parser.add_argument("-i", "--inventory", metavar="PATH", type=path_value,
                        help="cluster.yaml (default: $CLUSTER_INVENTORY, ./cluster.yaml, "
                             "then the embedded single-node localhost default)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS:
        if lazy and name != only:
            sub.add_parser(name, help=HELP[name], add_help=False)
        else:
            importlib.import_module(f"cluster.commands.{module}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code; never raises (argparse's own exits aside).

    Every error ends in one line on stderr and exit 2: a ClusterError says what is wrong; any
    other exception is an internal error whose traceback goes to a crash log, never the terminal.
    """
    args: argparse.Namespace | None = None
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help()
            return 2
        code = handler(args)
        return _exit_code(code)
    except SystemExit:  # argparse: --help/--version exit 0, usage errors exit 2 (two lines)
        raise
    except ClusterError as exc:
        return _fail(args, str(exc))
    except KeyboardInterrupt:
        return _fail(args, "interrupted")
    except BrokenPipeError:
        _silence_stdout()
        return 2
    except Exception as exc:  # the one top-level guard: unexpected means exit 2, never 1
        where = crash_log.write(exc)
        detail = f"details in {where}" if where else "no crash log could be written"
        return _fail(args, f"internal error: {type(exc).__name__}: {_one_line(exc)} "
                           f"(please report; {detail})")


def _exit_code(code: object) -> int:
    """A handler's return value as an exit code: 0, 1 or 2 (anything else is an error: 2)."""
    return code if isinstance(code, int) and not isinstance(code, bool) and code in (0, 1, 2) \
        else 2


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return text if len(text) <= limit else text[:limit] + "..."


def _fail(args: argparse.Namespace | None, message: str) -> int:
    command = getattr(args, "command", None) or ""
    prefix = f"cluster {command}:" if command else "cluster:"
    try:
        line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
        print(f"{prefix} {terminal_safe_line(line)}", file=sys.stderr)
        if getattr(args, "json", False):  # scripts always get one JSON document with --json
            json.dump({"command": command, "exit_code": 2, "status": "error",
                       "error": message}, sys.stdout)
            sys.stdout.write("\n")
            sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    return 2


def _silence_stdout() -> None:
    """After a closed pipe (`cluster ... | head`): point stdout at /dev/null so exit is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
