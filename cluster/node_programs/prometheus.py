"""On the head: the node's own Prometheus for Ray's metrics, in four verbs, each printing one
JSON document (stdlib only, Python 3.8+).

    probe --root R --port P --wait S    which prometheus binary, Ray's generated config for the
                                        latest session (waits up to S s for Ray's dashboard to
                                        write it), our running Prometheus (from its pid file,
                                        only if that pid is a prometheus with our storage
                                        path) and whether it answers /-/ready
    start --root R --port P --binary B --config C --retention T --wait S
                                        starts B detached (own session, stdin /dev/null, log
                                        file), bound to 127.0.0.1:P, storage under R, writes
                                        the pid file, waits up to S s for /-/ready
    stop --root R                       ends our Prometheus (SIGTERM, then SIGKILL after 10 s)
                                        and removes the pid file; nothing else is touched
    dashboards --root R --wait S        the Grafana dashboards Ray generated for the latest
                                        session: {file name: JSON text}; retried for up to
                                        S s while Ray (re)writes them

R is Ray's temp dir (/tmp/ray by default). Our files live in R/cluster-prometheus/:
prometheus.pid, prometheus.log and data/ (the TSDB). That folder is this user's private one
(private_dir: made 0700; refused when it is a link, another user's, or writable by others), its
files are never opened through a link.
"""

import argparse
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request

from cluster.node_programs._common import create_private, private_dir

OWN_DIR = "cluster-prometheus"
CONFIG = ("session_latest", "metrics", "prometheus", "prometheus.yml")
DASHBOARDS = ("session_latest", "metrics", "grafana", "dashboards")
MAX_DASHBOARD_BYTES = 4 << 20
MAX_DASHBOARDS = 32
DASHBOARD_RETRY_S = 0.5
STOP_WAIT_S = 10.0
LOG_TAIL_BYTES = 2000


def own_dir(root):
    return os.path.join(root, OWN_DIR)


def paths(root):
    d = own_dir(root)
    return {"dir": d, "pid": os.path.join(d, "prometheus.pid"),
            "log": os.path.join(d, "prometheus.log"), "data": os.path.join(d, "data")}


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return None


def flag(args, name):
    prefix = "--%s=" % name
    for a in args:
        if a.startswith(prefix):
            return a[len(prefix):]
    return None


def ours(root, pid):
    """The command line of pid when it is a prometheus storing under our data dir, else None."""
    args = cmdline(pid)
    if not args or os.path.basename(args[0]) != "prometheus":
        return None
    if flag(args, "storage.tsdb.path") != paths(root)["data"]:
        return None
    return args


def read_pid(root):
    try:
        with open(paths(root)["pid"]) as fh:
            text = fh.read(32).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 1 << 22 else None


