"""`cluster fix --checks model`: copy the model files a node lacks (or holds with other bytes)
from the reference node, node to node, never through the laptop.

The same pipelined relay as `cluster model pull` (playbooks/relay.py, on-node
cluster/node_programs/model_copy.py, as root: sudo -n when the SSH user is not root):

    1. manifest on the reference and the targets (path, size, sha256 of every file)
    2. plan per target (cluster/remedy/model_sync.py, pure): the files missing or differing
    3. relay: the reference serves, the targets that need files form the relay's shape (a
       chain, a tree on large clusters), each forwarding what it receives while it receives
       the rest; each file into <path>.part, resumed with a Range request (a rerun after an
       interruption continues), size + sha256 checked, renamed
    4. stop every relay; manifest the targets again: changed only when every file of the
       reference is there with its sha256

The undo record lists the paths a copy created or replaced; undo does not restore model files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from cluster.inspection.checks.node import MODEL_FILES
from cluster.base.errors import ClusterError
from cluster.remedy.fixes import Step
from cluster.nodes.inventory import Inventory, Node
from cluster.remedy.model_sync import CopyPlan, Manifest, copy_plan, still_different
from cluster.nodes.remote import Session
from playbooks.relay import DirOf, RelayReport, manifests, run_relay

_MIB = 1 << 20


@dataclass(frozen=True)
class ModelOutcome:
    node: str
    status: str                    # changed | failed
    summary: str
    after: str | None


def _record(undo, node: str, source: str, path: str, plan: CopyPlan) -> None:
    replaced = set(plan.replaced)
    undo.add({"node": node, "check": "model", "kind": "model-files", "dir": path,
              "source": source, "created": [f.path for f in plan.files if f.path not in replaced],
              "replaced": list(plan.replaced), "restored_by_undo": False})


def _summary(plan: CopyPlan, moved: int, source: str) -> str:
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


def _copy_from(inventory, session: Session, source: Node, targets: Mapping[str, Node], undo,
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
    total = sum(p.bytes for p in plans.values())
    on_event(f"model: {sum(len(p.files) for p in plans.values())} file(s), "
             f"{total / _MIB:.1f} MiB from {source.name} to {len(plans)} node(s)")
    busy = {n: p for n, p in plans.items() if p.files}
    report = None
    if busy:
        try:
            report = run_relay(inventory, session, source, ref, busy,
                               {n: targets[n] for n in busy}, local_root, dir_of, on_event)
        except ClusterError as exc:
            return out + [ModelOutcome(n, "failed", str(exc), None) for n in plans]
    answering = [targets[n] for n in busy if n not in report.errors] if report else []
    after = manifests(inventory, session, answering, local_root, dir_of) if answering else {}
    for name, plan in plans.items():
        out.append(_judge(name, plan, report, after.get(name), ref, source.name))
    return out


def _judge(name: str, plan: CopyPlan, report: RelayReport | None, now: Manifest | str | None,
           ref: Manifest, source: str) -> ModelOutcome:
    if not plan.files:
        return _extra_verdict(name, plan, 0, source, "ok")
    progress = report.progress.get(name) if report else None
    if report and name in report.errors:
        return ModelOutcome(name, "failed", f"relay: {report.errors[name]} (a rerun resumes)",
                            "fail")
    if progress is not None and progress.failed:
        return ModelOutcome(name, "failed", f"{len(progress.failed)} of {len(plan.files)} "
                                            f"file(s) failed (a rerun resumes): "
                                            f"{'; '.join(progress.failed[:3])}", "fail")
    if not isinstance(now, Manifest):
        return ModelOutcome(name, "failed", f"not verified: {now}", None)
    left = still_different(ref, now)
    if left:
        return ModelOutcome(name, "failed", f"still different after the copy: "
                                            f"{', '.join(left[:4])}", "fail")
    return _extra_verdict(name, plan, progress.bytes if progress else 0, source, "changed")


def _extra_verdict(name: str, plan: CopyPlan, moved: int, source: str, status: str
                   ) -> ModelOutcome:
    key_extra = [p for p in plan.extra if "/" not in p and p in MODEL_FILES]
    if key_extra:
        return ModelOutcome(name, "failed", f"{_summary(plan, moved, source)}; key file(s) the "
                                            f"reference lacks: {', '.join(key_extra)} (remove "
                                            f"them by hand)", "fail")
    return ModelOutcome(name, status, _summary(plan, moved, source), "ok")
