"""Per-node health checks (issue 16): probes for PCIe ACS, the kernel log, the fabric manager,
`nvidia-smi -q` and `ip addr`, judged by the pure verdicts of cluster/inspection/checks/health.py.

Each check reads its probes' outputs from the one SSH round trip of the preflight. A tool that
is not on the node (no pciutils, no systemd, no NVIDIA driver) makes its check skip: the GPU
and driver checks already fail when GPUs are expected and nvidia-smi is missing.

    acs            lspci ACSCtl bits                  ACS on with >1 GPU or RDMA NICs: fail
    fabricmanager  systemctl status + nvidia-smi -q   NVSwitch fabric not up: fail
    gpu-health     nvidia-smi -q + kernel log         Xid, ECC, remaps, retired pages: fail;
                                                      clock slowdowns: warn
    pcie-link      nvidia-smi -q                      below max width / gen under load: warn
    persistence    nvidia-smi                         off: warn (fixable)
    nic-locality   nvidia-smi topo -m + ibstat        nearest RDMA NIC across the socket: warn
    iface          ip addr                            NCCL/Gloo interface missing/down/no node_ip
"""

from __future__ import annotations

import ipaddress
from typing import Any, Mapping, Sequence

from cluster.inspection.checks import health
from cluster.inspection.checks.base import NodeCheck, NodeContext, Verdict, fail, read_tool, skip, tool_problem
from cluster.inspection.facts import (FABRICMANAGER, GPU_QUERY, GPU_TOPO, IBSTAT, IP_ADDR, KERNEL_LOG, LSPCI,
                           NVIDIA_SMI, NVIDIA_SMI_Q, ToolFact)
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.inspection.parsers.dmesg import Dmesg
from cluster.inspection.parsers.ip_addr import Interface
from cluster.base.results import worst

# fabricmanager's probe: systemctl's own exit code: 0 active, 3 not running, 4 no such unit.
_SYSTEMCTL_ANSWERED = (0, 3, 4)
KERNEL_LOG_UNREADABLE = 3


def _health(ctx: NodeContext) -> Mapping[str, Any]:
    return ctx.expect["health"]


def _optional(ctx: NodeContext, fact: ToolFact) -> Any:
    """The parser's reading of a fact whose tool may be absent: None when it did not run."""
    out = ctx.output(fact)
    if out.missing_tool or out.timed_out or (out.exit_code != 0 and not out.stdout.strip()):
        return None
    return ctx.reading(fact)


def _smi_q(ctx: NodeContext) -> tuple[Any, Verdict | None]:
    """nvidia-smi -q parsed, or the skip/error verdict when it did not run."""
    return read_tool(ctx, NVIDIA_SMI_Q, "nvidia-smi", False, "NVIDIA GPUs",
                     "install the NVIDIA driver")


def _gpu_count(ctx: NodeContext) -> int | None:
    query = _optional(ctx, GPU_QUERY)
    return len(query.gpus) if query is not None else None


def _rdma_devices(ctx: NodeContext) -> list[str] | None:
    """The node's RDMA devices (ibstat's CA names); None when ibstat did not run."""
    data = _optional(ctx, IBSTAT)
    if data is None:
        return None
    return sorted({p.ca for p in data.ports if p.ca})


# ---------------------------------------------------------------- ACS


def evaluate_acs(ctx: NodeContext) -> Verdict:
    out = ctx.output(LSPCI)
    if out.missing_tool:
        return skip("lspci not found (install pciutils): PCIe ACS not checked", probe="lspci")
    problem = tool_problem(out, "lspci", False, "PCIe ACS reading", "install pciutils")
    if problem:
        return problem
    if not out.stdout.strip():
        return skip("lspci showed no PCI device (a container without the host's PCI tree?)")
    rdma = _rdma_devices(ctx) or []
    return health.acs(ctx.reading(LSPCI), _gpu_count(ctx), len(rdma), _health(ctx))


# ---------------------------------------------------------------- fabric manager


def _fabricmanager_state(ctx: NodeContext) -> Any:
    """systemctl's view of nvidia-fabricmanager; None when systemctl could not say."""
    out = ctx.output(FABRICMANAGER)
    if out.missing_tool or out.timed_out or out.exit_code not in _SYSTEMCTL_ANSWERED:
        return None   # no systemd (a container) or systemctl failed: the GPUs' fabric state decides
    return ctx.reading(FABRICMANAGER)


def evaluate_fabricmanager(ctx: NodeContext) -> Verdict:
    smi_q, problem = _smi_q(ctx)
    if problem:
        return problem
    return health.fabricmanager(_fabricmanager_state(ctx), smi_q,
                                _health(ctx))


# ---------------------------------------------------------------- GPU health


def _kernel_log(ctx: NodeContext) -> Any:
    """The driver's kernel-log lines parsed; None when the log could not be read."""
    out = ctx.output(KERNEL_LOG)
    if out.missing_tool or out.timed_out or out.exit_code == KERNEL_LOG_UNREADABLE:
        return None
    if not out.stdout.strip():
        return Dmesg((), ())   # the log was read: no NVRM/AER line
    return ctx.reading(KERNEL_LOG)


