"""`cluster fix --checks model`: copy the model files a node lacks (or holds with other bytes)
from the reference node, node to node, never through the laptop.

Fan-outs of the on-node program cluster/node_programs/model_copy.py, as root (sudo -n when the
SSH user is not root: the model directory may be root's):

    1. manifest on the reference and the targets (path, size, sha256 of every file)
    2. plan per target (cluster/model_sync.py, pure): the files missing or differing
    3. serve on the reference, bound to its node IP on `expectations.fix.model_copy_port`, the
       files only under a fresh secret token (stdin, never argv); it exits by itself
    4. fetch on every target at once: each file into <path>.part, resumed from its size with a
       Range request (a rerun after an interruption continues), size + sha256 checked, renamed
    5. stop the server; manifest the targets again: changed only when every file of the
       reference is there with its sha256

The undo record lists the paths a copy created or replaced; undo does not restore model files.
"""

from __future__ import annotations

import json
import secrets
import shlex
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from cluster.checks.node import MODEL_FILES
from cluster.errors import ParseError
from cluster.fixes import Step, as_root
from cluster.inventory import Inventory, Node
from cluster.model_sync import CopyPlan, Manifest, copy_plan, parse_manifest, still_different
from cluster.node_programs import BOOT, with_input
from cluster.remote import CommandResult, Session, parallel

MANIFEST_TIMEOUT_S = 3600          # hashing a large model: about 1 GB/s per node
MIN_RATE_BPS = 50 << 20            # the copy's time bound assumes at least 50 MiB/s per target
COPY_BASE_S = 300
COPY_MAX_S = 6 * 3600
_MIB = 1 << 20


@dataclass(frozen=True)
class ModelOutcome:
    node: str
    status: str                    # changed | failed
    summary: str
    after: str | None


def _command(inventory: Inventory, node: Node, local_root: bool, verb: str, *args: str) -> str:
    py = shlex.quote(inventory.ray.python)
    line = " ".join([py, "-c", shlex.quote(BOOT), verb, *map(shlex.quote, args)])
    return as_root(line, node, inventory, local_root)


def _doc(res: CommandResult) -> dict:
    """The program's JSON document, or a dict with the error (never raises)."""
    if not res.reached:
        return {"error": f"{res.status}: {res.error}"}
    lines = res.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        why = (res.stderr.strip().splitlines() or [f"exit {res.exit_code}"])[-1]
        return {"error": f"no answer from the node's python: {why[:300]}"}
    return doc


DirOf = Callable[[Node], str]


def manifests(inventory: Inventory, session: Session, nodes: Sequence[Node],
              local_root: bool, dir_of: DirOf) -> dict[str, Manifest | str]:
    """node -> its manifest, or why there is none."""
    results = session.fan_out(
        nodes, lambda n: _command(inventory, n, local_root, "manifest", "--dir", dir_of(n),
                                  "--for", str(MANIFEST_TIMEOUT_S - 60)),
        timeout=MANIFEST_TIMEOUT_S, stdin=with_input("model_copy", ""))
    out: dict[str, Manifest | str] = {}
    for res in results:
        try:
            out[res.node] = parse_manifest(_doc(res))
        except ParseError as exc:
            out[res.node] = f"manifest: {exc}"
    return out


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _copy_timeout(plan: CopyPlan) -> int:
    return int(min(COPY_MAX_S, COPY_BASE_S + plan.bytes / MIN_RATE_BPS))


class _Copy:
    """One reference and its targets: serve, fetch in parallel, stop."""

    def __init__(self, inventory: Inventory, session: Session, source: Node, local_root: bool,
                 dir_of: DirOf):
        self.inventory, self.session, self.source = inventory, session, source
        self.local_root, self.dir_of = local_root, dir_of
        self.token = secrets.token_urlsafe(32)
        self.tag = secrets.token_hex(6)
        self.port = int(inventory.expectations["fix"]["model_copy_port"])

    def serve(self, lifetime: int) -> int:
        """The server's pid; RuntimeError (the reason) when it did not start."""
        cmd = _command(self.inventory, self.source, self.local_root, "serve", "--dir",
                       self.dir_of(self.source), "--bind", self.source.ip, "--port",
                       str(self.port), "--for", str(lifetime), "--tag", self.tag)
        doc = _doc(self.session.run(self.source, cmd, timeout=120,
                                    stdin=with_input("model_copy", self.token + "\n")))
        if type(doc.get("pid")) is not int:
            raise RuntimeError(f"cannot serve the model on {self.source.name}: "
                               f"{doc.get('error', 'no pid')}")
        return doc["pid"]

    def fetch(self, node: Node, plan: CopyPlan) -> dict:
        seconds = _copy_timeout(plan)
        url = f"http://{_url_host(self.source.ip)}:{self.port}"
        cmd = _command(self.inventory, node, self.local_root, "fetch", "--dir",
                       self.dir_of(node), "--url", url, "--for", str(seconds))
        data = self.token + "\n" + json.dumps({"files": [f.to_dict() for f in plan.files]})
        return _doc(self.session.run(node, cmd, timeout=seconds + 60,
                                     stdin=with_input("model_copy", data)))

    def stop(self, pid: int) -> None:
        cmd = _command(self.inventory, self.source, self.local_root, "stop", "--pid", str(pid),
                       "--tag", self.tag)
        self.session.run(self.source, cmd, timeout=60, stdin=with_input("model_copy", ""))


