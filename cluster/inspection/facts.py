"""The facts layer: what a node is, gathered once per node and run, in one SSH round trip.

A fact is a read-only command and the parser of its output, declared side by side once, here
(pyinfra's FactBase): the tools' facts (`ToolFact`: nvidia-smi's forms, ibstat, lsmod, chrony,
df, ulimit, lspci, the kernel log, ...) and the on-node program
cluster/node_programs/node_facts.py (NODE_PROGRAM). `gather` runs the union of the probes that the callers need as one probe
script per node (cluster/inspection/probes.py) and returns one frozen NodeFacts per node: the raw outputs
(which the preflight checks judge) and the readings every other step uses - the GPUs (one
parser: cluster/inspection/parsers/nvidia_smi_query), the versions (one reader: the node program), the
node's Ray processes (one "is Ray running" reading), auth token, HAProxy and memlock.

`version_skew` is the one judgement of "differs from the head" for versions, used by the
preflight's cross-node checks and by `cluster up`'s plan.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from cluster.base.errors import ParseError
from cluster.nodes.inventory import Inventory, Node
from cluster.inspection.probes import (Probe, ProbeOutput, probe_script, script_deadline, script_problem,
                            split_probe_output)
from cluster.nodes.remote import CommandResult, Exchange
from cluster.inspection.clock import (CLOCK_CONVERSATION, CLOCK_MARK, CLOCK_SAMPLES, ClockSample,
                                      clock_sample, quick_enough)

PER_PROBE_TIMEOUT_S = 20
NODE_PROGRAM = "versions"          # the probe name of node_facts.py (the versions check reads it)
IMPORTS_PROBE = "runtime-imports"  # node_facts.py --imports (the runtime check reads it)
GPU_PROBE = "gpu-query"
MAX_PROGRAM_OUTPUT = 4 * 1024 * 1024

ProbeBuilder = Callable[[Node, Inventory], "Probe | None"]


@dataclass(frozen=True)
class GPU:
    """One GPU as the gpu-query fact reads it (nvidia-smi --query-gpu): the one typed reading
    of a node's GPUs, for the gpus check, `up`'s plan and the planner alike."""

    index: int
    name: str
    memory_mib: int | float | None = None
    bus_id: str | None = None


def gpus_of(query: Any) -> tuple[GPU, ...]:
    """The GPUs of the gpu-query parser's reading (parsers/nvidia_smi_query.NvidiaSmiQuery):
    its rows are keyed by nvidia-smi's own column names, read here and nowhere else."""
    gpus = []
    for position, row in enumerate(query.gpus):
        index, memory, bus = row.get("index"), row.get("memory.total"), row.get("pci.bus_id")
        gpus.append(GPU(index if type(index) is int else position, str(row.get("name")),
                        memory if isinstance(memory, (int, float))
                        and not isinstance(memory, bool) else None,
                        bus if isinstance(bus, str) else None))
    return tuple(gpus)


def gpu_model_of(gpus: Iterable[GPU]) -> str | None:
    """The one GPU model of these GPUs, "mixed" for several, None for none."""
    names = sorted({g.name for g in gpus})
    return names[0] if len(names) == 1 else ("mixed" if names else None)


@dataclass(frozen=True)
class RayletInfo:
    """The node's running raylet, read from its command line and environment."""

    pid: int
    node_id: str | None
    node_ip: str | None
    gcs_address: str | None
    resources: Mapping[str, float] = field(default_factory=dict)
    env: Mapping[str, str] | None = None
    memlock: int | None | str = "unknown"   # bytes; None: unlimited; "unknown": not read
    key_states: Mapping[str, str] = field(default_factory=dict)  # asked keys: set|empty|unset


@dataclass(frozen=True)
class WritablePath:
    """A path a non-root user can change (node_facts.py's root_python rows) and by whom."""

    path: str
    by: str | None = None


