"""Parse `nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]` into one record per GPU.

Column names, in order of authority:
1. `fields=[...]` passed to `parse_query` (a caller that knows what it asked for);
2. the CSV header (`memory.total [MiB]` -> `memory.total`, unit kept in `units`);
3. the `--query-gpu=` list of a command line echoed in the text (`$ nvidia-smi --query-gpu=...`);
4. otherwise `col0`, `col1`, ...: header-less output without a command line does not say what
   its columns are (`column_source` is then "positional"). Such text is accepted only with two or
   more columns and at least one column that looks like nvidia-smi data (numbers, N/A, bus ids...).

Names are canonicalised to what nvidia-smi prints in its header: `gpu_name` -> `name`,
`gpu_bus_id` -> `pci.bus_id`, `gpu_uuid` -> `uuid`, `clocks.sm` -> `clocks.current.sm`, ...
Values: `[N/A]`, `N/A`, `[Not Supported]`... -> null; units stripped (`26 %` -> 26, `83.92 W` ->
83.92); int or float where numeric, except fields that are text even when they look numeric
(driver_version "535.100", serial, compute_cap "8.6", inforom.*, pci.*).

Looping output (`-l N`: the same GPU again and again) is recognised by a repeated `index`,
`uuid` or `pci.bus_id`: `gpus` then holds the last sample of each GPU, `samples` every row.
A Python list repr of CSV lines (`['0, 56, 26 %', '']`, as some tools log them) is unpacked.

Returned shape (`parse(text).to_dict()`):

    {
      "gpus": [{"name": "NVIDIA H100 80GB HBM3", "pci.bus_id": "00000000:04:00.0", ...}, ...],
      "columns": ["name", "pci.bus_id", "vbios_version"],
      "column_source": "header" | "fields" | "command" | "positional",
      "units": {"memory.total": "MiB", ...},      # from the header; {} without one
      "looping": false,
      "samples": [...],                            # every row when looping, else []
    }

Raises ParseError on text with no CSV rows, rows whose column count differs from the header,
another query (`--query-compute-apps`...), or nvidia-smi's own error messages.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from cluster.base.errors import ParseError
from cluster.inspection.parsers._lines import lines_of, strip_prompt, to_number, unwrap
from cluster.inspection.parsers._nvidia_text import BUS_ID, command_echo, is_elision, is_missing, tool_failure

KIND = "nvidia-smi-query"

# `--help-query-gpu` aliases -> the name nvidia-smi prints in the CSV header.
ALIASES = {
    "gpu_name": "name", "gpu_serial": "serial", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id",
    "inforom.image": "inforom.img", "gpu_operation_mode.current": "gom.current",
    "gpu_operation_mode.pending": "gom.pending",
    "clocks.gr": "clocks.current.graphics", "clocks.sm": "clocks.current.sm",
    "clocks.mem": "clocks.current.memory", "clocks.video": "clocks.current.video",
    "clocks.applications.gr": "clocks.applications.graphics",
    "clocks.applications.mem": "clocks.applications.memory",
    "clocks.default_applications.gr": "clocks.default_applications.graphics",
    "clocks.default_applications.mem": "clocks.default_applications.memory",
    "clocks.max.gr": "clocks.max.graphics", "clocks.max.mem": "clocks.max.memory",
    "retired_pages.sbe": "retired_pages.single_bit_ecc.count",
    "retired_pages.dbe": "retired_pages.double_bit.count",
}

# First dotted component of every --query-gpu field (used to recognise a header line).
_KNOWN_ROOTS = {
    "timestamp", "driver_version", "count", "name", "serial", "uuid", "pci", "pcie", "index",
    "display_mode", "display_active", "display_attached", "persistence_mode", "addressing_mode",
    "accounting", "driver_model", "vbios_version", "inforom", "gom", "gpu_operation_mode", "fan",
    "pstate", "clocks_throttle_reasons", "clocks_event_reasons", "clocks_event_reasons_counters",
    "memory", "compute_mode", "compute_cap", "utilization", "encoder", "fbc", "ecc",
    "retired_pages", "remapped_rows", "temperature", "power", "enforced", "module", "clocks",
    "mig", "reset_status", "gpu_reset_status", "gpu_recovery_action", "protected_memory",
    "fabric", "platform", "c2c", "vgpu_driver_capability", "vgpu_device_capability", "gsp",
    "gpu_name", "gpu_serial", "gpu_uuid", "gpu_bus_id", "gpu_part_number", "board_part_number",
    "conf_compute", "power_smoothing", "dramEncryption", "ofa", "jpeg",
}
# Fields whose values stay text even when they look like numbers.
_TEXT_FIELDS = {"timestamp", "driver_version", "name", "serial", "uuid", "vbios_version", "pstate",
                "compute_cap", "gpu_part_number", "board_part_number"}
_TEXT_ROOTS = {"inforom", "pci", "platform", "gsp"}
_OTHER_QUERY = re.compile(r"--query-(?!gpu\b)([\w-]+)")
_FIELD_NAME = re.compile(r"^([A-Za-z_][\w.]{0,127}+)(?:\s*+\[([^\]]{0,64}+)\])?$")
_UNIT_VALUE = re.compile(
    r"^([+-]?\d{1,30}+(?:\.\d{1,30}+)?)\s*+(MiB|GiB|KiB|MB|GB|KB|B|%|W|mW|MHz|GHz|C|us|ms|ns|s|V|mV|A|RPM|x)$")
_TYPED = re.compile(
    r"^(?:[+-]?\d{1,30}+(?:\.\d{1,30}+)?(?:\s*+(?:MiB|GiB|KiB|%|W|MHz|C|us|ms|s|V|A|RPM))?|"
    r"\[?N/A\]?|\[Not Supported\]|0x[0-9A-Fa-f]+|"
    + BUS_ID + r"|GPU-[0-9a-fA-F-]+|"
    r"\d{1,9}+(?:\.\d{1,9}+){1,6}+|P\d{1,2}+|Enabled|Disabled)$")
_IDENTITY = ("index", "uuid", "pci.bus_id")
# The shell's `time` report after the command (`real\t0m0,022s`, a locale's decimal comma).
_TIME_LINE = re.compile(r"^(?:real|user|sys)\s++\d{1,9}+m\d{1,9}+(?:[.,]\d{1,9}+)?s$")
# A logged list of CSV lines longer than this is not unpacked (literal_eval is not for big input).
_MAX_LITERAL_CHARS = 65536


@dataclass(frozen=True)
class NvidiaSmiQuery:
    """Rows of a --query-gpu CSV (see the module docstring)."""

    columns: tuple[str, ...]
    column_source: str
    units: dict = field(default_factory=dict)
    gpus: tuple[dict, ...] = ()
    looping: bool = False
    samples: tuple[dict, ...] = ()

    def to_dict(self) -> dict:
        return {
            "gpus": [dict(g) for g in self.gpus],
            "columns": list(self.columns),
            "column_source": self.column_source,
            "units": dict(self.units),
            "looping": self.looping,
            "samples": [dict(s) for s in self.samples],
        }


def canonical(name: str) -> str:
    """The header name nvidia-smi prints for a --query-gpu field or alias (units dropped)."""
    m = _FIELD_NAME.match(name.strip())
    base = m.group(1) if m else name.strip()
    return ALIASES.get(base, base)


def detect(text: str) -> bool:
    """True for an echoed `--query-gpu` command or a CSV header of known --query-gpu fields."""
    if re.search(r"--query-gpu[= ]", text):
        return True
    for line in text[:20000].splitlines()[:20]:
        names = _header_names(line)
        if names is not None and len(names) >= 2:
            return True
    return False


def parse(text: str) -> NvidiaSmiQuery:
    """Parse --query-gpu CSV output; column names come from the header or an echoed command."""
    return parse_query(text)


def parse_query(text: str, fields: list[str] | tuple[str, ...] | None = None) -> NvidiaSmiQuery:
    """Parse --query-gpu CSV output; `fields` (what was asked for) names the columns."""
    lines = lines_of(unwrap(text), KIND)
    cmd_fields, cmd_noheader = _command(lines)
    body = _body(lines)
    if not body:
        raise ParseError(KIND, "no CSV lines found")

    names: list[str] | None = [canonical(f) for f in fields] if fields else None
    source = "fields" if names else ""
    units: dict[str, str] = {}
    header = _header_names(body[0][1])
    header_at: int | None = None
    if header is not None and not (cmd_noheader and names is None and cmd_fields):
        header_at = 0
        units = {canonical(n): u for n, u in header if u}
        if names is None:
            names, source = [canonical(n) for n, _ in header], "header"
        elif len(header) != len(names):
            raise ParseError(KIND, f"header has {len(header)} columns but {len(names)} fields "
                                   f"were given", line=body[0][0])
    if names is None and cmd_fields:
        names, source = [canonical(f) for f in cmd_fields], "command"

    rows_text = body[header_at + 1:] if header_at is not None else body
    header_text = body[0][1].strip() if header_at is not None else None
    rows = _rows(rows_text, names, header_text)
    if names is None:
        width = len(rows[0][1])
        names, source = [f"col{i}" for i in range(width)], "positional"
        if not _has_typed_column(rows):
            raise ParseError(KIND, "header-less CSV without a command line, and no column looks "
                                   "like nvidia-smi data; pass fields=[...]", line=rows[0][0])
    records = [{name: _value(name, raw, units.get(name)) for name, raw in zip(names, values)}
               for _, values in rows]
    gpus, looping = _one_per_gpu(records)
    return NvidiaSmiQuery(columns=tuple(names), column_source=source, units=units,
                          gpus=tuple(gpus), looping=looping,
                          samples=tuple(records) if looping else ())


def _command(lines: list[str]) -> tuple[list[str] | None, bool]:
    """Fields and `noheader` from an echoed nvidia-smi command line, if the text has one."""
    for line in lines:
        cmd = command_echo(line, "nvidia-smi")
        if cmd is None:
            continue
        other = _OTHER_QUERY.search(cmd)
        if other and "--query-gpu" not in cmd:
            raise ParseError(KIND, f"this is --query-{other.group(1)} output, not --query-gpu")
        q = re.search(r"--query-gpu(?:=|\s+)['\"]?([^\s'\"]+)", cmd)
        if q is None:
            continue
        fmt = re.search(r"--format(?:=|\s+)['\"]?([^\s'\"]+)", cmd)
        noheader = bool(fmt and "noheader" in fmt.group(1).split(","))
        return [f for f in q.group(1).split(",") if f], noheader
    return None, False


def _body(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of every line that may be CSV: no prompts, echoes, elisions, blanks."""
    out: list[tuple[int, str]] = []
    for number, line in enumerate(lines, start=1):
        if command_echo(line, "nvidia-smi") is not None or is_elision(line):
            continue
        text = strip_prompt(line).strip() if re.match(r"^\s*[$#%>]\s*$", line) is None else ""
        if not text:
            continue
        unpacked = _python_list(text)
        if unpacked is not None:
            out.extend((number, item) for item in unpacked)
            continue
        out.append((number, text))
    return out


