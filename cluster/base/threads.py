"""Calls in daemon threads with deadlines: the one parallel-threads helper of the toolkit.

    Call(fn)                     fn() in a daemon thread now; .result() joins it
    Calls([(delay_s, fn), ...])  each fn after its delay, all at once; .wait(i, deadline_s)
    parallel(items, work, deadline_s, late, max_parallel)
                                 work(item) for every item, at most max_parallel at a time,
                                 late(item) for a call past its deadline

Rules shared by all three: threads are daemons (a hung call never keeps the process alive, it
is abandoned at its deadline); an exception raised by a call is kept and raised again to the
caller that asks for its result (never a thread traceback on stderr); a call that has not
finished by its deadline has no result (None from Calls.wait, late(item) from parallel).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Generic, Hashable, Sequence, TypeVar

T = TypeVar("T")
I = TypeVar("I")


class Call(Generic[T]):
    """fn() in a daemon thread, after delay_s; on_done() (if given) runs when it ends."""

    def __init__(self, fn: Callable[[], T], *, delay_s: float = 0.0, name: str | None = None,
                 on_done: Callable[[], None] | None = None):
        self._value: T | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, args=(fn, delay_s), daemon=True,
                                        name=name)
        self._thread.start()

    def _run(self, fn: Callable[[], T], delay_s: float) -> None:
        try:
            if delay_s > 0:
                time.sleep(delay_s)
            self._value = fn()
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc
        finally:
            self._finished = True
            if self._on_done is not None:
                self._on_done()

    @property
    def finished(self) -> bool:
        return self._finished

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait up to timeout_s (None: for ever); True when the call has finished."""
        self._thread.join(None if timeout_s is None else max(0.0, timeout_s))
        return self._finished

    def result(self, timeout_s: float | None = None) -> T | None:
        """The call's value (re-raising its exception); None when it is still running after
        timeout_s (None: wait for ever)."""
        if not self.join(timeout_s):
            return None
        if self._error is not None:
            raise self._error
        return self._value


class Calls(Generic[T]):
    """Callables started at once in daemon threads, each after its delay; wait for any one."""

    def __init__(self, items: Sequence[tuple[float, Callable[[], T]]]):
        self._start = time.monotonic()
        self._calls = [Call(fn, delay_s=delay) for delay, fn in items]

    def __len__(self) -> int:
        return len(self._calls)

    def wait(self, i: int, deadline_s: float) -> T | None:
        """The i-th result, waiting until deadline_s after the start (None: not finished)."""
        return self.wait_until(i, self._start + deadline_s)

    def wait_until(self, i: int, monotonic_deadline: float) -> T | None:
        """The i-th result, waiting until time.monotonic() reaches the deadline."""
        return self._calls[i].result(monotonic_deadline - time.monotonic())


def run_all(items: Sequence[tuple[float, Callable[[], T]]], deadline_s: float) -> list[T | None]:
    """Run callables in threads, each after its delay; wait at most deadline_s for all
    (None for a call not finished by then)."""
    calls = Calls(items)
    return [calls.wait(i, deadline_s) for i in range(len(calls))]


def parallel(items: Sequence[I], work: Callable[[I], T], deadline_s: float,
             late: Callable[[I], T], max_parallel: int | None = None,
             key: Callable[[I], Hashable] = lambda item: item.name) -> dict:
    """Call work(item) for every item in daemon threads, at most max_parallel at a time.

    Each item gets deadline_s from the moment its call starts; a call still running then gets
    late(item) as its result, its thread is abandoned and its slot goes to the next item, so a
    hung item delays no one and the whole call returns within
    ceil(len(items) / max_parallel) x deadline_s. Results are keyed by key(item) (a node's
    name). A call that raised is raised again once every other call has ended or gone late.
    """
    items = list(items)
    limit = len(items) if not max_parallel else max(1, min(int(max_parallel), len(items)))
    results: dict = {}
    errors: list[BaseException] = []
    waiting = list(reversed(items))
    running: dict = {}       # key -> (item, Call, monotonic deadline)
    done = threading.Condition()

    def notify() -> None:
        with done:
            done.notify_all()

    with done:
        while waiting or running:
            while waiting and len(running) < limit:
                item = waiting.pop()
                call = Call(lambda item=item: work(item), name=f"cluster-{key(item)}",
                            on_done=notify)
                running[key(item)] = (item, call, time.monotonic() + deadline_s)
            now = time.monotonic()
            ended = [k for k, (_, call, end) in running.items() if call.finished or end <= now]
            for k in ended:
                item, call, _ = running.pop(k)
                if not call.finished:
                    results[k] = late(item)
                    continue
                try:
                    results[k] = call.result(0)
                except Exception as exc:  # noqa: BLE001 - raised below, after the others
                    errors.append(exc)
            if running and not ended:
                done.wait(min(end for _, _, end in running.values()) - now)
    if errors:
        raise errors[0]
    return results
