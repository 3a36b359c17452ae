"""`cluster parse [--kind KIND] FILE... [--json]`: parse captured command outputs offline.

An admin pastes what a node printed into a file (or pipes it to `-`); the kind is detected
when --kind is not given. With --json: a list with one object per file,
{"file", "kind", "data"} or {"file", "kind", "error"} (kind null when detection failed).
Exit 0 when every file parsed, 2 when any did not.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cluster import parsers
from cluster.commands._common import add_json, print_json, stdout
from cluster.errors import ParseError

# Read whole files up to this size; beyond it, detect from the head and stream where possible.
_WHOLE_FILE_BYTES = 8 * 1024 * 1024
_DETECT_HEAD_BYTES = 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "parse", help="parse captured outputs of node diagnostics (nvidia-smi, ibstat, chronyc, "
                      "NCCL logs, ...)",
        description="Parse captured command outputs offline. KIND is detected when omitted. "
                    f"Kinds: {', '.join(parsers.KINDS)}.")
    p.add_argument("--kind", choices=parsers.KINDS, metavar="KIND",
                   help="the tool that printed the files (default: detect per file)")
    p.add_argument("files", nargs="+", metavar="FILE", help="captured output; '-' reads stdin")
    add_json(p)
    p.set_defaults(handler=run)


def _as_data(parsed: Any) -> Any:
    if hasattr(parsed, "to_dict"):
        return parsed.to_dict()
    if dataclasses.is_dataclass(parsed) and not isinstance(parsed, type):
        return dataclasses.asdict(parsed)
    return parsed


def _read_text(path: str, limit: int | None = None) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        return fh.read() if limit is None else fh.read(limit)


def parse_one(path: str, kind: str | None) -> dict[str, Any]:
    """{"file", "kind", "data"} or {"file", "kind", "error"} for one file; never raises."""
    result: dict[str, Any] = {"file": path, "kind": kind}
    try:
        big = path != "-" and os.path.getsize(path) > _WHOLE_FILE_BYTES
        text = None if big else _read_text(path)
        if kind is None:
            head = text if text is not None else _read_text(path, _DETECT_HEAD_BYTES)
            kind = parsers.detect(head)
            result["kind"] = kind
        module = parsers.load(kind)
        if path != "-" and hasattr(module, "parse_file") and (big or kind == "nccl"):
            parsed = module.parse_file(path)
        else:
            parsed = parsers.parse(kind, text if text is not None else _read_text(path))
        result["data"] = _as_data(parsed)
    except ParseError as exc:
        result["error"] = str(exc)
    except OSError as exc:
        result["error"] = f"cannot read {path}: {exc.strerror or exc}"
    except Exception as exc:  # a parser bug on one file must not hide the other files' results
        result["error"] = f"internal error in the {kind} parser: {type(exc).__name__}: {exc}"
    return result


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.9g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value) or "-"
    return str(value)


# Columns worth a person's eye for the list-valued keys of some kinds (None hides the list;
# every key stays in --json). Lists not named here show their columns that hold any value.
_SUMMARY: dict[tuple[str, str], tuple[str, ...] | None] = {
    ("ibstat", "ports"): ("ca", "port", "state", "physical_state", "rate_gbps", "link_layer", "lid"),
    ("ibstat", "cas"): ("ca", "ca_type", "num_ports", "firmware"),
    ("ibv_devinfo", "ports"): ("ca", "port", "state", "physical_state", "rate_gbps",
                               "link_layer", "lid", "active_mtu"),
    ("ibv_devinfo", "cas"): ("ca", "vendor_part_id", "board_id", "firmware", "phys_port_cnt"),
    ("ibdev2netdev", "ports"): ("ca", "port", "netdev", "state", "port_state"),
    ("chronyc-sources", "sources"): ("mode", "state", "name", "stratum", "poll", "reach",
                                     "last_rx", "offset_seconds", "error_seconds"),
    ("ntpq", "peers"): ("tally", "remote", "refid", "stratum", "type", "reach", "delay_ms",
                        "offset_ms", "jitter_ms"),
    ("lsmod", "modules"): None,
    ("lsmod", "loaded"): None,
    ("df-shm", "entries"): None,
}


def _render(result: dict[str, Any]) -> Panel:
    title = f"[bold]{result['kind'] or 'unknown kind'}[/bold]: {escape(result['file'])}"
    if "error" in result:
        return Panel(Text(result["error"], style="red"), title=title, title_align="left",
                     border_style="red")
    data = result["data"]
    if not isinstance(data, dict):
        return Panel(Text(_cell(data)), title=title, title_align="left")
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    tables: list[Table] = []
    kind = result["kind"] or ""
    for key, value in data.items():
        if (kind, key) in _SUMMARY and _SUMMARY[(kind, key)] is None:
            if isinstance(value, (list, tuple)):
                facts.add_row(key, f"{len(value)} (see --json)" if key != "loaded"
                              else _cell(value))
            continue
        rows = value if isinstance(value, (list, tuple)) else None
        if rows and all(isinstance(r, dict) for r in rows):
            columns: list[str] = []
            for r in rows:
                columns += [c for c in r if c not in columns]
            wanted = _SUMMARY.get((kind, key))
            if wanted:
                columns = [c for c in wanted if c in columns]
            columns = [c for c in columns
                       if any(r.get(c) not in (None, "", [], {}) for r in rows)] or columns
            table = Table(title=f"{key} ({len(rows)})", title_justify="left",
                          box=box.SIMPLE_HEAD, pad_edge=False)
            for c in columns:
                table.add_column(c, overflow="fold")
            for r in rows:
                table.add_row(*(_cell(r.get(c)) for c in columns))
            tables.append(table)
        elif value not in ({}, []) or key not in ("variables", "gids"):
            facts.add_row(key, _cell(value))
    return Panel(Group(facts, *tables), title=title, title_align="left", border_style="green")


def run(args: argparse.Namespace) -> int:
    results = [parse_one(path, args.kind) for path in args.files]
    if args.json:
        print_json(results)
    else:
        for result in results:
            stdout.print(_render(result))
    return 0 if all("data" in r for r in results) else 2
