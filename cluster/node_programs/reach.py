"""On a node: TCP reachability between nodes, in three verbs, each printing one JSON document.

    listen --ports 6379,8076 --for 90 --tag RUN [--expect N]
                                                  listeners on the free ones (a detached process
                                                  that accepts and closes, and exits by itself
                                                  after --for seconds, or once every port it
                                                  bound has heard the run's tag from N probes);
                                                  busy ports are reported (someone, e.g. Ray,
                                                  already answers there)
    probe --targets 10.0.0.2/10.0.0.3:6379+8076,... --timeout 2 [--tag RUN --tell 10.0.0.2:6379,...]
          [--at-once 64 --deadline 120]           connects to every target, at most --at-once
                                                  in flight (no connect starts after
                                                  --deadline s: those are left out); each is
                                                  ok, refused, timeout (dropped) or an OS error;
                                                  to the --tell ones (ports our listeners hold)
                                                  it then says the run's tag and waits for the
                                                  listener's "ok": those are "acked"
    stop --tag RUN                                ends this run's listener: a process of this
                                                  user whose command line is `listen ... --tag
                                                  RUN` (found in /proc)

The acknowledgement makes the caller's view exact: a listener exits by itself exactly when
every probe it expected was acked (it acks after counting), so the caller sends `stop` only to
the nodes where some expected probe was not acked (a command per node saved on a healthy
cluster). A connection that says something else, or nothing within READ_WAIT_S, is closed
uncounted. The tag is on the listener's command line: a local user who reads it can make a
listener leave early (a probe refused), never stay past --for.

Read-only for the node: nothing is written (no pid file another local user could plant first),
no rule or setting is changed.
"""

import errno
import json
import os
import selectors
import signal
import socket
import sys
import time

from cluster.node_programs._common import run_detached, stop_tagged

MAX_TARGETS = 20000
MAX_PORTS = 256
MAX_AT_ONCE = 512      # connects open at once, at most (the caller's --at-once: fewer)
MAX_DEADLINE_S = 600.0  # no connect starts later than this into a probe
STOP_WAIT_S = 5.0


MAX_CMDLINE = 1 << 20


def listener_pid(tag, proc="/proc"):
    """The pid of this user's listener of the run `tag` (its command line holds `listen` and
    `--tag TAG`), or None; never another user's process, never this one."""
    verb, mark = b"\0listen\0", ("\0--tag\0%s\0" % tag).encode()
    try:
        entries = os.listdir(proc)
    except OSError:
        return None
    for pid in entries:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if os.stat(os.path.join(proc, pid)).st_uid != os.geteuid():
                continue
            with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
                line = b"\0" + f.read(MAX_CMDLINE) + b"\0"
        except OSError:
            continue
        if verb in line and mark in line:
            return int(pid)
    return None


def parse_ports(text):
    ports = [int(p) for p in text.split(",") if p]
    if len(ports) > MAX_PORTS or any(not 0 < p < 65536 for p in ports):
        raise SystemExit("bad --ports")
    return ports


MIN_BACKLOG = 64


def bind_all(ports, expect=0):
    """Listeners on the free ones of `ports`, each with room in its accept queue for every
    expected prober (they connect at once, faster than this one process accepts: a full queue
    drops their SYNs, which the probes would report as a firewall; the kernel caps the room at
    net.core.somaxconn)."""
    bound, busy, failed = [], [], {}
    socks = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            s.listen(max(MIN_BACKLOG, expect))
            s.setblocking(False)
        except OSError as exc:
            s.close()
            (busy.append(port) if exc.errno == errno.EADDRINUSE
             else failed.__setitem__(str(port), os.strerror(exc.errno or 0)))
            continue
        socks.append(s)
        bound.append(port)
    return socks, bound, busy, failed


READ_WAIT_S = 2.0      # an accepted connection has this long to say the run's tag
MAX_HELD = 1024        # accepted connections waiting to say it
ACK = b"ok\n"


