"""On a node: TCP reachability between nodes, in three verbs, each printing one JSON document.

    listen --ports 6379,8076 --for 90 --tag RUN   listeners on the free ones (a detached process
                                                  that accepts and closes, and exits by itself
                                                  after --for seconds); busy ports are reported
                                                  (someone, e.g. Ray, already answers there)
    probe --targets 10.0.0.2:6379+8076,... --timeout 2
                                                  connects to every target at once; each is
                                                  ok, refused, timeout (dropped) or an OS error
    stop --tag RUN                                ends this run's listener (matched by its tag)

Read-only for the node: nothing is written but the listener's pid file under /tmp (removed on
exit), no rule or setting is changed.
"""

import errno
import json
import os
import selectors
import signal
import socket
import sys
import time

from cluster.node_programs._common import detach_grandchild, stop_tagged

MAX_TARGETS = 20000
MAX_PORTS = 256
MAX_AT_ONCE = 512
STOP_WAIT_S = 5.0


def pid_file(tag):
    return "/tmp/cluster-reach-%s.pid" % tag


def parse_ports(text):
    ports = [int(p) for p in text.split(",") if p]
    if len(ports) > MAX_PORTS or any(not 0 < p < 65536 for p in ports):
        raise SystemExit("bad --ports")
    return ports


def bind_all(ports):
    bound, busy, failed = [], [], {}
    socks = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            s.listen(64)
            s.setblocking(False)
        except OSError as exc:
            s.close()
            (busy.append(port) if exc.errno == errno.EADDRINUSE
             else failed.__setitem__(str(port), os.strerror(exc.errno or 0)))
            continue
        socks.append(s)
        bound.append(port)
    return socks, bound, busy, failed


def serve(socks, seconds, tag):
    """The detached listener: accept and close until the time is up or SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    end = time.monotonic() + seconds
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(min(left, 1.0)):
                try:
                    conn, _ = key.fileobj.accept()
                    conn.close()
                except OSError:
                    pass
    finally:
        try:
            os.unlink(pid_file(tag))
        except OSError:
            pass


def listen(args):
    ports = parse_ports(args["--ports"])
    seconds = float(args["--for"])
    tag = args["--tag"]
    if not (0 < seconds <= 3600) or not tag.isalnum():
        raise SystemExit("bad --for or --tag")
    socks, bound, busy, failed = bind_all(ports)
    pid = None
    if socks:
        read, write = os.pipe()
        first = os.fork()
        if first == 0 and detach_grandchild():
            os.close(read)
            with open(pid_file(tag), "w") as f:
                f.write(str(os.getpid()))
            os.write(write, str(os.getpid()).encode())
            os.close(write)
            serve(socks, seconds, tag)
            os._exit(0)
        if first == 0:
            os._exit(0)
        os.close(write)
        for s in socks:
            s.close()
        os.waitpid(first, 0)
        got = os.read(read, 32)
        os.close(read)
        pid = int(got) if got.isdigit() else None
    return {"listening": bound, "busy": busy, "failed": failed, "pid": pid}


def probe(args):
    targets = []
    for item in args["--targets"].split(","):     # host:port+port+...,host2:port
        host, _, ports = item.rpartition(":")
        for port in ports.split("+"):
            if host and port.isdigit() and 0 < int(port) < 65536:
                targets.append((host, int(port)))
    if len(targets) > MAX_TARGETS:
        raise SystemExit("too many targets")
    timeout = float(args["--timeout"])
    if not 0 < timeout <= 60:
        raise SystemExit("bad --timeout")
    results = {}
    for start in range(0, len(targets), MAX_AT_ONCE):
        results.update(probe_batch(targets[start:start + MAX_AT_ONCE], timeout))
    return {"results": results}


def probe_batch(targets, timeout):
    sel = selectors.DefaultSelector()
    out = {}
    t0 = time.monotonic()
    for host, port in targets:
        key = "%s:%d" % (host, port)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        code = s.connect_ex((host, port))
        if code in (0, errno.EINPROGRESS):
            sel.register(s, selectors.EVENT_WRITE, key)
        else:
            out[key] = outcome(code)
            s.close()
    while sel.get_map():
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            break
        for k, _ in sel.select(left):
            s = k.fileobj
            out[k.data] = outcome(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
            sel.unregister(s)
            s.close()
    for k in list(sel.get_map().values()):
        out[k.data] = "timeout"
        k.fileobj.close()
    return out


def outcome(code):
    if code == 0:
        return "ok"
    if code == errno.ECONNREFUSED:
        return "refused"
    if code in (errno.ETIMEDOUT,):
        return "timeout"
    return errno.errorcode.get(code, str(code)).lower()


def stop(args):
    tag = args["--tag"]
    if not tag.isalnum():
        raise SystemExit("bad --tag")
    try:
        with open(pid_file(tag)) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return {"stopped": None}
    return stop_tagged(pid, tag, STOP_WAIT_S)


def main(argv):
    verb, rest = argv[0], argv[1:]
    args = dict(zip(rest[::2], rest[1::2]))
    doc = {"listen": listen, "probe": probe, "stop": stop}[verb](args)
    sys.stdout.write(json.dumps(doc) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
