"""Read a user's YAML file (inventory, plan) as data plus the line of every key path, bounded.

The one YAML loader for files a person edits: every error is one typed exception whose message
is `FILE:LINE: key.path: why` (the caller chooses the class: InventoryError, PlanFileError).
Bounded on every axis a careless or hostile file can push: bytes read (a cap, so /dev/zero or a
log given by mistake ends at once), text encoding (UTF-8 only; UTF-16 and binary files are
named as such), nesting depth, and the size of the document once aliases are expanded (a
"billion laughs" of nested aliases is refused instead of filling memory). Every scalar is
constructed while its key path is known, so a value PyYAML cannot build (`port: 2020-13-45`,
an invalid date) is reported at its key, not as a traceback.

    doc = load("cluster.yaml", error=InventoryError)   # -> YamlDoc
    doc.data["nodes"][0]["port"]; doc.line(("nodes", 0, "port")); doc.text(("nodes", 0, "port"))
    raise doc.fail(("nodes", 0, "port"), "must be between 1 and 65535")

The package's own data files (cluster/data/*.yaml: limits, expectations, planner, gpus,
fabric, serving) are read by `packaged(name)`, the one loader for them: parsed once per process
by the same bounded parser, each caller getting its own copy.

    packaged("limits.yaml")["bench"]["timeout_s"]
"""

from __future__ import annotations

import copy
import datetime as _dt
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

MAX_BYTES = 1 << 20          # 1 MiB: an inventory of a thousand nodes is a few hundred KB
MAX_DEPTH = 64               # nesting levels (mappings and lists), aliases expanded
MAX_NODES = 250_000          # YAML nodes (values and keys) composed, and values once aliases expand

ErrorFactory = Callable[..., Exception]   # (message, *, path, line, key) -> exception
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_DECIMAL = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")

_TAG_NAMES = {"tag:yaml.org,2002:int": "integer", "tag:yaml.org,2002:float": "number",
              "tag:yaml.org,2002:bool": "boolean", "tag:yaml.org,2002:null": "null",
              "tag:yaml.org,2002:timestamp": "date/timestamp",
              "tag:yaml.org,2002:binary": "binary value", "tag:yaml.org,2002:str": "string"}


@dataclass(frozen=True)
class YamlDoc:
    """The constructed data, the line of every key path and the source text of every scalar."""

    path: str
    data: Any
    lines: Mapping[tuple, int]
    texts: Mapping[tuple, str]
    error: ErrorFactory

    def line(self, at: tuple) -> int | None:
        """The line of `at`, else of its nearest ancestor with a known line."""
        probe = tuple(at)
        while probe and probe not in self.lines:
            probe = probe[:-1]
        return self.lines.get(probe)

    def text(self, at: tuple) -> str | None:
        """The scalar at `at` exactly as written (None for mappings, lists and unknown paths)."""
        return self.texts.get(tuple(at))

    def fail(self, at: tuple, message: str, line: int | None = None) -> Exception:
        """The caller's error for `at`: `path:line: key.path: message` (raise it)."""
        return self.error(message, path=self.path, line=line if line is not None else self.line(at),
                          key=dotted(at))


def dotted(at: tuple) -> str:
    """("nodes", 0, "port") -> "nodes[0].port"; () -> "(document)". Very long paths (a
    recursive alias) are shortened in the middle."""
    out = ""
    for part in at:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
            continue
        text = str(part)
        if not text.isprintable() or not text:
            text = repr(text)   # a key with a newline or escape stays on one line, visibly
        out += f".{text}" if out else text
    if len(out) > 160:
        out = out[:80] + "..." + out[-60:]
    return out or "(document)"


def type_name(value: Any) -> str:
    """How a message names a value's YAML type ("a mapping", "a date", ...)."""
    if isinstance(value, _dt.datetime):
        return "a timestamp"
    if isinstance(value, _dt.date):
        return "a date"
    return {dict: "a mapping", list: "a list", str: "a string", int: "an integer",
            float: "a number", bool: "a boolean", type(None): "nothing",
            bytes: "a binary value", set: "a set", tuple: "a list"}.get(type(value),
                                                                       type(value).__name__)


