"""Parse `lsmod` (or `cat /proc/modules`): which kernel modules are loaded, peer memory first.

GPUDirect RDMA needs a peer-memory module: `nvidia_peermem` (driver >= 470) or the older
`nv_peer_mem` (Mellanox). A module listed only in another module's "Used by" column is
loaded too (`gdrdrv` under `nvidia`). Output filtered through grep (`lsmod | grep nvidia`,
no "Module Size Used by" header) still parses; "complete" is then false, because absence from
a filtered list proves less than absence from the full one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.errors import ParseError
from cluster.parsers._lines import clean_lines, head_text, jsonable, numbered, require_text

KIND = "lsmod"

_NAME = r"[A-Za-z0-9_][\w\-]*"
_USERS = rf"{_NAME}(?:,{_NAME})*,?"
_HEADER_RE = re.compile(r"^\s*Module\s+Size\s+Used\s+by\s*$", re.IGNORECASE)
# lsmod: "nvidia  56598528  147 nvidia_uvm,nvidia_peermem,gdrdrv"  (users may end with ",",
# or be "[permanent]"; "-" as the count for modules that cannot be unloaded)
_LSMOD_RE = re.compile(
    rf"^(?P<name>{_NAME})\s+(?P<size>\d+)\s+(?P<refs>-?\d+|-)"
    rf"(?:\s+(?P<users>{_USERS}|\[permanent\]))?\s*$"
)
# /proc/modules: "nvidia_peermem 16384 0 - Live 0xffffffffc0b3c000 (OE)"
_PROC_RE = re.compile(
    rf"^(?P<name>{_NAME})\s+(?P<size>\d+)\s+(?P<refs>-?\d+|-)\s+(?P<users>-|{_USERS}|\[permanent\],?)"
    r"\s+(?:Live|Loading|Unloading)\s+0x[0-9a-fA-F]+(?:\s+\([A-Z+\-]*\))?\s*$"
)


@dataclass(frozen=True)
class Module:
    name: str
    size: int
    refcount: int | None
    used_by: tuple[str, ...]


@dataclass(frozen=True)
class Lsmod:
    """Loaded modules, with the facts the GPUDirect RDMA check needs."""

    nvidia_peermem: bool
    nv_peer_mem: bool
    gdrdrv: bool
    ib_core: bool
    nvidia: bool
    complete: bool
    loaded: tuple[str, ...]
    modules: tuple[Module, ...]

    def to_dict(self) -> dict:
        return jsonable(self)


def _module(m: re.Match) -> Module:
    users = m.group("users") or ""
    used_by = tuple(u for u in users.split(",") if u and u not in ("-", "[permanent]"))
    refs = m.group("refs")
    return Module(name=m.group("name"), size=int(m.group("size")),
                  refcount=None if refs == "-" else int(refs), used_by=used_by)


def _canon(name: str) -> str:
    return name.replace("-", "_")


def parse(text: str) -> Lsmod:
    """Parse `lsmod` / `lsmod | grep ...` / `/proc/modules` output.

    Returns Lsmod; to_dict():
        {"nvidia_peermem": true, "nv_peer_mem": false, "gdrdrv": true, "ib_core": true,
         "nvidia": true, "complete": false (no header: a filtered listing),
         "loaded": ["drm", "gdrdrv", "ib_core", ...]  (listed modules plus their users),
         "modules": [{"name": "nvidia", "size": 56598528, "refcount": 147,
                      "used_by": ["nvidia_uvm", "nvidia_peermem", ...]}, ...]}
    Raises ParseError when no module line is found.
    """
    lines = clean_lines(require_text(KIND, text))
    modules: list[Module] = []
    header = False
    proc_format = False
    for _, line in numbered(lines):
        if _HEADER_RE.match(line):
            header = True
            continue
        m = _LSMOD_RE.match(line.strip()) or _PROC_RE.match(line.strip())
        if m:
            if m.re is _PROC_RE:
                proc_format = True
            modules.append(_module(m))
    if not modules:
        if header:
            raise ParseError(KIND, "'Module Size Used by' header but no module lines")
        raise ParseError(KIND, "no '<module> <size> <used-count> [users]' line found")
    loaded = {_canon(mod.name) for mod in modules}
    loaded |= {_canon(u) for mod in modules for u in mod.used_by}
    return Lsmod(
        nvidia_peermem="nvidia_peermem" in loaded,
        nv_peer_mem="nv_peer_mem" in loaded,
        gdrdrv="gdrdrv" in loaded,
        ib_core="ib_core" in loaded,
        nvidia="nvidia" in loaded,
        complete=header or proc_format,
        loaded=tuple(sorted(loaded)),
        modules=tuple(modules),
    )


def detect(text: str) -> bool:
    """The lsmod header, or mostly lines of the form `<module> <size> <count> [users]`."""
    head = head_text(text)
    if re.search(r"^\s*Module\s+Size\s+Used\s+by\s*$", head, re.MULTILINE):
        return True
    rows = [line.strip() for line in head.splitlines() if line.strip()]
    hits = sum(1 for r in rows if _LSMOD_RE.match(r) or _PROC_RE.match(r))
    echoes = sum(1 for r in rows if re.search(r"\blsmod\b|/proc/modules", r))
    # a filtered listing: module lines, plus the command echo and at most little else
    others = len(rows) - hits - echoes
    return hits >= 1 and others * 2 <= hits
