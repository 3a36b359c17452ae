"""Parse `ibv_devinfo` (rdma-core / libibverbs): HCAs and their ports, plain and `-v`.

`hca_id:` opens a device, `port: N` opens a port; keys are assigned by name, not by
indentation (pastes collapse it). States such as `PORT_ACTIVE (4)` are normalised to the
vocabulary ibstat uses (Active, Down, Init, Armed, Polling; physical LinkUp, Polling, ...).
The plain output shows no rate: rate_gbps is null unless `-v` prints active_width and
active_speed, then rate_gbps = lanes x per-lane speed (4X x 25.0 Gbps = 100).
`ibv_devinfo -l` (names only) gives devices without ports; "No IB devices found" gives none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.inspection.parsers._lines import (clean_lines, head_text, leading_int, numbered,
                                    require_text, tidy_number)
from cluster.inspection.parsers.ibstat import (CaBlocks, Ibstat, PortState, key_value, normalize_link_layer,
                                    normalize_physical_state, normalize_state, strip_code)

KIND = "ibv_devinfo"

_HCA_RE = re.compile(r"^\s*+hca_id\s*+:\s*+(?P<ca>\S++)\s*+$")
_PORT_RE = re.compile(r"^\s*+port\s*+:\s*+(?P<port>\d{1,5}+)\s*+$")
_KEY_RE = re.compile(r"[A-Za-z_][\w\[\] .]*+")
_GID_RE = re.compile(r"^\s*+GID\[\s*+(?P<index>\d{1,6}+)\s*+\]\s*+:\s*+(?P<gid>[0-9a-fA-F:.]++)"
                     r"(?:\s*+,\s*+(?P<type>.+))?$")
_LIST_HEADER_RE = re.compile(r"^\s*+(?P<n>\d{1,6}+)\s++HCAs?\s++found\s*+:?\s*+$", re.IGNORECASE)

_DEVICE_KEYS = {"transport", "fw_ver", "node_guid", "sys_image_guid", "vendor_id",
                "vendor_part_id", "hw_ver", "board_id", "phys_port_cnt"}
_PORT_KEYS = {"state", "max_mtu", "active_mtu", "sm_lid", "port_lid", "port_lmc", "link_layer",
              "phys_state", "active_width", "active_speed", "max_msg_sz", "port_cap_flags",
              "gid_tbl_len", "subnet_timeout", "sm_sl"}


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: str | None


@dataclass(frozen=True)
class IbvPort(PortState):
    """One port of one device."""

    active_mtu: int | None
    max_mtu: int | None
    active_width: str | None
    active_speed: str | None
    gids: tuple[Gid, ...]


@dataclass(frozen=True)
class IbvDevice:
    """One RDMA device (hca_id) and its identity."""

    ca: str
    transport: str | None
    firmware: str | None
    node_guid: str | None
    sys_image_guid: str | None
    vendor_id: str | None
    vendor_part_id: int | None
    board_id: str | None
    phys_port_cnt: int | None


@dataclass(frozen=True)
class IbvDevinfo(Ibstat):
    """The ports (IbvPort) and devices (IbvDevice) an `ibv_devinfo` output shows."""


def _strip_code(value: str | None) -> str | None:
    """'InfiniBand (0)' -> 'InfiniBand'."""
    if value is None:
        return None
    return strip_code(value) or None


def _rate(width: str | None, speed: str | None) -> int | float | None:
    """4X (2) x 25.0 Gbps (32) -> 100; None when either is missing or unreadable."""
    if not width or not speed:
        return None
    w = re.match(r"^\s*+(\d{1,3}+)\s*+X\b", width, re.IGNORECASE)
    s = re.match(r"^\s*+(\d{1,6}+(?:\.\d{1,6}+)?)\s*+Gb(?:ps|/s)?\b", speed, re.IGNORECASE)
    if not w or not s:
        return None
    return tidy_number(round(int(w.group(1)) * float(s.group(1)), 3))


def _make_port(ca: str | None, port: int, f: dict[str, str], gids: list[Gid]) -> IbvPort:
    state_raw = _strip_code(f.get("state"))
    return IbvPort(
        ca=ca, port=port,
        state=normalize_state(f.get("state")), state_raw=state_raw,
        physical_state=normalize_physical_state(f.get("phys_state")),
        rate_gbps=_rate(f.get("active_width"), f.get("active_speed")),
        link_layer=normalize_link_layer(f.get("link_layer")),
        lid=leading_int(f.get("port_lid")), sm_lid=leading_int(f.get("sm_lid")),
        active_mtu=leading_int(f.get("active_mtu")), max_mtu=leading_int(f.get("max_mtu")),
        active_width=_strip_code(f.get("active_width")),
        active_speed=_strip_code(f.get("active_speed")),
        gids=tuple(gids),
    )


def _make_device(ca: str, f: dict[str, str]) -> IbvDevice:
    return IbvDevice(ca=ca, transport=_strip_code(f.get("transport")), firmware=f.get("fw_ver"),
                     node_guid=f.get("node_guid"), sys_image_guid=f.get("sys_image_guid"),
                     vendor_id=f.get("vendor_id"), vendor_part_id=leading_int(f.get("vendor_part_id")),
                     board_id=f.get("board_id"), phys_port_cnt=leading_int(f.get("phys_port_cnt")))


def parse(text: str) -> IbvDevinfo:
    """Parse `ibv_devinfo` (or `ibv_devinfo -v`, `ibv_devinfo -l`) output.

    Returns IbvDevinfo; to_dict():
        {"ports": [{"ca": "mlx5_0", "port": 1, "state": "Active", "state_raw": "PORT_ACTIVE",
                    "physical_state": "LinkUp" | null, "rate_gbps": 100 | null,
                    "link_layer": "InfiniBand" | "Ethernet" | null, "lid": 12, "sm_lid": 1,
                    "active_mtu": 4096, "max_mtu": 4096, "active_width": "4X" | null,
                    "active_speed": "25.0 Gbps" | null,
                    "gids": [{"index": 3, "gid": "::ffff:10.0.0.1", "type": "RoCE v2"}]}],
         "cas": [{"ca": "mlx5_0", "transport": "InfiniBand", "firmware": "28.39.1002",
                  "node_guid": "...", "sys_image_guid": "...", "vendor_id": "0x02c9",
                  "vendor_part_id": 4129, "board_id": "MT_0000000838", "phys_port_cnt": 1}]}
    Raises ParseError when the text holds no `hca_id:` device and no device list.
    """
    lines = clean_lines(require_text(KIND, text))
    blocks = CaBlocks(_make_device, _make_port)
    listed: list[str] | None = None
    for _, line in numbered(lines):
        m = _HCA_RE.match(line)
        if m:
            blocks.open_ca(m.group("ca"))
            continue
        m = _PORT_RE.match(line)
        if m and blocks.ca is not None:
            blocks.open_port(int(m.group("port")))
            continue
        m = _LIST_HEADER_RE.match(line)
        if m:
            listed = []
            continue
        if listed is not None and blocks.ca is None:
            name = line.strip()
            if re.fullmatch(r"[A-Za-z][\w.\-]*", name):
                listed.append(name)
                continue
        m = _GID_RE.match(line)
        if m and blocks.port is not None:
            blocks.port_items.append(Gid(int(m.group("index")), m.group("gid"),
                            m.group("type").strip() if m.group("type") else None))
            continue
        kv = key_value(line, _KEY_RE)
        if kv is None or blocks.ca is None:
            continue
        key, value = kv[0].lower(), kv[1]
        if not value:
            continue
        if blocks.port is not None and key in _PORT_KEYS:
            blocks.port_fields.setdefault(key, value)
        elif blocks.port is None and key in _DEVICE_KEYS:
            blocks.ca_fields.setdefault(key, value)
    blocks.close_ca()
    ports, devices = blocks.ports, blocks.cas

    if not devices:
        if listed:
            return IbvDevinfo(ports=(), cas=tuple(_make_device(n, {}) for n in listed))
        if any("no ib devices found" in line.lower() for line in lines):
            return IbvDevinfo(ports=(), cas=())
        raise ParseError(KIND, "no 'hca_id:' device block found")
    if not ports and all(d.firmware is None and d.transport is None and d.node_guid is None
                         for d in devices):
        raise ParseError(KIND, "'hca_id:' lines without any device fields")
    return IbvDevinfo(ports=tuple(ports), cas=tuple(devices))


def detect(text: str) -> bool:
    """An `hca_id:` line followed by device keys (or the `N HCAs found:` list)."""
    head = head_text(text)
    if re.search(r"^[ \t]*+\d{1,6}+[ \t]++HCAs?[ \t]++found[ \t]*+:", head, re.MULTILINE | re.IGNORECASE):
        return True
    return (re.search(r"^[ \t]*+hca_id[ \t]*+:[ \t]*+\S", head, re.MULTILINE) is not None
            and re.search(r"^[ \t]*+(transport|fw_ver|node_guid|phys_port_cnt|port)[ \t]*+:", head,
                          re.MULTILINE) is not None)
