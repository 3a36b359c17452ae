"""The model relay's pure parts (issue 27): its shape, a node's progress and its verdict.

A relay copies one model directory from a source node to many nodes in a pipeline: every node
serves the bytes it has received while it receives the rest (cluster/node_programs/model_copy.py
`relay`). The shape is data:

    chain   source -> t1 -> t2 -> ... -> tN      (each link carries one copy: the time of one
                                                 copy over one link, whatever N)
    tree    a k-ary heap over [source, t1, ...]  (above `chain_max_nodes` targets: fewer hops,
                                                 a failure cuts off fewer nodes, at 1/k of the
                                                 link rate per child)

A node's upstreams are its ancestors, nearest first: when its parent falls silent the node
re-attaches to the grandparent (and so on), resuming each file with a Range request.

A directory on the laptop is one more hop in front (`fed_shape`): laptop -> first node, then
the chain or tree from that node; only the first node reaches the laptop (an SSH remote
forward on its loopback, cluster/remedy/laptop_feed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.base.bounds import bound, reply_number
from cluster.base.errors import ParseError, UsageError

STATES = ("running", "done", "failed", "serving")


@dataclass(frozen=True)
class RelaySettings:
    """expectations.model_relay: the port range and when a chain becomes a tree."""

    ports: tuple[int, int]
    chain_max_nodes: int
    tree_fanout: int

    @classmethod
    def from_expectations(cls, expectations: Mapping[str, Any]) -> "RelaySettings":
        raw = expectations["model_relay"]
        ports = tuple(raw["ports"])
        if len(ports) != 2 or not 0 < ports[0] <= ports[1] < 65536 or ports[1] - ports[0] > 1000:
            raise UsageError("expectations.model_relay.ports must be [LOW, HIGH], 1-65535, "
                             "at most 1000 ports")
        return cls((ports[0], ports[1]), int(raw["chain_max_nodes"]), int(raw["tree_fanout"]))

    @property
    def port_text(self) -> str:
        return f"{self.ports[0]}-{self.ports[1]}"


@dataclass(frozen=True)
class RelayShape:
    """Who receives from whom: `order` is the start order (source first), `parent` per node."""

    kind: str                                  # chain | tree
    fanout: int
    order: tuple[str, ...]
    parent: tuple[tuple[str, str], ...]        # (node, the node it receives from)

    @property
    def source(self) -> str:
        return self.order[0]

    def upstreams(self, node: str, skip: Sequence[str] = ()) -> tuple[str, ...]:
        """The node's ancestors, nearest first, without those in `skip` (failed to start)."""
        parents = dict(self.parent)
        out: list[str] = []
        while node in parents:
            node = parents[node]
            if node not in skip:
                out.append(node)
        return tuple(out)

    @property
    def depth(self) -> int:
        return max((len(self.upstreams(n)) for n in self.order), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "fanout": self.fanout, "source": self.source,
                "depth": self.depth,
                "edges": [{"from": p, "to": n} for n, p in self.parent]}

    def lines(self) -> list[str]:
        """The shape as text for the dry run: one line per sender and its receivers."""
        children: dict[str, list[str]] = {}
        for n, p in self.parent:
            children.setdefault(p, []).append(n)
        if self.kind == "chain":
            return [" -> ".join(self.order)]
        return [f"{p} -> {', '.join(c)}" for p, c in children.items()]


def relay_shape(source: str, targets: Sequence[str], settings: RelaySettings) -> RelayShape:
    """A chain up to settings.chain_max_nodes targets, else a tree of fan-out tree_fanout."""
    order = (source, *targets)
    tree = len(targets) > settings.chain_max_nodes
    k = max(2, settings.tree_fanout) if tree else 1
    parent = tuple((order[i], order[(i - 1) // k]) for i in range(1, len(order)))
    return RelayShape("tree" if tree else "chain", k, order, parent)


def fed_shape(feed: str, first: str, others: Sequence[str], settings: RelaySettings
              ) -> RelayShape:
    """The relay fed from outside the cluster (the laptop): `feed` sends to `first` alone,
    which is the source of relay_shape over the others (the feed is reachable from `first`
    only: never an upstream of the others)."""
    inner = relay_shape(first, others, settings)
    return RelayShape(inner.kind, inner.fanout, (feed, *inner.order),
                      ((first, feed), *inner.parent))


@dataclass(frozen=True)
class Progress:
    """One relay node's /.status document, checked."""

    state: str
    bytes: int            # moved in this run
    total: int            # bytes this node fetches
    files: int
    done: int
    failed: tuple[str, ...]
    seconds: float
    verified: bool

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed")


def parse_progress(doc: Any) -> Progress:
    """A relay's status document; ParseError on anything out of shape or range."""
    if not isinstance(doc, dict):
        raise ParseError("relay status", "not a JSON object")
    state = doc.get("state")
    if state not in STATES:
        raise ParseError("relay status", f"bad state {str(state)[:40]!r}")
    ints = {}
    for key in ("bytes", "total", "files", "done"):
        ints[key] = reply_number(doc.get(key, 0), lo=0,
                                 hi=bound("replies", "relay_bytes_max"), integer=True)
        if ints[key] is None:
            raise ParseError("relay status", f"bad {key}")
    seconds = reply_number(doc.get("seconds", 0.0), lo=0,
                           hi=bound("replies", "relay_seconds_max"))
    if seconds is None:
        raise ParseError("relay status", "bad seconds")
    failed = doc.get("failed") or []
    if not isinstance(failed, list) or not all(isinstance(f, dict) for f in failed):
        raise ParseError("relay status", "bad failed list")
    reasons = tuple(f"{str(f.get('path'))[:200]}: {str(f.get('reason'))[:300]}".lstrip(": ")
                    for f in failed[:50])
    return Progress(state, ints["bytes"], ints["total"], ints["files"], ints["done"], reasons,
                    seconds, doc.get("verified") is True)


@dataclass(frozen=True)
class NodeResult:
    """One node's outcome of a pull: --json's {status, bytes, seconds, verified} per node."""

    node: str
    status: str            # ok (had it) | copied | failed | planned (dry run)
    bytes: int
    seconds: float
    verified: bool
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "verified": self.verified, "detail": self.detail}


def rate_text(nbytes: int, seconds: float) -> str:
    """`12.3 MiB/s` (or `-` before a second has passed)."""
    if seconds < 0.5:
        return "-"
    return f"{nbytes / seconds / (1 << 20):.1f} MiB/s"
