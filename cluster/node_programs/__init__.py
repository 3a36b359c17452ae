"""Programs that run ON the nodes, and the one way to run them and read them: each program a
real file here (or in cluster/ray_jobs/, the programs about the cluster's Ray jobs; stdlib only,
Python 3.8+), declared by name (`NODE_PROGRAMS`; `declare_programs` for a higher layer's own),
that prints one JSON document; `run_program` ships its source over SSH (nothing is
installed on a node), runs it with the inventory's python and returns the document (or the
typed result `parse` makes of it), or raises ProgramError, the one error of a program run.

The one reader: `parse_answer` is the only decoding of a program's answer (size-bounded, one
JSON object, NaN/Infinity refused), used by `read_document` (a finished CommandResult), by
the facts layer (the node-facts program's output inside the probe script) and by callers of a
program that answers over HTTP (the model relay's status); `embedded_document` reads a
compressed document a program carries inside its own (the all-reduce job's result file).
tests/test_node_program_protocol.py keeps every other module from decoding remote JSON.

Shipping: a program that reads no input of its own goes on stdin as `python3 - ARGS`. One that
reads input (a secret, a request body, a file list) cannot be `python3 -`'s script (that reads
stdin to its end): it is shipped as `python3 -c BOOT ARGS` with stdin = the program as one JSON
line, then its input (`with_input`). Either way the program text never reaches argv (ps, run
logs). Code the programs share lives in _common.py; `source` bundles it in place of the
program's `from cluster.node_programs._common import ...` line. As root (program_call's wrap,
the one way): `python -I -S`, stdlib only, so nothing a non-root user can write is imported.
"""

from __future__ import annotations

import ast
import base64
import binascii
import functools
import json
import shlex
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from cluster.base.errors import ClusterError, ProgramError
from cluster.nodes.shell import heredoc

HERE = Path(__file__).resolve().parent
# The on-node programs this package holds (each HERE/NAME.py). A package of a higher layer that
# holds programs of its own declares them with `declare_programs` (cluster/ray_jobs/, declared
# whenever cluster.ray is imported); nothing else runs: no folder is searched for files.
NODE_PROGRAMS = ("dashboard", "engine_logs", "fix_files", "head_state", "hf_pull", "model_copy",
                 "node_facts", "prometheus", "ray_auth_token", "reach", "serve_sample")
_DECLARED: dict[str, Path] = {}
# Reads the program from stdin's first line and runs it as __main__; the rest of stdin is its.
BOOT = 'import sys,json;exec(compile(json.loads(sys.stdin.readline()),"node_program","exec"))'
COMMON_IMPORT = "from cluster.node_programs._common import "
# A program run as root (program_call's wrap) runs as `python -I -S`: -I (isolated: no PYTHON*
# env, no user site, no script directory or cwd on sys.path) and -S (no site module: a
# virtualenv's own site-packages and its .pth files, sitecustomize and usercustomize are never
# processed; -I alone still processes them). The programs are stdlib-only, they need no site.
AS_ROOT_FLAGS = ("-I", "-S")
MAX_OUTPUT_BYTES = 32 << 20        # what a program may print (Serve details of a large cluster)
DETAIL_CHARS = 300


def _common_text() -> str:
    return (HERE / "_common.py").read_text()


def declare_programs(folder: Path, names: Sequence[str]) -> tuple[str, ...]:
    """Declares the on-node programs folder/NAME.py for each of `names` (a name names one file:
    declaring it again for another file is a ValueError); returns the names."""
    for name in names:
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"not an on-node program name: {name!r}")
        path = Path(folder) / f"{name}.py"
        if _DECLARED.setdefault(name, path) != path:
            raise ValueError(f"on-node program {name!r} declared twice: {_DECLARED[name]}, {path}")
    return tuple(names)


def declared_programs() -> dict[str, Path]:
    """{name: file} of every on-node program declared so far."""
    return dict(_DECLARED)


