"""On the head, for `cluster nccl-check`: submit the all-reduce job to the dashboard's job API on
the head's loopback, wait for it, read its result back, and print one JSON document.

    nccl_job CONFIG_JSON
    CONFIG_JSON: {base, submission_id, python, script_b64, args, timeout_s, reserve_s, metadata}

The entrypoint script (cluster/ray_jobs/nccl_allreduce.py, base64 in the config) is written to a
temporary directory, submitted (`POST /api/jobs/`, so it shows in the Ray dashboard), polled
until it ends or the deadline (then stopped), and its result file (zlib + base64) and the tail of
its logs are read back; its files are removed. The document:
{submission_id, submitted, status, message, result_z, logs_tail, errors, timed_out, waited_s,
 entrypoint}. A Ray auth token (token mode) is read here, never passed in or printed.
Stdlib only, Python 3.8+.
"""

import base64
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib

from cluster.node_programs._common import auth_token

FINAL = ("SUCCEEDED", "FAILED", "STOPPED")
LOGS_TAIL = 30000
STOP_WAIT_S = 15


class Dashboard:
    """The job API at `base`, with the token when there is one."""

    def __init__(self, base, token):
        self.base = base
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = "Bearer " + token

    def call(self, method, route, body=None, timeout=20):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + route, data=data, headers=self.headers,
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read().decode("utf-8", "replace") or "null")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace").strip().splitlines()
            raise RuntimeError("HTTP %s %s: %s" % (exc.code, route,
                                                   text[-1] if text else exc.reason))


def failed(what, exc):
    return "%s: %s: %s" % (what, type(exc).__name__, exc)


def poll(api, sid, out):
    """One status read into `out`; False when it failed (the error is recorded)."""
    try:
        info = api.call("GET", "/api/jobs/" + sid)
        out["status"], out["message"] = info.get("status"), info.get("message")
        return True
    except Exception as exc:
        out["errors"].append(failed("status", exc))
        return False


def stop(api, sid, out, sleep):
    out["timed_out"] = True
    try:
        api.call("POST", "/api/jobs/%s/stop" % sid)
    except Exception as exc:
        out["errors"].append(failed("stop", exc))
    stop_by = time.time() + STOP_WAIT_S
    while time.time() < stop_by:
        try:
            info = api.call("GET", "/api/jobs/" + sid)
            out["status"], out["message"] = info.get("status"), info.get("message")
        except Exception:
            break
        if out["status"] in FINAL:
            break
        sleep(1)


def wait(api, sid, out, deadline, sleep):
    while out["submitted"]:
        if not poll(api, sid, out) or out["status"] in FINAL:
            return
        if time.time() >= deadline:
            stop(api, sid, out, sleep)
            return
        sleep(1)


def submit_and_wait(cfg, api, out, work, sleep):
    sid = cfg["submission_id"]
    start = time.time()
    deadline = start + cfg["timeout_s"]
    script = os.path.join(work, "nccl_allreduce.py")
    with open(script, "wb") as fh:
        fh.write(base64.b64decode(cfg["script_b64"]))
    result_file = os.path.join(work, "result.json")
    # no --log-dir: each rank makes its own private folder in its node's temp dir
    args = cfg["args"] + ["--deadline", "%.3f" % (deadline - cfg["reserve_s"]),
                          "--result-file", result_file]
    out["entrypoint"] = " ".join(shlex.quote(a) for a in [cfg["python"], script] + args)
    try:
        api.call("POST", "/api/jobs/", {"entrypoint": out["entrypoint"], "submission_id": sid,
                                        "metadata": cfg["metadata"]})
        out["submitted"] = True
    except Exception as exc:
        out["errors"].append("submit to %s: %s: %s" % (cfg["base"], type(exc).__name__, exc))
    wait(api, sid, out, deadline, sleep)
    out["waited_s"] = round(time.time() - start, 2)
    if os.path.isfile(result_file):
        with open(result_file, "rb") as fh:
            out["result_z"] = base64.b64encode(zlib.compress(fh.read(), 6)).decode()
    if out["submitted"]:
        try:
            logs = api.call("GET", "/api/jobs/%s/logs" % sid).get("logs") or ""
            out["logs_tail"] = logs[-LOGS_TAIL:]
        except Exception as exc:
            out["errors"].append(failed("logs", exc))


def main(argv, env=None, sleep=time.sleep):
    cfg = json.loads(argv[0])
    env = os.environ if env is None else env
    out = {"submission_id": cfg["submission_id"], "submitted": False, "status": None,
           "message": None, "result_z": None, "logs_tail": "", "errors": [],
           "timed_out": False, "waited_s": None, "entrypoint": None}
    api = Dashboard(cfg["base"], auth_token(env, scan_ray=True))
    work = tempfile.mkdtemp(prefix="cluster-nccl-check-")
    try:
        submit_and_wait(cfg, api, out, work, sleep)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1:])) + "\n")
