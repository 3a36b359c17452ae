"""vLLM's compile cache across a deployment's nodes (issue 27), pure: which cache directory each
engine rank used and whether it loaded or compiled (read from the ranks' own log lines), and
the union of the nodes' copies of one cache directory as relay plans (one per source node).

vLLM's layout (vllm/compilation/decorators.py, backends.py, compiler_interface.py; kept exactly):

    $VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<sha256>/rank_<r>_<dp>/model
    $VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<sha256>/inductor_cache/...
    $VLLM_CACHE_ROOT/torch_compile_cache/<hash10>/rank_<r>_<dp>/...   (without AOT compile)

The hash leaves out the rank, node rank, master address and VLLM_HOST_IP (ParallelConfig /
envs.compile_factors), so one configuration has one directory on every node; each rank
compiles only its own rank_<r>_<dp> subdirectory (PP 2: each node its own stage). Staging the
union of the directory to every node that may run a rank lets any rank start warm anywhere.

The lines read (vLLM's INFO lines, prefixed by its worker processes as `(Worker_PP1 pid=N)`):
    loaded:   "Directly load AOT compilation from path P"
              "Directly load the compiled graph(s) for compile range ... from the cache"
    compiled: "saved AOT compiled function to P"
              "Compiling a graph for compile range ... takes S s"
    the dir:  "Using cache directory: P for vLLM's torch.compile"
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from cluster.remedy.model_sync import CopyPlan, Manifest

CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"
SUBDIR = "torch_compile_cache"
MAX_LINES = 20_000

_PREFIX = re.compile(r"\((Worker[A-Za-z_0-9]{0,40}) pid=(\d{1,10})\)")
_MARK = "/" + SUBDIR + "/"
_AFTER = re.compile(r"(torch_aot_compile/[0-9a-f]{64}|[0-9a-f]{10})/rank_(\d{1,6})_(\d{1,6})"
                    r"(?![0-9])")
_PATH_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/+@-")
_LOADED = ("Directly load AOT compilation from path", "Directly load the compiled graph(s)")
_COMPILED = ("saved AOT compiled function to", "Compiling a graph for compile range",
             "Compiling model again due to a load failure")
_LOAD_FAILED = "due to a load failure from "
_SUB = re.compile(r"(torch_aot_compile/[0-9a-f]{64}|[0-9a-f]{10})\Z")
_ROOT = re.compile(r"/[A-Za-z0-9._/+@-]{0,3000}\Z")
_SKIPPED_SUFFIXES = (".tmp", ".lock")       # vLLM's in-flight saves; inductor's lock files
# vLLM's default root (~/.cache/vllm) of root or a /home user: the only root taken from a log
# line or a record without VLLM_CACHE_ROOT configured (the relay writes there as the owner of
# the directory, never through a link: node_programs/model_copy.py enter)
_DEFAULT_ROOT = re.compile(r"/(root|home/[A-Za-z0-9._-]{1,64})/\.cache/vllm\Z")


@dataclass(frozen=True)
class CacheDir:
    """One configuration's cache directory: `root` (VLLM_CACHE_ROOT) and the part under
    torch_compile_cache (`torch_aot_compile/<sha256>` or `<hash10>`)."""

    root: str
    sub: str

    @property
    def path(self) -> str:
        return f"{self.root}/{SUBDIR}/{self.sub}"

    def on_root(self, root: str) -> "CacheDir":
        return CacheDir(root, self.sub)

    def to_dict(self) -> dict[str, str]:
        return {"root": self.root, "dir": self.sub}


def cache_dir(root: Any, sub: Any) -> CacheDir | None:
    """A CacheDir from untrusted text (a log line, a deploy record), or None when either part
    is not what vLLM writes (an absolute root without `..`, the hash directory's own name)."""
    if not isinstance(root, str) or not isinstance(sub, str) or not _ROOT.match(root) \
            or not _SUB.match(sub) or any(p in ("..", ".") for p in root.split("/")):
        return None
    return CacheDir(root.rstrip("/") or "/", sub)


def node_root(configured: str | None, seen: str) -> str | None:
    """The cache root to stage into on a node: the configured VLLM_CACHE_ROOT (checked), else
    the root a rank's line or a record shows when it is vLLM's default for root or a /home
    user; None otherwise (the relay never writes where only a log line points)."""
    if configured:
        d = cache_dir(configured, "0000000000")
        return d.root if d else None
    return seen if _DEFAULT_ROOT.match(seen) else None


@dataclass(frozen=True)
class RankCache:
    """What one engine rank's lines say about its compile cache."""

    node: str
    rank: int
    dp: int
    dir: CacheDir
    state: str               # loaded | compiled | unknown
    worker: str              # the worker's log prefix, e.g. "Worker_PP1 pid=4242"
    note: str = ""           # vLLM's reason when a load from the cache failed

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "rank": self.rank, "dp_rank": self.dp,
                "state": self.state, "worker": self.worker, "note": self.note,
                **self.dir.to_dict()}


