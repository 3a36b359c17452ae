"""Parse `nvidia-smi -q` (the indented "key : value" report) into typed per-GPU data.

Reads the full report and its filtered forms (`-q -d MEMORY,ECC,...`, `-q -i N`, `-a`), the old
(R3xx-R4xx) and new (R450+, R550+ SRAM/DRAM ECC, R610+ `KMD Version` / `CUDA UMD Version`) key
names, the XML form (`nvidia-smi -q -x`, its tags mapped onto the same keys), and grep'ed
excerpts without the `GPU <bus id>` section lines (`nvidia-smi -q | grep UUID`,
`nvidia-smi -q | grep -A4 -i uncorr`): there a new GPU starts whenever a GPU-level key seen for
the current GPU comes again, grep's `--` separator closes the open sections, and counters whose
section line was cut (`Uncorrectable Error`, `Pending` of Remapped Rows; SRAM/DRAM counters
before an `Aggregate` section, which nvidia-smi prints after `Volatile`) are read into that
section; anything else without its section line is left out (null), never guessed.

Linear in its input: lines are cut at 4096 characters and split with string operations, no
pattern can backtrack over a line; XML with entity declarations is refused.

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
          "persistence_mode": "Enabled" | "Disabled" | null,  # as printed
          "persistence_mode_enabled": true | false | null,     # the same as a bool
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
          "ecc_uncorrectable_volatile": 0 | null,   # = ecc_errors.volatile.uncorrectable
          "ecc_uncorrectable_aggregate": 0 | null,  # = ecc_errors.aggregate.uncorrectable
          "remapped_rows_pending": true | false | null,   # "Remapped Rows" / "Pending"
          "remapped_rows_failure": true | false | null,   # / "Remapping Failure Occurred"
          "retired_pages_pending": true | false | null,   # "Pending Page Blacklist" Yes / No
          "fabric_state": "Completed" | "In Progress" | ... | null,   # "Fabric" / "State"
          "fabric_status": "Success" | ... | null,                    # "Fabric" / "Status"
          "fabric_health_summary": "Healthy" | "Unhealthy" | ... | null,  # "Health" / "Summary"
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
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from cluster.base.errors import ParseError
from cluster.inspection.parsers._lines import MAX_LINE_CHARS, lines_of, strip_prompt, to_number
from cluster.inspection.parsers._nvidia_text import (BUS_ID, command_echo, is_elision, is_missing,
                                                      tool_failure, version_in)

KIND = "nvidia-smi-q"

_SECTION_GPU = re.compile(r"^GPU\s{1,8}(" + BUS_ID + r")$")
_TITLE = re.compile(r"^[A-Za-z][\w ./()+-]*$")
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
                "gpu power readings", "power readings", "temperature", "nvsmi log",
                # ECC counters of a grep'ed excerpt (issue 26): read, their scope left null
                "sram correctable", "sram uncorrectable", "sram uncorrectable parity",
                "sram uncorrectable sec-ded", "dram correctable", "dram uncorrectable"}
# detect(): keys typical of -q, laid out as `Key    : value` (two or more spaces before the colon)
_DETECT_KEYS = ("Attached GPUs", "Product Name", "GPU UUID", "FB Memory Usage", "Driver Version",
                "CUDA Version", "KMD Version", "Persistence Mode", "Remapped Rows", "ECC Errors",
                "Performance State")
# Keys of the Remapped Rows section, read there even when a grep cut the section line.
_DETECT_TITLES = {"Clocks Throttle Reasons", "Clocks Event Reasons", "Remapped Rows", "Fabric",
                  "ECC Errors", "Retired Pages", "FB Memory Usage", "BAR1 Memory Usage"}
_REMAP_KEYS = {"correctable error", "uncorrectable error", "pending", "remapping failure occurred",
               "bank remap availability histogram"}
_REMAP_ONLY_KEYS = {"uncorrectable error", "remapping failure occurred"}
_ECC_COUNTER = re.compile(r"^(?:SRAM|DRAM) (?:Un)?correctable(?: [\w-]{1,16})?$", re.IGNORECASE)
_DETECT_SCAN_CHARS = 1_000_000


@dataclass(slots=True)
class _Node:
    """One line of the report: key, value (None for a section), children (indented below it)."""

    key: str
    value: str | None
    indent: int
    children: list["_Node"] = field(default_factory=list)
    # the first child of each lower-cased key, and how many children it was built from (a
    # section that grew since is indexed again): a GPU's ~45 lookups read a dict, not its list
    _index: dict[str, "_Node"] | None = field(default=None, repr=False, compare=False)
    _indexed: int = field(default=0, repr=False, compare=False)

    def child(self, name: str) -> "_Node | None":
        """The first child whose key is `name`, case aside."""
        index = self._index
        if index is None or self._indexed != len(self.children):
            index = {}
            for c in self.children:
                index.setdefault(c.key.lower(), c)
            self._index, self._indexed = index, len(self.children)
        return index.get(name.lower())

    def find(self, *path: str) -> "_Node | None":
        node: _Node | None = self
        for name in path:
            node = node.child(name)       # type: ignore[union-attr]
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
    persistence_mode_enabled: bool | None = None
    ecc_uncorrectable_volatile: int | None = None
    ecc_uncorrectable_aggregate: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    retired_pages_pending: bool | None = None
    fabric_state: str | None = None
    fabric_status: str | None = None
    fabric_health_summary: str | None = None
    ecc_unplaced: dict | None = None

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
    """True for the NVSMI LOG banner, the XML root, two typical -q keys as `Key    : value`,
    or a -q section title (`Remapped Rows`, `Clocks Event Reasons`, `Fabric`...) directly
    followed by a deeper `Key    : value` line (a grep'ed excerpt)."""
    if not isinstance(text, str):
        return False
    head = text[:_DETECT_SCAN_CHARS]
    if "NVSMI LOG" in head or "<nvidia_smi_log" in head:
        return True
    if "<" in head and _xml_fragment(head.split("\n", 2000)[:2000]):
        return True                 # a piece of `nvidia-smi -q -x` without its root (issue 26)
    hits = 0
    title_indent: int | None = None
    for raw in head.split("\n"):
        line = raw[:MAX_LINE_CHARS].rstrip().expandtabs(8)
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(stripped)
        if title_indent is not None and indent > title_indent and _is_aligned_key(stripped):
            return True
        title_indent = indent if stripped in _DETECT_TITLES else None
        if _is_detect_key_line(line):
            hits += 1
        if line.startswith("  ") and stripped.startswith("GPU UUID"):
            key, value = _key_value(line) or ("", "")
            if key == "GPU UUID" and value.startswith("GPU-"):
                return True
        if hits >= 2:
            return True
    return False


def _is_aligned_key(stripped: str) -> bool:
    """`HW Slowdown         : Active` (two or more blanks before the colon, as -q aligns)."""
    key, colon, _ = stripped.partition(":")
    return bool(colon) and key.endswith("  ") and bool(_TITLE.match(key.strip()))


def _is_detect_key_line(line: str) -> bool:
    """`    Product Name        : ...` (a known key, then two or more spaces, maybe a colon)."""
    stripped = line.lstrip()
    for key in _DETECT_KEYS:
        if stripped.startswith(key):
            rest = stripped[len(key):]
            return len(rest) >= 2 and rest[:2].isspace() and rest[:2] != "\n"
    return False


def parse(text: str) -> NvidiaSmiQ:
    """Parse nvidia-smi -q output (text or XML); see the module docstring for the shape."""
    lines = [line[:MAX_LINE_CHARS] for line in lines_of(text, KIND)]
    joined = "\n".join(lines)     # a needle without a newline is in it iff it is in a line
    # XML holds a '<' somewhere; the text report mostly does not, and skips the fragment test
    if "<" in joined and ("<nvidia_smi_log" in joined or _xml_fragment(lines)):
        top, sections, real_sections = _xml_tree(joined)
    else:
        top, sections, real_sections = _tree(lines, _noise_of(joined))
    if not real_sections and not _holds_a_marker(top, sections):
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


def _holds_a_marker(top: _Node, sections: list[_Node]) -> bool:
    """Whether a text without `GPU <bus id>` lines still reads as -q: a key only -q prints, or a
    GPU's Fabric State."""
    keys = {n.key.lower() for n in _walk(top)} | {n.key.lower() for s in sections for n in _walk(s)}
    return bool(keys & _MARKER_KEYS) or any(s.find("Fabric", "State") is not None for s in sections)


def _walk(node: _Node):
    """Every node below this one, depth first (iterative: indentation may nest deeply)."""
    stack = list(reversed(node.children))
    while stack:
        child = stack.pop()
        yield child
        stack.extend(reversed(child.children))


def _key_value(line: str) -> tuple[str, str] | None:
    """`  Key   : value` -> ("Key", "value"); None when the line has no `:` followed by a blank
    or the end (a section title, `GPU 00000000:18:00.0`), or the key is empty."""
    key, colon, value = line.partition(":")
    if not colon or (value and not value[0].isspace()):
        return None
    key = key.strip()
    if not key:
        return None
    return key, value.strip()


def _is_banner(line: str) -> bool:
    """`==============NVSMI LOG==============`"""
    if "NVSMI LOG" not in line:
        return False
    stripped = line.strip()
    return stripped.startswith("=") and stripped.endswith("=")


def _node_of(line: str, body: str | None = None) -> _Node | None:
    """The node a (prompt-stripped, tab-expanded) line stands for, or None for noise; `body`
    is the line without its indentation when the caller has it."""
    if body is None:
        body = line.lstrip()
    kv = _key_value(body)                       # the indentation holds no `:`
    indent = len(line) - len(body)
    if kv is None:
        # a section title (`ECC Errors`, `    Volatile`) has no colon
        title = body.rstrip()
        return _Node(title, None, indent) if _TITLE.match(title) else None
    return _Node(kv[0], kv[1], indent)


class _Headerless:
    """GPUs built from a grep'ed excerpt that has no `GPU <bus id>` lines."""

    def __init__(self, sections: list[_Node]):
        self.sections = sections
        self.gpu: _Node | None = None
        self.seen: set[str] = set()
        self.stack: list[_Node] = []

    def add(self, node: _Node) -> None:
        while len(self.stack) > 1 and self.stack[-1].indent >= node.indent:
            self.stack.pop()
        if self.gpu is None or (len(self.stack) <= 1 and node.key in self.seen):
            self.gpu = _Node("GPU", None, -1)
            self.sections.append(self.gpu)
            self.seen = set()
            self.stack = [self.gpu]
        if len(self.stack) == 1:
            self.seen.add(node.key)
        self.stack[-1].children.append(node)
        if not node.value:
            self.stack.append(node)

    def cut(self) -> None:
        """grep's `--`: the lines after it do not continue the sections open before it."""
        del self.stack[1:]


def _tree(lines: list[str], noise: "re.Pattern[str] | None") -> tuple[_Node, list[_Node], bool]:
    """The top-level node, one node per GPU section, and whether `GPU <bus id>` lines exist.

    Most lines of a report are an indented `Key : value` without a tab, an elision, a banner,
    a command echo or a grep separator: those go to _node_of as they are (no pattern); the
    rest through _clean_line first, which leaves such a line as it is. `noise` (_noise_of) finds
    the characters of those other lines that the text holds at all; None when it holds none."""
    top = _Node("", None, -1)
    sections: list[_Node] = []
    headerless = _Headerless(sections)   # GPUs when the text has no section lines
    real_sections = False
    stack: list[_Node] = [top]
    # a plain line read before, as (key, value, indent), None when noise: a report repeats most
    # of its lines once per GPU (`Idle : Not Active`, the counters at 0...)
    read: dict[str, tuple[str, str | None, int] | None] = {}
    for raw in lines:
        seen = read.get(raw, _UNSEEN)
        if seen is not _UNSEEN:
            node = None if seen is None else _Node(*seen)
        elif (body := _plain_body(raw, noise)) is not None:
            node = _node_of(raw, body)
            read[raw] = None if node is None else (node.key, node.value, node.indent)
        else:
            line = _clean_line(raw)
            if line is None:
                continue
            if line is _GREP_SEPARATOR:
                headerless.cut()
                continue
            sec = _SECTION_GPU.match(line.strip()) if not line.startswith(" ") else None
            if sec:
                node = _Node("GPU", sec.group(1), 0)
                if not real_sections:
                    sections.clear()   # drop GPUs guessed from keys above the first real section
                real_sections = True
                sections.append(node)
                stack = [node]
                continue
            node = _node_of(line)
        if node is None:
            continue
        if not real_sections and node.key.lower() not in _TOP_KEYS \
                and not _under_top_section(stack, node.indent):
            headerless.add(node)   # grep'ed excerpt: GPU keys with no `GPU <bus id>` above
            continue
        while len(stack) > 1 and stack[-1].indent >= node.indent:
            stack.pop()
        stack[-1].children.append(node)
        if not node.value:
            stack.append(node)
    return top, sections, real_sections


# What makes an indented line one for _clean_line: a tab, an elision's characters, the banner,
# a command echo (with blank lines and grep's `--`, which _plain_body tests itself).
_NOISE = ("\t", "...", "\u2026", "<", "NVSMI LOG", "nvidia-smi")


def _plain_body(raw: str, noise: "re.Pattern[str] | None") -> str | None:
    """An indented line's text without its indentation when _node_of can read the line as it
    is: not blank, not grep's `--`, none of the _NOISE the text holds (`noise`, _noise_of);
    None for a line _clean_line must see first."""
    if raw[:1] != " ":
        return None
    body = raw.lstrip()
    if not body or body.rstrip() == "--" or (noise is not None and noise.search(raw)):
        return None
    return body


def _noise_of(joined: str) -> "re.Pattern[str] | None":
    """A pattern of the _NOISE strings the text holds (the report mostly holds its banner
    alone), None when it holds none: _tree tests each line for those only."""
    present = [re.escape(s) for s in _NOISE if s in joined]
    return re.compile("|".join(present)) if present else None


_GREP_SEPARATOR = object()   # _clean_line's answer for grep's `--`
_UNSEEN = object()           # _tree: a line not read before


def _clean_line(raw: str) -> "str | object | None":
    """The line as _tree reads it (prompt stripped, tabs expanded, cut), _GREP_SEPARATOR for
    grep's `--`, None for a line that is noise (blank, elision, banner, command echo)."""
    stripped = raw.strip()
    if not stripped or is_elision(raw) or _is_banner(raw):
        return None
    if stripped == "--":
        return _GREP_SEPARATOR
    if "nvidia-smi" in raw and command_echo(raw, "nvidia-smi") is not None \
            and _key_value(raw) is None:
        return None
    line = raw if raw.startswith((" ", "\t")) else strip_prompt(raw)
    if "\t" in line:
        line = line.expandtabs(8)
    return line[:MAX_LINE_CHARS]


def _under_top_section(stack: list[_Node], indent: int) -> bool:
    """True while filling a top-level section such as `vGPU Driver Capability`."""
    return len(stack) > 1 and stack[1].key.lower() in _TOP_KEYS and indent > stack[1].indent


# ------------------------------------------------------------------ XML (`nvidia-smi -q -x`)

# XML tag -> the key the text report prints (tags not listed: underscores read as spaces).
_XML_KEYS = {
    "uuid": "GPU UUID", "serial": "Serial Number", "mig_mode": "MIG Mode",
    "current_mig": "Current", "current_ecc": "Current", "ecc_mode": "ECC Mode",
    "module_id": "Module ID", "gpu_module_id": "Module ID", "vbios_version": "VBIOS Version", "pci_bus_id": "Bus Id",
    "pci_gpu_link_info": "GPU Link Info", "pcie_gen": "PCIe Generation",
    "max_link_gen": "Max", "current_link_gen": "Current", "link_widths": "Link Width",
    "max_link_width": "Max", "current_link_width": "Current", "gpu_temp": "GPU Current Temp",
    "instant_power_draw": "Instantaneous Power Draw", "power_state": "Power State",
    "remapped_row_corr": "Correctable Error", "remapped_row_unc": "Uncorrectable Error",
    "remapped_row_pending": "Pending", "remapped_row_failure": "Remapping Failure Occurred",
    "remapped_row_histogram": "Bank Remap Availability Histogram",
    "row_remap_histogram_max": "Max", "row_remap_histogram_high": "High",
    "row_remap_histogram_partial": "Partial", "row_remap_histogram_low": "Low",
    "row_remap_histogram_none": "None",
    "multiple_single_bit_retirement": "Single Bit ECC", "double_bit_retirement": "Double Bit ECC",
    "retired_count": "Retired Page Count", "pending_blacklist": "Pending Page Blacklist",
    "clocks_throttle_reasons": "Clocks Throttle Reasons",
    "clocks_event_reasons": "Clocks Event Reasons",
}
# clocks_event_reason_<tag> / clocks_throttle_reason_<tag> -> the name the text report prints
_XML_REASONS = {
    "gpu_idle": "Idle", "applications_clocks_setting": "Applications Clocks Setting",
    "sw_power_cap": "SW Power Cap", "hw_slowdown": "HW Slowdown",
    "hw_thermal_slowdown": "HW Thermal Slowdown",
    "hw_power_brake_slowdown": "HW Power Brake Slowdown", "sync_boost": "Sync Boost",
    "sw_thermal_slowdown": "SW Thermal Slowdown",
    "display_clocks_setting": "Display Clock Setting",
}
_XML_MAX_DEPTH = 64


def _xml_key(tag: str) -> str:
    for prefix in ("clocks_event_reason_", "clocks_throttle_reason_"):
        if tag.startswith(prefix) and not tag.startswith(("clocks_event_reasons",
                                                          "clocks_throttle_reasons")):
            suffix = tag[len(prefix):]
            return _XML_REASONS.get(suffix, suffix.replace("_", " "))
    return _XML_KEYS.get(tag, tag.replace("_", " "))


def _xml_events(text: str):
    """(event, element) pairs of the XML up to the first error (a paste cut short)."""
    parser = ET.XMLPullParser(events=("start", "end"))
    try:
        parser.feed(text)
        parser.close()
    except ET.ParseError:
        pass
    events = parser.read_events()
    while True:
        try:
            yield next(events)
        except (StopIteration, ET.ParseError):
            return


_XML_TAG_LINE = re.compile(r"^\s{0,64}<(/?)([a-z][a-z0-9_]{0,63})(?: id=\"[^\"]{0,64}\")?>")


def _xml_fragment(lines: list[str]) -> bool:
    """A piece of `nvidia-smi -q -x` without its root (issue 26): a `<gpu id=...>` element, or
    a section (`<ecc_errors>`, `<remapped_rows>` ...) pasted alone: most non-blank lines are
    lower-case XML tags and at least one names a key the report prints."""
    tags = keys = rows = 0
    for line in lines[:2000]:
        if not line.strip():
            continue
        rows += 1
        m = _XML_TAG_LINE.match(line)
        if m:
            tags += 1
            if not m.group(1) and (m.group(2) == "gpu" or _xml_key(m.group(2)).lower() in _MARKER_KEYS
                                   or m.group(2) in _XML_KEYS):
                keys += 1
    return keys > 0 and tags * 10 >= rows * 8


def _balanced_lines(text: str) -> str:
    """A fragment cut inside an element starts with that element's children and its closing
    tag: drop closing-tag lines that close nothing opened in the fragment (nvidia-smi prints one
    tag per line), so the XML parser reads on past them. One pass over the lines."""
    out: list[str] = []
    opened: list[str] = []
    count: dict[str, int] = {}              # tag -> times open (membership in O(1))
    for line in text.split("\n"):
        m = _XML_TAG_LINE.match(line)
        if m and not m.group(1) and "</" not in line and not line.rstrip().endswith("/>"):
            opened.append(m.group(2))
            count[m.group(2)] = count.get(m.group(2), 0) + 1
        elif m and m.group(1):
            if not count.get(m.group(2)):
                continue                    # closes an element opened before the fragment
            while opened:                   # every tag is pushed and popped once: linear
                tag = opened.pop()
                count[tag] -= 1
                if tag == m.group(2):
                    break
        out.append(line)
    return "\n".join(out)


def _xml_tree(text: str) -> tuple[_Node, list[_Node], bool]:
    """The same tree as _tree, from `nvidia-smi -q -x`; a paste cut short keeps what came. A
    fragment without the root is read inside one (and, without a `<gpu>` element, inside a GPU
    whose bus id is not shown)."""
    if re.search(r"<!ENTITY", text, re.I):
        raise ParseError(KIND, "XML with entity declarations is refused")
    if "<nvidia_smi_log" not in text:
        body = _balanced_lines(re.sub(r"^\s{0,16}<\?xml[^>]{0,200}>", "", text.lstrip(), count=1))
        text = ("<nvidia_smi_log>" + (body if "<gpu" in body else "<gpu>" + body + "</gpu>")
                + "</nvidia_smi_log>")
    start = text.find("<nvidia_smi_log")
    decl = text.rfind("<?xml", 0, start)
    end = text.find("</nvidia_smi_log>", start)
    stop = end + len("</nvidia_smi_log>") if end >= 0 else len(text)
    top = _Node("", None, -1)
    sections: list[_Node] = []
    stack: list[_Node] = []
    for event, elem in _xml_events(text[decl if decl >= 0 else start:stop]):
        if event == "start":
            if not stack:
                stack.append(top)
                continue
            if len(stack) > _XML_MAX_DEPTH:
                raise ParseError(KIND, f"XML nested deeper than {_XML_MAX_DEPTH} levels")
            if len(stack) == 1 and elem.tag == "gpu":
                node = _Node("GPU", elem.get("id"), 0)
                sections.append(node)
            else:
                node = _Node(_xml_key(elem.tag), None, len(stack))
                stack[-1].children.append(node)
            stack.append(node)
        else:
            node = stack.pop() if stack else None
            if node is not None and node is not top and node.key != "GPU" and not node.children:
                node.value = (elem.text or "").strip()
            elem.clear()
    if not stack and not sections and not top.children:
        raise ParseError(KIND, "XML without an <nvidia_smi_log> element")
    for node in sections:
        if node.value is not None and not re.fullmatch(BUS_ID, node.value):
            node.value = None
    return top, sections, bool(sections)


# ------------------------------------------------------------------ per GPU


_LEADING_DIGITS = re.compile(r"^\s*(\d{1,18})")


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    m = _LEADING_DIGITS.match(value)
    return int(m.group(1)) if m else None


def _float(value: str | None) -> float | None:
    if value is None:
        return None
    m = re.match(r"^\s*(\d{1,18}(?:\.\d{1,18})?)", value)
    return float(m.group(1)) if m else None


def _first(node: _Node, *paths: tuple[str, ...]) -> str | None:
    for path in paths:
        value = node.value_at(*path)
        if value is not None:
            return value
    return None


def _enabled(value: str | None) -> bool | None:
    if value is None:
        return None
    return {"enabled": True, "disabled": False}.get(value.strip().lower())


def _gpu(index: int, s: _Node) -> Gpu:
    pcie = ("PCI", "GPU Link Info")
    ecc_volatile, ecc_aggregate = _ecc_nodes(s)
    ecc_errors = {"volatile": _ecc_side(ecc_volatile), "aggregate": _ecc_side(ecc_aggregate)}
    retired = _retired(s.find("Retired Pages"))
    remapped = _remapped(s.find("Remapped Rows") or _orphan_remapped(s))
    retired_pending = (retired or {}).get("pending") or s.value_at("Pending Page Blacklist")
    persistence = s.value_at("Persistence Mode")
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
        persistence_mode=persistence,
        mig_mode=_first(s, ("MIG Mode", "Current")),
        compute_mode=s.value_at("Compute Mode"),
        performance_state=s.value_at("Performance State"),
        clocks_event_reasons_active=_active_reasons(
            s.find("Clocks Event Reasons") or s.find("Clocks Throttle Reasons")),
        ecc_mode=_first(s, ("ECC Mode", "Current")),
        ecc_errors=ecc_errors,
        retired_pages=retired,
        remapped_rows=remapped,
        temperature_c=_int(_first(s, ("Temperature", "GPU Current Temp"),
                                  ("Temperature", "Gpu"))),   # R304: "Gpu"
        power_draw_w=_float(_first(s, ("GPU Power Readings", "Power Draw"),
                                   ("GPU Power Readings", "Instantaneous Power Draw"),
                                   ("GPU Power Readings", "Average Power Draw"),
                                   ("Power Readings", "Power Draw"))),
        power_limit_w=_float(_first(s, ("GPU Power Readings", "Current Power Limit"),
                                    ("GPU Power Readings", "Power Limit"),
                                    ("Power Readings", "Power Limit"))),
        # a piece of the report cut above `PCI` / `GPU Link Info` (issue 26) still shows these
        # sections by their own titles, which -q prints nowhere else
        pcie_gen_current=_int(_first(s, pcie + ("PCIe Generation", "Current"), ("PCIe Generation", "Current"))),
        pcie_gen_max=_int(_first(s, pcie + ("PCIe Generation", "Max"), ("PCIe Generation", "Max"))),
        pcie_width_current=_int(_first(s, pcie + ("Link Width", "Current"), ("Link Width", "Current"))),
        pcie_width_max=_int(_first(s, pcie + ("Link Width", "Max"), ("Link Width", "Max"))),
        persistence_mode_enabled=_enabled(persistence),
        ecc_uncorrectable_volatile=ecc_errors["volatile"]["uncorrectable"],
        ecc_uncorrectable_aggregate=ecc_errors["aggregate"]["uncorrectable"],
        remapped_rows_pending=remapped["pending"] if remapped else None,
        remapped_rows_failure=remapped["failure"] if remapped else None,
        retired_pages_pending=_yes_no(retired_pending),
        fabric_state=s.value_at("Fabric", "State"),
        fabric_status=s.value_at("Fabric", "Status"),
        fabric_health_summary=s.value_at("Fabric", "Health", "Summary"),
        ecc_unplaced=_ecc_unplaced(s, ecc_volatile, ecc_aggregate),
    )


