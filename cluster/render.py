"""Render reports and results for people (rich tables) and scripts (JSON)."""

from __future__ import annotations

import json
from typing import Any, Iterable

from rich.table import Table
from rich.text import Text

from cluster.remote import CommandResult
from cluster.results import Report, Status, to_jsonable
from cluster.textsafe import terminal_safe

STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "error": "bold magenta",
                "skip": "dim", "failed": "bold red", "unreachable": "bold magenta",
                "timeout": "bold magenta", "changed": "cyan"}


def to_json(data: Any) -> str:
    """Indented JSON; NaN or Infinity anywhere is a bug (invalid JSON) and raises ValueError."""
    return json.dumps(to_jsonable(data), indent=2, allow_nan=False)


def status_text(status: str | Status) -> Text:
    value = status.value if isinstance(status, Status) else str(status)
    return Text(value, style=STATUS_STYLE.get(value, ""))


def command_results_table(results: Iterable[CommandResult], title: str | None = None,
                          max_lines: int = 20) -> Table:
    table = Table(title=title, show_lines=True)
    for col in ("node", "status", "exit", "time", "output"):
        table.add_column(col, overflow="fold")
    for r in results:
        out = (r.stdout.rstrip("\n") + ("\n" + r.stderr.rstrip("\n") if r.stderr.strip() else ""))
        out = "\n".join(out.strip("\n").splitlines()[-max_lines:])
        if r.error:
            out = r.error if not out else f"{out}\n{r.error}"
        table.add_row(r.node, status_text(r.status), "" if r.exit_code is None else str(r.exit_code),
                      f"{r.duration_s:.2f}s", Text(terminal_safe(out)))
    return table


def report_table(report: Report, title: str | None = None) -> Table:
    """Checks as rows, one row per (node, check), with status, summary and the fix for failures."""
    table = Table(title=title, show_lines=False)
    for col in ("node", "check", "status", "summary"):
        table.add_column(col, overflow="fold")
    for r in report.results:
        summary = r.summary if not r.fix or r.status in (Status.OK, Status.SKIP) \
            else f"{r.summary}\n  fix: {r.fix}"
        table.add_row(r.node or "(cluster)", r.check, status_text(r.status),
                      Text(terminal_safe(summary)))
    return table
