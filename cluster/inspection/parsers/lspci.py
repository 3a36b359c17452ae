"""Parse `lspci -vvv` (whole, or `| grep ACSCtl` excerpts): PCI devices and their ACS control bits.

PCIe Access Control Services on a bridge or switch port redirect peer-to-peer traffic (GPU to
GPU, GPU to NIC) up through the root complex: NCCL hangs or crawls. NVIDIA's troubleshooting
guide says to disable it. `ACSCtl:` is the control register (what is on); `ACSCap:` (what the
device could do) is not read.

Returned shape (`parse(text).to_dict()`):

    {
      "devices": [{
          "bdf": "40:01.1" | "0000:40:01.1" | null,     # as printed; null in a grep excerpt
          "description": "PCI bridge: Advanced Micro Devices, Inc. [AMD] ..." | null,
          "acs_ctl": {"SrcValid": true, "TransBlk": false, "ReqRedir": true, "CmpltRedir": true,
                      "UpstreamFwd": true, "EgressCtrl": false, "DirectTrans": false} | null,
                      # null: the device shows no ACSCtl line; a bit not printed is null
      }, ...],
      "acs_enabled": true | false | null,
          # true: some ACSCtl line has SrcValid+, ReqRedir+, CmpltRedir+ or UpstreamFwd+;
          # false: ACSCtl lines, none with those, or capabilities shown and no ACSCtl at all;
          # null: nothing shows capabilities (plain `lspci`, or `<access denied>` as non-root)
    }

In a grep excerpt (no device lines) each ACSCtl line is one device with bdf and description
null. Lines are cut at 4096 characters and matched by anchored, bounded patterns (linear time).
Raises ParseError when the text has neither a device line nor an ACSCtl line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import clean_lines, command_in, head_text, require_text

KIND = "lspci"

ACS_BITS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl",
            "DirectTrans")
# the bits that redirect or block peer-to-peer traffic (issue 16: ACS "enabled")
ACS_ENABLING = ("SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd")

# `40:01.1 PCI bridge: ...`, `0000:3b:00.0 3D controller: ...` at the start of a line
_DEVICE = re.compile(r"^((?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]) "
                     r"([^:\s][^:]{0,80}: \S.*)$")
_BIT = re.compile(r"^([A-Za-z]{1,24})([+-])$")


@dataclass(frozen=True)
class Device:
    """One PCI function; fields the text does not show are None."""

    bdf: str | None
    description: str | None
    acs_ctl: dict | None


@dataclass(frozen=True)
class Lspci(Record):
    """Devices and whether ACS is enabled on any of them (see the module docstring)."""

    devices: tuple[Device, ...]
    acs_enabled: bool | None


def _acs_ctl(line: str) -> dict | None:
    """The bits of an `ACSCtl:` line (`SrcValid+ TransBlk- ...`), or None for any other line."""
    stripped = line.strip()
    if not stripped.startswith("ACSCtl:"):
        return None
    bits: dict = dict.fromkeys(ACS_BITS)
    for token in stripped[len("ACSCtl:"):].split():
        m = _BIT.match(token)
        if m and m.group(1) in bits:
            bits[m.group(1)] = m.group(2) == "+"
    return bits


def parse(text: str) -> Lspci:
    """Parse lspci output; see the module docstring for the returned shape."""
    lines = clean_lines(require_text(KIND, text))
    devices: list[dict] = []
    current: dict | None = None
    capabilities_shown = False
    for line in lines:
        if not line.strip() or command_in(line) is not None and "lspci" in line:
            continue
        m = _DEVICE.match(line)
        if m:
            current = {"bdf": m.group(1), "description": m.group(2).strip(), "acs_ctl": None}
            devices.append(current)
            continue
        if line.strip().startswith("Capabilities: [") or line.strip().startswith("ACSCap:"):
            capabilities_shown = True
        bits = _acs_ctl(line)
        if bits is None:
            continue
        capabilities_shown = True
        if current is None or current["acs_ctl"] is not None:
            # a grep excerpt: one ACSCtl line per device, the device lines cut
            current = {"bdf": None, "description": None, "acs_ctl": None}
            devices.append(current)
        current["acs_ctl"] = bits
        if current["bdf"] is None:
            current = None
    if not devices:
        raise ParseError(KIND, "no lspci device line (`40:01.1 PCI bridge: ...`) and no "
                               "`ACSCtl:` line found")
    enabled = any(d["acs_ctl"] and any(d["acs_ctl"][b] for b in ACS_ENABLING) for d in devices)
    return Lspci(
        devices=tuple(Device(**d) for d in devices),
        acs_enabled=True if enabled else (False if capabilities_shown else None),
    )


def detect(text: str) -> bool:
    """An `ACSCtl:` line, or two lspci device lines (`0000:3b:00.0 3D controller: ...`)."""
    head = head_text(text)
    devices = 0
    for line in head.splitlines():
        if _acs_ctl(line) is not None:
            return True
        if _DEVICE.match(line):
            devices += 1
            if devices >= 2:
                return True
    return False
