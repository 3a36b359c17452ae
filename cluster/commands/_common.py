"""Helpers shared by the CLI subcommands: inventory loading, output, prompts, progress, run records."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from cluster.base.errors import UsageError
from cluster.base.flags import path_value, text_value  # noqa: F401 - the commands import them here
from cluster.report.render import to_json

if TYPE_CHECKING:  # `cluster parse` and `plan` start without the inventory or run records
    from cluster.nodes.inventory import Inventory
    from cluster.report.rundir import RunDir



def _safe_console_class() -> type:
    """rich's Console that never lets a node's or server's text drive the terminal.

    Strings and Text objects are shown with their control characters escaped (textsafe); a
    string whose brackets are not valid rich markup (a node's output can hold "[/x]") is shown
    as plain text instead of raising MarkupError. Built on first use: rich costs ~40 ms of
    start-up that `--json` runs (`cluster parse --json`, scripts) never need.
    """
    global _SAFE_CONSOLE
    if _SAFE_CONSOLE is None:
        from rich.console import Console

        class SafeConsole(Console):
            __doc__ = _safe_console_class.__doc__

            def print(self, *objects: Any, **kwargs: Any) -> None:  # noqa: A003 - rich's name
                from rich.errors import MarkupError
                from rich.text import Text

                from cluster.base.textsafe import terminal_safe

                safe = []
                for obj in objects:
                    if isinstance(obj, str):
                        obj = terminal_safe(obj)
                    elif isinstance(obj, Text) and terminal_safe(obj.plain) != obj.plain:
                        obj = Text(terminal_safe(obj.plain), style=obj.style)
                    safe.append(obj)
                try:
                    super().print(*safe, **kwargs)
                except MarkupError:
                    super().print(*safe, **dict(kwargs, markup=False))

        _SAFE_CONSOLE = SafeConsole
    return _SAFE_CONSOLE


_SAFE_CONSOLE: type | None = None


def __getattr__(name: str) -> Any:
    """`_common.SafeConsole`: the class, built on first use."""
    if name == "SafeConsole":
        return _safe_console_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _LazyConsole:
    """stdout / stderr: a SafeConsole made on first use (attribute access goes to it)."""

    def __init__(self, **options: Any):
        self._options = options
        self._console = None

    def real(self) -> Any:
        if self._console is None:
            self._console = _safe_console_class()(**self._options)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)


stdout = _LazyConsole(soft_wrap=False)
stderr = _LazyConsole(stderr=True)


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def add_changing(parser: argparse.ArgumentParser) -> None:
    """Flags every node-changing command has."""
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would run on each node and change nothing")
    parser.add_argument("--yes", action="store_true",
                        help="answer yes to confirmations (required without a terminal)")


def add_nodes(parser: argparse.ArgumentParser,
              help: str = "only these nodes (names, globs, head, workers)") -> None:  # noqa: A002
    """--nodes PATTERN: the inventory nodes a command runs on (default: all)."""
    parser.add_argument("--nodes", metavar="PATTERN", type=text_value, help=help)


def add_node_timeout(parser: argparse.ArgumentParser) -> None:
    """--timeout S: each node's whole time (connecting, through its jump host too, and the
    command), a finite number in (0, limits.yaml node_time.timeout_s]."""
    from cluster.base.bounds import bound

    parser.add_argument("--timeout", type=float_range(0, bound("node_time", "timeout_s"),
                                                      strict=True), metavar="S",
                        help="seconds each node may take in all, connecting (through the jump "
                             "host too) included (default: the inventory's connect and command "
                             "timeouts)")


def add_serial(parser: argparse.ArgumentParser) -> None:
    """--serial N: change the workers N at a time (a rolling operation); 0 means all at once."""
    parser.add_argument("--serial", type=_serial, default=0, metavar="N",
                        help="change the workers N at a time, stopping at the first failed "
                             "batch (default: all at once)")


def _serial(text: str) -> int:
    """argparse type of --serial: a whole number from 0 (all at once) to 100000."""
    return _number(text, int, 0, strict=False, maximum=100_000)


def load_inventory(args: argparse.Namespace) -> Inventory:
    from cluster.nodes import inventory as inventory_mod

    return inventory_mod.load(getattr(args, "inventory", None))


def print_json(data: Any) -> None:
    sys.stdout.write(to_json(data) + "\n")
    sys.stdout.flush()


def emit_json(record: RunDir, name: str, payload: Any, to_stdout: bool) -> None:
    """Serialise a report once: the same scrubbed text goes to the run directory and, with
    --json, to stdout (large reports cost one encode, not one per destination)."""
    text = record.scrub(to_json(payload)) + "\n"
    record.write_text(name, text)
    if to_stdout:
        sys.stdout.write(text)
        sys.stdout.flush()


def interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def confirm(question: str, yes: bool) -> bool:
    """True when --yes was given or a person at a terminal said yes.

    Without a terminal it never prompts: the question becomes an error (exit 2) unless --yes.
    """
    if yes:
        return True
    if not interactive():
        raise UsageError(f"{question} Refusing without a terminal: pass --yes to confirm.")
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


def inventory_secrets(inv: Inventory) -> tuple[str, ...]:
    """Values of the inventory's secret-looking env entries, longest first (kept out of output
    and records; they still reach `ray start`)."""
    from cluster.nodes.inventory import REDACTED, redact_env

    out = set(inv.secret_values())
    for node in inv.nodes:
        shown = redact_env(node.env, node.secret_names)
        out |= {v for k, v in node.env.items() if shown[k] == REDACTED and len(v) >= 4}
    return tuple(sorted(out, key=lambda v: (-len(v), v)))


def start_run(args: argparse.Namespace, inventory: Inventory, command: str) -> RunDir:
    """A run directory whose scrub list holds the inventory's secrets and the secret
    variables of this environment."""
    from cluster.report.rundir import RunDir

    return RunDir.create(inventory.run_dir, command, argv=sys.argv,
                         inventory_path=inventory.path, secrets=inventory_secrets(inventory))


@dataclass
class RecordedRun:
    """One command's recorded run: the inventory, its run directory (the inventory's secrets
    on the scrub list) and SSH sessions whose every command is logged there."""

    args: argparse.Namespace
    command: str
    inventory: Inventory
    record: RunDir
    soft_wrap: bool = False                # progress lines unwrapped

    @property
    def path(self) -> Path:
        return self.record.path

    @property
    def quiet(self) -> bool:
        """--json: no progress lines (stdout carries the JSON, stderr only errors)."""
        return bool(getattr(self.args, "json", False))

    def scrub(self, text: str) -> str:
        return self.record.scrub(text)

    def add_secret(self, value: str | None) -> None:
        """One more value (an API key read here) to keep out of the record and output."""
        if value and value not in self.record.secrets:
            self.record.secrets = self.record.secrets + (value,)

    def session(self, hook: Callable[[Any], Any] | None = None,
                node_time_s: float | None = None) -> Any:
        """A Session over the inventory that logs each command (through `hook` when given);
        `node_time_s` bounds each node's whole time per call (--timeout)."""
        from cluster.nodes.remote import Session

        bounded = {} if node_time_s is None else {"node_time_s": node_time_s}
        return Session(self.inventory, hooks=[hook or self.record.record], **bounded)

    def event(self, event: Any) -> None:
        """A playbook's typed progress event rendered: a Progress line always into the run's
        events.log, and on stderr ("<command>: ...", secrets scrubbed) only for a person at a
        terminal (not with --json): a script's stderr holds nothing but the one error line of
        a failure (docs/json.md "Exit codes"). A NodeDone has no line."""
        from playbooks.outcome import Progress

        if not isinstance(event, Progress):
            return
        self.record.note(event.text)
        if not self.quiet and sys.stderr.isatty():
            stderr.print(f"[dim]{self.command}:[/dim] {self.scrub(event.text)}",
                         soft_wrap=self.soft_wrap)

    def events(self, advance: Callable[[Any], None]) -> Callable[[Any], None]:
        """`event`, with each NodeDone advancing the progress bar `advance` (run_.progress)."""
        from playbooks.outcome import NodeDone

        def on_event(event: Any) -> None:
            if isinstance(event, NodeDone):
                advance(event.result)
            else:
                self.event(event)
        return on_event

    def confirm(self, question: str) -> bool:
        return confirm(question, bool(getattr(self.args, "yes", False)))

    def progress(self, total: int) -> Any:
        """The progress bar over `total` nodes (none with --json or without a terminal)."""
        return progress(total, self.command, enabled=not self.quiet)

    def print_json(self, payload: Any) -> None:
        """The payload, secrets scrubbed, as JSON on stdout."""
        print_json(json.loads(self.scrub(to_json(payload))))

    def finish(self, exit_code: int) -> None:
        self.record.finish(exit_code)


