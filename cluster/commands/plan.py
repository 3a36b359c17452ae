"""`cluster plan`: a model's config + the cluster's facts -> TP/PP/DP/EP and vLLM engine args.

The model (--model): a path on this machine, NODE:PATH (config.json read on that inventory node
over SSH) or a Hugging Face repo id (its config.json only; HF_TOKEN from the environment), else
the inventory's model_path when it is on this machine (cluster.planning.model_source).
Cluster facts: the newest preflight run (--report, else the newest <run root>/*/preflight.json;
the run root is --run-root, else the inventory's run_dir, else ./runs) read as typed facts for
the inventory's nodes; each cluster flag (--nodes, --gpus-per-node, --gpu-model,
--gpu-memory-gib, --nvlink, --ib-rate-gbps) overrides what it read, and --gpus-per-node with
--gpu-model (or --gpu-memory-gib) needs no run. --alternatives N adds the next N layouts the
rules allow, side by side. Exit codes: 0 plan without warnings, 1 plan with warnings (e.g. fp8
KV refused, mixed GPUs), 2 no plan (does not fit, bad input) or engine args vLLM rejects.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from cluster.base.bounds import bound
from cluster.commands._common import float_range, int_range, path_value, text_value
from cluster.base.errors import ClusterError, InventoryError, PlanError, UsageError
from cluster.base.textsafe import safe_line
from cluster.planning.model_source import MODEL_FORMS, hub_info, info_from_text, model_source
from cluster.planning.modelinfo import ModelInfo, load_model_info
from cluster.planning.planner import (KV_DTYPE_CHOICES, SKIPPED_BY_FLAG, WORKLOADS, ClusterFacts,
                                      Plan, PlanOptions, latest_preflight_report,
                                      load_cluster_facts_from_report, make_plan, plan_alternatives,
                                      EngineArgsCheck, validate_quietly)
from cluster.planning.serve_lines import flags as serve_flags, node_commands
from cluster.planning.serve_lines import render as render_serve_lines


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="plan TP/PP/DP/EP and vLLM engine args for a model on this cluster",
        description="Turn a model's config.json and the cluster's GPU facts into tensor/pipeline/"
                    "data/expert parallel sizes and vLLM engine args, with a reason per choice.",
        epilog="Exit codes: 0 plan, 1 plan with warnings, 2 no plan (does not fit, bad input).")
    p.add_argument("--model", metavar="MODEL", type=text_value,
                   help="a model directory or config.json here, NODE:PATH on an inventory node, or a "
                        "Hugging Face repo id ORG/NAME (default: the inventory's model_path, when "
                        "it is on this machine)")
    p.add_argument("--allow-http-endpoint", action="store_true",
                   help="let HF_ENDPOINT be http to a loopback address (a local hub mirror); any "
                        "other HF_ENDPOINT must be https")
    facts = p.add_argument_group("cluster facts (default: the newest preflight run; a flag "
                                 "overrides that fact)")
    facts.add_argument("--nodes", type=int_range(1, bound("plan", "nodes")), metavar="N",
                       help=f"nodes, 1 to {bound('plan', 'nodes')} (default 1 with the flags below)")
    facts.add_argument("--gpus-per-node", type=int_range(1, bound("plan", "gpus_per_node")),
                       metavar="G", help=f"1 to {bound('plan', 'gpus_per_node')}")
    facts.add_argument("--gpu-model", metavar="NAME", type=text_value,
                       help="GPU name as nvidia-smi prints it, or an alias (H100, A100, L40S...)")
    facts.add_argument("--gpu-memory-gib", type=float_range(0, bound("plan", "gpu_memory_gib"),
                                                            strict=True), metavar="M",
                       help=f"GPU memory in GiB, at most {bound('plan', 'gpu_memory_gib')} "
                            f"(default: from the GPU model)")
    facts.add_argument("--nvlink", choices=("yes", "no"),
                       help="NVLink between a node's GPUs (default: typical for the GPU model)")
    facts.add_argument("--ib-rate-gbps", metavar="R",
                       type=float_range(0, bound("plan", "ib_rate_gbps"), strict=True),
                       help="InfiniBand/RoCE rate per port in Gb/s (default: the slowest Active "
                            "port preflight saw)")
    facts.add_argument("--report", metavar="PATH", type=path_value, help="a preflight.json report to read facts from")
    facts.add_argument("--run-root", metavar="DIR", type=path_value,
                       help="where <run>/preflight.json reports are (default: the inventory's "
                            "run_dir, else ./runs)")
    opts = p.add_argument_group("serving options")
    opts.add_argument("--max-model-len", metavar="L",
                      type=int_range(bound("plan", "max_model_len_min"),
                                     bound("plan", "max_model_len")),
                      help="default: min(8192, the model's maximum)")
    opts.add_argument("--min-concurrency", type=int_range(1, bound("plan", "min_concurrency")),
                      metavar="C",
                      help="full-length sequences a replica's KV cache must hold (default 8)")
    opts.add_argument("--kv-cache-dtype", choices=KV_DTYPE_CHOICES, default="auto")
    opts.add_argument("--gpu-memory-utilization", type=float_range(0, 1, strict=True), metavar="U",
                      help="default 0.90, 0.85 when more than one GPU serves a replica")
    opts.add_argument("--workload", choices=WORKLOADS, help="scheduler defaults (default: chat)")
    opts.add_argument("--tokens-per-s-per-gpu", metavar="X",
                      type=float_range(0, bound("plan", "tokens_per_s_per_gpu"), strict=True),
                      help="measured sustained tokens/s per GPU: adds a capacity estimate")
    opts.add_argument("--served-model-name", metavar="NAME", type=text_value, help="default: the model's directory name")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="PLAN.yaml", type=path_value, help="write the plan (YAML) for `cluster deploy`")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--alternatives", metavar="N", type=int_range(0, bound("plan", "alternatives")),
                     default=0, help="also the next N layouts the rules allow, side by side with "
                                     "their trade-offs (--json: a list)")
    out.add_argument("--no-validate", action="store_true",
                     help="skip the check of the engine args by vLLM's own EngineArgs")
    p.set_defaults(handler=run)


def _inventory(args: argparse.Namespace):
    """The inventory file given or found (-i, $CLUSTER_INVENTORY, ./cluster.yaml); None with
    none (the embedded localhost default names no cluster to plan for)."""
    from cluster.nodes import inventory
    explicit = getattr(args, "inventory", None)
    try:
        inv = inventory.load(explicit)
    except InventoryError:
        if explicit:
            raise
        return None
    return None if inv.path == inventory.EMBEDDED else inv


def _node_names(inv) -> list[str]:
    return [n.name for n in inv.nodes] if inv is not None else []


def _model_spec(args: argparse.Namespace, inv) -> str:
    """--model, else the inventory's model_path when it is on this machine; UsageError in one
    line naming the flag otherwise."""
    if args.model:
        return args.model
    if inv is not None and inv.model_path:
        if Path(inv.model_path).expanduser().exists():
            return inv.model_path
        node = inv.nodes[0].name if inv.nodes else "NODE"
        raise UsageError(f"no --model: the inventory's model_path {inv.model_path} is not on this "
                         f"machine; pass --model {node}:{inv.model_path} to read it on a node, "
                         f"or {MODEL_FORMS}")
    raise UsageError(f"no model: pass {MODEL_FORMS}")


def model_info(args: argparse.Namespace, inv) -> ModelInfo:
    """The model's facts from where --model points (cluster.planning.model_source)."""
    source = model_source(_model_spec(args, inv), _node_names(inv))
    if source.kind == "local":
        return load_model_info(source.where)
    if source.kind == "hub":
        return hub_info(source.where, allow_http=args.allow_http_endpoint)
    return info_from_text(_read_on_node(inv, source), source)


