"""`cluster deploy` as ordered steps.

gather (read-only: Ray's alive nodes and resources from the head, what Serve runs now) -> plan
(pure, cluster/serving/deploy.py: device, the Serve application, its placement, the config file; the
fabric proof's groups, cluster/planning/fabric_proof.py) -> checks on every node that may host a bundle
(the model files, the API-key variable: read-only) -> [dry run stops here, showing the groups
it would prove and the ports the layout opens between nodes, cluster/serving/ports.py; a dry
run with no head answering plans on the inventory and the latest preflight's facts instead and
lists what it could not check (doc "unchecked")] ->
the fabric proof (an all-reduce per group of the layout, the engine's backend, on its nodes and
ports; a failed proof refuses the deployment unless forced) ->
confirm (replacing a deployed app) -> [--stage-caches: this app's known compile-cache
directories staged to every node, playbooks/cache_stage.py] -> execute (the dashboard's PUT,
merged with the other apps on the head) -> verify (wait until the app is RUNNING; the replicas'
log tails when it is not) -> [--stage-caches: each replica's staged_cache read from its ranks'
lines, the directories they used staged to every node].

Nothing is printed: the caller gets a DeployOutcome (the deploy.json document) and an
`on_event` callback for progress lines; the Serve config is handed to `write_config`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from cluster.serving import deploy, rolling
from cluster.serving.deploy import DeploySpec
from cluster.base.errors import DeployError, UsageError
from cluster.nodes.inventory import Inventory
from cluster.nodes.remote import Session
from playbooks import cache_stage
from playbooks.outcome import Confirm, DocOutcome, OnEvent, ignore, lines_to, never_confirm
from playbooks.serve_wait import wait_for_app

LOG_TIMEOUT_S = 60               # the ranks' log lines, read once after RUNNING
ROLLBACK_TIMEOUT_S = 300         # a failed roll: the previous config back to RUNNING


@dataclass(frozen=True)
class DeployOptions:
    spec: DeploySpec
    timeout_s: float = deploy.DEFAULT_TIMEOUT_S
    dry_run: bool = False
    secrets: Sequence[str] = field(default=(), repr=False)  # a config holding one is refused
    verify: bool = True                 # run the fabric proof before engines start
    force: bool = False                 # deploy even when the proof fails (said in warnings)
    local_root: bool = False            # this process is root (the relay needs no sudo -n)
    max_unavailable: int = 1            # a roll replaces this many replicas (gangs) at a time
    replace: bool = False               # a change that renames the deployment: replace it whole
    rollback_timeout_s: float = ROLLBACK_TIMEOUT_S


class DeployOutcome(DocOutcome):
    """deploy.json's fields as they are learned."""

    @classmethod
    def start(cls, options: DeployOptions, run_dir: str) -> "DeployOutcome":
        spec = options.spec
        return cls({"name": spec.name, "served_model_name": spec.served_model_name,
                    "model": spec.model, "status": None, "endpoint": None,
                    "config_path": None, "run_dir": run_dir, "dry_run": options.dry_run,
                    "api_key_env": spec.api_key_env, "warnings": []})


def run(inventory: Inventory, session: Session, options: DeployOptions, confirm: Confirm,
        on_event: OnEvent = ignore, *, write_config: Callable[[str, str], Path] | None = None,
        out: DeployOutcome | None = None, client=None) -> DeployOutcome:
    """Fills `out` (given by a caller that records a partial outcome on an error) and returns
    it. `write_config(name, text)` stores the Serve config and returns its path (default: not
    stored); `client`: the dashboard (default DashboardClient)."""
    out = out if out is not None else DeployOutcome.start(options, "")
    out.exit_code = _deploy(inventory, session, options, confirm, lines_to(on_event),
                            write_config, out.doc, client)
    return out


def _replica_ranks(session: Session, inv, name: str) -> list[dict[str, Any]]:
    """The app's replicas with their ranks ([{rank, node, node_ip, pid, state}] each), read
    once more from the head (Serve details + the rank actors in Ray's state API)."""
    from cluster.ray.ray_state import query_state, serve_applications

    state, _ = query_state(session, inv, include_serve=True)
    apps = serve_applications(state.serve, state.rank_actors,
                              {n.node_id: n.ip for n in state.nodes or ()},
                              {n.ip: n.name for n in inv.nodes})
    return (apps.get(name) or {}).get("replicas") or []