def read_ranks(logs: Mapping[str, Sequence[str]]) -> tuple[RankCache, ...]:
    """node -> log texts (newest file first: cluster/node_programs/engine_logs.py) -> one
    reading per (node, rank, dp rank, directory): the newest worker that named it."""
    out: dict[tuple, RankCache] = {}
    for node, texts in logs.items():
        for text in texts:
            for reading in _file_readings(node, text):
                key = (node, reading.rank, reading.dp, reading.dir)
                out.setdefault(key, reading)
    return tuple(sorted(out.values(), key=lambda r: (r.rank, r.dp, r.node, r.dir.sub)))


def _file_readings(node: str, text: str) -> list[RankCache]:
    """One file's readings: its lines grouped by the worker prefix."""
    paths: dict[str, tuple[CacheDir, int, int]] = {}
    states: dict[str, set[str]] = {}
    notes: dict[str, str] = {}
    for line in text.splitlines()[:MAX_LINES]:
        m = _PREFIX.search(line)
        worker = f"{m.group(1)} pid={m.group(2)}" if m else ""
        found = _path_in(line) if worker not in paths else None
        if found:
            paths[worker] = found
        if any(s in line for s in _LOADED):
            states.setdefault(worker, set()).add("loaded")
        if any(s in line for s in _COMPILED):
            states.setdefault(worker, set()).add("compiled")
        if _LOAD_FAILED in line and worker not in notes:
            notes[worker] = "load failed: " + line.partition("reason: ")[2][:300]
    out = []
    for worker, (d, rank, dp) in paths.items():
        seen = states.get(worker, set())
        state = "compiled" if "compiled" in seen else "loaded" if "loaded" in seen else "unknown"
        out.append(RankCache(node, rank, dp, d, state, worker, notes.get(worker, "")))
    return out


def _path_in(line: str) -> tuple[CacheDir, int, int] | None:
    """(directory, rank, dp rank) of the first cache path in the line, or None (linear: the
    root is the run of path characters before /torch_compile_cache/)."""
    at = line.find(_MARK)
    if at < 0:
        return None
    after = _AFTER.match(line, at + len(_MARK))
    start = at
    while start > 0 and line[start - 1] in _PATH_CHARS:
        start -= 1
    d = cache_dir(line[start:at], after.group(1)) if after else None
    return (d, int(after.group(2)), int(after.group(3))) if d else None


