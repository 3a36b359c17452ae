"""Deploy's waits: poll Serve (through the dashboard client) until an app is RUNNING or
DEPLOY_FAILED, or until it is gone; used by deploy, undeploy and tune's redeploys.

Both go through the one bounded poll (cluster/base/waits.py): a deadline, a fixed interval, a
bounded number of tries; a dashboard hiccup while Serve starts is kept (the last 5) and the
poll goes on. The pure parts (app_state, WaitOutcome, failure_reason) are cluster/serving/deploy.py's.
"""

from __future__ import annotations

import time
from typing import Callable

from cluster.serving.deploy import DEPLOY_FAILED, RUNNING, AppState, WaitOutcome, app_state
from cluster.base.waits import poll

Event = Callable[[str], None]
KEPT_ERRORS = 5


class _Seen:
    """What a wait has seen so far: the state it takes as the answer, the dashboard's errors,
    the last progress line."""

    def __init__(self):
        self.state: AppState | None = None
        self.errors: list[str] = []
        self.last = ""

    def error(self, exc: Exception) -> None:
        self.errors = (self.errors + [str(exc)])[-KEPT_ERRORS:]

    def say(self, line: str, on_event: Event) -> None:
        if line != self.last:
            on_event(line)
            self.last = line


def wait_for_app(client, name: str, timeout_s: float, previous_time: float | None = None,
                 poll_s: float = 3.0, on_event: Event = lambda _: None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> WaitOutcome:
    """Poll Serve until the app is RUNNING or DEPLOY_FAILED, at most timeout_s.

    previous_time: the app's last_deployed_time_s before this deploy; an answer still showing
    it describes the old version and is not taken as the result.
    """
    seen = _Seen()

    def probe() -> AppState | None:
        try:
            current = app_state(client.serve_details(), name)
        except Exception as exc:  # a dashboard hiccup while Serve starts: keep polling
            seen.error(exc)
            return None
        if current is None or (previous_time is not None
                               and current.last_deployed_time_s == previous_time):
            return None
        seen.state = current
        seen.say(current.summary(), on_event)
        return current

    got = poll(probe, lambda s: s is not None and s.status in (RUNNING, DEPLOY_FAILED),
               timeout_s=timeout_s, interval_s=poll_s, clock=clock, sleep=sleep)
    return WaitOutcome(seen.state, got.elapsed_s, got.timed_out, tuple(seen.errors))


def wait_until_gone(client, name: str, timeout_s: float, poll_s: float = 2.0,
                    on_event: Event = lambda _: None,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> WaitOutcome:
    """Poll Serve until it no longer lists the app, at most timeout_s."""
    seen = _Seen()
    gone = object()

    def probe():
        try:
            seen.state = app_state(client.serve_details(), name)
        except Exception as exc:
            seen.error(exc)
            return None
        if seen.state is None:
            return gone
        seen.say(f"{name}: {seen.state.status}", on_event)
        return seen.state

    got = poll(probe, lambda v: v is gone, timeout_s=timeout_s, interval_s=poll_s,
               clock=clock, sleep=sleep)
    return WaitOutcome(None if got.done else seen.state, got.elapsed_s, got.timed_out,
                       tuple(seen.errors))
