"""Parse the default `nvidia-smi` table (driver, CUDA, GPU blocks, processes) into typed data.

Handles every table generation from the R3xx layout (`Persistence-M|`, no MIG row, no CUDA
version) through R450-R570 (`MIG M.` row), R580 (`+---` under the header) and R610+
(`KMD Version` / `CUDA UMD Version`), Windows (`TCC/WDDM` instead of `Persistence-M`), prompts and
command echoes, timestamps, truncated pastes and author elisions (`[...]`).

Returned shape (`parse(text).to_dict()`):

    {
      "driver_version": "550.90.12" | null,   # "Driver Version" (or R610+ "KMD Version")
      "cuda_version": "12.4" | null,          # "CUDA Version" (R610+ "CUDA UMD Version"); N/A -> null
      "nvidia_smi_version": "550.90.12" | null,
      "timestamp": "Tue Oct  8 09:49:34 2024" | null,
      "gpu_count": 8 | null,                  # len(gpus) when the table is complete, else null
      "complete": true | false | null,        # GPU table closed and followed by the next box
                                              # (Processes); null: text ends at its border
      "gpus": [{
          "index": 0, "name": "NVIDIA A100 80GB PCIe",   # name as shown, maybe cut ("...")
          "name_truncated": false,
          "memory_total_mib": 81920 | null, "memory_used_mib": 437 | null,
          "bus_id": "00000000:01:00.0",
          "persistence_mode": "On" | "Off" | null, "driver_model": "WDDM" | "TCC" | null,
          "persistence_mode_enabled": true | false | null,   # Persistence-M On / Off as a bool
          "display_active": "On" | "Off" | null,
          "ecc_uncorrected_volatile": 0 | null,     # "Volatile Uncorr. ECC"; N/A/Off -> null
          "ecc_column": "0" | "N/A" | "Off",        # that column as shown
          "fan_percent": 30 | null, "temperature_c": 32 | null, "performance_state": "P0" | null,
          "power_draw_w": 69 | null, "power_cap_w": 300 | null,
          "gpu_util_percent": 100 | null, "compute_mode": "Default" | "E. Process" | ... | null,
          "mig_mode": "Disabled" | "Enabled" | null,   # null also when the row is absent (pre-R450)
      }, ...],
      "processes": [{"gpu": 0, "gi": null, "ci": null, "pid": 1234, "type": "C",
                     "name": "python", "memory_mib": 1234 | null}, ...],
    }

`No devices were found` parses to zero GPUs (gpu_count 0). Text that is not an nvidia-smi table,
or nvidia-smi's own failure message (driver not loaded...), raises ParseError. Linear in its
input: lines are cut at 4096 characters and cells split with string operations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import fields_dict
from cluster.inspection.parsers._lines import MAX_LINE_CHARS, lines_of
from cluster.inspection.parsers._nvidia_text import BUS_ID, is_missing, tool_failure, version_in

KIND = "nvidia-smi"

_SMI_HEADER = re.compile(r"NVIDIA-SMI\s+(\d[\w.-]*)")
_DRIVER = re.compile(r"(?:Driver|KMD)\s+Version:\s*(\S+)", re.I)
_CUDA = re.compile(r"CUDA\s+(?:UMD\s+)?Version:\s*(\S+(?:\s\S+)?)", re.I)
_BUS_CELL = re.compile(r"^\s*(" + BUS_ID + r")\s*(On|Off|N/A)?\s*$")
_ROW1_MODES = ("On", "Off", "N/A", "WDDM", "TCC", "MCDM")
_MEMORY = re.compile(r"(?<!\d)(\d{1,12}) {0,8}MiB {0,8}/ {0,8}(\d{1,12}) {0,8}MiB")
_BORDER = re.compile(r"^\s*\+[-=+]+\+\s*$")
_TIMESTAMP = re.compile(
    r"^\s*(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)\s+\w{3}\s+\d+\s+\d\d:\d\d:\d\d\s+\d{4}\s*$")
_PROCESS_HEAD = re.compile(r"^\s*(\d+|N/A)\s+(?:(\S+)\s+(\S+)\s+)?(\d+)\s+([CGM](?:\+[CGM])*)\s")
_PROCESS_MEMORY = re.compile(r"(?<!\S)(\d{1,12}) {0,8}MiB$|(?<!\S)N/A$")
_NO_DEVICES = re.compile(r"No devices were found", re.I)


@dataclass(frozen=True)
class Process:
    """One row of the Processes section."""

    gpu: int | None
    gi: str | None
    ci: str | None
    pid: int
    type: str
    name: str
    memory_mib: int | None


@dataclass(frozen=True)
class Gpu:
    """One GPU block of the table; fields the text does not show are None."""

    index: int
    name: str
    name_truncated: bool
    memory_total_mib: int | None
    memory_used_mib: int | None
    bus_id: str
    persistence_mode: str | None
    persistence_mode_enabled: bool | None
    driver_model: str | None
    display_active: str | None
    ecc_uncorrected_volatile: int | None
    ecc_column: str | None
    fan_percent: int | None
    temperature_c: int | None
    performance_state: str | None
    power_draw_w: int | None
    power_cap_w: int | None
    gpu_util_percent: int | None
    compute_mode: str | None
    mig_mode: str | None


@dataclass(frozen=True)
class NvidiaSmi:
    """The default nvidia-smi table: versions, GPUs, processes (see the module docstring)."""

    driver_version: str | None
    cuda_version: str | None
    nvidia_smi_version: str | None
    timestamp: str | None
    complete: bool | None
    gpus: tuple[Gpu, ...]
    processes: tuple[Process, ...]

    @property
    def gpu_count(self) -> int | None:
        """Number of GPUs when the table is known to be complete, else None."""
        return len(self.gpus) if self.complete else None

    def to_dict(self) -> dict:
        return {
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "nvidia_smi_version": self.nvidia_smi_version,
            "timestamp": self.timestamp,
            "gpu_count": self.gpu_count,
            "complete": self.complete,
            "gpus": [fields_dict(g) for g in self.gpus],
            "processes": [fields_dict(p) for p in self.processes],
        }


def detect(text: str) -> bool:
    """True when the text holds an nvidia-smi table header or a GPU row of that table."""
    if re.search(r"NVIDIA-SMI\s+\d+\.\d+", text) and re.search(r"(?:Driver|KMD)\s+Version:", text):
        return True
    return bool(re.search(r"Persistence-M|TCC/WDDM", text) and re.search(r"Bus-Id", text))


def parse(text: str) -> NvidiaSmi:
    """Parse nvidia-smi's default output; see the module docstring for the returned shape."""
    lines = [_from_first_bar(line[:MAX_LINE_CHARS]) for line in lines_of(text, KIND)]
    header_seen, driver, cuda, smi_version = _header(lines)
    timestamp = next((ln.strip() for ln in lines if _TIMESTAMP.match(ln)), None)
    gpus, last_gpu_line = _gpus(lines)
    processes = _processes(lines)

    if not gpus:
        if any(_NO_DEVICES.search(ln) for ln in lines):
            return NvidiaSmi(driver, cuda, smi_version, timestamp, True, (), ())
        failure = tool_failure(lines)
        if failure and not header_seen:
            raise ParseError(KIND, f"nvidia-smi did not run: {failure}")
        if not header_seen:
            raise ParseError(KIND, "no nvidia-smi table found (no 'NVIDIA-SMI <version>' header "
                                   "and no GPU row with a bus id)")
        return NvidiaSmi(driver, cuda, smi_version, timestamp, False, (), tuple(processes))
    return NvidiaSmi(driver, cuda, smi_version, timestamp, _complete(lines, last_gpu_line),
                     tuple(gpus), tuple(processes))


