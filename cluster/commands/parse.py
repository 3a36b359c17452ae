"""`cluster parse [--kind KIND] FILE... [--json]`: parse captured command outputs offline.

An admin pastes what a node printed into a file (or pipes it to `-`); the kind is detected
when --kind is not given. With --json: a list with one object per file,
{"file", "kind", "data"} or {"file", "kind", "error"} (kind null when detection failed);
a fleet capture of several hosts (ansible, pdsh/clush, salt) gives one object per host, each
with a "host" key. Exit codes as every command's: 0 every file parsed and no verdict above ok,
1 a verdict of warn (an NCCL log is judged: checks/nccl.py's "status"), 2 a verdict of
fail or a file that did not parse.

Inputs are bounded: an NCCL log is streamed up to MAX_LOG_BYTES (2 GiB), any other kind's text
is read into memory up to MAX_TEXT_BYTES (256 MiB), in chunks, from files, pipes, devices and
stdin alike. A larger input, binary data (NUL bytes: `cluster parse /dev/zero`), a closed stdin
or an unreadable file is an error for that file, one line on stderr (the "error" of its object
with --json). UTF-16 text (a PowerShell capture) is decoded.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import os
import stat
import sys
from typing import IO, Any, Iterable, Iterator

from cluster.base.flags import path_value
from cluster.inspection import parsers
from cluster.commands._common import add_json, print_json, stderr, stdout
from cluster.base.errors import ParseError
from cluster.inspection.parsers._lines import MAX_LINE_CHARS, long_lines

MAX_LOG_BYTES = 2 * 1024 ** 3       # an NCCL log, streamed line by line
MAX_TEXT_BYTES = 256 * 1024 ** 2    # any other kind's text, held in memory
_DETECT_HEAD_BYTES = 1024 * 1024    # the kind is detected from this much of the start
_CHUNK_BYTES = 1024 * 1024
_BINARY_PROBE_BYTES = 64 * 1024     # NULs in this much of the start: not text
_STREAM_KINDS = frozenset({"nccl"})


class InputError(Exception):
    """An input that cannot be read as text: missing, closed, too large, binary."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "parse", help="parse captured outputs of node diagnostics (nvidia-smi, ibstat, chronyc, "
                      "NCCL logs, ...)",
        description="Parse captured command outputs offline. KIND is detected when omitted. "
                    f"Kinds: {', '.join(parsers.KINDS)}.",
        epilog="Exit codes: 0 parsed, every verdict ok; 1 a verdict of warn (an NCCL log's "
               "status); 2 a verdict of fail (e.g. NCCL on sockets where IB was expected, IB "
               "completion errors) or an input that did not parse.")
    p.add_argument("--kind", choices=parsers.KINDS, metavar="KIND",
                   help="the tool that printed the files (default: detect per file)")
    p.add_argument("files", nargs="+", metavar="FILE", type=path_value, help="captured output; '-' reads stdin")
    add_json(p)
    p.set_defaults(handler=run)


def reading_data(parsed: Any, kind: str | None = None) -> Any:
    """A parser's reading as JSON data; an NCCL log's judged (status, verdict, findings)."""
    if kind == "nccl":      # the one kind whose reading is judged: status, verdict, findings
        from cluster.inspection.checks.nccl import judged_document
        return judged_document(parsed)
    if hasattr(parsed, "to_dict"):
        return parsed.to_dict()
    if dataclasses.is_dataclass(parsed) and not isinstance(parsed, type):
        return dataclasses.asdict(parsed)
    return parsed


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


def _too_large(what: str, limit: int, kind: str | None) -> InputError:
    of = f" of a {kind} output" if kind else ""
    return InputError(f"{what} is larger than {_fmt_bytes(limit)}, the most `cluster parse` "
                      f"reads{of}; cut it to the part that matters")


