"""`cluster status [--json]`: the Ray cluster as the head sees it, matched to the inventory."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

from rich.table import Table
from rich.text import Text

from cluster.commands._common import (add_json, float_range, load_inventory, print_json,
                                      start_run, stdout)
from cluster.report.fold import Row, exact, fold
from cluster.report.render import GRID_MAX_NODES, folded_table, id_column, text_column
from cluster.commands._common import inventory_secrets
from cluster.base.textsafe import terminal_safe_line
from cluster.nodes.remote import Session


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status", help="Ray nodes, GPUs, version and Serve applications, read on the head",
        description="Ask the head (over SSH, through the dashboard's REST API, or the GCS when "
                    "the dashboard does not answer) which Ray nodes are alive with which GPUs "
                    "and CPUs, and which Serve applications run, with their serving health "
                    "from vLLM's metrics. Exit 0 when every inventory node is alive, 2 "
                    "otherwise; 1 when the nodes are fine but an app has a serving warning "
                    "(out of capacity).")
    _add_serving_args(p)
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from playbooks import status

    inv = load_inventory(args)
    record = start_run(args, inv, "status")  # run record: the query's log and status.json
    record.secrets = record.secrets + inventory_secrets(inv)
    code = 2
    try:
        with Session(inv, hooks=[record.record]) as session:
            outcome = status.run(inv, session, status.StatusOptions(args.window))
        doc, code = outcome.to_dict(), outcome.exit_code
        record.write_json("status.json", dict(doc, run_dir=str(record.path)))
    finally:
        record.finish(code)
    if args.json:
        print_json(doc)
        return code
    head = doc["head"]
    if not head["reachable"]:
        stdout.print(f"[bold red]head {head['name']} unreachable[/bold red]: "
                     + "; ".join(doc["errors"]))
        return code
    if not head["answered"]:
        stdout.print(f"[bold red]Ray is not running on the head {head['name']}[/bold red] "
                     f"(nothing answers at {head['gcs_address']} or the dashboard): "
                     + "; ".join(doc["errors"]))
        return code
    table = Table(title=f"Ray {doc['ray_version']} - dashboard {doc['dashboard_url']} "
                        f"on {head['name']} (source: {head['source']})")
    if len(doc["nodes"]) > GRID_MAX_NODES:
        stdout.print(_nodes_folded(doc, table.title))
        table = None
    else:
        for col in ("node", "state", "ip", "GPUs", "CPUs", "GPU model", "node id"):
            id_column(table, col)
    for n in doc["nodes"] if table is not None else ():
        table.add_row(n["name"] or "(not in inventory)",
                      Text("alive", style="green") if n["alive"]
                      else Text("dead", style="bold red"),
                      n["ip"], f"{n['gpus']:g}", f"{n['cpus']:g}", n["gpu_model"] or "-",
                      n["node_id"][:16])
    if table is not None:
        stdout.print(table)
    stdout.print(_metrics_line(doc["dashboard"]["metrics"]), soft_wrap=True)
    apps = (doc["serve"] or {}).get("applications") or {}
    if apps:
        serve = Table(title="Serve applications")
        for col in ("app", "status", "route"):
            id_column(serve, col)
        for col in ("deployments", "transport"):
            text_column(serve, col)
        for name, app in apps.items():
            deps = ", ".join(f"{d}: {v['status']} ({v['running_replicas']}/{v['replicas']})"
                             for d, v in app["deployments"].items())
            confirmed = (app.get("engine_transport") or {}).get("groups") or ["-"]
            serve.add_row(name, str(app["status"]), str(app["route_prefix"]), deps,
                          "; ".join(confirmed))
        stdout.print(serve)
        for name, rank in status.broken_ranks(doc):
            stdout.print(f"[bold red]rank {rank['rank']} {rank['state']}[/bold red] "
                         f"(node {rank['node'] or '?'}, {rank['node_ip'] or 'no IP'}) of "
                         f"replica {rank['replica_id']}: it takes down that replica of app "
                         f"{name} (a multi-node engine serves only with every rank)",
                         soft_wrap=True)
        _print_serving(apps)
    elif doc["serve"] is not None:
        stdout.print("no Serve application")
    if doc["health"]:
        stdout.print(_health_folded(doc["health"], doc["health_period_s"]))
    _print_health_actions(doc.get("health_actions") or {})
    if doc["missing"]:
        stdout.print(f"[bold red]missing from Ray:[/bold red] {', '.join(doc['missing'])}")
    return code


def _health_folded(health: dict, period_s: float | None):
    """The health job's latest readings: one line per check and distinct result, with the age
    of its oldest reading."""
    rows, ages = [], {}
    for node, checks in health.items():
        for check, r in checks.items():
            value = "" if r["value"] is None else f" [{r['value']:g}]"
            rows.append(Row(node, check, r["status"], f"{r['summary']}{value}"))
            ages[node, check] = r["age_s"]
    groups = [replace(g, summary=f"{g.summary} ({max(ages[n, g.key] for n in g.nodes):.0f} s ago)")
              for g in fold(rows)]
    every = "period not reported" if period_s is None else f"every {period_s:g} s"
    return folded_table(groups, len(health), title=f"Node health (health job, {every})")


def _print_health_actions(actions: dict, shown: int = 10) -> None:
    """health.act: the nodes the job cordoned, then its latest records (one line each)."""
    for node, c in sorted((actions.get("cordoned") or {}).items()):
        why = terminal_safe_line(f"{node} ({c.get('finding')}); `cluster uncordon {node}` or "
                                 f"`cluster restart-node {node}` brings it back")
        stdout.print(Text.assemble(("cordoned by the health job: ", "bold yellow"), why),
                     soft_wrap=True)
    records = (actions.get("records") or [])[-shown:]
    if records:
        stdout.print("Health actions (latest first):")
    for r in reversed(records):
        moved = "" if r.get("move_s") is None else (
            f"; {len(r.get('replicas_moved') or [])} replica(s), "
            f"{len(r.get('gangs_moved') or [])} gang(s) moved in {r['move_s']} s")
        outcome = f" ({r['outcome']})" if r.get("outcome") else ""
        line = (f"{_clock(r.get('time'))} {r.get('action')} {r.get('node')}: {r.get('finding')}: "
                f"{r.get('evidence')} [{r.get('reason')}]{outcome}{moved}")
        stdout.print("  " + terminal_safe_line(line), soft_wrap=True, markup=False,
                     highlight=False)


def _clock(t) -> str:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
            or not 0 <= t < 1e11:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _metrics_line(metrics: dict) -> str:
    prom = metrics["prometheus_url"]
    grafana = metrics["grafana_url"]
    return ("metrics: " + (f"Prometheus {prom} on the head" if prom else "Prometheus off")
            + (f", Grafana {grafana}" if grafana else ""))


def _nodes_folded(doc: dict, title: str):
    """Ray's nodes folded: one line per distinct (state, GPUs, CPUs, GPU model)."""
    rows = [Row(n["name"] or f"(not in inventory: {n['ip']})", "nodes",
                "alive" if n["alive"] else "dead",
                f"{n['gpus']:g} GPUs, {n['cpus']:g} CPUs, {n['gpu_model'] or 'no GPU model'}")
            for n in doc["nodes"]]
    return folded_table(fold(rows, label=exact), len(rows), title=title, key_header="Ray")