def _deploy(inv, session: Session, options: DeployOptions, confirm, say, write_config,
            doc: dict[str, Any], client) -> int:
    """Prepare (config, checks), then apply and wait. Fills `doc`; returns the exit code."""
    from cluster.ray.ray_state import query_state

    spec = options.spec
    # 1. what Ray has: alive nodes and their resources -> device, config, placement (a dry run
    # with no head answering: the inventory and the latest preflight's facts instead)
    state, _ = query_state(session, inv, include_serve=False)
    headless = not state.answered
    if headless and not options.dry_run:
        raise DeployError("the head did not answer (is Ray up? `cluster status`): "
                          + "; ".join(state.errors[-2:]))
    if headless:
        cluster = _offline_cluster(inv, spec, doc, "; ".join(state.errors[-2:]))
    else:
        cluster = deploy.ClusterView.from_state(inv, state)
    device = cluster.resolve_device(spec.device)
    try:
        app, notes = deploy.build_application(spec, device, cluster, inv)
    except UsageError as exc:
        if headless and device == "cpu" and not inv.ray.num_cpus:
            raise UsageError(f"{exc} (no head answered: without Ray the CPUs per node come "
                             "from ray.num_cpus in the inventory)") from None
        raise
    preview = deploy.placement_preview(app)
    app = rolling.with_roll_options(app, options.max_unavailable, spec.replicas)
    text = deploy.render_config(deploy.serve_config(app, inv), spec.source,
                                inv.ray.dashboard_port)
    leaked = deploy.find_secrets(text, options.secrets)
    if leaked:
        raise DeployError(f"refusing to write a Serve config holding secret values ({leaked}): "
                          "secrets belong in the nodes' env, set at `ray start`")
    config_path = write_config("serve_config.yaml", text) if write_config else None
    doc.update(device=device, import_path=spec.import_path, route_prefix=spec.route,
               config_path=str(config_path) if config_path else None,
               placement=preview, notes=notes, spec=spec.to_dict())
    warnings = doc["warnings"]
    if not spec.api_key_env:
        warnings.append("no API key: anyone who can reach the Serve port can use the endpoint")

    # 2. what Serve runs now (the port it serves on, a previous version of this app)
    if headless:
        return _dry_run_without_head(inv, session, options, cluster, device, app, preview,
                                     say, doc)
    if client is None:
        from cluster.ray.dashboard_api import DashboardClient
        client = DashboardClient(session, inv)
    details = client.serve_details()
    before = deploy.app_state(details, spec.name)
    running_port = (details.get("http_options") or {}).get("port")
    if running_port and running_port != inv.ray.serve_port:
        warnings.append(f"Serve already runs on port {running_port} (the inventory says "
                        f"{inv.ray.serve_port}); the app is served there")
    doc.update(endpoint=deploy.endpoint_url(inv, spec.route, running_port),
               previous=before.to_dict() if before else None)

    # 3. checks on every node that may host a bundle
    say(f"checking {spec.model} and ${spec.api_key_env or '(no API key)'} on "
        f"{len(cluster.nodes)} node(s)")
    checks = deploy.check_nodes(session, inv, spec, cluster)
    warnings += list(checks.warnings)
    doc["checks"] = checks.to_dict()
    problems = list(checks.problems) + deploy.capacity_problems(preview, cluster)
    running_config = _running_config(client, spec.name) if before is not None else None
    app = rolling.keeping_rebuild(running_config, app)
    renamed = _renamed(running_config, app, options, doc)
    roll = None if renamed else _roll(inv, details, running_config, app, preview, cluster,
                                      options, doc)
    problems += roll.problems if roll is not None else []
    if renamed and not options.replace:
        problems.append(renamed)
    if problems:
        doc.update(status="REFUSED", error="; ".join(problems))
        return 2
    proof_plan = _proof_plan(spec, device, cluster, inv, options, doc)
    doc["ports"] = _inter_node_ports(spec, device, cluster, inv, proof_plan)
    if options.dry_run:
        if proof_plan is not None:
            doc["fabric_proof"] = _planned(proof_plan)
        doc["status"] = "DRY_RUN"
        return 0
    if proof_plan is not None and not _prove(inv, session, proof_plan, cluster, options, say,
                                             doc):
        return 2
    if before is not None and not confirm(
            f"Application {spec.name!r} is already deployed ({before.status}); replace it "
            + (f"(a rolling change in {len(roll.steps)} step(s), {roll.batch} replica(s) at a "
               f"time, each new one ready before an old one stops)?" if roll is not None else
               f"({renamed}; --replace)?" if renamed else
               "(its replicas restart if the config changed)?")):
        doc["status"] = "CANCELLED"
        return 2
    if roll is not None:
        # the capacity gate once more, on what runs now (the proof and the question took time)
        details = client.serve_details()
        roll = _roll(inv, details, running_config, app, preview, cluster, options, doc)
        if roll is not None and roll.problems:
            doc.update(status="REFUSED", error="; ".join(roll.problems))
            return 2

    # 4. PUT (merged with the other apps on the head), then wait for RUNNING
    staging = _cache_nodes(inv, spec, cluster)
    if staging:
        doc["compile_cache"] = cache_stage.before_start(inv, session, spec, staging,
                                                        options.local_root, say)
    started = time.time()
    say(f"deploying {spec.name} ({spec.import_path}) through the dashboard")
    applied = deploy.deploy_app(client, app, inv)
    doc["apply"] = applied.to_dict()
    if not applied.ok:
        doc.update(status="FAILED", error=applied.error)
        return 2
    if applied.http_options and applied.http_options.get("port"):
        doc["endpoint"] = deploy.endpoint_url(inv, spec.route, applied.http_options["port"])
    previous_time = (applied.previous or {}).get("last_deployed_time_s")
    say(f"waiting up to {options.timeout_s:g} s for {spec.name} to be RUNNING")
    outcome = wait_for_app(client, spec.name, options.timeout_s,
                           previous_time=previous_time, on_event=say)
    doc.update(status=outcome.state.status if outcome.state else "UNKNOWN",
               waited_s=round(outcome.waited_s, 1),
               app=outcome.state.to_dict() if outcome.state else None)
    if outcome.running:
        doc["replicas"] = _replica_ranks(session, inv, spec.name)
        rank_nodes = cache_stage.rank_nodes(staging, doc["replicas"]) if staging else []
        logs = _engine_logs(inv, session, rank_nodes, proof_plan, started, say)
        if staging:
            warnings += cache_stage.after_start(inv, session, spec, staging, doc["replicas"],
                                                doc["compile_cache"], logs,
                                                options.local_root, say)
        return _confirm_transport(inv, proof_plan, options, doc, logs)
    doc["error"] = deploy.failure_reason(outcome, options.timeout_s)
    say(f"not RUNNING: {doc['error']}; reading the replica logs")
    doc["log_tails"] = deploy.collect_log_tails(session, inv, outcome.state)
    doc["error"] = deploy.with_engine_error(doc["error"], doc["log_tails"], app)
    if roll is not None:
        _roll_back(inv, client, roll, running_config, outcome, options, say, doc)
    return 2


