"""What the NVIDIA tools print around their data: command echoes, elisions, tool errors, N/A; and
the one pattern of the PCI bus id they all print (BUS_ID).

Private helper of nvidia_smi, nvidia_smi_q, nvidia_smi_query, nvidia_smi_topo, nvidia_smi_nvlink,
nvcc and proc_driver_nvidia_version. Pure functions on strings; nothing here knows a format. The
text clean-up itself (lines, ANSI colours, CRLF, prompts, numbers) is _lines.py's.
"""

from __future__ import annotations

import re

# The PCI bus id the NVIDIA tools print (`00000000:17:00.0`: a domain of 4 to 8 hex digits).
BUS_ID = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]"

# Lines an author put in to show that something was cut: `[...]`, `...`, `....`, `(...)`, `<snip>`.
_ELISION = re.compile(
    r"^\s*(?:\[\s*\.{3,}\s*\]|\(\s*\.{3,}\s*\)|\.{3,}|…|<\s*snip(?:ped)?\s*>)\s*$", re.I)

# What the NVIDIA tools print instead of their output when they cannot run.
_TOOL_FAILURES = (
    re.compile(r"NVIDIA-SMI has failed.*", re.I),
    re.compile(r"Failed to initialize NVML.*", re.I),
    re.compile(r"Unable to determine the device handle.*", re.I),
    re.compile(r"Driver/library version mismatch.*", re.I),
    re.compile(r"(?:nvidia-smi|nvcc)\S*:\s*(?:command )?not found.*", re.I),
    re.compile(r"Command '(?:nvidia-smi|nvcc)' not found.*", re.I),
    re.compile(r"No such file or directory.*", re.I),
)


def is_elision(line: str) -> bool:
    """True for a line an author inserted to mark cut text (`[...]`, `...`)."""
    # every form holds one of these: the pattern is tried only on such lines (a hot loop)
    if "..." not in line and "\u2026" not in line and "<" not in line:
        return False
    return bool(_ELISION.match(line))


def command_echo(line: str, tool: str) -> str | None:
    """If the line is an echoed command line running `tool`, the command from the tool name on.

    `tool` is matched as a word, optionally after a path (`/usr/bin/nvidia-smi`), anywhere after a
    prompt, `sudo`, `watch -n 1` and the like. Returns None for any other line.
    """
    m = re.search(r"(?:^|[\s/$#>;|&(`])(" + re.escape(tool) + r")(?=\s|$)(.*)$", line)
    if m is None:
        return None
    return (m.group(1) + m.group(2)).strip()


def tool_failure(lines: list[str]) -> str | None:
    """The first line where an NVIDIA tool says it could not run (driver not loaded...), or None."""
    for line in lines:
        for pattern in _TOOL_FAILURES:
            m = pattern.search(line)
            if m:
                return m.group(0).strip()
    return None


_MISSING = {"n/a", "[n/a]", "na", "not supported", "[not supported]", "not found", "[not found]",
            "unknown", "[unknown]", "unknown error", "[unknown error]", "not available",
            "[not available]", "insufficient permissions", "[insufficient permissions]",
            "gpu requires reset", "[gpu requires reset]", "gpu is lost", "[gpu is lost]",
            "err!", "-", ""}


def is_missing(value: str | None) -> bool:
    """True for the placeholders NVIDIA tools print where they have no value (N/A, [N/A], ...)."""
    return value is None or value.strip().lower() in _MISSING


def version_in(value: str | None) -> str | None:
    """The first dotted version number in value (`"12.4"`, `"550.90.12"`), or None."""
    if value is None or is_missing(value):
        return None
    m = re.search(r"\d+(?:\.\d+)+", value)
    return m.group(0) if m else None


_NOT_SNAKE = re.compile(r"[^0-9a-z]+")


def snake(key: str) -> str:
    """`"Replay Errors"` -> `"replay_errors"`, `"P2P is supported"` -> `"p2p_is_supported"`."""
    return _NOT_SNAKE.sub("_", key.strip().lower()).strip("_")