def knock(tag):
    return ("%s\n" % tag).encode()


class Heard:
    """The listener's count of the probes that said the run's tag, per port it bound."""

    def __init__(self, ports, expect):
        self.expect = expect
        self.counts = dict.fromkeys(ports, 0)

    def add(self, port):
        self.counts[port] += 1

    def complete(self):
        return self.expect > 0 and all(n >= self.expect for n in self.counts.values())


def serve(socks, seconds, tag, expect=0):
    """The detached listener: accept until the time is up, SIGTERM, or (expect > 0) every port
    heard the run's tag from `expect` probes; each connection that says it is counted, acked
    and closed, any other closed."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ, ("listen", s.getsockname()[1]))
    heard = Heard([s.getsockname()[1] for s in socks], expect)
    want = knock(tag)
    held = {}                       # conn -> (port, accepted at, what it said so far)
    end = time.monotonic() + seconds
    while not heard.complete():
        now = time.monotonic()
        left = end - now
        if left <= 0:
            break
        for key, _ in sel.select(min(left, 0.5)):
            kind, port = key.data
            if kind == "listen":
                accept(key.fileobj, port, sel, held, expect, now)
            else:
                hear(key.fileobj, sel, held, heard, want)
        for conn, (_, at, _) in list(held.items()):
            if time.monotonic() - at > READ_WAIT_S:
                drop(conn, sel, held)


def accept(listener, port, sel, held, expect, now):
    try:
        conn, _ = listener.accept()
    except OSError:
        return
    if not expect or len(held) >= MAX_HELD:
        conn.close()
        return
    conn.setblocking(False)
    sel.register(conn, selectors.EVENT_READ, ("conn", port))
    held[conn] = (port, now, b"")


def hear(conn, sel, held, heard, want):
    port, at, said = held[conn]
    try:
        data = conn.recv(len(want) - len(said))
    except OSError:
        data = b""
    said += data
    if data and len(said) < len(want) and want.startswith(said):
        held[conn] = (port, at, said)
        return
    if said == want:
        heard.add(port)
        try:
            conn.send(ACK)
        except OSError:
            pass
    drop(conn, sel, held)


def drop(conn, sel, held):
    sel.unregister(conn)
    conn.close()
    held.pop(conn, None)


def arg_number(args, flag, kind, default=None):
    """The number `flag` gives (kind: int or float; `default` when absent, else required);
    SystemExit("bad FLAG") for one that is missing or not a number (NaN passes: the callers'
    range checks refuse it)."""
    try:
        return kind(args[flag] if default is None else args.get(flag, default))
    except (KeyError, ValueError, OverflowError):
        raise SystemExit("bad %s" % flag)


def listen(args):
    ports = parse_ports(args["--ports"])
    seconds = arg_number(args, "--for", float)
    tag = args["--tag"]
    expect = arg_number(args, "--expect", int, 0)
    if not (0 < seconds <= 3600) or not tag.isalnum() or not 0 <= expect <= MAX_TARGETS:
        raise SystemExit("bad --for, --tag or --expect")
    socks, bound, busy, failed = bind_all(ports, expect)
    pid = None
    if socks:
        def close_ours():
            for s in socks:
                s.close()

        pid = run_detached(lambda: serve(socks, seconds, tag, expect), close_ours)
    return {"listening": bound, "busy": busy, "failed": failed, "pid": pid}


def parse_targets(text):
    """host/host2:port+port+...,host3:port -> [(host, port)]: each host of an item with each of
    its ports (malformed items left out)."""
    targets = []
    for item in text.split(","):
        hosts, _, ports = item.rpartition(":")
        for host in hosts.split("/"):
            for port in ports.split("+"):
                if host and port.isdigit() and 0 < int(port) < 65536:
                    targets.append((host, int(port)))
    if len(targets) > MAX_TARGETS:
        raise SystemExit("too many targets")
    return targets


def probe(args):
    targets = parse_targets(args["--targets"])
    timeout = arg_number(args, "--timeout", float)
    if not 0 < timeout <= 60:
        raise SystemExit("bad --timeout")
    at_once = arg_number(args, "--at-once", int, MAX_AT_ONCE)
    deadline = arg_number(args, "--deadline", float, MAX_DEADLINE_S)
    if not 1 <= at_once <= MAX_AT_ONCE or not 0 < deadline <= MAX_DEADLINE_S:
        raise SystemExit("bad --at-once or --deadline")
    tag = args.get("--tag", "")
    if tag and not tag.isalnum():
        raise SystemExit("bad --tag")
    tell = set(parse_targets(args.get("--tell", ""))) if tag else set()
    results, acked = probe_window(targets, timeout, at_once, deadline, tell,
                                  knock(tag) if tag else b"")
    return {"results": results, "acked": acked} if tag else {"results": results}


def probe_window(targets, timeout, at_once, deadline, tell=frozenset(), said=b""):
    """Connect to the targets with at most `at_once` sockets open at a time (a sliding window:
    a large fan-out would otherwise send every SYN, and every ARP request for a neighbour not
    yet known, in one burst), each given `timeout` from its own start to connect and, when it is
    one of the `tell` ones, to say `said` and hear the listener's ACK: ({"host:port": outcome},
    [acked keys]). No connect starts after `deadline` seconds; the ones never started are left
    out (the caller reads them as unanswered)."""
    sel = selectors.DefaultSelector()
    out, acked = {}, []
    t0 = time.monotonic()
    todo = iter(targets)
    while True:
        now = time.monotonic()
        while len(sel.get_map()) < at_once and now - t0 < deadline:
            target = next(todo, None)
            if target is None:
                break
            start_connect(sel, out, target, target in tell, now + timeout)
        if not sel.get_map():
            break
        soonest = min(k.data[3] for k in sel.get_map().values())
        for k, events in sel.select(max(0.0, soonest - now)):
            if on_event(k, events, out, acked, said):
                sel.modify(k.fileobj, selectors.EVENT_READ, k.data)
            else:
                sel.unregister(k.fileobj)
                k.fileobj.close()
        now = time.monotonic()
        for k in [k for k in sel.get_map().values() if k.data[3] <= now]:
            out.setdefault(k.data[0], "timeout")     # connected but not acked in time: still ok
            sel.unregister(k.fileobj)
            k.fileobj.close()
    return out, acked


def start_connect(sel, out, target, telling, until):
    """A non-blocking connect to target, registered with sel (its data: [key, telling, heard
    bytes, its deadline]), or its outcome in out when it failed at once."""
    host, port = target
    key = "%s:%d" % (host, port)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    code = s.connect_ex((host, port))
    if code in (0, errno.EINPROGRESS):
        sel.register(s, selectors.EVENT_WRITE, [key, telling, b"", until])
    else:
        out[key] = outcome(code)
        s.close()


def on_event(k, events, out, acked, said):
    """One ready socket: True when it now waits for the listener's ACK (or more of it)."""
    s, data = k.fileobj, k.data
    key, telling = data[0], data[1]
    if events & selectors.EVENT_WRITE:
        out[key] = outcome(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        return telling and out[key] == "ok" and say(s, said)
    try:
        got = s.recv(len(ACK) - len(data[2]))
    except OSError:
        got = b""
    data[2] += got
    if got and len(data[2]) < len(ACK):
        return True
    if data[2] == ACK:
        acked.append(key)
    return False


def say(s, data):
    try:
        return s.send(data) == len(data)
    except OSError:
        return False


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
    pid = listener_pid(tag)
    return stop_tagged(pid, tag, STOP_WAIT_S) if pid else {"stopped": None}


def main(argv):
    verb, rest = argv[0], argv[1:]
    args = dict(zip(rest[::2], rest[1::2]))
    doc = {"listen": listen, "probe": probe, "stop": stop}[verb](args)
    sys.stdout.write(json.dumps(doc) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
