"""The fabric proof of a deployment: its layout's own groups, all-reduced with the backend the
engine will use on the nodes the layout takes, judged against cluster/data/fabric.yaml.

Pure (the Ray job is nccl-check's: cluster/ray_jobs/nccl_allreduce.py with --groups, submitted by
playbooks/nccl_check.py run_proof):

    plan = plan_proof(spec, device, cluster, inventory)     # groups, ranks, nodes, ports
    plan.to_dict()                                          # what a dry run shows
    job_args(plan)                                          # the job's arguments
    proof = judge_proof(plan, outcome, inventory, ib_facts) # -> FabricProof
    proof.to_dict()["groups"]  -> [{kind, ranks, nodes, backend, transport, gdr, busbw_gbps,
                                    threshold_gbps, verdict}]

Backend: NCCL on GPUs (one rank per GPU), gloo on the CPU build (what vLLM's CPU workers use
between ranks). Each group's store listens on its first member's node on a port of the
inventory's ray.vllm_port_min..vllm_port_max, the range the engine's ranks rendezvous on, so
a firewall that would stop the engine stops the proof.

A group FAILs when it cannot form (its nodes and port named), when a cross-node NCCL group runs
over sockets where the inventory expects InfiniBand/RoCE, when GPUDirect RDMA is required and
not used, or when its bus bandwidth is below its threshold; each verdict says what to look at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from cluster.planning import fabric_thresholds as ft
from cluster.base.bounds import bound, reply_number
from cluster.base.errors import UsageError
from cluster.planning.fabric_groups import Group, Layout, NodeSlots, RankSlot, layout_groups, rank_slots, \
    slots_per_node
from cluster.base.results import Status, worst
from cluster.inspection.node_summary import PreflightFacts

DEFAULT_SIZE_MB = {"nccl": 256.0, "gloo": 8.0}
DEFAULT_ITERS = {"nccl": 20, "gloo": 5}
WARMUP = 2
GROUP_MAX = 256                 # groups one proof runs (a larger layout: one per kind/nodes)


# ---------------------------------------------------------------- plan


@dataclass(frozen=True)
class ProofPlan:
    """What the proof runs: the layout's groups, each on its nodes, with its port."""

    layout: Layout
    device: str
    backend: str
    slots: tuple[RankSlot, ...]
    groups: tuple[Group, ...]
    ports: tuple[int, ...]
    port_range: tuple[int, int]
    size_mb: float
    iters: int
    small_bytes: int
    join_timeout_s: float

    @property
    def timeout_s(self) -> float:
        """The whole job's bound: every group may take its join time plus its transfer."""
        return min(float(bound("nccl_check", "timeout_s_max")),
                   60.0 + len(self.groups) * (self.join_timeout_s + 60.0))

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "device": self.device, "layout": self.layout.to_dict(),
                "port_range": list(self.port_range), "size_mb": self.size_mb,
                "iters": self.iters, "latency_bytes": self.small_bytes,
                "join_timeout_s": self.join_timeout_s,
                "groups": [dict(kind=g.kind, replica=g.replica, ranks=list(g.ranks),
                                nodes=list(g.nodes), devices=[m.device for m in g.members],
                                crosses_nodes=g.crosses_nodes, port=port)
                           for g, port in zip(self.groups, self.ports)]}


def backend_for(device: str) -> str:
    return "nccl" if device == "gpu" else "gloo"


def node_slots(layout: Layout, device: str, cluster: Any, inventory: Any) -> list[NodeSlots]:
    """The alive Ray nodes that are in the inventory, in inventory order, with their room."""
    by_name = {n.name: n for n in cluster.nodes if n.name}
    out = []
    for node in inventory.nodes:
        ray_node = by_name.get(node.name)
        if ray_node is None:
            continue
        room = ray_node.gpus if device == "gpu" else ray_node.cpus
        out.append(NodeSlots(node.name, ray_node.ip, slots_per_node(layout, device, room)))
    return out


