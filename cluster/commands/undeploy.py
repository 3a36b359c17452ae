"""`cluster undeploy NAME [--timeout S] [--dry-run] [--yes] [--json]`: remove one Serve app.

The other declaratively deployed apps stay (the dashboard's PUT is sent with the remaining
ones, merged on the head). Waits until Serve no longer lists the app. Exit 0 removed (or was
not deployed), 2 otherwise.
"""

from __future__ import annotations

import argparse
from typing import Any

from cluster.commands._common import (add_changing, add_json, confirm, load_inventory,
                                      print_json, start_run, stderr, stdout)

DEFAULT_TIMEOUT_S = 180.0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "undeploy", help="remove a Serve application (the others keep running)",
        description="Remove one application deployed with `cluster deploy` (or any declarative "
                    "Serve config) through the dashboard's REST API, keeping the others, and "
                    "wait until Serve no longer lists it.",
        epilog="Exit codes: 0 removed or not deployed, 2 failed or still listed after --timeout.")
    p.add_argument("name", metavar="NAME", help="the application name (`cluster status`)")
    p.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="how long to wait until it is gone (default %(default)g)")
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster import deploy
    from cluster.commands.up import inventory_secrets
    from cluster.dashboard_api import DashboardClient
    from cluster.remote import Session

    inv = load_inventory(args)
    record = start_run(args, inv, "undeploy")
    record.secrets = record.secrets + inventory_secrets(inv)
    say = (lambda line: None) if args.json else (lambda line: stderr.print(
        f"[dim]undeploy:[/dim] {line}"))
    doc: dict[str, Any] = {"name": args.name, "status": None, "run_dir": str(record.path),
                           "dry_run": args.dry_run}
    code = 2
    try:
        with Session(inv, hooks=[record.record]) as session:
            client = DashboardClient(session, inv)
            details = client.serve_details()
            before = deploy.app_state(details, args.name)
            others = sorted(n for n in (details.get("applications") or {}) if n != args.name)
            doc.update(previous=before.to_dict() if before else None, remaining=others)
            if before is None:
                doc["status"] = "ABSENT"
                code = 0
            elif args.dry_run:
                doc["status"] = "DRY_RUN"
                code = 0
            elif not confirm(f"Remove application {args.name!r} ({before.status}); "
                             f"{len(others)} other app(s) keep running?", args.yes):
                doc["status"] = "CANCELLED"
            else:
                say(f"removing {args.name} through the dashboard")
                applied = deploy.undeploy_app(client, args.name)
                doc["apply"] = applied.to_dict()
                if not applied.ok:
                    doc.update(status="FAILED", error=applied.error)
                else:
                    outcome = deploy.wait_until_gone(client, args.name, args.timeout,
                                                     on_event=say)
                    doc["waited_s"] = round(outcome.waited_s, 1)
                    if outcome.timed_out:
                        doc.update(status=outcome.state.status if outcome.state else "UNKNOWN",
                                   error=f"still listed after {args.timeout:g} s")
                    else:
                        doc["status"] = "REMOVED"
                        code = 0
    finally:
        record.write_json("undeploy.json", doc)
        record.finish(code)
    if args.json:
        import json

        from cluster.render import to_json
        print_json(json.loads(record.scrub(to_json(doc))))
        return code
    status = doc["status"]
    if status == "REMOVED":
        stdout.print(f"{args.name} removed (waited {doc.get('waited_s', 0):g} s); still "
                     f"running: {', '.join(doc['remaining']) or 'nothing'}")
    elif status == "ABSENT":
        stdout.print(f"{args.name} is not deployed: nothing to do "
                     f"(apps: {', '.join(doc['remaining']) or 'none'})")
    elif status == "DRY_RUN":
        stdout.print(f"dry run: would remove {args.name}; "
                     f"{', '.join(doc['remaining']) or 'no other app'} would keep running")
    else:
        stdout.print(f"[bold red]{args.name} {status}[/bold red]: "
                     f"{record.scrub(doc.get('error') or '')}", soft_wrap=True)
    return code
