"""Programs that run ON the nodes, and the one way to run them: each program a real file here
(stdlib only, Python 3.8+) that prints one JSON document; `run_program` ships its source over
SSH (nothing is installed on a node), runs it with the inventory's python and returns the
document, or raises ProgramError.

Shipping: a program that reads no input of its own goes on stdin as `python3 - ARGS`. One that
reads input (a secret, a request body, a file list) cannot be `python3 -`'s script (that reads
stdin to its end): it is shipped as `python3 -c BOOT ARGS` with stdin = the program as one JSON
line, then its input (`with_input`). Either way the program text never reaches argv (ps, run
logs). Code the programs share lives in _common.py; `source` bundles it in place of the
program's `from cluster.node_programs._common import ...` line.
"""

from __future__ import annotations

import functools
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from cluster.errors import ProgramError
from cluster.shell import heredoc

HERE = Path(__file__).resolve().parent
# Reads the program from stdin's first line and runs it as __main__; the rest of stdin is its.
BOOT = 'import sys,json;exec(compile(json.loads(sys.stdin.readline()),"node_program","exec"))'
COMMON_IMPORT = "from cluster.node_programs._common import "
MAX_OUTPUT_BYTES = 32 << 20        # what a program may print (Serve details of a large cluster)
DETAIL_CHARS = 300


