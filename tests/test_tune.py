"""`cluster tune`: the pure decision on synthetic bench results, the sweep's order of deploys
(against an in-memory stand-in for the dashboard, as tests/test_deploy.py does), the plot and
the CLI's usage errors. The real sweep runs in tests/integration/test_tune_status.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.serving.distribution import Distribution

from cluster.serving.bench import RequestOutcome, summarize_level
from cluster.cli import main
from cluster.base.errors import UsageError
from fakes import TUNE_APP_CONFIG as ORIGINAL, FakeServe, fake_bench
from cluster.serving.tune import (BENCH_FAILED, DEPLOY_FAILED, OK, Applied, DeployedApp, Recommendation,
                          TuneError, TunePoint, TuneResult, TuneSettings, check_tunable,
                          config_with, parse_values, plot_tune, point_from_level, read_app,
                          recommend)
from playbooks.tune import run_tune

REPO = Path(__file__).resolve().parents[1]


def pt(value, tok_s, p99, status=OK, errors=None, ok=16) -> TunePoint:
    return TunePoint(value=value, status=status, output_tokens_per_s=tok_s,
                     total_tokens_per_s=None if tok_s is None else tok_s * 2,
                     ttft_p50_ms=None if p99 is None else p99 / 2, ttft_p99_ms=p99,
                     requests=16, ok=ok, errors=errors or {})


# ---------------------------------------------------------------- values and configs


def test_parse_values_reads_yaml_scalars():
    assert parse_values("512, 1024,2048 ,4096") == (512, 1024, 2048, 4096)
    assert parse_values("0.5,0.9") == (0.5, 0.9)
    assert parse_values("true,false") == (True, False)
    for bad in ("512", "512,512", "1,[2]", "1,,", "a: b,c"):
        with pytest.raises(UsageError):
            parse_values(bad)


@pytest.mark.parametrize("written", ["0x1e", "010", "1:30", "2_2"])
def test_parse_values_refuses_numbers_yaml_would_silently_rewrite(written):
    """Read by the one bounded value reader (cluster/base/yamlfile.parse_value): YAML 1.1 would
    compare 30, 8, 90 and 22 instead of what the person wrote."""
    with pytest.raises(UsageError, match="--values"):
        parse_values(f"1,{written}")


def test_config_with_sets_one_engine_arg_on_a_copy():
    new = config_with(ORIGINAL, "max_num_batched_tokens", 1024)
    assert new["args"]["engine_kwargs"] == {"tensor_parallel_size": 1, "max_model_len": 512,
                                            "max_num_batched_tokens": 1024}
    assert "max_num_batched_tokens" not in ORIGINAL["args"]["engine_kwargs"]
    assert new["args"]["runtime_env"] == ORIGINAL["args"]["runtime_env"]
    new["args"]["runtime_env"]["env_vars"]["X"] = "1"
    assert "X" not in ORIGINAL["args"]["runtime_env"]["env_vars"]


def test_only_engine_apps_of_cluster_deploy_can_be_tuned():
    check_tunable(ORIGINAL, "tiny")
    with pytest.raises(TuneError, match="serve.run"):
        check_tunable(None, "tiny")
    with pytest.raises(TuneError, match="only apps of serve_apps"):
        check_tunable(dict(ORIGINAL, import_path="my.app:build"), "tiny")
    dry = copy.deepcopy(ORIGINAL)
    dry["args"]["dry_run"] = True
    with pytest.raises(TuneError, match="placement-only"):
        check_tunable(dry, "tiny")


def test_settings_refuse_what_cannot_be_swept():
    ok = TuneSettings("tiny", "max_num_batched_tokens", (512, 1024))
    assert ok.bench_requests == 64 and ok.warmups == 16
    assert TuneSettings("t", "max_num_seqs", (1, 2), concurrency=2).bench_requests == 16
    for kwargs in ({"param": "model"}, {"param": "tensor_parallel_size"},
                   {"param": "Bad-Name"}, {"values": (1,)}, {"apply": "newest"},
                   {"concurrency": 0}, {"target_ttft_p99_ms": 0}):
        args = dict(name="t", param="max_num_seqs", values=(1, 2)) | kwargs
        with pytest.raises(UsageError):
            TuneSettings(**args)
    assert "api-key" not in repr(TuneSettings("t", "max_num_seqs", (1, 2), api_key="s3cr3t-xyz"))
    assert "s3cr3t" not in repr(TuneSettings("t", "max_num_seqs", (1, 2), api_key="s3cr3t-xyz"))


# ---------------------------------------------------------------- the decision (pure)


def test_recommends_the_best_throughput_that_meets_the_target():
    points = [pt(512, 400.0, 300.0), pt(1024, 520.0, 450.0), pt(2048, 610.0, 900.0),
              pt(4096, 600.0, 1500.0)]
    rec = recommend(points, target_ttft_p99_ms=1000)
    assert rec.value == 2048 and rec.found and rec.meeting_target == (512, 1024, 2048)
    assert rec.close_values == () and rec.best_unconstrained == 2048
    assert rec.reason == "best output tokens/s: 610.0 with TTFT p99 900 ms <= 1000 ms"
    tight = recommend(points, target_ttft_p99_ms=500)
    assert tight.value == 1024 and tight.best_unconstrained == 2048
    free = recommend(points, None)
    assert free.value == 2048 and free.close_values == (4096,)
    assert "within 10 % of it: 4096" in free.reason and "noise" in free.reason


def test_no_value_meets_the_target():
    points = [pt(512, 400.0, 3000.0), pt(1024, 520.0, 2500.0)]
    rec = recommend(points, target_ttft_p99_ms=1000)
    assert rec.value is None and not rec.found and rec.best_unconstrained == 1024
    assert "no value meets TTFT p99 <= 1000 ms (the lowest is 2500 ms at 1024)" in rec.reason


def test_failed_or_erroring_points_are_never_recommended():
    points = [pt(512, 900.0, 100.0, errors={"http_500": 1}, ok=15),
              pt(1024, None, None, status=DEPLOY_FAILED),
              pt(2048, 0.0, None, status=BENCH_FAILED, ok=0), pt(4096, 300.0, 200.0)]
    assert recommend(points, 1000).value == 4096
    none = recommend(points[:3], 1000)
    assert none.value is None and none.reason.startswith("no value was benched cleanly")


def test_ties_go_to_the_lower_ttft_then_the_earlier_value():
    assert recommend([pt(1, 500.0, 300.0), pt(2, 500.0, 200.0)], None).value == 2
    assert recommend([pt(1, 500.0, 200.0), pt(2, 500.0, 200.0)], None).value == 1


def _level(ok: int = 8, failed: int = 0, ttft: float = 0.05, tokens: int = 32):
    outcomes = [RequestOutcome(ok=True, ttft_s=ttft + i * 0.001, e2e_s=0.5,
                               itl=Distribution.of((0.01,) * 3),
                               prompt_tokens=30, output_tokens=tokens, usage_reported=True,
                               content_chunks=tokens) for i in range(ok)]
    outcomes += [RequestOutcome(ok=False, error_kind="http_503", detail="down")] * failed
    return summarize_level(4, outcomes, 2.0, 32)


def test_point_from_a_bench_level():
    p = point_from_level(1024, _level(), deploy_s=51.2)
    assert p.status == OK and p.measured and p.output_tokens_per_s == 8 * 32 / 2.0
    assert p.ttft_p99_ms == pytest.approx(56.93) and p.bench["ok"] == 8 and p.deploy_s == 51.2
    bad = point_from_level(2048, _level(ok=6, failed=2))
    assert bad.status == BENCH_FAILED and not bad.measured
    assert bad.error == "2 of 8 request(s) failed (http_503 x2)"
    assert point_from_level(1, _level(ok=0)).error == "no request completed"


def _result(points, rec, applied_ok=True) -> TuneResult:
    s = TuneSettings("tiny", "max_num_batched_tokens", tuple(p.value for p in points),
                     concurrency=4, target_ttft_p99_ms=1000)
    return TuneResult(s, "http://h:8000/tiny/v1", "tiny", None, tuple(points), rec,
                      Applied("original", None, applied_ok, True, "RUNNING"))


def test_exit_codes():
    points = [pt(512, 400.0, 300.0), pt(1024, 520.0, 2000.0)]
    assert _result(points, recommend(points, 1000)).exit_code == 0
    slow = [pt(512, 400.0, 3000.0), pt(1024, 520.0, 2000.0)]
    assert _result(slow, recommend(slow, 1000)).exit_code == 1
    dead = [pt(512, None, None, status=DEPLOY_FAILED), pt(1024, None, None, status=DEPLOY_FAILED)]
    assert _result(dead, recommend(dead, 1000)).exit_code == 2
    assert _result(points, recommend(points, 1000), applied_ok=False).exit_code == 2
    doc = _result(points, recommend(points, 1000)).to_dict()
    assert doc["recommendation"]["value"] == 512 and doc["points"][0]["meets_target"]
    assert not doc["points"][1]["meets_target"] and doc["exit_code"] == 0
    assert json.loads(json.dumps(doc)) == doc


def test_plot_is_a_png_that_opens(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    points = [pt(512, 400.0, 300.0), pt(1024, 520.0, 450.0),
              pt(2048, None, None, status=DEPLOY_FAILED), pt(4096, 600.0, 1500.0)]
    path = plot_tune(_result(points, recommend(points, 1000)), tmp_path / "tune.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(str(path)).shape[2] in (3, 4)
    words = _result([pt("a", 1.0, 1.0), pt("b", 2.0, 2.0)], Recommendation(None, "x"))
    assert plot_tune(words, tmp_path / "words.png").stat().st_size > 1000


# ---------------------------------------------------------------- the sweep (stand-in dashboard)


class Inv:
    class ray:
        serve_port = 8000


def _sweep(serve, speeds, calls=None, **kw):
    settings = TuneSettings("tiny", "max_num_batched_tokens", (512, 1024, 2048, 4096),
                            concurrency=4, requests=8, warmup_requests=2, output_len=32, **kw)
    app = read_app(serve, "tiny")
    bench = fake_bench(speeds, calls)
    bench.serve = serve
    events: list[str] = []
    return run_tune(settings, serve, Inv, app, "http://h:8000/tiny/v1", events.append, bench), \
        events


def test_sweep_deploys_each_value_benches_it_and_restores_the_original():
    serve = FakeServe(ORIGINAL)
    calls: list = []
    result, events = _sweep(serve, {512: 10, 1024: 30, 2048: 20, 4096: 5}, calls)
    swept = [p["args"]["engine_kwargs"].get("max_num_batched_tokens") for p in serve.puts]
    assert swept == [512, 1024, 2048, 4096, None]          # the last PUT is the original
    assert serve.puts[-1] == ORIGINAL and serve.config == ORIGINAL
    assert calls == [(v, n, out) for v in (512, 1024, 2048, 4096) for n, out in ((2, 16), (8, 32))]
    assert result.recommendation.value == 1024 and result.exit_code == 0
    assert result.applied == Applied("original", None, True, True, "RUNNING")
    assert result.original_value is None and result.model == "tiny"
    assert any("bench at concurrency 4 (8 requests)" in e for e in events)


def test_apply_best_and_a_value_that_fails_to_deploy():
    serve = FakeServe(ORIGINAL, fail={2048})
    result, _ = _sweep(serve, {512: 10, 1024: 30, 4096: 40}, apply="best")
    status = {p.value: p.status for p in result.points}
    assert status == {512: OK, 1024: OK, 2048: DEPLOY_FAILED, 4096: OK}
    assert result.recommendation.value == 4096
    # 4096 was the last value swept: already running, no extra redeploy
    assert result.applied == Applied("best", 4096, True, False, "RUNNING")
    assert len(serve.puts) == 4


def test_apply_best_redeploys_the_winner_and_unchanged_values_are_not_redeployed():
    original = config_with(ORIGINAL, "max_num_batched_tokens", 512)
    serve = FakeServe(original)
    result, _ = _sweep(serve, {512: 10, 1024: 50, 2048: 20, 4096: 5}, apply="best")
    swept = [p["args"]["engine_kwargs"]["max_num_batched_tokens"] for p in serve.puts]
    assert swept == [1024, 2048, 4096, 1024]  # 512 is what runs already: benched as is
    assert result.points[0].deploy_s == 0 and result.original_value == 512
    assert result.applied.value == 1024 and result.applied.redeployed


def test_no_recommendation_with_apply_best_restores_the_original():
    serve = FakeServe(ORIGINAL)
    result, _ = _sweep(serve, {512: 10, 1024: 30, 2048: 20, 4096: 5}, apply="best",
                       target_ttft_p99_ms=1)
    assert result.recommendation.value is None and result.exit_code == 1
    assert result.applied.what == "original" and serve.config == ORIGINAL
    assert result.warnings == ("--apply best: no recommendation, the original config is "
                               "restored",)


def test_an_error_mid_sweep_restores_the_original_and_raises():
    serve = FakeServe(ORIGINAL)
    with pytest.raises(KeyboardInterrupt):
        _sweep(serve, {512: 10, 1024: KeyboardInterrupt()})
    assert serve.config == ORIGINAL and len(serve.puts) == 3


def test_read_app_refuses_unknown_apps():
    with pytest.raises(TuneError, match=r"no Serve application 'other' \(deployed: tiny\)"):
        read_app(FakeServe(ORIGINAL), "other")
    app = read_app(FakeServe(ORIGINAL), "tiny")
    assert isinstance(app, DeployedApp) and app.serve_port == 8000
    assert app.api_key_env == "CLUSTER_API_KEY" and app.route_prefix == "/tiny"


# ---------------------------------------------------------------- CLI


def test_cli_usage_errors_exit_2(capsys, tmp_path):
    assert main(["tune", "--name", "tiny", "--param", "max_model_len"]) == 2
    assert "--values is required with --param max_model_len" in capsys.readouterr().err
    assert main(["tune", "--name", "tiny", "--param", "model", "--values", "a,b"]) == 2
    assert "--param model" in capsys.readouterr().err
    assert main(["tune", "--name", "tiny", "--apply", "newest"]) == 2
    assert capsys.readouterr().err.startswith("cluster tune: error: argument --apply")


def test_cli_import_stays_light():
    code = ("import sys, cluster.cli; cluster.cli.build_parser(); "
            "print(sorted(m for m in ('matplotlib', 'vllm', 'ray', 'torch', 'openai', "
            "'transformers', 'httpx') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr
