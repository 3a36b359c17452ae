"""`cluster fix [--checks LIST] [--nodes PATTERN] [--dry-run] [--yes] [--json] [--undo RUN]`:
repair what preflight found (playbooks/fix.py), or put back what a fix run changed."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cluster.commands._common import (add_changing, add_json, add_nodes, emit_json, path_value,
                                      recorded_run_on_nodes, stdout)
from cluster.base.errors import UsageError
from cluster.remedy.fix_undo import read_record
from cluster.report.fold import Row, fold
from cluster.report.render import fix_lines, folded_table
from playbooks import fix as fix_playbook

NAME_RE_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fix", help="repair what preflight found (check mode, idempotent, undo record)",
        description="Gather facts, judge them (the preflight checks), plan a fix for each "
                    "failed check that has a safe one, print the plan, confirm, apply per node "
                    "in parallel, then re-check. Exit 0 all ok afterwards, 1 only manual "
                    "items left, 2 a fix failed or a node was unreachable.")
    p.add_argument("--checks", metavar="LIST", type=_check_list,
                   help="only these checks, comma-separated (e.g. gpudirect,shm); "
                        "`versions` and `model` (copies model files) run only when named")
    add_nodes(p)
    p.add_argument("--undo", metavar="RUN", type=path_value,
                   help="restore the files and mounts a fix run changed (its run directory "
                        "or name)")
    add_changing(p)
    add_json(p)
    p.set_defaults(handler=run)


def _check_list(text: str) -> frozenset[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or len(names) > 64 or any(len(n) > 32 or set(n) - NAME_RE_CHARS for n in names):
        raise argparse.ArgumentTypeError("a comma-separated list of check ids (e.g. gpudirect,shm)")
    return frozenset(names)


def _local_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _undo_file(inv, run: str) -> Path:
    path = Path(run)
    try:
        if not path.is_absolute() and not path.exists():
            path = Path(inv.run_dir) / run
        record = path / fix_playbook.UNDO_FILE if path.is_dir() else path
        found = record.is_file()
    except OSError as exc:                          # a name the system cannot take
        raise UsageError(f"--undo {run[:80]}: {exc.strerror or exc}") from None
    if not found:
        raise UsageError(f"--undo {run}: no {fix_playbook.UNDO_FILE} there (the run directory "
                         f"of a `cluster fix` that changed something)")
    return record


def run(args: argparse.Namespace) -> int:
    run_, nodes = recorded_run_on_nodes(args, "fix")
    inv, record = run_.inventory, run_.record
    code = 2
    try:
        with run_.session() as session:
            if args.undo is not None:
                undo_file = _undo_file(inv, args.undo)
                read_record(undo_file)              # a malformed record: refused at once
                options = fix_playbook.UndoOptions(undo_file, _local_root(), args.dry_run)
                outcome = fix_playbook.undo(inv, session, options, run_.confirm, run_.event)
            else:
                options = fix_playbook.FixOptions(tuple(nodes), args.checks, args.dry_run,
                                                  args.yes, record.path, _local_root())
                outcome = fix_playbook.run(inv, session, options, run_.confirm, run_.event)
        code = outcome.exit_code
        payload = dict(outcome.to_dict(), run_dir=str(record.path), inventory=inv.path)
        emit_json(record, "fix.json", payload, to_stdout=args.json)
    finally:
        record.finish(code)
    if not args.json:
        render(outcome, args.dry_run)
        stdout.print(f"report: {record.path / 'fix.json'}")
    return code


def _detail(r) -> str:
    change = f"{r.before} -> {r.after}: " if r.status in ("changed", "failed") and r.before \
        else ""
    note = f" (note: {r.note})" if r.note else ""
    return change + r.summary + note


def render(outcome, dry_run: bool) -> None:
    """Identical results folded into one line per check ("ok on 3 nodes"), the nodes that
    differ listed with theirs; the next step of each manual item once."""
    results = outcome.results
    title = "fix plan (dry run: nothing was changed)" if dry_run else "cluster fix"
    nodes = {r.node for r in results if r.node}
    groups = fold(Row(r.node or "(cluster)", r.check, r.status, _detail(r), r.next_step)
                  for r in results)
    stdout.print(folded_table(groups, max(1, len(nodes)), title=title))
    for line in fix_lines(groups, max(1, len(nodes))):
        stdout.print(line)
    if dry_run:
        for r in results:
            for c in r.commands:
                stdout.print(f"[{r.node}] $ {c}", soft_wrap=True, markup=False)
    if outcome.restart_ray:
        stdout.print("restart Ray to apply the new memlock limit on: "
                     + ", ".join(outcome.restart_ray))
    if outcome.undo_file:
        stdout.print(f"undo: cluster fix --undo {Path(outcome.undo_file).parent}")
