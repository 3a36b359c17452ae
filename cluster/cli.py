"""The `cluster` command line: parse arguments, dispatch to a subcommand, turn errors into exit codes.

Only the CLI layer (this module and cluster/commands/) prints or exits. Every subcommand
returns an exit code: 0 all ok, 1 warnings only, 2 any failure, error or bad usage.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import re
import sys
from typing import Any, Sequence

from cluster import __version__
from cluster.report import crash_log
from cluster.base.errors import ClusterError
from cluster.base.flags import path_value
from cluster.base.textsafe import terminal_safe_line

# Explicit registry: (subcommand, module under cluster.commands). Each module has
# register(subparsers) -> None, which sets `handler` (args -> int) on its parser.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("init", "init"),
    ("inventory", "inventory"),
    ("exec", "exec_cmd"),
    ("preflight", "preflight"),
    ("fix", "fix"),
    ("runs", "runs"),
    ("parse", "parse"),
    ("up", "up"),
    ("down", "down"),
    ("status", "status"),
    ("dashboard", "dashboard"),
    ("plan", "plan"),
    ("bench", "bench"),
    ("deploy", "deploy"),
    ("undeploy", "undeploy"),
    ("nccl-check", "nccl_check"),
    ("tune", "tune"),
    ("drain", "drain"),
    ("restart-node", "restart_node"),
    ("uncordon", "uncordon"),
    ("model", "model"),
    ("completion", "completion"),
)


class UsageProblem(Exception):
    """A usage error, raised by the parser (never printed there): main() prints it as one line
    naming the (sub)command's prog, and as one JSON document on stdout under --json."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise UsageProblem (argparse's own error() prints the whole
    usage block and exits), with a "did you mean" for a mistyped subcommand or choice.
    `cluster CMD --help` still shows the usage."""

    def error(self, message: str):  # noqa: D401 - argparse's name
        raise UsageProblem(self.prog, _with_choice_hint(message))

    def unknown_arguments(self, extras: Sequence[str]) -> UsageProblem:
        """The error for arguments this (sub)command does not take, with the nearest flags."""
        hints = [f"{word} (did you mean {' or '.join(close)}?)" if close else word
                 for word in extras for close in [_close_flags(word, self.format_help())]]
        return UsageProblem(self.prog, "unrecognized arguments: " + " ".join(hints))


_CHOICE_RE = re.compile(r"invalid choice: '([^']{0,200})' \(choose from (.{0,4000})\)$")
_FLAG_RE = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]{0,60})")


def _with_choice_hint(message: str) -> str:
    """argparse's invalid-choice message with "did you mean 'preflight'?" in place of the list
    of every choice when one is close; other messages unchanged."""
    m = _CHOICE_RE.search(message)
    if not m:
        return message
    choices = re.findall(r"'([^']{1,100})'", m.group(2))
    close = difflib.get_close_matches(m.group(1), choices, n=2, cutoff=0.6)
    if not close:
        return message
    return message[:m.start(2) - len("(choose from ")] + \
        f"(did you mean {' or '.join(repr(c) for c in close)}?)"


def _close_flags(word: str, help_text: str) -> list[str]:
    """The flags of a (sub)command's help nearest to a mistyped `word` (`--modle`)."""
    if not word.startswith("-"):
        return []
    flag = word.split("=", 1)[0]
    flags = sorted(set(_FLAG_RE.findall(help_text)))
    return difflib.get_close_matches(flag, flags, n=2, cutoff=0.6)


# One line each for `cluster --help`, so that listing the commands imports none of them
# (tests/test_cli_guard.py checks these against each module's own help).
HELP: dict[str, str] = {
    "init": "write a commented cluster.yaml template",
    "inventory": "show the resolved inventory (secrets redacted)",
    "exec": "run a command on nodes in parallel",
    "preflight": "check drivers, GPUs, NVLink, IB, GPUDirect, clocks, /dev/shm, memlock, "
                 "versions, model files",
    "fix": "repair what preflight found (check mode, idempotent, undo record)",
    "runs": "list past runs and where their records are",
    "parse": "parse captured outputs of node diagnostics (nvidia-smi, ibstat, chronyc, NCCL "
             "logs, ...)",
    "up": "start (or repair) the Ray cluster: head, then workers; idempotent",
    "down": "stop Ray on every node (workers first, then the head); idempotent",
    "status": "Ray nodes, GPUs, version and Serve applications, read on the head",
    "dashboard": "serve the head's Ray dashboard on this machine's loopback, the Ray token "
                 "added, and print its local URL",
    "plan": "plan TP/PP/DP/EP and vLLM engine args for a model on this cluster",
    "bench": "load-test an OpenAI-compatible endpoint (TTFT, ITL, latency, tokens/s)",
    "deploy": "serve a model on the Ray cluster (Ray Serve + vLLM, OpenAI API)",
    "undeploy": "remove a Serve application (the others keep running)",
    "nccl-check": "prove the real inter-node transport and bandwidth with an all-reduce",
    "tune": "sweep an engine arg of a deployed app (redeploy + bench per value) and recommend one",
    "drain": "drain a worker: no new Ray work there, Serve replicas moved off first",
    "restart-node": "drain a worker, restart its Ray, rejoin and verify (rolling restart)",
    "uncordon": "bring back a node the health job cordoned (its preflight must pass)",
    "model": "model weights on every node: pull once, relay node to node",
    "completion": "print shell completion code for bash or zsh",
}


