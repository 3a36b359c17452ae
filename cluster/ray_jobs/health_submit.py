"""Runs ON the head (a node program, shipped by cluster/ray/health_job.py through the one runner as
`python3 -c BOOT`, this file on stdin's first line, then one JSON request line): starts the
health job (cluster/ray_jobs/health_runner.py), or keeps the one running.

Uses the head's Ray (ray.job_submission.JobSubmissionClient against the dashboard on the head's
loopback; the token of Ray's token authentication is found on the head as every client here
finds it, _common.find_token: this login's sources, else the running Ray's own, never passed
here). The job is found by its metadata (`cluster-toolkit: health`), not a
fixed submission id (Ray does not support re-using one). `ensure`: a running job whose metadata
`digest` matches (same code, same config) is kept; any other running health job is stopped;
if none is kept, the `cluster` package from the request is unpacked into a temporary
directory, submitted as the job's `py_modules` (Ray uploads it to the cluster), and the
directory removed. Prints one JSON document {action, submission_id, job_status, stopped,
error} (Ray's own chatter goes to stderr).
"""

import base64
import io
import json
import os
import shlex
import shutil
import sys
import tarfile
import tempfile
import time

from cluster.node_programs._common import answer, auth_token, export_token

# Imported from the head's own Ray install (the inventory's python runs Ray there), not stdlib.
NODE_IMPORTS = ("ray",)

ACTIVE = ("PENDING", "RUNNING")
START_WAIT_S = 30.0
RETRY_S = 60.0        # the dashboard and its job agent start a little after the nodes register


def _status(job):
    return str(getattr(job.status, "value", job.status))


def _retrying(call):
    """call() until it works or RETRY_S has passed (then its last error is raised)."""
    deadline = time.monotonic() + RETRY_S
    while True:
        try:
            return call()
        except Exception:
            if time.monotonic() >= deadline:
                raise
            time.sleep(2)


def _client(dashboard):
    export_token(auth_token(os.environ, scan_ray=True))
    from ray.job_submission import JobSubmissionClient
    return _retrying(lambda: JobSubmissionClient(dashboard))


def _active(client, req):
    return [j for j in client.list_jobs()
            if (j.metadata or {}).get(req["metadata_key"]) == req["metadata_value"]
            and _status(j) in ACTIVE and j.submission_id]


def _unpack(archive, into):
    """The package archive into `into` (plain files under cluster/ only)."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if not member.isfile() or parts[0] != "cluster" or ".." in parts \
                    or member.name.startswith("/"):
                raise ValueError("unexpected entry in the package: %r" % member.name[:100])
            target = os.path.join(into, *parts)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return os.path.join(into, "cluster")


def _submit(client, req):
    work = tempfile.mkdtemp(prefix="cluster-health-")
    try:
        package = _unpack(base64.b64decode(req["package_b64"]), work)
        entrypoint = shlex.join([req["python"], "-m", "cluster.ray_jobs.health_runner",
                                 json.dumps(req["config"], separators=(",", ":"))])
        sid = "%s%s-%s" % (req["submission_prefix"], time.strftime("%Y%m%d-%H%M%S"),
                           os.urandom(3).hex())
        metadata = {req["metadata_key"]: req["metadata_value"], "digest": req["digest"],
                    "period_s": "%g" % req["config"]["period_s"]}
        def submit():
            try:
                return client.submit_job(entrypoint=entrypoint, submission_id=sid,
                                         runtime_env={"py_modules": [package]},
                                         metadata=metadata, entrypoint_num_cpus=0)
            except Exception as exc:  # an earlier try went through after all
                if "already exists" in str(exc):
                    return sid
                raise
        return _retrying(submit)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _wait_started(client, sid, out):
    deadline = time.monotonic() + START_WAIT_S
    while True:
        info = client.get_job_info(sid)
        out["job_status"] = _status(info)
        if out["job_status"] != "PENDING" or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if out["job_status"] not in ACTIVE:
        logs = (client.get_job_logs(sid) or "").strip().splitlines()
        out["error"] = "the health job %s ended at once (%s): %s" % (
            sid, out["job_status"], (logs[-1] if logs else info.message or "no log")[:300])


def ensure(req):
    out = {"action": None, "submission_id": None, "job_status": None, "stopped": [],
           "error": None}
    try:
        client = _client(req["dashboard"])
        jobs = _active(client, req)
        keep = next((j for j in jobs if (j.metadata or {}).get("digest") == req["digest"]), None)
        for job in jobs:
            if job is not keep:
                client.stop_job(job.submission_id)
                out["stopped"].append(job.submission_id)
        if keep is not None:
            out.update(action="kept", submission_id=keep.submission_id, job_status=_status(keep))
        else:
            out.update(action="submitted", submission_id=_submit(client, req))
            _wait_started(client, out["submission_id"], out)
    except Exception as exc:  # one line back to the laptop, never a traceback
        lines = str(exc).strip().splitlines()
        out["error"] = "%s: %s" % (type(exc).__name__, lines[-1][:300] if lines else "")
    return out


def handle(req):
    if req.get("action") != "ensure":
        return {"error": "unknown action %r" % req.get("action")}
    return ensure(req)


def main():
    answer(handle, json.loads(sys.stdin.readline()))


if __name__ == "__main__":
    main()
