"""Parse the max-locked-memory limit from `ulimit -a` / `ulimit -l` and their relatives.

RDMA (NCCL over IB/RoCE) pins memory: memlock must be unlimited or large. Read from:
  bash       `max locked memory       (kbytes, -l) 64`
  busybox    `max locked memory (kb)          (-l) 64`
  zsh/dash   `-l: locked-in-memory size (kbytes) 64`, `-l: locked memory(kbytes) 64`
  dash (old) `locked memory(kbytes) 64`
  zsh/tcsh   `limit`: `memorylocked    64kB` / `memorylocked 8 MB` / `unlimited`
  /proc/<pid>/limits `Max locked memory  65536  65536  bytes` (soft and hard, bytes)
  `ulimit -l` / `ulimit -Hl` alone: one number (KiB) or `unlimited`, right after the command
      echo or as the only line.
memlock_kib is an int (KiB) or "unlimited". scope is "hard" when the command echo asked for
hard limits (`-H`) and "soft" for `-S` or a plain `ulimit`; null when no command is shown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import (clean_lines, command_in, head_text, numbered,
                                    require_text)

KIND = "ulimit"

_VALUE = r"(?P<value>unlimited|infinity|\d{1,30})"
_NOTE = r"\s*+(?:#.*)?"  # a trailing "# annotation" some pastes carry
# Possessive quantifiers throughout: every pattern is linear in the line's length.
_LINE_RES = (
    # bash: "max locked memory       (kbytes, -l) 64"; busybox/ksh: "... (kb)   (-l) 64"
    re.compile(rf"^\s*+max locked memory\s*+(?:\((?P<unit>[^,)]*+)(?:,\s*+-l)?\))?\s*+(?:\(-l\))?"
               rf"\s*+{_VALUE}{_NOTE}$", re.IGNORECASE),
    # zsh: "-l: locked-in-memory size (kbytes) 64"; dash: "-l: locked memory(kbytes) 64"
    re.compile(rf"^\s*+-l:\s*+(?:[A-Za-z_\-]++\s*+)*?\(?(?P<unit>kbytes|kb|kib|bytes|blocks)?\)?"
               rf"\s*+{_VALUE}{_NOTE}$", re.IGNORECASE),
    # old dash: "locked memory(kbytes) 64"; mksh "-l: locked memory (KiB)"
    re.compile(rf"^\s*+locked(?:-in)?[\s\-]memory(?: size)?\s*+\((?P<unit>[^)]*+)\)\s*+{_VALUE}"
               rf"{_NOTE}$", re.IGNORECASE),
)
_LIMIT_RE = re.compile(r"^\s*+memorylocked\s++(?P<value>unlimited|\d{1,30}(?:\.\d{1,30})?)\s*+"
                       r"(?P<unit>[kKmMgGtT]?B|kbytes|megabytes|bytes)?\s*+$", re.IGNORECASE)
_PROC_RE = re.compile(r"^\s*+Max locked memory\s++(?P<soft>unlimited|\d{1,30})\s++"
                      r"(?P<hard>unlimited|\d{1,30})(?:\s++(?P<unit>bytes|kbytes))?\s*+$", re.IGNORECASE)
_BARE_RE = re.compile(r"^\s*+(?P<value>unlimited|\d{1,30})\s*+$", re.IGNORECASE)
_ULIMIT_CMD_RE = re.compile(r"(?:^|[\s;|&(])ulimit\s++(?P<flags>(?:-[a-zA-Z]++\s*+)+)")
# a line of `ulimit -a`: bash "(blocks, -c) 0", busybox "(-c) 0", zsh/dash "-c: ..."
_A_LINE_RE = re.compile(r"-[a-zA-Z]\)\s++\S++$")
_A_LINE_ZSH_RE = re.compile(r"^\s*+-[a-zA-Z]:\s")

@dataclass(frozen=True)
class Ulimit(Record):
    memlock_kib: int | str | None
    memlock_hard_kib: int | str | None
    scope: str | None
    source: str  # "ulimit -a", "ulimit -l", "limit", "/proc/limits"


def _kib(value: str, unit: str | None) -> int | str:
    v = value.strip().lower()
    if v in ("unlimited", "infinity"):
        return "unlimited"
    u = (unit or "kbytes").strip().lower()
    mult = {"mb": 1024, "megabytes": 1024, "gb": 1024 ** 2, "tb": 1024 ** 3}.get(u, 1)
    if u in ("bytes", "b"):
        return int(v) // 1024 if v.isdigit() else int(float(v) / 1024)
    if v.isdigit():
        return int(v) * mult
    return int(float(v) * mult)


def _scope_of(flags: str | None) -> str | None:
    if flags is None:
        return None
    letters = flags.replace("-", "").replace(" ", "")
    if "H" in letters:
        return "hard"
    return "soft"


def parse(text: str) -> Ulimit:
    """Parse a memlock limit out of ulimit / limit / /proc/<pid>/limits output.

    Returns Ulimit; to_dict():
        {"memlock_kib": 64 | "unlimited", "memlock_hard_kib": 64 | "unlimited" | null (only
         /proc/<pid>/limits shows both), "scope": "soft" | "hard" | null,
         "source": "ulimit -a" | "ulimit -l" | "limit" | "/proc/limits"}
    Raises ParseError when no locked-memory limit is found (or a lone number is ambiguous).
    """
    lines = clean_lines(require_text(KIND, text))
    flags: str | None = None
    for_l_flags: str | None = None
    awaiting_value = False
    bare: list[tuple[str, str | None]] = []
    a_lines = 0
    non_blank = list(numbered(lines))
    for _, line in non_blank:
        cmd = _ULIMIT_CMD_RE.search(line)
        if cmd:
            flags = cmd.group("flags")
            awaiting_value = "l" in flags.replace("-", "") and "a" not in flags.replace("-", "")
            for_l_flags = flags if awaiting_value else for_l_flags
            continue
        m = _PROC_RE.match(line)
        if m:
            return Ulimit(memlock_kib=_kib(m.group("soft"), m.group("unit") or "bytes"),
                          memlock_hard_kib=_kib(m.group("hard"), m.group("unit") or "bytes"),
                          scope=None, source="/proc/limits")
        for rx in _LINE_RES:
            m = rx.match(line)
            if m:
                value, scope = _kib(m.group("value"), m.group("unit")), _scope_of(flags)
                return Ulimit(memlock_kib=value, memlock_hard_kib=value if scope == "hard" else None,
                              scope=scope, source="ulimit -a")
        m = _LIMIT_RE.match(line)
        if m:
            value = _kib(m.group("value"), m.group("unit") or "kbytes")
            scope = "hard" if flags is None and re.search(r"\blimit\s+-h\b", text) else None
            return Ulimit(memlock_kib=value, memlock_hard_kib=value if scope == "hard" else None,
                          scope=scope, source="limit")
        if _A_LINE_RE.search(line) or _A_LINE_ZSH_RE.match(line):
            a_lines += 1
        m = _BARE_RE.match(line)
        if m:
            bare.append((m.group("value"), for_l_flags if awaiting_value else None))
            awaiting_value = False
            continue
        if command_in(line) is None:
            awaiting_value = False
    if a_lines >= 3:
        raise ParseError(KIND, "ulimit -a listing without a 'max locked memory' (-l) line")
    # `ulimit -l`: the value printed right after its command echo, or the only line there is
    echoed = [(_kib(v, "kbytes"), _scope_of(f)) for v, f in bare if f is not None]
    if echoed:
        soft = next((v for v, scope in echoed if scope == "soft"), None)
        hard = next((v for v, scope in echoed if scope == "hard"), None)
        if soft is not None:
            return Ulimit(memlock_kib=soft, memlock_hard_kib=hard, scope="soft",
                          source="ulimit -l")
        return Ulimit(memlock_kib=hard, memlock_hard_kib=hard, scope="hard", source="ulimit -l")
    if len(bare) == 1 and len(non_blank) == 1:
        return Ulimit(memlock_kib=_kib(bare[0][0], "kbytes"), memlock_hard_kib=None,
                      scope=None, source="ulimit -l")
    raise ParseError(KIND, "no locked-memory limit ('max locked memory ... (-l) N', "
                           "'-l: locked-in-memory size', 'memorylocked', or a lone "
                           "`ulimit -l` value) found")


def detect(text: str) -> bool:
    """A locked-memory line of some shell's ulimit/limit listing, or `ulimit -l` with its value."""
    head = head_text(text)
    if re.search(r"max locked memory|locked-in-memory size|^[ \t]*+-l:[ \t]*+locked|"
                 r"^[ \t]*+memorylocked\s",
                 head, re.IGNORECASE | re.MULTILINE):
        return True
    return re.search(r"ulimit[ \t]++-[SH]?l[SH]?[ \t]*+\n\s*+(unlimited|\d++)[ \t]*+$", head,
                     re.MULTILINE) is not None
