"""The inventory field -> `ray start` env table (cluster/nodes/ray_env.py) drives every direction:
field to variable (start env, fabric env, a deployment's defaults) and variable back to field
(the plan warning when an inventory `env:` entry is overridden)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cluster.nodes import endpoints
from cluster.nodes.ray_env import (FABRIC_ENV, MANAGED_ENV, START_ENV, env_conflicts, fabric_env,
                             field_of, start_env, uniform_fabric_env)
from fakes import RAY_INVENTORY, inventory_of

# Each fabric field as written in the inventory and the variable's value it must give.
FABRIC_FIELDS = {"nccl_socket_ifname": ("eth7", "eth7"), "gloo_socket_ifname": ("eth8", "eth8"),
                 "ib_hcas": ("[mlx5_3, mlx5_4]", "mlx5_3,mlx5_4"),
                 "node_ip": ("10.9.9.9", "10.9.9.9")}


def one_node(entries: str):
    return inventory_of("nodes:\n  - {name: a, address: 10.0.0.1, role: head, "
                        f"{entries}}}\n").head


def test_the_table_names_every_fabric_field_this_test_knows():
    assert {field_of(v.name) for v in FABRIC_ENV} == set(FABRIC_FIELDS)
    assert MANAGED_ENV == tuple(v.name for v in START_ENV)


@pytest.mark.parametrize("var", FABRIC_ENV, ids=lambda v: v.name)
def test_a_fabric_field_reaches_its_variable_and_a_hand_set_variable_names_its_field(var):
    field = field_of(var.name)
    written, value = FABRIC_FIELDS[field]
    node = one_node(f"{field}: {written}")
    assert fabric_env(node)[var.name] == value
    assert start_env(node)[var.name] == value

    overridden = one_node(f"{field}: {written}, env: {{{var.name}: by-hand}}")
    assert start_env(overridden)[var.name] == value
    assert env_conflicts(overridden) == [
        f"a: env {var.name}='by-hand' is overridden by {value!r} (from the node's {field})"]


@pytest.mark.parametrize("name, hand, ingress, field", [
    ("RAY_USAGE_STATS_ENABLED", "1", "haproxy", "usage-stats policy"),
    ("RAY_SERVE_ENABLE_HA_PROXY", "0", "haproxy", "ray.serve_ingress"),
    ("RAY_SERVE_ENABLE_HA_PROXY", "1", "proxy", "ray.serve_ingress"),
])
def test_a_policy_variable_set_by_hand_names_its_policy(name, hand, ingress, field):
    node = one_node(f"env: {{{name}: '{hand}'}}")
    (warning,) = env_conflicts(node, ingress)
    assert warning.startswith(f"a: env {name}='{hand}' is overridden by ")
    assert warning.endswith(f"(from the node's {field})")
    assert start_env(node, serve_ingress=ingress)[name] != hand


def test_the_auth_mode_is_set_only_when_given():
    node = one_node("node_ip: 10.0.0.1")
    assert "RAY_AUTH_MODE" not in start_env(node)
    assert start_env(node, "token")["RAY_AUTH_MODE"] == "token"


def test_a_deployment_gets_the_fabric_values_every_node_shares_and_never_the_node_ip():
    inv = inventory_of(RAY_INVENTORY)     # nccl differs, gloo and HCAs only on the head
    assert uniform_fabric_env(inv) == {}
    same = inventory_of("nodes:\n"
                        "  - {name: a, address: 10.0.0.1, role: head, nccl_socket_ifname: eth0,"
                        " ib_hcas: [mlx5_0]}\n"
                        "  - {name: b, address: 10.0.0.2, nccl_socket_ifname: eth0,"
                        " ib_hcas: [mlx5_0]}\n")
    assert uniform_fabric_env(same) == {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0"}
    single = inventory_of("nodes:\n  - {name: a, address: 10.0.0.1, role: head}\n")
    assert "VLLM_HOST_IP" not in uniform_fabric_env(single)
    assert fabric_env(single.head) == {"VLLM_HOST_IP": "10.0.0.1"}


def test_only_the_head_gets_the_prometheus_host_and_it_is_the_endpoint_status_reports():
    inv = inventory_of("nodes:\n  - {name: a, address: 10.0.0.1, role: head}\n"
                       "  - {name: b, address: 10.0.0.2}\n"
                       "ray: {metrics: prometheus, prometheus_port: 9191}\n")
    head, worker = inv.nodes
    assert start_env(head, ray=inv.ray)["RAY_PROMETHEUS_HOST"] == \
        endpoints.prometheus_url(inv.ray) == "http://127.0.0.1:9191"
    assert "RAY_PROMETHEUS_HOST" not in start_env(worker, ray=inv.ray)


# ---------------------------------------------------------------- Serve's HAProxy files
# (security: its admin socket and config were in /tmp/haproxy-serve, reachable by any local user)

@pytest.fixture
def short():
    """A folder with a short path (pytest's are longer than a unix socket's folder may be)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="h", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def haproxy_prefix_run(home: Path, shell: str = "sh") -> subprocess.CompletedProcess:
    """The start command's HAProxy prefix run by a real shell with HOME=home, then `env`."""
    from cluster.nodes.ray_env import serve_haproxy_dir_prefix

    return subprocess.run([shell, "-c", serve_haproxy_dir_prefix("haproxy") + "env"],
                          env={"HOME": str(home), "PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_haproxy_files_go_to_a_new_private_folder_of_the_user(short, shell):
    from cluster.nodes.ray_env import SERVE_HAPROXY_FILES

    home = short / "h"
    home.mkdir(mode=0o755)
    p = haproxy_prefix_run(home, shell)
    assert p.returncode == 0, p.stderr
    folder = home / ".cache" / "cluster" / "hap"
    for level in (home / ".cache", home / ".cache" / "cluster", folder):
        assert level.is_dir() and not level.is_symlink() and level.stat().st_mode & 0o777 == 0o700
    env = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
    want = {name: str(folder / leaf) if leaf else str(folder)
            for name, leaf in SERVE_HAPROXY_FILES.items()}
    assert {k: env.get(k) for k in want} == want


def test_haproxy_folder_tightens_our_own_folder_and_allows_a_group_writable_cache(short):
    home = short / "h"
    (home / ".cache" / "cluster").mkdir(parents=True)
    (home / ".cache").chmod(0o775)                  # umask 002: the user's own group may write
    (home / ".cache" / "cluster").chmod(0o755)
    p = haproxy_prefix_run(home)
    assert p.returncode == 0, p.stderr
    assert (home / ".cache" / "cluster").stat().st_mode & 0o777 == 0o700


def plant_link(home: Path, target: Path) -> None:
    (home / ".cache").mkdir(parents=True)
    target.mkdir()
    (home / ".cache" / "cluster").symlink_to(target)


def plant_others_writable(home: Path, _target: Path) -> None:
    (home / ".cache" / "cluster").mkdir(parents=True)
    (home / ".cache" / "cluster").chmod(0o777)


def plant_others_writable_cache(home: Path, _target: Path) -> None:
    (home / ".cache").mkdir(parents=True)
    (home / ".cache").chmod(0o757)


def plant_another_users(home: Path, _target: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    (home / ".cache" / "cluster" / "hap").mkdir(parents=True)
    os.chown(home / ".cache" / "cluster" / "hap", 65534, 65534)


@pytest.mark.parametrize("plant", [plant_link, plant_others_writable,
                                   plant_others_writable_cache, plant_another_users])
def test_haproxy_folder_refuses_a_planted_level_and_writes_nothing_through_it(short, plant):
    from cluster.nodes.ray_env import SERVE_HAPROXY_REFUSED_EXIT

    home, target = short / "h", short / "e"
    plant(home, target)
    before = sorted(str(p) for p in short.rglob("*"))
    p = haproxy_prefix_run(home)
    assert p.returncode == SERVE_HAPROXY_REFUSED_EXIT, (p.stdout, p.stderr)
    assert "RAY_SERVE_HAPROXY" not in p.stdout        # `ray start` never ran
    (line,) = p.stderr.splitlines()
    assert line.startswith("cluster: refused ") and "not a private folder" in line
    assert sorted(str(p) for p in short.rglob("*")) == before


def test_haproxy_folder_too_long_for_a_unix_socket_is_refused_with_the_way_out(short):
    from cluster.nodes.ray_env import SERVE_HAPROXY_DIR_MAX, SERVE_HAPROXY_REFUSED_EXIT

    home = short / ("x" * max(1, SERVE_HAPROXY_DIR_MAX - len(str(short))))
    home.mkdir()
    p = haproxy_prefix_run(home)
    assert p.returncode == SERVE_HAPROXY_REFUSED_EXIT and not (home / ".cache").exists()
    assert "ray.serve_ingress: proxy" in p.stderr and len(p.stderr.splitlines()) == 1
    # the limit is the socket's: 107 bytes for "<folder>/<56-char node id>/metrics.sock"
    assert SERVE_HAPROXY_DIR_MAX + len("/" + "0" * 56 + "/metrics.sock") == 107


def test_the_start_command_carries_the_prefix_only_for_the_haproxy_ingress():
    from cluster.nodes.ray_env import serve_haproxy_dir_prefix
    from cluster.ray.ray_cluster import start_command

    doc = RAY_INVENTORY
    inv = inventory_of(doc)
    prefix = serve_haproxy_dir_prefix("haproxy")
    assert inv.ray.serve_ingress == "haproxy"        # the default
    assert start_command(inv.head, inv, ()).startswith(prefix)
    worker = start_command(inv.workers[0], inv, ())
    assert prefix in worker and worker.index(prefix) < worker.index(" env ")
    proxy = inventory_of(doc.replace("ray:\n", "ray:\n  serve_ingress: proxy\n", 1))
    assert proxy.ray.serve_ingress == "proxy"
    assert "RAY_SERVE_HAPROXY" not in start_command(proxy.head, proxy, ())
    assert serve_haproxy_dir_prefix("proxy") == ""
