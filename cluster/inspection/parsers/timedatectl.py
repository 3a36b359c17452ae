"""Parse `timedatectl` / `timedatectl status` / `timedatectl show`, every systemd generation.

The labels changed over the years; all map onto the same two facts:
  synchronized: "System clock synchronized: yes" (systemd >= 236),
                "NTP synchronized: yes" (<= 235), "NTPSynchronized=yes" (`show`, >= 239)
  ntp_active:   "NTP service: active|inactive|n/a" (>= 239),
                "systemd-timesyncd.service active: yes" (236-238),
                "Network time on: yes" (~ 220-235), "NTP enabled: yes" (<= 219), "NTP=yes" (`show`).
The machine-readable and timesyncd forms are read too: `timedatectl show` (Key=Value:
NTPSynchronized=yes, NTP=yes, Timezone=...), `timedatectl show-timesync` (ServerName=,
NTPMessage={ Leap=0, Stratum=2, ... }) and `timedatectl timesync-status` (Server:, Leap:,
Stratum:, Offset:, ...). These two print no synchronisation flag: synchronized is then judged
like chronyc's tracking, from what they do show (leap not "not synchronized", 0 < stratum < 16,
|Offset| <= 1 s), and null when the offset is not shown.
"n/a" (no NTP unit timedatectl knows of) is null, not false. When the output was pasted
several times, the last value wins. Weekday names may be localised; dates are read from
their digits only. rtc_offset_seconds is RTC minus system time (an RTC years off is a
warning sign of a node that booted without network time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import clean_lines, head_text, numbered, require_text

KIND = "timedatectl"

# `Key: value` labels of `timedatectl [status]` (every generation) and `timedatectl timesync-status`
_STATUS_KEYS = {"local time", "universal time", "rtc time", "time zone", "timezone",
                "system clock synchronized", "ntp synchronized", "ntp service", "ntp enabled",
                "network time on", "systemd-timesyncd.service active", "rtc in local tz",
                "dst active"}
_TIMESYNC_KEYS = {"server", "poll interval", "leap", "version", "stratum", "reference",
                  "precision", "root distance", "offset", "delay", "jitter", "packet count",
                  "frequency"}
# `Key=Value` properties of `timedatectl show` and `timedatectl show-timesync`
_SHOW_KEYS = {"Timezone", "LocalRTC", "CanNTP", "NTP", "NTPSynchronized", "TimeUSec", "RTCTimeUSec"}
_SHOW_TIMESYNC_KEYS = {"LinkNTPServers", "SystemNTPServers", "RuntimeNTPServers",
                       "FallbackNTPServers", "ServerName", "ServerAddress", "RootDistanceMaxUSec",
                       "PollIntervalMinUSec", "PollIntervalMaxUSec", "PollIntervalUSec",
                       "NTPMessage", "Frequency"}
_COMMAND_PREFIX_RE = re.compile(r"^\S{0,200}timedatectl(?:\s++status)?\s++")
_SHOW_LINE_RE = re.compile(r"^\s*+(?P<key>[A-Za-z]{1,40}+)=(?P<value>.*)$")
_MESSAGE_KEY_RE = re.compile(r"(?<![\w.])(?P<key>[A-Za-z]{1,40}+)=")
_SYNC_KEYS = {"system clock synchronized", "ntp synchronized", "NTPSynchronized"}
_NTP_KEYS = {"ntp service", "ntp enabled", "network time on", "systemd-timesyncd.service active",
             "NTP"}
_DATETIME_RE = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})")
_FAILURE_RE = re.compile(r"System has not been booted with systemd|Failed to (?:create bus "
                         r"connection|connect to bus|query server)|Can't operate", re.IGNORECASE)
_SPAN_PART_RE = re.compile(r"^(?P<num>[+-]?\d{1,20}(?:\.\d{1,20})?)(?P<unit>ns|us|µs|μs|ms|s|min|h|d)$")
_SPAN_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0,
               "h": 3600.0, "d": 86400.0}
_LEAP_NUMBERS = {"0": "normal", "1": "insert second", "2": "delete second", "3": "not synchronized"}
DEFAULT_MAX_OFFSET_SECONDS = 1.0


@dataclass(frozen=True)
class Timedatectl(Record):
    synchronized: bool | None
    ntp_active: bool | None
    ntp_service: str | None
    timezone: str | None
    rtc_in_local_tz: bool | None
    local_time: str | None
    universal_time: str | None
    rtc_time: str | None
    rtc_offset_seconds: int | None
    labels: str  # "status-new", "status-old", "show", "show-timesync", "timesync-status"
    server: str | None = None             # timesyncd's server (timesync-status, show-timesync)
    leap: str | None = None               # "normal", "not synchronized", ... (timesyncd)
    stratum: int | None = None            # the server's stratum (timesyncd)
    offset_seconds: float | None = None   # the last sample's offset (timesync-status)


def _yes_no(value: str | None) -> bool | None:
    if value is None:
        return None
    v = value.strip().lower()
    if v in ("yes", "active", "true", "1", "on"):
        return True
    if v in ("no", "inactive", "false", "0", "off"):
        return False
    return None


def _dt(value: str | None) -> datetime | None:
    if not value:
        return None
    m = _DATETIME_RE.search(value)
    if not m:
        return None
    try:
        return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
    except ValueError:   # 2024-13-45 99:99:99
        return None


def _timespan_seconds(value: str | None) -> float | None:
    """systemd's time span: '-1.087495s', '40.580ms', '1min 2.5s' -> seconds; else None."""
    if not value:
        return None
    parts = value.split()
    if not parts or len(parts) > 6:
        return None
    total = 0.0
    for part in parts:
        m = _SPAN_PART_RE.match(part)
        if m is None:
            return None
        total += float(m.group("num")) * _SPAN_UNITS[m.group("unit")]
    if parts[0].startswith("-"):   # "-1min 2s": the sign is the whole span's
        total = -abs(total)
    return round(total, 9)


