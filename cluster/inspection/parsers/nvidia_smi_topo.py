"""Parse `nvidia-smi topo -m` (the GPU/NIC connection matrix) into GPUs, links, NVLink and NICs.

Reads tab- or space-separated matrices of every generation: NIC columns named `NIC0..` with a
`NIC Legend` (`NIC0: mlx5_0`) or, in old drivers, named after the device (`mlx5_0`); optional
`CPU Affinity`, `NUMA Affinity` and `GPU NUMA ID` columns (empty cells allowed); the legend; old
`SOC` for today's `SYS`; prompts and command echoes; truncated pastes (rows missing).

Returned shape (`parse(text).to_dict()`):

    {
      "gpus": 8,                              # GPU columns in the header
      "nvlink": true | false | null,          # any GPU pair NV#: true; every pair shown and none
                                              # NV#: false; otherwise (1 GPU, rows cut) null
      "links": {"GPU0-GPU1": "NV18", ...},    # each GPU pair shown, lower index first
      "nics": ["mlx5_0", "NIC1", ...],        # NIC columns: legend name when shown, else the label
      "nic_legend": {"NIC0": "mlx5_0", ...},  # as printed; {} when the legend is absent
      "gpu_nic_paths": {"GPU0": {"NIC0": "PIX", ...}, ...},   # keyed by column label
      "gpu_nic": {"GPU0": {"nics": ["NIC0"], "names": ["mlx5_0"], "relation": "PIX"}, ...},
                                              # the closest NIC columns of each GPU row shown
                                              # (best of PIX, PXB, PHB, NODE, SYS; old SOC =
                                              # SYS), their legend names (null where the
                                              # legend is not printed; old mlx5_N columns
                                              # name themselves); {} without NIC columns;
                                              # nics [] and relation null when no cell ranks
      "affinity": {"GPU0": {"cpu_affinity": "0-79", "numa_affinity": "0", "gpu_numa_id": null}},
      "complete": true | false,               # every GPU row is shown
    }

Link values are kept as printed: X (self), NV# (# bonded NVLinks), PIX, PXB, PHB, NODE, SYS
(SOC in old drivers). Raises ParseError when no matrix header with GPU0 is found, no GPU row
follows it, or a row holds something that is not a link value (a last row cut short by the
paste is left out, and `complete` says so). Linear in its input: lines are cut at 4096
characters and split into tokens; patterns only ever see one token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cluster.base.errors import ParseError
from cluster.inspection.parsers._lines import MAX_LINE_CHARS, lines_of
from cluster.inspection.parsers._nvidia_text import is_missing, snake, tool_failure

KIND = "nvidia-smi-topo"

_AFFINITY = {"CPU Affinity": "cpu_affinity", "NUMA Affinity": "numa_affinity",
             "GPU NUMA ID": "gpu_numa_id"}
_MULTIWORD = (("GPU", "NUMA", "ID"), ("CPU", "Affinity"), ("NUMA", "Affinity"))
_LINK_VALUE = re.compile(r"^(?:X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC|PSB|C2C\d*|N/A)$")
_NVLINK = re.compile(r"^NV\d+$")
_GPU = re.compile(r"^GPU(\d+)$")
_DEVICE = re.compile(r"^(?:GPU\d+|NIC\d+|[A-Za-z][\w.-]*\d)$")
_LEGEND = re.compile(r"^(NIC\d{1,6}) {0,8}: {0,8}(\S{1,256})$")
_NIC_LABEL = re.compile(r"^NIC\d+$")
# NIC relations from nearest to farthest (SOC: old name of SYS)
_NIC_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4, "SOC": 4}


@dataclass(frozen=True)
class NvidiaSmiTopo:
    """The topology matrix (see the module docstring)."""

    gpus: int
    nvlink: bool | None
    links: dict = field(default_factory=dict)
    nics: tuple[str, ...] = ()
    nic_legend: dict = field(default_factory=dict)
    gpu_nic_paths: dict = field(default_factory=dict)
    affinity: dict = field(default_factory=dict)
    complete: bool = False
    gpu_nic: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "gpus": self.gpus,
            "nvlink": self.nvlink,
            "links": dict(self.links),
            "nics": list(self.nics),
            "nic_legend": dict(self.nic_legend),
            "gpu_nic_paths": {g: dict(p) for g, p in self.gpu_nic_paths.items()},
            "affinity": {g: dict(a) for g, a in self.affinity.items()},
            "complete": self.complete,
            "gpu_nic": {g: {"nics": list(v["nics"]), "names": list(v["names"]),
                            "relation": v["relation"]} for g, v in self.gpu_nic.items()},
        }


def detect(text: str) -> bool:
    """True when a header with GPU0 is followed by a `GPU0  X ...` row."""
    header = row = False
    for raw in text[:1_000_000].split("\n"):
        words = raw[:MAX_LINE_CHARS].split()
        if len(words) < 2 or words[0] != "GPU0":
            continue
        if words[1] == "X":
            row = True
        elif words[1] in ("GPU1", "NIC0") or re.fullmatch(r"mlx\d{1,4}_\d{1,4}", words[1]) \
                or (words[1] == "CPU" and len(words) > 2 and words[2] == "Affinity"):
            header = True
        if header and row:
            return True
    return False


def _tokens(line: str) -> list[str]:
    """Whitespace tokens with the multi-word column names glued back together."""
    words = line.split()
    out: list[str] = []
    i = 0
    while i < len(words):
        for group in _MULTIWORD:
            if tuple(words[i:i + len(group)]) == group:
                out.append(" ".join(group))
                i += len(group)
                break
        else:
            out.append(words[i])
            i += 1
    return out


def _header(lines: list[str]) -> tuple[int, list[str], list[str]]:
    """(line index, device columns, affinity columns) of the matrix header."""
    for i, line in enumerate(lines):
        tokens = _tokens(line)
        if not tokens or tokens[0] != "GPU0" or len(tokens) < 2:
            continue
        if _LINK_VALUE.match(tokens[1]):
            continue          # that is the GPU0 row, not the header
        devices: list[str] = []
        for token in tokens:
            if token in _AFFINITY or not _DEVICE.match(token):
                break
            devices.append(token)
        extra = tokens[len(devices):]
        if any(_LINK_VALUE.match(t) for t in extra):
            continue
        return i, devices, extra
    raise ParseError(KIND, "no topology matrix header (a line starting with GPU0 GPU1 ... / "
                           "GPU0 CPU Affinity) found")


def parse(text: str) -> NvidiaSmiTopo:
    """Parse nvidia-smi topo -m output; see the module docstring for the returned shape."""
    lines = [line[:MAX_LINE_CHARS] for line in lines_of(text, KIND)]
    try:
        at, devices, extra = _header(lines)
    except ParseError:
        failure = tool_failure(lines)
        if failure:
            raise ParseError(KIND, f"nvidia-smi did not run: {failure}") from None
        raise
    gpu_cols = [d for d in devices if _GPU.match(d)]
    nic_cols = [d for d in devices if not _GPU.match(d)]
    if not gpu_cols or gpu_cols != [f"GPU{i}" for i in range(len(gpu_cols))]:
        raise ParseError(KIND, f"GPU columns are not GPU0..GPUn: {gpu_cols}", line=at + 1)

    rows: dict[str, list[str]] = {}
    affinity: dict[str, dict] = {}
    legend: dict[str, str] = {}
    for number, line in enumerate(lines[at + 1:], start=at + 2):
        legend_entry = _LEGEND.match(line.strip())
        if legend_entry:
            legend[legend_entry.group(1)] = legend_entry.group(2)
            continue
        tokens = line.split()
        if not tokens or tokens[0] not in devices or tokens[0] in rows:
            continue
        values = tokens[1:1 + len(devices)]
        if len(values) < len(devices) or not all(_LINK_VALUE.match(v) for v in values):
            if len(values) < len(devices) and all(_LINK_VALUE.match(v) for v in values) \
                    and not any(_row_label(ln, devices) for ln in lines[number:]):
                break     # the paste was cut inside the last matrix row
            raise ParseError(KIND, f"row {tokens[0]} does not hold {len(devices)} link values "
                                   f"(X, NV#, PIX, PXB, PHB, NODE, SYS): {line.strip()[:100]!r}",
                             line=number)
        rows[tokens[0]] = values
        if _GPU.match(tokens[0]):
            rest = tokens[1 + len(devices):]
            cells = {_AFFINITY.get(name, snake(name)): (
                None if i >= len(rest) or is_missing(rest[i]) else rest[i])
                for i, name in enumerate(extra)}
            affinity[tokens[0]] = {**dict.fromkeys(_AFFINITY.values()), **cells}
    if not any(_GPU.match(r) for r in rows):
        raise ParseError(KIND, "matrix header found but no GPU row under it", line=at + 1)

    links = _links(rows, devices, gpu_cols)
    n = len(gpu_cols)
    if any(_NVLINK.match(v) for v in links.values()):
        nvlink: bool | None = True
    elif n >= 2 and len(links) == n * (n - 1) // 2:
        nvlink = False
    else:
        nvlink = None
    paths = {g: {nic: rows[g][devices.index(nic)] for nic in nic_cols}
             for g in gpu_cols if g in rows}
    return NvidiaSmiTopo(
        gpus=n,
        nvlink=nvlink,
        links=links,
        nics=tuple(legend.get(nic, nic) for nic in nic_cols),
        nic_legend=legend,
        gpu_nic_paths=paths,
        affinity=affinity,
        complete=all(g in rows for g in gpu_cols),
        gpu_nic=_gpu_nic(paths, legend) if nic_cols else {},
    )


def _gpu_nic(paths: dict[str, dict[str, str]], legend: dict[str, str]) -> dict[str, dict]:
    """Each GPU row's closest NIC columns, their names and the relation to them."""
    out: dict[str, dict] = {}
    for gpu, cells in paths.items():
        ranked = [(nic, _NIC_RANK[v]) for nic, v in cells.items() if v in _NIC_RANK]
        best = min((rank for _, rank in ranked), default=None)
        nics = [nic for nic, rank in ranked if rank == best]
        relation = next((cells[nic] for nic in nics), None)
        out[gpu] = {
            "nics": nics,
            "names": [legend.get(nic) or (None if _NIC_LABEL.match(nic) else nic) for nic in nics],
            "relation": "SYS" if relation == "SOC" else relation,
        }
    return out


def _row_label(line: str, devices: list[str]) -> bool:
    """True when the line starts with a device label of the matrix (a matrix row)."""
    tokens = line.split()
    return bool(tokens) and tokens[0] in devices


def _links(rows: dict[str, list[str]], devices: list[str], gpu_cols: list[str]) -> dict[str, str]:
    links: dict[str, str] = {}
    for i, a in enumerate(gpu_cols):
        for b in gpu_cols[i + 1:]:
            if a in rows:
                value = rows[a][devices.index(b)]
            elif b in rows:
                value = rows[b][devices.index(a)]
            else:
                continue
            links[f"{a}-{b}"] = value
    return links
