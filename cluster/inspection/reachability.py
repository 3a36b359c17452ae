"""Cross-node reachability: real TCP connects between the nodes on Ray's and Serve's ports.

The on-node program cluster/node_programs/reach.py: every node starts a short-lived listener
on the ports it will serve (those already taken, e.g. by a running Ray, are answered by their
owner), told how many peers will probe it - in the preflight's own gather (`Listeners.probe`,
no command of its own) or in a `listen` fan-out when the facts were gathered already; every
node connects to the ports of its peers and says the run's tag to our listeners, which ack it;
a listener that has heard every peer it expected exits by itself, so only the nodes where some
expected probe went unacked get a `stop` (none on a healthy cluster: one command a node, the
probe, where it was three). A dropped SYN (a firewall's DROP) is a timeout, a REJECT is
refused: both fail with the pair and the port named.

Peers (pure, `plan_targets`): up to `full_matrix_max_nodes` every node probes every other. Above
it the cost stays linear: each node probes the head and `peers_per_node` others at distances
1, 2, 4, ... along the inventory order; the head probes every node; and every pair of /24
subnets (the racks, as far as addresses tell) has at least one probe each way.

A node's probe keeps at most `connects_in_flight` connects open at once (the head's probe of
1,000 nodes sent 512 SYNs, each needing an ARP request flooded to every node, and lost some of
its own); no connect starts after `probe_deadline_s` (`probe_seconds`: how long the laptop waits).
"""

from __future__ import annotations

import ipaddress
import secrets
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from cluster.inspection.checks.node import ray_ports
from cluster.base.errors import InventoryError, ParseError, ProgramError
from cluster.inspection.facts import BuiltFact, gather_timeout
from cluster.inspection.probes import Probe, ProbeOutput
from cluster.nodes.inventory import Inventory, Node
from cluster.node_programs import fan_out_program, inline_command, parse_answer
from cluster.nodes.remote import Session
from cluster.base.results import CheckResult, Evidence, Status

CHECK = "reachability"
PROGRAM = "reach"                # cluster/node_programs/reach.py
LISTEN_PROBE = "reach-listen"   # the gather's probe that starts a node's listener
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Target:
    node: str
    ip: str
    port: int
    what: str      # the port's name (node_manager_port, ...)


