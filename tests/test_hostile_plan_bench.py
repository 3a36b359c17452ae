"""Hostile and careless input to `plan`, `bench` and `tune` (issue 17): each reproduction is kept.

Model configs with strings, lists, NaN, Infinity, 1e400 or absurd sizes, deep JSON, an index
or a safetensors header that is a list, inconsistent heads; flags that are NaN, infinite or
huge; a bench server that answers with deep nesting, invalid token counts or terminal escape
sequences. Through the CLI each must end in one stderr line and exit 2 (never a traceback),
or, where the input is valid, a correct result. The bench runs against the loopback fake
server of tests/test_bench.py only.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from pathlib import Path

import pytest

from cluster.serving.bench import (BenchConfig, SseReader, StreamFailure, redact_url,
                           run_bench, usage_tokens)
from cluster.base.bounds import bound, check_float, check_int
from cluster.commands._common import float_range, int_range, positive_float, positive_int
from cluster.base.errors import PlanError, UsageError
from cluster.planning.modelinfo import load_model_info, loads_json, model_info_from_config
from cluster.planning.planner import ClusterFacts, PlanOptions, load_cluster_facts_from_report, make_plan
from cluster.base.textsafe import safe_line
from cluster.serving.tune import TuneSettings, parse_values
from fakes import ESCAPE_TEXT, FakeOpenAI, cluster_main

CONFIGS = Path(__file__).parent / "model_configs"
LLAMA = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
MIXTRAL = json.loads((CONFIGS / "mixtral-8x7b-instruct-v0.1.json").read_text())
DEEPSEEK = json.loads((CONFIGS / "deepseek-v3.json").read_text())
AWQ = json.loads((CONFIGS / "qwen2.5-7b-instruct-awq.json").read_text())
FACTS = ("--gpus-per-node", "8", "--gpu-model", "H100", "--no-validate")


def _strict_json(text: str):
    """json.loads that fails on NaN / Infinity (what a strict consumer does)."""
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")
    return json.loads(text, parse_constant=refuse)


_cli = cluster_main


def _refused(capsys, *argv: str, says: str = "") -> str:
    """Exit 2 with one error line on stderr and no traceback; returns that line.

    A flag argparse refuses comes after argparse's usage block (cluster/cli.py keeps it); the
    error itself is still one line, the last.
    """
    code, _, err = _cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert lines and "Traceback" not in err, err
    usage = lines[:-1]
    assert not usage or (usage[0].startswith("usage: ")
                         and all(line.startswith(" ") for line in usage[1:])), err
    assert "\x1b" not in err and "\x07" not in err
    assert says in lines[-1], lines[-1]
    return lines[-1]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- model configs

BAD_FIELDS = [
    (LLAMA, "num_hidden_layers", 10 ** 18, "num_hidden_layers"),
    (LLAMA, "num_hidden_layers", "32", "num_hidden_layers"),
    (LLAMA, "num_hidden_layers", True, "num_hidden_layers"),
    (LLAMA, "hidden_size", [4096], "hidden_size"),
    (LLAMA, "vocab_size", 0, "vocab_size"),
    (LLAMA, "intermediate_size", -14336, "intermediate_size"),
    (LLAMA, "num_key_value_heads", 0, "num_key_value_heads"),
    (LLAMA, "num_key_value_heads", 7, "num_key_value_heads 7"),
    (LLAMA, "num_key_value_heads", 64, "num_key_value_heads 64"),
    (LLAMA, "head_dim", 0, "head_dim"),
    (LLAMA, "max_position_embeddings", -5, "max_position_embeddings"),
    (LLAMA, "max_position_embeddings", 0, "max_position_embeddings"),
    (LLAMA, "layer_types", 5, "layer_types"),
    (LLAMA, "layer_types", [1, 2], "layer_types"),
    (LLAMA, "sliding_window", "4096", "sliding_window"),
    (LLAMA, "tie_word_embeddings", "false", "tie_word_embeddings"),
    (LLAMA, "multi_query", "true", "multi_query"),
    (LLAMA, "use_sliding_window", 0, "use_sliding_window"),
    (LLAMA, "attention_bias", "no", "attention_bias"),
    (LLAMA, "torch_dtype", {"a": 1}, "torch_dtype"),
    (LLAMA, "architectures", {"0": "x"}, "architectures"),
    (LLAMA, "model_type", 7, "model_type"),
    (MIXTRAL, "num_local_experts", -8, "num_local_experts"),
    (MIXTRAL, "num_local_experts", "8", "num_local_experts"),
    (MIXTRAL, "num_local_experts", 10 ** 9, "num_local_experts"),
    (MIXTRAL, "num_experts_per_tok", [2], "num_experts_per_tok"),
    (MIXTRAL, "num_experts_per_tok", 9, "num_experts_per_tok 9"),
    (DEEPSEEK, "moe_intermediate_size", "2048", "moe_intermediate_size"),
    (DEEPSEEK, "kv_lora_rank", [512], "kv_lora_rank"),
    (DEEPSEEK, "kv_lora_rank", 0, "kv_lora_rank"),
    (DEEPSEEK, "moe_layer_freq", "1", "moe_layer_freq"),
    (DEEPSEEK, "first_k_dense_replace", -1, "first_k_dense_replace"),
    (DEEPSEEK, "n_shared_experts", 1.5, "n_shared_experts"),
    (AWQ, "quantization_config", [1], "quantization_config"),
    (AWQ, "quantization_config", {"quant_method": "awq", "bits": "4"}, "bits"),
    (AWQ, "quantization_config", {"quant_method": "awq", "bits": 1e9}, "bits"),
    (AWQ, "quantization_config", {"quant_method": "gptq", "bits": 4, "group_size": "128"},
     "group_size"),
    (AWQ, "quantization_config", {"quant_method": "compressed-tensors",
                                  "config_groups": {"g": {"weights": {"num_bits": -8}}}}, "num_bits"),
    (AWQ, "quantization_config", {"quant_method": "fp8", "weight_block_size": "128"},
     "weight_block_size"),
    (AWQ, "quantization_config", {"quant_method": ["fp8"]}, "quant_method"),
]


@pytest.mark.parametrize("base,key,value,says", BAD_FIELDS,
                         ids=[f"{k}={v!r}"[:40] for _, k, v, _ in BAD_FIELDS])
def test_bad_config_fields_are_refused_with_the_key(base, key, value, says, tmp_path, capsys):
    with pytest.raises(PlanError) as exc:
        model_info_from_config({**base, key: value}, name="m")
    assert says in str(exc.value)
    path = _write(tmp_path, "config.json", json.dumps({**base, key: value}))
    _refused(capsys, "plan", "--model", str(path), *FACTS, says=says)


def test_kv_head_message_names_key_and_both_values():
    with pytest.raises(PlanError, match=r"num_key_value_heads 7 does not divide "
                                        r"num_attention_heads 32"):
        model_info_from_config({**LLAMA, "num_key_value_heads": 7}, name="m")


def test_a_negative_expert_count_does_not_plan_a_dense_model():
    with pytest.raises(PlanError, match="num_local_experts: -8"):
        model_info_from_config({**MIXTRAL, "num_local_experts": -8}, name="m")
    assert model_info_from_config(MIXTRAL, name="m").num_experts == 8


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("key", ["num_local_experts", "num_experts_per_tok",
                                 "moe_intermediate_size", "kv_lora_rank", "num_hidden_layers",
                                 "max_position_embeddings"])
def test_non_finite_numbers_in_a_config_are_refused(key, literal, tmp_path, capsys):
    text = json.dumps({**MIXTRAL, key: 12345}).replace("12345", literal)
    path = _write(tmp_path, "config.json", text)
    line = _refused(capsys, "plan", "--model", str(path), *FACTS)
    assert key in line or "NaN" in line or "Infinity" in line


def test_a_100k_deep_config_is_refused(tmp_path, capsys):
    path = _write(tmp_path, "config.json", "[" * 100_000 + "]" * 100_000)
    _refused(capsys, "plan", "--model", str(path), *FACTS, says="nested too deeply")
    path = _write(tmp_path, "deep.json", '{"a": ' * 100_000 + "1" + "}" * 100_000)
    _refused(capsys, "plan", "--model", str(path), *FACTS, says="nested too deeply")


def test_configs_that_are_not_objects_or_not_json_are_refused(tmp_path, capsys):
    for name, text in (("list.json", "[1, 2]"), ("str.json", '"x"'), ("bad.json", "{"),
                       ("latin1.json", "")):
        path = tmp_path / name
        path.write_bytes(text.encode() if name != "latin1.json" else b'{"a": "\xff\xfe"}')
        _refused(capsys, "plan", "--model", str(path), *FACTS)


def test_an_oversized_config_is_refused_before_parsing(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(b" " * (bound("files", "config_json") + 1))
    _refused(capsys, "plan", "--model", str(path), *FACTS, says="larger than")


def _model_dir(tmp_path: Path, config=LLAMA) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("index", ["[1, 2]", '{"metadata": [1]}',
                                   '{"metadata": {"total_size": "16GB"}}',
                                   '{"metadata": {"total_size": -1}}',
                                   '{"metadata": {"total_size": true}}',
                                   '{"metadata": {"total_size": 1e400}}',
                                   '{"metadata": {"total_size": NaN}}',
                                   "[" * 50_000 + "]" * 50_000])
def test_bad_safetensors_index_is_refused(index, tmp_path, capsys):
    model = _model_dir(tmp_path)
    (model / "model.safetensors.index.json").write_text(index)
    _refused(capsys, "plan", "--model", str(model), *FACTS, says="model.safetensors.index.json")


def _safetensors(path: Path, header: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("header", [b"[1, 2]", b'"x"', b'{"w": {"data_offsets": [0, "8"]}}',
                                    b'{"w": {"data_offsets": [0, 1e400]}}',
                                    b'{"w": {"data_offsets": [8, 0]}}',
                                    b'{"w": {"data_offsets": 5}}',
                                    b'{"w": {"data_offsets": [0, -1]}}',
                                    b"[" * 50_000 + b"]" * 50_000, b"\xff\xfe"])
def test_bad_safetensors_header_is_refused(header, tmp_path, capsys):
    model = _model_dir(tmp_path)
    _safetensors(model / "model.safetensors", header)
    _refused(capsys, "plan", "--model", str(model), *FACTS, says="model.safetensors")


def test_a_valid_safetensors_header_still_measures(tmp_path):
    model = _model_dir(tmp_path)
    _safetensors(model / "model.safetensors",
                 json.dumps({"__metadata__": {"format": "pt"},
                             "w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 16_000_000_000]}
                             }).encode())
    info = load_model_info(model)
    assert (info.weights_bytes, info.weights_source) == (16_000_000_000, "safetensors-headers")


def test_config_strings_reaching_the_terminal_are_cleaned():
    info = model_info_from_config({**LLAMA, "architectures": ["Evil\x1b]0;pwned\x07ForCausalLM"],
                                   "model_type": "llama\x1b[2J"}, name="x\x1b[31m")
    assert "\x1b" not in (info.architecture + info.model_type + info.name)


def test_loads_json_refuses_nan_and_deep_nesting():
    with pytest.raises(PlanError, match="NaN"):
        loads_json('{"a": NaN}', "x")
    with pytest.raises(PlanError, match="nested too deeply"):
        loads_json("[" * 100_000, "x")


# ----------------------------------------------------------------------------- plan flags

@pytest.mark.parametrize("flags,says", [
    (("--gpu-memory-gib", "nan"), "--gpu-memory-gib"),
    (("--gpu-memory-gib", "inf"), "--gpu-memory-gib"),
    (("--gpu-memory-gib", "1e300"), "--gpu-memory-gib"),
    (("--gpu-memory-gib", "-80"), "--gpu-memory-gib"),
    (("--gpus-per-node", "1000000000"), "--gpus-per-node"),
    (("--nodes", "1000000000"), "--nodes"),
    (("--nodes", "0"), "--nodes"),
    (("--nodes", "-3"), "--nodes"),
    (("--nodes", "٣"), "--nodes"),
    (("--tokens-per-s-per-gpu", "nan"), "--tokens-per-s-per-gpu"),
    (("--tokens-per-s-per-gpu", "inf"), "--tokens-per-s-per-gpu"),
    (("--gpu-memory-utilization", "nan"), "--gpu-memory-utilization"),
    (("--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization"),
    (("--max-model-len", "10000000000000"), "--max-model-len"),
    (("--max-model-len", "0"), "--max-model-len"),
    (("--min-concurrency", "0"), "--min-concurrency"),
    (("--served-model-name", "a\x1b[2Jb"), "--served-model-name"),
])
def test_plan_flags_are_bounded(flags, says, capsys):
    argv = ["plan", "--model", str(CONFIGS / "llama-3.1-8b.json"), "--gpu-model", "H100",
            "--no-validate", *flags]
    if "--gpus-per-node" not in flags:
        argv += ["--gpus-per-node", "8"]
    _refused(capsys, *argv, says=says)


def test_plan_at_the_documented_maxima_finishes_with_strict_json(capsys):
    code, out, err = _cli(capsys, "plan", "--model", str(CONFIGS / "llama-3.1-8b.json"),
                          "--gpu-model", "H100", "--no-validate", "--json",
                          "--nodes", str(bound("plan", "nodes")),
                          "--gpus-per-node", str(bound("plan", "gpus_per_node")),
                          "--tokens-per-s-per-gpu", "2500")
    assert code in (0, 1), err
    doc = _strict_json(out)
    assert doc["gpus_total"] == bound("plan", "nodes") * bound("plan", "gpus_per_node")
    assert doc["capacity"]["tokens_per_s"] > 0


def test_library_refuses_what_the_flags_refuse():
    for kw in ({"nodes": 0}, {"nodes": True}, {"nodes": 10 ** 9}, {"gpus_per_node": 10 ** 9},
               {"gpu_memory_gib": math.nan}, {"gpu_memory_gib": math.inf}):
        args = {"nodes": 1, "gpus_per_node": 8, "gpu_model": "H100", **kw}
        with pytest.raises(UsageError):
            ClusterFacts.from_flags(**args)
    info = model_info_from_config(LLAMA, name="m")
    facts = ClusterFacts.from_flags(gpus_per_node=8, gpu_model="H100")
    for kw in ({"tokens_per_s_per_gpu": math.nan}, {"tokens_per_s_per_gpu": math.inf},
               {"gpu_memory_utilization": math.nan}, {"max_model_len": 2.5},
               {"min_concurrency": True}):
        with pytest.raises(UsageError):
            make_plan(info, facts, PlanOptions(**kw))


@pytest.mark.parametrize("report", [
    "[1, 2]", "NaN", '{"facts": {"nodes": []}}',
    '{"facts": {"nodes": {"n1": {"gpu_count": 8, "gpu_model": "H100", "gpu_memory_mib": 1e400}}}}',
    '{"facts": {"nodes": {"n1": {"gpu_count": 1000000000, "gpu_model": "H100", '
    '"gpu_memory_mib": 81559}}}}',
    '{"facts": {"nodes": {"n1": {"gpu_count": true, "gpu_model": "H100", "gpu_memory_mib": 81559}}}}',
    "[" * 100_000,
])
def test_bad_preflight_reports_are_refused(report, tmp_path, capsys):
    path = _write(tmp_path, "preflight.json", report)
    with pytest.raises((PlanError, UsageError)):
        load_cluster_facts_from_report(path)
    _refused(capsys, "plan", "--model", str(CONFIGS / "llama-3.1-8b.json"), "--report", str(path),
             "--no-validate")


def test_a_report_with_too_many_nodes_is_refused(tmp_path):
    nodes = {f"n{i}": {"gpu_count": 8, "gpu_model": "NVIDIA H100 80GB HBM3",
                       "gpu_memory_mib": 81559} for i in range(bound("plan", "nodes") + 1)}
    path = _write(tmp_path, "preflight.json", json.dumps({"facts": {"nodes": nodes}}))
    with pytest.raises(PlanError, match="nodes"):
        load_cluster_facts_from_report(path)


# ----------------------------------------------------------------------------- shared helpers

def test_argparse_number_types_refuse_non_finite_non_ascii_and_out_of_range():
    for bad in ("nan", "inf", "-inf", "Infinity", "1e400", "٣", "３", "", "1" * 100):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_float(bad)
    for bad in ("0", "-1", "1.5", "٣", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
    assert int_range(1, 8)("8") == 8 and float_range(0, 1, strict=True)("1") == 1.0
    for bad in ("9", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_range(1, 8)(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        float_range(0, 1, strict=True)("0")


def test_bounds_checks_name_the_field_and_refuse_bools():
    with pytest.raises(UsageError, match="--x: expected a whole number, got True"):
        check_int(True, "--x", lo=0, hi=9)
    with pytest.raises(UsageError, match="--x: 10 is out of range"):
        check_int(10, "--x", lo=0, hi=9)
    assert check_int(4.0, "--x", lo=0, hi=9, integral_float=True) == 4
    with pytest.raises(PlanError, match="finite"):
        check_float(math.nan, "--y", lo=0, hi=1, error=PlanError)
    with pytest.raises(UsageError, match="finite"):
        check_float(10 ** 400, "--y", lo=0, hi=1)


def test_safe_line_shows_control_characters_as_inert_escapes():
    line = safe_line(ESCAPE_TEXT)
    assert not any(c in line for c in "\x1b\x07\x9b\r\n")
    assert "\\x1b]0;pwned" in line and "engine exploded" in line
    assert safe_line("a\u202eb") == "a\\u202eb"
    assert safe_line("x" * 50, limit=10) == "x" * 10
    assert safe_line(42) == "42"


# ----------------------------------------------------------------------------- bench

@pytest.fixture(scope="module")
def fake():
    server = FakeOpenAI()
    yield server
    server.close()


def _bench(fake, model: str, **kw) -> dict:
    kw.setdefault("concurrency", (1,))
    kw.setdefault("requests", 2)
    config = BenchConfig(url=fake.url, model=model, prompt_len=4, output_len=3, timeout_s=10.0, **kw)
    return run_bench(config).to_dict()


@pytest.mark.parametrize("flags,says", [
    (("--timeout", "inf"), "--timeout"), (("--timeout", "nan"), "--timeout"),
    (("--timeout", "1e300"), "--timeout"), (("--duration", "inf"), "--duration"),
    (("--duration", "nan"), "--duration"), (("--duration", "1e9"), "--duration"),
    (("--concurrency", "1000000000"), "--concurrency"), (("--concurrency", "1,0"), "--concurrency"),
    (("--concurrency", ",".join(["1"] * 65)), "--concurrency"),
    (("--requests", "1000000000"), "--requests"), (("--output-len", "٣"), "--output-len"),
])
def test_bench_flags_are_bounded(flags, says, capsys):
    _refused(capsys, "bench", "--url", "http://127.0.0.1:9", "--model", "ok", *flags, says=says)


@pytest.mark.parametrize("url", ["http://[::1", "http://[::1]:99999", "http://h:0",
                                 "http://\u0663.1/", "http://[::1]x/",
                                 "http://h:８０", "http://a b", "http://h\x1b[2J/", "ftp://h",
                                 "http://user:secret@[::1/v1"])
def test_bench_bad_urls_are_one_line(url, capsys):
    line = _refused(capsys, "bench", "--url", url, "--model", "ok", "--requests", "1",
                    says="not an http(s) URL")
    assert "secret" not in line
    with pytest.raises(UsageError):
        BenchConfig(url=url, model="ok")


def test_redact_url_never_raises_and_drops_credentials():
    assert redact_url("http://u:pw@[::1/x") == "http://[::1/x"
    assert redact_url("http://u:pw@host:8000/v1") == "http://host:8000/v1"
    assert "\x1b" not in redact_url("http://h\x1b[2J:1/")


def test_bench_config_refuses_non_finite_and_huge_values():
    base = {"url": "http://127.0.0.1:9", "model": "m"}
    for kw in ({"timeout_s": math.inf}, {"timeout_s": math.nan}, {"duration_s": math.inf},
               {"duration_s": 1e12}, {"concurrency": (True,)}, {"concurrency": (10 ** 9,)},
               {"concurrency": "1"}, {"prompt_len": 10 ** 9}, {"output_len": 0},
               {"requests": 10 ** 9}, {"api_key": "k\nX-Evil: 1"}, {"api_key": "k\u00e4y"}):
        with pytest.raises(UsageError) as exc:
            BenchConfig(**base, **kw)
        assert "X-Evil" not in str(exc.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["deepnest", "deepchoice"])
def test_a_chunk_nested_100k_deep_is_a_per_request_error(fake, mode):
    doc = _bench(fake, mode)
    level = doc["levels"][0]
    assert level["errors"] == {"protocol_error": 2}
    assert "nested too deeply" in level["error_examples"]["protocol_error"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,shown", [("negusage", "-2000000"), ("boolusage", "True"),
                                        ("floatusage", "1.5")])
def test_invalid_usage_counts_are_errors_and_never_counted(fake, mode, shown):
    doc = _bench(fake, mode)
    level = doc["levels"][0]
    assert (level["ok"], level["output_tokens"], level["input_tokens"]) == (0, 0, 0)
    assert level["errors"] == {"protocol_error": 2}
    example = level["error_examples"]["protocol_error"]
    assert "usage.completion_tokens" in example and shown in example
    assert doc["exit_code"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,kind", [("escape", "http_500"), ("streamescape", "stream_error")])
def test_server_error_text_reaches_no_terminal_raw(fake, mode, kind, capsys, tmp_path):
    code, out, err = _cli(capsys, "bench", "--url", fake.url, "--model", mode, "--concurrency", "1",
                          "--requests", "1", "--output-len", "3", "--timeout", "10",
                          "--out", str(tmp_path))
    assert code == 2
    assert "engine exploded" in out
    for text in (out, err, (tmp_path / "bench.json").read_text()):
        assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    code, out, _ = _cli(capsys, "bench", "--url", fake.url, "--model", mode, "--concurrency", "1",
                        "--requests", "1", "--output-len", "3", "--json")
    doc = _strict_json(out)
    assert doc["levels"][0]["errors"] == {kind: 1}
    assert doc["levels"][0]["error_examples"][kind] == safe_line(ESCAPE_TEXT)


def test_sse_reader_reads_a_split_stream_and_caps_lines():
    reader = SseReader("completions")
    stream = (b'data: {"choices": [{"text": "a"}]}\r\n\r\ndata: {"choices": [{"text": "b"}]}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
              b"data: [DONE]\n\n")
    found = sum(reader.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))
    assert found == 2 and reader.done and usage_tokens(reader.usage) == (3, 2)
    with pytest.raises(StreamFailure, match="longer than"):
        SseReader().feed(b"data: " + b"x" * (bound("bench", "sse_line_bytes") + 1))
    for usage in ({"prompt_tokens": -1, "completion_tokens": 1},
                  {"prompt_tokens": 1, "completion_tokens": True},
                  {"prompt_tokens": 1, "completion_tokens": 2 ** 40}):
        with pytest.raises(StreamFailure):
            usage_tokens(usage)
    assert usage_tokens({"completion_tokens": 3}) is None


# ----------------------------------------------------------------------------- tune

@pytest.mark.parametrize("flag,value", [
    ("--target-ttft-p99", "nan"), ("--target-ttft-p99", "inf"), ("--timeout", "inf"),
    ("--request-timeout", "nan"), ("--concurrency", "1000000000"), ("--warmup", "-1"),
    ("--requests", "1e3"),
])
def test_tune_flags_are_bounded(flag, value, capsys):
    _refused(capsys, "tune", "--name", "app", flag, value, says=flag)


def test_tune_values_and_settings_refuse_non_finite_numbers():
    for text in ("1,.nan", "1,.inf", ",".join(str(i) for i in range(100)), "1,2020-01-01"):
        with pytest.raises(UsageError):
            parse_values(text)
    with pytest.raises(UsageError):
        TuneSettings(name="a", param="max_num_seqs", values=(1, 2), request_timeout_s=math.inf)
    with pytest.raises(UsageError):
        TuneSettings(name="a", param="max_num_seqs", values=(1, 2), concurrency=True)


@pytest.mark.timeout(60)
def test_bench_table_shows_a_model_name_with_brackets_and_escapes_verbatim_and_safe(fake, capsys):
    code, out, err = _cli(capsys, "bench", "--url", fake.url, "--model", "[/x]\x1b[2J", "--concurrency",
                          "1", "--requests", "1", "--output-len", "3", "--timeout", "10")
    assert code in (0, 1), err
    assert "[/x]" in out and "\x1b" not in out and "Traceback" not in err


def test_plan_errors_print_paths_and_values_safely(tmp_path, capsys):
    model = tmp_path / "evil\x1b]0;t\x07"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**LLAMA, "num_key_value_heads": 7}))
    line = _refused(capsys, "plan", "--model", str(model), *FACTS, says="num_key_value_heads 7")
    assert "\\x1b" in line


class _Dashboard:
    """A dashboard client stub answering GET /api/serve/applications/ with `details`."""

    def __init__(self, details):
        self.details = details

    def request(self, method, path, body=None, redact=True):
        from cluster.ray.dashboard_api import DashboardReply

        return DashboardReply(200, json=self.details)


_TUNABLE = {"import_path": "serve_apps.vllm_app:build", "args": {"engine_kwargs": {}}}


@pytest.mark.parametrize("details", [
    {"applications": [1, 2]},
    {"applications": {"app": [1]}},
    {"applications": {"app": {"source": "declarative", "deployed_app_config": [1]}}},
    {"applications": {"app": {"deployed_app_config": _TUNABLE, "route_prefix": 5}}},
    {"applications": {"app": {"deployed_app_config": _TUNABLE, "route_prefix": "/a\x1b[2J"}}},
    {"applications": {"app": {"deployed_app_config": _TUNABLE}}, "http_options": {"port": 1e400}},
    {"applications": {"app": {"deployed_app_config": _TUNABLE}}, "http_options": {"port": 99999}},
    {"applications": {"app": {"deployed_app_config": _TUNABLE}}, "http_options": {"port": True}},
])
def test_tune_refuses_a_dashboard_reply_it_cannot_use(details):
    from cluster.serving.tune import TuneError, read_app

    with pytest.raises(TuneError):
        read_app(_Dashboard(details), "app")


def test_tune_reads_a_sane_dashboard_reply():
    from cluster.serving.tune import read_app

    app = read_app(_Dashboard({"applications": {"app": {
        "deployed_app_config": _TUNABLE, "status": "RUNNING\x1b[2J", "route_prefix": "/app"}},
        "http_options": {"port": 8000}}), "app")
    assert (app.serve_port, app.route_prefix) == (8000, "/app") and "\x1b" not in app.status
