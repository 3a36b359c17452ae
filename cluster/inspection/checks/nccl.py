"""Judge an NCCL log's reading (cluster/inspection/parsers/nccl.py's NcclLog): its status
(ok / warn / fail), the findings behind that status, and the one sentence an admin reads.

The parser only reads what the log shows; everything here is judgement: TCP sockets between
nodes fail, GPUDirect RDMA on some nodes only fails, RDMA without GPUDirect warns, NCCL's own
errors fail and its warnings warn. docs/nccl-parser.md explains the rules; `cluster parse`,
`cluster nccl-check` and the fabric proof read the judged document (`judged_document`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from cluster.base.errors import ParseError
from cluster.base.results import Status, worst
from cluster.inspection.parsers.nccl import NcclLog, parse_texts

RDMA_TRANSPORTS = ("IB", "ROCE", "OFI")


@dataclass(frozen=True)
class NcclReason:
    """One reason behind the status: its level and what the log shows."""

    status: Status
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"status": self.status.value, "reason": self.reason}


@dataclass(frozen=True)
class NcclJudgement:
    """An NCCL log judged: `status`, the one-sentence `verdict`, and the `findings` behind them."""

    status: Status
    verdict: str
    findings: tuple[NcclReason, ...]


def judge(log: NcclLog) -> NcclJudgement:
    """The status, findings and verdict sentence of one reading."""
    findings = _findings(log)
    status = worst(f.status for f in findings) if findings else Status.OK
    return NcclJudgement(status, _verdict(log, status), findings)


def judged_document(log: NcclLog) -> dict[str, Any]:
    """The reading's `to_dict()` with the judgement in its contract places: `status` and
    `verdict` right after `busbw_gbps`, `findings` after `communicators`."""
    judgement = judge(log)
    out: dict[str, Any] = {}
    for key, value in log.to_dict().items():
        out[key] = value
        if key == "busbw_gbps":
            out["status"] = judgement.status.value
            out["verdict"] = judgement.verdict
        elif key == "communicators":
            out["findings"] = [f.to_dict() for f in judgement.findings]
    return out


def judged_logs(texts: Iterable[str]) -> dict[str, Any] | None:
    """Several ranks' NCCL_DEBUG logs read as one cluster-wide log (hosts and ranks told apart
    by their envelopes, so GDR asymmetry between nodes shows), judged; None when no text holds
    an NCCL line."""
    try:
        return judged_document(parse_texts(texts))
    except ParseError:
        return None


# -- status ----------------------------------------------------------------------------------


def _findings(log: NcclLog) -> tuple[NcclReason, ...]:
    out: list[NcclReason] = []

    def add(status: Status, reason: str) -> None:
        out.append(NcclReason(status, reason))

    transport = log.inter_node_transport
    if log.errors:
        add(Status.FAIL, f"{len(log.errors)} kind(s) of NCCL error in the log")
    if transport == "SOCKET":
        add(Status.FAIL, "inter-node traffic over TCP sockets (no RDMA)"
            + ("" if _multi_node(log) else "; node count not shown"))
    if log.gdr_asymmetric:
        add(Status.FAIL, "GPUDirect RDMA on some nodes but not on others")
    if transport in RDMA_TRANSPORTS and not log.gdr_asymmetric:
        if log.gdr is False:
            add(Status.WARN, "GPUDirect RDMA " + ("only on part of the channels" if log.gdr_mixed
                                                  else "not used") + ": data staged through host memory")
        elif log.gdr is None:
            add(Status.WARN, "GPUDirect RDMA use not shown in the log")
    if transport == "UNKNOWN":
        add(Status.WARN, "inter-node transport not shown in the log")
    if transport == "NONE" and _intra_through_nic(log):
        add(Status.WARN, "intra-node traffic goes through the NIC (NET) instead of P2P/SHM")
    if log.warnings:
        add(Status.WARN, f"{len(log.warnings)} kind(s) of NCCL warning in the log")
    if log.ranks_incomplete:
        add(Status.WARN, f"{len(log.ranks_incomplete)} rank(s) started init without completing it "
                         "(hung, failed, or the log is cut)")
    if log.version_mismatch_suspected:
        add(Status.WARN, "different NCCL versions on different hosts")
    return tuple(out)


def _multi_node(log: NcclLog) -> bool:
    return (log.n_nodes or 0) >= 2 or (log.n_nodes_min or 0) >= 2


def _intra_through_nic(log: NcclLog) -> bool:
    """Every intra-node hop the log names goes through the NIC (NET), none over P2P/SHM/NVLS."""
    return set(log.intra_node_transports) == {"NET"}


# -- verdict sentence ------------------------------------------------------------------------


def _verdict(log: NcclLog, status: Status) -> str:
    parts: list[str] = []
    if log.errors:
        parts.append(_errors_phrase(log))
    parts.append(_transport_phrase(log))
    if log.ranks_incomplete:
        parts.append(f"{len(log.ranks_incomplete)} rank(s) never reached Init COMPLETE")
    if log.version_mismatch_suspected:
        parts.append("hosts run different NCCL versions")
    if log.busbw_gbps is not None:
        parts.append(f"nccl-tests average bus bandwidth {log.busbw_gbps:g} GB/s")
    elif log.nccl_tests and log.nccl_tests.get("peak_busbw_gbps_oop") is not None:
        parts.append(f"nccl-tests peak bus bandwidth {log.nccl_tests['peak_busbw_gbps_oop']:g} GB/s")
    text = "; ".join(parts)
    return f"{status.value.upper()}: {text[0].upper()}{text[1:]}."


def _errors_phrase(log: NcclLog) -> str:
    kinds: Counter = Counter()
    for e in log.errors:
        kinds[e.kind] += e.count
    hosts = sorted({h for e in log.errors for h in e.hosts})
    where = (f" on {', '.join(hosts[:4])}" + (" ..." if len(hosts) > 4 else "")) if hosts else ""
    return "NCCL errors: " + ", ".join(f"{k.replace('_', ' ')} ({n} line{'s' if n != 1 else ''})"
                                       for k, n in kinds.items()) + where


def _shape(log: NcclLog) -> str:
    n_ranks, n_nodes = log.n_ranks, log.n_nodes
    if not (n_ranks or n_nodes):
        return ""
    shape = f" ({n_ranks if n_ranks else '?'} rank{'s' if n_ranks != 1 else ''} on "
    return shape + (f"{n_nodes} node{'s' if n_nodes != 1 else ''})" if n_nodes
                    else f">= {log.n_nodes_min or 1} node(s))")


def _transport_phrase(log: NcclLog) -> str:
    transport, network, shape = log.inter_node_transport, log.network, _shape(log)
    intra_t = log.intra_node_transports
    intra = "/".join(intra_t) if intra_t else None
    if transport == "NONE":
        s = f"single-node run{shape}: no inter-node traffic"
        if intra:
            s += f"; intra-node over {intra}"
        if _intra_through_nic(log):
            s += " (through the NIC, not NVLink/PCIe P2P)"
        return s
    if transport == "SOCKET":
        s = f"inter-node traffic falls back to TCP sockets{shape} instead of RDMA"
        ifaces = list(log.net_socket_ifaces) or list(log.socket_ifaces)
        return s + (f" (NET/Socket on {', '.join(ifaces[:4])})" if ifaces else "")
    if transport in ("IB", "ROCE"):
        return _verbs_phrase(log, shape, intra)
    if transport == "OFI":
        prov = log.ofi_provider
        s = f"inter-node traffic uses the OFI/libfabric plugin{shape}" + (f" (provider {prov})" if prov else "")
        return s + _gdr_phrase(log)
    s = f"the log does not show which inter-node transport NCCL uses{shape}"
    if network:
        s += f" (network {network})"
    return s + (f"; intra-node {intra}" if intra else "")


def _verbs_phrase(log: NcclLog, shape: str, intra: str | None) -> str:
    """NET/IB's sentence: InfiniBand, RoCE, or either when the log does not tell them apart."""
    transport, network = log.inter_node_transport, log.network
    mixed = transport == "IB" and log.link_layers_mixed
    name = "RoCE" if transport == "ROCE" else "InfiniBand or RoCE" if mixed else "InfiniBand"
    s = f"inter-node traffic uses {name}{shape}"
    if transport == "IB" and not log.link_layers:
        s += " verbs (NET/IB; the link layer is not shown, RoCE would print the same)"
    elif mixed:
        s += (" (NET/IB lists HCAs of both link layers; the log does not show which one "
              "carries the traffic)")
    if network and network not in ("IB",):
        s += f" via {network}"
    hcas = ", ".join(log.ib_hcas[:4]) + (" ..." if len(log.ib_hcas) > 4 else "")
    if hcas:
        s += f" on {hcas}"
    s += _gdr_phrase(log)
    return s + (f"; intra-node {intra}" if intra else "")


def _gdr_phrase(log: NcclLog) -> str:
    if log.gdr_asymmetric:
        by_host: Mapping[str, Any] = log.gdr_by_host
        on = [h for h, v in by_host.items() if v is True]
        off = [h for h, v in by_host.items() if v is not True]
        return f", but GPUDirect RDMA only on {', '.join(on[:3])} and not on {', '.join(off[:3])}"
    if log.gdr is True:
        return " with GPUDirect RDMA"
    if log.gdr is False:
        return (" with GPUDirect RDMA on only part of the channels" if log.gdr_mixed
                else " WITHOUT GPUDirect RDMA (data staged through host memory)")
    return ("; GPUDirect RDMA not shown (rerun with NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH "
            "and a real collective)")
