"""`cluster preflight [--nodes PATTERN] [--timeout S] [--json]`: every node check in parallel, plus
cross-node checks; nodes behind a jump host this run could not reach are one line, not a row each."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cluster.commands._common import (add_json, add_node_timeout, add_nodes, emit_json,
                                      recorded_run_on_nodes, stdout)
from cluster.report.fold import Row, fold, grid_fits, shared_causes
from playbooks import preflight
from cluster.report.render import (STATUS_STYLE, breakable, fix_lines, folded_table, id_column,
                                   prose, shared_cause_lines, shared_causes_json, text_column)
from cluster.base.results import Report, Status
from playbooks.outcome import never_confirm

if TYPE_CHECKING:  # rich is imported where a table is drawn: `--json` needs none (~40 ms)
    from rich.text import Text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preflight", help="check drivers, GPUs, NVLink, IB, GPUDirect, clocks, "
                                         "/dev/shm, memlock, versions, model files",
                       description="Read-only checks on every node in parallel plus cross-node "
                                   "checks. Exit 0 all ok, 1 warnings, 2 failures or errors.")
    add_nodes(p)
    p.add_argument("--no-clock-skew", action="store_true",
                   help="do not sample the nodes' clocks from here")
    p.add_argument("--no-reachability", action="store_true",
                   help="do not test TCP between the nodes on Ray's ports (a short-lived "
                        "listener on each node)")
    add_node_timeout(p)
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    run_, nodes = recorded_run_on_nodes(args, "preflight")
    inv, record = run_.inventory, run_.record
    options = preflight.PreflightOptions(tuple(nodes), measure_clock=not args.no_clock_skew,
                                         reachability=not args.no_reachability)
    with run_.session(node_time_s=args.timeout) as session, \
            run_.progress(len(nodes)) as advance:
        report = preflight.run(inv, session, options, never_confirm,
                               run_.events(advance)).report
    payload = report.to_dict() | {"run_dir": str(record.path), "inventory": inv.path,
                                  "shared_causes": shared_causes_json(_shared_causes(report))}
    emit_json(record, "preflight.json", payload, to_stdout=args.json)
    record.finish(report.exit_code)
    if not args.json:
        render(report)
        stdout.print(f"report: {record.path / 'preflight.json'}")
    return report.exit_code


def _cell(status: Status, summary: str, width: int = 30) -> "Text":
    from rich.text import Text

    short = summary if len(summary) <= width else summary[: width - 1] + "…"
    text = Text(status.value, style=STATUS_STYLE.get(status.value, ""))
    text.append(f" {short}")
    return text


def _shared_causes(report: Report):
    """The nodes whose every check failed for one cause outside them (a dead jump host)."""
    return shared_causes((r.node, r.summary) for r in report.results
                         if r.node is not None and r.status is Status.ERROR)


def render(report: Report) -> None:
    """A check x node grid while it fits the terminal, else one line per distinct result (folded);
    nodes behind a dead jump host: one line per jump host instead; then the cross-node section,
    the fixes and the counts."""
    causes = _shared_causes(report)
    behind = {node for c in causes for node in c.nodes}
    node_results = [r for r in report.results if r.node is not None and r.node not in behind]
    nodes = list(dict.fromkeys(r.node for r in node_results))
    if nodes and grid_fits(len(nodes), stdout.width):
        _render_grid(report, node_results, nodes)
    else:
        _render_folded(report, node_results, nodes)
    for line in shared_cause_lines(causes, "not checked"):
        stdout.print(line)
    counts = report.counts()
    stdout.print(" ".join(f"{k} {v}" for k, v in counts.items() if v) or "no checks")


def _render_folded(report: Report, node_results, nodes) -> None:
    groups = fold(Row(r.node, r.check, r.status.value, r.summary, r.fix) for r in node_results)
    if groups:
        stdout.print(folded_table(groups, len(nodes), title=f"preflight: {len(nodes)} nodes"))
    _render_cross(report)
    for line in fix_lines(groups, len(nodes)):
        stdout.print(line)


def _render_grid(report: Report, node_results, nodes) -> None:
    from rich.table import Table
    from rich.text import Text

    checks = list(dict.fromkeys(r.check for r in node_results))
    table = Table(title="preflight", show_lines=True)
    id_column(table, "check")
    for n in nodes:
        text_column(table, n)
    for c in checks:
        cells = []
        for n in nodes:
            hit = next((r for r in node_results if r.node == n and r.check == c), None)
            cells.append(_cell(hit.status, hit.summary) if hit else Text(""))
        table.add_row(c, *cells)
    stdout.print(table)
    _render_cross(report)
    bad = [r for r in report.results if r.status in (Status.FAIL, Status.ERROR, Status.WARN)
           and r.node is not None]
    for r in bad:
        line = Text(f"{r.status.value:5} {r.node}/{r.check}: ",
                    style=STATUS_STYLE.get(r.status.value, ""))
        line.append(breakable(r.summary))
        if r.fix:
            line.append(f"\n      fix: {r.fix}", style="cyan")
        stdout.print(line)


def _render_cross(report: Report) -> None:
    from rich.table import Table
    from rich.text import Text

    cluster_rows = [r for r in report.results if r.node is None]
    if cluster_rows:
        cross = Table(title="cross-node", show_lines=False)
        id_column(cross, "check")
        id_column(cross, "status")
        text_column(cross, "summary")
        for r in cluster_rows:
            cross.add_row(r.check, Text(r.status.value, style=STATUS_STYLE.get(r.status.value, "")),
                          prose(r.summary))
        stdout.print(cross)
        for r in cluster_rows:
            if r.fix and r.status in (Status.FAIL, Status.ERROR, Status.WARN):
                stdout.print(Text(f"fix {r.check}: {r.fix}", style="cyan"))
