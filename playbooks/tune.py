"""`cluster tune --name APP` as ordered steps.

gather (read-only: the app's deployed config from the dashboard, the API key it wants, its
endpoint) -> plan (pure: the values to sweep, from TuneSettings) -> [dry run stops here] ->
confirm (every value restarts the app's replicas) -> execute (run_tune below: redeploy, wait
RUNNING (playbooks/serve_wait.py), warm up and bench per value, recommend (cluster/serving/tune.py, pure),
restore or apply) -> verify (the final config RUNNING, inside run_tune) -> the plot.

Nothing is printed: the caller gets a TuneOutcome (the tune.json document) and an `on_event`
callback for progress lines; `on_secret` is told the API key before anything uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from cluster.base.errors import UsageError
from cluster.nodes.inventory import Inventory
from cluster.nodes.remote import Session
from playbooks.outcome import Confirm, DocOutcome, OnEvent, ignore, lines_to
from cluster.serving.tune import (DEPLOY_FAILED, OK, Applied, DeployedApp, TunePoint, TuneResult,
                          TuneSettings, fmt_value, config_with, engine_kwargs_of, point_from_level,
                          recommend)


@dataclass(frozen=True)
class TuneOptions:
    settings: TuneSettings
    out_dir: Path                          # where tune.json and tune.png go
    api_key_env: str | None = None         # --api-key-env (default: the app's own)
    dry_run: bool = False


class TuneOutcome(DocOutcome):
    """tune.json's fields as they are learned."""

    @classmethod
    def start(cls, options: TuneOptions, run_dir: str) -> "TuneOutcome":
        return cls({**options.settings.to_dict(), "status": None, "run_dir": run_dir,
                    "dry_run": options.dry_run})