def evaluate_gpu_health(ctx: NodeContext) -> Verdict:
    smi_q, problem = _smi_q(ctx)
    if problem:
        return problem
    log = _kernel_log(ctx)
    verdict = health.gpu_health(smi_q, log, _health(ctx))
    if log is None and verdict.status.value == "ok":
        return Verdict(verdict.status, verdict.summary + " (kernel log not readable: Xids not "
                                                         "checked)", verdict.fix, verdict.data)
    return verdict


# ---------------------------------------------------------------- PCIe link, persistence


def evaluate_pcie_link(ctx: NodeContext) -> Verdict:
    smi_q, problem = _smi_q(ctx)
    if problem:
        return problem
    return health.pcie_link(smi_q, _health(ctx))


def evaluate_persistence(ctx: NodeContext) -> Verdict:
    out = ctx.output(NVIDIA_SMI)
    problem = tool_problem(out, "nvidia-smi", False, "NVIDIA GPUs", "install the NVIDIA driver")
    if problem:
        return problem
    verdict = health.persistence(ctx.reading(NVIDIA_SMI).gpus, _health(ctx))
    off = verdict.status.value == "warn"
    return Verdict(verdict.status, verdict.summary, verdict.fix, verdict.data,
                   NodeFactsSummary.of(persistence_off=off) if verdict.status.value != "skip"
                   else NodeFactsSummary())


# ---------------------------------------------------------------- NIC locality


def evaluate_nic_locality(ctx: NodeContext) -> Verdict:
    out = ctx.output(GPU_TOPO)
    problem = tool_problem(out, "nvidia-smi", False, "GPU topology", "install the NVIDIA driver")
    if problem:
        return problem
    return health.nic_locality(ctx.reading(GPU_TOPO), _health(ctx),
                               _rdma_devices(ctx))


# ---------------------------------------------------------------- interface


def matching_interfaces(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME select, in NCCL's syntax.

    A comma-separated list of name prefixes; `=` in front: exact names; `^` in front: every
    interface except those.
    """
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    body = body[1:] if exact else body
    wanted = [w for w in body.split(",") if w]
    hit = (lambda n: n in wanted) if exact else (lambda n: any(n.startswith(w) for w in wanted))
    return [n for n in names if hit(n) != exclude]


def _node_ip(ctx: NodeContext) -> str | None:
    try:
        return str(ipaddress.IPv4Address(ctx.node.ip))
    except ValueError:
        return None   # a host name: the address Ray uses is not known here


def _carrying(interfaces: Sequence[Interface], ip: str | None) -> list[str]:
    return [i.name for i in interfaces
            if ip is not None and any(a.split("/", 1)[0] == ip for a in i.ipv4)]


def evaluate_iface(ctx: NodeContext) -> Verdict:
    data, problem = read_tool(ctx, IP_ADDR, "ip", False, "network interfaces",
                              "install iproute2")
    if problem:
        return problem
    interfaces = data.interfaces
    names = [i.name for i in interfaces]
    ip = _node_ip(ctx)
    carrying = _carrying(interfaces, ip)
    specs = [(var, spec) for var, spec in (("NCCL_SOCKET_IFNAME", ctx.node.nccl_socket_ifname),
                                           ("GLOO_SOCKET_IFNAME", ctx.node.gloo_socket_ifname))
             if spec]
    if not specs:
        if ip is None:
            return skip(f"node address {ctx.node.ip} is a host name: set node_ip to check the "
                        f"interface Ray and NCCL use")
        if not carrying:
            return fail(f"no interface carries node_ip {ip} (have: "
                        f"{', '.join(names[:32]) or 'none'}): Ray cannot bind to it",
                        "set node_ip to the node's cluster-network address (`ip -br addr`)",
                        data=data)
        return health.iface(data, carrying[0], ip)
    verdicts = []
    for var, spec in dict.fromkeys(specs):
        chosen = matching_interfaces(spec, names)
        if not chosen:
            return fail(f"no interface matches {var}={spec} (have: "
                        f"{', '.join(names[:32]) or 'none'})",
                        f"set {var.lower()} in the inventory to the interface that carries the "
                        f"node's address (`ip -br addr`)", data=data)
        preferred = [n for n in chosen if n in carrying] or chosen
        verdicts.append(health.iface(data, preferred[0], ip))
    return next(v for v in verdicts if v.status == worst(v.status for v in verdicts))


HEALTH_CHECKS: tuple[NodeCheck, ...] = (
    NodeCheck("acs", "PCIe ACS off on the GPU/NIC paths",
              (LSPCI, GPU_QUERY, IBSTAT), evaluate_acs),
    NodeCheck("fabricmanager", "NVSwitch fabric manager and fabric state",
              (NVIDIA_SMI_Q,
               FABRICMANAGER), evaluate_fabricmanager),
    NodeCheck("gpu-health", "Xid, ECC, row remaps, retired pages, clock slowdowns",
              (NVIDIA_SMI_Q,
               KERNEL_LOG), evaluate_gpu_health),
    NodeCheck("pcie-link", "GPU PCIe link width and generation",
              (NVIDIA_SMI_Q,), evaluate_pcie_link),
    NodeCheck("persistence", "GPU persistence mode",
              (NVIDIA_SMI,), evaluate_persistence),
    NodeCheck("nic-locality", "an RDMA NIC near each GPU",
              (GPU_TOPO, IBSTAT),
              evaluate_nic_locality),
    NodeCheck("iface", "NCCL/Gloo interface up with node_ip",
              (IP_ADDR,), evaluate_iface),
)
