"""A record's JSON has one writer: a frozen dataclass whose to_dict() is its fields by name, in
order, each made plain, inherits cluster.base.results.Record (to_dict = fields_dict(self))
instead of listing its fields again by hand or repeating that method (issue 43 item 5: one
helper where many places did the same job)."""

from __future__ import annotations

import ast
from pathlib import Path

from cluster.base.results import Record, fields_dict
from cluster.planning.fabric_groups import Layout
from cluster.planning.gang import NodeRank

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(d).startswith("dataclass") for d in cls.decorator_list)


def field_dicts_written_again(source: str) -> list[str]:
    """The dataclasses of `source` whose to_dict returns fields_dict(self) or a dict literal of
    exactly their fields, in order, each `self.f` or `list(self.f)`: what Record gives."""
    found = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef) or not _is_dataclass(cls):
            continue
        names = [s.target.id for s in cls.body
                 if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "to_dict"):
                continue
            returned = fn.body[-1]
            if ast.unparse(returned) == "return fields_dict(self)":
                found.append(cls.name)
                continue
            if not (isinstance(returned, ast.Return) and isinstance(returned.value, ast.Dict)):
                continue
            keys = [k.value if isinstance(k, ast.Constant) else None for k in returned.value.keys]
            values = [ast.unparse(v) for v in returned.value.values]
            if keys == names and all(v in (f"self.{k}", f"list(self.{k})")
                                     for k, v in zip(keys, values)):
                found.append(cls.name)
    return found


def test_the_scan_sees_a_to_dict_that_lists_its_fields():
    """Control: a hand-listed to_dict and a repeated fields_dict one are seen; one that renames,
    rounds or leaves out is not."""
    source = '''
@dataclass(frozen=True)
class Repeated:
    a: int

    def to_dict(self) -> dict:
        return fields_dict(self)


@dataclass(frozen=True)
class Listed:
    a: int
    b: tuple[str, ...]

    def to_dict(self):
        return {"a": self.a, "b": list(self.b)}


@dataclass(frozen=True)
class Renamed:
    a: float

    def to_dict(self):
        return {"alpha": round(self.a, 1)}
'''
    assert field_dicts_written_again(source) == ["Repeated", "Listed"]


def test_no_record_lists_its_fields_by_hand():
    listed = {str(p.relative_to(CLUSTER)): names for p in sorted(CLUSTER.rglob("*.py"))
              if (names := field_dicts_written_again(p.read_text()))}
    assert listed == {}, f"inherit cluster.base.results.Record instead: {listed}"


def test_a_record_s_json_is_its_fields_in_order_with_tuples_as_lists():
    layout = Layout(tp=2, pp=2, replicas=3)
    assert isinstance(layout, Record)
    assert list(layout.to_dict().items()) == [("tp", 2), ("pp", 2), ("dp", 1), ("ep", False),
                                              ("replicas", 3), ("nnodes", None)]
    rank = NodeRank(1, (2, 3), (1,), (0, 1))
    assert fields_dict(rank) == rank.to_dict() == {"node_rank": 1, "ranks": [2, 3], "stages": [1],
                                                   "tp_ranks": [0, 1], "dp_ranks": [0]}
