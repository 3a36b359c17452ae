"""The ports a deployment opens between nodes (cluster/serving/ports.py, issue 39 item 7):
what `cluster deploy --dry-run` prints so the admin can firewall what vLLM does not
authenticate, and that docs/security.md's ports section (moved there from the README) names
the same ones."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.planning.gang import gang_layout
from cluster.serving import deploy
from cluster.serving.ports import deployment_ports, inter_node_ports
from cluster.nodes.inventory import loads as load_inventory
from fakes import DEPLOY_INVENTORY, DEPLOY_MODEL, deploy_cluster_of

RANGE = (29500, 29599)
SECURITY_DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"
CPU2 = deploy_cluster_of(("10.0.0.1", 2, 0), ("10.0.0.2", 2, 0))
GPU2x4 = deploy_cluster_of(("10.0.0.1", 16, 4), ("10.0.0.2", 16, 4))
GPU2x8 = deploy_cluster_of(("10.0.0.1", 64, 8), ("10.0.0.2", 64, 8))


def _dicts(ports):
    return [p.to_dict() for p in ports]


def test_pp2_across_two_nodes_opens_the_master_port_range_the_queue_and_the_collectives():
    got = _dicts(inter_node_ports(gang_layout(tp=1, pp=2, nnodes=2), RANGE, "cpu"))
    assert got == [
        {"ports": "29500-29599", "proto": "tcp", "between": "node rank 1 -> node rank 0",
         "what": "torch.distributed TCPStore (master_port, picked at start)"},
        {"ports": "ephemeral", "proto": "tcp", "between": "node rank 1 -> node rank 0",
         "what": "executor message queue (ZMQ, shm_broadcast) on node rank 0's IP"},
        {"ports": "ephemeral", "proto": "tcp",
         "between": "every node rank <-> every node rank",
         "what": "gloo rendezvous and transfers of the ranks"}]
    gpu = inter_node_ports(gang_layout(tp=8, pp=2, nnodes=4), RANGE, "gpu")
    assert gpu[0].between == "node ranks 1-3 -> node rank 0"
    assert "NCCL" in gpu[-1].what and gpu[-1].ports == "ephemeral"


def test_moe_dp_across_nodes_opens_the_dp_rpc_port_range_and_node_0s_queues():
    got = inter_node_ports(gang_layout(tp=1, pp=1, nnodes=2, dp=16), RANGE, "gpu")
    assert got[0].ports == "29500-29599" and "data_parallel_rpc_port" in got[0].what
    assert got[0].between == "node rank 1 -> node rank 0"
    whats = " ".join(p.what for p in got)
    for name in ("input/output queues", "DP coordinator", "data_parallel_master_port", "NCCL"):
        assert name in whats, name
    assert all(p.proto == "tcp" for p in got)
    assert [p.ports for p in got[1:]] == ["ephemeral"] * 3
    assert "master_port," not in whats          # no dense TCPStore at master_port in DP mode


def test_a_single_node_engine_opens_none_between_nodes():
    assert inter_node_ports(gang_layout(tp=2, pp=2, nnodes=1), RANGE, "gpu") == ()
    inv = load_inventory(DEPLOY_INVENTORY)
    # TP 4 inside one 8-GPU node, two replicas: STRICT_PACK, each engine on one node
    one_node = deploy.spec_from_flags(DEPLOY_MODEL, tp=4, dp=2)
    assert deployment_ports(one_node, "gpu", GPU2x8, inv) == ()
    # PP 2 on 2-CPU nodes without --nnodes: the native engine stays on one node
    assert deployment_ports(deploy.spec_from_flags(DEPLOY_MODEL), "cpu", CPU2, inv) == ()
    # placement only starts no engine
    spec = deploy.spec_from_flags(DEPLOY_MODEL, pp=2, nnodes=2, placement_only=True)
    assert deployment_ports(spec, "cpu", CPU2, inv) == ()


def test_deployment_ports_follow_the_engine_the_app_will_run():
    inv = load_inventory(DEPLOY_INVENTORY)
    lo, hi = inv.ray.vllm_port_min, inv.ray.vllm_port_max
    native = deployment_ports(deploy.spec_from_flags(DEPLOY_MODEL, pp=2, nnodes=2), "cpu",
                              CPU2, inv)
    assert native[0].ports == f"{lo}-{hi}" and "master_port" in native[0].what
    # TP 4 x PP 2 on 4-GPU nodes with the Ray executor: PACK spreads the workers over nodes
    ray = deployment_ports(deploy.spec_from_flags(DEPLOY_MODEL, tp=4, pp=2), "gpu", GPU2x4, inv)
    assert ray and "driver worker" in ray[0].what and ray[0].ports == "ephemeral"


def test_the_security_doc_names_the_ports_the_function_reports():
    text = SECURITY_DOC.read_text()
    section = text.split("### Ports a multi-node engine opens between nodes", 1)[1]
    section = section.split("\n### ", 1)[0]
    for name in ("master_port", "shm_broadcast", "data_parallel_rpc_port",
                 "data_parallel_master_port", "DP coordinator", "NCCL", "gloo",
                 "ip_local_port_range", "vllm_port_min", "deploy --dry-run", "Ray executor"):
        assert name in section, name
    assert re.search(r"fabric proof", section)


def test_the_dry_run_prints_one_line_per_port(capsys):
    from types import SimpleNamespace

    from cluster.commands import deploy as command

    ports = [p.to_dict() for p in inter_node_ports(gang_layout(tp=1, pp=2, nnodes=2), RANGE,
                                                   "cpu")]
    doc = {"name": "tiny", "endpoint": "http://10.0.0.1:8000/tiny/v1", "status": "DRY_RUN",
           "ports": ports + [{"port": 29500, "proto": "tcp", "between": "gpu2 -> gpu1",
                              "what": "fabric proof: TCPStore of the pp all-reduce"}]}
    record = SimpleNamespace(scrub=lambda text: text)
    command._print(SimpleNamespace(json=False), doc, record)
    out = capsys.readouterr().out
    assert "  29500-29599/tcp  node rank 1 -> node rank 0: torch.distributed TCPStore" in out
    assert out.count("ephemeral/tcp") == 2
    assert "  29500/tcp  gpu2 -> gpu1: fabric proof" in out
    command._print(SimpleNamespace(json=False), dict(doc, ports=[]), record)
    assert "ports between nodes: none" in capsys.readouterr().out
