"""Fuzz `cluster plan` on mutated real model configs and bench's SSE reader on random streams.

Properties (Hypothesis, modest example counts, no deadline):
- a real config from tests/model_configs/ with numeric fields replaced by random JSON values,
  keys dropped or values nested gives a plan or a typed error (PlanError / UsageError /
  ClusterError), never another exception; a plan's JSON holds no NaN or Infinity; through the
  CLI the exit code is 0, 1 or 2, stdout with --json is strict JSON and stderr has no traceback;
- SseReader on random bytes, and on SSE streams of random JSON chunks cut at random places,
  reads them or raises StreamFailure, and the result does not depend on where the stream was
  cut; usage_tokens returns counts in range or raises StreamFailure;
- the bench against the loopback fake server (tests/test_bench.py) replying with a random
  SSE body ends with a result whose JSON is strict, every failure classified by kind.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.serving.bench import (ERROR_KINDS, BenchConfig, SseReader, StreamFailure, endpoint_url,
                           metrics_url, redact_url, run_bench, usage_tokens)
from cluster.base.bounds import bound
from cluster.cli import main
from cluster.base.errors import ClusterError, UsageError
from cluster.planning.modelinfo import model_info_from_config
from cluster.planning.planner import ClusterFacts, make_plan
from fakes import FakeOpenAI

CONFIGS = {p.stem: json.loads(p.read_text())
           for p in sorted((Path(__file__).parent / "model_configs").glob("*.json"))}
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")
    return json.loads(text, parse_constant=refuse)


# ----------------------------------------------------------------------------- strategies

_numbers = st.one_of(
    st.integers(min_value=-10, max_value=300),
    st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 63, 10 ** 18, 1e400, -1e400, 0.5, 4096.0]),
)
_scalars = st.one_of(st.none(), st.booleans(), _numbers, st.text(max_size=12))
_json_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


def _numeric_paths(doc, prefix=()):
    """Paths (tuples of keys) of every number in a config, nested objects included."""
    for key, value in doc.items():
        if isinstance(value, dict):
            yield from _numeric_paths(value, prefix + (key,))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix + (key,)
        elif isinstance(value, list) and value and isinstance(value[0], (int, float, str)):
            yield prefix + (key,)


def _set(doc: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _pop(doc: dict, path: tuple) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc.pop(path[-1], None)


def _get(doc: dict, path: tuple):
    for key in path:
        doc = doc[key]
    return doc


@st.composite
def mutated_configs(draw) -> dict:
    name = draw(st.sampled_from(sorted(CONFIGS)))
    doc = json.loads(json.dumps(CONFIGS[name]))
    paths = sorted(_numeric_paths(doc)) + [(k,) for k in ("layer_types", "architectures",
                                                          "torch_dtype", "quantization_config")]
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "drop", "nest"]))
        try:
            if action == "replace":
                _set(doc, path, draw(_json_values))
            elif action == "drop":
                _pop(doc, path)
            else:
                _set(doc, path, draw(st.sampled_from([list, lambda v: {"value": v}]))(_get(doc, path)))
        except (KeyError, TypeError):
            continue  # an earlier mutation removed or replaced the parent
    return doc


_facts = st.builds(lambda n, g, mem: ClusterFacts.from_flags(nodes=n, gpus_per_node=g,
                                                             gpu_memory_gib=mem, nvlink=True),
                   st.integers(1, 4), st.sampled_from([1, 2, 4, 8]),
                   st.sampled_from([24.0, 80.0, 141.0]))


# ----------------------------------------------------------------------------- plan

@FUZZ
@given(config=mutated_configs(), facts=_facts)
def test_plan_on_mutated_configs_is_a_plan_or_a_typed_error(config, facts):
    try:
        info = model_info_from_config(config, name="fuzz")
        plan = make_plan(info, facts)
    except ClusterError:
        return
    doc = plan.to_dict()
    _strict(json.dumps(doc, allow_nan=False))
    assert plan.max_model_len >= 1 and plan.gpus_used <= plan.gpus_total
    assert info.num_kv_heads >= 1 and info.num_attention_heads % info.num_kv_heads == 0
    assert info.num_experts >= 0 and info.weights_bytes >= 0


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(config=mutated_configs())
def test_plan_cli_on_mutated_configs_exits_0_1_or_2_with_strict_json(config, tmp_path_factory,
                                                                      capsys):
    path = tmp_path_factory.mktemp("fuzz") / "config.json"
    path.write_text(json.dumps(config))  # json.dumps writes NaN / Infinity as the literals
    code = main(["plan", "--model", str(path), "--gpus-per-node", "8", "--gpu-model", "H100",
                 "--no-validate", "--json"])
    out, err = capsys.readouterr()
    assert code in (0, 1, 2)
    assert "Traceback" not in err and "internal error" not in err, err
    _strict(out)
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- SSE reader

def _read(pieces) -> tuple[str, int, bool, object]:
    """('ok', content chunks, done, usage) or ('error', kind) after feeding every piece."""
    reader = SseReader("completions")
    found = 0
    try:
        for piece in pieces:
            found += reader.feed(piece)
        found += reader.finish()
        counts = usage_tokens(reader.usage)
    except StreamFailure as failure:
        assert failure.kind in ERROR_KINDS
        return ("error", failure.kind, False, None)
    if counts is not None:
        assert all(isinstance(c, int) and 0 <= c <= bound("bench", "token_count") for c in counts)
    assert found == reader.content_chunks >= 0
    return ("ok", found, reader.done, counts)


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


@FUZZ
@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_sse_reader_on_random_bytes_reads_or_raises_stream_failure(data, cuts):
    assert _read(_cut(data, cuts))[0] in ("ok", "error")


_chunk_objects = st.one_of(
    st.fixed_dictionaries({"choices": st.lists(st.fixed_dictionaries(
        {"index": st.integers(0, 3), "text": st.one_of(st.text(max_size=8), _scalars)}), max_size=2)}),
    st.fixed_dictionaries({"choices": st.just([]), "usage": st.dictionaries(
        st.sampled_from(["prompt_tokens", "completion_tokens", "total_tokens"]), _json_values)}),
    st.fixed_dictionaries({"error": _json_values}),
    _json_values,
)
_lines = st.one_of(
    _chunk_objects.map(lambda c: b"data: " + json.dumps(c).encode() + b"\n\n"),
    st.sampled_from([b"data: [DONE]\n\n", b": keep-alive\n", b"event: x\n", b"\r\n", b"id: 1\r\n",
                     b"data: {\n\n", b"data: [[[[[[\n", b"garbage\n", b"data: NaN\n\n"]),
    st.binary(max_size=40),
)


@FUZZ
@given(lines=st.lists(_lines, max_size=12), cuts=st.lists(st.integers(0, 600), max_size=8))
def test_sse_reader_result_does_not_depend_on_where_the_stream_is_cut(lines, cuts):
    data = b"".join(lines)
    whole = _read([data])
    assert _read(_cut(data, cuts)) == whole


@FUZZ
@given(usage=st.dictionaries(st.sampled_from(["prompt_tokens", "completion_tokens"]), _json_values))
def test_usage_tokens_accepts_only_whole_counts_in_range(usage):
    try:
        counts = usage_tokens(usage)
    except StreamFailure as failure:
        assert failure.kind == "protocol_error" and "usage." in failure.detail
        return
    if counts is not None:
        for value in counts:
            assert isinstance(value, int) and not isinstance(value, bool)
            assert 0 <= value <= bound("bench", "token_count")


_hosts = st.one_of(st.sampled_from(["127.0.0.1", "localhost", "[::1]", "[::1", "::1]", "h..x",
                                    "\u0663.1", "ex\u00e4mple.com", "u:p@h", "[fe80::1%25e]"]),
                   st.text(max_size=12))
_ports = st.one_of(st.just(""), st.integers(-5, 70000).map(lambda p: f":{p}"),
                   st.text(max_size=6).map(lambda t: ":" + t))
_urls = st.one_of(st.text(max_size=40),
                  st.builds(lambda scheme, host, port, path: f"{scheme}://{host}{port}{path}",
                            st.sampled_from(["http", "https", "ftp", "HTTP"]), _hosts, _ports,
                            st.one_of(st.just(""), st.just("/v1"), st.text(max_size=10))))


@FUZZ
@given(url=_urls)
def test_bench_urls_are_accepted_only_when_the_http_client_can_use_them(url):
    import httpx

    try:
        BenchConfig(url=url, model="m", concurrency=(1,), requests=1)
    except UsageError:
        assert "\x1b" not in redact_url(url)
        return
    httpx.URL(endpoint_url(url, "completions"))
    httpx.URL(metrics_url(url))
    assert "\x1b" not in redact_url(url)


# ----------------------------------------------------------------------------- bench end to end

@pytest.fixture(scope="module")
def fake():
    server = FakeOpenAI()
    yield server
    server.close()


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_lines, max_size=8))
def test_bench_against_random_sse_replies_classifies_every_outcome(fake, lines):
    fake.raw["raw"] = b"".join(lines)
    config = BenchConfig(url=fake.url, model="raw", concurrency=(1,), requests=1, prompt_len=2,
                         output_len=2, timeout_s=10.0)
    doc = run_bench(config).to_dict()
    level = _strict(json.dumps(doc, allow_nan=False))["levels"][0]
    assert level["requests"] == 1 and level["ok"] + sum(level["errors"].values()) == 1
    assert set(level["errors"]) <= set(ERROR_KINDS)
    assert level["output_tokens"] >= 0 and level["input_tokens"] >= 0
    assert all(math.isfinite(v) for v in (level["duration_s"], level["output_tokens_per_s"]))
