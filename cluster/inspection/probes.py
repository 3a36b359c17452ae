"""Probes: many read-only commands in one SSH round trip per node, split back into per-command outputs.

A probe is (name, shell command). `probe_script` wraps them into one bash script that runs
every probe at the same time, each under `timeout` and with its stdout and stderr in files of
a private temporary directory (mktemp -d), so one hung tool (a wedged nvidia-smi) costs only
the checks that read it: the script waits at most the probe timeout (plus the kill grace) for
all of them, then prints every probe's output, the unfinished ones as timed out (exit 124)
with what they printed so far. What it prints is bounded on the node: per probe and stream
at most `node_output.probe_bytes` (its head and tail, the cut said in a marker line: "N bytes
cut"), and a stream may grow to `node_output.probe_file_bytes` in the temporary directory
(`ulimit -f`: a tool writing more is stopped there).

Every line of a probe's output is printed with a prefix (`|` stdout, `!` stderr) and the
markers start with `@@cluster-probe@@`, so no output can forge another probe's (a tool that
prints a marker line prints `|@@cluster-probe@@ ...`). `split_probe_output` is the pure,
bounded inverse: it keeps at most the same head and tail per stream, whatever a node sends.
"""

from __future__ import annotations

import re
import shlex
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

from cluster.base.errors import ParseError
from cluster.nodes.kept import cut_note

_MARK = "@@cluster-probe@@"
_OUT, _ERR = "|", "!"
_END_RE = re.compile(rf"{re.escape(_MARK)} (\S+) end (-?\d+)")
_BEGIN_RE = re.compile(rf"{re.escape(_MARK)} (\S+) begin")
_CUT_RE = re.compile(rf"{re.escape(_MARK)} (\S+) cut ([|!]) (\d+) bytes cut")
_NO_TMP_RE = re.compile(rf"{re.escape(_MARK)} - no-tmp (.*)")
NOT_FOUND = 127
TIMED_OUT = 124
KILL_GRACE_S = 2           # `timeout -k`: SIGKILL this long after SIGTERM
COLLECT_SLACK_S = 2        # the script's wait beyond the probe timeout and the kill grace
POLL_S = 0.05


def _limit(key: str) -> int:
    from cluster.base.bounds import bound
    return int(bound("node_output", key))


@dataclass(frozen=True)
class Probe:
    """One read of a node: its name and shell command. `after_the_others`: it starts once
    every other probe of the script has ended (bounded by LATE_TIMEOUT_S), for a probe that
    changes what they would read (the reachability listener binds the ports the ports check
    lists)."""

    name: str
    command: str
    after_the_others: bool = False


@dataclass(frozen=True)
class ProbeOutput:
    """What one probe printed. exit_code 127: command not found; 124: timed out.
    `cut`: bytes of its stdout and stderr dropped from the middle (0: it is whole)."""

    name: str
    command: str
    exit_code: int
    stdout: str
    stderr: str
    cut: int = 0

    @property
    def missing_tool(self) -> bool:
        return self.exit_code == NOT_FOUND or "command not found" in self.stderr \
            or "No such file or directory" in self.stderr and not self.stdout.strip()

    @property
    def timed_out(self) -> bool:
        return self.exit_code == TIMED_OUT


LATE_TIMEOUT_S = 10        # a probe that runs after the others (it only starts something)


def script_deadline(per_probe_timeout: float) -> float:
    """Seconds the probe script runs at most, however many probes: they run at once, then
    the ones that wait for the others (their own shorter timeout)."""
    return per_probe_timeout + LATE_TIMEOUT_S + 2 * (KILL_GRACE_S + COLLECT_SLACK_S)


