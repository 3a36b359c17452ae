"""`cluster deploy (--plan PLAN | --model PATH [--tp N] [--pp N] [--dp N]) ...`: serve a model.

Writes the Ray Serve config into the run directory (serve_config.yaml), checks the model files
and the API-key variable on every node that may host a bundle, deploys through the dashboard's
REST API (merged with the apps already running), waits until the app is RUNNING and prints the
OpenAI endpoint. Exit 0 RUNNING (or a dry run that would deploy), 2 otherwise.
"""

from __future__ import annotations

import argparse
from typing import Any

from cluster.commands._common import (add_changing, add_json, confirm, load_inventory,
                                      print_json, start_run, stderr, stdout)
from cluster.errors import DeployError, UsageError


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _engine_pair(text: str) -> tuple[str, Any]:
    from cluster import yamlfile

    key, value = _pair(text)
    try:
        parsed = yamlfile.parse_value(value, f"--engine-arg {key}") if value.strip() else value
    except ValueError:  # not YAML, a bad date, too large once aliases expand: the text as given
        parsed = value
    if isinstance(parsed, (dict, list)) and not value.strip().startswith(("{", "[")):
        parsed = value
    return key, parsed


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    from cluster.deploy import DEFAULT_API_KEY_ENV, DEFAULT_TIMEOUT_S, DEVICES

    p = sub.add_parser(
        "deploy", help="serve a model on the Ray cluster (Ray Serve + vLLM, OpenAI API)",
        description="Turn a plan (`cluster plan --out plan.yaml`) or flags into a Ray Serve "
                    "config, check the model files and the API-key variable on every node, "
                    "deploy it through the Ray dashboard (other apps are kept), wait until it "
                    "is RUNNING and print the OpenAI endpoint. docs/deploy.md.",
        epilog="Exit codes: 0 RUNNING (dry run: would deploy), 2 not RUNNING, refused or bad "
               "input. The API key itself never goes on the command line: name its variable.")
    what = p.add_argument_group("what to serve (a plan, or a model and its layout)")
    what.add_argument("--plan", metavar="PLAN.yaml", help="a plan written by `cluster plan --out`")
    what.add_argument("--model", metavar="PATH",
                      help="model directory on the nodes (absolute); with --plan: overrides the "
                           "plan's path (default without --plan: the inventory's model_path)")
    what.add_argument("--tp", type=_positive, metavar="N", help="tensor parallel size (default 1)")
    what.add_argument("--pp", type=_positive, metavar="N",
                      help="pipeline parallel size (default 1)")
    what.add_argument("--dp", type=_positive, metavar="N",
                      help="data parallel: Serve replicas of a dense model (default 1); with "
                           "--expert-parallel the DP attention ranks of one MoE engine")
    what.add_argument("--expert-parallel", action="store_true",
                      help="MoE: data-parallel attention + expert-parallel MoE layers")
    how = p.add_argument_group("serving options")
    how.add_argument("--name", metavar="NAME",
                     help="Serve application name (default: from the served model name)")
    how.add_argument("--served-model-name", metavar="NAME",
                     help="the model name clients send (default: the plan's, else the "
                          "model directory's name)")
    how.add_argument("--route-prefix", metavar="/PATH", help="default: /NAME")
    how.add_argument("--api-key-env", metavar="VAR", default=DEFAULT_API_KEY_ENV,
                     help="environment variable holding the API key on every node, set at "
                          "`ray start` from the inventory's node env (default %(default)s)")
    how.add_argument("--no-api-key", action="store_true",
                     help="serve without an API key (anyone who reaches the port can use it)")
    how.add_argument("--max-model-len", type=_positive, metavar="L")
    how.add_argument("--engine-arg", action="append", default=[], type=_engine_pair,
                     metavar="KEY=VALUE",
                     help="extra vLLM engine arg (snake_case; YAML value), repeatable")
    how.add_argument("--env", action="append", default=[], type=_pair, metavar="KEY=VALUE",
                     help="extra environment for the replicas (runtime_env; no secrets), "
                          "repeatable")
    how.add_argument("--device", choices=DEVICES, default="auto",
                     help="auto: gpu when Ray has GPU resources, else cpu (vLLM's CPU build)")
    how.add_argument("--request-logging", action="store_true",
                     help="log every request (off by default: costly under load)")
    how.add_argument("--placement-only", action="store_true",
                     help="reserve the bundles with probe actors instead of starting vLLM: "
                          "checks a layout's placement without loading the model")
    p.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="how long to wait for RUNNING (default %(default)g)")
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def _spec(args: argparse.Namespace, inv):
    from cluster import deploy
    from cluster.plan_file import load_plan

    api_key_env = None if args.no_api_key else args.api_key_env
    common = dict(name=args.name, served_model_name=args.served_model_name,
                  max_model_len=args.max_model_len, engine_args=dict(args.engine_arg),
                  api_key_env=api_key_env, route_prefix=args.route_prefix, env=dict(args.env),
                  request_logging=args.request_logging, device=args.device,
                  placement_only=args.placement_only)
    if args.plan:
        if args.tp or args.pp or args.dp or args.expert_parallel:
            raise UsageError("--tp/--pp/--dp/--expert-parallel come from the plan: give either "
                             "--plan or the layout flags")
        return deploy.spec_from_plan(load_plan(args.plan), model=args.model, **common)
    model = args.model or inv.model_path
    if not model:
        raise UsageError("give --plan PLAN.yaml or --model PATH (or set model_path in the "
                         "inventory)")
    return deploy.spec_from_flags(model, tp=args.tp, pp=args.pp, dp=args.dp,
                                  expert_parallel=args.expert_parallel, **common)


