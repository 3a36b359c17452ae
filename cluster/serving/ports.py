"""The TCP ports one deployment opens between nodes, none of which vLLM authenticates (pure).

What `cluster deploy --dry-run` prints (and deploy.json's `ports`) so the admin can firewall
them: allow them between the cluster's own nodes only (docs/security.md "Ports a multi-node engine opens
between nodes"). Read from vLLM's source (vllm/distributed/parallel_state.py, vllm/v1/executor/
multiproc_executor.py, vllm/v1/engine/utils.py, vllm/config/parallel.py):

- dense multi-node (nnodes > 1, the native executor): node rank 0 opens torch.distributed's
  TCPStore at master_addr:master_port (the app picks it from the gang port range at start) and
  the executor's message queue (ZMQ, shm_broadcast.MessageQueue) on an ephemeral port;
- MoE data-parallel across nodes: node 0 opens the DP handshake (ZMQ) at data_parallel_rpc_port
  (the gang port range), the engine cores' input/output queues, the DP coordinator's sockets and
  the DP TCPStores (coordination store, data_parallel_master_port) on ephemeral ports;
- vLLM's Ray executor spread over nodes: the driver worker's TCPStore on an ephemeral port;
- every layout across nodes: NCCL (GPU) and gloo rendezvous between every pair of nodes on
  ephemeral ports; the fabric proof's all-reduce before the start on its planned port.

A single-node engine (any executor with its ranks on one node) opens none between nodes.

    inter_node_ports(gang_layout(tp=1, pp=2, nnodes=2), (29500, 29599), "cpu")
    -> (NodePort(ports="29500-29599", what="torch.distributed TCPStore ...", ...), ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.planning.gang import GangLayout, gang_layout

EPHEMERAL = "ephemeral"         # the node's net.ipv4.ip_local_port_range


@dataclass(frozen=True)
class NodePort:
    """One port (or range) a deployment listens on for other nodes: TCP, unauthenticated."""

    what: str
    between: str                    # "A -> B": B listens, A connects; "<->": both ways
    port: int | None = None         # one known port
    ports: str | None = None        # "LO-HI" (the gang port range) or "ephemeral"
    proto: str = "tcp"

    @property
    def label(self) -> str:
        """`29500-29599/tcp`, `ephemeral/tcp`, `29500/tcp`."""
        return f"{self.port if self.port is not None else self.ports}/{self.proto}"

    def to_dict(self) -> dict[str, Any]:
        where = {"port": self.port} if self.port is not None else {"ports": self.ports}
        return {**where, "proto": self.proto, "what": self.what, "between": self.between}


def _others(nnodes: int) -> str:
    return "node rank 1" if nnodes == 2 else f"node ranks 1-{nnodes - 1}"


def _collectives(device: str, between: str) -> NodePort:
    what = ("NCCL bootstrap/socket and gloo rendezvous of the ranks" if device == "gpu"
            else "gloo rendezvous and transfers of the ranks")
    return NodePort(what, between, ports=EPHEMERAL)


def inter_node_ports(layout: GangLayout, port_range: tuple[int, int],
                     device: str) -> tuple[NodePort, ...]:
    """What vLLM's native multi-node engine of `layout` opens between its nodes; () when it
    runs on one node. `port_range`: the inventory's ray.vllm_port_min..vllm_port_max."""
    if layout.nnodes < 2:
        return ()
    gang = f"{port_range[0]}-{port_range[1]}"
    to_0 = f"{_others(layout.nnodes)} -> node rank 0"
    every = "every node rank <-> every node rank"
    if layout.moe_dp:
        return (NodePort("DP handshake (ZMQ, data_parallel_rpc_port, picked at start)", to_0,
                         ports=gang),
                NodePort("engine cores' input/output queues (ZMQ) of the DP front end", to_0,
                         ports=EPHEMERAL),
                NodePort("DP coordinator (ZMQ) and the DP TCPStores (coordination store, "
                         "data_parallel_master_port)", to_0, ports=EPHEMERAL),
                _collectives(device, every))
    return (NodePort("torch.distributed TCPStore (master_port, picked at start)", to_0,
                     ports=gang),
            NodePort("executor message queue (ZMQ, shm_broadcast) on node rank 0's IP", to_0,
                     ports=EPHEMERAL),
            _collectives(device, every))


def ray_executor_ports(device: str) -> tuple[NodePort, ...]:
    """vLLM's Ray executor with its workers on several nodes (the driver worker's TCPStore on
    get_open_port(), then the collectives)."""
    return (NodePort("torch.distributed TCPStore of the driver worker (get_open_port)",
                     "the other workers' nodes -> the driver worker's node", ports=EPHEMERAL),
            _collectives(device, "every worker's node <-> every worker's node"))


def proof_ports(plan) -> tuple[NodePort, ...]:
    """The fabric proof's cross-node groups (cluster/planning/fabric_proof.ProofPlan): each
    group's store listens on its first member's node on its planned port."""
    out = []
    for group, port in zip(plan.groups, plan.ports):
        nodes = group.nodes
        if len(nodes) > 1:
            out.append(NodePort(f"fabric proof: TCPStore of the {group.kind} all-reduce "
                                "(before the engine starts)",
                                f"{', '.join(nodes[1:])} -> {nodes[0]}", port=port))
    return tuple(out)


def deployment_ports(spec, device: str, cluster, inventory) -> tuple[NodePort, ...]:
    """What the engine of `spec` (cluster/serving/deploy.DeploySpec) opens between nodes on
    `cluster`: the native multi-node layout's, the Ray executor's when its bundles may land
    on several nodes, else () (one node; --placement-only starts no engine)."""
    from cluster.serving import deploy

    if spec.placement_only:
        return ()
    nnodes = deploy.engine_nodes(spec, device, cluster)
    if nnodes > 1:
        layout = gang_layout(spec.tensor_parallel_size, spec.pipeline_parallel_size, nnodes,
                             spec.data_parallel_size)
        r = inventory.ray
        return inter_node_ports(layout, (r.vllm_port_min, r.vllm_port_max), device)
    ray_executor = not spec.expert_parallel and (
        spec.executor == "ray" or (spec.executor == "auto" and device == "gpu"))
    world = spec.tensor_parallel_size * spec.pipeline_parallel_size
    if ray_executor and world > 1 and \
            deploy.placement_strategy(spec, device, cluster) != "STRICT_PACK":
        return ray_executor_ports(device)
    return ()
