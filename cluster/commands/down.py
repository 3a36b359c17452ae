"""`cluster down [--yes] [--dry-run] [--json]`: stop Ray on the workers, then on the head."""

from __future__ import annotations

import argparse

from cluster.commands._common import (add_changing, add_json, add_serial, recorded_run,
                                      run_outcome, stdout)
from cluster.commands.up import print_plan, steps_table
from cluster.base.errors import UsageError
from playbooks import ray_down


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "down", help="stop Ray on every node (workers first, then the head); idempotent",
        description="Stop Ray with `ray stop` on each node that runs it (workers in parallel, "
                    "then the head), then check that no Ray process is left. Only Ray processes "
                    "of each node are affected. Running Serve apps and jobs are killed.")
    add_serial(p)
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.serial < 0:
        raise UsageError("--serial must be >= 0")
    run_ = recorded_run(args, "down")
    options = ray_down.DownOptions(dry_run=args.dry_run, serial=args.serial)
    outcome, payload = run_outcome(run_, lambda session: ray_down.run(
        run_.inventory, session, options, run_.confirm, run_.event), dry_run=args.dry_run)
    code = outcome.exit_code
    if args.json:
        run_.print_json(payload)
        return code
    if args.dry_run:
        print_plan(outcome.plan, "plan (dry run: nothing was changed)")
        return code
    if outcome.steps:
        stdout.print(steps_table(outcome.steps + outcome.extra_steps, "cluster down"))
    if outcome.stopped:
        stdout.print(f"[bold red]stopped:[/bold red] {outcome.stopped}")
    elif code != 0:
        stdout.print("[bold red]Ray is not stopped everywhere[/bold red] (see above)")
    else:
        stdout.print("Ray stopped" if outcome.changed else "nothing to stop: Ray is not running")
    return code
