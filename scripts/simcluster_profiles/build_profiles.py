#!/usr/bin/env python3
"""Regenerate the simcluster node profiles from real captured command outputs.

Every output file a simulated node prints is a capture from ../shared/fixtures/node, or is
derived from one by named, minimal edits. The source and every edit of each file are written
into the profile's profile.yaml, so a reader can see exactly what is real and what was changed.
The generated files are committed; this script is only needed to change them.

    .venv/bin/python scripts/simcluster_profiles/build_profiles.py [--fixtures DIR]

(needs PyYAML to read the fixtures' LABELS.yaml; scripts/simcluster itself is stdlib only).
Values that no capture shows (bus ids of GPUs the author elided, temperatures of the extra GPUs,
compute capability, ...) are listed as edits with the words "chosen" or "not captured".
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_FIXTURES = REPO.parent / "shared" / "fixtures"


# ----------------------------------------------------------------------------- captures

class Captures:
    """The real captures and their labelled sources."""

    def __init__(self, root: Path):
        self.root = root
        labels = yaml.safe_load((root / "LABELS.yaml").read_text())
        self.sources = {s["file"]: s["source"] for s in labels.get("node_samples", [])}

    def text(self, rel: str) -> str:
        return (self.root / "node" / rel).read_text()

    def cite(self, rel: str) -> str:
        return f"fixtures node/{rel} ({self.sources['node/' + rel]})"


@dataclass
class Output:
    """One file a node prints, with where it came from and what was changed."""

    text: str
    sources: list[str]
    edits: list[str] = field(default_factory=list)
    exit_code: int = 0          # the tool's exit status with this output (systemctl status: 3 failed, 4 absent)

    def replace(self, old: str, new: str, why: str, count: int = 1) -> "Output":
        found = self.text.count(old)
        if found != count:
            raise SystemExit(f"edit {why!r}: expected {count} x {old!r}, found {found}")
        self.text = self.text.replace(old, new)
        self.edits.append(why)
        return self

    def drop_lines(self, pred, why: str, expect: int | None = None) -> "Output":
        lines = self.text.splitlines(keepends=True)
        kept = [ln for ln in lines if not pred(ln.rstrip("\n"))]
        dropped = len(lines) - len(kept)
        if dropped == 0 or (expect is not None and dropped != expect):
            raise SystemExit(f"edit {why!r}: dropped {dropped} lines")
        self.text = "".join(kept)
        self.edits.append(why)
        return self


def verbatim(cap: Captures, rel: str) -> Output:
    return Output(cap.text(rel), [cap.cite(rel)])


def without_prompt(cap: Captures, rel: str, prompt_prefix: str) -> Output:
    """A capture whose first line is the poster's shell prompt/command, which the tool never prints."""
    out = verbatim(cap, rel)
    first, rest = out.text.split("\n", 1)
    if not first.startswith(prompt_prefix):
        raise SystemExit(f"{rel}: first line {first!r} is not the expected prompt {prompt_prefix!r}")
    out.text = rest
    out.edits.append(f"first line {first.strip()!r} (the poster's prompt and command) removed")
    return out


# ----------------------------------------------------------------------------- GPU facts

@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    bus_id: str
    uuid: str
    vbios: str
    temp_c: int
    power_w: int
    power_cap_w: int
    mem_used_mib: int
    mem_total_mib: int
    mem_reserved_mib: int
    perf: str
    mig: str
    compute_cap: str
    max_sm_mhz: int
    util_pct: int = 0
    fan: str = "N/A"
    persistence: str = "On"
    disp: str = "Off"
    ecc: str = "0"
    compute_mode: str = "Default"
    pcie_gen: int = 5               # PCIe generation (max = current: H100 SXM5 is Gen5 x16)
    pcie_width_max: int = 16
    pcie_width: int = 16            # current link width
    remap_pending: bool = False     # Remapped Rows as in the pending-remap capture
    fabric: str | None = "completed"  # "completed" | "in_progress" | None (no NVSwitch: N/A)


def uuids_from_capture(cap: Captures) -> list[str]:
    text = cap.text("nvidia-smi-q/003-uuid-list-8gpu.txt")
    return re.findall(r"GPU UUID\s+: (GPU-[0-9a-f-]+)", text)


H100 = "NVIDIA H100 80GB HBM3"
L40S = "NVIDIA L40S"
H100_BUS = ["00000000:04:00.0", "00000000:05:00.0", "00000000:0A:00.0", "00000000:0B:00.0",
            "00000000:84:00.0", "00000000:85:00.0", "00000000:8A:00.0", "00000000:8B:00.0"]
L40S_BUS = ["00000000:4A:00.0", "00000000:61:00.0", "00000000:CA:00.0", "00000000:E1:00.0"]
H100_TEMPS = [32, 30, 31, 33, 30, 29, 31, 32]
H100_POWER = [69, 70, 68, 71, 69, 70, 68, 70]
L40S_TEMPS = [36, 35, 37, 36]
L40S_POWER = [33, 34, 32, 35]

H100_FACT_EDITS = [
    "GPU model name 'NVIDIA H100 80GB HBM3' and vbios 96.00.89.00.01 from fixtures "
    "node/nvidia-smi-query/001-h100-name-busid-vbios-elided.txt",
    "bus ids 00000000:04:00.0 (first) and 00000000:8B:00.0 (last) from that capture; the six "
    "the author elided are chosen: 05, 0A, 0B, 84, 85, 8A",
    "GPU UUIDs from fixtures node/nvidia-smi-q/003-uuid-list-8gpu.txt, in order",
    "memory 81559 MiB and power cap 700 W: what nvidia-smi reports for an H100 80GB HBM3 SXM "
    "(not in the fixtures); temperatures 29-33 C, idle power 68-71 W, 0 MiB used and 454 MiB "
    "reserved (-q) chosen",
]
L40S_FACT_EDITS = [
    "GPU model name 'NVIDIA L40S', memory 46068 MiB, power cap 350 W: what nvidia-smi reports "
    "for an L40S (not in the fixtures); bus ids 4A, 61, CA, E1, vbios 95.02.66.00.02, 509 MiB reserved "
    "(-q), temperatures and idle power chosen",
    "GPU UUIDs: the last four of fixtures node/nvidia-smi-q/003-uuid-list-8gpu.txt (L40S UUIDs "
    "are not captured)",
]


def h100_gpus(cap: Captures, count: int = 8) -> list[Gpu]:
    uuids = uuids_from_capture(cap)
    return [Gpu(i, H100, H100_BUS[i], uuids[i], "96.00.89.00.01", H100_TEMPS[i], H100_POWER[i], 700,
                0, 81559, 454, "P0", "Disabled", "9.0", 1980) for i in range(count)]


def l40s_gpus(cap: Captures) -> list[Gpu]:
    uuids = uuids_from_capture(cap)[4:]
    return [Gpu(i, L40S, L40S_BUS[i], uuids[i], "95.02.66.00.02", L40S_TEMPS[i], L40S_POWER[i], 350,
                0, 46068, 509, "P8", "N/A", "8.9", 2520, pcie_gen=4, fabric=None) for i in range(4)]


# ----------------------------------------------------------------------------- nvidia-smi table

def table_rows(g: Gpu) -> list[str]:
    """The three lines nvidia-smi (R550+) prints for one GPU; widths measured on the captures."""
    return [
        f"|{g.index:>4}  {g.name:<31}{g.persistence:<4}|{g.bus_id:>19} {g.disp:<3} |{g.ecc:>21} |",
        f"| {g.fan:>3}  {str(g.temp_c) + 'C':>4}    {g.perf:>2}{str(g.power_w) + 'W':>16} / "
        f"{str(g.power_cap_w) + 'W':>5} |{str(g.mem_used_mib) + 'MiB':>11} / {str(g.mem_total_mib) + 'MiB':>9} |"
        f"{str(g.util_pct) + '%':>8}{g.compute_mode:>13} |",
        f"|{'':41}|{'':24}|{g.mig:>21} |",
    ]


def check_row_layout(cap: Captures) -> None:
    """table_rows() must reproduce captured rows exactly, or the layout guess is wrong."""
    l4 = Gpu(0, "NVIDIA L4", "00000000:31:00.0", "", "", 36, 16, 72, 0, 23034, 0, "P8", "N/A", "", 0)
    a100 = Gpu(0, "NVIDIA A100 80GB PCIe", "00000000:01:00.0", "", "", 32, 69, 300, 437, 81920, 0, "P0",
               "Disabled", "", 0, util_pct=100, persistence="Off")
    sxm = Gpu(1, "NVIDIA A100-SXM4-40GB", "00000000:10:1D.0", "", "", 37, 66, 400, 602, 40960, 0, "P0",
              "Disabled", "", 0, util_pct=7, compute_mode="E. Process")
    b200 = Gpu(1, "NVIDIA B200", "00000000:68:00.0", "", "", 30, 142, 1000, 0, 183359, 0, "P0", "Disabled", "", 0)
    for g, rel in ((l4, "nvidia-smi/007-l4-570-single-gpu.txt"),
                   (a100, "nvidia-smi/001-a100-80gb-pcie-550-partial.txt"),
                   (sxm, "nvidia-smi/003-a100-sxm4-40gb-580-exclusive-process.txt"),
                   (b200, "nvidia-smi/005-b200-610-kmd-umd-header.txt")):
        lines = cap.text(rel).splitlines()
        rows = table_rows(g)
        at = lines.index(rows[0]) if rows[0] in lines else -1
        if at < 0 or lines[at:at + 3] != rows:
            raise SystemExit(f"table layout does not reproduce {rel}:\n" + "\n".join(rows))


