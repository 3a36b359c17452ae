"""The heavy lane's scheduler (tests/xdist_pairing.py): modules that start vLLM engines are kept
off each other's cores while a module without engines waits, and no worker ever waits for work.
Driven the way xdist's DSession drives a scheduler (add_node, add_node_collection, schedule,
mark_test_complete), with workers that record what they were sent."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xdist")

from xdist.scheduler import LoadFileScheduling   # noqa: E402

from xdist_pairing import ENGINE_MODULES, EngineApartScheduling   # noqa: E402

TESTS = Path(__file__).resolve().parent
# module -> whether it starts engines, in the order tests/conftest.py sorted them (costliest first)
MODULES = {"tests/integration/test_gang_e2e.py": True, "tests/integration/test_tune_status.py": True,
           "tests/integration/test_faults.py": False, "tests/integration/test_deploy_e2e.py": True,
           "tests/integration/test_ray_cluster.py": False, "tests/test_simcluster.py": False}


class Worker:
    """A WorkerController as the scheduler sees it: the indices it was sent to run."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def collection(tests_each: int = 3) -> list[str]:
    return [f"{module}::test_{i}" for module in MODULES for i in range(tests_each)]


def started(kind=EngineApartScheduling):
    config = SimpleNamespace(getvalue=lambda name: {"tx": ["2*popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=False))
    sched = kind(config, None, engine_modules=frozenset(
        Path(m).name for m, engines in MODULES.items() if engines)) \
        if kind is EngineApartScheduling else kind(config, None)
    workers = [Worker("gw0"), Worker("gw1")]
    ids = collection()
    for w in workers:
        sched.add_node(w)
    for w in workers:
        sched.add_node_collection(w, ids)
    sched.schedule()
    return sched, workers, ids


def modules_sent(worker: Worker, ids: list[str]) -> list[str]:
    seen: list[str] = []
    for i in worker.sent:
        module = Path(ids[i].split("::")[0]).name
        if module not in seen:
            seen.append(module)
    return seen


def finish(sched, worker: Worker, ids: list[str], module: str) -> None:
    for i in [i for i in worker.sent if ids[i].split("::")[0].endswith(module)]:
        sched.mark_test_complete(worker, i)


def test_control_plain_loadfile_starts_two_engine_modules_side_by_side():
    """What xdist does by itself: the two costliest modules, both engine modules, at once."""
    _, (gw0, gw1), ids = started(LoadFileScheduling)
    assert modules_sent(gw0, ids) == ["test_gang_e2e.py"]
    assert modules_sent(gw1, ids) == ["test_tune_status.py"]


def test_beside_an_engine_module_the_other_worker_gets_the_costliest_module_without_engines():
    sched, (gw0, gw1), ids = started()
    assert modules_sent(gw0, ids) == ["test_gang_e2e.py"]
    assert modules_sent(gw1, ids) == ["test_faults.py"]
    finish(sched, gw1, ids, "test_faults.py")            # gang still runs on gw0
    assert modules_sent(gw1, ids) == ["test_faults.py", "test_ray_cluster.py"]


def test_an_engine_module_follows_one_that_ended_and_no_worker_waits_when_only_engines_are_left():
    sched, (gw0, gw1), ids = started()
    finish(sched, gw0, ids, "test_gang_e2e.py")          # gw1 runs faults: engines may start
    assert modules_sent(gw0, ids) == ["test_gang_e2e.py", "test_tune_status.py"]
    finish(sched, gw1, ids, "test_faults.py")
    finish(sched, gw1, ids, "test_ray_cluster.py")
    finish(sched, gw1, ids, "test_simcluster.py")
    # only engine modules are left (deploy), tune still runs on gw0: gw1 takes deploy anyway
    assert modules_sent(gw1, ids)[-1] == "test_deploy_e2e.py"
    assert not sched.workqueue


def test_the_engine_modules_are_the_ones_marked_vllm():
    """The table names exactly the modules whose tests carry the `vllm` mark (a new engine
    module unlisted would be started beside another one)."""
    marked = {p.name for p in TESTS.rglob("test_*.py")
              if re.search(r"pytest\.mark\.vllm\b", p.read_text())}
    assert marked and ENGINE_MODULES == marked


def test_the_suite_hands_loadfile_to_this_scheduler(pytestconfig):
    """tests/conftest.py's pytest_xdist_make_scheduler: loadfile gets it, other modes xdist's own."""
    (conftest,) = [p for p in pytestconfig.pluginmanager.get_plugins()
                   if getattr(p, "__file__", "") == str(TESTS / "conftest.py")]
    config = SimpleNamespace(getvalue=lambda name: {"dist": "loadfile", "tx": ["2*popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=False))
    assert isinstance(conftest.pytest_xdist_make_scheduler(config, None), EngineApartScheduling)
    other = SimpleNamespace(getvalue=lambda name: {"dist": "load"}[name])
    assert conftest.pytest_xdist_make_scheduler(other, None) is None
