"""`cluster nccl-check`: build the all-reduce Ray job, run it through the head's job API, judge it.

The job's entrypoint is cluster/ray_jobs/nccl_allreduce.py (see its docstring for what runs on the
cluster). This module is the laptop side, in three layers:

  build    `job_args(options, nodes)` (the entrypoint's arguments) and `head_call(...)`: one
           SSH command that runs the on-node program cluster/ray_jobs/nccl_job.py with
           the inventory's python on the head. It writes the entrypoint script to a temporary
           directory there, submits the job to the dashboard's REST API on the head's loopback
           (`POST /api/jobs/`, so it shows in the Ray dashboard), polls it until it ends or the
           deadline (then stops it), reads the result file the entrypoint wrote and the job's
           logs, removes its files and prints one JSON document.
  collect  `parse_head_output(document) -> JobOutcome` (pure).
  judge    `expected_bandwidth(preflight_facts, nodes)` (IB rate x active NICs per node) and
           `judge(options, outcome, expected)` -> NcclCheckResult (pure): for NCCL the ranks'
           NCCL_DEBUG logs are parsed together with cluster.inspection.parsers.nccl (transport, GDR,
           verdict) and the measured bus bandwidth is compared with the expected one (< 50%:
           warn). A node that is missing, unreachable or died fails the check by name.

playbooks/nccl_check.py ties them together (submit, wait, judge). Nothing here prints; ray and
torch are never imported on the laptop.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping, Sequence

from cluster.base.bounds import bound, check_float, check_int
from cluster.nodes.endpoints import head_dashboard_base
from cluster.base.errors import ProgramError, UsageError
from cluster.nodes.inventory import Inventory, Node
from cluster.node_programs import Call, document_of, embedded_document, failure, program_call
from cluster.ray.ray_state import head_client_env
from cluster.ray_jobs import entrypoint_path
from cluster.base.results import Status, exit_code_for, worst, Record
from cluster.inspection.node_summary import PreflightFacts

BACKENDS = ("nccl", "gloo")
DEFAULT_SIZE_MB = {"nccl": 256.0, "gloo": 32.0}
DEFAULT_ITERS = {"nccl": 20, "gloo": 10}
DEFAULT_WARMUP = 2
DEFAULT_TIMEOUT_S = 300.0
BANDWIDTH_WARN_FRACTION = 0.5
DRIVER_RESERVE_S = 10.0       # the entrypoint finishes this long before the job is stopped
SSH_MARGIN_S = 60.0           # the SSH command's timeout beyond --timeout (submit, stop, read back)
HEAD_PROGRAM = "nccl_job"           # cluster/ray_jobs/nccl_job.py, run on the head
RESULT_MAX_BYTES = 512 << 20        # the entrypoint's result file: 128 ranks' NCCL logs (4 MiB each)
ENTRYPOINT = entrypoint_path("nccl_allreduce")



# ---------------------------------------------------------------- options and the job


@dataclass(frozen=True)
class CheckOptions:
    """What `cluster nccl-check` was asked for; None picks the backend's default."""

    backend: str = "nccl"
    size_mb: float | None = None
    iters: int | None = None
    warmup: int = DEFAULT_WARMUP
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}")
        if self.size_mb is not None:
            check_float(self.size_mb, "--size-mb", lo=0, lo_open=True,
                        hi=bound("nccl_check", "size_mb_max"))
        if self.iters is not None:
            check_int(self.iters, "--iters", lo=1, hi=bound("nccl_check", "iters_max"))
        check_int(self.warmup, "--warmup", lo=0, hi=bound("nccl_check", "warmup_max"))
        check_float(self.timeout_s, "--timeout", lo=bound("nccl_check", "timeout_s_min"),
                    hi=bound("nccl_check", "timeout_s_max"))

    @property
    def size(self) -> float:
        return self.size_mb if self.size_mb is not None else DEFAULT_SIZE_MB[self.backend]

    @property
    def iterations(self) -> int:
        return self.iters if self.iters is not None else DEFAULT_ITERS[self.backend]


