"""`cluster deploy (--plan PLAN | --model PATH [--tp N] [--pp N] [--dp N]) ...`: serve a model.

Writes the Ray Serve config into the run directory (serve_config.yaml), checks the model files
and the API-key variable on every node that may host a bundle, deploys through the dashboard's
REST API (merged with the apps already running), waits until the app is RUNNING and prints the
OpenAI endpoint. Exit 0 RUNNING (or a dry run that would deploy), 1 a dry run with no head
answering that could not reach every node, 2 otherwise. The steps are playbooks/deploy.py.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from cluster.base.flags import path_value, text_value
from cluster.base.bounds import bound
from cluster.commands._common import (add_changing, add_json, int_range, load_inventory,
                                      positive_float, positive_int, print_json, recorded_run,
                                      stderr, stdout)
from cluster.base.errors import UsageError


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _engine_pair(text: str) -> tuple[str, Any]:
    from cluster.base import yamlfile

    key, value = _pair(text)
    try:
        parsed = yamlfile.parse_value(value, f"--engine-arg {key}") if value.strip() else value
    except ValueError:  # not YAML, a bad date, too large once aliases expand: the text as given
        parsed = value
    if isinstance(parsed, (dict, list)) and not value.strip().startswith(("{", "[")):
        parsed = value
    return key, parsed


def register(sub: argparse._SubParsersAction) -> None:
    from cluster.serving.deploy import DEFAULT_API_KEY_ENV, DEFAULT_TIMEOUT_S, DEVICES

    p = sub.add_parser(
        "deploy", help="serve a model on the Ray cluster (Ray Serve + vLLM, OpenAI API)",
        description="Turn a plan (`cluster plan --out plan.yaml`) or flags into a Ray Serve "
                    "config, check the model files and the API-key variable on every node, "
                    "deploy it through the Ray dashboard (other apps are kept), wait until it "
                    "is RUNNING and print the OpenAI endpoint. docs/deploy.md.",
        epilog="Exit codes: 0 RUNNING (dry run: would deploy), 1 a dry run with no head "
               "answering that could not reach every node, 2 not RUNNING, refused or bad "
               "input. --dry-run works before `cluster up`: with no head it plans on the "
               "inventory and the latest preflight's facts and says what it could not check. "
               "The API key itself never goes on the command line: name its variable.")
    what = p.add_argument_group("what to serve (a plan, or a model and its layout)")
    what.add_argument("--plan", metavar="PLAN.yaml", type=path_value, help="a plan written by `cluster plan --out`")
    what.add_argument("--model", metavar="PATH", type=path_value,
                      help="model directory on the nodes (absolute); with --plan: overrides the "
                           "plan's path (default without --plan: the inventory's model_path)")
    what.add_argument("--tp", type=positive_int, metavar="N", help="tensor parallel size (default 1)")
    what.add_argument("--pp", type=positive_int, metavar="N",
                      help="pipeline parallel size (default 1)")
    what.add_argument("--dp", type=positive_int, metavar="N",
                      help="data parallel: Serve replicas of a dense model (default 1); with "
                           "--expert-parallel the DP attention ranks of one MoE engine")
    what.add_argument("--nnodes", type=positive_int, metavar="N",
                      help="nodes one engine spans (vLLM's native multi-node mode: node rank "
                           "0 in the replica, the others headless rank actors); default: the "
                           "fewest nodes that hold it")
    what.add_argument("--executor", choices=("auto", "native", "ray"), default=None,
                      help="vLLM executor: native (its own multi-node mode; the only one on "
                           "CPU) or ray (GPU); auto (default): native on CPU and across "
                           "nodes, Ray on one GPU node")
    what.add_argument("--expert-parallel", action="store_true",
                      help="MoE: data-parallel attention + expert-parallel MoE layers")
    how = p.add_argument_group("serving options")
    how.add_argument("--name", metavar="NAME", type=text_value,
                     help="Serve application name (default: from the served model name)")
    how.add_argument("--served-model-name", metavar="NAME", type=text_value,
                     help="the model name clients send (default: the plan's, else the "
                          "model directory's name)")
    how.add_argument("--route-prefix", metavar="/PATH", type=text_value, help="default: /NAME")
    how.add_argument("--api-key-env", metavar="VAR", type=text_value, default=DEFAULT_API_KEY_ENV,
                     help="environment variable holding the API key on every node, set at "
                          "`ray start` from the inventory's node env (default %(default)s)")
    how.add_argument("--no-api-key", action="store_true",
                     help="serve without an API key (anyone who reaches the port can use it)")
    how.add_argument("--max-model-len", type=positive_int, metavar="L")
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
    proof = p.add_argument_group("fabric proof (before engines start)")
    proof.add_argument("--no-verify", action="store_true",
                       help="skip the fabric proof (an all-reduce on each group of the "
                            "layout, the engine's backend, its nodes and ports)")
    proof.add_argument("--force", action="store_true",
                       help="deploy even when the fabric proof fails (said in the warnings)")
    how.add_argument("--stage-caches", action="store_true",
                     help="stage vLLM's compile cache to every node through the model relay: "
                          "this app's known cache before the start, the one its ranks used "
                          "after RUNNING (deploy --json: staged_cache per replica); a plan's "
                          "`stage_caches: true` does the same")
    how.add_argument("--max-unavailable", type=int_range(1, bound("plan", "parallel_size")),
                     default=1, metavar="N",
                     help="an app that already runs with another config rolls: N replicas (a "
                          "multi-node engine is one) replaced at a time, each new one ready "
                          "before an old one stops (default %(default)s)")
    how.add_argument("--replace", action="store_true",
                     help="a change of the served model name renames the Serve deployment, "
                          "which Serve replaces whole (every old replica stops while the new "
                          "ones start): refused unless this is given")
    p.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="how long to wait for RUNNING (default %(default)g)")
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def _spec(args: argparse.Namespace, inv):
    from cluster.serving import deploy
    from cluster.planning.plan_file import load_plan

    api_key_env = None if args.no_api_key else args.api_key_env
    common = dict(name=args.name, served_model_name=args.served_model_name,
                  max_model_len=args.max_model_len, engine_args=dict(args.engine_arg),
                  api_key_env=api_key_env, route_prefix=args.route_prefix, env=dict(args.env),
                  request_logging=args.request_logging, device=args.device,
                  placement_only=args.placement_only, nnodes=args.nnodes,
                  stage_caches=args.stage_caches)
    if args.plan:
        if args.tp or args.pp or args.dp or args.expert_parallel:
            raise UsageError("--tp/--pp/--dp/--expert-parallel come from the plan: give either "
                             "--plan or the layout flags")
        return deploy.spec_from_plan(load_plan(args.plan), model=args.model,
                                     executor=args.executor, **common)
    model = args.model or inv.model_path
    if not model:
        raise UsageError("give --plan PLAN.yaml or --model PATH (or set model_path in the "
                         "inventory)")
    return deploy.spec_from_flags(model, tp=args.tp, pp=args.pp, dp=args.dp,
                                  expert_parallel=args.expert_parallel,
                                  executor=args.executor or "auto", **common)


def run(args: argparse.Namespace) -> int:
    from playbooks import deploy

    inv = load_inventory(args)
    spec = _spec(args, inv)
    run_ = recorded_run(args, "deploy", inv)
    record = run_.record
    if args.no_verify and args.force:
        raise UsageError("--force deploys despite a failed fabric proof; with --no-verify no "
                         "proof runs: give one of them")
    options = deploy.DeployOptions(spec, timeout_s=args.timeout, dry_run=args.dry_run,
                                   secrets=record.secrets, verify=not args.no_verify,
                                   force=args.force, max_unavailable=args.max_unavailable,
                                   replace=args.replace,
                                   local_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    out = deploy.DeployOutcome.start(options, str(record.path))
    doc = out.doc
    try:
        with run_.session() as session:
            deploy.run(inv, session, options, confirm=run_.confirm, on_event=run_.event,
                       write_config=record.write_text, out=out)
    except Exception as exc:
        doc.setdefault("error", str(exc))
        raise
    finally:
        record.write_json("deploy.json", doc)
        record.finish(out.exit_code)
    _print(args, doc, record)
    return out.exit_code


def _print(args: argparse.Namespace, doc: dict, record) -> None:
    import json

    from rich.text import Text

    from cluster.report.render import to_json

    if args.json:
        print_json(json.loads(record.scrub(to_json(doc))))
        return
    scrub = record.scrub
    for w in doc.get("warnings") or []:
        stderr.print(f"[yellow]warning:[/yellow] {scrub(w)}")
    for n in doc.get("notes") or []:
        stderr.print(f"[dim]note:[/dim] {scrub(n)}")
    status = doc.get("status")
    if doc.get("head") == "unreachable":
        stdout.print(f"no head answered ({scrub(doc.get('head_error') or 'no reply')}): planned "
                     f"on the inventory's nodes, GPUs from {scrub(doc.get('cluster_source'))}",
                     soft_wrap=True, markup=False, highlight=False)
    placement = doc.get("placement") or {}
    if placement:
        stdout.print(f"placement: {placement.get('num_replicas')} replica(s) x "
                     f"{placement.get('bundles_per_replica')} "
                     f"({placement.get('strategy') or 'gang'}), device {doc.get('device')}")
    if doc.get("config_path"):
        stdout.print(f"serve config: {doc['config_path']}", soft_wrap=True)
    for group in (doc.get("fabric_proof") or {}).get("groups") or []:
        stdout.print(f"fabric proof: {scrub(group['verdict'])}", soft_wrap=True, markup=False,
                     highlight=False)
    _print_roll(doc.get("roll"), scrub)
    if status == "RUNNING":
        stdout.print(f"[bold green]{doc['name']} RUNNING[/bold green] "
                     f"(waited {doc.get('waited_s', 0):g} s)")
        stdout.print(f"endpoint: {doc['endpoint']}", soft_wrap=True)
        stdout.print(f"model:    {doc['served_model_name']}", soft_wrap=True)
        if doc.get("api_key_env"):
            stdout.print(f"API key:  the value of ${doc['api_key_env']} on the nodes "
                         "(Authorization: Bearer ...)")
        for rep in doc.get("replicas") or []:
            if "staged_cache" in rep:
                stdout.print(f"compile cache: {rep.get('replica_id')}: staged_cache "
                             f"{str(rep['staged_cache']).lower()} ({scrub(rep['cache_detail'])})",
                             soft_wrap=True, markup=False, highlight=False)
        return
    if status == "DRY_RUN":
        _print_layout(doc)
        _print_ports(doc.get("ports") or [])
        if doc.get("unchecked"):
            stdout.print("not checked without a head: " + scrub("; ".join(doc["unchecked"])),
                         soft_wrap=True, markup=False, highlight=False)
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


def _print_roll(roll: dict | None, scrub) -> None:
    """A rolling change's steps in order, the free capacity after each, the failed one."""
    if not roll:
        return
    stdout.print(f"rolling change: {len(roll['steps'])} step(s), {roll['batch']} replica(s) at "
                 f"a time, each new one ready before an old one stops", soft_wrap=True)
    if roll.get("source"):
        stdout.print(scrub(f"  the steps come from {roll['source']}"), soft_wrap=True,
                     markup=False, highlight=False)
    for step in roll["steps"]:
        free = ", ".join(f"{v:g} {k}" for k, v in step["free_after"].items())
        mark = "" if step["fits"] else f"  DOES NOT FIT: {step['short']}"
        if roll.get("failed_step") == step["step"]:
            mark += "  FAILED"
        stdout.print(scrub(f"  step {step['step']}: {step['what']} (free after: {free}){mark}"),
                     soft_wrap=True, markup=False, highlight=False)


