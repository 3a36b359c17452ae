"""Get the serving API key to the replicas without putting it in args, YAML, argv or logs.

The app args carry only the NAME of an environment variable (`api_key_env`). A replica reads
the key from, in order:
1. its own environment (set where `ray start` ran on that node, inherited by Ray workers);
2. Ray's cluster key-value store (GCS), where `publish_api_key` put it from the environment
   of the process that deploys (the head). Anyone who can read the GCS can also run code on
   the cluster, so this widens nobody's access; the key is never written to a file.

`KeyCheck` is the replica's check of it: an ASGI middleware (the one vLLM's `--api-key` adds,
vllm/entrypoints/serve/middleware/authenticate.py, written here on Starlette's public API so the
app imports no vLLM internals): a request to an API path (/v1, /v2, /inference, /cohere) needs
`Authorization: Bearer KEY`, compared as SHA-256 digests in constant time; /health, /metrics and
OPTIONS pass.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from cluster.base.errors import UsageError

KV_NAMESPACE = "cluster-serve"
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


class ApiKeyError(UsageError):
    """The app names an API key variable that holds no key."""


def _kv_key(env_name: str) -> str:
    return f"api_key/{env_name}"


def publish_api_key(env_name: str, value: str | None = None) -> None:
    """Store the key (default: this process's $env_name) in the cluster KV; needs ray.init()."""
    from ray.experimental.internal_kv import _internal_kv_put

    value = os.environ.get(env_name) if value is None else value
    if not value:
        raise ApiKeyError(f"${env_name} is empty or unset: nothing to publish")
    _internal_kv_put(_kv_key(env_name), value.encode(), overwrite=True, namespace=KV_NAMESPACE)


def unpublish_api_key(env_name: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_kv_key(env_name), namespace=KV_NAMESPACE)


def read_api_key(env_name: str) -> str:
    """The key named by env_name: this process's environment first, then the cluster KV."""
    value = os.environ.get(env_name)
    if value:
        return value
    try:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized
        if _internal_kv_initialized():
            stored = _internal_kv_get(_kv_key(env_name), namespace=KV_NAMESPACE)
            if stored:
                return stored.decode()
    except ImportError:
        pass
    raise ApiKeyError(
        f"api_key_env names ${env_name}, but it is unset in the replica's environment and "
        "not published to the cluster (serve_apps.secrets.publish_api_key); refusing to "
        "serve without the key")


class KeyCheck:
    """ASGI middleware: 401 for an API path without `Authorization: Bearer <one of tokens>`."""

    def __init__(self, app, tokens: list[str]):
        self.app = app
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    def _allowed(self, headers) -> bool:
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        ok = False
        for known in self._digests:
            ok |= hmac.compare_digest(digest, known)
        return ok

    async def __call__(self, scope, receive, send):
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path.startswith(GUARDED_PREFIXES) and not self._allowed(Headers(scope=scope)):
            return await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive,
                                                                                  send)
        return await self.app(scope, receive, send)
