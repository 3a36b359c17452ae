"""Inventory loading: lookup order, validation with file:line + key, the CLI's one-line errors."""

from __future__ import annotations

import os

import pytest

from cluster.nodes import inventory
from cluster.base.errors import InventoryError
from fakes import cluster_cli, write_inventory

GOOD = """\
ssh:
  user: root
  known_hosts: kh
nodes:
  - name: gpu01
    role: head
    address: 10.0.0.1
    node_ip: 10.0.0.1
    nccl_socket_ifname: eth0
    gloo_socket_ifname: eth0
    ib_hcas: [mlx5_0, mlx5_1]
    env: {NCCL_DEBUG: INFO, HF_TOKEN: secret-value}
  - name: gpu02
    address: gpu02.example.org
    port: 2222
    jump_host: admin@bastion:22
expectations:
  gpu_model: NVIDIA H100 80GB HBM3
  gpus_per_node: 8
  clock: {max_skew_ms: 200}
ray: {port: 6380, dashboard_port: 8266}
model: {path: /models/llama}
"""


def test_good_inventory_resolves(tmp_path):
    f = write_inventory(tmp_path, GOOD)
    inv = inventory.load(str(f))
    assert [n.name for n in inv.nodes] == ["gpu01", "gpu02"]
    assert inv.head.name == "gpu01" and inv.workers[0].name == "gpu02"
    assert inv.node("gpu02").port == 2222 and inv.node("gpu02").user == "root"
    assert inv.node("gpu02").jump_host == "admin@bastion:22"
    assert inv.node("gpu01").ib_hcas == ("mlx5_0", "mlx5_1")
    assert inv.ssh.known_hosts == str(tmp_path / "kh")  # relative to the file
    assert inv.expectations["clock"]["max_skew_ms"] == 200
    assert inv.expectations["clock"]["max_offset_ms"] == 100  # default kept
    assert inv.ray.port == 6380 and inv.ray.dashboard_host == "127.0.0.1"
    assert inv.model_path == "/models/llama"
    assert inv.to_dict()["nodes"][0]["env"]["HF_TOKEN"] == "***"
    assert inv.to_dict()["nodes"][0]["env"]["NCCL_DEBUG"] == "INFO"
    assert [n.name for n in inv.select("gpu0*")] == ["gpu01", "gpu02"]
    assert [n.name for n in inv.select("workers")] == ["gpu02"]


def test_lookup_order(tmp_path, monkeypatch):
    (tmp_path / "cluster.yaml").write_text(GOOD)
    other = tmp_path / "other.yaml"
    other.write_text("nodes: [{name: solo, address: 10.1.1.1}]\n")
    monkeypatch.delenv(inventory.ENV_VAR, raising=False)
    assert inventory.load(None, cwd=str(tmp_path)).nodes[0].name == "gpu01"
    monkeypatch.setenv(inventory.ENV_VAR, str(other))
    assert inventory.load(None, cwd=str(tmp_path)).nodes[0].name == "solo"
    assert inventory.load(str(tmp_path / "cluster.yaml")).nodes[0].name == "gpu01"
    monkeypatch.delenv(inventory.ENV_VAR)
    default = inventory.load(None, cwd=str(tmp_path / "nowhere"))
    assert default.path == inventory.EMBEDDED
    assert default.nodes[0].name == "localhost" and default.nodes[0].local


