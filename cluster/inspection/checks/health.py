"""Node-health verdicts (issue 16): parsed outputs + thresholds -> Verdict, as pure functions.

Each function takes what the parsers return (the frozen readings `parse(text)` of lspci, dmesg,
fabricmanager, nvidia-smi-q, nvidia-smi, nvidia-smi-topo, ip addr) and the `health` section of the
expectations (cluster/data/expectations.yaml), and returns a Verdict (status, summary, fix
hint; facts where a later step needs them). Nothing here runs a command or reads a file: the
per-node checks that probe the nodes and call these are to be built on the facts layer.

    acs(lspci, gpu_count, rdma_nics, th)            ACS redirecting peer traffic: fail
    fabricmanager(fm, smi_q, th, nvswitch=None)      NVSwitch fabric not up: fail; skip elsewhere
    gpu_health(smi_q, kernel_log, th)                Xids, ECC, row remaps, retired pages, clocks
    pcie_link(smi_q, th)                             link trained below its width / generation
    persistence(gpus, th)                            persistence mode off: warn (fixable)
    nic_locality(topo, th, rdma_nics=None)           nearest RDMA NIC across the socket: warn
    iface(ip_addr, ifname, node_ip)                  NCCL/Gloo interface missing, down, wrong IP
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from cluster.inspection.checks.base import Verdict, fail, ok, skip, warn
from cluster.base.errors import InventoryError
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.inspection.parsers.dmesg import Dmesg
from cluster.inspection.parsers.fabricmanager import FabricManager
from cluster.inspection.parsers.ip_addr import IpAddr
from cluster.inspection.parsers.lspci import Lspci
from cluster.inspection.parsers.nvidia_smi import Gpu as SmiGpu
from cluster.inspection.parsers.nvidia_smi_q import Gpu as SmiQGpu, NvidiaSmiQ
from cluster.inspection.parsers.nvidia_smi_topo import NvidiaSmiTopo

# Names of the Xids an admin meets most (NVIDIA's Xid catalog); others print as "Xid N".
XID_NAMES: dict[int, str] = {
    13: "graphics engine exception", 31: "GPU memory page fault", 32: "corrupted push buffer",
    43: "GPU stopped processing", 45: "preemptive cleanup", 48: "double-bit ECC error",
    61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
    63: "row remapping / page retirement recorded", 64: "row remapping / page retirement failed",
    69: "graphics engine class error", 74: "NVLink error", 79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error",
    109: "context switch timeout", 119: "GSP RPC timeout", 120: "GSP error",
    137: "NVLink interrupt", 140: "unrecovered ECC error", 145: "NVLink RLW error",
    149: "NVLink NETIR error", 154: "GPU recovery action required",
}
_NIC_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4, "SOC": 4}
_MAX_LISTED = 4


# ---------------------------------------------------------------- thresholds


def _th_int(th: Mapping[str, Any], key: str) -> int:
    value = th.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InventoryError(f"must be a whole number >= 0, got {value!r}",
                             key=f"expectations.health.{key}")
    return value


def _th_list(th: Mapping[str, Any], key: str, kind: type) -> list:
    value = th.get(key)
    if not isinstance(value, list) or not all(
            isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise InventoryError(f"must be a list of {kind.__name__}, got {value!r}",
                             key=f"expectations.health.{key}")
    return value


def _th_str(th: Mapping[str, Any], key: str) -> str:
    value = th.get(key)
    if not isinstance(value, str) or not value:
        raise InventoryError(f"must be a text, got {value!r}", key=f"expectations.health.{key}")
    return value


def _listed(items: Iterable[str]) -> str:
    items = list(items)
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


def _gpu_name(gpu: Any) -> str:
    """A GPU of nvidia-smi's or nvidia-smi -q's reading, by bus id else index."""
    return gpu.bus_id or f"GPU{gpu.index}"


# ---------------------------------------------------------------- ACS


def acs(lspci: Lspci, gpu_count: int | None, rdma_nics: int,
        th: Mapping[str, Any]) -> Verdict:
    """PCIe ACS redirecting peer traffic through the root complex.

    Fails when ACS is enabled on a node with at least `acs_fail_min_gpus` GPUs or with RDMA
    NICs (GPU-GPU and GPUDirect RDMA traffic both cross the bridges); ok otherwise.
    """
    min_gpus = _th_int(th, "acs_fail_min_gpus")
    enabled = lspci.acs_enabled
    if enabled is None:
        return skip("ACS state unknown: lspci showed no device capabilities (run `lspci -vvv` "
                    "as root)")
    if not enabled:
        return ok("PCIe ACS disabled on every bridge shown")
    on = [d for d in lspci.devices
          if d.acs_ctl and any(d.acs_ctl.get(b) for b in
                               ("SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"))]
    where = _listed(d.bdf for d in on if d.bdf) or f"{len(on)} ACSCtl line(s)"
    gpus = gpu_count or 0
    if gpus < min_gpus and rdma_nics <= 0:
        return ok(f"PCIe ACS enabled ({where}), harmless with {gpus} GPU(s) and no RDMA NIC")
    return fail(
        f"PCIe ACS enabled on {where}: peer-to-peer and GPUDirect RDMA traffic is redirected "
        f"through the root complex (NCCL hangs or crawls)",
        "disable ACS in the BIOS (PCIe ACS / ACS Control: Disabled), or at runtime "
        "`setpci -s <bdf> ECAP_ACS+0x6.w=0000` for each bridge listed; setpci does not survive "
        "a reboot: reapply it at boot (a systemd unit) or boot with pci=noacs where supported",
        data={"devices": [d.bdf for d in on]})


# ---------------------------------------------------------------- fabric manager


def fabricmanager(fm: FabricManager | None, smi_q: NvidiaSmiQ | None,
                  th: Mapping[str, Any], nvswitch: bool | None = None) -> Verdict:
    """On NVSwitch systems: nvidia-fabricmanager running and every GPU's fabric registered.

    `nvswitch` None: an NVSwitch system is one whose GPUs report a fabric state. Skips
    elsewhere (fabric manager has nothing to do without NVSwitch).
    """
    state_ok, status_ok = _th_str(th, "fabric_state_ok"), _th_str(th, "fabric_status_ok")
    gpus = list(smi_q.gpus) if smi_q is not None else []
    if nvswitch is None:
        nvswitch = any(g.fabric_state for g in gpus)
    if not nvswitch:
        return skip("no NVSwitch fabric (GPUs report no fabric state): fabric manager not needed")
    fix = ("install nvidia-fabricmanager of exactly the driver's version and "
           "`systemctl enable --now nvidia-fabricmanager`; then check "
           "`journalctl -u nvidia-fabricmanager` and `nvidia-smi -q | grep -A2 Fabric`")
    if fm is not None and fm.running is False:
        why = f": {fm.failure}" if fm.failure else ""
        return fail(f"nvidia-fabricmanager is not running{why} (CUDA error 802 on NVSwitch "
                    f"systems)", fix)
    bad = [g for g in gpus if g.fabric_state != state_ok or g.fabric_status != status_ok]
    if bad:
        shown = _listed(f"{_gpu_name(g)} {g.fabric_state}/{g.fabric_status}"
                        for g in bad)
        return fail(f"{len(bad)} GPU(s) not registered with the NVLink fabric "
                    f"(state/status {shown}; want {state_ok}/{status_ok})", fix)
    if not gpus:
        return skip("no per-GPU fabric state to judge")
    unhealthy = [g for g in gpus if g.fabric_health_summary in
                 _th_list(th, "fabric_health_fail", str)]
    limited = [g for g in gpus if g.fabric_health_summary in
               _th_list(th, "fabric_health_warn", str)]
    if unhealthy or limited:
        which = unhealthy or limited
        shown = _listed(f"{_gpu_name(g)} {g.fabric_health_summary}" for g in which)
        summary = (f"{len(which)} GPU(s) registered ({state_ok}/{status_ok}) but the fabric "
                   f"health summary says {shown}")
        hint = ("check `nvidia-smi -q | grep -A12 Fabric` (Bandwidth, Route Unhealthy) and the "
                "NVSwitch / NVLink trays; `journalctl -u nvidia-fabricmanager` for link errors")
        return fail(summary, hint) if unhealthy else warn(summary, hint)
    running = "" if fm is None or fm.running is None else ", fabric manager running"
    return ok(f"{len(gpus)} GPU(s) fabric {state_ok}/{status_ok}{running}")


# ---------------------------------------------------------------- GPU health


def _xid_problems(kernel_log: Dmesg | None, fail_codes: set[int]
                  ) -> tuple[list[str], list[str]]:
    """(failing, warning) descriptions of the Xids in a parsed kernel log, one per code/GPU."""
    failing: list[str] = []
    warning: list[str] = []
    seen: set[tuple] = set()
    for x in kernel_log.xids if kernel_log is not None else ():
        key = (x.xid, x.pci)
        if key in seen:
            continue
        seen.add(key)
        name = XID_NAMES.get(x.xid, "")
        text = f"Xid {x.xid}{f' ({name})' if name else ''} on {x.pci or '?'}"
        (failing if x.xid in fail_codes else warning).append(text)
    for pci in kernel_log.fell_off_bus if kernel_log is not None else ():
        text = f"{pci} fell off the bus"
        if not any(pci in f for f in failing):
            failing.append(text)
    return failing, warning


def _failing_xids(kernel_log: Dmesg | None, fail_codes: set[int],
                  lost: list[str]) -> list[dict[str, Any]]:
    """[{xid, text}] of the failing lines in `lost` (a GPU off the bus is Xid 79's class)."""
    codes = {x.xid for x in (kernel_log.xids if kernel_log is not None else ())
             if x.xid in fail_codes}
    out = []
    for text in lost:
        code = next((c for c in codes if text.startswith(f"Xid {c} ") or text == f"Xid {c}"), 79)
        out.append({"xid": code, "text": text})
    return out


def _aer_problems(kernel_log: Dmesg | None, fail_levels: set[str]
                  ) -> tuple[list[str], list[str]]:
    """(failing, warning) descriptions of the PCIe AER errors in a parsed kernel log, one per
    device and level with its count (corrected errors are retried by the link: warn)."""
    counts: dict[tuple, int] = {}
    for e in kernel_log.aer if kernel_log is not None else ():
        key = (e.pci or "?", e.level or "?", e.severity or "?")
        counts[key] = counts.get(key, 0) + 1
    failing: list[str] = []
    warning: list[str] = []
    for (pci, level, severity), n in counts.items():
        text = f"PCIe AER {severity} on {pci}" + (f" ({n}x)" if n > 1 else "")
        (failing if level in fail_levels else warning).append(text)
    return failing, warning


def _gpu_problems(gpu: SmiQGpu, th: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    failing: list[str] = []
    warning: list[str] = []
    name = _gpu_name(gpu)
    volatile = gpu.ecc_uncorrectable_volatile
    if isinstance(volatile, int) and volatile > _th_int(th, "ecc_uncorrectable_volatile_max"):
        failing.append(f"{name}: {volatile} uncorrectable ECC error(s) since the driver loaded")
    aggregate = gpu.ecc_uncorrectable_aggregate
    if isinstance(aggregate, int) and aggregate > _th_int(th, "ecc_uncorrectable_aggregate_max"):
        warning.append(f"{name}: {aggregate} uncorrectable ECC error(s) in its lifetime")
    unplaced = gpu.ecc_unplaced or {}
    if isinstance(unplaced.get("uncorrectable"), int) and unplaced["uncorrectable"] > 0:
        warning.append(f"{name}: {unplaced['uncorrectable']} uncorrectable ECC error(s), volatile or "
                       "aggregate not shown (rerun `nvidia-smi -q -d ECC` in full)")
    if gpu.remapped_rows_pending:
        failing.append(f"{name}: row remapping pending (needs a GPU reset)")
    if gpu.remapped_rows_failure:
        failing.append(f"{name}: row remapping failed")
    if gpu.retired_pages_pending:
        failing.append(f"{name}: page retirement pending (needs a GPU reset)")
    slow = [r for r in gpu.clocks_event_reasons_active or ()
            if r in _th_list(th, "clock_reasons_warn", str)]
    if slow:
        warning.append(f"{name}: clocks held down ({', '.join(slow)})")
    return failing, warning


def gpu_health(smi_q: NvidiaSmiQ | None, kernel_log: Dmesg | None,
               th: Mapping[str, Any]) -> Verdict:
    """Xids, uncorrectable ECC, row remaps, retired pages and fatal PCIe AER errors: fail; clock
    slowdowns, corrected / non-fatal AER errors and ECC counts of unknown scope: warn."""
    if smi_q is None and kernel_log is None:
        return skip("neither nvidia-smi -q nor the kernel log was read")
    fail_codes = set(_th_list(th, "xid_fail", int))
    failing, warning = _xid_problems(kernel_log, fail_codes)
    lost = list(failing)          # the fatal Xids and GPUs off the bus, for the health job's act
    aer_fail, aer_warn = _aer_problems(kernel_log, set(_th_list(th, "aer_fail_levels", str)))
    failing += aer_fail
    warning += aer_warn
    gpu_failing: list[str] = []   # uncorrectable ECC, pending / failed remaps and retirements
    for gpu in smi_q.gpus if smi_q is not None else ():
        f, w = _gpu_problems(gpu, th)
        gpu_failing += f
        warning += w
    failing += gpu_failing
    if failing:
        return fail("; ".join(failing[:_MAX_LISTED * 2]) + (" ..." if len(failing) > 8 else ""),
                    "drain the node; reset the GPU (`nvidia-smi -r -i <n>`, no process on it) or "
                    "reboot to apply pending remaps and clear a fallen-off GPU; a remap failure, "
                    "repeated uncorrectable ECC or Xid 79 after a reboot means RMA (check power, "
                    "cooling and seating first)",
                    data={"fail": failing, "warn": warning, "xids": _failing_xids(kernel_log,
                                                                              fail_codes, lost),
                          "gpu_fail": gpu_failing})
    if warning:
        return warn("; ".join(warning[:_MAX_LISTED * 2]),
                    "HW slowdown / power brake: check cooling, PSUs and the BMC's power capping "
                    "(`nvidia-smi -q -d PERFORMANCE`); application Xids (13, 31, 43, 45) point "
                    "at the workload, not the GPU",
                    data={"warn": warning})
    return ok("no Xid, PCIe AER error, uncorrectable ECC error, pending remap or clock slowdown")


# ---------------------------------------------------------------- PCIe link


def pcie_link(smi_q: NvidiaSmiQ | None, th: Mapping[str, Any]) -> Verdict:
    """A GPU's link trained below its maximum width, or below its generation under load: warn.

    GPUs drop the link generation at idle to save power, so a lower generation only counts in
    the performance states listed in `pcie_gen_check_pstates` (P0: busy).
    """
    busy = set(_th_list(th, "pcie_gen_check_pstates", str))
    gpus = [g for g in (smi_q.gpus if smi_q is not None else ())
            if g.pcie_width_max is not None or g.pcie_gen_max is not None]
    if not gpus:
        return skip("no PCIe link information (nvidia-smi -q PCI section not shown)")
    slow: list[str] = []
    idle: list[str] = []
    for g in gpus:
        width, width_max = g.pcie_width_current, g.pcie_width_max
        gen, gen_max = g.pcie_gen_current, g.pcie_gen_max
        if width is not None and width_max is not None and width < width_max:
            slow.append(f"{_gpu_name(g)} x{width} of x{width_max}")
        if gen is not None and gen_max is not None and gen < gen_max:
            if g.performance_state in busy:
                slow.append(f"{_gpu_name(g)} Gen{gen} of Gen{gen_max} under load")
            else:
                idle.append(_gpu_name(g))
    if slow:
        return warn(f"PCIe link below its maximum: {_listed(slow)}",
                    "reseat the GPU or riser, check the slot's BIOS setting (link width / "
                    "generation) and `lspci -vv` LnkSta against LnkCap; a x8 or Gen1 link halves "
                    "or worse host-device and GPUDirect bandwidth")
    note = f" ({_listed(idle)} at a lower generation while idle: rerun under load)" if idle else ""
    return ok(f"{len(gpus)} GPU(s) at full PCIe width{note}")


# ---------------------------------------------------------------- persistence


def persistence(gpus: Iterable[SmiGpu], th: Mapping[str, Any]) -> Verdict:
    """Persistence mode off on any GPU: warn (each CUDA start re-initialises the GPU)."""
    del th   # no threshold: on or off
    gpus = list(gpus)
    known = [g for g in gpus if g.persistence_mode_enabled is not None]
    if not known:
        return skip("persistence mode not shown (Windows, or not in the output)")
    off = [_gpu_name(g) for g in known if g.persistence_mode_enabled is False]
    if off:
        return warn(f"persistence mode off on {len(off)} of {len(known)} GPU(s) ({_listed(off)})",
                    "`sudo nvidia-smi -pm 1` now; to keep it across reboots "
                    "`sudo systemctl enable --now nvidia-persistenced`")
    return ok(f"persistence mode on for all {len(known)} GPU(s)")


# ---------------------------------------------------------------- NIC locality


def nic_locality(topo: NvidiaSmiTopo, th: Mapping[str, Any],
                 rdma_nics: Iterable[str] | None = None) -> Verdict:
    """A GPU whose nearest RDMA NIC is across the CPU socket (SYS): warn.

    `rdma_nics`: names of the RDMA devices (mlx5_0 ...; NIC legend names or old-style column
    names); None: every NIC column counts. Facts: per GPU, the RDMA NICs nearest first (an
    NCCL_IB_HCA order), and the relation to the nearest.
    """
    warn_at = set(_th_list(th, "nic_locality_warn", str))
    legend = topo.nic_legend
    wanted = set(rdma_nics) if rdma_nics is not None else None
    order: dict[str, list[str]] = {}
    nearest: dict[str, str] = {}
    for gpu, cells in topo.gpu_nic_paths.items():
        ranked = []
        for column, relation in cells.items():
            name = legend.get(column, column)
            if relation in _NIC_RANK and (wanted is None or name in wanted):
                ranked.append((_NIC_RANK[relation], name, relation))
        if ranked:
            ranked.sort(key=lambda r: r[0])
            order[gpu] = [name for _, name, _ in ranked]
            nearest[gpu] = "SYS" if ranked[0][2] == "SOC" else ranked[0][2]
    facts = NodeFactsSummary.of(nccl_ib_hca_order={g: tuple(o) for g, o in order.items()},
                                nearest_nic_relation=nearest)
    if not order:
        return skip("no RDMA NIC in the topology matrix", facts=facts)
    far = [f"{gpu} ({nearest[gpu]})" for gpu in order if nearest[gpu] in warn_at]
    if far:
        return warn(f"{len(far)} GPU(s) reach their nearest RDMA NIC only across the CPU "
                    f"socket: {_listed(far)}; GPUDirect RDMA cannot help them",
                    "put a NIC on each GPU's PCIe switch or socket, or accept the host-memory "
                    "path; set NCCL_IB_HCA per GPU from the facts' nccl_ib_hca_order",
                    facts=facts)
    return ok(f"every GPU has an RDMA NIC on its side of the socket "
              f"({', '.join(sorted(set(nearest.values())))})", facts=facts)



# ---------------------------------------------------------------- interface


def iface(ip_addr: IpAddr, ifname: str, node_ip: str | None) -> Verdict:
    """The configured NCCL/Gloo interface exists, is up and carries node_ip, a private address.

    Facts: the interface's MTU (cross.mtu_consistency compares it across nodes).
    """
    found = next((i for i in ip_addr.interfaces if i.name == ifname), None)
    fix = (f"set nccl_socket_ifname / gloo_socket_ifname to the interface that carries the "
           f"node's address (`ip -br addr`), or bring {ifname} up (`ip link set {ifname} up`)")
    if found is None:
        names = ", ".join([i.name for i in ip_addr.interfaces][:32])
        return fail(f"interface {ifname} does not exist (have: {names or 'none'})", fix)
    facts = NodeFactsSummary.of(mtu=found.mtu)
    if found.state not in ("UP", "UNKNOWN"):
        return fail(f"interface {ifname} is {found.state or 'not up'}", fix, facts=facts)
    addresses = [a.split("/", 1)[0] for a in found.ipv4]
    if node_ip is not None and node_ip not in addresses:
        return fail(f"interface {ifname} does not carry node_ip {node_ip} "
                    f"(it has {', '.join(addresses) or 'no IPv4 address'})", fix, facts=facts)
    if node_ip is not None:
        try:
            private = ipaddress.IPv4Address(node_ip).is_private
        except ValueError:
            return fail(f"node_ip {node_ip!r} is not an IPv4 address", fix, facts=facts)
        if not private:
            return warn(f"node_ip {node_ip} on {ifname} is a public address: Ray and NCCL "
                        f"ports would be reachable from outside",
                        "use the node's private (cluster network) address as node_ip",
                        facts=facts)
    return ok(f"{ifname} is up with {', '.join(addresses) or 'no IPv4'}"
              + (f", MTU {found.mtu}" if found.mtu else ""),
              facts=facts)
