"""`cluster bench`: load-test an OpenAI-compatible endpoint at several concurrency levels.

Prints a table (or --json), optionally writes bench.json and PNG plots (--out). Exit codes:
0 every request succeeded, 1 no failures but warnings (short outputs, usage missing, a level
with no request, plots not written), 2 any request failed (errors by kind) or bad usage.
The library is cluster/serving/bench.py; the JSON keys are documented in docs/bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from cluster.base.flags import path_value, text_value
from cluster.base.bounds import bound
from cluster.commands._common import float_range, int_range
from cluster.base.errors import UsageError


def _concurrency_list(text: str) -> tuple[int, ...]:
    parse = int_range(1, bound("bench", "concurrency"))
    parts = [part for part in text.split(",") if part.strip()]
    if len(parts) > bound("bench", "concurrency_levels"):
        raise argparse.ArgumentTypeError(f"at most {bound('bench', 'concurrency_levels')} "
                                         f"concurrency levels: {text[:80]!r}")
    try:
        values = tuple(parse(part.strip()) for part in parts)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"concurrency levels must be integers from 1 to "
                                         f"{bound('bench', 'concurrency')}: {exc}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive integers: {text!r}")
    return values


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible endpoint (TTFT, ITL, latency, tokens/s)",
        description="Closed-loop load test over the OpenAI API with streaming: per concurrency "
                    "level, C workers send requests back to back; reports TTFT, inter-token and "
                    "end-to-end latency p50/p95/p99, requests/s, tokens/s and errors by kind.",
        epilog="Exit codes: 0 all requests ok, 1 warnings only (e.g. outputs shorter than "
               "--output-len), 2 any request failed, or bad usage. JSON keys: docs/bench.md.")
    p.add_argument("--url", required=True,
                   help="server base URL, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", required=True, type=text_value, help="the served model name")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    p.add_argument("--concurrency", type=_concurrency_list, default=(1, 4, 16, 64),
                   metavar="C[,C...]", help="concurrency levels (default 1,4,16,64)")
    p.add_argument("--prompt-len", type=int_range(1, bound("bench", "prompt_len")), default=128,
                   metavar="N",
                   help="prompt length in words, ~tokens (default 128; the server's count is reported)")
    p.add_argument("--output-len", type=int_range(1, bound("bench", "output_len")), default=128,
                   metavar="N",
                   help="output tokens per request (default 128)")
    amount = p.add_mutually_exclusive_group()
    amount.add_argument("--requests", type=int_range(1, bound("bench", "requests")), metavar="N",
                        help=f"requests per level (default max(4*C, 16); at most "
                             f"{bound('bench', 'requests')})")
    amount.add_argument("--duration", metavar="S",
                        type=float_range(0, bound("bench", "duration_s"), strict=True),
                        help=f"seconds per level instead of a request count (at most "
                             f"{bound('bench', 'duration_s')})")
    p.add_argument("--timeout", type=float_range(0, bound("bench", "timeout_s"), strict=True),
                   default=120.0, metavar="S",
                   help=f"total time allowed per request (default 120, at most "
                        f"{bound('bench', 'timeout_s')})")
    p.add_argument("--api-key-env", metavar="VAR", type=text_value,
                   help="environment variable holding the API key (sent as Bearer; never printed)")
    p.add_argument("--no-vllm-extensions", action="store_true",
                   help="do not send ignore_eos/min_tokens (for servers that reject them)")
    p.add_argument("--out", metavar="DIR", type=path_value, help="write bench.json, latency.png and throughput.png")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(handler=run)


def _api_key(var: str | None) -> str | None:
    if not var:
        return None
    value = os.environ.get(var, "")
    if not value:
        raise UsageError(f"--api-key-env {var}: that environment variable is not set or empty")
    return value


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[tuple[Any, Any]]:
    """(on_level, on_request) callbacks drawing a rich bar on stderr; no-ops when not enabled."""
    if not enabled:
        yield None, None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[errors]}"), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    state: dict[str, Any] = {}

    def on_level(concurrency: int, planned: int | None) -> None:
        if "task" in state:
            bar.update(state["task"], visible=False)
        state["errors"] = 0
        state["task"] = bar.add_task(f"bench c={concurrency}", total=planned, errors="")

    def on_request(_concurrency: int, outcome: Any) -> None:
        if not outcome.ok:
            state["errors"] += 1
        errors = f"[red]{state['errors']} failed[/red]" if state["errors"] else ""
        bar.update(state["task"], advance=1, errors=errors)

    with bar:
        yield on_level, on_request


def _ms(stats: dict[str, Any], keys: tuple[str, ...] = ("p50", "p95", "p99")) -> str:
    if stats.get("p50") is None:
        return "-"
    return "/".join(f"{stats[k]:.0f}" if stats[k] >= 10 else f"{stats[k]:.1f}" for k in keys)


def render_text(doc: dict[str, Any]) -> Any:
    """A rich Table of the levels (the errors and warnings are printed below it)."""
    from rich import box
    from rich.table import Table

    from rich.text import Text

    from cluster.base.textsafe import safe_line

    title = Text(f"cluster bench: {safe_line(doc['endpoint_url'])}  model "  # no markup: names
                 f"{safe_line(doc['model'])}  "                            # are the user's text
                 f"prompt ~{doc['prompt_len']} / output {doc['output_len']} tokens")
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("C", "ok/reqs", "req/s", "out tok/s", "total tok/s",
                "TTFT ms\np50/95/99", "ITL ms\np50/95/99", "E2E ms\np50/95/99"):
        table.add_column(col, justify="right", overflow="fold")
    for lv in doc["levels"]:
        ok = f"{lv['ok']}/{lv['requests']}"
        table.add_row(str(lv["concurrency"]), ok if lv["ok"] == lv["requests"] else f"[red]{ok}[/red]",
                      f"{lv['requests_per_s']:.2f}", f"{lv['output_tokens_per_s']:.1f}",
                      f"{lv['total_tokens_per_s']:.1f}", _ms(lv["ttft_ms"]), _ms(lv["itl_ms"]),
                      _ms(lv["e2e_ms"]))
    return table


def _error_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for lv in doc["levels"]:
        if not lv["errors"]:
            continue
        parts = []
        for kind, count in lv["errors"].items():
            example = lv["error_examples"].get(kind, "")
            parts.append(f"{kind} x{count}" + (f" ({example})" if example else ""))
        lines.append(f"  c={lv['concurrency']}: " + "; ".join(parts))
    return lines


def _write_out(out_dir: str, doc: dict[str, Any]) -> tuple[list[Path], str | None]:
    """bench.json and the plots; (written paths, a warning when the plots could not be drawn)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "bench.json"
        path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write to {out_dir}: {exc.strerror or exc}") from None
    written = [path]
    try:
        from cluster.serving.plots import write_bench_plots
        written += write_bench_plots(doc, out)
    except ImportError as exc:
        return written, f"plots not written: {exc}"
    return written, None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from cluster.serving.bench import BenchConfig, run_bench

    config = BenchConfig(
        url=args.url, model=args.model, concurrency=args.concurrency,
        prompt_len=args.prompt_len, output_len=args.output_len, requests=args.requests,
        duration_s=args.duration, timeout_s=args.timeout, endpoint=args.endpoint,
        api_key=_api_key(args.api_key_env), vllm_extensions=not args.no_vllm_extensions)
    with _progress(not args.json and sys.stderr.isatty()) as (on_level, on_request):
        result = run_bench(config, on_request=on_request, on_level=on_level)
    doc = result.to_dict()
    exit_code = result.exit_code
    written: list[Path] = []
    if args.out:
        written, plot_warning = _write_out(args.out, doc)
        if plot_warning:
            print(f"cluster bench: {plot_warning}", file=sys.stderr)
            exit_code = max(exit_code, 1)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        sys.stdout.flush()
        return exit_code
    # Not at a terminal (a log, a pipe): wide enough that the table is never cropped.
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    console.print(render_text(doc))
    errors = _error_lines(doc)
    if errors:
        console.print("[red]failed requests by kind:[/red]", highlight=False)
        for line in errors:
            console.print(line, markup=False, highlight=False)
    for warning in doc["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    for path in written:
        console.print(f"wrote {path}", markup=False, highlight=False)
    total = sum(lv["requests"] for lv in doc["levels"])
    failed = sum(doc["errors"].values())
    summary = (f"{failed} of {total} requests failed" if failed else f"all {total} requests ok")
    console.print(f"cluster bench: {summary}; output tokens {result.output_tokens}",
                  markup=False, highlight=False)
    return exit_code
