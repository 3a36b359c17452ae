"""Percentiles of a stream of durations in bounded memory: exact while small, a log histogram after.

`Distribution` takes values one at a time (`add`) and merges with others (`merge`). Up to
EXACT_MAX values it keeps them all, and `percentile(q)` is exact (linear between closest
ranks, numpy's default: cluster/serving/bench.py `percentile`). Beyond that it folds them into
logarithmic buckets of ratio GROWTH (values below ZERO_S in one bucket for 0), so memory stays
bounded by the number of distinct buckets (a few thousand for durations from 1 µs to 1 h) however
many values arrive. In that mode each percentile is within RELATIVE_ERROR (1%) of the exact one,
or ZERO_S absolute for values under it; count, mean, min and max stay exact. Non-finite or
negative values are refused (ValueError): they are not durations.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable

EXACT_MAX = 10_000            # values kept as they are (an ordinary bench level: every one)
GROWTH = 1.02                 # bucket i holds [GROWTH**i, GROWTH**(i+1)) seconds
RELATIVE_ERROR = (GROWTH - 1) / (GROWTH + 1)   # < 1%: each bucket's value is its weighted middle
ZERO_S = 1e-9                 # below this a value counts as 0 (chunks that arrived together)
_LOG_GROWTH = math.log(GROWTH)
_ZERO = None                  # the key of the bucket for 0


class Distribution:
    """A bounded accumulator of non-negative finite values (seconds): count, mean, min, max,
    percentiles. Not thread-safe (one request, one level)."""

    __slots__ = ("count", "total", "low", "high", "_exact", "_buckets", "_exact_max")

    def __init__(self, exact_max: int = EXACT_MAX):
        self.count = 0
        self.total = 0.0
        self.low = math.inf
        self.high = -math.inf
        self._exact: list[float] | None = []
        self._buckets: dict[int | None, int] = {}
        self._exact_max = exact_max

    @classmethod
    def of(cls, values: Iterable[float], exact_max: int = EXACT_MAX) -> "Distribution":
        out = cls(exact_max)
        for value in values:
            out.add(value)
        return out

    def __repr__(self) -> str:
        return f"Distribution(count={self.count}, exact={self.exact})"

    def __len__(self) -> int:
        return self.count

    @property
    def exact(self) -> bool:
        """Percentiles are exact (every value is kept)."""
        return self._exact is not None

    @property
    def size(self) -> int:
        """The entries held (values or buckets): what memory grows with."""
        return len(self._exact) if self._exact is not None else len(self._buckets)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def add(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"not a duration: {value!r}")
        self.count += 1
        self.total += value
        self.low = min(self.low, value)
        self.high = max(self.high, value)
        if self._exact is not None:
            self._exact.append(value)
            if len(self._exact) > self._exact_max:
                self._fold()
        else:
            key = _bucket(value)
            self._buckets[key] = self._buckets.get(key, 0) + 1

    def merge(self, other: "Distribution") -> None:
        """Add every value of `other` (exact while the two together fit, else bucketed)."""
        if other.count == 0:
            return
        if self._exact is not None and other._exact is not None \
                and len(self._exact) + len(other._exact) <= self._exact_max:
            self._exact.extend(other._exact)
        else:
            if self._exact is not None:
                self._fold()
            for key, n in other._counts():
                self._buckets[key] = self._buckets.get(key, 0) + n
        self.count += other.count
        self.total += other.total
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100): exact, or within RELATIVE_ERROR once bucketed."""
        if not self.count:
            raise ValueError("percentile of no values")
        rank = (self.count - 1) * q / 100.0
        low = math.floor(rank)
        high = min(low + 1, self.count - 1)
        if self._exact is not None:
            values = sorted(self._exact)
            return values[low] + (values[high] - values[low]) * (rank - low)
        a, b = self._at(low), self._at(high)
        return a + (b - a) * (rank - low)

    def _fold(self) -> None:
        for value in self._exact or ():
            key = _bucket(value)
            self._buckets[key] = self._buckets.get(key, 0) + 1
        self._exact = None

    def _counts(self) -> Iterable[tuple[int | None, int]]:
        if self._exact is not None:
            return ((_bucket(v), 1) for v in self._exact)
        return self._buckets.items()

    def _at(self, index: int) -> float:
        """The value standing for the index-th smallest (0-based), within the bounds seen."""
        keys = sorted(self._buckets, key=lambda k: -math.inf if k is _ZERO else k)
        cumulative, seen = [], 0
        for key in keys:
            seen += self._buckets[key]
            cumulative.append(seen)
        key = keys[bisect.bisect_right(cumulative, index)]
        return min(max(_middle(key), self.low), self.high)


def _bucket(value: float) -> int | None:
    return _ZERO if value < ZERO_S else math.floor(math.log(value) / _LOG_GROWTH)


def _middle(key: int | None) -> float:
    """The value of bucket `key` with the least relative error to any value in it."""
    if key is _ZERO:
        return 0.0
    start = GROWTH ** key
    return 2 * start * GROWTH / (1 + GROWTH)
