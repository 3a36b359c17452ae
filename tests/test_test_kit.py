"""The suite's own shape (issue 24, item 5): every test uses one kit and no test module imports
another. A module under tests/ may import, of the suite's own files, only the kit: tests/fakes.py
(unit fakes, the CLI runners, inventory builders), tests/integration/integration_kit.py
(ClusterCli, derive_inventory, ray_up...) and tests/integration/browser.py (the headless
browser driver); conftest fixtures come in as fixture arguments, never by import."""

from __future__ import annotations

import ast
import importlib.util
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

TESTS = Path(__file__).resolve().parent
KIT = {"fakes", "integration_kit", "browser"}


def suite_modules() -> dict[str, Path]:
    """{module name: file} of every Python file of the suite (fixtures are data, not code)."""
    return {p.stem: p for p in TESTS.rglob("*.py")
            if "fixtures" not in p.relative_to(TESTS).parts}


def imported_names(path: Path) -> set[str]:
    """The top names this file imports (`tests.integration.x` -> x, `a.b` -> a), at any depth."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            while parts and parts[0] in ("tests", "integration"):
                parts = parts[1:]
            names.add(parts[0] if parts else module)
    return names


def suite_imports_outside_the_kit(path: Path) -> set[str]:
    return (imported_names(path) & set(suite_modules())) - KIT


def test_the_scan_sees_a_test_module_import(tmp_path):
    """Control: an import of another test module, plain or through the tests package, is seen."""
    bad = tmp_path / "test_x.py"
    bad.write_text("from test_ray_plan import INV\nimport tests.integration.conftest\n"
                   "from integration_kit import ClusterCli\n")
    assert suite_imports_outside_the_kit(bad) == {"test_ray_plan", "conftest"}


@pytest.mark.parametrize("name", sorted(str(p.relative_to(TESTS)) for p in suite_modules().values()))
def test_a_suite_module_imports_only_the_kit(name):
    assert suite_imports_outside_the_kit(TESTS / name) == set()


RUNNER_HOME = {"fakes.py"}      # cluster_cli / cluster_process: the CLI in a subprocess
RUNNER_WORDS = tuple(q + "-m" + q + ", " + q + "cluster" + q for q in "\"'")   # the argv pair, quoted either way


@pytest.mark.parametrize("name", sorted(str(p.relative_to(TESTS)) for p in suite_modules().values()
                                        if p.name not in RUNNER_HOME))
def test_only_the_kit_starts_the_cli_in_a_subprocess(name):
    """`python -m cluster` is spelled once (tests/fakes.py); every other module calls it."""
    text = (TESTS / name).read_text()
    assert not [w for w in RUNNER_WORDS if w in text]


def import_time_temp_dirs(path: Path) -> list[int]:
    """Lines where a module makes a temporary folder when it is imported (a module-level statement
    calling mkdtemp): collection runs it in every lane, and nothing ever removes it."""
    found = []
    for statement in ast.parse(path.read_text(), str(path)).body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "mkdtemp":
                    found.append(node.lineno)
    return found


def test_the_scan_sees_a_temp_dir_made_at_import(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text("import tempfile\nRUN = dict(d=tempfile.mkdtemp())\n\n"
                      "def test_y():\n    tempfile.mkdtemp()\n")
    assert import_time_temp_dirs(module) == [2]


@pytest.mark.parametrize("name", sorted(str(p.relative_to(TESTS)) for p in suite_modules().values()))
def test_no_suite_module_makes_a_temp_dir_when_imported(name):
    """A module's run records go to integration_kit.ModuleRunDir (under pytest's base temp dir)."""
    assert import_time_temp_dirs(TESTS / name) == []


def test_a_module_run_dir_is_made_under_the_sessions_base_temp_dir(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(TESTS / "integration"))
    from integration_kit import ClusterCli, ModuleRunDir

    run_dir = ModuleRunDir("fix-model")
    monkeypatch.setattr(ModuleRunDir, "root", None)
    with pytest.raises(RuntimeError, match="outside a pytest session"):
        os.fspath(run_dir)
    monkeypatch.setattr(ModuleRunDir, "root", tmp_path)
    assert os.fspath(run_dir) == str(tmp_path / "module-runs" / "fix-model")
    assert (tmp_path / "module-runs" / "fix-model").is_dir() and Path(run_dir).is_dir()
    assert ClusterCli(env={"CLUSTER_RUN_DIR": run_dir}).env["CLUSTER_RUN_DIR"] is run_dir
    for bad in ("", "../up", "a/b", "Fix"):
        with pytest.raises(ValueError):
            ModuleRunDir(bad)


def test_each_xdist_worker_gets_a_simulated_cluster_of_its_own(monkeypatch):
    """scripts/test's workers never share nodes: gwN -> prefix gwN, subnet 100+N, its own dir;
    outside xdist, or when the caller chose an instance, nothing is set."""
    monkeypatch.syspath_prepend(str(TESTS / "integration"))
    from integration_kit import worker_simcluster_env

    gw0, gw3 = worker_simcluster_env("gw0", {}), worker_simcluster_env("gw3", {})
    assert (gw0["SIMCLUSTER_PREFIX"], gw0["SIMCLUSTER_SUBNET"]) == ("gw0", "100")
    assert (gw3["SIMCLUSTER_PREFIX"], gw3["SIMCLUSTER_SUBNET"]) == ("gw3", "103")
    assert gw0["SIMCLUSTER_DIR"] != gw3["SIMCLUSTER_DIR"]
    assert worker_simcluster_env(None, {}) == {}
    assert worker_simcluster_env("master", {}) == {}
    assert worker_simcluster_env("gw1", {"SIMCLUSTER_SUBNET": "7"}) == {}
    with pytest.raises(ValueError):
        worker_simcluster_env("gw200", {})


def fresh_python(code: str, env: dict[str, str]) -> str:
    """The last line `code` prints in a fresh interpreter run with exactly `env` (what a node's
    process reads at import)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True)
    return p.stdout.strip().splitlines()[-1]


