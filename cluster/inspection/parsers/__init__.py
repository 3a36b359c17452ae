"""Pure parsers: text -> typed data, one module per tool, and the registry of kinds.

Each module has `parse(text) -> <frozen dataclass with to_dict()>` and a cheap, specific
`detect(text) -> bool`; nccl also has `parse_file(path)` (streaming). Modules are imported
lazily by name, so one missing or broken module does not take the others down.

    PARSERS["ibstat"]            -> the cluster.inspection.parsers.ibstat module
    detect(text)                 -> "ibstat"   (ParseError("auto", ...) when nothing matches)
    parse("ibstat", text)        -> Ibstat(...)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from cluster.base.errors import ParseError
from cluster.inspection.parsers import _lines

# kind (the fixture folder name, the --kind value) -> module under cluster.inspection.parsers
MODULES: dict[str, str] = {
    "nvidia-smi": "nvidia_smi",
    "nvidia-smi-query": "nvidia_smi_query",
    "nvidia-smi-q": "nvidia_smi_q",
    "nvidia-smi-topo": "nvidia_smi_topo",
    "nvidia-smi-nvlink": "nvidia_smi_nvlink",
    "nvcc": "nvcc",
    "proc-driver-nvidia-version": "proc_driver_nvidia_version",
    "ibstat": "ibstat",
    "ibv_devinfo": "ibv_devinfo",
    "ibdev2netdev": "ibdev2netdev",
    "lsmod": "lsmod",
    "chronyc-tracking": "chronyc_tracking",
    "chronyc-sources": "chronyc_sources",
    "ntpq": "ntpq",
    "timedatectl": "timedatectl",
    "ulimit": "ulimit",
    "df-shm": "df_shm",
    "nccl": "nccl",
    "lspci": "lspci",
    "dmesg": "dmesg",
    "fabricmanager": "fabricmanager",
    "ip-addr": "ip_addr",
}

# Most specific first: a text that could pass two detectors goes to the stricter one.
# nccl logs are unmistakable and may embed anything; nvidia-smi -q and topo before the default
# table; the CSV query form is loose, so it comes late; chronyc sources before tracking (a
# sources paste often ends with a tracking report); fabric manager's journal before the kernel
# log (both are journal lines); lsmod/ulimit/df after the rest.
DETECT_ORDER: tuple[str, ...] = (
    "nccl",
    "nvidia-smi-q",
    "nvidia-smi-topo",
    "nvidia-smi-nvlink",
    "nvidia-smi",
    "nvcc",
    "proc-driver-nvidia-version",
    "ibv_devinfo",
    "ibstat",
    "ibdev2netdev",
    "chronyc-sources",
    "chronyc-tracking",
    "ntpq",
    "timedatectl",
    "fabricmanager",
    "lspci",
    "ip-addr",
    "dmesg",
    "ulimit",
    "df-shm",
    "lsmod",
    "nvidia-smi-query",
)

_loaded: dict[str, ModuleType] = {}


def load(kind: str) -> ModuleType:
    """The parser module for a kind; ParseError for an unknown kind or a module that won't import."""
    if kind in _loaded:
        return _loaded[kind]
    if kind not in MODULES:
        raise ParseError(kind, f"unknown kind; known kinds: {', '.join(sorted(MODULES))}")
    try:
        module = importlib.import_module(f"{__name__}.{MODULES[kind]}")
    except ImportError as exc:
        raise ParseError(kind, f"parser module cluster.inspection.parsers.{MODULES[kind]} is not "
                               f"available: {exc}") from exc
    _loaded[kind] = module
    return module


class _Registry(Mapping[str, ModuleType]):
    """kind -> module, importing each module on first access."""

    def __getitem__(self, kind: str) -> ModuleType:
        if kind not in MODULES:
            raise KeyError(kind)
        return load(kind)

    def __iter__(self) -> Iterator[str]:
        return iter(MODULES)

    def __len__(self) -> int:
        return len(MODULES)

    def __contains__(self, kind: object) -> bool:
        return kind in MODULES

    def __repr__(self) -> str:
        return f"PARSERS({', '.join(MODULES)})"


PARSERS: Mapping[str, ModuleType] = _Registry()

KINDS: tuple[str, ...] = tuple(MODULES)


def available(kind: str) -> bool:
    """Whether the kind's module imports."""
    try:
        load(kind)
    except ParseError:
        return False
    return True


