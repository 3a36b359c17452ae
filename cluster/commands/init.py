"""`cluster init [PATH]`: write a commented inventory template."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.base.flags import path_value
from cluster.commands._common import add_json, print_json, stderr
from cluster.base.errors import UsageError
from cluster.nodes.inventory import template_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="write a commented cluster.yaml template",
                       description="Write a commented cluster.yaml template to PATH (default ./cluster.yaml).")
    p.add_argument("path", nargs="?", default="cluster.yaml", type=path_value)
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    target = Path(args.path)
    if target.exists() and not args.force:
        raise UsageError(f"{target} exists; pass --force to overwrite it")
    if target.exists() and not target.is_file():
        raise UsageError(f"{target} is not a regular file; give a file path for the inventory")
    try:
        target.write_text(template_text())
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc.strerror or exc}") from None
    if getattr(args, "json", False):
        print_json({"path": str(target.resolve()), "written": True})
        return 0
    stderr.print(f"wrote {target}: edit the nodes, then run `cluster -i {target} preflight`")
    return 0
