"""`cluster status [--json]`: the Ray cluster as the head sees it, matched to the inventory."""

from __future__ import annotations

import argparse

from rich.table import Table
from rich.text import Text

from cluster.commands._common import add_json, load_inventory, print_json, stdout
from cluster.ray_state import cluster_status, query_state, status_exit_code
from cluster.remote import Session


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status", help="Ray nodes, GPUs, version and Serve applications, read on the head",
        description="Ask the head (over SSH, through the dashboard's REST API, or the GCS when "
                    "the dashboard does not answer) which Ray nodes are alive with which GPUs "
                    "and CPUs, and which Serve applications run. Exit 0 when every inventory "
                    "node is alive, 2 otherwise.")
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    inv = load_inventory(args)
    with Session(inv) as session:
        state, result = query_state(session, inv, include_serve=True)
    doc = cluster_status(inv, state, head_reached=result.reached)
    code = status_exit_code(doc)
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
    for col in ("node", "state", "ip", "GPUs", "CPUs", "GPU model", "node id"):
        table.add_column(col, overflow="fold")
    for n in doc["nodes"]:
        table.add_row(n["name"] or "(not in inventory)",
                      Text("alive", style="green") if n["alive"] else Text("dead", style="bold red"),
                      n["ip"], f"{n['gpus']:g}", f"{n['cpus']:g}", n["gpu_model"] or "-",
                      n["node_id"][:16])
    stdout.print(table)
    apps = (doc["serve"] or {}).get("applications") or {}
    if apps:
        serve = Table(title="Serve applications")
        for col in ("app", "status", "route", "deployments"):
            serve.add_column(col, overflow="fold")
        for name, app in apps.items():
            deps = ", ".join(f"{d}: {v['status']} ({v['running_replicas']}/{v['replicas']})"
                             for d, v in app["deployments"].items())
            serve.add_row(name, str(app["status"]), str(app["route_prefix"]), deps)
        stdout.print(serve)
    elif doc["serve"] is not None:
        stdout.print("no Serve application")
    if doc["missing"]:
        stdout.print(f"[bold red]missing from Ray:[/bold red] {', '.join(doc['missing'])}")
    return code
