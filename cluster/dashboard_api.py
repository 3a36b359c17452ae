"""A small client for the Ray dashboard's REST API on the head, spoken over the SSH session.

The dashboard listens on the head's loopback by default (it has no authentication of its own),
so every request runs on the head: a stdlib-only Python snippet (the inventory's `ray.python`)
sends it with urllib and prints one MARKER line of JSON. Request bodies travel on the
snippet's stdin (a quoted here-document), never in argv. A Ray auth token (token mode) is read
on the head: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token, else the environment of
the head's own gcs_server/raylet; it is never passed in or printed.

Serve's `PUT /api/serve/applications/` REPLACES every declaratively deployed application.
`apply_application` / `remove_application` therefore do GET + merge + PUT on the head in one
command, under a lock file on the head, so deploying app B keeps app A (and concurrent
`cluster deploy` runs do not overwrite each other). Other apps' configs never leave the head.
`merge_applications` is the pure merge rule; its source is shipped inside the snippet.
"""

from __future__ import annotations

import inspect
import json
import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping

from cluster.errors import RayError
from cluster.inventory import Inventory, redact_env
from cluster.ray_state import dashboard_target
from cluster.shell import env_prefix, heredoc

MARKER = "CLUSTER_DASHBOARD "
SERVE_API = "/api/serve/applications/"
LOCK_FILE = "/tmp/cluster-serve-apply.lock"
REQUEST_TIMEOUT_S = 60.0
REDACTED = "***"


