"""`cluster model pull SOURCE`: one copy of a model directory onto every node through a
pipelined relay node to node (issue 27), and the relay itself (`run_relay`, also used by
`cluster fix --checks model`).

    1. source: a local PATH (a directory on the laptop: it exists here, or it starts with /,
       ./, ../ or ~), NODE:PATH (a directory on one node), or a Hugging Face repo id
       downloaded by huggingface_hub on the head into --path as the SSH user, never root
       (HF_TOKEN from the head's env on stdin; HF_ENDPOINT https only). A laptop directory is
       served by the laptop (cluster/remedy/laptop_feed.py) to the first node (the head, or
       the first of --nodes without it) through an SSH remote forward; the relay goes on from
       that node
    2. manifests (model_copy.py manifest, sha256 of every file) on the source and the targets
    3. plan (pure): each target's missing or differing files (cluster/remedy/model_sync.py); the
       relay's shape over the targets that need something (cluster/remedy/model_relay.py); dry run
    4. relay: every node of the shape starts model_copy.py `relay` (detached, on its node IP,
       the first free port of expectations.model_relay.ports, a fresh secret on stdin) in start
       order, told its ancestors' URLs (nearest first); progress read from each node's
       signed /.status over the node's SSH connection (a direct-tcpip channel)
    5. stop every relay; manifests again on the targets: verified when every file of the
       source is there with its sha256
A node that stops answering is bypassed by its successors (they re-attach to its upstream and
resume with Range) and reported failed; a second run fetches only what it still lacks.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.base.errors import ProgramError, RemoteError, UsageError
from cluster.nodes.inventory import Inventory, Node
from cluster.remedy.model_relay import NodeResult, RelaySettings, RelayShape, fed_shape, rate_text, \
    relay_shape
from cluster.remedy.model_sync import CopyPlan, Manifest, copy_plan, still_different
from cluster.node_programs import run_call
from cluster.nodes.remote import Session
from playbooks.outcome import Confirm, OnEvent, Outcome, ignore, lines_to, never_confirm
from playbooks.relay import Feed, RelayReport, manifests, run_relay

_MIB = 1 << 20
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?\Z")


# ------------------------------------------------------------------ model pull


@dataclass(frozen=True)
class Source:
    kind: str                   # local | node | hf
    text: str
    node: str | None = None
    path: str | None = None
    repo: str | None = None


def node_path(text: str, what: str) -> str:
    """A directory on the nodes: absolute, no `..` component (where it lands is exactly what
    was written, never a parent reached by walking up), at most 1024 characters."""
    if not text.startswith("/") or len(text) > 1024:
        raise UsageError(f"{what} must be an absolute path, at most 1024 characters")
    if ".." in text.split("/"):
        raise UsageError(f"{what} {text[:100]!r}: a '..' component is not allowed")
    return text


LOCAL_PREFIXES = ("/", "./", "../", "~")


def is_local_path(text: str) -> bool:
    """scp's ambiguity settled: a path that exists on the laptop, or one that starts with /,
    ./, ../ or ~ (or is . or ..), is a local directory, before NODE:PATH and a repo id."""
    return text in (".", "..", "~") or text.startswith(LOCAL_PREFIXES) \
        or os.path.lexists(text)


def parse_source(text: str, inventory: Inventory) -> Source:
    """A local PATH (is_local_path), NODE:PATH (an inventory node, an absolute path) or a
    Hugging Face repo id."""
    if not text or len(text) > 4096 or "\0" in text:
        raise UsageError("SOURCE must be a local PATH, NODE:PATH or a Hugging Face repo id")
    if is_local_path(text):
        return Source("local", text, path=local_directory(text))
    name, colon, path = text.partition(":")
    if colon and name in {n.name for n in inventory.nodes}:
        path = node_path(path, f"SOURCE {name}:PATH")
        return Source("node", text, node=name, path=path.rstrip("/") or "/")
    if colon:
        raise UsageError(f"SOURCE {text[:100]!r}: no node named {name[:60]!r} in the inventory")
    if not _REPO_ID.fullmatch(text) or ".." in text:
        raise UsageError(f"SOURCE {text[:100]!r} is neither NODE:PATH nor a Hugging Face repo "
                         "id (ORG/NAME)")
    return Source("hf", text, repo=text)


def local_directory(text: str) -> str:
    """The real path of a directory on the laptop (UsageError when it is not one)."""
    path = os.path.realpath(os.path.expanduser(text))
    if not os.path.isdir(path):
        raise UsageError(f"SOURCE {text[:100]!r}: not a directory on this machine")
    return path


@dataclass(frozen=True)
class PullOptions:
    source: str
    path: str | None = None
    revision: str | None = None
    nodes: str | None = None
    dry_run: bool = False
    allow_patterns: tuple[str, ...] = ()
    ignore_patterns: tuple[str, ...] = ()
    local_root: bool = False                  # this process is root (no sudo -n for local)
    allow_http_endpoint: bool = False         # HF_ENDPOINT may be http to a loopback address


@dataclass
class PullOutcome(Outcome):
    source: str
    path: str
    dry_run: bool
    shape: RelayShape | None = None
    nodes: dict[str, NodeResult] = field(default_factory=dict)
    seconds: float = 0.0
    bytes: int = 0
    notes: list[str] = field(default_factory=list)
    stopped: str | None = None

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


def run(inventory: Inventory, session: Session, options: PullOptions, confirm: Confirm = never_confirm,
        on_event: OnEvent = ignore) -> PullOutcome:
    """The whole pull; raises UsageError/RemoteError for what stops it before the relay.
    Nothing is asked (confirm is not called): the pull only adds or replaces the model's
    files, as `--dry-run` shows first."""
    local_root, say = options.local_root, lines_to(on_event)
    path = options.path or inventory.model_path
    if not path:
        raise UsageError("--path DIR (absolute) or the inventory's model.path is needed")
    path = node_path(path, "--path" if options.path else "model.path")
    source = parse_source(options.source, inventory)
    chosen = list(inventory.select(options.nodes))
    outcome = PullOutcome(options.source, path, options.dry_run)
    start = time.monotonic()
    settings = RelaySettings.from_expectations(inventory.expectations)
    if source.kind == "local":
        return _pull_local(inventory, session, options, source, chosen, outcome, settings,
                           local_root, say, start)
    by_name = {n.name: n for n in inventory.nodes}
    if source.kind == "node":
        src = by_name[source.node]
        src_dir = source.path
    else:
        src = inventory.head
        src_dir = path
    targets = {n.name: n for n in chosen if n.name != src.name}
    if options.nodes and src.name in {n.name for n in chosen} and src_dir != path:
        outcome.notes.append(f"{src.name} is the source: its {src_dir} is not copied into "
                             f"{path} there")
    if source.kind == "hf":
        hub_endpoint(src, options.allow_http_endpoint)      # refused before anything runs
    if source.kind == "hf" and options.dry_run:
        return _hub_dry_run(outcome, source, src, targets, settings)
    if source.kind == "hf":
        say(f"model: {source.repo} from the hub onto {src.name}:{path}")
        hub_download(inventory, session, src, source.repo, options, path, local_root)

    def dir_of(node: Node) -> str:
        return src_dir if node.name == src.name else path

    say(f"model: manifests on {src.name} and {len(targets)} node(s)")
    found = manifests(inventory, session, [src, *targets.values()], local_root, dir_of)
    ref = found[src.name]
    if isinstance(ref, str):
        raise RemoteError(src.name, f"no manifest of {src_dir}: {ref}")
    _check_reference(outcome, ref, src.name, src_dir)
    plans = _plans(outcome, ref, found, targets)
    busy = [n for n in plans if plans[n].files]
    outcome.shape = relay_shape(src.name, busy, settings)
    if options.dry_run or not busy:
        return _planned(outcome, plans, busy, start)
    return _relay_and_verify(inventory, session, outcome, src, ref, plans, busy, targets,
                             local_root, dir_of, say, start)


def _check_reference(outcome: PullOutcome, ref: Manifest, where: str, src_dir: str) -> None:
    """The source's manifest must list files; what it skipped becomes a note."""
    if not ref.exists or not ref.files:
        raise UsageError(f"{where}:{src_dir} holds no files to copy")
    if ref.skipped:
        outcome.notes.append(f"{len(ref.skipped)} path(s) on {where} not copied (links "
                             f"leaving the directory, or not regular files): "
                             f"{', '.join(ref.skipped[:4])}")


