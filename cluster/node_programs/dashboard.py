"""On the head: one request to the Ray dashboard's REST API on the head's loopback, for
cluster/ray/dashboard_api.py. Prints one JSON document:

    dashboard request BASE TIMEOUT LOCK_FILE   stdin: {"method", "path", "body", "redact"}
    dashboard apply   BASE TIMEOUT LOCK_FILE   stdin: {"upsert": app} | {"remove": name},
                                                      "http_options"
    {"op", "status", "json", "text", "error"[, "merge"]}

`apply`: Serve's `PUT /api/serve/applications/` REPLACES every declaratively deployed app, so
GET + merge (`merge_applications`) + PUT run here in one go, under a lock file on the head
(LOCK_FILE, `~` expanded here; its folder must be this user's private one, the file is never
opened through a link): deploying app B keeps app A, and concurrent deploys do not overwrite
each other; the other apps'
configs never leave the head. `redact`: runtime_env env_vars values are masked before the reply
leaves the head. The request travels on stdin (after the program, see __init__.py), never in
argv. A Ray auth token is read here ($RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token,
else the environment of the head's own gcs_server/raylet), never passed in or printed.
Stdlib only, Python 3.8+; merge_applications and redact_runtime_envs are pure and the laptop
imports them from here too.
"""

import json
import os
import sys
import urllib.error
import urllib.request

from cluster.node_programs._common import auth_token, private_dir

SERVE_API = "/api/serve/applications/"
# The lock every declarative change of Serve's apps on this head takes (`cluster deploy` through
# this program, the health job's rebuilds): in the Ray user's private folder, `~` expanded here.
SERVE_APPLY_LOCK = "~/.cache/cluster/serve-apply.lock"
TEXT_TAIL = 4000
REDACTED = "***"


def merge_applications(details, upsert=None, remove=None, http_options=None):
    """The PUT body that upserts one app (or removes one) and keeps every other declarative app.

    details: the GET /api/serve/applications/ reply (Serve's instance details).
    Returns {"body": the ServeDeploySchema dict or None when it must not be sent,
             "kept": [names], "untouched": [imperative apps, which PUT never changes],
             "previous": the target app's {status, last_deployed_time_s, source} or None,
             "error": why nothing may be sent, or None}.
    Pure; runs on the head (apply) and on the laptop (tests).
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
    body = {"applications": body_apps}
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


def redact_runtime_envs(value):
    """A copy with the values of every runtime_env's env_vars masked (keys kept)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "runtime_env" and isinstance(v, dict):
                v = dict(v)
                if isinstance(v.get("env_vars"), dict):
                    v["env_vars"] = {name: REDACTED for name in v["env_vars"]}
                out[k] = {kk: redact_runtime_envs(vv) if kk != "env_vars" else vv
                          for kk, vv in v.items()}
            else:
                out[k] = redact_runtime_envs(v)
        return out
    if isinstance(value, list):
        return [redact_runtime_envs(v) for v in value]
    return value


class Dashboard:
    """HTTP to the dashboard at `base` (the token as a Bearer header when there is one)."""

    def __init__(self, base, timeout, token):
        self.base, self.timeout, self.token = base, timeout, token

    def call(self, method, path, body=None):
        """(status, text, parsed JSON or None); an HTTP error status is an answer too."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = "Bearer " + self.token
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                status, text = r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode("utf-8", "replace")
        try:
            parsed = json.loads(text) if text.strip() else None
        except ValueError:
            parsed = None
        return status, text, parsed


def request(api, payload, out):
    status, text, parsed = api.call(payload["method"], payload["path"], payload.get("body"))
    if payload.get("redact"):
        parsed = redact_runtime_envs(parsed)
    out.update(status=status, json=parsed, text=None if parsed is not None else text[-TEXT_TAIL:])


def open_lock(lock_path):
    """The lock file (made 0600) in this user's private folder, never through a link: its
    file object; PermissionError when the folder or file is another user's."""
    import stat

    path = os.path.expanduser(lock_path)
    folder = os.path.dirname(path)
    os.makedirs(os.path.dirname(folder), mode=0o700, exist_ok=True)
    private_dir(folder)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError("refused the lock file %s: not this user's regular file" % path)
    return os.fdopen(fd, "r+b")


def apply(api, payload, out, lock_path, edit=None):
    """GET, merge, PUT under the lock. `edit` (the health job's rebuild): details -> the app to
    upsert, computed from what Serve runs now, under the same lock."""
    import fcntl

    with open_lock(lock_path) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        status, text, details = api.call("GET", SERVE_API)
        if status != 200 or not isinstance(details, dict):
            out.update(status=status, text=text[-TEXT_TAIL:],
                       error="GET %s answered %s" % (SERVE_API, status))
            return
        upsert = payload.get("upsert") if edit is None else edit(details)
        merged = merge_applications(details, upsert, payload.get("remove"),
                                    payload.get("http_options"))
        body = merged.pop("body")
        out["merge"] = merged
        if body is not None:
            status, text, _ = api.call("PUT", SERVE_API, body)
            out.update(status=status, text=text[-TEXT_TAIL:])


def main(argv, stdin_text, env=None, proc="/proc"):
    op, base, timeout, lock_path = argv[0], argv[1], float(argv[2]), argv[3]
    env = os.environ if env is None else env
    out = {"op": op, "status": None, "json": None, "text": None, "error": None}
    try:
        payload = json.loads(stdin_text or "null") or {}
        api = Dashboard(base, timeout, auth_token(env, scan_ray=True, proc=proc))
        if op == "request":
            request(api, payload, out)
        elif op == "apply":
            apply(api, payload, out, lock_path)
        else:
            out["error"] = "unknown op %r" % op
    except Exception as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, exc)
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1:], sys.stdin.read())) + "\n")
