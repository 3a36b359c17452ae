"""On the head, for `cluster status` and the commands that read Ray's state: the node table, Ray's
version and the Serve applications, as the head itself sees them. Prints one JSON document:

    head_state DASHBOARD_BASE GCS_ADDRESS INCLUDE_SERVE(1|0)
    {"source": "dashboard" | "gcs" | null, "ray_version", "nodes": [...] | null,
     "serve": {...} | null, "rank_actors": [{name, state, pid, node_id}] | null,
     "errors": [...]}

The dashboard's REST API first (`/api/version`, the state API `/api/v0/nodes`, then
`/api/serve/applications/`); when it does not answer (it starts a few seconds after the GCS),
the node table from the GCS client (`ray._raylet.GcsClient`, the one non-stdlib import, only
then). A Ray auth token (token mode) is read here (the caller's env, else the one the running
Ray was started with: cluster/node_programs/_common.py find_token), never passed in or
printed. Read-only. Python 3.8+.
"""

import json
import os
import socket
import sys
import time
import urllib.request

from cluster.node_programs._common import auth_token, export_token

NODE_IMPORTS = ("ray",)           # the GCS fallback only, inside from_gcs
BUDGET_S = 35.0     # the whole query: with one last socket wait (<= 15 s) inside the client's 60 s
MAX_REPLY_BYTES = 64 << 20        # one REST reply (a 10,000-node table is ~20 MB)
CHUNK = 1 << 16


class Budget:
    """The query's time left: each wait is the smaller of its own timeout and what is left, and
    a reply is read as it arrives with the budget checked between reads, so a dashboard that
    accepts and then hangs or drips (as it can while its GCS is gone) cannot hold the program
    much past its budget."""

    def __init__(self, seconds, clock=time.monotonic):
        self.clock = clock
        self.deadline = clock() + seconds

    def wait(self, timeout):
        left = self.deadline - self.clock()
        if left <= 0.05:
            raise TimeoutError("the state query's time budget is spent")
        return min(timeout, left)


def fetcher(base, token, budget):
    headers = {"Authorization": "Bearer " + token} if token else {}

    def get(path, timeout):
        req = urllib.request.Request(base + path, headers=headers)
        with urllib.request.urlopen(req, timeout=budget.wait(timeout)) as r:
            data = bytearray()
            while True:
                chunk = r.read1(CHUNK)      # what has arrived: a drip is seen between reads
                if not chunk:
                    break
                budget.wait(timeout)
                data += chunk
                if len(data) > MAX_REPLY_BYTES:
                    raise ValueError("reply over %d bytes" % MAX_REPLY_BYTES)
            return json.loads(data.decode("utf-8", "replace"))
    return get


def from_dashboard(get, out):
    out["ray_version"] = get("/api/version", 5).get("ray_version")
    reply = get("/api/v0/nodes?detail=1&limit=10000&timeout=10", 15)
    if not reply.get("result"):
        raise RuntimeError(reply.get("msg") or "state API error")
    out["nodes"] = reply["data"]["result"]["result"]
    out["source"] = "dashboard"


def from_gcs(gcs, token, out, budget):
    host, _, port = gcs.rpartition(":")
    socket.create_connection((host.strip("[]"), int(port)), timeout=budget.wait(3)).close()
    export_token(token)                           # what the GCS client reads
    import ray
    from ray._raylet import GcsClient
    from ray.core.generated import gcs_pb2
    infos = GcsClient(address=gcs).get_all_node_info(timeout=budget.wait(10))
    nodes = []
    for node_id, info in infos.items():
        nodes.append({"node_id": node_id.hex(), "node_ip": info.node_manager_address,
                      "is_head_node": bool(info.is_head_node),
                      "state": "ALIVE" if info.state == gcs_pb2.GcsNodeInfo.ALIVE else "DEAD",
                      "node_name": info.node_name,
                      "resources_total": dict(info.resources_total),
                      "labels": dict(info.labels),
                      "start_time_ms": int(info.start_time_ms)})
    out["nodes"] = nodes
    out["source"] = "gcs"
    out["ray_version"] = out["ray_version"] or ray.__version__


RANK_ACTORS = ("/api/v0/actors?detail=1&limit=10000&timeout=10&filter_keys=class_name"
               "&filter_predicates=%3D&filter_values=RankActor")
RANK_FIELDS = ("name", "state", "pid", "node_id", "ray_namespace")


def rank_actors(get):
    """The multi-node engines' rank actors (serve_apps/gang.py), a few fields each."""
    reply = get(RANK_ACTORS, 15)
    if not reply.get("result"):
        raise RuntimeError(reply.get("msg") or "state API error")
    return [{k: a.get(k) for k in RANK_FIELDS} for a in reply["data"]["result"]["result"]]


def main(argv, env=None, budget_s=BUDGET_S):
    base, gcs, want_serve = argv[0], argv[1], argv[2] == "1"
    env = os.environ if env is None else env
    out = {"source": None, "ray_version": None, "nodes": None, "serve": None,
           "rank_actors": None, "errors": []}
    budget = Budget(budget_s)
    token = auth_token(env, scan_ray=True)
    get = fetcher(base, token, budget)
    try:
        from_dashboard(get, out)
    except Exception as exc:
        out["errors"].append("dashboard %s: %s: %s" % (base, type(exc).__name__, exc))
    if out["nodes"] is None:
        try:
            from_gcs(gcs, token, out, budget)
        except Exception as exc:
            out["errors"].append("gcs %s: %s: %s" % (gcs, type(exc).__name__, exc))
    if want_serve and out["source"] == "dashboard":
        try:
            out["serve"] = get("/api/serve/applications/", 30)
        except Exception as exc:
            out["errors"].append("serve: %s: %s" % (type(exc).__name__, exc))
        try:
            out["rank_actors"] = rank_actors(get)
        except Exception as exc:
            out["errors"].append("rank actors: %s: %s" % (type(exc).__name__, exc))
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1:])) + "\n")