def _read_on_node(inv, source) -> str:
    """config.json's text on an inventory node, read bounded (head -c) over one SSH command."""
    import shlex

    from cluster.nodes.remote import Session

    node = next(n for n in inv.nodes if n.name == source.node)
    path = source.config_path()
    limit = bound("files", "config_json")
    with Session(inv) as session:
        got = session.run(node, f"head -c {limit + 1} -- {shlex.quote(path)}",
                          timeout=inv.ssh.command_timeout)
    if not got.ok:
        why = got.error or safe_line(got.stderr, limit=200) or got.status
        raise UsageError(f"--model {source.node}:{source.where}: cannot read {path} on "
                         f"{source.node} ({why})")
    if got.cut:
        raise PlanError(f"{source.node}:{path}: config.json is larger than the {len(got.stdout):,} "
                        "bytes a command's output keeps: refused")
    return got.stdout


def _complete_flags(args: argparse.Namespace) -> bool:
    return args.gpus_per_node is not None and (args.gpu_model is not None
                                               or args.gpu_memory_gib is not None)


def _saved_run(args: argparse.Namespace, inv) -> tuple[Path | None, list[str]]:
    """(the preflight report to read, the run roots looked in): --report, else the newest
    under --run-root, the inventory's run_dir, else ./runs. Complete cluster flags with no
    inventory file and no --report/--run-root read none (nothing of another cluster leaks in)."""
    if args.report:
        return Path(args.report), [str(args.report)]
    roots = [args.run_root] if args.run_root else []
    if not roots:
        if inv is None and _complete_flags(args):
            return None, []
        if inv is not None:
            roots.append(inv.run_dir)
        roots.append("runs")
    roots = list(dict.fromkeys(roots))
    for root in roots:
        report = latest_preflight_report(root)
        if report is not None:
            return report, roots
    return None, roots


