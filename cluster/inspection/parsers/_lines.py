"""Text hygiene shared by the node-diagnostics parsers: clean lines, prompts, fleet captures, numbers.

Real captured output arrives with CRLF, ANSI colour, tabs, shell prompts, command echo lines and
the wrapping of the tool that ran it on many nodes: ansible ad-hoc headers (`host | CHANGED |
rc=0 >>`), pdsh/clush/srun prefixes (`node01: `, `10.1.2.3: `, `0: `), dshbak/clush -b and salt
blocks, `script` session markers, line numbers a paste tool added. This module is the ONE place
that removes that wrapping (clean_lines for one host, host_outputs to split several); parsers
match their own data lines first and treat whatever else they meet as noise.

Every pattern here is linear in its input: anchored, bounded or possessive quantifiers only.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

from cluster.base.errors import ParseError

# CSI (`ESC [ ... final`), OSC (`ESC ] ... BEL|ST`, window titles) and two-byte escapes. The OSC
# body stops at the next ESC/newline so an unterminated one costs no more than its own length.
_ANSI_RE = re.compile(r"\x1b\[[0-9;?<=>!]*+[ -/]*+[@-~]?|\x1b\][^\x07\x1b\n]*+(?:\x07|\x1b\\)?"
                      r"|\x1b[@-Z\\-_]?")
# C0 controls other than tab and newline (backspaces and bells of a `script` session), and DEL.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]++")
# The same characters for str.translate: on ASCII text (most tool output) ~8x faster than the
# pattern, which tests each character in Python's regex engine; on other text slower, so there
# the pattern stays (normalize_text).
_CONTROL_CHARS = dict.fromkeys([*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f])

# A shell prompt: "$", "#", "root@h:~#", "[u@h dir]$", "(venv) [u@h ~]$", "/sia #", "h:~ #",
# "bash-5.1$", "PS C:\>", "zira:~>". Possessive quantifiers: no backtracking over a long line.
_PROMPT_HEAD = (
    r"^\s*+(?:\([^)]*+\)\s*+)?"
    r"(?:\[[^\]]*+\]|[\w.\-]++@[^\s:#$%>]++(?::\S*)?|(?:PS )?[A-Za-z]:\\[^\s>]*+|[\w.\-]++:\S*"
    r"|[~/]\S*|[\w.\-]++)?"
    r"\s*+[#$%>❯➜]"
)
# A shell prompt followed by a command.
PROMPT_RE = re.compile(_PROMPT_HEAD + r"\s++(?P<command>\S.*)$")
_PROMPT_ONLY_RE = re.compile(_PROMPT_HEAD + r"$")


def lines_of(text: str, kind: str) -> list[str]:
    """The text's lines, normalised (normalize_text; no-break spaces as spaces), right-stripped.

    For parsers that read every line themselves (the NVIDIA tools'): no fleet unwrapping, no
    line cut. ParseError when the text is not a string or holds nothing but whitespace.
    """
    if not isinstance(text, str):
        raise ParseError(kind, f"expected text, got {type(text).__name__}")
    lines = [line.rstrip() for line in normalize_text(text).replace("\xa0", " ").split("\n")]
    if not any(line.strip() for line in lines):
        raise ParseError(kind, "empty input")
    return lines


def require_text(kind: str, text: Any) -> str:
    """The text itself, or ParseError when it is not a string or holds nothing but whitespace."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ParseError(kind, f"expected text, got {type(text).__name__}")
    if not text.strip():
        raise ParseError(kind, "empty input")
    return text


# No line of these tools is anywhere near this long; cutting keeps the work per line bounded
# on hostile input (a multi-megabyte line without newlines). Parsers read the first
# MAX_LINE_CHARS characters of a longer line; long_lines() counts the lines that were cut.
MAX_LINE_CHARS = 4096


def normalize_text(text: str) -> str:
    """CRLF/CR -> LF; BOM, NULs, ANSI escapes (colour, titles) and other control characters dropped."""
    text = text.replace("\ufeff", "").replace("\x00", "")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if "\x1b" in text:
        text = _ANSI_RE.sub("", text)
    return text.translate(_CONTROL_CHARS) if text.isascii() else _CONTROL_RE.sub("", text)


def long_lines(text: str, limit: int = MAX_LINE_CHARS) -> int:
    """How many lines of the text are longer than limit characters (what clean_lines cuts)."""
    count, start = 0, 0
    while True:
        end = text.find("\n", start)
        stop = len(text) if end < 0 else end
        if stop - start > limit:
            count += 1
        if end < 0:
            return count
        start = end + 1


def _split(text: str) -> list[str]:
    lines = [line[:MAX_LINE_CHARS].rstrip() for line in normalize_text(text).split("\n")]
    return strip_line_numbers([line for line in lines if not _SCRIPT_RE.match(line)])


def clean_lines(text: str) -> list[str]:
    """Lines of ONE host's output, unwrapped (index + 1 = line number of the unwrapped text).

    CR, ANSI escapes, NULs, BOM and trailing whitespace go; lines longer than MAX_LINE_CHARS
    are cut to that length; `script` session markers and paste line numbers are dropped; a
    fleet tool's wrapping of one host's output (ansible header, pdsh/clush prefix, dshbak or
    salt block) is removed. A capture of several hosts is returned as it is (see host_outputs).
    """
    lines = _split(text)
    outputs = _fleet(lines)
    if outputs is not None and len(outputs) == 1:
        return strip_line_numbers(list(outputs[0].lines))
    return lines


def plain_text(text: str) -> str:
    """The text normalised (CR, ANSI, controls, BOM), `script` markers and paste line numbers
    dropped, lines cut at MAX_LINE_CHARS; no fleet unwrapping."""
    return "\n".join(_split(text))


def unwrap(text: Any) -> Any:
    """The text of ONE host's output without its fleet-tool wrapping (see clean_lines); a text
    that is not a string is returned as it is (the parser's own check refuses it)."""
    return "\n".join(clean_lines(text)) if isinstance(text, str) else text


def head_text(text: str, chars: int = 20000) -> str:
    """The cleaned start of a text (its first host's, for a fleet capture), for detect()."""
    return host_outputs(text[:chars])[0].text if isinstance(text, str) else ""


# ---- fleet captures -------------------------------------------------------------------------

@dataclass(frozen=True)
class HostOutput:
    """One host's part of a fleet capture; host None when the text names no host."""

    host: str | None
    lines: tuple[str, ...]
    rc: int | None = None

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


_SCRIPT_RE = re.compile(r"^Script (?:started|done)(?: on |, (?:file|output log file) is )")
# ansible ad-hoc: "host | CHANGED | rc=0 >>" (then the output) or, with -o,
# "host | CHANGED | rc=0 | (stdout) line1\nline2" (the output on one line, \n escaped)
_ANSIBLE_RE = re.compile(
    r"^(?P<host>[^\s|]{1,253}) \| (?P<status>CHANGED|SUCCESS|FAILED!?|OK|SKIPPED|UNREACHABLE!?)"
    r" \| rc=(?P<rc>-?\d{1,6}) (?:>>|\| \(stdout\) ?(?P<inline>.*))$")
ANSIBLE_RC_NOTE = "non-zero return code"
# dshbak / clush -b: a dashed rule, the host (or node set "n[1-2] (2)"), a dashed rule
_RULE_RE = re.compile(r"^-{5,200}$")
_DSHBAK_HOST_RE = re.compile(r"^(?P<host>[A-Za-z0-9][\w.\-,\[\]]{0,252})(?: \(\d{1,6}\))?$")
# salt: "<minion-id>:" alone at column 0, the output indented by four spaces
_SALT_RE = re.compile(r"^(?P<host>[A-Za-z0-9][\w.\-]{0,252}):$")
# pdsh / clush / srun --label: "<host>: " before every line
_HOST_PREFIX_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9][\w.\-]{0,252}:)(?:\s|$)")
_LINE_NUMBER_RE = re.compile(r"^\s{0,12}(?P<n>\d{1,9}):(?: |$)")


