"""On a node: copy a model directory node to node over HTTP, in four verbs, each printing one
JSON document.

    manifest --dir D [--for S]      every file under D: relative path, size, sha256 (read in
                                    1 MiB chunks). A symlink to a regular file is listed as a
                                    file ("link": true, its content hashed); a symlink to a
                                    directory or to nothing is listed under "skipped" with the
                                    reason (directory links are not followed). `*.part` files
                                    (interrupted fetches) are counted under "partial", not listed.
    serve --dir D --bind IP --port P --for S --tag T
                                    a detached HTTP server (double fork) that serves the files
                                    the walk of D found at startup, only at /TOKEN/<path>, with
                                    Range requests (resume); it exits by itself after S seconds.
                                    Prints {"pid", "port"} or {"error"}.
    fetch --dir D --url http://IP:P --for S
                                    downloads each listed file into D/<path>.part, resuming from
                                    the .part's size (a Range request), checks size and sha256,
                                    then renames it into place. A mismatch deletes the .part.
    stop --pid PID --tag T          ends the server started with that tag.

The secret token is never on the command line: stdin's first line holds it (serve, fetch); the
rest of stdin is fetch's file list, {"files": [{"path", "size", "sha256"}]}. Shipped as
`python3 -c BOOT VERB ARGS` where BOOT reads this program as stdin's first line (a JSON string)
and its input after it (cluster/node_programs/__init__.py). Stdlib only, Python 3.8+.
"""

import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from cluster.node_programs._common import detach_grandchild, stop_tagged

CHUNK = 1 << 20
MAX_FILES = 100000
MAX_PATH = 4096
MAX_INPUT = 64 << 20
MAX_SECONDS = 86400.0
REQUEST_TIMEOUT_S = 60.0
PART = ".part"
STOP_WAIT_S = 5.0


class Refused(Exception):
    """A request or an input this program will not act on (the reason is the message)."""


class Unreachable(Refused):
    """The source did not answer (refused, dropped, timed out)."""


# ---------------------------------------------------------------- walking and hashing


def walk(root):
    """(files, skipped, partial): files maps relative path -> (absolute path, is a link)."""
    files, skipped, partial = {}, {}, 0
    for top, dirs, names in os.walk(root, followlinks=False):
        for d in list(dirs):
            full = os.path.join(top, d)
            if os.path.islink(full):
                skipped[rel(root, full)] = "a link to a directory (not followed)"
                dirs.remove(d)
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(top, name)
            path = rel(root, full)
            if name.endswith(PART):
                partial += 1
                continue
            link = os.path.islink(full)
            if not os.path.isfile(full):
                skipped[path] = "a link to nothing" if link else "not a regular file"
                continue
            files[path] = (full, link)
            if len(files) > MAX_FILES:
                raise Refused("more than %d files under %s" % (MAX_FILES, root))
    return files, skipped, partial


def rel(root, full):
    return os.path.relpath(full, root).replace(os.sep, "/")


def sha256_of(path, deadline):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)
            if time.monotonic() > deadline:
                raise Refused("out of time hashing %s" % path)


def manifest(args, _stdin):
    root = directory(args, must_exist=False)
    seconds = number(args, "--for", 3600.0)
    if not os.path.isdir(root):
        return {"dir": root, "exists": False, "files": [], "skipped": {}, "partial": 0}
    deadline = time.monotonic() + seconds
    files, skipped, partial = walk(root)
    listed = []
    for path, (full, link) in sorted(files.items()):
        entry = {"path": path, "size": os.path.getsize(full), "sha256": sha256_of(full, deadline)}
        if link:
            entry["link"] = True
        listed.append(entry)
    return {"dir": root, "exists": True, "files": listed, "skipped": skipped,
            "partial": partial}


# ---------------------------------------------------------------- serving


