"""`cluster down [--yes] [--dry-run] [--json]`: stop Ray on the workers, then on the head."""

from __future__ import annotations

import argparse
import json

from cluster.commands._common import (add_changing, add_json, add_serial, confirm,
                                      load_inventory, print_json, start_run, stderr, stdout)
from cluster.errors import UsageError
from cluster.commands.up import inventory_secrets, print_plan, steps_table
from cluster.remote import Session
from cluster.render import to_json
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
    inv = load_inventory(args)
    record = start_run(args, inv, "down")
    record.secrets = record.secrets + inventory_secrets(inv)

    def event(line: str) -> None:
        if not args.json:
            stderr.print(f"[dim]down:[/dim] {line}")

    code = 2
    try:
        with Session(inv, hooks=[record.record]) as session:
            outcome = ray_down.run(inv, session, args.dry_run,
                                   confirm=lambda q: confirm(q, args.yes), on_event=event,
                                   serial=args.serial)
        code = outcome.exit_code
        payload = dict(outcome.to_dict(), run_dir=str(record.path), dry_run=args.dry_run)
        record.write_json("down.json", payload)
    finally:
        record.finish(code)
    if args.json:
        print_json(json.loads(record.scrub(to_json(payload))))
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
