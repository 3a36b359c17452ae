"""On a node, after `cluster deploy`: the distributed-init lines of the engine's ranks from the
logs Ray keeps here, for cluster/serving/engine_transport.py. Prints one JSON document:

    engine_logs LOGS_DIR SINCE_UNIX_S
    {"dir": LOGS_DIR, "files": [{"path": name, "lines": [...]}], "truncated": bool,
     "error": null | "why"}

Reads the worker logs (worker-*.out / worker-*.err, the replica's and the rank actors' stdout and
stderr) and Serve's replica logs (serve/replica_*.log) modified since SINCE, and keeps the lines
that say how the ranks communicate: NCCL INFO lines about channels, the network and
communicator init (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET), and vLLM's process-group
lines (`world_size=... backend=gloo`, `rank R in world size W is assigned as ...`), and its
compile-cache lines (the cache directory used, loaded or compiled: cluster/serving/compile_cache.py).

Bounded: at most MAX_FILES files, the first MAX_READ bytes of each, MAX_LINES lines kept in all,
each cut at LINE_MAX characters. The logs directory may be Ray's `session_latest` link, which
must resolve inside Ray's temp dir (the parent of LOGS_DIR's session link); file entries are
never followed through a symbolic link (O_NOFOLLOW). Read-only. Stdlib only, Python 3.8+.
"""

import json
import os
import re
import stat
import sys

MAX_FILES = 4000
MAX_READ = 8 << 20
MAX_LINES = 4000
LINE_MAX = 1000
NAME_RE = re.compile(r"^(worker-[0-9a-f]{1,64}-[0-9a-f]{1,64}-\d{1,10}\.(out|err)|"
                     r"worker-[0-9a-f]{1,64}-\d{1,10}-\d{1,10}\.(out|err)|"
                     r"replica_[A-Za-z0-9_.-]{1,200}\.log)$")
KEEP_RE = re.compile(r"NCCL INFO (Channel \d|.*via (NET|P2P|SHM)|Using network|NET/|"
                     r"comm 0x|Init COMPLETE|ncclCommInitRank)|"
                     r"distributed_init_method=\S+ backend=|is assigned as DP rank|"
                     r"/torch_compile_cache/|Compiling a graph for compile range|"
                     r"Directly load the compiled graph")


def candidates(logs_dir, since):
    """(name, path) of the log files to read, newest first."""
    found = []
    for sub in ("", "serve"):
        folder = os.path.join(logs_dir, sub) if sub else logs_dir
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if not NAME_RE.match(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mtime >= since:
                found.append((st.st_mtime, os.path.join(sub, entry.name) if sub else entry.name,
                              entry.path))
    found.sort(reverse=True)
    return [(name, path) for _, name, path in found[:MAX_FILES]]


def kept_lines(path, budget):
    """The kept lines of the file's head (no symbolic link followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return []
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_READ)
    except OSError:
        return []
    out = []
    for raw in data.decode("utf-8", "replace").splitlines():
        if KEEP_RE.search(raw):
            out.append(raw[:LINE_MAX])
            if len(out) >= budget:
                break
    return out


def safe_dir(logs_dir):
    """The logs directory when it resolves inside the directory holding Ray's session link
    (e.g. /tmp/ray/session_latest/logs -> /tmp/ray/session_2026-.../logs), else None."""
    session = os.path.dirname(os.path.abspath(logs_dir))
    root = os.path.realpath(os.path.dirname(session))
    real = os.path.realpath(logs_dir)
    if not real.startswith(root + os.sep) or not os.path.isdir(real):
        return None
    return real


def main(argv):
    if len(argv) != 2:
        raise SystemExit("usage: engine_logs LOGS_DIR SINCE_UNIX_S")
    logs_dir, since = argv[0], float(argv[1])
    doc = {"dir": logs_dir, "files": [], "truncated": False, "error": None}
    real = safe_dir(logs_dir)
    if real is None:
        doc["error"] = "no Ray logs directory at " + logs_dir
        return doc
    budget = MAX_LINES
    for name, path in candidates(real, since):
        if budget <= 0:
            doc["truncated"] = True
            break
        lines = kept_lines(path, budget)
        if lines:
            doc["files"].append({"path": name, "lines": lines})
            budget -= len(lines)
    return doc


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
