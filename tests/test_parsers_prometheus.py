"""cluster.inspection.parsers.prometheus on real /metrics excerpts (tests/fixtures/prometheus/, labelled in
tests/fixtures/labels/prometheus.yaml) and on what the format refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from cluster.base.errors import ParseError
from cluster.inspection.parsers import prometheus
from cluster.inspection.parsers.prometheus import parse, parse_value, total

FIXTURES = Path(__file__).parent / "fixtures"
LABELS = {Path(s["file"]).name: s["labels"]
          for s in yaml.safe_load((FIXTURES / "labels" / "prometheus.yaml").read_text())["samples"]}


def samples(name: str):
    return parse((FIXTURES / "prometheus" / name).read_text()).samples


def labelled(name: str):
    """(the fixture's label, its samples), the sample count checked against the label."""
    label, got = LABELS[name], samples(name)
    assert len(got) == label["samples"]
    for metric, value in label.get("totals", {}).items():
        assert total(got, metric) == pytest.approx(value)
    return label, got


def test_every_fixture_has_a_label():
    assert sorted(LABELS) == sorted(p.name for p in (FIXTURES / "prometheus").glob("*.txt"))


def test_vllm_process_and_gauges():
    label, got = labelled("001-production-stack318-vllm-process-and-gauges.txt")
    for name, value in label["values"].items():
        assert total(got, name) == pytest.approx(value)
    for name, labels in label["label"].items():
        (one,) = [s for s in got if s.name == name]
        assert dict(one.labels) == labels


def test_histogram_buckets_in_order():
    label, got = labelled("002-production-stack318-vllm-tpot-histogram-buckets.txt")
    buckets = [(parse_value(s.label("le")), s.value) for s in got
               if s.name == label["buckets"]["metric"]]
    first, last = label["buckets"]["first"], label["buckets"]["last"]
    assert buckets[0] == (first["le"], first["count"]) and buckets[-1] == (last["le"], last["count"])
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)


def test_two_models_and_the_inf_bucket():
    label, got = labelled("003-vllm11117-lora-e2e-latency-buckets-two-models.txt")
    inf = [s for s in got if s.label("le") == "+Inf"]
    assert len(inf) == 1 and math.isinf(parse_value(inf[0].label("le")))
    assert inf[0].label("model_name") == label["inf_bucket"]["model_name"]
    assert inf[0].value == label["inf_bucket"]["count"]
    assert sorted({s.label("model_name") for s in got}) == label["models"]


def test_python_collector_counters_and_info_labels():
    label, got = labelled("004-ibm-vllm18-python-gc-and-info-labels.txt")
    (info,) = [s for s in got if s.name == "python_info"]
    assert dict(info.labels) == label["label"]["python_info"]


def test_a_terminal_paste_is_refused_but_its_sample_lines_read():
    name = "101-ray59072-curl-grep-serve-counter-progress-meter-interleaved.txt"
    label, text = LABELS[name], (FIXTURES / "prometheus" / name).read_text()
    with pytest.raises(ParseError) as err:
        parse(text)
    assert err.value.kind == "prometheus" and err.value.line == label["parse_error_line"]
    lines = text.splitlines()
    got = parse("\n".join(lines[5:7])).samples
    want = label["sample_lines"]
    assert len(got) == want["count"] and [s.value for s in got] == want["values"]
    assert [s.label("deployment") for s in got] == want["deployments"]
    assert got[1].label("route") == want["route_of_second"]
    assert got[0].label("WorkerId") == "a9b57a4b29fde6f3f03028f3994ebb3192ceb4b5e018281bab8b0a82"


def test_crlf_blank_lines_bytes_and_eof_read_the_same():
    text = (FIXTURES / "prometheus" / "004-ibm-vllm18-python-gc-and-info-labels.txt").read_text()
    plain = parse(text)
    assert parse(text.replace("\n", "\r\n")) == plain
    assert parse("\n\n" + text + "\n# EOF\n") == plain
    assert parse(text.encode()) == plain


@pytest.mark.parametrize("bad, line", [
    ("m 1\n{x} 2\n", 2), ("m{a=1} 2", 1), ('m{a="x} 1', 1), ("m", 1), ("m one", 1),
    ("m 1e999", 1), ("m 1_000", 1), ("m infinity", 1), ("m 1 2 3", 1), ("m 1 soon", 1),
    ("m-x 1", 1), ("m{a=\"1\"}2x 3", 1), ("ok 1\nm " + "9" * 80, 2),
    ("x " + "1" * (prometheus.MAX_LINE_CHARS + 1), 1),
])
def test_garbage_is_a_parse_error_with_its_line(bad, line):
    with pytest.raises(ParseError) as err:
        parse(bad)
    assert err.value.line == line and err.value.kind == "prometheus"


def test_not_text_is_refused():
    with pytest.raises(ParseError):
        parse(None)  # type: ignore[arg-type]


def test_special_values_are_kept_and_left_out_of_totals():
    got = parse("a +Inf\na -Inf\na NaN\na 2\nb NaN\n").samples
    assert math.isinf(got[0].value) and got[1].value == -math.inf and math.isnan(got[2].value)
    assert total(got, "a") == 2 and total(got, "b") is None and total(got, "c") is None


def test_to_dict_holds_only_json_numbers():
    data = parse('a{le="+Inf"} +Inf\nb 1.5\n').to_dict()
    assert data == {"samples": [{"name": "a", "labels": {"le": "+Inf"}, "value": "inf"},
                                {"name": "b", "labels": {}, "value": 1.5}]}


def _serve_once(body: bytes):
    """A loopback HTTP server answering every GET with body; returns (url, server)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


@pytest.mark.timeout(30)
def test_bench_scrapes_with_this_parser_and_refuses_a_page_that_is_not_prometheus():
    from cluster.serving.bench import BenchError, parse_metric_total, scrape_metric

    page = (FIXTURES / "prometheus" / "004-ibm-vllm18-python-gc-and-info-labels.txt").read_bytes()
    url, server = _serve_once(page)
    try:
        assert scrape_metric(url, "python_gc_collections_total") == 4261
    finally:
        server.shutdown()
    html = b"<html><body>502 Bad Gateway</body></html>\n"
    with pytest.raises(ParseError):
        parse_metric_total(html.decode(), "x")
    url, server = _serve_once(html)
    try:
        with pytest.raises(BenchError, match="cannot parse prometheus output"):
            scrape_metric(url, "x", default=0.0)
    finally:
        server.shutdown()
