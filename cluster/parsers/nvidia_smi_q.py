"""Parse `nvidia-smi -q` (the indented "key : value" report) into typed per-GPU data.

Reads the full report and its filtered forms (`-q -d MEMORY,ECC,...`, `-q -i N`, `-a`), the old
(R3xx-R4xx) and new (R450+, R550+ SRAM/DRAM ECC, R610+ `KMD Version` / `CUDA UMD Version`) key
names, and grep'ed excerpts without the `GPU <bus id>` section lines (`nvidia-smi -q | grep UUID`):
there a new GPU starts whenever a key seen for the current GPU comes again.

Returned shape (`parse(text).to_dict()`):

    {
      "driver_version": "510.73.08" | null,   # "Driver Version" or "KMD Version"
      "cuda_version": "11.6" | null,          # "CUDA Version" or "CUDA UMD Version";
                                              # "Not Found" -> null
      "timestamp": "Wed Jun  7 19:32:16 2023" | null,
      "attached_gpus": 8 | null,              # "Attached GPUs" as printed (all GPUs, even with -i)
      "gpu_count": 8 | null,                  # attached_gpus when shown, else len(gpus) when
                                              # GPUs are shown, else null
      "gpus": [{
          "index": 0,                 # position in the output (GPU sections come in index order;
                                      # with -i N it is the position, not N)
          "name": "NVIDIA A100-SXM4-80GB" | null,    # "Product Name"
          "memory_total_mib": 81920 | null,          # "FB Memory Usage" / "Total"
          "memory_used_mib": ... | null, "memory_reserved_mib": ... | null,
          "bus_id": "00000000:10:1C.0" | null,       # section line, else "PCI" / "Bus Id"
          "uuid": "GPU-..." | null, "serial": ... | null, "vbios_version": ... | null,
          "brand": "Tesla" | null, "architecture": "Ampere" | null,
          "minor_number": 0 | null, "module_id": 1 | null,
          "persistence_mode": "Enabled" | "Disabled" | null,
          "mig_mode": "Enabled" | "Disabled" | null,          # "MIG Mode" / "Current"
          "compute_mode": "Default" | ... | null,
          "performance_state": "P0" | null,
          "clocks_event_reasons_active": ["SW Power Cap", ...] | null,
                                      # reasons marked "Active" under "Clocks Event Reasons"
                                      # (older: "Clocks Throttle Reasons"); [] when none is;
                                      # null when the section is not shown
          "ecc_mode": "Enabled" | "Disabled" | null,          # "ECC Mode" / "Current"
          "ecc_errors": {"volatile": {"correctable": 177, "uncorrectable": 0},
                         "aggregate": {"correctable": ..., "uncorrectable": ...}},
                         # sums of the counters shown (SRAM+DRAM, or old Single/Double Bit Total);
                         # a side the text does not show has both counts null
          "retired_pages": {"single_bit_ecc": int|null, "double_bit_ecc": int|null,
                            "pending": "Yes"/"No"|null},
          "remapped_rows": {"correctable": 1, "uncorrectable": 0, "pending": true|false|null,
                            "failure": true|false|null, "histogram": {"max": 639, ...}} | null,
          "temperature_c": 34 | null,
          "power_draw_w": 69.3 | null, "power_limit_w": 400.0 | null,
          "pcie_gen_current": 4 | null, "pcie_gen_max": 4 | null,
          "pcie_width_current": 16 | null, "pcie_width_max": 16 | null,
      }, ...],
    }

Raises ParseError on text that is not an nvidia-smi -q report (no known key at all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cluster.errors import ParseError
from cluster.parsers._nvidia_text import (command_echo, is_elision, is_missing, lines_of,
                                          strip_prompt, tool_failure, to_number, version_in)

KIND = "nvidia-smi-q"

_BUS_ID = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]"
_SECTION_GPU = re.compile(r"^GPU\s+(" + _BUS_ID + r")\s*$")
_KEY_VALUE = re.compile(r"^(\s*)([^:\s][^:]*?)\s*:(?:\s+(.*?))?\s*$")
_BANNER = re.compile(r"=+\s*NVSMI LOG\s*=+")
_TOP_KEYS = {"timestamp", "driver version", "kmd version", "cuda version", "cuda umd version",
             "attached gpus", "vgpu driver capability"}
# Keys that only nvidia-smi -q prints; at least one must be present.
_MARKER_KEYS = {"driver version", "kmd version", "cuda version", "cuda umd version",
                "attached gpus", "product name", "gpu uuid", "product brand", "vbios version",
                "fb memory usage", "bar1 memory usage", "ecc errors", "remapped rows",
                "retired pages", "clocks event reasons", "clocks throttle reasons",
                "persistence mode", "performance state", "minor number", "gpu part number",
                "bus id", "serial number", "gpu current temp", "board id", "module id",
                "product architecture", "driver model", "mig mode", "ecc mode", "compute mode",
                "gpu power readings", "power readings", "temperature", "nvsmi log"}


@dataclass
class _Node:
    """One line of the report: key, value (None for a section), children (indented below it)."""

    key: str
    value: str | None
    indent: int
    children: list["_Node"] = field(default_factory=list)

    def find(self, *path: str) -> "_Node | None":
        node: _Node | None = self
        for name in path:
            assert node is not None
            node = next((c for c in node.children if c.key.lower() == name.lower()), None)
            if node is None:
                return None
        return node

    def value_at(self, *path: str) -> str | None:
        node = self.find(*path)
        if node is None or node.value is None or is_missing(node.value):
            return None
        return node.value


@dataclass(frozen=True)
class Gpu:
    """One GPU section of the report; fields the text does not show are None."""

    index: int
    name: str | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    memory_reserved_mib: int | None
    bus_id: str | None
    uuid: str | None
    serial: str | None
    vbios_version: str | None
    brand: str | None
    architecture: str | None
    minor_number: int | None
    module_id: int | None
    persistence_mode: str | None
    mig_mode: str | None
    compute_mode: str | None
    performance_state: str | None
    clocks_event_reasons_active: tuple[str, ...] | None
    ecc_mode: str | None
    ecc_errors: dict
    retired_pages: dict | None
    remapped_rows: dict | None
    temperature_c: int | None
    power_draw_w: float | None
    power_limit_w: float | None
    pcie_gen_current: int | None
    pcie_gen_max: int | None
    pcie_width_current: int | None
    pcie_width_max: int | None

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        if self.clocks_event_reasons_active is not None:
            out["clocks_event_reasons_active"] = list(self.clocks_event_reasons_active)
        return out


@dataclass(frozen=True)
class NvidiaSmiQ:
    """An nvidia-smi -q report (see the module docstring)."""

    driver_version: str | None
    cuda_version: str | None
    timestamp: str | None
    attached_gpus: int | None
    gpus: tuple[Gpu, ...]

    @property
    def gpu_count(self) -> int | None:
        """Attached GPUs when printed, else the number of GPU sections shown, else None."""
        if self.attached_gpus is not None:
            return self.attached_gpus
        return len(self.gpus) if self.gpus else None

    def to_dict(self) -> dict:
        return {
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "timestamp": self.timestamp,
            "attached_gpus": self.attached_gpus,
            "gpu_count": self.gpu_count,
            "gpus": [g.to_dict() for g in self.gpus],
        }


def detect(text: str) -> bool:
    """True for the NVSMI LOG banner or typical -q keys laid out as `Key    : value`."""
    if _BANNER.search(text):
        return True
    hits = re.findall(r"(?m)^\s*(Attached GPUs|Product Name|GPU UUID|FB Memory Usage|"
                      r"Driver Version|CUDA Version|KMD Version|Persistence Mode|"
                      r"Remapped Rows|ECC Errors|Performance State)\s{2,}:?", text)
    return len(hits) >= 2 or bool(re.search(r"(?m)^\s{2,}GPU UUID\s+:\s+GPU-", text))


def parse(text: str) -> NvidiaSmiQ:
    """Parse nvidia-smi -q output; see the module docstring for the returned shape."""
    lines = lines_of(text, KIND)
    top, sections, real_sections = _tree(lines)
    keys = {n.key.lower() for n in _walk(top)} | {n.key.lower() for s in sections for n in _walk(s)}
    if not real_sections and not (keys & _MARKER_KEYS):
        failure = tool_failure(lines)
        if failure:
            raise ParseError(KIND, f"nvidia-smi did not run: {failure}")
        raise ParseError(KIND, "no nvidia-smi -q keys found (no 'Driver Version', "
                               "'Attached GPUs', 'GPU <bus id>', 'Product Name', 'GPU UUID'...)")
    driver = version_in(top.value_at("KMD Version") or top.value_at("Driver Version"))
    cuda = version_in(top.value_at("CUDA UMD Version") or top.value_at("CUDA Version"))
    attached = top.value_at("Attached GPUs")
    return NvidiaSmiQ(
        driver_version=driver,
        cuda_version=cuda,
        timestamp=top.value_at("Timestamp"),
        attached_gpus=int(attached) if attached and attached.isdigit() else None,
        gpus=tuple(_gpu(i, s) for i, s in enumerate(sections)),
    )


def _walk(node: _Node):
    for child in node.children:
        yield child
        yield from _walk(child)


def _tree(lines: list[str]) -> tuple[_Node, list[_Node], bool]:
    """The top-level node, one node per GPU section, and whether `GPU <bus id>` lines exist."""
    top = _Node("", None, -1)
    sections: list[_Node] = []
    headerless: _Node | None = None   # GPU being filled when the text has no section lines
    real_sections = False
    stack: list[_Node] = [top]
    for raw in lines:
        if not raw.strip() or is_elision(raw) or _BANNER.search(raw):
            continue
        if command_echo(raw, "nvidia-smi") is not None and _KEY_VALUE.match(raw) is None:
            continue
        line = raw if raw.startswith((" ", "\t")) else strip_prompt(raw)
        line = line.expandtabs(8)
        sec = _SECTION_GPU.match(line.strip()) if not line.startswith(" ") else None
        if sec:
            node = _Node("GPU", sec.group(1), 0)
            if not real_sections:
                sections.clear()   # drop GPUs guessed from keys above the first real section
            real_sections = True
            sections.append(node)
            stack = [node]
            headerless = None
            continue
        m = _KEY_VALUE.match(line)
        if m is None:
            # a section title (`ECC Errors`, `    Volatile`) has no colon
            title = line.strip()
            if not re.match(r"^[A-Za-z][\w ./()+-]*$", title):
                continue
            indent = len(line) - len(line.lstrip())
            node = _Node(title, None, indent)
        else:
            indent = len(m.group(1))
            node = _Node(m.group(2).strip(), m.group(3) if m.group(3) is not None else "", indent)
        if not real_sections and indent > 0 and node.key.lower() not in _TOP_KEYS \
                and not _under_top_section(stack):
            # grep'ed excerpt: GPU keys with no `GPU <bus id>` line above them
            if not node.value:
                continue
            if headerless is None or any(c.key == node.key for c in headerless.children):
                headerless = _Node("GPU", None, 0)
                sections.append(headerless)
            headerless.children.append(node)
            continue
        while len(stack) > 1 and stack[-1].indent >= indent:
            stack.pop()
        stack[-1].children.append(node)
        if node.value is None or node.value == "":
            stack.append(node)
    return top, sections, real_sections


def _under_top_section(stack: list[_Node]) -> bool:
    """True while filling a top-level section such as `vGPU Driver Capability`."""
    return len(stack) > 1 and stack[1].key.lower() in _TOP_KEYS


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    m = re.match(r"^\s*(\d+)", value)
    return int(m.group(1)) if m else None


def _float(value: str | None) -> float | None:
    if value is None:
        return None
    m = re.match(r"^\s*(\d+(?:\.\d+)?)", value)
    return float(m.group(1)) if m else None


def _first(node: _Node, *paths: tuple[str, ...]) -> str | None:
    for path in paths:
        value = node.value_at(*path)
        if value is not None:
            return value
    return None


def _gpu(index: int, s: _Node) -> Gpu:
    pcie = ("PCI", "GPU Link Info")
    return Gpu(
        index=index,
        name=s.value_at("Product Name"),
        memory_total_mib=_int(s.value_at("FB Memory Usage", "Total")),
        memory_used_mib=_int(s.value_at("FB Memory Usage", "Used")),
        memory_reserved_mib=_int(s.value_at("FB Memory Usage", "Reserved")),
        bus_id=s.value or s.value_at("PCI", "Bus Id") or s.value_at("Bus Id"),
        uuid=s.value_at("GPU UUID"),
        serial=s.value_at("Serial Number"),
        vbios_version=s.value_at("VBIOS Version"),
        brand=s.value_at("Product Brand"),
        architecture=s.value_at("Product Architecture"),
        minor_number=_int(s.value_at("Minor Number")),
        module_id=_int(_first(s, ("Module ID",), ("Module Id",))),
        persistence_mode=s.value_at("Persistence Mode"),
        mig_mode=_first(s, ("MIG Mode", "Current")),
        compute_mode=s.value_at("Compute Mode"),
        performance_state=s.value_at("Performance State"),
        clocks_event_reasons_active=_active_reasons(
            s.find("Clocks Event Reasons") or s.find("Clocks Throttle Reasons")),
        ecc_mode=_first(s, ("ECC Mode", "Current")),
        ecc_errors={"volatile": _ecc_side(s.find("ECC Errors", "Volatile")),
                    "aggregate": _ecc_side(s.find("ECC Errors", "Aggregate"))},
        retired_pages=_retired(s.find("Retired Pages")),
        remapped_rows=_remapped(s.find("Remapped Rows")),
        temperature_c=_int(s.value_at("Temperature", "GPU Current Temp")),
        power_draw_w=_float(_first(s, ("GPU Power Readings", "Power Draw"),
                                   ("GPU Power Readings", "Instantaneous Power Draw"),
                                   ("GPU Power Readings", "Average Power Draw"),
                                   ("Power Readings", "Power Draw"))),
        power_limit_w=_float(_first(s, ("GPU Power Readings", "Current Power Limit"),
                                    ("GPU Power Readings", "Power Limit"),
                                    ("Power Readings", "Power Limit"))),
        pcie_gen_current=_int(_first(s, pcie + ("PCIe Generation", "Current"))),
        pcie_gen_max=_int(_first(s, pcie + ("PCIe Generation", "Max"))),
        pcie_width_current=_int(_first(s, pcie + ("Link Width", "Current"))),
        pcie_width_max=_int(_first(s, pcie + ("Link Width", "Max"))),
    )


def _active_reasons(node: _Node | None) -> tuple[str, ...] | None:
    if node is None:
        return None
    return tuple(n.key for n in _walk(node)
                 if n.value is not None and n.value.strip().lower() == "active")


def _ecc_side(node: _Node | None) -> dict:
    """Sum the correctable / uncorrectable counters directly under Volatile or Aggregate."""
    out: dict = {"correctable": None, "uncorrectable": None}
    if node is None:
        return out
    # Old layout: Single Bit / Double Bit sub-sections with a Total each.
    single, double = node.find("Single Bit"), node.find("Double Bit")
    if single is not None or double is not None:
        out["correctable"] = _int(single.value_at("Total")) if single is not None else None
        out["uncorrectable"] = _int(double.value_at("Total")) if double is not None else None
        return out
    for child in node.children:
        if child.value is None or child.children:
            continue
        count = to_number(child.value)
        if not isinstance(count, int):
            continue
        key = child.key.lower()
        side = ("uncorrectable" if "uncorrectable" in key
                else "correctable" if "correctable" in key else None)
        if side is None:
            continue
        out[side] = (out[side] or 0) + count
    return out


def _retired(node: _Node | None) -> dict | None:
    if node is None:
        return None
    return {
        "single_bit_ecc": _int(_first(node, ("Single Bit ECC",),
                                      ("Single Bit ECC", "Retired Page Count"))),
        "double_bit_ecc": _int(_first(node, ("Double Bit ECC",),
                                      ("Double Bit ECC", "Retired Page Count"))),
        "pending": _first(node, ("Pending Page Blacklist",), ("Pending",)),
    }


def _yes_no(value: str | None) -> bool | None:
    if value is None:
        return None
    return {"yes": True, "no": False}.get(value.strip().lower())


def _remapped(node: _Node | None) -> dict | None:
    if node is None or (node.value is not None and node.value != "" and not node.children):
        return None
    histogram = node.find("Bank Remap Availability Histogram")
    return {
        "correctable": _int(node.value_at("Correctable Error")),
        "uncorrectable": _int(node.value_at("Uncorrectable Error")),
        "pending": _yes_no(node.value_at("Pending")),
        "failure": _yes_no(node.value_at("Remapping Failure Occurred")),
        "histogram": ({c.key.lower(): _int(c.value) for c in histogram.children}
                      if histogram is not None else None),
    }