def host_outputs(text: str) -> list[HostOutput]:
    """Each host's output in a fleet capture, unwrapped; [HostOutput(None, lines)] for plain text.

    Lines before the first host (the command echo) are kept in front of every host's lines.
    """
    lines = _split(text)
    outputs = _fleet(lines)
    if outputs is None:
        return [HostOutput(None, tuple(lines))]
    return [dataclasses.replace(o, lines=tuple(strip_line_numbers(list(o.lines)))) for o in outputs]


def _fleet(lines: list[str], depth: int = 2) -> list[HostOutput] | None:
    """The hosts of a fleet capture; one host's output is unwrapped once more (salt run
    through pdsh, ansible pasted with line prefixes)."""
    outputs = _ansible(lines) or _dshbak(lines) or _salt(lines) or _prefixed(lines)
    if outputs is not None and len(outputs) == 1 and depth > 1:
        inner = _fleet(list(outputs[0].lines), depth - 1)
        if inner is not None:
            return inner
    return outputs


def _ansible(lines: list[str]) -> list[HostOutput] | None:
    heads = [(i, m) for i, line in enumerate(lines) if " | " in line and (m := _ANSIBLE_RE.match(line))]
    if not heads:
        return None
    preamble = [ln for ln in lines[:heads[0][0]]]
    out: list[HostOutput] = []
    for n, (i, m) in enumerate(heads):
        end = heads[n + 1][0] if n + 1 < len(heads) else len(lines)
        if m.group("inline") is not None:
            body = m.group("inline").replace("\\r", "").split("\\n")
            body = [b.split(" (stderr) ")[0] if k == len(body) - 1 else b for k, b in enumerate(body)]
            body += lines[i + 1:end]
        else:
            body = list(lines[i + 1:end])
        rc = int(m.group("rc"))
        if rc != 0:
            body = _without_rc_tail(body)
        out.append(HostOutput(m.group("host"), tuple(preamble + body), rc))
    return out


