"""`cluster restart-node NODE [--dry-run] [--yes] [--json]`: drain, restart Ray on one worker,
rejoin, verify; only when the other nodes can carry the deployed apps (playbooks/restart_node.py)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from cluster.commands._common import add_changing, add_json, float_range
from cluster.commands.drain import add_node_and_wait, execute


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "restart-node", help="drain a worker, restart its Ray, rejoin and verify (rolling restart)",
        description="Check that the other alive nodes can carry the deployed Serve apps (their "
                    "placement bundles against the nodes' GPUs/CPUs; refused with the numbers "
                    "otherwise), drain NODE (Serve replicas move off first), `ray stop` on it, "
                    "start it with the command `cluster up` would run, wait until it is alive "
                    "with its GPUs and every app is RUNNING. Exit 0 done, 2 refused or failed.")
    add_restart_flags(p)
    p.set_defaults(handler=run)


def add_restart_flags(p: argparse.ArgumentParser) -> None:
    """NODE, --wait, --timeout (the rejoin's), --dry-run/--yes and --json: the flags of a
    command that restarts a worker's Ray (restart-node, uncordon)."""
    add_node_and_wait(p)
    p.add_argument("--timeout", type=float_range(0, 3600, strict=True), default=240.0, metavar="S",
                   help="how long to wait for the node to rejoin (default %(default)s)")
    add_changing(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from playbooks import restart_node

    return run_restart(args, "restart-node", restart_node.run, restart_node.RestartOptions)


def run_restart(args: argparse.Namespace, command: str, playbook: Callable[..., Any],
                options: Callable[..., Any]) -> int:
    """A worker's Ray restarted by `playbook` with `options` (RestartOptions or a subclass)
    built from add_restart_flags' flags."""
    return execute(args, command, playbook, options(
        args.node, dry_run=args.dry_run, wait_s=args.wait, join_timeout_s=args.timeout),
        ("--timeout", args.timeout))
