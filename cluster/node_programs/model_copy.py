"""On a node: copy a model directory node to node over HTTP, each verb printing one JSON document.

    manifest --dir D [--for S]      every file under D: relative path, size, mode, sha256 (read
                                    in 1 MiB chunks). Nothing is followed out of D: a symlink is
                                    listed ("link": true, its target's bytes) only when its real
                                    path is a regular file inside D; a link leaving D, to a
                                    directory or to nothing, and anything not a regular file are
                                    listed under "skipped" with the reason. `*.part` files
                                    (interrupted fetches) are counted under "partial".
    serve --dir D --bind IP --port P --for S --tag T
                                    a detached HTTP server (double fork) that serves the files
                                    the walk of D found at startup, at /<path>, with
                                    Range requests; it exits by itself after S seconds.
                                    Prints {"pid", "port"} or {"error"}.
    fetch --dir D --url http://IP:P --for S
                                    downloads each listed file into D/<path>.part, resuming from
                                    the .part's size (a Range request), stops at the listed size,
                                    checks sha256, then renames it into place.
    relay --dir D --bind IP --ports LOW-HIGH --for S --tag T
                                    one node of a pipelined relay (cluster/remedy/model_relay.py): a
                                    detached server on the first free port of the range, serving
                                    the run's files it holds AND the bytes of the files it is
                                    receiving as they land, while a fetch thread pulls the rest
                                    from its upstreams (the nearest first; a silent one is
                                    bypassed for the next, resuming with Range). GET /.status
                                    is its progress. Prints {"pid", "port"}.
    stop --pid PID --tag T          ends the server started with that tag.

Safety (the program starts as root on every node; docs/security.md "Model copy and relay"):
- --dir itself is walked from / one component at a time with O_NOFOLLOW (enter): a link
  anywhere on it, a directory of a third user or one others may write is refused. When the
  deepest existing directory is a user's, the program becomes that user (no other group)
  before it creates, reads or serves anything: it writes as that user, never as root, and
  ships only what that user can read. As root it enters no other user's directory below.
- the directory named by --dir is the boundary. Below it every path is opened component by
  component from a directory descriptor with O_NOFOLLOW: the target never opens, writes or
  renames through a symbolic link; a link where a directory is expected refuses the file.
- a listed file over MAX_FILE_BYTES or a listing over MAX_TOTAL_BYTES is refused before
  anything is made.
- a `.part` is reused for a resume only when it is a regular file with one link, owned by this
  user and not longer than the listed size; anything else under that name is removed (the name,
  not what a link points to) and the `.part` is created anew with O_CREAT|O_EXCL|O_NOFOLLOW.
- a fetch writes at most the listed size: the reply is read no further (a server that sends
  more is cut off there) and a Content-Length or Content-Range that disagrees is refused. On a
  timeout or a lost source the `.part` is kept (bounded by the listed size) so that a rerun
  resumes; a sha256 mismatch deletes it.
- modes: the copy takes the source file's permission bits without setuid, setgid, sticky or
  group/other write (mode & 0o755): a 0600 file stays 0600, nothing arrives world-writable.
- the server serves only what the walk found, reopened without following links and checked
  to be the same regular file (device, inode) when a request comes.

The run's secret key is never on the command line nor sent: stdin's first line holds it (serve,
fetch, relay); the rest of stdin is the input document: fetch's {"files": [{"path", "size",
"sha256", "mode"}]}, relay's {"files": [...], "fetch": [paths], "upstreams": ["http://IP:P", ...],
"peers": [IP, ...]}, serve's optional {"peers": [...]}.

Who may ask (the servers read as root): a connection from an address not in "peers" (the run's
nodes; loopback alone when none are named) is closed at accept without a byte read, as is one
above MAX_CONNECTIONS at once; a request line and headers not in within HEAD_TIMEOUT_S (silent)
or twice that (trickled) close the connection. Every request carries X-Relay-Auth: STAMP.NONCE.
HMAC-SHA256(key, method, target, stamp, nonce, Range); a missing, wrong, stale (STAMP over
AUTH_WINDOW_S from the server's clock) or replayed (NONCE seen) signature gets 403 and nothing.

Shipped as
`python3 -c BOOT VERB ARGS` where BOOT reads this program as stdin's first line (a JSON string)
and its input after it (cluster/node_programs/__init__.py). Stdlib only, Python 3.8+.
"""

import binascii
import collections
import errno
import fcntl
import hashlib
import hmac
import ipaddress
import json
import os
import signal
import socket
import stat
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from cluster.node_programs._common import run_detached, stop_tagged

CHUNK = 1 << 20
MAX_FILES = 100000
MAX_PATH = 4096
MAX_INPUT = 64 << 20
MAX_SECONDS = 86400.0
MAX_UPSTREAMS = 64
REQUEST_TIMEOUT_S = 60.0
STALL_S = 10.0                  # an upstream silent this long is bypassed for the next one
GIVE_UP_S = 45.0                # no upstream moved a byte for this long: the fetch fails
IDLE_EXIT_S = 120.0             # a relay whose fetch is over exits after this long unasked
PART = ".part"
STATUS = ".status"
STOP_WAIT_S = 5.0
MODE_MASK = 0o755               # no setuid/setgid/sticky, no group/other write
MAX_FILE_BYTES = 1 << 40        # one listed file: 1 TiB at most (the largest shards are ~10 GiB)
MAX_TOTAL_BYTES = 1 << 44       # a whole listing: 16 TiB
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
MAX_CONNECTIONS = 32            # connections served at once; one more is closed at accept
HEAD_TIMEOUT_S = 5.0            # a request line and headers: silent this long, or unfinished
                                # after twice this, and the connection is closed