def nvidia_smi_table(cap: Captures, gpus: list[Gpu], header_from: str | None = None) -> Output:
    """The default nvidia-smi table, built on the layout of the 570 L4 capture."""
    l4_rel = "nvidia-smi/007-l4-570-single-gpu.txt"
    l4 = cap.text(l4_rel).splitlines()
    sep = l4[11]
    assert sep.startswith("+---") and l4[8].startswith("|   0  NVIDIA L4")
    sources = [cap.cite(l4_rel)]
    edits = []
    head = l4[:8]
    if header_from:
        other = [ln for ln in cap.text(header_from).splitlines()]
        start = next(i for i, ln in enumerate(other) if ln.startswith("| NVIDIA-SMI"))
        head = [other[start - 2], other[start - 1], other[start], other[start + 1]] + l4[4:8]
        sources.append(cap.cite(header_from))
        edits.append(f"timestamp, banner and the line under it (driver, CUDA version) from {header_from}")
    body = []
    for g in gpus:
        body += table_rows(g) + [sep]
    footer = l4[12:15] + [
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|=========================================================================================|",
        "|  No running processes found                                                             |",
        "+-----------------------------------------------------------------------------------------+",
    ]
    edits += [
        f"one GPU block per GPU in the capture's row layout ({len(gpus)} GPUs; rows re-rendered and "
        "checked to reproduce the captured L4, A100, A100-SXM4 and B200 rows byte for byte)",
        "Processes box completed after its captured first line 'Processes:' in nvidia-smi 570's "
        "layout (column header, rule, 'No running processes found', closing border)",
    ]
    return Output("\n".join(head + body + footer) + "\n", sources, edits)


