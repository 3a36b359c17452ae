"""The health job's remediation policy (`health.act`): readings history + the cluster's state ->
what to do with each finding (report it, cordon the node, or hold back and alert), and the
records of what was done. Pure: cluster/ray_jobs/health_runner.py runs it every period and
executes its cordons (Ray's drain, gangs with a rank there replaced).

The guards, in order, for a finding whose class says `cordon`:
  - confirmed: seen in `confirm_readings[class]` consecutive readings (1 for gpu_lost);
  - ib_port_down acts only on a node holding a rank of a cross-node gang;
  - never the head (it holds the GCS and the Serve controller);
  - at most `max_cordons` nodes cordoned by the job within `window_s`;
  - the nodes left (alive, not cordoned) hold the deployed apps' bundles (rollout's capacity
    verdict); else the decision is `held` and its reason says what is short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from cluster.nodes.inventory import ACT_CLASSES, ActPolicy
from cluster.ray.health_job import ACTIONS_VERSION, MAX_SUMMARY, Reading
from cluster.ray.rollout import Demand, capacity_without

CORDON, REPORT, HELD = "cordon", "report", "held"
UNCORDONED = "uncordoned"
MISSED = "missed_periods"
_SEVERITY = {c: i for i, c in enumerate(ACT_CLASSES)}     # gpu_lost first


@dataclass(frozen=True)
class Observation:
    """One node in one period: the finding classes its readings showed (class -> evidence)."""

    node: str
    node_id: str
    time: float
    findings: Mapping[str, str] = field(default_factory=dict)
    missed: bool = False          # no reading this period (reader failed, node not alive)
    why_missed: str = ""


def observe(node: str, node_id: str, readings: Iterable[Reading], now: float) -> Observation:
    """A node's readings of one period -> its Observation (missed when every one is unknown)."""
    readings = list(readings)
    found: dict[str, str] = {}
    for r in readings:
        for cls, line in r.findings:
            if cls in _SEVERITY:
                found.setdefault(cls, f"{r.check}: {line}"[:MAX_SUMMARY])
    missed = not readings or all(r.status == "unknown" for r in readings)
    why = readings[0].summary if readings and missed else ("no reading" if missed else "")
    return Observation(node, node_id, now, found, missed, why)


def confirmed(history: Sequence[Observation], policy: ActPolicy) -> dict[str, str]:
    """The classes the latest observations confirm: class -> evidence line of the latest one.
    A class counts when the last `confirm_readings[class]` observations (of the same Ray node)
    all show it; missed_periods when the last `missed_after` were all missed."""
    if not history:
        return {}
    latest = history[-1]
    same = [o for o in history if o.node_id == latest.node_id]
    out = {}
    for cls, line in latest.findings.items():
        need = policy.confirm[cls]
        tail = same[-need:]
        if len(tail) >= need and all(cls in o.findings for o in tail):
            out[cls] = line
    need = max(policy.missed_after, policy.confirm[MISSED])
    tail = same[-need:]
    if len(tail) >= need and all(o.missed for o in tail):
        out[MISSED] = f"no reading for {need} period(s): {latest.why_missed}"[:MAX_SUMMARY]
    return out


@dataclass(frozen=True)
class ClusterView:
    """What the guards read: the alive nodes' resources, who is cordoned, when the job cordoned
    (for the window), the deployed apps' replicas and the nodes holding a cross-node gang's rank."""

    now: float
    head: str | None
    nodes: Mapping[str, Mapping[str, float]]        # alive Ray nodes: name -> total resources
    cordoned: frozenset[str] = frozenset()
    cordon_times: tuple[float, ...] = ()
    demands: tuple[Demand, ...] = ()
    gang_nodes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Decision:
    """What the policy says for one finding on one node: cordon, report, or held (a guard)."""

    node: str
    finding: str
    evidence: str
    action: str
    reason: str

    @property
    def key(self) -> tuple[str, str, str]:
        return self.node, self.finding, self.action


def decide(history: Mapping[str, Sequence[Observation]], view: ClusterView,
           policy: ActPolicy) -> tuple[Decision, ...]:
    """Every confirmed finding of every node not cordoned yet -> a Decision. At most one cordon
    a node (its most severe class that says cordon); its other findings are reported."""
    out: list[Decision] = []
    cordoned = set(view.cordoned)
    recent = [t for t in view.cordon_times if view.now - t < policy.window_s]
    for node in sorted(history):
        if node in cordoned:
            continue
        found = confirmed(history[node], policy)
        acting = None
        for cls in sorted(found, key=_SEVERITY.__getitem__):
            wants, why = _wants_cordon(node, cls, view, policy)
            if acting is None and wants:
                acting = _guarded(node, cls, found[cls], view, policy, cordoned, len(recent))
                out.append(acting)
                if acting.action == CORDON:
                    cordoned.add(node)
                    recent.append(view.now)
            else:
                out.append(Decision(node, cls, found[cls], REPORT, why))
    return tuple(out)


