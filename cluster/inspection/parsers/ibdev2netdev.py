"""Parse `ibdev2netdev` (MLNX OFED / DOCA): which netdev sits on which RDMA device port.

Plain lines `mlx5_0 port 1 ==> ib0 (Up)` and verbose lines (`-v`)
`0000:3b:00.0 mlx5_0 (MT4119 - MCX516A) ConnectX-5 ... fw 16.27.2008 port 1 (ACTIVE) ==> ens1f0 (Up)`.
"state" is the netdev's operational state (Up/Down), NOT the RDMA port state: an IB port
without IPoIB configured shows (Down) while the fabric works. The RDMA port state is only
printed by `-v` and goes to "port_state" (Active, Down, Init, Armed, as ibstat says it).
Trailing `# ...` annotations and `column -t` spacing are tolerated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import clean_lines, head_text, numbered, require_text
from cluster.inspection.parsers.ibstat import normalize_state

KIND = "ibdev2netdev"

# The line is split at its "==>" (str.find); each side has its own anchored, possessive pattern.
_LEFT_RE = re.compile(
    r"^\s*+(?P<pre>\S(?:.*\S)?)\s++port\s++(?P<port>\d{1,5}+)\s*+(?:\(\s*+(?P<pstate>[A-Za-z_]{1,32}+)\s*+\)\s*+)?"
    r"=*+$"
)
_RIGHT_RE = re.compile(
    r"^\s*+(?P<netdev>[^\s()#]++)\s*+(?:\(\s*+(?P<state>[A-Za-z_]{1,32}+(?: [A-Za-z_]{1,32}+){0,3}+)"
    r"\s*+\))?\s*+(?:#.*)?$"
)
_PCI_RE = re.compile(r"^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_FW_RE = re.compile(r"\bfw\s+(?P<fw>\d[\w.\-]*)")
_STATES = {"up": "Up", "down": "Down", "unknown": "Unknown"}


@dataclass(frozen=True)
class NetdevPort:
    """One RDMA device port and the network interface on top of it."""

    ca: str
    port: int
    netdev: str | None
    state: str | None
    port_state: str | None
    pci: str | None
    firmware: str | None


class _Match:
    """The groups of a line's two sides, read like one match."""

    def __init__(self, left: re.Match, right: re.Match):
        self._groups = {**left.groupdict(), **right.groupdict()}

    def group(self, name: str) -> str | None:
        return self._groups[name]


@dataclass(frozen=True)
class Ibdev2netdev(Record):
    ports: tuple[NetdevPort, ...]


def _parse_line(line: str) -> NetdevPort | None:
    arrow = line.find("=>")
    if arrow < 0:
        return None
    left, right = _LEFT_RE.match(line[:arrow]), _RIGHT_RE.match(line[arrow + 2:])
    if not left or not right:
        return None
    m = _Match(left, right)
    tokens = m.group("pre").split()
    pci = None
    if len(tokens) > 1 and _PCI_RE.match(tokens[0]):
        pci, tokens = tokens[0], tokens[1:]
    ca = tokens[0]
    if not re.fullmatch(r"[A-Za-z][\w.\-]*", ca):
        return None
    fw = _FW_RE.search(m.group("pre"))
    netdev = m.group("netdev")
    raw_state = m.group("state")
    return NetdevPort(
        ca=ca, port=int(m.group("port")),
        netdev=None if netdev.upper() in ("N/A", "NA") else netdev,
        state=_STATES.get(raw_state.strip().lower(), raw_state.strip()) if raw_state else None,
        port_state=normalize_state(m.group("pstate")),
        pci=pci, firmware=fw.group("fw") if fw else None,
    )


def parse(text: str) -> Ibdev2netdev:
    """Parse `ibdev2netdev` or `ibdev2netdev -v` output.

    Returns Ibdev2netdev; to_dict():
        {"ports": [{"ca": "mlx5_0", "port": 1, "netdev": "ibp26s0", "state": "Up" | "Down",
                    "port_state": "Active" | null (only -v shows it),
                    "pci": "0000:1a:00.0" | null, "firmware": "28.39.1002" | null}, ...]}
    Raises ParseError when no `<dev> port <n> ==> <netdev>` line is found.
    """
    lines = clean_lines(require_text(KIND, text))
    ports = [p for _, line in numbered(lines) if (p := _parse_line(line)) is not None]
    if not ports:
        raise ParseError(KIND, "no '<device> port <n> ==> <netdev> (<state>)' line found")
    return Ibdev2netdev(ports=tuple(ports))


def detect(text: str) -> bool:
    """A `<dev> port <n> ==> <netdev> (Up|Down)` line."""
    for line in head_text(text).splitlines():
        port = _parse_line(line) if "=>" in line else None
        if port is not None and port.state in ("Up", "Down"):
            return True
    return False