def make_handler(files, token):
    from http.server import BaseHTTPRequestHandler

    prefix = "/" + token + "/"

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def do_GET(self):
            try:
                full = self.lookup()
            except Refused as exc:
                return self.refuse(404, str(exc))
            size = os.path.getsize(full)
            try:
                start, end = byte_range(self.headers.get("Range"), size)
            except Refused as exc:
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
            with open(full, "rb") as f:
                f.seek(start)
                left = end - start
                while left > 0:
                    block = f.read(min(CHUNK, left))
                    if not block:
                        break
                    self.wfile.write(block)
                    left -= len(block)
            return None

        def lookup(self):
            raw = self.path.split("?", 1)[0]
            if not hmac.compare_digest(raw[:len(prefix)].encode(), prefix.encode()):
                raise Refused("not found")
            path = urllib.parse.unquote(raw[len(prefix):])
            entry = files.get(path)
            if entry is None:
                raise Refused("not found")
            return entry[0]

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


def serve(args, stdin):
    from http.server import ThreadingHTTPServer

    root = directory(args)
    seconds = number(args, "--for", 3600.0)
    tag = args.get("--tag", "")
    port = int(args.get("--port", "0"))
    if not tag.isalnum() or not 0 < port < 65536:
        raise Refused("bad --tag or --port")
    token = read_token(stdin)
    files, skipped, _ = walk(root)
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.allow_reuse_address = True
    try:
        server = ThreadingHTTPServer((args["--bind"], port), make_handler(files, token))
    except OSError as exc:
        return {"error": "cannot listen on %s:%d: %s" % (args["--bind"], port,
                                                         os.strerror(exc.errno or 0))}
    read, write = os.pipe()
    first = os.fork()
    if first == 0 and detach_grandchild():
        os.close(read)
        os.write(write, str(os.getpid()).encode())
        os.close(write)
        run_server(server, seconds)
        os._exit(0)
    if first == 0:
        os._exit(0)
    os.close(write)
    server.server_close()
    os.waitpid(first, 0)
    got = os.read(read, 32)
    os.close(read)
    return {"pid": int(got) if got.isdigit() else None, "port": port, "files": len(files),
            "skipped": skipped}


def run_server(server, seconds):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    timer = threading.Timer(seconds, lambda: os._exit(0))
    timer.daemon = True
    timer.start()
    server.serve_forever(poll_interval=0.5)


def stop(args, _stdin):
    tag = args.get("--tag", "")
    pid = args.get("--pid", "")
    if not tag.isalnum() or not pid.isdigit() or int(pid) <= 1:
        raise Refused("bad --tag or --pid")
    return stop_tagged(int(pid), tag, STOP_WAIT_S)


# ---------------------------------------------------------------- fetching


def fetch(args, stdin):
    root = directory(args, must_exist=False)
    seconds = number(args, "--for", 3600.0)
    url = args.get("--url", "")
    if not url.startswith("http://") or len(url) > 300:
        raise Refused("bad --url")
    token = read_token(stdin)
    wanted = read_files(stdin)
    deadline = time.monotonic() + seconds
    os.makedirs(root, exist_ok=True)
    out = []
    down = None                     # the source did not answer: the other files are not tried
    for entry in wanted:
        if down is not None:
            out.append({"path": entry["path"], "status": "failed",
                        "reason": "not tried: %s" % down})
            continue
        try:
            got = fetch_one(root, url, token, entry, deadline)
            out.append({"path": entry["path"], "status": "ok", "bytes": got})
        except Unreachable as exc:
            down = str(exc)[:200]
            out.append({"path": entry["path"], "status": "failed", "reason": str(exc)[:300]})
        except Refused as exc:
            out.append({"path": entry["path"], "status": "failed", "reason": str(exc)[:300]})
    return {"files": out, "ok": sum(1 for o in out if o["status"] == "ok"),
            "failed": sum(1 for o in out if o["status"] != "ok"),
            "bytes": sum(o.get("bytes", 0) for o in out)}


def read_files(stdin):
    text = stdin.read(MAX_INPUT + 1)
    if len(text) > MAX_INPUT:
        raise Refused("the file list is too long")
    try:
        doc = json.loads(text)
    except ValueError:
        raise Refused("the file list is not JSON")
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise Refused("the file list must be {\"files\": [...]}, at most %d" % MAX_FILES)
    for e in files:
        if not (isinstance(e, dict) and isinstance(e.get("path"), str)
                and type(e.get("size")) is int and 0 <= e["size"] < 1 << 50
                and isinstance(e.get("sha256"), str) and len(e["sha256"]) == 64):
            raise Refused("bad file entry %r" % (str(e)[:100],))
        safe_relative(e["path"])
    return files


