"""`cluster model pull SOURCE`: one copy of a model directory onto every node through a
pipelined relay node to node (issue 27), and the relay itself (`run_relay`, also used by
`cluster fix --checks model`).

    1. source: NODE:PATH (a directory on one node), or a Hugging Face repo id downloaded by
       huggingface_hub on the head into --path (HF_TOKEN from the head's env on stdin)
    2. manifests (model_copy.py manifest, sha256 of every file) on the source and the targets
    3. plan (pure): each target's missing or differing files (cluster/model_sync.py); the
       relay's shape over the targets that need something (cluster/model_relay.py); dry run
    4. relay: every node of the shape starts model_copy.py `relay` (detached, on its node IP,
       the first free port of expectations.model_relay.ports, a fresh secret on stdin) in start
       order, told its ancestors' URLs (nearest first); progress read from each node's
       /TOKEN/.status over the node's SSH connection (a direct-tcpip channel)
    5. stop every relay; manifests again on the targets: verified when every file of the
       source is there with its sha256
A node that stops answering is bypassed by its successors (they re-attach to its upstream and
resume with Range) and reported failed; a second run fetches only what it still lacks.
"""

from __future__ import annotations

import json
import re
import shlex
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from cluster.errors import ClusterError, ParseError, RemoteError, UsageError
from cluster.head_tunnel import HeadTunnel
from cluster.inventory import Inventory, Node
from cluster.model_relay import (NodeResult, Progress, RelaySettings, RelayShape, parse_progress,
                                 rate_text, relay_shape)
from cluster.model_sync import CopyPlan, Manifest, copy_plan, still_different
from cluster.fixes import as_root
from cluster.node_programs import BOOT, with_input
from cluster.threads import Call
from playbooks.fix_model import DirOf, _command, _doc, _url_host, manifests

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
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?\Z")


# ------------------------------------------------------------------ the relay


@dataclass
class _Member:
    node: Node
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
    def __init__(self, inventory: Inventory, session, local_root: bool, dir_of: DirOf,
                 on_event: Callable[[str], None]):
        self.inventory, self.session, self.local_root = inventory, session, local_root
        self.dir_of, self.on_event = dir_of, on_event
        self.settings = RelaySettings.from_expectations(inventory.expectations)
        self.token = secrets.token_urlsafe(32)
        self.tag = secrets.token_hex(6)

    def start(self, m: _Member, files: list[dict], fetch: list[str], upstreams: list[str],
              lifetime: int) -> None:
        cmd = _command(self.inventory, m.node, self.local_root, "relay", "--dir",
                       self.dir_of(m.node), "--bind", m.node.ip, "--ports",
                       self.settings.port_text, "--for", str(lifetime), "--tag", self.tag)
        data = self.token + "\n" + json.dumps({"files": files, "fetch": fetch,
                                               "upstreams": upstreams})
        doc = _doc(self.session.run(m.node, cmd, timeout=START_TIMEOUT_S,
                                    stdin=with_input("model_copy", data)))
        if type(doc.get("pid")) is int and type(doc.get("port")) is int:
            m.pid, m.port = doc["pid"], doc["port"]
        else:
            m.error = f"the relay did not start: {str(doc.get('error', 'no pid'))[:300]}"

    def url(self, m: _Member) -> str:
        return f"http://{_url_host(m.node.ip)}:{m.port}"

    def status(self, m: _Member) -> dict:
        """GET /TOKEN/.status over the node's SSH connection (TunnelError, RemoteError...)."""
        stream = HeadTunnel(self.session, m.node, timeout=5).open(m.node.ip, m.port, timeout=5)
        try:
            stream.settimeout(5)
            stream.sendall(f"GET /{self.token}/.status HTTP/1.0\r\nHost: {m.node.ip}\r\n\r\n"
                           .encode())
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
        return json.loads(body.decode("utf-8", "replace"))

    def stop(self, m: _Member) -> None:
        if m.pid is None:
            return
        cmd = _command(self.inventory, m.node, self.local_root, "stop", "--pid", str(m.pid),
                       "--tag", self.tag)
        self.session.run(m.node, cmd, timeout=STOP_TIMEOUT_S, stdin=with_input("model_copy", ""))


