"""`cluster tune --name APP`: sweep one engine arg of a deployed app, bench each value, recommend.

Redeploys the app once per value (engine_kwargs[param] = value), benches it at one fixed
concurrency, recommends the value with the best output tokens/s that meets the TTFT p99 target,
writes tune.json and tune.png (--out, default the run directory), then restores the original
config or applies the chosen one (--apply). Exit codes: 0 a recommendation, 1 no value meets
the target, 2 errors or bad usage. The steps are playbooks/tune.py, the library cluster/serving/tune.py;
docs/tune-status.md.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from cluster.base.flags import path_value, text_value
from cluster.base.bounds import bound
from cluster.commands._common import (add_changing, add_json, float_range, int_range,
                                      print_json, recorded_run, stderr, stdout)
from cluster.base.errors import UsageError
from cluster.base.textsafe import safe_line


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="sweep an engine arg of a deployed app (redeploy + bench per value) and "
                     "recommend one",
        description="Stepwise load test of one deployed app: for each value of one vLLM engine "
                    "arg, redeploy the app with it, wait RUNNING, warm up, bench at a fixed "
                    "concurrency, then recommend the value with the best output tokens/s whose "
                    "TTFT p99 meets --target-ttft-p99. Writes tune.json and tune.png, then "
                    "restores the original config (or applies the chosen one with --apply "
                    "best). Every value restarts the app's replicas.",
        epilog="Exit codes: 0 a recommendation, 1 no value meets the target, 2 errors or bad "
               "usage. docs/tune-status.md.")
    p.add_argument("--name", required=True, metavar="APP", type=text_value,
                   help="the Serve application (`cluster status`), deployed by `cluster deploy`")
    p.add_argument("--param", metavar="ENGINE_ARG", type=text_value,
                   help="the vLLM engine arg to sweep (snake_case; default "
                        "max_num_batched_tokens)")
    p.add_argument("--values", metavar="V1,V2,...", type=text_value,
                   help="comma-separated values (default for max_num_batched_tokens: "
                        "512,1024,2048,4096; for max_num_seqs: 32,64,128,256)")
    p.add_argument("--concurrency", type=int_range(1, bound("bench", "concurrency")), metavar="C",
                   help="requests in flight during each bench (default 16)")
    p.add_argument("--target-ttft-p99",
                   type=float_range(0, bound("tune", "target_ttft_p99_ms"), strict=True), metavar="MS",
                   help="TTFT p99 target in ms a value must meet (default: none, best "
                        "throughput wins)")
    p.add_argument("--requests", type=int_range(1, bound("bench", "requests")), metavar="N",
                   help="requests per value (default max(4*C, 16))")
    p.add_argument("--warmup", type=int_range(0, bound("bench", "requests")), metavar="N",
                   help="warm-up requests after each redeploy, not measured (default C)")
    p.add_argument("--prompt-len", type=int_range(1, bound("bench", "prompt_len")), default=128, metavar="N",
                   help="prompt length in words (~tokens) (default %(default)s)")
    p.add_argument("--output-len", type=int_range(1, bound("bench", "output_len")), default=128, metavar="N",
                   help="output tokens per request (default %(default)s)")
    p.add_argument("--apply", choices=("original", "best"), default="original",
                   help="what runs afterwards: the original config (default) or the "
                        "recommended value")
    p.add_argument("--out", metavar="DIR", type=path_value,
                   help="where tune.json and tune.png go (default: the run directory)")
    p.add_argument("--api-key-env", metavar="VAR", type=text_value,
                   help="environment variable (here) holding the API key (default: the app's "
                        "own api_key_env, e.g. CLUSTER_API_KEY)")
    p.add_argument("--timeout",
                   type=float_range(0, bound("tune", "deploy_timeout_s"), strict=True), default=900.0, metavar="S",
                   help="how long each redeploy may take to be RUNNING (default %(default)g)")
    p.add_argument("--request-timeout",
                   type=float_range(0, bound("bench", "timeout_s"), strict=True), default=120.0, metavar="S",
                   help="time limit of one bench request (default %(default)g)")
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def _settings(args: argparse.Namespace):
    from cluster.serving.tune import TuneSettings, parse_values, tune_defaults

    defaults = tune_defaults()
    param = args.param or defaults.get("default_param", "max_num_batched_tokens")
    if args.values:
        values = parse_values(args.values)
    else:
        known = (defaults.get("default_values") or {}).get(param)
        if not known:
            raise UsageError(f"--values is required with --param {param} (defaults exist for "
                             f"{', '.join(sorted(defaults.get('default_values') or {}))})")
        values = tuple(known)
    return TuneSettings(
        name=args.name, param=param, values=values,
        concurrency=args.concurrency or int(defaults.get("default_concurrency", 16)),
        target_ttft_p99_ms=args.target_ttft_p99, requests=args.requests,
        warmup_requests=args.warmup, prompt_len=args.prompt_len, output_len=args.output_len,
        apply=args.apply, deploy_timeout_s=args.timeout, request_timeout_s=args.request_timeout,
        close_pct=float(defaults.get("close_pct", 10)))


def _out_dir(args: argparse.Namespace, record) -> Path:
    out = Path(args.out) if args.out else record.path
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: {exc}") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {out}: not writable")
    return out


def run(args: argparse.Namespace) -> int:
    from playbooks import tune

    settings = _settings(args)
    run_ = recorded_run(args, "tune", soft_wrap=True)
    options = tune.TuneOptions(settings, _out_dir(args, run_.record),
                               api_key_env=args.api_key_env, dry_run=args.dry_run)
    out = tune.TuneOutcome.start(options, str(run_.path))
    doc = out.doc
    try:
        with run_.session() as session:
            tune.run(run_.inventory, session, options, confirm=run_.confirm,
                     on_event=run_.event, on_secret=run_.add_secret, out=out)
    except Exception as exc:
        doc.setdefault("error", str(exc))
        raise
    finally:
        doc["exit_code"] = out.exit_code
        run_.record.write_json("tune.json", doc)
        if doc.get("json_path") and Path(doc["json_path"]).resolve() != \
                (run_.path / "tune.json").resolve():
            Path(doc["json_path"]).write_text(
                run_.scrub(json.dumps(doc, indent=2, default=str, allow_nan=False)) + "\n")
        run_.finish(out.exit_code)
    _print(args, doc, run_.record)
    return out.exit_code


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _print(args: argparse.Namespace, doc: dict[str, Any], record) -> None:
    from rich.table import Table
    from rich.text import Text

    if args.json:
        print_json(json.loads(record.scrub(json.dumps(doc, default=str, allow_nan=False))))
        return
    status = doc.get("status")
    if status == "DRY_RUN":
        stdout.print(f"dry run: would redeploy {doc['name']} with {doc['param']} = "
                     f"{', '.join(map(str, doc['values']))} (now: "
                     f"{doc.get('original_value') if doc.get('original_value') is not None else 'vLLM default'}), "
                     f"bench each at concurrency {doc['concurrency']} ({doc['requests']} "
                     f"requests) against {doc.get('endpoint')}, then apply the "
                     f"{doc['apply']} config (nothing was changed)", soft_wrap=True)
        return
    if status == "CANCELLED":
        stdout.print("cancelled: nothing was changed")
        return
    target = doc.get("target_ttft_p99_ms")
    table = Table(title=f"{doc['name']}: {doc['param']} at concurrency {doc['concurrency']}"
                        + (f", target TTFT p99 <= {target:g} ms" if target else ""))
    for col in (doc["param"], "status", "output tok/s", "total tok/s", "TTFT p50 ms",
                "TTFT p99 ms", "ok/requests", "meets target", "note"):
        table.add_column(col, overflow="fold")
    chosen = (doc.get("recommendation") or {}).get("value")
    for p in doc.get("points") or []:
        mark = Text("yes", style="green") if p["meets_target"] else Text("no", style="red")
        value = Text(str(p["value"]), style="bold green" if p["value"] == chosen else "")
        table.add_row(value, p["status"], _fmt(p["output_tokens_per_s"], 1),
                      _fmt(p["total_tokens_per_s"], 1), _fmt(p["ttft_p50_ms"]),
                      _fmt(p["ttft_p99_ms"]), f"{p['ok']}/{p['requests']}", mark,
                      safe_line(record.scrub(p.get("error") or "")))
    stdout.print(table)
    rec = doc.get("recommendation") or {}
    if rec.get("found"):
        stdout.print(Text.assemble(("recommended: ", "bold"),
                                   (f"{doc['param']}={rec['value']}", "bold green"),
                                   f" - {rec['reason']}"), soft_wrap=True)
    elif rec:
        stdout.print(Text.assemble(("no recommendation: ", "bold red"), rec.get("reason", "")),
                     soft_wrap=True)
    applied = doc.get("applied") or {}
    if applied:
        state = "RUNNING" if applied.get("ok") else f"NOT RUNNING: {applied.get('error')}"
        stdout.print(f"now running: the {applied['what']} config ({doc['param']}="
                     f"{applied.get('value') if applied.get('value') is not None else 'vLLM default'}"
                     f") - {state}", soft_wrap=True)
    for w in doc.get("warnings") or []:
        stderr.print(f"[yellow]warning:[/yellow] {safe_line(record.scrub(w))}")
    stdout.print(f"results: {doc.get('json_path')}", soft_wrap=True)
    if doc.get("plot_path"):
        stdout.print(f"plot:    {doc['plot_path']}", soft_wrap=True)