def cluster_facts(args: argparse.Namespace, inv=None) -> ClusterFacts:
    """The latest preflight run's facts for the inventory's nodes, each cluster flag in place
    of what it read; complete flags (--gpus-per-node with --gpu-model or --gpu-memory-gib)
    need no run. UsageError/PlanError in one line when neither gives GPU facts."""
    nvlink = None if args.nvlink is None else args.nvlink == "yes"
    names = _node_names(inv)
    report, roots = _saved_run(args, inv)
    base = None
    if report is not None:
        try:
            base = load_cluster_facts_from_report(report, only=names or None)
        except PlanError:
            if args.report or not _complete_flags(args):
                raise
    if base is None:
        if args.gpus_per_node is None:
            looked = f"no preflight run in {' or '.join(roots)}" if roots else "no preflight run"
            raise UsageError(f"no cluster facts: {looked}: run `cluster preflight`, or pass "
                             "--gpus-per-node G with --gpu-model NAME or --gpu-memory-gib M"
                             if not _flags_given(args) else
                             f"--gpus-per-node is required with the cluster flags when there is "
                             f"{looked} (run `cluster preflight` for the facts)")
        return ClusterFacts.from_flags(nodes=args.nodes or len(names) or 1,
                                       gpus_per_node=args.gpus_per_node, gpu_model=args.gpu_model,
                                       gpu_memory_gib=args.gpu_memory_gib, nvlink=nvlink,
                                       ib_rate_gbps=args.ib_rate_gbps, names=names)
    return base.overridden(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                           gpu_model=args.gpu_model, gpu_memory_gib=args.gpu_memory_gib,
                           nvlink=nvlink, ib_rate_gbps=args.ib_rate_gbps)


def _flags_given(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.nodes, args.gpus_per_node, args.gpu_model,
                                       args.gpu_memory_gib, args.nvlink, args.ib_rate_gbps))


def render_text(plan: Plan, validation: EngineArgsCheck, serve_lines: list[str]) -> str:
    """The plan for a terminal."""
    g = plan.gpu
    m = plan.memory
    ep = f"on (EP {plan.expert_parallel_size})" if plan.enable_expert_parallel else "off"
    ib = f", IB {g['ib_rate_gbps']:g} Gb/s" if g.get("ib_rate_gbps") else ""
    lines = [
        f"cluster plan: {plan.model_name} on {g['nodes']} node(s) × {g['gpus_per_node']} × "
        f"{g['model']} ({m.total_gib:.1f} GiB, {'NVLink' if g['nvlink'] else 'no NVLink'}{ib})",
        f"  facts        {plan.cluster_source}",
        f"  layout       TP {plan.tensor_parallel_size} × PP {plan.pipeline_parallel_size}, "
        f"DP {plan.data_parallel_size}, expert parallel {ep}; {plan.replicas} replica(s) × "
        f"{plan.gpus_per_replica} GPU(s) = {plan.gpus_used}/{plan.gpus_total} GPUs",
        f"  memory/GPU   {m.usable_gib:.1f} GiB usable ({m.utilization:.2f}) = weights "
        f"{m.weights_gib:.1f} + overhead {m.overhead_gib:.1f} + KV {m.kv_gib:.1f}",
        f"  KV cache     {plan.kv_bytes_per_token:,} B/token ({plan.kv_cache_dtype}), "
        f"{plan.kv_bytes_per_token_per_gpu:,} per GPU; {plan.kv_cache_tokens:,} tokens = "
        f"{plan.max_concurrency:g} × {plan.max_model_len:,}-token sequences",
    ]
    if plan.capacity:
        lines.append(f"  capacity     ~{plan.capacity.tokens_per_s:,.0f} tokens/s")
    lines.append(f"  engine args  {' '.join(serve_flags(plan.engine_args))}")
    lines += serve_lines
    lines.append("reasons:")
    lines += [f"  {r}" for r in plan.reasons]
    if plan.warnings:
        lines.append("warnings:")
        lines += [f"  {w}" for w in plan.warnings]
    lines.append(validation.line())
    return "\n".join(lines)


def _per_replica(plan: Plan) -> tuple[int, float]:
    """(KV tokens, full-length sequences) of one replica: comparable across layouts."""
    tokens = plan.kv_cache_tokens * (plan.data_parallel_size if plan.enable_expert_parallel else 1)
    return tokens, tokens / plan.max_model_len


