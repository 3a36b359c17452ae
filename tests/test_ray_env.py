"""The inventory field -> `ray start` env table (cluster/nodes/ray_env.py) drives every direction:
field to variable (start env, fabric env, a deployment's defaults) and variable back to field
(the plan warning when an inventory `env:` entry is overridden)."""

from __future__ import annotations

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
