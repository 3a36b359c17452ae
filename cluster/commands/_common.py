"""Helpers shared by the CLI subcommands: inventory loading, output, prompts, progress, run records."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cluster import inventory as inventory_mod
from cluster.errors import UsageError
from cluster.inventory import Inventory
from cluster.render import to_json
from cluster.rundir import RunDir

stdout = Console(soft_wrap=False)
stderr = Console(stderr=True)


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def add_changing(parser: argparse.ArgumentParser) -> None:
    """Flags every node-changing command has."""
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would run on each node and change nothing")
    parser.add_argument("--yes", action="store_true",
                        help="answer yes to confirmations (required without a terminal)")


def add_serial(parser: argparse.ArgumentParser) -> None:
    """--serial N: change the workers N at a time (a rolling operation); 0 means all at once."""
    parser.add_argument("--serial", type=int, default=0, metavar="N",
                        help="change the workers N at a time, stopping at the first failed "
                             "batch (default: all at once)")


def load_inventory(args: argparse.Namespace) -> Inventory:
    return inventory_mod.load(getattr(args, "inventory", None))


def print_json(data: Any) -> None:
    sys.stdout.write(to_json(data) + "\n")
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


def start_run(args: argparse.Namespace, inventory: Inventory, command: str) -> RunDir:
    return RunDir.create(inventory.run_dir, command, argv=sys.argv,
                         inventory_path=inventory.path, secrets=inventory.secret_values())


@contextlib.contextmanager
def progress(total: int, label: str, enabled: bool) -> Iterator[Any]:
    """A progress bar on stderr for a person at a terminal; a no-op callback otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield lambda *_: None
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=stderr, transient=True)
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda *_: bar.advance(task)


def _number(text: str, kind: type, minimum: float, strict: bool):
    try:
        value = kind(text)
    except ValueError:
        name = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"not {name}: {text!r}") from None
    if value < minimum or (strict and value == minimum):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}: {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _number(text, int, 1, strict=False)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(text, int, 0, strict=False)


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    return _number(text, float, 0, strict=True)
