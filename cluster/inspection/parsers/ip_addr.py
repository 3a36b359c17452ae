"""Parse `ip addr` / `ip -4 addr` / `ip -br addr`: network interfaces, their state, MTU and IPv4.

The NCCL/Gloo interface must exist, be up and carry the node's address, with the same MTU on
every node. The full form gives name, state, mtu and `inet` lines; the brief form (`-br`)
gives name, state and addresses, no MTU.

Returned shape (`parse(text).to_dict()`):

    {
      "interfaces": [{
          "name": "bond0",                 # without the `@peer` part (`eth0@if12` -> eth0)
          "state": "UP" | "DOWN" | "UNKNOWN" | ... | null,   # as printed (operstate)
          "mtu": 1500 | null,              # null in the brief form
          "ipv4": ["10.0.0.5/24", ...],    # `inet` addresses with their prefix, as printed
      }, ...],
    }

Addresses are checked with the ipaddress module (ASCII digits, octets in range). Lines are cut
at 4096 characters and matched with anchored, bounded patterns (linear time). Raises ParseError
when no interface line is found.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import clean_lines, head_text, require_text

KIND = "ip-addr"

# `2: ens15f0np0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq master bond0 state UP ...`
_HEADER = re.compile(r"^(\d{1,10}): ([^\s:@]{1,64})(?:@[^\s:]{1,64})?: <([A-Z0-9_,-]{0,256})>"
                     r"(.*)$")
_MTU = re.compile(r"(?:^| )mtu (\d{1,7})(?: |$)")
_STATE = re.compile(r"(?:^| )state ([A-Za-z_-]{1,24})(?: |$)")
_INET = re.compile(r"^ {1,16}inet ([0-9./]{7,18})(?: |$)")
_BRIEF_STATES = {"UP", "DOWN", "UNKNOWN", "LOWERLAYERDOWN", "DORMANT", "NOTPRESENT", "TESTING"}
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}(?:@[A-Za-z0-9_.:-]{1,64})?$")


@dataclass(frozen=True)
class Interface:
    """One network interface."""

    name: str
    state: str | None
    mtu: int | None
    ipv4: tuple[str, ...]


@dataclass(frozen=True)
class IpAddr(Record):
    """The interfaces `ip addr` listed (see the module docstring)."""

    interfaces: tuple[Interface, ...]


def _ipv4(token: str) -> str | None:
    """`10.0.0.5/24` when it is a valid IPv4 interface address with a prefix, else None."""
    if "/" not in token or not token.isascii():
        return None
    try:
        ipaddress.IPv4Interface(token)
    except ValueError:
        return None
    return token


def _brief(line: str) -> Interface | None:
    """`eth0@if5   UP   10.0.0.5/24 fe80::1/64` -> Interface, or None for any other line."""
    tokens = line.split()
    if len(tokens) < 2 or not _NAME.match(tokens[0]) or tokens[1] not in _BRIEF_STATES:
        return None
    ipv4: list[str] = []
    for token in tokens[2:]:
        address = _ipv4(token)
        if address is not None:
            ipv4.append(address)
        elif not _is_ipv6_with_prefix(token):
            return None   # `ip -br link` shows a MAC here; anything else is not this form
    return Interface(name=tokens[0].split("@", 1)[0], state=tokens[1], mtu=None,
                     ipv4=tuple(ipv4))


def _is_ipv6_with_prefix(token: str) -> bool:
    if "/" not in token or ":" not in token or not token.isascii():
        return False
    try:
        ipaddress.IPv6Interface(token)
    except ValueError:
        return False
    return True


def parse(text: str) -> IpAddr:
    """Parse ip addr output; see the module docstring for the returned shape."""
    lines = clean_lines(require_text(KIND, text))
    interfaces: list[dict] = []
    current: dict | None = None
    for line in lines:
        m = _HEADER.match(line)
        if m:
            rest = m.group(4)
            mtu, state = _MTU.search(rest), _STATE.search(rest)
            current = {"name": m.group(2), "state": state.group(1) if state else None,
                       "mtu": int(mtu.group(1)) if mtu else None, "ipv4": []}
            interfaces.append(current)
            continue
        inet = _INET.match(line)
        if inet and current is not None:
            address = _ipv4(inet.group(1))
            if address is not None:
                current["ipv4"].append(address)
            continue
        if not line.startswith(" "):
            brief = _brief(line)
            if brief is not None:
                interfaces.append(dict(brief.__dict__, ipv4=list(brief.ipv4)))
                current = None
    if not interfaces:
        raise ParseError(KIND, "no interface line (`2: eth0: <...> mtu 1500 ... state UP` or "
                               "`eth0  UP  10.0.0.5/24`) found")
    return IpAddr(interfaces=tuple(
        Interface(name=i["name"], state=i["state"], mtu=i["mtu"], ipv4=tuple(i["ipv4"]))
        for i in interfaces))


def detect(text: str) -> bool:
    """An `N: name: <FLAGS> mtu N` header, or a brief line with an address."""
    for line in head_text(text).splitlines():
        m = _HEADER.match(line)
        if m and _MTU.search(m.group(4)):
            return True
        brief = _brief(line) if not line.startswith(" ") else None
        if brief is not None and brief.ipv4:
            return True
    return False