def _running_config(client, name: str) -> dict[str, Any] | None:
    """The config `name` runs with, its env values as deployed: Serve's details through
    `serve_details()` mask them, which would make every config look changed and a roll-back
    PUT the masks themselves. Held in memory only (never written to a record)."""
    from cluster.ray.dashboard_api import SERVE_API

    reply = client.request("GET", SERVE_API, redact=False)
    if not reply.ok or not isinstance(reply.json, dict):
        raise DeployError(f"the dashboard did not list the Serve applications: "
                          f"{reply.describe()}")
    app = (reply.json.get("applications") or {}).get(name)
    config = app.get("deployed_app_config") if isinstance(app, dict) else None
    return config if isinstance(config, dict) else None


def _roll(inv, details, running_config, app, preview, cluster, options: DeployOptions,
          doc: dict) -> "rolling.RollPlan | None":
    """The rolling change's steps when this app runs with another config (`running_config`,
    env values unmasked; None: a first deploy or an unchanged config); doc["roll"] shows them
    and the capacity at each."""
    spec = options.spec
    running = ((details or {}).get("applications") or {}).get(spec.name) or {}
    if not rolling.app_changed(running_config, app):
        return None
    names = {n.ip: n.name for n in inv.nodes}
    total = {n.name or n.ip: {"CPU": n.cpus, "GPU": n.gpus} for n in cluster.nodes}
    deployments = list((running.get("deployments") or {}).values())
    old = rolling.old_replicas(details, spec.name, names)
    old_footprint = (rolling.footprint_of_deployment(deployments[0]) if deployments
                     else rolling.footprint_of_preview(preview))
    plan = rolling.plan_roll(old, old_footprint, rolling.footprint_of_preview(preview),
                             spec.replicas, rolling.free_capacity(total, details, names),
                             options.max_unavailable)
    doc["roll"] = {**plan.to_dict(), "old_replicas": [r.replica_id for r in old],
                   "max_unavailable": options.max_unavailable, "failed_step": None,
                   "rolled_back": None}
    return plan