# ---------------------------------------------------------------- reading


def read_text(path: str | Path, *, error: ErrorFactory, what: str = "a YAML file",
              max_bytes: int = MAX_BYTES) -> str:
    """The file's text: at most max_bytes read (any file kind), UTF-8 only, no binary."""
    name = str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(max_bytes + 1)
    except IsADirectoryError:
        raise error(f"is a directory, not {what}", path=name, line=None, key=None) from None
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror or exc}", path=name, line=None,
                    key=None) from None
    if len(raw) > max_bytes:
        raise error(f"larger than {_size(max_bytes)}: not {what}",
                    path=name, line=None, key=None)
    return decode(raw, path=name, error=error, what=what)


def decode(raw: bytes, *, path: str, error: ErrorFactory, what: str = "a YAML file") -> str:
    """UTF-8 text from bytes, or one clear error naming UTF-16/32 or a binary file."""
    encoding = _wide_encoding(raw)
    if encoding:
        raise error(f"is {encoding} text, not UTF-8: save it as UTF-8", path=path, line=1, key=None)
    if b"\0" in raw:
        line = raw[:raw.index(b"\0")].count(b"\n") + 1
        raise error(f"is a binary file (NUL byte), not {what}", path=path, line=line, key=None)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise error(f"not UTF-8 text (byte 0x{raw[exc.start]:02x}): save it as UTF-8",
                    path=path, line=line, key=None) from None
    return text[1:] if text.startswith("\ufeff") else text


def _wide_encoding(raw: bytes) -> str | None:
    if raw.startswith((b"\xff\xfe\0\0", b"\0\0\xfe\xff")):
        return "UTF-32"
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    head = raw[:256]
    if len(head) >= 4 and head.count(0) * 2 >= len(head) - 1:
        # ASCII in UTF-16 without a BOM: every other byte is NUL.
        if not head[0::2].count(0) or not head[1::2].count(0):
            return "UTF-16"
    return None


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


# ---------------------------------------------------------------- parsing


class _TooDeep(Exception):
    def __init__(self, mark: Any, what: str):
        self.mark, self.what = mark, what


class _BoundedComposer(yaml.composer.Composer):
    """PyYAML's composer, stopping at max_depth nested collections and max_nodes nodes."""

    max_depth = MAX_DEPTH
    max_nodes = MAX_NODES
    _depth = 0
    _count = 0

    def compose_node(self, parent, index):  # noqa: D401 - PyYAML's hook
        self._depth += 1
        self._count += 1
        try:
            if self._depth > self.max_depth:
                raise _TooDeep(self.peek_event().start_mark,
                               f"nested deeper than {self.max_depth} levels")
            if self._count > self.max_nodes:
                raise _TooDeep(self.peek_event().start_mark,
                               f"more than {self.max_nodes} values")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


if getattr(yaml, "__with_libyaml__", False):
    from yaml._yaml import CParser as _Parser   # libyaml's scanner and parser: the slow part in C

    class _Loader(_BoundedComposer, _Parser, yaml.constructor.SafeConstructor,
                  yaml.resolver.Resolver):
        """libyaml's events, composed and constructed by PyYAML's safe Python classes."""

        def __init__(self, stream: str):
            _Parser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            _BoundedComposer.__init__(self)
else:  # pragma: no cover - PyYAML without libyaml
    class _Loader(_BoundedComposer, yaml.SafeLoader):  # type: ignore[no-redef]
        """PyYAML's SafeLoader with the bounded composer."""


def parse(text: str, *, path: str, error: ErrorFactory, empty: str = "the file is empty",
          max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
          max_nodes: int = MAX_NODES) -> YamlDoc:
    """Parse one YAML document. Raises `error` (one line, file:line and key) on anything wrong."""
    if len(text) > max_bytes:
        raise error(f"larger than {_size(max_bytes)}", path=path, line=None, key=None)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error("not valid Unicode text (a lone surrogate)", path=path,
                    line=text[:exc.start].count("\n") + 1, key="(yaml)") from None
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:
        raise _reader_error(exc, text, path, error) from None
    loader.max_depth, loader.max_nodes = max_depth, max_nodes
    try:
        root = _compose(loader, path, error, text)
        if root is None:
            raise error(empty, path=path, line=1, key="(document)")
        index = _Indexer(loader, path, error, max_depth, max_nodes)
        index.walk(root, (), 0)
        data = _construct(loader, root, path, error)
    finally:
        loader.dispose()
    return YamlDoc(path=path, data=data, lines=index.lines, texts=index.texts, error=error)


