"""`cluster drain NODE [--wait S] [--dry-run] [--yes] [--json]`: Ray's node drain, Serve
replicas moved off first (playbooks/drain.py)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from cluster.base.flags import text_value
from cluster.ray import rollout
from cluster.commands._common import (add_changing, add_json, float_range, int_range,
                                      load_inventory, recorded_run, run_outcome, stdout)
from cluster.base.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain", help="drain a worker: no new Ray work there, Serve replicas moved off first",
        description="Ask Ray's GCS to drain NODE (`ray drain-node`, reason preemption): it takes "
                    "no new tasks or actors, and Serve starts replacement replicas on other nodes "
                    "before stopping the ones on it. Waits until no replica is left on NODE and "
                    "every app is RUNNING. Refused (with the numbers) when the other alive nodes "
                    "cannot carry the deployed apps. `cluster restart-node NODE` brings it back.")
    add_node_and_wait(p)
    p.add_argument("--deadline", type=int_range(1, 86400), default=rollout.DEFAULT_DRAIN_DEADLINE_S, metavar="S",
                   help="tell Ray the node goes away after S seconds (default %(default)s)")
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def add_node_and_wait(p: argparse.ArgumentParser) -> None:
    """NODE and --wait, shared by drain and restart-node."""
    p.add_argument("node", metavar="NODE", type=text_value, help="an inventory worker name")
    p.add_argument("--wait", type=float_range(0, 3600), default=rollout.DEFAULT_MOVE_WAIT_S, metavar="S",
                   help="how long to wait for the replicas to move (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from playbooks import drain

    return execute(args, "drain", drain.run, drain.DrainOptions(
        args.node, dry_run=args.dry_run, wait_s=args.wait, deadline_s=args.deadline),
        ("--deadline", args.deadline))


def execute(args: argparse.Namespace, command: str, playbook: Callable[..., Any],
            options: Any, limit: tuple[str, float]) -> int:
    """Shared by drain and restart-node: checks, run dir, session, the playbook, output.
    `limit`: the command's other time flag and its value, > 0 like --wait."""
    if args.wait <= 0 or limit[1] <= 0:
        raise UsageError(f"--wait and {limit[0]} must be > 0")
    inv = load_inventory(args)
    inv.node(args.node)  # unknown name -> InventoryError/UsageError before anything runs
    run_ = recorded_run(args, command, inv)
    outcome, payload = run_outcome(run_, lambda session: playbook(
        inv, session, options, confirm=run_.confirm, on_event=run_.event), dry_run=args.dry_run)
    code = outcome.exit_code
    if args.json:
        run_.print_json(payload)
        return code
    if outcome.capacity is not None:
        stdout.print(f"capacity without {args.node}: {outcome.capacity.summary()}")
    for r in outcome.to_dict()["gang_replicas"]:
        stdout.print(f"app {r['app']} loses replica {r['replica_id']}: its node rank "
                     f"{r['rank']} runs on {args.node} (a multi-node engine needs every rank)",
                     markup=False)
    if args.dry_run:
        stdout.print("plan (dry run: nothing was changed):")
        for line in outcome.planned:
            stdout.print(run_.scrub(line), soft_wrap=True, markup=False)
    for s in outcome.steps:
        stdout.print(f"{s['step']:14} {s['status']:9} {run_.scrub(s['message'])}", markup=False)
    if outcome.stopped and outcome.stopped != "dry run":
        stdout.print(f"[bold red]stopped:[/bold red] {run_.scrub(outcome.stopped)}")
    elif not args.dry_run:
        stdout.print(f"{command} {args.node}: done")
    stdout.print(f"record: {run_.path}")
    return code