def _open(path: str) -> tuple[IO[bytes], bool, int | None]:
    """(binary stream, whether to close it, its size when it is a regular file)."""
    if path == "-":
        stream = getattr(sys.stdin, "buffer", None) if sys.stdin is not None else None
        try:
            if stream is None or stream.closed:
                raise ValueError
            st = os.fstat(stream.fileno())
        except (OSError, ValueError):
            raise InputError("cannot read stdin: it is closed (pipe the output in, or name "
                             "a file)") from None
        return stream, False, st.st_size if stat.S_ISREG(st.st_mode) else None
    fh = open(path, "rb")
    try:
        st = os.fstat(fh.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"cannot read {path}: it is a directory")
    except BaseException:
        fh.close()
        raise
    return fh, True, st.st_size if stat.S_ISREG(st.st_mode) else None


def _read_head(stream: IO[bytes], n: int) -> bytes:
    """Up to n bytes (fewer only at the end of the stream), in chunks."""
    chunks: list[bytes] = []
    total = 0
    while total < n:
        chunk = stream.read(min(_CHUNK_BYTES, n - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _read_rest(stream: IO[bytes], limit: int, what: str, kind: str | None) -> bytes:
    """The rest of the stream, at most `limit` bytes; InputError when it holds more."""
    data = _read_head(stream, limit + 1)
    if len(data) > limit:
        raise _too_large(what, MAX_TEXT_BYTES, kind)
    return data


_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
         (codecs.BOM_UTF16_BE, "utf-16"))


def _encoding(head: bytes) -> str:
    """utf-16 for UTF-16 text (a BOM, or ASCII with every other byte NUL), else utf-8."""
    for bom, name in _BOMS:
        if head.startswith(bom):
            return name
    probe = head[:_BINARY_PROBE_BYTES]
    if len(probe) >= 8:
        even, odd = probe[0::2], probe[1::2]
        if odd.count(0) > 0.9 * len(odd) and even.count(0) < 0.05 * len(even):
            return "utf-16-le"
        if even.count(0) > 0.9 * len(even) and odd.count(0) < 0.05 * len(odd):
            return "utf-16-be"
    return "utf-8"


def _refuse_binary(head: bytes, what: str) -> None:
    """InputError for data that is not text: NUL bytes in its start (and it is not UTF-16)."""
    if _encoding(head) != "utf-8":
        return
    probe = head[:_BINARY_PROBE_BYTES]
    nuls = probe.count(0)
    if nuls > 8 + len(probe) // 1000:
        raise InputError(f"{what} is not text: {nuls} NUL bytes in its first "
                         f"{_fmt_bytes(len(probe))} (binary data, not a captured output)")
    bad = probe.decode("utf-8", errors="replace").count("\ufffd")
    if bad > 8 + len(probe) // 20:
        raise InputError(f"{what} is not text: {bad} bytes that are not UTF-8 in its first "
                         f"{_fmt_bytes(len(probe))} (binary data, not a captured output)")


def _decode(data: bytes) -> str:
    return data.decode(_encoding(data[:_BINARY_PROBE_BYTES]), errors="replace")


def _stream_lines(head: bytes, stream: IO[bytes], what: str) -> Iterator[bytes]:
    """The lines of head + the rest of the stream; InputError past MAX_LOG_BYTES."""
    total, pending = len(head), head
    while True:
        chunk = stream.read(_CHUNK_BYTES)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_LOG_BYTES:
            raise _too_large(what, MAX_LOG_BYTES, "nccl")
        pending += chunk
        cut = pending.rfind(b"\n")
        if cut >= 0:
            yield from pending[:cut + 1].splitlines(keepends=True)
            pending = pending[cut + 1:]
    if pending:
        yield from pending.splitlines(keepends=True)


def _parse_stream(result: dict[str, Any], path: str, stream: IO[bytes],
                  size: int | None) -> list[dict[str, Any]]:
    what = "stdin" if path == "-" else path
    if size is not None and size > MAX_LOG_BYTES:
        raise InputError(f"{what} is {_fmt_bytes(size)}, larger than {_fmt_bytes(MAX_LOG_BYTES)}, "
                         "the most `cluster parse` reads; cut it to the part that matters")
    head = _read_head(stream, _DETECT_HEAD_BYTES)
    _refuse_binary(head, what)
    kind = result["kind"]
    if kind is None:
        kind = result["kind"] = parsers.detect(_decode(head))
    if kind in _STREAM_KINDS:
        module = parsers.load(kind)
        if path != "-" and size is not None and hasattr(module, "parse_file"):
            parsed = module.parse_file(path)      # streamed in C, memory flat
        else:
            parsed = module.parse_lines(_stream_lines(head, stream, what))
        return [{**result, "data": reading_data(parsed, kind)}]
    if size is not None and size > MAX_TEXT_BYTES:
        raise _too_large(what, MAX_TEXT_BYTES, kind)
    data = head + _read_rest(stream, MAX_TEXT_BYTES - len(head), what, kind)
    return _results(result, kind, _decode(data))


# Kinds whose parser reads each line only up to _lines.MAX_LINE_CHARS characters.
_CAPPED_KINDS = frozenset(parsers.KINDS) - {"nccl", "nvidia-smi", "nvidia-smi-q", "nvidia-smi-topo"}


def _results(result: dict[str, Any], kind: str, text: str) -> list[dict[str, Any]]:
    """One result, or one per host of a fleet capture; "truncated_lines" counts the lines
    longer than the parser reads (only when there are any)."""
    if kind in _CAPPED_KINDS:
        cut = long_lines(text)
        if cut:
            result = {**result, "truncated_lines": cut}
    outs = parsers.parse_hosts(kind, text)
    if len(outs) == 1:
        parsed = outs[0][1]
        if isinstance(parsed, ParseError):
            raise parsed
        return [{**result, "data": reading_data(parsed, kind)}]
    rows = []
    for host, parsed in outs:
        row: dict[str, Any] = {"file": result["file"], "host": host, "kind": kind}
        if "truncated_lines" in result:
            row["truncated_lines"] = result["truncated_lines"]
        if isinstance(parsed, ParseError):
            row["error"] = str(parsed)
        else:
            row["data"] = reading_data(parsed, kind)
        rows.append(row)
    return rows


def parse_path(path: str, kind: str | None) -> list[dict[str, Any]]:
    """{"file", "kind", "data"} or {"file", "kind", "error"} for one file, one per host of a
    fleet capture of several hosts (with a "host" key); never raises. An input that could
    not be read as text also carries "input_error": True (not printed in --json)."""
    result: dict[str, Any] = {"file": path, "kind": kind}
    what = "stdin" if path == "-" else path
    try:
        stream, close, size = _open(path)
        try:
            return _parse_stream(result, path, stream, size)
        finally:
            if close:
                stream.close()
    except InputError as exc:
        return [{**result, "error": str(exc), "input_error": True}]
    except ParseError as exc:
        return [{**result, "error": str(exc)}]
    except OSError as exc:
        return [{**result, "error": f"cannot read {what}: {exc.strerror or exc}",
                 "input_error": True}]
    except MemoryError:
        return [{**result, "error": f"cannot read {what}: out of memory", "input_error": True}]
    except Exception as exc:  # a parser bug on one file must not hide the other files' results
        return [{**result, "error": f"internal error in the {result['kind'] or 'kind detection'}"
                                    f" parser: {type(exc).__name__}: {exc}"}]


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
    ("nccl", "errors"): ("kind", "severity", "count", "hosts", "message"),
}