@dataclass(frozen=True)
class RootPython:
    """ray.root_python as node_facts.py found it: what a non-root user could change of it
    (`paths`), or why it did not run (`error`)."""

    python: str | None = None
    paths: tuple[WritablePath, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class NodeFacts:
    """One node's facts for one run. `error` set: the facts are incomplete (see `reached`)."""

    node: str
    reached: bool
    error: str | None = None
    python: str | None = None
    python_version: str | None = None
    ray_version: str | None = None
    ray_error: str | None = None
    gpus: tuple[GPU, ...] = ()
    gpu_error: str | None = None          # nvidia-smi present but failed / unreadable
    nvidia_smi: str | None = None         # "ok" | "missing" | "failed"
    raylet: RayletInfo | None = None
    gcs_port: int | None = None           # a gcs_server runs here (its port)
    ray_pids: tuple[int, ...] = ()        # every Ray process of this node
    ray_processes: tuple[str, ...] = ()   # "pid comm" for reports
    hostname: str | None = None
    python_match_level: str = "patch"
    auth_mode: str | None = None          # RAY_AUTH_MODE in the node's env, if set
    auth_token: bool = False              # a Ray auth token is available (env or token file)
    haproxy: str | None = None            # the HAProxy binary Serve's HAProxy ingress would run
    memlock_session: int | None | str = "unknown"   # a new session's limit (bytes; None: unlimited)
    # python, ray, vllm, torch, nccl; None: the node program's document did not say
    versions: Mapping[str, str | None] | None = None
    torch_cuda: str | None = None         # the CUDA torch was built for (None: CPU build or none)
    root_python: RootPython | None = None  # ray.root_python's safety (None: not reported)
    outputs: Mapping[str, ProbeOutput] = field(default_factory=dict, repr=False, compare=False)
    probe_command: str | None = field(default=None, repr=False, compare=False)
    # probe name -> its parser's reading (or the ParseError), filled on first read: each
    # tool's output is parsed once per node and run, whichever checks, fixes or plans read it
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    clock: ClockSample | None = None      # sampled on the gather's channel (gather(clock=True))

    def reading(self, fact: "ToolFact") -> Any:
        """`fact`'s output on this node as its parser reads it: the parser's frozen dataclass
        (never a dict view: to_dict happens only where JSON is written), parsed once
        (ParseError on garbage or when the node gave no output for it, every time it is asked)."""
        out = self.outputs.get(fact.name)
        if out is None:
            raise ParseError("probe", f"no output for {fact.name!r}: the node stopped answering "
                                      "mid-probe")
        return parsed_once(self.memo, fact.name, fact.parse, out)

    @property
    def usable(self) -> bool:
        """Reached and Python ran (the facts can be trusted)."""
        return self.reached and self.error is None

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def gpu_model(self) -> str | None:
        return gpu_model_of(self.gpus)

    @property
    def running(self) -> bool:
        """Some Ray process runs on the node."""
        return bool(self.ray_pids)

    def to_dict(self) -> dict[str, Any]:
        from cluster.base.results import to_jsonable
        d = {f: to_jsonable(getattr(self, f)) for f in (
            "node", "reached", "error", "python", "python_version", "ray_version", "ray_error",
            "gpu_error", "nvidia_smi", "raylet", "gcs_port", "ray_pids", "ray_processes",
            "hostname", "auth_mode", "auth_token", "haproxy")}
        d["gpus"] = [g.name for g in self.gpus]
        d["gpu_count"] = self.gpu_count
        d["gpu_model"] = self.gpu_model
        return d


# ---------------------------------------------------------------- the tools' facts


@dataclass(frozen=True)
class ToolFact:
    """One tool's fact: its probe name, the command, and the parser module (under
    cluster.inspection.parsers) that reads the command's output; None: its text is read as is. Called with
    (node, inventory) it is the probe builder the checks list."""

    name: str
    command: str
    parser: str | None = None
    reader: Callable[[str], Any] | None = None   # a small output's reader, without a module

    def __call__(self, node: Node, inventory: Inventory) -> Probe:
        return Probe(self.name, self.command)

    def parse(self, out: ProbeOutput) -> Any:
        """The parser's reading of this fact's output: its frozen dataclass (ParseError on
        garbage)."""
        refuse_cut(out)
        if self.reader is not None:
            return self.reader(out.stdout)
        if self.parser is None:
            raise ValueError(f"the {self.name} fact has no parser")
        import importlib
        return importlib.import_module(f"cluster.inspection.parsers.{self.parser}").parse(out.stdout)


@dataclass(frozen=True)
class BuiltFact:
    """A fact whose command a builder makes per node (it depends on the node or the inventory:
    the model's path, the head's Prometheus, node_facts.py's env): its probe name and the
    reader of its output. The builders name it; checks read it by this object, never by the
    probe's name."""

    name: str
    reader: Callable[[ProbeOutput], Any]

    def parse(self, out: ProbeOutput) -> Any:
        refuse_cut(out)
        return self.reader(out)


def refuse_cut(out: ProbeOutput) -> None:
    """ParseError when the output was cut (its middle dropped to bound it): a parser given a
    part would judge the part, so it is never given one."""
    if out.cut:
        raise ParseError(out.name, f"the output was cut ({out.cut} bytes dropped from its "
                                   f"middle, over the {_kept_bytes()} bytes kept per probe "
                                   f"and stream): not judged")


def _kept_bytes() -> int:
    from cluster.base.bounds import bound
    return int(bound("node_output", "probe_bytes"))


GPU_QUERY_FIELDS = ("index", "name", "memory.total", "pci.bus_id", "driver_version")
GPU_QUERY = ToolFact("gpu-query", "nvidia-smi --query-gpu=" + ",".join(GPU_QUERY_FIELDS)
                     + " --format=csv,nounits", "nvidia_smi_query")
NVIDIA_SMI = ToolFact("nvidia-smi", "nvidia-smi", "nvidia_smi")
NVIDIA_SMI_Q = ToolFact("nvidia-smi-q", "nvidia-smi -q", "nvidia_smi_q")
GPU_TOPO = ToolFact("gpu-topo", "nvidia-smi topo -m", "nvidia_smi_topo")
IBSTAT = ToolFact("ibstat", "ibstat", "ibstat")
LSMOD = ToolFact("lsmod", "lsmod", "lsmod")


def peermem_registered(text: str) -> tuple[str, ...]:
    """The peer-memory registration files the peermem-sysfs probe found readable."""
    return tuple(line.split(":", 1)[0] for line in text.splitlines() if line.startswith("/sys/"))


# "<file>: <its content>" per readable peer-memory registration file
PEERMEM_SYSFS = ToolFact("peermem-sysfs", (
    "for f in /sys/kernel/mm/memory_peers/nv_mem*/version /sys/module/nvidia_peermem/version "
    "/sys/module/nv_peer_mem/version; do [ -r \"$f\" ] && echo \"$f: $(cat \"$f\")\"; done; true"),
    reader=peermem_registered)

_LISTEN_RE = re.compile(r"(?:^|\s)(?:\S*[:.])(\d+)\s+\S+[:.](?:\*|\d+)\s*")


def listening_ports(text: str) -> frozenset[int]:
    """The TCP ports `ss -Hltn` (or `netstat -ltn`) lists as listening."""
    return frozenset(int(m.group(1)) for m in _LISTEN_RE.finditer(text))


PORTS = ToolFact("ports", "ss -Hltn 2>/dev/null || netstat -ltn", reader=listening_ports)
CHRONY = ToolFact("chrony", "chronyc tracking", "chronyc_tracking")
NTPQ = ToolFact("ntpq", "ntpq -pn", "ntpq")
TIMEDATECTL = ToolFact("timedatectl", "timedatectl", "timedatectl")
SHM = ToolFact("shm", "df -k /dev/shm", "df_shm")
MEMLOCK = ToolFact("memlock", "ulimit -l", "ulimit")
# Device lines and the ACS lines only: a whole `lspci -vvv` is ~1 MB on a GPU server.
LSPCI = ToolFact("lspci", "command -v lspci >/dev/null || exit 127; lspci -vvv 2>/dev/null | "
                          "grep -E '^[[:xdigit:]]|Access Control Services|ACSCap:|ACSCtl:'; true",
                 "lspci")
# The NVIDIA driver's and the PCIe AER lines of the kernel log since boot (dmesg, else the
# journal's copy).
KERNEL_LOG = ToolFact("kernel-log", (
    "command -v dmesg >/dev/null || exit 127; "
    "log=$(dmesg 2>&1) || log=$(journalctl -k -b --no-pager -q 2>&1) || "
    "{ printf '%s\\n' \"$log\" | tail -n 2 >&2; exit 3; }; "
    "printf '%s\\n' \"$log\" | grep -E 'NVRM|fallen off the bus|PCIe Bus Error' | tail -n 400; true"),
    "dmesg")
# systemctl's own exit code: 0 active, 3 not running, 4 no such unit.
FABRICMANAGER = ToolFact("fabricmanager", (
    "command -v systemctl >/dev/null || exit 127; "
    "systemctl status nvidia-fabricmanager --no-pager --full 2>&1 | "
    "head -n 200; exit ${PIPESTATUS[0]}"), "fabricmanager")
IP_ADDR = ToolFact("ip-addr", "ip addr", "ip_addr")


# ---------------------------------------------------------------- probes


def node_program_probe(node: Node, inventory: Inventory, presence: Sequence[str] = ()) -> Probe:
    """node_facts.py run by the inventory's python with the env `ray start` would get, less
    secret-looking values (they change no fact and must not reach a command line); `presence`:
    variables whose state (set/empty/unset, never the value) in the raylet's env it reports."""
    from cluster.node_programs import inline_command
    from cluster.nodes.ray_env import REPORTED_ENV
    from cluster.nodes.shell import env_prefix

    env = _program_env(node, inventory)
    keys = ",".join(sorted(set(env) | set(REPORTED_ENV)))
    args = [keys, ",".join(presence), inventory.ray.root_python]
    return Probe(NODE_PROGRAM, inline_command(inventory.ray.python, "node_facts", args,
                                              env_prefix(env)))


def _program_env(node: Node, inventory: Inventory) -> dict[str, str]:
    """The env `ray start` would get on the node, less secret-looking values."""
    from cluster.nodes.inventory import public_env
    from cluster.nodes.ray_env import start_env

    return public_env(start_env(node, serve_ingress=inventory.ray.serve_ingress,
                                ray=inventory.ray), node.secret_names)


def imports_document(out: ProbeOutput) -> Mapping[str, Any]:
    """node_facts.py --imports' answer: the import smoke test's entry per module (ParseError
    when it is not one)."""
    imports = program_document(out).get("imports")
    if not isinstance(imports, dict):
        raise ParseError(IMPORTS_PROBE, "no imports in the node program's answer")
    return imports


IMPORTS = BuiltFact(IMPORTS_PROBE, imports_document)


def imports_probe(node: Node, inventory: Inventory) -> Probe:
    """node_facts.py --imports: `import ray` and `import vllm` by the inventory's python with
    the env `ray start` would get (bounded on the node: node_facts.SMOKE_TIMEOUT_S)."""
    from cluster.node_programs import inline_command
    from cluster.nodes.shell import env_prefix

    return Probe(IMPORTS_PROBE, inline_command(inventory.ray.python, "node_facts", ["--imports"],
                                               env_prefix(_program_env(node, inventory))))


def node_program_asking(presence: Sequence[str]) -> ProbeBuilder:
    """node_program_probe that also reports these variables' state in the raylet's env."""
    keys = tuple(k for k in presence if k)
    return lambda node, inventory: node_program_probe(node, inventory, keys)


def _directory_kind(out: ProbeOutput) -> str | None:
    """What the model-dir probe printed: model | dir | none; None when it failed or printed
    anything else."""
    where = out.stdout.strip() if out.exit_code == 0 else None
    return where if where in ("model", "dir", "none") else None


MODEL_DIR = BuiltFact("model-dir", _directory_kind)


def directory_probe(path: str) -> ProbeBuilder:
    """Is `path` a directory with a config.json (a Hugging Face model) on the node: prints
    `model` (config.json there), `dir` (a directory without it) or `none`."""
    quoted = shlex.quote(path.rstrip("/") or "/")
    probe = Probe(MODEL_DIR.name, f"if [ -f {quoted}/config.json ]; then echo model; "
                               f"elif [ -d {quoted} ]; then echo dir; else echo none; fi")
    return lambda node, inventory: probe


# What `cluster up`/`down`, restart-node and the preflight's versions check read.
RAY_PROBES: tuple[ProbeBuilder, ...] = (GPU_QUERY, node_program_probe)


def probes_for(node: Node, inventory: Inventory, builders: Iterable[ProbeBuilder]) -> list[Probe]:
    """The node's probes, one per name (the first builder of a name wins); a builder listed
    again (by several checks) is not built again."""
    probes: dict[str, Probe] = {}
    for build in dict.fromkeys(builders):
        probe = build(node, inventory)
        if probe is not None:
            probes.setdefault(probe.name, probe)
    return list(probes.values())


def gather_command(node: Node, inventory: Inventory,
                   builders: Sequence[ProbeBuilder] = RAY_PROBES) -> str:
    """The one read-only command that gathers a node's facts (the Ray facts' probes and
    `builders`', as `gather` sends it)."""
    return probe_script(probes_for(node, inventory, builders), PER_PROBE_TIMEOUT_S)


def gather_timeout(probe_count: int) -> float:
    """A node's budget for its probe script: its probes run at once, so the script's own
    deadline (the probe timeout, the kill grace, the collection) whatever their number, plus
    time for the transfer and a slow connection."""
    return script_deadline(PER_PROBE_TIMEOUT_S) + 20 + (10 if probe_count > 2 else 0)


def gather(session, inventory: Inventory, nodes: Sequence[Node] | None = None,
           builders: Sequence[ProbeBuilder] = RAY_PROBES, on_node_done=None,
           clock: bool = False) -> dict[str, NodeFacts]:
    """Every node's facts, in parallel, one round trip per node: the probes of `builders` (by
    default the Ray facts'). Keys: node names, in inventory order.

    `clock`: each node's clock sampled too, on the gather's own channel once its output is in
    (Session.fan_out_exchange, cluster/inspection/clock.py): NodeFacts.clock. A node whose
    runner cannot converse (this machine's) has no sample: measure it on its own."""
    nodes = list(nodes or inventory.nodes)
    probes = {n.name: probes_for(n, inventory, builders) for n in nodes}
    timeout = gather_timeout(max((len(p) for p in probes.values()), default=0))
    if not clock:
        results = session.fan_out(nodes, lambda n: probe_script(probes[n.name],
                                                                PER_PROBE_TIMEOUT_S),
                                  timeout=timeout, on_result=on_node_done)
        return {n.name: node_facts(n, r, probes[n.name]) for n, r in zip(nodes, results)}
    talks = session.fan_out_exchange(
        nodes, lambda n: probe_script(probes[n.name], PER_PROBE_TIMEOUT_S, CLOCK_CONVERSATION),
        CLOCK_SAMPLES, quick_enough, after=CLOCK_MARK, timeout=timeout, on_result=on_node_done)
    return {n.name: _with_clock(node_facts(n, got.result, probes[n.name]), got)
            for n, got in zip(nodes, talks)}


def _with_clock(facts: NodeFacts, got: Exchange) -> NodeFacts:
    """The node's facts with its clock sample, when the gather's conversation gave replies."""
    return replace(facts, clock=clock_sample(facts.node, got)) if got.replies else facts


# ---------------------------------------------------------------- parsing (pure)


def parsed_once(memo: dict, name: str, parse: Callable[[ProbeOutput], Any],
                out: ProbeOutput) -> Any:
    """parse(out), kept in `memo` under `name`: a second read gets the same reading (or the
    same ParseError) without parsing again."""
    if name not in memo:
        try:
            memo[name] = parse(out)
        except ParseError as exc:
            memo[name] = exc
    reading = memo[name]
    if isinstance(reading, ParseError):
        raise reading
    return reading


def node_facts(node: Node, result: CommandResult, probes: Sequence[Probe]) -> NodeFacts:
    """The gather command's result -> NodeFacts (never raises)."""
    if not result.reached:
        return NodeFacts(node.name, reached=False,
                         error=f"{result.status}: {result.error or result.status}",
                         probe_command=result.command)
    problem = script_problem(result.stdout)
    if problem:
        return NodeFacts(node.name, reached=True, error=f"fact gathering failed: {problem}",
                         probe_command=result.command)
    return facts_from_outputs(node, split_probe_output(result.stdout, probes), result)


def facts_from_outputs(node: Node, outputs: Mapping[str, ProbeOutput],
                       result: CommandResult | None = None) -> NodeFacts:
    """A reached node's probe outputs -> NodeFacts (never raises)."""
    memo: dict = {}
    base = {"outputs": outputs, "probe_command": result.command if result else None,
            "memo": memo}
    data, error = _program_data(outputs.get(NODE_PROGRAM), result, memo)
    if error is not None:
        return NodeFacts(node.name, reached=True, error=error, **base)
    nvidia, gpus, gpu_error = read_gpus(
        outputs.get(GPU_PROBE), lambda out: parsed_once(memo, GPU_PROBE, GPU_QUERY.parse, out))
    raylet, gcs_port, pids, procs = _read_processes(data.get("processes") or [])
    level = "minor" if node.env.get("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL") == "minor" else "patch"
    versions = data.get("versions")
    return NodeFacts(node.name, reached=True, python=data.get("python"),
                     python_version=data.get("python_version"),
                     ray_version=data.get("ray_version"), ray_error=data.get("ray_error"),
                     gpus=gpus, gpu_error=gpu_error, nvidia_smi=nvidia, raylet=raylet,
                     gcs_port=gcs_port, ray_pids=pids, ray_processes=procs,
                     hostname=data.get("hostname"), python_match_level=level,
                     auth_mode=data.get("auth_mode"), auth_token=bool(data.get("auth_token")),
                     haproxy=data.get("haproxy"),
                     memlock_session=_limit(data.get("memlock_session"))
                     if data.get("memlock_session_known") is True else "unknown",
                     versions={str(k): (str(v) if v is not None else None)
                               for k, v in versions.items()}
                     if isinstance(versions, dict) else None,
                     torch_cuda=str(data["torch_cuda"]) if data.get("torch_cuda") else None,
                     root_python=_root_python(data.get("root_python")), **base)


def _root_python(found: Any) -> RootPython | None:
    """node_facts.py's root_python entry, typed (rows that are not {path, by} are dropped)."""
    if not isinstance(found, dict):
        return None
    paths = found.get("paths")
    rows = tuple(WritablePath(r["path"], r["by"] if isinstance(r.get("by"), str) else None)
                 for r in (paths if isinstance(paths, list) else ())
                 if isinstance(r, dict) and isinstance(r.get("path"), str))
    return RootPython(found["python"] if isinstance(found.get("python"), str) else None, rows,
                      found["error"] if isinstance(found.get("error"), str) else None)


def program_document(out: ProbeOutput) -> dict:
    """node_facts.py's JSON document, read by the programs' one reader (ParseError when it is
    not one, or was cut)."""
    from cluster.base.errors import ProgramError
    from cluster.node_programs import parse_answer

    refuse_cut(out)
    try:
        return parse_answer(out.stdout, "node_facts", max_bytes=MAX_PROGRAM_OUTPUT)
    except ProgramError as exc:
        raise ParseError("node-facts", exc.reason) from None


NODE_FACTS = BuiltFact(NODE_PROGRAM, program_document)   # node_facts.py's document


def _program_data(out: ProbeOutput | None, result: CommandResult | None,
                  memo: dict) -> tuple[dict, str | None]:
    """(node_facts.py's document, None) or ({}, why the facts could not be read)."""
    if out is None:
        if result is None:
            return {}, "no output of the node-facts program"
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return {}, f"fact gathering failed (exit {result.exit_code}): {detail[0][:300]}"
    if out.exit_code != 0:
        why = "python not found" if out.missing_tool else \
            "timed out" if out.timed_out else f"exit {out.exit_code}"
        detail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return {}, f"fact gathering failed ({why}): {detail[0][:300]}"
    try:
        return parsed_once(memo, NODE_PROGRAM, program_document, out), None
    except ParseError as exc:
        return {}, f"unreadable facts: {exc}"


def read_gpus(out: ProbeOutput | None, parse: Callable[[ProbeOutput], Any] | None = None
              ) -> tuple[str, tuple[GPU, ...], str | None]:
    """(nvidia-smi status, GPUs, error) from the gpu-query probe: ok | missing | failed.
    `parse`: the probe's reader (default GPU_QUERY.parse; the facts pass their memoised one)."""
    if out is None:
        return "failed", (), "nvidia-smi gave no output (the node stopped answering?)"
    if out.missing_tool:
        return "missing", (), None
    if out.timed_out:
        return "failed", (), "nvidia-smi hung (no answer within the probe timeout)"
    if out.exit_code != 0:
        tail = (out.stderr or out.stdout).strip()
        return "failed", (), (f"nvidia-smi failed (exit {out.exit_code}): "
                              f"{tail.splitlines()[-1] if tail else 'no output'}")
    if not out.stdout.strip():
        return "ok", (), None
    try:
        refuse_cut(out)
        return "ok", gpus_of((parse or GPU_QUERY.parse)(out)), None
    except ParseError as exc:
        return "failed", (), str(exc)


def _flag(args: Sequence[str], name: str) -> str | None:
    prefix = f"--{name}="
    for a in args:
        if a.startswith(prefix):
            return a[len(prefix):]
    return None


def _static_resources(text: str | None) -> dict[str, float]:
    """Raylet `--static_resource_list=CPU,2,GPU,4,...` -> {name: amount}."""
    if not text:
        return {}
    parts = text.split(",")
    out = {}
    for name, value in zip(parts[0::2], parts[1::2]):
        try:
            amount = float(value)
        except ValueError:
            continue
        if math.isfinite(amount) and amount >= 0:
            out[name] = amount
    return out


def _limit(value: Any) -> int | None | str:
    """A memlock limit from the node's document: bytes (an int >= 0), None (unlimited), or
    "unknown" for anything else (never a number that could not be compared)."""
    if value is None or (type(value) is int and value >= 0):
        return value
    return "unknown"


def _key_states(value: Any) -> dict[str, str]:
    """The raylet's asked variables -> set | empty | unset (anything else is dropped)."""
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if v in ("set", "empty", "unset")}