_BAR = re.compile(r"[|+]")
_PROCESSES_TITLE = re.compile(r"\|\s*Processes:")


def _from_first_bar(line: str) -> str:
    """Drop anything pasted in front of a table line (`node1: |...`) so it starts at `|` or `+`."""
    m = _BAR.search(line)
    if m and m.start() > 0 and line.rstrip().endswith(("|", "+")):
        return line[m.start():]
    return line


def _header(lines: list[str]) -> tuple[bool, str | None, str | None, str | None]:
    for line in lines:
        m = _SMI_HEADER.search(line)
        d = _DRIVER.search(line)
        if m is None and d is None:
            continue
        driver = version_in(d.group(1)) if d else None
        c = _CUDA.search(line)
        cuda = version_in(c.group(1)) if c else None
        return True, driver, cuda, (m.group(1) if m else None)
    return False, None, None, None


def _cells(line: str) -> list[str] | None:
    """The three cells of a GPU-table line `| a | b | c |`, or None for any other line."""
    stripped = line.strip()
    if not (stripped.startswith("|") and stripped.endswith("|")):
        return None
    parts = stripped[1:-1].split("|")
    return parts if len(parts) == 3 else None


def _gpus(lines: list[str]) -> tuple[list[Gpu], int]:
    gpus: list[Gpu] = []
    last = -1
    for i, line in enumerate(lines):
        cells = _cells(line)
        if cells is None:
            continue
        bus = _BUS_CELL.match(cells[1])
        first = _row1_cell(cells[0])
        if bus is None or first is None:
            continue
        row2 = _cells(lines[i + 1]) if i + 1 < len(lines) else None
        row3 = _cells(lines[i + 2]) if row2 is not None and i + 2 < len(lines) else None
        if row3 is not None and (row3[0].strip() or _BUS_CELL.match(row3[1])):
            row3 = None
        gpus.append(_gpu(first, bus, cells[2], row2, row3, i))
        last = i + (1 if row2 else 0) + (1 if row3 else 0)
    return gpus, last


