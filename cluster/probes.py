"""Probes: many read-only commands in one SSH round trip per node, split back into per-command outputs.

A probe is (name, shell command). `probe_script` wraps them into one bash script that prints,
for each probe, a begin marker, the command's stdout, its stderr lines (prefixed), and an end
marker carrying the exit code; every probe runs under `timeout` so one hung tool (a wedged
nvidia-smi) cannot eat the node's whole budget. `split_probe_output` is the pure inverse.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Iterable, Mapping

from cluster.errors import ParseError

_MARK = "@@cluster-probe@@"
_ERR = "@@cluster-stderr@@ "
_END_RE = re.compile(rf"^{re.escape(_MARK)} (\S+) end (-?\d+)$")
_BEGIN_RE = re.compile(rf"^{re.escape(_MARK)} (\S+) begin$")
NOT_FOUND = 127
TIMED_OUT = 124


@dataclass(frozen=True)
class Probe:
    name: str
    command: str


@dataclass(frozen=True)
class ProbeOutput:
    """What one probe printed. exit_code 127: command not found; 124: timed out."""

    name: str
    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def missing_tool(self) -> bool:
        return self.exit_code == NOT_FOUND or "command not found" in self.stderr \
            or "No such file or directory" in self.stderr and not self.stdout.strip()

    @property
    def timed_out(self) -> bool:
        return self.exit_code == TIMED_OUT


def probe_script(probes: Iterable[Probe], per_probe_timeout: float = 20) -> str:
    """One bash command line running every probe in order, read-only, with markers."""
    parts = ["export LC_ALL=C"]
    for p in probes:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", p.name):
            raise ValueError(f"bad probe name {p.name!r}")
        body = f"timeout -k 2 {per_probe_timeout:g} bash -c {shlex.quote(p.command)}"
        parts.append(
            f"echo '{_MARK} {p.name} begin'; "
            f"{{ {body} 2>&1 1>&3 3>&- | sed -u 's/^/{_ERR}/'; rc=${{PIPESTATUS[0]}}; }} 3>&1; "
            f"printf '\\n{_MARK} {p.name} end %s\\n' \"$rc\"")
    # All output is gathered on the node and written at once: streamed, every line of every
    # probe was its own SSH packet (through a bastion, twice), which cost the laptop more CPU
    # than everything else in a preflight. The trailing "." keeps $(...) from eating newlines.
    script = "\n".join(parts)
    return "bash -c " + shlex.quote(
        f"export LC_ALL=C; out=$({script}\necho .); printf '%s' \"${{out%.}}\"")


def split_probe_output(text: str, probes: Iterable[Probe]) -> dict[str, ProbeOutput]:
    """Inverse of probe_script: {probe name: ProbeOutput}. Probes that never ended are absent."""
    commands = {p.name: p.command for p in probes}
    out: dict[str, ProbeOutput] = {}
    current: str | None = None
    lines_out: list[str] = []
    lines_err: list[str] = []
    for line in text.splitlines():
        begin = _BEGIN_RE.match(line)
        if begin:
            current, lines_out, lines_err = begin.group(1), [], []
            continue
        end = _END_RE.match(line)
        if end and current == end.group(1):
            if lines_out and lines_out[-1] == "":
                lines_out.pop()  # the newline printf added before the end marker
            out[current] = ProbeOutput(current, commands.get(current, ""), int(end.group(2)),
                                       "\n".join(lines_out) + ("\n" if lines_out else ""),
                                       "\n".join(lines_err) + ("\n" if lines_err else ""))
            current = None
            continue
        if current is None:
            continue
        if line.startswith(_ERR):
            lines_err.append(line[len(_ERR):])
        else:
            lines_out.append(line)
    return out


def require(outputs: Mapping[str, ProbeOutput], name: str) -> ProbeOutput:
    try:
        return outputs[name]
    except KeyError:
        raise ParseError("probe", f"no output for probe {name!r} (the node stopped answering?)") \
            from None