def _without_rc_tail(body: list[str]) -> list[str]:
    """ansible appends 'non-zero return code' to a failed command's output with no newline
    before it: put it on its own line (an empty `grep` answer reads as that line alone)."""
    for k in range(len(body) - 1, -1, -1):
        if body[k].strip():
            if body[k].endswith(ANSIBLE_RC_NOTE) and body[k] != ANSIBLE_RC_NOTE:
                rest = body[k][: -len(ANSIBLE_RC_NOTE)]
                return body[:k] + [rest, ANSIBLE_RC_NOTE] + body[k + 1:]
            return body
    return body


def _dshbak(lines: list[str]) -> list[HostOutput] | None:
    heads = [i for i in range(len(lines) - 2) if _RULE_RE.match(lines[i])
             and _RULE_RE.match(lines[i + 2]) and _DSHBAK_HOST_RE.match(lines[i + 1])]
    if not heads:
        return None
    preamble = lines[:heads[0]]
    out = []
    for n, i in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        out.append(HostOutput(lines[i + 1].split(" (")[0], tuple(preamble + lines[i + 3:end])))
    return out


def _salt(lines: list[str]) -> list[HostOutput] | None:
    heads = [i for i, line in enumerate(lines) if line.endswith(":") and _SALT_RE.match(line)]
    if not heads:
        return None
    first = heads[0]
    after = [ln for ln in lines[first:] if ln.strip() and not prompt_only(ln)]
    if any(not (ln.startswith("    ") or _SALT_RE.match(ln)) for ln in after):
        return None
    if not any(ln.startswith("    ") for ln in after):
        return None
    before = lines[:first]
    preamble = [ln for ln in before if ln.strip() and not ln.startswith("    ")]
    if any(command_in(ln) is None and not prompt_only(ln) for ln in preamble):
        return None
    orphan = [ln[4:] for ln in before if ln.startswith("    ")]
    out = [HostOutput(None, tuple(preamble + orphan))] if orphan else []
    for n, i in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        body = [ln[4:] if ln.startswith("    ") else ln for ln in lines[i + 1:end]]
        out.append(HostOutput(lines[i][:-1], tuple(preamble + body)))
    return out


