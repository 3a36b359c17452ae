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
each cut at LINE_MAX characters, MAX_SECONDS of reading in all. The logs directory may be Ray's
`session_latest` link, which must resolve inside Ray's temp dir (the parent of LOGS_DIR's session
link); from that temp dir on every directory (the resolved logs directory, `serve/`) is opened
relative to the one before with O_NOFOLLOW, and each file with O_NOFOLLOW | O_NONBLOCK and read
only when the opened file is a regular one (fstat): a link, a FIFO or a device swapped in after
the listing is skipped, never waited on. Read-only. Stdlib only, Python 3.8+.
"""

import json
import os
import re
import stat
import sys
import time

MAX_FILES = 4000
MAX_READ = 8 << 20
MAX_LINES = 4000
LINE_MAX = 1000
MAX_SECONDS = 30.0
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | CLOEXEC
NAME_RE = re.compile(r"^(worker-[0-9a-f]{1,64}-[0-9a-f]{1,64}-\d{1,10}\.(out|err)|"
                     r"worker-[0-9a-f]{1,64}-\d{1,10}-\d{1,10}\.(out|err)|"
                     r"replica_[A-Za-z0-9_.-]{1,200}\.log)$")
KEEP_RE = re.compile(r"NCCL INFO (Channel \d|.*via (NET|P2P|SHM)|Using network|NET/|"
                     r"comm 0x|Init COMPLETE|ncclCommInitRank)|"
                     r"distributed_init_method=\S+ backend=|is assigned as DP rank|"
                     r"/torch_compile_cache/|Compiling a graph for compile range|"
                     r"Directly load the compiled graph")


def candidates(folders, since):
    """(name, directory fd, file name) of the log files to read, newest first; `folders`:
    {"": the logs directory's fd, "serve": serve/'s fd}."""
    found = []
    for sub, dfd in sorted(folders.items()):
        try:
            entries = list(os.scandir(dfd))
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
                found.append((st.st_mtime, sub + "/" + entry.name if sub else entry.name,
                              sub, entry.name))
    found.sort(reverse=True)
    return [(name, folders[sub], file) for _, name, sub, file in found[:MAX_FILES]]


def read_head(dfd, name):
    """The first MAX_READ bytes of the regular file `name` in dfd, or None: opened without
    following a link and without waiting (a FIFO has no writer), then checked to be regular."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, left = [], MAX_READ
        while left > 0:
            block = os.read(fd, min(left, 1 << 20))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def kept_lines(dfd, name, budget):
    """The kept lines of the file's head (read_head)."""
    data = read_head(dfd, name)
    if data is None:
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


def open_folders(logs_dir):
    """{"": fd of the logs directory, "serve": fd of its serve/} ({} when there is none): the
    resolved path walked from Ray's temp dir one directory at a time with O_NOFOLLOW, so a link
    planted after the check (or a serve/ that is a link) is not followed."""
    real = safe_dir(logs_dir)
    if real is None:
        return {}
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(logs_dir))))
    try:
        fd = os.open(root, DIR_FLAGS)
    except OSError:
        return {}
    try:
        for name in os.path.relpath(real, root).split(os.sep):
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError:
        os.close(fd)
        return {}
    folders = {"": fd}
    try:
        folders["serve"] = os.open("serve", DIR_FLAGS, dir_fd=fd)
    except OSError:
        pass
    return folders


def main(argv):
    if len(argv) != 2:
        raise SystemExit("usage: engine_logs LOGS_DIR SINCE_UNIX_S")
    logs_dir, since = argv[0], float(argv[1])
    doc = {"dir": logs_dir, "files": [], "truncated": False, "error": None}
    folders = open_folders(logs_dir)
    if not folders:
        doc["error"] = "no Ray logs directory at " + logs_dir
        return doc
    budget = MAX_LINES
    end = time.monotonic() + MAX_SECONDS
    try:
        for name, dfd, file in candidates(folders, since):
            if budget <= 0 or time.monotonic() > end:
                doc["truncated"] = True
                break
            lines = kept_lines(dfd, file, budget)
            if lines:
                doc["files"].append({"path": name, "lines": lines})
                budget -= len(lines)
    finally:
        for fd in folders.values():
            os.close(fd)
    return doc


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
