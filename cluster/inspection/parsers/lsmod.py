"""Parse `lsmod` (or `cat /proc/modules`): which kernel modules are loaded, peer memory first.

GPUDirect RDMA needs a peer-memory module: `nvidia_peermem` (driver >= 470) or the older
`nv_peer_mem` (Mellanox). A module listed only in another module's "Used by" column is
loaded too (`gdrdrv` under `nvidia`). Output filtered through grep (`lsmod | grep nvidia`,
no "Module Size Used by" header) still parses; "complete" is then false, because absence from
a filtered list proves less than absence from the full one. A session whose `lsmod | grep PAT`
(or `grep PAT /proc/modules`) command is followed straight by the next prompt shows that grep
found nothing: the modules are absent (no module lines, "filtered_by" names the patterns), not
an unreadable text. Text without a module line or such an empty grep still raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import (ANSIBLE_RC_NOTE, clean_lines, command_in, head_text, numbered,
                                    prompt_only, require_text)

KIND = "lsmod"

_NAME = r"[A-Za-z0-9_][\w\-]{0,63}+"
_USERS = rf"{_NAME}(?:,{_NAME})*+,?"
_HEADER_RE = re.compile(r"^\s*+Module\s++Size\s++Used\s++by\s*+$", re.IGNORECASE)
# lsmod: "nvidia  56598528  147 nvidia_uvm,nvidia_peermem,gdrdrv"  (users may end with ",",
# or be "[permanent]"; "-" as the count for modules that cannot be unloaded)
_LSMOD_RE = re.compile(
    rf"^(?P<name>{_NAME})\s++(?P<size>\d{{1,20}}+)\s++(?P<refs>-?\d{{1,9}}+|-)"
    rf"(?:\s++(?P<users>{_USERS}|\[permanent\]))?\s*+$"
)
# /proc/modules: "nvidia_peermem 16384 0 - Live 0xffffffffc0b3c000 (OE)"
_PROC_RE = re.compile(
    rf"^(?P<name>{_NAME})\s++(?P<size>\d{{1,20}}+)\s++(?P<refs>-?\d{{1,9}}+|-)\s++"
    rf"(?P<users>-|{_USERS}|\[permanent\],?)"
    r"\s++(?:Live|Loading|Unloading)\s++0x[0-9a-fA-F]{1,32}+(?:\s++\([A-Z+\-]{0,16}+\))?\s*+$"
)
_GREPS = ("grep", "egrep", "fgrep", "rg")


@dataclass(frozen=True)
class Module:
    name: str
    size: int
    refcount: int | None
    used_by: tuple[str, ...]


@dataclass(frozen=True)
class Lsmod(Record):
    """Loaded modules, with the facts the GPUDirect RDMA check needs."""

    nvidia_peermem: bool
    nv_peer_mem: bool
    gdrdrv: bool
    ib_core: bool
    nvidia: bool
    complete: bool
    loaded: tuple[str, ...]
    modules: tuple[Module, ...]
    filtered_by: tuple[str, ...] = ()  # grep patterns of the command lines shown


def _module(m: re.Match) -> Module:
    users = m.group("users") or ""
    used_by = tuple(u for u in users.split(",") if u and u not in ("-", "[permanent]"))
    refs = m.group("refs")
    return Module(name=m.group("name"), size=int(m.group("size")),
                  refcount=None if refs == "-" else int(refs), used_by=used_by)


def _canon(name: str) -> str:
    return name.replace("-", "_")


def _grep_patterns(command: str) -> list[str] | None:
    """The patterns of `lsmod | grep PAT` / `grep PAT /proc/modules`; None for another command."""
    if "lsmod" not in command and "/proc/modules" not in command:
        return None
    patterns: list[str] = []
    for segment in command.split("|"):
        tokens = segment.split()
        while tokens and tokens[0] in ("sudo", "command"):
            tokens = tokens[1:]
        if not tokens or tokens[0].rsplit("/", 1)[-1] not in _GREPS:
            continue
        take_next = False
        for tok in tokens[1:]:
            if take_next or not tok.startswith("-"):
                patterns.append(tok.strip("'\""))
                if not take_next:
                    break
                take_next = False
            elif tok in ("-e", "--regexp"):
                take_next = True
    return patterns or None


def _command(line: str) -> str | None:
    """The command on a prompt line, or a bare `lsmod ...` / `grep ...` line without a prompt."""
    cmd = command_in(line)
    if cmd is not None:
        return cmd
    bare = line.strip()
    return bare if bare.split(" ", 1)[0] in ("lsmod", "sudo", "grep", "cat") else None


def parse(text: str) -> Lsmod:
    """Parse `lsmod` / `lsmod | grep ...` / `/proc/modules` output.

    Returns Lsmod; to_dict():
        {"nvidia_peermem": true, "nv_peer_mem": false, "gdrdrv": true, "ib_core": true,
         "nvidia": true, "complete": false (no header: a filtered listing),
         "loaded": ["drm", "gdrdrv", "ib_core", ...]  (listed modules plus their users),
         "modules": [{"name": "nvidia", "size": 56598528, "refcount": 147,
                      "used_by": ["nvidia_uvm", "nvidia_peermem", ...]}, ...],
         "filtered_by": ["nvidia_peermem"]  (grep patterns of the command lines shown)}
    Raises ParseError when no module line is found and no grep is shown to have found nothing.
    """
    lines = clean_lines(require_text(KIND, text))
    modules: list[Module] = []
    header = False
    proc_format = False
    patterns: list[str] = []
    pending: list[str] | None = None   # the grep patterns of the last command line, unanswered
    empty_greps = 0
    for _, line in numbered(lines):
        if pending is not None and (prompt_only(line) or command_in(line) is not None
                                    or line.strip() == ANSIBLE_RC_NOTE):
            empty_greps += 1
        if pending is not None:
            pending = None
        if prompt_only(line):
            continue
        command = _command(line)
        if command is not None:
            grep = _grep_patterns(command)
            if grep:
                patterns += [p for p in grep if p not in patterns]
                pending = grep
            continue
        if _HEADER_RE.match(line):
            header = True
            continue
        stripped = line.strip()
        m = _LSMOD_RE.match(stripped) or _PROC_RE.match(stripped)
        if m:
            if m.re is _PROC_RE:
                proc_format = True
            modules.append(_module(m))
    if not modules and not empty_greps:
        if header:
            raise ParseError(KIND, "'Module Size Used by' header but no module lines")
        raise ParseError(KIND, "no '<module> <size> <used-count> [users]' line found (nor an "
                               "`lsmod | grep` answered by the next prompt)")
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
        filtered_by=tuple(patterns),
    )


def detect(text: str) -> bool:
    """The lsmod header, or mostly lines of the form `<module> <size> <count> [users]`."""
    head = head_text(text)
    if re.search(r"^[ \t]*+Module[ \t]++Size[ \t]++Used[ \t]++by[ \t]*+$", head, re.MULTILINE):
        return True
    rows = [line.strip() for line in head.splitlines() if line.strip()]
    hits = sum(1 for r in rows if _LSMOD_RE.match(r) or _PROC_RE.match(r))
    echoes = sum(1 for r in rows if re.search(r"\blsmod\b|/proc/modules", r) or prompt_only(r))
    # a filtered listing: module lines, plus the command echo and at most little else
    others = len(rows) - hits - echoes
    if hits == 0:   # an empty `lsmod | grep`: its command lines and prompts, nothing else
        greps = [r for r in rows if (c := _command(r)) is not None and _grep_patterns(c)]
        return bool(greps) and all(r in greps or prompt_only(r) or r == ANSIBLE_RC_NOTE
                                   for r in rows)
    return hits >= 1 and others * 2 <= hits