AUTH_HEADER = "X-Relay-Auth"    # STAMP.NONCE.HMAC-SHA256(key, method, target, stamp, nonce, range)
AUTH_WINDOW_S = 300.0           # a signature's stamp: at most this far from the server's clock
MAX_NONCES = 65536              # signatures remembered over 2 windows (a replay is refused)
MAX_PEERS = 4096
LOOPBACK_PEERS = ("127.0.0.1", "::1")   # the peers when the input names none
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
ON_NODE = []                    # main() marks the program's own run: only it walks, drops to a user
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | CLOEXEC


class Refused(Exception):
    """A request or an input this program will not act on (the reason is the message)."""


class Unreachable(Refused):
    """The source did not answer (refused, dropped, timed out, ended early); `written`: the
    bytes it sent before."""

    def __init__(self, message, written=0):
        Refused.__init__(self, message)
        self.written = written


# ---------------------------------------------------------------- paths without links


def enter(root, create=False):
    """A descriptor of the model directory `root`, or None when it is absent (and not `create`).

    As root the path is walked from / one component at a time (O_NOFOLLOW, openat): a link
    anywhere is refused, and so is a component that belongs to another user than root and the
    owner of the deepest existing directory, or that others may write (a sticky one excepted,
    not the directory itself). When that owner is not root, this process becomes that user
    (become) before it creates the rest or reads anything below. Afterwards no one but root
    or this process's user can change the path, so the later path-based calls are safe. A
    process that is not root, or not this program run by main (the laptop's feed in the CLI's
    own process), opens the path as given."""
    if os.geteuid() != 0 or not ON_NODE:
        return open_root(root, create) if create or os.path.isdir(root) else None
    parts = [p for p in root.split("/") if p]
    fd = os.open("/", DIR_FLAGS)
    try:
        seen = [("/", os.fstat(fd))]
        for name in parts:
            try:
                child = descend(fd, name, root)
            except FileNotFoundError:
                break
            os.close(fd)
            fd = child
            seen.append(("/" + "/".join(parts[:len(seen)]), os.fstat(fd)))
        owner = seen[-1][1]
        for i, (where, st) in enumerate(seen):
            trusted(st, owner.st_uid, where, i == len(parts))
        if len(seen) <= len(parts) and not create:
            os.close(fd)
            return None
        become(owner.st_uid, owner.st_gid)
        for name in parts[len(seen) - 1:]:
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            child = descend(fd, name, root)
            os.close(fd)
            fd = child
            seen.append(("/" + "/".join(parts[:len(seen)]), os.fstat(fd)))
            trusted(seen[-1][1], owner.st_uid, seen[-1][0], len(seen) > len(parts))
        return fd
    except BaseException:
        os.close(fd)
        raise