def _renamed(old_config, app, options: DeployOptions, doc: dict) -> str | None:
    """Why a change cannot roll when it renames the app's Serve deployment (a new served model
    name): Serve deletes the old deployment, every old replica at once, and starts the new one
    beside it. doc["replaced"] names both; None when the name stays or nothing runs."""
    names = rolling.renamed(old_config, app) if rolling.app_changed(old_config, app) else None
    if names is None:
        return None
    doc["replaced"] = {"old_deployment": names[0], "new_deployment": names[1],
                       "replace": options.replace}
    why = (f"the served model name changes, so Serve deployment {names[0]} is replaced whole by "
           f"{names[1]} (every old replica stops while the new ones start): no rolling change")
    if options.replace:
        doc["warnings"].append(f"{why} (--replace)")
        return why
    return (f"{why}; give --replace to do that, or keep the served model name "
            f"(--served-model-name) to roll")


def _roll_back(inv, client, roll, previous, outcome, options: DeployOptions, say,
               doc: dict) -> None:
    """A roll that did not finish: name the failed step and put the previous config back
    (same code version: Serve keeps the old replicas that still run and stops the new ones)."""
    spec = options.spec
    old_ids = doc["roll"]["old_replicas"]
    step = rolling.failed_step(roll, old_ids, outcome.state)
    doc["roll"]["failed_step"] = step
    what = roll.steps[step - 1].describe() if roll.steps else "?"
    say(f"roll step {step} of {len(roll.steps)} failed; putting the previous config back")
    applied = deploy.deploy_app(client, previous, inv) if previous else None
    back = None
    if applied is not None and applied.ok:
        last = (outcome.state.last_deployed_time_s if outcome.state else None)
        back = wait_for_app(client, spec.name, options.rollback_timeout_s, previous_time=last,
                            on_event=say)
    doc["roll"]["rolled_back"] = bool(back is not None and back.running)
    kept = (f"the previous config is back and RUNNING ({len(old_ids)} old replica(s) "
            f"serving)" if doc["roll"]["rolled_back"] else
            f"putting the previous config back did not finish: "
            f"{applied.error if applied is not None and not applied.ok else 'not RUNNING'}")
    doc.update(status="ROLL_FAILED",
               error=f"roll step {step} of {len(roll.steps)} failed ({what}): "
                     f"{doc['error']}; {kept}")


# What a dry run cannot check while no head answers (doc["unchecked"] leads with these).
WITHOUT_HEAD = ("live capacity (Ray's alive nodes and their GPUs and CPUs)",
                "running apps (a deployed version of this app, the other apps kept)",
                "Serve's state (the HTTP port it serves on)")