def recorded_run(args: argparse.Namespace, command: str, inventory: Inventory | None = None,
                 soft_wrap: bool = False) -> RecordedRun:
    """Load the inventory (unless given) and start the command's run directory."""
    inv = inventory if inventory is not None else load_inventory(args)
    return RecordedRun(args, command, inv, start_run(args, inv, command), soft_wrap)


def recorded_run_on_nodes(args: argparse.Namespace, command: str
                          ) -> tuple[RecordedRun, list[Any]]:
    """The run of a command over --nodes: the pattern is checked before the run directory is
    made (a bad one leaves no record). Returns (run, the selected nodes)."""
    inv = load_inventory(args)
    nodes = inv.select(getattr(args, "nodes", None))
    return recorded_run(args, command, inv), nodes


def run_outcome(run: RecordedRun, work: Callable[[Any], Any], hook: Callable[[Any], Any] | None = None,
                **extra: Any) -> tuple[Any, dict]:
    """Open the run's session (its commands logged through `hook` when given), let
    `work(session)` return an outcome (exit_code, to_dict()), write <command>.json (the outcome,
    run_dir and `extra`) and finish the record, whatever happens. Returns (outcome, payload)."""
    code = 2
    try:
        with run.session(hook) as session:
            outcome = work(session)
        code = outcome.exit_code
        payload = dict(outcome.to_dict(), run_dir=str(run.path), **extra)
        run.record.write_json(f"{run.command}.json", payload)
    finally:
        run.finish(code)
    return outcome, payload