def _common_text() -> str:
    return (HERE / "_common.py").read_text()


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The self-contained text of the on-node program `name` (e.g. "reach"): its file, with the
    line importing _common replaced by _common's own text. Read once per process (a fan-out
    builds one call per node: at rack scale re-reading it was ~1 ms of the laptop's CPU a
    node)."""
    if not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"not an on-node program name: {name!r}")
    lines = (HERE / f"{name}.py").read_text().splitlines(keepends=True)
    if any(line.startswith(COMMON_IMPORT) and "(" in line for line in lines):
        raise ValueError(f"{name}.py: the _common import must be one line (it is replaced whole)")
    return "".join(_common_text() if line.startswith(COMMON_IMPORT) else line for line in lines)


def with_input(name: str, data: str) -> str:
    """stdin for `python3 -c BOOT ARGS`: the program `name` on one line, then `data`."""
    return json.dumps(source(name)) + "\n" + data


@dataclass(frozen=True)
class Call:
    """One program run as it goes over SSH: the shell command (no program text, no input) and
    what goes on its stdin (the program, then its input)."""

    command: str
    stdin: str


def program_call(python: str, name: str, args: Sequence[str] = (), stdin: str | None = None,
                 env_prefix: str = "") -> Call:
    """The command and stdin that run program `name` with `python` (env_prefix: `env K=V ... `
    for the program's process, already quoted, '' for none). stdin None: the program reads no
    input (`python -`), else it gets `stdin` after its own text (`python -c BOOT`)."""
    words = list(map(str, args))
    if stdin is None:
        return Call(env_prefix + shlex.join([python, "-", *words]), source(name))
    return Call(env_prefix + shlex.join([python, "-c", BOOT, *words]), with_input(name, stdin))


def inline_command(python: str, name: str, args: Sequence[str] = (), env_prefix: str = "") -> str:
    """Program `name` as one shell command that carries its own text in a quoted here-document
    (`python - ARGS <<'EOF'`): for a script of several commands sharing one stdin, such as the
    preflight's probe script (one SSH round trip per node). Its output is still one document."""
    return heredoc(env_prefix + shlex.join([python, "-", *map(str, args)]),
                   source(name).rstrip(), prefix="CLUSTER_PROGRAM_")


def _detail(result) -> str:
    lines = (result.stderr or result.stdout or "").strip().splitlines()
    return lines[-1][:DETAIL_CHARS] if lines else "no output"


def read_document(result, name: str, max_bytes: int = MAX_OUTPUT_BYTES) -> dict:
    """The one JSON object the program printed (its stdout, whitespace around it allowed).
    ProgramError when the node was not reached, the output is too long, not one JSON object,
    or the exit code is not 0 (the document, when one was read, rides on the error)."""
    node = result.node
    if not result.reached:
        raise ProgramError(node, name, result.status, f"{result.status}: {result.error}",
                           result=result)
    if len(result.stdout) > max_bytes:
        raise ProgramError(node, name, "oversized",
                           f"printed {len(result.stdout)} characters (at most {max_bytes})",
                           result=result)
    detail = _detail(result)
    doc = _one_document(result.stdout.strip(), node, name, result, detail)
    if result.exit_code != 0:
        raise ProgramError(node, name, "exit", f"exit {result.exit_code}: {detail}",
                           result=result, doc=doc, detail=detail)
    if doc is None:
        raise ProgramError(node, name, "no-json", f"printed no JSON document: {detail}",
                           result=result, detail=detail)
    return doc


def document_of(result, name: str, max_bytes: int = MAX_OUTPUT_BYTES) -> dict | ProgramError:
    """read_document without raising: the document (also one printed before a non-zero exit)
    or the ProgramError that says why there is none."""
    try:
        return read_document(result, name, max_bytes)
    except ProgramError as exc:
        return exc.doc if exc.doc is not None else exc


def failure(exc: ProgramError, where: str) -> str:
    """One line for a run without a document: `WHERE STATUS: ERROR` when the node was not
    reached, else `exit CODE: DETAIL` (the output's last line, or the reason)."""
    result = exc.result
    if not exc.reached:
        return f"{where} {result.status}: {result.error}"
    return f"exit {result.exit_code}: {exc.detail or exc.reason}"


def _one_document(text: str, node: str, name: str, result, detail: str) -> dict | None:
    """None when the text is no JSON document; ProgramError for several or a non-object."""
    if not text:
        return None
    decoder = json.JSONDecoder()
    try:
        doc, end = decoder.raw_decode(text)
    except ValueError:
        return None
    if text[end:].strip():
        if result.exit_code != 0:
            return None
        raise ProgramError(node, name, "several",
                           f"printed more than one JSON document or text after it: {detail}",
                           result=result, detail=detail)
    if not isinstance(doc, dict):
        raise ProgramError(node, name, "not-an-object", f"printed a JSON {type(doc).__name__}, "
                           "not an object", result=result, detail=detail)
    return doc


def _python(session, python: str | None) -> str:
    return python or session.inventory.ray.python


def run_raw(session, node, name: str, args: Sequence[str] = (), stdin: str | None = None,
            timeout: float | None = None, python: str | None = None, env_prefix: str = ""):
    """Run the program once on `node`: its CommandResult (never raises for the node)."""
    call = program_call(_python(session, python), name, args, stdin, env_prefix)
    return session.run(node, call.command, timeout=timeout, stdin=call.stdin)


def run_program(session, node, name: str, args: Sequence[str] = (), stdin: str | None = None,
                timeout: float | None = None, python: str | None = None, env_prefix: str = "",
                max_bytes: int = MAX_OUTPUT_BYTES) -> dict:
    """Run the on-node program `name` on `node` with the inventory's python (or `python`) and
    return the JSON document it printed. Raises ProgramError (see read_document)."""
    result = run_raw(session, node, name, args, stdin, timeout, python, env_prefix)
    return read_document(result, name, max_bytes)


ArgsSpec = Sequence[str] | Callable[[object], Sequence[str]]


def fan_out_program(session, nodes, name: str, args: ArgsSpec = (), stdin: str | None = None,
                    timeout: float | None = None, python: str | None = None,
                    env_prefix: str = "", max_bytes: int = MAX_OUTPUT_BYTES
                    ) -> tuple[dict | ProgramError, ...]:
    """The program on every node at once (Session.fan_out): per node, in order, its document
    or the ProgramError that says why there is none (never raises for a node). `args` may be a
    per-node builder."""
    nodes = list(nodes)
    python = _python(session, python)
    calls = {n.name: program_call(python, name, args(n) if callable(args) else args, stdin,
                                  env_prefix) for n in nodes}
    shipped = next(iter(calls.values())).stdin if calls else None
    results = session.fan_out(nodes, lambda n: calls[n.name].command, timeout=timeout,
                              stdin=shipped)
    out: list[dict | ProgramError] = []
    for result in results:
        try:
            out.append(read_document(result, name, max_bytes))
        except ProgramError as exc:
            out.append(exc)
    return tuple(out)