def _offline_cluster(inv, spec, doc: dict, why: str):
    """The cluster a headless dry run plans on: every inventory node, its GPUs from the latest
    preflight report's facts under the run root (what `cluster plan` reads), else the
    inventory's expectations.gpus_per_node; doc says which (head, head_error, cluster_source,
    unchecked)."""
    from cluster.base.errors import ClusterError
    from cluster.planning.planner import latest_preflight_report, load_cluster_facts_from_report

    gpus: dict[str, tuple[int, str | None]] = {}
    sources = []
    report = latest_preflight_report(inv.run_dir)
    if report is not None:
        try:
            facts = load_cluster_facts_from_report(report)
        except ClusterError as exc:
            doc["warnings"].append(f"the latest preflight report was not used: {exc}")
        else:
            gpus = {n.node: (n.gpu_count, n.gpu_model or None) for n in facts.nodes}
            sources.append(f"preflight report {report}")
    expected = inv.expectations.get("gpus_per_node")
    rest = [n.name for n in inv.nodes if n.name not in gpus]
    if rest and expected:
        gpus.update({name: (int(expected), inv.expectations.get("gpu_model")) for name in rest})
        sources.append("the inventory's expectations.gpus_per_node")
    unchecked = list(WITHOUT_HEAD)
    unknown = [n.name for n in inv.nodes if n.name not in gpus]
    if unknown:
        unchecked.append(f"the GPUs of {', '.join(unknown)} (no preflight facts, no "
                         "expectations.gpus_per_node: run `cluster preflight`; taken as 0"
                         + (", --device picks the device" if spec.device == "auto" else "")
                         + ")")
    if not inv.ray.num_cpus:
        unchecked.append("the nodes' CPUs (Ray counts them at start; ray.num_cpus in the "
                         "inventory fixes them)")
    doc.update(head="unreachable", head_error=why,
               cluster_source=" and ".join(sources) or "the inventory", unchecked=unchecked)
    return deploy.ClusterView.from_inventory(inv, gpus)


def _dry_run_without_head(inv, session: Session, options: DeployOptions, cluster, device, app, preview,
                          say, doc: dict) -> int:
    """The rest of a dry run when no head answers: the endpoint from the inventory, the checks
    on the nodes SSH reaches (a missing model refuses; an unreached node is unchecked, exit 1),
    the roll from the app's last deploy record, the proof's groups and the ports; 0 when every
    node was checked."""
    spec = options.spec
    doc.update(endpoint=deploy.endpoint_url(inv, spec.route), previous=None)
    say(f"no head answered: checking {spec.model} on {len(cluster.nodes)} inventory node(s)")
    checks = deploy.check_nodes(session, inv, spec, cluster, without_head=True)
    doc["warnings"] += list(checks.warnings)
    doc["checks"] = checks.to_dict()
    doc["unchecked"] += list(checks.unchecked)
    problems = list(checks.problems)
    record = last_deploy_record(inv.run_dir, spec.name)
    if record is not None:
        renamed = _renamed(record.app, app, options, doc)
        roll = None if renamed else _roll_from_record(record, app, preview, cluster, options,
                                                      doc)
        problems += ([renamed] if renamed and not options.replace else
                     roll.problems if roll is not None else [])
    if problems:
        doc.update(status="REFUSED", error="; ".join(problems))
        return 2
    proof_plan = _proof_plan(spec, device, cluster, inv, options, doc)
    doc["ports"] = _inter_node_ports(spec, device, cluster, inv, proof_plan)
    if proof_plan is not None:
        doc["fabric_proof"] = _planned(proof_plan)
    doc["status"] = "DRY_RUN"
    return 1 if any(not c.reached or c.error for c in checks.nodes) else 0


@dataclass(frozen=True)
class DeployRecord:
    """An app's last deploy that ended RUNNING: its run's deploy.json and the app's config in
    the Serve config it wrote (serve_config.yaml beside it)."""

    path: Path
    doc: dict
    app: dict

    def describe(self) -> str:
        return f"the last deploy record {self.path}"


def last_deploy_record(run_root, name: str) -> DeployRecord | None:
    """The newest run record of `name` (deploy.json or undeploy.json under the run root): a
    deploy that ended RUNNING with its Serve config; None when the newest removed the app or
    none did. Dry runs and failed deploys are passed over (they changed nothing that runs);
    a record that is a link or unreadable is skipped."""
    from cluster.base.bounds import bound
    from cluster.base.errors import ClusterError
    from cluster.base import yamlfile
    from cluster.planning.modelinfo import read_json_file

    root = Path(run_root)
    found = [p for pattern in ("*/deploy.json", "*/undeploy.json") for p in root.glob(pattern)]
    for path in sorted(found, key=lambda p: p.parent.name, reverse=True):
        config = path.parent / "serve_config.yaml"
        if path.is_symlink() or path.parent.is_symlink():
            continue
        try:
            doc = read_json_file(path, "run record", max_bytes=bound("files", "deploy_record"),
                                 error=DeployError)
        except ClusterError:
            continue
        if not isinstance(doc, dict) or doc.get("name") != name or doc.get("dry_run"):
            continue
        if path.name == "undeploy.json":
            if doc.get("status") == "REMOVED":
                return None
            continue
        if doc.get("status") != "RUNNING" or config.is_symlink():
            continue
        try:
            serve = yamlfile.load(config, what="a Serve config",
                                  error=lambda message, **_: DeployError(message)).data
        except ClusterError:
            continue
        apps = [a for a in (serve or {}).get("applications") or []
                if isinstance(a, dict) and a.get("name") == name]
        if apps:
            return DeployRecord(path, doc, apps[0])
    return None


