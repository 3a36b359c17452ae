#!/usr/bin/env python3
"""Tokens/s and TTFT through the Serve app against vLLM's own OpenAI server, side by side.

Same model, same engine settings, same machine. vLLM's server runs as a subprocess on
127.0.0.1; a private single-node Ray (started in this process) serves the app(s) under test.
Each round runs every path at every concurrency level, in an order that rotates between
rounds (this kind of machine drifts by up to +-60 % between rounds), and the summary is the
median over rounds of the PAIRED figures: tokens/s ratio (path / vLLM) and TTFT p50
difference (path - vLLM, ms).

Paths:
  direct        vLLM's own server (`python -m vllm.entrypoints.openai.api_server`), the reference
  serve         serve_apps.vllm_app:build_app (replica lowers itself to nice 0: the default)
  serve-nice15  the same app with process_priority: null (replica stays at Ray's nice 15)
  rayllm        ray.serve.llm build_openai_app with its defaults (CPU placement bundles)

The Serve ingress follows the product's default (the inventory's ray.serve_ingress: haproxy,
i.e. RAY_SERVE_ENABLE_HA_PROXY=1); --serve-ingress proxy measures Serve's Python proxy instead.
Other Ray-wide settings (worker niceness ...) go in with --ray-env KEY=VALUE; they apply to the
whole Ray instance, so compare them across separate runs.

    .venv/bin/python scripts/bench_serve.py --rounds 5 --paths serve,serve-nice15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cluster.nodes.inventory import SERVE_INGRESS, RayOptions  # noqa: E402

MODEL_ID = "tiny"
KEY_ENV = "BENCH_SERVE_API_KEY"
ENGINE_KWARGS = {"max_model_len": 512, "enforce_eager": True, "dtype": "bfloat16"}
# Identical in every path: 1 GiB KV cache; vLLM's default CPU binding on 2 cores (one OMP
# thread on core 0, core 1 reserved for the API server side), spelled out.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto",
              "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
SERVE_PATHS = ("serve", "serve-nice15", "rayllm")
PROMPT = "The cluster node runs a quiet model and the rack sends every token"


@dataclass(frozen=True)
class LevelResult:
    round: int
    path: str
    concurrency: int
    requests: int
    errors: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    bunched: int  # streams whose first token came with (nearly) the last: TTFT >= 90 % of total
    ttft_p50_streamed_ms: float  # TTFT p50 over the streams that were not bunched
    engine_ttft_mean_ms: float | None  # vLLM's own vllm:time_to_first_token_seconds, mean
    loadavg_1m: float  # the machine's load when the level ended (other work shares it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runnable_tasks() -> int:
    """Tasks the kernel has runnable right now (/proc/loadavg's r of r/t), this reader included."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def wait_for_quiet(threshold: int, max_wait_s: float) -> tuple[float, int]:
    """Wait (bounded) until at most `threshold` tasks stay runnable for 3 samples in a row.

    The machine may be shared: a round measured while other work holds the cores says
    little about either path. Returns (seconds waited, runnable count at the end).
    """
    start = time.monotonic()
    calm = 0
    runnable = runnable_tasks()
    while time.monotonic() - start < max_wait_s:
        runnable = runnable_tasks()
        calm = calm + 1 if runnable <= threshold else 0
        if calm >= 3:
            break
        time.sleep(0.5)
    return time.monotonic() - start, runnable


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# ----------------------------------------------------------------------------- load generator

async def _one_stream(client, url: str, headers: dict, body: dict) -> tuple[float | None, float, int]:
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, time.perf_counter() - start, tokens


def _ttft_sum_count(client, base_url: str) -> tuple[float, float] | None:
    """vllm:time_to_first_token_seconds sum and count from the path's /metrics, if it has one."""
    try:
        response = client.get(f"{base_url}/metrics", timeout=10)
    except Exception:
        return None
    if response.status_code != 200:
        return None
    total = count = 0.0
    for line in response.text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return (total, count) if count else None


async def run_level(base_url: str, key: str, concurrency: int, requests: int,
                    max_tokens: int, round_no: int, path: str) -> LevelResult:
    import httpx

    url = f"{base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    ttfts: list[float] = []
    streamed: list[float] = []
    tokens = errors = bunched = 0
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker():
            nonlocal tokens, errors, bunched
            async with semaphore:
                try:
                    first, total, count = await _one_stream(client, url, headers, body)
                except Exception:  # counted, not fatal: a bench reports errors
                    errors += 1
                    return
                tokens += count
                if first is not None:
                    ttfts.append(first)
                    if count > 1 and first >= 0.9 * total:
                        bunched += 1
                    else:
                        streamed.append(first)

        with httpx.Client() as sync_client:
            before = _ttft_sum_count(sync_client, base_url)
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(requests)))
            wall = time.perf_counter() - start
            after = _ttft_sum_count(sync_client, base_url)
    engine_ttft = None
    if before and after and after[1] > before[1]:
        engine_ttft = round((after[0] - before[0]) / (after[1] - before[1]) * 1000, 1)
    return LevelResult(round_no, path, concurrency, requests, errors, tokens, round(wall, 3),
                       round(tokens / wall, 1) if wall else 0.0,
                       round(_percentile(ttfts, 0.5) * 1000, 1),
                       round(_percentile(ttfts, 0.95) * 1000, 1), bunched,
                       round(_percentile(streamed, 0.5) * 1000, 1), engine_ttft,
                       os.getloadavg()[0])