def _fields(lines: list[str]) -> tuple[dict[str, str], set[str]]:
    """Every known field of the text, by label (last value wins), and which forms were seen."""
    fields: dict[str, str] = {}
    forms: set[str] = set()
    for _, line in numbered(lines):
        key, sep, value = line.partition(":")
        if sep:
            label = _COMMAND_PREFIX_RE.sub("", key.strip(), count=1).strip().lower()
            if label in _STATUS_KEYS:
                fields[label.replace("timezone", "time zone")] = value.strip()
                forms.add("status")
                continue
            if label in _TIMESYNC_KEYS:
                fields["timesync " + label] = value.strip()
                forms.add("timesync-status")
                continue
        m = _SHOW_LINE_RE.match(line)
        if m and m.group("key") in _SHOW_KEYS:
            fields[m.group("key")] = m.group("value").strip()
            forms.add("show")
        elif m and m.group("key") in _SHOW_TIMESYNC_KEYS:
            fields["show " + m.group("key")] = m.group("value").strip()
            forms.add("show-timesync")
    return fields, forms


def _message(value: str | None) -> dict[str, str]:
    """NTPMessage={ Leap=0, Version=4, Stratum=2, ... } -> {"Leap": "0", "Stratum": "2", ...}."""
    if not value:
        return {}
    body = value.strip().removeprefix("{").removesuffix("}")
    keys = list(_MESSAGE_KEY_RE.finditer(body))
    out: dict[str, str] = {}
    for k, m in enumerate(keys):
        end = keys[k + 1].start() if k + 1 < len(keys) else len(body)
        out.setdefault(m.group("key"), body[m.end():end].strip().rstrip(",").strip())
    return out


def _int_field(value: str | None) -> int | None:
    if value is None:
        return None
    m = re.match(r"^\s*+(\d{1,6})(?!\d)", value)
    return int(m.group(1)) if m else None


def _timesync(fields: dict[str, str]) -> tuple[str | None, str | None, int | None, float | None]:
    """(server, leap, stratum, offset seconds) from timesync-status or show-timesync fields."""
    message = _message(fields.get("show NTPMessage"))
    server = fields.get("timesync server") or fields.get("show ServerName")
    leap_raw = fields.get("timesync leap")
    if leap_raw is None and "Leap" in message:
        leap_raw = _LEAP_NUMBERS.get(message["Leap"], message["Leap"])
    leap = leap_raw.strip().lower() if leap_raw else None
    stratum = _int_field(fields.get("timesync stratum", message.get("Stratum")))
    offset = _timespan_seconds(fields.get("timesync offset"))
    return server, leap, stratum, offset


def _judge_timesync(leap: str | None, stratum: int | None, offset: float | None) -> bool | None:
    """False when a shown condition fails, None when the offset is not shown, else True."""
    checks = [None if leap is None else leap != "not synchronized",
              None if stratum is None else 0 < stratum < 16,
              None if offset is None else abs(offset) <= DEFAULT_MAX_OFFSET_SECONDS]
    if any(c is False for c in checks):
        return False
    return None if offset is None or leap is None else True


