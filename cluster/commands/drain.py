"""`cluster drain NODE [--wait S] [--dry-run] [--yes] [--json]`: Ray's node drain, Serve
replicas moved off first."""

from __future__ import annotations

import argparse
import json

from cluster import rollout
from cluster.commands._common import (float_range, int_range, add_changing, add_json, confirm, load_inventory,
                                      print_json, start_run, stderr, stdout)
from cluster.commands.up import inventory_secrets
from cluster.errors import UsageError
from cluster.remote import Session
from cluster.render import to_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain", help="drain a worker: no new Ray work there, Serve replicas moved off first",
        description="Ask Ray's GCS to drain NODE (`ray drain-node`, reason preemption): it takes "
                    "no new tasks or actors, and Serve starts replacement replicas on other nodes "
                    "before stopping the ones on it. Waits until no replica is left on NODE and "
                    "every app is RUNNING. Refused (with the numbers) when the other alive nodes "
                    "cannot carry the deployed apps. `cluster restart-node NODE` brings it back.")
    p.add_argument("node", metavar="NODE", help="an inventory worker name")
    p.add_argument("--wait", type=float_range(0, 3600), default=rollout.DEFAULT_MOVE_WAIT_S, metavar="S",
                   help="how long to wait for the replicas to move (default %(default)s)")
    p.add_argument("--deadline", type=int_range(1, 86400), default=rollout.DEFAULT_DRAIN_DEADLINE_S, metavar="S",
                   help="tell Ray the node goes away after S seconds (default %(default)s)")
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.wait <= 0 or args.deadline <= 0:
        raise UsageError("--wait and --deadline must be > 0")
    return execute(args, "drain", lambda session, inv, event: rollout.drain(
        session, inv, args.node, dry_run=args.dry_run, confirm=lambda q: confirm(q, args.yes),
        wait_s=args.wait, deadline_s=args.deadline, on_event=event))


def execute(args: argparse.Namespace, command: str, work) -> int:
    """Shared by drain and restart-node: run dir, session, output."""
    inv = load_inventory(args)
    inv.node(args.node)  # unknown name -> InventoryError/UsageError before anything runs
    record = start_run(args, inv, command)
    record.secrets = record.secrets + inventory_secrets(inv)

    def event(line: str) -> None:
        if not args.json:
            stderr.print(f"[dim]{command}:[/dim] {record.scrub(line)}")

    code = 2
    try:
        with Session(inv, hooks=[record.record]) as session:
            outcome = work(session, inv, event)
        code = outcome.exit_code
        payload = dict(outcome.to_dict(), run_dir=str(record.path), dry_run=args.dry_run)
        record.write_json(f"{command}.json", payload)
    finally:
        record.finish(code)
    if args.json:
        print_json(json.loads(record.scrub(to_json(payload))))
        return code
    if outcome.capacity is not None:
        stdout.print(f"capacity without {args.node}: {outcome.capacity.summary()}")
    if args.dry_run:
        stdout.print("plan (dry run: nothing was changed):")
        for line in outcome.planned:
            stdout.print(record.scrub(line), soft_wrap=True, markup=False)
    for s in outcome.steps:
        stdout.print(f"{s['step']:14} {s['status']:9} {record.scrub(s['message'])}", markup=False)
    if outcome.stopped and outcome.stopped != "dry run":
        stdout.print(f"[bold red]stopped:[/bold red] {record.scrub(outcome.stopped)}")
    elif not args.dry_run:
        stdout.print(f"{command} {args.node}: done")
    stdout.print(f"record: {record.path}")
    return code
