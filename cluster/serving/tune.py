"""Stepwise tuning of one deployed app: redeploy per value of an engine arg, bench, recommend.

`cluster tune` (docs/tune-status.md). For each value of one vLLM engine arg (default
max_num_batched_tokens 512/1024/2048/4096) the app's deployed config is redeployed with
`engine_kwargs[param] = value` through the dashboard (cluster.serving.deploy), waited RUNNING, warmed
up, and benched at one fixed concurrency (cluster.serving.bench). The recommendation is the value with
the best output tokens/s whose TTFT p99 meets the target (or none). Finally the original config
is restored, or the chosen one applied, as the admin says; an error or an interrupt mid-sweep
restores the original.

Pure part (tests/test_tune.py): parse_values, config_with, TunePoint, recommend, TuneResult.
Side-effecting part: read_app (the dashboard's GET). The sweep itself (deploy, wait, bench,
restore) is playbooks/tune.py's `run_tune`. Never prints.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from cluster.base.bounds import bound, check_float, check_int
from cluster.base.errors import ClusterError, UsageError
from cluster.base.results import Record
from cluster.base.textsafe import safe_line
from cluster.base.yamlfile import ValueTextError, parse_value

APPLY_CHOICES = ("original", "best")
SERVE_APPS_PREFIX = "serve_apps.vllm_app:"
OK, DEPLOY_FAILED, BENCH_FAILED, SKIPPED = "ok", "deploy_failed", "bench_failed", "skipped"


class TuneError(ClusterError):
    """The app cannot be tuned (absent, not a serve_apps app) or the sweep could not run."""


def tune_defaults() -> dict[str, Any]:
    """cluster/data/serving.yaml `tune:`."""
    from cluster.serving.serving_health import serving_data

    return dict(serving_data().get("tune") or {})


# ---------------------------------------------------------------- pure helpers


def parse_values(text: str) -> tuple[Any, ...]:
    """'512,1024,2048' -> (512, 1024, 2048): YAML scalars (ints, floats, true/false), distinct."""
    values: list[Any] = []
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if len(parts) > bound("tune", "values"):
        raise UsageError(f"--values: at most {bound('tune', 'values')} values (got {len(parts)})")
    for part in parts:
        if len(part) > bound("tune", "value_chars"):
            raise UsageError(f"--values: {part[:40]!r}... is longer than "
                             f"{bound('tune', 'value_chars')} characters")
        try:
            value = parse_value(part, "--values")
        except ValueTextError as exc:
            raise UsageError(f"--values: cannot read {part!r} ({exc})") from None
        if isinstance(value, (dict, list)) or value is None:
            raise UsageError(f"--values: {part!r} is not a scalar")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--values: {part!r} is not a finite number")
        if not isinstance(value, (str, int, float, bool)):
            raise UsageError(f"--values: {part!r} is not a number, a word or true/false")
        if value in values:
            raise UsageError(f"--values: {part!r} is given twice")
        values.append(value)
    if len(values) < 2:
        raise UsageError("--values: give at least two comma-separated values to compare")
    return tuple(values)


def engine_kwargs_of(app_config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(((app_config.get("args") or {}).get("engine_kwargs")) or {})


def config_with(app_config: Mapping[str, Any], param: str, value: Any) -> dict[str, Any]:
    """A deep copy of the app's deployed config with args.engine_kwargs[param] = value."""
    out = copy.deepcopy(dict(app_config))
    args = out.setdefault("args", {})
    kwargs = dict(args.get("engine_kwargs") or {})
    kwargs[param] = value
    args["engine_kwargs"] = kwargs
    return out