# Two or three examples at the end of the main commands' --help (checked to parse by
# tests/test_readable.py). Text after "#" is a comment; after ">" or "|" the shell's.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "preflight": ("cluster preflight                      # every node: a table, then the fixes",
                  "cluster preflight --nodes 'gpu-*' --no-clock-skew",
                  "cluster preflight --json > preflight.json   # one JSON document"),
    "fix": ("cluster fix --dry-run                  # what would change, node by node",
            "cluster fix --checks gpudirect,shm --yes",
            "cluster fix --undo RUN_DIR             # put back what a fix run changed"),
    "up": ("cluster up --dry-run                   # the plan per node, nothing changed",
           "cluster up --yes",
           "cluster up --serial 4 --stagger 2 --yes"),
    "plan": ("cluster plan --model Qwen/Qwen2.5-72B-Instruct --alternatives 2",
             "cluster plan --model gpu-01:/models/llama-70b --out plan.yaml",
             "cluster plan --model ./llama-70b --nodes 2 --gpus-per-node 8 --gpu-model H100"),
    "deploy": ("cluster deploy --plan plan.yaml --dry-run",
               "cluster deploy --plan plan.yaml --api-key-env VLLM_API_KEY",
               "cluster deploy --model /models/Qwen2.5-7B-Instruct --tp 8 --name chat"),
    "bench": ("cluster bench --url http://10.0.0.1:8000 --model chat",
              "cluster bench --url http://10.0.0.1:8000 --model chat --concurrency 1,8,32",
              "cluster bench --url http://10.0.0.1:8000 --model chat --out bench/"),
    "status": ("cluster status                         # Ray nodes, GPUs, Serve apps",
               "cluster status --window 10             # vLLM metrics over 10 s",
               "cluster status --json > status.json"),
}


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but lines of a description or epilog that start with two spaces
    (examples) are kept as written; the other lines are filled as paragraphs."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        paragraph: list[str] = []
        for line in text.splitlines() + [""]:
            if line.startswith("  ") or not line.strip():
                if paragraph:
                    out.append(super()._fill_text(" ".join(paragraph), width, indent))
                    paragraph = []
                if line.strip():
                    out.append(indent + line)
                elif out and line == "" and out[-1] != "":
                    out.append("")
            else:
                paragraph.append(line.strip())
        return "\n".join(out).rstrip("\n")


def _add_examples(parser: argparse.ArgumentParser, name: str) -> None:
    """The command's EXAMPLES at the end of its --help."""
    examples = EXAMPLES.get(name)
    if not examples:
        return
    parser.formatter_class = _HelpFormatter
    block = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    parser.epilog = f"{parser.epilog}\n\n{block}" if parser.epilog else block


