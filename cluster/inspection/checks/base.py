"""The shape of a check: probes (commands) + an evaluate function (parsed data -> verdict)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Mapping

from cluster.base.errors import ParseError
from cluster.nodes.inventory import Inventory, Node
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.inspection.probes import Probe, ProbeOutput
from cluster.base.results import Status

if TYPE_CHECKING:
    from cluster.inspection.facts import BuiltFact, NodeFacts, ToolFact


@dataclass(frozen=True)
class Verdict:
    """What a check concluded on one node; `facts` (what it read of the node, typed) feed the
    report, the planner, the cross-node checks and the fixes."""

    status: Status
    summary: str
    fix: str | None = None
    data: Any = None
    facts: NodeFactsSummary = field(default_factory=NodeFactsSummary)
    probe: str | None = None  # the probe whose output is the evidence


@dataclass(frozen=True)
class NodeContext:
    node: Node
    inventory: Inventory
    outputs: Mapping[str, ProbeOutput]
    gathered: "NodeFacts | None" = None   # the run's facts of this node (cluster/inspection/facts.py)

    @classmethod
    def of(cls, node: Node, inventory: Inventory, facts: "NodeFacts") -> "NodeContext":
        """The context of a node's gathered facts (its outputs are theirs)."""
        return cls(node, inventory, facts.outputs, facts)

    @cached_property
    def facts(self) -> "NodeFacts":
        """The node's facts: those gathered for the run, else read from `outputs` (once)."""
        if self.gathered is not None:
            return self.gathered
        from cluster.inspection.facts import facts_from_outputs
        return facts_from_outputs(self.node, self.outputs)

    def reading(self, fact: "ToolFact") -> Any:
        """`fact`'s parser's frozen reading on this node, parsed once per node and run
        (NodeFacts.reading)."""
        return self.facts.reading(fact)

    @property
    def expect(self) -> Mapping[str, Any]:
        return self.inventory.expectations

    def output(self, fact: "ToolFact | BuiltFact") -> ProbeOutput:
        """How `fact`'s command ran on this node (exit code, missing tool, timeout) for the
        verdicts on a tool that did not run; its text is read through `reading`. Asked by the
        fact, never by a probe's name."""
        if isinstance(fact, str):
            raise TypeError(f"a check asks for a fact, not the probe name {fact!r}")
        try:
            return self.outputs[fact.name]
        except KeyError:
            raise ParseError("probe", f"no output for {fact.name!r}: the node stopped answering "
                                      "mid-probe") from None


ProbeBuilder = Callable[[Node, Inventory], "Probe | None"]


@dataclass(frozen=True)
class NodeCheck:
    """A per-node check: which probes it needs and how it judges their output."""

    id: str
    title: str
    probes: tuple[ProbeBuilder, ...]
    evaluate: Callable[[NodeContext], Verdict]


def judge(check: NodeCheck, ctx: NodeContext) -> Verdict:
    """The check's verdict on the node; output it cannot read is an error verdict, not a raise."""
    try:
        return check.evaluate(ctx)
    except ParseError as exc:
        return Verdict(Status.ERROR, f"could not read the output: {exc}")


def ok(summary: str, **kw: Any) -> Verdict:
    return Verdict(Status.OK, summary, **kw)


def warn(summary: str, fix: str | None = None, **kw: Any) -> Verdict:
    return Verdict(Status.WARN, summary, fix, **kw)


def fail(summary: str, fix: str | None = None, **kw: Any) -> Verdict:
    return Verdict(Status.FAIL, summary, fix, **kw)


def skip(summary: str, **kw: Any) -> Verdict:
    return Verdict(Status.SKIP, summary, **kw)


def error(summary: str, **kw: Any) -> Verdict:
    return Verdict(Status.ERROR, summary, **kw)


def required(setting: Any, default_when_auto: bool) -> bool:
    """Resolve a true/false/auto expectation."""
    if isinstance(setting, bool):
        return setting
    return default_when_auto


def tool_problem(out: ProbeOutput, tool: str, needed: bool, what: str, fix: str) -> Verdict | None:
    """A verdict when the tool did not run properly (missing, hung, failed), else None.

    `what` names the thing the tool reveals ("NVIDIA GPUs"): a missing tool fails when it is
    expected and is a skip otherwise.
    """
    if out.missing_tool:
        if needed:
            return fail(f"{tool} not found, but {what} expected", fix, probe=out.name)
        return skip(f"{tool} not found: no {what} here (none expected)", probe=out.name)
    if out.timed_out:
        return error(f"{tool} hung (no answer within the probe timeout)", probe=out.name)
    if out.cut:
        return error(f"{tool} printed more than is kept ({out.cut} bytes cut): not judged",
                     probe=out.name)
    if out.exit_code != 0 and not out.stdout.strip():
        msg = (out.stderr.strip().splitlines() or [f"exit {out.exit_code}"])[-1]
        return fail(f"{tool} failed: {msg}", fix, probe=out.name) if needed \
            else skip(f"{tool} failed: {msg}", probe=out.name)
    return None


def read_tool(ctx: NodeContext, fact: "ToolFact", tool: str, needed: bool, what: str,
              fix: str) -> tuple[Any, Verdict | None]:
    """(the fact's parser's reading, None), or (None, the verdict) when the tool did not run
    properly (see tool_problem)."""
    out = ctx.output(fact)
    problem = tool_problem(out, tool, needed, what, fix)
    if problem:
        return None, problem
    return ctx.reading(fact), None
