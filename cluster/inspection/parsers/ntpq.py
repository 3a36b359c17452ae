"""Parse `ntpq -p` (peer billboard) and `ntpq -c rv` (system variables) from ntpd or NTPsec.

ntpq -p: one row per peer; the tally code in column 1 says what ntpd made of it
(`*` system peer, `o` PPS system peer, `+` candidate, `-` outlier, `x` falseticker,
`.` excess, `#` backup, blank reject). synchronized = there is a `*`/`o` peer, it is not
the undisciplined local clock (LOCAL(n) / .LOCL.; a GPS/PPS/WWVB refclock, also t=l, is
fine), and its offset is within max_offset_ms (default 1000 ms). offset_ms is that peer's
offset. Old (`disp` column, `remote local` header), NTPsec, wide (`-w`, the name on its own
line) and `-n` output are read too. "No association ID's returned" is an answer: no peers,
not synchronized.

ntpq -c rv: `status=0615 leap_none, sync_ntp, ...` then `key=value` pairs. synchronized =
leap is not `leap_alarm` (11), the sync source is not `sync_unspec` / `sync_local`,
stratum < 16, and |offset| within max_offset_ms. A value the text does not show is null.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import (clean_lines, finite_float, head_text, numbered,
                                    require_text)

KIND = "ntpq"

DEFAULT_MAX_OFFSET_MS = 1000.0

_NUM = r"[+-]?\d{1,20}+(?:\.\d{1,20}+)?(?:[eE][+-]?\d{1,3}+)?"
_UNIT = r"(?:ns|us|µs|ms|s)?"
_PEER_TAIL = (rf"(?P<refid>\S++)\s++(?P<st>\d{{1,3}}+)\s++(?P<t>[A-Za-z\-*])\s++"
              rf"(?P<when>-|\d{{1,12}}+[smhd]?)\s++(?P<poll>\d{{1,12}}+[smhd]?)\s++(?P<reach>[0-7]{{1,6}}+)\s++"
              rf"(?P<delay>{_NUM})(?P<delay_u>{_UNIT})\s++(?P<offset>{_NUM})(?P<offset_u>{_UNIT})\s++"
              rf"(?P<jitter>{_NUM})(?P<jitter_u>{_UNIT})\s*+$")
_PEER_RE = re.compile(rf"^(?P<tally>[ x.\-+#*o])(?P<remote>\S++)\s++{_PEER_TAIL}")
_WIDE_NAME_RE = re.compile(r"^(?P<tally>[ x.\-+#*o])(?P<remote>\S++)\s*+$")
_WIDE_TAIL_RE = re.compile(rf"^\s++{_PEER_TAIL}")
_PEER_HEADER_RE = re.compile(r"^\s*+remote\s++(?:refid|local)\s++st\s++t\s++when\s++poll\s++reach"
                             r"\s++delay\s++offset", re.IGNORECASE)
_STATUS_RE = re.compile(r"\bstatus=(?P<word>[0-9a-fA-F]{4})\s++(?P<text>[^\n]*+)")
_VAR_RE = re.compile(r"(?<![\w.])(?P<key>[A-Za-z_]\w{0,63}+)=(?P<value>\"[^\"\n]*+\"|[^,\s]*+)")
_TO_MS = {"": 1.0, "ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1000.0}
_SYNC_SOURCES = ("sync_unspec", "sync_pps", "sync_lf_radio", "sync_hf_radio", "sync_uhf_radio",
                 "sync_local", "sync_ntp", "sync_other", "sync_wristwatch", "sync_telephone")
_LEAP_NAMES = {"00": "leap_none", "01": "leap_add_sec", "10": "leap_del_sec", "11": "leap_alarm",
               "0": "leap_none", "1": "leap_add_sec", "2": "leap_del_sec", "3": "leap_alarm"}
_TALLY = {"*": "sys_peer", "o": "pps_peer", "+": "candidate", "-": "outlier", "x": "falseticker",
          ".": "excess", "#": "backup", " ": "reject"}


@dataclass(frozen=True)
class Peer:
    """One row of `ntpq -p`; times in ms."""

    tally: str
    status: str
    remote: str
    refid: str
    stratum: int
    type: str
    when: str
    poll: str
    reach: str
    delay_ms: float
    offset_ms: float
    jitter_ms: float


@dataclass(frozen=True)
class Ntpq(Record):
    synchronized: bool | None
    offset_ms: float | None
    source: str  # "peers" (ntpq -p) or "variables" (ntpq -c rv)
    system_peer: str | None
    stratum: int | None
    leap: str | None
    sync_source: str | None
    peers: tuple[Peer, ...]
    variables: dict
    max_offset_ms: float


def _ms(value: str, unit: str) -> float:
    number = finite_float(value)
    if number is None:
        raise ParseError(KIND, f"peer value {value!r} is not a finite number")
    return round(number * _TO_MS[unit], 9)


def _peer(tally: str, remote: str, m: re.Match) -> Peer:
    return Peer(tally=tally.strip() or " ", status=_TALLY[tally], remote=remote,
                refid=m.group("refid"), stratum=int(m.group("st")), type=m.group("t"),
                when=m.group("when"), poll=m.group("poll"), reach=m.group("reach"),
                delay_ms=_ms(m.group("delay"), m.group("delay_u")),
                offset_ms=_ms(m.group("offset"), m.group("offset_u")),
                jitter_ms=_ms(m.group("jitter"), m.group("jitter_u")))


def _is_local_clock(p: Peer) -> bool:
    # the undisciplined local clock driver (type 1), not a GPS/PPS/WWVB reference clock,
    # which ntpq also shows with t = l
    return (p.refid.upper() in (".LOCL.", "LOCAL") or p.remote.upper().startswith("LOCAL(")
            or p.remote.startswith("127.127.1."))


def _parse_peers(lines: list[str]) -> tuple[list[Peer], bool, bool]:
    peers: list[Peer] = []
    header = no_assoc = False
    pending: tuple[str, str] | None = None
    for _, line in numbered(lines):
        if _PEER_HEADER_RE.match(line):
            header = True
            pending = None
            continue
        if re.search(r"No association ID'?s returned", line, re.IGNORECASE):
            no_assoc = True
            continue
        m = _PEER_RE.match(line)
        if m:
            peers.append(_peer(m.group("tally"), m.group("remote"), m))
            pending = None
            continue
        if pending is not None:
            m = _WIDE_TAIL_RE.match(line)
            if m:
                peers.append(_peer(pending[0], pending[1], m))
                pending = None
                continue
        m = _WIDE_NAME_RE.match(line)
        if m and header and not re.fullmatch(r"=+", m.group("remote")):
            pending = (m.group("tally"), m.group("remote"))
        else:
            pending = None
    return peers, header, no_assoc


def _judge_offset(offset_ms: float | None, max_offset_ms: float) -> bool | None:
    return None if offset_ms is None else abs(offset_ms) <= max_offset_ms


def _from_peers(peers: list[Peer], max_offset_ms: float) -> Ntpq:
    sys_peer = next((p for p in peers if p.tally in ("*", "o")), None)
    if sys_peer is None:
        synchronized: bool | None = False
    elif _is_local_clock(sys_peer):
        synchronized = False
    else:
        synchronized = sys_peer.stratum < 16 and bool(_judge_offset(sys_peer.offset_ms, max_offset_ms))
    return Ntpq(synchronized=synchronized, offset_ms=sys_peer.offset_ms if sys_peer else None,
                source="peers", system_peer=sys_peer.remote if sys_peer else None,
                stratum=(sys_peer.stratum + 1 if sys_peer and sys_peer.stratum < 16 else None),
                leap=None, sync_source=None, peers=tuple(peers), variables={},
                max_offset_ms=max_offset_ms)


def _from_variables(text: str, max_offset_ms: float) -> Ntpq | None:
    variables: dict[str, str] = {}
    for m in _VAR_RE.finditer(text):
        value = m.group("value")
        if value.startswith('"'):
            value = value[1:-1]
        variables.setdefault(m.group("key"), value)
    status = _STATUS_RE.search(text)
    known = {"offset", "leap", "stratum", "sys_jitter", "refid", "rootdisp", "rootdelay",
             "precision", "reftime", "clock", "frequency", "clk_jitter"}
    if status is None and len(known & variables.keys()) < 2:
        return None
    leap = sync_source = None
    if status:
        word = int(status.group("word"), 16)
        leap = _LEAP_NAMES[format(word >> 14, "02b")]
        sync_source = _SYNC_SOURCES[(word >> 8) & 0x3F] if ((word >> 8) & 0x3F) < 10 else None
        words = status.group("text").lower()
        leap = next((w for w in _LEAP_NAMES.values() if w in words), leap)
        sync_source = next((w for w in _SYNC_SOURCES if re.search(rf"\b{w}\b", words)), sync_source)
    elif "leap" in variables:
        leap = _LEAP_NAMES.get(variables["leap"].strip())
    stratum = (int(variables["stratum"]) if re.fullmatch(r"[0-9]{1,6}", variables.get("stratum", ""))
               else None)
    offset_ms = finite_float(variables["offset"]) if "offset" in variables else None
    checks = [
        None if leap is None else leap != "leap_alarm",
        None if sync_source is None else sync_source not in ("sync_unspec", "sync_local"),
        None if stratum is None else 0 < stratum < 16,
        _judge_offset(offset_ms, max_offset_ms),
    ]
    if any(c is False for c in checks):
        synchronized: bool | None = False
    elif checks[0] is None or checks[3] is None:
        synchronized = None
    else:
        synchronized = True
    return Ntpq(synchronized=synchronized, offset_ms=offset_ms, source="variables",
                system_peer=None, stratum=stratum, leap=leap, sync_source=sync_source,
                peers=(), variables=variables, max_offset_ms=max_offset_ms)


def parse(text: str, max_offset_ms: float = DEFAULT_MAX_OFFSET_MS) -> Ntpq:
    """Parse `ntpq -p` / `ntpq -pn` / `ntpq -pw` or `ntpq -c rv` output.

    max_offset_ms: the largest |offset| still called synchronized (default 1000 ms).

    Returns Ntpq; to_dict():
        {"synchronized": true | false | null, "offset_ms": -26.064, "source": "peers" | "variables",
         "system_peer": "time.euro.apple" | null, "stratum": 3 | null,
         "leap": "leap_none" | "leap_add_sec" | "leap_del_sec" | "leap_alarm" | null,
         "sync_source": "sync_ntp" | ... | null, "max_offset_ms": 1000.0,
         "peers": [{"tally": "*", "status": "sys_peer", "remote": "time.euro.apple",
                    "refid": "17.72.133.55", "stratum": 2, "type": "u", "when": "596",
                    "poll": "1024", "reach": "377", "delay_ms": 18.19, "offset_ms": -26.064,
                    "jitter_ms": 40.024}],
         "variables": {"version": "ntpd 4.2.6p5...", "offset": "0.671", ...}  (ntpq -c rv)}
    Raises ParseError for text with neither peer rows nor system variables, and for ntpq's
    own errors ("ntpq: read: Connection refused": ntpd is not running).
    """
    text = require_text(KIND, text)
    lines = clean_lines(text)
    peers, header, no_assoc = _parse_peers(lines)
    if peers or no_assoc or header:
        return _from_peers(peers, max_offset_ms)
    result = _from_variables("\n".join(lines), max_offset_ms)
    if result is not None:
        return result
    err = next((ln.strip() for ln in lines if re.search(r"\bntpq: |Connection refused|"
                                                        r"timed out, nothing received", ln)), None)
    if err:
        raise ParseError(KIND, f"ntpq reported an error: {err!r}")
    raise ParseError(KIND, "no peer table ('remote refid st t when poll ...') and no "
                           "system variables ('status=... offset=...') found")


def detect(text: str) -> bool:
    """The `ntpq -p` column header or peer rows, or `associd=0 status=...` variables."""
    head = head_text(text)
    if re.search(r"^[ \t]*+remote[ \t]++(?:refid|local)[ \t]++st[ \t]++t[ \t]++when[ \t]++poll"
                 r"[ \t]++reach", head,
                 re.MULTILINE | re.IGNORECASE):
        return True
    if re.search(r"\bassocid=\d{1,9}+\s++status=[0-9a-fA-F]{4}\b", head):
        return True
    if re.search(r"\bstatus=[0-9a-fA-F]{4}\s++leap_\w", head):
        return True
    return sum(1 for line in head.splitlines()[:100] if _PEER_RE.match(line)) >= 2