def _planned(outcome: PullOutcome, plans: dict, busy: list, start: float) -> PullOutcome:
    """A dry run's (or a pull with nothing to move) outcome: every busy node planned."""
    if outcome.dry_run:
        for name in busy:
            outcome.nodes[name] = NodeResult(
                name, "planned", plans[name].bytes, 0.0, False,
                f"{len(plans[name].files)} file(s), {plans[name].bytes / _MIB:.1f} MiB from "
                f"{outcome.shape.upstreams(name)[0]}")
    outcome.seconds = time.monotonic() - start
    return outcome


def _relay_and_verify(inventory: Inventory, session: Session, outcome: PullOutcome, source,
                      ref: Manifest,
                      plans: dict, busy: list, targets: dict, local_root: bool, dir_of,
                      say: Callable[[str], None], start: float) -> PullOutcome:
    """The relay to the busy targets, then a second manifest on each: its verdict."""
    path = outcome.path
    report = run_relay(inventory, session, source, ref, {n: plans[n] for n in busy},
                       {n: targets[n] for n in busy}, local_root, dir_of, say)
    outcome.shape = report.shape
    say(f"model: relay over in {report.seconds:.1f} s; verifying by a second manifest")
    answering = [targets[n] for n in busy if n not in report.errors]
    after = manifests(inventory, session, answering, local_root, lambda node: path)
    for name in busy:
        outcome.nodes[name] = _judge(name, plans[name], report, after.get(name), ref)
    outcome.bytes = sum(r.bytes for r in outcome.nodes.values())
    outcome.seconds = time.monotonic() - start
    return outcome