def _wants_cordon(node: str, cls: str, view: ClusterView, policy: ActPolicy) -> tuple[bool, str]:
    if policy.actions[cls] != CORDON:
        return False, f"health.act.{cls}: report"
    if cls == "ib_port_down" and node not in view.gang_nodes:
        return False, "ib_port_down: the node holds no rank of a cross-node gang"
    return True, ""


def _guarded(node: str, cls: str, evidence: str, view: ClusterView, policy: ActPolicy,
             cordoned: set[str], recent: int) -> Decision:
    """cordon, or held with the guard that stopped it."""
    def held(reason: str) -> Decision:
        return Decision(node, cls, evidence, HELD, reason)

    if node == view.head:
        return held("never the head: it holds the GCS and the Serve controller")
    if recent >= policy.max_cordons:
        return held(f"rate limit: {recent} node(s) cordoned within {policy.window_s:g} s "
                    f"(health.act.max_cordons: {policy.max_cordons})")
    left = [(n, r) for n, r in sorted(view.nodes.items()) if n != node and n not in cordoned]
    capacity = capacity_without(view.demands, left)
    if not capacity.ok:
        return held(f"capacity: without {node} {capacity.summary()}: "
                    + "; ".join(capacity.problems) + " short")
    return Decision(node, cls, evidence, CORDON, f"health.act.{cls}: cordon")


def new_decisions(decisions: Iterable[Decision], seen: frozenset[tuple[str, str, str]]
                  ) -> tuple[tuple[Decision, ...], frozenset[tuple[str, str, str]]]:
    """The decisions not already recorded while their finding lasted, and the keys to remember
    (a finding that clears and comes back is recorded again)."""
    decisions = list(decisions)
    return (tuple(d for d in decisions if d.key not in seen),
            frozenset(d.key for d in decisions))


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class ActionRecord:
    """One thing the job did (or held back from): kept on the head, shown by `cluster status`."""

    node: str
    finding: str
    evidence: str
    action: str           # cordon | report | held | uncordoned
    reason: str
    time: float
    node_id: str | None = None
    outcome: str = ""     # cordon: moving, then moved | not moved in time; held: drain refused: ...
    replicas_moved: tuple[Mapping[str, Any], ...] = ()
    gangs_moved: tuple[str, ...] = ()
    move_s: float | None = None
    # how the gangs with a rank on the node were replaced: "surge" (each app rolled by Serve, the
    # new gang RUNNING before the old stops) or "restart: <why not surge>" (their ranks killed)
    gang_rebuild: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "finding": self.finding, "evidence": self.evidence,
                "action": self.action, "reason": self.reason, "time": round(self.time, 3),
                "node_id": self.node_id, "outcome": self.outcome,
                "replicas_moved": [dict(r) for r in self.replicas_moved],
                "gangs_moved": list(self.gangs_moved), "gang_rebuild": self.gang_rebuild,
                "move_s": None if self.move_s is None else round(self.move_s, 1)}

    def line(self) -> str:
        """One line for the job's log and `cluster status`."""
        moved = "" if self.move_s is None else (
            f"; {len(self.replicas_moved)} replica(s), {len(self.gangs_moved)} gang(s) moved "
            f"in {self.move_s:.1f} s")
        outcome = f" ({self.outcome})" if self.outcome else ""
        return (f"{self.action} {self.node}: {self.finding}: {self.evidence} [{self.reason}]"
                f"{outcome}{moved}")


def record_of(d: Decision, now: float, node_id: str | None = None) -> ActionRecord:
    return ActionRecord(d.node, d.finding, d.evidence, d.action, d.reason, now, node_id)


def actions_document(records: Sequence[ActionRecord], cordoned: Mapping[str, Mapping[str, Any]],
                     written: float, max_records: int) -> dict[str, Any]:
    """The actions file: the latest `max_records` records and the nodes cordoned now
    ({name: {node_id, time, finding}})."""
    return {"version": ACTIONS_VERSION, "written": round(written, 3),
            "cordoned": {n: dict(c) for n, c in sorted(cordoned.items())},
            "records": [r.to_dict() for r in list(records)[-max_records:]]}