def plan_proof(spec: Any, device: str, cluster: Any, inventory: Any,
               nnodes: int | None = None) -> ProofPlan:
    """The proof of this DeploySpec (or Layout) on these alive nodes (deploy.ClusterView).
    `nnodes`: the nodes one engine spans when the deployment fixes it."""
    layout = spec if isinstance(spec, Layout) else Layout.from_spec(spec)
    if nnodes is not None:
        layout = replace(layout, nnodes=nnodes)
    return plan_on_nodes(layout, device, node_slots(layout, device, cluster, inventory),
                         (inventory.ray.vllm_port_min, inventory.ray.vllm_port_max),
                         inventory.expectations.get("fabric") or {})


def plan_on_nodes(layout: Layout, device: str, nodes: Sequence[NodeSlots],
                  port_range: tuple[int, int], fabric: Mapping[str, Any]) -> ProofPlan:
    """The proof of `layout` on these nodes, in order (a gang replica's own nodes, where Ray
    placed its bundles: serve_apps/gang_proof.py), stores on ports of `port_range`."""
    slots = rank_slots(layout, nodes)
    groups = layout_groups(layout, slots)[:GROUP_MAX]
    lo, hi = port_range
    span = hi - lo + 1
    backend = backend_for(device)
    size = fabric.get("size_mb") or DEFAULT_SIZE_MB[backend]
    small = max(4, int(float(fabric.get("latency_kb") or 8) * 1024) // 4 * 4)
    return ProofPlan(layout, device, backend, slots, groups,
                     tuple(lo + i % span for i in range(len(groups))), (lo, hi), float(size),
                     DEFAULT_ITERS[backend], small, float(fabric.get("join_timeout_s") or 60))


def job_args(plan: ProofPlan) -> list[str]:
    """The entrypoint's arguments (nccl_check.head_call adds --deadline, --result-file)."""
    if not plan.groups:
        raise UsageError("the layout has no group of two or more ranks: nothing to prove")
    index = {(s.replica, s.rank): i for i, s in enumerate(plan.slots)}
    nodes: list[dict[str, str]] = []
    for s in plan.slots:
        if not any(n["name"] == s.node for n in nodes):
            nodes.append({"name": s.node, "ip": s.ip})
    spec = {"slots": [{"node": s.node, "ip": s.ip} for s in plan.slots],
            "groups": [{"kind": g.kind, "replica": g.replica, "ranks": list(g.ranks),
                        "members": [index[(m.replica, m.rank)] for m in g.members],
                        "port": port} for g, port in zip(plan.groups, plan.ports)],
            "small_bytes": plan.small_bytes, "join_timeout_s": plan.join_timeout_s,
            "port_range": list(plan.port_range)}
    compact = (",", ":")
    return ["--backend", plan.backend, "--size-mb", f"{plan.size_mb:g}", "--iters",
            str(plan.iters), "--warmup", str(WARMUP), "--nodes", json.dumps(nodes,
                                                                             separators=compact),
            "--groups", json.dumps(spec, separators=compact)]


# ---------------------------------------------------------------- judge


@dataclass(frozen=True)
class GroupVerdict:
    """One group's proof."""

    kind: str
    replica: int
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    backend: str
    transport: str | None
    gdr: bool | None
    busbw_gbps: float | None
    threshold_gbps: float | None
    verdict: str
    status: Status
    port: int
    latency_us: float | None = None
    threshold_basis: str = ""
    threshold_source: str | None = None
    evidence: str | None = None
    problems: tuple[str, ...] = ()
    devices: tuple[tuple[str, ...], ...] = ()     # per rank: the GPU ids Ray gave it

    def to_dict(self) -> dict[str, Any]:
        """The contract keys of fabric_proof.groups[] (issue 23)."""
        return {"kind": self.kind, "ranks": list(self.ranks), "nodes": list(self.nodes),
                "backend": self.backend, "transport": self.transport, "gdr": self.gdr,
                "busbw_gbps": self.busbw_gbps, "threshold_gbps": self.threshold_gbps,
                "verdict": self.verdict}

    def detail(self) -> dict[str, Any]:
        return {"kind": self.kind, "replica": self.replica, "ranks": list(self.ranks),
                "status": self.status.value, "port": self.port, "latency_us": self.latency_us,
                "threshold_basis": self.threshold_basis, "threshold_source": self.threshold_source,
                "evidence": self.evidence, "problems": list(self.problems),
                "devices": [list(d) for d in self.devices]}


@dataclass(frozen=True)
class FabricProof:
    groups: tuple[GroupVerdict, ...]
    backend: str
    port_range: tuple[int, int]
    problems: tuple[str, ...] = ()
    job_id: str | None = None

    @property
    def status(self) -> Status:
        statuses = [g.status for g in self.groups] or [Status.FAIL]
        if self.problems:
            statuses.append(Status.FAIL)
        return worst(statuses)

    @property
    def ok(self) -> bool:
        return self.status in (Status.OK, Status.WARN)

    @property
    def verdict(self) -> str:
        failed = [g for g in self.groups if g.status == Status.FAIL]
        if self.problems and not failed:
            return "FAIL: " + self.problems[0]
        warned = [g for g in self.groups if g.status == Status.WARN]
        for worse in (failed, warned):
            if worse:
                more = f" (+{len(worse) - 1} more group(s))" if len(worse) > 1 else ""
                return worse[0].verdict + more
        return f"OK: {len(self.groups)} group(s) proven with {self.backend}"

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [g.to_dict() for g in self.groups], "status": self.status.value,
                "verdict": self.verdict, "backend": self.backend,
                "port_range": list(self.port_range), "problems": list(self.problems),
                "job_id": self.job_id, "details": [g.detail() for g in self.groups]}