def run(args: argparse.Namespace) -> int:
    from cluster.commands.up import inventory_secrets
    from cluster.remote import Session

    inv = load_inventory(args)
    spec = _spec(args, inv)
    record = start_run(args, inv, "deploy")
    record.secrets = record.secrets + inventory_secrets(inv)
    doc: dict[str, Any] = {"name": spec.name, "served_model_name": spec.served_model_name,
                           "model": spec.model, "status": None, "endpoint": None,
                           "config_path": None, "run_dir": str(record.path),
                           "dry_run": args.dry_run, "api_key_env": spec.api_key_env,
                           "warnings": []}
    code = 2
    try:
        with Session(inv, hooks=[record.record]) as session:
            code = _deploy(args, inv, spec, session, record, doc)
    except Exception as exc:
        doc.setdefault("error", str(exc))
        raise
    finally:
        record.write_json("deploy.json", doc)
        record.finish(code)
    _print(args, doc, record)
    return code


def _deploy(args, inv, spec, session, record, doc: dict[str, Any]) -> int:
    """Prepare (config, checks), then apply and wait. Fills `doc`; returns the exit code."""
    from cluster import deploy
    from cluster.dashboard_api import DashboardClient
    from cluster.ray_state import query_state

    def say(line: str) -> None:
        if not args.json:
            stderr.print(f"[dim]deploy:[/dim] {line}")

    # 1. what Ray has: alive nodes and their resources -> device, config, placement
    state, _ = query_state(session, inv, include_serve=False)
    if not state.answered:
        raise DeployError("the head did not answer (is Ray up? `cluster status`): "
                          + "; ".join(state.errors[-2:]))
    cluster = deploy.ClusterView.from_state(inv, state)
    device = cluster.resolve_device(spec.device)
    app, notes = deploy.build_application(spec, device, cluster, inv)
    preview = deploy.placement_preview(app)
    text = deploy.render_config(deploy.serve_config(app, inv), spec.source,
                                inv.ray.dashboard_port)
    leaked = deploy.find_secrets(text, record.secrets)
    if leaked:
        raise DeployError(f"refusing to write a Serve config holding secret values ({leaked}): "
                          "secrets belong in the nodes' env, set at `ray start`")
    doc.update(device=device, import_path=spec.import_path, route_prefix=spec.route,
               config_path=str(record.write_text("serve_config.yaml", text)),
               placement=preview, notes=notes, spec=spec.to_dict())
    warnings = doc["warnings"]
    if not spec.api_key_env:
        warnings.append("no API key: anyone who can reach the Serve port can use the endpoint")

    # 2. what Serve runs now (the port it serves on, a previous version of this app)
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
    if problems:
        doc.update(status="REFUSED", error="; ".join(problems))
        return 2
    if args.dry_run:
        doc["status"] = "DRY_RUN"
        return 0
    if before is not None and not confirm(
            f"Application {spec.name!r} is already deployed ({before.status}); replace it "
            f"(its replicas restart if the config changed)?", args.yes):
        doc["status"] = "CANCELLED"
        return 2

    # 4. PUT (merged with the other apps on the head), then wait for RUNNING
    say(f"deploying {spec.name} ({spec.import_path}) through the dashboard")
    applied = deploy.deploy_app(client, app, inv)
    doc["apply"] = applied.to_dict()
    if not applied.ok:
        doc.update(status="FAILED", error=applied.error)
        return 2
    if applied.http_options and applied.http_options.get("port"):
        doc["endpoint"] = deploy.endpoint_url(inv, spec.route, applied.http_options["port"])
    previous_time = (applied.previous or {}).get("last_deployed_time_s")
    say(f"waiting up to {args.timeout:g} s for {spec.name} to be RUNNING")
    outcome = deploy.wait_for_app(client, spec.name, args.timeout, previous_time=previous_time,
                                  on_event=say)
    doc.update(status=outcome.state.status if outcome.state else "UNKNOWN",
               waited_s=round(outcome.waited_s, 1),
               app=outcome.state.to_dict() if outcome.state else None)
    if outcome.running:
        return 0
    doc["error"] = deploy.failure_reason(outcome, args.timeout)
    say(f"not RUNNING: {doc['error']}; reading the replica logs")
    doc["log_tails"] = deploy.collect_log_tails(session, inv, outcome.state)
    return 2