def _poll_forever(relay: _Relay, m: _Member, done: list) -> None:
    while not done:
        try:
            m.progress = parse_progress(relay.status(m))
            m.heard = time.monotonic()
        except (ClusterError, OSError, ValueError, EOFError) as exc:
            m.last_error = str(exc)[:200]
        except Exception as exc:            # paramiko's own errors on a dying transport
            m.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        time.sleep(POLL_S)


def run_relay(inventory: Inventory, session, source: Node, reference: Manifest,
              plans: Mapping[str, CopyPlan], targets: Mapping[str, Node], local_root: bool,
              dir_of: DirOf, on_event: Callable[[str], None] = lambda line: None
              ) -> RelayReport:
    """Relay the reference's files from `source` to every target with a non-empty plan."""
    relay = _Relay(inventory, session, local_root, dir_of, on_event)
    busy = [n for n in targets if plans[n].files]
    shape = relay_shape(source.name, busy, relay.settings)
    files = [f.to_dict() for f in reference.files]
    total = sum(plans[n].bytes for n in busy)
    lifetime = relay_lifetime(max([plans[n].bytes for n in busy] + [0]) + total // 4)
    members = {source.name: _Member(source)}
    members.update({n: _Member(targets[n]) for n in busy})
    start = time.monotonic()
    done: list = []
    try:
        for name in shape.order:
            m = members[name]
            failed = [n for n in shape.order if members[n].error]
            ups = [relay.url(members[u]) for u in shape.upstreams(name, skip=failed)]
            if name != shape.source and not ups:
                m.error = "no upstream started"
                continue
            relay.start(m, files, [f.path for f in plans[name].files] if name != shape.source
                        else [], ups, lifetime)
            if m.error and name == shape.source:
                raise RemoteError(source.name, m.error)
            m.heard = time.monotonic()
            if not m.error:
                Call(lambda m=m: _poll_forever(relay, m, done), name=f"relay-status-{name}")
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
    last_line = time.monotonic()
    while time.monotonic() - start < lifetime:
        time.sleep(POLL_S)
        now = time.monotonic()
        live = [n for n in busy if not members[n].error
                and not (members[n].progress and members[n].progress.finished)]
        silent = [n for n in live if now - members[n].heard > SILENT_FAIL_S]
        if not live or len(silent) == len(live):
            return
        if now - last_line >= PROGRESS_EVERY_S:
            last_line = now
            on_event("model: " + ", ".join(_progress_text(n, members[n]) for n in busy))


def _progress_text(name: str, m: _Member) -> str:
    p = m.progress
    if m.error or p is None:
        return f"{name} -"
    return (f"{name} {p.bytes / _MIB:.0f}/{p.total / _MIB:.0f} MiB "
            f"{rate_text(p.bytes, p.seconds)}{' ' + p.state if p.finished else ''}")


# ------------------------------------------------------------------ model pull


@dataclass(frozen=True)
class Source:
    kind: str                   # node | hf
    text: str
    node: str | None = None
    path: str | None = None
    repo: str | None = None


def parse_source(text: str, inventory: Inventory) -> Source:
    """NODE:PATH (an inventory node, an absolute path) or a Hugging Face repo id."""
    if not text or len(text) > 4096 or "\0" in text:
        raise UsageError("SOURCE must be NODE:PATH or a Hugging Face repo id")
    name, colon, path = text.partition(":")
    if colon and name in {n.name for n in inventory.nodes}:
        if not path.startswith("/"):
            raise UsageError(f"SOURCE {text!r}: the path on {name} must be absolute")
        return Source("node", text, node=name, path=path.rstrip("/") or "/")
    if colon:
        raise UsageError(f"SOURCE {text[:100]!r}: no node named {name[:60]!r} in the inventory")
    if text.startswith(("/", ".", "~")):
        raise UsageError(f"SOURCE {text[:100]!r}: a directory on the laptop is not supported: "
                         "copy it to one node and pull NODE:PATH")
    if not _REPO_ID.fullmatch(text) or ".." in text:
        raise UsageError(f"SOURCE {text[:100]!r} is neither NODE:PATH nor a Hugging Face repo "
                         "id (ORG/NAME)")
    return Source("hf", text, repo=text)


@dataclass(frozen=True)
class PullOptions:
    source: str
    path: str | None = None
    revision: str | None = None
    nodes: str | None = None
    dry_run: bool = False
    allow_patterns: tuple[str, ...] = ()
    ignore_patterns: tuple[str, ...] = ()


@dataclass
class PullOutcome:
    source: str
    path: str
    dry_run: bool
    shape: RelayShape | None = None
    nodes: dict[str, NodeResult] = field(default_factory=dict)
    seconds: float = 0.0
    bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if any(r.status == "failed" for r in self.nodes.values()):
            return 2
        return 1 if self.notes else 0

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "path": self.path, "dry_run": self.dry_run,
                "shape": self.shape.to_dict() if self.shape else None,
                "nodes": {n: r.to_dict() for n, r in self.nodes.items()},
                "seconds": round(self.seconds, 3), "bytes": self.bytes, "notes": self.notes}


