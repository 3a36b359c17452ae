"""Parse `df` output for /dev/shm: its size (NCCL and vLLM need far more than Docker's 64 MB).

Reads GNU, busybox and BSD/macOS df in any unit: `df -h` (powers of 1024), `df -H`/`--si`
(powers of 1000, recognised from the command echo), `df`, `df -k`, `df -m`, `df -B1`, `df -P`
(N-blocks headers), `-T` (Type column), `--output=...`, wrapped long filesystem names.
The row mounted on /dev/shm is the answer (the first one when several listings are pasted;
all are in "entries"). Without such a row, `df /dev/shm` still answers when its listing has
exactly one row: the filesystem that holds /dev/shm. A headerless row is read only when its
sizes carry units or the command echo fixes the block size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import (clean_lines, command_in, head_text, human_size_bytes,
                                    numbered, require_text)

KIND = "df-shm"

SHM_MOUNT = "/dev/shm"

_HEADER_RE = re.compile(r"^\s*+(?:Filesystem|Type|Size|\d{1,12}+[A-Za-z]{0,3}+-blocks)\b.*\b"
                        r"(?:Mounted on|Avail(?:able)?|Use%|Capacity|Used)\b", re.IGNORECASE)
_BLOCKS_RE = re.compile(r"^(?P<n>\d{1,12}+)(?P<unit>[KMGTPE]?)(?P<si>B?)-blocks$", re.IGNORECASE)
# "df ARGS" to the end of the line; ARGS split by str.split (no nested quantifier)
_DF_CMD_RE = re.compile(r"(?:^|[\s;|&(/])df(?=\s|$)")
_SIZE_CELL = re.compile(r"^\d{1,30}+(?:[.,]\d{1,30}+)?[KMGTPEZY]?i?B?$", re.IGNORECASE)
_PCT_RE = re.compile(r"^(?P<n>\d{1,3})%$|^-$")


@dataclass(frozen=True)
class DfEntry:
    filesystem: str | None
    type: str | None
    size_bytes: int | None
    used_bytes: int | None
    available_bytes: int | None
    use_percent: int | None
    mount: str


@dataclass(frozen=True)
class DfShm(Record):
    """The filesystem that /dev/shm is, sizes in bytes."""

    size_bytes: int | None
    used_bytes: int | None
    available_bytes: int | None
    use_percent: int | None
    filesystem: str | None
    type: str | None
    mount: str
    entries: tuple[DfEntry, ...]


@dataclass
class _Listing:
    columns: list[str] | None        # header column names, "mounted on" as one
    block_bytes: int | None          # bytes per unit of block columns, None = human sizes
    si: bool
    shm_arg: bool                    # the command asked about /dev/shm
    rows: list[tuple[int, list[str]]]


def _header_columns(line: str) -> list[str]:
    line = re.sub(r"Mounted\s+on", "Mounted_on", line.strip(), flags=re.IGNORECASE)
    return [c.lower() for c in line.split()]


def _block_bytes(columns: list[str], si: bool) -> tuple[int | None, bool]:
    """Bytes per block for N-blocks headers; (None, si) when sizes are printed with units."""
    for c in columns:
        m = _BLOCKS_RE.match(c)
        if m:
            n = int(m.group("n"))
            unit = m.group("unit").upper()
            base = 1000 if m.group("si") else 1024
            return n * (base ** " KMGTPE".index(unit) if unit else 1), False
    return None, si


def _flags_of(args: str) -> tuple[bool, int | None, bool]:
    """(si, block bytes or None, asks about /dev/shm) from a df command line."""
    flags = [tok for tok in args.split() if tok.startswith("-")]
    si = any(tok == "--si" or (not tok.startswith("--") and "H" in tok) for tok in flags)
    human = any(tok == "--human-readable" or (not tok.startswith("--") and "h" in tok)
                for tok in flags)
    block: int | None = None if (si or human) else 1024
    m = re.search(r"(?:-B\s*+|--block-size=)(?P<n>\d{0,12}+)(?P<u>[KMGTPE]?)(?P<b>i?B?)", args)
    if m:
        n = int(m.group("n") or 1)
        u = m.group("u").upper()
        base = 1000 if m.group("b").upper() == "B" and u else 1024
        block = n * (base ** " KMGTPE".index(u) if u else 1)
    elif re.search(r"(?:^|\s)-[a-zA-Z]*m\b", args):
        block = 1024 ** 2
    elif re.search(r"(?:^|\s)-[a-zA-Z]*P\b", args) and not re.search(r"-[a-zA-Z]*k", args):
        block = 1024  # GNU df -P still uses 1K blocks unless POSIXLY_CORRECT
    return si, block, "/dev/shm" in args.split()


def _size(cell: str, block: int | None, si: bool) -> int | None:
    if cell in ("-", ""):
        return None
    if block is not None and cell.isdigit():
        return int(cell) * block
    return human_size_bytes(cell, si=si)


def _entry(listing: _Listing, tokens: list[str]) -> DfEntry | None:
    cols = listing.columns
    if cols is None:
        # headerless: filesystem size used avail use% mount (optionally a type after fs)
        if len(tokens) < 6:
            return None
        cols = ["filesystem", "type", "size", "used", "avail", "use%", "mounted_on"] \
            if len(tokens) >= 7 and not _SIZE_CELL.match(tokens[1]) else \
            ["filesystem", "size", "used", "avail", "use%", "mounted_on"]
    n = len(cols)
    if "mounted_on" not in cols[-1:]:
        return None
    if len(tokens) < n:
        return None
    head, mount = tokens[:n - 1], " ".join(tokens[n - 1:])
    values = dict(zip(cols[:-1], head))
    size_key = next((c for c in cols if c == "size" or _BLOCKS_RE.match(c)), None)
    if size_key is None:
        return None
    block = listing.block_bytes
    size = _size(values[size_key], block, listing.si)
    if size is None:
        return None
    pct_cell = values.get("use%", values.get("capacity"))
    pct = _PCT_RE.match(pct_cell) if pct_cell else None
    return DfEntry(
        filesystem=values.get("filesystem"), type=values.get("type"), size_bytes=size,
        used_bytes=_size(values.get("used", "-"), block, listing.si),
        available_bytes=_size(values.get("avail", values.get("available", "-")), block,
                              listing.si),
        use_percent=int(pct.group("n")) if pct and pct.group("n") else None, mount=mount,
    )


def parse(text: str) -> DfShm:
    """Parse df output and return the /dev/shm filesystem.

    Returns DfShm; to_dict():
        {"size_bytes": 135291469824, "used_bytes": 528384, "available_bytes": 135291469824,
         "use_percent": 1, "filesystem": "tmpfs", "type": null, "mount": "/dev/shm",
         "entries": [{"filesystem", "type", "size_bytes", "used_bytes", "available_bytes",
                      "use_percent", "mount"}, ...]  (every /dev/shm row seen)}
    Sizes from df -h are read as powers of 1024 (126G = 126 * 2**30), so they are rounded
    as df rounded them. Raises ParseError when no df listing or no /dev/shm row is found.
    """
    lines = clean_lines(require_text(KIND, text))
    listings: list[_Listing] = []
    si, block, shm_arg, saw_cmd = False, 1024, False, False
    current: _Listing | None = None
    wrapped: str | None = None
    for i, line in numbered(lines):
        cmd = command_in(line)
        where = cmd if cmd is not None else line
        m = _DF_CMD_RE.search(where)
        if m and (cmd is not None or line.strip().startswith("df")):
            si, block, shm_arg = _flags_of(where[m.end():])
            saw_cmd = True
            current, wrapped = None, None
            continue
        if _HEADER_RE.match(line):
            columns = _header_columns(line)
            blocks, is_si = _block_bytes(columns, si)
            current = _Listing(columns=columns, block_bytes=blocks, si=is_si, shm_arg=shm_arg,
                               rows=[])
            listings.append(current)
            wrapped = None
            continue
        tokens = line.split()
        if current is not None and current.columns is not None:
            if len(tokens) == 1 and not tokens[0].startswith("/") or (
                    len(tokens) == 1 and tokens[0].startswith("/dev/") and tokens[0] != SHM_MOUNT):
                wrapped = tokens[0]          # a long filesystem name on its own line
                continue
            if wrapped is not None and len(tokens) == len(current.columns) - 1:
                tokens = [wrapped] + tokens
            wrapped = None
            current.rows.append((i, tokens))
            continue
        # rows without a header: only when sizes have units or the df command fixed the unit
        if len(tokens) >= 6 and tokens[-1].startswith("/") and re.fullmatch(r"\d{1,3}%|-", tokens[-2]):
            if current is None or current.columns is not None:
                human = any(re.search(r"[KMGTPE]i?$", t, re.IGNORECASE) for t in tokens[1:-2])
                if not human and not saw_cmd:
                    continue
                current = _Listing(columns=None, block_bytes=None if human else block,
                                   si=si, shm_arg=shm_arg, rows=[])
                listings.append(current)
            current.rows.append((i, tokens))

    parsed: list[tuple[_Listing, DfEntry]] = []
    for listing in listings:
        for _, tokens in listing.rows:
            e = _entry(listing, tokens)
            if e is not None:
                parsed.append((listing, e))
    if not parsed:
        failure = next((ln.strip() for ln in lines if re.search(r"\bdf: ", ln)), None)
        if failure:
            raise ParseError(KIND, f"df reported an error: {failure!r}")
        raise ParseError(KIND, "no df listing (a 'Filesystem ... Mounted on' header and rows) found")
    shm = [e for _, e in parsed if e.mount.rstrip("/") == SHM_MOUNT]
    if not shm:
        asked = [lst for lst in listings if lst.shm_arg]
        holders = [e for lst, e in parsed if lst in asked]
        if len(asked) == 1 and len(holders) == 1:
            shm = holders
        else:
            mounts = ", ".join(sorted({e.mount for _, e in parsed}))
            raise ParseError(KIND, f"no row mounted on /dev/shm (mounts shown: {mounts})")
    first = shm[0]
    return DfShm(size_bytes=first.size_bytes, used_bytes=first.used_bytes,
                 available_bytes=first.available_bytes, use_percent=first.use_percent,
                 filesystem=first.filesystem, type=first.type, mount=first.mount,
                 entries=tuple(shm))


def _df_on_shm(line: str) -> bool:
    """`df ... /dev/shm` on this line."""
    m = re.search(r"\s/dev/shm\b", line)
    return m is not None and re.search(r"\bdf\b", line[:m.start()]) is not None


def detect(text: str) -> bool:
    """A df header (Filesystem ... Mounted on) and a row mounted on /dev/shm or `df ... /dev/shm`."""
    head = head_text(text)
    has_header = re.search(r"^[ \t]*+Filesystem[ \t].*Mounted[ \t]++on[ \t]*+$", head,
                           re.MULTILINE | re.IGNORECASE) is not None
    shm_row = re.search(r"[ \t]/dev/shm/?[ \t]*+$", head, re.MULTILINE) is not None
    shm_cmd = any(_df_on_shm(line) for line in head.splitlines() if "/dev/shm" in line)
    return (has_header and (shm_row or shm_cmd)) or (shm_row and shm_cmd)
