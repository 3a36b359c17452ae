"""Preflight's runtime checks: does the interpreter Ray runs (`ray.python`) serve, against the
version contract (cluster/data/versions.yaml, cluster/inspection/contract.py).

Per node: vLLM and Ray import (`runtime`: FAIL with the exception's last line), the combination
is one the contract supports (`contract`: WARN naming the nearest supported row), torch's CUDA
runs on the node's driver (`torch-cuda`: FAIL below the driver floor). Across the cluster: the
laptop's Ray client against the nodes' Ray (`ray-client`), judged only for the commands that
connect through Ray's client (none today: see RAY_CLIENT_COMMANDS).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from cluster.base.results import CheckResult, Evidence, Status
from cluster.inspection.checks.base import (NodeCheck, NodeContext, Verdict, error, fail, ok,
                                            read_tool, skip, warn)
from cluster.inspection.contract import ContractError, Runtime, compare, load_contract
from cluster.inspection.facts import (IMPORTS, NVIDIA_SMI, NodeFacts, imports_probe,
                                      node_program_probe)
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.inspection.probes import Probe
from cluster.nodes.inventory import Inventory, Node

SERVING_IMPORTS = ("ray", "vllm")
NODES_DOC = "docs/nodes.md"
# Commands that connect to the cluster through Ray's client (`ray.init("ray://...")`) from
# the laptop: Ray requires the client's Ray and Python minor version to equal the cluster's.
# None do: the laptop reaches the head over SSH and the dashboard's REST API (jobs, Serve,
# state), which needs no Ray on the laptop at all.
RAY_CLIENT_COMMANDS: tuple[str, ...] = ()


def runtime_of(facts: NodeFacts) -> Runtime:
    """The node's Runtime, from its facts (node_facts.py's versions and torch's CUDA)."""
    v = facts.versions or {}
    return Runtime(*(v.get(c) or None for c in ("python", "ray", "vllm", "torch")),
                   facts.torch_cuda or None, v.get("nccl") or None)


# ---------------------------------------------------------------- vLLM and Ray import


def asked_imports_probe(node: Node, inventory: Inventory) -> Probe | None:
    """The imports probe, unless the inventory's expectations.runtime_imports is false."""
    return imports_probe(node, inventory) if inventory.expectations.get("runtime_imports", True) \
        else None


