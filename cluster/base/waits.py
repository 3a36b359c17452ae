"""The one bounded poll/retry helper: every wait of the library (Ray's nodes joining, a Serve
app RUNNING or gone, replicas moved off a drained node, Ray's processes gone after `down`) and
every retry (an SSH connect through a dropped banner) goes through `poll` or `retry`.

Both are bounded three ways: a deadline (timeout_s / budget_s from the first try), a fixed
interval (or a backoff) between tries, and a maximum number of attempts. A poll that runs out
returns `Polled` with `done` False (callers that need an error call `.value_or_raise()`, which
raises the typed `WaitTimeout`); a retry that runs out raises `GaveUp` with the last error.
The clock and sleep are injectable (default: time.monotonic / time.sleep, looked up at call
time) so unit tests need no real time.

tenacity is not in the toolkit's environment; this module is the small stand-in the
developers' brief asks for (deadline, interval, bounded attempts, typed timeout error).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from cluster.base.errors import ClusterError

T = TypeVar("T")

Clock = Callable[[], float]
Sleep = Callable[[float], None]

MAX_POLL_ATTEMPTS = 100_000  # a poll's hard cap whatever its timeout and interval say


class WaitTimeout(ClusterError):
    """A poll ran out of time or attempts before its condition held."""

    def __init__(self, what: str, timeout_s: float, attempts: int):
        self.what = what
        self.timeout_s = timeout_s
        self.attempts = attempts
        super().__init__(f"{what}: not done within {timeout_s:g} s ({attempts} attempts)")


class GaveUp(Exception):
    """retry() stopped: `error` is the last attempt's exception, after `attempts` tries."""

    def __init__(self, error: BaseException, attempts: int):
        super().__init__(str(error))
        self.error = error
        self.attempts = attempts

    @property
    def attempts_text(self) -> str:
        return f" (after {self.attempts} attempts)" if self.attempts > 1 else ""


@dataclass(frozen=True)
class Polled(Generic[T]):
    """How a poll ended: the last value probed, whether the condition held, the time taken."""

    value: T | None
    done: bool
    elapsed_s: float
    attempts: int
    timeout_s: float

    @property
    def timed_out(self) -> bool:
        return not self.done

    def value_or_raise(self, what: str) -> T:
        if not self.done:
            raise WaitTimeout(what, self.timeout_s, self.attempts)
        return self.value  # type: ignore[return-value]


def _checked(name: str, value: float, low: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not math.isfinite(value) or value < low:
        raise ValueError(f"{name} must be a finite number >= {low:g}, got {value!r}")
    return float(value)


def attempts_for(timeout_s: float, interval_s: float) -> int:
    """The most tries a poll of timeout_s at interval_s can make (one at t=0, then one per
    interval while another interval fits), capped at MAX_POLL_ATTEMPTS."""
    if interval_s <= 0:
        return MAX_POLL_ATTEMPTS
    return min(MAX_POLL_ATTEMPTS, int(timeout_s // interval_s) + 1)


def poll(probe: Callable[[], T], done: Callable[[T], bool], *, timeout_s: float,
         interval_s: float, max_attempts: int | None = None,
         on_value: Callable[[T], None] | None = None,
         clock: Clock | None = None, sleep: Sleep | None = None) -> Polled[T]:
    """probe() until done(value), at most timeout_s from the first probe and max_attempts tries.

    A probe runs at once; another starts only while one more interval still fits in timeout_s,
    so the poll ends within timeout_s plus the last probe's own time. on_value sees every value
    (callers report progress from it). A probe's exception propagates: a probe that tolerates
    hiccups catches them itself and returns a value saying so.
    """
    clock, sleep = clock or time.monotonic, sleep or time.sleep
    timeout_s = _checked("timeout_s", timeout_s, 0.0)
    interval_s = _checked("interval_s", interval_s, 0.0)
    limit = attempts_for(timeout_s, interval_s) if max_attempts is None \
        else max(1, min(int(max_attempts), MAX_POLL_ATTEMPTS))
    start = clock()
    attempts = 0
    while True:
        value = probe()
        attempts += 1
        if on_value is not None:
            on_value(value)
        if done(value):
            return Polled(value, True, clock() - start, attempts, timeout_s)
        if attempts >= limit or clock() - start + interval_s > timeout_s:
            return Polled(value, False, clock() - start, attempts, timeout_s)
        sleep(interval_s)


def backoff_pause(attempt: int, base: float = 0.1, cap: float = 2.0) -> float:
    """Jittered exponential backoff ("full jitter"): uniform in [0.5, 1.5) x base x 2^(n-1)."""
    return min(cap, base * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)


def retry(attempt: Callable[[], T], *, retryable: Callable[[BaseException], bool],
          budget_s: float, attempt_s: float, max_attempts: int,
          pause: Callable[[int], float] = backoff_pause,
          clock: Clock | None = None, sleep: Sleep | None = None) -> T:
    """attempt() until it succeeds, retrying the failures `retryable` accepts.

    A retry starts only while its pause plus one more attempt (attempt_s) fit in budget_s from
    the first try, and never past max_attempts, so the whole call ends within budget_s + the
    last attempt's own timeouts. Raises GaveUp with the last error (a non-retryable one at once).
    """
    clock, sleep = clock or time.monotonic, sleep or time.sleep
    budget_s = _checked("budget_s", budget_s, 0.0)
    give_up_at = clock() + budget_s
    n = 0
    while True:
        n += 1
        try:
            return attempt()
        except Exception as exc:
            wait = pause(n)
            if not retryable(exc) or n >= max_attempts or clock() + wait + attempt_s > give_up_at:
                raise GaveUp(exc, n) from exc
            sleep(wait)
