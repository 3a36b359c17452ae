"""Per-node preflight checks: each is probes (read-only commands) + parser + verdict vs expectations.

Thresholds come from the inventory's expectations (cluster/data/expectations.yaml defaults).
A missing tool is `skip` when the thing it checks is not required, `fail` when it is.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Mapping

from cluster.inspection.checks.base import (NodeCheck, NodeContext, Verdict, error, fail, ok, read_tool,
                                 required, skip, tool_problem, warn)
from cluster.base.errors import ParseError
from cluster.inspection.facts import (CHRONY, GPU_QUERY, GPU_TOPO, IBSTAT, LSMOD, MEMLOCK,
                                      NODE_FACTS, NTPQ, NVIDIA_SMI, PEERMEM_SYSFS, PORTS, SHM,
                                      TIMEDATECTL, BuiltFact, RootPython, WritablePath,
                                      gpu_model_of, gpus_of, node_program_probe)
from cluster.inspection.node_summary import IbPortFact, ModelFile, NodeFactsSummary
from cluster.nodes.inventory import Inventory, Node
from cluster.inspection.checks.metrics import METRICS_CHECKS
from cluster.inspection.checks.node_health import HEALTH_CHECKS
from cluster.inspection.checks.runtime import RUNTIME_CHECKS
from cluster.inspection.probes import Probe, ProbeOutput



def _same_model(a: str, b: str) -> bool:
    norm = lambda s: re.sub(r"\s+", " ", s.lower().replace("nvidia ", "")).strip()  # noqa: E731
    return norm(a) == norm(b) or norm(a).startswith(norm(b)) or norm(b).startswith(norm(a))


# ---------------------------------------------------------------- GPUs


def evaluate_gpus(ctx: NodeContext) -> Verdict:
    want_count = ctx.expect.get("gpus_per_node")
    want_model = ctx.expect.get("gpu_model")
    needed = bool(want_count or want_model)
    data, problem = read_tool(ctx, GPU_QUERY, "nvidia-smi", needed,
                              "NVIDIA GPUs",
                              "install the NVIDIA driver and check `nvidia-smi` on the node")
    if problem:
        return problem
    gpus = gpus_of(data)
    names = [g.name for g in gpus]
    memory = [g.memory_mib for g in gpus if g.memory_mib is not None]
    model = gpu_model_of(gpus)
    facts = NodeFactsSummary.of(gpu_count=len(gpus), gpu_model=model, gpu_names=tuple(names),
                                gpu_memory_mib=min(memory) if memory else None,
                                gpu_bus_ids=tuple(g.bus_id for g in gpus))
    summary = f"{len(gpus)} x {model}" if gpus else "no GPUs reported"
    if want_count and len(gpus) != want_count:
        return fail(f"{len(gpus)} of {want_count} GPUs visible ({summary})",
                    "a GPU is missing or fell off the bus: check `nvidia-smi -q`, dmesg for Xid "
                    "errors, and reseat/replace it before serving", data=data, facts=facts)
    if want_model and any(not _same_model(n, want_model) for n in names):
        odd = sorted({n for n in names if not _same_model(n, want_model)})
        return fail(f"expected {want_model}, found {', '.join(odd)} ({summary})",
                    "fix the inventory's expectations.gpu_model or remove the node",
                    data=data, facts=facts)
    if len(set(names)) > 1:
        return warn(f"mixed GPU models in one node: {', '.join(sorted(set(names)))}",
                    "a TP group runs at the smallest GPU's memory", data=data, facts=facts)
    if not gpus and not needed:
        return skip("no GPUs reported", data=data, facts=facts)
    return ok(summary, data=data, facts=facts)


def evaluate_driver(ctx: NodeContext) -> Verdict:
    want_driver = ctx.expect.get("driver_version")
    want_cuda = ctx.expect.get("cuda_version")
    needed = bool(want_driver or want_cuda or ctx.expect.get("gpus_per_node")
                  or ctx.expect.get("gpu_model"))
    data, problem = read_tool(ctx, NVIDIA_SMI, "nvidia-smi", needed,
                              "NVIDIA driver", "install the NVIDIA driver")
    if problem:
        return problem
    driver, cuda = data.driver_version, data.cuda_version
    facts = NodeFactsSummary.of(driver_version=driver, cuda_version=cuda)
    summary = f"driver {driver}, CUDA {cuda}"
    if want_driver and str(driver) != str(want_driver):
        return fail(f"driver {driver}, expected {want_driver}",
                    "install the expected driver version on this node", data=data, facts=facts)
    if want_cuda and str(cuda) != str(want_cuda):
        return fail(f"CUDA {cuda}, expected {want_cuda}",
                    "align the driver (its CUDA version) with the other nodes", data=data,
                    facts=facts)
    return ok(summary, data=data, facts=facts)


def evaluate_nvlink(ctx: NodeContext) -> Verdict:
    want = ctx.expect.get("nvlink")
    data, problem = read_tool(ctx, GPU_TOPO, "nvidia-smi", want is True,
                              "NVLink", "install the NVIDIA driver")
    if problem:
        return problem
    nvlink = data.nvlink
    kinds = sorted(set(data.links.values()))
    facts = NodeFactsSummary.of(nvlink=nvlink, topology_nics=tuple(data.nics))
    if nvlink is True:
        return ok(f"NVLink between GPUs ({', '.join(k for k in kinds if k.startswith('NV'))})",
                  data=data, facts=facts)
    if want is True:
        return fail(f"no NVLink between GPUs ({', '.join(kinds) or 'unknown'})",
                    "check the NVLink bridges / NVSwitch fabric manager (`nvidia-smi nvlink -s`)",
                    data=data, facts=facts)
    if nvlink is False:
        return ok(f"no NVLink: GPUs talk over PCIe ({', '.join(kinds)}); the planner prefers "
                  "pipeline over tensor parallel here", data=data, facts=facts)
    return ok("NVLink not determinable (single GPU)", data=data, facts=facts)


# ---------------------------------------------------------------- InfiniBand / RoCE


def _hca_name(entry: str) -> tuple[str, int | None]:
    entry = entry.lstrip("^=")
    name, _, port = entry.partition(":")
    return name, int(port) if port.isdigit() else None


_PORT_EVIDENCE = ("ca", "port", "state", "physical_state", "rate_gbps", "link_layer")


def evaluate_infiniband(ctx: NodeContext) -> Verdict:
    ib = ctx.expect.get("infiniband", {})
    expected_hcas = [_hca_name(h) for h in ctx.node.ib_hcas if not h.startswith("^")]
    needed = required(ib.get("required"), bool(expected_hcas))
    out = ctx.output(IBSTAT)
    problem = tool_problem(out, "ibstat", needed,
                            "InfiniBand/RoCE ports",
                            "install infiniband-diags (ibstat) and the MLNX/DOCA OFED drivers")
    if problem:
        return problem
    if not needed:
        return skip("no InfiniBand expected on this node (no ib_hcas in the inventory)")
    ports = ctx.reading(IBSTAT).ports
    # the evidence: every port's state (the CAs' GUIDs and firmware stay in the output)
    data = {"ports": [{k: getattr(p, k) for k in _PORT_EVIDENCE} for p in ports]}
    if expected_hcas:
        chosen = [p for p in ports if any(p.ca == n and (pt is None or p.port == pt)
                                          for n, pt in expected_hcas)]
        present = {p.ca for p in ports}
        missing = [n for n, _ in expected_hcas if n not in present]
        if missing:
            return fail(f"HCA {', '.join(missing)} not found (ibstat shows "
                        f"{', '.join(sorted(present)) or 'none'})",
                        "fix ib_hcas in the inventory or the node's OFED driver", data=data)
    else:
        chosen = ports
    facts = NodeFactsSummary.of(ib_ports=tuple(IbPortFact(p.ca, p.port, p.state, p.rate_gbps,
                                                          p.link_layer) for p in chosen))
    problems = []
    for p in chosen:
        name = f"{p.ca} port {p.port}"
        if p.state != "Active":
            problems.append(f"{name} is {p.state} (physical {p.physical_state})")
    want_layer = ib.get("link_layer")
    for p in chosen:
        if want_layer and p.link_layer and p.link_layer != want_layer:
            got = "RoCE (Ethernet)" if p.link_layer == "Ethernet" else p.link_layer
            problems.append(f"{p.ca} port {p.port} is {got}, expected {want_layer}")
    min_rate = ib.get("min_rate_gbps")
    rates = {p.rate_gbps for p in chosen if p.state == "Active"}
    for p in chosen:
        if min_rate and p.state == "Active" and (p.rate_gbps or 0) < min_rate:
            problems.append(f"{p.ca} port {p.port} at {p.rate_gbps} Gb/s, "
                            f"expected >= {min_rate}")
    if problems:
        return fail("; ".join(problems),
                    "check cables/switch ports (`ibstat`, `ibportstate`), the subnet manager "
                    "for Init/Down ports, and NCCL_IB_HCA", data=data, facts=facts)
    summary = f"{len(chosen)} port(s) Active, {'/'.join(str(r) for r in sorted(rates, key=str))} " \
              f"Gb/s, {'/'.join(sorted({str(p.link_layer) for p in chosen}))}"
    if not min_rate and len(rates) > 1:
        return warn(f"ports run at different rates: {summary}",
                    "a slow port caps NCCL's ring bandwidth: check that link", data=data,
                    facts=facts)
    return ok(summary, data=data, facts=facts)


_PEERMEM_FILES = ("/sys/kernel/mm/memory_peers/nv_mem/version",
                  "/sys/kernel/mm/memory_peers/nv_mem_nc/version",
                  "/sys/module/nvidia_peermem/version", "/sys/module/nv_peer_mem/version")

# What the evidence shows of lsmod: the peer-memory modules and those they sit on.
_PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem", "gdrdrv", "ib_core", "nvidia", "complete")


def evaluate_gpudirect(ctx: NodeContext) -> Verdict:
    ib = ctx.expect.get("infiniband", {})
    expected_hcas = [h for h in ctx.node.ib_hcas if not h.startswith("^")]
    ib_needed = required(ib.get("required"), bool(expected_hcas))
    needed = required(ctx.expect.get("gpudirect_rdma"), ib_needed)
    if not needed:
        return skip("GPUDirect RDMA not expected here (no InfiniBand/RoCE)")
    data, problem = read_tool(ctx, LSMOD, "lsmod", True, "kernel module listing",
                              "install kmod")
    if problem:
        return problem
    registered = list(ctx.reading(PEERMEM_SYSFS))
    facts = NodeFactsSummary.of(peermem_loaded=bool(data.nvidia_peermem or data.nv_peer_mem),
                                peermem_registered=tuple(registered))
    evidence = {"lsmod": {k: getattr(data, k) for k in _PEERMEM_MODULES},
                "registered": registered}
    if not facts.peermem_loaded:
        return fail("peer-memory module not loaded (neither nvidia_peermem nor nv_peer_mem): "
                    "NCCL will stage inter-node traffic through host memory (no GDRDMA)",
                    "modprobe nvidia_peermem (and add it to /etc/modules-load.d/)",
                    data=evidence, facts=facts)
    if not registered:
        return fail("nvidia_peermem is loaded but not registered (no "
                    "/sys/kernel/mm/memory_peers/nv_mem*/version nor "
                    "/sys/module/nvidia_peermem/version): NCCL disables GPUDirect RDMA",
                    "reload it (`rmmod nvidia_peermem; modprobe nvidia_peermem`) after the "
                    "MLNX/DOCA OFED stack; match the module to the driver", data=evidence,
                    facts=facts)
    return ok(f"peer memory loaded and registered ({', '.join(registered)})", data=evidence,
              facts=facts)


# ---------------------------------------------------------------- clock, shm, memlock


def evaluate_clock(ctx: NodeContext) -> Verdict:
    max_offset_s = float(ctx.expect["clock"]["max_offset_ms"]) / 1000.0
    fix = "enable and sync chrony (`systemctl enable --now chronyd; chronyc makestep`)"
    tried = []
    for fact, tool in ((CHRONY, "chronyc tracking"), (NTPQ, "ntpq -p"),
                       (TIMEDATECTL, "timedatectl")):
        probe = fact.name
        out = ctx.output(fact)
        if out.missing_tool or out.exit_code != 0 or not out.stdout.strip():
            tried.append(tool)
            continue
        data = ctx.reading(fact)
        offset_s = getattr(data, "offset_seconds", None)       # chrony, timedatectl
        if offset_s is None and getattr(data, "offset_ms", None) is not None:   # ntpq
            offset_s = data.offset_ms / 1000.0
        facts = NodeFactsSummary.of(clock_source=tool, clock_synchronized=data.synchronized,
                                    clock_offset_s=offset_s)
        shown = "" if offset_s is None else (
            f", offset {offset_s:+.3g} s" if abs(offset_s) >= 1 else f", offset {offset_s * 1000:+.3g} ms")
        if offset_s is not None and abs(offset_s) > max_offset_s:
            return fail(f"clock {abs(offset_s):.3g} s off ({tool}{shown}), limit "
                        f"{max_offset_s * 1000:g} ms", fix + " and check its sources",
                        data=data, facts=facts, probe=probe)
        if not data.synchronized:
            return fail(f"clock not synchronized ({tool}{shown})", fix, data=data, facts=facts,
                        probe=probe)
        return ok(f"synchronized ({tool}{shown})", data=data, facts=facts, probe=probe)
    return fail(f"no time sync service answers ({', '.join(tried)})", fix)


def evaluate_shm(ctx: NodeContext) -> Verdict:
    data, problem = read_tool(ctx, SHM, "df", True, "/dev/shm", "mount /dev/shm")
    if problem:
        return problem
    size = data.size_bytes
    want = int(ctx.expect["shm_min_bytes"])
    facts = NodeFactsSummary.of(shm_bytes=size)
    if size < want:
        return fail(f"/dev/shm is {_human(size)}, need >= {_human(want)} (NCCL and Ray's object "
                    "store live there)",
                    "remount bigger (`mount -o remount,size=64G /dev/shm`) or run containers "
                    "with --shm-size / --ipc=host", data=data, facts=facts)
    return ok(f"/dev/shm {_human(size)}", data=data, facts=facts)


def evaluate_memlock(ctx: NodeContext) -> Verdict:
    data = ctx.reading(MEMLOCK)
    value = data.memlock_kib
    want = ctx.expect["memlock_min_kib"]
    facts = NodeFactsSummary.of(memlock_kib=value)
    fix = ("set `* - memlock unlimited` in /etc/security/limits.conf (LimitMEMLOCK=infinity for "
           "services; docker --ulimit memlock=-1 or IPC_LOCK in containers)")
    if value == "unlimited":
        return ok("memlock unlimited", data=data, facts=facts)
    if want == "unlimited" or int(value) < int(want):
        return fail(f"memlock {value} KiB, need {want}{'' if want == 'unlimited' else ' KiB'} "
                    "(RDMA registers GPU/host memory)", fix, data=data, facts=facts)
    return ok(f"memlock {value} KiB", data=data, facts=facts)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------- software, model, ports

def evaluate_versions(ctx: NodeContext) -> Verdict:
    """The versions ray.python reports; WARN also when ray.root_python (the interpreter root runs
    node programs with) is missing or a non-root user can change it (root_python)."""
    out = ctx.output(NODE_FACTS)
    python = ctx.inventory.ray.python
    if out.missing_tool:
        return fail(f"{python} not found on the node", "install Python 3.10+ or set ray.python")
    if out.exit_code != 0:
        return error(f"version probe failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    if not ctx.facts.usable:
        raise ParseError("versions", ctx.facts.error or "no node facts")
    data = ctx.facts.versions
    if data is None:
        raise ParseError("versions", "no versions in the node facts' document")
    summary = ", ".join(f"{k} {v}" for k, v in data.items() if v)
    missing = [k for k in ("ray", "vllm") if not data.get(k)]
    unsafe = root_python(ctx.facts.root_python, ctx.inventory.ray.root_python)
    facts = NodeFactsSummary.of(versions=data, python_writable=tuple(r.path for r in unsafe[2])) \
        if unsafe else NodeFactsSummary.of(versions=data)
    if missing:
        return warn(f"{' and '.join(missing)} not installed for {python} ({summary})"
                    + (f"; {unsafe[0]}" if unsafe else ""),
                    f"pip install {' '.join(missing)} in the nodes' environment (same versions "
                    "on every node)" + (f"; {unsafe[1]}" if unsafe else ""), data=data,
                    facts=facts)
    if unsafe:
        return warn(f"{summary}; {unsafe[0]}", unsafe[1], data={**data, "writable": unsafe[2]},
                    facts=facts)
    return ok(summary, data=data, facts=facts)


def root_python(found: RootPython | None, python: str
                ) -> tuple[str, str, tuple[WritablePath, ...]] | None:
    """(summary, fix, rows) when ray.root_python did not run on the node, or a non-root user can
    change it (node_facts.py's root_python: the interpreter, its real file, pyvenv.cfg, its
    stdlib and every directory above them): root runs it (`python -I -S`) for `cluster fix`,
    `model pull` and cache staging, and -S does not stop a changed interpreter, pyvenv.cfg or
    stdlib. None when only root can (or the facts do not say)."""
    if found is None:
        return None
    if found.error is not None:
        return (f"ray.root_python {python} did not run: {found.error[:160]} (cluster fix, "
                "model pull and cache staging run node programs as root with it)",
                "install python3 for root (e.g. apt-get install python3) or set ray.root_python "
                "to an interpreter only root can change", ())
    rows = found.paths
    if not rows:
        return None
    shown = ", ".join(f"{r.path} ({r.by})" for r in rows[:3])
    more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
    return (f"root runs {python} (fix, model pull, cache staging) and a non-root user can "
            f"change it: {shown}{more}",
            "set ray.root_python to an interpreter only root can change (the system's "
            "/usr/bin/python3, or a virtualenv created by root under /opt, not group/other-"
            "writable)", rows)


MODEL_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json",
               "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelListing:
    """The model probe's reading: the key files (name -> size, sha256) and the directory's
    total bytes; `missing`: the path is not there (the probe's exit 3)."""

    files: Mapping[str, ModelFile]
    total: int | None
    missing: bool = False

    def to_dict(self) -> dict:
        return {"model_files": {k: {"size": f.size, "sha256": f.sha256}
                                for k, f in self.files.items()}, "model_bytes": self.total}


def read_model_listing(out: ProbeOutput) -> ModelListing:
    """`file <name> <size> <sha256>` lines and a `total <bytes>` line (model_probe)."""
    if out.exit_code == 3:
        return ModelListing({}, None, missing=True)
    files: dict[str, ModelFile] = {}
    total = None
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts[:1] == ["file"] and len(parts) == 4 and parts[2].isdigit():
            files[parts[1]] = ModelFile(int(parts[2]), parts[3])
        elif parts[:1] == ["total"] and len(parts) == 2 and parts[1].isdigit():
            total = int(parts[1])
    return ModelListing(files, total)


MODEL_LISTING = BuiltFact("model", read_model_listing)


def model_probe(node: Node, inventory: Inventory) -> Probe | None:
    if not inventory.model_path:
        return None
    path = shlex.quote(inventory.model_path)
    files = " ".join(MODEL_FILES)
    return Probe(MODEL_LISTING.name, f"cd {path} || exit 3; for f in {files}; do [ -f \"$f\" ] && "
                          f"echo \"file $f $(stat -c %s \"$f\") $(sha256sum < \"$f\" | cut -c1-64)\"; "
                          f"done; echo \"total $(du -sb . | cut -f1)\"")


def evaluate_model(ctx: NodeContext) -> Verdict:
    path = ctx.inventory.model_path
    if not path:
        return skip("no model path in the inventory")
    listing = ctx.reading(MODEL_LISTING)
    if listing.missing:
        return fail(f"model path {path} does not exist on this node",
                    "copy the model to the same path on every node (or a shared filesystem)")
    data = listing.to_dict()
    facts = NodeFactsSummary.of(model_files=listing.files, model_bytes=listing.total)
    if "config.json" not in listing.files:
        return fail(f"{path} has no config.json", "point model.path at a Hugging Face model "
                                                  "directory", data=data, facts=facts)
    return ok(f"{path}: {len(listing.files)} key files, {_human(listing.total or 0)}",
              data=data, facts=facts)


def ray_ports(node: Node, inventory: Inventory) -> dict[int, str]:
    r = inventory.ray
    ports = {r.node_manager_port: "node_manager_port", r.object_manager_port: "object_manager_port",
             r.dashboard_agent_listen_port: "dashboard_agent_listen_port",
             r.dashboard_agent_grpc_port: "dashboard_agent_grpc_port",
             r.runtime_env_agent_port: "runtime_env_agent_port",
             r.metrics_export_port: "metrics_export_port"}
    if node.is_head:
        ports.update({r.port: "port (GCS)", r.dashboard_port: "dashboard_port",
                      r.client_server_port: "client_server_port", r.serve_port: "serve_port"})
    return ports


def evaluate_ports(ctx: NodeContext) -> Verdict:
    if ctx.facts.raylet is not None:   # the one "is Ray running" reading (cluster/inspection/facts.py)
        return ok("Ray is running on this node: its ports are in use by Ray",
                  facts=NodeFactsSummary.of(ray_running=True), probe=NODE_FACTS.name)
    listening = ctx.reading(PORTS)
    wanted = ray_ports(ctx.node, ctx.inventory)
    busy = {p: name for p, name in wanted.items() if p in listening}
    facts = NodeFactsSummary.of(ray_running=False)
    if busy:
        return fail("ports Ray needs are taken: " + ", ".join(f"{p} ({n})" for p, n in busy.items()),
                    "stop what listens there (`ss -ltnp`) or change the ports under ray: in the "
                    "inventory", data={"listening": sorted(listening)}, facts=facts,
                    probe=PORTS.name)
    return ok(f"{len(wanted)} Ray ports free", facts=facts, probe=PORTS.name)


# ---------------------------------------------------------------- registry

NODE_CHECKS: tuple[NodeCheck, ...] = (
    NodeCheck("gpus", "GPU count and model",
              (GPU_QUERY,), evaluate_gpus),
    NodeCheck("driver", "NVIDIA driver and CUDA version",
              (NVIDIA_SMI,), evaluate_driver),
    NodeCheck("nvlink", "NVLink between GPUs", (GPU_TOPO,),
              evaluate_nvlink),
    NodeCheck("infiniband", "InfiniBand/RoCE ports", (IBSTAT,),
              evaluate_infiniband),
    NodeCheck("gpudirect", "GPUDirect RDMA peer memory",
              (LSMOD, PEERMEM_SYSFS), evaluate_gpudirect),
    NodeCheck("clock", "clock synchronized",
              (CHRONY, NTPQ, TIMEDATECTL), evaluate_clock),
    NodeCheck("shm", "/dev/shm size", (SHM,), evaluate_shm),
    NodeCheck("memlock", "locked-memory limit", (MEMLOCK,),
              evaluate_memlock),
    NodeCheck("versions", "Python, Ray, vLLM, torch, NCCL versions", (node_program_probe,),
              evaluate_versions),
    NodeCheck("model", "model files present", (model_probe,), evaluate_model),
    NodeCheck("ports", "Ray ports free", (PORTS, node_program_probe), evaluate_ports),
) + RUNTIME_CHECKS + HEALTH_CHECKS + METRICS_CHECKS