def merge_applications(details: Mapping[str, Any] | None, upsert: Mapping[str, Any] | None = None,
                       remove: str | None = None,
                       http_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The PUT body that upserts one app (or removes one) and keeps every other declarative app.

    details: the GET /api/serve/applications/ reply (Serve's instance details).
    Returns {"body": the ServeDeploySchema dict or None when it must not be sent,
             "kept": [names], "untouched": [imperative apps, which PUT never changes],
             "previous": the target app's {status, last_deployed_time_s, source} or None,
             "error": why nothing may be sent, or None}.
    Runs on the head too (shipped by source): stdlib only, self-contained.
    """
    details = details or {}
    apps = details.get("applications") or {}
    target = upsert.get("name") if upsert else remove
    body_apps, kept, untouched, previous, error = [], [], [], None, None
    for name in sorted(apps):
        app = apps[name] or {}
        if name == target:
            previous = {"status": app.get("status"), "source": app.get("source"),
                        "last_deployed_time_s": app.get("last_deployed_time_s"),
                        "route_prefix": app.get("route_prefix")}
            continue
        config = app.get("deployed_app_config")
        if app.get("source") == "declarative" and config:
            body_apps.append(config)
            kept.append(name)
        else:
            untouched.append(name)
    if previous is not None and previous.get("source") not in (None, "declarative"):
        error = (f"application {target!r} was deployed with serve.run (imperative API): the "
                 "REST API cannot replace or remove it; use serve.delete on the cluster")
    if upsert:
        prefix = upsert.get("route_prefix")
        for name in sorted(apps):
            other = apps[name] or {}
            if name != target and prefix and other.get("route_prefix") == prefix:
                error = (f"route_prefix {prefix!r} is already used by application {name!r}: "
                         "pick another name or --route-prefix")
        body_apps.append(dict(upsert))
    body: dict[str, Any] | None = {"applications": body_apps}
    running_http = details.get("http_options")
    if running_http:
        # Serve keeps the HTTP options it started with; sending others only logs a warning.
        body["http_options"] = dict(running_http)
    elif http_options:
        body["http_options"] = dict(http_options)
    if details.get("proxy_location"):
        body["proxy_location"] = details["proxy_location"]
    if details.get("target_capacity") is not None:
        body["target_capacity"] = details["target_capacity"]
    if error or (upsert is None and previous is None):
        body = None  # nothing to remove, or refused
    return {"body": body, "kept": kept, "untouched": untouched, "previous": previous,
            "error": error, "http_options": (body or {}).get("http_options")
            or running_http or http_options}


def redact_runtime_envs(value: Any) -> Any:
    """A copy with the values of every runtime_env's env_vars masked (keys kept)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "runtime_env" and isinstance(v, dict):
                v = dict(v)
                if isinstance(v.get("env_vars"), dict):
                    v["env_vars"] = {name: "***" for name in v["env_vars"]}
                out[k] = {kk: redact_runtime_envs(vv) if kk != "env_vars" else vv
                          for kk, vv in v.items()}
            else:
                out[k] = redact_runtime_envs(v)
        return out
    if isinstance(value, list):
        return [redact_runtime_envs(v) for v in value]
    return value


# Runs on the head. argv: op, dashboard base URL, timeout, lock file. stdin: JSON payload.
_SNIPPET_MAIN = r'''
import fcntl, json, os, sys, urllib.error, urllib.request
op, base, timeout, lock_path = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
payload = json.loads(sys.stdin.read() or "null") or {}

def auth_token():
    token = os.environ.get("RAY_AUTH_TOKEN")
    if token:
        return token.strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.path.isfile(path):
        with open(path) as fh:
            return fh.read().strip()
    for pid in os.listdir("/proc"):  # the env the head's Ray was started with
        try:
            with open("/proc/%s/comm" % pid) as fh:
                if fh.read().strip() not in ("gcs_server", "raylet"):
                    continue
            with open("/proc/%s/environ" % pid, "rb") as fh:
                env = dict(i.decode("utf-8", "replace").partition("=")[::2]
                           for i in fh.read().split(b"\0") if i)
        except (OSError, ValueError):
            continue
        if env.get("RAY_AUTH_TOKEN"):
            return env["RAY_AUTH_TOKEN"].strip()
        p = env.get("RAY_AUTH_TOKEN_PATH")
        if p and os.path.isfile(p):
            with open(p) as fh:
                return fh.read().strip()
    return None

TOKEN = auth_token()

def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if TOKEN:
        headers["Authorization"] = "Bearer " + TOKEN
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode("utf-8", "replace")
    try:
        parsed = json.loads(text) if text.strip() else None
    except ValueError:
        parsed = None
    return status, text, parsed

out = {"op": op, "status": None, "json": None, "text": None, "error": None}
try:
    if op == "request":
        status, text, parsed = call(payload["method"], payload["path"], payload.get("body"))
        if payload.get("redact"):
            parsed = redact_runtime_envs(parsed)
        out.update(status=status, json=parsed, text=None if parsed is not None else text[-4000:])
    elif op == "apply":
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            status, text, details = call("GET", "/api/serve/applications/")
            if status != 200 or not isinstance(details, dict):
                out.update(status=status, text=text[-4000:],
                           error="GET /api/serve/applications/ answered %s" % status)
            else:
                merged = merge_applications(details, payload.get("upsert"),
                                            payload.get("remove"), payload.get("http_options"))
                body = merged.pop("body")
                out["merge"] = merged
                if body is not None:
                    status, text, parsed = call("PUT", "/api/serve/applications/", body)
                    out.update(status=status, text=text[-4000:])
except Exception as exc:
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
print("CLUSTER_DASHBOARD " + json.dumps(out))
'''


def snippet() -> str:
    """The program run on the head: the pure helpers' source, then the request logic."""
    # Postponed annotations: the helpers' type hints name typing objects the head never imports.
    return "\n".join(["from __future__ import annotations",
                      inspect.getsource(merge_applications),
                      inspect.getsource(redact_runtime_envs), _SNIPPET_MAIN])


@dataclass(frozen=True)
class DashboardReply:
    """One answer from the dashboard (status None: no HTTP answer at all, see error)."""

    status: int | None
    json: Any = None
    text: str | None = None
    error: str | None = None
    merge: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status is not None and 200 <= self.status < 300

    def describe(self) -> str:
        """One line: why the request did not succeed."""
        if self.error:
            return self.error
        detail = (self.text or (json.dumps(self.json) if self.json is not None else "")).strip()
        return f"HTTP {self.status}: {detail.splitlines()[-1][:500] if detail else 'no body'}"


def parse_reply(stdout: str) -> DashboardReply | None:
    payload = None
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            payload = line[len(MARKER):]
    if payload is None:
        return None
    try:
        data = json.loads(payload)
    except ValueError as exc:
        return DashboardReply(None, error=f"unreadable reply from the head: {exc}")
    return DashboardReply(status=data.get("status"), json=data.get("json"), text=data.get("text"),
                          error=data.get("error"), merge=data.get("merge") or {})


class DashboardClient:
    """Requests to the head's dashboard, each one SSH command through `session`."""

    def __init__(self, session, inventory: Inventory, timeout: float = REQUEST_TIMEOUT_S):
        self.session = session
        self.inventory = inventory
        self.timeout = timeout

    @property
    def base_url(self) -> str:
        target = dashboard_target(self.inventory)
        if ":" in target:
            target = f"[{target}]"
        return f"http://{target}:{self.inventory.ray.dashboard_port}"

    def command(self, op: str, payload: Mapping[str, Any]) -> str:
        """The shell command run on the head (payload on stdin, only non-secret env in argv)."""
        body = json.dumps(payload, separators=(",", ":"))
        head_env = {k: v for k, v in redact_env(self.inventory.head.env,
                                                 self.inventory.secret_names).items()
                    if v != REDACTED}
        argv = [self.inventory.ray.python, "-c", snippet(), op, self.base_url,
                str(self.timeout), LOCK_FILE]
        return heredoc(env_prefix(head_env) + shlex.join(argv), body)

    def _run(self, op: str, payload: Mapping[str, Any]) -> DashboardReply:
        head = self.inventory.head
        result = self.session.run(head, self.command(op, payload), timeout=self.timeout + 30)
        if not result.reached:
            return DashboardReply(None, error=f"head {head.name} {result.status}: {result.error}")
        reply = parse_reply(result.stdout)
        if reply is None:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            return DashboardReply(None, error=f"the request on the head printed no answer "
                                              f"(exit {result.exit_code}): {tail[0][:300]}")
        return reply

    def request(self, method: str, path: str, body: Any = None,
                redact: bool = True) -> DashboardReply:
        """One HTTP request; JSON replies come back parsed (runtime_env values masked)."""
        return self._run("request", {"method": method, "path": path, "body": body,
                                     "redact": redact})

    def serve_details(self) -> dict[str, Any]:
        """GET /api/serve/applications/ (env values masked). Raises RayError when unanswered."""
        reply = self.request("GET", SERVE_API)
        if not reply.ok or not isinstance(reply.json, dict):
            raise RayError(f"the dashboard on {self.inventory.head.name} did not list the Serve "
                           f"applications: {reply.describe()} (is Ray up? `cluster status`)")
        return reply.json

    def apply_application(self, app: Mapping[str, Any],
                          http_options: Mapping[str, Any] | None = None) -> DashboardReply:
        """Deploy or replace one application, keeping the other declarative apps."""
        return self._run("apply", {"upsert": dict(app), "http_options": http_options})

    def remove_application(self, name: str) -> DashboardReply:
        """Remove one application (PUT of the remaining ones); a no-op when it is absent."""
        return self._run("apply", {"remove": name})