def _fetch_all(copy: _Copy, targets: Mapping[str, Node], plans: Mapping[str, CopyPlan]
               ) -> dict[str, dict]:
    busy = [targets[n] for n, p in plans.items() if p.files]
    if not busy:
        return {}
    longest = max(_copy_timeout(plans[n.name]) for n in busy)
    batches = -(-len(busy) // max(1, copy.session.max_parallel))    # parallel()'s bound
    pid = copy.serve(batches * (longest + 120) + 60)
    try:
        return parallel(busy, lambda n: copy.fetch(n, plans[n.name]), longest + 120,
                        lambda n: {"error": "no answer within the copy's deadline"},
                        copy.session.max_parallel)
    finally:
        copy.stop(pid)


def _record(undo, node: str, source: str, path: str, plan: CopyPlan) -> None:
    replaced = set(plan.replaced)
    undo.add({"node": node, "check": "model", "kind": "model-files", "dir": path,
              "source": source, "created": [f.path for f in plan.files if f.path not in replaced],
              "replaced": list(plan.replaced), "restored_by_undo": False})


def _failed_files(doc: dict) -> list[str]:
    return [f"{f.get('path')}: {f.get('reason')}" for f in doc.get("files") or []
            if isinstance(f, dict) and f.get("status") != "ok"]


def _summary(plan: CopyPlan, doc: dict, source: str) -> str:
    moved = doc.get("bytes") if type(doc.get("bytes")) is int else 0
    text = (f"copied {len(plan.files)} file(s) ({plan.bytes / _MIB:.1f} MiB, "
            f"{moved / _MIB:.1f} MiB sent now) from {source}, {len(plan.replaced)} replaced; "
            f"sha256 verified") if plan.files else "nothing to copy"
    if plan.extra:
        text += f"; {len(plan.extra)} file(s) only here kept: {', '.join(plan.extra[:4])}"
    return text


def copy_models(inventory: Inventory, session: Session, steps: Sequence[Step], undo,
                local_root: bool, on_event: Callable[[str], None] = lambda line: None,
                dir_of: DirOf | None = None) -> list[ModelOutcome]:
    """Run the model steps (grouped by their reference node); an outcome per step.

    `dir_of`: a node's model directory (default: the inventory's model.path on every node)."""
    dir_of = dir_of or (lambda node: inventory.model_path or "")
    by_name = {n.name: n for n in inventory.nodes}
    out: list[ModelOutcome] = []
    for source in dict.fromkeys(s.source for s in steps):
        targets = {s.node: by_name[s.node] for s in steps if s.source == source}
        out += _copy_from(inventory, session, by_name[source], targets, undo, local_root,
                          on_event, dir_of)
    return out


def _copy_from(inventory, session, source: Node, targets: Mapping[str, Node], undo,
               local_root: bool, on_event, dir_of: DirOf) -> list[ModelOutcome]:
    on_event(f"model: manifests on {source.name} and {len(targets)} node(s)")
    found = manifests(inventory, session, [source, *targets.values()], local_root, dir_of)
    ref = found[source.name]
    if isinstance(ref, str) or not ref.exists:
        why = ref if isinstance(ref, str) else f"{dir_of(source)} is gone on {source.name}"
        return [ModelOutcome(n, "failed", f"no reference manifest: {why}", None) for n in targets]
    out: list[ModelOutcome] = []
    plans: dict[str, CopyPlan] = {}
    for name in targets:
        mine = found[name]
        if isinstance(mine, str):
            out.append(ModelOutcome(name, "failed", mine, None))
        else:
            plans[name] = copy_plan(name, ref, mine)
            if plans[name].files:
                _record(undo, name, source.name, dir_of(targets[name]), plans[name])
    copy = _Copy(inventory, session, source, local_root, dir_of)
    total = sum(p.bytes for p in plans.values())
    on_event(f"model: {sum(len(p.files) for p in plans.values())} file(s), "
             f"{total / _MIB:.1f} MiB from {source.name} to {len(plans)} node(s)")
    try:
        fetched = _fetch_all(copy, targets, plans)
    except RuntimeError as exc:
        return out + [ModelOutcome(n, "failed", str(exc), None) for n in plans]
    after = manifests(inventory, session, [targets[n] for n in plans], local_root, dir_of) \
        if plans else {}
    for name, plan in plans.items():
        doc = fetched.get(name, {})
        out.append(_judge(name, plan, doc, after.get(name), ref, source.name))
    return out


def _judge(name: str, plan: CopyPlan, doc: dict, now: Manifest | str | None, ref: Manifest,
           source: str) -> ModelOutcome:
    if "error" in doc:
        return ModelOutcome(name, "failed", f"fetch: {doc['error']}", "fail")
    bad = _failed_files(doc)
    if bad:
        return ModelOutcome(name, "failed", f"{len(bad)} of {len(plan.files)} file(s) failed "
                                            f"(a rerun resumes): {'; '.join(bad[:3])}", "fail")
    if not isinstance(now, Manifest):
        return ModelOutcome(name, "failed", f"not verified: {now}", None)
    left = still_different(ref, now)
    if left:
        return ModelOutcome(name, "failed", f"still different after the copy: "
                                            f"{', '.join(left[:4])}", "fail")
    key_extra = [p for p in plan.extra if "/" not in p and p in MODEL_FILES]
    if key_extra:
        return ModelOutcome(name, "failed", f"{_summary(plan, doc, source)}; key file(s) the "
                                            f"reference lacks: {', '.join(key_extra)} (remove "
                                            f"them by hand)", "fail")
    return ModelOutcome(name, "changed" if plan.files else "ok", _summary(plan, doc, source),
                        "ok")