def check_tunable(app_config: Mapping[str, Any] | None, name: str) -> None:
    """Raise TuneError unless the app was deployed by `cluster deploy` (serve_apps.vllm_app)."""
    if app_config is None:
        raise TuneError(f"application {name!r} has no declarative config in Serve (deployed "
                        "with serve.run?): only apps deployed with `cluster deploy` can be tuned")
    path = str(app_config.get("import_path") or "")
    if not path.startswith(SERVE_APPS_PREFIX) or not isinstance(
            (app_config.get("args") or {}).get("engine_kwargs", {}), dict):
        raise TuneError(f"application {name!r} runs {path or 'an unknown import path'}: only "
                        f"apps of {SERVE_APPS_PREFIX}* (`cluster deploy`) can be tuned")
    if (app_config.get("args") or {}).get("dry_run"):
        raise TuneError(f"application {name!r} is deployed --placement-only (no engine): "
                        "nothing to bench")


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class TunePoint:
    """One swept value: how its deploy went and the bench at the fixed concurrency."""

    value: Any
    status: str                               # ok | deploy_failed | bench_failed | skipped
    output_tokens_per_s: float | None = None
    total_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    e2e_p99_ms: float | None = None
    requests: int = 0
    ok: int = 0
    errors: Mapping[str, int] = field(default_factory=dict)
    deploy_s: float | None = None
    error: str | None = None
    bench: Mapping[str, Any] | None = None    # the level's JSON (docs/bench.md levels[])

    @property
    def measured(self) -> bool:
        """Benched cleanly: every request succeeded and there is a TTFT."""
        return (self.status == OK and not self.errors and self.ok > 0
                and self.ttft_p99_ms is not None and self.output_tokens_per_s is not None)

    def meets(self, target_ttft_p99_ms: float | None) -> bool:
        if not self.measured:
            return False
        return target_ttft_p99_ms is None or self.ttft_p99_ms <= target_ttft_p99_ms

    def to_dict(self, target_ttft_p99_ms: float | None = None) -> dict[str, Any]:
        return {"value": self.value, "status": self.status,
                "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s,
                "requests_per_s": self.requests_per_s, "ttft_p50_ms": self.ttft_p50_ms,
                "ttft_p99_ms": self.ttft_p99_ms, "itl_p50_ms": self.itl_p50_ms,
                "e2e_p99_ms": self.e2e_p99_ms, "requests": self.requests, "ok": self.ok,
                "errors": dict(self.errors), "meets_target": self.meets(target_ttft_p99_ms),
                "deploy_s": self.deploy_s, "error": self.error,
                "bench": dict(self.bench) if self.bench is not None else None}


def point_from_level(value: Any, level: Any, deploy_s: float | None = None) -> TunePoint:
    """A bench LevelResult (cluster.serving.bench) -> TunePoint."""
    status = OK if level.ok > 0 and not level.failed else BENCH_FAILED
    error = None
    if status == BENCH_FAILED:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(level.errors.items()))
        error = f"{level.failed} of {level.requests} request(s) failed ({kinds})" if kinds \
            else "no request completed"
    r = lambda v: None if v is None else round(float(v), 3)  # noqa: E731
    return TunePoint(value=value, status=status,
                     output_tokens_per_s=r(level.output_tokens_per_s),
                     total_tokens_per_s=r(level.total_tokens_per_s),
                     requests_per_s=r(level.requests_per_s),
                     ttft_p50_ms=r(level.ttft_ms.p50), ttft_p99_ms=r(level.ttft_ms.p99),
                     itl_p50_ms=r(level.itl_ms.p50), e2e_p99_ms=r(level.e2e_ms.p99),
                     requests=level.requests, ok=level.ok, errors=dict(level.errors),
                     deploy_s=deploy_s, error=error, bench=level.to_dict())


@dataclass(frozen=True)
class Recommendation:
    """The chosen value (None: no value meets the target) and why."""

    value: Any
    reason: str
    meeting_target: tuple[Any, ...] = ()
    close_values: tuple[Any, ...] = ()        # meet the target within close_pct of the best
    best_unconstrained: Any = None            # the best throughput ignoring the target

    @property
    def found(self) -> bool:
        return self.value is not None

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "found": self.found, "reason": self.reason,
                "meeting_target": list(self.meeting_target),
                "close_values": list(self.close_values),
                "best_unconstrained": self.best_unconstrained}


def fmt_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def recommend(points: Sequence[TunePoint], target_ttft_p99_ms: float | None,
              close_pct: float = 10.0) -> Recommendation:
    """The value with the best output tokens/s among cleanly benched points whose TTFT p99
    meets the target (no target: any cleanly benched point). Ties: the lower TTFT p99, then
    the earlier value. Pure."""
    measured = [p for p in points if p.measured]
    if not measured:
        failed = [f"{fmt_value(p.value)}: {p.error or p.status}" for p in points if not p.measured]
        return Recommendation(None, "no value was benched cleanly (" + "; ".join(failed) + ")")
    order = {id(p): i for i, p in enumerate(points)}
    key = lambda p: (-p.output_tokens_per_s, p.ttft_p99_ms, order[id(p)])  # noqa: E731
    best_any = min(measured, key=key)
    meeting = [p for p in measured if p.meets(target_ttft_p99_ms)]
    if not meeting:
        fastest = min(measured, key=lambda p: (p.ttft_p99_ms, order[id(p)]))
        return Recommendation(
            None, f"no value meets TTFT p99 <= {target_ttft_p99_ms:g} ms (the lowest is "
                  f"{fastest.ttft_p99_ms:.0f} ms at {fmt_value(fastest.value)}): lower the load "
                  f"(--concurrency), relax the target or add replicas",
            best_unconstrained=best_any.value)
    best = min(meeting, key=key)
    floor = best.output_tokens_per_s * (1 - close_pct / 100.0)
    close = tuple(p.value for p in meeting if p is not best and p.output_tokens_per_s >= floor)
    target = (f" with TTFT p99 {best.ttft_p99_ms:.0f} ms <= {target_ttft_p99_ms:g} ms"
              if target_ttft_p99_ms is not None else f" (TTFT p99 {best.ttft_p99_ms:.0f} ms)")
    reason = f"best output tokens/s: {best.output_tokens_per_s:.1f}{target}"
    if close:
        reason += (f"; within {close_pct:g} % of it: {', '.join(map(fmt_value, close))} "
                   "(differences that small can be noise: rerun to confirm)")
    return Recommendation(best.value, reason, tuple(p.value for p in meeting), close,
                          best_any.value)