def new_submission_id(backend: str) -> str:
    """`nccl-check-<backend>-<time>-<random>`: readable in the dashboard's job list, unique."""
    return f"nccl-check-{backend}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def job_args(options: CheckOptions, nodes: Sequence[Node]) -> list[str]:
    """The entrypoint's arguments (the head snippet adds --deadline, --result-file).

    `--nodes` lists the nodes in rank order (inventory order: the head first) with the IP Ray
    registered them under (`node_ip`, else the address).
    """
    if not nodes:
        raise UsageError("no node selected")
    return ["--backend", options.backend, "--size-mb", f"{options.size:g}",
            "--iters", str(options.iterations), "--warmup", str(options.warmup),
            "--nodes", json.dumps([{"name": n.name, "ip": n.ip} for n in nodes],
                                  separators=(",", ":"))]


def head_call(inventory: Inventory, options: CheckOptions, nodes: Sequence[Node],
              submission_id: str, script: str | None = None,
              args: Sequence[str] | None = None) -> Call:
    """The one SSH command run on the head (submit, wait, read back) and its stdin. `args`:
    the entrypoint's arguments when not job_args(options, nodes) (the fabric proof's groups)."""
    text = script if script is not None else ENTRYPOINT.read_text()
    cfg = {"base": head_dashboard_base(inventory), "submission_id": submission_id,
           "python": inventory.ray.python,
           "script_b64": base64.b64encode(text.encode()).decode(),
           "args": list(args) if args is not None else job_args(options, nodes),
           "timeout_s": options.timeout_s,
           "reserve_s": DRIVER_RESERVE_S,
           "metadata": {"cluster-toolkit": "nccl-check", "backend": options.backend}}
    return program_call(inventory.ray.python, HEAD_PROGRAM,
                        [json.dumps(cfg, separators=(",", ":"))],
                        env_prefix=head_client_env(inventory))


# ---------------------------------------------------------------- collect


@dataclass(frozen=True)
class JobOutcome:
    """What the head snippet reported: the job's fate and the entrypoint's result (or None)."""

    submission_id: str | None
    submitted: bool
    status: str | None                  # Ray job status: SUCCEEDED / FAILED / STOPPED / ...
    message: str | None
    result: Mapping[str, Any] | None    # the entrypoint's result file (cluster/ray_jobs/nccl_allreduce.py)
    logs_tail: str = ""
    errors: tuple[str, ...] = ()
    timed_out: bool = False
    waited_s: float | None = None
    entrypoint: str | None = None


def parse_head_output(data: Mapping[str, Any]) -> JobOutcome:
    """The head program's JSON document -> JobOutcome (pure). The result is the entrypoint's
    result file, carried packed in the document (none when the driver wrote none)."""
    result = None
    errors = list(data.get("errors") or ())
    if data.get("result_z"):
        try:
            result = embedded_document(str(data["result_z"]), HEAD_PROGRAM,
                                       max_bytes=RESULT_MAX_BYTES)
        except ProgramError as exc:
            errors.append(f"unreadable job result: {exc.reason}")
    return JobOutcome(submission_id=data.get("submission_id"), submitted=bool(data.get("submitted")),
                      status=data.get("status"), message=data.get("message"), result=result,
                      logs_tail=data.get("logs_tail") or "", errors=tuple(errors),
                      timed_out=bool(data.get("timed_out")), waited_s=data.get("waited_s"),
                      entrypoint=data.get("entrypoint"))


def outcome_of(result, head: str, submission_id: str) -> JobOutcome:
    """The head command's CommandResult -> JobOutcome (when the program gave no document,
    an outcome whose errors say why)."""
    got = document_of(result, HEAD_PROGRAM)
    if isinstance(got, dict):
        return parse_head_output(got)
    why = ("the head printed no nccl-check result",) if got.reached else ()
    return JobOutcome(submission_id, False, None, None, None,
                      errors=why + (failure(got, f"head {head}")[:320],))


# ---------------------------------------------------------------- expected bandwidth


@dataclass(frozen=True)
class Expected:
    """Expected all-reduce bus bandwidth (GB/s) between nodes: the slowest node's NIC total."""

    gbps: float | None
    basis: str
    per_node: Mapping[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"gbps": self.gbps, "basis": self.basis, "per_node": dict(self.per_node)}


