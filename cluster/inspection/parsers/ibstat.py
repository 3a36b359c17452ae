"""Parse `ibstat` (infiniband-diags): one entry per HCA port with state, rate and link layer.

Reads the full listing (`ibstat`), one CA (`ibstat mlx5_0`), one port (`ibstat mlx5_0 1`,
whose header is `CA: 'mlx5_0'`) and the short form (`ibstat -s`, CAs without ports).
Indentation is not trusted (pastes collapse it): keys are assigned by name to the CA or to
the port that is open. A key the text does not show (a block cut short) is null.

The state vocabulary is shared with ibv_devinfo: Active, Down, Init, Armed, Polling;
physical states: LinkUp, Polling, Disabled, Sleep, PortConfigurationTraining,
LinkErrorRecovery, PhyTest. Anything else is kept as printed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import (clean_lines, head_text, leading_int, numbered,
                                    require_text, to_number)

KIND = "ibstat"

_CA_RE = re.compile(r"^\s*+CA:?\s++'(?P<ca>[^']++)'\s*+$")
_PORT_RE = re.compile(r"^\s*+Port\s++(?P<port>\d{1,5}+)\s*+:\s*+$")
_KEY_RE = re.compile(r"[A-Za-z][A-Za-z ]*+")
_CODE_SUFFIX_RE = re.compile(r"\(\s*+-?\d{1,12}+\s*+\)$")


def key_value(line: str, key_re: re.Pattern = _KEY_RE) -> tuple[str, str] | None:
    """`  Key name: value` -> ("Key name", "value") when the text before the first ':' is a key."""
    key, sep, value = line.partition(":")
    key = key.strip()
    if not sep or not key_re.fullmatch(key):
        return None
    return key, value.strip()


def strip_code(raw: str) -> str:
    """'PORT_NOP (0)' -> 'PORT_NOP': the value without a trailing numeric code."""
    raw = raw.rstrip()
    m = _CODE_SUFFIX_RE.search(raw)
    return raw[:m.start()].rstrip() if m else raw.strip()

_CA_KEYS = {"ca type": "ca_type", "number of ports": "num_ports",
            "firmware version": "firmware", "hardware version": "hardware_version",
            "node guid": "node_guid", "system image guid": "system_image_guid"}
_PORT_KEYS = {"state": "state", "physical state": "physical_state", "rate": "rate",
              "base lid": "lid", "lmc": "lmc", "sm lid": "sm_lid",
              "capability mask": "capability_mask", "port guid": "port_guid",
              "link layer": "link_layer"}

_STATES = {"active": "Active", "activedefer": "Active", "down": "Down", "init": "Init",
           "initialize": "Init", "initializing": "Init", "armed": "Armed", "polling": "Polling"}
_PHYS_STATES = {"linkup": "LinkUp", "polling": "Polling", "disabled": "Disabled",
                "sleep": "Sleep", "portconfigurationtraining": "PortConfigurationTraining",
                "configurationtraining": "PortConfigurationTraining",
                "linkerrorrecovery": "LinkErrorRecovery", "phytest": "PhyTest"}
_LINK_LAYERS = {"infiniband": "InfiniBand", "ib": "InfiniBand", "ethernet": "Ethernet",
                "eth": "Ethernet"}


def _printed(raw: str) -> str:
    """The value as printed, without a trailing numeric code: 'PORT_NOP (0)' -> 'PORT_NOP'."""
    return strip_code(raw)


_CODE_IN_PARENS = re.compile(r"\(\s*+\d{1,12}+\s*+\)")


def _squash(value: str) -> str:
    """'PORT_ACTIVE (4)' -> 'active'; '5: LinkUp' -> 'linkup'; 'Port Configuration Training' ..."""
    value = _CODE_IN_PARENS.sub("", value)
    value = re.sub(r"^\s*+\d{1,12}+\s*+:\s*+", "", value)
    value = re.sub(r"^\s*+PORT_", "", value.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z]", "", value.lower())


def normalize_state(raw: str | None) -> str | None:
    """Logical port state in the shared vocabulary (Active, Down, Init, Armed, Polling)."""
    if raw is None or not raw.strip():
        return None
    return _STATES.get(_squash(raw), _printed(raw))


def normalize_physical_state(raw: str | None) -> str | None:
    """Physical port state as ibstat spells it (LinkUp, Polling, Disabled, ...)."""
    if raw is None or not raw.strip():
        return None
    return _PHYS_STATES.get(_squash(raw), _printed(raw))


def normalize_link_layer(raw: str | None) -> str | None:
    """InfiniBand or Ethernet; other values (Unspecified on EFA) as printed."""
    if raw is None or not raw.strip():
        return None
    return _LINK_LAYERS.get(raw.strip().lower(), raw.strip())


@dataclass(frozen=True)
class PortState:
    """What ibstat and ibv_devinfo both tell of a port (their port types add the rest)."""

    ca: str | None
    port: int
    state: str | None
    state_raw: str | None
    physical_state: str | None
    rate_gbps: int | float | None
    link_layer: str | None
    lid: int | None
    sm_lid: int | None


@dataclass(frozen=True)
class IbPort(PortState):
    """One port of one CA."""

    lmc: int | None
    port_guid: str | None
    capability_mask: str | None


@dataclass(frozen=True)
class IbCa:
    """One channel adapter (HCA) and its identity."""

    ca: str
    ca_type: str | None
    num_ports: int | None
    firmware: str | None
    hardware_version: str | None
    node_guid: str | None
    system_image_guid: str | None


@dataclass(frozen=True)
class Ibstat(Record):
    """The ports (and CAs) an `ibstat` output shows (ibv_devinfo's result has this shape too)."""

    ports: tuple[PortState, ...]
    cas: tuple[Any, ...]


class CaBlocks:
    """The CA (device) blocks and the port blocks inside them, as ibstat and ibv_devinfo print
    them: a header opens a block and closes the open one; keys go to the block that is open.
    make_ca(name, fields) and make_port(ca, port, fields, items) build the closed blocks
    (items: what a port collected besides its keys, ibv_devinfo's GIDs)."""

    def __init__(self, make_ca: Callable[[str, dict], Any],
                 make_port: Callable[[str | None, int, dict, list], Any]):
        self._make_ca, self._make_port = make_ca, make_port
        self.cas: list = []
        self.ports: list = []
        self.ca: str | None = None
        self.ca_fields: dict[str, str] = {}
        self.port: int | None = None
        self.port_fields: dict[str, str] = {}
        self.port_items: list = []

    def open_ca(self, name: str) -> None:
        self.close_ca()
        self.ca = name

    def open_port(self, number: int) -> None:
        self.close_port()
        self.port = number

    def close_port(self) -> None:
        if self.port is not None:
            self.ports.append(self._make_port(self.ca, self.port, self.port_fields,
                                              self.port_items))
        self.port, self.port_fields, self.port_items = None, {}, []

    def close_ca(self) -> None:
        self.close_port()
        if self.ca is not None:
            self.cas.append(self._make_ca(self.ca, self.ca_fields))
        self.ca, self.ca_fields = None, {}


def _rate(value: str | None) -> int | float | None:
    if value is None:
        return None
    m = re.match(r"^\s*+(\d{1,9}+(?:\.\d{1,9}+)?)", value)
    return to_number(m.group(1)) if m else None


def _make_port(ca: str | None, port: int, fields: dict[str, str], _items: list) -> IbPort:
    state_raw = fields.get("state")
    return IbPort(
        ca=ca, port=port,
        state=normalize_state(state_raw), state_raw=state_raw,
        physical_state=normalize_physical_state(fields.get("physical_state")),
        rate_gbps=_rate(fields.get("rate")),
        link_layer=normalize_link_layer(fields.get("link_layer")),
        lid=leading_int(fields.get("lid")), sm_lid=leading_int(fields.get("sm_lid")), lmc=leading_int(fields.get("lmc")),
        port_guid=fields.get("port_guid"), capability_mask=fields.get("capability_mask"),
    )


def _make_ca(ca: str, fields: dict[str, str]) -> IbCa:
    return IbCa(ca=ca, ca_type=fields.get("ca_type"), num_ports=leading_int(fields.get("num_ports")),
                firmware=fields.get("firmware"), hardware_version=fields.get("hardware_version"),
                node_guid=fields.get("node_guid"), system_image_guid=fields.get("system_image_guid"))


def parse(text: str) -> Ibstat:
    """Parse `ibstat` output.

    Returns Ibstat; to_dict():
        {"ports": [{"ca": "mlx5_0", "port": 1, "state": "Active", "state_raw": "Active",
                    "physical_state": "LinkUp", "rate_gbps": 200, "link_layer": "Ethernet",
                    "lid": 0, "sm_lid": 0, "lmc": 0, "port_guid": "0x5aa2...",
                    "capability_mask": "0x00010000"}, ...],
         "cas": [{"ca": "mlx5_0", "ca_type": "MT4129", "num_ports": 1, "firmware": "28.39.1002",
                  "hardware_version": "0", "node_guid": "0x58a2...", "system_image_guid": "0x58a2..."}]}
    Raises ParseError when the text holds no `CA '...'` block or port section.
    """
    lines = clean_lines(require_text(KIND, text))
    blocks = CaBlocks(_make_ca, _make_port)
    saw_structure = False
    for _, line in numbered(lines):
        m = _CA_RE.match(line)
        if m:
            blocks.open_ca(m.group("ca"))
            saw_structure = True
            continue
        m = _PORT_RE.match(line)
        if m:
            blocks.open_port(int(m.group("port")))
            saw_structure = True
            continue
        kv = key_value(line)
        if kv is None:
            continue
        key, value = kv[0].lower(), kv[1]
        if not value or value in ("...", "…", "[...]"):   # a value the author elided
            continue
        if key in _PORT_KEYS and blocks.port is not None:
            blocks.port_fields.setdefault(_PORT_KEYS[key], value)
        elif key in _CA_KEYS and blocks.ca is not None and blocks.port is None:
            blocks.ca_fields.setdefault(_CA_KEYS[key], value)
    blocks.close_ca()
    ports, cas = blocks.ports, blocks.cas

    if not saw_structure:
        if any("no ib devices found" in line.lower() for line in lines):
            return Ibstat(ports=(), cas=())
        raise ParseError(KIND, "no \"CA '<name>'\" block or \"Port N:\" section found")
    port_facts = any(p.state is not None or p.rate_gbps is not None for p in ports)
    ca_facts = any(c.ca_type or c.firmware or c.node_guid or c.num_ports is not None for c in cas)
    if not port_facts and not ca_facts:
        raise ParseError(KIND, "CA/port headers without any CA or port fields")
    return Ibstat(ports=tuple(ports), cas=tuple(cas))


def detect(text: str) -> bool:
    """A `CA 'name'` header followed by CA or port keys."""
    head = head_text(text)
    return (re.search(r"^[ \t]*+CA:?[ \t]++'[^'\n]++'[ \t]*+$", head, re.MULTILINE) is not None
            and re.search(r"^[ \t]*+(CA type|Port \d{1,5}+|State|Firmware version)[ \t]*+:", head,
                          re.MULTILINE) is not None)