def _print(args: argparse.Namespace, doc: dict, record) -> None:
    import json

    from rich.text import Text

    from cluster.render import to_json

    if args.json:
        print_json(json.loads(record.scrub(to_json(doc))))
        return
    scrub = record.scrub
    for w in doc.get("warnings") or []:
        stderr.print(f"[yellow]warning:[/yellow] {scrub(w)}")
    for n in doc.get("notes") or []:
        stderr.print(f"[dim]note:[/dim] {scrub(n)}")
    status = doc.get("status")
    placement = doc.get("placement") or {}
    if placement:
        stdout.print(f"placement: {placement.get('num_replicas')} replica(s) x "
                     f"{placement.get('bundles_per_replica')} "
                     f"({placement.get('strategy') or 'gang'}), device {doc.get('device')}")
    if doc.get("config_path"):
        stdout.print(f"serve config: {doc['config_path']}", soft_wrap=True)
    if status == "RUNNING":
        stdout.print(f"[bold green]{doc['name']} RUNNING[/bold green] "
                     f"(waited {doc.get('waited_s', 0):g} s)")
        stdout.print(f"endpoint: {doc['endpoint']}", soft_wrap=True)
        stdout.print(f"model:    {doc['served_model_name']}", soft_wrap=True)
        if doc.get("api_key_env"):
            stdout.print(f"API key:  the value of ${doc['api_key_env']} on the nodes "
                         "(Authorization: Bearer ...)")
        return
    if status == "DRY_RUN":
        stdout.print(f"dry run: would deploy {doc['name']} to {doc['endpoint']} "
                     "(nothing was changed)", soft_wrap=True)
        return
    for node, tail in (doc.get("log_tails") or {}).items():
        stdout.print(f"--- log tails on {node} ---")
        stdout.print(scrub(tail), soft_wrap=True, markup=False, highlight=False)
    stdout.print(Text.assemble((f"{doc['name']} not deployed ({status})", "bold red"),
                               ": " + scrub(doc.get("error") or "")), soft_wrap=True)
    if doc.get("app"):
        stdout.print(f"it stays in Serve as {status} for inspection (`cluster status`); remove it "
                     f"with `cluster undeploy {doc['name']}`")