# ---------------------------------------------------------------- serving section (docs/tune-status.md)


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=float_range(0, 600), metavar="S",
                   help="serving section: seconds between the two samples of each app's vLLM "
                        "/metrics (default 5; 0: one sample, gauges only). Exit 1 when an app "
                        "is out of capacity")


def _print_serving(apps: dict) -> None:
    rows = {name: app["serving"] for name, app in apps.items() if app.get("serving")}
    if not rows:
        return
    window = max((s.get("window_s") or 0) for s in rows.values())
    table = Table(title="Serving (vLLM metrics" + (f" over {window:.1f} s)" if window else ")"))
    for col in ("app", "replicas", "run/wait", "KV %", "preempt", "TTFT p50/p95 ms",
                "tok/s out/in"):
        id_column(table, col)
    text_column(table, "verdict")

    def num(value, fmt="{:.0f}"):
        return "-" if value is None else fmt.format(value)

    for name, s in rows.items():
        if s["status"] == "error":
            table.add_row(name, "-", "-", "-", "-", "-", "-",
                          Text(f"unavailable: {s.get('error')}", style="dim"))
            continue
        seen = f"{s['replicas_seen']}" + (f"/{s['replicas_expected']}"
                                          if s.get("replicas_expected") else "")
        kv = num(s["kv_cache_use_pct"])
        if s.get("kv_cache_use_min_pct") is not None and window:
            kv += f" (min {num(s['kv_cache_use_min_pct'])})"
        pre = num(s["preemptions"]) + (f" ({num(s['preemptions_per_s'], '{:.1f}')}/s)"
                                       if s.get("preemptions") else "")
        verdict = Text("out of capacity", style="bold yellow") if s["out_of_capacity"] else (
            Text("warning", style="yellow") if s["status"] == "warn" else Text("ok", style="green"))
        table.add_row(name, seen, f"{num(s['running'])}/{num(s['waiting'])}", kv, pre,
                      f"{num(s['ttft_p50_ms'])}/{num(s['ttft_p95_ms'])}",
                      f"{num(s['generation_tokens_per_s'])}/{num(s['prompt_tokens_per_s'])}",
                      verdict)
    stdout.print(table)
    for name, s in rows.items():
        for w in s.get("warnings") or []:
            stdout.print(f"[bold yellow]warning:[/bold yellow] {name}: {w}", soft_wrap=True)
        for n in s.get("notes") or []:
            stdout.print(f"[dim]note: {name}: {n}[/dim]", soft_wrap=True)
