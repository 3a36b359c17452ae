"""Check results and reports: one status per result plus evidence; the exit-code contract."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


class Status(str, enum.Enum):
    """ok / warn / fail / skip / error. error = could not decide (unreachable, timeout, unparseable)."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {Status.OK: 0, Status.SKIP: 0, Status.WARN: 1, Status.FAIL: 2, Status.ERROR: 2}

EXIT_OK, EXIT_WARN, EXIT_FAIL = 0, 1, 2

# What a changing step did on one node (up, down, fix, every playbook): Ansible's vocabulary.
OK, CHANGED, FAILED, SKIPPED, UNREACHABLE = "ok", "changed", "failed", "skipped", "unreachable"
STEP_STATUSES = (OK, CHANGED, FAILED, SKIPPED, UNREACHABLE)


def exit_code_for(statuses: Iterable[Status]) -> int:
    """0 all ok (or skipped), 1 warnings only, 2 any failure or error."""
    return max((s.severity for s in statuses), default=EXIT_OK)


def worst(statuses: Iterable[Status]) -> Status:
    """The overall status: error > fail > warn > ok; skip only when nothing else was decided."""
    found = set(statuses)
    for s in (Status.ERROR, Status.FAIL, Status.WARN, Status.OK):
        if s in found:
            return s
    return Status.SKIP if found else Status.OK


def tail(text: str, lines: int = 20, chars: int = 2000) -> str:
    """The last lines of an output, bounded in size, for evidence."""
    out = "\n".join(text.rstrip("\n").splitlines()[-lines:])
    return out[-chars:]


@dataclass(frozen=True)
class Evidence:
    """What a verdict rests on: the command, its exit code, the end of its output, parsed data."""

    command: str | None = None
    exit_code: int | None = None
    output_tail: str = ""
    data: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "exit_code": self.exit_code,
                "output_tail": self.output_tail, "data": to_jsonable(self.data)}


@dataclass(frozen=True)
class CheckResult:
    """One check on one node (node=None for cross-node checks)."""

    check: str
    node: str | None
    status: Status
    summary: str
    evidence: Evidence = field(default_factory=Evidence)
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "node": self.node, "status": self.status.value,
                "summary": self.summary, "fix": self.fix, "evidence": self.evidence.to_dict()}


@dataclass(frozen=True)
class Report:
    """A list of results from one command run, with the exit code it implies."""

    command: str
    results: tuple[CheckResult, ...]
    facts: Any = field(default_factory=dict)    # plain JSON data or a record with to_dict()

    @property
    def status(self) -> Status:
        return worst(r.status for r in self.results)

    @property
    def exit_code(self) -> int:
        return exit_code_for(r.status for r in self.results)

    def by_node(self) -> dict[str | None, list[CheckResult]]:
        grouped: dict[str | None, list[CheckResult]] = {}
        for r in self.results:
            grouped.setdefault(r.node, []).append(r)
        return grouped

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in Status}
        for r in self.results:
            counts[r.status.value] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "status": self.status.value, "exit_code": self.exit_code,
                "counts": self.counts(), "results": [r.to_dict() for r in self.results],
                "facts": to_jsonable(self.facts)}


_SCALARS = frozenset((str, int, float, bool, type(None)))


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples and mappings to plain JSON types.

    Plain data (dicts, lists and scalars, the bulk of a large report) takes a fast path on the
    exact type; anything else goes through the general checks.
    """
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        return {k if type(k) is str else str(k): to_jsonable(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [to_jsonable(v) for v in value]
    return _to_jsonable_general(value)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def fields_dict(record: Any) -> dict[str, Any]:
    """A dataclass instance's fields by name, each to_jsonable: what a record's own to_dict()
    returns (a parser's result, a fact). The field names are looked up once per class."""
    kind = type(record)
    names = _FIELD_NAMES.get(kind)
    if names is None:
        import dataclasses
        names = _FIELD_NAMES.setdefault(kind, tuple(f.name for f in dataclasses.fields(kind)))
    return {name: to_jsonable(getattr(record, name)) for name in names}


class Record:
    """The base of a frozen dataclass whose JSON is its fields by name, each made plain: its
    to_dict() is fields_dict(self), written once here rather than again in every such record."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def _to_jsonable_general(value: Any) -> Any:
    import dataclasses
    from collections.abc import Mapping as AbcMapping

    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if hasattr(value, "to_dict"):
            return value.to_dict()
        return fields_dict(value)
    if isinstance(value, AbcMapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    return value