def _row1_cell(cell: str) -> tuple[int, str, str | None] | None:
    """`   0  NVIDIA A100 80GB PCIe  On` -> (0, "NVIDIA A100 80GB PCIe", "On"); None when the
    cell does not start with a GPU index followed by a blank (the name may then be empty)."""
    parts = cell.split(None, 1)
    if not parts or not (parts[0].isascii() and parts[0].isdigit()):
        return None
    if len(parts) == 1:
        after = cell.lstrip()[len(parts[0]):]
        return (int(parts[0]), "", None) if after else None
    rest = parts[1].strip()
    words = rest.rsplit(None, 1)
    if len(words) == 2 and words[1] in _ROW1_MODES:
        return int(parts[0]), words[0].strip(), words[1]
    return int(parts[0]), rest, None


def _gpu(first: tuple[int, str, str | None], bus: re.Match, ecc_cell: str, row2: list[str] | None,
         row3: list[str] | None, line_no: int) -> Gpu:
    index, name, mode = first
    if not name:
        raise ParseError(KIND, "GPU row without a name", line=line_no + 1)
    ecc = ecc_cell.strip() or None
    fan = temp = perf = draw = cap = util = used = total = None
    compute = None
    if row2 is not None:
        fan, temp, perf, draw, cap = _row2_first_cell(row2[0])
        mem = _MEMORY.search(row2[1])
        if mem:
            used, total = int(mem.group(1)), int(mem.group(2))
        util, compute = _row2_last_cell(row2[2])
    mig = row3[2].strip() if row3 is not None else None
    return Gpu(
        index=index,
        name=name,
        name_truncated=name.endswith("..."),
        memory_total_mib=total,
        memory_used_mib=used,
        bus_id=bus.group(1),
        persistence_mode=mode if mode in ("On", "Off") else None,
        persistence_mode_enabled={"On": True, "Off": False}.get(mode or ""),
        driver_model=mode if mode in ("WDDM", "TCC", "MCDM") else None,
        display_active=bus.group(2) if bus.group(2) in ("On", "Off") else None,
        ecc_uncorrected_volatile=int(ecc) if ecc and ecc.isdigit() else None,
        ecc_column=ecc,
        fan_percent=fan,
        temperature_c=temp,
        performance_state=perf,
        power_draw_w=draw,
        power_cap_w=cap,
        gpu_util_percent=util,
        compute_mode=None if is_missing(compute) else compute,
        mig_mode=None if is_missing(mig) else mig,
    )