def api_key(app: DeployedApp, variable: str | None,
            environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(value, variable name) of the API key the app wants; usage error when it is unset."""
    name = variable or app.api_key_env
    if not name:
        return None, None
    value = environ.get(name)
    if not value:
        raise UsageError(f"application {app.name!r} wants an API key: export {name} here with "
                         f"the value the nodes have (or name another variable with "
                         f"--api-key-env)")
    return value, name


def confirm_question(settings: TuneSettings) -> str:
    return (f"Tune redeploys {settings.name!r} {len(settings.values)} time(s) "
            f"({settings.param} = {', '.join(map(str, settings.values))}) and then "
            f"{'restores the original' if settings.apply == 'original' else 'applies the best'}"
            f" config; every redeploy restarts its replicas (requests in flight fail, "
            f"the endpoint is down while vLLM starts). Go on?")


def run(inventory: Inventory, session: Session, options: TuneOptions, confirm: Confirm,
        on_event: OnEvent = ignore, *, on_secret: Callable[[str], None] = lambda _: None,
        environ: Mapping[str, str] | None = None, out: TuneOutcome | None = None,
        client=None, bench: Callable[..., Any] | None = None) -> TuneOutcome:
    """Fills `out` (given by a caller that records a partial outcome on an error) and returns
    it. `client`: the dashboard (default DashboardClient); `bench`: see run_tune;
    `environ`: where the API key is read (default os.environ)."""
    import os

    from cluster.serving import deploy
    from cluster.serving.tune import plot_tune, read_app

    out = out if out is not None else TuneOutcome.start(options, "")
    if client is None:
        from cluster.ray.dashboard_api import DashboardClient
        client = DashboardClient(session, inventory)
    doc = out.doc

    app = read_app(client, options.settings.name)
    key, key_env = api_key(app, options.api_key_env, os.environ if environ is None else environ)
    if key:
        on_secret(key)
    settings = replace(options.settings, api_key=key)
    endpoint = deploy.endpoint_url(inventory, app.route_prefix, app.serve_port)
    original = (app.config.get("args") or {}).get("engine_kwargs", {}).get(settings.param)
    doc.update(endpoint=endpoint, model=app.model, original_value=original,
               app_status=app.status, api_key_env=key_env)
    if options.dry_run:
        doc["status"] = "DRY_RUN"
        out.exit_code = 0
        return out
    if not confirm(confirm_question(settings)):
        doc["status"] = "CANCELLED"
        return out

    def explain(state, config: Mapping[str, Any], reason: str) -> str:
        """A failed value's reason with what its engine core died of (the replicas' log tails)."""
        return deploy.with_engine_error(reason, deploy.collect_log_tails(session, inventory, state),
                                        config)

    result = run_tune(settings, client, inventory, app, endpoint, lines_to(on_event), bench,
                      explain)
    doc.update(result.to_dict())
    out.exit_code = result.exit_code
    doc["status"] = "DONE"
    doc["json_path"] = str(options.out_dir / "tune.json")
    try:
        doc["plot_path"] = str(plot_tune(result, options.out_dir / "tune.png"))
    except ImportError as exc:
        doc["plot_path"] = None
        doc["warnings"] = doc.get("warnings", []) + [
            f"plot not drawn (matplotlib missing: {exc})"]
    return out


# ---------------------------------------------------------------- the sweep


# (Serve's state of the app that failed, its config, the one-line reason) -> the reason told.
Explain = Callable[[Any, Mapping[str, Any], str], str]


def _as_is(state, config: Mapping[str, Any], reason: str) -> str:
    return reason


def _deploy_and_wait(client, inventory, config: Mapping[str, Any], timeout_s: float,
                     say: Callable[[str], None], explain: Explain = _as_is
                     ) -> tuple[bool, float, str | None, str | None]:
    """(RUNNING?, seconds, final status, error)."""
    from cluster.serving import deploy
    from playbooks.serve_wait import wait_for_app

    start = time.monotonic()
    applied = deploy.deploy_app(client, config, inventory)
    if not applied.ok:
        return False, time.monotonic() - start, None, applied.error
    previous = (applied.previous or {}).get("last_deployed_time_s")
    outcome = wait_for_app(client, config["name"], timeout_s, previous_time=previous,
                           on_event=say)
    status = outcome.state.status if outcome.state else None
    if outcome.running:
        return True, time.monotonic() - start, status, None
    return False, time.monotonic() - start, status, explain(
        outcome.state, config, deploy.failure_reason(outcome, timeout_s))


def _bench(settings: TuneSettings, endpoint: str, model: str, requests: int, output_len: int):
    from cluster.serving.bench import BenchConfig, run_bench

    config = BenchConfig(url=endpoint, model=model, concurrency=(settings.concurrency,),
                         prompt_len=settings.prompt_len, output_len=output_len,
                         requests=requests, timeout_s=settings.request_timeout_s,
                         api_key=settings.api_key)
    return run_bench(config).levels[0]


def run_tune(settings: TuneSettings, client, inventory, app: DeployedApp, endpoint: str,
             say: Callable[[str], None] = lambda _: None,
             bench: Callable[..., Any] | None = None, explain: Explain = _as_is) -> TuneResult:
    """Sweep, recommend, then restore or apply. Deploys through `client` (DashboardClient);
    benches `endpoint` from here with `bench(settings, endpoint, model, requests, output_len)
    -> LevelResult` (default: cluster.serving.bench at the fixed concurrency); a value that does
    not come up RUNNING is told with `explain` (run: what its engine core died of). An exception
    or interrupt mid-sweep restores the original config (best effort) and is re-raised."""
    bench = bench or _bench
    original = dict(app.config)
    original_value = engine_kwargs_of(original).get(settings.param)
    current = original
    points: list[TunePoint] = []
    warnings: list[str] = []
    finished = False
    try:
        for i, value in enumerate(settings.values, start=1):
            target = config_with(original, settings.param, value)
            say(f"[{i}/{len(settings.values)}] {settings.param}={fmt_value(value)}: deploying")
            deploy_s = 0.0
            if target != current:
                running, deploy_s, status, error = _deploy_and_wait(
                    client, inventory, target, settings.deploy_timeout_s, say, explain)
                current = target
                if not running:
                    say(f"{settings.param}={fmt_value(value)}: not RUNNING ({error})")
                    points.append(TunePoint(value, DEPLOY_FAILED, deploy_s=round(deploy_s, 1),
                                            error=error or f"status {status}"))
                    continue
            if settings.warmups:
                say(f"{settings.param}={fmt_value(value)}: warm-up ({settings.warmups} requests)")
                bench(settings, endpoint, app.model, settings.warmups,
                      min(settings.output_len, 16))
            say(f"{settings.param}={fmt_value(value)}: bench at concurrency {settings.concurrency} "
                f"({settings.bench_requests} requests)")
            level = bench(settings, endpoint, app.model, settings.bench_requests,
                          settings.output_len)
            point = point_from_level(value, level, round(deploy_s, 1))
            points.append(point)
            say(f"{settings.param}={fmt_value(value)}: {point.output_tokens_per_s or 0:.1f} output "
                f"tokens/s, TTFT p99 {point.ttft_p99_ms or 0:.0f} ms"
                + (f" ({point.error})" if point.error else ""))
        finished = True
    finally:
        if not finished:  # error or interrupt: put the original back before raising
            if current != original:
                say("sweep stopped: restoring the original config")
                _deploy_and_wait(client, inventory, original, settings.deploy_timeout_s, say)
    rec = recommend(points, settings.target_ttft_p99_ms, settings.close_pct)
    what = settings.apply
    if what == "best" and not rec.found:
        warnings.append("--apply best: no recommendation, the original config is restored")
        what = "original"
    final = original if what == "original" else config_with(original, settings.param, rec.value)
    final_value = engine_kwargs_of(final).get(settings.param)
    if final == current:
        applied = Applied(what, final_value, ok=True, redeployed=False, status="RUNNING")
    else:
        say(f"applying the {what} config ({settings.param}={fmt_value(final_value)})")
        running, _, status, error = _deploy_and_wait(client, inventory, final,
                                                     settings.deploy_timeout_s, say, explain)
        applied = Applied(what, final_value, ok=running, redeployed=True, status=status,
                          error=error)
        if not running:
            warnings.append(f"the {what} config is not RUNNING: {error}")
    for p in points:
        if p.status == OK and p.bench and p.bench.get("short_outputs"):
            warnings.append(f"{settings.param}={fmt_value(p.value)}: {p.bench['short_outputs']} "
                            "short output(s): the server ignored ignore_eos/min_tokens")
    return TuneResult(settings, endpoint, app.model, original_value, tuple(points), rec,
                      applied, tuple(warnings))
