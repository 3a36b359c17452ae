"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_tiny_model_builder():
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny(kind: str) -> Path:
    for needed in ("torch", "transformers", "tokenizers"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"tiny model needs {needed}, not installed")
    # The default location (<tempdir>/cluster-tiny-models/<kind>) is reused across runs.
    return _load_tiny_model_builder().build_tiny_model(None, kind)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Directory of the tiny random-weight dense Llama-style model (built once, ~6 s)."""
    return _tiny("dense")


@pytest.fixture(scope="session")
def tiny_moe_model() -> Path:
    """Directory of the tiny random-weight Qwen3-MoE model."""
    return _tiny("moe")


@pytest.fixture(scope="session")
def tiny_model_builder():
    """The scripts/make_tiny_model.py module (build_tiny_model(out_dir, kind))."""
    return _load_tiny_model_builder()