def load(path: str | Path, *, error: ErrorFactory, what: str = "a YAML file",
         empty: str = "the file is empty", max_bytes: int = MAX_BYTES) -> YamlDoc:
    """read_text + parse."""
    text = read_text(path, error=error, what=what, max_bytes=max_bytes)
    return parse(text, path=str(path), error=error, empty=empty, max_bytes=max_bytes)


class ValueTextError(ValueError):
    """parse_value's error: the text is not one bounded YAML value (message says why)."""

    def __init__(self, message: str, *, path: str, line: int | None = None,
                 key: str | None = None):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")


def parse_value(text: str, what: str = "<value>", max_bytes: int = 1 << 16,
                max_nodes: int = 10_000) -> Any:
    """One YAML value from a short text (a flag's KEY=VALUE), with the same bounds as files.
    Raises ValueTextError (a ValueError) instead of a YAML error, a bad date or an alias bomb."""
    return parse(text, path=what, error=ValueTextError, empty="empty", max_bytes=max_bytes,
                 max_nodes=max_nodes).data


class PackagedDataError(ValueTextError):
    """A file of cluster/data/ is not valid YAML: a defect of the package, not of the input."""


def packaged_text(name: str) -> str:
    """The text of a data file shipped in cluster/data/ (e.g. cluster.template.yaml)."""
    return resources.files("cluster.data").joinpath(name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def _packaged(name: str) -> Any:
    return parse(packaged_text(name), path=f"cluster/data/{name}", error=PackagedDataError).data


def packaged(name: str) -> Any:
    """A YAML data file of cluster/data/ as data: parsed once per process, a fresh copy for
    every caller (who may change it)."""
    return copy.deepcopy(_packaged(name))


def _compose(loader: _Loader, path: str, error: ErrorFactory, text: str) -> yaml.Node | None:
    try:
        return loader.get_single_node()
    except _TooDeep as exc:
        raise error(exc.what, path=path, line=exc.mark.line + 1, key="(yaml)") from None
    except yaml.reader.ReaderError as exc:
        raise _reader_error(exc, text, path, error) from None
    except yaml.YAMLError as exc:
        raise error(f"YAML syntax error: {_problem(exc)}", path=path, line=_mark_line(exc),
                    key="(yaml)") from None
    except RecursionError:
        raise error("nested too deeply", path=path, line=None, key="(yaml)") from None


def _reader_error(exc: yaml.reader.ReaderError, text: str, path: str,
                  error: ErrorFactory) -> Exception:
    line = text[:exc.position].count("\n") + 1
    char = exc.character if isinstance(exc.character, int) else 0
    return error(f"control character U+{char:04X} is not allowed in YAML", path=path,
                 line=line, key="(yaml)")


def _construct(loader: _Loader, root: yaml.Node, path: str, error: ErrorFactory) -> Any:
    try:
        return loader.construct_document(root)
    except yaml.YAMLError as exc:
        raise error(f"YAML error: {_problem(exc)}", path=path, line=_mark_line(exc),
                    key="(yaml)") from None
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise error(f"YAML value error: {_one_line(str(exc))}", path=path,
                    line=root.start_mark.line + 1, key="(yaml)") from None


class _Indexer:
    """Walks the node tree (aliases expanded, bounded), recording lines and scalar texts and
    constructing every scalar where its key path is known."""

    def __init__(self, loader: _Loader, path: str, error: ErrorFactory, max_depth: int,
                 max_nodes: int):
        self.loader, self.path, self.error = loader, path, error
        self.max_depth, self.budget = max_depth, max_nodes
        self.max_nodes = max_nodes
        self.lines: dict[tuple, int] = {}
        self.texts: dict[tuple, str] = {}

    def fail(self, at: tuple, message: str, node: yaml.Node) -> Exception:
        return self.error(message, path=self.path, line=node.start_mark.line + 1,
                          key=dotted(at))

    def walk(self, node: yaml.Node, at: tuple, depth: int) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise self.fail(at, f"more than {self.max_nodes} values once aliases are expanded "
                                "(nested aliases?)", node)
        if depth > self.max_depth:
            raise self.fail(at, f"nested deeper than {self.max_depth} levels (a recursive "
                                "alias?)", node)
        self.lines.setdefault(at, node.start_mark.line + 1)
        if not isinstance(node, yaml.ScalarNode) and node.tag not in _COLLECTION_TAGS:
            raise self.fail(at, f"unsupported YAML tag {node.tag[:60]!r}", node)
        if isinstance(node, yaml.ScalarNode):
            self.scalar(node, at)
        elif isinstance(node, yaml.MappingNode):
            self.mapping(node, at, depth)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.walk(item, at + (i,), depth + 1)

    def scalar(self, node: yaml.ScalarNode, at: tuple, record: bool = True) -> Any:
        if record:
            self.texts[at] = node.value
        problem = number_text_problem(node.tag, node.value)
        if problem:
            kind = "a decimal integer" if node.tag == _INT else "a decimal number"
            raise self.fail(at, f"must be {kind}, got {_short(node.value)} ({problem})", node)
        try:
            return self.loader.construct_object(node)
        except yaml.YAMLError as exc:
            raise self.fail(at, f"invalid value {_short(node.value)}: {_problem(exc)}",
                            node) from None
        except (ValueError, OverflowError) as exc:
            kind = _TAG_NAMES.get(node.tag, node.tag)
            why = _one_line(str(exc).split(";")[0]) or type(exc).__name__
            raise self.fail(at, f"invalid {kind} {_short(node.value)} ({why})", node) from None
        except (TypeError, AttributeError):
            kind = _TAG_NAMES.get(node.tag, node.tag)
            raise self.fail(at, f"invalid {kind} {_short(node.value)}", node) from None

    def mapping(self, node: yaml.MappingNode, at: tuple, depth: int) -> None:
        # Merged keys (`<<: *base`) first, so that the mapping's own keys win, as in YAML.
        merges = [v for k, v in node.value if k.tag == _MERGE]
        for value_node in merges:
            items = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for item in items:
                self.walk(item, at, depth + 1)
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.fail(at, "keys must be plain values, not a mapping or a list",
                                key_node)
            key = self.scalar(key_node, at + (key_node.value,), record=False)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                raise self.fail(at, "keys must be plain values", key_node) from None
            if first is not None:
                raise self.fail(at + (key,), f"duplicate key (first at line {first})", key_node)
            seen[key] = line
            self.lines[at + (key,)] = line
            self.walk(value_node, at + (key,), depth + 1)
            self.lines[at + (key,)] = line


_MERGE = "tag:yaml.org,2002:merge"
_COLLECTION_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("map", "seq", "omap", "pairs",
                                                                  "set"))


def number_text_problem(tag: str, text: str) -> str | None:
    """Why a scalar YAML resolved as a number is refused, or None (pure). YAML 1.1 reads
    `1:30` as 90 (base 60), `2_2` as 22, `010` as 8 and `0x1e` as 30: a person who writes
    them meant something else, so numbers are plain decimals only (exponents and `.inf`
    pass here; finiteness is the reader's check)."""
    if tag not in (_INT, _FLOAT):
        return None
    if ":" in text:
        return "YAML's base 60 is refused: it reads 1:30 as 90"
    if "_" in text:
        return "underscores in numbers are refused: YAML reads 2_2 as 22"
    if tag == _INT and not _DECIMAL.fullmatch(text):
        return "YAML reads 0x1e as 30 and 010 as 8"
    return None


def _mark_line(exc: BaseException) -> int | None:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return mark.line + 1 if mark is not None else None


def _problem(exc: BaseException) -> str:
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    return _one_line(f"{context}, {problem}" if context and problem != str(exc) else problem)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:200]


def _short(value: str) -> str:
    return repr(value if len(value) <= 60 else value[:60] + "...")
