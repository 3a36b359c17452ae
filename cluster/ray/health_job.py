"""The periodic node-health job: its config, its readings and their file, the gauges, and the
laptop side that starts it (`cluster up`) and reads it (`cluster status`).

After `cluster up`, one Ray job (cluster/ray_jobs/health_runner.py, shipped with this package
as its runtime_env `py_modules`) re-reads the cheap facts of every Ray node every
`health.period_s` seconds: one reader actor per node runs the preflight probes and verdicts of
HEALTH_CHECKS there (cluster/inspection/checks/*, thresholds from the inventory's expectations). Each
reading becomes two Ray metrics gauges, tagged node and check (`gauge_points`), and the latest
readings are kept on the head in `<ray temp dir>/session_<current>/cluster-health.json`
(`readings_document`, replaced atomically), which `cluster status` reads over SSH.

Pure: JobConfig, Reading (from a preflight CheckResult), gauge_points, the file format
(`readings_document` / `parse_readings`) and `health_doc` (readings + the head's clock -> the
`health` key of `cluster status --json`). Impure: `ensure_job` (start or keep the job, one SSH
command on the head running ray_jobs/health_submit.py) and `read_health` (ray_jobs/
health_readings.py on the head); both are node programs, run and read by the one runner
(cluster/node_programs/__init__.py).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import math
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from cluster.base.bounds import reply_number
from cluster.nodes.endpoints import head_dashboard_base, ray_temp_dir
from cluster.base.errors import InventoryError, ParseError
from cluster.nodes.inventory import (ActPolicy, Inventory, Node, RayOptions, SSHOptions,
                                     default_act_policy, health_period_bounds)
from cluster.base.results import CheckResult, Status, Record
from cluster.inspection.node_summary import NodeFactsSummary

HEALTH_CHECKS = ("gpus", "clock", "infiniband", "gpudirect", "gpu-health")
STATUS_CODES = {"ok": 0, "warn": 1, "fail": 2, "unknown": 3}
GAUGE_STATUS = "cluster_health_status"       # Prometheus: ray_cluster_health_status
GAUGE_VALUE = "cluster_health_value"         # Prometheus: ray_cluster_health_value
GAUGE_TAGS = ("node", "check")
METADATA_KEY = "cluster-toolkit"
METADATA_VALUE = "health"
SUBMISSION_PREFIX = "cluster-health-"
READINGS_FILE = "cluster-health.json"
FORMAT_VERSION = 1
MAX_NODES = 4096
MAX_SUMMARY = 300
MAX_FILE_BYTES = 8 << 20                     # readings of MAX_NODES nodes fit comfortably
PACKAGE_DIR = Path(__file__).resolve().parents[1]
SUBMIT_TIMEOUT_S = 240.0       # the program retries for up to 2 x 60 s, then waits 30 s
READ_TIMEOUT_S = 30.0
SUBMIT_PROGRAM = "health_submit"             # cluster/ray_jobs/health_submit.py, on the head
READ_PROGRAM = "health_readings"             # cluster/ray_jobs/health_readings.py, on the head
READ_MAX_BYTES = 2 * MAX_FILE_BYTES + 4096   # the file's text as one JSON string


# ---------------------------------------------------------------- statuses and values


def status_word(status: Status | str) -> str:
    """ok / warn / fail, anything else (skip, error) is unknown."""
    value = status.value if isinstance(status, Status) else str(status)
    return value if value in ("ok", "warn", "fail") else "unknown"


def check_value(check: str, result: CheckResult, facts: NodeFactsSummary) -> float | None:
    """The number a check's reading shows: GPUs, clock offset (s), IB ports Active, peer memory
    loaded (1/0), GPU-health problems; None when the check could not say."""
    if result.status in (Status.SKIP, Status.ERROR):
        return None
    if check == "gpus":
        return reply_number(facts.gpu_count)
    if check == "clock":
        return reply_number(facts.clock_offset_s)
    if check == "infiniband":
        return None if facts.ib_ports is None else float(len(facts.active_ib_ports))
    if check == "gpudirect":
        loaded = facts.peermem_loaded
        return None if loaded is None else float(bool(loaded and facts.peermem_registered))
    if check == "gpu-health":
        data = result.evidence.data if result.evidence is not None else None
        if not isinstance(data, Mapping):
            return 0.0
        return float(len(data.get("fail") or ()) + len(data.get("warn") or ()))
    return None


@dataclass(frozen=True)
class Reading:
    """One check on one node at one time (seconds since the epoch, the head's clock)."""

    node: str
    check: str
    status: str           # ok | warn | fail | unknown
    value: float | None
    summary: str
    time: float
    findings: tuple[tuple[str, str], ...] = ()    # (finding class, evidence line): health_act

    def __post_init__(self) -> None:
        if self.status not in STATUS_CODES:
            raise ParseError("health readings", f"unknown status {self.status!r}")
        if reply_number(self.time) is None or (self.value is not None
                                               and reply_number(self.value) is None):
            raise ParseError("health readings", "a time or value is not a finite number")

    def to_dict(self) -> dict[str, Any]:
        out = {"status": self.status, "value": self.value, "summary": self.summary,
               "time": round(self.time, 3)}
        if self.findings:
            out["findings"] = [list(f) for f in self.findings]
        return out


def finding_lines(check: str, result: CheckResult, value: float | None,
                  expect: Mapping[str, Any], ecc_xids: Iterable[int],
                  facts: NodeFactsSummary = NodeFactsSummary()) -> tuple[tuple[str, str], ...]:
    """The health.act finding classes a check's result shows, each with its evidence line:
    gpu-health's failing Xids (ecc_uncorrectable for `ecc_xids`, else gpu_lost) and its ECC /
    remap lines; fewer GPUs than expected (gpu_missing); a failed IB check that shows a port not
    Active or could not list the expected ports (ib_port_down: not one whose ports are all Active
    and fails for their rate or link layer); a failed clock check (clock_offset). Pure."""
    if result.status != Status.FAIL:
        return ()
    line = result.summary[:MAX_SUMMARY]
    if check == "gpus":
        want = expect.get("gpus_per_node")
        if isinstance(want, int) and value is not None and value < want:
            return (("gpu_missing", line),)
        return ()
    if check == "clock":
        return (("clock_offset", line),)
    if check == "infiniband":
        ports = facts.ib_ports
        return (("ib_port_down", line),) if ports is None or not all(p.active for p in ports) \
            else ()
    if check != "gpu-health" or result.evidence is None or not isinstance(result.evidence.data,
                                                                            Mapping):
        return ()
    data, ecc, out = result.evidence.data, set(ecc_xids), {}
    for x in data.get("xids") or ():
        cls = "ecc_uncorrectable" if x.get("xid") in ecc else "gpu_lost"
        out.setdefault(cls, str(x.get("text"))[:MAX_SUMMARY])
    if data.get("gpu_fail"):
        out.setdefault("ecc_uncorrectable", str(data["gpu_fail"][0])[:MAX_SUMMARY])
    return tuple(sorted(out.items()))


def readings_from_results(node: str, results: Iterable[CheckResult], facts: NodeFactsSummary,
                          now: float, expect: Mapping[str, Any] | None = None,
                          ecc_xids: Iterable[int] = ()) -> tuple[Reading, ...]:
    """A node's preflight results of HEALTH_CHECKS (cluster.inspection.preflight.evaluate_node)
    -> readings, each with the finding classes it shows (finding_lines)."""
    out = []
    for r in results:
        if r.check in HEALTH_CHECKS:
            value = check_value(r.check, r, facts)
            out.append(Reading(node, r.check, status_word(r.status), value,
                               r.summary[:MAX_SUMMARY], now,
                               finding_lines(r.check, r, value, expect or {}, ecc_xids, facts)))
    return tuple(out)


def unknown_readings(node: str, why: str, now: float,
                     checks: Sequence[str] = HEALTH_CHECKS) -> tuple[Reading, ...]:
    """Every check of a node unknown, with the reason (its reader died, it left Ray...)."""
    return tuple(Reading(node, c, "unknown", None, why[:MAX_SUMMARY], now) for c in checks)


def gauge_points(readings: Iterable[Reading]) -> list[tuple[str, float, dict[str, str]]]:
    """(gauge name, value, tags) per reading: the status code always, the value when known."""
    points = []
    for r in readings:
        tags = {"node": r.node, "check": r.check}
        points.append((GAUGE_STATUS, float(STATUS_CODES[r.status]), tags))
        if r.value is not None:
            points.append((GAUGE_VALUE, float(r.value), dict(tags)))
    return points


# ---------------------------------------------------------------- the readings file


def readings_document(readings: Mapping[str, Mapping[str, Reading]], meta: Mapping[str, Any],
                      written: float) -> dict[str, Any]:
    """{node: {check: Reading}} -> the file's JSON document (bounded: MAX_NODES nodes)."""
    nodes = {}
    for name in sorted(readings)[:MAX_NODES]:
        nodes[name] = {c: r.to_dict() for c, r in sorted(readings[name].items())}
    return {"version": FORMAT_VERSION, "written": round(written, 3), **dict(meta), "nodes": nodes}


@dataclass(frozen=True)
class Snapshot:
    """What the readings file held: the job's settings and each node's latest readings."""

    written: float
    period_s: float | None
    submission_id: str | None
    readings: Mapping[str, Mapping[str, Reading]] = field(default_factory=dict)


def parse_readings(text: str) -> Snapshot:
    """The readings file -> Snapshot; ParseError on anything else (never a guess)."""
    if len(text) > MAX_FILE_BYTES:
        raise ParseError("health readings", f"larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ParseError("health readings", f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise ParseError("health readings", "not a version-1 health readings document")
    nodes = doc.get("nodes")
    written = reply_number(doc.get("written"))
    if not isinstance(nodes, dict) or written is None or len(nodes) > MAX_NODES:
        raise ParseError("health readings", "no nodes or no time of writing")
    readings: dict[str, dict[str, Reading]] = {}
    for name, checks in nodes.items():
        if not isinstance(checks, dict):
            raise ParseError("health readings", f"node {str(name)[:60]!r}: not a mapping")
        readings[str(name)] = {str(c): _reading(str(name), str(c), raw) for c, raw in checks.items()}
    lo, hi = health_period_bounds()
    period = reply_number(doc.get("period_s"), lo=lo, hi=hi)    # out of range: not reported
    sid = doc.get("submission_id")
    return Snapshot(written, period, sid if isinstance(sid, str) else None, readings)


def _reading(node: str, check: str, raw: Any) -> Reading:
    if not isinstance(raw, dict) or not isinstance(raw.get("summary", ""), str):
        raise ParseError("health readings", f"{node} {check}: not a reading")
    value = raw.get("value")
    if value is not None and reply_number(value) is None:
        raise ParseError("health readings", f"{node} {check}: value {value!r} is not a number")
    found = raw.get("findings") or []
    if not isinstance(found, list) or not all(
            isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f)
            for f in found):
        raise ParseError("health readings", f"{node} {check}: findings are not [class, line] pairs")
    return Reading(node, check, str(raw.get("status")), None if value is None else float(value),
                   raw.get("summary", "")[:MAX_SUMMARY], reply_number(raw.get("time")) or math.nan,
                   tuple((c[:40], line[:MAX_SUMMARY]) for c, line in found[:16]))


def health_doc(snapshot: Snapshot, now: float) -> dict[str, dict[str, dict[str, Any]]]:
    """`cluster status --json`'s `health`: {node: {check: {status, value, age_s, summary}}}.
    Ages are from the head's clock, as the readings' times are (a clock in the future is 0)."""
    return {node: {c: {"status": r.status, "value": r.value,
                       "age_s": round(max(0.0, now - r.time), 1), "summary": r.summary}
                   for c, r in checks.items()}
            for node, checks in snapshot.readings.items()}


# ---------------------------------------------------------------- the job's config


@dataclass(frozen=True)
class JobConfig:
    """What the job needs to judge every node as preflight does (no secret: no env, no SSH)."""

    period_s: float
    expectations: Mapping[str, Any]
    nodes: Mapping[str, Mapping[str, Any]]    # name -> {"ip", "role", "ib_hcas"}
    temp_dir: str
    act: ActPolicy = field(default_factory=default_act_policy)   # health.act
    dashboard: str = ""                      # the head's dashboard as the head reaches it

    def to_dict(self) -> dict[str, Any]:
        return {"period_s": self.period_s, "expectations": dict(self.expectations),
                "nodes": {k: dict(v) for k, v in self.nodes.items()}, "temp_dir": self.temp_dir,
                "act": self.act.to_dict(), "dashboard": self.dashboard}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "JobConfig":
        lo, hi = health_period_bounds()
        period = reply_number(raw.get("period_s"), lo=lo, hi=hi)
        if period is None:
            raise ParseError("health job config", f"period_s {raw.get('period_s')!r} out of range")
        nodes = raw.get("nodes")
        if not isinstance(nodes, dict) or not isinstance(raw.get("expectations"), dict) \
                or not isinstance(raw.get("temp_dir"), str):
            raise ParseError("health job config", "nodes, expectations or temp_dir missing")
        try:
            act = ActPolicy.from_dict(raw.get("act") or {})
        except InventoryError as exc:
            raise ParseError("health job config", f"act: {exc}") from None
        dashboard = raw.get("dashboard") or ""
        if not isinstance(dashboard, str) or not (dashboard == ""
                                                  or dashboard.startswith("http://")):
            raise ParseError("health job config", "dashboard is not an http:// URL")
        return cls(period, raw["expectations"], nodes, raw["temp_dir"], act, dashboard)

    @property
    def head(self) -> str | None:
        return next((name for name, n in self.nodes.items() if n.get("role") == "head"), None)

    def inventory(self) -> Inventory:
        """An Inventory of the nodes as far as the checks read it (name, IP, role, HCAs)."""
        nodes = tuple(Node(name=name, address=str(n.get("ip")), role=str(n.get("role", "worker")),
                           node_ip=str(n.get("ip")), ib_hcas=tuple(n.get("ib_hcas") or ()))
                      for name, n in self.nodes.items())
        return Inventory(path="<health job>", nodes=nodes, ssh=SSHOptions(), ray=RayOptions(),
                         expectations=self.expectations)

    def node(self, name: str) -> Node:
        """The inventory node, or one with no HCA for a Ray node the inventory does not name."""
        for n in self.inventory().nodes:
            if n.name == name:
                return n
        return Node(name=name, address=name)


def job_config(inventory: Inventory) -> JobConfig:
    return JobConfig(period_s=inventory.health.period_s,
                     expectations=json.loads(json.dumps(dict(inventory.expectations))),
                     nodes={n.name: {"ip": n.ip, "role": n.role, "ib_hcas": list(n.ib_hcas)}
                            for n in inventory.nodes},
                     temp_dir=ray_temp_dir(inventory), act=inventory.health.act,
                     dashboard=head_dashboard_base(inventory))


def readings_path(temp_dir: str) -> str:
    """The readings of the current Ray session on the head (a restarted Ray starts afresh)."""
    return f"{temp_dir.rstrip('/')}/session_latest/{READINGS_FILE}"


# ---------------------------------------------------------------- shipping the package


def package_archive(root: Path = PACKAGE_DIR) -> bytes:
    """The `cluster` package as a reproducible tar.gz (sources and data files, no caches)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:     # no time stamp: the same bytes
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root.parent)
            if "__pycache__" in rel.parts or not path.is_file() or path.suffix in (".pyc", ".pyo"):
                continue
            info = tarfile.TarInfo(str(rel))
            data = path.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def code_digest(archive: bytes, config: JobConfig) -> str:
    """Names what a job runs: the same code and config keep the running job."""
    h = hashlib.sha256(archive)
    h.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- start / keep the job (`up`)


@dataclass(frozen=True)
class JobStep(Record):
    """What `ensure_job` did: ok (kept), changed (submitted, stopped an outdated one), failed."""

    status: str
    submission_id: str | None
    message: str
    stopped: tuple[str, ...] = ()


def submit_request(inventory: Inventory, action: str, archive: bytes | None = None) -> str:
    """The input of ray_jobs/health_submit.py: one JSON request line (no secret)."""

    config = job_config(inventory)
    request: dict[str, Any] = {"action": action, "dashboard": head_dashboard_base(inventory),
                               "metadata_key": METADATA_KEY, "metadata_value": METADATA_VALUE}
    if action == "ensure":
        archive = archive if archive is not None else package_archive()
        request.update(python=inventory.ray.python, config=config.to_dict(),
                       digest=code_digest(archive, config),
                       submission_prefix=SUBMISSION_PREFIX,
                       package_b64=base64.b64encode(archive).decode())
    return json.dumps(request, separators=(",", ":")) + "\n"


def submit_call(inventory: Inventory, action: str = "ensure", archive: bytes | None = None):
    """The head's command (with the Ray client env) and stdin (the program, then the request)."""
    from cluster.node_programs import program_call
    from cluster.ray.ray_state import head_client_env

    return program_call(inventory.ray.python, SUBMIT_PROGRAM,
                        stdin=submit_request(inventory, action, archive),
                        env_prefix=head_client_env(inventory))


def step_from_reply(reply: Mapping[str, Any]) -> JobStep:
    """The program's reply -> JobStep."""
    stopped = tuple(str(s) for s in reply.get("stopped") or ())
    sid = reply.get("submission_id")
    sid = sid if isinstance(sid, str) else None
    if reply.get("error"):
        return JobStep("failed", sid, str(reply["error"])[:500], stopped)
    if reply.get("action") == "kept":
        return JobStep("ok", sid, f"health job {sid} running (kept)", stopped)
    state = reply.get("job_status") or "submitted"
    return JobStep("changed", sid, f"health job {sid} started ({state})", stopped)


def ensure_job(session: Any, inventory: Inventory) -> JobStep:
    """Start the health job, or keep the one running with this code and config (idempotent)."""
    from cluster.base.errors import ProgramError
    from cluster.node_programs import failure, read_document, run_call

    if not inventory.health.enabled:
        return JobStep("ok", None, "health job disabled (health.enabled: false)")
    head = inventory.head
    result = run_call(session, head, submit_call(inventory), timeout=SUBMIT_TIMEOUT_S)
    try:
        return read_document(result, SUBMIT_PROGRAM, parse=step_from_reply)
    except ProgramError as exc:
        return JobStep("failed", None, "the health job program gave no result: "
                                       + failure(exc, f"head {head.name}")[:300])


# ---------------------------------------------------------------- read the readings (`status`)


ACTIONS_FILE = "cluster-health-actions.json"   # health.act's records, next to the readings
ACTIONS_VERSION = 1
STATUS_RECORDS = 50                              # records `cluster status` shows, the latest


def read_args(inventory: Inventory, actions: bool = False) -> list[str]:
    """ray_jobs/health_readings.py's arguments: the readings file, the most it reads (and the
    actions file beside it)."""
    path = readings_path(ray_temp_dir(inventory))
    extra = [path.rsplit("/", 1)[0] + "/" + ACTIONS_FILE] if actions else []
    return [path, str(MAX_FILE_BYTES)] + extra


def parse_read_reply(doc: Mapping[str, Any]) -> tuple[float, str | None]:
    """health_readings.py's document -> (the head's time, the file's text or None)."""
    return parse_read_reply_with_actions(doc)[:2]


def parse_read_reply_with_actions(doc: Mapping[str, Any]
                                  ) -> tuple[float, str | None, str | None]:
    """... and the actions file's text (None: not written, no action file asked or readable)."""
    now, text, error = reply_number(doc.get("now")), doc.get("text"), doc.get("error")
    if now is None:
        raise ParseError("health readings", "the head printed no time")
    if error:
        raise ParseError("health readings", f"cannot read the file: {str(error)[:300]}")
    if text is not None and not isinstance(text, str):
        raise ParseError("health readings", "the file's text is not text")
    actions = doc.get("actions_text")
    if doc.get("actions_error"):
        raise ParseError("health actions", f"cannot read the file: "
                                           f"{str(doc['actions_error'])[:300]}")
    if actions is not None and not isinstance(actions, str):
        raise ParseError("health actions", "the file's text is not text")
    return now, text, actions


@dataclass(frozen=True)
class HealthStatus:
    """What `status` shows of the health job: `nodes` is status --json's `health` (None when it
    could not be read, `error` says why), `period_s` the period the running job reports."""

    nodes: dict | None
    period_s: float | None = None
    error: str | None = None
    actions: dict | None = None     # health.act: {"cordoned": {node: ...}, "records": [...]}


def read_health(session: Any, inventory: Inventory) -> HealthStatus:
    """The health job's latest readings on the head, as `status` shows them."""
    from cluster.base.errors import ProgramError
    from cluster.node_programs import failure, run_program

    head = inventory.head
    try:
        now, text, actions_text = run_program(
            session, head, READ_PROGRAM, read_args(inventory, actions=True),
            timeout=READ_TIMEOUT_S, python=inventory.ray.python,
            max_bytes=2 * READ_MAX_BYTES, parse=parse_read_reply_with_actions)
    except ProgramError as exc:
        return HealthStatus(None, error="health: " + (exc.reason if exc.kind == "bad-answer"
                                                      else failure(exc, f"head {head.name}")))
    try:
        actions = actions_doc(actions_text)
    except ParseError as exc:
        return HealthStatus(None, error=f"health: {exc}")
    if text is None or not text.strip():   # no reading yet (the job starts with `cluster up`)
        return HealthStatus({}, actions=actions)
    try:
        snapshot = parse_readings(text)
    except ParseError as exc:
        return HealthStatus(None, error=f"health: {exc}", actions=actions)
    return HealthStatus(health_doc(snapshot, now), snapshot.period_s, actions=actions)


def actions_doc(text: str | None) -> dict[str, Any]:
    """`cluster status --json`'s `health_actions`: the nodes the job cordoned now and its latest
    STATUS_RECORDS records ({"cordoned": {}, "records": []} before any)."""
    if text is None or not text.strip():
        return {"cordoned": {}, "records": []}
    if len(text) > MAX_FILE_BYTES:
        raise ParseError("health actions", f"larger than {MAX_FILE_BYTES} bytes")
    return parse_actions(text, STATUS_RECORDS)


def parse_actions(text: str, max_records: int = 10000) -> dict[str, Any]:
    """The actions file (cluster/ray/health_act.actions_document) -> {"cordoned": {...},
    "records": [the latest max_records]}; ParseError on anything else."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ParseError("health actions", f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != ACTIONS_VERSION \
            or not isinstance(doc.get("records"), list) or not isinstance(doc.get("cordoned"), dict):
        raise ParseError("health actions", "not a version-1 health actions document")
    records = [r for r in doc["records"][-max_records:] if isinstance(r, dict)]
    return {"cordoned": doc["cordoned"], "records": records}