def expected_bandwidth(preflight_facts: PreflightFacts | None,
                       nodes: Sequence[str]) -> Expected:
    """IB rate x active NICs per node, from preflight facts (each node's typed `ib_ports`).

    A ring all-reduce between nodes moves each node's share through all its NICs at once, so
    nccl-tests' bus bandwidth tops out at the sum of a node's active port rates (Gb/s / 8 =
    GB/s); the slowest node bounds the cluster. Ports not Active count for nothing. A node
    without ib_ports in the facts gives no expectation (run `cluster preflight`).
    """
    if preflight_facts is None:
        return Expected(None, "no preflight facts (run `cluster preflight` first)")
    per_node: dict[str, float | None] = {}
    counts: dict[str, tuple[int, set]] = {}
    for name in nodes:
        facts = preflight_facts.nodes.get(name)
        if facts is None or facts.ib_ports is None:
            per_node[name] = None
            continue
        active = facts.active_ib_rates
        per_node[name] = round(sum(float(r) for r in active) / 8.0, 3)
        counts[name] = (len(active), set(active))
    missing = [n for n, v in per_node.items() if v is None]
    if missing:
        return Expected(None, f"no InfiniBand facts for {', '.join(missing)} (its ibstat could "
                              f"not be read, or the report lacks it)", per_node)
    if not per_node:
        return Expected(None, "no node", per_node)
    slowest = min(per_node, key=lambda n: per_node[n] or 0.0)
    n_ports, rates = counts[slowest]
    value = per_node[slowest]
    if not value:
        return Expected(0.0, f"{slowest} has no Active InfiniBand/RoCE port", per_node)
    rate = "/".join(f"{r:g}" for r in sorted(rates))
    return Expected(value, f"{n_ports} x {rate} Gb/s active ports on {slowest} "
                           f"(the slowest node) = {value:g} GB/s", per_node)


# ---------------------------------------------------------------- judge


@dataclass(frozen=True)
class RankResult(Record):
    rank: int | None
    node: str | None
    hostname: str | None
    ip: str | None
    pid: int | None
    gpu_ids: tuple[str, ...]
    time_s: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None
    error: str | None
    phase: str | None


@dataclass(frozen=True)
class NcclCheckResult:
    """The judged check; `to_dict()` is the `cluster nccl-check --json` document (docs/nccl-check.md)."""

    backend: str
    size_mb: float
    iters: int
    ranks: int
    nodes: tuple[str, ...]
    busbw_gbps: float | None
    algbw_gbps: float | None
    expected: Expected
    bandwidth_ratio: float | None
    transport: str | None
    gdr: bool | None
    nccl: Mapping[str, Any] | None          # cluster.inspection.parsers.nccl result of all ranks' logs
    status: Status
    verdict: str
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    failed_nodes: tuple[str, ...]
    per_rank: tuple[RankResult, ...]
    job_id: str | None
    job_status: str | None
    stage: str | None
    timings: Mapping[str, float] = field(default_factory=dict)
    versions: Mapping[str, Any] = field(default_factory=dict)
    logs_tail: str = ""
    run_dir: str | None = None
    dashboard_url: str | None = None

    @property
    def exit_code(self) -> int:
        return exit_code_for([self.status])

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "ranks": self.ranks, "nodes": list(self.nodes),
            "size_mb": self.size_mb, "iters": self.iters,
            "busbw_gbps": self.busbw_gbps, "algbw_gbps": self.algbw_gbps,
            "expected_gbps": self.expected.gbps, "expected_basis": self.expected.basis,
            "bandwidth_ratio": self.bandwidth_ratio,
            "transport": self.transport, "gdr": self.gdr,
            "nccl_status": (self.nccl or {}).get("status"),
            "nccl_verdict": (self.nccl or {}).get("verdict"),
            "status": self.status.value, "verdict": self.verdict,
            "problems": list(self.problems), "notes": list(self.notes),
            "failed_nodes": list(self.failed_nodes),
            "per_rank": [r.to_dict() for r in self.per_rank],
            "job_id": self.job_id, "job_status": self.job_status, "stage": self.stage,
            "timings_s": dict(self.timings), "versions": dict(self.versions),
            "expected": self.expected.to_dict(), "nccl": self.nccl,
            "dashboard_url": self.dashboard_url, "run_dir": self.run_dir,
            "exit_code": self.exit_code,
        }

