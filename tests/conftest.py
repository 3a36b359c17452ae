"""Shared pytest fixtures, and the order in which the heavy modules run."""

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


# The heavy modules, costliest first (seconds of one serial run on this 2-core machine; the rest
# follow in collection order). On xdist workers (scripts/test: --dist loadfile
# --no-loadscope-reorder) a module runs whole on one worker, in this order, so the two longest
# start at once instead of one of them at the end while the other worker idles.
HEAVY_MODULE_COST_S = {
    "test_gang_e2e.py": 650,
    "test_tune_status.py": 480,
    "test_deploy_e2e.py": 420,
    "test_faults.py": 330,
    "test_simcluster.py": 250,
    "test_metrics.py": 240,
    "test_dashboard_browser.py": 200,
    "test_placement_sim.py": 150,
}


def pytest_collection_modifyitems(config, items):
    """Costliest modules first (stable: the order inside a module and among the rest stays)."""
    items.sort(key=lambda item: -HEAVY_MODULE_COST_S.get(item.path.name, 0))
