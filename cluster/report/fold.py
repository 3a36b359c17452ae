"""Fold per-node results for people: identical results become one line, however many nodes.

A report over 1,000 nodes must still read in a screen or two. `fold` groups one key's results
(a check, a command) by status and summary: results whose summaries differ only in their numbers
fold together when they are ok/skip ("ok on 126 nodes: synchronized (offset 0.2 ms ...)", the
first node's text as the example); a warning or failure is grouped by its exact text, so every
distinct problem keeps its own line and its nodes. Node lists are compressed as pdsh's dshbak
does (node[1-96,98]). Pure functions over plain data; rendering to rich is the caller's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

QUIET = ("ok", "skip", "changed")     # statuses whose number-only differences fold together
_DIGITS = re.compile(r"\d+(?:\.\d+)?")
_NAME_NUMBER = re.compile(r"([^\d]*?)(\d{1,9})\Z")
ORDER = {"error": 0, "unreachable": 0, "timeout": 0, "failed": 1, "fail": 1, "warn": 2,
         "manual": 2, "changed": 3, "ok": 4, "skip": 5, "skipped": 5}


@dataclass(frozen=True)
class Row:
    """One node's result for one key: what the fold reads."""

    node: str
    key: str
    status: str
    summary: str
    fix: str | None = None


@dataclass(frozen=True)
class Group:
    """Results of one key that read the same: status, an example summary, the nodes."""

    key: str
    status: str
    summary: str
    nodes: tuple[str, ...]
    fix: str | None
    varies: bool  # the summaries differ in their numbers (an example is shown)

    @property
    def count(self) -> int:
        return len(self.nodes)


def shape(summary: str) -> str:
    """The summary with every number replaced by '#' (what number-only differences share)."""
    return _DIGITS.sub("#", summary)


def quiet_shape(row: Row) -> str:
    """The default grouping label: numbers ignored for ok/skip results, exact text otherwise."""
    return shape(row.summary) if row.status in QUIET else row.summary


def exact(row: Row) -> str:
    """Group only identical texts (dshbak -c: command outputs)."""
    return row.summary


def fold(rows: Iterable[Row], label: Callable[[Row], str] = quiet_shape) -> list[Group]:
    """Group rows by key, then status and label(row) (by default numbers are ignored for quiet
    statuses). Keys keep their first-seen order; within a key the worst status comes first and,
    within a status, the largest group.
    """
    by_key: dict[str, dict[tuple[str, str], list[Row]]] = {}
    for row in rows:
        label_text = label(row)
        by_key.setdefault(row.key, {}).setdefault((row.status, label_text), []).append(row)
    out: list[Group] = []
    for key, groups in by_key.items():
        made = [Group(key, members[0].status, members[0].summary,
                      tuple(r.node for r in members), members[0].fix,
                      len({r.summary for r in members}) > 1)
                for members in groups.values()]
        made.sort(key=lambda g: (ORDER.get(g.status, 3), -g.count))
        out += made
    return out


def compress(names: Sequence[str], limit: int = 12) -> str:
    """node1,node2,node3,node7 -> node[1-3,7] (dshbak -c style); at most `limit` ranges."""
    prefixes: dict[str, list[int]] = {}
    widths: dict[str, int] = {}
    plain: list[str] = []
    for name in names:
        m = _NAME_NUMBER.match(name)
        if not m or (len(m.group(2)) > 1 and m.group(2).startswith("0")):
            plain.append(name)
            continue
        prefixes.setdefault(m.group(1), []).append(int(m.group(2)))
        widths[m.group(1)] = len(m.group(2))
    parts: list[str] = []
    for prefix, numbers in prefixes.items():
        ranges = _ranges(sorted(set(numbers)))
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            parts.append(f"{prefix}{ranges[0][0]}")
            continue
        text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)
        parts.append(f"{prefix}[{text}]")
    parts += plain
    if len(parts) > limit:
        return ",".join(parts[:limit]) + f",... (+{len(parts) - limit} more)"
    return ",".join(parts)


def _ranges(numbers: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for n in numbers:
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out


def nodes_text(group: Group, total: int) -> str:
    """'126 nodes' / 'node7' / '3 nodes: node[3-5]' / 'all 128 nodes'."""
    if group.count == 1:
        return group.nodes[0]
    if group.count == total and total > 1:
        return f"all {total} nodes"
    if group.status in QUIET and group.count > 8:
        return f"{group.count} nodes"
    return f"{group.count} nodes: {compress(group.nodes)}"


def distinct_fixes(groups: Iterable[Group]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(key, fix, nodes) once per distinct fix of a non-quiet group, in first-seen order."""
    seen: dict[tuple[str, str], list[str]] = {}
    for g in groups:
        if g.fix and g.status not in QUIET:
            seen.setdefault((g.key, g.fix), []).extend(g.nodes)
    return [(key, fix, tuple(nodes)) for (key, fix), nodes in seen.items()]


def grid_fits(columns: int, width: int, column_width: int = 24, label_width: int = 14) -> bool:
    """Whether a table with one column per node (of about column_width) fits `width`."""
    return label_width + columns * column_width <= width
