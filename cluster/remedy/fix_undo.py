"""The `cluster fix` undo record (fix-undo.json) read back for `cluster fix --undo`, strictly.

The record is a file anyone with access to the run directory can edit, and undo acts as root
on every node: so it is read as hostile input. Every entry must have exactly the shape
playbooks/fix.py (and playbooks/fix_model.py) write, and name only a file or mount point the
entry's check owns (the paths its Fixer declares in cluster/remedy/fixes.py): an absolute, normalized
path. Anything else refuses the whole record (UsageError: one line, exit 2) before any node is
contacted. The links on the way are checked on the node (node_programs/fix_files.py).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from cluster.base.bounds import bound
from cluster.base.errors import UsageError
from cluster.remedy.fixes import OWNED_FILES, OWNED_MOUNTS
from cluster.base.textsafe import safe_line

# the size= of a tmpfs: bytes, or with a k/m/g suffix, or a % of RAM (tmpfs(5))
_SIZE_RE = re.compile(r"[0-9]{1,20}[kKmMgG%]?")
_SHAPES: dict[str, frozenset[str]] = {
    "start": frozenset({"kind", "nodes"}),
    "file": frozenset({"node", "check", "kind", "path", "before"}),
    "mount": frozenset({"node", "check", "kind", "target", "options"}),
    "model-files": frozenset({"node", "check", "kind", "dir", "source", "created", "replaced",
                              "restored_by_undo"}),
}
_NAME_CHARS = 255


@dataclass(frozen=True)
class FileRestore:
    """Put `path` back as `before` (None: it did not exist: remove it)."""

    node: str
    check: str
    path: str
    before: str | None


@dataclass(frozen=True)
class MountRestore:
    node: str
    check: str
    target: str
    size: str


@dataclass(frozen=True)
class ModelFiles:
    """Model files a copy created or replaced (listed, never restored)."""

    node: str
    dir: str
    count: int


@dataclass(frozen=True)
class UndoPlan:
    """What undo does, newest change first; one restore per (node, path): its oldest state."""

    files: tuple[FileRestore, ...]
    mounts: tuple[MountRestore, ...]
    models: tuple[ModelFiles, ...]

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys([f.node for f in self.files] + [m.node for m in self.mounts]))


class _Refused(Exception):
    pass


def read_record(path: Path) -> UndoPlan:
    """The record at `path` as an UndoPlan; UsageError (one line) for anything else."""
    from cluster.planning.modelinfo import read_json_file

    doc = read_json_file(path, "the undo record", max_bytes=bound("undo_record", "bytes"),
                         error=UsageError)
    try:
        return parse_record(doc)
    except _Refused as exc:
        raise UsageError(f"{path}: not a fix undo record `cluster fix` wrote: {exc}; refused "
                         f"whole, nothing was changed") from None


def parse_record(doc: Any) -> UndoPlan:
    """Pure: the decoded record -> UndoPlan; _Refused names the first entry that is not one
    `cluster fix` writes."""
    if not isinstance(doc, dict) or set(doc) != {"entries"} or not isinstance(doc["entries"],
                                                                              list):
        raise _Refused('expected {"entries": [...]}')
    entries = doc["entries"]
    if len(entries) > bound("undo_record", "entries"):
        raise _Refused(f"more than {bound('undo_record', 'entries'):,} entries")
    files: dict[tuple[str, str], FileRestore] = {}
    mounts: dict[tuple[str, str], MountRestore] = {}
    order: list[tuple[str, str, str]] = []
    models: list[ModelFiles] = []
    for i, e in enumerate(entries, 1):
        try:
            kind = _shape(e)
            if kind == "file":
                f = _file(e)
                if (f.node, f.path) not in files:
                    files[(f.node, f.path)] = f
                    order.append(("file", f.node, f.path))
            elif kind == "mount":
                m = _mount(e)
                if (m.node, m.target) not in mounts:
                    mounts[(m.node, m.target)] = m
                    order.append(("mount", m.node, m.target))
            elif kind == "model-files":
                models.append(_model_files(e))
            else:
                _names(e["nodes"], "nodes")
        except _Refused as exc:
            raise _Refused(f"entry {i}: {exc}") from None
    newest_first = list(reversed(order))
    return UndoPlan(tuple(files[(n, p)] for k, n, p in newest_first if k == "file"),
                    tuple(mounts[(n, p)] for k, n, p in newest_first if k == "mount"),
                    tuple(models))


def _shape(e: Any) -> str:
    if not isinstance(e, dict):
        raise _Refused(f"not an object but {type(e).__name__}")
    kind = e.get("kind")
    if not isinstance(kind, str) or kind not in _SHAPES:
        raise _Refused(f"unknown kind {_shown(kind)}")
    if set(e) != _SHAPES[kind]:
        missing, extra = sorted(_SHAPES[kind] - set(e)), sorted(set(e) - _SHAPES[kind])
        raise _Refused(f"a {kind} entry " + "; ".join(
            ([f"without {', '.join(missing)}"] if missing else [])
            + ([f"with unknown key(s) {_shown(', '.join(extra))}"] if extra else [])))
    if kind != "start":
        _name(e["node"], "node")
    return kind


def _file(e: Mapping[str, Any]) -> FileRestore:
    check = _check(e, OWNED_FILES)
    path = _path(e["path"], "path", OWNED_FILES[check], check, "writes")
    before = e["before"]
    if before is not None:
        if not isinstance(before, str):
            raise _Refused(f"before: expected the file's text or null, got "
                           f"{type(before).__name__}")
        try:
            size = len(before.encode("utf-8"))
        except UnicodeEncodeError:
            raise _Refused("before: not text (a lone surrogate)") from None
        if size > bound("undo_record", "file_bytes"):
            raise _Refused(f"before: more than {bound('undo_record', 'file_bytes'):,} bytes")
        if "\x00" in before:
            raise _Refused("before: holds a NUL byte (not the text of a configuration file)")
    return FileRestore(e["node"], check, path, before)


def _mount(e: Mapping[str, Any]) -> MountRestore:
    check = _check(e, OWNED_MOUNTS)
    target = _path(e["target"], "target", OWNED_MOUNTS[check], check, "remounts")
    options = e["options"]
    if not isinstance(options, str) or len(options) > 4096:
        raise _Refused("options: expected the mount's option text")
    sizes = [o[5:] for o in options.split(",") if o.startswith("size=")]
    if len(sizes) != 1 or not _SIZE_RE.fullmatch(sizes[0]):
        raise _Refused(f"options: no single size=N[k|m|g|%] in {_shown(options)}")
    return MountRestore(e["node"], check, target, sizes[0])


def _model_files(e: Mapping[str, Any]) -> ModelFiles:
    if e["check"] != "model" or e["restored_by_undo"] is not False:
        raise _Refused("a model-files entry of another check, or one claiming undo restores it")
    _name(e["source"], "source")
    _text(e["dir"], "dir", 4096)
    count = 0
    for key in ("created", "replaced"):
        if not isinstance(e[key], list) or any(not isinstance(p, str) for p in e[key]):
            raise _Refused(f"{key}: expected a list of paths")
        count += len(e[key])
    return ModelFiles(e["node"], e["dir"], count)


def _check(e: Mapping[str, Any], owned: Mapping[str, frozenset[str]]) -> str:
    check = e["check"]
    if not isinstance(check, str) or not owned.get(check):
        raise _Refused(f"check {_shown(check)} changes no such thing (checks whose fix does: "
                       f"{', '.join(sorted(c for c, p in owned.items() if p))})")
    return check


def _path(value: Any, key: str, owned: frozenset[str], check: str, verb: str) -> str:
    path = _text(value, key, 4096)
    if not path.startswith("/"):
        raise _Refused(f"{key}: a relative path {_shown(path)}")
    if ".." in path.split("/") or posixpath.normpath(path) != path:
        raise _Refused(f"{key}: {_shown(path)} is not a normalized path (.., . or //)")
    if path not in owned:
        raise _Refused(f"{key}: {_shown(path)} is not a file the {check} fix {verb} (it "
                       f"{verb} only {', '.join(sorted(owned))})")
    return path


def _names(value: Any, key: str) -> None:
    if not isinstance(value, list) or len(value) > bound("undo_record", "entries"):
        raise _Refused(f"{key}: expected a list of node names")
    for v in value:
        _name(v, key)


def _name(value: Any, key: str) -> str:
    return _text(value, key, _NAME_CHARS)


def _text(value: Any, key: str, limit: int) -> str:
    if not isinstance(value, str) or not value or len(value) > limit \
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise _Refused(f"{key}: expected a name or path of 1 to {limit} printable characters, "
                       f"got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    if isinstance(value, str) and len(value) > 80:
        value = value[:80] + "..."
    return safe_line(repr(value) if not isinstance(value, (list, dict)) else
                     f"a {type(value).__name__}", limit=100)