@dataclass(frozen=True)
class TuneSettings:
    """What to sweep and how to bench each value."""

    name: str
    param: str
    values: tuple[Any, ...]
    concurrency: int = 16
    target_ttft_p99_ms: float | None = None
    requests: int | None = None               # per value; None: max(4*C, 16)
    warmup_requests: int | None = None        # None: C
    prompt_len: int = 128
    output_len: int = 128
    apply: str = "original"
    deploy_timeout_s: float = 900.0
    request_timeout_s: float = 120.0
    close_pct: float = 10.0
    api_key: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.apply not in APPLY_CHOICES:
            raise UsageError(f"--apply must be one of {', '.join(APPLY_CHOICES)}")
        check_int(self.concurrency, "--concurrency", lo=1, hi=bound("bench", "concurrency"))
        if self.target_ttft_p99_ms is not None:
            check_float(self.target_ttft_p99_ms, "--target-ttft-p99", lo=0, lo_open=True,
                        hi=bound("tune", "target_ttft_p99_ms"))
        if self.requests is not None:
            check_int(self.requests, "--requests", lo=1, hi=bound("bench", "requests"))
        if self.warmup_requests is not None:
            check_int(self.warmup_requests, "--warmup", lo=0, hi=bound("bench", "requests"))
        check_int(self.prompt_len, "--prompt-len", lo=1, hi=bound("bench", "prompt_len"))
        check_int(self.output_len, "--output-len", lo=1, hi=bound("bench", "output_len"))
        check_float(self.deploy_timeout_s, "--timeout", lo=0, lo_open=True,
                    hi=bound("tune", "deploy_timeout_s"))
        check_float(self.request_timeout_s, "--request-timeout", lo=0, lo_open=True,
                    hi=bound("bench", "timeout_s"))
        check_float(self.close_pct, "close_pct", lo=0, hi=100)
        if len(self.values) < 2:
            raise UsageError("give at least two values to compare")
        from cluster.serving.deploy import check_engine_args

        try:
            check_engine_args({self.param: self.values[0]})
        except UsageError as exc:
            raise UsageError(str(exc).replace("--engine-arg", "--param")) from None

    @property
    def bench_requests(self) -> int:
        return self.requests if self.requests is not None else max(4 * self.concurrency, 16)

    @property
    def warmups(self) -> int:
        return self.warmup_requests if self.warmup_requests is not None else self.concurrency

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "param": self.param, "values": list(self.values),
                "concurrency": self.concurrency, "target_ttft_p99_ms": self.target_ttft_p99_ms,
                "requests": self.bench_requests, "warmup_requests": self.warmups,
                "prompt_len": self.prompt_len, "output_len": self.output_len,
                "apply": self.apply, "deploy_timeout_s": self.deploy_timeout_s,
                "request_timeout_s": self.request_timeout_s, "close_pct": self.close_pct}


@dataclass(frozen=True)
class Applied(Record):
    """The config left running at the end: original or best, and whether it is RUNNING."""

    what: str                                 # original | best
    value: Any                                # engine_kwargs[param] of it (None: not set)
    ok: bool
    redeployed: bool
    status: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class TuneResult:
    settings: TuneSettings
    endpoint: str
    model: str
    original_value: Any
    points: tuple[TunePoint, ...]
    recommendation: Recommendation
    applied: Applied | None
    warnings: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        """0 a recommendation, 1 none meets the target, 2 errors (nothing benched cleanly, or
        the final config not RUNNING)."""
        if self.applied is None or not self.applied.ok:
            return 2
        if self.recommendation.found:
            return 0
        return 1 if any(p.measured for p in self.points) else 2

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {**s.to_dict(), "endpoint": self.endpoint, "model": self.model,
                "original_value": self.original_value,
                "points": [p.to_dict(s.target_ttft_p99_ms) for p in self.points],
                "recommendation": self.recommendation.to_dict(),
                "applied": self.applied.to_dict() if self.applied else None,
                "warnings": list(self.warnings),
                "exit_code": self.exit_code}


