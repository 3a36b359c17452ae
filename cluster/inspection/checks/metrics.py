"""The head-only preflight check of `ray.metrics: prometheus`: the head has a `prometheus`
binary for `cluster up` to start (cluster/ray/prometheus_head.py). Skipped on the workers and
when metrics are off (no probe runs then)."""

from __future__ import annotations

from cluster.inspection.checks.base import NodeCheck, NodeContext, Verdict, ok, skip, tool_problem
from cluster.nodes.inventory import Inventory, Node
from cluster.inspection.facts import BuiltFact
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.inspection.probes import Probe, ProbeOutput

PROMETHEUS_COMMAND = "command -v prometheus >/dev/null || exit 127; prometheus --version 2>&1 | head -n 1"
FIX = ("install Prometheus on the head (Debian/Ubuntu: apt-get install prometheus) or set "
       "ray.metrics: off")


def _wanted(node: Node, inventory: Inventory) -> bool:
    return inventory.ray.metrics == "prometheus" and node.is_head


def _version_line(out: ProbeOutput) -> str:
    """`prometheus --version`'s first line (bounded)."""
    return (out.stdout.strip().splitlines() or ["prometheus"])[0][:200]


PROMETHEUS = BuiltFact("prometheus", _version_line)


def prometheus_probe(node: Node, inventory: Inventory) -> Probe | None:
    return Probe(PROMETHEUS.name, PROMETHEUS_COMMAND) if _wanted(node, inventory) else None


def evaluate_prometheus(ctx: NodeContext) -> Verdict:
    if ctx.inventory.ray.metrics != "prometheus":
        return skip("ray.metrics is off")
    if not ctx.node.is_head:
        return skip("Prometheus runs on the head only")
    problem = tool_problem(ctx.output(PROMETHEUS), "prometheus", True, "ray.metrics: prometheus",
                           FIX)
    if problem:
        return problem
    return ok(ctx.reading(PROMETHEUS), facts=NodeFactsSummary.of(prometheus_binary=True))


METRICS_CHECKS: tuple[NodeCheck, ...] = (
    NodeCheck("prometheus", "Prometheus binary on the head (ray.metrics)",
              (prometheus_probe,), evaluate_prometheus),
)