def probe_script(probes: Iterable[Probe], per_probe_timeout: float = 20,
                 conversation: str | None = None) -> str:
    """One bash command line running every probe at once, read-only, with markers;
    `conversation`: shell lines run after the output is printed, on the same channel (the clock
    samples' CLOCK_CONVERSATION: it reads the script's stdin, which nothing else does)."""
    probes = list(probes)
    for p in probes:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", p.name):
            raise ValueError(f"bad probe name {p.name!r}")
    keep, blocks = _limit("probe_bytes"), max(1, _limit("probe_file_bytes") // 1024)
    parts = [
        "export LC_ALL=C",
        f"M='{_MARK}'",
        # a private directory (0700) for the outputs: mktemp's, else one in /dev/shm
        "d=$(mktemp -d 2>/dev/null || mktemp -d /dev/shm/cluster-probe.XXXXXXXX 2>/dev/null) "
        "|| { printf '%s - no-tmp mktemp -d failed (no writable temporary directory)\\n' \"$M\"; "
        "exit 0; }",
        "trap 'rm -rf \"$d\"' EXIT",
        # one stream of a probe, its lines prefixed; over the cap: head, a cut line, tail
        f"o() {{ s=$(( $(wc -c < \"$2\" 2>/dev/null || echo 0) )); h={keep // 2}; "
        f"if [ \"$s\" -le {keep} ]; then sed \"s/^/$3/\" \"$2\"; else head -c $h \"$2\" | "
        f"sed \"s/^/$3/\"; printf '\\n%s %s cut %s %s bytes cut\\n' \"$M\" \"$1\" \"$3\" "
        f"$((s - 2 * h)); "
        f"tail -c $h \"$2\" | sed \"s/^/$3/\"; fi; printf '\\n'; }}",
        "e() { r=$(cat \"$d/$2.r\" 2>/dev/null); [ -n \"$r\" ] || r=124; "
        "printf '%s %s begin\\n' \"$M\" \"$1\"; o \"$1\" \"$d/$2.o\" '|'; o \"$1\" \"$d/$2.e\" '!'; "
        "printf '%s %s end %s\\n' \"$M\" \"$1\" \"$r\"; }",
    ]
    first = [i for i, p in enumerate(probes) if not p.after_the_others]
    late = [i for i, p in enumerate(probes) if p.after_the_others]
    for group, limit in ((first, per_probe_timeout), (late, min(per_probe_timeout, LATE_TIMEOUT_S))):
        if not group:
            continue
        for i in group:
            parts.append(
                f"( ulimit -f {blocks} 2>/dev/null; timeout -k {KILL_GRACE_S} {limit:g} "
                f"bash -c {shlex.quote(probes[i].command)} >\"$d/{i}.o\" 2>\"$d/{i}.e\" "
                f"</dev/null; echo $? >\"$d/{i}.t\"; mv \"$d/{i}.t\" \"$d/{i}.r\" ) "
                ">/dev/null 2>&1 </dev/null &")
        done = " && ".join(f"[ -e \"$d/{i}.r\" ]" for i in group)
        ticks = int((limit + KILL_GRACE_S + COLLECT_SLACK_S) / POLL_S)
        parts.append(f"w=0; until {{ {done}; }} || [ $w -ge {ticks} ]; do sleep {POLL_S:g}; "
                     f"w=$((w + 1)); done")
    # All output is gathered in one file and written at once: streamed, every line of every
    # probe was its own SSH packet (through a bastion, twice), which cost the laptop more CPU
    # than everything else in a preflight.
    parts.append("{ " + " ".join(f"e {p.name} {i};" for i, p in enumerate(probes))
                 + " } > \"$d/all\" 2>/dev/null; cat \"$d/all\"")
    if conversation:
        parts.append(conversation)
    return "bash -c " + shlex.quote("\n".join(parts))


_EMIT_RE = re.compile(r"\be ([A-Za-z0-9_.-]+) \d+;")


def probe_names(script: str) -> list[str]:
    """The names of the probes a probe_script command runs, in order (for logs and tests)."""
    return _EMIT_RE.findall(script) if _MARK in script else []


class _Kept:
    """One stream's lines as the split keeps them: the first and last `half` characters
    (whole lines), the count of those dropped between."""

    def __init__(self, half: int):
        self.half, self.head, self.tail = half, [], deque()
        self.head_size = self.tail_size = 0
        self.cut = 0
        self.cut_at = -1           # where in `head` the node's own cut marker was

    def add(self, line: str) -> None:
        if self.head_size + len(line) <= self.half and not self.tail:
            self.head.append(line)
            self.head_size += len(line) + 1
            return
        self.tail.append(line)
        self.tail_size += len(line) + 1
        while self.tail_size > self.half and self.tail:
            dropped = self.tail.popleft()
            self.tail_size -= len(dropped) + 1
            self.cut += len(dropped) + 1

    def add_lines(self, lines: list[str]) -> None:
        """add() for each line, in one step when they all fit the head (the common case)."""
        size = sum(map(len, lines)) + len(lines)
        if not self.tail and self.head_size + size <= self.half + 1:
            # add()'s test holds for every line: the last one's is the tightest
            self.head += lines
            self.head_size += size
            return
        for line in lines:
            self.add(line)

    def node_cut(self, count: int) -> None:
        self.cut += count
        self.head.extend(self.tail)
        self.head_size += self.tail_size
        self.tail, self.tail_size = deque(), 0
        self.cut_at = len(self.head)

    def text(self) -> str:
        lines = list(self.head)
        if self.cut:
            lines.insert(self.cut_at if self.cut_at >= 0 else len(lines), cut_note(self.cut))
        lines += self.tail
        return "\n".join(lines) + ("\n" if lines else "")


def _lines(text: str) -> Iterator[str]:
    """text split on "\\n" only (a tool's \\r or form feed stays in its line), lazily."""
    start = 0
    while True:
        end = text.find("\n", start)
        if end < 0:
            if start < len(text):
                yield text[start:]
            return
        yield text[start:end]
        start = end + 1


def split_probe_output(text: str, probes: Iterable[Probe]) -> dict[str, ProbeOutput]:
    """Inverse of probe_script: {probe name: ProbeOutput}. Probes that never ended are absent;
    so are names that were not asked. Each stream keeps at most node_output.probe_bytes."""
    commands = {p.name: p.command for p in probes}
    half = _limit("probe_bytes") // 2 + 4096
    out: dict[str, ProbeOutput] = {}
    current: str | None = None
    streams: dict[str, _Kept] = {}
    after = 0                                 # where the lines after the last marker start
    for start, stop in _marker_lines(text):
        if current is not None:
            _feed(streams, text[after:start])
        after = stop + 1
        line = text[start:stop]
        begin, end, cut = _BEGIN_RE.fullmatch(line), _END_RE.fullmatch(line), \
            _CUT_RE.fullmatch(line)
        if begin:
            current = begin.group(1) if begin.group(1) in commands else None
            streams = {_OUT: _Kept(half), _ERR: _Kept(half)}
        elif cut and current == cut.group(1):
            streams[cut.group(2)].node_cut(int(cut.group(3)))
        elif end and current == end.group(1):
            o, e = streams[_OUT], streams[_ERR]
            out[current] = ProbeOutput(current, commands[current], int(end.group(2)),
                                       o.text(), e.text(), o.cut + e.cut)
            current = None
    return out


def _marker_lines(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each line (split on "\\n" only) that starts with the marker, in order.
    str.find jumps from one to the next: a pattern anchored at line starts tests every
    character of the output (two thirds of the split's time for a node's 40 KB)."""
    at = 0 if text.startswith(_MARK) else text.find("\n" + _MARK) + 1
    if at == 0 and not text.startswith(_MARK):
        return
    while True:
        stop = text.find("\n", at)
        if stop < 0:
            stop = len(text)
        yield at, stop
        at = text.find("\n" + _MARK, stop) + 1      # the line after a newline at or past stop
        if at == 0:
            return


def _feed(streams: dict[str, _Kept], lines: str) -> None:
    """The lines between two markers to their streams by prefix (`|` stdout, `!` stderr);
    other lines (the blank line after a stream) are not a probe's. A stream none of whose
    lines is there (most probes print nothing on stderr) is not looked for line by line."""
    rows = lines.split("\n")
    for prefix, kept in streams.items():
        if lines.startswith(prefix) or "\n" + prefix in lines:
            kept.add_lines([row[1:] for row in rows if row[:1] == prefix])


def script_problem(text: str) -> str | None:
    """Why the probe script ran none of its probes (no temporary directory), or None."""
    head = text[:4096]
    for line in _lines(head):
        m = _NO_TMP_RE.fullmatch(line)
        if m:
            return m.group(1)
    return None


def require(outputs: Mapping[str, ProbeOutput], name: str) -> ProbeOutput:
    try:
        return outputs[name]
    except KeyError:
        raise ParseError("probe", f"no output for probe {name!r} (the node stopped answering?)") \
            from None