def descend(fd, name, root):
    """The directory `name` in fd, opened O_NOFOLLOW (FileNotFoundError when absent)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise Refused("%s: %s is a link or not a directory (not followed)"
                          % (root[:200], name[:100]))
        raise Refused("%s: %s" % (root[:200], os.strerror(exc.errno or 0)))


def trusted(st, owner, where, last):
    """Refused unless the directory belongs to root or `owner` and no one else may write it (a
    sticky directory such as /tmp may be on the way, never as the model directory itself; the
    owner's directory may be writable by the owner's private group: umask 002)."""
    if st.st_uid not in (0, owner):
        raise Refused("%s belongs to uid %d, the directory below it to uid %d: not entered as "
                      "root (give the path one owner)" % (where[:200], st.st_uid, owner))
    shared = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP
                                           and not private_group(st.st_gid, st.st_uid))
    if shared and (last or not st.st_mode & stat.S_ISVTX):
        raise Refused("%s is writable by its group or others: not entered as root" % where[:200])


def private_group(gid, uid):
    """The group is user uid's own (not root's): its primary group, no other user's primary
    group, no other member (a user private group)."""
    try:
        import grp
        import pwd
        user = pwd.getpwuid(uid)
        return uid != 0 and user.pw_gid == gid \
            and set(grp.getgrgid(gid).gr_mem) <= set([user.pw_name]) \
            and not any(p.pw_gid == gid and p.pw_uid != uid for p in pwd.getpwall())
    except (ImportError, KeyError):
        return False


def become(uid, gid):
    """This process becomes user `uid` (its primary group, else `gid`; no other group) when it
    is root and uid is not: it then writes and reads only what that user may."""
    if uid == 0 or os.geteuid() != 0:
        return
    import encodings.idna           # noqa: F401  imported now: the interpreter's own files may
    import http.server              # noqa: F401  be root's alone (a python under /root)
    try:
        import pwd
        gid = pwd.getpwuid(uid).pw_gid
    except (ImportError, KeyError):
        pass
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    os.umask(0o022)


def open_root(root, create=False):
    """A descriptor of the model directory itself (the boundary; created when asked)."""
    if create:
        os.makedirs(root, mode=0o755, exist_ok=True)
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)
    except OSError as exc:
        raise Refused("cannot open %s: %s" % (root, os.strerror(exc.errno or 0)))


def open_parent(rootfd, parts, create=False):
    """A descriptor of the directory holding parts[-1], walked from rootfd with O_NOFOLLOW
    (missing directories created when asked). Refused on a link or a non-directory."""
    fd = os.dup(rootfd)
    try:
        for name in parts[:-1]:
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise Refused("%s: %s is a link or not a directory (not followed)"
                                  % ("/".join(parts)[:200], name[:100]))
                raise Refused("%s: %s" % ("/".join(parts)[:200], os.strerror(exc.errno or 0)))
            os.close(fd)
            fd = child
            below_root(fd, parts, name)
        return fd
    except BaseException:
        os.close(fd)
        raise


def below_root(fd, parts, name):
    """As root, a directory below the model directory must be root's alone (another user's
    directory is entered only by a process that became that user: enter)."""
    if os.geteuid() == 0 and ON_NODE:
        st = os.fstat(fd)
        if st.st_uid != 0 or st.st_mode & OTHERS_WRITE:
            raise Refused("%s: %s is another user's or writable by others (not entered as root)"
                          % ("/".join(parts)[:200], name[:100]))


def open_regular(rootfd, parts, expect=None):
    """(fd, stat) of the regular file at parts, no link followed; `expect`: (dev, ino) it must
    still be (the file the walk found)."""
    parent = open_parent(rootfd, parts)
    try:
        fd = os.open(parts[-1], READ_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise Refused("%s: %s" % ("/".join(parts)[:200], "a link (not followed)"
                                  if exc.errno == errno.ELOOP else os.strerror(exc.errno or 0)))
    finally:
        os.close(parent)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (expect and (st.st_dev, st.st_ino) != expect):
        os.close(fd)
        raise Refused("%s is no longer the file listed" % "/".join(parts)[:200])
    return fd, st


# ---------------------------------------------------------------- walking and hashing


class Found(object):
    """One servable file: where its bytes are (parts below the root), which inode, size, mode."""

    __slots__ = ("parts", "key", "size", "mode", "link")

    def __init__(self, parts, st, link):
        self.parts, self.key, self.size = parts, (st.st_dev, st.st_ino), st.st_size
        self.mode, self.link = stat.S_IMODE(st.st_mode) & MODE_MASK, link


def walk(root):
    """(files, skipped, partial): files maps relative path -> Found; nothing followed out."""
    real_root = os.path.realpath(root)
    files, skipped, partial = {}, {}, 0
    rootfd = open_root(real_root)
    try:
        for top, dirs, names, dfd in os.fwalk(real_root, follow_symlinks=False):
            dirs.sort()
            for name in sorted(set(dirs) | set(names)):
                path = rel(real_root, os.path.join(top, name))
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    continue
                if name.endswith(PART):
                    partial += 1
                    continue
                if stat.S_ISREG(st.st_mode):
                    files[path] = Found(path.split("/"), st, False)
                elif stat.S_ISLNK(st.st_mode):
                    found = linked(rootfd, real_root, os.path.join(top, name))
                    if isinstance(found, str):
                        skipped[path] = found
                    else:
                        files[path] = found
                else:
                    skipped[path] = "not a regular file"
                if len(files) > MAX_FILES:
                    raise Refused("more than %d files under %s" % (MAX_FILES, root))
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
    finally:
        os.close(rootfd)
    return files, skipped, partial


def linked(rootfd, real_root, full):
    """A link's Found when its real path is a regular file inside the root, else why not."""
    target = os.path.realpath(full)
    if target != real_root and not target.startswith(real_root.rstrip("/") + "/"):
        return "a link leaving the model directory (not served)"
    if not os.path.exists(target):
        return "a link to nothing"
    if os.path.isdir(target):
        return "a link to a directory (not followed)"
    parts = rel(real_root, target).split("/")
    if parts[-1].endswith(PART):
        return "a link to an interrupted fetch"
    try:
        fd, st = open_regular(rootfd, parts)
    except Refused as exc:
        return "a link to %s" % exc
    os.close(fd)
    return Found(parts, st, True)


def rel(root, full):
    return os.path.relpath(full, root).replace(os.sep, "/")


def sha256_fd(fd, deadline, label, upto=None):
    """The sha256 of fd's first `upto` bytes (all when None), read with pread."""
    h = hashlib.sha256()
    pos = 0
    while upto is None or pos < upto:
        block = os.pread(fd, CHUNK if upto is None else min(CHUNK, upto - pos), pos)
        if not block:
            break
        h.update(block)
        pos += len(block)
        if time.monotonic() > deadline:
            raise Refused("out of time hashing %s" % label)
    return h


def manifest(args, _stdin):
    root = directory(args, must_exist=False)
    seconds = number(args, "--for", 3600.0)
    rootfd = enter(root)
    if rootfd is None:
        return {"dir": root, "exists": False, "files": [], "skipped": {}, "partial": 0}
    os.close(rootfd)
    deadline = time.monotonic() + seconds
    files, skipped, partial = walk(root)
    rootfd = open_root(os.path.realpath(root))
    listed = []
    try:
        for path, found in sorted(files.items()):
            try:
                fd, st = open_regular(rootfd, found.parts, found.key)
            except Refused as exc:
                skipped[path] = str(exc)
                continue
            try:
                digest = sha256_fd(fd, deadline, path).hexdigest()
            finally:
                os.close(fd)
            entry = {"path": path, "size": st.st_size, "mode": found.mode, "sha256": digest}
            if found.link:
                entry["link"] = True
            listed.append(entry)
    finally:
        os.close(rootfd)
    return {"dir": root, "exists": True, "files": listed, "skipped": skipped,
            "partial": partial}


# ---------------------------------------------------------------- what a server offers


class Board(object):
    """The files one server offers and, for a relay, how far each being received has landed.

    entry states: disk (whole on disk: parts, inode), pending (not started), landing (bytes
    [0, landed) of the .part are written), done (renamed into place), failed."""

    def __init__(self, root, real_root):
        self.root, self.rootfd = root, open_root(real_root)
        self.cond = threading.Condition()
        self.entries = {}
        self.status = {"state": "serving", "bytes": 0, "done": 0, "failed": [],
                       "files": 0, "total": 0, "upstream": None}
        self.started = time.monotonic()
        self.active = 0
        self.last_request = time.monotonic()

    def offer(self, path, found=None, size=None):
        self.entries[path] = {"state": "disk" if found else "pending", "size":
                              found.size if found else size, "parts": found.parts if found
                              else path.split("/"), "key": found.key if found else None,
                              "landed": 0}

    def update(self, path, **changes):
        with self.cond:
            self.entries[path].update(changes)
            self.cond.notify_all()

    def snapshot(self):
        with self.cond:
            doc = dict(self.status)
            doc["seconds"] = round(time.monotonic() - self.started, 3)
            doc["failed"] = list(doc["failed"])[:50]
            return doc

    def note(self, **changes):
        with self.cond:
            self.status.update(changes)
            if changes.get("state") in ("done", "failed"):
                self.last_request = time.monotonic()    # idle counts from the fetch's end
            self.cond.notify_all()


