"""Cross-node checks: what must be the same on every node, and clock skew measured from the laptop.

Inputs are the per-node facts gathered by the node checks. A difference is attributed to the
nodes that differ from the reference (the majority; on a tie, the head), so an admin sees
which machine to fix.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from cluster.inspection.checks.runtime import laptop_ray_version, ray_client_check
from cluster.inspection.clock import CLOCK_COMMAND, ClockSample
from cluster.inspection.facts import component_versions, majority_value
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.nodes.inventory import Inventory
from cluster.base.results import CheckResult, Evidence, Status

Facts = Mapping[str, NodeFactsSummary]  # node name -> the facts its checks reported


def _differences(check: str, what: str, values: Mapping[str, Any], head: str, status: Status,
                 fix: str) -> list[CheckResult]:
    if not values:
        return [CheckResult(check, None, Status.SKIP, f"no {what} known on any node")]
    ref = majority_value(values, head)
    same = sorted(n for n, v in values.items() if v == ref)
    odd = {n: v for n, v in values.items() if v != ref}
    ev = Evidence(data={"values": dict(values), "reference": ref})
    if not odd:
        return [CheckResult(check, None, Status.OK, f"{what} {ref} on all {len(values)} nodes",
                            ev)]
    results = [CheckResult(check, None, status,
                           f"{what} differs: {ref} on {', '.join(same)}; " +
                           "; ".join(f"{v} on {n}" for n, v in sorted(odd.items())), ev, fix)]
    for name, value in sorted(odd.items()):
        results.append(CheckResult(check, name, status,
                                   f"{what} {value} differs from {ref} ({', '.join(same)})",
                                   ev, fix))
    return results


def gpu_consistency(facts: Facts, head: str) -> list[CheckResult]:
    models = {n: f.gpu_model for n, f in facts.items() if f.gpu_model}
    return _differences("gpu-match", "GPU model", models, head, Status.WARN,
                        "a TP/PP group runs at the smallest GPU: keep one model per group")


def driver_consistency(facts: Facts, head: str) -> list[CheckResult]:
    drivers = {n: f.driver_version for n, f in facts.items() if f.driver_version}
    return _differences("driver-match", "NVIDIA driver", drivers, head, Status.FAIL,
                        "install the same driver version on every node")


def mtu_consistency(facts: Facts, head: str) -> list[CheckResult]:
    """The NCCL/Gloo interface's MTU (the iface check's fact) is the same on every node."""
    mtus = {n: f.mtu for n, f in facts.items() if f.mtu is not None}
    if len(mtus) < 2:
        return [CheckResult("mtu-match", None, Status.SKIP,
                            "fewer than two nodes with a known interface MTU")]
    return _differences("mtu-match", "MTU", mtus, head, Status.FAIL,
                        "set the same MTU on every node's interface and its switch ports (e.g. "
                        "`ip link set <if> mtu 9000` plus the distribution's network config): "
                        "large messages are dropped or fragmented between nodes that differ")


def version_consistency(facts: Facts, head: str, components: Sequence[str]) -> list[CheckResult]:
    """Every component in `components` at the head's version on every node (the one skew
    judgement: cluster.inspection.facts.component_versions, which version_skew lists)."""
    versions = {n: f.versions for n, f in facts.items() if f.versions}
    results: list[CheckResult] = []
    for known in component_versions(versions, head, components):
        comp, values, ref, odd = known.component, known.values, known.reference, known.skews()
        ev = Evidence(data={"values": values, "reference": ref})
        fix = f"install {comp} {ref} on every node (Ray and vLLM must match the head exactly)"
        if not odd:
            results.append(CheckResult(f"{comp}-match", None, Status.OK,
                                       f"{comp} {ref} on all {len(values)} nodes", ev))
            continue
        results.append(CheckResult(f"{comp}-match", None, Status.FAIL,
                                   f"{comp} differs from the head's {ref}: " +
                                   ", ".join(f"{s.value} on {s.node}" for s in odd), ev, fix))
        results += [CheckResult(f"{comp}-match", s.node, Status.FAIL,
                                f"{comp} {s.value}, head has {ref}", ev, fix) for s in odd]
    return results


def model_consistency(facts: Facts, head: str) -> list[CheckResult]:
    prints = {n: f.model_print() for n, f in facts.items() if f.model_files}
    if not prints:
        return []
    ref = majority_value(prints, head)
    odd = sorted(n for n, p in prints.items() if p != ref)
    ev = Evidence(data={n: dict((k, {"size": s, "sha256": h}) for k, s, h in p)
                        for n, p in prints.items()})
    if not odd:
        return [CheckResult("model-match", None, Status.OK,
                            f"identical model config/index on {len(prints)} nodes", ev)]
    fix = "re-sync the model directory (rsync -a --checksum) from a good node"
    out = [CheckResult("model-match", None, Status.FAIL,
                       f"model files differ on {', '.join(odd)}", ev, fix)]
    for n in odd:
        diff = sorted({k for k, s, h in set(prints[n]) ^ set(ref)})
        out.append(CheckResult("model-match", n, Status.FAIL,
                               f"model files differ from the other nodes: {', '.join(diff)}", ev,
                               fix))
    return out


# ---------------------------------------------------------------- clock skew


def clock_skew(samples: Mapping[str, ClockSample], expect: Mapping[str, Any]) -> list[CheckResult]:
    good = {n: s for n, s in samples.items() if s.offset_s is not None}
    if len(good) < 2:
        return [CheckResult("clock-skew", None, Status.SKIP,
                            "fewer than two nodes answered: no skew to measure",
                            Evidence(data=_samples_data(samples)))]
    offsets = {n: s.offset_s for n, s in good.items()}
    spread = max(offsets.values()) - min(offsets.values())
    uncertainty = max(s.rtt_s for s in good.values()) / 2
    median = statistics.median(offsets.values())
    limit = float(expect["clock"]["max_skew_ms"]) / 1000
    warn_at = float(expect["clock"]["warn_skew_ms"]) / 1000
    ev = Evidence(command=CLOCK_COMMAND, data=_samples_data(samples) | {
        "max_skew_s": spread, "uncertainty_s": uncertainty})
    summary = f"max skew {spread * 1000:.1f} ms (+-{uncertainty * 1000:.1f} ms) across {len(good)} nodes"
    fix = "sync clocks with chrony on every node (same NTP sources)"
    if spread - uncertainty > limit:
        out = [CheckResult("clock-skew", None, Status.FAIL, summary + f", limit {limit * 1000:g} ms",
                           ev, fix)]
        for n, off in sorted(offsets.items()):
            if abs(off - median) > limit:
                out.append(CheckResult("clock-skew", n, Status.FAIL,
                                       f"clock {off - median:+.3f} s from the other nodes' median",
                                       ev, fix))
        return out
    if spread - uncertainty > warn_at:
        return [CheckResult("clock-skew", None, Status.WARN, summary, ev, fix)]
    return [CheckResult("clock-skew", None, Status.OK, summary, ev)]


def _samples_data(samples: Mapping[str, ClockSample]) -> dict[str, Any]:
    return {"nodes": {n: {"offset_s": s.offset_s, "rtt_s": s.rtt_s, "error": s.error}
                      for n, s in samples.items()}}


def cross_node_checks(facts: Facts, inventory: Inventory,
                      skew: Mapping[str, ClockSample] | None) -> list[CheckResult]:
    head = inventory.head.name
    results = gpu_consistency(facts, head) + driver_consistency(facts, head)
    results += mtu_consistency(facts, head)
    results += version_consistency(facts, head,
                                   inventory.expectations.get("versions_must_match", ()))
    results += model_consistency(facts, head)
    results += ray_client_check(facts, laptop_ray_version())
    if skew is not None:
        results += clock_skew(skew, inventory.expectations)
    return results