def replica_verdict(ranks: Sequence[Mapping[str, Any]], readings: Sequence[RankCache],
                    staged: Iterable[tuple[str, CacheDir]]) -> dict[str, Any]:
    """One replica (its node ranks [{node, ...}] as deploy --json lists them): staged_cache
    is true when every node of the replica has a reading, every reading there says "loaded",
    and at least one of them read a directory that was staged onto its node before the start
    (`staged`: (node, CacheDir) pairs that received files)."""
    nodes = [r.get("node") for r in ranks if isinstance(r, Mapping)]
    mine = [r for r in readings if r.node in nodes]
    landed = set(staged)
    loaded = bool(nodes) and all(any(r.node == n for r in mine) for n in nodes) \
        and all(r.state == "loaded" for r in mine)
    from_stage = [r for r in mine if (r.node, r.dir) in landed]
    if not mine:
        why = "no compile-cache line from its ranks (compile mode off, e.g. enforce_eager?)"
    elif not loaded:
        why = "compiled: " + ", ".join(f"rank {r.rank} on {r.node}"
                                       + (f" ({r.note})" if r.note else "")
                                       for r in mine if r.state != "loaded")
    elif not from_stage:
        why = "loaded its nodes' own caches (nothing staged onto them before this start)"
    else:
        why = "loaded staged caches: " + ", ".join(f"rank {r.rank} on {r.node}"
                                                   for r in from_stage)
    return {"staged_cache": loaded and bool(from_stage), "cache_detail": why,
            "cache_ranks": [r.to_dict() for r in mine]}


@dataclass(frozen=True)
class SourcePlan:
    """One relay of a union: the files `source` contributes and what each target lacks."""

    source: str
    reference: Manifest
    plans: Mapping[str, CopyPlan]

    @property
    def busy(self) -> list[str]:
        return [n for n, p in self.plans.items() if p.files]


@dataclass(frozen=True)
class UnionPlan:
    sources: tuple[SourcePlan, ...]
    conflicts: tuple[str, ...]          # paths held with different bytes: left as they are


def stageable(path: str) -> bool:
    return not path.endswith(_SKIPPED_SUFFIXES)


def union_plan(manifests: Mapping[str, Manifest], order: Sequence[str]) -> UnionPlan:
    """The union of the nodes' copies of one directory: each file from the first node in
    `order` holding it, to every node of `order` without that path. A path two nodes hold
    with different bytes is not staged at all (nothing of vLLM's own is overwritten)."""
    owner: dict[str, tuple[str, Any]] = {}
    conflicts: set[str] = set()
    for node in order:
        for f in manifests[node].files:
            if not stageable(f.path):
                continue
            if f.path not in owner:
                owner[f.path] = (node, f)
            elif owner[f.path][1] != f:
                conflicts.add(f.path)
    sources = []
    for node in order:
        files = tuple(f for n, f in owner.values() if n == node and f.path not in conflicts)
        if not files:
            continue
        reference = Manifest(True, tuple(sorted(files, key=lambda f: f.path)))
        plans = {}
        for target in order:
            if target == node:
                continue
            have = manifests[target].by_path
            plans[target] = CopyPlan(target, tuple(f for f in reference.files
                                                   if f.path not in have), (), ())
        sources.append(SourcePlan(node, reference, plans))
    return UnionPlan(tuple(sources), tuple(sorted(conflicts)))


def dirs_of(readings: Sequence[RankCache]) -> tuple[CacheDir, ...]:
    """The distinct cache directories the readings name, in rank order."""
    return tuple(dict.fromkeys(r.dir for r in readings))


def recorded_dirs(doc: Any) -> tuple[CacheDir, ...]:
    """The cache directories a deploy record's `compile_cache.dirs` names (invalid entries
    dropped: the record is a file on the laptop, checked like any input)."""
    cache = doc.get("compile_cache") if isinstance(doc, Mapping) else None
    raw = cache.get("dirs") if isinstance(cache, Mapping) else None
    out = []
    for entry in raw[:64] if isinstance(raw, list) else ():
        d = cache_dir(entry.get("root"), entry.get("dir")) if isinstance(entry, Mapping) \
            else None
        if d is not None:
            out.append(d)
    return tuple(dict.fromkeys(out))