def _section(text: str, title: str, last_key: str) -> list[str]:
    """The lines of a captured -q section: its title line through the first line with last_key."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip() == title)
    stop = next(i for i in range(at + 1, len(lines)) if lines[i].strip().startswith(last_key))
    return lines[at:stop + 1]


class QSections:
    """The per-GPU health sections of `nvidia-smi -q`, cut from the captures (see edits())."""

    Q1 = "nvidia-smi-q/001-a100-sxm4-ecc-remapped-rows-pending.txt"
    Q6 = "nvidia-smi-q/006-rtx-pro-6000-580-cuda-not-found-d-memory-performance.txt"
    FABRIC_OK = "nvidia-smi-q/h2-005-dra626-nvsmi-q-fabric-completed-health-unhealthy.txt"
    FABRIC_WAIT = "nvidia-smi-q/h2-007-gpuoperator2511-fabric-in-progress.txt"

    def __init__(self, cap: Captures):
        q1, q6 = cap.text(self.Q1), cap.text(self.Q6)
        self.clocks = _section(q6, "Clocks Event Reasons", "Display Clock Setting")
        assert len(self.clocks) == 10 and all(ln.endswith(": Not Active") for ln in self.clocks[1:])
        ecc = _section(q1, "ECC Errors", "Aggregate")
        ecc += _section(q1, "Aggregate", "DRAM Uncorrectable")[1:]
        assert sum("177" in ln for ln in ecc) == 2
        self.ecc = [ln.replace(": 177", ": 0") for ln in ecc]
        self.retired = _section(q1, "Retired Pages", "Pending Page Blacklist")
        self.remap_pending = _section(q1, "Remapped Rows", "None")
        assert self.remap_pending[3].endswith("Pending                           : Yes")
        undo = {"        Correctable Error                 : 1": "        Correctable Error                 : 0",
                "        Pending                           : Yes": "        Pending                           : No",
                "            Max                           : 639 bank(s)": "            Max                           : 640 bank(s)",
                "            High                          : 1 bank(s)": "            High                          : 0 bank(s)"}
        healthy = [undo.get(ln, ln) for ln in self.remap_pending]
        self.remap_ok = healthy
        assert [ln for ln in healthy if ln not in self.remap_pending] == [
            "        Correctable Error                 : 0", "        Pending                           : No",
            "            Max                           : 640 bank(s)", "            High                          : 0 bank(s)"]
        fab = [ln for ln in cap.text(self.FABRIC_OK).splitlines() if ln.startswith("    ")]
        assert fab[0] == "    Fabric" and fab[-1].strip().startswith("Bandwidth")
        self.fabric_ok = [ln.replace(": Unhealthy", ": Healthy").replace(": 2", ": 0")
                          .replace("dc6e40c4-d722-4357-9ba6-5291dd461278", "00000000-0000-0000-0000-000000000000")
                          for ln in fab]
        wait = {}
        for ln in cap.text(self.FABRIC_WAIT).splitlines():
            key, sep, value = ln.partition(":")
            if sep:
                wait[key.strip()] = value.strip()
        assert wait["State"] == "In Progress" and wait["Status"] == "N/A"
        self.fabric_wait = [ln if ":" not in ln else ln.split(":", 1)[0] + ": " + wait[ln.split(":", 1)[0].strip()]
                            for ln in fab]

    def edits(self, gpus: list[Gpu]) -> list[str]:
        out = [
            f"Clocks Event Reasons (all 'Not Active') verbatim from {self.Q6}",
            f"ECC Errors (Volatile, Aggregate; SRAM/DRAM Correctable/Uncorrectable) and Retired Pages "
            f"(N/A: row remapping replaces page retirement on A100/H100) from {self.Q1}; DRAM Correctable "
            "177 -> 0 (a clean GPU)",
        ]
        if any(not g.remap_pending for g in gpus):
            out.append(f"Remapped Rows from {self.Q1} with that GPU's pending remap undone: Correctable Error "
                       "1 -> 0, Pending Yes -> No, histogram Max 639 -> 640 bank(s), High 1 -> 0")
        if any(g.remap_pending for g in gpus):
            out.append(f"Remapped Rows of {', '.join(g.bus_id for g in gpus if g.remap_pending)} verbatim from "
                       f"{self.Q1} (Correctable Error 1, Pending: Yes, a remap waiting for a GPU reset)")
        if any(g.pcie_width_max or g.pcie_gen for g in gpus):
            out.append("PCI > GPU Link Info (PCIe Generation Max/Current/Device Current/Device Max/Host Max, "
                       "Link Width Max/Current) in nvidia-smi -q's layout (not in the fixtures): "
                       + "; ".join(sorted({f"Gen{g.pcie_gen} x{g.pcie_width} of x{g.pcie_width_max}" for g in gpus})))
        if any(g.fabric == "completed" for g in gpus):
            out.append(f"Fabric section from {self.FABRIC_OK} (its key layout; printed after Max Clocks, near the "
                       "end of each GPU as nvidia-smi does): Health Summary Unhealthy -> Healthy; CliqueId 2 -> 0 "
                       "and ClusterUUID -> 00000000-0000-0000-0000-000000000000 (one NVSwitch node, no "
                       "multi-node NVLink clique)")
        if any(g.fabric == "in_progress" for g in gpus):
            out.append(f"Fabric values State 'In Progress', Status/CliqueId/ClusterUUID/Summary/Bandwidth 'N/A' "
                       f"from {self.FABRIC_WAIT} (a node whose fabric manager did not finish), in the "
                       f"key layout of {self.FABRIC_OK}; that capture's five further 580 Health keys not printed")
        if any(g.fabric is None for g in gpus):
            out.append("no Fabric section (no NVSwitch)")
        return out


def nvidia_smi_q(cap: Captures, gpus: list[Gpu], driver: str, cuda: str) -> Output:
    """A reduced `nvidia-smi -q`: the header and, per GPU, the sections the toolkit reads."""
    def kv(indent: int, key: str, value: str) -> str:
        return " " * indent + f"{key:<{42 - indent}}: {value}"

    sec = QSections(cap)
    lines = ["", "==============NVSMI LOG==============", "",
             kv(0, "Timestamp", "Wed Jun  7 19:32:16 2023"),
             kv(0, "Driver Version", driver), kv(0, "CUDA Version", cuda), "",
             kv(0, "Attached GPUs", str(len(gpus)))]
    for g in gpus:
        gen = str(g.pcie_gen)
        lines += [f"GPU {g.bus_id}",
                  kv(4, "Product Name", g.name),
                  kv(4, "Persistence Mode", "Enabled" if g.persistence == "On" else "Disabled"),
                  kv(4, "GPU UUID", g.uuid),
                  kv(4, "Minor Number", str(g.index)),
                  kv(4, "VBIOS Version", g.vbios),
                  "    PCI",
                  kv(8, "Bus Id", g.bus_id),
                  "        GPU Link Info",
                  "            PCIe Generation",
                  kv(16, "Max", gen), kv(16, "Current", gen), kv(16, "Device Current", gen),
                  kv(16, "Device Max", gen), kv(16, "Host Max", gen),
                  "            Link Width",
                  kv(16, "Max", f"{g.pcie_width_max}x"), kv(16, "Current", f"{g.pcie_width}x"),
                  kv(4, "Performance State", g.perf),
                  *sec.clocks,
                  "    FB Memory Usage",
                  kv(8, "Total", f"{g.mem_total_mib} MiB"),
                  kv(8, "Reserved", f"{g.mem_reserved_mib} MiB"),
                  kv(8, "Used", f"{g.mem_used_mib} MiB"),
                  kv(8, "Free", f"{g.mem_total_mib - g.mem_reserved_mib - g.mem_used_mib} MiB"),
                  kv(4, "Compute Mode", g.compute_mode),
                  *sec.ecc,
                  *sec.retired,
                  *(sec.remap_pending if g.remap_pending else sec.remap_ok),
                  "    Max Clocks",
                  kv(8, "SM", f"{g.max_sm_mhz} MHz"),
                  *({"completed": sec.fabric_ok, "in_progress": sec.fabric_wait}.get(g.fabric, [])),
                  ""]
    q1, q6 = QSections.Q1, QSections.Q6
    return Output("\n".join(lines) + "\n", [cap.cite(q6), cap.cite(q1)] + [
        cap.cite(f) for f, used in ((QSections.FABRIC_OK, any(g.fabric for g in gpus)),
                                    (QSections.FABRIC_WAIT, any(g.fabric == "in_progress" for g in gpus))) if used], [
        f"header layout (NVSMI LOG banner, Driver/CUDA Version, Attached GPUs) from {q6}; "
        f"timestamp from {q1}; driver {driver} and CUDA {cuda} set",
        "reduced: per GPU only Product Name, Persistence Mode, GPU UUID, Minor Number, VBIOS Version, "
        "PCI (Bus Id, GPU Link Info), Performance State, Clocks Event Reasons, FB Memory Usage, Compute Mode, "
        "ECC Errors, Retired Pages, Remapped Rows, Max Clocks SM and Fabric, in nvidia-smi -q's order and "
        "key: value layout (key column 42 wide, as in the captures); a real -q prints ~150 more lines per GPU",
        "FB Memory Usage section and the Reserved/Free values follow nvidia-smi -q (not in the fixtures)",
        *sec.edits(gpus),
    ])


QUERY_FIELDS = ["index", "name", "uuid", "pci.bus_id", "driver_version", "memory.total [MiB]",
                "memory.used [MiB]", "compute_cap", "clocks.max.sm [MHz]", "temperature.gpu",
                "utilization.gpu [%]", "vbios_version", "pstate", "persistence_mode"]


def query_table(cap: Captures, gpus: list[Gpu], driver: str) -> Output:
    """The GPU table behind `nvidia-smi --query-gpu=...`, itself in --format=csv form."""
    rows = [", ".join(QUERY_FIELDS)]
    for g in gpus:
        rows.append(", ".join([str(g.index), g.name, g.uuid, g.bus_id, driver, f"{g.mem_total_mib} MiB",
                               f"{g.mem_used_mib} MiB", g.compute_cap, f"{g.max_sm_mhz} MHz", str(g.temp_c),
                               f"{g.util_pct} %", g.vbios, g.perf,
                               "Enabled" if g.persistence == "On" else "Disabled"]))
    q1 = "nvidia-smi-query/001-h100-name-busid-vbios-elided.txt"
    q3 = "nvidia-smi-query/003-loop-index-temp-util-power-clocks.txt"
    return Output("\n".join(rows) + "\n", [cap.cite(q1), cap.cite(q3)], [
        "the output of `nvidia-smi --query-gpu=<all fields above> --format=csv` for this node: header "
        f"names with [unit] and values with units as in {q1} and {q3}; scripts/simcluster renders any "
        "requested subset, noheader and nounits from it",
        "values are the same GPUs as nvidia-smi.txt; compute_cap and clocks.max.sm are the GPU model's "
        "(not captured)",
    ])


def nvlink_errors(cap: Captures, gpus: list[Gpu], links: int = 18) -> Output:
    rel = "nvidia-smi-nvlink/001-nvlink-error-counters-h100.txt"
    out = []
    for g in gpus:
        out.append(f"GPU {g.index}: {g.name} (UUID: {g.uuid})")
        for link in range(links):
            if link:
                out.append("")
            out += [f"         Link {link}: Replay Errors: 0", f"         Link {link}: Recovery Errors: 0",
                    f"         Link {link}: CRC Errors: 0"]
    return Output("\n".join(out) + "\n", [cap.cite(rel)], [
        "the captured GPU 0 block ('$ nvidia-smi nvlink -e' prompt dropped) expanded to all "
        f"{links} links (the author elided 2-16 with '[...]') and repeated for every GPU with its UUID "
        "(the capture's UUID was anonymised by its author)",
    ])


TOPO_NIC_REL = "nvidia-smi-topo/001-h100-8gpu-nv18-9nic-tabs.txt"
LEGEND_REL = "nvidia-smi-topo/013-2x-rtx5090-phb-tabs-consumer.txt"
# NIC0..NIC7 of the matrix after its all-SYS NIC0 is dropped: the profile's eight HCAs, by name
TOPO_NICS = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]  # = H100_IB


def topo_h100_nics(cap: Captures, gpu_count: int = 8, all_sys: bool = False) -> Output:
    """8x H100 NV18 with one PIX InfiniBand NIC per GPU, from the 9-NIC capture."""
    out = verbatim(cap, TOPO_NIC_REL)
    lines = out.text.splitlines()
    head = lines[0].split("\t")
    assert head[1:18] == [f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(9)], head
    cell = {}                        # (row, column) -> relation
    tails = {}                       # GPU row -> the affinity cells, as printed
    for ln in lines[1:]:
        parts = ln.split("\t")
        for col, value in zip(head[1:18], parts[1:18]):
            cell[(parts[0], col)] = value
        if parts[0].startswith("GPU"):
            tails[parts[0]] = parts[18:]
    rows = {r for r, _ in cell}
    assert rows == {f"GPU{i}" for i in range(8)} | {f"NIC{i}" for i in range(6)}, rows
    assert all(cell[(f"GPU{g}", "NIC0")] == "SYS" for g in range(8))
    nics = [f"NIC{i}" for i in range(1, 9)]
    for n in ("NIC6", "NIC7", "NIC8"):   # rows cut in the capture: the matrix is symmetric
        for c in head[1:18]:
            cell[(n, c)] = " X " if c == n else cell.get((c, n)) or "NODE"
    assert all(cell[(a, b)] == cell[(b, a)].replace(" X ", " X ") for a in nics for b in nics)
    gpus = [f"GPU{i}" for i in range(gpu_count)]
    rename = {old: f"NIC{i}" for i, old in enumerate(nics)}
    edits = [
        "NIC0 column and row removed: the capture's NIC0 is SYS to every GPU (a front-end or storage NIC, not "
        "one of the profile's InfiniBand HCAs); NIC1..NIC8 renumbered NIC0..NIC7",
        "rows of NIC6..NIC8 (cut in the capture) completed from the matrix's symmetry (their GPU and NIC1-5 "
        "cells); NIC6-NIC8 among themselves NODE, as NIC5 (same socket) is to them",
        f"the Legend block nvidia-smi prints under the matrix appended verbatim from {LEGEND_REL} (the capture "
        "stops at the matrix), then nvidia-smi's 'NIC Legend:' block (not captured) naming NIC0..NIC7 after "
        f"the profile's HCAs in mlx5 number order ({', '.join(TOPO_NICS)}); GPU-NIC relations as captured",
    ]
    if all_sys:
        for g in gpus:
            for n in nics:
                cell[(g, n)] = cell[(n, g)] = "SYS"
        edits.append("every GPU-NIC cell (both the GPU rows and the NIC rows) set to SYS, as the capture's NIC0 "
                     "is to every GPU: no GPU has an HCA on its side of the CPU socket")
    if gpu_count != 8:
        edits.append(f"{gpu_count}-GPU variant: GPU{gpu_count}..GPU7 rows and columns removed")
    cols = gpus + nics
    text = ["\t".join([""] + gpus + [rename[n] for n in nics] + head[18:])]
    for g in gpus:
        text.append("\t".join([g] + [cell[(g, c)] for c in cols] + tails[g]))
    for n in nics:
        text.append("\t".join([rename[n]] + [cell[(n, c)] for c in cols]))
    legend = cap.text(LEGEND_REL).split("\nLegend:", 1)[1]
    nic_legend = "\nNIC Legend:\n\n" + "".join(f"  NIC{i}: {ca}\n" for i, ca in enumerate(TOPO_NICS))
    out.text = "\n".join(text) + "\n\nLegend:" + legend + nic_legend
    out.sources.append(cap.cite(LEGEND_REL))
    out.edits += edits
    return out


def topo_4x_h100(cap: Captures) -> Output:
    rel = "nvidia-smi-topo/011-4x-h100-nv6-4nic-pix-with-nic-rows.txt"
    out = verbatim(cap, rel)
    legend = cap.text("nvidia-smi-topo/013-2x-rtx5090-phb-tabs-consumer.txt")
    tail = legend[legend.index("  PXB  ="):]
    out.text = out.text + tail
    out.sources.append(cap.cite("nvidia-smi-topo/013-2x-rtx5090-phb-tabs-consumer.txt"))
    out.edits.append("Legend completed after its captured PHB line with the PXB, PIX and NV# lines from "
                     "node/nvidia-smi-topo/013; the NIC Legend (NIC0.. names) is not captured and not added")
    return out


def topo_4x_pcie(cap: Captures) -> Output:
    rel = "nvidia-smi-topo/013-2x-rtx5090-phb-tabs-consumer.txt"
    out = verbatim(cap, rel)
    lines = out.text.splitlines()
    assert lines[0] == "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"
    matrix = ["\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for i in range(4):
        cells = [" X " if i == j else "PHB" for j in range(4)]
        matrix.append(f"GPU{i}\t" + "\t".join(cells) + "\t0-63\t0\t\tN/A")
    out.text = "\n".join(matrix + lines[3:]) + "\n"
    out.edits.append("4-GPU variant: GPU2 and GPU3 rows and columns added with the capture's PHB relation "
                     "(no NVLink), CPU/NUMA affinity as captured")
    return out


# ----------------------------------------------------------------------------- InfiniBand

# The H100 node of fixtures node/ibdev2netdev/001: eight ConnectX-7 InfiniBand ports.
H100_IB = [("mlx5_0", "ibp26s0"), ("mlx5_10", "ibp204s0"), ("mlx5_11", "ibp220s0"), ("mlx5_3", "ibp60s0"),
           ("mlx5_4", "ibp77s0"), ("mlx5_5", "ibp94s0"), ("mlx5_6", "ibp156s0"), ("mlx5_9", "ibp188s0")]
PORT_DOWN_CA = "mlx5_5"
assert sorted(TOPO_NICS) == sorted(ca for ca, _ in H100_IB)


def _guid(ca: str) -> int:
    return 0x58a2e10300dae600 + int(ca.split("_")[1])


def ibstat(cap: Captures, down: str | None = None) -> Output:
    rel = "ibstat/001-cx7-roce-200g-active-plus-cx6dx-down.txt"
    rel_ib = "ibstat/005-cx6-ib-200-linkup-but-state-down-no-sm.txt"
    text = cap.text(rel)
    block = text[text.index("CA 'mlx5_0'"):text.index("CA 'mlx5_1'")]
    ib_down = cap.text(rel_ib)
    assert "Capability mask: 0x2651ec48" in ib_down and "Base lid: 65535" in ib_down
    blocks = []
    for lid, (ca, _) in enumerate(sorted(H100_IB), start=11):
        guid = f"0x{_guid(ca):016x}"
        b = (block.replace("CA 'mlx5_0'", f"CA '{ca}'")
             .replace("Node GUID: 0x58a2e10300dae626", f"Node GUID: {guid}")
             .replace("System image GUID: 0x58a2e10300dae626", f"System image GUID: {guid}")
             .replace("Port GUID: 0x5aa2e1fffedae626", f"Port GUID: {guid}")
             .replace("Rate: 200", "Rate: 400")
             .replace("Capability mask: 0x00010000", "Capability mask: 0x2651ec48")
             .replace("Link layer: Ethernet", "Link layer: InfiniBand")
             .replace("SM lid: 0", "SM lid: 1"))
        if ca == down:
            b = (b.replace("State: Active", "State: Down")
                 .replace("Base lid: 0", "Base lid: 65535"))
        else:
            b = b.replace("Base lid: 0", f"Base lid: {lid}")
        blocks.append(b)
    edits = [
        "the first CA block (ConnectX-7 MT4129, firmware 28.39.1002, 'ibstat' prompt dropped) repeated for "
        "the eight InfiniBand CAs of the H100 node in node/ibdev2netdev/001 (mlx5_0, 3, 4, 5, 6, 9, 10, 11; "
        "sorted by name as ibstat lists them); its RoCE CAs are not modelled",
        "InfiniBand instead of RoCE: 'Rate: 200' -> 'Rate: 400' (NDR), 'Link layer: Ethernet' -> "
        "'InfiniBand', 'SM lid: 0' -> 'SM lid: 1' and 'Capability mask' 0x2651ec48 as in the InfiniBand "
        f"capture {rel_ib}; 'Base lid' 11-18 chosen (RoCE ports have none)",
        "Node/System image/Port GUID: the captured node GUID with its last byte set from the CA number "
        "(an InfiniBand port GUID equals the node GUID; the captured one was RoCE's MAC-derived GUID)",
    ]
    if down:
        edits.append(f"{down}: 'State: Active' -> 'State: Down' and 'Base lid' 65535 as in {rel_ib} "
                     "(a port the subnet manager has not brought up); Physical state LinkUp kept, as there")
    return Output("".join(blocks), [cap.cite(rel), cap.cite(rel_ib)], edits)


def ibv_devinfo(cap: Captures, down: str | None = None) -> Output:
    rel = "ibv_devinfo/001-cx6dx-port-down-ethernet-then-cx7.txt"
    rel_init = "ibv_devinfo/003-cx7-ib-port-init-pod-reformatted.txt"
    text = cap.text(rel)
    first = text[:text.index("\nhca_id: mlx5_13")]
    blocks = []
    for lid, (ca, _) in enumerate(sorted(H100_IB), start=11):
        g = f"{_guid(ca):016x}"
        guid = ":".join(g[i:i + 4] for i in range(0, 16, 4))
        active = ca != down
        b = (first.replace("hca_id: mlx5_12", f"hca_id: {ca}")
             .replace("22.38.1900", "28.39.1002")
             .replace("a088:c203:0030:9a0d", guid)
             .replace("a088:c203:0030:9a0c", guid)
             .replace("vendor_part_id:                 4125", "vendor_part_id:                 4129")
             .replace("MT_0000000436", "MT_0000000838")
             .replace("active_mtu:             1024 (3)", "active_mtu:             4096 (5)")
             .replace("sm_lid:                 0", "sm_lid:                 1")
             .replace("link_layer:             Ethernet", "link_layer:             InfiniBand"))
        if active:
            b = (b.replace("PORT_DOWN (1)", "PORT_ACTIVE (4)")
                 .replace("port_lid:               0", f"port_lid:               {lid}"))
        else:
            b = b.replace("port_lid:               0", "port_lid:               65535")
        blocks.append(b)
    edits = [
        "the first hca block's layout (whitespace as printed by ibv_devinfo) repeated for the same eight "
        "ConnectX-7 CAs as ibstat.txt, each block followed by a blank line as captured",
        "ConnectX-7 values from the capture's mlx5_13 block (vendor_part_id 4129, board_id MT_0000000838); "
        "fw_ver 28.39.1002 and GUIDs as in ibstat.txt",
        "InfiniBand port: link_layer InfiniBand, active_mtu 4096 (5) and sm_lid as in " + rel_init +
        "; state PORT_ACTIVE (4) (ibv_devinfo's name and number for an active port) and port_lid 11-18 "
        "matching ibstat.txt",
    ]
    if down:
        edits.append(f"{down}: state PORT_DOWN (1) kept from the capture, port_lid 65535 as ibstat.txt")
    return Output("".join(b + "\n" for b in blocks), [cap.cite(rel), cap.cite(rel_init)], edits)


def ibdev2netdev(cap: Captures, down: str | None = None) -> Output:
    rel = "ibdev2netdev/001-h100-8x-cx7-ib-plus-cx6-eth-annotated.txt"
    rel_plain = "ibdev2netdev/003-pod-single-vf-net1-down.txt"
    assert cap.text(rel_plain).splitlines()[1] == "mlx5_3 port 1 ==> net1 (Down)"
    text = cap.text(rel)
    for ca, netdev in H100_IB:
        assert re.search(rf"^{ca}\s+port\s+1\s+==>\s+{netdev}\s+\(Down\)", text, re.M), ca
    lines = [f"{ca} port 1 ==> {netdev} ({'Down' if ca == down else 'Up'})" for ca, netdev in H100_IB]
    edits = [
        "the poster's 'column -t' alignment and '# ...' annotations removed (the tool prints single "
        f"spaces, as in {rel_plain}); prompt line removed",
        "only the eight InfiniBand lines kept (mlx5_0, 10, 11, 3, 4, 5, 6, 9 in the captured order); the "
        "four ConnectX-6 Ethernet lines are not modelled",
        "IPoIB netdevs '(Down)' -> '(Up)': the poster notes their IB fabric worked without IPoIB "
        "configured; a healthy simulated node shows its netdevs up",
    ]
    if down:
        edits.append(f"{down} left '(Down)' (its port is down)")
    return Output("\n".join(lines) + "\n", [cap.cite(rel), cap.cite(rel_plain)], edits)


# ----------------------------------------------------------------------------- other tools

def lsmod(cap: Captures, peermem: bool) -> Output:
    rel = "lsmod/001-nvidia-peermem-loaded-gdrdrv.txt"
    out = without_prompt(cap, rel, "(base) [szymon.ozog@gh-3714u06 ~]$ lsmod | grep nvidia")
    out.text = "Module                  Size  Used by\n" + out.text
    out.edits.append("lsmod's header line 'Module                  Size  Used by' added (the capture was "
                     "piped through grep nvidia, so only those modules are listed)")
    if not peermem:
        out.drop_lines(lambda ln: ln.startswith("nvidia_peermem "), "nvidia_peermem line removed", expect=1)
        out.replace("nvidia              56598528  147 nvidia_uvm,nvidia_peermem,gdrdrv,nvidia_modeset",
                    "nvidia              56598528  146 nvidia_uvm,gdrdrv,nvidia_modeset",
                    "nvidia_peermem removed from nvidia's users (use count 147 -> 146)")
        out.replace("ib_core               442368  9 rdma_cm,ib_ipoib,nvidia_peermem,iw_cm,",
                    "ib_core               442368  8 rdma_cm,ib_ipoib,iw_cm,",
                    "nvidia_peermem removed from ib_core's users (use count 9 -> 8)")
    return out


def chronyc_tracking(cap: Captures, offset_off: bool = False) -> Output:
    rel = "chronyc-tracking/001-stratum3-synced-fast-0.26ms.txt"
    out = without_prompt(cap, rel, "root@server2:/var/log# chronyc tracking")
    if offset_off:
        out.replace("System time     : 0.000260112 seconds fast of NTP time",
                    "System time     : 7.800260112 seconds fast of NTP time",
                    "clock 7.8 s off: 'System time' 0.000260112 -> 7.800260112 seconds fast of NTP time; "
                    "'Leap status: Normal' kept (chrony reports Normal while it slews a large offset)")
    return out


def chronyc_sources(cap: Captures, verbose: bool, offset_off: bool = False) -> Output:
    rel = "chronyc-sources/001-aws-link-local-synced-verbose-plus-tracking.txt"
    out = verbatim(cap, rel)
    text = out.text
    body = text[text.index("210 Number of sources"):text.index("\n\n# chronyc tracking")] + "\n"
    out.text = body
    out.edits.append("the poster's '# chronyc sources -v' line and the appended 'chronyc tracking' "
                     "output removed")
    if not verbose:
        lines = out.text.splitlines()
        out.text = "\n".join([lines[0]] + lines[lines.index("") + 9:]) + "\n"
        assert out.text.splitlines()[1].startswith("MS Name/IP address"), out.text
        out.edits.append("`chronyc sources` without -v: the legend lines (blank line and the 8-line "
                         "'.-- Source mode' diagram) removed")
    if offset_off:
        out.replace("   -307ns[-3023ns]", "  -7800ms[-7800ms]",
                    "clock 7.8 s off: the selected source's last sample -307ns[-3023ns] -> -7800ms[-7800ms]")
    return out


def timedatectl_synced(cap: Captures) -> Output:
    rel = "timedatectl/005-ntp-active-not-synced-rtc-2017.txt"
    return verbatim(cap, rel).replace(
        "System clock synchronized: no", "System clock synchronized: yes",
        "'System clock synchronized: no' -> 'yes' (the capture's NTP service was active but not yet synced)")


def nvcc(cap: Captures) -> Output:
    return without_prompt(cap, "nvcc/005-cuda-12.5.txt", "nvcc --version")


def proc_driver_version(cap: Captures, driver: str) -> Output:
    rel = "proc-driver-nvidia-version/001-open-kernel-module-565.57.01.txt"
    return verbatim(cap, rel).replace("565.57.01", driver, f"driver version 565.57.01 -> {driver}")


# ----------------------------------------------------------------------------- node health

LSPCI_ACS_REL = "lspci/h2-001-rccl547-amd-starship-gpp-bridge-acs-enabled.txt"
LSPCI_OFF_REL = "lspci/h2-004-nccl1405-grep-acsctl-all-disabled.txt"
GPU_PCI_NAME = {H100: "3D controller: NVIDIA Corporation GH100 [H100 SXM5 80GB] (rev a1)",
                L40S: "3D controller: NVIDIA Corporation AD102GL [L40S] (rev a1)"}


def lspci_vvv(cap: Captures, gpus: list[Gpu], acs_on: bool = False) -> Output:
    """A reduced `lspci -vvv`: for each GPU its bridge (with the ACS capability) and the GPU."""
    acs = verbatim(cap, LSPCI_ACS_REL)
    lines = acs.text.splitlines()
    device, numa = lines[0], lines[2]
    cap_line, acscap, acsctl_on = lines[4:7]
    assert device.startswith("40:01.1 PCI bridge: ") and numa == "\tNUMA node: 1"
    assert cap_line == "\tCapabilities: [2a0 v1] Access Control Services" and acscap.startswith("\t\tACSCap:\t")
    off_bits = cap.text(LSPCI_OFF_REL).splitlines()[1].split("ACSCtl:", 1)[1].strip()
    assert off_bits == "SrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-"
    acsctl = acsctl_on if acs_on else "\t\tACSCtl:\t" + off_bits
    devices = []
    for g in gpus:
        bus = int(g.bus_id.split(":")[1], 16)
        bdf = f"{bus - 1:02x}:00.0" if bus % 2 == 0 else f"{bus - 2:02x}:01.0"
        node = "\tNUMA node: " + ("1" if bus >= 0x80 else "0")
        devices += [(bdf, [bdf + device[len("40:01.1"):], node, cap_line, acscap, acsctl]),
                    (f"{bus:02x}:00.0", [f"{bus:02x}:00.0 {GPU_PCI_NAME[g.name]}", node])]
    out = [ln for _, block in sorted(devices) for ln in block + [""]]
    edits = [
        f"per GPU, the bridge above it and the GPU, in address order, reduced to the lines the toolkit greps for "
        f"(device line, NUMA node, Access Control Services capability with ACSCap and ACSCtl; the capture "
        f"elided the rest with '....' too); a blank line after each device as lspci prints",
        "bridge device line, NUMA node line, Capabilities/ACSCap lines verbatim from the capture (an AMD GPP "
        "bridge; an HGX board's PCIe switch ports are not captured); bridge addresses chosen: the GPU's bus - 1, "
        "device 00 for even GPU buses, the bus - 2 bridge's device 01 for odd ones; NUMA node 0 below bus 0x80",
        "GPU device lines: the pci.ids name of the GPU (not captured), revision a1",
    ]
    if acs_on:
        edits.append(f"ACSCtl verbatim from the capture on every bridge (SrcValid+ ReqRedir+ CmpltRedir+ "
                     f"UpstreamFwd+: ACS redirecting peer traffic)")
    else:
        edits.append(f"ACSCtl bits 'SrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- "
                     f"DirectTrans-' (ACS disabled) from {LSPCI_OFF_REL} in the capture's tab layout")
    return Output("\n".join(out) + "\n", [cap.cite(LSPCI_ACS_REL), cap.cite(LSPCI_OFF_REL)], edits)


DMESG_REL = "dmesg/h2-007-ollama1769-multi-gpu-driver-load-no-xid.txt"
XID_REL = "dmesg/h2-003-chia-gigahorse301-xid31-62-45-cascade.txt"


def dmesg(cap: Captures, gpus: list[Gpu], driver: str, xid79: Gpu | None = None) -> Output:
    """The kernel log of a healthy driver load (and, with xid79, a GPU that fell off the bus)."""
    out = verbatim(cap, DMESG_REL)
    out.drop_lines(lambda ln: "HDA NVidia HDMI/DP" in ln,
                   "the five 'input: HDA NVidia HDMI/DP' lines removed (a data-centre GPU has no display audio)",
                   expect=5)
    lines = out.text.splitlines()
    drm = [ln for ln in lines if "nvidia-drm" in ln]
    assert len(drm) == 5 and lines[-2].startswith("[   25.182630] nvidia_uvm")
    stamp = [ln.split("]", 1)[0] + "]" for ln in drm]
    captured_buses = ["0000:43:00.0", "0000:88:00.0", "0000:c4:00.0"]
    ours = [f"0000:{g.bus_id.split(':', 1)[1].lower()}" for g in gpus[:3]]
    text = out.text
    for old, new in zip(captured_buses, ours):
        text = text.replace(f"for {old} on", f"for {new} on")
    for old, new in (("0x00008800", f"0x0000{ours[1][5:7]}00"), ("0x0000c400", f"0x0000{ours[2][5:7]}00")):
        text = text.replace(f"[GPU ID {old}]", f"[GPU ID {new}]")
    proc = proc_driver_version(cap, driver).text.splitlines()[0]
    assert proc.startswith("NVRM version: NVIDIA UNIX Open Kernel Module")
    load = "[    5.912345] NVRM: loading " + proc[len("NVRM version: "):]
    out.text = load + "\n" + text
    out.sources.append(cap.cite("proc-driver-nvidia-version/001-open-kernel-module-565.57.01.txt"))
    out.edits += [
        f"the nvidia-drm lines' GPUs 0000:43:00.0, 0000:88:00.0, 0000:c4:00.0 (and GPU IDs 0x8800, 0xc400) -> "
        f"this node's first three GPUs {', '.join(ours)} (the capture starts mid-load: its earlier lines, "
        "other GPUs included, are not captured)",
        "first line added: the driver's load message 'NVRM: loading <the banner of /proc/driver/nvidia/version>' "
        f"(as the module prints it when it loads; banner from the profile's proc-driver-nvidia-version.txt, "
        f"driver {driver}), timestamp 5.912345 chosen (before the capture's first line)",
    ]
    if xid79 is not None:
        xid_line = next(ln for ln in cap.text(XID_REL).splitlines() if "): 45, " in ln)
        bus = "0000:" + xid79.bus_id.split(":", 1)[1][:5].lower()
        assert xid_line.startswith("[14370.688139] NVRM: Xid (PCI:0000:0a:00): 45, pid='<unknown>', name=<unknown>")
        line = (xid_line.replace("[14370.688139]", "[81234.567890]").replace("PCI:0000:0a:00", f"PCI:{bus}")
                .replace("): 45, ", "): 79, ").replace("Ch 00000008", "GPU has fallen off the bus."))
        out.text += line + "\n"
        out.sources.append(cap.cite(XID_REL))
        out.edits.append(
            f"last line added: an Xid 79 for {xid79.bus_id}, from the driver-raised Xid 45 line of {XID_REL} "
            f"(\"NVRM: Xid (PCI:0000:0a:00): 45, pid='<unknown>', name=<unknown>, Ch 00000008\"): 45 -> 79, "
            f"'Ch 00000008' -> 'GPU has fallen off the bus.' (the Xid 79 text; no Xid 79 line is captured), "
            f"PCI:0000:0a:00 -> PCI:{bus}, timestamp 81234.567890 chosen")
    return out


FM_REL = "fabricmanager/h2-001-bottlerocket142-systemctl-status-active-running.txt"
FM_FAIL_REL = "fabricmanager/h2-002-gpuoperator610-journal-failed-nothing-to-do.txt"
FM_UNIT = "systemctl-status-nvidia-fabricmanager.txt"


def fabricmanager_status(cap: Captures, running: bool = True) -> Output:
    """`systemctl status nvidia-fabricmanager --no-pager --full` (exit 0 running, 3 failed)."""
    out = without_prompt(cap, FM_REL, "bash-5.1# systemctl status nvidia-fabricmanager")
    out.drop_lines(lambda ln: ln.endswith("…"),
                   "the second journal line, ellipsized ('…') by systemctl without --full, removed (--full "
                   "prints it whole; its rest is not captured)", expect=1)
    if running:
        return out
    host = "ip-192-168-38-187.us-west-2.compute.internal"
    journal = []
    for ln in cap.text(FM_FAIL_REL).splitlines():
        assert ln.startswith("11月 15 14:15:47 leon-NF5468M6 ")
        journal.append("May 16 15:10:10 " + host + ln[len("11月 15 14:15:47 leon-NF5468M6"):])
    box = out.text.split("\n\n", 1)[0].splitlines()
    assert box[0].startswith("● ") and box[4].startswith("     Active: active (running) since ")
    kept = [box[0].replace("● ", "× ", 1), *box[1:4],
            "     Active: failed (Result: exit-code) since Fri 2025-05-16 15:10:10 UTC; 13min ago",
            "    Process: 4177 ExecStart=/usr/bin/nv-fabricmanager -c /etc/nvidia/fabricmanager.cfg "
            "-g 0xe09d7303003f3bf8 (code=exited, status=1/FAILURE)",
            "        CPU: 12ms"]
    out.text = "\n".join(kept) + "\n\n" + "\n".join(journal) + "\n"
    out.exit_code = 3
    out.sources.append(cap.cite(FM_FAIL_REL))
    out.edits += [
        "status box of a failed unit: '●' -> '×', 'Active: active (running) since ...' -> 'Active: failed "
        "(Result: exit-code) since ...' (same time), the Main PID, Tasks, Memory, CPU and CGroup lines of the "
        "running service replaced by systemd's 'Process: 4177 ExecStart=<the captured command line> "
        "(code=exited, status=1/FAILURE)' (the pid of the journal's nv-fabricmanager[4177]) and 'CPU: 12ms' (chosen) lines",
        f"journal lines: the three lines of {FM_FAIL_REL} (fabric manager's start failing with "
        "NV_WARN_NOTHING_TO_DO: no NVSwitch device reached) with the capture's '11月 15 14:15:47 leon-NF5468M6' "
        f"-> 'May 16 15:10:10 {host}' (this box's host and time; the probes run in the C locale)",
    ]
    return out


def fabricmanager_absent(cap: Captures) -> Output:
    out = verbatim(cap, FM_REL)
    assert "nvidia-fabricmanager.service" in out.text
    out.text, out.exit_code = "Unit nvidia-fabricmanager.service could not be found.\n", 4
    out.edits.append("systemctl's one line for a unit that is not installed (exit 4; not captured), with the "
                     "unit name of the capture: a node without NVSwitch has no fabric manager")
    return out


# ----------------------------------------------------------------------------- profiles

@dataclass
class Profile:
    name: str
    description: str
    base: str | None = None
    facts: dict = field(default_factory=dict)
    differences: list[str] = field(default_factory=list)
    node_files: dict = field(default_factory=dict)   # path -> {"file": name} | {"text": s} | None
    node_dirs: list[str] | None = None
    outputs: dict = field(default_factory=dict)      # file name -> Output | None (removed)
    mtu: int | None = None                           # eth0's MTU (None: inherited, default 1500)


BASE_DRIVER, BASE_CUDA = "570.133.20", "12.8"
DIFF_DRIVER, DIFF_CUDA = "580.126.09", "13.0"
SHM_DEFAULT = "2G"


def h100_facts(**over) -> dict:
    facts = {
        "gpu_count": 8, "gpu_model": H100, "gpu_memory_mib": 81559,
        "driver_version": BASE_DRIVER, "cuda_version": BASE_CUDA, "cuda_toolkit": "12.5",
        "nvlink": True, "ib_hcas": sorted(ca for ca, _ in H100_IB), "ib_rate_gbps": 400,
        "ib_link_layer": "InfiniBand", "ib_ports_down": [],
        "nvidia_peermem": True, "memory_peers": ["nv_mem"],
        "clock_source": "chrony", "clock_synchronized": True, "clock_offset_seconds": 0.000260112,
        "dev_shm": SHM_DEFAULT, "memlock": "unlimited",
        # node health (cluster/inspection/checks/health.py): what lspci, dmesg, systemctl and nvidia-smi show
        "acs_enabled": False, "fabric_manager": "running", "fabric_state": "Completed", "xids": [],
        "persistence_mode": True, "pcie_narrow_gpus": [], "remap_pending_gpus": [],
        "lost_gpus": [], "nearest_nic_relation": "PIX",
    }
    facts.update(over)
    return facts


def peermem_files(driver: str) -> dict:
    return {
        "/sys/module/nvidia_peermem/version": {"text": driver + "\n"},
        "/sys/kernel/mm/memory_peers/nv_mem/version": {"text": driver + "\n"},
    }


def build(cap: Captures) -> list[Profile]:
    check_row_layout(cap)
    h100 = h100_gpus(cap)

    def with_facts(out: Output, edits: list[str]) -> Output:
        out.edits = edits + out.edits
        return out

    def gpu_outputs(gpus, driver, cuda, header_from=None, fact_edits=H100_FACT_EDITS):
        return {
            "nvidia-smi.txt": with_facts(nvidia_smi_table(cap, gpus, header_from), fact_edits),
            "nvidia-smi-q.txt": with_facts(nvidia_smi_q(cap, gpus, driver, cuda), fact_edits),
            "nvidia-smi-query-gpu.csv": with_facts(query_table(cap, gpus, driver), fact_edits),
        }

    def health_outputs(gpus, driver, **kw):
        """lspci, dmesg and systemctl for a node of these GPUs (kw: acs_on, xid79, fm)."""
        fm = kw.get("fm", "running")
        return {
            "lspci-vvv.txt": lspci_vvv(cap, gpus, acs_on=kw.get("acs_on", False)),
            "dmesg.txt": dmesg(cap, gpus, driver, xid79=kw.get("xid79")),
            FM_UNIT: (fabricmanager_absent(cap) if fm == "absent"
                      else fabricmanager_status(cap, running=fm == "running")),
        }

    healthy = Profile(
        "h100-ib",
        "healthy 8x H100 80GB HBM3 SXM node: NVLink NV18 between all GPUs, eight ConnectX-7 InfiniBand "
        "ports Active at 400 Gb/s (one PIX to each GPU), nvidia_peermem loaded and registered, chrony "
        f"synchronized, {SHM_DEFAULT} /dev/shm, memlock unlimited; PCIe ACS off, fabric manager running, "
        "no Xid, persistence mode on, Gen5 x16 links, no pending row remap",
        facts=h100_facts(),
        node_files={"/proc/driver/nvidia/version": {"file": "proc-driver-nvidia-version.txt"},
                    **peermem_files(BASE_DRIVER)},
        node_dirs=["/sys/kernel/mm/memory_peers"],
        outputs={
            **gpu_outputs(h100, BASE_DRIVER, BASE_CUDA),
            **health_outputs(h100, BASE_DRIVER),
            "nvidia-smi-topo.txt": topo_h100_nics(cap),
            "nvidia-smi-nvlink-e.txt": nvlink_errors(cap, h100),
            "ibstat.txt": ibstat(cap),
            "ibv_devinfo.txt": ibv_devinfo(cap),
            "ibdev2netdev.txt": ibdev2netdev(cap),
            "lsmod.txt": lsmod(cap, peermem=True),
            "chronyc-tracking.txt": chronyc_tracking(cap),
            "chronyc-sources.txt": chronyc_sources(cap, verbose=False),
            "chronyc-sources-v.txt": chronyc_sources(cap, verbose=True),
            "timedatectl.txt": timedatectl_synced(cap),
            "nvcc.txt": nvcc(cap),
            "proc-driver-nvidia-version.txt": proc_driver_version(cap, BASE_DRIVER),
        },
    )
    port_down = Profile(
        "h100-ib-port-down", f"h100-ib with InfiniBand port {PORT_DOWN_CA}/1 Down", base="h100-ib",
        facts={"ib_ports_down": [PORT_DOWN_CA]},
        differences=[f"{PORT_DOWN_CA} port 1 is Down: ibstat 'State: Down', ibv_devinfo PORT_DOWN, "
                     "ibdev2netdev '(Down)'"],
        outputs={"ibstat.txt": ibstat(cap, down=PORT_DOWN_CA),
                 "ibv_devinfo.txt": ibv_devinfo(cap, down=PORT_DOWN_CA),
                 "ibdev2netdev.txt": ibdev2netdev(cap, down=PORT_DOWN_CA)},
    )
    no_peermem = Profile(
        "h100-no-peermem", "h100-ib without a peer-memory module: GPUDirect RDMA unavailable", base="h100-ib",
        facts={"nvidia_peermem": False, "memory_peers": []},
        differences=["nvidia_peermem not loaded: absent from lsmod, no /sys/module/nvidia_peermem, "
                     "/sys/kernel/mm/memory_peers exists (MLNX_OFED) but holds no nv_mem client"],
        node_files={"/sys/module/nvidia_peermem/version": None,
                    "/sys/kernel/mm/memory_peers/nv_mem/version": None},
        outputs={"lsmod.txt": lsmod(cap, peermem=False)},
    )
    clock_off = Profile(
        "h100-clock-off", "h100-ib whose clock is 7.8 s off while chrony reports Leap status Normal",
        base="h100-ib",
        facts={"clock_synchronized": False, "clock_offset_seconds": 7.800260112},
        differences=["chronyc tracking: 'System time : 7.800260112 seconds fast of NTP time' with "
                     "'Leap status : Normal'; chronyc sources: last sample -7800ms; timedatectl still "
                     "says synchronized"],
        outputs={"chronyc-tracking.txt": chronyc_tracking(cap, offset_off=True),
                 "chronyc-sources.txt": chronyc_sources(cap, verbose=False, offset_off=True),
                 "chronyc-sources-v.txt": chronyc_sources(cap, verbose=True, offset_off=True)},
    )
    h100_580 = h100_gpus(cap)
    driver_diff = Profile(
        "h100-driver-diff", f"h100-ib with NVIDIA driver {DIFF_DRIVER} (CUDA {DIFF_CUDA}) instead of "
        f"{BASE_DRIVER} (CUDA {BASE_CUDA})", base="h100-ib",
        facts={"driver_version": DIFF_DRIVER, "cuda_version": DIFF_CUDA},
        differences=[f"driver {DIFF_DRIVER} / CUDA {DIFF_CUDA} in nvidia-smi, nvidia-smi -q, --query-gpu "
                     "driver_version, /proc/driver/nvidia/version the peer-memory versions and the driver's load line in dmesg"],
        node_files=peermem_files(DIFF_DRIVER),
        outputs={**gpu_outputs(h100_580, DIFF_DRIVER, DIFF_CUDA,
                               header_from="nvidia-smi/003-a100-sxm4-40gb-580-exclusive-process.txt"),
                 "dmesg.txt": dmesg(cap, h100_580, DIFF_DRIVER),
                 "proc-driver-nvidia-version.txt": proc_driver_version(cap, DIFF_DRIVER)},
    )
    l40s = l40s_gpus(cap)
    l40s_profile = Profile(
        "l40s-pcie", "4x NVIDIA L40S on PCIe: no NVLink (PHB), no InfiniBand, no peer-memory module",
        base="h100-ib",
        facts={"gpu_count": 4, "gpu_model": L40S, "gpu_memory_mib": 46068, "nvlink": False, "ib_hcas": [],
               "ib_rate_gbps": None, "ib_link_layer": None, "nvidia_peermem": False, "memory_peers": None,
               "fabric_manager": "absent", "fabric_state": None, "nearest_nic_relation": None},
        differences=["4x NVIDIA L40S instead of 8x H100", "no NVLink: topology PHB between all GPUs",
                     "no InfiniBand: ibstat, ibv_devinfo and ibdev2netdev are not installed",
                     "no nvidia_peermem, no /sys/kernel/mm/memory_peers",
                     "no NVSwitch: no Fabric section in nvidia-smi -q, nvidia-fabricmanager not installed "
                     "(systemctl status: 'could not be found', exit 4); PCIe Gen4 links"],
        node_files={"/sys/module/nvidia_peermem/version": None,
                    "/sys/kernel/mm/memory_peers/nv_mem/version": None},
        node_dirs=[],
        outputs={**gpu_outputs(l40s, BASE_DRIVER, BASE_CUDA, fact_edits=L40S_FACT_EDITS),
                 **health_outputs(l40s, BASE_DRIVER, fm="absent"),
                 "nvidia-smi-topo.txt": topo_4x_pcie(cap),
                 "nvidia-smi-nvlink-e.txt": None,
                 "ibstat.txt": None, "ibv_devinfo.txt": None, "ibdev2netdev.txt": None,
                 "lsmod.txt": lsmod(cap, peermem=False)},
    )
    h100_7 = h100_gpus(cap, 7)
    seven = Profile(
        "h100-7gpu", "h100-ib with 7 of its 8 GPUs visible (GPU 7 missing)", base="h100-ib",
        facts={"gpu_count": 7},
        differences=["7 GPUs: GPU 7 (00000000:8B:00.0) is missing from every GPU output"],
        outputs={**{k: v for k, v in gpu_outputs(h100_7, BASE_DRIVER, BASE_CUDA,
                                                 fact_edits=H100_FACT_EDITS + ["7-GPU variant: GPU 7 removed"]
                                                 ).items()},
                 "lspci-vvv.txt": lspci_vvv(cap, h100_7),
                 "nvidia-smi-topo.txt": topo_h100_nics(cap, 7),
                 "nvidia-smi-nvlink-e.txt": nvlink_errors(cap, h100_7)},
    )
    h100_4 = [replace(g, fabric=None) for g in h100_gpus(cap, 4)]
    small4 = Profile(
        "small-4gpu", "4x H100 80GB HBM3 (NV6 between all pairs) without InfiniBand, for Ray placement tests",
        base="h100-ib",
        facts={"gpu_count": 4, "ib_hcas": [], "ib_rate_gbps": None, "ib_link_layer": None,
               "fabric_manager": "absent", "fabric_state": None},
        differences=["4 GPUs", "no InfiniBand tools (the 4 NICs of its topology are not modelled)",
                     "no NVSwitch (NVLink between the 4 GPUs directly): no Fabric section, no fabric manager"],
        outputs={**gpu_outputs(h100_4, BASE_DRIVER, BASE_CUDA,
                               fact_edits=H100_FACT_EDITS + ["4-GPU variant: GPUs 0-3 only"]),
                 **health_outputs(h100_4, BASE_DRIVER, fm="absent"),
                 "nvidia-smi-topo.txt": topo_4x_h100(cap),
                 "nvidia-smi-nvlink-e.txt": nvlink_errors(cap, h100_4),
                 "ibstat.txt": None, "ibv_devinfo.txt": None, "ibdev2netdev.txt": None},
    )
    small_shm = Profile(
        "small-shm", "h100-ib with a 64 MiB /dev/shm (a container default)", base="h100-ib",
        facts={"dev_shm": "64M"},
        differences=["/dev/shm is a 64 MiB tmpfs (df /dev/shm shows 64M)"],
    )
    memlock = Profile(
        "h100-memlock-64", "h100-ib whose memlock limit is 64 KiB (too low for RDMA)", base="h100-ib",
        facts={"memlock": 64},
        differences=["ulimit -l prints 64 (sshd and every session run with RLIMIT_MEMLOCK 64 KiB, the value "
                     "of fixtures node/ulimit/001 and 003)"],
    )
    cpu = Profile(
        "cpu", "a laptop or CPU-only server: no NVIDIA, InfiniBand or chrony tools, timedatectl only",
        facts={"gpu_count": 0, "gpu_model": None, "gpu_memory_mib": None, "driver_version": None,
               "cuda_version": None, "cuda_toolkit": None, "nvlink": None, "ib_hcas": [], "ib_rate_gbps": None,
               "ib_link_layer": None, "ib_ports_down": [], "nvidia_peermem": False, "memory_peers": None,
               "clock_source": "systemd-timesyncd", "clock_synchronized": True, "clock_offset_seconds": None,
               "dev_shm": SHM_DEFAULT, "memlock": 64,
               "acs_enabled": None, "fabric_manager": None, "fabric_state": None, "xids": None,
               "persistence_mode": None, "pcie_narrow_gpus": None, "remap_pending_gpus": None,
               "lost_gpus": None, "nearest_nic_relation": None},
        differences=["no GPU, no CUDA toolkit, no InfiniBand, no chrony: nvidia-smi, nvcc, ibstat, ... are "
                     "'command not found' (exit 127)", "memlock 64 KiB (fixtures node/ulimit/001)"],
        node_files={}, node_dirs=[],
        outputs={"timedatectl.txt": verbatim(cap, "timedatectl/003-old-systemd-ntp-enabled-synchronized-yes.txt")},
    )
    broken = broken_health_profiles(cap, h100, gpu_outputs, health_outputs)
    return [healthy, port_down, no_peermem, clock_off, driver_diff, l40s_profile, seven, small4, small_shm,
            memlock, cpu, *broken]


def broken_health_profiles(cap: Captures, h100: list[Gpu], gpu_outputs, health_outputs) -> list[Profile]:
    """h100-ib with one node-health fault each (cluster preflight's health checks)."""
    xid_gpu, remap_gpu, x8_gpu = h100[2], h100[5], h100[3]
    lost_gpus = [replace(g, index=i) for i, g in enumerate(g for g in h100 if g != xid_gpu)]

    fm_gpus = [replace(g, fabric="in_progress") for g in h100]
    remap_gpus = [replace(g, remap_pending=True) if g is remap_gpu else g for g in h100]
    x8_gpus = [replace(g, pcie_width=8) if g is x8_gpu else g for g in h100]
    off_gpus = [replace(g, persistence="Off") for g in h100]
    return [
        Profile("h100-acs", "h100-ib with PCIe ACS enabled on the GPUs' bridges", base="h100-ib",
                facts={"acs_enabled": True},
                differences=["lspci -vvv: ACSCtl 'SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+' on the "
                             "bridge above every GPU"],
                outputs={"lspci-vvv.txt": lspci_vvv(cap, h100, acs_on=True)}),
        Profile("h100-fm-stopped", "h100-ib whose nvidia-fabricmanager failed: the NVSwitch fabric is not up",
                base="h100-ib",
                facts={"fabric_manager": "failed", "fabric_state": "In Progress"},
                differences=["systemctl status nvidia-fabricmanager: failed (exit 3), journal "
                             "NV_WARN_NOTHING_TO_DO", "nvidia-smi -q: every GPU's Fabric State 'In Progress', "
                             "Status N/A"],
                outputs={**{k: v for k, v in gpu_outputs(fm_gpus, BASE_DRIVER, BASE_CUDA).items()
                            if k == "nvidia-smi-q.txt"},
                         FM_UNIT: fabricmanager_status(cap, running=False)}),
        Profile("h100-xid79", f"h100-ib whose GPU 2 ({xid_gpu.bus_id}) fell off the bus (Xid 79)",
                base="h100-ib", facts={"xids": [79]},
                differences=[f"dmesg: 'NVRM: Xid (PCI:0000:0a:00): 79, ... GPU has fallen off the bus.' for "
                             f"{xid_gpu.bus_id}"],
                outputs={"dmesg.txt": dmesg(cap, h100, BASE_DRIVER, xid79=xid_gpu)}),
        Profile("h100-gpu-lost", f"h100-ib whose GPU 2 ({xid_gpu.bus_id}) fell off the bus: Xid 79 "
                "in dmesg and 7 GPUs in nvidia-smi (`simcluster state NODE gpu lost`)",
                base="h100-ib", facts={"xids": [79], "gpu_count": 7, "lost_gpus": [xid_gpu.bus_id]},
                differences=[f"dmesg: 'NVRM: Xid (PCI:0000:0a:00): 79, ... GPU has fallen off the bus.' for "
                             f"{xid_gpu.bus_id} (as h100-xid79)",
                             f"nvidia-smi, -q, --query-gpu: {xid_gpu.bus_id} missing, the GPUs after it "
                             "renumbered (as h100-7gpu, with GPU 2 gone instead of GPU 7); "
                             "nvidia-smi topo -m and lspci still show 8 (not switched by the gpu state)"],
                outputs={"dmesg.txt": dmesg(cap, h100, BASE_DRIVER, xid79=xid_gpu),
                         **gpu_outputs(lost_gpus, BASE_DRIVER, BASE_CUDA,
                                       fact_edits=H100_FACT_EDITS + [
                                           f"GPU lost: GPU 2 ({xid_gpu.bus_id}) removed, GPUs 3-7 "
                                           "renumbered 2-6 (nvidia-smi numbers the GPUs it sees)"])}),
        Profile("h100-remap-pending", f"h100-ib whose GPU 5 ({remap_gpu.bus_id}) has a row remap pending",
                base="h100-ib", facts={"remap_pending_gpus": [remap_gpu.bus_id]},
                differences=[f"nvidia-smi -q: Remapped Rows Pending: Yes on {remap_gpu.bus_id}"],
                outputs={"nvidia-smi-q.txt": gpu_outputs(remap_gpus, BASE_DRIVER, BASE_CUDA)["nvidia-smi-q.txt"]}),
        Profile("h100-pcie-x8", f"h100-ib whose GPU 3 ({x8_gpu.bus_id}) trained its PCIe link at x8 of x16",
                base="h100-ib", facts={"pcie_narrow_gpus": [x8_gpu.bus_id]},
                differences=[f"nvidia-smi -q: Link Width Current 8x (Max 16x) on {x8_gpu.bus_id}"],
                outputs={"nvidia-smi-q.txt": gpu_outputs(x8_gpus, BASE_DRIVER, BASE_CUDA)["nvidia-smi-q.txt"]}),
        Profile("h100-persistence-off", "h100-ib with persistence mode off on every GPU", base="h100-ib",
                facts={"persistence_mode": False},
                differences=["Persistence-M Off in nvidia-smi, Persistence Mode Disabled in nvidia-smi -q, "
                             "persistence_mode Disabled in --query-gpu"],
                outputs=gpu_outputs(off_gpus, BASE_DRIVER, BASE_CUDA)),
        Profile("h100-nic-sys", "h100-ib whose InfiniBand NICs are all across the CPU socket from every GPU (SYS)",
                base="h100-ib", facts={"nearest_nic_relation": "SYS"},
                differences=["nvidia-smi topo -m: every GPU-NIC cell SYS"],
                outputs={"nvidia-smi-topo.txt": topo_h100_nics(cap, all_sys=True)}),
        Profile("h100-mtu-9000", "h100-ib whose eth0 has MTU 9000 (jumbo frames) instead of 1500", base="h100-ib",
                differences=["eth0 MTU 9000 (set for real with `ip link set eth0 mtu 9000` in the node's "
                             "namespace, and on the host side of its veth)"],
                mtu=9000),
    ]


# ----------------------------------------------------------------------------- writing

PLAIN = re.compile(r"^[A-Za-z0-9_/][A-Za-z0-9 _./()+,=<>'-]*$")


def scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    reserved = {"null", "true", "false", "yes", "no", "on", "off", "~"}
    if (PLAIN.match(s) and s.lower() not in reserved and not re.match(r"^[-+0-9.]", s)
            and not s.endswith(" ") and ": " not in s and " #" not in s):
        return s
    return json.dumps(s, ensure_ascii=False)


def emit(key: str, value, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            out.append(f"{pad}{key}: {{}}")
            return
        out.append(f"{pad}{key}:")
        for k, v in value.items():
            emit(scalar(k), v, indent + 2, out)
    elif isinstance(value, list):
        if all(not isinstance(x, (dict, list)) for x in value) and sum(len(scalar(x)) for x in value) < 70:
            items = [json.dumps(x) if isinstance(x, str) and "," in x else scalar(x) for x in value]
            out.append(f"{pad}{key}: [{', '.join(items)}]")
        else:
            out.append(f"{pad}{key}:")
            for x in value:
                out.append(f"{pad}  - {scalar(x)}")
    else:
        out.append(f"{pad}{key}: {scalar(value)}")


def write(profile: Profile, root: Path) -> None:
    d = root / profile.name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    lines = ["# Generated by scripts/simcluster_profiles/build_profiles.py from ../shared/fixtures/node;",
             "# edit that script, not this file. Format: docs/simcluster.md#profiles"]
    emit("description", profile.description, 0, lines)
    if profile.base:
        emit("base", profile.base, 0, lines)
    emit("facts", profile.facts, 0, lines)
    emit("differences", profile.differences, 0, lines)
    if profile.node_files or not profile.base:
        lines.append("node_files:" if profile.node_files else "node_files: {}")
        for path, spec in profile.node_files.items():
            if spec is None:
                lines.append(f"  {path}: null")
            else:
                lines.append(f"  {path}:")
                for k, v in spec.items():
                    lines.append(f"    {k}: {scalar(v)}")
    if profile.node_dirs is not None:
        emit("node_dirs", profile.node_dirs, 0, lines)
    if profile.mtu is not None:
        emit("mtu", profile.mtu, 0, lines)
    lines.append("outputs:" if profile.outputs else "outputs: {}")
    for name, out in profile.outputs.items():
        if out is None:
            lines.append(f"  {name}: null")
            continue
        (d / name).write_text(out.text)
        lines.append(f"  {name}:")
        if out.exit_code:
            emit("exit_code", out.exit_code, 4, lines)
        emit("sources", out.sources, 4, lines)
        emit("edits", out.edits, 4, lines)
    (d / "profile.yaml").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES,
                    help=f"the shared fixtures directory (default {DEFAULT_FIXTURES})")
    args = ap.parse_args(argv)
    cap = Captures(args.fixtures)
    profiles = build(cap)
    for p in profiles:
        write(p, HERE)
    print(f"wrote {len(profiles)} profiles to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