# Words a log puts before a colon on every line that are not hosts (a journal's or dmesg's own
# tags: `kernel: NVRM: Xid ...`), so they are never taken for a pdsh/clush prefix.
_LOG_TAGS = frozenset({"kernel", "nvrm", "systemd", "nvidia-fabricmanager", "nv-fabricmanager",
                       "nvidia-persistenced", "error", "warning", "info", "debug", "note"})


def _prefix_match(line: str):
    """The `host:` prefix of a line (None for none, or for a log's own tag such as kernel:)."""
    m = _HOST_PREFIX_RE.match(line)
    if m is None or m.group("prefix")[:-1].lower() in _LOG_TAGS:
        return None
    return m


def _host_like(prefix: str) -> bool:
    """A pdsh/clush prefix names a host: it carries a digit or a dot (node01, 10.1.2.3, gpu-a.x)."""
    return any(c.isdigit() or c == "." for c in prefix)


def _prefix_counts(rows: list[str]) -> dict[str, int]:
    """How many lines start with each `host:` prefix (a log's own tags excluded)."""
    counts: dict[str, int] = {}
    for line in rows:
        m = _prefix_match(line)
        if m:
            counts[m.group("prefix")] = counts.get(m.group("prefix"), 0) + 1
    return counts


def _prefixed(lines: list[str]) -> list[HostOutput] | None:
    """pdsh/clush/srun -l: one prefix on >= 90% of 3+ lines (or on every line, when it looks
    like a host: a digit or a dot in it), or several host-like ones on >= 90% of the lines."""
    rows = [line for line in lines if line.strip()]
    counts = _prefix_counts(rows)
    if not counts:
        return None
    prefix, n = max(counts.items(), key=lambda kv: kv[1])
    unprefixed = [ln for ln in rows if not _prefix_match(ln)]
    commands = sum(1 for ln in unprefixed if command_in(ln) is not None or prompt_only(ln))
    if (len(rows) >= 3 and n >= 0.9 * len(rows)) or (n == len(rows) and _host_like(prefix[:-1])):
        hosts = [prefix]
    else:
        hosts = [p for p in counts if _host_like(p[:-1])]
        covered = sum(counts[p] for p in hosts)
        if len(hosts) < 2 or covered < 0.9 * (len(rows) - commands):
            return None
    wanted = set(hosts)
    preamble: list[str] = []
    bodies: dict[str, list[str]] = {h: [] for h in hosts}
    for line in lines:
        m = _prefix_match(line)
        p = m.group("prefix") if m else None
        if p in wanted:
            bodies[p].append(line[len(p) + 1:])   # the prefix and the one space after it
        elif not any(bodies.values()):
            preamble.append(line)
        elif len(hosts) == 1:
            bodies[hosts[0]].append(line)
    return [HostOutput(h[:-1], tuple(preamble + bodies[h])) for h in hosts]