# Kinds that no preflight check reads: `cluster parse` and the field kit read them for a person
# (each says something a check's own source already decides), so they stay parse-only.
PARSE_ONLY: Mapping[str, str] = {
    "chronyc-sources": "which time source is selected; the clock check reads chronyc tracking's "
                       "offset and sync state",
    "ibdev2netdev": "the HCA -> netdev map; nic-locality reads the topology and NCCL_IB_HCA",
    "ibv_devinfo": "port states like ibstat's; the infiniband check reads ibstat",
    "nvcc": "the CUDA toolkit on the node; what matters to vLLM's wheels is the driver's CUDA "
            "(the driver check)",
    "nvidia-smi-nvlink": "per-link NVLink speeds; the nvlink check reads `nvidia-smi topo -m`",
    "proc-driver-nvidia-version": "the kernel module's version; the driver check reads "
                                  "nvidia-smi's",
}

# Kinds whose parser reads a whole multi-host log itself (its own prefixes, every rank's lines).
WHOLE_TEXT_KINDS: frozenset[str] = frozenset({"nccl"})


def detect(text: str) -> str:
    """The kind of a captured output, trying detectors from the most specific.

    A fleet capture (ansible, pdsh/clush, salt) is recognised by its first host's output.
    A detector that is missing or raises is skipped. Raises ParseError("auto", ...) when
    none recognises the text.
    """
    if not isinstance(text, str) or not text.strip():
        raise ParseError("auto", "could not recognise the output: empty input")
    candidates = [_detect_head(text)]
    first = _first_host_text(text)
    if first is not None:
        candidates.append(_detect_head(first))
    for candidate in candidates:
        for kind in DETECT_ORDER:
            try:
                module = load(kind)
                if module.detect(candidate):
                    return kind
            except Exception:  # one broken detector must not hide the others
                continue
    raise ParseError("auto", "could not recognise the output of any known tool "
                             f"(kinds: {', '.join(KINDS)}); pass --kind")


def parse(kind: str, text: str) -> Any:
    """Parse text as the given kind; ParseError on an unknown kind or unreadable text.

    A node kind's text captured through a fleet tool (ansible ad-hoc header, pdsh/clush/srun
    prefix, dshbak or salt block) is unwrapped first; a capture of several hosts is refused
    (parse_hosts gives one result per host): one verdict must not mix two nodes.
    """
    module = load(kind)
    if kind in WHOLE_TEXT_KINDS or not isinstance(text, str):
        return module.parse(text)
    outputs = _lines.host_outputs(text)
    if len(outputs) > 1:
        names = ", ".join(o.host or "(unnamed)" for o in outputs[:5])
        more = ", ..." if len(outputs) > 5 else ""
        raise ParseError(kind, f"the capture holds the output of {len(outputs)} hosts "
                               f"({names}{more}); parse one host at a time")
    if outputs[0].host is None:
        try:
            return module.parse(text)
        except ParseError:
            plain = _lines.plain_text(text)   # CR, ANSI, `script` markers, line numbers
            if plain == text or plain == text.rstrip("\n"):
                raise
            try:
                return module.parse(plain)
            except ParseError:
                pass
            raise
    try:
        return module.parse(outputs[0].text)
    except ParseError:
        try:
            return module.parse(text)
        except ParseError:
            pass
        raise


def parse_hosts(kind: str, text: str) -> list[tuple[str | None, Any]]:
    """[(host, parsed or the ParseError)] for each host of a fleet capture (one entry, host
    None, for a plain text). Never raises ParseError for a host's text; raises it for an
    unknown kind."""
    module = load(kind)
    outputs = ([] if kind in WHOLE_TEXT_KINDS or not isinstance(text, str)
               else _lines.host_outputs(text))
    if len(outputs) <= 1:
        host = outputs[0].host if outputs else None
        try:
            return [(host, parse(kind, text))]
        except ParseError as exc:
            return [(host, exc)]
    results: list[tuple[str | None, Any]] = []
    for out in outputs:
        try:
            results.append((out.host, module.parse(out.text)))
        except ParseError as exc:
            results.append((out.host, exc))
    return results


# What detectors are shown: the start of the text without blank lines, each line cut, so that
# no detector's pattern can be made slow by a run of blank lines or one endless line.
_DETECT_CHARS = 1_000_000
_DETECT_LINES = 20_000


def _detect_head(text: str) -> str:
    lines = []
    for line in text[:_DETECT_CHARS].split("\n"):
        line = line[:_lines.MAX_LINE_CHARS].rstrip()
        if line.strip():
            lines.append(line)
            if len(lines) >= _DETECT_LINES:
                break
    return "\n".join(lines) + "\n"


def _first_host_text(text: str) -> str | None:
    """The first host's output of a fleet capture, or the cleaned text of a terminal capture
    (CR, ANSI, `script` markers), from its first 4 MB; None when cleaning changes nothing."""
    head = text[:4_000_000]
    outputs = _lines.host_outputs(head)
    if outputs[0].host is not None or len(outputs) > 1:
        return outputs[0].text
    plain = outputs[0].text
    return plain if plain != head and plain != head.rstrip("\n") else None