def test_template_is_a_valid_inventory(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(inventory.template_text())
    inv = inventory.load(str(f))
    assert inv.head.name == "gpu01" and len(inv.nodes) == 2


# (yaml text, expected line, expected key fragment)
BAD = [
    ("nodes: [\n  {name: a\n", None, "(yaml)"),
    ("nodes:\n  - name: a\n    address: 1.2.3.4\n   role: head\n", None, "(yaml)"),
    ("", 1, "(document)"),
    ("- just\n- a list\n", 1, "(document)"),
    ("ssh: {}\n", 1, "nodes"),
    ("nodes: []\n", 1, "nodes"),
    ("nodes: {a: 1}\n", 1, "nodes"),
    ("nodes:\n  - address: 1.2.3.4\n", 2, "nodes[0].name"),
    ("nodes:\n  - name: a\n    adress: 1.2.3.4\n", 3, "nodes[0].adress"),
    ("nodes:\n  - name: a\n  - name: a\n", 3, "nodes[1].name"),
    ("nodes:\n  - name: a\n    port: '22'\n", 3, "nodes[0].port"),
    ("nodes:\n  - name: a\n    port: 70000\n", 3, "nodes[0].port"),
    ("nodes:\n  - name: a\n    role: boss\n", 3, "nodes[0].role"),
    ("nodes:\n  - {name: a, role: head}\n  - {name: b, role: head}\n", 3, "nodes[1].role"),
    ("nodes:\n  - name: 'a;rm -rf /'\n", 2, "nodes[0].name"),
    ("nodes:\n  - name: a\n    address: 'host$(reboot)'\n", 3, "nodes[0].address"),
    ("nodes:\n  - name: a\n    address: 'h`id`'\n", 3, "nodes[0].address"),
    ("nodes:\n  - name: a\n    identity_file: '/k; rm -rf /'\n", 3, "nodes[0].identity_file"),
    ("nodes:\n  - name: a\nmodel: {path: '/m && reboot'}\n", 3, "model.path"),
    ("nodes:\n  - name: a\n    nccl_socket_ifname: 'eth0|x'\n", 3, "nodes[0].nccl_socket_ifname"),
    ("nodes:\n  - name: a\n    ib_hcas: ['mlx5_0 x']\n", 3, "nodes[0].ib_hcas[0]"),
    ("nodes:\n  - name: a\n    ib_hcas: 5\n", 3, "nodes[0].ib_hcas"),
    ("nodes:\n  - name: a\n    env: {'BAD-NAME': 1}\n", 3, "nodes[0].env.BAD-NAME"),
    ("nodes:\n  - name: a\n    env: [A]\n", 3, "nodes[0].env"),
    ("nodes:\n  - name: a\n    local: maybe\n", 3, "nodes[0].local"),
    ("nodes:\n  - name: a\nexpectations: {gpus_per_node: many}\n", 3, "expectations.gpus_per_node"),
    ("nodes:\n  - name: a\nexpectations: {gpu_count: 8}\n", 3, "expectations.gpu_count"),
    ("nodes:\n  - name: a\nray: {port: -1}\n", 3, "ray.port"),
    ("nodes:\n  - name: a\nray: {dashboard_host: '0.0.0.0 --x'}\n", 3, "ray.dashboard_host"),
    ("nodes:\n  - name: a\nssh: {connect_timeout: 0}\n", 3, "ssh.connect_timeout"),
    ("nodes:\n  - name: a\nssh: {user: 'root;id'}\n", 3, "ssh.user"),
    ("nodes:\n  - name: a\nnodes:\n  - name: b\n", 3, "nodes"),
    ("nodes:\n  - name: a\nextra: 1\n", 3, "extra"),
    ("nodes:\n  - name: a\n    node_ip: '10.0.0.1\\n'\n", 3, "nodes[0].node_ip"),
]


@pytest.mark.parametrize("text,line,key", BAD, ids=[f"bad{i:02d}" for i in range(len(BAD))])
def test_malformed_inventory_names_file_line_and_key(tmp_path, text, line, key):
    f = write_inventory(tmp_path, text)
    with pytest.raises(InventoryError) as err:
        inventory.load(str(f))
    e = err.value
    assert e.path == str(f)
    assert e.key is not None and key in e.key
    if line is not None:
        assert e.line == line
    else:
        assert e.line is not None
    assert str(e).startswith(f"{f}:{e.line}: ")


@pytest.mark.parametrize("text", [b[0] for b in BAD[:12]] + [b[0] for b in BAD[14:20]])
def test_cli_gives_one_line_exit_2_no_traceback(tmp_path, text):
    f = write_inventory(tmp_path, text)
    proc = cluster_cli("-i", str(f), "inventory", timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(f) in lines[0], proc.stderr


def test_missing_file_is_one_line(tmp_path):
    proc = cluster_cli("-i", str(tmp_path / "nope.yaml"), "inventory", "--json", timeout=60)
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1", "::1", "127.0.0.2"])
def test_only_local_true_runs_on_this_machine_a_loopback_address_goes_over_ssh(address):
    """A node at a loopback address without `local: true` is a node like any other: the
    Session gives it the SSH runner (strict host keys), never the local one (an earlier test's
    `fix --undo` against 127.0.0.1 rewrote this machine's /etc through it). Only the runner
    chosen is checked: nothing runs."""
    from cluster.nodes.remote import LocalRunner, Session, SSHRunner

    inv = inventory.loads(f"nodes:\n  - {{name: a, address: '{address}'}}\n"
                          f"  - {{name: b, address: '{address}', port: 2201, local: false}}\n"
                          f"  - {{name: c, address: '{address}', port: 2202, local: true}}\n")
    assert not inv.node("a").local and not inv.node("b").local and inv.node("c").local
    session = Session(inv)
    try:
        assert isinstance(session.runner_for(inv.node("a")), SSHRunner)
        assert isinstance(session.runner_for(inv.node("b")), SSHRunner)
        assert isinstance(session.runner_for(inv.node("c")), LocalRunner)
    finally:
        session.close()



@pytest.mark.parametrize("second, field, shown", [
    ("{name: b, address: 10.0.0.1}", "address", "address 10.0.0.1"),
    ("{name: b, address: 10.0.0.1, port: 2222, user: other}", None, None),
    ("{name: b, address: 10.0.0.2, node_ip: 192.168.0.1}", "node_ip", "node_ip 192.168.0.1"),
])
def test_two_entries_for_one_machine_are_refused_naming_both(second, field, shown):
    """The same SSH endpoint (address and port) or the same node_ip twice is one machine
    listed twice (a copy-paste slip in a 16-node inventory): refused, naming both nodes; the
    same address on another port (two sshds) is two endpoints and allowed."""
    text = ("nodes:\n  - {name: a, address: 10.0.0.1, node_ip: 192.168.0.1}\n"
            f"  - {second}\n")
    if field is None:
        assert [n.name for n in inventory.loads(text).nodes] == ["a", "b"]
        return
    with pytest.raises(InventoryError) as err:
        inventory.loads(text)
    message = str(err.value)
    assert f"nodes[1].{field}" in message and f"duplicate {shown}" in message
    assert "'a'" in message and "'b'" in message
