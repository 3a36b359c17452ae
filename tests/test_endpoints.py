"""The head's endpoints and Ray's paths, each built in one place (cluster/nodes/endpoints.py)."""

from __future__ import annotations

import pytest

from cluster.nodes import endpoints
from fakes import inventory_of


def inv(ray: str = "{}", head: str = "10.0.0.1"):
    return inventory_of(f"nodes:\n  - {{name: a, address: '{head}', role: head}}\nray: {ray}\n")


@pytest.mark.parametrize("host, on_head, printed", [
    ("127.0.0.1", "http://127.0.0.1:8265", "http://127.0.0.1:8265"),
    ("0.0.0.0", "http://127.0.0.1:8265", "http://10.0.0.1:8265"),
    ("10.0.0.1", "http://10.0.0.1:8265", "http://10.0.0.1:8265"),
    ("fd00::1", "http://[fd00::1]:8265", "http://[fd00::1]:8265"),
])
def test_the_dashboard_as_the_head_reaches_it_and_as_printed(host, on_head, printed):
    i = inv(f"{{dashboard_host: '{host}'}}")
    assert endpoints.head_dashboard_base(i) == on_head
    assert endpoints.dashboard_url(i) == printed


def test_the_printed_dashboard_of_an_ipv6_head_bound_everywhere_is_bracketed():
    i = inv("{dashboard_host: '::'}", head="fd00::9")
    assert endpoints.dashboard_url(i) == "http://[fd00::9]:8265"
    assert endpoints.head_dashboard_base(i) == "http://127.0.0.1:8265"


@pytest.mark.parametrize("temp_dir, root, logs", [
    (None, "/tmp/ray", "/tmp/ray/session_latest/logs"),
    ("/scratch/ray/", "/scratch/ray", "/scratch/ray/session_latest/logs"),
    ("/", "/", "/session_latest/logs"),
])
def test_rays_temp_dir_and_the_paths_under_it(temp_dir, root, logs):
    i = inv("{}" if temp_dir is None else f"{{temp_dir: '{temp_dir}'}}")
    assert endpoints.ray_temp_dir(i) == root
    assert endpoints.log_dir(i) == logs
    assert endpoints.session_dir(i) == logs[:-len("/logs")]
