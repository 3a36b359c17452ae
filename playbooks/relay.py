"""The model relay run from the laptop (issue 27): start model_copy.py `relay` on the source and
on every receiving node in the shape's order, watch each node's progress, stop them all.

Used by `cluster model pull` (playbooks/model_pull.py) and `cluster fix --checks model`
(playbooks/fix_model.py). Every node runs the on-node program as root (sudo -n when the SSH
user is not root), detached, on its node IP and the first free port of
expectations.model_relay.ports, with a fresh secret key and the run's peers (its nodes'
addresses, loopback) on stdin; a node's upstreams are its ancestors in the shape, nearest first.
Every request is signed with the key (model_copy.py `auth_headers`: the key is never sent).
Progress is each node's signed GET /.status over that node's own SSH connection (a direct-tcpip
channel: no port is opened to the laptop).

A `Feed` source is a directory on the laptop (cluster/remedy/laptop_feed.py): nothing is started
for it; its first node's relay pulls from the feed's URL (that node's end of an SSH remote
forward), and no other node is ever told that URL.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from cluster.base.errors import ClusterError, ParseError, ProgramError, RemoteError
from cluster.remedy.fixes import as_root
from cluster.nodes.inventory import Inventory, Node
from cluster.remedy.model_relay import Progress, RelaySettings, RelayShape, fed_shape, parse_progress, \
    rate_text, relay_shape
from cluster.remedy.model_sync import CopyPlan, Manifest, parse_manifest
from cluster.node_programs.model_copy import AUTH_HEADER, LOOPBACK_PEERS, auth_headers
from cluster.node_programs import (Call as ProgramCall, document_of, failure, fan_out_program,
                                   parse_answer, program_call, run_call)
from cluster.nodes.remote import CommandResult, Session
from cluster.base.threads import Call
from cluster.base.waits import poll

MANIFEST_TIMEOUT_S = 3600          # hashing a large model: about 1 GB/s per node
POLL_S = 1.0
PROGRESS_EVERY_S = 5.0
SILENT_FAIL_S = 40.0               # a node unheard of this long, the others finished: failed
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 15
MIN_RATE_BPS = 5 << 20             # the relay's lifetime assumes at least 5 MiB/s per link
BASE_S = 300
MAX_S = 24 * 3600
STATUS_MAX_BYTES = 256 << 10
_MIB = 1 << 20

DirOf = Callable[[Node], str]
PROGRAM = "model_copy"             # cluster/node_programs/model_copy.py, on every node as root


def root_wrap(inventory: Inventory, local_root: bool) -> Callable[[Node, str], str]:
    """node, command -> the command as root there (sudo -n when the SSH user is not root)."""
    return lambda node, command: as_root(command, node, inventory, local_root)


def program(inventory: Inventory, node: Node, local_root: bool, name: str, args: Sequence[str],
            data: str = "") -> ProgramCall:
    """`python -c BOOT ARGS` of an on-node program as root (ray.root_python, never the Ray
    user's interpreter), `data` after it on stdin."""
    return program_call(inventory.ray.root_python, name, args, data,
                        wrap=functools.partial(root_wrap(inventory, local_root), node))


def answer_of(res: CommandResult, name: str = PROGRAM) -> dict:
    """The program's JSON document (the one reader; also one printed with a non-zero exit), or
    a dict with the error (never raises)."""
    got = document_of(res, name)
    return got if isinstance(got, dict) else {"error": _why(got)}


def _why(exc: ProgramError) -> str:
    if not exc.reached:
        return f"{exc.result.status}: {exc.result.error}"
    return f"no answer from the node's python: {failure(exc, exc.result.node)[:300]}"


def manifests(inventory: Inventory, session: Session, nodes: Sequence[Node],
              local_root: bool, dir_of: DirOf) -> dict[str, Manifest | str]:
    """node -> its manifest, or why there is none."""
    got = fan_out_program(session, nodes, PROGRAM,
                          lambda n: ["manifest", "--dir", dir_of(n),
                                     "--for", str(MANIFEST_TIMEOUT_S - 60)],
                          stdin="", timeout=MANIFEST_TIMEOUT_S, python=inventory.ray.root_python,
                          wrap=root_wrap(inventory, local_root))
    out: dict[str, Manifest | str] = {}
    for node, doc in zip(nodes, got):
        if isinstance(doc, ProgramError):
            doc = doc.doc if doc.doc is not None else {"error": _why(doc)}
        try:
            out[node.name] = parse_manifest(doc)
        except ParseError as exc:
            out[node.name] = f"manifest: {exc}"
    return out


def run_peers(nodes: Sequence[Node]) -> list[str]:
    """The addresses a run's relays answer: each node's IP (and its SSH address when that is an
    IP) and loopback (the status poll arrives through the node's own sshd)."""
    out = set(LOOPBACK_PEERS)
    for node in nodes:
        for text in (node.ip, node.address):
            try:
                out.add(str(ipaddress.ip_address(text)))
            except ValueError:
                pass
    return sorted(out)


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


@dataclass(frozen=True)
class Feed:
    """A source outside the inventory (the laptop's directory, cluster/remedy/laptop_feed.py): only
    the node `first` reaches it, at `url`; it checks requests with the relay's key `token`."""

    name: str
    first: str
    url: str
    token: str


@dataclass
class _Member:
    node: Node | None                  # None: the feed (nothing to start or stop)
    url: str | None = None
    pid: int | None = None
    port: int | None = None
    error: str | None = None
    progress: Progress | None = None
    heard: float = 0.0
    last_error: str | None = None


@dataclass(frozen=True)
class RelayReport:
    """What each receiving node's relay reported (its last status) or why there is none."""

    shape: RelayShape
    progress: Mapping[str, Progress]
    errors: Mapping[str, str]
    seconds: float


def relay_lifetime(total_bytes: int) -> int:
    return int(min(MAX_S, BASE_S + total_bytes / MIN_RATE_BPS))


class _Relay:
    def __init__(self, inventory: Inventory, session: Session, local_root: bool, dir_of: DirOf,
                 token: str | None = None):
        self.inventory, self.session, self.local_root = inventory, session, local_root
        self.dir_of = dir_of
        self.settings = RelaySettings.from_expectations(inventory.expectations)
        self.token = token or secrets.token_urlsafe(32)
        self.tag = secrets.token_hex(6)
        self.peers: list[str] = list(LOOPBACK_PEERS)

    def start(self, m: _Member, files: list[dict], fetch: list[str], upstreams: list[str],
              lifetime: int) -> None:
        data = self.token + "\n" + json.dumps({"files": files, "fetch": fetch,
                                               "upstreams": upstreams, "peers": self.peers})
        call = program(self.inventory, m.node, self.local_root, PROGRAM,
                       ["relay", "--dir", self.dir_of(m.node), "--bind", m.node.ip, "--ports",
                        self.settings.port_text, "--for", str(lifetime), "--tag", self.tag],
                       data)
        doc = answer_of(run_call(self.session, m.node, call, timeout=START_TIMEOUT_S))
        if type(doc.get("pid")) is int and type(doc.get("port")) is int:
            m.pid, m.port = doc["pid"], doc["port"]
        else:
            m.error = f"the relay did not start: {str(doc.get('error', 'no pid'))[:300]}"

    def url(self, m: _Member) -> str:
        return m.url or f"http://{_url_host(m.node.ip)}:{m.port}"

    def status(self, m: _Member) -> dict:
        """A signed GET /.status over the node's SSH connection (TunnelError, RemoteError...)."""
        from cluster.nodes.head_tunnel import HeadTunnel      # httpx: not at the CLI's import

        stream = HeadTunnel(self.session, m.node, timeout=5).open(m.node.ip, m.port, timeout=5)
        try:
            stream.settimeout(5)
            auth = auth_headers(self.token, "/.status")[AUTH_HEADER]
            stream.sendall(f"GET /.status HTTP/1.0\r\nHost: {_url_host(m.node.ip)}\r\n"
                           f"{AUTH_HEADER}: {auth}\r\n\r\n".encode())
            data = b""
            while len(data) <= STATUS_MAX_BYTES:
                block = stream.recv(65536)
                if not block:
                    break
                data += block
        finally:
            stream.close()
        head, _, body = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.") or head.split(b" ")[1:2] != [b"200"]:
            raise ParseError("relay status", "not a 200 reply")
        return parse_answer(body.decode("utf-8", "replace"), "model_copy relay status",
                            m.node.name, STATUS_MAX_BYTES)

    def stop(self, m: _Member) -> None:
        if m.pid is None:
            return
        call = program(self.inventory, m.node, self.local_root, PROGRAM,
                       ["stop", "--pid", str(m.pid), "--tag", self.tag])
        run_call(self.session, m.node, call, timeout=STOP_TIMEOUT_S)


def _poll_status(relay: _Relay, m: _Member, done: list, lifetime: int) -> None:
    """The member's /.status every POLL_S until the relay is over (`done`), at most
    its lifetime."""
    def probe() -> None:
        try:
            m.progress = parse_progress(relay.status(m))
            m.heard = time.monotonic()
        except (ClusterError, OSError, ValueError, EOFError) as exc:
            m.last_error = str(exc)[:200]
        except Exception as exc:            # paramiko's own errors on a dying transport
            m.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"

    poll(probe, lambda _: bool(done), timeout_s=lifetime + SILENT_FAIL_S, interval_s=POLL_S)


def run_relay(inventory: Inventory, session: Session, source: Node | Feed, reference: Manifest,
              plans: Mapping[str, CopyPlan], targets: Mapping[str, Node], local_root: bool,
              dir_of: DirOf, on_event: Callable[[str], None] = lambda line: None
              ) -> RelayReport:
    """Relay the reference's files from `source` (a node, or a Feed whose `first` is one of
    the busy targets) to every target with a non-empty plan."""
    feed = source if isinstance(source, Feed) else None
    relay = _Relay(inventory, session, local_root, dir_of, feed.token if feed else None)
    busy = [n for n in targets if plans[n].files]
    if feed:
        shape = fed_shape(feed.name, feed.first, [n for n in busy if n != feed.first],
                          relay.settings)
    else:
        shape = relay_shape(source.name, busy, relay.settings)
    files = [f.to_dict() for f in reference.files]
    total = sum(plans[n].bytes for n in busy)
    lifetime = relay_lifetime(max([plans[n].bytes for n in busy] + [0]) + total // 4)
    members = {feed.name: _Member(None, url=feed.url)} if feed else {source.name: _Member(source)}
    members.update({n: _Member(targets[n]) for n in busy})
    relay.peers = run_peers([m.node for m in members.values() if m.node is not None])
    start = time.monotonic()
    done: list = []
    try:
        for name in shape.order:
            m = members[name]
            if m.node is None:
                continue                # the feed serves already (cluster/remedy/laptop_feed.py)
            failed = [n for n in shape.order if members[n].error]
            if feed and name != feed.first:
                failed.append(feed.name)     # only the first node reaches the laptop
            ups = [relay.url(members[u]) for u in shape.upstreams(name, skip=failed)]
            if name != shape.source and not ups:
                m.error = "no upstream started"
                continue
            relay.start(m, files, [f.path for f in plans[name].files] if name != shape.source
                        else [], ups, lifetime)
            if m.error and (name == shape.source or (feed and name == feed.first)):
                raise RemoteError(name, m.error)
            m.heard = time.monotonic()
            if not m.error:
                Call(lambda m=m: _poll_status(relay, m, done, lifetime),
                     name=f"relay-status-{name}")
        on_event(f"model: relay {shape.kind} {' | '.join(shape.lines())[:300]}; "
                 f"{total / _MIB:.1f} MiB to {len(busy)} node(s)")
        _watch(members, busy, start, lifetime, on_event)
    finally:
        done.append(True)
        stoppers = [Call(lambda m=m: relay.stop(m)) for m in members.values() if m.pid]
        for c in stoppers:
            c.join(STOP_TIMEOUT_S + 5)
    progress = {n: members[n].progress for n in busy if members[n].progress is not None}
    errors = {}
    for n in busy:
        m = members[n]
        if m.error:
            errors[n] = m.error
        elif m.progress is None or not m.progress.finished:
            errors[n] = (f"stopped answering (last heard {time.monotonic() - m.heard:.0f} s "
                         f"before the end: {m.last_error or 'no status'})")
    return RelayReport(shape, progress, errors, time.monotonic() - start)


def _watch(members: Mapping[str, _Member], busy: Sequence[str], start: float, lifetime: int,
           on_event: Callable[[str], None]) -> None:
    """Until every receiving node is finished, silent too long, or the lifetime is over."""
    last_line = [time.monotonic()]

    def live_and_silent() -> tuple[list[str], list[str]]:
        now = time.monotonic()
        live = [n for n in busy if not members[n].error
                and not (members[n].progress and members[n].progress.finished)]
        return live, [n for n in live if now - members[n].heard > SILENT_FAIL_S]

    def report(_value) -> None:
        now = time.monotonic()
        if now - last_line[0] >= PROGRESS_EVERY_S:
            last_line[0] = now
            on_event("model: " + ", ".join(_progress_text(n, members[n]) for n in busy))

    poll(live_and_silent, lambda v: not v[0] or len(v[1]) == len(v[0]),
         timeout_s=max(0.0, lifetime - (time.monotonic() - start)), interval_s=POLL_S,
         on_value=report)


def _progress_text(name: str, m: _Member) -> str:
    p = m.progress
    if m.error or p is None:
        return f"{name} -"
    return (f"{name} {p.bytes / _MIB:.0f}/{p.total / _MIB:.0f} MiB "
            f"{rate_text(p.bytes, p.seconds)}{' ' + p.state if p.finished else ''}")