def _int_in(token: str | None, suffix: str) -> int | None:
    if token is None:
        return None
    m = re.fullmatch(r"(\d{1,12})(?:\.\d{1,12})? {0,8}" + suffix, token.strip())
    return int(m.group(1)) if m else None


def _row2_first_cell(cell: str) -> tuple:
    """`N/A   32C    P0    69W /  300W` -> (fan %, temp C, perf state, power draw W, cap W)."""
    tokens, draw_token, cap_token = _power_split(cell.split())
    draw = _int_in(draw_token, "W")
    cap = _int_in(cap_token, "W")
    fan = _int_in(tokens[0], "%") if len(tokens) > 0 else None
    temp = _int_in(tokens[1], "C") if len(tokens) > 1 else None
    perf = tokens[2] if len(tokens) > 2 and re.fullmatch(r"P\d+", tokens[2]) else None
    return fan, temp, perf, draw, cap


def _power_split(tokens: list[str]) -> tuple[list[str], str | None, str | None]:
    """(tokens before the power pair, draw, cap) of `... 69W / 300W` (also `69W/300W`,
    `69W /300W`, `69W/ 300W`); no pair: (tokens, None, None)."""
    if len(tokens) >= 3 and tokens[-2] == "/":
        return tokens[:-3], tokens[-3], tokens[-1]
    if len(tokens) >= 2 and tokens[-1].startswith("/") and len(tokens[-1]) > 1:
        return tokens[:-2], tokens[-2], tokens[-1][1:]
    if len(tokens) >= 2 and tokens[-2].endswith("/") and len(tokens[-2]) > 1:
        return tokens[:-2], tokens[-2][:-1], tokens[-1]
    if tokens and tokens[-1].count("/") == 1 and tokens[-1] != "N/A":
        draw, _, cap = tokens[-1].partition("/")
        if draw and cap:
            return tokens[:-1], draw, cap
    return tokens, None, None


def _row2_last_cell(cell: str) -> tuple[int | None, str | None]:
    """`100%      Default` -> (100, "Default"); `11%   E. Process` -> (11, "E. Process")."""
    parts = cell.strip().split(None, 1)
    if len(parts) < 2:
        return None, None
    return _int_in(parts[0], "%"), parts[1] or None


def _complete(lines: list[str], last_gpu_line: int) -> bool | None:
    """True when the last GPU block is closed by a border and another box (Processes, MIG
    devices) follows it; None when the text ends at that border; False when it is not closed."""
    i = last_gpu_line + 1
    if i >= len(lines) or not _BORDER.match(lines[i]):
        return False
    following = next((ln.strip() for ln in lines[i + 1:] if ln.strip()), "")
    return True if following.startswith(("+", "|")) else None


def _processes(lines: list[str]) -> list[Process]:
    start = next((i for i, ln in enumerate(lines) if _PROCESSES_TITLE.search(ln)), None)
    if start is None:
        return []
    out: list[Process] = []
    for line in lines[start + 1:]:
        stripped = line.strip()
        if not (stripped.startswith("|") and stripped.endswith("|")) or stripped.count("|") != 2:
            continue
        parsed = _process_row(stripped[1:-1])
        if parsed is None:
            continue
        gpu, gi, ci, pid, ptype, name, mem = parsed
        out.append(Process(
            gpu=int(gpu) if gpu.isdigit() else None,
            gi=None if gi is None or is_missing(gi) else gi,
            ci=None if ci is None or is_missing(ci) else ci,
            pid=int(pid), type=ptype, name=name.strip(),
            memory_mib=_int_in(mem.replace(" ", ""), "MiB")))
    return out


def _process_row(cell: str) -> tuple | None:
    """(gpu, gi, ci, pid, type, name, memory) of one Processes row, or None."""
    cell = cell.rstrip()
    head = _PROCESS_HEAD.match(cell)
    tail = _PROCESS_MEMORY.search(cell[-32:])
    if head is None or tail is None:
        return None
    mem_start = len(cell) - len(cell[-32:]) + tail.start()
    if mem_start < head.end():
        return None
    name = cell[head.end():mem_start].strip()
    if not name:
        return None
    return (*head.groups(), name, tail.group(0))