# ----------------------------------------------------------------------------- the servers

def start_direct_server(model: Path, port: int, log_path: Path,
                        extra_env: dict[str, str]) -> subprocess.Popen:
    """vLLM's own server, per-request logging off like the app (no uvicorn access log)."""
    env = {**os.environ, **ENGINE_ENV, **extra_env, "VLLM_API_KEY": os.environ[KEY_ENV]}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", MODEL_ID, "--dtype", ENGINE_KWARGS["dtype"],
               "--max-model-len", str(ENGINE_KWARGS["max_model_len"]), "--enforce-eager",
               "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    log = open(log_path, "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_direct_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_ready(base_url: str, key: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base_url} not ready within {timeout:.0f} s")


def serve_app_for(path: str, model: Path):
    """The Serve application of one path."""
    env = dict(ENGINE_ENV)
    if path in ("serve", "serve-nice15"):
        from serve_apps.vllm_app import build_app

        return build_app({
            "model_loading_config": {"model_id": MODEL_ID, "model_source": str(model)},
            "engine_kwargs": dict(ENGINE_KWARGS), "runtime_env": {"env_vars": env},
            "api_key_env": KEY_ENV, "device": "cpu",
            "process_priority": 0 if path == "serve" else None})
    if path == "rayllm":
        from ray.serve.llm import LLMConfig, build_openai_app

        config = LLMConfig(
            model_loading_config={"model_id": MODEL_ID, "model_source": str(model)},
            engine_kwargs=dict(ENGINE_KWARGS), runtime_env={"env_vars": env},
            placement_group_config={"bundle_per_worker": {"CPU": 1}, "strategy": "PACK"})
        return build_openai_app({"llm_configs": [config]})
    raise ValueError(f"unknown path {path!r}")


# ----------------------------------------------------------------------------- report

def summarize(results: list[LevelResult], paths: list[str], levels: list[int]) -> dict:
    by_key = {(r.round, r.path, r.concurrency): r for r in results}
    rounds = sorted({r.round for r in results})
    summary: dict = {}
    for path in paths:
        if path == "direct":
            continue
        for c in levels:
            ratios, ttft_diffs, streamed_diffs = [], [], []
            for n in rounds:
                mine, ref = by_key.get((n, path, c)), by_key.get((n, "direct", c))
                if not mine or not ref or not ref.tokens_per_s:
                    continue
                ratios.append(mine.tokens_per_s / ref.tokens_per_s)
                ttft_diffs.append(mine.ttft_p50_ms - ref.ttft_p50_ms)
                diff = mine.ttft_p50_streamed_ms - ref.ttft_p50_streamed_ms
                if diff == diff:  # not NaN: both had streams that were not bunched
                    streamed_diffs.append(diff)
            if ratios:
                summary[f"{path}@c{c}"] = {
                    "tokens_per_s_ratio_median": round(statistics.median(ratios), 3),
                    "tokens_per_s_ratios": [round(x, 3) for x in ratios],
                    "ttft_p50_added_ms_median": round(statistics.median(ttft_diffs), 1),
                    "ttft_p50_added_ms": [round(x, 1) for x in ttft_diffs],
                    "ttft_p50_streamed_added_ms_median": (
                        round(statistics.median(streamed_diffs), 1) if streamed_diffs else None),
                }
    return summary