def ready(port, timeout=2.0):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % port, timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def log_tail(root):
    try:
        with open(paths(root)["log"], "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - LOG_TAIL_BYTES))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def config_path(root, wait_s):
    """The real path of Ray's generated config (waits for the dashboard to write it)."""
    link = os.path.join(root, *CONFIG)
    end = time.monotonic() + wait_s
    while not os.path.isfile(link) and time.monotonic() < end:
        time.sleep(0.5)
    return os.path.realpath(link) if os.path.isfile(link) else None


def running(root, port):
    pid = read_pid(root)
    args = ours(root, pid) if pid else None
    if args is None:
        return None
    return {"pid": pid, "config": flag(args, "config.file"),
            "listen": flag(args, "web.listen-address"),
            "retention": flag(args, "storage.tsdb.retention.time"), "ready": ready(port)}


def probe(a):
    binary = shutil.which("prometheus")
    return {"binary": binary, "config": config_path(a.root, a.wait),
            "running": running(a.root, a.port), "pid_file": read_pid(a.root)}


def start(a):
    p = paths(a.root)
    private_dir(p["dir"])
    os.makedirs(p["data"], mode=0o700, exist_ok=True)
    argv = [a.binary, "--config.file=" + a.config,
            "--web.listen-address=127.0.0.1:%d" % a.port,
            "--storage.tsdb.path=" + p["data"],
            "--storage.tsdb.retention.time=" + a.retention]
    log_fd = os.open(p["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(log_fd, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                cwd=p["dir"], start_new_session=True, close_fds=True)
    if os.path.lexists(p["pid"] + ".tmp"):
        os.unlink(p["pid"] + ".tmp")
    with os.fdopen(create_private(p["pid"] + ".tmp"), "w") as fh:
        fh.write("%d\n" % proc.pid)
    os.replace(p["pid"] + ".tmp", p["pid"])
    end = time.monotonic() + a.wait
    up = False
    while time.monotonic() < end and proc.poll() is None:
        if ready(a.port):
            up = True
            break
        time.sleep(0.5)
    return {"pid": proc.pid, "ready": up, "exit_code": proc.poll(),
            "log_tail": "" if up else log_tail(a.root)}


def stop(a):
    p = paths(a.root)
    pid = read_pid(a.root)
    if pid is None or ours(a.root, pid) is None:
        if os.path.exists(p["pid"]):
            os.remove(p["pid"])
        return {"stopped": None, "stale_pid": pid}
    os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + STOP_WAIT_S
    while ours(a.root, pid) is not None and time.monotonic() < end:
        time.sleep(0.2)
    killed = False
    if ours(a.root, pid) is not None:
        os.kill(pid, signal.SIGKILL)
        killed = True
    os.remove(p["pid"])
    return {"stopped": pid, "killed": killed}


def read_dashboards(d):
    """{name: text} of the directory's regular *.json files, no link followed, each bounded.
    FileNotFoundError when Ray removed the directory or a file while it was read."""
    names = sorted(n for n in os.listdir(d) if n.endswith(".json"))[:MAX_DASHBOARDS]
    out = {}
    for name in names:
        try:
            fd = os.open(os.path.join(d, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            continue                                  # a link or unreadable: not Ray's file
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_DASHBOARD_BYTES:
                out[name] = fh.read(MAX_DASHBOARD_BYTES + 1).decode("utf-8", "replace")
    return out


def complete(found):
    """Ray has finished writing: some dashboards, each a whole JSON document."""
    try:
        return bool(found) and all(isinstance(json.loads(t), dict) for t in found.values())
    except ValueError:
        return False


def dashboards(a):
    """Ray's dashboard rewrites this directory (rmtree, then the files) when it starts, so a
    read that meets a vanished file, no file or a half-written one is retried until --wait
    ends; then the last read is returned as it is."""
    d = os.path.join(a.root, *DASHBOARDS)
    end = time.monotonic() + a.wait
    found = {}
    while True:
        try:
            found = read_dashboards(d)
        except FileNotFoundError:
            found = {}
        except OSError:
            return {"dir": d, "dashboards": {}}
        if complete(found) or time.monotonic() >= end:
            return {"dir": d, "dashboards": found}
        time.sleep(DASHBOARD_RETRY_S)


def main(argv):
    ap = argparse.ArgumentParser(prog="prometheus")
    ap.add_argument("verb", choices=("probe", "start", "stop", "dashboards"))
    ap.add_argument("--root", required=True)
    ap.add_argument("--port", type=int, default=9090)
    ap.add_argument("--wait", type=float, default=0.0)
    ap.add_argument("--binary")
    ap.add_argument("--config")
    ap.add_argument("--retention", default="2d")
    a = ap.parse_args(argv)
    if not math.isfinite(a.wait):         # NaN passes min/max and would make a wait endless
        ap.error("--wait: expected a finite number of seconds")
    a.wait = min(max(a.wait, 0.0), 300.0)
    try:
        doc = {"probe": probe, "start": start, "stop": stop, "dashboards": dashboards}[a.verb](a)
    except PermissionError as exc:        # a refused folder or file: one line, no traceback
        raise SystemExit(str(exc))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
