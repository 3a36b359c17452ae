"""Shared pytest fixtures, and the simulated-cluster instance of each pytest-xdist worker."""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# scripts/test runs the heavy lane on pytest-xdist workers (gw0, gw1, ...). Each worker gets a
# simulated cluster of its own (docs/simcluster.md: prefix, subnet and directory select the
# instance), unless the caller chose one: two workers never share nodes, Ray or files. Subnets
# 100 + N stay clear of the fixed instances some modules bring up themselves (bst: 14).
XDIST_SUBNET_BASE = 100


def worker_simcluster_env(worker: str | None, environ) -> dict[str, str]:
    """The SIMCLUSTER_* variables for xdist worker `worker` ("gw3"), or {} outside xdist or
    when the caller already set any of them."""
    match = re.fullmatch(r"gw(\d{1,3})", worker or "")
    if match is None or any(k in environ for k in ("SIMCLUSTER_PREFIX", "SIMCLUSTER_SUBNET",
                                                   "SIMCLUSTER_DIR")):
        return {}
    index = int(match.group(1))
    if XDIST_SUBNET_BASE + index > 253:
        raise pytest.UsageError(f"xdist worker {worker}: no simulated-cluster subnet left")
    return {"SIMCLUSTER_PREFIX": f"gw{index}", "SIMCLUSTER_SUBNET": str(XDIST_SUBNET_BASE + index),
            "SIMCLUSTER_DIR": os.path.join(tempfile.gettempdir(), f"simcluster-gw{index}")}


os.environ.update(worker_simcluster_env(os.environ.get("PYTEST_XDIST_WORKER"), os.environ))


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
