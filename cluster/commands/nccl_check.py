"""`cluster nccl-check [--backend nccl|gloo] [--size-mb N] [--iters N] [--timeout S] [--json]`.

`--layout PLAN.yaml`: the fabric proof of a plan's groups (what `cluster deploy` runs before it
starts engines) without deploying: cluster/planning/fabric_proof.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any, Sequence

from rich.table import Table
from rich.text import Text

from cluster.base.flags import path_value
from cluster.ray import nccl_check
from cluster.base.bounds import bound
from cluster.commands._common import (add_json, add_nodes, float_range, int_range,
                                      load_inventory, recorded_run, run_outcome, stdout)
from cluster.base.errors import UsageError
from cluster.inspection.node_summary import PreflightFacts
from cluster.planning.modelinfo import read_json_file
from cluster.nodes.remote import CommandResult
from cluster.report.render import id_column, status_text, text_column
from playbooks.outcome import never_confirm

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "nccl-check", help="prove the real inter-node transport and bandwidth with an all-reduce",
        description="Run a timed torch.distributed all-reduce across the running Ray cluster as "
                    "a Ray job (it shows in the dashboard): NCCL with one rank per GPU, reading "
                    "NCCL_DEBUG output for the transport actually used (IB/RoCE with or without "
                    "GPUDirect RDMA, or a socket fallback), or gloo with one rank per node over "
                    "TCP. Reports the bus bandwidth against the expected one (IB rate x active "
                    "NICs per node, from the last preflight report). A node that is missing, "
                    "unreachable or dies fails the check by name, within --timeout. "
                    "Exit 0 ok, 1 warnings, 2 failures.")
    p.add_argument("--backend", choices=nccl_check.BACKENDS, default=None,
                   help="nccl (GPUs, default) or gloo (CPU, TCP between nodes); with --layout "
                        "the default is the engine's: nccl when Ray has GPUs, else gloo")
    p.add_argument("--layout", metavar="PLAN.yaml",
                   help="prove the groups of this plan's layout (each TP group, each pair of "
                        "neighbouring PP stages, the DP/EP groups) on the nodes and ports the "
                        "deployment would use, judged against cluster/data/fabric.yaml; "
                        "nothing is deployed")
    limit = lambda key: bound("nccl_check", key)  # noqa: E731
    p.add_argument("--size-mb", type=float_range(0, limit("size_mb_max"), strict=True),
                   default=None, metavar="N",
                   help=f"all-reduce size in MiB (default {nccl_check.DEFAULT_SIZE_MB['nccl']:g} "
                        f"for nccl, {nccl_check.DEFAULT_SIZE_MB['gloo']:g} for gloo)")
    p.add_argument("--iters", type=int_range(1, limit("iters_max")), default=None, metavar="N",
                   help=f"timed all-reduces (default {nccl_check.DEFAULT_ITERS['nccl']} for nccl, "
                        f"{nccl_check.DEFAULT_ITERS['gloo']} for gloo)")
    p.add_argument("--warmup", type=int_range(0, limit("warmup_max")),
                   default=nccl_check.DEFAULT_WARMUP, metavar="N",
                   help="untimed all-reduces first (default %(default)s)")
    p.add_argument("--timeout", type=float_range(limit("timeout_s_min"), limit("timeout_s_max")),
                   default=nccl_check.DEFAULT_TIMEOUT_S, metavar="S",
                   help="the whole check ends within S seconds (default %(default)g)")
    add_nodes(p, "only these inventory nodes (comma-separated globs, 'head', 'workers')")
    p.add_argument("--report", metavar="PATH", type=path_value,
                   help="a preflight.json to read the IB ports from (default: read them "
                        "from the nodes now, through the facts layer)")
    add_json(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from playbooks import nccl_check as playbook

    if args.layout:
        return _run_layout(args)
    check = nccl_check.CheckOptions(backend=args.backend or "nccl", size_mb=args.size_mb,
                                    iters=args.iters, warmup=args.warmup,
                                    timeout_s=args.timeout)
    inv = load_inventory(args)
    nodes = inv.select(args.nodes)
    if not nodes:
        raise UsageError(f"--nodes {args.nodes!r} matches no inventory node")
    facts, facts_source = _preflight_facts(args.report, [n.name for n in nodes])
    run_ = recorded_run(args, "nccl-check", inv)
    record = run_.record
    options = playbook.NcclOptions(check, tuple(nodes), facts,
                                   facts_from_report=facts_source is not None)

    def work(session: Any) -> nccl_check.NcclCheckResult:
        outcome = playbook.run(inv, session, options, never_confirm, run_.event)
        _write_logs(record.path, outcome.job)
        return dataclasses.replace(outcome.result, run_dir=str(record.path))

    result, payload = run_outcome(run_, work, lambda r: record.record(_short(r)),
                                  preflight_report=facts_source,
                                  ib_facts="report" if facts_source else "gathered")
    if args.json:
        run_.print_json(payload)
    else:
        _print(result, facts_source)
    return result.exit_code


def _preflight_facts(explicit: str | None, nodes: Sequence[str] | None = None
                     ) -> tuple[PreflightFacts | None, str | None]:
    """The typed facts of the preflight report --report names (None when it holds none), of
    `nodes` alone when given, and its path; (None, None) without --report: the playbook
    gathers."""
    if not explicit:
        return None, None
    path = Path(explicit)
    # the planner's bounded reader: size cap, NaN/Infinity and deep nesting refused
    data = read_json_file(path, "preflight report", max_bytes=bound("files", "preflight_report"),
                          error=UsageError)
    return PreflightFacts.from_report(data, only=nodes), str(path)


def _short(result: CommandResult) -> CommandResult:
    """The head command carries the entrypoint script (base64) and prints the compressed result:
    keep the run record readable."""
    command = result.command
    if len(command) > 600:
        command = command[:300] + f" ...[{len(command) - 600} chars]... " + command[-300:]
    out = result.stdout
    if len(out) > 4000:
        out = out[:2000] + f"\n...[{len(out) - 4000} chars]...\n" + out[-2000:]
    return dataclasses.replace(result, command=command, stdout=out)


def _write_logs(run_dir: Path, outcome: nccl_check.JobOutcome) -> None:
    """The job's log tail and every rank's NCCL debug log, beside nccl-check.json."""
    if outcome.logs_tail:
        (run_dir / "job.log").write_text(outcome.logs_tail)
    ranks = (outcome.result or {}).get("ranks") or []
    logs = nccl_check.rank_logs(ranks)
    if not logs:
        return
    folder = run_dir / "nccl"
    folder.mkdir(exist_ok=True)
    for rec, text in logs:
        name = f"rank{int(rec.get('rank') or 0):03d}-{_SAFE.sub('_', str(rec.get('hostname')))}.log"
        (folder / name).write_text(text)


def _print(result: nccl_check.NcclCheckResult, facts_source: str | None) -> None:
    style = {"ok": "green", "warn": "yellow"}.get(result.status.value, "bold red")
    stdout.print(Text(result.verdict, style=style))
    if result.per_rank:
        table = Table(title=f"{result.backend} all-reduce, {result.size_mb:g} MiB x {result.iters} "
                            f"(job {result.job_id}, {result.job_status})")
        for col in ("rank", "node", "host", "ip", "GPU", "time/iter", "algbw GB/s",
                    "busbw GB/s"):
            id_column(table, col)
        text_column(table, "error")
        for r in result.per_rank:
            per_iter = f"{r.time_s / result.iters * 1000:.1f} ms" if r.time_s else "-"
            table.add_row("-" if r.rank is None else str(r.rank), r.node or "-",
                          r.hostname or "-", r.ip or "-", ",".join(r.gpu_ids) or "-", per_iter,
                          _fmt(r.algbw_gbps), _fmt(r.busbw_gbps),
                          Text(r.error or "", style="red"))
        stdout.print(table)
    if result.busbw_gbps is not None:
        line = f"bus bandwidth {result.busbw_gbps:g} GB/s, algorithm bandwidth {result.algbw_gbps:g} GB/s"
        if result.expected.gbps:
            line += f"; expected {result.expected.gbps:g} GB/s ({result.expected.basis})"
        stdout.print(line)
    if result.backend == "nccl" and result.nccl:
        stdout.print(f"NCCL {result.nccl.get('nccl_version') or '?'}: inter-node transport "
                     f"{result.transport}, GDR {result.gdr}; {result.nccl.get('verdict')}")
    for p in result.problems:
        stdout.print(Text(f"problem: {p}", style="red"))
    for n in result.notes:
        stdout.print(f"note: {n}")
    stdout.print(Text.assemble("status ", status_text(result.status),
                               f" - job {result.job_id} in the Ray dashboard "
                               f"({result.dashboard_url}; `cluster dashboard` opens it)"))
    stdout.print(f"report: {Path(result.run_dir or '.') / 'nccl-check.json'}"
                 + (f" (expected bandwidth from {facts_source})" if facts_source else ""))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _run_layout(args: argparse.Namespace) -> int:
    """--layout PLAN: the plan's groups proven on the alive nodes (the deploy's proof step)."""
    from cluster.serving import deploy
    from cluster.planning import fabric_proof
    from cluster.base.errors import DeployError
    from cluster.planning.fabric_groups import Layout
    from cluster.planning.plan_file import load_plan
    from cluster.ray.ray_state import query_state
    from playbooks import nccl_check as playbook

    if args.nodes not in (None, "all", "*") or args.report:
        raise UsageError("--layout places the groups on the nodes the deployment would use "
                         "(--nodes and --report do not apply)")
    planned = load_plan(args.layout)
    layout = Layout.from_plan(planned)
    inv = load_inventory(args)
    run_ = recorded_run(args, "nccl-check", inv)
    record = run_.record
    code, payload = 2, {}
    try:
        with run_.session(lambda r: record.record(_short(r))) as session:
            state, _ = query_state(session, inv, include_serve=False)
            if not state.answered:
                raise DeployError("the head did not answer (is Ray up? `cluster status`)")
            cluster = deploy.ClusterView.from_state(inv, state)
            device = {"nccl": "gpu", "gloo": "cpu"}.get(args.backend or "",
                                                        cluster.resolve_device("auto"))
            # the nodes one engine spans as `cluster deploy --plan` would place it
            spec = deploy.spec_from_plan(planned, model=planned.model)
            plan = fabric_proof.plan_proof(layout, device, cluster, inv,
                                           nnodes=deploy.engine_nodes(spec, device, cluster))
            if not plan.groups:
                raise UsageError(f"{args.layout}: one rank per engine, no group to prove")
            models = {n.name: n.gpu_model for n in cluster.nodes if n.name}
            outcome = playbook.run_proof(inv, session, playbook.ProofOptions(plan, models),
                                         never_confirm, run_.event)
        proof = outcome.proof
        _write_logs(record.path, outcome.job)
        payload = {"layout": layout.to_dict(), "plan": plan.to_dict(),
                   "fabric_proof": proof.to_dict(), "run_dir": str(record.path)}
        record.write_json("nccl-check.json", payload)
        code = outcome.exit_code
    finally:
        run_.finish(code)
    if args.json:
        run_.print_json(payload)
    else:
        style = {"ok": "green", "warn": "yellow"}.get(proof.status.value, "bold red")
        stdout.print(Text(proof.verdict, style=style))
        for group in proof.groups:
            stdout.print(Text(group.verdict), soft_wrap=True)
        stdout.print(f"report: {Path(record.path) / 'nccl-check.json'}")
    return code