def serve_drain_window(env: dict[str, str]) -> float:
    """The stopping replica's drain window (s) Ray Serve's HAProxy ingress takes from `env`."""
    return float(fresh_python("from ray.serve._private import constants as c; "
                              "print(c.RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S)", env))


def test_the_short_drain_env_is_the_variable_serve_reads(monkeypatch):
    """SHORT_DRAIN_ENV (the test clusters' 2 s drain window) names the variable Ray Serve reads:
    a renamed one would bring back Ray's 30 s, ~35 s an undeploy, without a failure anywhere.
    Control: without it, Ray's own 30 s."""
    pytest.importorskip("ray.serve")

    monkeypatch.syspath_prepend(str(TESTS / "integration"))
    from integration_kit import SHORT_DRAIN_ENV

    ((name, value),) = SHORT_DRAIN_ENV.items()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    assert serve_drain_window({**base, name: value}) == float(value) == 2.0
    assert serve_drain_window(base) == 30.0


def simcluster_private_dirs() -> tuple[str, ...]:
    """scripts/simcluster's PRIVATE_NODE_DIRS (the folders each simulated node has of its own),
    read from its source."""
    tree = ast.parse((TESTS.parent / "scripts" / "simcluster").read_text())
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign)
                and [getattr(t, "id", None) for t in n.targets] == ["PRIVATE_NODE_DIRS"]]
    return ast.literal_eval(value)


def inductor_cache_dir(env: dict) -> str:
    """Where a fresh interpreter's torch inductor keeps its cache under `env`."""
    return fresh_python("from torch._inductor.runtime.cache_dir_utils import cache_dir; "
                        "print(cache_dir())", env)


def test_the_shared_inductor_env_is_the_variable_torch_reads(monkeypatch, tmp_path):
    """SHARED_INDUCTOR_ENV (one inductor cache for the test clusters' nodes) names the variable
    torch reads, and a folder every simulated node sees (none of simcluster's private folders):
    a renamed variable would bring back a ~30 s compile on every fresh node of a TP >= 2 test
    without a failure anywhere. Control: without it, inductor's own folder under /tmp."""
    pytest.importorskip("torch")

    monkeypatch.syspath_prepend(str(TESTS / "integration"))
    from integration_kit import SHARED_INDUCTOR_DIR, SHARED_INDUCTOR_ENV

    ((name, value),) = SHARED_INDUCTOR_ENV.items()
    assert Path(value) == SHARED_INDUCTOR_DIR and SHARED_INDUCTOR_DIR.is_absolute()
    private = simcluster_private_dirs()
    assert "/tmp" in private and not any(SHARED_INDUCTOR_DIR.is_relative_to(d) for d in private)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    assert inductor_cache_dir({**base, name: str(tmp_path)}) == str(tmp_path)
    assert Path(inductor_cache_dir(base)).parent == Path(tempfile.gettempdir())


