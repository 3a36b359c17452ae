"""Parse `timedatectl` / `timedatectl status` / `timedatectl show`, every systemd generation.

The labels changed over the years; all map onto the same two facts:
  synchronized: "System clock synchronized: yes" (systemd >= 236),
                "NTP synchronized: yes" (<= 235), "NTPSynchronized=yes" (`show`, >= 239)
  ntp_active:   "NTP service: active|inactive|n/a" (>= 239),
                "systemd-timesyncd.service active: yes" (236-238),
                "Network time on: yes" (~ 220-235), "NTP enabled: yes" (<= 219), "NTP=yes" (`show`).
"n/a" (no NTP unit timedatectl knows of) is null, not false. When the output was pasted
several times, the last value wins. Weekday names may be localised; dates are read from
their digits only. rtc_offset_seconds is RTC minus system time (an RTC years off is a
warning sign of a node that booted without network time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from cluster.errors import ParseError
from cluster.parsers._lines import clean_lines, head_text, jsonable, numbered, require_text

KIND = "timedatectl"

_STATUS_RE = re.compile(
    r"^\s*(?:\S*timedatectl(?:\s+status)?\s+)?(?P<key>Local time|Universal time|RTC time|Time ?zone|"
    r"System clock synchronized|NTP synchronized|NTP service|NTP enabled|Network time on|"
    r"systemd-timesyncd\.service active|RTC in local TZ|DST active)\s*:\s*(?P<value>.*?)\s*$",
    re.IGNORECASE)
_SHOW_RE = re.compile(r"^\s*(?P<key>Timezone|LocalRTC|CanNTP|NTP|NTPSynchronized|TimeUSec|"
                      r"RTCTimeUSec)=(?P<value>.*?)\s*$")
_SYNC_KEYS = {"system clock synchronized", "ntp synchronized", "NTPSynchronized"}
_NTP_KEYS = {"ntp service", "ntp enabled", "network time on", "systemd-timesyncd.service active",
             "NTP"}
_DATETIME_RE = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})")
_FAILURE_RE = re.compile(r"System has not been booted with systemd|Failed to (?:create bus "
                         r"connection|connect to bus|query server)|Can't operate", re.IGNORECASE)


@dataclass(frozen=True)
class Timedatectl:
    synchronized: bool | None
    ntp_active: bool | None
    ntp_service: str | None
    timezone: str | None
    rtc_in_local_tz: bool | None
    local_time: str | None
    universal_time: str | None
    rtc_time: str | None
    rtc_offset_seconds: int | None
    labels: str  # which generation of labels: "status-new", "status-old", "show"

    def to_dict(self) -> dict:
        return jsonable(self)


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
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S") if m else None


def parse(text: str) -> Timedatectl:
    """Parse timedatectl output.

    Returns Timedatectl; to_dict():
        {"synchronized": true | false | null, "ntp_active": true | false | null,
         "ntp_service": "active" | "inactive" | "n/a" | "yes" | "no" | null (the printed value),
         "timezone": "UTC (UTC, +0000)", "rtc_in_local_tz": false,
         "local_time": "Wed 2024-07-31 00:20:55 UTC", "universal_time": "...",
         "rtc_time": "Wed 2024-07-31 00:20:56" | "n/a", "rtc_offset_seconds": 1 | null,
         "labels": "status-new" | "status-old" | "show"}
    Raises ParseError when no timedatectl field is found, or timedatectl could not talk to
    systemd ("System has not been booted with systemd as init system").
    """
    lines = clean_lines(require_text(KIND, text))
    fields: dict[str, str] = {}
    show = False
    for _, line in numbered(lines):
        m = _STATUS_RE.match(line)
        if m:
            fields[m.group("key").lower().replace("timezone", "time zone")] = m.group("value")
            continue
        m = _SHOW_RE.match(line)
        if m:
            fields[m.group("key")] = m.group("value")
            show = True
    facts = _SYNC_KEYS | _NTP_KEYS | {"local time", "universal time", "time zone", "Timezone"}
    if not facts & fields.keys():
        failure = next((ln.strip() for ln in lines if _FAILURE_RE.search(ln)), None)
        if failure:
            raise ParseError(KIND, f"timedatectl could not read the clock state: {failure!r}")
        raise ParseError(KIND, "no timedatectl field ('System clock synchronized', "
                               "'NTP synchronized', 'Local time', ...) found")

    sync_raw = next((fields[k] for k in ("system clock synchronized", "ntp synchronized",
                                         "NTPSynchronized") if k in fields), None)
    ntp_raw = next((fields[k] for k in ("ntp service", "systemd-timesyncd.service active",
                                        "network time on", "ntp enabled", "NTP")
                    if k in fields), None)
    rtc_local = _yes_no(fields.get("rtc in local tz", fields.get("LocalRTC")))
    rtc, ref = _dt(fields.get("rtc time")), _dt(
        fields.get("local time") if rtc_local else fields.get("universal time"))
    if "system clock synchronized" in fields or "ntp service" in fields:
        labels = "status-new"
    elif show and not ({"local time", "universal time"} & fields.keys()):
        labels = "show"
    else:
        labels = "status-old"
    return Timedatectl(
        synchronized=_yes_no(sync_raw),
        ntp_active=_yes_no(ntp_raw),
        ntp_service=ntp_raw,
        timezone=fields.get("time zone", fields.get("Timezone")),
        rtc_in_local_tz=rtc_local,
        local_time=fields.get("local time"),
        universal_time=fields.get("universal time"),
        rtc_time=fields.get("rtc time"),
        rtc_offset_seconds=int((rtc - ref).total_seconds()) if rtc and ref else None,
        labels=labels,
    )


def detect(text: str) -> bool:
    """Two or more timedatectl status labels, or the NTPSynchronized= property."""
    head = head_text(text)
    if re.search(r"^\s*NTPSynchronized=(yes|no)\s*$", head, re.MULTILINE):
        return True
    hits = {m.group("key").lower() for line in head.splitlines()[:200]
            if (m := _STATUS_RE.match(line))}
    return len(hits) >= 2 and bool(hits & {"system clock synchronized", "ntp synchronized",
                                           "ntp service", "ntp enabled", "network time on",
                                           "universal time", "rtc in local tz"})
