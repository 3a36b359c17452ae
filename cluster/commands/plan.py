"""`cluster plan`: a model's config + the cluster's facts -> TP/PP/DP/EP and vLLM engine args.

Cluster facts come from flags (--gpus-per-node with --gpu-model and/or --gpu-memory-gib), else
from a preflight report (--report, else the newest <run root>/*/preflight.json; the run root is
--run-root, else the inventory's run_dir, else ./runs). Exit codes: 0 plan without warnings,
1 plan with warnings (e.g. fp8 KV refused, mixed GPUs), 2 no plan (does not fit, bad input) or
engine args vLLM rejects.
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
from cluster.base.errors import ClusterError, InventoryError, UsageError
from cluster.base.textsafe import safe_line
from cluster.planning.modelinfo import load_model_info
from cluster.planning.planner import (KV_DTYPE_CHOICES, WORKLOADS, ClusterFacts, Plan, PlanOptions,
                             latest_preflight_report, load_cluster_facts_from_report, make_plan,
                             validate_engine_args)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="plan TP/PP/DP/EP and vLLM engine args for a model on this cluster",
        description="Turn a model's config.json and the cluster's GPU facts into tensor/pipeline/"
                    "data/expert parallel sizes and vLLM engine args, with a reason per choice.",
        epilog="Exit codes: 0 plan, 1 plan with warnings, 2 no plan (does not fit, bad input).")
    p.add_argument("--model", metavar="PATH", type=path_value,
                   help="model directory or config.json (default: the inventory's model_path)")
    facts = p.add_argument_group("cluster facts (default: the newest preflight report)")
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
    out.add_argument("--no-validate", action="store_true",
                     help="skip the check of the engine args by vLLM's own EngineArgs")
    p.set_defaults(handler=run)


def _inventory(args: argparse.Namespace):
    """The inventory when one is given or found; None when there is none to read."""
    from cluster.nodes import inventory
    explicit = getattr(args, "inventory", None)
    try:
        return inventory.load(explicit)
    except InventoryError:
        if explicit:
            raise
        return None


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    inv = _inventory(args)
    if inv is not None and inv.model_path:
        return inv.model_path
    raise UsageError("--model PATH is required (a model directory or config.json; or set "
                     "model_path in the inventory)")


def _flags_given(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.nodes, args.gpus_per_node, args.gpu_model,
                                       args.gpu_memory_gib, args.nvlink))


def cluster_facts(args: argparse.Namespace) -> ClusterFacts:
    """Facts from flags, else --report, else the newest preflight report under the run root."""
    if _flags_given(args):
        if args.gpus_per_node is None:
            raise UsageError("--gpus-per-node is required with the cluster flags "
                             "(--nodes, --gpu-model, --gpu-memory-gib, --nvlink)")
        nvlink = None if args.nvlink is None else args.nvlink == "yes"
        return ClusterFacts.from_flags(nodes=1 if args.nodes is None else args.nodes, gpus_per_node=args.gpus_per_node,
                                       gpu_model=args.gpu_model, gpu_memory_gib=args.gpu_memory_gib,
                                       nvlink=nvlink)
    if args.report:
        return load_cluster_facts_from_report(args.report)
    roots = [args.run_root] if args.run_root else []
    if not roots:
        inv = _inventory(args)
        if inv is not None:
            roots.append(inv.run_dir)
        roots.append("runs")
    for root in dict.fromkeys(roots):
        report = latest_preflight_report(root)
        if report is not None:
            return load_cluster_facts_from_report(report)
    raise UsageError(f"no cluster facts: no preflight report in {' or '.join(dict.fromkeys(roots))} "
                     f"(run `cluster preflight`), or pass --gpus-per-node G with --gpu-model NAME "
                     f"or --gpu-memory-gib M")


def render_text(plan: Plan, validation: dict[str, Any] | None) -> str:
    """The plan for a terminal."""
    g = plan.gpu
    m = plan.memory
    ep = f"on (EP {plan.expert_parallel_size})" if plan.enable_expert_parallel else "off"
    lines = [
        f"cluster plan: {plan.model_name} on {g['nodes']} node(s) × {g['gpus_per_node']} × "
        f"{g['model']} ({m.total_gib:.1f} GiB, {'NVLink' if g['nvlink'] else 'no NVLink'})",
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
    args = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                    for k, v in plan.engine_args.items()
                    if k not in ("model",) and v is not False)
    lines.append(f"  engine args  {args}")
    lines.append("reasons:")
    lines += [f"  {r}" for r in plan.reasons]
    if plan.warnings:
        lines.append("warnings:")
        lines += [f"  {w}" for w in plan.warnings]
    if validation:
        lines.append(f"validation: {validation['status']}: {validation['detail']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        info = load_model_info(_model_path(args))
        facts = cluster_facts(args)
        options = PlanOptions(
            max_model_len=args.max_model_len, min_concurrency=args.min_concurrency,
            kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
            workload=args.workload, tokens_per_s_per_gpu=args.tokens_per_s_per_gpu,
            served_model_name=args.served_model_name)
        plan = make_plan(info, facts, options)
    except ClusterError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        print(f"cluster plan: {safe_line(exc)}", file=sys.stderr)
        return 2
    check = None if args.no_validate else validate_engine_args(plan.engine_args)
    doc = plan.to_dict()
    from cluster.planning.fabric_needs import fabric_needs, render as render_fabric

    doc["fabric"] = fabric_needs(info, plan, facts)
    doc["validation"] = check.to_dict() if check else {"status": "skipped", "detail": "--no-validate"}
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
        print(render_text(plan, doc["validation"]))
        print("\n".join(render_fabric(doc["fabric"])))
        if args.out:
            print(f"plan written to {args.out}")
    if check is not None and not check.ok:
        print(f"cluster plan: engine args rejected by vLLM: {safe_line(check.detail)}",
              file=sys.stderr)
        return 2
    return 1 if plan.warnings else 0
