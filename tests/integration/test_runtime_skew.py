"""A node whose `ray.python` is another runtime, found before it costs an hour (issue 40 item 4).

Each simulated node has its own /tmp, so one `ray.python` path is a different virtualenv per
node: /tmp/<venv> made on every node with `python -m venv`, the suite's site-packages added by a
.pth file; on the odd node the venv's own site-packages (first on sys.path) also holds another
Ray package (`ray/_version.py` 2.59.0, importable) and a `vllm` 0.31.0 distribution, so that
interpreter really imports that Ray and reports that vLLM. Preflight fails on that node naming
both versions, `cluster up` refuses it; the same cluster with one runtime everywhere passes
these checks. Nothing here starts Ray (refused plans and dry runs only).
"""

from __future__ import annotations

import shlex
import sys
import sysconfig

import pytest
import yaml

from integration_kit import ClusterCli, ModuleRunDir, derive_inventory

pytestmark = pytest.mark.integration
VENV = "/tmp/cluster-runtime-skew"
PY = f"{VENV}/bin/python"
SITE = f"{VENV}/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
_cli = ClusterCli(timeout=300, python=sys.executable, no_traceback=True,
                  env={"CLUSTER_RUN_DIR": ModuleRunDir("runtime-skew")})


def _make_runtime(c, node: str, ray: str | None = None, vllm: str | None = None) -> None:
    """The node's /tmp venv: the suite's packages, or another Ray / vLLM in front of them."""
    lines = [f"rm -rf {VENV}", f"{shlex.quote(sys.executable)} -m venv --without-pip {VENV}",
             f"echo {shlex.quote(sysconfig.get_paths()['purelib'])} > {SITE}/zz-suite.pth"]
    if ray:
        lines += [f"mkdir -p {SITE}/ray",
                  f"echo \"__version__ = '{ray}'\" > {SITE}/ray/__init__.py",
                  f"echo \"version = '{ray}'\" > {SITE}/ray/_version.py"]
    if vllm:
        meta = f"{SITE}/vllm-{vllm}.dist-info"
        lines += [f"mkdir -p {meta}",
                  f"printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: {vllm}\\n' > {meta}/METADATA"]
    p = c.ssh(node, " && ".join(lines), timeout=120)
    assert p.returncode == 0, p.stderr


@pytest.fixture(scope="module")
def two_nodes(simcluster_factory, tmp_path_factory):
    c = simcluster_factory(2)
    inv = derive_inventory(c, tmp_path_factory.mktemp("skew"), ray={"python": PY})
    doc = yaml.safe_load(inv.read_text())      # the simulated cluster's inventory leaves the
    doc["expectations"]["runtime_imports"] = True   # imports out (128 nodes share 2 cores)
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    yield c, inv
    for node in ("node1", "node2"):
        c.ssh(node, f"rm -rf {VENV}")


def _by(report: dict) -> dict:
    return {(r["node"], r["check"]): r for r in report["results"]}


# The runtime check's WARN when the whole smoke test ran past the probe's timeout (no evidence).
PROBE_TIMED_OUT = "the import smoke test did not finish within the probe timeout: not judged"


def assert_imports(runtime: dict, ray: str) -> None:
    """The runtime check's import smoke test: that Ray imported, with that version, and the
    check ok; or WARN "not judged" only for a time-out: an import that did not finish within the
    node program's 17 s (`import vllm` beside the heavy lane's engines on 2 cores, 2026-12-06),
    or the whole smoke test past the probe's timeout (beside them, 2026-12-07); never a failed
    import."""
    if runtime["status"] == "ok":
        assert f"ray {ray} (" in runtime["summary"], runtime
        return
    if runtime["summary"] == PROBE_TIMED_OUT:
        assert runtime["status"] == "warn", runtime
        return
    imports = runtime["evidence"]["data"]["imports"]
    assert imports["ray"]["ok"] is True and imports["ray"]["version"] == ray, runtime
    late = [n for n, e in imports.items() if e.get("timed_out")]
    assert runtime["status"] == "warn" and late and runtime["summary"].endswith(
        ": not judged") and all(imports[n]["ok"] for n in imports if n not in late), runtime


def test_a_node_with_another_ray_and_vllm_fails_preflight_and_up_refuses_it(two_nodes):
    c, inv = two_nodes
    _make_runtime(c, "node1")
    _make_runtime(c, "node2", ray="2.59.0", vllm="0.31.0")
    code, report = _cli.json(inv, "preflight", "--no-reachability")
    assert code == 2
    by = _by(report)
    assert by[("node2", "ray-match")]["status"] == "fail"
    assert by[("node2", "ray-match")]["summary"] == "ray 2.59.0, head has 2.60.0"
    assert by[("node2", "vllm-match")]["summary"] == "vllm 0.31.0, head has 0.32.0"
    assert by[("node2", "contract")]["status"] == "warn"
    assert "nearest supported: cpu" in by[("node2", "contract")]["summary"]
    assert_imports(by[("node2", "runtime")], ray="2.59.0")     # that Ray does import
    assert by[("node1", "contract")]["status"] == "ok"

    code, up = _cli.json(inv, "up", "--skip-preflight", "--yes", "--force")
    assert code == 2
    refused = " ".join(up["plan"]["refused"])
    assert "node2: Ray 2.59.0" in refused and "node1 has Ray 2.60.0" in refused
    assert "--force does not override it" in refused
    assert not any(s["results"] for s in up["steps"])         # nothing ran on any node


def test_a_node_with_another_vllm_is_refused_by_up_and_force_says_so(two_nodes):
    c, inv = two_nodes
    _make_runtime(c, "node1")
    _make_runtime(c, "node2", vllm="0.31.0")
    code, up = _cli.json(inv, "up", "--skip-preflight", "--dry-run")
    actions = {a["node"]: a for a in up["plan"]["actions"]}
    assert actions["node1"]["action"] == "start"
    assert actions["node2"]["action"] == "refuse"
    assert "vllm 0.31.0" in actions["node2"]["reason"] and \
        "the head node1 has 0.32.0" in actions["node2"]["reason"]
    code, up = _cli.json(inv, "up", "--skip-preflight", "--dry-run", "--force")
    actions = {a["node"]: a for a in up["plan"]["actions"]}
    assert actions["node2"]["action"] == "start"
    assert any(w.startswith("--force: Ray (re)started on node2") for w in up["plan"]["warnings"])


def test_the_same_runtime_everywhere_passes_these_checks(two_nodes):
    c, inv = two_nodes
    for node in ("node1", "node2"):
        _make_runtime(c, node)
    code, report = _cli.json(inv, "preflight", "--no-reachability")
    by = _by(report)
    for node in ("node1", "node2"):
        for check in ("versions", "contract"):
            assert by[(node, check)]["status"] == "ok", by[(node, check)]
        assert_imports(by[(node, "runtime")], ray="2.60.0")
        assert by[(node, "torch-cuda")]["status"] == "skip"     # the CPU build
    for check in ("python-match", "ray-match", "vllm-match", "torch-match"):
        assert by[(None, check)]["status"] == "ok"
    code, up = _cli.json(inv, "up", "--skip-preflight", "--dry-run")
    assert not up["plan"]["refused"]
    assert [a["action"] for a in up["plan"]["actions"]] == ["start", "start"]