def _roll_from_record(record: DeployRecord, app, preview, cluster, options: DeployOptions,
                      doc: dict) -> "rolling.RollPlan | None":
    """A headless dry run's roll: the replicas the app's last deploy record lists, on the
    inventory's capacity (that app's replicas taken off; other apps are not known without a
    head). doc["roll"]["source"] says the steps come from that record."""
    if not rolling.app_changed(record.app, app):
        doc["notes"].append(f"the config is the one in {record.describe()}: no roll")
        return None
    old = rolling.replicas_of_record(record.doc)
    old_footprint = rolling.footprint_of_preview(record.doc.get("placement") or preview)
    new_footprint = rolling.footprint_of_preview(preview)
    if not cluster.total("CPU"):      # no ray.num_cpus: the CPUs are not known (doc["unchecked"])
        old_footprint, new_footprint = old_footprint.without("CPU"), new_footprint.without("CPU")
    total = {n.name or n.ip: {"CPU": n.cpus, "GPU": n.gpus} for n in cluster.nodes}
    plan = rolling.plan_roll(old, old_footprint, new_footprint, options.spec.replicas,
                             rolling.free_beside(total, old, old_footprint),
                             options.max_unavailable)
    source = (f"{record.describe()}: no head answered, so what runs now was not read; other "
              "apps' replicas are not counted")
    doc["roll"] = {**plan.to_dict(), "old_replicas": [r.replica_id for r in old],
                   "max_unavailable": options.max_unavailable, "failed_step": None,
                   "rolled_back": None, "source": source}
    doc["unchecked"].append("the running replicas (the roll's steps come from "
                            f"{record.describe()})")
    return plan


def _cache_nodes(inv, spec, cluster) -> list:
    """The nodes a compile cache is staged to (every alive Ray node of the inventory: any may
    run a rank), or none without --stage-caches / with --placement-only."""
    if not spec.stage_caches or spec.placement_only:
        return []
    names = {n.name for n in cluster.nodes if n.name}
    return [n for n in inv.nodes if n.name in names]


def _proof_plan(spec, device, cluster, inv, options: DeployOptions, doc: dict):
    """The fabric proof of this layout (None: --no-verify, or no group of two ranks)."""
    from cluster.planning import fabric_proof

    if not options.verify:
        doc["notes"].append("fabric proof skipped (--no-verify)")
        return None
    if spec.placement_only:
        doc["notes"].append("fabric proof skipped: placement only, no engine starts")
        return None
    try:
        # the nodes the engine will really span (the multi-node engine's own rule), so the
        # groups proven are the ranks the engine later reports
        plan = fabric_proof.plan_proof(spec, device, cluster, inv,
                                       nnodes=deploy.engine_nodes(spec, device, cluster))
    except UsageError as exc:
        doc["warnings"].append(f"fabric proof not planned: {exc}")
        return None
    if not plan.groups:
        doc["notes"].append("fabric proof: one rank per engine, no group to prove")
        return None
    return plan


def _inter_node_ports(spec, device, cluster, inv, plan) -> list[dict[str, Any]]:
    """The TCP ports the engine (and the fabric proof) open between nodes, unauthenticated:
    what the admin firewalls to the cluster's own nodes (cluster/serving/ports.py)."""
    from cluster.serving import ports

    found = ports.deployment_ports(spec, device, cluster, inv)
    if plan is not None:
        found += ports.proof_ports(plan)
    return [p.to_dict() for p in found]


