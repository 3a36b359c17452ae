"""Parse `nvcc --version` into the CUDA toolkit release and the compiler's own version and build.

Returned shape (`parse(text).to_dict()`):

    {
      "cuda_version": "12.5",                          # "Cuda compilation tools, release 12.5"
      "nvcc_version": "V12.5.82",                      # as printed after the release
      "build": "cuda_12.5.r12.5/compiler.34385749_0" | null,   # "Build ..." line (CUDA >= 11)
      "built_on": "Thu_Jun__6_02:18:23_PDT_2024" | null,
      "copyright_years": "2005-2024" | null,
    }

Raises ParseError when the text has no "Cuda compilation tools, release X.Y" line (not nvcc,
`nvcc: command not found`, truncated before that line).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from cluster.base.errors import ParseError
from cluster.inspection.parsers._lines import lines_of, unwrap
from cluster.inspection.parsers._nvidia_text import tool_failure

KIND = "nvcc"

_RELEASE = re.compile(
    r"Cuda compilation tools,\s*+release\s++(\d{1,4}+\.\d{1,4}+)(?:\s*+,\s*+(V?\d{1,6}+(?:\.\d{1,9}+){0,4}+))?",
    re.I)
_BUILD = re.compile(r"^\s*+Build\s++(\S++)\s*+$")
_BUILT_ON = re.compile(r"Built on\s++(\S++)")
_COPYRIGHT = re.compile(r"Copyright \(c\)\s*+(\d{4}(?:-\d{4})?)\s++NVIDIA", re.I)


@dataclass(frozen=True)
class Nvcc:
    """The CUDA toolkit version nvcc reports (see the module docstring)."""

    cuda_version: str
    nvcc_version: str | None
    build: str | None
    built_on: str | None
    copyright_years: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def detect(text: str) -> bool:
    """True for nvcc's banner or its release line."""
    return bool(re.search(r"Cuda compiler driver|Cuda compilation tools,\s*release", text, re.I))


def parse(text: str) -> Nvcc:
    """Parse nvcc --version output; see the module docstring for the returned shape."""
    lines = lines_of(unwrap(text), KIND)
    release = next((m for m in map(_RELEASE.search, lines) if m), None)
    if release is None:
        failure = tool_failure(lines)
        reason = f"nvcc did not run: {failure}" if failure else \
            "no 'Cuda compilation tools, release X.Y' line found"
        raise ParseError(KIND, reason)
    build = next((m.group(1) for m in map(_BUILD.match, lines) if m), None)
    built_on = next((m.group(1) for m in map(_BUILT_ON.search, lines) if m), None)
    years = next((m.group(1) for m in map(_COPYRIGHT.search, lines) if m), None)
    return Nvcc(cuda_version=release.group(1), nvcc_version=release.group(2), build=build,
                built_on=built_on, copyright_years=years)
