"""Fold per-node results for people: identical results become one line, however many nodes.

A report over 1,000 nodes must still read in a screen or two. `fold` groups one key's results
(a check, a command) by status and summary: results whose summaries differ only in their numbers
fold together when they are ok/skip ("ok on 126 nodes: synchronized (offset 0.2 ms ...)", the
first node's text as the example); a warning or failure is grouped by its exact text, so every
distinct problem keeps its own line and its nodes. Node lists are compressed as pdsh's dshbak
does (node[1-96,98]). Nodes behind a jump host this run could not reach fold into one line
naming it and its cause (`shared_causes`). Pure functions over plain data; rendering to rich
is the caller's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from cluster.nodes.connect_errors import JumpHostDown, jump_host_down

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


JUMP_HOST_KEY = "jump host"      # the key of a dead jump host's one group


def fold(rows: Iterable[Row], label: Callable[[Row], str] = quiet_shape) -> list[Group]:
    """Group rows by key, then status and label(row) (by default numbers are ignored for quiet
    statuses). Keys keep their first-seen order; within a key the worst status comes first and,
    within a status, the largest group. Rows that failed behind a dead jump host (their summary
    ends with its shared cause) are one group per jump host, first, whatever their keys.
    """
    by_key: dict[str, dict[tuple[str, str], list[Row]]] = {}
    behind: dict[JumpHostDown, list[str]] = {}
    for row in rows:
        down = None if row.status in QUIET else jump_host_down(row.summary)
        if down is not None:        # every key of every node behind it: one group
            behind.setdefault(down, []).append(row.node)
            continue
        label_text = label(row)
        by_key.setdefault(row.key, {}).setdefault((row.status, label_text), []).append(row)
    out = [Group(JUMP_HOST_KEY, "unreachable", f"{down.text}: the nodes behind it not reached",
                 tuple(dict.fromkeys(nodes)), None, False) for down, nodes in behind.items()]
    for key, groups in by_key.items():
        made = [Group(key, members[0].status, members[0].summary,
                      tuple(r.node for r in members), members[0].fix,
                      len({r.summary for r in members}) > 1)
                for members in groups.values()]
        made.sort(key=lambda g: (ORDER.get(g.status, 3), -g.count))
        out += made
    return out


def compress(names: Sequence[str], limit: int = 12) -> str:
    """node1,node2,node3,node7 -> node[1-3,7] (dshbak -c style); zero-padded numbers keep
    their width (rb-01..rb-16 -> rb-[01-16]); at most `limit` ranges."""
    numbered: list[tuple[str, str]] = []
    plain: list[str] = []
    for name in names:
        m = _NAME_NUMBER.match(name)
        if m:
            numbered.append((m.group(1), m.group(2)))
        else:
            plain.append(name)
    padded = {(prefix, len(digits)) for prefix, digits in numbered
              if len(digits) > 1 and digits.startswith("0")}
    groups: dict[tuple[str, int], list[int]] = {}   # (prefix, zero-padded width or 0)
    for prefix, digits in numbered:
        width = len(digits) if (prefix, len(digits)) in padded else 0
        groups.setdefault((prefix, width), []).append(int(digits))
    parts: list[str] = []
    for (prefix, width), numbers in groups.items():
        ranges = _ranges(sorted(set(numbers)))
        number = f"0{width}d"                      # width 0: the number as it is
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            parts.append(f"{prefix}{ranges[0][0]:{number}}")
            continue
        text = ",".join(f"{a:{number}}" if a == b else f"{a:{number}}-{b:{number}}"
                        for a, b in ranges)
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


@dataclass(frozen=True)
class SharedCause:
    """Nodes that failed for one reason outside themselves: the jump host they sit behind."""

    down: JumpHostDown
    nodes: tuple[str, ...]

    def line(self, what: str = "not checked") -> str:
        """'jump host ops@X unreachable (why): 16 nodes behind it not checked: rb-[01-16]'."""
        count = "1 node" if len(self.nodes) == 1 else f"{len(self.nodes)} nodes"
        return f"{self.down.text}: {count} behind it {what}: {compress(self.nodes)}"


def shared_causes(errors: Iterable[tuple[str, str | None]]) -> list[SharedCause]:
    """(node, error text) of nodes not reached -> one SharedCause per dead jump host, with its
    nodes in the order given (first-seen order of the jump hosts); other errors are left out."""
    by_down: dict[JumpHostDown, list[str]] = {}
    for node, text in errors:
        down = jump_host_down(text) if text else None
        if down is not None:
            by_down.setdefault(down, []).append(node)
    return [SharedCause(down, tuple(dict.fromkeys(nodes))) for down, nodes in by_down.items()]
