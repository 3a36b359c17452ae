"""The clock fact: a node's clock against this machine's, from round trips on an open channel.

A sample is one ask of a conversation (Session.exchange): a newline to the node, its
`date +%s.%N` back, stamped here when the ask left and when the answer came; the offset is taken
against the round trip's midpoint, the best of up to CLOCK_SAMPLES round trips kept. The
conversation is either a command of its own (CLOCK_COMMAND, `sample_clock`) or the end of the
preflight's gather script (CLOCK_CONVERSATION after the line CLOCK_MARK: the gather's channel,
no second command per node). `clock_sample` is the pure reading of either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cluster.nodes.inventory import Node
from cluster.nodes.remote import Exchange, Session, parallel


@dataclass(frozen=True)
class ClockSample:
    node: str
    offset_s: float | None  # node clock - laptop clock, RTT-compensated
    rtt_s: float | None
    error: str | None = None


# Each newline read is answered with the node's clock: a sample is one round trip on an open
# channel, not a command of its own.
CLOCK_LOOP = "while read -r _; do date +%s.%N || exit; done"
CLOCK_COMMAND = f"sh -c '{CLOCK_LOOP}'"
# The line a gather script prints before its CLOCK_LOOP (every line of its probes' output is
# prefixed, so no probe can print it).
CLOCK_MARK = "@@cluster-clock@@"
CLOCK_CONVERSATION = f"printf '%s\\n' '{CLOCK_MARK}'\n{CLOCK_LOOP}"
CLOCK_SAMPLES = 3

GOOD_RTT_S = 0.02  # a sample this quick bounds the offset to +-10 ms: no need for more


def quick_enough(reply) -> bool:
    """Session.exchange's `enough`: a round trip under GOOD_RTT_S ends the asking."""
    return reply.round_trip_s < GOOD_RTT_S


def clock_sample(node: str, got: Exchange) -> ClockSample:
    """Pure: a clock conversation's replies -> the sample with the smallest round trip (an
    error sample, never an exception, when there is none or a reply is not a clock)."""
    if not got.replies:
        res = got.result
        why = res.error or (f"exit {res.exit_code}" if not res.ok else "no date output")
        return ClockSample(node, None, None, why)
    best: tuple[float, float] | None = None
    for reply in got.replies:
        try:
            remote = float(reply.line.strip())
        except ValueError:
            remote = math.nan
        if not math.isfinite(remote):
            return ClockSample(node, None, None, f"unreadable date output {reply.line[:80]!r}")
        offset = remote - (reply.sent_s + reply.received_s) / 2
        if best is None or reply.round_trip_s < best[1]:
            best = (offset, reply.round_trip_s)
    assert best is not None
    return ClockSample(node, best[0], best[1])


def sample_clock(session: Session, node: Node, samples: int = CLOCK_SAMPLES) -> ClockSample:
    """Offset of a node's clock from this machine's: up to `samples` round trips on one
    command (Session.exchange), stopping early once one is under GOOD_RTT_S."""
    return clock_sample(node.name, session.exchange(node, CLOCK_COMMAND, samples, quick_enough,
                                                    timeout=10))


def measure_skew(session: Session, nodes: Sequence[Node]) -> dict[str, ClockSample]:
    """sample_clock on every node at once."""
    return parallel(list(nodes), lambda n: sample_clock(session, n), 60,
                    lambda n: ClockSample(n.name, None, None, "no answer"),
                    session.max_parallel)
