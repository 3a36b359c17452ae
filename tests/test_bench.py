"""`cluster bench`: statistics, error classification, CLI output and plots, against real servers.

A tiny OpenAI-compatible streaming server (stdlib asyncio, HTTP/1.1, chunked SSE) runs in a
thread on 127.0.0.1 inside the tests. What it does is chosen by the request's `model`:
ok (one token per chunk, usage at the end), nousage, short, http500, http401, close (closes
before answering), drop (closes mid-stream), stall (answers headers, then nothing), garbage
(bad SSE JSON), notsse (a plain line), nodone (no [DONE]), streamerror (an error event),
flaky (every third request gets a 500); hostile replies (tests/test_hostile_plan_bench.py):
escape / streamescape (error text with terminal escape sequences), deepnest / deepchoice (a
chunk nested 100k deep), negusage / boolusage / floatusage (invalid usage.completion_tokens).
/metrics exposes a generation-token counter the server increments by what it streamed. The
heavy test (@pytest.mark.vllm) runs bench against vLLM's own OpenAI server on the tiny model and
checks the counted output tokens against vllm:generation_tokens_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.serving.distribution import Distribution

from cluster.serving.bench import (BenchConfig, RequestOutcome, api_base, build_prompt, endpoint_url,
                           latency_stats, metrics_url, parse_metric_total, percentile,
                           redact_url, run_bench, scrape_metric, summarize_level)
from cluster.cli import main
from cluster.base.errors import UsageError
from fakes import FakeOpenAI, cluster_main

KEY_ENV = "CLUSTER_TEST_BENCH_KEY"
KEY = "bench-test-key-7d1e9a"  # test-only
# A window-title change, clear-screen and colour codes: must never reach a terminal or report.


# ----------------------------------------------------------------------------- the fake server


@pytest.fixture(scope="module")
def fake():
    server = FakeOpenAI()
    yield server
    server.close()


def _config(fake, model="ok", **kw) -> BenchConfig:
    kw.setdefault("concurrency", (1, 3))
    kw.setdefault("prompt_len", 10)
    kw.setdefault("output_len", 5)
    kw.setdefault("requests", 6)
    kw.setdefault("timeout_s", 10.0)
    return BenchConfig(url=fake.url, model=model, **kw)


# ----------------------------------------------------------------------------- pure helpers

def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([4.0], 99) == 4.0
    stats = latency_stats([0.001 * v for v in values])  # seconds in, ms out
    assert (stats.p50, stats.mean, stats.count) == (pytest.approx(5.5), pytest.approx(5.5), 10)
    assert latency_stats([]).to_dict() == {"p50": None, "p95": None, "p99": None, "mean": None}


def test_summarize_level_counts_tokens_of_successes_and_errors_by_kind():
    good = RequestOutcome(True, ttft_s=0.1, e2e_s=0.5, itl=Distribution.of((0.1, 0.1, 0.2)),
                          prompt_tokens=10,
                          output_tokens=5, usage_reported=True, content_chunks=4)
    short = RequestOutcome(True, ttft_s=0.2, e2e_s=0.4, itl=Distribution.of((0.2,)),
                           prompt_tokens=10,
                           output_tokens=2, usage_reported=False, content_chunks=2)
    bad = [RequestOutcome(False, "http_500", "boom"), RequestOutcome(False, "http_500", "again"),
           RequestOutcome(False, "dropped", "peer closed")]
    level = summarize_level(4, [good, short, *bad], duration_s=2.0, output_len=5)
    assert (level.requests, level.ok, level.failed) == (5, 2, 3)
    assert level.errors == {"dropped": 1, "http_500": 2}
    assert level.error_examples["http_500"] == "boom"
    assert (level.input_tokens, level.output_tokens) == (20, 7)
    assert level.output_tokens_per_s == pytest.approx(3.5)
    assert level.total_tokens_per_s == pytest.approx(13.5)
    assert level.requests_per_s == pytest.approx(1.0)
    assert level.itl_ms.count == 4 and level.itl_ms.p50 == pytest.approx(150.0)
    assert level.tpot_ms.p50 == pytest.approx((100.0 + 200.0) / 2)  # (0.4/4, 0.2/1) s
    assert (level.short_outputs, level.usage_missing) == (1, 1)


def test_urls_prompts_and_bodies():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/completions"):
        assert api_base(url) == "http://h:8000/v1"
    assert api_base("http://h/app") == "http://h/app/v1"
    assert endpoint_url("http://h:8000", "chat") == "http://h:8000/v1/chat/completions"
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
    assert metrics_url("http://h/app/v1") == "http://h/app/metrics"
    assert metrics_url("http://h:9/metrics") == "http://h:9/metrics"
    assert redact_url("http://u:secret@h:8000/v1") == "http://h:8000/v1"
    with pytest.raises(UsageError):
        api_base("ftp://h")
    assert len(build_prompt(100, 3).split()) == 100
    assert build_prompt(20, 1) == build_prompt(20, 1) != build_prompt(20, 2)
    with pytest.raises(UsageError):
        BenchConfig(url="http://h", model="m", requests=3, duration_s=1.0)
    with pytest.raises(UsageError):
        BenchConfig(url="http://h", model="m", concurrency=(0,))
    cfg = BenchConfig(url="http://h", model="m", api_key="sekrit")
    assert "sekrit" not in repr(cfg)
    assert cfg.requests_for(1) == 16 and cfg.requests_for(64) == 256


def test_parse_metric_total_sums_label_sets_only_of_that_name():
    text = ('# TYPE a_total counter\n'
            'a_total{x="1"} 3.0\n'
            'a_total{x="} {"} 4.5 1700000000\n'
            'a_total 1\n'
            'a_total_created{x="1"} 1.7e9\n'
            'a_totalx 100\n')
    assert parse_metric_total(text, "a_total") == 8.5
    assert parse_metric_total(text, "missing") is None


# ----------------------------------------------------------------------------- against the fake server

@pytest.mark.timeout(60)
def test_deterministic_server_counts_exactly(fake):
    before = len(fake.requests)
    key_before = os.environ.get(KEY_ENV)
    result = run_bench(_config(fake, concurrency=(1, 3), requests=6, api_key=KEY))
    assert result.exit_code == 0 and result.warnings == ()
    assert [lv.concurrency for lv in result.levels] == [1, 3]
    for level in result.levels:
        assert (level.requests, level.ok, dict(level.errors)) == (6, 6, {})
        assert level.output_tokens == 6 * 5
        assert level.input_tokens == 6 * 10  # the server counts prompt words
        assert level.ttft_ms.count == 6 and level.e2e_ms.count == 6
        assert level.itl_ms.count == 6 * 4  # 5 content chunks -> 4 gaps per request
        stats = level.e2e_ms
        assert stats.p50 <= stats.p95 <= stats.p99 and stats.mean > 0
        assert level.ttft_ms.p50 <= level.e2e_ms.p50
    sent = fake.requests[before:]
    assert len(sent) == 12
    body = sent[0]
    assert body["_path"] == "/v1/completions" and body["_auth"] == f"Bearer {KEY}"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["min_tokens"] == 5 and body["ignore_eos"] is True
    assert len(body["prompt"].split()) == 10
    assert len({r["prompt"] for r in sent}) == 12  # distinct prompts, no shared prefix
    doc = result.to_dict()
    assert doc["levels"][1]["output_tokens"] == 30 and doc["exit_code"] == 0
    assert KEY not in json.dumps(doc)
    assert os.environ.get(KEY_ENV) == key_before


@pytest.mark.timeout(60)
def test_chat_endpoint_and_counted_tokens_match_the_metric_increase(fake):
    before = scrape_metric(fake.url, "vllm:generation_tokens_total")
    result = run_bench(_config(fake, endpoint="chat", concurrency=(2,), requests=5, output_len=7))
    after = scrape_metric(fake.url + "/v1", "vllm:generation_tokens_total")
    assert result.exit_code == 0
    assert result.output_tokens == 35 == after - before
    assert result.levels[0].input_tokens == 5 * 13  # the chat template's extra tokens, from usage
    assert fake.requests[-1]["_path"] == "/v1/chat/completions"
    assert fake.requests[-1]["messages"][0]["role"] == "user"


@pytest.mark.timeout(30)
def test_scrape_metric_errors():
    from cluster.serving.bench import BenchError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BenchError):
        scrape_metric(f"http://127.0.0.1:{port}", "x", timeout_s=2)


@pytest.mark.timeout(60)
def test_missing_usage_counts_chunks_and_short_outputs_warn(fake):
    result = run_bench(_config(fake, model="nousage", concurrency=(2,), requests=4))
    level = result.levels[0]
    assert (level.ok, level.output_tokens, level.usage_missing) == (4, 20, 4)
    assert level.input_tokens == 40  # prompt words as the estimate
    assert result.exit_code == 1 and any("without usage" in w for w in result.warnings)

    result = run_bench(_config(fake, model="short", concurrency=(1,), requests=2, output_len=6))
    assert result.levels[0].output_tokens == 6 and result.levels[0].short_outputs == 2
    assert result.exit_code == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("model, kind", [
    ("http500", "http_500"),
    ("http401", "http_401"),
    ("close", "connection_error"),
    ("drop", "dropped"),
    ("stall", "timeout"),
    ("garbage", "protocol_error"),
    ("notsse", "protocol_error"),
    ("nodone", "incomplete_stream"),
    ("streamerror", "stream_error"),
])
def test_errors_are_classified_by_kind_and_exit_2(fake, model, kind):
    result = run_bench(_config(fake, model=model, concurrency=(1, 2), requests=3, timeout_s=1.0))
    for level in result.levels:
        assert (level.requests, level.ok) == (3, 0)
        assert dict(level.errors) == {kind: 3}
        assert level.output_tokens == 0 and level.ttft_ms.p50 is None
        assert not level.deadline_hit
    assert result.exit_code == 2 and result.errors == {kind: 6}


class _ShortDeadline(BenchConfig):
    def level_deadline_s(self, concurrency: int) -> float:
        return 0.5


@pytest.mark.timeout(60)
def test_level_deadline_cuts_requests_in_flight(fake):
    # The safety net behind the per-request timeout: in-flight requests count as timeouts.
    result = run_bench(_ShortDeadline(url=fake.url, model="stall", concurrency=(3,), requests=6,
                                      timeout_s=30.0))
    level = result.levels[0]
    assert level.deadline_hit and level.errors == {"timeout": 3} and level.requests == 3
    assert level.error_examples["timeout"] == "cut by the level's deadline"
    assert result.exit_code == 2


def test_worst_case_time_is_known_up_front():
    cfg = BenchConfig(url="http://h", model="m", concurrency=(1, 4), requests=8, timeout_s=10)
    assert cfg.level_deadline_s(4) < cfg.level_deadline_s(1) < 8 * 11 + 10
    assert cfg.deadline_s() == cfg.level_deadline_s(1) + cfg.level_deadline_s(4)
    timed = BenchConfig(url="http://h", model="m", concurrency=(2,), duration_s=30, timeout_s=10)
    assert 40 < timed.deadline_s() < 50


@pytest.mark.timeout(60)
def test_connection_refused_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_bench(BenchConfig(url=f"http://127.0.0.1:{port}", model="m", concurrency=(2,),
                                   requests=4, timeout_s=2.0))
    assert result.errors == {"connection_error": 4} and result.exit_code == 2


@pytest.mark.timeout(60)
def test_mixed_errors_keep_the_successes(fake):
    result = run_bench(_config(fake, model="flaky", concurrency=(3,), requests=9))
    level = result.levels[0]
    assert level.requests == 9 and level.ok + level.errors.get("http_500", 0) == 9
    assert level.errors["http_500"] == 3 and level.output_tokens == 6 * 5
    assert result.exit_code == 2


@pytest.mark.timeout(60)
def test_duration_mode_is_bounded(fake):
    result = run_bench(_config(fake, concurrency=(2,), requests=None, duration_s=0.5))
    level = result.levels[0]
    assert level.requests >= 2 and level.ok == level.requests
    assert level.output_tokens == 5 * level.ok
    # a stalling server in duration mode: each request ends at the timeout, the level ends
    stalled = run_bench(_config(fake, model="stall", concurrency=(2,), requests=None,
                                duration_s=0.2, timeout_s=1.0))
    assert stalled.levels[0].errors == {"timeout": 2} and stalled.exit_code == 2


# ----------------------------------------------------------------------------- the CLI

def _run_cli(capsys, *argv):
    return cluster_main(capsys, "bench", *argv)


@pytest.mark.timeout(120)
def test_cli_json_and_out_write_json_and_pngs(fake, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    out_dir = tmp_path / "bench"
    code, out, err = _run_cli(capsys, "--url", fake.url, "--model", "ok", "--concurrency", "1,2,4",
                              "--prompt-len", "8", "--output-len", "4", "--requests", "4",
                              "--api-key-env", KEY_ENV, "--json", "--out", str(out_dir))
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) >= {"url", "model", "endpoint", "prompt_len", "output_len", "levels", "exit_code"}
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 2, 4]
    level_keys = {"concurrency", "requests", "ok", "errors", "duration_s", "requests_per_s",
                  "input_tokens", "output_tokens", "input_tokens_per_s", "output_tokens_per_s",
                  "total_tokens_per_s", "ttft_ms", "itl_ms", "e2e_ms"}
    for lv in doc["levels"]:
        assert set(lv) >= level_keys
        assert set(lv["ttft_ms"]) == {"p50", "p95", "p99", "mean"}
        assert (lv["requests"], lv["ok"], lv["output_tokens"], lv["errors"]) == (4, 4, 16, {})
    assert json.loads((out_dir / "bench.json").read_text()) == doc
    for name in ("latency.png", "throughput.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        import matplotlib.image

        image = matplotlib.image.imread(str(out_dir / name))
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    everything = out + err + "".join(p.read_text(errors="replace") for p in out_dir.glob("*.json"))
    assert KEY not in everything
    assert fake.requests[-1]["_auth"] == f"Bearer {KEY}"


@pytest.mark.timeout(60)
def test_cli_table_reports_errors_by_kind_and_exits_2(fake, capsys):
    code, out, err = _run_cli(capsys, "--url", fake.url + "/v1", "--model", "drop",
                              "--concurrency", "2", "--requests", "4", "--output-len", "4",
                              "--timeout", "5")
    assert code == 2
    assert "dropped x4" in out and "4 of 4 requests failed" in out


@pytest.mark.timeout(60)
def test_cli_usage_errors_exit_2(fake, capsys, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    code, _, err = _run_cli(capsys, "--url", fake.url, "--model", "ok", "--api-key-env", KEY_ENV)
    assert code == 2 and KEY_ENV in err
    assert main(["bench", "--url", fake.url, "--model", "ok", "--concurrency", "1,x"]) == 2
    assert capsys.readouterr().err.startswith("cluster bench: error: argument --concurrency")
    assert main(["bench", "--url", fake.url, "--model", "ok", "--requests", "2",
                 "--duration", "1"]) == 2
    assert capsys.readouterr().err.startswith("cluster bench: error:")


def test_cli_import_stays_light():
    code = ("import sys, cluster.cli; cluster.cli.build_parser(); "
            "print(sorted(m for m in ('matplotlib', 'cluster.serving.bench', 'cluster.serving.plots', 'vllm', "
            "'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"


def test_plot_sweep_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from cluster.serving.plots import plot_sweep

    path = plot_sweep([512, 1024, 2048, 4096], {"tokens/s": [100, 180, None, 260],
                                                "TTFT p99 ms": [40, 55, 90, 150]},
                      "max_num_batched_tokens", "value", tmp_path / "sweep.png", "sweep", log_x=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        plot_sweep([1, 2], {"a": [1]}, "x", "y", tmp_path / "bad.png", "bad")


# ----------------------------------------------------------------------------- real vLLM

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _vllm_server(model_dir: Path, log_path: Path):
    """vLLM's own OpenAI server on 127.0.0.1 (its own process group), stopped by PID at the end."""
    import httpx

    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready in 300 s:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
                proc.wait(10)


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_bench_against_vllm_counts_what_the_engine_generated(tiny_model, tmp_path, capsys):
    with _vllm_server(tiny_model, tmp_path / "vllm.log") as url:
        metric = "vllm:generation_tokens_total"
        before = scrape_metric(url, metric)
        code, out, err = _run_cli(capsys, "--url", url, "--model", "tiny", "--concurrency", "1,4",
                                  "--requests", "8", "--prompt-len", "32", "--output-len", "16",
                                  "--timeout", "60", "--json", "--out", str(tmp_path / "out"))
        after = scrape_metric(url, metric)
        assert code == 0, (out, err)
        doc = json.loads(out)
        counted = sum(lv["output_tokens"] for lv in doc["levels"])
        assert counted == 2 * 8 * 16  # ignore_eos + min_tokens: exactly output_len each
        assert counted == after - before
        for lv in doc["levels"]:
            assert lv["ok"] == 8 and lv["errors"] == {} and lv["usage_missing"] == 0
            assert lv["input_tokens"] > 0 and lv["ttft_ms"]["p50"] is not None

        before = scrape_metric(url, metric)
        result = run_bench(BenchConfig(url=url + "/v1", model="tiny", endpoint="chat",
                                       concurrency=(2,), requests=4, prompt_len=16,
                                       output_len=8, timeout_s=60))
        assert result.exit_code == 0, result.to_dict()
        assert result.output_tokens == 32 == scrape_metric(url, metric) - before
        assert (tmp_path / "out" / "latency.png").read_bytes()[:4] == b"\x89PNG"
