"""`cluster inventory [--json]`: show the resolved inventory, secrets redacted."""

from __future__ import annotations

import argparse

from rich.table import Table

from rich.markup import escape

from cluster.commands._common import add_json, load_inventory, print_json, stderr, stdout
from cluster.nodes.inventory import redact_env
from cluster.report.render import breakable, id_column, text_column


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inventory", help="show the resolved inventory (secrets redacted)")
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    inv = load_inventory(args)
    for warning in inv.warnings:
        stderr.print(f"warning: {escape(warning)}", soft_wrap=True)
    code = 1 if inv.warnings else 0
    if args.json:
        print_json(inv.to_dict(redact=True))
        return code
    table = Table(title=f"inventory: {inv.path}")
    for col in ("node", "role"):
        id_column(table, col)
    text_column(table, "ssh")
    for col in ("node ip", "NCCL/GLOO iface"):
        id_column(table, col)
    for col in ("IB HCAs", "env"):
        text_column(table, col)
    for n in inv.nodes:
        ssh = "local" if n.local else f"{n.user or ''}{'@' if n.user else ''}{n.address}:{n.port}"
        if n.jump_host:
            ssh += f" via {n.jump_host}"
        env = " ".join(f"{k}={v}" for k, v in redact_env(n.env, inv.secret_names).items())
        table.add_row(*(escape(cell) for cell in (
            n.name, n.role, ssh, n.ip,
            f"{n.nccl_socket_ifname or '-'} / {n.gloo_socket_ifname or '-'}",
            breakable(",".join(n.ib_hcas)) or "-", env or "-")))
    stdout.print(table)
    exp = inv.expectations
    stdout.print(escape(
        f"expected GPU: {exp.get('gpu_model') or 'any (same on all nodes)'} x "
        f"{exp.get('gpus_per_node') or 'any'}; model path: {inv.model_path or '-'}; "
        f"Ray: port {inv.ray.port}, dashboard {inv.ray.dashboard_host}:{inv.ray.dashboard_port}"))
    return code