def _python_list(text: str) -> list[str] | None:
    """`['a, b', '']` (a CSV line logged as a Python list) -> ['a, b']; None for anything else."""
    if not (text.startswith("[") and text.endswith("]") and ("'" in text or '"' in text)):
        return None
    if len(text) > _MAX_LITERAL_CHARS:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        return None
    return [ln.strip() for v in value for ln in v.splitlines() if ln.strip()]


def _header_names(line: str) -> list[tuple[str, str | None]] | None:
    """[(name, unit)] when the line is a --query-gpu CSV header, else None."""
    parts = [p.strip() for p in line.strip().split(",")]
    out: list[tuple[str, str | None]] = []
    known = 0
    for part in parts:
        m = _FIELD_NAME.match(part)
        if m is None:
            return None
        name = m.group(1)
        if canonical(name).split(".")[0] in _KNOWN_ROOTS and (
                "." in name or "_" in name or m.group(2) or name in _KNOWN_ROOTS):
            known += 1
        out.append((name, m.group(2)))
    # a data row of bare words ("P0, Enabled") must not pass for a header
    return out if known and known * 2 >= len(parts) else None


def _rows(body: list[tuple[int, str]], names: list[str] | None,
          header_text: str | None) -> list[tuple[int, list[str]]]:
    rows: list[tuple[int, list[str]]] = []
    width = len(names) if names else None
    for number, text in body:
        if header_text is not None and text == header_text:
            continue   # header printed again (several runs pasted together)
        if _TIME_LINE.match(text):
            continue   # `time nvidia-smi ...`: the shell's timing lines
        values = [v.strip() for v in text.split(",")]
        if width is None:
            if len(values) < 2:
                continue
            width = len(values)
        if len(values) == width:
            rows.append((number, values))
        elif "," not in text and width > 1:
            continue   # a stray non-CSV line (log prefix, tool note)
        else:
            raise ParseError(KIND, f"expected {width} comma-separated values, found "
                                   f"{len(values)}: {text[:80]!r}", line=number)
    if not rows:
        failure = tool_failure([t for _, t in body])
        first = body[0][1] if body else ""
        detail = f": {(failure or first)[:120]}" if body else ""
        raise ParseError(KIND, f"no CSV rows found{detail}", line=body[0][0] if body else None)
    return rows