@contextlib.contextmanager
def progress(total: int, label: str, enabled: bool) -> Iterator[Any]:
    """A progress bar on stderr for a person at a terminal (nodes done/total, failures so far,
    elapsed); a no-op callback otherwise (not a terminal, or --json). The callback takes the
    finished item: one whose `ok` is False counts as a failure."""
    if not enabled or not sys.stderr.isatty():
        yield lambda *_: None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[failed]}"), TimeElapsedColumn(),
                   console=stderr.real(), transient=True)
    failed = 0

    def advance(result: Any = None, *_: Any) -> None:
        nonlocal failed
        if result is not None and getattr(result, "ok", True) is False:
            failed += 1
            bar.update(task, failed=f"{failed} failed")
        bar.advance(task)

    with bar:
        task = bar.add_task(label, total=total, failed="")
        yield advance


def _number(text: str, kind: type, minimum: float, strict: bool,
            maximum: float = math.inf) -> Any:
    """Parse a flag's number: ASCII digits only (no `_`: Python reads 1_0 as 10), finite,
    >= (or >) minimum and <= maximum."""
    name = "an integer" if kind is int else "a number"
    if not isinstance(text, str) or not text.isascii() or not text.isprintable() \
            or len(text) > 64 or "_" in text:
        raise argparse.ArgumentTypeError(f"not {name}: {text!r}")
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {name}: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    if value < minimum or (strict and value == minimum):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}: {text}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be <= {maximum:g}: {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _number(text, int, 1, strict=False)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, 0, strict=True)


def int_range(minimum: int, maximum: int) -> Callable[[str], int]:
    """argparse type factory: an integer in [minimum, maximum]."""
    def parse(text: str) -> int:
        return _number(text, int, minimum, strict=False, maximum=maximum)
    parse.__name__ = f"int in [{minimum}, {maximum}]"
    return parse


def float_range(minimum: float, maximum: float, *, strict: bool = False) -> Callable[[str], float]:
    """argparse type factory: a finite number in [minimum, maximum] ((minimum, maximum] if strict)."""
    def parse(text: str) -> float:
        return _number(text, float, minimum, strict=strict, maximum=maximum)
    parse.__name__ = f"number in {'(' if strict else '['}{minimum:g}, {maximum:g}]"
    return parse
