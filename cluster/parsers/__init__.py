"""Pure parsers: text -> typed data, one module per tool, and the registry of kinds.

Each module has `parse(text) -> <frozen dataclass with to_dict()>` and a cheap, specific
`detect(text) -> bool`; nccl also has `parse_file(path)` (streaming). Modules are imported
lazily by name, so one missing or broken module does not take the others down.

    PARSERS["ibstat"]            -> the cluster.parsers.ibstat module
    detect(text)                 -> "ibstat"   (ParseError("auto", ...) when nothing matches)
    parse("ibstat", text)        -> Ibstat(...)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from cluster.errors import ParseError

# kind (the fixture folder name, the --kind value) -> module under cluster.parsers
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
        raise ParseError(kind, f"parser module cluster.parsers.{MODULES[kind]} is not "
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


def detect(text: str) -> str:
    """The kind of a captured output, trying detectors from the most specific.

    A detector that is missing or raises is skipped. Raises ParseError("auto", ...) when
    none recognises the text.
    """
    if not isinstance(text, str) or not text.strip():
        raise ParseError("auto", "could not recognise the output: empty input")
    candidates = [text]
    unprefixed = _without_host_prefix(text)
    if unprefixed is not None:
        candidates.append(unprefixed)
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

    When the text carries a `host: ` prefix on every line (pdsh, clush, srun --label) and the
    parser refuses it, the text is parsed once more without the prefix.
    """
    module = load(kind)
    try:
        return module.parse(text)
    except ParseError:
        unprefixed = _without_host_prefix(text) if isinstance(text, str) else None
        if unprefixed is None:
            raise
        return module.parse(unprefixed)


def _without_host_prefix(text: str) -> str | None:
    """The text without a per-line `host: ` prefix, or None when it has none."""
    from cluster.parsers._lines import clean_lines

    head = text[:4_000_000]
    cleaned = "\n".join(clean_lines(head))
    plain = "\n".join(line.rstrip() for line in head.replace("\r\n", "\n").split("\n"))
    return cleaned if cleaned != plain and len(head) == len(text) else None


def parse_auto(text: str) -> tuple[str, Any]:
    """(kind, parsed) for a text whose kind is detected."""
    kind = detect(text)
    return kind, parse(kind, text)
