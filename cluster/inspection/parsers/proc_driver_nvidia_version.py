"""Parse `cat /proc/driver/nvidia/version` into the loaded kernel driver's version and flavour.

The file's first line names the module and its version; the flavour is in the wording:

    NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  565.57.01  Release Build  (...)  <date>
    NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023
    GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)

Returned shape (`parse(text).to_dict()`):

    {
      "driver_version": "565.57.01",
      "kernel_module": "open" | "proprietary" | null,   # "Open Kernel [...] Module" -> open;
                                                        # another "... Kernel Module" -> proprietary
      "module_description": "NVIDIA UNIX Open Kernel Module for x86_64",   # as printed
      "arch": "x86_64" | "aarch64" | ... | null,
      "build_type": "Release Build" | null,
      "builder": "dvs-builder@U16-A24-9-2" | null,
      "build_date": "Thu Oct 10 12:15:00 UTC 2024" | null,
      "gcc": "gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)" | null,   # "GCC version:" line
      "gcc_version": "13.3.0" | null,
    }

Raises ParseError when there is no `NVRM version:` line with a version number (driver not
loaded: `cat: /proc/driver/nvidia/version: No such file or directory`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from cluster.base.errors import ParseError
from cluster.inspection.parsers._lines import lines_of, unwrap
from cluster.inspection.parsers._nvidia_text import tool_failure

KIND = "proc-driver-nvidia-version"

_NVRM = re.compile(r"NVRM version:\s*+(.*)$")
# The description up to the first "Kernel Module" (str.find), then anchored bounded patterns.
_AFTER_MODULE = re.compile(r"(?:\s++for\s++(?P<arch_for>\S++))?\s++"
                           r"(?P<version>\d{1,6}+\.\d{1,6}+(?:\.\d{1,6}+){0,4}+)\b\s*+(?P<rest>.*)$")
_ARCH_BEFORE = re.compile(r"(?<!Open)\s(?!Open\b|UNIX\b)(\S++)\s++Kernel Module")
_BUILD_TYPE = re.compile(r"^((?:Release|Debug|Develop)\s++Build)\s*+")
_BUILDER = re.compile(r"^\(([^)]*+)\)\s*+")
_GCC = re.compile(r"GCC version:(.*)$")


def _module_match(nvrm: str) -> tuple[str, str | None, str, str] | None:
    """(description, arch after "for", version, rest) of the NVRM line's text, or None."""
    at = nvrm.find("Kernel Module")
    if at < 0:
        return None
    m = _AFTER_MODULE.match(nvrm, at + len("Kernel Module"))
    if m is None:
        return None
    desc = nvrm[:m.start("version")].rstrip()
    return desc, m.group("arch_for"), m.group("version"), m.group("rest")


@dataclass(frozen=True)
class ProcDriverNvidiaVersion:
    """The kernel driver named in /proc/driver/nvidia/version (see the module docstring)."""

    driver_version: str
    kernel_module: str | None
    module_description: str
    arch: str | None
    build_type: str | None
    builder: str | None
    build_date: str | None
    gcc: str | None
    gcc_version: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def detect(text: str) -> bool:
    """True for the file's `NVRM version:` line."""
    return bool(re.search(r"NVRM version:\s*NVIDIA", text))


def parse(text: str) -> ProcDriverNvidiaVersion:
    """Parse /proc/driver/nvidia/version; see the module docstring for the returned shape."""
    lines = lines_of(unwrap(text), KIND)
    found = [(i, m) for i, m in enumerate(map(_NVRM.search, lines), start=1) if m]
    if not found:
        failure = tool_failure(lines)
        raise ParseError(KIND, f"driver not loaded or file missing: {failure}" if failure
                         else "no 'NVRM version:' line found")
    number, nvrm = found[0]
    module = _module_match(nvrm.group(1).strip())
    if module is None:
        raise ParseError(KIND, "no '<...> Kernel Module  <version>' on the NVRM line", line=number)
    raw_desc, arch, version, rest = module
    desc = re.sub(r"\s+", " ", raw_desc).strip()
    if arch is None:
        before = _ARCH_BEFORE.search(desc)
        arch = before.group(1) if before else None
    if re.search(r"\bOpen Kernel\b", desc, re.I):
        flavour: str | None = "open"
    elif re.search(r"\bKernel Module\b", desc):
        flavour = "proprietary"
    else:
        flavour = None
    rest = rest.strip()
    build_type = builder = None
    m = _BUILD_TYPE.match(rest)
    if m:
        build_type, rest = m.group(1), rest[m.end():]
    m = _BUILDER.match(rest)
    if m:
        builder, rest = m.group(1), rest[m.end():]
    gcc = next((m.group(1).strip() for m in map(_GCC.search, lines) if m), None) or None
    gcc_version = None
    if gcc:
        v = re.search(r"version\s++(\d{1,6}+(?:\.\d{1,6}+){1,4}+)", gcc)
        gcc_version = v.group(1) if v else None
    return ProcDriverNvidiaVersion(
        driver_version=version,
        kernel_module=flavour,
        module_description=desc,
        arch=arch,
        build_type=build_type,
        builder=builder,
        build_date=re.sub(r"\s+", " ", rest).strip() or None,
        gcc=gcc,
        gcc_version=gcc_version,
    )