def _nccl_of(members: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    from cluster.inspection.checks.nccl import judged_logs

    texts = [m["nccl_log"] for m in members if isinstance(m.get("nccl_log"), str)
             and m["nccl_log"].strip()]
    return judged_logs(texts) if texts else None


def _pair(group: Group) -> str:
    return " -> ".join(group.nodes)


def _could_not_form(group: Group, port: int, raw: Mapping[str, Any], backend: str) -> str:
    first = group.nodes[0]
    others = [n for n in group.nodes if n != first]
    problems = [str(p) for p in raw.get("problems") or ()]
    # a joining rank's own error (it names the address it could not reach) says more than
    # the store owner's wait timeout
    joining = [p for p in problems if not p.startswith("rank 0 ")]
    lead = (joining or problems or ["the ranks did not all join"])[0]
    if others:
        look = (f"TCP port {port} on {first} must be reachable from {', '.join(others)} "
                f"(firewall, security groups: open ray.vllm_port_min..vllm_port_max between the "
                f"nodes), and the interface the ranks bind "
                f"({'GLOO' if backend == 'gloo' else 'NCCL'}_SOCKET_IFNAME / VLLM_HOST_IP)")
    else:
        look = f"port {port} free on {first}, the ranks' processes (`cluster status`)"
    return (f"FAIL: {group.label} on {_pair(group)} cannot form on port {port}: {lead}; "
            f"look at: {look}")


def _port_rates(ib_facts: PreflightFacts | None, nodes: Sequence[str]) -> list[float]:
    """The active port rates (Gb/s) of the group's node with the least in all."""
    per_node = ib_facts.nodes if ib_facts is not None else {}
    best: list[float] | None = None
    for name in nodes:
        facts = per_node.get(name)
        rates = [float(r) for r in (facts.active_ib_rates if facts else ()) if r < 1e5]
        if best is None or sum(rates) < sum(best):
            best = rates
    return best or []


@dataclass(frozen=True)
class Context:
    """What the judge needs beyond the job's result (from the inventory and the facts)."""

    expectations: Mapping[str, Any]
    expected_network: str | None             # "IB" / "ROCE" / None
    gdr_required: bool
    gpu_models: Mapping[str, str | None] = field(default_factory=dict)
    nvlink: Mapping[str, bool | None] = field(default_factory=dict)
    ib_facts: PreflightFacts | None = None

    @classmethod
    def of(cls, inventory: Any, gpu_models: Mapping[str, str | None] | None = None,
           ib_facts: PreflightFacts | None = None) -> "Context":
        exp = inventory.expectations
        network = ft.expected_network(exp, any(n.ib_hcas for n in inventory.nodes))
        gdr = exp.get("gpudirect_rdma", "auto")
        models = dict(gpu_models or {})
        nvlink: dict[str, bool | None] = {}
        from cluster.planning.planner import lookup_gpu

        for name, model in models.items():
            spec = lookup_gpu(model)
            nvlink[name] = spec.nvlink if spec else None
        return cls(exp, network, gdr is True or (gdr == "auto" and network is not None),
                   models, nvlink, ib_facts)


def _figure(value: Any) -> float | None:
    """A figure from the job's result: a finite, non-negative number, else None."""
    return reply_number(value, lo=0, hi=bound("replies", "figure_max"))


def judge_group(plan: ProofPlan, index: int, raw: Mapping[str, Any] | None,
                ctx: Context) -> GroupVerdict:
    """One group's verdict from its record in the job's result (None: the job never ran it)."""
    group, port = plan.groups[index], plan.ports[index]
    raw = raw or {"problems": ["the proof job ended before this group ran"]}
    if isinstance(raw.get("port"), int) and not isinstance(raw.get("port"), bool) and \
            plan.port_range[0] <= raw["port"] <= plan.port_range[1]:
        port = raw["port"]             # the store moved to a free port of the range
    base = dict(kind=group.kind, replica=group.replica, ranks=group.ranks, nodes=group.nodes,
                backend=plan.backend, port=port)
    base["devices"] = tuple(tuple(str(x) for x in (m.get("gpu_ids") or ()))
                            for m in raw.get("members") or () if isinstance(m, Mapping))
    if not raw.get("ok"):
        return GroupVerdict(**base, transport=None, gdr=None, busbw_gbps=None,
                            threshold_gbps=None, status=Status.FAIL,
                            verdict=_could_not_form(group, port, raw, plan.backend),
                            problems=tuple(str(p) for p in raw.get("problems") or ()))
    busbw, latency = _figure(raw.get("busbw_gbps")), _figure(raw.get("latency_us"))
    crosses = group.crosses_nodes
    nodes = list(group.nodes)
    gpu_model = ctx.gpu_models.get(nodes[0])
    gdr: bool | None = None
    transport: str | None
    evidence = None
    findings: list[tuple[Status, str]] = []
    if plan.backend == "gloo":
        transport, key = "TCP", "TCP"
    else:
        nccl = _nccl_of(raw.get("members") or ())
        if nccl is None:
            transport = key = None
            findings.append((Status.WARN, "no NCCL debug log came back: transport not proven"))
        elif crosses:
            transport, gdr = nccl.get("inter_node_transport"), nccl.get("gdr")
            key = ft.transport_key("nccl", True, transport, gdr)
            evidence = str(nccl.get("verdict") or "")[:300]
        else:
            intra = nccl.get("intra_node_transports") or []
            transport = "+".join(intra) or "UNKNOWN"
            key = ft.transport_key("nccl", False, None, None, ctx.nvlink.get(nodes[0], True))
            evidence = str(nccl.get("verdict") or "")[:300]
        if crosses and ctx.expected_network and transport == "SOCKET":
            want = "InfiniBand" if ctx.expected_network == "IB" else "RoCE"
            findings.append((Status.FAIL, (
                f"runs over sockets where the inventory expects {want}; look at: ibstat on "
                f"{', '.join(nodes)} (ports Active?), the inventory's ib_hcas / NCCL_IB_HCA, "
                f"NCCL_IB_DISABLE, the RDMA modules (`cluster preflight`)")))
        elif crosses and ctx.gdr_required and transport in ("IB", "ROCE") and gdr is False:
            findings.append((Status.FAIL, (
                f"moves data without GPUDirect RDMA; look at: nvidia-peermem on "
                f"{', '.join(nodes)} (`lsmod | grep peermem`), PCIe ACS, the GPU-NIC "
                f"locality (`nvidia-smi topo -m`)")))
    threshold = ft.threshold_for(ft.load_table(), backend=plan.backend, crosses=crosses,
                                 transport=key, gpu_model=gpu_model, ranks=len(group.ranks),
                                 ranks_per_node=group.ranks_per_node(),
                                 port_rates_gbps=_port_rates(ctx.ib_facts, nodes) if crosses
                                 else (), overrides=ctx.expectations.get("fabric"))
    if busbw is None:
        findings.append((Status.WARN, "no bus bandwidth figure came back from the job"))
    met = ft.meets(busbw, threshold)
    if met is False:
        if crosses:
            look = (f"the links of {', '.join(nodes)} (`ibstat` rates, errors), congestion "
                    f"from other jobs, NCCL_IB_HCA")
        else:
            look = f"NVLink on {nodes[0]} (`nvidia-smi nvlink -s`, the fabric manager)"
        findings.append((Status.FAIL, f"bus bandwidth {busbw:g} GB/s is below its threshold "
                                      f"{threshold.gbps:g} GB/s ({threshold.basis}); look at: "
                                      f"{look}"))
    status = worst([Status.OK] + [s for s, _ in findings])
    measured = f"{busbw:g} GB/s bus bandwidth" if busbw is not None else "completed"
    if latency is not None:
        measured += f", {latency:g} us per {plan.small_bytes // 1024 or plan.small_bytes} " \
                    f"{'KiB' if plan.small_bytes >= 1024 else 'B'} all-reduce"
    over = f"{transport}{'/GDR' if gdr else ''}" if transport else "an unproven transport"
    lead = f"{status.value.upper()}: {group.label} on {_pair(group)} over {over}: {measured}"
    if findings:
        lead += "; " + "; ".join(text for _, text in findings)
    elif threshold.gbps is not None:
        lead += f" (threshold {threshold.gbps:g} GB/s)"
    else:
        lead += f" (not judged on bandwidth: {threshold.basis})"
    return GroupVerdict(**base, transport=transport, gdr=gdr, busbw_gbps=busbw,
                        threshold_gbps=threshold.gbps, verdict=lead, status=status,
                        latency_us=latency, threshold_basis=threshold.basis,
                        threshold_source=threshold.source, evidence=evidence)


def judge_proof(plan: ProofPlan, outcome: Any, ctx: Context) -> FabricProof:
    """The job's outcome (cluster.ray.nccl_check.JobOutcome) -> every group's verdict."""
    result = dict(outcome.result or {})
    raw_groups = [g for g in result.get("groups") or [] if isinstance(g, Mapping)]
    by_index = {g.get("index"): g for g in raw_groups}
    problems: list[str] = []
    busy = [str(n) for n in result.get("placement_busy") or []]
    if not raw_groups and busy:
        return _not_proven(plan, outcome, busy)
    if not raw_groups:
        why = [str(p) for p in result.get("problems") or []] or list(outcome.errors) or [
            f"the proof job ended {outcome.status or 'without a status'} without a result"]
        problems.extend(why[:5])
    verdicts = []
    for i in range(len(plan.groups)):
        raw = by_index.get(i)
        if raw is None and problems:
            raw = {"problems": problems[:1]}
        verdicts.append(judge_group(plan, i, raw, ctx))
    return FabricProof(tuple(verdicts), plan.backend, plan.port_range, tuple(problems),
                       outcome.submission_id)


def _not_proven(plan: ProofPlan, outcome: Any, busy: Sequence[str]) -> FabricProof:
    """Every group WARN: the layout's resources on `busy` (alive, answering) are in use (by the
    app a redeploy replaces, or other work), so the proof could not run there now."""
    why = (f"not proven: the layout's {'GPUs' if plan.backend == 'nccl' else 'CPUs'} on "
           f"{', '.join(busy)} are in use (the app being replaced or other work: "
           f"`cluster status`); `cluster nccl-check --layout` proves them when free")
    verdicts = tuple(GroupVerdict(kind=g.kind, replica=g.replica, ranks=g.ranks, nodes=g.nodes,
                                  backend=plan.backend, transport=None, gdr=None,
                                  busbw_gbps=None, threshold_gbps=None,
                                  verdict=f"WARN: {g.label} on {_pair(g)} {why}",
                                  status=Status.WARN, port=port, problems=(why,))
                     for g, port in zip(plan.groups, plan.ports))
    return FabricProof(verdicts, plan.backend, plan.port_range, (), outcome.submission_id)
