"""Where the head's services are: the one home of every address and path the inventory implies.

The dashboard as the head reaches it (`head_dashboard_base`: what on-head programs, the status
query and `cluster dashboard`'s tunnel use) and as printed for a person (`dashboard_url`), the
GCS address workers join, the head's Prometheus URL, and Ray's temp dir with the paths under it
(the latest session, its logs). Pure functions of the inventory; nothing here reaches a node.
"""

from __future__ import annotations

from cluster.nodes.inventory import Inventory, RayOptions

DEFAULT_TEMP_DIR = "/tmp/ray"          # Ray's own default when ray.temp_dir is not set
LOOPBACK_HOSTS = ("0.0.0.0", "::", "localhost", "127.0.0.1", "::1")
ALL_INTERFACES = ("0.0.0.0", "::")


def url_host(host: str) -> str:
    """A host as it goes into a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def dashboard_target(inventory: Inventory) -> str:
    """The address the dashboard listens on, as seen from the head itself."""
    host = inventory.ray.dashboard_host
    return "127.0.0.1" if host in LOOPBACK_HOSTS else host


def head_dashboard_base(inventory: Inventory) -> str:
    """The dashboard's base URL as the head itself reaches it (bound to its loopback)."""
    return f"http://{url_host(dashboard_target(inventory))}:{inventory.ray.dashboard_port}"


def dashboard_url(inventory: Inventory) -> str:
    """The dashboard URL on the head as printed (a laptop reaches it with `cluster dashboard`)."""
    host = inventory.ray.dashboard_host
    if host in ALL_INTERFACES:
        host = inventory.head.ip
    return f"http://{url_host(host)}:{inventory.ray.dashboard_port}"


def gcs_address(inventory: Inventory) -> str:
    """The head's GCS, the address every worker's `ray start --address` joins."""
    return f"{inventory.head.ip}:{inventory.ray.port}"


def prometheus_url(ray: RayOptions) -> str | None:
    """The head's Prometheus (bound to its loopback), or None when ray.metrics is off."""
    return f"http://127.0.0.1:{ray.prometheus_port}" if ray.metrics == "prometheus" else None


def ray_temp_dir(inventory: Inventory) -> str:
    """Ray's temp dir on the nodes (ray.temp_dir, else Ray's default), without a trailing '/'."""
    return (inventory.ray.temp_dir or DEFAULT_TEMP_DIR).rstrip("/") or "/"


def session_dir(inventory: Inventory) -> str:
    """The latest Ray session's directory (Ray's `session_latest` link) under the temp dir."""
    return f"{ray_temp_dir(inventory).rstrip('/')}/session_latest"


def log_dir(inventory: Inventory) -> str:
    """The latest Ray session's log directory on a node."""
    return f"{session_dir(inventory)}/logs"
