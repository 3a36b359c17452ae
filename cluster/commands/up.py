"""`cluster up [--skip-preflight] [--force] [--stagger S] [--dry-run] [--yes] [--json]`."""

from __future__ import annotations

import argparse
import json
from typing import Callable

from rich.table import Table
from rich.text import Text

from cluster.commands._common import (add_changing, add_json, add_serial, float_range,
                                      print_json, recorded_run, stdout)
from cluster.base.errors import UsageError
from cluster.report.fold import Row, compress, fold, shape
from cluster.ray.ray_cluster import RayActionPlan, StepResult
from cluster.report.render import (GRID_MAX_NODES, folded_table, id_column,
                                   status_text, text_column, to_json)
from playbooks import ray_up


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up", help="start (or repair) the Ray cluster: head, then workers; idempotent",
        description="Run preflight, then start Ray on the head and the workers with each node's "
                    "IP, fixed ports, GPU count and NCCL/GLOO/VLLM env at `ray start` time, and "
                    "wait until every node is alive. On a healthy cluster it changes nothing; a "
                    "dead or missing worker is rejoined; version skew is refused before any start.")
    p.add_argument("--skip-preflight", action="store_true", help="do not run preflight first")
    p.add_argument("--force", action="store_true",
                   help="start even when preflight reports failures, and on a worker whose "
                        "vLLM or torch differs from the head's (said in the output; a Ray or "
                        "Python difference is still refused: Ray refuses the join)")
    p.add_argument("--stagger", type=float_range(0, 600), default=0.0, metavar="S",
                   help="start the workers S seconds apart instead of all at once (ray#59778)")
    p.add_argument("--timeout", type=float_range(0, 86400, strict=True), default=ray_up.DEFAULT_WAIT_S, metavar="S",
                   help="how long to wait for every node to register (default %(default)s)")
    add_serial(p)
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.stagger < 0 or args.timeout <= 0:
        raise UsageError("--stagger must be >= 0 and --timeout > 0")
    if getattr(args, "serial", 0) < 0:
        raise UsageError("--serial must be >= 0")
    run_ = recorded_run(args, "up")
    inv, record = run_.inventory, run_.record
    options = ray_up.UpOptions(skip_preflight=args.skip_preflight, force=args.force,
                               stagger_s=args.stagger, dry_run=args.dry_run, wait_s=args.timeout,
                               serial=args.serial)
    code = 2
    try:
        with run_.session() as session:
            outcome = ray_up.run(inv, session, options, confirm=run_.confirm,
                                 on_event=run_.event)
        if args.dry_run and outcome.exit_code == 0 and _preflight_failed(outcome) \
                and not args.force:
            outcome.exit_code = 2
        code = outcome.exit_code
        if code == 0 and inv.warnings:  # e.g. a dashboard bound beyond loopback: warnings only
            code = 1
        payload = dict(outcome.to_dict(), run_dir=str(record.path), dry_run=args.dry_run,
                       inventory_warnings=list(inv.warnings))
        payload["exit_code"] = code
        payload["grafana"] = dict(payload["grafana"], dir=_write_dashboards(record, outcome))
        record.write_json("up.json", payload)
    finally:
        record.finish(code)
    if args.json:
        print_json(json.loads(record.scrub(to_json(payload))))
    else:
        _print(outcome, args.dry_run, record.scrub)
        if payload["grafana"]["dir"]:
            stdout.print(f"Ray's Grafana dashboards (to import): {payload['grafana']['dir']}",
                         soft_wrap=True)
        for warning in inv.warnings:
            stdout.print(Text(f"warning: {warning}", style="yellow"), soft_wrap=True)
    return code


def _write_dashboards(record, outcome: ray_up.UpOutcome) -> str | None:
    """Ray's Grafana dashboards into <run dir>/grafana/ (for import); that folder or None."""
    if not outcome.grafana:
        return None
    (record.path / "grafana").mkdir(exist_ok=True)
    for name, text in outcome.grafana.items():
        record.write_text(f"grafana/{name}", text)
    return str(record.path / "grafana")


def _preflight_failed(outcome: ray_up.UpOutcome) -> bool:
    return outcome.preflight_error is not None or \
        (outcome.preflight is not None and outcome.preflight.exit_code >= 2)


def plan_table(plan: RayActionPlan, title: str) -> Table:
    nodes = {a.node for a in plan.actions}
    if len(nodes) > GRID_MAX_NODES:
        groups = fold(Row(a.node, a.kind + (" (asks first)" if a.needs_confirmation else ""),
                          "plan", a.reason) for a in plan.actions)
        return folded_table(groups, len(nodes), title=title, key_header="action")
    table = Table(title=title)
    id_column(table, "node")
    id_column(table, "action")
    text_column(table, "why")
    for a in plan.actions:
        table.add_row(a.node, a.kind + (" (asks first)" if a.needs_confirmation else ""), a.reason)
    return table


