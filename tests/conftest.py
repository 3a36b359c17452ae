"""Shared pytest fixtures, and the order in which the heavy modules run."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# vLLM engines the tests start on this machine (a local Ray, vLLM's own server) share its cores
# with the other worker's engines and the simulated nodes (whose sessions get the same policy:
# scripts/simcluster NODE_ENV): an OpenMP thread spinning at a barrier under libgomp's default
# wait policy takes a core another engine needs (2 cores, two engines at once: 110 s of
# generation against 66 s passive). A run that sets its own policy keeps it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session", autouse=True)
def vllm_rpc_sockets(tmp_path_factory) -> Path:
    """vLLM's ZMQ IPC sockets of the engines started on this machine go under pytest's base temp
    dir: vLLM makes them in VLLM_RPC_BASE_PATH (the temp dir by default) and a stopped engine
    leaves them there (about 15 a heavy lane; 324 in /tmp by 2026-12-07). The simulated nodes'
    engines have a private /tmp of their own."""
    folder = tmp_path_factory.mktemp("vllm-rpc")
    os.environ["VLLM_RPC_BASE_PATH"] = str(folder)
    return folder


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


# The heavy modules, costliest first (seconds of module time in the heavy lane as CI runs it, 2
# workers on this 2-core machine, 2026-12-07 noon, 37:17 in all, the engine modules on one worker:
# .test-output/module-times-gw*.tsv; the rest follow in collection order). On xdist workers
# (scripts/test: --dist loadfile --no-loadscope-reorder) a module runs whole on one worker, in this
# order, so the longest start first and the short ones fill in at the end; the engine modules
# (ENGINE_MODULES below) run in this order too, one after another on one worker (2234 s of the
# lane; the other worker's modules ended 246 s before them).
HEAVY_MODULE_COST_S = {
    "test_gang_e2e.py": 850,       # 600 alone on a quiet machine; 1700 beside another engine module
    "test_tune_status.py": 540,
    "test_deploy_e2e.py": 415,
    "test_simcluster.py": 295,
    "test_faults.py": 250,
    "test_placement_sim.py": 205,
    "test_ray_cluster.py": 200,     # 124 + the late dashboard agent's head retry (74 alone)
    "test_model_pull.py": 170,
    "test_readme_main_path.py": 165,   # the README's main path
    "test_health_job_cluster.py": 155,
    "test_dashboard_browser.py": 125,
    "test_bastion_scale.py": 125,
    "test_nccl_check_cluster.py": 120,
    "test_fabric_proof_cluster.py": 110,
    "test_fix_model.py": 90,
    "test_metrics.py": 85,
    "test_planner_vllm_kv.py": 65,
    "test_serve_app.py": 65,        # 240 before its TP 2 and killed-replica cases went (2026-12-07)
    "test_bench.py": 35,
}


# The modules that start vLLM engines (the `vllm` marker: test_test_kit checks the list) run one
# after another on one worker, while the other worker takes the rest (simulated nodes, Ray, SSH):
# two engine modules at once on 2 cores took CI's gang past vLLM's 60 s step timeout (the gang's
# execute_model, 3 replicas in a row, 2026-12-07: test_gang_e2e beside test_tune_status) and
# ran the heavy lane to 46 min here. EngineModulesInOneScope makes them one xdist work unit.
ENGINE_MODULES = frozenset({
    "test_gang_e2e.py", "test_tune_status.py", "test_deploy_e2e.py", "test_readme_main_path.py",
    "test_metrics.py", "test_serve_app.py", "test_planner_vllm_kv.py", "test_bench.py",
    "test_prometheus_head.py",
})
ENGINE_SCOPE = "vLLM engine modules"
# Engine modules with one small engine each (~40-80 s): their own work units, handed out after
# every other module, so whichever worker is free first takes them, beside the engine worker's
# last modules (single engines too), never beside the gang or tune's sweep, which run first. The
# engine worker was the heavy lane's long pole by ~240 s (2026-12-07: 2487 s against 2250 s).
ENGINE_TAIL = frozenset({"test_bench.py", "test_serve_app.py"})


def engine_scope(scope: str) -> str:
    """xdist loadfile's scope of a test (its module's path) -> the engine modules' one scope for
    an engine module (those of ENGINE_TAIL excepted), else unchanged."""
    name = Path(scope).name
    return ENGINE_SCOPE if name in ENGINE_MODULES and name not in ENGINE_TAIL else scope


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """With --dist loadfile: xdist's LoadFileScheduling, the engine modules one work unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class EngineModulesInOneScope(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return engine_scope(super()._split_scope(nodeid))

    return EngineModulesInOneScope(config, log)


# test_day_two.py (1270-1700 s) is marked `alone`: it runs several vLLM engines under load, and
# beside test_gang_e2e.py a gang's warm-up step timed out for CPU (2026-12-06); scripts/test runs
# it in a lane of its own, after the heavy lane. Its rolling change under load is the one the
# alone lane's test_rolling_deploy.py repeated on a cluster of its own (~670 s) until 2026-12-07:
# that module's comparison with a plain redeploy is now scripts/bench_roll.py.


def collection_order(name: str) -> tuple[bool, float]:
    """A module's place in the run: ENGINE_TAIL's last, the others costliest first."""
    return name in ENGINE_TAIL, -HEAVY_MODULE_COST_S.get(name, 0)


def pytest_collection_modifyitems(config, items):
    """Costliest modules first, ENGINE_TAIL's last (stable: the order inside a module and among
    the rest stays)."""
    items.sort(key=lambda item: collection_order(item.path.name))


# Where each module's time went, per worker: <output>/module-times-<worker>.tsv at the end of a
# session (worker, module, wall seconds from its first test's start to its last test's end,
# started at, in seconds since the session began): what HEAVY_MODULE_COST_S is measured from.
_SESSION_START = time.monotonic()
_MODULE_SPANS: dict[str, list[float]] = {}
_INTEGRATION_RAN: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.monotonic()
    try:
        return (yield)
    finally:
        span = _MODULE_SPANS.setdefault(item.path.name, [start, start])
        span[1] = time.monotonic()
        if item.path.parent.name == "integration":
            _INTEGRATION_RAN.add(item.path.name)


def pytest_sessionfinish(session, exitstatus):
    if not _INTEGRATION_RAN:
        return   # only runs with integration modules are worth a file
    from fakes import output_dir

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    try:
        folder = output_dir()
        rows = sorted(_MODULE_SPANS.items(), key=lambda kv: kv[1][0])
        (folder / f"module-times-{worker}.tsv").write_text("".join(
            f"{worker}\t{module}\t{end - start:.1f}\t{start - _SESSION_START:.1f}\n"
            for module, (start, end) in rows))
    except OSError:
        pass   # a report of the suite's own timing never fails the suite
