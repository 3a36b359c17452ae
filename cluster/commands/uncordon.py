"""`cluster uncordon NODE [--dry-run] [--yes] [--json]`: a node the health job cordoned back into
service: its preflight first (refused while a check fails), then restart-node's steps
(playbooks/uncordon.py)."""

from __future__ import annotations

import argparse

from cluster.commands.restart_node import add_restart_flags, run_restart


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "uncordon", help="bring back a node the health job cordoned (its preflight must pass)",
        description="Run NODE's preflight (every node check and its clock); refuse (exit 2, "
                    "naming the failing checks) while one fails. Then restart Ray on it as "
                    "`cluster restart-node` does (a drained Ray node takes work again only as a "
                    "new node): the health job sees it rejoin and lifts its cordon. Exit 0 done, "
                    "2 refused or failed.")
    add_restart_flags(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from playbooks import uncordon

    return run_restart(args, "uncordon", uncordon.run, uncordon.UncordonOptions)