def _print_layout(doc: dict) -> None:
    """A dry run's layout line: the parallel sizes of one replica, the replicas, the executor."""
    spec = doc.get("spec") or {}
    if not spec:
        return
    parts = [f"TP {spec.get('tensor_parallel_size')}", f"PP {spec.get('pipeline_parallel_size')}"]
    if spec.get("expert_parallel"):
        parts.append(f"DP {spec.get('data_parallel_size')} with expert parallel")
    nnodes = f" over {spec['nnodes']} node(s)" if spec.get("nnodes") else ""
    stdout.print(f"layout: {' x '.join(parts)} per replica{nnodes}, {spec.get('replicas')} "
                 f"replica(s), executor {spec.get('executor')}", soft_wrap=True, markup=False,
                 highlight=False)


def _print_ports(ports: list) -> None:
    """One line per port (range) the layout opens between nodes, none authenticated."""
    if not ports:
        stdout.print("ports between nodes: none (Ray's own ports aside)")
        return
    stdout.print("ports between nodes (vLLM authenticates none: allow them between the cluster's "
                 "nodes only):", soft_wrap=True)
    for p in ports:
        where = p["port"] if "port" in p else p["ports"]
        stdout.print(f"  {where}/{p['proto']}  {p['between']}: {p['what']}", soft_wrap=True,
                     markup=False, highlight=False)