def parse(text: str) -> Timedatectl:
    """Parse timedatectl output.

    Returns Timedatectl; to_dict():
        {"synchronized": true | false | null, "ntp_active": true | false | null,
         "ntp_service": "active" | "inactive" | "n/a" | "yes" | "no" | null (the printed value),
         "timezone": "UTC (UTC, +0000)", "rtc_in_local_tz": false,
         "local_time": "Wed 2024-07-31 00:20:55 UTC", "universal_time": "...",
         "rtc_time": "Wed 2024-07-31 00:20:56" | "n/a", "rtc_offset_seconds": 1 | null,
         "labels": "status-new" | "status-old" | "show" | "show-timesync" | "timesync-status",
         "server": "91.189.94.4 (ntp.ubuntu.com)" | null, "leap": "normal" | null,
         "stratum": 2 | null, "offset_seconds": -0.001087 | null  (timesyncd forms)}
    Raises ParseError when no timedatectl field is found, or timedatectl could not talk to
    systemd ("System has not been booted with systemd as init system").
    """
    lines = clean_lines(require_text(KIND, text))
    fields, forms = _fields(lines)
    facts = _SYNC_KEYS | _NTP_KEYS | {"local time", "universal time", "time zone", "Timezone"}
    timesync = (forms & {"timesync-status", "show-timesync"}) and _timesync_enough(fields)
    if not facts & fields.keys() and not timesync:
        failure = next((ln.strip() for ln in lines if _FAILURE_RE.search(ln)), None)
        if failure:
            raise ParseError(KIND, f"timedatectl could not read the clock state: {failure!r}")
        raise ParseError(KIND, "no timedatectl field ('System clock synchronized', "
                               "'NTP synchronized', 'Local time', 'NTPSynchronized=', "
                               "timesync-status's 'Server:'/'Offset:', ...) found")

    sync_raw = next((fields[k] for k in ("system clock synchronized", "ntp synchronized",
                                         "NTPSynchronized") if k in fields), None)
    ntp_raw = next((fields[k] for k in ("ntp service", "systemd-timesyncd.service active",
                                        "network time on", "ntp enabled", "NTP")
                    if k in fields), None)
    rtc_local = _yes_no(fields.get("rtc in local tz", fields.get("LocalRTC")))
    rtc, ref = _dt(fields.get("rtc time")), _dt(
        fields.get("local time") if rtc_local else fields.get("universal time"))
    server, leap, stratum, offset = _timesync(fields)
    synchronized = _yes_no(sync_raw)
    if sync_raw is None and timesync:
        synchronized = _judge_timesync(leap, stratum, offset)
    if "system clock synchronized" in fields or "ntp service" in fields:
        labels = "status-new"
    elif "status" in forms and {"local time", "universal time"} & fields.keys():
        labels = "status-old"
    elif "show" in forms:
        labels = "show"
    elif "show-timesync" in forms and not ("timesync-status" in forms and offset is not None):
        labels = "show-timesync"
    elif "timesync-status" in forms:
        labels = "timesync-status"
    else:
        labels = "status-old"
    return Timedatectl(
        synchronized=synchronized,
        ntp_active=_yes_no(ntp_raw),
        ntp_service=ntp_raw,
        timezone=fields.get("time zone", fields.get("Timezone")),
        rtc_in_local_tz=rtc_local,
        local_time=fields.get("local time"),
        universal_time=fields.get("universal time"),
        rtc_time=fields.get("rtc time"),
        rtc_offset_seconds=int((rtc - ref).total_seconds()) if rtc and ref else None,
        labels=labels,
        server=server, leap=leap, stratum=stratum, offset_seconds=offset,
    )


def _timesync_enough(fields: dict[str, str]) -> bool:
    """timesyncd fields that identify the form: a server and its leap/stratum/offset/poll."""
    status = {k for k in fields if k.startswith("timesync ")}
    show = {k for k in fields if k.startswith("show ")}
    return (len(status) >= 3 and bool(status & {"timesync server", "timesync offset",
                                                  "timesync poll interval"})) or \
        (len(show) >= 2 and bool(show & {"show NTPMessage", "show ServerName",
                                         "show PollIntervalUSec"}))


def detect(text: str) -> bool:
    """Two or more timedatectl status labels, NTPSynchronized=, or the timesyncd forms."""
    head = head_text(text)
    if re.search(r"^[ \t]*+NTPSynchronized=(yes|no)[ \t]*+$", head, re.MULTILINE):
        return True
    fields, forms = _fields(head.splitlines()[:200])
    if (forms & {"timesync-status", "show-timesync"}) and _timesync_enough(fields):
        status = {k for k in fields if k.startswith("timesync ")}
        if "show-timesync" in forms or {"timesync server", "timesync poll interval"} <= status:
            return True
    hits = {k for k in fields if not k.startswith(("timesync ", "show ")) and k[:1].islower()}
    return len(hits) >= 2 and bool(hits & {"system clock synchronized", "ntp synchronized",
                                           "ntp service", "ntp enabled", "network time on",
                                           "universal time", "rtc in local tz"})