def open_served(board, path):
    """(fd, entry) to read a request's bytes from: the file on disk, or its .part while it
    lands (the same inode the fetch writes). Refused when it cannot be served."""
    for _ in range(3):
        with board.cond:
            entry = board.entries.get(path)
            if entry is None:
                raise Refused("not found")
            end = time.monotonic() + STALL_S * 3
            while entry["state"] == "pending" and time.monotonic() < end:
                board.cond.wait(1.0)
            state, parts, key = entry["state"], list(entry["parts"]), entry["key"]
        if state in ("pending", "failed"):
            raise Refused("not available")
        if state == "landing":
            parts[-1] += PART
        try:
            fd, _st = open_regular(board.rootfd, parts, key)
            return fd, entry
        except Refused:
            if state != "landing":
                raise
    raise Refused("not available")


def readable(board, entry, pos, deadline):
    """How many bytes from pos may be read now (waiting while they land); 0: never."""
    with board.cond:
        while True:
            state = entry["state"]
            if state in ("disk", "done"):
                return entry["size"] - pos
            if state == "landing" and entry["landed"] > pos:
                return entry["landed"] - pos
            if state == "failed" or time.monotonic() > deadline:
                return 0
            board.cond.wait(1.0)


# ---------------------------------------------------------------- who may ask


def signature(key, method, target, stamp, nonce, byte_range):
    """HMAC-SHA256 (hex) of one request under the run's key: the key itself never travels."""
    message = "\n".join(("model_copy-v1", method, target, stamp, nonce, byte_range or ""))
    return hmac.new(key.encode(), message.encode("utf-8", "surrogateescape"),
                    hashlib.sha256).hexdigest()


def auth_headers(key, target, byte_range=None, now=None, nonce=None):
    """The headers of a signed GET of `target` (a Range when asked)."""
    stamp = "%d" % int(time.time() if now is None else now)
    nonce = nonce or binascii.hexlify(os.urandom(16)).decode()
    headers = {AUTH_HEADER: "%s.%s.%s" % (stamp, nonce, signature(key, "GET", target, stamp,
                                                                  nonce, byte_range))}
    if byte_range is not None:
        headers["Range"] = byte_range
    return headers


REFUSALS = ("not signed", "bad signature", "stale signature", "replayed signature",
            "too many requests")


class Signatures(object):
    """Checks request signatures; each one is accepted once (a replay is refused) and only
    within AUTH_WINDOW_S of this clock (a stale one is refused)."""

    def __init__(self, key):
        self.key, self.lock = key, threading.Lock()
        self.seen, self.order = set(), collections.deque()  # nonces; (forget at, nonce)

    def check(self, method, target, byte_range, header):
        """None when the request is signed by the key, fresh and new; else why not."""
        stamp, _, rest = (header or "").partition(".")
        nonce, _, mac = rest.partition(".")
        if not (0 < len(stamp) <= 12 and len(nonce) == 32 and len(mac) == 64
                and all(c in "0123456789" for c in stamp)
                and all(c in "0123456789abcdef" for c in nonce + mac)):
            return "not signed"
        want = signature(self.key, method, target, stamp, nonce, byte_range)
        if not hmac.compare_digest(want.encode(), mac.encode()):
            return "bad signature"
        if abs(time.time() - int(stamp)) > AUTH_WINDOW_S:
            return "stale signature"
        now = time.monotonic()
        with self.lock:
            while self.order and self.order[0][0] < now:
                self.seen.discard(self.order.popleft()[1])
            if nonce in self.seen:
                return "replayed signature"
            if len(self.seen) >= MAX_NONCES:
                return "too many requests"
            self.seen.add(nonce)
            self.order.append((now + 2 * AUTH_WINDOW_S, nonce))
        return None


