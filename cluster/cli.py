"""The `cluster` command line: parse arguments, dispatch to a subcommand, turn errors into exit codes.

Only the CLI layer (this module and cluster/commands/) prints or exits. Every subcommand
returns an exit code: 0 all ok, 1 warnings only, 2 any failure, error or bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

from cluster import __version__
from cluster.errors import ClusterError

# Explicit registry: (subcommand, module under cluster.commands). Each module has
# register(subparsers) -> None, which sets `handler` (args -> int) on its parser.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("init", "init"),
    ("inventory", "inventory"),
    ("exec", "exec_cmd"),
    ("preflight", "preflight"),
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
)


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (argparse already uses 2 for usage errors)."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cluster",
        description="Turn bare-metal GPU servers into a verified Ray cluster serving vLLM.",
        epilog="Exit codes: 0 ok, 1 warnings only, 2 failures, errors or bad usage.",
    )
    parser.add_argument("--version", action="version", version=f"cluster {__version__}")
    parser.add_argument("-i", "--inventory", metavar="PATH",
                        help="cluster.yaml (default: $CLUSTER_INVENTORY, ./cluster.yaml, "
                             "then the embedded single-node localhost default)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, module in COMMANDS:
        importlib.import_module(f"cluster.commands.{module}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args))
    except ClusterError as exc:
        print(f"cluster {args.command}: {exc}", file=sys.stderr)
        if getattr(args, "json", False):  # scripts always get one JSON document with --json
            json.dump({"command": args.command, "exit_code": 2, "status": "error",
                       "error": str(exc)}, sys.stdout)
            sys.stdout.write("\n")
        return 2
    except KeyboardInterrupt:
        print(f"cluster {args.command}: interrupted", file=sys.stderr)
        return 2


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