LAPTOP = "laptop"


def _pull_local(inventory: Inventory, session: Session, options: PullOptions, source: Source,
                chosen: list, outcome: PullOutcome, settings: RelaySettings, local_root: bool,
                say: Callable[[str], None], start: float) -> PullOutcome:
    """A directory on the laptop: its manifest here, the laptop's server fed to the first
    node (the head, or the first of --nodes) through an SSH remote forward, then the relay."""
    from cluster.remedy.laptop_feed import LaptopServer, RemoteForward, laptop_manifest

    names = {n.name for n in inventory.nodes}
    feed_name = LAPTOP if LAPTOP not in names else f"({LAPTOP})"
    path = outcome.path
    say(f"model: manifest of {source.path} on this machine")
    ref = laptop_manifest(source.path)
    _check_reference(outcome, ref, feed_name, source.path)
    targets = {n.name: n for n in chosen}
    say(f"model: manifests on {len(targets)} node(s)")
    found = manifests(inventory, session, chosen, local_root, lambda node: path)
    plans = _plans(outcome, ref, found, targets)
    busy = [n for n in plans if plans[n].files]
    first = inventory.head.name if inventory.head.name in targets else chosen[0].name
    fed = first if first in busy or not busy else busy[0]
    outcome.shape = fed_shape(feed_name, fed, [n for n in busy if n != fed], settings)
    if options.dry_run or not busy:
        return _planned(outcome, plans, busy, start)
    token = secrets.token_urlsafe(32)
    with LaptopServer(source.path, token) as server, \
            RemoteForward(session, targets[fed], server.port) as forward:
        say(f"model: {server.files} file(s) of {source.path} served to {fed} "
                 f"({'directly' if targets[fed].local else 'an SSH remote forward'})")
        return _relay_and_verify(inventory, session, outcome, Feed(feed_name, fed, forward.url,
                                                                   token),
                                 ref, plans, busy, targets, local_root, lambda node: path,
                                 say, start)