def _planned(plan) -> dict[str, Any]:
    """What a dry run shows: the groups it would prove (nothing measured)."""
    groups = [{"kind": g.kind, "ranks": list(g.ranks), "nodes": list(g.nodes),
               "backend": plan.backend, "transport": None, "gdr": None, "busbw_gbps": None,
               "threshold_gbps": None,
               "verdict": f"dry run: would all-reduce on port {port}"}
              for g, port in zip(plan.groups, plan.ports)]
    return {"groups": groups, "status": "planned", "plan": plan.to_dict()}


def _prove(inv, session: Session, plan, cluster, options: DeployOptions, say, doc: dict) -> bool:
    """Run the proof; False (doc says why) when it failed and --force was not given."""
    from playbooks.nccl_check import ProofOptions, run_proof

    models = {n.name: n.gpu_model for n in cluster.nodes if n.name}
    outcome = run_proof(inv, session, ProofOptions(plan, models), never_confirm,
                        lambda event: say(str(event)))
    proof = outcome.proof
    doc["fabric_proof"] = proof.to_dict()
    say(f"fabric proof: {proof.verdict}")
    if proof.ok:
        if proof.status.value == "warn":
            doc["warnings"].append(f"fabric proof: {proof.verdict}")
        return True
    if options.force:
        doc["warnings"].append(f"the fabric proof failed and --force deploys anyway: "
                               f"{proof.verdict}")
        return True
    doc.update(status="REFUSED", error=f"fabric proof failed: {proof.verdict} (nothing was "
                                       f"deployed; --force deploys anyway, --no-verify skips "
                                       f"the proof)")
    return False


def _engine_logs(inv, session: Session, rank_nodes, plan, since: float, say) -> dict[str, list[str]]:
    """node -> the ranks' log texts since the start, read once for both readers (the compile
    cache's ranks, the proof's groups) from the union of their nodes."""
    from cluster.serving import engine_transport
    from cluster.nodes.endpoints import log_dir
    from cluster.node_programs import fan_out_program

    names = list(dict.fromkeys([n.name for n in rank_nodes]
                               + ([s.node for s in plan.slots] if plan is not None else [])))
    if not names:
        return {}
    nodes = [inv.node(n) for n in names]
    say(f"reading the ranks' log lines on {', '.join(names)}")
    got = fan_out_program(session, nodes, "engine_logs", [log_dir(inv), f"{since - 5:.0f}"],
                          timeout=LOG_TIMEOUT_S, python=inv.ray.python)
    return engine_transport.logs_of({n.name: d for n, d in zip(nodes, got)
                                     if isinstance(d, dict)})


def _confirm_transport(inv, plan, options: DeployOptions, doc: dict,
                       logs: dict[str, list[str]]) -> int:
    """After RUNNING: each group's transport from its ranks' own init lines (the logs Ray keeps
    on the groups' nodes); a contradiction of the proof or the inventory fails (exit 2)."""
    from cluster.serving import engine_transport
    from cluster.planning import fabric_thresholds

    if plan is None:
        return 0
    names = list(dict.fromkeys(s.node for s in plan.slots))
    readings = engine_transport.read_engine(plan.groups, {n: logs.get(n, []) for n in names},
                                            plan.backend, plan.layout.ranks_per_engine)
    doc["engine_transport"] = [r.to_dict() for r in readings]
    doc["warnings"] += engine_transport.placement_warnings(readings)
    missing = engine_transport.unconfirmed(readings)
    if missing:
        doc["warnings"].append(f"transport not confirmed from the engine's own lines for "
                               f"{', '.join(missing)} (no init line found in the Ray logs "
                               f"of {', '.join(names)})")
    proof = doc.get("fabric_proof") or {}
    network = fabric_thresholds.expected_network(inv.expectations,
                                                 any(n.ib_hcas for n in inv.nodes))
    problems = engine_transport.mismatches(proof.get("groups") or [], readings, network,
                                           proof.get("details") or [])
    if not problems:
        return 0
    doc.update(status="TRANSPORT_MISMATCH",
               error="; ".join(problems) + f" (the app stays deployed for inspection: "
                                           f"`cluster undeploy {options.spec.name}`)")
    return 2
