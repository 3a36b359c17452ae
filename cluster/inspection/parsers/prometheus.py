"""Parse Prometheus text exposition (format 0.0.4, and OpenMetrics' `# EOF`) into its samples.

The one reader of /metrics pages (vLLM's, Ray Serve's) for the laptop side: cluster/serving/bench.py
sums a counter with it, cluster/serving/serving_health.py reads gauges and histograms from it.

    parse(text)               -> Exposition(samples=(Sample(name, labels, value), ...))
    total(samples, name)      -> sum of the finite values of `name` over its label sets, or None
    parse_value("+Inf")       -> inf   (a sample value or a histogram bucket's `le` label)

Comments (`# HELP`, `# TYPE`, any `#` line) and blank lines are skipped; every other line must
be `name[{label="value",...}] value [timestamp]`, else ParseError names its line. Label values
keep their escapes' meaning (`\\"`, `\\\\`, `\\n`). Values are the format's: a decimal or
exponent literal, or the tokens +Inf, -Inf, NaN; a literal that overflows a float (1e999) or
has more than MAX_NUMBER_CHARS characters is garbage, not infinity. Infinite and NaN values are
kept as they are (a gauge may be NaN); `total` leaves them out.

Linear in its input: one pass per line, no regular expression that backtracks, lines capped
at MAX_LINE_CHARS (a longer line is a ParseError, not a cut).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from cluster.base.errors import ParseError

KIND = "prometheus"

# Ray's label sets (WorkerId, SessionName, ...) make its lines a few hundred characters long.
MAX_LINE_CHARS = 16384
MAX_NUMBER_CHARS = 64

_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,40}(?:\.\d{0,40})?|\.\d{1,40})(?:[eE][+-]?\d{1,4})?")
_SPECIAL = {"+inf": math.inf, "inf": math.inf, "-inf": -math.inf, "nan": math.nan,
            "+nan": math.nan, "-nan": math.nan}
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


@dataclass(frozen=True)
class Sample:
    """One sample line: name, labels (sorted (key, value) pairs), value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str, default: str | None = None) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return default


@dataclass(frozen=True)
class Exposition:
    """A whole /metrics page: its samples in page order."""

    samples: tuple[Sample, ...]

    def to_dict(self) -> dict:
        return {"samples": [{"name": s.name, "labels": dict(s.labels),
                             "value": s.value if math.isfinite(s.value) else str(s.value)}
                            for s in self.samples]}

    def names(self) -> frozenset[str]:
        return frozenset(s.name for s in self.samples)


def parse_value(text: str, lineno: int = 0) -> float:
    """A sample value or `le` bound: a decimal literal, +Inf/-Inf/NaN; ParseError otherwise."""
    special = _SPECIAL.get(text.lower()) if len(text) <= 4 else None
    if special is not None:
        return special
    if len(text) > MAX_NUMBER_CHARS or not _NUMBER_RE.fullmatch(text):
        raise ParseError(KIND, f"not a number: {text[:40]!r}", line=lineno or None)
    value = float(text)
    if math.isinf(value):
        raise ParseError(KIND, f"number out of range: {text[:40]!r}", line=lineno or None)
    return value


def _is_name_char(ch: str, first: bool) -> bool:
    return ch.isascii() and (ch.isalpha() or ch in "_:" or (not first and ch.isdigit()))


def _name_end(line: str, start: int) -> int:
    """Index after the metric or label name that starts at line[start] (start: none)."""
    i = start
    while i < len(line) and _is_name_char(line[i], i == start):
        i += 1
    return i


def _label_value(line: str, start: int, lineno: int) -> tuple[str, int]:
    """The quoted value whose opening quote is line[start - 1]; returns (value, index after it)."""
    value, k, n = [], start, len(line)
    while k < n and line[k] != '"':
        if line[k] == "\\" and k + 1 < n:
            value.append(_ESCAPES.get(line[k + 1], line[k + 1]))
            k += 2
        else:
            value.append(line[k])
            k += 1
    if k >= n:
        raise ParseError(KIND, "unterminated label value", line=lineno)
    return "".join(value), k + 1


def _labels(line: str, start: int, lineno: int) -> tuple[tuple[tuple[str, str], ...], int]:
    """Labels from line[start] == '{'; returns (sorted pairs, index after '}')."""
    pairs, i, n = [], start + 1, len(line)
    while True:
        while i < n and line[i] in " \t,":
            i += 1
        if i < n and line[i] == "}":
            return tuple(sorted(pairs)), i + 1
        j = _name_end(line, i)
        if j == i or j + 1 >= n or line[j] != "=" or line[j + 1] != '"':
            raise ParseError(KIND, "malformed label set", line=lineno)
        key = line[i:j]
        value, i = _label_value(line, j + 2, lineno)
        pairs.append((key, value))


def _sample(line: str, lineno: int) -> Sample:
    """One `name[{labels}] value [timestamp]` line (stripped, not a comment)."""
    i = _name_end(line, 0)
    if i == 0:
        raise ParseError(KIND, f"not a metric line: {line[:60]!r}", line=lineno)
    name, labels = line[:i], ()
    if i < len(line) and line[i] == "{":
        labels, i = _labels(line, i, lineno)
    elif i < len(line) and not line[i].isspace():
        raise ParseError(KIND, f"not a metric line: {line[:60]!r}", line=lineno)
    fields = line[i:].split()
    if not fields or len(fields) > 2:
        raise ParseError(KIND, f"expected a value after {name}", line=lineno)
    if len(fields) == 2:
        parse_value(fields[1], lineno)  # the timestamp: a number, not kept
    return Sample(name, labels, parse_value(fields[0], lineno))


def parse(text: str) -> Exposition:
    """A /metrics page -> its samples; ParseError (with the line) on a line that is none."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ParseError(KIND, f"expected text, got {type(text).__name__}")
    out = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if len(raw) > MAX_LINE_CHARS:
            raise ParseError(KIND, f"line longer than {MAX_LINE_CHARS} characters", line=lineno)
        line = raw.strip()
        if line and not line.startswith("#"):
            out.append(_sample(line, lineno))
    return Exposition(tuple(out))


def total(samples: Iterable[Sample], name: str) -> float | None:
    """The sum of the finite values of metric `name` over its label sets; None when absent
    (or when every value is NaN or infinite: those carry no count)."""
    found = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
    return math.fsum(found) if found else None