def print_round(results: list[LevelResult]) -> None:
    for r in results:
        print(f"  round {r.round}  {r.path:<13} c={r.concurrency:<3} {r.tokens_per_s:>8.1f} tok/s  "
              f"TTFT p50 {r.ttft_p50_ms:>7.1f} ms  p95 {r.ttft_p95_ms:>7.1f} ms  "
              f"bunched {r.bunched}/{r.requests} (streamed p50 {r.ttft_p50_streamed_ms:.1f} ms)  "
              f"engine TTFT mean {r.engine_ttft_mean_ms if r.engine_ttft_mean_ms is not None else '-'} ms  "
              f"errors {r.errors}  load {r.loadavg_1m:.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build the tiny dense model)")
    parser.add_argument("--paths", default="serve", help=f"comma list from {SERVE_PATHS}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", default="1:12,16:64",
                        help="requests per level as C:N pairs (bounded)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the whole Ray instance (e.g. RAY_worker_niceness=0)")
    parser.add_argument("--serve-ingress", choices=sorted(SERVE_INGRESS),
                        default=RayOptions.serve_ingress,
                        help="how HTTP reaches the replicas (default: the inventory default, "
                             f"{RayOptions.serve_ingress})")
    parser.add_argument("--direct-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for vLLM's own server only")
    parser.add_argument("--quiet-threshold", type=int, default=0,
                        help="before each round wait until at most this many tasks are runnable "
                             "(0: do not wait); bounded by --quiet-max-wait")
    parser.add_argument("--quiet-max-wait", type=float, default=120)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--json", help="write all figures here")
    args = parser.parse_args(argv)

    paths = ["direct"] + [p for p in args.paths.split(",") if p]
    for path in paths[1:]:
        if path not in SERVE_PATHS:
            parser.error(f"unknown path {path!r}")
    levels = [int(c) for c in args.concurrency.split(",")]
    per_level = {int(k): int(v) for k, v in (p.split(":") for p in args.requests.split(","))}
    for c in levels:
        per_level.setdefault(c, max(4 * c, 12))
        if per_level[c] > 1000:
            parser.error("at most 1000 requests per level")

    if args.model:
        model = Path(args.model)
    else:
        from importlib.util import module_from_spec, spec_from_file_location
        spec = spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
        builder = module_from_spec(spec)
        spec.loader.exec_module(builder)
        model = builder.build_tiny_model(None, "dense")

    os.environ[KEY_ENV] = os.environ.get(KEY_ENV) or os.urandom(12).hex()
    key = os.environ[KEY_ENV]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = SERVE_INGRESS[args.serve_ingress]
    for item in args.ray_env:
        name, _, value = item.partition("=")
        os.environ[name] = value
    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    direct_port = _free_port()
    direct_url = f"http://127.0.0.1:{direct_port}"
    print(f"model {model}; logs and Ray temp dir under {workdir}", flush=True)
    direct_env = dict(item.partition("=")[::2] for item in args.direct_env)
    proc = start_direct_server(model, direct_port, workdir / "vllm-direct.log", direct_env)
    import ray
    from ray import serve

    results: list[LevelResult] = []
    try:
        # Logical CPUs only: ray.serve.llm's replica claims a CPU beside its worker's bundle,
        # which 2 would not fit; the engines' real CPU binding is ENGINE_ENV's.
        for attempt in (1, 2):  # a loaded machine can miss Ray's node start-up deadline
            try:
                ray.init(address="local", num_cpus=8, include_dashboard=False,
                         _temp_dir=str(workdir / "ray"), log_to_driver=False)
                break
            except Exception as exc:
                ray.shutdown()
                if attempt == 2:
                    raise
                print(f"Ray did not start ({exc}); retrying once", flush=True)
                time.sleep(10)
        serve_port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
        urls = {"direct": direct_url}
        for path in paths[1:]:
            started = time.monotonic()
            serve.run(serve_app_for(path, model), name=path, route_prefix=f"/{path}")
            urls[path] = f"http://127.0.0.1:{serve_port}/{path}"
            print(f"{path}: ready in {time.monotonic() - started:.0f} s", flush=True)
        wait_ready(direct_url, key, args.startup_timeout, proc)
        for path in paths:  # warm-up, not measured
            asyncio.run(run_level(urls[path], key, 4, 8, args.max_tokens, 0, path))

        for n in range(1, args.rounds + 1):
            order = paths[(n - 1) % len(paths):] + paths[:(n - 1) % len(paths)]
            round_results = []
            for c in levels:
                if args.quiet_threshold:
                    waited, runnable = wait_for_quiet(args.quiet_threshold, args.quiet_max_wait)
                    print(f"  round {n} c={c}: waited {waited:.0f} s for a quiet machine "
                          f"({runnable} runnable)", flush=True)
                for path in order:
                    round_results.append(asyncio.run(run_level(
                        urls[path], key, c, per_level[c], args.max_tokens, n, path)))
            print_round(round_results)
            results.extend(round_results)
    finally:
        stop_direct_server(proc)
        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()

    summary = summarize(results, paths, levels)
    print("\nmedian of paired ratios over rounds (path vs vLLM's own server):")
    for name, s in summary.items():
        streamed = s["ttft_p50_streamed_added_ms_median"]
        streamed = "n/a" if streamed is None else f"{streamed:+.1f}"
        print(f"  {name:<20} tokens/s x{s['tokens_per_s_ratio_median']:.2f}  "
              f"TTFT p50 {s['ttft_p50_added_ms_median']:+.1f} ms "
              f"(streamed only {streamed} ms)   "
              f"(per round: x{s['tokens_per_s_ratios']}, {s['ttft_p50_added_ms']} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "settings": {"model": str(model), "engine_kwargs": ENGINE_KWARGS,
                         "max_tokens": args.max_tokens, "requests": per_level,
                         "serve_ingress": args.serve_ingress, "ray_env": args.ray_env, "direct_env": args.direct_env,
                         "paths": paths},
            "results": [asdict(r) for r in results], "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