def _plans(outcome: PullOutcome, ref: Manifest, found: dict, targets: dict
           ) -> dict[str, CopyPlan]:
    """Each answering target's copy plan; a target without a manifest fails, one already
    identical is ok (both recorded in the outcome)."""
    plans: dict[str, CopyPlan] = {}
    for name in targets:
        mine = found.get(name)
        if isinstance(mine, str):
            outcome.nodes[name] = NodeResult(name, "failed", 0, 0.0, False, mine)
            continue
        plans[name] = copy_plan(name, ref, mine)
        if not plans[name].files:
            outcome.nodes[name] = NodeResult(name, "ok", 0, 0.0, True, "already identical")
    return plans


def _hub_dry_run(outcome: PullOutcome, source: Source, src: Node, targets: dict,
                 settings: RelaySettings) -> PullOutcome:
    """The hub's file list is only known once downloaded: the shape over every target."""
    outcome.shape = relay_shape(src.name, list(targets), settings)
    for name in targets:
        outcome.nodes[name] = NodeResult(name, "planned", 0, 0.0, False,
                                         f"{source.repo} (downloaded on {src.name}, its files "
                                         f"listed then) from {outcome.shape.upstreams(name)[0]}")
    return outcome


HUB_TIMEOUT_S = 6 * 3600


def hub_endpoint(node: Node, allow_http: bool) -> str | None:
    """The node's HF_ENDPOINT (None: the hub's own https URL). UsageError when the token would
    travel in clear: not https, or http to anything but a loopback address, or http without
    --allow-http-endpoint (node_programs/hf_pull.py applies the same rule on the node)."""
    from cluster.node_programs.hf_pull import endpoint_problem

    endpoint = node.env.get("HF_ENDPOINT") or None
    problem = endpoint and endpoint_problem(endpoint, allow_http)
    if problem:
        raise UsageError(f"{node.name}: {problem}")
    return endpoint


def hub_download(inventory: Inventory, session: Session, node: Node, repo: str, options: PullOptions,
                 path: str, local_root: bool) -> dict:
    """snapshot_download of `repo` into `path` on `node` (node_programs/hf_pull.py, as the SSH
    user, never root: it imports the node's huggingface_hub): the node's HF_TOKEN (inventory
    env) on stdin only, its HF_ENDPOINT honoured when https (hub_endpoint)."""
    from cluster.node_programs import document_of, program_call
    from cluster.node_programs.hf_pull import scrub

    token = node.env.get("HF_TOKEN") or None
    doc = {"repo": repo, "revision": options.revision, "dir": path,
           "allow": list(options.allow_patterns), "ignore": list(options.ignore_patterns),
           "endpoint": hub_endpoint(node, options.allow_http_endpoint),
           "allow_http": options.allow_http_endpoint, "token": token}
    call = program_call(inventory.ray.python, "hf_pull", [], json.dumps(doc))
    got = document_of(run_call(session, node, call, timeout=HUB_TIMEOUT_S), "hf_pull")
    if isinstance(got, ProgramError):
        got = {"error": str(got) if not got.reached else
               f"no answer from the node's python: {got.detail or got.reason}"}
    if "error" in got or type(got.get("files")) is not int:
        why = scrub(f"hub download of {repo} as {node.user or inventory.ssh.user or 'the SSH user'}"
                    f": {got.get('error', 'no answer')}", token)
        if got.get("denied") is True:
            why += f" (the pull runs as the SSH user, never root: make {path} writable by it)"
        raise RemoteError(node.name, why)
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