def peer_address(text):
    """An address in one form (an IPv4-mapped IPv6 address as IPv4); None when not an IP."""
    try:
        ip = ipaddress.ip_address(str(text).split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def read_peers(doc):
    """The input's "peers" (the run's node addresses, loopback when none are named)."""
    peers = doc.get("peers", list(LOOPBACK_PEERS))
    if not isinstance(peers, list) or not 0 < len(peers) <= MAX_PEERS:
        raise Refused("peers must be a list of 1-%d IP addresses" % MAX_PEERS)
    out = set()
    for p in peers:
        ip = peer_address(p) if isinstance(p, str) and len(p) < 64 else None
        if ip is None:
            raise Refused("bad peer %r (an IP address)" % str(p)[:64])
        out.add(ip)
    return frozenset(out)


def make_handler(board, key):
    from http.server import BaseHTTPRequestHandler

    signatures = Signatures(key)

    class Handler(BaseHTTPRequestHandler):
        timeout = HEAD_TIMEOUT_S            # each read of the request line and headers
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def handle_one_request(self):
            self.connection.settimeout(HEAD_TIMEOUT_S)
            self.server.watch(self.connection)
            try:
                BaseHTTPRequestHandler.handle_one_request(self)
            finally:
                self.server.unwatch(self.connection)

        def do_GET(self):
            target = self.requestline.split()[1]        # as sent (self.path may be rewritten)
            ranges = self.headers.get_all("Range") or []
            auth = self.headers.get_all(AUTH_HEADER) or []
            why = "not signed" if len(auth) != 1 or len(ranges) > 1 else signatures.check(
                "GET", target, ranges[0] if ranges else None, auth[0])
            if why is not None:
                self.close_connection = True
                return self.refuse(403, why)
            self.server.unwatch(self.connection)
            self.connection.settimeout(REQUEST_TIMEOUT_S)
            raw = target.split("?", 1)[0]
            if not raw.startswith("/"):
                return self.refuse(404, "not found")
            path = urllib.parse.unquote(raw[1:])
            if path == STATUS:
                return self.reply_json(board.snapshot())
            with board.cond:
                board.active += 1
            try:
                return self.send_file(path)
            finally:
                with board.cond:
                    board.active -= 1
                    board.last_request = time.monotonic()

        def send_file(self, path):
            try:
                fd, entry = open_served(board, path)
            except Refused as exc:
                return self.refuse(404, str(exc))
            try:
                size = entry["size"]
                try:
                    start, end = byte_range(self.headers.get("Range"), size)
                except Refused:
                    self.send_response(416)
                    self.send_header("Content-Range", "bytes */%d" % size)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                partial = self.headers.get("Range") is not None
                self.send_response(206 if partial else 200)
                if partial:
                    self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end - 1, size))
                self.send_header("Content-Length", str(end - start))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                self.stream(fd, entry, start, end)
            finally:
                os.close(fd)
            return None

        def stream(self, fd, entry, pos, end):
            deadline = time.monotonic() + GIVE_UP_S
            while pos < end:
                ready = min(readable(board, entry, pos, deadline), end - pos, CHUNK)
                if ready <= 0:
                    self.close_connection = True
                    return
                block = os.pread(fd, ready, pos)
                if not block:
                    self.close_connection = True
                    return
                self.wfile.write(block)
                pos += len(block)
                deadline = time.monotonic() + GIVE_UP_S

        def reply_json(self, doc):
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def refuse(self, code, why):
            body = (why + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def byte_range(header, size):
    """[start, end) of a `Range: bytes=N-` or `bytes=N-M` header (None: the whole file)."""
    if header is None:
        return 0, size
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip() != "bytes" or not dash or not first.isdigit() or len(first) > 20 \
            or (last and (not last.isdigit() or len(last) > 20)):
        raise Refused("bad range")
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    if start >= size or end <= start:
        raise Refused("range not satisfiable")
    return start, end


def server_class(bind, peers):
    """A threading HTTP server that closes at accept, without reading, a connection from an
    address not in `peers` or above MAX_CONNECTIONS, and one whose request line and headers
    are not in within 2 * HEAD_TIMEOUT_S."""
    from http.server import HTTPServer
    from socketserver import ThreadingMixIn

    class Server(ThreadingMixIn, HTTPServer):
        address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        daemon_threads = True
        block_on_close = False
        allow_reuse_address = True          # a listener still refuses the port
        request_queue_size = 64

        def server_activate(self):
            self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
            self.heads, self.heads_lock = {}, threading.Lock()
            HTTPServer.server_activate(self)

        def verify_request(self, request, client_address):
            return peer_address(client_address[0]) in peers \
                and self.slots.acquire(blocking=False)

        def process_request(self, request, client_address):
            try:
                ThreadingMixIn.process_request(self, request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                ThreadingMixIn.process_request_thread(self, request, client_address)
            finally:
                self.slots.release()

        def handle_error(self, request, client_address):
            pass                            # a detached server: nowhere to print a traceback

        def watch(self, connection):
            with self.heads_lock:
                self.heads[connection] = time.monotonic() + 2 * HEAD_TIMEOUT_S

        def unwatch(self, connection):
            with self.heads_lock:
                self.heads.pop(connection, None)

        def service_actions(self):          # serve_forever's loop, every poll interval
            now = time.monotonic()
            with self.heads_lock:
                late = [c for c, end in self.heads.items() if end < now]
                for c in late:
                    del self.heads[c]
            for c in late:
                try:
                    c.shutdown(socket.SHUT_RDWR)        # its thread's read ends at once
                except OSError:
                    pass

    return Server


def listen(bind, ports, board, key, peers=frozenset(LOOPBACK_PEERS)):
    """A server on the first free port of `ports` answering only `peers` and only requests
    signed with `key`, or the error document."""
    server = server_class(bind, peers)
    last = None
    for port in ports:
        try:
            return server((bind, port), make_handler(board, key)), port
        except OSError as exc:
            last = exc
    return None, {"error": "cannot listen on %s port %s: %s"
                  % (bind, "-".join(str(p) for p in (ports[0], ports[-1]) if ports),
                     os.strerror(getattr(last, "errno", 0) or 0))}


def detach(server, port, run, found):
    """Fork the server off (it runs `run()` in the grandchild); {"pid", "port"} in the parent."""
    doc = {"pid": run_detached(run, server.server_close), "port": port}
    doc.update(found)
    return doc


def serve(args, stdin):
    root = directory(args)
    seconds = number(args, "--for", 3600.0)
    tag = args.get("--tag", "")
    port = int(args.get("--port", "0")) if args.get("--port", "").isdigit() else 0
    if not tag.isalnum() or not 0 < port < 65536:
        raise Refused("bad --tag or --port")
    token = read_token(stdin)
    peers = read_peers(read_input(stdin, optional=True))
    rootfd = enter(root)
    if rootfd is None:
        raise Refused("%s is not a directory" % root)
    os.close(rootfd)
    files, skipped, _ = walk(root)
    board = Board(root, os.path.realpath(root))
    for path, found in files.items():
        board.offer(path, found)
    server, port = listen(bind_address(args), [port], board, token, peers)
    if server is None:
        return port
    return detach(server, port, lambda: run_server(server, seconds, board),
                  {"files": len(files), "skipped": skipped})


def run_server(server, seconds, board, idle_exit=False):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    timer = threading.Timer(seconds, lambda: os._exit(0))
    timer.daemon = True
    timer.start()
    if idle_exit:
        watcher = threading.Thread(target=exit_when_idle, args=(board,))
        watcher.daemon = True
        watcher.start()
    server.serve_forever(poll_interval=0.5)


def exit_when_idle(board):
    """A relay whose fetch is over and that nobody asked for a file for IDLE_EXIT_S (since the
    fetch ended, or the last request) exits: the laptop has read its status by then."""
    while True:
        time.sleep(1.0)
        with board.cond:
            over = board.status["state"] in ("done", "failed")
            idle = board.active == 0 and time.monotonic() - board.last_request > IDLE_EXIT_S
        if over and idle:
            os._exit(0)


def stop(args, _stdin):
    tag = args.get("--tag", "")
    pid = args.get("--pid", "")
    if not tag.isalnum() or not pid.isdigit() or int(pid) <= 1:
        raise Refused("bad --tag or --pid")
    return stop_tagged(int(pid), tag, STOP_WAIT_S)


# ---------------------------------------------------------------- fetching


class Upstreams(object):
    """The servers a fetch may read from, nearest first; a silent one is passed over."""

    def __init__(self, urls, key):
        self.urls, self.key, self.current = list(urls), key, 0

    def request(self, path, have=0):
        """A GET of the file's bytes from `have` on, signed with the run's key (the key itself
        is never sent)."""
        target = "/" + urllib.parse.quote(path)
        return urllib.request.Request(self.urls[self.current] + target, headers=auth_headers(
            self.key, target, "bytes=%d-" % have if have else None))

    def host(self):
        return self.urls[self.current].split("/")[2]

    def next(self):
        self.current = (self.current + 1) % len(self.urls)


def fetch(args, stdin):
    root = directory(args, must_exist=False)
    seconds = number(args, "--for", 3600.0)
    url = args.get("--url", "")
    if not url.startswith("http://") or len(url) > 300:
        raise Refused("bad --url")
    token = read_token(stdin)
    wanted = read_files(read_input(stdin))
    rootfd = enter(root, create=True)
    try:
        lock(rootfd, root)
        return fetch_all(rootfd, Upstreams([url], token), wanted, time.monotonic() + seconds,
                         single=True)
    finally:
        os.close(rootfd)


def lock(rootfd, root, wait_s=0.0):
    """One fetch at a time into a directory: a relay waits up to wait_s for an earlier run's
    fetch (one whose link was cut gives up within GIVE_UP_S of its last byte)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(rootfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            if time.monotonic() >= end:
                raise Refused("another copy is writing into %s" % root)
            time.sleep(1.0)


def fetch_all(rootfd, upstreams, wanted, deadline, single=False, board=None):
    out = []
    down = None                     # the source did not answer: the other files are not tried
    for entry in wanted:
        if down is not None:
            out.append({"path": entry["path"], "status": "failed",
                        "reason": "not tried: %s" % down})
        else:
            try:
                got = fetch_one(rootfd, upstreams, entry, deadline, single, board)
                out.append({"path": entry["path"], "status": "ok", "bytes": got})
            except Unreachable as exc:
                down = str(exc)[:200]
                out.append({"path": entry["path"], "status": "failed",
                            "reason": str(exc)[:300]})
            except (Refused, OSError) as exc:
                out.append({"path": entry["path"], "status": "failed",
                            "reason": str(exc)[:300]})
        if board is not None and out[-1]["status"] != "ok":
            board.update(entry["path"], state="failed")
            with board.cond:
                board.status["failed"].append({"path": entry["path"],
                                               "reason": out[-1]["reason"]})
    return {"files": out, "ok": sum(1 for o in out if o["status"] == "ok"),
            "failed": sum(1 for o in out if o["status"] != "ok"),
            "bytes": sum(o.get("bytes", 0) for o in out)}


def read_input(stdin, optional=False):
    text = stdin.read(MAX_INPUT + 1)
    if len(text) > MAX_INPUT:
        raise Refused("the input is too long")
    if optional and not text.strip():
        return {}
    try:
        doc = json.loads(text)
    except ValueError:
        raise Refused("the input is not JSON")
    if not isinstance(doc, dict):
        raise Refused("the input must be a JSON object")
    return doc


def read_files(doc):
    files = doc.get("files")
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise Refused("the file list must be {\"files\": [...]}, at most %d" % MAX_FILES)
    seen = set()
    total = 0
    for e in files:
        if not (isinstance(e, dict) and isinstance(e.get("path"), str)
                and type(e.get("size")) is int and 0 <= e["size"] <= MAX_FILE_BYTES
                and isinstance(e.get("sha256"), str) and len(e["sha256"]) == 64
                and all(c in "0123456789abcdef" for c in e["sha256"])
                and (e.get("mode") is None or type(e["mode"]) is int and 0 <= e["mode"] < 4096)):
            raise Refused("bad file entry %r" % (str(e)[:100],))
        safe_relative(e["path"])
        if e["path"] in seen:
            raise Refused("%r is listed twice" % e["path"][:200])
        seen.add(e["path"])
        total += e["size"]
    if total > MAX_TOTAL_BYTES:
        raise Refused("the file list holds %d bytes, more than %d" % (total, MAX_TOTAL_BYTES))
    return files


def safe_relative(path):
    """A relative path of plain components (no .., no absolute path, no empty part)."""
    parts = path.split("/")
    if not path or len(path) > MAX_PATH or "\0" in path or "\\" in path \
            or any(p in ("", ".", "..") or len(p) > 255 for p in parts) \
            or parts[-1].endswith(PART) or path == STATUS:
        raise Refused("refused path %r" % path[:200])
    return parts


def open_part(dfd, name, size):
    """(fd, bytes already there) of name.part in dfd: reused only when it is a regular file
    with one link, ours and not longer than size; otherwise removed and created exclusively."""
    part = name + PART
    stale = True
    try:
        fd = os.open(part, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        stale = False
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES,
                             errno.EPERM, errno.ETXTBSY):
            raise
    else:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid() \
                and st.st_size <= size:
            return fd, st.st_size
        os.close(fd)
    if stale:
        try:
            os.unlink(part, dir_fd=dfd)             # the name itself, never a link's target
        except OSError as exc:
            raise Refused("%s is in the way: %s" % (part[:200], os.strerror(exc.errno or 0)))
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | CLOEXEC, 0o600,
                 dir_fd=dfd)
    return fd, 0


def fetch_one(rootfd, upstreams, entry, deadline, single=True, board=None):
    """Download one file into place; the bytes it moved. Raises Refused with the reason."""
    parts = safe_relative(entry["path"])
    size = entry["size"]
    dfd = open_parent(rootfd, parts, create=True)
    try:
        name = parts[-1]
        fd, have = open_part(dfd, name, size)
        try:
            st = os.fstat(fd)
            if board is not None:
                board.update(entry["path"], state="landing", landed=have,
                             key=(st.st_dev, st.st_ino))
            h = sha256_fd(fd, deadline, entry["path"], have)
            moved = receive(upstreams, entry, fd, have, h, deadline, single, board)
            digest = h.hexdigest()
            if digest != entry["sha256"]:
                os.close(fd)
                fd = None
                os.unlink(name + PART, dir_fd=dfd)
                raise Refused("sha256 mismatch: got %s, expected %s"
                              % (digest[:12], entry["sha256"][:12]))
            mode = entry.get("mode")
            os.fchmod(fd, (mode if type(mode) is int else 0o600) & MODE_MASK)
        finally:
            if fd is not None:
                os.close(fd)
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                raise Refused("%s is a directory here" % entry["path"][:200])
        except FileNotFoundError:
            pass
        os.rename(name + PART, name, src_dir_fd=dfd, dst_dir_fd=dfd)   # replaces a link itself
        if board is not None:
            board.update(entry["path"], state="done")
        return moved
    finally:
        os.close(dfd)


def receive(upstreams, entry, fd, have, h, deadline, single, board):
    """Bytes [have, size) of the file into fd from the upstreams (a silent one is bypassed,
    resuming where it stopped); the bytes moved."""
    size, moved = entry["size"], 0
    last_progress = time.monotonic()
    tried = 0
    while have < size:
        if time.monotonic() > deadline:
            raise Refused("out of time (the .part is kept: run again to resume)")
        try:
            got = download(upstreams.request(entry["path"], have), fd, have, size, h, deadline,
                           board, entry["path"])
        except Unreachable as exc:
            got, why = exc.written, exc
        else:
            why = None
        have += got
        moved += got
        if got:
            last_progress, tried = time.monotonic(), 0
        if have >= size:
            break
        if single:
            raise why if why is not None else Unreachable("the source ended early")
        tried += 1
        upstreams.next()
        if board is not None:
            board.note(upstream=upstreams.current)
        if time.monotonic() - last_progress > GIVE_UP_S:
            raise Unreachable("no upstream sent a byte for %d s (last: %s)"
                              % (GIVE_UP_S, str(why)[:150]))
        if tried >= len(upstreams.urls):
            time.sleep(1.0)
            tried = 0
    return moved


def download(request, fd, have, size, h, deadline, board=None, path=None):
    """Append bytes [have, size) from the request's reply to fd (hashing them); the bytes
    written. Never more than size - have: the reply is not read further. Unreachable(msg,
    written) on a lost source."""
    url = request.full_url
    written = 0
    try:
        timeout = max(1.0, min(STALL_S, deadline - time.monotonic()))
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            check_reply(reply, have, size)
            read = getattr(reply, "read1", reply.read)
            while have + written < size:
                if time.monotonic() > deadline:
                    raise Refused("out of time (the .part is kept: run again to resume)")
                block = read(min(CHUNK, size - have - written))
                if not block:
                    raise Unreachable("the source ended at %d of %d bytes"
                                      % (have + written, size), written)
                os.pwrite(fd, block, have + written)
                h.update(block)
                written += len(block)
                if board is not None:
                    board.update(path, landed=have + written)
                    with board.cond:
                        board.status["bytes"] += len(block)
        return written
    except urllib.error.HTTPError as exc:
        code = "HTTP %d%s" % (exc.code, refusal(exc))
        if board is None:                   # one source: this file is refused, not the source
            raise Refused("%s from the source" % code)
        raise Unreachable("%s from %s" % (code, url.split("/")[2]), written)
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as exc:
        raise Unreachable("cannot download from %s: %s"
                          % (url.split("/")[2], getattr(exc, "reason", None) or exc), written)


def refusal(exc):
    """` (why)` of a 403 from a model_copy server (a bad, stale or replayed signature; the
    clocks of two nodes apart by more than AUTH_WINDOW_S), else ""."""
    if exc.code != 403:
        return ""
    try:
        why = exc.read(64).decode("ascii", "replace").strip()
    except (OSError, ValueError):
        return ""
    return " (%s)" % why if why in REFUSALS else ""


def check_reply(reply, have, size):
    """The reply must be the bytes [have, size) of a file of `size` bytes, as its headers say."""
    length = reply.headers.get("Content-Length")
    if length is not None and (not length.strip().isdigit() or int(length) != size - have):
        raise Refused("the source offers %s bytes, the manifest expects %d"
                      % (length[:20], size - have))
    if have and reply.status != 206:
        raise Refused("the server ignored the range (status %d)" % reply.status)
    if reply.status == 206:
        want = "bytes %d-%d/%d" % (have, size - 1, size)
        if (reply.headers.get("Content-Range") or "").strip() != want:
            raise Refused("the source's Content-Range is not %r" % want)


# ---------------------------------------------------------------- relaying


def relay(args, stdin):
    root = directory(args, must_exist=False)
    seconds = number(args, "--for", 3600.0)
    tag = args.get("--tag", "")
    ports = port_range(args.get("--ports", ""))
    if not tag.isalnum():
        raise Refused("bad --tag")
    token = read_token(stdin)
    doc = read_input(stdin)
    files = read_files(doc)
    peers = read_peers(doc)
    want = doc.get("fetch")
    urls = doc.get("upstreams")
    if not isinstance(want, list) or len(want) > MAX_FILES \
            or not all(isinstance(p, str) for p in want) \
            or not isinstance(urls, list) or len(urls) > MAX_UPSTREAMS \
            or not all(isinstance(u, str) and u.startswith("http://") and len(u) < 300
                       for u in urls) or (want and not urls):
        raise Refused("the input needs fetch: [paths] and upstreams: [http://IP:PORT]")
    os.close(enter(root, create=True))
    real_root = os.path.realpath(root)
    board = Board(root, real_root)
    by_path = dict((e["path"], e) for e in files)
    wanted = set(p for p in want if p in by_path)
    want = [e for e in files if e["path"] in wanted]
    have, skipped, _ = walk(root)
    for e in files:
        found = have.get(e["path"])
        if e["path"] in wanted or found is None:
            board.offer(e["path"], size=e["size"])
        else:
            board.offer(e["path"], found)
    board.status.update(files=len(want), total=sum(e["size"] for e in want),
                        state="running" if want else "done", verified=not want)
    for e in files:                          # on disk but not listed to fetch: must match
        if e["path"] not in wanted and board.entries[e["path"]]["size"] != e["size"]:
            board.entries[e["path"]]["state"] = "failed"
    server, port = listen(bind_address(args), ports, board, token, peers)
    if server is None:
        return port

    def run():
        lock_fd = open_root(real_root)
        thread = threading.Thread(target=relay_fetch, args=(board, lock_fd, root, Upstreams(
            urls or ["http://unused"], token), want, time.monotonic() + seconds))
        thread.daemon = True
        thread.start()
        run_server(server, seconds, board, idle_exit=True)

    return detach(server, port, run, {"files": len(want), "skipped": skipped})


def relay_fetch(board, rootfd, root, upstreams, want, deadline):
    """The relay's fetch thread: the directory locked while it writes, released after (the
    server goes on serving what it has)."""
    try:
        lock(rootfd, root, GIVE_UP_S + STALL_S * 3)
        try:
            result = fetch_all(rootfd, upstreams, want, deadline, board=board)
        finally:
            fcntl.flock(rootfd, fcntl.LOCK_UN)
        board.note(state="done" if not result["failed"] else "failed", done=result["ok"],
                   verified=not result["failed"])
    except (Refused, OSError) as exc:
        with board.cond:
            board.status["failed"].append({"path": "", "reason": str(exc)[:300]})
            for entry in board.entries.values():
                if entry["state"] in ("pending", "landing"):
                    entry["state"] = "failed"
        board.note(state="failed", verified=False)


def port_range(text):
    low, dash, high = text.partition("-")
    if not low.isdigit() or (dash and not high.isdigit()) or len(text) > 11:
        raise Refused("bad --ports (LOW-HIGH)")
    low, high = int(low), int(high) if dash else int(low)
    if not 0 < low <= high < 65536 or high - low > 1000:
        raise Refused("bad --ports (LOW-HIGH, at most 1000 ports)")
    return list(range(low, high + 1))


# ---------------------------------------------------------------- arguments


def directory(args, must_exist=True):
    root = args.get("--dir", "")
    if not root.startswith("/") or len(root) > MAX_PATH or "\0" in root:
        raise Refused("--dir must be an absolute path")
    if must_exist and not os.path.isdir(root):
        raise Refused("%s is not a directory" % root)
    return os.path.normpath(root)


def bind_address(args):
    """--bind: an IPv4 or IPv6 address (the node's own; never a name)."""
    bind = args.get("--bind", "")
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, bind)
            return bind
        except (OSError, ValueError):
            pass
    raise Refused("bad --bind (an IP address)")


def number(args, flag, default):
    try:
        value = float(args.get(flag, default))
    except ValueError:
        raise Refused("bad %s" % flag)
    if not 0 < value <= MAX_SECONDS:
        raise Refused("bad %s" % flag)
    return value


def read_token(stdin):
    token = stdin.readline().strip()
    if not 16 <= len(token) <= 200 or not all(c.isalnum() or c in "-_" for c in token):
        raise Refused("no token on stdin's first line")
    return token


VERBS = {"manifest": manifest, "serve": serve, "fetch": fetch, "relay": relay, "stop": stop}


def main(argv, stdin):
    if not argv or argv[0] not in VERBS or len(argv) % 2 == 0:
        sys.stdout.write(json.dumps({"error": "usage: %s ARGS" % "|".join(VERBS)}) + "\n")
        return 2
    args = dict(zip(argv[1::2], argv[2::2]))
    ON_NODE.append(True)
    try:
        doc = VERBS[argv[0]](args, stdin)
    except (Refused, OSError) as exc:
        doc = {"error": str(exc)[:500]}
    sys.stdout.write(json.dumps(doc) + "\n")
    return 0 if "error" not in doc else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], sys.stdin))