def test_the_shared_inductor_folder_must_be_the_users_own(tmp_path, monkeypatch):
    """derive_inventory(shared_inductor=True) makes the folder 0700 and takes it again; a link
    to a folder, or a folder others can write, is refused: the nodes run what is in it as root
    (/var/tmp is writable by every user)."""
    monkeypatch.syspath_prepend(str(TESTS / "integration"))
    import integration_kit

    source = tmp_path / "sim.yaml"
    source.write_text(yaml.safe_dump({"nodes": [{"name": "node1"}]}))
    sim = SimpleNamespace(inventory_path=source)

    def derive(folder: Path) -> None:
        monkeypatch.setattr(integration_kit, "SHARED_INDUCTOR_DIR", folder)
        integration_kit.derive_inventory(sim, tmp_path, shared_inductor=True)

    made = tmp_path / "cache"
    derive(made)
    derive(made)
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    (tmp_path / "link").symlink_to(made)
    (tmp_path / "open").mkdir(mode=0o700)
    (tmp_path / "open").chmod(0o777)
    for planted in ("link", "open"):
        with pytest.raises(PermissionError, match="refused"):
            derive(tmp_path / planted)
    assert (tmp_path / "open").stat().st_mode & 0o777 == 0o777     # refused, left untouched


def test_derive_inventory_puts_the_test_envs_under_each_nodes_own(tmp_path, monkeypatch):
    """short_drain and shared_inductor join every node's env; an entry of the test's own wins;
    neither flag leaves the env as the test wrote it."""
    monkeypatch.syspath_prepend(str(TESTS / "integration"))
    from integration_kit import SHARED_INDUCTOR_ENV, SHORT_DRAIN_ENV, derive_inventory

    source = tmp_path / "sim.yaml"
    source.write_text(yaml.safe_dump({"nodes": [{"name": "node1"}, {"name": "node2"}]}))
    sim = SimpleNamespace(inventory_path=source)
    own = {"TORCHINDUCTOR_CACHE_DIR": "/var/tmp/mine", "K": "v"}

    def envs(folder: str, **flags) -> list:
        (tmp_path / folder).mkdir()
        path = derive_inventory(sim, tmp_path / folder, nodes={"node2": {"env": own}}, **flags)
        return [n.get("env") for n in yaml.safe_load(path.read_text())["nodes"]]

    assert envs("both", short_drain=True, shared_inductor=True) == [
        {**SHORT_DRAIN_ENV, **SHARED_INDUCTOR_ENV}, {**SHORT_DRAIN_ENV, **own}]
    assert envs("inductor", shared_inductor=True) == [dict(SHARED_INDUCTOR_ENV),
                                                      {**SHARED_INDUCTOR_ENV, **own}]
    assert envs("neither") == [None, own]


def test_derive_inventory_leaves_the_health_job_out_only_when_asked(tmp_path, monkeypatch):
    """health_job=False writes `health: {enabled: false}` (keeping the inventory's other health
    keys), which the inventory loader reads as no health job; the default leaves the key alone."""
    monkeypatch.syspath_prepend(str(TESTS / "integration"))
    from integration_kit import derive_inventory

    from cluster.nodes import inventory as inventory_mod

    source = tmp_path / "sim.yaml"
    source.write_text(yaml.safe_dump({"nodes": [{"name": "node1", "address": "198.18.0.1",
                                                 "role": "head"}],
                                      "health": {"period_s": 60}}))
    sim = SimpleNamespace(inventory_path=source)
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off = inventory_mod.load(str(derive_inventory(sim, tmp_path / "off", health_job=False)))
    on = inventory_mod.load(str(derive_inventory(sim, tmp_path / "on")))
    assert (off.health.enabled, off.health.period_s) == (False, 60.0)
    assert (on.health.enabled, on.health.period_s) == (True, 60.0)


def test_the_heavy_modules_named_for_the_order_exist():
    """The cost table of tests/conftest.py names modules that exist (a renamed module would
    silently lose its place at the front)."""
    text = (TESTS / "conftest.py").read_text()
    table = text.split("HEAVY_MODULE_COST_S = {", 1)[1].split("}", 1)[0]
    names = [line.split('"')[1] for line in table.splitlines() if '"' in line]
    assert names and all(suite_modules().get(Path(n).stem) for n in names), names