def pull(inventory: Inventory, session, options: PullOptions, local_root: bool,
         on_event: Callable[[str], None] = lambda line: None) -> PullOutcome:
    """The whole pull; raises UsageError/RemoteError for what stops it before the relay."""
    path = options.path or inventory.model_path
    if not path or not path.startswith("/"):
        raise UsageError("--path DIR (absolute) or the inventory's model.path is needed")
    source = parse_source(options.source, inventory)
    chosen = list(inventory.select(options.nodes))
    by_name = {n.name: n for n in inventory.nodes}
    if source.kind == "node":
        src = by_name[source.node]
        src_dir = source.path
    else:
        src = inventory.head
        src_dir = path
    targets = {n.name: n for n in chosen if n.name != src.name}
    outcome = PullOutcome(options.source, path, options.dry_run)
    if options.nodes and src.name in {n.name for n in chosen} and src_dir != path:
        outcome.notes.append(f"{src.name} is the source: its {src_dir} is not copied into "
                             f"{path} there")
    start = time.monotonic()
    if source.kind == "hf":
        on_event(f"model: {source.repo} from the hub onto {src.name}:{path}")
        if options.dry_run:
            outcome.notes.append(f"the dry run does not download {source.repo}: the relay's "
                                 "shape assumes every target needs every file")
        else:
            hub_download(inventory, session, src, source.repo, options, path, local_root)

    def dir_of(node: Node) -> str:
        return src_dir if node.name == src.name else path

    on_event(f"model: manifests on {src.name} and {len(targets)} node(s)")
    hf_dry = options.dry_run and source.kind == "hf"
    found = manifests(inventory, session, list(targets.values()) + ([] if hf_dry else [src]),
                      local_root, dir_of)
    if hf_dry:
        found[src.name] = Manifest(True, ())
    ref = found[src.name]
    if isinstance(ref, str):
        raise RemoteError(src.name, f"no manifest of {src_dir}: {ref}")
    if not hf_dry and (not ref.exists or not ref.files):
        raise UsageError(f"{src.name}:{src_dir} holds no files to copy")
    if ref.skipped:
        outcome.notes.append(f"{len(ref.skipped)} path(s) on {src.name} not copied (links "
                             f"leaving the directory, or not regular files): "
                             f"{', '.join(ref.skipped[:4])}")
    plans: dict[str, CopyPlan] = {}
    for name in targets:
        mine = found.get(name)
        if isinstance(mine, str):
            outcome.nodes[name] = NodeResult(name, "failed", 0, 0.0, False, mine)
        else:
            plans[name] = copy_plan(name, ref, mine)
    busy = [n for n in plans if plans[n].files]
    settings = RelaySettings.from_expectations(inventory.expectations)
    outcome.shape = relay_shape(src.name, busy, settings)
    for name, plan in plans.items():
        if not plan.files:
            outcome.nodes[name] = NodeResult(name, "ok", 0, 0.0, True, "already identical")
        elif options.dry_run:
            outcome.nodes[name] = NodeResult(
                name, "planned", plan.bytes, 0.0, False,
                f"{len(plan.files)} file(s), {plan.bytes / _MIB:.1f} MiB from "
                f"{outcome.shape.upstreams(name)[0]}")
    if options.dry_run or not busy:
        outcome.seconds = time.monotonic() - start
        return outcome
    report = run_relay(inventory, session, src, ref, {n: plans[n] for n in busy},
                       {n: targets[n] for n in busy}, local_root, dir_of, on_event)
    outcome.shape = report.shape
    on_event(f"model: relay over in {report.seconds:.1f} s; verifying by a second manifest")
    answering = [targets[n] for n in busy if n not in report.errors]
    after = manifests(inventory, session, answering, local_root, lambda node: path)
    for name in busy:
        outcome.nodes[name] = _judge(name, plans[name], report, after.get(name), ref)
    outcome.bytes = sum(r.bytes for r in outcome.nodes.values())
    outcome.seconds = time.monotonic() - start
    return outcome