def plot_tune(result: TuneResult, path: str | Path) -> Path:
    """Throughput and TTFT p99 (p50, the target) against the swept value, one PNG."""
    from cluster.serving.plots import plot_panels

    s = result.settings
    points = result.points
    numeric = all(isinstance(p.value, (int, float)) and not isinstance(p.value, bool)
                  for p in points)
    xs = [p.value for p in points] if numeric else list(range(len(points)))
    order = sorted(range(len(points)), key=lambda i: xs[i])
    xs = [xs[i] for i in order]
    pts = [points[i] for i in order]
    ok = lambda p, v: v if p.measured else None  # noqa: E731
    latency: dict[str, list[Any]] = {
        "TTFT p99": [ok(p, p.ttft_p99_ms) for p in pts],
        "TTFT p50": [ok(p, p.ttft_p50_ms) for p in pts]}
    if s.target_ttft_p99_ms is not None:
        latency["target p99"] = [s.target_ttft_p99_ms] * len(pts)
    log_x = numeric and min(xs) > 0 and max(xs) / min(xs) >= 4
    chosen = result.recommendation.value
    title = (f"{s.name}: {s.param} at concurrency {s.concurrency} - "
             + (f"recommended {fmt_value(chosen)}" if chosen is not None else "no value meets the target"))
    return plot_panels(xs, [
        ("throughput", "tokens/s", {"output tokens/s": [ok(p, p.output_tokens_per_s) for p in pts],
                                    "total tokens/s": [ok(p, p.total_tokens_per_s) for p in pts]}),
        ("time to first token", "ms", latency),
    ], s.param if numeric else f"{s.param} (index)", path, title, log_x=log_x)


# ---------------------------------------------------------------- the deployed app (read)


@dataclass(frozen=True)
class DeployedApp:
    """The app as Serve runs it: its declarative config (unredacted: it is sent back as is and
    never written out), route, status, the Serve port."""

    name: str
    config: Mapping[str, Any]
    route_prefix: str
    status: str
    serve_port: int | None

    @property
    def model(self) -> str:
        loading = (self.config.get("args") or {}).get("model_loading_config") or {}
        return str(loading.get("model_id") or "")

    @property
    def api_key_env(self) -> str | None:
        return (self.config.get("args") or {}).get("api_key_env")


def read_app(client, name: str) -> DeployedApp:
    """GET /api/serve/applications/ (env values kept: the config is redeployed as is)."""
    from cluster.ray.dashboard_api import SERVE_API

    reply = client.request("GET", SERVE_API, redact=False)
    if not reply.ok or not isinstance(reply.json, dict):
        raise TuneError(f"the dashboard did not list the Serve applications: {reply.describe()}")
    details = reply.json
    apps = details.get("applications") or {}
    if not isinstance(apps, dict):
        raise TuneError("the dashboard's Serve applications are not an object")
    app = apps.get(name)
    if app is None:
        names = ", ".join(sorted(safe_line(n, limit=80) for n in apps)[:50]) or "none"
        raise TuneError(f"no Serve application {name!r} (deployed: {names})")
    if not isinstance(app, dict):
        raise TuneError(f"the dashboard's entry for {name!r} is not an object")
    config = app.get("deployed_app_config")
    if app.get("source") not in (None, "declarative"):
        config = None
    if config is not None and not isinstance(config, dict):
        raise TuneError(f"the deployed config of {name!r} is not an object")
    check_tunable(config, name)
    return DeployedApp(name=name, config=config, route_prefix=_route_prefix(app.get("route_prefix")),
                       status=safe_line(app.get("status"), limit=40),
                       serve_port=_serve_port(details.get("http_options")))


def _route_prefix(value: Any) -> str:
    """The app's route prefix as the dashboard reports it: a path without control characters."""
    if value is None or value == "":
        return "/"
    if not isinstance(value, str) or not value.startswith("/") or safe_line(value) != value \
            or " " in value or len(value) > 200:
        raise TuneError(f"the dashboard reports route_prefix {safe_line(repr(value), limit=60)}: "
                        f"not a URL path")
    return value


def _serve_port(http_options: Any) -> int | None:
    """Serve's HTTP port from the dashboard's http_options: 1-65535, or None when absent."""
    port = http_options.get("port") if isinstance(http_options, dict) else None
    if port is None:
        return None
    return check_int(port, "the dashboard's http_options.port", lo=1, hi=65535, error=TuneError)
