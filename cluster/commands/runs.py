"""`cluster runs [--json] [--limit N]`: list past runs (newest first) from the run directory."""

from __future__ import annotations

import argparse
import re

from rich.markup import escape
from rich.table import Table

from cluster.commands._common import int_range, add_json, load_inventory, print_json, stdout
from cluster.report.rundir import list_runs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help="list past runs and where their records are")
    p.add_argument("--limit", type=int_range(1, 100000), default=20, metavar="N", help="at most N runs (default 20)")
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    inv = load_inventory(args)
    runs = list_runs(inv.run_dir)[: max(args.limit, 0)]
    if args.json:
        print_json({"run_dir": inv.run_dir, "runs": runs})
        return 0
    table = Table(title=f"runs in {inv.run_dir}")
    for col in ("started", "command", "exit", "path"):
        table.add_column(col, overflow="fold")
    for r in runs:
        if r.get("error"):
            status = f"broken: {r['error']}"
        else:
            status = "running?" if r["exit_code"] is None else str(r["exit_code"])
        table.add_row(*(_cell(x) for x in (r["started"] or "-", r["command"] or "-", status,
                                             r["path"])))
    stdout.print(table)
    return 0


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _cell(value: object) -> str:
    """Text for the terminal: control characters shown as ?, Rich markup escaped."""
    return escape(_CONTROL.sub("?", str(value)))