HUB_TIMEOUT_S = 6 * 3600


def hub_download(inventory: Inventory, session, node: Node, repo: str, options: PullOptions,
                 path: str, local_root: bool) -> dict:
    """snapshot_download of `repo` into `path` on `node` (node_programs/hf_pull.py, as root):
    the node's HF_TOKEN (inventory env) on stdin only, its HF_ENDPOINT honoured."""
    doc = {"repo": repo, "revision": options.revision, "dir": path,
           "allow": list(options.allow_patterns), "ignore": list(options.ignore_patterns),
           "endpoint": node.env.get("HF_ENDPOINT"), "token": node.env.get("HF_TOKEN")}
    line = " ".join([shlex.quote(inventory.ray.python), "-c", shlex.quote(BOOT)])
    res = session.run(node, as_root(line, node, inventory, local_root), timeout=HUB_TIMEOUT_S,
                      stdin=with_input("hf_pull", json.dumps(doc)))
    got = _doc(res)
    if "error" in got or type(got.get("files")) is not int:
        raise RemoteError(node.name, f"hub download of {repo}: "
                                     f"{str(got.get('error', 'no answer'))[:400]}")
    return got


def _judge(name: str, plan: CopyPlan, report: RelayReport, now, ref: Manifest) -> NodeResult:
    p = report.progress.get(name)
    moved = p.bytes if p else 0
    seconds = p.seconds if p else report.seconds
    if name in report.errors:
        return NodeResult(name, "failed", moved, seconds, False,
                          f"{report.errors[name]} (a rerun resumes from the .part files)")
    if p is not None and p.failed:
        return NodeResult(name, "failed", moved, seconds, False,
                          f"{len(p.failed)} file(s) failed: {'; '.join(p.failed[:3])}")
    if not isinstance(now, Manifest):
        return NodeResult(name, "failed", moved, seconds, False, f"not verified: {now}")
    left = still_different(ref, now)
    if left:
        return NodeResult(name, "failed", moved, seconds, False,
                          f"still different after the copy: {', '.join(left[:4])}")
    return NodeResult(name, "copied", moved, seconds, True,
                      f"{len(plan.files)} file(s), {plan.bytes / _MIB:.1f} MiB, "
                      f"{rate_text(moved, seconds)}; sha256 verified")