def _samples(lo: int, hi: int, count: int) -> list[int]:
    """`count` ports from lo to hi: the first, the last and evenly between."""
    return sorted({lo + (hi - lo) * i // max(1, count - 1) for i in range(count)})


def served_ports(node: Node, inventory: Inventory, th: Mapping[str, Any]) -> dict[int, str]:
    """The ports other nodes connect to on `node`: Ray's; samples of the worker range (Ray
    workers); with Serve's HAProxy ingress, samples of the replicas' HTTP port range; samples
    of the multi-node vLLM master port range (ray.vllm_port_min..max: a rank on another node
    connects to its master there). The dashboard only when not on loopback."""
    ports = dict(ray_ports(node, inventory))
    r = inventory.ray
    if r.dashboard_host in _LOOPBACK_HOSTS:
        ports.pop(r.dashboard_port, None)
    count = th["worker_port_samples"]
    for port in _samples(r.min_worker_port, r.max_worker_port, count):
        ports.setdefault(port, "worker port range")
    replica = th["serve_replica_ports"]
    if len(replica) != 2 or replica[0] > replica[1]:
        raise InventoryError(f"must be [first, last] port, got {replica!r}",
                             key="expectations.reachability.serve_replica_ports")
    if r.serve_ingress == "haproxy":
        for port in _samples(replica[0], replica[1], count):
            ports.setdefault(port, "Serve replica port range")
    for port in _samples(r.vllm_port_min, r.vllm_port_max, count):
        ports.setdefault(port, "vLLM multi-node master port range")
    return ports


def _subnet(node: Node) -> str:
    try:
        return str(ipaddress.ip_network(f"{node.ip}/24", strict=False))
    except ValueError:
        return node.ip      # a host name: its own group


def plan_peers(nodes: Sequence[Node], head: str, full_max: int, per_node: int
               ) -> dict[str, list[str]]:
    """source node -> the nodes it probes (pure)."""
    names = [n.name for n in nodes]
    count = len(names)
    if count <= full_max:
        return {a: [b for b in names if b != a] for a in names}
    peers: dict[str, set[str]] = {a: set() for a in names}
    for i, a in enumerate(names):
        if a != head and head in peers:
            peers[a].add(head)
        step = 1
        for _ in range(per_node):
            peers[a].add(names[(i + step) % count])
            step *= 2
        peers[a].discard(a)
    if head in peers:
        peers[head] |= set(names) - {head}
    groups: dict[str, list[str]] = defaultdict(list)
    subnet = {}
    for n in nodes:
        subnet[n.name] = _subnet(n)
        groups[subnet[n.name]].append(n.name)
    # the subnet pairs some probe covers, from the probes (a look at every pair of nodes of two
    # subnets was O(nodes^2): ~1 s of the laptop's CPU a call at 1,000 nodes)
    covered = {(subnet[a], subnet[b]) for a, ps in peers.items() for b in ps}
    keys = sorted(groups)
    for i, ga in enumerate(keys):
        for j, gb in enumerate(keys):
            if ga != gb and (ga, gb) not in covered:
                src = groups[ga][(i + j) % len(groups[ga])]
                peers[src].add(groups[gb][(i + j) % len(groups[gb])])
    order = {name: i for i, name in enumerate(names)}   # names.index: O(nodes) per lookup
    return {a: sorted(p, key=order.__getitem__) for a, p in peers.items()}


def plan_targets(nodes: Sequence[Node], inventory: Inventory, th: Mapping[str, Any]
                 ) -> dict[str, list[Target]]:
    """source node -> every (peer, port) it connects to (pure)."""
    by_name = {n.name: n for n in nodes}
    head = inventory.head.name
    peers = plan_peers(nodes, head, th["full_matrix_max_nodes"], th["peers_per_node"])
    served = {n.name: served_ports(n, inventory, th) for n in nodes}
    return {src: [Target(dst, by_name[dst].ip, port, what)
                  for dst in dsts for port, what in sorted(served[dst].items())]
            for src, dsts in peers.items()}


def _targets_arg(targets: Sequence[Target]) -> str:
    """host/host2:p1+p2,host3:p3: the hosts that share a port list write it once. sshd hands
    the whole command to the shell as one argument (at most 128 KiB): the head probes every
    node, and a port list per node made ~200 KB at 1,000 nodes (exec failed: E2BIG)."""
    by_ip: dict[str, list[int]] = defaultdict(list)
    for t in targets:
        by_ip[t.ip].append(t.port)
    by_ports: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for ip, ports in by_ip.items():
        by_ports[tuple(ports)].append(ip)
    return ",".join(f"{'/'.join(ips)}:{'+'.join(map(str, ports))}"
                    for ports, ips in by_ports.items())


def probers(plan: Mapping[str, Sequence[Target]]) -> dict[str, int]:
    """node -> how many nodes probe it (each probes all of its served ports once) (pure)."""
    count: dict[str, int] = {src: 0 for src in plan}
    for targets in plan.values():
        for dst in {t.node for t in targets}:
            count[dst] = count.get(dst, 0) + 1
    return count


def started(listen_docs: Mapping[str, dict | None]) -> set[str]:
    """The nodes whose listener may have started (pure): its listen gave no answer, or a pid
    (a listen that bound nothing started none)."""
    return {name for name, doc in listen_docs.items() if not doc or doc.get("pid")}


def still_listening(plan: Mapping[str, Sequence[Target]], listen_docs: Mapping[str, dict | None],
                    probe_docs: Mapping[str, dict | None], told: Mapping[str, int]) -> set[str]:
    """The nodes whose listener may still run (pure): it may have started (`started`) and its
    listen gave no answer, or some port it bound has fewer acked probes than the `told` count
    it waits for (what its listen was told, which may count peers that never probed:
    unreachable since). A listener acks a probe after counting it and exits once every port
    has its count, so where every port has that many acks no `stop` is needed. An ack counts
    only for a target its prober was given."""
    planned = {src: {f"{t.ip}:{t.port}" for t in targets} for src, targets in plan.items()}
    ip_of = {t.node: t.ip for targets in plan.values() for t in targets}
    acks: Counter[str] = Counter()
    for src, doc in probe_docs.items():
        acked = doc.get("acked") if doc else None
        if isinstance(acked, list):
            acks.update({a for a in acked if type(a) is str} & planned.get(src, set()))
    left = set()
    for name in started(listen_docs):
        doc = listen_docs[name]
        want, ip = told.get(name, 0), ip_of.get(name)
        if not doc or want <= 0 or ip is None or any(acks[f"{ip}:{port}"] < want
                                                     for port in listed_ports(doc, "listening")):
            left.add(name)      # no answer, runs to --for (nothing to wait for), or waits still
    return left


def _docs(answers: Sequence[dict | ProgramError], nodes: Sequence[Node]) -> dict[str, dict | None]:
    """node -> the program's document, None when it gave none (unreached, failed, garbled)."""
    return {n.name: a if isinstance(a, dict) else None for n, a in zip(nodes, answers)}


@dataclass(frozen=True)
class Listeners:
    """One run's listeners, planned before they start: the tag, how long they live, and per
    node the ports it serves and how many peers will probe it. They start in the preflight's
    gather (`probe` is a facts-layer probe builder: no command of their own;
    playbooks.preflight.gather_with_listeners, which `cluster up` gathers with too)."""

    tag: str
    lifetime_s: float
    served: Mapping[str, Mapping[int, str]]
    expected: Mapping[str, int]
    plan: Mapping[str, Sequence[Target]] = field(default_factory=dict)   # of `planned_for`
    planned_for: tuple[str, ...] = ()

    def plan_of(self, nodes: Sequence[Node], inventory: Inventory) -> dict[str, list[Target]]:
        """The probes' plan for `nodes`: the one made with the listeners when they are the same
        nodes (every node reached), else planned again for the ones left."""
        if tuple(n.name for n in nodes) == self.planned_for:
            return dict(self.plan)
        return plan_targets(nodes, inventory, inventory.expectations["reachability"])

    def args(self, node: str) -> list[str]:
        return ["listen", "--ports", ",".join(map(str, self.served[node])),
                "--for", f"{self.lifetime_s:g}", "--tag", self.tag,
                "--expect", str(self.expected.get(node, 0))]

    def probe(self, node: Node, inventory: Inventory) -> Probe | None:
        """The gather's probe that starts `node`'s listener (None: not one of the run's): after
        the gather's other probes, which would otherwise see its ports taken (the ports
        check read them so on 11 of 127 nodes)."""
        if node.name not in self.served:
            return None
        return Probe(LISTEN.name, inline_command(inventory.ray.python, PROGRAM,
                                                  self.args(node.name)), after_the_others=True)


def plan_listeners(inventory: Inventory, session: Session, nodes: Sequence[Node]) -> Listeners:
    """The listeners of a run on `nodes` (a random tag). They start in the gather, so they
    live through it, the checks and the clock samples too, then the probes."""
    th = inventory.expectations["reachability"]
    timeout = float(th["connect_timeout_s"])
    batches = -(-len(nodes) // max(1, session.max_parallel))
    per_batch = timeout * 3 + inventory.ssh.connect_timeout + 5 \
        + gather_timeout(probe_count=3) + 10   # a gather of several probes
    plan = plan_targets(nodes, inventory, th)
    return Listeners(secrets.token_hex(6), min(900.0, 60.0 + batches * per_batch),
                     {n.name: served_ports(n, inventory, th) for n in nodes}, probers(plan),
                     plan, tuple(n.name for n in nodes))


def gathered_listen_docs(facts: Mapping[str, Any], nodes: Sequence[Node]
                         ) -> dict[str, dict | None]:
    """reached node -> its listener's document from the gather's LISTEN_PROBE output, None
    when the probe gave none (it did not run, failed, or printed something else). A node the
    gather did not reach is left out: nothing is sent to it (stop_listeners)."""
    docs: dict[str, dict | None] = {}
    for n in nodes:
        if n.name not in facts or not facts[n.name].reached:
            continue
        try:
            docs[n.name] = facts[n.name].reading(LISTEN)
        except ParseError:     # no output, or cut
            docs[n.name] = None
    return docs


def _listen_document(out: ProbeOutput) -> dict | None:
    """The listener's document of the gather's LISTEN_PROBE output, None when the probe failed
    or printed something else."""
    try:
        return parse_answer(out.stdout, PROGRAM) if out.exit_code == 0 else None
    except ProgramError:
        return None


LISTEN = BuiltFact(LISTEN_PROBE, _listen_document)


def probe_seconds(targets: int, th: Mapping[str, Any]) -> float:
    """The longest a node's probe of `targets` connects runs (pure): each of reach.py's
    `connects_in_flight` slots holds a connect at most `connect_timeout_s`, and none starts after
    `probe_deadline_s`."""
    timeout = float(th["connect_timeout_s"])
    rounds = -(-targets // th["connects_in_flight"])
    return min(float(th["probe_deadline_s"]), rounds * timeout) + timeout


def stop_listeners(session: Session, nodes: Sequence[Node], tag: str, names: set[str]) -> None:
    """`stop` on those of `nodes` named in `names` (their listener of run `tag` may run)."""
    chosen = [n for n in nodes if n.name in names]
    if chosen:
        fan_out_program(session, chosen, PROGRAM, ["stop", "--tag", tag], timeout=30)


def run_reachability(inventory: Inventory, session: Session, nodes: Sequence[Node],
                     listeners: Listeners, listen_docs: Mapping[str, dict | None]
                     ) -> list[CheckResult]:
    """Probe, and stop where a listener may be left, on `nodes` (all reachable over SSH), the
    gather having started `listeners` and given their `listen_docs`; the results, never
    raising."""
    th = inventory.expectations["reachability"]
    if len(nodes) < 2:
        stop_listeners(session, nodes, listeners.tag, started(listen_docs))
        return [CheckResult(CHECK, None, Status.SKIP, "fewer than two reachable nodes")]
    plan = listeners.plan_of(nodes, inventory)
    timeout = float(th["connect_timeout_s"])
    listen_docs = {n.name: listen_docs.get(n.name) for n in nodes}
    ours = {name: listed_ports(doc, "listening") for name, doc in listen_docs.items()}
    window = ["--timeout", f"{timeout:g}", "--at-once", str(th["connects_in_flight"]),
              "--deadline", f"{float(th['probe_deadline_s']):g}"]
    probe_docs: dict[str, dict | None] = {n.name: None for n in nodes}
    try:
        probed = fan_out_program(
            session, nodes, PROGRAM, lambda n: [
                "probe", "--targets", _targets_arg(plan[n.name]), *window,
                "--tag", listeners.tag, "--tell", _targets_arg(
                    [t for t in plan[n.name] if t.port in ours[t.node]]) or "-"],
            timeout=30 + probe_seconds(max(len(plan[n.name]) for n in nodes), th))
        probe_docs = _docs(probed, nodes)
    finally:
        stop_listeners(session, nodes, listeners.tag,
                       still_listening(plan, listen_docs, probe_docs, listeners.expected))
    return judge(plan, listen_docs, probe_docs, [n.name for n in nodes],
                 sampled=len(nodes) > th["full_matrix_max_nodes"])


_OUTCOME = {"timeout": "timed out (SYN dropped: a firewall?)",
            "refused": "refused (a REJECT rule, or nothing listened)"}
_LISTED = 4


def _describe(t: Target, outcome: str) -> str:
    return f"{t.node}:{t.port} ({t.what}) {_OUTCOME.get(outcome, outcome)}"


def listed_ports(doc: Mapping[str, Any] | None, key: str) -> frozenset[int]:
    """The ports a listener's document lists under `key` ("listening": bound by our listener,
    "busy": held by another process). A node's answer is data: anything but a port number in
    the list, or no list, is left out."""
    values = doc.get(key) if doc else None
    if not isinstance(values, list):
        return frozenset()
    return frozenset(v for v in values if type(v) is int and 0 < v < 65536)


def _node_result(src: str, targets: Sequence[Target],
                 answering: Mapping[str, tuple[frozenset[int], frozenset[int]]],
                 outcomes: Mapping[str, Any]) -> tuple[CheckResult, int, list[tuple[str, Target, str]]]:
    """One source node's result, how many connects counted, and its failures. answering:
    node -> (ports our listener bound, ports another process held)."""
    bad: list[tuple[str, Target, str]] = []
    counted = 0
    peers: set[str] = set()
    nothing = (frozenset(), frozenset())
    for t in targets:
        ours, theirs = answering.get(t.node, nothing)
        if t.port not in ours and t.port not in theirs:
            continue            # nothing was to answer there: not a verdict on the path
        got = outcomes.get(f"{t.ip}:{t.port}")
        if got == "refused" and t.port in theirs:
            # Another process held the port (Ray, a Serve replica): it may listen on loopback
            # only or have closed it since. A refusal says nothing about the path; a dropped
            # SYN (timeout) still does.
            continue
        counted += 1
        peers.add(t.node)
        if got != "ok":
            bad.append((src, t, str(got or "no answer")))
    if bad:
        shown = "; ".join(_describe(t, o) for _, t, o in bad[:_LISTED])
        more = f" and {len(bad) - _LISTED} more" if len(bad) > _LISTED else ""
        dsts = sorted({t.node for _, t, _ in bad})
        ports = sorted({t.port for _, t, _ in bad})
        return (CheckResult(CHECK, src, Status.FAIL, f"cannot connect to {shown}{more}",
                            Evidence(data={"failed": [{"to": t.node, "port": t.port,
                                                       "what": t.what, "outcome": o}
                                                      for _, t, o in bad]}),
                            f"open TCP {','.join(map(str, ports))} from {src} to "
                            f"{', '.join(dsts[:_LISTED])} (on the receiver: `nft list ruleset`, "
                            f"`iptables -S`; cloud security groups; switch ACLs)"),
                counted, bad)
    # One wording for every healthy node (counts in the evidence) so a report folds them.
    return (CheckResult(CHECK, src, Status.OK, "every connection to its peers ok",
                        Evidence(data={"peers": len(peers), "connections": counted})),
            counted, bad)


def judge(plan: Mapping[str, Sequence[Target]], listen_docs: Mapping[str, dict | None],
          probe_docs: Mapping[str, dict | None], names: Sequence[str],
          sampled: bool = False) -> list[CheckResult]:
    """Pure: the listeners' and probes' JSON documents -> per-node results and a summary."""
    results: list[CheckResult] = []
    failures: list[tuple[str, Target, str]] = []
    total = 0
    answering = {name: (listed_ports(doc, "listening"), listed_ports(doc, "busy"))
                 for name, doc in listen_docs.items()}     # once, not once per target
    for src in names:
        doc = probe_docs.get(src)
        if doc is None or not isinstance(doc.get("results"), dict):
            results.append(CheckResult(CHECK, src, Status.ERROR,
                                       "the connect probe did not run (no answer from the node's "
                                       "python)"))
            continue
        result, counted, bad = _node_result(src, plan.get(src, ()), answering, doc["results"])
        results.append(result)
        total += counted
        failures += bad
    silent = [n for n in names if listen_docs.get(n) is None]
    how = "sampled peers (the head, 2^k neighbours, every subnet pair)" if sampled else \
        "every pair"
    if failures:
        pairs = sorted({(s, t.node) for s, t, _ in failures})
        shown = "; ".join(f"{s} -> {_describe(t, o)}" for s, t, o in failures[:_LISTED])
        results.append(CheckResult(
            CHECK, None, Status.FAIL,
            f"{len(failures)} of {total} connections failed between {len(pairs)} pair(s): "
            f"{shown}", Evidence(data={"pairs": [list(p) for p in pairs]}),
            "open Ray's ports and the worker port range between the nodes named"))
    elif silent:
        results.append(CheckResult(CHECK, None, Status.ERROR,
                                   f"no listener started on {', '.join(silent[:_LISTED])}: their "
                                   f"ports were not tested"))
    else:
        results.append(CheckResult(CHECK, None, Status.OK,
                                   f"{total} connections between {len(names)} nodes ok ({how})"))
    return results