def suite_conftest():
    """tests/conftest.py loaded from its file under a name of its own: its scheduler and tables
    are what these tests check (test modules never import it; its fixtures come as arguments)."""
    spec = importlib.util.spec_from_file_location("suite_conftest_under_test", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_marks(path: Path) -> set[str]:
    """The marker names a module uses anywhere (`pytest.mark.NAME`: its pytestmark, a test's
    decorator)."""
    return {n.attr for n in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "mark" and getattr(n.value.value, "id", "") == "pytest"}


def test_the_engine_modules_are_the_modules_marked_vllm():
    """conftest's ENGINE_MODULES (run one after another on one xdist worker) is every module
    with a `vllm` mark (on the module or a test), and nothing else: an engine module left out
    would run beside the others' engines again; the alone lane's modules run by themselves."""
    marked = {p.name for p in suite_modules().values()
              if {"vllm"} <= module_marks(p) and "alone" not in module_marks(p)}
    conftest = suite_conftest()
    engine_modules = conftest.ENGINE_MODULES
    assert marked and engine_modules == marked, sorted(marked ^ engine_modules)
    assert conftest.ENGINE_TAIL < engine_modules
    assert not conftest.ENGINE_TAIL & {"test_gang_e2e.py", "test_tune_status.py"}


def test_the_engine_tail_runs_after_every_other_module():
    conftest = suite_conftest()
    items = [SimpleNamespace(path=Path(f"tests/{m}"), n=i) for i, m in enumerate(
        ("test_bench.py", "test_exec.py", "test_gang_e2e.py", "test_serve_app.py", "test_faults.py",
         "test_bench.py"))]
    conftest.pytest_collection_modifyitems(None, items)
    assert [(i.path.name, i.n) for i in items] == [
        ("test_gang_e2e.py", 2), ("test_faults.py", 4), ("test_exec.py", 1),
        ("test_serve_app.py", 3), ("test_bench.py", 0), ("test_bench.py", 5)]


def test_module_marks_reads_a_list_and_a_single_mark(tmp_path):
    """Control for the scan above: a module's pytestmark (one or a list) and a test's decorator."""
    one, many = tmp_path / "one.py", tmp_path / "many.py"
    one.write_text("import pytest\npytestmark = pytest.mark.vllm\n")
    many.write_text("import pytest\npytestmark = [pytest.mark.integration, pytest.mark.ray]\n"
                    "@pytest.mark.torch\ndef test_x():\n    pass\n")
    assert module_marks(one) == {"vllm"}
    assert module_marks(many) == {"integration", "ray", "torch"}


class FakeXdistWorker:
    """What xdist's LoadScopeScheduling asks of a worker: the test indexes it sends, shutdown."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes) -> None:
        self.sent += list(indexes)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_the_engine_modules_run_on_one_worker_the_rest_on_the_other():
    """xdist with conftest's scheduler (--dist loadfile): every engine module's tests go to the
    first worker, one module after another in collection order; the second worker takes the
    other modules, and the first only gets more once its engine modules are nearly done."""
    conftest = suite_conftest()
    config = SimpleNamespace(getvalue=lambda name: {"dist": "loadfile", "tx": ["2*popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=False))
    sched = conftest.pytest_xdist_make_scheduler(config, None)
    collection = [f"tests/integration/{m}::t{i}" for m, n in (
        ("test_gang_e2e.py", 3), ("test_faults.py", 2), ("test_tune_status.py", 2),
        ("test_simcluster.py", 2), ("test_deploy_e2e.py", 1), ("test_exec.py", 1))
        for i in range(n)] + ["tests/test_bench.py::t0"]
    first, second = FakeXdistWorker("gw0"), FakeXdistWorker("gw1")
    for worker in (first, second):
        sched.add_node(worker)
        sched.add_node_collection(worker, collection)
    sched.schedule()
    engine = [i for i, nodeid in enumerate(collection)
              if nodeid.split("::")[0].endswith(("gang_e2e.py", "tune_status.py", "deploy_e2e.py"))]
    assert first.sent == engine
    assert second.sent and not set(second.sent) & set(engine)
    assert [collection[i].split("::")[0] for i in second.sent][:1] == \
        ["tests/integration/test_faults.py"]
    # an ENGINE_TAIL module is a unit of its own, still queued for whichever worker frees first
    assert list(sched.workqueue)[-1] == "tests/test_bench.py"
    assert len(collection) - 1 not in first.sent + second.sent
    # without --dist loadfile, xdist's own choice stands
    other = SimpleNamespace(getvalue=lambda name: "load")
    assert conftest.pytest_xdist_make_scheduler(other, None) is None


# ---------------------------------------------------------------- one fake of the nodes (issue 43 item 4)

NODE_METHODS = {"run", "exchange", "fan_out", "fan_out_exchange"}


def session_stand_ins(text: str) -> list[str]:
    """The classes of a module that stand in for a Session or a Runner: named *Session or
    *Runner, or with a run / exchange / fan_out / fan_out_exchange method whose first argument
    is a node (or nodes); or a session's runner swapped by assignment (`x.runner_for = ...`)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            takes_nodes = [f.name for f in node.body if isinstance(f, ast.FunctionDef)
                           and f.name in NODE_METHODS and len(f.args.args) > 1
                           and f.args.args[1].arg in ("node", "nodes")]
            if takes_nodes or node.name.endswith(("Session", "Runner")):
                found.append(node.name)
        elif isinstance(node, ast.Assign):
            found += [f"{ast.unparse(t)} =" for t in node.targets
                      if isinstance(t, ast.Attribute) and t.attr == "runner_for"]
    return found


