"""A minimal Hugging Face hub for tests: serves one directory as the model repo ORG/NAME to
huggingface_hub's snapshot_download, on the address given, and nothing else.

The endpoints snapshot_download (huggingface_hub 2.x) calls, read from the installed library:
    GET  /api/models/{repo}/revision/{rev}            repo_info: {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{sha}?recursive=..   list_repo_tree: [{"type", "path", "size",
                                                      "oid"}] (one page: no Link header)
    HEAD /{repo}/resolve/{sha}/{file}                 get_hf_file_metadata: X-Repo-Commit,
                                                      ETag, Content-Length (no X-Xet-* headers:
                                                      a plain HTTP download follows)
    GET  /{repo}/resolve/{sha}/{file}                 the bytes (Range honoured)
Every request must carry `Authorization: Bearer TOKEN` (the token is read from stdin's first
line, never argv); each request's path and whether its token matched are appended to the log
file, never the token itself.

    python tests/hub_server.py --bind IP --port P --repo ORG/NAME --dir DIR --log FILE < token
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"


def repo_files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def make_handler(root: Path, repo: str, token: str, log: Path):
    files = repo_files(root)
    oids = {name: hashlib.sha1(p.read_bytes()).hexdigest() for name, p in files.items()}

    class Hub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            ok = hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
            with log.open("a") as f:
                f.write(json.dumps({"method": self.command, "path": self.path, "token": ok})
                        + "\n")
            return ok

        def reply(self, code: int, body: bytes = b"", headers: dict | None = None,
                  send_body: bool = True) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body and body:
                self.wfile.write(body)

        def route(self, send_body: bool) -> None:
            if not self.authorized():
                return self.reply(401, b'{"error": "token"}')
            path = urllib.parse.urlsplit(self.path).path
            api = f"/api/models/{repo}/"
            if path.startswith(api + "revision/"):
                doc = {"id": repo, "sha": SHA, "private": True,
                       "siblings": [{"rfilename": n} for n in files]}
                return self.reply(200, json.dumps(doc).encode(),
                                  {"Content-Type": "application/json"}, send_body)
            if path.startswith(api + "tree/"):
                doc = [{"type": "file", "path": n, "size": files[n].stat().st_size,
                        "oid": oids[n]} for n in files]
                return self.reply(200, json.dumps(doc).encode(),
                                  {"Content-Type": "application/json"}, send_body)
            prefix = f"/{repo}/resolve/"
            if path.startswith(prefix):
                _rev, _, name = urllib.parse.unquote(path[len(prefix):]).partition("/")
                if name not in files:
                    return self.reply(404, b"", {"X-Error-Code": "EntryNotFound"}, send_body)
                data = files[name].read_bytes()
                start = 0
                rng = self.headers.get("Range", "")
                if rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
                    start = min(int(rng[6:].split("-")[0]), len(data))
                headers = {"X-Repo-Commit": SHA, "ETag": f'"{oids[name]}"',
                           "Content-Length": str(len(data) - start),
                           "Content-Type": "application/octet-stream"}
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                self.send_response(206 if start else 200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if send_body:
                    self.wfile.write(data[start:])
                return None
            return self.reply(404, b"", {"X-Error-Code": "RepoNotFound"}, send_body)

        def do_GET(self):
            self.route(True)

        def do_HEAD(self):
            self.route(False)

    return Hub


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bind", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--repo", required=True)
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--log", required=True, type=Path)
    args = p.parse_args()
    token = sys.stdin.readline().strip()
    server = ThreadingHTTPServer((args.bind, args.port),
                                 make_handler(args.dir, args.repo, token, args.log))
    server.daemon_threads = True
    print(f"hub on {args.bind}:{args.port} pid {os.getpid()}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
