"""Text hygiene shared by the node-diagnostics parsers: clean lines, prompts, numbers, sizes.

Real captured output arrives with CRLF, ANSI colour, tabs, shell prompts and command echo
lines. Parsers match their own data lines first and treat whatever else they meet as noise;
these helpers make that noise cheap to recognise and the numbers in between easy to read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator

from cluster.errors import ParseError

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")

# A shell prompt followed by a command: "$ cmd", "# cmd", "root@h:~# cmd", "[u@h dir]$ cmd",
# "(venv) [u@h ~]$ cmd", "/sia # cmd", "h:~ # cmd", "bash-5.1$ cmd", "PS C:\> cmd".
PROMPT_RE = re.compile(
    r"^\s*(?:\([^)]*\)\s*)?"
    r"(?:\[[^\]]*\]|[\w.\-]+@[^\s:#$%>]+(?::\S*)?|[\w.\-]+:\S*|[~/]\S*|[\w.\-]+|PS \S+)?"
    r"\s*[#$%>❯➜]\s+(?P<command>\S.*)$"
)


def require_text(kind: str, text: Any) -> str:
    """The text itself, or ParseError when it is not a string or holds nothing but whitespace."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ParseError(kind, f"expected text, got {type(text).__name__}")
    if not text.strip():
        raise ParseError(kind, "empty input")
    return text


# No line of these tools is anywhere near this long; cutting keeps every regex linear-time
# on hostile input (a multi-megabyte line without newlines).
MAX_LINE_CHARS = 4096


def clean_lines(text: str) -> list[str]:
    """Lines without CR, ANSI escapes, NULs, BOM or trailing whitespace (index + 1 = line number).

    Lines longer than MAX_LINE_CHARS are cut to that length.
    """
    text = text.replace("\ufeff", "").replace("\x00", "")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ANSI_RE.sub("", text)
    return strip_host_prefix([line[:MAX_LINE_CHARS].rstrip() for line in text.split("\n")])


def head_text(text: str, chars: int = 20000) -> str:
    """The cleaned start of a text, for cheap detect() checks."""
    return "\n".join(clean_lines(text[:chars])) if isinstance(text, str) else ""


_HOST_PREFIX_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9][\w.\-]*:)(?:\s|$)")


def strip_host_prefix(lines: list[str]) -> list[str]:
    """Drop a `node01: ` / `0: ` prefix that pdsh, clush or `srun --label` put on every line.

    Only when one and the same prefix starts at least 90% of the non-blank lines (and 3 or
    more of them), so a tool's own `Key: value` lines, which differ, are never touched.
    """
    rows = [line for line in lines if line.strip()]
    if len(rows) < 3:
        return lines
    counts: dict[str, int] = {}
    for line in rows:
        m = _HOST_PREFIX_RE.match(line)
        if m:
            counts[m.group("prefix")] = counts.get(m.group("prefix"), 0) + 1
    if not counts:
        return lines
    prefix, n = max(counts.items(), key=lambda kv: kv[1])
    if n < 0.9 * len(rows):
        return lines
    cut = len(prefix) + 1  # the prefix and the one space after it; the rest is the tool's
    return [line[cut:] if line.startswith(prefix) else line for line in lines]


def numbered(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for the non-blank lines."""
    for i, line in enumerate(lines, start=1):
        if line.strip():
            yield i, line


def command_in(line: str) -> str | None:
    """The command after a shell prompt on this line, or None when the line has no prompt."""
    m = PROMPT_RE.match(line)
    return m.group("command").strip() if m else None


def to_number(value: str) -> int | float | None:
    """'200' -> 200, '2.5' -> 2.5, anything else -> None."""
    value = value.strip()
    try:
        f = float(value)
    except ValueError:
        return None
    if f != f or f in (float("inf"), float("-inf")):
        return None
    return int(f) if f.is_integer() and re.fullmatch(r"[+-]?\d+(?:\.0*)?", value) else f


def leading_int(value: str | None) -> int | None:
    """The integer (decimal or 0x hex) a field value starts with, else None ("4 (0x4)" -> 4)."""
    if value is None:
        return None
    m = re.match(r"^\s*(0x[0-9a-fA-F]+|\d+)\b", value)
    if not m:
        return None
    return int(m.group(1), 16) if m.group(1).lower().startswith("0x") else int(m.group(1))


def tidy_number(x: float) -> int | float:
    """An int when the float is whole, else the float rounded to 6 significant decimals."""
    return int(x) if float(x).is_integer() else round(x, 6)


_BINARY_SUFFIX = {"": 1, "B": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4,
                  "P": 1024 ** 5, "E": 1024 ** 6, "Z": 1024 ** 7, "Y": 1024 ** 8}
_SIZE_RE = re.compile(r"^(?P<num>\d+(?:[.,]\d+)?)\s*(?P<unit>[KMGTPEZY]?)(?P<i>i?)(?P<b>[Bb]?)$",
                      re.IGNORECASE)


def human_size_bytes(value: str, *, si: bool = False) -> int | None:
    """'126G' -> bytes (powers of 1024 as df -h prints; powers of 1000 with si=True, df -H).

    Accepts '64M', '516K', '1.5T', '0', '4.0Ki', '64MB', '8kB'. None when it is not a size.
    """
    m = _SIZE_RE.match(value.strip())
    if not m:
        return None
    num = float(m.group("num").replace(",", "."))
    unit = m.group("unit").upper()
    if si and not m.group("i"):
        mult = 1000 ** " KMGTPEZY".index(unit or " ") if unit else 1
    else:
        mult = _BINARY_SUFFIX[unit]
    return int(round(num * mult))


def jsonable(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, recursively (for to_dict())."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    return obj