def test_the_scan_sees_a_session_of_a_test_modules_own():
    """Control: the shapes the six old session fakes had are each seen."""
    text = ("class CannedSession:\n    pass\n"
            "class Flaky:\n    def run(self, node, command, timeout=None):\n        pass\n"
            "class Group:\n    def fan_out(self, nodes, command):\n        pass\n"
            "class Serve:\n    def run(self, app):\n        pass\n"
            "session.runner_for = lambda node: runner\n")
    assert session_stand_ins(text) == ["CannedSession", "Flaky", "Group", "session.runner_for ="]


def test_fakes_has_one_fake_of_the_nodes():
    """tests/fakes.py's FakeRunner (a Runner inside a real Session) is the only stand-in for the
    nodes: no second session fake re-implementing fan_out / run / exchange."""
    assert session_stand_ins((TESTS / "fakes.py").read_text()) == ["FakeRunner"]


@pytest.mark.parametrize("name", sorted(str(p.relative_to(TESTS)) for p in suite_modules().values()
                                        if p.name != "fakes.py"))
def test_a_suite_module_defines_no_session_of_its_own(name):
    assert session_stand_ins((TESTS / name).read_text()) == []


def test_the_fake_nodes_run_inside_a_real_session():
    """FakeRunner is only the nodes: the Session's own hooks, result building (a ConnectError
    or CommandTimeout raised by the runner becomes an unreachable / timeout result) and fan-out
    in node order run as they do over SSH."""
    from cluster.base.errors import CommandTimeout, ConnectError
    from fakes import FakeRunner, fake_inventory, result

    inv = fake_inventory(3)
    nodes = FakeRunner({"n1": result("n1", "up\n"), "n2": ConnectError("n2", "refused"),
                        "n3": CommandTimeout("n3", 7.0)})
    seen = []
    with nodes.session(inv, hooks=[seen.append]) as session:
        got = session.fan_out(inv.nodes, lambda n: f"echo {n.name}", timeout=7.0)
    assert [(r.node, r.status, r.command) for r in got] == [
        ("n1", "ok", "echo n1"), ("n2", "unreachable", "echo n2"), ("n3", "timeout", "echo n3")]
    assert got[0].stdout == "up\n" and got[1].error == "n2: refused"
    assert sorted(r.node for r in seen) == ["n1", "n2", "n3"]
    assert sorted((s.node, s.command, s.timeout) for s in nodes.sent) == [
        ("n1", "echo n1", 7.0), ("n2", "echo n2", 7.0), ("n3", "echo n3", 7.0)]


def test_vllm_rpc_sockets_go_under_the_sessions_base_temp_dir(vllm_rpc_sockets, tmp_path_factory):
    """Engines started on this machine leave their ZMQ IPC sockets where VLLM_RPC_BASE_PATH
    points: the session's base temp dir (pytest keeps 3), not /tmp."""
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(vllm_rpc_sockets) and vllm_rpc_sockets.is_dir()
    assert tmp_path_factory.getbasetemp() in vllm_rpc_sockets.parents
