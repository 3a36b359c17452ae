"""`cluster init [PATH]`: write a commented inventory template."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.commands._common import stderr
from cluster.errors import UsageError
from cluster.inventory import template_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="write a commented cluster.yaml template",
                       description="Write a commented cluster.yaml template to PATH (default ./cluster.yaml).")
    p.add_argument("path", nargs="?", default="cluster.yaml")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    target = Path(args.path)
    if target.exists() and not args.force:
        raise UsageError(f"{target} exists; pass --force to overwrite it")
    target.write_text(template_text())
    stderr.print(f"wrote {target}: edit the nodes, then run `cluster -i {target} preflight`")
    return 0