def _ecc_unplaced(s: _Node, volatile: _Node | None, aggregate: _Node | None) -> dict | None:
    """ECC counters shown without the `Volatile` / `Aggregate` line that says which they count
    (`nvidia-smi -q | grep -i uncorr` keeps `SRAM Uncorrectable : 5` alone): their sums, and
    why the volatile and aggregate counts stay null. None when every counter is placed."""
    placed = {id(c) for side in (volatile, aggregate) if side is not None for c in side.children}
    orphans = [c for c in s.children if c.value and _ECC_COUNTER.match(c.key) and id(c) not in placed]
    ecc = s.find("ECC Errors")
    if ecc is not None:
        orphans += [c for c in ecc.children if c.value and _ECC_COUNTER.match(c.key)]
    if not orphans:
        return None
    sums = _ecc_side(_Node("", None, 0, orphans))
    return {**sums, "reason": "ECC counters shown without their Volatile/Aggregate section line: "
                              "which of the two they count is not shown"}


def _ecc_nodes(s: _Node) -> tuple[_Node | None, _Node | None]:
    """The Volatile and Aggregate ECC sections; in a grep'ed excerpt without the `ECC Errors`
    line, the sections at GPU level, and counters cut from their `Volatile` line but followed
    by `Aggregate` (nvidia-smi prints Volatile first) read as Volatile."""
    volatile, aggregate = s.find("ECC Errors", "Volatile"), s.find("ECC Errors", "Aggregate")
    if s.value is not None or s.find("ECC Errors") is not None:
        return volatile, aggregate
    volatile, aggregate = s.find("Volatile"), s.find("Aggregate")
    if volatile is None and aggregate is not None:
        before = s.children[:s.children.index(aggregate)]
        orphans = [c for c in before if c.value and _ECC_COUNTER.match(c.key)]
        if orphans:
            volatile = _Node("Volatile", None, aggregate.indent, orphans)
    return volatile, aggregate


def _orphan_remapped(s: _Node) -> _Node | None:
    """Remapped Rows counters of a grep'ed excerpt whose `Remapped Rows` line was cut: the run
    of its keys around `Uncorrectable Error` / `Remapping Failure Occurred` at GPU level."""
    if s.value is not None:
        return None
    children = s.children
    anchor = next((i for i, c in enumerate(children) if c.key.lower() in _REMAP_ONLY_KEYS), None)
    if anchor is None:
        return None
    lo = anchor
    while lo > 0 and children[lo - 1].key.lower() in _REMAP_KEYS:
        lo -= 1
    hi = anchor
    while hi + 1 < len(children) and children[hi + 1].key.lower() in _REMAP_KEYS:
        hi += 1
    return _Node("Remapped Rows", None, children[anchor].indent, children[lo:hi + 1])


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
        count = to_number(child.value[:64])
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