def program_path(name: str) -> Path:
    """The file of the declared on-node program `name`; ValueError for any other name."""
    try:
        return _DECLARED[name]
    except (KeyError, TypeError):
        raise ValueError(f"not a declared on-node program: {name!r}") from None


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The self-contained text of the on-node program `name` (e.g. "reach"): its file, with the
    line importing _common replaced by _common's own text. Read once per process (a fan-out
    builds one call per node: at rack scale re-reading it was ~1 ms of the laptop's CPU a
    node)."""
    lines = program_path(name).read_text().splitlines(keepends=True)
    if any(line.startswith(COMMON_IMPORT) and "(" in line for line in lines):
        raise ValueError(f"{name}.py: the _common import must be one line (it is replaced whole)")
    return "".join(_common_text() if line.startswith(COMMON_IMPORT) else line for line in lines)


declare_programs(HERE, NODE_PROGRAMS)


def with_input(name: str, data: str) -> str:
    """stdin for `python3 -c BOOT ARGS`: the program `name` on one line, then `data`."""
    return json.dumps(source(name)) + "\n" + data


@dataclass(frozen=True)
class Call:
    """One program run as it goes over SSH: the shell command (no program text, no input) and
    what goes on its stdin (the program, then its input)."""

    command: str
    stdin: str


Wrap = Callable[[str], str]


@functools.lru_cache(maxsize=None)
def node_imports(name: str) -> tuple[str, ...]:
    """The third-party packages program `name` declares (its top-level NODE_IMPORTS), read
    from its text without importing it."""
    for node in ast.parse(program_path(name).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "NODE_IMPORTS"
                                                for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return ()


def program_call(python: str, name: str, args: Sequence[str] = (), stdin: str | None = None,
                 env_prefix: str = "", wrap: Wrap | None = None) -> Call:
    """The command and stdin that run program `name` with `python` (env_prefix: `env K=V ... `
    for the program's process, already quoted, '' for none). stdin None: the program reads no
    input (`python -`), else it gets `stdin` after its own text (`python -c BOOT`).

    wrap: the function of the whole command line that makes it run AS ROOT (fixes.as_root: as
    it is for root, else `sudo -n`), the only way a program runs as root. A wrapped program
    runs isolated (AS_ROOT_FLAGS: no site module, so no .pth, sitecustomize or usercustomize of
    a virtualenv a non-root user can write; no PYTHON* env; no cwd on sys.path) and may import
    no third-party package (ValueError for a program declaring NODE_IMPORTS)."""
    words = list(map(str, args))
    flags: list[str] = []
    if wrap is not None:
        if not python.startswith("/"):
            raise ValueError(f"{name} as root needs an absolute interpreter path (ray.root_python), "
                             f"not {python!r}")
        if node_imports(name):
            raise ValueError(f"{name} imports {', '.join(node_imports(name))}: it never runs as "
                             "root (a non-root user may change those packages)")
        flags = list(AS_ROOT_FLAGS)
    if stdin is None:
        call = Call(env_prefix + shlex.join([python, *flags, "-", *words]), source(name))
    else:
        call = Call(env_prefix + shlex.join([python, *flags, "-c", BOOT, *words]),
                    with_input(name, stdin))
    return Call(wrap(call.command), call.stdin) if wrap is not None else call


def inline_command(python: str, name: str, args: Sequence[str] = (), env_prefix: str = "") -> str:
    """Program `name` as one shell command that carries its own text in a quoted here-document
    (`python - ARGS <<'EOF'`): for a script of several commands sharing one stdin, such as the
    preflight's probe script (one SSH round trip per node). Its output is still one document,
    read with `parse_answer`."""
    return heredoc(env_prefix + shlex.join([python, "-", *map(str, args)]),
                   source(name).rstrip(), prefix="CLUSTER_PROGRAM_")


# ---------------------------------------------------------------- the one reader


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _last_line(text: str) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1][:DETAIL_CHARS] if lines else ""


def parse_answer(text: str, name: str, node: str = "", max_bytes: int = MAX_OUTPUT_BYTES,
                 result=None) -> dict:
    """The one JSON object a program answered (whitespace around it allowed), the only place a
    program's answer is decoded. ProgramError `oversized` over max_bytes, `no-json` for no
    JSON document (or NaN/Infinity in it), `several` for text after it, `not-an-object`."""
    if len(text) > max_bytes:
        raise ProgramError(node, name, "oversized",
                           f"printed {len(text)} characters (at most {max_bytes})", result=result)
    text = text.strip()
    detail = _last_line(text) or "no output"
    try:
        doc, end = _DECODER.raw_decode(text)
    except json.JSONDecodeError:
        raise ProgramError(node, name, "no-json", f"printed no JSON document: {detail}",
                           result=result, detail=detail) from None
    except ValueError as exc:        # NaN / Infinity
        raise ProgramError(node, name, "not-finite", f"printed a document with {exc}",
                           result=result, detail=detail) from None
    if text[end:].strip():
        raise ProgramError(node, name, "several",
                           f"printed more than one JSON document or text after it: {detail}",
                           result=result, detail=detail)
    if not isinstance(doc, dict):
        raise ProgramError(node, name, "not-an-object", f"printed a JSON {type(doc).__name__}, "
                           "not an object", result=result, detail=detail)
    return doc


def embedded_document(packed: str, name: str, node: str = "",
                      max_bytes: int = MAX_OUTPUT_BYTES) -> dict:
    """A document a program carries inside its own as base64 of zlib (a result file read back
    on the node): decompressed at most max_bytes, then parse_answer. ProgramError `packed`
    when it is not base64/zlib or decompresses to more than max_bytes."""
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(packed, validate=True), max_bytes + 1)
    except (binascii.Error, ValueError, TypeError, zlib.error) as exc:
        raise ProgramError(node, name, "packed", f"unreadable packed document: {exc}") from None
    if len(raw) > max_bytes or inflater.unconsumed_tail:
        raise ProgramError(node, name, "packed", f"packed document over {max_bytes} bytes")
    return parse_answer(raw.decode("utf-8", "replace"), name, node, max_bytes)


def _detail(result) -> str:
    return _last_line(result.stderr) or _last_line(result.stdout) or "no output"


def _typed(doc: dict, parse: Callable[[dict], object] | None, node: str, name: str, result):
    """parse(doc): the program's typed result; garbage in the document is ProgramError."""
    if parse is None:
        return doc
    try:
        return parse(doc)
    except (ClusterError, ValueError, TypeError, KeyError, AttributeError) as exc:
        if isinstance(exc, ProgramError):
            raise
        raise ProgramError(node, name, "bad-answer", f"unusable answer: {exc}"[:DETAIL_CHARS],
                           result=result, doc=doc) from None


def read_document(result, name: str, max_bytes: int = MAX_OUTPUT_BYTES,
                  parse: Callable[[dict], object] | None = None):
    """The one JSON object the program printed (its stdout), or `parse` of it (a typed
    result). ProgramError when the node was not reached, the output is too long, not one
    JSON object, the exit code is not 0 (the document, when one was read, rides on the
    error), or parse refuses it (`bad-answer`)."""
    node = result.node
    if not result.reached:
        raise ProgramError(node, name, result.status, f"{result.status}: {result.error}",
                           result=result)
    detail = _detail(result)
    try:
        doc = parse_answer(result.stdout, name, node, max_bytes, result)
    except ProgramError as exc:
        if exc.kind == "oversized" or (exc.kind == "several" and result.exit_code == 0):
            raise
        doc, error = None, exc
    if result.exit_code != 0:
        raise ProgramError(node, name, "exit", f"exit {result.exit_code}: {detail}",
                           result=result, doc=doc, detail=detail)
    if doc is None:
        raise ProgramError(node, name, error.kind, f"{error.reason.split(':')[0]}: {detail}"
                           if error.kind == "no-json" else error.reason,
                           result=result, detail=detail)
    return _typed(doc, parse, node, name, result)


def document_of(result, name: str, max_bytes: int = MAX_OUTPUT_BYTES) -> dict | ProgramError:
    """read_document without raising: the document (also one printed before a non-zero exit)
    or the ProgramError that says why there is none."""
    try:
        return read_document(result, name, max_bytes)
    except ProgramError as exc:
        return exc.doc if exc.doc is not None else exc


def failure(exc: ProgramError, where: str) -> str:
    """One line for a run without a document: `WHERE STATUS: ERROR` when the node was not
    reached, `exit CODE: DETAIL` (the output's last line) when the program failed, else what
    was wrong with its answer."""
    result = exc.result
    if not exc.reached:
        return f"{where} {result.status}: {result.error}"
    if exc.kind != "exit":
        return exc.reason
    return f"exit {result.exit_code}: {exc.detail or exc.reason}"


# ---------------------------------------------------------------- the one runner


def _python(session, python: str | None) -> str:
    return python or session.inventory.ray.python


def run_call(session, node, call: Call, timeout: float | None = None, record: bool = True):
    """Run a built program call on `node`: its CommandResult (never raises for the node).
    record False: straight through the node's runner, past the session's result hooks (run
    directories), for an answer that is a secret (the Ray token); that raises ConnectError /
    CommandTimeout as the runner does."""
    if record:
        return session.run(node, call.command, timeout=timeout, stdin=call.stdin)
    return session.runner_for(node).run(node, call.command, timeout, stdin=call.stdin)


def run_raw(session, node, name: str, args: Sequence[str] = (), stdin: str | None = None,
            timeout: float | None = None, python: str | None = None, env_prefix: str = "",
            wrap: Wrap | None = None, record: bool = True):
    """Run the program once on `node`: its CommandResult (never raises for the node)."""
    call = program_call(_python(session, python), name, args, stdin, env_prefix, wrap)
    return run_call(session, node, call, timeout, record)


def run_program(session, node, name: str, args: Sequence[str] = (), stdin: str | None = None,
                timeout: float | None = None, python: str | None = None, env_prefix: str = "",
                max_bytes: int = MAX_OUTPUT_BYTES, wrap: Wrap | None = None,
                parse: Callable[[dict], object] | None = None, record: bool = True):
    """Run the on-node program `name` on `node` with the inventory's python (or `python`) and
    return the JSON document it printed, or `parse` of it. Raises ProgramError (see
    read_document)."""
    result = run_raw(session, node, name, args, stdin, timeout, python, env_prefix, wrap, record)
    return read_document(result, name, max_bytes, parse)


ArgsSpec = Sequence[str] | Callable[[object], Sequence[str]]


def fan_out_program(session, nodes, name: str, args: ArgsSpec = (), stdin: str | None = None,
                    timeout: float | None = None, python: str | None = None,
                    env_prefix: str = "", max_bytes: int = MAX_OUTPUT_BYTES,
                    wrap: Callable[[object, str], str] | None = None,
                    parse: Callable[[dict], object] | None = None) -> tuple:
    """The program on every node at once (Session.fan_out): per node, in order, its document
    (or `parse` of it) or the ProgramError that says why there is none (never raises for a
    node). `args` may be a per-node builder; `wrap(node, command)` a per-node wrapper."""
    nodes = list(nodes)
    python = _python(session, python)
    calls = {n.name: program_call(python, name, args(n) if callable(args) else args, stdin,
                                  env_prefix,
                                  None if wrap is None else functools.partial(wrap, n))
             for n in nodes}
    shipped = next(iter(calls.values())).stdin if calls else None
    results = session.fan_out(nodes, lambda n: calls[n.name].command, timeout=timeout,
                              stdin=shipped)
    out: list = []
    for result in results:
        try:
            out.append(read_document(result, name, max_bytes, parse))
        except ProgramError as exc:
            out.append(exc)
    return tuple(out)