def _has_typed_column(rows: list[tuple[int, list[str]]]) -> bool:
    """Some column is nvidia-smi-like data and no cell looks like a table or prose."""
    if any(len(v) > 96 or re.search(r"\s{3,}|\t", v) for _, values in rows for v in values):
        return False
    width = len(rows[0][1])
    return any(all(_TYPED.match(values[i]) for _, values in rows) for i in range(width))


def _value(name: str, raw: str, unit: str | None):
    raw = raw.strip()
    if is_missing(raw):
        return None
    if name in _TEXT_FIELDS or name.split(".")[0] in _TEXT_ROOTS:
        return raw
    if unit and raw.endswith(unit):
        stripped = raw[: -len(unit)].strip()
        number = to_number(stripped)
        if number is not None:
            return number
    m = _UNIT_VALUE.match(raw)
    if m:
        return to_number(m.group(1))
    number = to_number(raw)
    return raw if number is None else number


def _one_per_gpu(records: list[dict]) -> tuple[list[dict], bool]:
    key = next((k for k in _IDENTITY if records and k in records[0]), None)
    if key is None:
        return records, False
    ids = [r.get(key) for r in records]
    if len(set(map(repr, ids))) == len(ids):
        return records, False
    latest: dict[str, dict] = {}
    for record, ident in zip(records, ids):
        latest[repr(ident)] = record          # dict keeps first-seen order, value = last sample
    return list(latest.values()), True