def evaluate_imports(ctx: NodeContext) -> Verdict:
    if not ctx.expect.get("runtime_imports", True):
        return skip("not asked (expectations.runtime_imports is false)")
    out = ctx.output(IMPORTS)
    python = ctx.inventory.ray.python
    if out.missing_tool:
        return fail(f"{python} not found on the node", "install Python or set ray.python")
    if out.timed_out:
        return warn("the import smoke test did not finish within the probe timeout: not judged",
                    f"time `{python} -c 'import vllm'` on the node (a hung import hangs Ray's "
                    "workers too)")
    if out.exit_code != 0:
        return error(f"import smoke test failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    imports = ctx.reading(IMPORTS)
    versions = (ctx.facts.versions or {}) if ctx.facts.usable else {}
    return judge_imports(imports, versions, python)


def judge_imports(imports: Mapping[str, Any], versions: Mapping[str, Any],
                  python: str) -> Verdict:
    """Pure: the smoke test's entries -> the verdict. Not installed (no version, the module
    not found): WARN, as the versions check says; installed but not importable: FAIL."""
    broken, absent, slow, fine = [], [], [], []
    for name in SERVING_IMPORTS:
        entry = imports.get(name)
        if not isinstance(entry, dict):
            slow.append(f"{name}: no answer")
        elif entry.get("ok") is True:
            fine.append(f"{name} {entry.get('version') or '?'} ({entry.get('seconds', '?')} s)")
        elif entry.get("timed_out"):
            slow.append(str(entry.get("error") or f"import {name} timed out"))
        elif not versions.get(name) and f"No module named '{name}'" in str(entry.get("error")):
            absent.append(name)
        else:
            broken.append(f"`import {name}` fails: {entry.get('error') or 'no reason given'}")
    data = {"imports": dict(imports)}
    if broken:
        return fail("; ".join(broken) + f" (with {python})",
                    f"reinstall the tested combination in that environment ({NODES_DOC}); run "
                    f"`{python} -c 'import vllm'` on the node for the whole traceback", data=data)
    if absent:
        return warn(f"{' and '.join(absent)} not installed for {python}",
                    f"install the tested combination ({NODES_DOC})", data=data)
    if slow:
        return warn("; ".join(slow) + ": not judged",
                    f"time `{python} -c 'import vllm'` on the node: a hung import hangs Ray's "
                    "workers too", data=data)
    return ok("imports: " + ", ".join(fine))


# ---------------------------------------------------------------- the version contract


def evaluate_contract(ctx: NodeContext) -> Verdict:
    if not ctx.facts.usable:
        return error(ctx.facts.error or "no facts")
    runtime = runtime_of(ctx.facts)
    if not runtime.ray or not runtime.vllm:
        return skip("not judged: Ray or vLLM is not installed (the versions check says so)")
    return judge_contract(runtime)


def judge_contract(runtime: Runtime) -> Verdict:
    """Pure: a runtime inside a supported row is ok; outside, WARN naming the nearest row."""
    try:
        contract = load_contract()
    except ContractError as exc:
        return error(str(exc))
    rows = contract.matching(runtime)
    if rows:
        tested = " (the suite runs it)" \
            if any(r.id == contract.tested_id for r in rows) else ""
        return ok(f"{runtime.describe()}: contract row {rows[0].id}{tested}",
                  facts=NodeFactsSummary.of(runtime=runtime, contract_row=rows[0].id))
    near = contract.nearest(runtime)
    return warn(f"{runtime.describe()} is outside the version contract; nearest supported: "
                f"{near.describe()} (differs in {', '.join(near.differences(runtime))})",
                f"install that combination with ray.python: `{near.install}` ({NODES_DOC})",
                facts=NodeFactsSummary.of(runtime=runtime, contract_row=None,
                                          contract_nearest=near.id),
                data={"runtime": runtime})


# ---------------------------------------------------------------- torch's CUDA vs the driver


def evaluate_torch_cuda(ctx: NodeContext) -> Verdict:
    if not ctx.facts.usable:
        return error(ctx.facts.error or "no facts")
    cuda, torch = ctx.facts.torch_cuda, (ctx.facts.versions or {}).get("torch")
    if not torch:
        return skip("torch not installed for the inventory's python")
    if not cuda:
        return skip(f"torch {torch} is a CPU build (no CUDA)")
    needed = bool(ctx.expect.get("driver_version") or ctx.expect.get("gpus_per_node")
                  or ctx.expect.get("gpu_model"))
    data, problem = read_tool(ctx, NVIDIA_SMI, "nvidia-smi", needed, "NVIDIA driver",
                              "install the NVIDIA driver")
    if problem:
        return problem
    return judge_torch_cuda(str(torch), str(cuda), data.driver_version, data.cuda_version)


def judge_torch_cuda(torch: str, cuda: str, driver: Any, driver_cuda: Any) -> Verdict:
    """Pure: torch built for CUDA `cuda` on a node with NVIDIA driver `driver`."""
    try:
        floor = load_contract().driver_needed(cuda)
    except ContractError as exc:
        return error(str(exc))
    data = {"torch": torch, "torch_cuda": cuda, "driver": driver, "driver_cuda": driver_cuda,
            "driver_minimum": floor}
    if not driver:
        return skip(f"torch {torch} is built for CUDA {cuda}; no NVIDIA driver reported",
                    data=data)
    if floor is None:
        return warn(f"torch {torch} is built for CUDA {cuda}, a major version the contract "
                    "has no driver floor for: not judged",
                    "add its minimum driver to cluster/data/versions.yaml (NVIDIA's CUDA "
                    "compatibility table)", data=data)
    if compare(str(driver), floor) < 0:
        return fail(f"torch {torch} is built for CUDA {cuda}, which needs NVIDIA driver >= "
                    f"{floor}; this node has {driver}",
                    f"install NVIDIA driver {floor} or newer (or the cuda-compat package on a "
                    f"data-center GPU), or a torch built for an older CUDA ({NODES_DOC})",
                    data=data)
    how = f" (CUDA minor version compatibility: the driver's own is {driver_cuda})" \
        if driver_cuda and compare(str(driver_cuda), cuda) < 0 else ""
    return ok(f"torch CUDA {cuda} on driver {driver} (>= {floor}){how}", probe=NVIDIA_SMI.name)


# ---------------------------------------------------------------- the laptop's Ray client


def laptop_ray_version() -> str | None:
    """The Ray installed beside this CLI (metadata only, Ray not imported), or None."""
    from importlib import metadata
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return None


def ray_client_check(facts: Mapping[str, NodeFactsSummary], laptop_ray: str | None,
                     commands: Sequence[str] = RAY_CLIENT_COMMANDS) -> list[CheckResult]:
    """The laptop's Ray against the nodes' Ray: FAIL when a command of `commands` (those that
    connect through Ray's client) would connect and the versions differ; otherwise a skip
    saying why equality is not needed."""
    rays = sorted({ray for f in facts.values() if (ray := f.version("ray"))})
    ev = Evidence(data={"laptop_ray": laptop_ray, "node_ray": rays,
                        "client_commands": list(commands)})
    if not commands:
        return [CheckResult("ray-client", None, Status.SKIP,
                            f"laptop Ray {laptop_ray or 'not installed'} need not match "
                            f"(nodes {', '.join(rays) or 'unknown'}): no command uses Ray's "
                            "client", ev)]
    odd = [r for r in rays if r != laptop_ray]
    if not rays or not odd:
        return [CheckResult("ray-client", None, Status.OK,
                            f"laptop Ray {laptop_ray} equals the nodes' Ray", ev)]
    return [CheckResult("ray-client", None, Status.FAIL,
                        f"laptop Ray {laptop_ray or 'not installed'} differs from the nodes' "
                        f"{', '.join(odd)}: Ray's client requires them equal "
                        f"({', '.join(commands)})", ev,
                        f"pip install 'ray=={odd[0]}' on the laptop")]


RUNTIME_CHECKS: tuple[NodeCheck, ...] = (
    NodeCheck("runtime", "vLLM and Ray import with ray.python", (asked_imports_probe,),
              evaluate_imports),
    NodeCheck("contract", "Python/Ray/vLLM/torch in the version contract",
              (node_program_probe,), evaluate_contract),
    NodeCheck("torch-cuda", "torch's CUDA runs on the NVIDIA driver",
              (node_program_probe, NVIDIA_SMI), evaluate_torch_cuda),
)
