"""`cluster deploy --stage-caches` (issue 27): vLLM's compile cache of the deployment staged to
every node that may run a rank, through the model relay (playbooks/relay.py: a fresh secret per
run, node IP + a port of expectations.model_relay.ports, Range resume, sha256 before rename,
never through a symbolic link, writes only inside the cache directory).

    before the start   the directories this app's last deploy record names (compile_cache.dirs)
                       are staged as a union: each file from the first node holding it to every
                       node without it (cluster/serving/compile_cache.py union_plan); then manifests
                       again: a node is verified when it holds every staged file with its sha256
    after RUNNING      the ranks' own log lines (node_programs/engine_logs.py) say which
                       directory each rank used and whether it loaded or compiled; each
                       replica's staged_cache is judged from them; the directories are staged
                       the same way, so a replacement gang, a scale-out or a redeploy on other
                       nodes starts warm

Where the cache lives on a node: VLLM_CACHE_ROOT of the deployment's --env, else of the node's
inventory env, else the root the ranks' lines show when it is vLLM's default (~/.cache/vllm of
root or a /home user; the same path on every node set up alike). Any other root from a line is
refused. On the node the relay walks the path from / without following a link and writes as the
directory's owner (node_programs/model_copy.py enter): a link in the user's home is refused.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from cluster.serving import compile_cache
from cluster.serving.compile_cache import CacheDir
from cluster.nodes.inventory import Inventory, Node
from cluster.remedy.model_relay import NodeResult
from cluster.remedy.model_sync import Manifest, still_different
from cluster.nodes.remote import Session
from playbooks.relay import manifests, run_relay

_MIB = 1 << 20


def root_of(node: Node, spec_env: Mapping[str, str], seen_root: str) -> str | None:
    """The node's VLLM_CACHE_ROOT: the deployment's env, the node's env, else the one seen
    (when it is vLLM's default: compile_cache.node_root)."""
    key = compile_cache.CACHE_ROOT_ENV
    return compile_cache.node_root(spec_env.get(key) or node.env.get(key), seen_root)


def stage(inv: Inventory, session: Session, dirs: Sequence[CacheDir], nodes: Sequence[Node],
          spec_env: Mapping[str, str], local_root: bool,
          say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Stage each directory's union to every node; the deploy record's part for one stage:
    {"dirs": [...], "nodes": {node: {status, files, bytes, seconds, verified, detail}},
     "conflicts": [...], "seconds"}."""
    start = time.monotonic()
    results: dict[str, list[NodeResult]] = {n.name: [] for n in nodes}
    landed: list[list[str]] = []
    conflicts: list[str] = []
    for d in dirs:
        where = {n.name: root_of(n, spec_env, d.root) for n in nodes}
        usable = [n for n in nodes if where[n.name]]
        dir_of = {n.name: d.on_root(where[n.name]).path for n in usable}
        for r in _stage_dir(inv, session, d, usable, dir_of, local_root, say, conflicts):
            results[r.node].append(r)
            if r.status == "copied":
                landed.append([r.node, d.root, d.sub])
        for n in nodes:
            if not where[n.name]:
                results[n.name].append(NodeResult(n.name, "failed", 0, 0.0, False,
                                                  "no cache root to write: set VLLM_CACHE_ROOT "
                                                  "(absolute, no '..') in the node's env or "
                                                  "--env"))
    return {"dirs": [d.to_dict() for d in dirs],
            "nodes": {n: _fold(rs) for n, rs in results.items()},
            "landed": landed, "conflicts": conflicts[:50],
            "seconds": round(time.monotonic() - start, 3)}


def _stage_dir(inv, session: Session, d: CacheDir, nodes: Sequence[Node], dir_of: Mapping[str, str],
               local_root: bool, say, conflicts: list[str]) -> list[NodeResult]:
    """One directory: manifests everywhere, one relay per contributing node, verified."""
    by_name = {n.name: n for n in nodes}
    found = manifests(inv, session, nodes, local_root, lambda n: dir_of[n.name])
    failed = [NodeResult(n, "failed", 0, 0.0, False, f"no manifest: {m}")
              for n, m in found.items() if isinstance(m, str)]
    held = {n: m for n, m in found.items() if isinstance(m, Manifest)}
    order = [n.name for n in nodes if n.name in held]
    union = compile_cache.union_plan(held, order)
    conflicts += [f"{d.sub}/{p}" for p in union.conflicts]
    moved: dict[str, list] = {n: [] for n in order}
    for source in union.sources:
        busy = source.busy
        if not busy:
            continue
        say(f"compile cache {d.sub[:40]}: {len(source.reference.files)} file(s) from "
            f"{source.source} to {', '.join(busy)}")
        report = run_relay(inv, session, by_name[source.source], source.reference,
                           {n: source.plans[n] for n in busy}, {n: by_name[n] for n in busy},
                           local_root, lambda n: dir_of[n.name], say)
        for n in busy:
            moved[n].append((source, report))
    after = manifests(inv, session, [by_name[n] for n in order], local_root,
                      lambda n: dir_of[n.name])
    return failed + [_judge(n, moved[n], after.get(n), union) for n in order]


def _judge(node: str, moved: list, now, union) -> NodeResult:
    """A node after the relays: every file of the union (but conflicts) there with its sha256."""
    files = sum(len(s.plans[node].files) for s, _ in moved)
    nbytes = sum(s.plans[node].bytes for s, _ in moved)
    seconds = sum(r.progress[node].seconds for _, r in moved if node in r.progress)
    errors = [r.errors[node] for _, r in moved if node in r.errors]
    if errors:
        return NodeResult(node, "failed", nbytes, seconds, False, "; ".join(errors)[:400])
    if not isinstance(now, Manifest):
        return NodeResult(node, "failed", nbytes, seconds, False, f"not verified: {now}")
    left = [p for s in union.sources if s.source != node
            for p in still_different(s.reference, now)]
    if left:
        return NodeResult(node, "failed", nbytes, seconds, False,
                          f"still missing after the copy: {', '.join(left[:4])}")
    if not files:
        return NodeResult(node, "ok", 0, 0.0, True, "already held every file")
    return NodeResult(node, "copied", nbytes, seconds, True,
                      f"{files} file(s), {nbytes / _MIB:.1f} MiB; sha256 verified")


def _fold(results: Sequence[NodeResult]) -> dict[str, Any]:
    """A node's results over the directories, as one {status, bytes, seconds, verified}."""
    if not results:
        return {"status": "ok", "bytes": 0, "seconds": 0.0, "verified": True, "detail": ""}
    status = "failed" if any(r.status == "failed" for r in results) else \
        "copied" if any(r.status == "copied" for r in results) else "ok"
    return {"status": status, "bytes": sum(r.bytes for r in results),
            "seconds": round(sum(r.seconds for r in results), 3),
            "verified": all(r.verified for r in results),
            "detail": "; ".join(r.detail for r in results if r.detail)[:600]}


def landed_pairs(stage_doc: Mapping[str, Any] | None) -> set[tuple[str, CacheDir]]:
    """(node, CacheDir) pairs that received files in a stage document."""
    out = set()
    for node, root, sub in (stage_doc or {}).get("landed") or ():
        d = compile_cache.cache_dir(root, sub)
        if d is not None:
            out.add((node, d))
    return out


def rank_nodes(nodes: Sequence[Node], replicas: Sequence[dict]) -> list[Node]:
    """The staging nodes that run one of the replicas' ranks (their logs say what they used)."""
    names = {r.get("node") for rep in replicas for r in rep.get("ranks") or ()}
    return [n for n in nodes if n.name in names]


def previous_dirs(run_root: str, app: str) -> tuple[CacheDir, ...]:
    """The cache directories the newest deploy record of `app` that named any holds."""
    from cluster.serving.engine_transport import deploy_records

    for _, doc in deploy_records(run_root):
        if isinstance(doc, dict) and doc.get("name") == app:
            dirs = compile_cache.recorded_dirs(doc)
            if dirs:
                return dirs
    return ()


def before_start(inv: Inventory, session: Session, spec, nodes: Sequence[Node], local_root: bool,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """The deploy record's `compile_cache`, with the stage of this app's known directories."""
    dirs = previous_dirs(inv.run_dir, spec.name)
    doc: dict[str, Any] = {"dirs": [d.to_dict() for d in dirs], "ranks": [],
                           "before_start": None, "after_start": None}
    if not dirs:
        doc["before_start"] = {"dirs": [], "nodes": {}, "detail": "no earlier deployment of "
                               f"{spec.name} named a compile-cache directory: nothing to stage"}
        return doc
    say(f"staging {len(dirs)} compile-cache director(ies) of {spec.name} to "
        f"{len(nodes)} node(s) before the start")
    doc["before_start"] = stage(inv, session, dirs, nodes, spec.env, local_root, say)
    return doc


def after_start(inv: Inventory, session: Session, spec, nodes: Sequence[Node],
                replicas: Sequence[dict], doc: dict[str, Any],
                logs: Mapping[str, Sequence[str]], local_root: bool,
                say: Callable[[str], None]) -> list[str]:
    """Each replica's staged_cache (from its ranks' lines in `logs`: node -> texts since the
    start), then the stage of the directories they used; returns warnings (a node the cache
    did not reach)."""
    readings = compile_cache.read_ranks({n.name: logs.get(n.name, ())
                                         for n in rank_nodes(nodes, replicas)})
    landed = landed_pairs(doc.get("before_start"))
    for rep in replicas:
        rep.update(compile_cache.replica_verdict(rep.get("ranks") or [], readings, landed))
    doc["ranks"] = [r.to_dict() for r in readings]
    dirs = compile_cache.dirs_of(readings)
    if not dirs:
        doc["after_start"] = {"dirs": [], "nodes": {}, "detail": "the ranks named no "
                              "compile-cache directory (compile mode off?): nothing to stage"}
        return ["--stage-caches: the ranks' lines name no compile-cache directory"]
    doc["dirs"] = [d.to_dict() for d in dirs]
    say(f"staging the compile cache the ranks used to {len(nodes)} node(s)")
    doc["after_start"] = stage(inv, session, dirs, nodes, spec.env, local_root, say)
    return [f"compile cache not staged onto {n}: {r['detail']}"
            for n, r in doc["after_start"]["nodes"].items() if r["status"] == "failed"]
