"""Render reports and results for people (rich tables) and scripts (JSON).

Tables stay readable at 80 columns and in a pipe: an identifier (node name, IP, GPU model, HCA
list) is never broken mid-word. Identifier columns do not wrap and end a value wider than the
column in an ellipsis; prose columns wrap between words, a long comma-separated list between its
items. The whole value of anything cut is in the command's --json.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from cluster.base.results import Report, Status, to_jsonable
from cluster.base.textsafe import terminal_safe

if TYPE_CHECKING:  # annotations only: rendering needs no SSH code, JSON needs no rich
    from rich.table import Table
    from rich.text import Text

    from cluster.nodes.remote import CommandResult

STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "error": "bold magenta",
                "skip": "dim", "failed": "bold red", "unreachable": "bold magenta",
                "timeout": "bold magenta", "changed": "cyan"}


INDENT_MAX_BYTES = 256 << 10


def to_json(data: Any) -> str:
    """JSON, indented for reading up to INDENT_MAX_BYTES, compact beyond (the indenting encoder
    is pure Python, ~6x slower: a 1,000-node report would cost the laptop seconds). NaN or
    Infinity anywhere is a bug (invalid JSON) and raises ValueError."""
    plain = to_jsonable(data)
    compact = json.dumps(plain, allow_nan=False)
    if len(compact) > INDENT_MAX_BYTES:
        return compact
    return json.dumps(plain, indent=2, allow_nan=False)


def id_column(table: Table, header: str, **options: Any) -> None:
    """A column of identifiers: one line per cell, a value wider than the column ends in "…"."""
    table.add_column(header, no_wrap=True, overflow="ellipsis", **options)


def text_column(table: Table, header: str, **options: Any) -> None:
    """A column of prose: wraps between words; a word wider than the column ends in "…"."""
    table.add_column(header, overflow="ellipsis", **options)


_LONG_LIST = re.compile(r"\S{21,}")
_AFTER_COMMA = re.compile(r",(?=[^\s,])")


def breakable(text: str) -> str:
    """`text` with a space after each comma of a long word (`mlx5_0,mlx5_1,...`), so that a
    list wraps between its items instead of being cut."""
    return _LONG_LIST.sub(lambda m: _AFTER_COMMA.sub(", ", m.group(0)), text)


def prose(text: str, style: str = "") -> Text:
    """A prose cell: terminal-safe, lists made breakable (see text_column)."""
    from rich.text import Text

    return Text(terminal_safe(breakable(text)), style=style)


def status_text(status: str | Status) -> Text:
    from rich.text import Text

    value = status.value if isinstance(status, Status) else str(status)
    return Text(value, style=STATUS_STYLE.get(value, ""))


def command_results_table(results: Iterable[CommandResult], title: str | None = None,
                          max_lines: int = 20) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, show_lines=True)
    for col in ("node", "status", "exit", "time"):
        id_column(table, col)
    table.add_column("output", overflow="fold")       # raw output, shown whole
    for r in results:
        out = _output_of(r, max_lines)
        table.add_row(r.node, status_text(r.status), "" if r.exit_code is None else str(r.exit_code),
                      f"{r.duration_s:.2f}s", Text(terminal_safe(out)))
    return table


GRID_MAX_NODES = 8
FOLDED_MAX_GROUPS = 40


def command_results_folded(results: Sequence[CommandResult], title: str | None = None,
                           max_lines: int = 20) -> list[Any]:
    """Identical outputs folded (dshbak -c): one block per distinct (status, exit, output), its
    nodes compressed; at most FOLDED_MAX_GROUPS blocks, the rest counted."""
    from rich.table import Table
    from rich.text import Text

    from cluster.report.fold import Row, exact, fold, nodes_text

    rows = []
    for r in results:
        out = _output_of(r, max_lines)
        exit_text = "" if r.exit_code is None else f" (exit {r.exit_code})"
        rows.append(Row(r.node, "output", r.status + exit_text, out))
    groups = fold(rows, label=exact)
    table = Table(title=title, show_lines=True)
    text_column(table, "nodes")
    id_column(table, "status")
    table.add_column("output", overflow="fold")       # raw output, shown whole
    for g in groups[:FOLDED_MAX_GROUPS]:
        status, _, rest = g.status.partition(" ")
        cell = status_text(status)
        cell.append(f" {rest}" if rest else "")
        table.add_row(prose(nodes_text(g, len(results))), cell, Text(terminal_safe(g.summary)))
    out: list[Any] = [table]
    if len(groups) > FOLDED_MAX_GROUPS:
        hidden = groups[FOLDED_MAX_GROUPS:]
        out.append(Text(f"... {len(hidden)} more distinct outputs on "
                        f"{sum(g.count for g in hidden)} nodes (all of them: --json or the run "
                        "directory's node logs)"))
    return out


def _output_of(r: CommandResult, max_lines: int) -> str:
    out = (r.stdout.rstrip("\n") + ("\n" + r.stderr.rstrip("\n") if r.stderr.strip() else ""))
    out = "\n".join(out.strip("\n").splitlines()[-max_lines:])
    if r.error:  # without the node's name in front: equal errors on many nodes fold
        error = r.error.removeprefix(f"{r.node}: ")
        out = error if not out else f"{out}\n{error}"
    return out


def report_table(report: Report, title: str | None = None) -> Table:
    """Checks as rows, one row per (node, check), with status, summary and the fix for failures."""
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for col in ("node", "check", "status"):
        id_column(table, col)
    text_column(table, "summary")
    for r in report.results:
        summary = r.summary if not r.fix or r.status in (Status.OK, Status.SKIP) \
            else f"{r.summary}\n  fix: {r.fix}"
        table.add_row(r.node or "(cluster)", r.check, status_text(r.status),
                      prose(summary))
    return table


def folded_table(groups, total: int, title: str | None = None, key_header: str = "check") -> Table:
    """Folded results (cluster.report.fold.Group): one row per distinct result, nodes compressed."""
    from rich.table import Table

    from cluster.report.fold import nodes_text

    table = Table(title=title, show_lines=False, box=None, pad_edge=False)
    id_column(table, key_header)
    id_column(table, "status")
    text_column(table, "where")
    text_column(table, "summary")
    last = None
    for g in groups:
        summary = g.summary + (" (values differ; see --json)" if g.varies else "")
        table.add_row("" if g.key == last else g.key, status_text(g.status),
                      prose(nodes_text(g, total)), prose(summary))
        last = g.key
    return table


def fix_lines(groups, total: int) -> list[Text]:
    """Each distinct fix once, with the checks and nodes it is for."""
    from rich.text import Text

    from cluster.report.fold import compress, distinct_fixes

    out = []
    for key, fix, nodes in distinct_fixes(groups):
        where = "all nodes" if len(nodes) == total and total > 1 else compress(nodes)
        line = Text(f"fix {key} on {where}: ", style="cyan")
        line.append(terminal_safe(fix))
        out.append(line)
    return out


def shared_cause_lines(causes, what: str = "not checked") -> list[Text]:
    """One line per dead jump host (cluster.report.fold.SharedCause): its cause and the nodes
    behind it, in place of one row per node (and per check) repeating the same error."""
    from rich.text import Text

    return [Text(terminal_safe(c.line(what)), style=STATUS_STYLE["unreachable"]) for c in causes]


def shared_causes_json(causes) -> list[dict[str, Any]]:
    """The shared causes for --json: jump host, cause and the nodes behind it (in full)."""
    return [{"jump_host": c.down.jump_host, "cause": c.down.cause, "nodes": list(c.nodes)}
            for c in causes]
