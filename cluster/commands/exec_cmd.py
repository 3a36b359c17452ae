"""`cluster exec [--nodes PATTERN] [--timeout S] [--json] -- CMD...`: ad-hoc fan-out."""

from __future__ import annotations

import argparse
import dataclasses
import shlex

from cluster.commands._common import (add_json, add_nodes, emit_json, float_range,
                                      recorded_run_on_nodes, stdout)
from cluster.base.errors import UsageError
from cluster.report.fold import compress
from cluster.report.render import GRID_MAX_NODES, command_results_folded, command_results_table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "exec", help="run a command on nodes in parallel",
        description="Run a command on the selected nodes in parallel. One argument after -- is "
                    "a shell command line (pipes allowed); several are an exact argv, quoted.")
    add_nodes(p, "comma-separated node names or globs, or head / workers (default: all)")
    p.add_argument("--timeout", type=float_range(0, 86400, strict=True), metavar="S",
                   help="per-node command timeout in seconds (default: the inventory's)")
    add_json(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    p.set_defaults(handler=run)


def command_line(words: list[str]) -> str:
    if words and words[0] == "--":
        words = words[1:]
    if not words:
        raise UsageError("no command given: cluster exec -- CMD...")
    return words[0] if len(words) == 1 else shlex.join(words)


def run(args: argparse.Namespace) -> int:
    command = command_line(args.cmd)
    run_, nodes = recorded_run_on_nodes(args, "exec")
    inv, record = run_.inventory, run_.record
    with run_.session() as session, run_.progress(len(nodes)) as advance:
        results = session.fan_out(nodes, command, timeout=args.timeout, on_result=advance)
    code = 0 if all(r.ok for r in results) else 2
    payload = {"command": command, "exit_code": code,
               "status": "ok" if code == 0 else "fail",
               "results": [dict(r.to_dict(), address=inv.node(r.node).address) for r in results],
               "run_dir": str(record.path)}
    emit_json(record, "exec.json", payload, to_stdout=args.json)
    record.finish(code)
    if not args.json:
        # The table shows what --json and the run record show: the inventory's secrets masked.
        results = tuple(_scrubbed(run_.scrub, r) for r in results)
        title = run_.scrub(f"$ {command}")
        if len(results) <= GRID_MAX_NODES:
            stdout.print(command_results_table(results, title=title))
        else:
            for part in command_results_folded(results, title=title):
                stdout.print(part)
        bad = [r for r in results if not r.ok]
        summary = f"{len(results) - len(bad)}/{len(results)} nodes ok"
        if bad:
            by_status: dict[str, list[str]] = {}
            for r in bad:
                by_status.setdefault(r.status, []).append(r.node)
            summary += "; " + "; ".join(f"{status}: {compress(names)}"
                                        for status, names in by_status.items())
        stdout.print(summary)
    return code


def _scrubbed(scrub, result):
    """The result with every text field through the run's scrub (secrets masked)."""
    return dataclasses.replace(result, command=scrub(result.command), stdout=scrub(result.stdout),
                               stderr=scrub(result.stderr),
                               error=scrub(result.error) if result.error else result.error)
