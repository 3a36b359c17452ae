"""`cluster model pull SOURCE [--revision R] [--path DIR] [--nodes PATTERN] [--dry-run] [--json]`:
one copy of a model directory (on the laptop, on a node, or on the hub) on every node, relayed
node to node (playbooks/model_pull.py)."""

from __future__ import annotations

import argparse
import os

from cluster.commands._common import (add_json, add_nodes, emit_json, path_value,
                                      recorded_run_on_nodes, stdout, text_value)
from cluster.base.errors import ClusterError
from cluster.base.textsafe import terminal_safe_line

PATTERN_MAX = 64


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "model", help="model weights on every node: pull once, relay node to node",
        description="Model directories on the nodes. `pull` lands SOURCE on one node and relays "
                    "it node to node to every other in a pipeline.")
    add_json(p)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True, parser_class=type(p))
    pull = verbs.add_parser(
        "pull", help="copy SOURCE to --path on every node (a pipelined relay)",
        description="SOURCE: a local PATH (a directory on this machine: one that exists "
                    "here or starts with / ./ ../ ~, checked first; served to the first node "
                    "through an SSH remote forward), NODE:PATH (a directory on one node) or a "
                    "Hugging Face repo id (downloaded on the head by huggingface_hub as the SSH "
                    "user, never root: HF_TOKEN and HF_ENDPOINT (https) from the head's env in "
                    "the inventory). No '..' in --path "
                    "or NODE:PATH. The files then travel node to node "
                    "(a chain, or a tree on large clusters), sha256 verified before each "
                    "rename, the manifests compared afterwards. Exit 0 every node verified, "
                    "1 with notes, 2 a node failed (a rerun resumes it).")
    pull.add_argument("source", metavar="SOURCE", type=text_value)
    pull.add_argument("--revision", metavar="R", type=text_value,
                      help="the hub revision (branch, tag, commit)")
    pull.add_argument("--path", metavar="DIR", type=path_value,
                      help="where the files land on every node (default: model.path)")
    pull.add_argument("--allow-patterns", metavar="GLOB", action="append", default=[],
                      help="hub source: only files matching (huggingface_hub's allow_patterns; "
                           "repeatable)")
    pull.add_argument("--ignore-patterns", metavar="GLOB", action="append", default=[],
                      help="hub source: skip files matching (huggingface_hub's ignore_patterns)")
    pull.add_argument("--allow-http-endpoint", action="store_true",
                      help="hub source: let HF_ENDPOINT be http to a loopback address (a local "
                           "mirror on the head); any other HF_ENDPOINT must be https")
    add_nodes(pull, help="only these nodes receive (names, globs, head, workers)")
    pull.add_argument("--dry-run", action="store_true",
                      help="print the relay's shape and each node's files; copy nothing")
    pull.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                      help="machine-readable output on stdout (also `cluster model --json pull`)")
    pull.set_defaults(handler=run)


def _options(args: argparse.Namespace):
    from cluster.base.errors import UsageError
    from playbooks.model_pull import PullOptions, node_path

    if args.revision is not None and (len(args.revision) > 256 or not all(
            c.isalnum() or c in "._-/" for c in args.revision)):
        raise UsageError("--revision: letters, digits and ._-/ only, at most 256")
    patterns = args.allow_patterns + args.ignore_patterns
    if len(patterns) > PATTERN_MAX or any(not p or len(p) > 512 for p in patterns):
        raise UsageError(f"--allow/--ignore-patterns: at most {PATTERN_MAX}, each 1-512 chars")
    if args.path is not None:
        node_path(args.path, "--path")
    return PullOptions(args.source, args.path, args.revision, args.nodes, args.dry_run,
                       tuple(args.allow_patterns), tuple(args.ignore_patterns),
                       local_root=hasattr(os, "geteuid") and os.geteuid() == 0,
                       allow_http_endpoint=args.allow_http_endpoint)


def run(args: argparse.Namespace) -> int:
    from playbooks import model_pull
    from playbooks.outcome import never_confirm

    options = _options(args)
    run_, _nodes = recorded_run_on_nodes(args, "model-pull")
    code = 2
    try:
        with run_.session() as session:
            outcome = model_pull.run(run_.inventory, session, options, never_confirm,
                                     run_.event)
        code = outcome.exit_code
        emit_json(run_.record, "model-pull.json",
                  dict(outcome.to_dict(), run_dir=str(run_.path)), to_stdout=args.json)
    except ClusterError as exc:     # cluster/cli.py prints the one line (and --json's document)
        emit_json(run_.record, "model-pull.json",
                  {"source": options.source, "path": options.path, "dry_run": options.dry_run,
                   "error": str(exc), "nodes": {}, "run_dir": str(run_.path)},
                  to_stdout=False)
        raise
    finally:
        run_.finish(code)
    if not args.json:
        _render(outcome, run_)
    return code


def _render(outcome, run_) -> None:
    title = "model pull (dry run: nothing copied)" if outcome.dry_run else "model pull"
    stdout.print(f"{title}: {terminal_safe_line(outcome.source)} -> {outcome.path}",
                 markup=False)
    if outcome.shape is not None:
        stdout.print(f"relay: {outcome.shape.kind} (fan-out {outcome.shape.fanout}, depth "
                     f"{outcome.shape.depth}) from {outcome.shape.source}", markup=False)
        for line in outcome.shape.lines():
            stdout.print(f"  {line}", markup=False, soft_wrap=True)
    for name, r in outcome.nodes.items():
        stdout.print(f"{name:<16} {r.status:<8} {r.bytes / (1 << 20):>10.1f} MiB "
                     f"{r.seconds:>8.1f} s  verified={'yes' if r.verified else 'no'}  "
                     f"{terminal_safe_line(run_.scrub(r.detail))}", markup=False, soft_wrap=True)
    for note in outcome.notes:
        stdout.print(f"note: {terminal_safe_line(run_.scrub(note))}", markup=False)
    stdout.print(f"report: {run_.path / 'model-pull.json'}", markup=False)