def strip_line_numbers(lines: list[str]) -> list[str]:
    """Drop `   160: ` line numbers a paste tool or `grep -n` put before every data line.

    Only when every non-blank line carries one, except prompts and one command line before the
    first, there are two or more, and the numbers rise strictly and do not start at 0 (`srun -l`
    task ids 0, 1, ... are host prefixes, not line numbers).
    """
    numbers: list[int] = []
    loose = 0
    for line in lines:
        if not line.strip() or prompt_only(line):
            continue
        m = _LINE_NUMBER_RE.match(line)
        if m:
            numbers.append(int(m.group("n")))
        elif numbers:
            return lines
        elif command_in(line) is None:
            loose += 1
            if loose > 1:
                return lines
    if len(numbers) < 2 or numbers[0] == 0 or any(b <= a for a, b in zip(numbers, numbers[1:])):
        return lines
    return [line[m.end():] if (m := _LINE_NUMBER_RE.match(line)) else line for line in lines]


def numbered(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for the non-blank lines."""
    for i, line in enumerate(lines, start=1):
        if line.strip():
            yield i, line


def command_in(line: str) -> str | None:
    """The command after a shell prompt on this line, or None when the line has no prompt."""
    m = PROMPT_RE.match(line)
    return m.group("command").strip() if m else None


def prompt_only(line: str) -> bool:
    """True for a line that is a shell prompt and nothing else (`#`, `(venv) [root@gpu3 ~]#`)."""
    return _PROMPT_ONLY_RE.match(line) is not None


def strip_prompt(line: str) -> str:
    """The line without a leading shell prompt: the command after it, '' for a prompt alone,
    the line as it is when it has none."""
    command = command_in(line)
    if command is not None:
        return command
    return "" if prompt_only(line) else line


# Digits a number of these tools may carry; more is not a measurement, and keeps int()/float()
# away from Python's 4300-digit limit and from overflowing to inf.
MAX_NUMBER_DIGITS = 40


def finite_float(value: str | None) -> float | None:
    """float(value) when it is a finite number of at most MAX_NUMBER_DIGITS digits, else None."""
    if value is None:
        return None
    value = value.strip()
    if not value or sum(c.isdigit() for c in value) > MAX_NUMBER_DIGITS:
        return None
    try:
        f = float(value)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,40}(?:\.\d{0,40})?|\.\d{1,40})(?:[eE][+-]?\d{1,4})?")
_INT_RE = re.compile(r"[+-]?\d{1,40}")


def to_number(value: str) -> int | float | None:
    """'200' -> 200, '83.92' -> 83.92, '1e-9' -> 1e-09 (an int only for an integer literal);
    anything else (NaN, inf, 1e400, 1_000, more than MAX_NUMBER_DIGITS digits) -> None."""
    value = value.strip()
    if not _NUMBER_RE.fullmatch(value) or sum(c.isdigit() for c in value) > MAX_NUMBER_DIGITS:
        return None
    if _INT_RE.fullmatch(value):
        return int(value)
    number = float(value)
    return number if math.isfinite(number) else None


def leading_int(value: str | None) -> int | None:
    """The integer (decimal or 0x hex) a field value starts with, else None ("4 (0x4)" -> 4)."""
    if value is None:
        return None
    m = re.match(r"^\s*+(0x[0-9a-fA-F]{1,32}|\d{1,40})(?![\w.])", value)
    if not m:
        return None
    return int(m.group(1), 16) if m.group(1).lower().startswith("0x") else int(m.group(1))


def tidy_number(x: float) -> int | float:
    """An int when the float is whole, else the float rounded to 6 significant decimals."""
    return int(x) if float(x).is_integer() else round(x, 6)


_BINARY_SUFFIX = {"": 1, "B": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4,
                  "P": 1024 ** 5, "E": 1024 ** 6, "Z": 1024 ** 7, "Y": 1024 ** 8}
_SIZE_RE = re.compile(r"^(?P<num>\d{1,30}(?:[.,]\d{1,30})?)\s*+(?P<unit>[KMGTPEZY]?)(?P<i>i?)"
                      r"(?P<b>[Bb]?)$", re.IGNORECASE)


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
    size = num * mult
    return int(round(size)) if math.isfinite(size) else None