def judge(options: CheckOptions, outcome: JobOutcome, expected: Expected | None = None,
          dashboard_url: str | None = None) -> NcclCheckResult:
    """Pure: the job's outcome (+ expected bandwidth) -> the verdict."""
    expected = expected or Expected(None, "not computed")
    res = dict(outcome.result or {})
    raw_ranks = [r for r in res.get("ranks") or [] if isinstance(r, Mapping)]
    per_rank = tuple(_rank(r) for r in raw_ranks)
    problems = [str(p) for p in res.get("problems") or []]
    notes = [str(n) for n in res.get("notes") or []]
    failed = [str(n) for n in res.get("failed_nodes") or []]
    rank_nodes = _ordered({r.node for r in per_rank if r.node and r.rank is not None},
                          list((res.get("nodes") or {}).keys()))
    base = dict(backend=options.backend, size_mb=options.size, iters=options.iterations,
                ranks=len(per_rank) if per_rank else int(res.get("world_size") or 0),
                nodes=tuple(rank_nodes), per_rank=per_rank, job_id=outcome.submission_id,
                job_status=outcome.status, stage=res.get("stage"),
                timings=dict(res.get("stage_s") or {}), versions=dict(res.get("versions") or {}),
                logs_tail=outcome.logs_tail, dashboard_url=dashboard_url)

    if not res.get("ok"):
        why = _failure_reason(outcome, res, problems)
        if why and why not in problems:
            problems.insert(0, why)
        nccl = _parse_rank_logs(raw_ranks) if options.backend == "nccl" else None
        named = f" ({', '.join(failed)})" if failed else ""
        lead = problems[0] if problems else "the all-reduce did not complete"
        verdict = f"FAIL{named}: {lead}"
        if len(problems) > 1:
            verdict += f" (+{len(problems) - 1} more)"
        return NcclCheckResult(**base, busbw_gbps=None, algbw_gbps=None, expected=expected,
                               bandwidth_ratio=None,
                               transport=(nccl or {}).get("inter_node_transport"),
                               gdr=(nccl or {}).get("gdr"), nccl=nccl, status=Status.FAIL,
                               verdict=verdict, problems=tuple(problems), notes=tuple(notes),
                               failed_nodes=tuple(failed))

    world = len(per_rank)
    algbw, busbw = _number(res.get("algbw_gbps")), _number(res.get("busbw_gbps"))
    statuses = [Status.OK]
    parts: list[str] = []
    transport = gdr = None
    nccl = None
    multi_node = len(rank_nodes) > 1
    where = f"{len(rank_nodes)} node{'s' if len(rank_nodes) != 1 else ''}, {world} rank{'s' if world != 1 else ''}"
    size = f"{options.size:g} MiB"
    if options.backend == "nccl":
        nccl = _parse_rank_logs(raw_ranks)
        if nccl is None:
            statuses.append(Status.WARN)
            notes.append("no NCCL debug log came back from the ranks: transport not proven")
            parts.append("NCCL's transport could not be read (no debug log)")
        else:
            transport, gdr = nccl.get("inter_node_transport"), nccl.get("gdr")
            statuses.append(Status(nccl.get("status", "warn")))
            said = re.sub(r"^(?:OK|WARN|FAIL)\s*:\s*", "", str(nccl.get("verdict") or ""),
                          flags=re.IGNORECASE)
            parts.append(f"NCCL log: {said}")
    elif not multi_node:
        statuses.append(Status.WARN)
        parts.append("a single node: nothing crossed the network")
    ratio = None
    if busbw is not None and multi_node and options.backend == "nccl" and expected.gbps:
        ratio = round(busbw / expected.gbps, 3)
        if ratio < BANDWIDTH_WARN_FRACTION:
            statuses.append(Status.WARN)
            parts.insert(0, f"bus bandwidth {busbw:g} GB/s is {ratio:.0%} of the expected "
                            f"{expected.gbps:g} GB/s (< {BANDWIDTH_WARN_FRACTION:.0%})")
        else:
            parts.insert(0, f"{ratio:.0%} of the expected {expected.gbps:g} GB/s")
    elif options.backend == "nccl" and not multi_node:
        notes.append("one node: the bandwidth is NVLink/PCIe inside it, not the network")
    elif options.backend == "nccl":
        notes.append(f"no expected bandwidth: {expected.basis}")
    else:
        notes.append("gloo over TCP: no expected figure (the IB rate does not apply)")
    status = worst(statuses)
    measured = (f"all-reduce of {size} at {busbw:g} GB/s bus bandwidth ({algbw:g} GB/s algorithm)"
                if busbw is not None else f"all-reduce of {size} completed")
    verdict = f"{status.value.upper()}: {where}, {options.backend}: {measured}"
    if parts:
        verdict += "; " + "; ".join(parts)
    return NcclCheckResult(**base, busbw_gbps=busbw, algbw_gbps=algbw, expected=expected,
                           bandwidth_ratio=ratio, transport=transport if options.backend == "nccl"
                           else "TCP", gdr=gdr, nccl=nccl, status=status, verdict=verdict,
                           problems=tuple(problems), notes=tuple(notes), failed_nodes=())