LAYOUT_RULES = ("R1", "R2", "R3", "R4", "R5", "R6")


def _rule_line(plan: Plan) -> str:
    """The reason line of the rule that chose the plan's layout."""
    return next((r for r in plan.reasons if r.split(" ")[0] in LAYOUT_RULES
                 and " rejected: " not in r), "")


def render_alternatives(chosen: Plan, alternatives: tuple[Plan, ...], width: int = 80) -> list[str]:
    """The chosen layout and its alternatives side by side: one row each (fits 80 columns),
    then each one's rule and trade-offs, wrapped."""
    import textwrap

    head = f"  {'#':<2} {'layout':<24} {'GPUs':>4} {'replicas':>8} {'nodes':>5} {'KV/replica':>11} {'seqs':>7}"
    lines = [f"alternatives ({len(alternatives)} after the chosen layout, *):", head]
    plans = [("*", chosen)] + [(str(i), a) for i, a in enumerate(alternatives, start=1)]
    for mark, plan in plans:
        tokens, seqs = _per_replica(plan)
        layout = plan.layout if len(plan.layout) <= 24 else plan.layout[:23] + "…"
        lines.append(f"  {mark:<2} {layout:<24} {plan.gpus_per_replica:>4} {plan.replicas:>8} "
                     f"{plan.placement.nodes_per_replica:>5} {tokens:>11,} {seqs:>7.1f}")
    wrap = lambda text, first, rest: textwrap.wrap(text, width, initial_indent=first,  # noqa: E731
                                                   subsequent_indent=rest, break_on_hyphens=False)
    for mark, plan in plans:
        lines += wrap(f"{plan.layout}: {_rule_line(plan)}", f"  {mark:<2} ", "       ")
        for t in plan.tradeoffs:
            lines += wrap(t, "       - ", "         ")
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        inv = _inventory(args)
        info = model_info(args, inv)
        facts = cluster_facts(args, inv)
        options = PlanOptions(
            max_model_len=args.max_model_len, min_concurrency=args.min_concurrency,
            kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
            workload=args.workload, tokens_per_s_per_gpu=args.tokens_per_s_per_gpu,
            served_model_name=args.served_model_name)
        plan = make_plan(info, facts, options)
        alternatives = plan_alternatives(info, facts, options, args.alternatives)
    except ClusterError as exc:
        if args.json:
            print(json.dumps({"status": "error", "exit_code": 2, "error": safe_line(exc)}))
        print(f"cluster plan: {safe_line(exc)}", file=sys.stderr)
        return 2
    addresses = {n.name: n.node_ip or n.address for n in inv.nodes} if inv is not None else {}
    commands = node_commands(plan, addresses)
    if args.no_validate:
        check = SKIPPED_BY_FLAG
    else:
        if not args.json and sys.stderr.isatty():
            print("cluster plan: checking the engine args with vLLM's own parser...",
                  file=sys.stderr)
        check = validate_quietly(_widest_args(plan, commands))
    from cluster.planning.fabric_needs import fabric_needs, render as render_fabric

    doc = plan.to_dict()
    doc["fabric"] = fabric_needs(info, plan, facts)
    doc["node_commands"] = [c.to_dict() for c in commands]
    doc["validation"] = check.to_dict()
    if args.alternatives:
        doc["alternatives"] = [dict(a.to_dict(), node_commands=[c.to_dict() for c in
                                                                node_commands(a, addresses)])
                               for a in alternatives]
    try:
        text = json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:  # a NaN/Infinity slipped past the checks: never print it
        print(f"cluster plan: internal error: the plan holds a non-finite number ({exc})",
              file=sys.stderr)
        return 2
    if args.out:
        try:
            Path(args.out).write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
        except OSError as exc:
            print(safe_line(f"cluster plan: cannot write {args.out}: {exc.strerror or exc}"),
                  file=sys.stderr)
            return 2
    if args.json:
        print(text)
    else:
        print(render_text(plan, check, render_serve_lines(commands)))
        print("\n".join(render_fabric(doc["fabric"])))
        if args.alternatives:
            print("\n".join(render_alternatives(plan, alternatives)))
        if args.out:
            print(f"plan written to {args.out}")
    if not check.ok:
        print(f"cluster plan: engine args rejected by vLLM: {safe_line(check.detail)}",
              file=sys.stderr)
        return 2
    return 1 if plan.warnings else 0


def _widest_args(plan: Plan, commands) -> dict[str, Any]:
    """The engine args to check: a further node's (the per-node flags too) where the engine
    spans nodes, else the plan's."""
    further = [c for c in commands if c.replica == 1 and c.node_rank > 0]
    return dict(further[0].engine_kwargs) if further else dict(plan.engine_args)
