"""Parse `nvidia-smi nvlink` output (-s, -e, -c, -R, -p, -gt...) into one record per GPU link.

Every sub-command prints one `GPU <i>: <name> (UUID: GPU-...)` line per GPU followed by
`Link <n>: ...` or `Link <n>, ...` lines; several lines may describe the same link (-e prints
replay, recovery and CRC counters on three lines). They are merged into one record per link:

    {
      "nvlink": true | false | null,          # any link active: true; links shown, all
                                              # <inactive>: false; no link state shown: null
      "gpus": [{
          "index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-..." | null,
          "link_count": 18,                   # links shown for this GPU
          "active_links": 18 | null,          # links with a speed; null when no state is shown
          "links": [{
              "link": 0,
              "state": "active" | "inactive" | null,   # -s: speed -> active, <inactive>
              "speed_gbps": 26.562,                    # -s only
              "replay_errors": 0, "recovery_errors": 0, "crc_errors": 0,   # -e
              "p2p_is_supported": true, ...            # -c ("Link 0, P2P is supported: true")
              "<key>": value,          # any other "Key: value" (snake_case key; numbers as
                                       # numbers; "0 KiB" -> key "<key>_kib": 0)
          }, ...],
          "messages": ["..."],        # other lines under the GPU (driver notes), as printed
      }, ...],
    }

A GPU without NVLink prints just its GPU line; that parses to `links: []` (as does
`nvidia-smi -L`, which looks the same). Raises ParseError when there is no GPU line at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cluster.base.errors import ParseError
from cluster.inspection.parsers._lines import lines_of, strip_prompt, to_number, unwrap
from cluster.inspection.parsers._nvidia_text import (BUS_ID, command_echo, is_elision, is_missing, snake,
                                                      tool_failure)

KIND = "nvidia-smi-nvlink"

# Anchored, bounded patterns; the free text after a label is taken whole and split in Python.
_GPU_LINE = re.compile(r"^\s*+GPU\s++(\d{1,4}):(?=\s|$)(.*)$")
_BUS_ID = re.compile(r"^" + BUS_ID + r"$")
_LINK_LINE = re.compile(r"^\s*+Link\s++(\d{1,6}+)\s*+[:,](.*)$")
_SPEED = re.compile(r"^(\d{1,9}+(?:\.\d{1,9}+)?)\s*+GB/s$")
_UNIT_VALUE = re.compile(r"^([+-]?\d{1,30}+(?:\.\d{1,30}+)?)\s*+([A-Za-z/]{1,16}+)$")


def _gpu_name_uuid(rest: str) -> tuple[str | None, str | None]:
    """' NVIDIA H100 (UUID: GPU-...)' -> ('NVIDIA H100', 'GPU-...')."""
    rest = rest.strip()
    at = rest.rfind("(UUID:")
    if rest.endswith(")") and at >= 0 and ")" not in rest[at:-1]:
        return rest[:at].strip() or None, rest[at + 6:-1].strip() or None
    return rest or None, None


@dataclass(frozen=True)
class Gpu:
    """One GPU of the nvlink output with its links."""

    index: int
    name: str | None
    uuid: str | None
    links: tuple[dict, ...] = ()
    messages: tuple[str, ...] = ()

    @property
    def active_links(self) -> int | None:
        states = [link.get("state") for link in self.links]
        if not any(s is not None for s in states):
            return None
        return sum(1 for s in states if s == "active")

    def to_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "uuid": self.uuid,
                "link_count": len(self.links), "active_links": self.active_links,
                "links": [dict(link) for link in self.links], "messages": list(self.messages)}


@dataclass(frozen=True)
class NvidiaSmiNvlink:
    """nvidia-smi nvlink output (see the module docstring)."""

    gpus: tuple[Gpu, ...] = field(default_factory=tuple)

    @property
    def nvlink(self) -> bool | None:
        counts = [g.active_links for g in self.gpus if g.active_links is not None]
        if not counts:
            return None
        return any(c > 0 for c in counts)

    def to_dict(self) -> dict:
        return {"nvlink": self.nvlink, "gpus": [g.to_dict() for g in self.gpus]}


def detect(text: str) -> bool:
    """True for `GPU <i>: ...` lines followed by indented `Link <n>:` / `Link <n>,` lines."""
    return bool(re.search(r"(?m)^[ \t]*+GPU[ \t]++\d{1,4}:\s", text)
                and re.search(r"(?m)^[ \t]++Link[ \t]++\d{1,6}+[ \t]*+[:,]", text))


def parse(text: str) -> NvidiaSmiNvlink:
    """Parse nvidia-smi nvlink output; see the module docstring for the returned shape."""
    lines = lines_of(unwrap(text), KIND)
    gpus: list[dict] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip() or is_elision(raw) or command_echo(raw, "nvidia-smi") is not None:
            continue
        line = strip_prompt(raw) if not raw[:1].isspace() else raw
        gpu = _GPU_LINE.match(line)
        if gpu and not _LINK_LINE.match(line):
            name, uuid = _gpu_name_uuid(gpu.group(2))
            gpus.append({"index": int(gpu.group(1)), "name": name,
                         "uuid": uuid, "links": {}, "messages": []})
            continue
        link = _LINK_LINE.match(line)
        if link:
            if not gpus:
                raise ParseError(KIND, "link line before any 'GPU <i>:' line", line=number)
            record = gpus[-1]["links"].setdefault(int(link.group(1)), {"link": int(link.group(1))})
            _merge(record, link.group(2).strip(), number)
            continue
        if gpus and raw[:1].isspace():
            gpus[-1]["messages"].append(line.strip())
    if not gpus:
        failure = tool_failure(lines)
        if failure:
            raise ParseError(KIND, f"nvidia-smi did not run: {failure}")
        raise ParseError(KIND, "no 'GPU <i>: <name> (UUID: ...)' line found")
    return NvidiaSmiNvlink(tuple(
        Gpu(g["index"], g["name"], g["uuid"], tuple(g["links"].values()), tuple(g["messages"]))
        for g in gpus))


def _merge(record: dict, body: str, number: int) -> None:
    """Fold one `Link n: <body>` line into the link's record."""
    if body.lower() in ("<inactive>", "inactive", "<disabled>"):
        record["state"] = "inactive"
        return
    if _BUS_ID.match(body):
        record["remote_pci_bus_id"] = body
        return
    speed = _SPEED.match(body)
    if speed:
        record["state"] = "active"
        record["speed_gbps"] = float(speed.group(1))
        return
    # `Rx0: 0 KBytes, Tx0: 0 KBytes` carries two pairs on one line
    pairs = [p for p in re.split(r",\s++(?=[^,:]++:)", body) if p.strip()]
    for pair in pairs:
        if ":" not in pair:
            record.setdefault("notes", []).append(pair.strip())
            continue
        key, value = (s.strip() for s in pair.split(":", 1))
        _set(record, snake(key), value)


def _set(record: dict, key: str, value: str) -> None:
    if not key:
        return
    low = value.lower()
    if low in ("true", "false"):
        record[key] = low == "true"
        return
    if is_missing(value):
        record[key] = None
        return
    number = to_number(value)
    if number is not None:
        record[key] = number
        return
    unit = _UNIT_VALUE.match(value)
    if unit:
        record[f"{key}_{snake(unit.group(2))}"] = to_number(unit.group(1))
        return
    record[key] = value
