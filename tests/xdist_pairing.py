"""The heavy lane's module scheduler: pytest-xdist's --dist loadfile (a module runs whole on one
worker, in collection order), except that a module starting vLLM engines is not handed to a
worker while another worker still runs one, as long as a module without engines waits.

Why: on this 2-core machine two workers' vLLM engines side by side roughly doubled each other's
time (test_gang_e2e.py: 1319 s beside test_tune_status.py, 597 s alone, 2026-12-06), while an
idle 2-node Ray cluster with a serving app costs about a quarter of one core (measured with
/proc/PID/stat over 60 s). Paired with the Ray-only modules (SSH, `cluster up`, faults, health
timeouts: mostly waiting) an engine module gets the cores it can use. The order stays
tests/conftest.py's costliest first within each kind; no worker ever waits for work (when only
engine modules are left, both workers take them).

Built on xdist's LoadFileScheduling through its public hook (pytest_xdist_make_scheduler,
tests/conftest.py); its `workqueue` (scope -> {nodeid: done}, an OrderedDict) and
`assigned_work` (node -> that, per scope) are what this reads and reorders:
tests/test_xdist_pairing.py pins them.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from xdist.scheduler import LoadFileScheduling

# The modules whose tests start vLLM engines: those marked `vllm` (tests/test_xdist_pairing.py
# checks the two agree). test_day_two.py and test_rolling_deploy.py run in the alone lane.
ENGINE_MODULES = frozenset({
    "test_gang_e2e.py", "test_tune_status.py", "test_deploy_e2e.py", "test_serve_app.py",
    "test_readme_main_path.py", "test_bench.py", "test_metrics.py", "test_planner_vllm_kv.py",
    "test_prometheus_head.py", "test_rolling_deploy.py",
})


class EngineApartScheduling(LoadFileScheduling):
    """--dist loadfile with engine modules (file names in `engine_modules`) kept apart."""

    def __init__(self, config, log=None, engine_modules: frozenset[str] = ENGINE_MODULES):
        super().__init__(config, log)
        self.engine_modules = engine_modules

    def is_engine_module(self, scope: str) -> bool:
        """scope: a module's node id (tests/integration/test_gang_e2e.py)."""
        return PurePosixPath(scope).name in self.engine_modules

    def engines_run_beside(self, node) -> bool:
        """Whether a worker other than `node` has an engine module with tests still to run."""
        return any(self.is_engine_module(scope) and not all(done.values())
                   for other, work in self.assigned_work.items() if other is not node
                   for scope, done in work.items())

    def _assign_work_unit(self, node) -> None:
        if self.engines_run_beside(node):
            light = next((s for s in self.workqueue if not self.is_engine_module(s)), None)
            if light is not None:
                self.workqueue.move_to_end(light, last=False)   # hand it out next
        super()._assign_work_unit(node)