class _Version(argparse.Action):
    """`cluster --version`: the toolkit's version and the version contract's tested combination
    (cluster/data/versions.yaml, read only when asked; a malformed one is a ClusterError)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from cluster.inspection.contract import load_contract
        contract = load_contract()
        print(f"cluster {__version__}\ntested with: {contract.tested_line()}")
        parser.exit(0)


def chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named in argv (skipping the global options), or None."""
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-i", "--inventory"):
            i += 2
            continue
        if word.startswith("-"):
            i += 1
            continue
        return word
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. With argv, only the command it names is imported and registered in
    full (the others get a one-line entry from HELP): `cluster --help`, `cluster parse` and
    friends start without importing every command's dependencies. Without argv, all are."""
    only = chosen_command(argv) if argv is not None else None
    lazy = argv is not None
    parser = _Parser(
        prog="cluster",
        description="Turn bare-metal GPU servers into a verified Ray cluster serving vLLM.",
        epilog="Exit codes: 0 ok, 1 warnings only, 2 failures, errors or bad usage.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="the toolkit's version and the tested runtime combination")
    _add_inventory(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS:
        if lazy and name != only:
            sub.add_parser(name, help=HELP[name], add_help=False)
        else:
            importlib.import_module(f"cluster.commands.{module}").register(sub)
            _add_inventory(sub.choices[name], argparse.SUPPRESS)
            _add_examples(sub.choices[name], name)
    parser.subcommands = sub.choices      # name -> parser: whose error an unknown flag is
    return parser


def _add_inventory(parser: argparse.ArgumentParser, default=None) -> None:
    """-i/--inventory, on the main parser and on every subcommand (`cluster preflight -i X`
    as well as `cluster -i X preflight`); a subcommand's SUPPRESS default keeps the main
    parser's value when the flag comes before the subcommand."""
    parser.add_argument("-i", "--inventory", metavar="PATH", type=path_value, default=default,
                        help="cluster.yaml (default: $CLUSTER_INVENTORY, ./cluster.yaml, "
                             "then the embedded single-node localhost default)")


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """parse_args, but arguments a subcommand does not take are that subcommand's error."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        owner = _subparser(parser, getattr(args, "command", None)) or parser
        raise (owner.unknown_arguments(extras) if isinstance(owner, _Parser)
               else UsageProblem(owner.prog, "unrecognized arguments: " + " ".join(extras)))
    return args


def _subparser(parser: argparse.ArgumentParser, command: str | None):
    """The subcommand's parser (build_parser keeps the subparsers' `choices`), or None."""
    return getattr(parser, "subcommands", {}).get(command)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code; never raises (argparse's own exits aside).

    Every error ends in one line on stderr and exit 2: a ClusterError says what is wrong; any
    other exception is an internal error whose traceback goes to a crash log, never the terminal.
    """
    args: argparse.Namespace | None = None
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if "_ARGCOMPLETE" in os.environ:      # the shell asks for completions (see completion.py)
            _complete()
        parser = build_parser(argv)
        args = _parse(parser, argv)
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help()
            return 2
        code = handler(args)
        return _exit_code(code)
    except SystemExit:  # argparse: --help/--version exit 0
        raise
    except UsageProblem as exc:
        return _usage_error(exc, argv)
    except ClusterError as exc:
        return _fail(args, str(exc))
    except KeyboardInterrupt:
        return _fail(args, "interrupted")
    except BrokenPipeError:
        _silence_stdout()
        return 2
    except Exception as exc:  # the one top-level guard: unexpected means exit 2, never 1
        where = crash_log.write(exc)
        detail = f"details in {where}" if where else "no crash log could be written"
        return _fail(args, f"internal error: {type(exc).__name__}: {_one_line(exc)} "
                           f"(please report; {detail})")


def _complete() -> None:
    """Answer the shell's completion request through argcomplete and exit: the parser is built
    for the command the line names so far (only that one imported)."""
    import argcomplete

    line = os.environ.get("COMP_LINE", "")[:_int(os.environ.get("COMP_POINT"))]
    argcomplete.autocomplete(build_parser(line.split()[1:]))


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def _exit_code(code: object) -> int:
    """A handler's return value as an exit code: 0, 1 or 2 (anything else is an error: 2)."""
    return code if isinstance(code, int) and not isinstance(code, bool) and code in (0, 1, 2) \
        else 2


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return text if len(text) <= limit else text[:limit] + "..."


def _fail(args: argparse.Namespace | None, message: str) -> int:
    command = getattr(args, "command", None) or ""
    prefix = f"cluster {command}:" if command else "cluster:"
    line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    error = {"error": message} if getattr(args, "json", False) else None  # --json: always a document
    return _error_out(f"{prefix} {terminal_safe_line(line)}", command, error)


def _usage_error(exc: UsageProblem, argv: Sequence[str] | None) -> int:
    """A usage error: one line on stderr naming the (sub)command (`cluster parse: error: ...
    (see `cluster parse --help`)`), and with --json one JSON document on stdout as every
    other error gives."""
    words = list(argv or [])
    wants_json = "--json" in (words[:words.index("--")] if "--" in words else words)
    command = exc.prog[len("cluster"):].strip()
    line = f"{exc.prog}: error: {terminal_safe_line(exc.message)} (see `{exc.prog} --help`)"
    return _error_out(line, command, {"error": exc.message, "usage": True} if wants_json else None)


def _error_out(line: str, command: str, error: dict[str, Any] | None) -> int:
    """An error's end: `line` on stderr and, when `error` is given (--json), one JSON document on
    stdout: the command, exit code 2, status "error" and `error`'s keys. A closed pipe is
    silenced. Returns 2."""
    try:
        print(line, file=sys.stderr)
        if error is not None:
            json.dump({"command": command, "exit_code": 2, "status": "error", **error}, sys.stdout)
            sys.stdout.write("\n")
            sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    return 2


def _silence_stdout() -> None:
    """After a closed pipe (`cluster ... | head`): point stdout at /dev/null so exit is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