# Kinds whose "gpus" list is shown as one row per GPU with a few columns that fit 80 columns.
_GPU_KINDS = frozenset({"nvidia-smi", "nvidia-smi-q"})
# Keys that lead the panel when a kind's reading is judged (an NCCL log's: checks/nccl.py).
_VERDICT_KEYS = ("status", "verdict")


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def _pair(a: Any, b: Any) -> str:
    """"used/total" of two numbers, "-" for a missing one."""
    if a is None and b is None:
        return "-"
    return f"{_cell(a)}/{_cell(b)}"


def _gpu_table(rows: list[dict[str, Any]]) -> Any:
    """The GPUs of an nvidia-smi report, one row each (every field stays in --json)."""
    from rich import box
    from rich.table import Table

    from cluster.report.render import id_column, text_column

    table = Table(title=f"gpus ({len(rows)})", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    id_column(table, "gpu", justify="right")
    text_column(table, "name")
    for header in ("mem MiB", "util%", "temp", "power W", "bus id"):
        id_column(table, header)
    for r in rows:
        cap = r.get("power_cap_w", r.get("power_limit_w"))
        table.add_row(_cell(r.get("index")), _cell(r.get("name")),
                      _pair(r.get("memory_used_mib"), r.get("memory_total_mib")),
                      _cell(r.get("gpu_util_percent")), _cell(r.get("temperature_c")),
                      _pair(r.get("power_draw_w"), cap), _cell(r.get("bus_id")))
    return table


def _render(result: dict[str, Any]) -> Any:
    """One result as a rich Panel (rich is imported here: `--json` runs never load it)."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    host = f" ({escape(str(result['host']))})" if "host" in result else ""
    title = f"[bold]{result['kind'] or 'unknown kind'}[/bold]: {escape(result['file'])}{host}"
    if "error" in result:
        return Panel(Text(result["error"], style="red"), title=title, title_align="left",
                     border_style="red")
    data = result["data"]
    if result.get("truncated_lines"):
        note = Text(f"{result['truncated_lines']} line(s) longer than {MAX_LINE_CHARS} characters "
                    "were read only up to that length", style="yellow")
        return Panel(Group(note, _render({k: v for k, v in result.items()
                                          if k != "truncated_lines"}).renderable),
                     title=title, title_align="left", border_style="green")
    if not isinstance(data, dict):
        return Panel(Text(_cell(data)), title=title, title_align="left")
    from cluster.report.render import STATUS_STYLE, id_column, prose, text_column

    facts = Table(show_header=False, box=None, pad_edge=False)
    id_column(facts, "", style="bold")
    text_column(facts, "")
    tables: list[Any] = []
    kind = result["kind"] or ""
    lead: list[Any] = []
    if isinstance(data.get("verdict"), str) and data["verdict"]:   # the verdict first
        lead.append(Text(data["verdict"], style=STATUS_STYLE.get(str(data.get("status")), "")))
    empty = [k for k, v in data.items() if _empty(v)]
    for key, value in data.items():
        if _empty(value) or (lead and key in _VERDICT_KEYS):
            continue
        if (kind, key) in _SUMMARY and _SUMMARY[(kind, key)] is None:
            if isinstance(value, (list, tuple)):
                facts.add_row(key, f"{len(value)} (see --json)" if key != "loaded"
                              else _cell(value))
            continue
        rows = value if isinstance(value, (list, tuple)) else None
        if rows and key == "gpus" and kind in _GPU_KINDS and all(isinstance(r, dict) for r in rows):
            tables.append(_gpu_table(rows))
        elif rows and all(isinstance(r, dict) for r in rows):
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
                text_column(table, c)
            for r in rows:
                table.add_row(*(prose(_cell(r.get(c))) for c in columns))
            tables.insert(0, table) if key == "findings" else tables.append(table)
        else:
            facts.add_row(key, prose(_cell(value)))
    if empty:
        lead_out = Text(f"{len(empty)} empty field(s) left out (--json has every field)",
                        style="dim")
        tables.append(lead_out)
    return Panel(Group(*lead, facts, *tables), title=title, title_align="left",
                 border_style="green")


def run(args: argparse.Namespace) -> int:
    results = [r for path in args.files for r in parse_path(path, args.kind)]
    if args.json:
        print_json([{k: v for k, v in r.items() if k != "input_error"} for r in results])
    else:
        for result in results:
            if not result.get("input_error"):
                stdout.print(_render(result))
    failed = [r for r in results if "data" not in r]
    if failed:  # the error rule: one line on stderr, whatever stdout shows
        first = failed[0]
        more = f" (and {len(failed) - 1} more of {len(results)} inputs)" if len(failed) > 1 else ""
        stderr.print(f"cluster parse: {first.get('file')}: {first.get('error')}{more}",
                     markup=False, highlight=False, soft_wrap=True)
    return 2 if failed else verdict_exit_code(r["data"] for r in results)


VERDICT_EXIT = {"ok": 0, "warn": 1, "fail": 2}


def verdict_exit_code(parsed: Iterable[Any]) -> int:
    """The exit code the parsed outputs' verdicts give (a judged kind, as an NCCL log, says
    "status": ok/warn/fail): the worst of them, 0 when none is judged."""
    return max((VERDICT_EXIT.get(d.get("status"), 0) for d in parsed if isinstance(d, dict)),
               default=0)