def _read_processes(processes: Sequence[Mapping[str, Any]]):
    raylet, gcs_port = None, None
    pids, procs = [], []
    for p in processes:
        if not isinstance(p, Mapping) or type(p.get("pid")) is not int or p["pid"] <= 0:
            continue
        pids.append(p["pid"])
        procs.append(f"{p['pid']} {p.get('comm', '?')}")
        args = [a for a in p.get("args") or [] if isinstance(a, str)]
        if p.get("kind") == "raylet" and raylet is None:
            raylet = RayletInfo(pid=p["pid"], node_id=_flag(args, "node_id"),
                                node_ip=_flag(args, "node_ip_address"),
                                gcs_address=_flag(args, "gcs-address"),
                                resources=_static_resources(_flag(args, "static_resource_list")),
                                env=p.get("env"),
                                memlock=_limit(p["memlock"]) if "memlock" in p else "unknown",
                                key_states=_key_states(p.get("key_states")))
        elif p.get("kind") == "gcs_server":
            port = _flag(args, "gcs_server_port")
            gcs_port = int(port) if port and port.isdigit() else -1
    return raylet, gcs_port, tuple(sorted(pids)), tuple(procs)


# ---------------------------------------------------------------- one skew judgement


@dataclass(frozen=True)
class Skew:
    """`component` on `node` is `value`, the reference (the head, else the majority) `reference`."""

    node: str
    component: str
    value: str
    reference: str


