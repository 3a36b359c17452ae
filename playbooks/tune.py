"""`cluster tune --name APP` as ordered steps.

gather (read-only: the app's deployed config from the dashboard, the API key it wants, its
endpoint) -> plan (pure: the values to sweep, from TuneSettings) -> [dry run stops here] ->
confirm (every value restarts the app's replicas) -> execute (cluster.tune.run_tune: redeploy,
warm up and bench per value, recommend, restore or apply) -> verify (the final config RUNNING,
inside run_tune) -> the plot.

Nothing is printed: the caller gets a TuneOutcome (the tune.json document) and an `on_event`
callback for progress lines; `on_secret` is told the API key before anything uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from cluster.errors import UsageError
from cluster.inventory import Inventory
from playbooks.outcome import Confirm, DocOutcome, OnEvent, ignore, lines_to
from cluster.tune import DeployedApp, TuneSettings


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


def run(inventory: Inventory, session, options: TuneOptions, confirm: Confirm,
        on_event: OnEvent = ignore, *, on_secret: Callable[[str], None] = lambda _: None,
        environ: Mapping[str, str] | None = None, out: TuneOutcome | None = None,
        client=None, bench: Callable[..., Any] | None = None) -> TuneOutcome:
    """Fills `out` (given by a caller that records a partial outcome on an error) and returns
    it. `client`: the dashboard (default DashboardClient); `bench`: see cluster.tune.run_tune;
    `environ`: where the API key is read (default os.environ)."""
    import os

    from cluster import deploy
    from cluster.tune import plot_tune, read_app, run_tune

    out = out if out is not None else TuneOutcome.start(options, "")
    if client is None:
        from cluster.dashboard_api import DashboardClient
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

    result = run_tune(settings, client, inventory, app, endpoint, lines_to(on_event), bench)
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