def safe_relative(path):
    """A relative path of plain components (no .., no absolute path, no empty part)."""
    parts = path.split("/")
    if not path or len(path) > MAX_PATH or "\0" in path or "\\" in path \
            or any(p in ("", ".", "..") for p in parts) or parts[-1].endswith(PART):
        raise Refused("refused path %r" % path[:200])
    return parts


def destination(root, path):
    """D/path, its parents created, refused if a parent resolves outside D (a symlink)."""
    full = os.path.join(root, *safe_relative(path))
    parent = os.path.dirname(full)
    os.makedirs(parent, exist_ok=True)
    real_root = os.path.realpath(root)
    real_parent = os.path.realpath(parent)
    if real_parent != real_root and not real_parent.startswith(real_root + os.sep):
        raise Refused("%s leads outside %s (a link)" % (path, root))
    return full


def fetch_one(root, url, token, entry, deadline):
    """Download one file; the bytes it moved. Raises Refused with the reason."""
    full = destination(root, entry["path"])
    part = full + PART
    have = os.path.getsize(part) if os.path.isfile(part) else 0
    if have > entry["size"]:
        os.unlink(part)
        have = 0
    moved = 0
    if have < entry["size"]:
        moved = download(url + "/" + token + "/" + urllib.parse.quote(entry["path"]), part, have,
                         deadline)
    elif not os.path.exists(part):
        open(part, "wb").close()
    size = os.path.getsize(part)
    if size != entry["size"]:
        os.unlink(part)
        raise Refused("size %d, expected %d" % (size, entry["size"]))
    digest = sha256_of(part, deadline)
    if digest != entry["sha256"]:
        os.unlink(part)
        raise Refused("sha256 mismatch: got %s, expected %s" % (digest[:12], entry["sha256"][:12]))
    os.chmod(part, 0o644)
    os.replace(part, full)
    return moved


def download(url, part, have, deadline):
    request = urllib.request.Request(url, headers={"Range": "bytes=%d-" % have} if have else {})
    moved = 0
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            if have and reply.status != 206:
                raise Refused("the server ignored the range (status %d)" % reply.status)
            with open(part, "ab") as f:
                while True:
                    if time.monotonic() > deadline:
                        raise Refused("out of time (the .part is kept: run again to resume)")
                    block = reply.read(CHUNK)
                    if not block:
                        return moved
                    f.write(block)
                    moved += len(block)
    except urllib.error.HTTPError as exc:
        raise Refused("HTTP %d from the source" % exc.code)
    except (urllib.error.URLError, socket.timeout, ConnectionError) as exc:
        raise Unreachable("cannot download from %s: %s"
                          % (url.split("/")[2], getattr(exc, "reason", None) or exc))


# ---------------------------------------------------------------- arguments


def directory(args, must_exist=True):
    root = args.get("--dir", "")
    if not root.startswith("/") or len(root) > MAX_PATH or "\0" in root:
        raise Refused("--dir must be an absolute path")
    if must_exist and not os.path.isdir(root):
        raise Refused("%s is not a directory" % root)
    return os.path.normpath(root)


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


VERBS = {"manifest": manifest, "serve": serve, "fetch": fetch, "stop": stop}


def main(argv, stdin):
    if not argv or argv[0] not in VERBS or len(argv) % 2 == 0:
        sys.stdout.write(json.dumps({"error": "usage: %s ARGS" % "|".join(VERBS)}) + "\n")
        return 2
    args = dict(zip(argv[1::2], argv[2::2]))
    try:
        doc = VERBS[argv[0]](args, stdin)
    except (Refused, OSError) as exc:
        doc = {"error": str(exc)[:500]}
    sys.stdout.write(json.dumps(doc) + "\n")
    return 0 if "error" not in doc else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], sys.stdin))
