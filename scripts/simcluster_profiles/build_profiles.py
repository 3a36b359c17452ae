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
from dataclasses import dataclass, field
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
                0, 46068, 509, "P8", "N/A", "8.9", 2520) for i in range(4)]


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


def nvidia_smi_q(cap: Captures, gpus: list[Gpu], driver: str, cuda: str) -> Output:
    """A reduced `nvidia-smi -q`: the header and, per GPU, the sections the toolkit reads."""
    def kv(indent: int, key: str, value: str) -> str:
        return " " * indent + f"{key:<{42 - indent}}: {value}"

    lines = ["", "==============NVSMI LOG==============", "",
             kv(0, "Timestamp", "Wed Jun  7 19:32:16 2023"),
             kv(0, "Driver Version", driver), kv(0, "CUDA Version", cuda), "",
             kv(0, "Attached GPUs", str(len(gpus)))]
    for g in gpus:
        lines += [f"GPU {g.bus_id}",
                  kv(4, "Product Name", g.name),
                  kv(4, "Persistence Mode", "Enabled" if g.persistence == "On" else "Disabled"),
                  kv(4, "GPU UUID", g.uuid),
                  kv(4, "Minor Number", str(g.index)),
                  kv(4, "VBIOS Version", g.vbios),
                  "    PCI",
                  kv(8, "Bus Id", g.bus_id),
                  kv(4, "Performance State", g.perf),
                  "    FB Memory Usage",
                  kv(8, "Total", f"{g.mem_total_mib} MiB"),
                  kv(8, "Reserved", f"{g.mem_reserved_mib} MiB"),
                  kv(8, "Used", f"{g.mem_used_mib} MiB"),
                  kv(8, "Free", f"{g.mem_total_mib - g.mem_reserved_mib - g.mem_used_mib} MiB"),
                  kv(4, "Compute Mode", g.compute_mode),
                  "    Max Clocks",
                  kv(8, "SM", f"{g.max_sm_mhz} MHz"),
                  ""]
    q1 = "nvidia-smi-q/001-a100-sxm4-ecc-remapped-rows-pending.txt"
    q6 = "nvidia-smi-q/006-rtx-pro-6000-580-cuda-not-found-d-memory-performance.txt"
    return Output("\n".join(lines) + "\n", [cap.cite(q6), cap.cite(q1)], [
        f"header layout (NVSMI LOG banner, Driver/CUDA Version, Attached GPUs) from {q6}; "
        f"timestamp from {q1}; driver {driver} and CUDA {cuda} set",
        "reduced: per GPU only Product Name, Persistence Mode, GPU UUID, Minor Number, VBIOS Version, "
        "PCI Bus Id, Performance State, FB Memory Usage, Compute Mode and Max Clocks SM, in nvidia-smi -q's "
        "order and key: value layout (key column 42 wide, as in the captures); a real -q prints ~150 more lines per GPU",
        "FB Memory Usage section and the Reserved/Free values follow nvidia-smi -q (not in the fixtures)",
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


def topo_h100(cap: Captures, gpu_count: int = 8) -> Output:
    rel = "nvidia-smi-topo/007-h100-8gpu-nv18-no-nic-columns.txt"
    out = without_prompt(cap, rel, "$ nvidia-smi topo -m")
    legend = cap.text("nvidia-smi-topo/013-2x-rtx5090-phb-tabs-consumer.txt").split("\nLegend:", 1)[1]
    out.text = out.text + "\nLegend:" + legend
    out.sources.append(cap.cite("nvidia-smi-topo/013-2x-rtx5090-phb-tabs-consumer.txt"))
    out.edits.append("the Legend block nvidia-smi prints under the matrix appended verbatim from "
                     "node/nvidia-smi-topo/013 (the 007 capture stops at the matrix)")
    if gpu_count == 7:
        lines = out.text.splitlines()
        header = lines[0]
        a, b = header.index("GPU7"), header.index("CPU Affinity")
        kept = [header[:a] + header[b:]]
        for ln in lines[1:]:
            if ln.startswith("GPU7"):
                continue
            kept.append(ln[:a] + ln[b:] if ln.startswith("GPU") else ln)
        out.text = "\n".join(kept) + "\n"
        out.edits.append("7-GPU variant: GPU7 row and GPU7 column removed")
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

    healthy = Profile(
        "h100-ib",
        "healthy 8x H100 80GB HBM3 SXM node: NVLink NV18 between all GPUs, eight ConnectX-7 InfiniBand "
        "ports Active at 400 Gb/s, nvidia_peermem loaded and registered, chrony synchronized, "
        f"{SHM_DEFAULT} /dev/shm, memlock unlimited",
        facts=h100_facts(),
        node_files={"/proc/driver/nvidia/version": {"file": "proc-driver-nvidia-version.txt"},
                    **peermem_files(BASE_DRIVER)},
        node_dirs=["/sys/kernel/mm/memory_peers"],
        outputs={
            **gpu_outputs(h100, BASE_DRIVER, BASE_CUDA),
            "nvidia-smi-topo.txt": topo_h100(cap),
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
                     "driver_version, /proc/driver/nvidia/version and the peer-memory versions"],
        node_files=peermem_files(DIFF_DRIVER),
        outputs={**gpu_outputs(h100_580, DIFF_DRIVER, DIFF_CUDA,
                               header_from="nvidia-smi/003-a100-sxm4-40gb-580-exclusive-process.txt"),
                 "proc-driver-nvidia-version.txt": proc_driver_version(cap, DIFF_DRIVER)},
    )
    l40s = l40s_gpus(cap)
    l40s_profile = Profile(
        "l40s-pcie", "4x NVIDIA L40S on PCIe: no NVLink (PHB), no InfiniBand, no peer-memory module",
        base="h100-ib",
        facts={"gpu_count": 4, "gpu_model": L40S, "gpu_memory_mib": 46068, "nvlink": False, "ib_hcas": [],
               "ib_rate_gbps": None, "ib_link_layer": None, "nvidia_peermem": False, "memory_peers": None},
        differences=["4x NVIDIA L40S instead of 8x H100", "no NVLink: topology PHB between all GPUs",
                     "no InfiniBand: ibstat, ibv_devinfo and ibdev2netdev are not installed",
                     "no nvidia_peermem, no /sys/kernel/mm/memory_peers"],
        node_files={"/sys/module/nvidia_peermem/version": None,
                    "/sys/kernel/mm/memory_peers/nv_mem/version": None},
        node_dirs=[],
        outputs={**gpu_outputs(l40s, BASE_DRIVER, BASE_CUDA, fact_edits=L40S_FACT_EDITS),
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
                 "nvidia-smi-topo.txt": topo_h100(cap, 7),
                 "nvidia-smi-nvlink-e.txt": nvlink_errors(cap, h100_7)},
    )
    h100_4 = h100_gpus(cap, 4)
    small4 = Profile(
        "small-4gpu", "4x H100 80GB HBM3 (NV6 between all pairs) without InfiniBand, for Ray placement tests",
        base="h100-ib",
        facts={"gpu_count": 4, "ib_hcas": [], "ib_rate_gbps": None, "ib_link_layer": None},
        differences=["4 GPUs", "no InfiniBand tools (the 4 NICs of its topology are not modelled)"],
        outputs={**gpu_outputs(h100_4, BASE_DRIVER, BASE_CUDA,
                               fact_edits=H100_FACT_EDITS + ["4-GPU variant: GPUs 0-3 only"]),
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
               "dev_shm": SHM_DEFAULT, "memlock": 64},
        differences=["no GPU, no CUDA toolkit, no InfiniBand, no chrony: nvidia-smi, nvcc, ibstat, ... are "
                     "'command not found' (exit 127)", "memlock 64 KiB (fixtures node/ulimit/001)"],
        node_files={}, node_dirs=[],
        outputs={"timedatectl.txt": verbatim(cap, "timedatectl/003-old-systemd-ntp-enabled-synchronized-yes.txt")},
    )
    return [healthy, port_down, no_peermem, clock_off, driver_diff, l40s_profile, seven, small4, small_shm,
            memlock, cpu]


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
    lines.append("outputs:" if profile.outputs else "outputs: {}")
    for name, out in profile.outputs.items():
        if out is None:
            lines.append(f"  {name}: null")
            continue
        (d / name).write_text(out.text)
        lines.append(f"  {name}:")
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
