"""The replica's API-key check (serve_apps/api_key.py KeyCheck), which replaced vLLM's internal
AuthenticationMiddleware (issue 40 item 3): the same answers for the same requests."""

from __future__ import annotations

import asyncio

import pytest

from serve_apps.api_key import KeyCheck

KEY = "sk-test-4b1f"


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _status(path, auth=None, method="GET", root_path="", kind="http"):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    headers = [(b"authorization", auth.encode())] if auth is not None else []
    scope = {"type": kind, "path": path, "method": method, "headers": headers,
             "root_path": root_path}
    asyncio.run(KeyCheck(_app, tokens=[KEY])(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("path, auth, method, root, status", [
    ("/v1/completions", f"Bearer {KEY}", "POST", "", 200),
    ("/v1/completions", f"bearer {KEY}", "POST", "", 200),
    ("/v1/completions", None, "POST", "", 401),
    ("/v1/models", "Bearer wrong", "GET", "", 401),
    ("/v1/models", KEY, "GET", "", 401),                 # no scheme
    ("/v1/models", f"Basic {KEY}", "GET", "", 401),
    ("/app/v1/models", None, "GET", "/app", 401),       # under a route prefix
    ("/app/v1/models", f"Bearer {KEY}", "GET", "/app", 200),
    ("/health", None, "GET", "", 200),
    ("/metrics", None, "GET", "", 200),
    ("/v1/completions", None, "OPTIONS", "", 200)])
def test_api_paths_need_the_bearer_key_and_health_metrics_options_do_not(path, auth, method,
                                                                          root, status):
    assert _status(path, auth, method, root) == status
