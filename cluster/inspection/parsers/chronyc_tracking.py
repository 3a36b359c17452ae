"""Parse `chronyc tracking` (and `chronyc -c tracking`): is this clock really in sync?

"System time : X seconds fast|slow of NTP time" is how far the system clock is from true
time right now: fast -> positive offset_seconds, slow -> negative (local minus true time).
In CSV mode (`chronyc -c tracking`) chrony prints the correction instead (positive = slow),
so the sign is flipped back.

synchronized is true only when every condition the text shows holds:
  - leap status is not "Not synchronised" (Normal, or a pending Insert/Delete second),
  - 0 < stratum < 16,
  - the reference is not chrony's own local clock (Reference ID 7F7F0101, `local stratum N`),
  - |offset_seconds| <= max_offset_seconds (default 1.0 s): a clock 7.8 s off that chrony is
    still slewing is NOT synchronized, whatever "Leap status: Normal" says,
  - the error bound chrony gives for the clock, root delay / 2 + root dispersion, is within
    max_offset_seconds too: a daemon that just started (root dispersion 48 s) does not yet know
    its clock to within a second, however small the offset it prints.
It is false as soon as one shown condition fails, and null when one is not shown (a cut paste).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import (clean_lines, finite_float, head_text, numbered,
                                    require_text)

KIND = "chronyc-tracking"

DEFAULT_MAX_OFFSET_SECONDS = 1.0

_KV_RE = re.compile(r"^\s*+(?P<key>Reference ID|Stratum|Ref time \(UTC\)|System time|Last offset|"
                    r"RMS offset|Frequency|Residual freq|Skew|Root delay|Root dispersion|"
                    r"Update interval|Leap status)\s*+:(?P<value>.*)$", re.IGNORECASE)
_NUM = r"[+-]?\d{1,20}+(?:\.\d{1,20}+)?(?:[eE][+-]?\d{1,3}+)?"
_SYSTEM_TIME_RE = re.compile(rf"^(?P<num>{_NUM})\s*+(?:seconds?)?\s*+(?P<dir>fast|slow)\b",
                             re.IGNORECASE)
_FREQ_RE = re.compile(rf"^(?P<num>{_NUM})\s*+ppm\s*+(?P<dir>fast|slow)?", re.IGNORECASE)
_REF_RE = re.compile(r"^(?P<id>[0-9A-Fa-f]{8}|\d{1,3}(?:\.\d{1,3}){3}|[^\s(]++)\s*+"
                     r"(?:\((?P<name>.*)\))?$")
_CSV_RE = re.compile(
    rf"^(?P<id>[0-9A-Fa-f]{{8}}),(?P<name>[^,]*),(?P<stratum>\d{{1,3}}+),(?P<reftime>{_NUM}),"
    rf"(?P<correction>{_NUM}),(?P<last>{_NUM}),(?P<rms>{_NUM}),(?P<freq>{_NUM}),"
    rf"(?P<resid>{_NUM}),(?P<skew>{_NUM}),(?P<delay>{_NUM}),(?P<disp>{_NUM}),"
    rf"(?P<interval>{_NUM}),(?P<leap>[A-Za-z][A-Za-z ]*+)$"
)
_LOCAL_REFIDS = {"7F7F0101", "127.127.1.1"}
_LEAPS = {"normal": "Normal", "insert second": "Insert second", "delete second": "Delete second",
          "not synchronised": "Not synchronised", "not synchronized": "Not synchronised"}


@dataclass(frozen=True)
class Tracking(Record):
    """What `chronyc tracking` reports, offsets in seconds (local minus true time)."""

    synchronized: bool | None
    offset_seconds: float | None
    stratum: int | None
    leap_status: str | None
    reference_id: str | None
    reference_name: str | None
    ref_time: str | None
    last_offset_seconds: float | None
    rms_offset_seconds: float | None
    frequency_ppm: float | None
    residual_freq_ppm: float | None
    skew_ppm: float | None
    root_delay_seconds: float | None
    root_dispersion_seconds: float | None
    update_interval_seconds: float | None
    max_offset_seconds: float


def _float(value: str | None) -> float | None:
    if value is None:
        return None
    m = re.match(rf"^\s*+({_NUM})", value)
    return finite_float(m.group(1)) if m else None


def _signed(value: str | None, regex: re.Pattern, positive: str) -> float | None:
    if value is None:
        return None
    m = regex.match(value.strip())
    if not m:
        return None
    value = finite_float(m.group("num"))
    if value is None:
        return None
    x = abs(value)
    direction = (m.group("dir") or "").lower()
    if not direction:
        return value
    return x if direction == positive else -x


def judge(*, leap_status: str | None, stratum: int | None, offset_seconds: float | None,
          reference_id: str | None, max_offset_seconds: float,
          root_delay: float | None = None, root_dispersion: float | None = None) -> bool | None:
    """False when a shown condition fails, None when one is missing, else True."""
    bound = None if root_dispersion is None else (root_delay or 0.0) / 2 + root_dispersion
    if bound is not None and bound > max_offset_seconds:
        return False
    checks: list[bool | None] = [
        None if leap_status is None else leap_status != "Not synchronised"
        and leap_status in ("Normal", "Insert second", "Delete second"),
        None if stratum is None else 0 < stratum < 16,
        None if offset_seconds is None else abs(offset_seconds) <= max_offset_seconds,
        None if reference_id is None else reference_id.upper() not in _LOCAL_REFIDS
        and reference_id not in ("00000000", "0.0.0.0"),
    ]
    if any(c is False for c in checks):
        return False
    if any(c is None for c in checks[:3]):
        return None
    return True


def _leap(value: str | None) -> str | None:
    if value is None:
        return None
    return _LEAPS.get(value.strip().lower(), value.strip())


def _from_csv(m: re.Match, max_offset_seconds: float) -> Tracking:
    keys = ("correction", "last", "rms", "freq", "resid", "skew", "delay", "disp", "interval")
    v = {k: finite_float(m.group(k)) for k in keys}
    bad = next((k for k in keys if v[k] is None), None)
    if bad is not None:
        raise ParseError(KIND, f"CSV field {bad} {m.group(bad)!r} is not a finite number")
    correction = v["correction"]
    offset = -correction if correction else 0.0
    leap = _leap(m.group("leap"))
    stratum = int(m.group("stratum"))
    return Tracking(
        synchronized=judge(leap_status=leap, stratum=stratum, offset_seconds=offset,
                           reference_id=m.group("id"), max_offset_seconds=max_offset_seconds,
                           root_delay=v["delay"], root_dispersion=v["disp"]),
        offset_seconds=offset, stratum=stratum, leap_status=leap,
        reference_id=m.group("id").upper(), reference_name=m.group("name") or None,
        ref_time=m.group("reftime"),
        last_offset_seconds=v["last"], rms_offset_seconds=v["rms"],
        frequency_ppm=v["freq"], residual_freq_ppm=v["resid"],
        skew_ppm=v["skew"], root_delay_seconds=v["delay"],
        root_dispersion_seconds=v["disp"],
        update_interval_seconds=v["interval"],
        max_offset_seconds=max_offset_seconds,
    )


def parse(text: str, max_offset_seconds: float = DEFAULT_MAX_OFFSET_SECONDS) -> Tracking:
    """Parse `chronyc tracking` output (the last report when several are pasted).

    max_offset_seconds: the largest |System time offset| still called synchronized (default 1 s).

    Returns Tracking; to_dict():
        {"synchronized": true | false | null, "offset_seconds": 0.000260112, "stratum": 3,
         "leap_status": "Normal" | "Insert second" | "Delete second" | "Not synchronised",
         "reference_id": "B280042C", "reference_name": "ntp1.bytestacker.com",
         "ref_time": "Thu Dec 06 06:04:02 2018", "last_offset_seconds": 8.5454e-05,
         "rms_offset_seconds": 0.000458358, "frequency_ppm": 35.646 (positive = runs fast),
         "residual_freq_ppm": 0.015, "skew_ppm": 0.554, "root_delay_seconds": 0.03114,
         "root_dispersion_seconds": 0.0188, "update_interval_seconds": 259.2,
         "max_offset_seconds": 1.0}
    Raises ParseError for text without tracking fields, or chronyc's own error
    ("506 Cannot talk to daemon": chronyd is not running).
    """
    lines = clean_lines(require_text(KIND, text))
    reports: list[dict[str, str]] = []
    current: dict[str, str] = {}
    csv_match = None
    for _, line in numbered(lines):
        m = _KV_RE.match(line)
        if m:
            key = m.group("key").lower()
            if key == "reference id" and current:
                reports.append(current)
                current = {}
            current.setdefault(key, m.group("value").strip())
            continue
        m = _CSV_RE.match(line.strip())
        if m:
            csv_match = m
    if current:
        reports.append(current)
    if not reports and csv_match is not None:
        return _from_csv(csv_match, max_offset_seconds)
    # a Stratum line alone is timesyncd's or ntpq's as much as chrony's
    useful = [r for r in reports if "system time" in r or "leap status" in r
              or ("stratum" in r and "reference id" in r)]
    if (not any("system time" in r for r in useful)
            and any(re.match(r"^\s*Remote address\s*:", ln, re.IGNORECASE) for ln in lines)):
        raise ParseError(KIND, "this is `chronyc ntpdata` (per-server data), not `chronyc tracking`")
    if not useful:
        daemon_error = next((ln.strip() for ln in lines if re.match(r"^\s*5\d\d\s+\w", ln)), None)
        if daemon_error:
            raise ParseError(KIND, f"chronyc reported an error: {daemon_error!r}")
        raise ParseError(KIND, "no 'System time', 'Stratum' or 'Leap status' line found")
    f = useful[-1]

    reference_id = reference_name = None
    if "reference id" in f:
        rm = _REF_RE.match(f["reference id"].strip())
        if rm:
            reference_id = rm.group("id")
            reference_name = (rm.group("name") or "").strip() or None
    system_time = f.get("system time")
    offset = _signed(system_time, _SYSTEM_TIME_RE, "fast")
    if system_time is not None and offset is None:
        raise ParseError(KIND, f"unreadable System time value {system_time!r}")
    stratum_text = f.get("stratum")
    stratum = (int(stratum_text) if stratum_text and re.fullmatch(r"[0-9]{1,6}", stratum_text.strip())
               else None)
    leap = _leap(f.get("leap status"))
    root_delay, root_dispersion = _float(f.get("root delay")), _float(f.get("root dispersion"))
    return Tracking(
        synchronized=judge(leap_status=leap, stratum=stratum, offset_seconds=offset,
                           reference_id=reference_id, max_offset_seconds=max_offset_seconds,
                           root_delay=root_delay, root_dispersion=root_dispersion),
        offset_seconds=offset, stratum=stratum, leap_status=leap,
        reference_id=reference_id, reference_name=reference_name,
        ref_time=f.get("ref time (utc)"),
        last_offset_seconds=_float(f.get("last offset")),
        rms_offset_seconds=_float(f.get("rms offset")),
        frequency_ppm=_signed(f.get("frequency"), _FREQ_RE, "fast"),
        residual_freq_ppm=_float(f.get("residual freq")),
        skew_ppm=_float(f.get("skew")),
        root_delay_seconds=root_delay,
        root_dispersion_seconds=root_dispersion,
        update_interval_seconds=_float(f.get("update interval")),
        max_offset_seconds=max_offset_seconds,
    )


def detect(text: str) -> bool:
    """`System time : ... of NTP time` or the Reference ID / Leap status pair, or the CSV form."""
    head = head_text(text)
    if re.search(r"^[ \t]*+System time[ \t]*+:.*\bof NTP time", head, re.MULTILINE | re.IGNORECASE):
        return True
    if (re.search(r"^[ \t]*+Reference ID[ \t]*+:", head, re.MULTILINE)
            and re.search(r"^[ \t]*+(Leap status|Root dispersion|Ref time \(UTC\))[ \t]*+:", head,
                          re.MULTILINE)
            and not re.search(r"^[ \t]*+Remote address[ \t]*+:", head, re.MULTILINE)):
        return True
    return any(_CSV_RE.match(line.strip()) for line in head.splitlines()[:50])
