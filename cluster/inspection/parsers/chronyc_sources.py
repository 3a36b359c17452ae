"""Parse `chronyc sources` (plain, `-v`, headerless, and `chronyc -c sources` CSV).

One row per time source: mode (^ server, = peer, # local reference clock), state
(* selected, + combined, - not combined, ? unusable/unreachable, x falseticker, ~ too variable),
name, stratum, poll (log2 s), reach (octal register), LastRx and the last sample
`adjusted[measured] +/- error` with units ns/us/ms/s (and m/h/d/y for huge offsets).

synchronized: a source is selected (`*`) and, when its adjusted offset is shown, that offset
is within max_offset_seconds (default 1.0 s). With no source lines but chrony's header
("Number of sources = 0", the column header) the answer is false; other text raises. When no
source is selected but the author cut rows out of the listing (`...`, `[...]` lines), the
answer is null: the selected row may be among those cut.
Lines of other reports pasted alongside (a following `chronyc tracking`) are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import (clean_lines, finite_float, head_text, numbered,
                                    require_text)

KIND = "chronyc-sources"

DEFAULT_MAX_OFFSET_SECONDS = 1.0

_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                 "m": 60.0, "h": 3600.0, "d": 86400.0, "y": 365 * 86400.0}
_U = r"(?:ns|us|µs|μs|ms|s|m|h|d|y)"
_NUM = r"[+-]?\d{1,20}+(?:\.\d{1,20}+)?(?:[eE][+-]?\d{1,3}+)?"
_ROW_RE = re.compile(
    r"^(?P<mode>[\^=#])(?P<state>[*+\-?x~ ]?)\s*+(?P<name>\S++)\s++(?P<stratum>\d{1,3}+)\s++"
    r"(?P<poll>-?\d{1,3}+)\s++(?P<reach>[0-7]{1,6}+)\s++(?P<lastrx>-|\d{1,12}+[smhdy]?)"
    rf"(?:\s++(?P<adj>{_NUM})\s*+(?P<adj_u>{_U})\s*+"
    rf"(?:\[\s*+(?P<meas>{_NUM})\s*+(?P<meas_u>{_U})\s*+\]\s*+"
    rf"(?:\+/-\s*+(?P<err>{_NUM})\s*+(?P<err_u>{_U}))?)?)?\s*+$"
)
_CSV_RE = re.compile(
    rf"^(?P<mode>[\^=#]),(?P<state>[*+\-?x~ ]),(?P<name>[^,]++),(?P<stratum>\d{{1,3}}+),"
    rf"(?P<poll>-?\d{{1,3}}+),(?P<reach>[0-7]{{1,6}}+),(?P<lastrx>-?\d{{1,12}}+),(?P<adj>{_NUM}),(?P<meas>{_NUM}),(?P<err>{_NUM})\s*$"
)
_ELISION_RE = re.compile(r"^\s*+(?:\.{3,}+|\[\s*+\.{3,}+\s*+\]|…|<\s*+snip(?:ped)?\s*+>)\s*+$",
                         re.IGNORECASE)
_COUNT_RE = re.compile(r"^\s*+(?:210\s++)?Number of sources\s*+=\s*+(?P<n>\d{1,9}+)\s*+$", re.IGNORECASE)
_HEADER_RE = re.compile(r"^\s*MS\s+Name/IP address\s+Stratum\s+Poll\s+Reach", re.IGNORECASE)

_MODES = {"^": "server", "=": "peer", "#": "local_refclock"}
_STATES = {"*": "selected", "+": "combined", "-": "not_combined", "?": "unusable",
           "x": "falseticker", "~": "too_variable", "": None, " ": None}


@dataclass(frozen=True)
class Source:
    """One row of `chronyc sources`; offsets in seconds (positive = local clock ahead)."""

    mode: str
    mode_name: str
    state: str | None
    state_name: str | None
    name: str
    stratum: int
    poll: int
    reach: str
    reachable: bool
    last_rx: str
    last_rx_seconds: int | None
    offset_seconds: float | None
    measured_offset_seconds: float | None
    error_seconds: float | None


@dataclass(frozen=True)
class Sources(Record):
    synchronized: bool | None
    selected: str | None
    offset_seconds: float | None
    number_of_sources: int | None
    sources: tuple[Source, ...]
    max_offset_seconds: float


def _seconds(num: str | None, unit: str | None) -> float | None:
    if num is None:
        return None
    value = finite_float(num)
    return None if value is None else round(value * _UNIT_SECONDS[unit or "s"], 12)


def _last_rx_seconds(value: str) -> int | None:
    m = re.fullmatch(r"(\d+)([smhdy]?)", value)
    if not m:
        return None
    n = int(m.group(1))
    return int(n * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "y": 365 * 86400}[m.group(2)])


def _source(m: re.Match, csv: bool) -> Source:
    state = m.group("state").strip() or None
    reach = m.group("reach")
    lastrx = m.group("lastrx")
    if csv:
        adj, meas, err = (finite_float(m.group(k)) for k in ("adj", "meas", "err"))
        # chrony's CSV prints the reach register in octal like the table, LastRx in seconds
        last_rx_seconds = None if lastrx.startswith("-") else int(lastrx)
        # a never-sampled source prints 4294967295 (uint32 -1)
        if last_rx_seconds is not None and last_rx_seconds >= 2 ** 32 - 1:
            last_rx_seconds, lastrx = None, "-"
    else:
        adj = _seconds(m.group("adj"), m.group("adj_u"))
        meas = _seconds(m.group("meas"), m.group("meas_u"))
        err = _seconds(m.group("err"), m.group("err_u"))
        last_rx_seconds = _last_rx_seconds(lastrx)
    for key, value in (("adj", adj), ("meas", meas), ("err", err)):
        if m.group(key) is not None and value is None:
            raise ParseError(KIND, f"sample value {m.group(key)!r} is not a finite number")
    mode = m.group("mode")
    return Source(
        mode=mode, mode_name=_MODES[mode], state=state, state_name=_STATES.get(state or ""),
        name=m.group("name"), stratum=int(m.group("stratum")), poll=int(m.group("poll")),
        reach=reach, reachable=int(reach, 8) != 0, last_rx=lastrx,
        last_rx_seconds=last_rx_seconds, offset_seconds=adj, measured_offset_seconds=meas,
        error_seconds=err,
    )


def parse(text: str, max_offset_seconds: float = DEFAULT_MAX_OFFSET_SECONDS) -> Sources:
    """Parse `chronyc sources [-v]` output.

    Returns Sources; to_dict():
        {"synchronized": true | false | null (no `*` row, but rows were cut out: `...`),
         "selected": "169.254.169.123", "offset_seconds": -3.07e-07,
         "number_of_sources": 1 | null, "max_offset_seconds": 1.0,
         "sources": [{"mode": "^", "mode_name": "server", "state": "*",
                      "state_name": "selected", "name": "169.254.169.123", "stratum": 3,
                      "poll": 4, "reach": "17", "reachable": true, "last_rx": "12",
                      "last_rx_seconds": 12, "offset_seconds": -3.07e-07,
                      "measured_offset_seconds": -3.023e-06, "error_seconds": 0.000445}]}
    Raises ParseError when there is neither a source row nor chrony's sources header.
    """
    lines = clean_lines(require_text(KIND, text))
    sources: list[Source] = []
    count: int | None = None
    header = False
    elided = False
    for _, line in numbered(lines):
        if _ELISION_RE.match(line):
            elided = True
            continue
        m = _ROW_RE.match(line.strip())
        if m:
            sources.append(_source(m, csv=False))
            continue
        m = _CSV_RE.match(line.strip())
        if m:
            sources.append(_source(m, csv=True))
            continue
        m = _COUNT_RE.match(line)
        if m:
            count = int(m.group("n"))
            continue
        if _HEADER_RE.match(line):
            header = True
    if not sources and count is None and not header:
        daemon_error = next((ln.strip() for ln in lines if re.match(r"^\s*5\d\d\s+\w", ln)), None)
        if daemon_error:
            raise ParseError(KIND, f"chronyc reported an error: {daemon_error!r}")
        raise ParseError(KIND, "no source line ('^* name stratum poll reach lastrx sample') found")
    selected = next((s for s in sources if s.state == "*"), None)
    synchronized: bool | None = selected is not None and (
        selected.offset_seconds is None or abs(selected.offset_seconds) <= max_offset_seconds)
    if selected is None and elided:
        synchronized = None
    return Sources(
        synchronized=synchronized,
        selected=selected.name if selected else None,
        offset_seconds=selected.offset_seconds if selected else None,
        number_of_sources=count, sources=tuple(sources), max_offset_seconds=max_offset_seconds,
    )


def detect(text: str) -> bool:
    """chrony's sources header, or at least one source row."""
    head = head_text(text)
    if re.search(r"^[ \t]*+MS[ \t]++Name/IP address[ \t]++Stratum[ \t]++Poll[ \t]++Reach", head,
                 re.MULTILINE):
        return True
    for line in head.splitlines()[:200]:
        if _ROW_RE.match(line.strip()) and re.search(rf"{_U}\s*\[", line):
            return True
        if _CSV_RE.match(line.strip()):
            return True
    return False
