"""`cluster exec [--nodes PATTERN] [--timeout S] [--json] -- CMD...`: ad-hoc fan-out; nodes behind a
jump host this run could not reach are one line (their --json records each name the cause)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex

from cluster.commands._common import (add_json, add_node_timeout, add_nodes, emit_json,
                                      recorded_run_on_nodes, stdout)
from cluster.base.errors import UsageError
from cluster.report.fold import compress, shared_causes
from cluster.report.render import (GRID_MAX_NODES, command_results_folded, command_results_table,
                                   shared_cause_lines, shared_causes_json)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "exec", help="run a command on nodes in parallel",
        description="Run a command on the selected nodes in parallel. One argument after -- is "
                    "a shell command line (pipes allowed); several are an exact argv, quoted.")
    add_nodes(p, "comma-separated node names or globs, or head / workers (default: all)")
    add_node_timeout(p)
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
    with run_.session(node_time_s=args.timeout) as session, \
            run_.progress(len(nodes)) as advance:
        results = session.fan_out(nodes, command, timeout=args.timeout, on_result=advance)
    code = 0 if all(r.ok for r in results) else 2
    causes = shared_causes((r.node, r.error) for r in results if not r.reached)
    cause_of = {node: c.down for c in causes for node in c.nodes}
    payload = {"command": command, "exit_code": code,
               "status": "ok" if code == 0 else "fail",
               "results": [dict(r.to_dict(), address=inv.node(r.node).address,
                                shared_cause=_cause_json(cause_of.get(r.node)))
                           for r in results],
               "shared_causes": shared_causes_json(causes),
               "run_dir": str(record.path)}
    emit_json(record, "exec.json", payload, to_stdout=args.json)
    record.finish(code)
    if not args.json:
        # The table shows what --json and the run record show: the inventory's secrets masked.
        results = tuple(_scrubbed(run_.scrub, r) for r in results)
        title = run_.scrub(f"$ {command}")
        shown = tuple(r for r in results if r.node not in cause_of)  # the rest: one line a cause
        if shown and len(shown) <= GRID_MAX_NODES:
            stdout.print(command_results_table(shown, title=title))
        elif shown:
            for part in command_results_folded(shown, title=title):
                stdout.print(part)
        scrubbed_causes = shared_causes((r.node, r.error) for r in results if not r.reached)
        for line in shared_cause_lines(scrubbed_causes, "not run"):
            stdout.print(line)
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


def _cause_json(down) -> dict | None:
    """A node's shared cause in its --json record (None: it failed, if at all, on its own)."""
    return None if down is None else {"jump_host": down.jump_host, "cause": down.cause}


def _scrubbed(scrub, result):
    """The result with every text field through the run's scrub (secrets masked)."""
    return dataclasses.replace(result, command=scrub(result.command), stdout=scrub(result.stdout),
                               stderr=scrub(result.stderr),
                               error=scrub(result.error) if result.error else result.error)