def _failure_reason(outcome: JobOutcome, res: Mapping[str, Any], problems: Sequence[str]) -> str | None:
    """Why there is no complete result, when the entrypoint's problems do not say."""
    if outcome.errors and not outcome.submitted:
        return f"the job could not be submitted: {outcome.errors[0]}"
    if not res:
        if outcome.timed_out:
            return (f"the job did not finish within the timeout and was stopped "
                    f"(status {outcome.status})")
        last = [ln for ln in outcome.logs_tail.strip().splitlines() if ln.strip()][-1:]
        detail = f": {last[0][:300]}" if last else ""
        msg = f" ({outcome.message})" if outcome.message else ""
        return (f"the job ended {outcome.status or 'without a status'}{msg} "
                f"without a result{detail}")
    if outcome.timed_out and not problems:
        return "the job did not finish within the timeout and was stopped"
    return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _rank(raw: Mapping[str, Any]) -> RankResult:
    def num(key: str) -> float | None:
        return _number(raw.get(key))

    rank = raw.get("rank")
    pid = raw.get("pid")
    return RankResult(rank=int(rank) if isinstance(rank, int) else None,
                      node=raw.get("node"), hostname=raw.get("hostname"), ip=raw.get("ip"),
                      pid=int(pid) if isinstance(pid, int) else None,
                      gpu_ids=tuple(str(g) for g in raw.get("gpu_ids") or ()),
                      time_s=num("time_s"), algbw_gbps=num("algbw_gbps"),
                      busbw_gbps=num("busbw_gbps"), error=raw.get("error"), phase=raw.get("phase"))


def _ordered(names: set, order: Sequence[str]) -> list[str]:
    known = [n for n in order if n in names]
    return known + sorted(n for n in names if n not in known)


def rank_logs(raw_ranks: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], str]]:
    """(rank record, NCCL debug text) for every rank that sent its log back."""
    return [(r, r["nccl_log"]) for r in raw_ranks
            if isinstance(r.get("nccl_log"), str) and r["nccl_log"].strip()]


def _parse_rank_logs(raw_ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """All ranks' NCCL_DEBUG logs read as one cluster-wide log (hosts and ranks told apart by
    their envelopes), so GDR asymmetry between nodes shows. None when no log came back."""
    from cluster.inspection.checks.nccl import judged_logs

    logs = rank_logs(raw_ranks)
    return judged_logs(text for _rank_record, text in logs) if logs else None


def nodes_with_ranks(outcome: JobOutcome, default: Sequence[str]) -> list[str]:
    """The nodes the job's ranks ran on (in `default`'s order), else `default`."""
    ranks = (outcome.result or {}).get("ranks") or []
    names = _ordered({r.get("node") for r in ranks if isinstance(r, Mapping) and r.get("node")},
                     list(default))
    return names or list(default)
