"""`cluster undeploy NAME [--timeout S] [--dry-run] [--yes] [--json]`: remove one Serve app.

The other declaratively deployed apps stay (the dashboard's PUT is sent with the remaining
ones, merged on the head). Waits until Serve no longer lists the app. Exit 0 removed (or was
not deployed), 2 otherwise. The steps are playbooks/undeploy.py.
"""

from __future__ import annotations

import argparse

from cluster.base.flags import text_value
from cluster.commands._common import (add_changing, add_json, positive_float, recorded_run,
                                      stdout)

DEFAULT_TIMEOUT_S = 180.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "undeploy", help="remove a Serve application (the others keep running)",
        description="Remove one application deployed with `cluster deploy` (or any declarative "
                    "Serve config) through the dashboard's REST API, keeping the others, and "
                    "wait until Serve no longer lists it.",
        epilog="Exit codes: 0 removed or not deployed, 2 failed or still listed after --timeout.")
    p.add_argument("name", metavar="NAME", type=text_value, help="the application name (`cluster status`)")
    p.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="how long to wait until it is gone (default %(default)g)")
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from playbooks import undeploy

    run_ = recorded_run(args, "undeploy")
    options = undeploy.UndeployOptions(args.name, timeout_s=args.timeout, dry_run=args.dry_run)
    out = undeploy.UndeployOutcome.start(options, str(run_.path))
    try:
        with run_.session() as session:
            undeploy.run(run_.inventory, session, options, confirm=run_.confirm,
                         on_event=run_.event, out=out)
    finally:
        run_.record.write_json("undeploy.json", out.doc)
        run_.finish(out.exit_code)
    doc, code = out.doc, out.exit_code
    if args.json:
        run_.print_json(doc)
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
                     f"{run_.scrub(doc.get('error') or '')}", soft_wrap=True)
    return code