def majority_value(values: Mapping[str, Any], head: str) -> Any:
    """The most common value; on a tie the head's (when it has one), else the first seen."""
    counts: dict[Any, int] = {}
    for v in values.values():
        counts[v] = counts.get(v, 0) + 1
    top = max(counts.values())
    leaders = [v for v, c in counts.items() if c == top]
    return values[head] if len(leaders) > 1 and head in values else leaders[0]


def reference_value(values: Mapping[str, Any], head: str) -> Any:
    """What versions are judged against: the head's value when it has one, else the majority."""
    return values[head] if head in values else majority_value(values, head)


@dataclass(frozen=True)
class ComponentVersions:
    """One component's known versions (node -> version) and the `reference` they are judged against."""

    component: str
    values: Mapping[str, str]
    reference: str

    def skews(self) -> tuple[Skew, ...]:
        """Every node whose version differs from the reference, by node name."""
        return tuple(Skew(n, self.component, value, self.reference)
                     for n, value in sorted(self.values.items()) if value != self.reference)


def component_versions(versions: Mapping[str, Mapping[str, str | None]], head: str,
                       components: Sequence[str]) -> tuple[ComponentVersions, ...]:
    """Per component (in order) that some node knows, its versions and their reference.

    `versions`: node -> component -> version (None or absent: unknown, never a difference).
    """
    out: list[ComponentVersions] = []
    for comp in components:
        values = {n: v[comp] for n, v in versions.items() if v.get(comp)}
        if values:
            out.append(ComponentVersions(comp, values, reference_value(values, head)))
    return tuple(out)


def version_skew(versions: Mapping[str, Mapping[str, str | None]], head: str,
                 components: Sequence[str]) -> tuple[Skew, ...]:
    """Per component (in order), every node whose version differs from the reference
    (`versions` as component_versions takes it)."""
    return tuple(s for known in component_versions(versions, head, components) for s in known.skews())
