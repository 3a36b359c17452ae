"""A small client for the Ray dashboard's REST API on the head, spoken over the SSH session.

The dashboard listens on the head's loopback by default (it has no authentication of its own),
so every request runs on the head: the on-node program cluster/node_programs/dashboard.py (the
inventory's `ray.python`) sends it with urllib and prints one JSON document. Request bodies
travel on the program's stdin, never in argv. A Ray auth token (token mode) is read on the
head: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token, else the environment of the
head's own gcs_server/raylet; it is never passed in or printed.

Serve's `PUT /api/serve/applications/` REPLACES every declaratively deployed application.
`apply_application` / `remove_application` therefore do GET + merge + PUT on the head in one
command, under a lock file on the head (in the SSH user's private ~/.cache/cluster, never a
shared /tmp path another local user could own), so deploying app B keeps app A (and concurrent
`cluster deploy` runs do not overwrite each other). Other apps' configs never leave the head.
`merge_applications` is the pure merge rule; it lives in the on-node program (which runs it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from cluster.base.errors import RayError
from cluster.nodes.inventory import Inventory
from cluster.node_programs import Call, document_of, failure, program_call, run_call
from cluster.node_programs.dashboard import (SERVE_API, SERVE_APPLY_LOCK,  # noqa: F401
                                             merge_applications, redact_runtime_envs)
from cluster.nodes.endpoints import head_dashboard_base
from cluster.ray.ray_state import head_client_env

PROGRAM = "dashboard"              # cluster/node_programs/dashboard.py, run on the head
LOCK_FILE = SERVE_APPLY_LOCK    # on the head, in the SSH user's private folder
REQUEST_TIMEOUT_S = 60.0


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


def parse_reply(data: Mapping[str, Any]) -> DashboardReply:
    """The head program's JSON document -> DashboardReply (pure)."""
    return DashboardReply(status=data.get("status"), json=data.get("json"), text=data.get("text"),
                          error=data.get("error"), merge=data.get("merge") or {})


def reply_of(result, head: str) -> DashboardReply:
    """The request's CommandResult -> DashboardReply (status None, with the reason, when the
    program gave no document)."""
    got = document_of(result, PROGRAM)
    if isinstance(got, dict):
        return parse_reply(got)
    if not got.reached:
        return DashboardReply(None, error=failure(got, f"head {head}"))
    return DashboardReply(None, error=f"the request on the head printed no answer (exit "
                                      f"{got.result.exit_code}): {(got.detail or got.reason)[:300]}")


class DashboardClient:
    """Requests to the head's dashboard, each one SSH command through `session`."""

    def __init__(self, session, inventory: Inventory, timeout: float = REQUEST_TIMEOUT_S):
        self.session = session
        self.inventory = inventory
        self.timeout = timeout

    @property
    def base_url(self) -> str:
        return head_dashboard_base(self.inventory)

    def call(self, op: str, payload: Mapping[str, Any]) -> Call:
        """The command run on the head (only non-secret env in argv) and its stdin (the
        program, then the payload)."""
        body = json.dumps(payload, separators=(",", ":"))
        return program_call(self.inventory.ray.python, PROGRAM,
                            [op, self.base_url, str(self.timeout), LOCK_FILE], stdin=body,
                            env_prefix=head_client_env(self.inventory))

    def _run(self, op: str, payload: Mapping[str, Any]) -> DashboardReply:
        head = self.inventory.head
        call = self.call(op, payload)
        result = run_call(self.session, head, call, timeout=self.timeout + 30)
        return reply_of(result, head.name)

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
