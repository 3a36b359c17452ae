"""Parse the kernel log (`dmesg`, `dmesg -T`, `journalctl -k`) for NVIDIA Xid events.

An Xid is the driver's report of a GPU error: `NVRM: Xid (PCI:0000:3d:00): 43, pid=35521, ...`.
Xid 79 ("GPU has fallen off the bus") takes the GPU, and with it a whole tensor-parallel group,
away until the node is reset; so does the same message printed without an Xid
(`NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.`).

Returned shape (`parse(text).to_dict()`):

    {
      "xids": [{"pci": "0000:3d:00",            # as printed in the Xid line (no function);
                                               # null where the paste elided it (`PCI:...`)
                "xid": 43,
                "message": "pid=35521, Ch 00000008"}, ...],   # the rest of the line
      "aer": [{"pci": "0000:00:03.0",          # the device that reported it, as printed
               "driver": "pcieport",           # the kernel driver named before it
               "severity": "Uncorrected (Fatal)",   # as printed: Corrected, Correctable,
                                                    # Uncorrected (Non-Fatal) / (Fatal)
               "level": "fatal",               # corrected | non_fatal | fatal
               "type": "Transaction Layer"}, ...],  # the error's layer, as printed
      "fell_off_bus": ["0000:3b:00", ...],     # PCI ids of Xid 79 lines and of "fallen off
                                               # the bus" messages (also wrapped over lines:
                                               # `NVRM: The NVIDIA GPU 0000:b3:00.0` ...
                                               # `NVRM: fallen off the bus ...`), as printed,
                                               # first seen first
    }

`aer` holds the PCIe Advanced Error Reporting lines (`<driver> <bdf>: [AER: ]PCIe Bus Error:
severity=..., type=...`), one per error the kernel reported; AER lines come with or without
an Xid (a link that drops with AER alone is how a failing riser or slot shows first).

A log without Xids gives empty lists. Lines are cut at 4096 characters; patterns are anchored
at a literal and bounded (linear time). Timestamps are read in every form dmesg and journalctl
print: monotonic `[  12.345678]`, `dmesg -T` `[Wed Jan 27 23:04:35 2021]`, relative
`dmesg -d` / `--reltime` / `-H` lines `[  +0.000316]` with `[Dec 1 10:00]` headers,
`... kernel: ...`, and NVRM or AER lines with no stamp at all. Raises ParseError when no line
looks like a kernel log line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import clean_lines, head_text, require_text

KIND = "dmesg"

FELL_OFF_BUS_XID = 79

# `Xid (PCI:0000:3d:00): 43, pid=...`; MIG: `Xid (PCI:0000:01:00 GPU-I:05): 94, ...`
_XID = re.compile(r"Xid \((?:PCI:)?([0-9A-Fa-f][0-9A-Fa-f:.]{0,15}|\.{2,4})(?: [^)]{0,64})?\): "
                  r"(\d{1,5})\b,? ?(.*)$")
# `NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.` / `NVRM: GPU at PCI:0000:3b:00: ...`
_OFF_BUS = re.compile(r"GPU (?:at )?(?:PCI:)?([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
                      r"(?:\.[0-7])?)\b")
_MONOTONIC = re.compile(r"^\[ {0,12}\d{1,10}\.\d{1,9}\]")
_WALLCLOCK = re.compile(r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) [A-Z][a-z]{2} [ \d]\d "
                        r"\d\d:\d\d:\d\d \d{4}\]")
# `dmesg -d` / `--reltime` / `-H`: `[  +0.000316]`, `[+0.000316]`, and the minute headers
# `[Dec 1 10:00]` / `[Aug12 15:37]` (-H prints the month glued to a two-digit day).
_RELATIVE = re.compile(r"^\[ {0,12}\+ {0,4}\d{1,10}[.,]\d{1,9}\]")
_HUMAN_HEADER = re.compile(r"^\[[A-Z][a-z]{2} ?[ \d]\d \d\d:\d\d(?::\d\d)?\]")
# `pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, ...`
# (4.x+ kernels insert `AER: ` after the device); matched from the device before the literal.
_AER = re.compile(r"([\w.-]{1,64}) ([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]): (?:AER: {1,2})?"
                  r"PCIe Bus Error: severity=([A-Za-z][A-Za-z ()-]{0,40}?), ?type=([A-Za-z][A-Za-z ]{0,40})")
_AER_BEFORE = 160              # chars before "PCIe Bus Error" searched for "<driver> <bdf>: "
_JOURNAL_KERNEL = re.compile(r"^\S{1,32} {1,2}\d{1,2} \d\d:\d\d:\d\d \S{1,253} kernel: ")
_ISO_KERNEL = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S{0,32} \S{1,253} kernel: ")


@dataclass(frozen=True)
class Xid:
    """One Xid line."""

    pci: str | None
    xid: int
    message: str


@dataclass(frozen=True)
class Aer:
    """One PCIe AER error line."""

    pci: str
    driver: str
    severity: str
    level: str
    type: str


@dataclass(frozen=True)
class Dmesg(Record):
    """Xid events, GPUs that fell off the bus and PCIe AER errors (see the module docstring)."""

    xids: tuple[Xid, ...]
    fell_off_bus: tuple[str, ...]
    aer: tuple[Aer, ...] = ()


def _is_kernel_line(line: str) -> bool:
    return bool(_MONOTONIC.match(line) or _WALLCLOCK.match(line) or _RELATIVE.match(line)
                or _HUMAN_HEADER.match(line) or _JOURNAL_KERNEL.match(line)
                or _ISO_KERNEL.match(line) or "NVRM: " in line or _aer(line) is not None)


def _aer_level(severity: str) -> str:
    low = severity.lower()
    if low.startswith("correct"):
        return "corrected"
    return "fatal" if "non" not in low and "fatal" in low else "non_fatal"


def _aer(line: str) -> Aer | None:
    at = line.find("PCIe Bus Error: severity=")
    if at < 0:
        return None
    m = None
    for m in _AER.finditer(line, max(0, at - _AER_BEFORE), at + 120):
        break
    if m is None:
        return None
    severity = m.group(3).strip()
    return Aer(pci=m.group(2), driver=m.group(1), severity=severity, level=_aer_level(severity),
               type=m.group(4).strip())


def _xid(line: str) -> Xid | None:
    at = line.find("Xid (")
    if at < 0:
        return None
    m = _XID.match(line, at)
    if m is None:
        return None
    pci = None if m.group(1).startswith(".") else m.group(1)   # `PCI:...`: elided in the paste
    return Xid(pci=pci, xid=int(m.group(2)), message=m.group(3).strip())


def _gpu_named(line: str, end: int | None = None) -> str | None:
    """The PCI id after `GPU` / `GPU at` in the line (before `end`), or None."""
    m = _OFF_BUS.search(line, 0, len(line) if end is None else end)
    return m.group(1) if m else None


def _is_continuation(line: str) -> bool:
    """A wrapped kernel message: `               NVRM: fallen off the bus ...` (no stamp)."""
    return line[:1].isspace() and not _MONOTONIC.match(line.lstrip()) \
        and not _RELATIVE.match(line.lstrip())


def parse(text: str) -> Dmesg:
    """Parse a kernel log; see the module docstring for the returned shape."""
    lines = clean_lines(require_text(KIND, text))
    xids: list[Xid] = []
    off_bus: list[str] = []
    aer: list[Aer] = []
    kernel_lines = 0
    named: str | None = None   # the GPU a message wrapped over several lines is about
    for line in lines:
        if not line.strip():
            continue
        err = _aer(line)
        if err is not None:
            aer.append(err)
        if err is not None or _is_kernel_line(line):
            kernel_lines += 1
        xid = _xid(line)
        if xid is not None:
            xids.append(xid)
            if xid.xid == FELL_OFF_BUS_XID and xid.pci is not None and xid.pci not in off_bus:
                off_bus.append(xid.pci)
            named = None
            continue
        at = line.find("fallen off the bus")
        pci = _gpu_named(line, None if at < 0 else at)
        if pci is None and not _is_continuation(line):
            named = None
        named = pci or named
        if at >= 0 and named is not None and named not in off_bus:
            off_bus.append(named)
    if not kernel_lines:
        raise ParseError(KIND, "no kernel log line (`[  12.345678] ...`, `[  +0.000316] ...`, "
                               "`[Wed Jan 27 23:04:35 2021] ...`, `... kernel: ...`, `NVRM: ...` "
                               "or a PCIe AER line) found")
    return Dmesg(xids=tuple(xids), fell_off_bus=tuple(off_bus), aer=tuple(aer))


def detect(text: str) -> bool:
    """Mostly kernel log lines, or an NVRM Xid line."""
    rows = [line for line in head_text(text).splitlines() if line.strip()]
    if any(_xid(line) is not None and "NVRM" in line for line in rows):
        return True
    kernel = sum(1 for line in rows if _is_kernel_line(line))
    return kernel >= 1 and kernel * 2 >= len(rows)
