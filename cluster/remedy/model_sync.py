"""Model copy planning (issue 13), pure: per-node manifests of the model directory (the JSON of
cluster/node_programs/model_copy.py `manifest`) -> the reference node and, per other node, the
files it lacks or holds with other bytes.

The reference is the node whose manifest the most nodes share; on a tie the head's, as the
cross-node checks choose it (cluster/inspection/checks/cross.py). Files a node has that the reference lacks
are never deleted: they are listed, and the admin decides.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from cluster.base.errors import ParseError
from cluster.base.results import Record

MAX_FILES = 100_000                # the on-node program's bound
MAX_SIZE = 1 << 50
MODE_MASK = 0o755                  # the copy's permission bits: no setuid/setgid/sticky, no
                                   # group/other write (the on-node program applies it too)
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class FileEntry(Record):
    """One file of a manifest; `mode` (permission bits, setuid/setgid/sticky and group/other
    write already cleared by the node) travels with the copy but is not part of a match."""

    path: str
    size: int
    sha256: str
    mode: int = field(default=0o600, compare=False)


@dataclass(frozen=True)
class Manifest:
    exists: bool
    files: tuple[FileEntry, ...]
    skipped: tuple[str, ...] = ()      # paths not copied (links to directories or nothing)
    partial: int = 0                   # interrupted fetches (*.part) left in the directory

    @property
    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    @property
    def fingerprint(self) -> tuple[FileEntry, ...]:
        return tuple(sorted(self.files, key=lambda f: f.path))

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class CopyPlan:
    """One target's copy: what to fetch, which of those replace a file, what only it has."""

    node: str
    files: tuple[FileEntry, ...]
    replaced: tuple[str, ...]
    extra: tuple[str, ...]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def parse_manifest(doc: Any) -> Manifest:
    """The manifest verb's JSON document, every field checked; ParseError on anything else."""
    if not isinstance(doc, dict):
        raise ParseError("model manifest", "not a JSON object")
    if "error" in doc:
        raise ParseError("model manifest", str(doc["error"])[:300])
    files = doc.get("files")
    if not isinstance(doc.get("exists"), bool) or not isinstance(files, list) \
            or len(files) > MAX_FILES:
        raise ParseError("model manifest", "no exists/files fields (or too many files)")
    entries = tuple(_entry(e) for e in files)
    if len({e.path for e in entries}) != len(entries):
        raise ParseError("model manifest", "a path is listed twice")
    skipped = doc.get("skipped") or {}
    partial = doc.get("partial", 0)
    if not isinstance(skipped, dict) or type(partial) is not int or not 0 <= partial <= MAX_FILES:
        raise ParseError("model manifest", "bad skipped/partial fields")
    return Manifest(doc["exists"], entries, tuple(sorted(map(str, skipped))[:MAX_FILES]), partial)


def _entry(e: Any) -> FileEntry:
    if not isinstance(e, dict):
        raise ParseError("model manifest", "a file entry is not an object")
    path, size, sha = e.get("path"), e.get("size"), e.get("sha256")
    if not isinstance(path, str) or not path or len(path) > 4096 or path.startswith("/") \
            or any(p in ("", ".", "..") for p in path.split("/")):
        raise ParseError("model manifest", f"bad path {str(path)[:80]!r}")
    if type(size) is not int or not 0 <= size < MAX_SIZE:
        raise ParseError("model manifest", f"bad size for {path[:80]!r}")
    if not isinstance(sha, str) or len(sha) != 64 or set(sha) - _HEX:
        raise ParseError("model manifest", f"bad sha256 for {path[:80]!r}")
    mode = e.get("mode", 0o600)
    if type(mode) is not int or not 0 <= mode <= 0o777:
        raise ParseError("model manifest", f"bad mode for {path[:80]!r}")
    return FileEntry(path, size, sha, mode & MODE_MASK)


def reference_node(fingerprints: Mapping[str, Any], head: str,
                   order: Sequence[str] = ()) -> str | None:
    """The node holding the majority fingerprint; the head on a tie it is part of, else the
    first of the tied in `order` (inventory order). None when no node has one."""
    if not fingerprints:
        return None
    counts = Counter(fingerprints.values())
    top = max(counts.values())
    leaders = {v for v, c in counts.items() if c == top}
    if head in fingerprints and fingerprints[head] in leaders:
        return head
    names = list(order) + sorted(set(fingerprints) - set(order))
    return next(n for n in names if n in fingerprints and fingerprints[n] in leaders)


def copy_plan(node: str, reference: Manifest, target: Manifest) -> CopyPlan:
    """The files of the reference that `target` lacks or holds with another size or sha256."""
    have = target.by_path
    files = tuple(f for f in reference.fingerprint if have.get(f.path) != f)
    ref_paths = set(reference.by_path)
    return CopyPlan(node, files, tuple(f.path for f in files if f.path in have),
                    tuple(sorted(set(have) - ref_paths)))


def still_different(reference: Manifest, target: Manifest) -> tuple[str, ...]:
    """After a copy: the reference's files the target still lacks or holds differently."""
    return tuple(f.path for f in copy_plan("", reference, target).files)