def print_plan(plan: RayActionPlan, title: str, scrub: Callable[[str], str] = lambda t: t) -> None:
    """The plan table, then the exact commands per node, unwrapped (copy-pasteable; secret
    values of the inventory's env shown as ***)."""
    stdout.print(plan_table(plan, title))
    nodes = {a.node for a in plan.actions}
    if len(nodes) <= GRID_MAX_NODES:
        for a in plan.actions:
            for command in a.commands:
                stdout.print(Text(scrub(f"[{a.node}] $ {command}")), soft_wrap=True)
        return
    # Many nodes: each distinct command list once (numbers, such as addresses, may differ),
    # shown for its first node; every node's exact commands are in the run's JSON.
    seen: dict[str, list[str]] = {}
    first: dict[str, tuple[str, tuple[str, ...]]] = {}
    for a in plan.actions:
        if not a.commands:
            continue
        key = a.kind + "\0" + "\0".join(shape(c) for c in a.commands)
        seen.setdefault(key, []).append(a.node)
        first.setdefault(key, (a.node, a.commands))
    for key, names in seen.items():
        node, commands = first[key]
        also = f" (and {len(names) - 1} more nodes: {compress(names[1:])}, with their own values)" \
            if len(names) > 1 else ""
        stdout.print(Text(f"[{node}]{also}"), soft_wrap=True)
        for command in commands:
            stdout.print(Text(scrub(f"  $ {command}")), soft_wrap=True)


def steps_table(steps: tuple[StepResult, ...], title: str,
                scrub: Callable[[str], str] = lambda t: t) -> Table:
    nodes = {s.node for s in steps}
    if len(nodes) > GRID_MAX_NODES:
        groups = fold(Row(s.node, s.action, s.status, scrub(s.message)) for s in steps)
        return folded_table(groups, len(nodes), title=title, key_header="action")
    table = Table(title=title)
    for col in ("node", "action", "status", "time"):
        id_column(table, col)
    text_column(table, "detail")
    for s in steps:
        took = sum(r.duration_s for r in s.results)
        table.add_row(s.node, s.action, status_text(s.status), f"{took:.1f}s" if s.results else "",
                      scrub(s.message))
    return table


def _print(outcome: ray_up.UpOutcome, dry_run: bool, scrub: Callable[[str], str]) -> None:
    if outcome.preflight is not None and outcome.preflight.exit_code >= 1:
        from cluster.commands.preflight import render as render_preflight   # grid or folded,
        render_preflight(outcome.preflight)        # a dead jump host's nodes on one line
    if outcome.preflight_error:
        stdout.print(f"[bold red]preflight:[/bold red] {outcome.preflight_error}")
    plan = outcome.plan
    if plan is not None:
        if dry_run or plan.refused:
            print_plan(plan, "plan (dry run: nothing was changed)" if dry_run else "plan", scrub)
        for line in plan.refused:
            stdout.print(f"[bold red]refused:[/bold red] {line}")
        if plan.auth is not None:
            stdout.print(Text(f"Ray auth: {plan.auth.mode} (from {plan.auth.source})"),
                         soft_wrap=True)
        for line in plan.warnings:
            stdout.print(f"[yellow]warning:[/yellow] {line}")
    if outcome.steps and not dry_run:
        stdout.print(steps_table(outcome.steps + outcome.extra_steps, "cluster up", scrub))
    if outcome.grafana_error:
        stdout.print(f"[yellow]warning:[/yellow] {outcome.grafana_error}")
    for node, tail in outcome.failed_logs.items():
        stdout.print(f"[bold red]{node}:[/bold red] `ray start` failed; end of its Ray logs:")
        stdout.print(Text(scrub(tail) or "(no Ray log)"))
    if outcome.wait is not None and not outcome.wait.ok:
        for node, problem in outcome.wait.problems.items():
            stdout.print(f"[bold red]{node}:[/bold red] {problem}")
            tail = outcome.wait.log_tails.get(node)
            if tail:
                stdout.print(Text(scrub(tail)))
    if outcome.status is not None:
        alive = [n for n in outcome.status["nodes"] if n["alive"] and n["name"]]
        gpus = sum(n["gpus"] for n in alive)
        stdout.print(f"{len(alive)} node(s) alive, {gpus:g} GPUs; "
                     f"Ray {outcome.status['ray_version']}; "
                     f"dashboard {outcome.status['dashboard_url']} on the head "
                     "(`cluster dashboard` tunnels to it)")
    if outcome.health_job is not None:
        style = "yellow" if outcome.health_job.status == "failed" else "dim"
        stdout.print(Text(scrub(f"health job: {outcome.health_job.message}"), style=style))
    if outcome.stopped and outcome.stopped != "dry run":
        stdout.print(f"[bold red]stopped:[/bold red] {outcome.stopped}")
    elif not dry_run and outcome.plan is not None and not outcome.plan.refused:
        stdout.print("changed" if outcome.changed else "nothing to change: the cluster is up")
