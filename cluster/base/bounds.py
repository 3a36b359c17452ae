"""Bounds (cluster/data/limits.yaml) and checks for numbers entering from flags, configs or servers.

`bound("plan", "nodes")` reads a limit; `check_int` / `check_float` refuse what is not a
number of the right kind (bools are not numbers), not finite, or out of range, naming the
field and the value, with the error type the caller gives (UsageError for flags, PlanError for
model configs...); `reply_number` keeps a number of a server's answer only when it is one,
finite and in range (else None: the reader treats it as missing). Pure apart from the cached
YAML read.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from cluster.base.errors import ClusterError, UsageError
from cluster.base.yamlfile import packaged


@lru_cache(maxsize=1)
def limits() -> dict[str, dict[str, Any]]:
    """cluster/data/limits.yaml."""
    return packaged("limits.yaml")


def bound(section: str, key: str) -> int | float:
    """One limit, e.g. bound("bench", "timeout_s") -> 3600."""
    return limits()[section][key]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_int(value: Any, what: str, *, lo: int, hi: int | float,
              error: type[ClusterError] = UsageError, integral_float: bool = False) -> int:
    """value as an int in [lo, hi]; integral floats (4096.0) pass when integral_float."""
    ok_type = isinstance(value, int) or (integral_float and isinstance(value, float))
    if isinstance(value, bool) or not ok_type:
        raise error(f"{what}: expected a whole number, got {_shown(value)}")
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise error(f"{what}: expected a whole number, got {_shown(value)}")
    if not lo <= value <= hi:
        raise error(f"{what}: {_shown(value)} is out of range (expected {lo:,} to {hi:,})")
    return int(value)


def reply_number(value: Any, *, lo: float = -math.inf, hi: float = math.inf,
            integer: bool = False) -> int | float | None:
    """A number read from a server's or a program's answer, as a float (an int when
    `integer`, which then refuses floats): kept when it is a number (not a bool), finite and
    in [lo, hi]; None otherwise (the reader treats it as missing)."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if not lo <= value <= hi:
        return None
    return value if integer else float(value)


def check_float(value: Any, what: str, *, lo: float, hi: float, lo_open: bool = False,
                error: type[ClusterError] = UsageError) -> float:
    """value as a finite float in [lo, hi] ((lo, hi] when lo_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{what}: expected a number, got {_shown(value)}")
    number = float(value) if not isinstance(value, int) or abs(value) < 2 ** 1023 else math.inf
    if not math.isfinite(number):
        raise error(f"{what}: expected a finite number, got {_shown(value)}")
    if number < lo or number > hi or (lo_open and number == lo):
        low = "above" if lo_open else "from"
        raise error(f"{what}: {_shown(value)} is out of range (expected {low} {lo:g} to {hi:g})")
    return number
