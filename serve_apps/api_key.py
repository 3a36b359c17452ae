"""Get the serving API key to the replicas without putting it in args, YAML, argv or logs.

The app args carry only the NAME of an environment variable (`api_key_env`). A replica reads
the key from, in order:
1. its own environment (set where `ray start` ran on that node, inherited by Ray workers);
2. Ray's cluster key-value store (GCS), where `publish_api_key` put it from the environment
   of the process that deploys (the head). Anyone who can read the GCS can also run code on
   the cluster, so this widens nobody's access; the key is never written to a file.
"""

from __future__ import annotations

import os

from cluster.base.errors import UsageError

KV_NAMESPACE = "cluster-serve"


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
