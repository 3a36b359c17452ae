"""Reachability between nodes: the peer plan (pure), the verdicts (pure), and the on-node
program run for real on loopback (listen, connect, stop)."""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys
from itertools import combinations

import pytest

from cluster.nodes.inventory import loads
from cluster.node_programs import source
from cluster.inspection.reachability import (LISTEN_PROBE, Target, judge, listed_ports,
                                             plan_peers, plan_targets, probers, served_ports,
                                             still_listening)
from cluster.base.results import Status
from fakes import FakeRunner, fake_inventory, preflight_answers, result

TH = {"full_matrix_max_nodes": 16, "peers_per_node": 4, "connect_timeout_s": 2,
      "worker_port_samples": 3, "serve_replica_ports": [30000, 31000]}


def inventory(count: int, per_subnet: int = 250):
    rows = [f"  - {{name: n{i}, address: 10.0.{i // per_subnet}.{i % per_subnet + 1}"
            f"{', role: head' if i == 0 else ''}}}" for i in range(count)]
    return loads("nodes:\n" + "\n".join(rows) + "\n")


def test_small_clusters_get_the_full_matrix():
    inv = inventory(5)
    peers = plan_peers(inv.nodes, "n0", 16, 4)
    assert all(set(p) == {n.name for n in inv.nodes} - {src} for src, p in peers.items())


def test_large_clusters_stay_linear_and_cover_head_and_every_subnet_pair():
    inv = inventory(600, per_subnet=100)        # 6 "racks" of 100
    peers = plan_peers(inv.nodes, "n0", 16, 4)
    workers = [n.name for n in inv.nodes[1:]]
    assert set(peers["n0"]) == set(workers)                       # the head reaches everyone
    assert all("n0" in peers[w] for w in workers)                 # everyone reaches the head
    assert max(len(peers[w]) for w in workers) <= 1 + 4 + 2       # linear: a few per node
    subnet = {n.name: n.address.rsplit(".", 1)[0] for n in inv.nodes}
    covered = {(subnet[a], subnet[b]) for a, ps in peers.items() for b in ps}
    racks = sorted(set(subnet.values()))
    assert all((a, b) in covered and (b, a) in covered for a, b in combinations(racks, 2))


def test_each_nodes_peers_come_in_inventory_order():
    """The order is the inventory's (a position table: names.index made the head's sort, with
    every node its peer, O(nodes^2))."""
    inv = inventory(300, per_subnet=100)
    position = {n.name: i for i, n in enumerate(inv.nodes)}
    peers = plan_peers(inv.nodes, "n0", 16, 4)
    assert peers["n0"] == [n.name for n in inv.nodes[1:]]
    assert all(p == sorted(p, key=position.__getitem__) and len(set(p)) == len(p)
               for p in peers.values())


def test_a_listeners_garbled_port_lists_count_nothing_and_raise_nothing():
    """A node's answer is data: only port numbers in a list count (no bool, text, object or
    out-of-range number; no list at all: nothing)."""
    assert listed_ports({"listening": [8076, True, "6379", {"p": 1}, [2], 0, 70000, 6379.0]},
                        "listening") == {8076}
    assert listed_ports({"listening": 8076}, "listening") == frozenset()
    assert listed_ports(None, "busy") == frozenset()
    listens = {"a": {"listening": [{"port": 8076}]}, "b": {"listening": "6379", "busy": 5}}
    probes = {"a": {"results": {"10.0.0.2:6379": "ok", "10.0.0.2:8076": "ok"}, "acked": 7},
              "b": {"results": {"10.0.0.1:8076": "ok"}, "acked": [["10.0.0.1:8076"]]}}
    results = {(r.node, r.check): r for r in judge(_plan(), listens, probes, ["a", "b"])}
    assert results[("a", "reachability")].status is Status.OK     # nothing counted
    assert still_listening(_plan(), listens, probes, {"a": 1, "b": 1}) <= {"a", "b"}


def test_served_ports_skip_a_loopback_dashboard_and_sample_the_worker_range():
    inv = inventory(2)
    head, worker = inv.nodes
    ports = served_ports(head, inv, TH)
    assert inv.ray.port in ports and inv.ray.dashboard_port not in ports
    assert {inv.ray.min_worker_port, inv.ray.max_worker_port} <= set(ports)
    assert {30000, 30500, 31000} <= set(ports)                    # HAProxy ingress replicas
    assert inv.ray.port not in served_ports(worker, inv, TH)      # GCS lives on the head only
    targets = plan_targets(inv.nodes, inv, TH)
    assert {t.port for t in targets["n1"]} == set(ports)


def _plan():
    return {"a": [Target("b", "10.0.0.2", 6379, "port (GCS)"),
                  Target("b", "10.0.0.2", 8076, "node_manager_port")],
            "b": [Target("a", "10.0.0.1", 8076, "node_manager_port")]}


def test_a_dropped_port_names_the_pair_and_the_port():
    listens = {"a": {"listening": [8076], "busy": []}, "b": {"listening": [6379, 8076]}}
    probes = {"a": {"results": {"10.0.0.2:6379": "ok", "10.0.0.2:8076": "timeout"}},
              "b": {"results": {"10.0.0.1:8076": "ok"}}}
    results = {(r.node, r.check): r for r in judge(_plan(), listens, probes, ["a", "b"])}
    bad = results[("a", "reachability")]
    assert bad.status is Status.FAIL
    assert "b:8076 (node_manager_port) timed out" in bad.summary and "8076" in bad.fix
    assert results[("b", "reachability")].status is Status.OK
    summary = results[(None, "reachability")]
    assert summary.status is Status.FAIL and "1 of 3 connections" in summary.summary


def test_a_refusal_on_a_port_another_process_held_is_not_a_verdict_but_a_drop_is():
    listens = {"a": {"listening": [8076]}, "b": {"listening": [], "busy": [6379, 8076]}}
    refused = {"a": {"results": {"10.0.0.2:6379": "refused", "10.0.0.2:8076": "ok"}},
               "b": {"results": {"10.0.0.1:8076": "ok"}}}
    results = {(r.node, r.check): r for r in judge(_plan(), listens, refused, ["a", "b"])}
    assert results[("a", "reachability")].status is Status.OK
    dropped = {"a": {"results": {"10.0.0.2:6379": "timeout", "10.0.0.2:8076": "ok"}},
               "b": {"results": {"10.0.0.1:8076": "ok"}}}
    results = {(r.node, r.check): r for r in judge(_plan(), listens, dropped, ["a", "b"])}
    assert results[("a", "reachability")].status is Status.FAIL


def test_ports_nobody_listened_on_are_not_counted_and_a_silent_node_is_an_error():
    listens = {"a": None, "b": {"listening": [6379], "busy": [8076]}}
    probes = {"a": {"results": {"10.0.0.2:6379": "ok", "10.0.0.2:8076": "ok"}}, "b": None}
    results = {(r.node, r.check): r for r in judge(_plan(), listens, probes, ["a", "b"])}
    assert results[("a", "reachability")].status is Status.OK
    assert results[("b", "reachability")].status is Status.ERROR
    assert results[(None, "reachability")].status is Status.ERROR


def _program(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-", *args], input=source("reach"),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("args", [
    ("probe", "--targets", "127.0.0.1:9", "--timeout", "abc"),
    ("probe", "--targets", "127.0.0.1:9"),
    ("probe", "--targets", "127.0.0.1:9", "--timeout", "1", "--at-once", "abc"),
    ("probe", "--targets", "127.0.0.1:9", "--timeout", "1", "--at-once", "1e999"),
    ("probe", "--targets", "127.0.0.1:9", "--timeout", "1", "--at-once", "0"),
    ("probe", "--targets", "127.0.0.1:9", "--timeout", "1", "--deadline", "nan"),
    ("listen", "--ports", "1", "--for", "x" * 100_000, "--tag", "t"),
    ("listen", "--ports", "1", "--for", "5", "--tag", "t", "--expect", "1.5")])
def test_a_bad_number_is_one_line_naming_its_flag(args):
    proc = subprocess.run([sys.executable, "-", *args], input=source("reach"),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and not proc.stdout, proc
    assert proc.stderr.startswith("bad --") and proc.stderr.count("\n") == 1, proc.stderr


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_the_node_program_listens_connects_and_stops_for_real():
    free, closed = _free_ports(2)
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen(1)
    busy = taken.getsockname()[1]
    try:
        up = _program("listen", "--ports", f"{free},{busy}", "--for", "30", "--tag", "t0test")
        assert up["listening"] == [free] and up["busy"] == [busy] and up["pid"]
        got = _program("probe", "--targets", f"127.0.0.1:{free}+{busy}+{closed}",
                       "--timeout", "2")["results"]
        assert got == {f"127.0.0.1:{free}": "ok", f"127.0.0.1:{busy}": "ok",
                       f"127.0.0.1:{closed}": "refused"}
        down = _program("stop", "--tag", "t0test")
        assert down == {"stopped": up["pid"], "gone": True}
        after = _program("probe", "--targets", f"127.0.0.1:{free}", "--timeout", "2")
        assert after["results"] == {f"127.0.0.1:{free}": "refused"}
        assert _program("stop", "--tag", "t0test") == {"stopped": None}
    finally:
        taken.close()


def test_a_listener_told_how_many_probe_it_acks_each_and_exits_by_itself():
    """The tag protocol for real: a listener expecting 2 probers counts the ones that say the
    run's tag (not a silent connection, not a wrong word), acks each, and exits by itself after
    the second; the probes report which were acked."""
    free, other = _free_ports(2)
    up = _program("listen", "--ports", f"{free},{other}", "--for", "30", "--tag", "t1test",
                  "--expect", "2")
    assert up["listening"] == [free, other] and up["pid"]
    try:
        silent = socket.create_connection(("127.0.0.1", free), timeout=5)   # says nothing
        wrong = socket.create_connection(("127.0.0.1", free), timeout=5)
        wrong.sendall(b"t0test\n")                                          # another run's tag
        assert wrong.recv(8) == b""                                          # closed, unacked
        wrong.close()
        targets = f"127.0.0.1:{free}+{other}"
        first = _program("probe", "--targets", targets, "--timeout", "5", "--tag", "t1test",
                         "--tell", targets)
        assert first["results"] == {f"127.0.0.1:{free}": "ok", f"127.0.0.1:{other}": "ok"}
        assert sorted(first["acked"]) == sorted(first["results"])
        assert _pid_running(up["pid"])                  # one prober of two: still listening
        second = _program("probe", "--targets", targets, "--timeout", "5", "--tag", "t1test",
                          "--tell", f"127.0.0.1:{other}")  # `free` connected, not told
        assert second["acked"] == [f"127.0.0.1:{other}"]
        assert _pid_running(up["pid"])                  # `free` heard 1 of 2
        third = _program("probe", "--targets", f"127.0.0.1:{free}", "--timeout", "5",
                         "--tag", "t1test", "--tell", f"127.0.0.1:{free}")
        assert third["acked"] == [f"127.0.0.1:{free}"]
        assert _gone_within(up["pid"], 5)               # every port heard 2: it left
        after = _program("probe", "--targets", f"127.0.0.1:{free}", "--timeout", "2")
        assert after["results"] == {f"127.0.0.1:{free}": "refused"}
        silent.close()
    finally:
        _program("stop", "--tag", "t1test")


def test_a_listener_holds_every_expected_probe_that_connects_at_once():
    """At 1,000 nodes every worker probes the head's ports at once, faster than one listener
    process accepts: its accept queue must hold every expected prober, or the kernel drops their
    SYNs and the probes report a firewall that is not there. The listener is stopped (SIGSTOP)
    so that nothing is accepted while the expected probers all connect."""
    import os
    import selectors
    import signal
    import time

    expect = 300
    (port,) = _free_ports(1)
    up = _program("listen", "--ports", str(port), "--for", "30", "--tag", "t2test",
                  "--expect", str(expect))
    assert up["listening"] == [port] and up["pid"]
    os.kill(up["pid"], signal.SIGSTOP)
    clients, sel = [], selectors.DefaultSelector()
    try:
        for _ in range(expect):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            clients.append(s)
            sel.register(s, selectors.EVENT_WRITE)
        connected, end = 0, time.monotonic() + 10       # a bound on the wait, not a timing
        while sel.get_map() and time.monotonic() < end:
            for key, _ in sel.select(0.5):
                connected += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                sel.unregister(key.fileobj)
        assert connected == expect
    finally:
        for s in clients:
            s.close()
        os.kill(up["pid"], signal.SIGCONT)
        _program("stop", "--tag", "t2test")


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    import time
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _pid_running(pid):
            return True
        time.sleep(0.05)
    return False


MAX_ARG_STRLEN = 32 * 4096    # Linux: the longest single argument exec takes (E2BIG beyond)


def test_every_probe_command_of_a_1000_node_cluster_fits_one_exec_argument():
    """sshd hands a command to the shell as one argument (`sh -c COMMAND`): the head probes
    every node, and at 1,000 nodes its --targets and --tell (every node's 18 ports, the address
    written once per node) made 230 KB, so exec failed and the head's probe never ran ("no
    answer from the node's python"). Nodes with the same ports share one port list."""
    from cluster.inspection.reachability import plan_listeners, run_reachability

    inv = fake_inventory(1000)
    log = CommandLog()
    session = log.session(inv)
    listeners = plan_listeners(inv, session, inv.nodes)
    docs = {n.name: {"listening": sorted(listeners.served[n.name]), "busy": [], "pid": 1}
            for n in inv.nodes}
    results = run_reachability(inv, session, inv.nodes, listeners, docs)
    assert [r.status for r in results if r.node is None] == [Status.OK]
    assert log.longest["probe"] < MAX_ARG_STRLEN


def test_nodes_sharing_their_ports_are_probed_from_one_port_list_for_real():
    """The compact targets (addresses that share a port list, written once) read by the node
    program: every (address, port) is probed and told, none lost or made up."""
    from cluster.inspection.reachability import _targets_arg

    a, b = _free_ports(2)
    up = _program("listen", "--ports", f"{a},{b}", "--for", "30", "--tag", "t3test",
                  "--expect", "2")
    try:
        targets = [Target(node, ip, port, "x") for node, ip in (("n1", "127.0.0.1"),
                                                                 ("n2", "127.0.0.2"))
                   for port in (a, b)]
        arg = _targets_arg(targets)
        assert arg.count(str(a)) == 1                  # one port list for both addresses
        got = _program("probe", "--targets", arg, "--timeout", "5", "--tag", "t3test",
                       "--tell", arg)
        want = {f"{t.ip}:{t.port}" for t in targets}
        assert got["results"] == dict.fromkeys(want, "ok") and set(got["acked"]) == want
    finally:
        _program("stop", "--tag", "t3test")


def test_stop_goes_only_where_an_expected_probe_was_not_acked():
    t = lambda node, ip, port: Target(node, ip, port, "x")  # noqa: E731
    plan = {"a": [t("b", "10.0.0.2", 1), t("b", "10.0.0.2", 2), t("c", "10.0.0.3", 1)],
            "b": [t("a", "10.0.0.1", 1), t("c", "10.0.0.3", 1)],
            "c": [t("a", "10.0.0.1", 1)]}
    told = probers(plan)
    assert told == {"a": 2, "b": 1, "c": 2}
    listen = {"a": {"listening": [1], "pid": 11}, "b": {"listening": [1, 2], "pid": 12},
              "c": {"listening": [1], "pid": 13}}
    every = {"a": {"acked": ["10.0.0.2:1", "10.0.0.2:2", "10.0.0.3:1"]},
             "b": {"acked": ["10.0.0.1:1", "10.0.0.3:1"]}, "c": {"acked": ["10.0.0.1:1"]}}
    assert still_listening(plan, listen, every, told) == set()
    one_short = dict(every, a={"acked": ["10.0.0.2:1", "10.0.0.3:1"]})     # b's port 2
    assert still_listening(plan, listen, one_short, told) == {"b"}
    assert still_listening(plan, listen, dict(every, c=None), told) == {"a"}  # c's probe: nothing
    assert still_listening(plan, dict(listen, c=None), every, told) == {"c"}  # c's listen: nothing
    # a port b did not bind (busy: Ray's) is not waited for
    assert still_listening(plan, dict(listen, b={"listening": [1], "pid": 12}), one_short,
                           told) == set()
    # told more probers than came (a peer unreachable since the listen): it waits, stop it
    assert still_listening(plan, listen, every, dict(told, a=3)) == {"a"}
    # an ack for a target its prober was not given does not count
    forged = dict(every, b={"acked": ["10.0.0.1:1", "10.0.0.3:1", "10.0.0.2:2"]})
    assert still_listening(plan, listen, dict(forged, a={"acked": ["10.0.0.2:1", "10.0.0.3:1"]}),
                           told) == {"b"}
    # a node nobody probes runs to --for: stopped
    assert still_listening({"a": [], "b": []}, {"a": {"listening": [1], "pid": 11},
                                                "b": {"listening": [], "pid": None}},
                           {"a": {"acked": []}, "b": {"acked": []}}, {"a": 0, "b": 0}) == {"a"}


class CommandLog:
    """A FakeRunner's `respond` over the fake nodes (preflight_answers), recording each command
    a node gets by kind (gather, clock, listen, probe, stop); `unreachable` nodes answer
    nothing, `silent` ones give no probe document. `session(inv)`: a real Session over them."""

    def __init__(self, unreachable=(), silent=()):
        self.kinds: list[tuple[str, str]] = []
        self.longest: dict[str, int] = {}     # kind -> its longest command's length
        self.probe_args: list[str] = []       # the probe commands
        self.unreachable, self.silent = set(unreachable), set(silent)
        self.nodes = preflight_answers()

    def session(self, inv):
        return FakeRunner(respond=self).session(inv)

    def __call__(self, sent):
        if sent.node in self.unreachable:
            return result(sent.node, "", status="unreachable", code=None,
                          error="unreachable: link down")
        if sent.asks is not None and sent.after is None:
            kind = "clock"       # a clock command of its own (the gather's conversation is not)
        else:
            kind = "gather" if "@@cluster-probe@@" in sent.command else \
                next(v for v in ("listen", "probe", "stop") if f" {v} " in f" {sent.command} ")
        self.kinds.append((sent.node, kind))
        self.longest[kind] = max(self.longest.get(kind, 0), len(sent.command))
        if kind == "probe":
            self.probe_args.append(sent.command)
        if kind == "probe" and sent.node in self.silent:
            return '{"stopped": true}\n'      # no probe document
        return self.nodes(sent)

    def sent(self, kind: str) -> list[str]:
        return sorted(n for n, k in self.kinds if k == kind)


def test_a_healthy_preflight_sends_two_commands_a_node_and_no_listen_stop_or_clock():
    """The listener starts in the gather's round trip and leaves by itself once acked, and the
    clock is sampled on the gather's channel: a node gets its gather and its probe; a node whose
    probe goes unanswered gets a stop (its peers' listeners stay unacked by it, so they are
    stopped too)."""
    from playbooks.preflight import run_preflight

    inv = fake_inventory(3)
    log = CommandLog()
    session = log.session(inv)
    report = run_preflight(inv, session)
    reach = [r for r in report.results if r.check == "reachability"]
    assert reach and all(r.status == Status.OK for r in reach), [r.summary for r in reach]
    assert sorted(log.kinds) == sorted((n, k) for n in ("n1", "n2", "n3")
                                           for k in ("gather", "probe"))
    skew = next(r for r in report.results if r.check == "clock-skew")
    assert skew.status == Status.OK and set(skew.evidence.data["nodes"]) == {"n1", "n2", "n3"}

    log = CommandLog(silent={"n3"})
    session = log.session(inv)
    run_preflight(inv, session)
    assert log.sent("stop") == ["n1", "n2"]
    assert log.sent("listen") == []


def test_ups_gather_starts_the_listeners_so_its_preflight_sends_no_listen_either():
    """`cluster up` gathers its facts once (gather_facts) and hands them to the preflight with
    the listeners that gather started: 2 commands a node, as a preflight of its own; with the
    preflight skipped, its gather starts no listener."""
    from playbooks.ray_up import gather_facts, run_preflight

    inv = fake_inventory(3)
    log = CommandLog()
    session = log.session(inv)
    facts, listeners = gather_facts(session, inv, with_preflight=True)
    assert listeners is not None and sorted(listeners.served) == ["n1", "n2", "n3"]
    report = run_preflight(inv, session, facts, listeners)
    reach = [r for r in report.results if r.check == "reachability"]
    assert reach and all(r.status == Status.OK for r in reach), [r.summary for r in reach]
    assert sorted(log.kinds) == sorted((n, k) for n in ("n1", "n2", "n3")
                                           for k in ("gather", "probe"))
    assert all(f.clock is not None and f.clock.offset_s is not None for f in facts.values())
    log = CommandLog()
    session = log.session(inv)
    facts, listeners = gather_facts(session, inv, with_preflight=False)
    assert listeners is None and log.sent("gather") == ["n1", "n2", "n3"]
    assert all(LISTEN_PROBE not in f.outputs for f in facts.values())


def test_facts_handed_in_without_their_listeners_are_refused_before_any_command():
    """The listeners start only in the gather (gather_with_listeners): facts gathered without
    them cannot feed the reachability matrix, and nothing is sent to the nodes."""
    import pytest

    from playbooks.ray_up import gather_facts
    from playbooks.preflight import run_preflight

    inv = fake_inventory(3)
    facts, _ = gather_facts(CommandLog().session(inv), inv, with_preflight=True)
    log = CommandLog()
    session = log.session(inv)
    with pytest.raises(ValueError, match="gather_with_listeners"):
        run_preflight(inv, session, facts=facts)
    assert log.kinds == []


def test_listeners_told_of_a_peer_that_is_unreachable_by_the_probes_are_stopped():
    """A node gathered (its listener told 2 probers) while a third went unreachable: the
    probes run between the two reachable nodes only, so each listener hears 1 of its 2 and
    would stay to --for: both are stopped (test_faults' cut link found it: the head's Ray
    port stayed held)."""
    from playbooks.preflight import run_preflight

    inv = fake_inventory(3)
    log = CommandLog(unreachable={"n3"})
    session = log.session(inv)
    run_preflight(inv, session, measure_clock=False)
    assert log.sent("stop") == ["n1", "n2"]
    assert not [k for n, k in log.kinds if n == "n3"]      # nothing more is sent to n3

    log = CommandLog(unreachable={"n2", "n3"})
    session = log.session(inv)
    report = run_preflight(inv, session, measure_clock=False)
    assert log.sent("stop") == ["n1"]   # one reachable node: no probes, its listener stopped
    assert not [r for r in report.results if r.check == "reachability"]   # nothing to probe


class GatherBreaks(CommandLog):
    """A CommandLog whose gather on `breaks` raises what no runner should let out (EOFError:
    paramiko's channel close on a transport gone), after the other nodes' listeners started."""

    def __init__(self, breaks):
        super().__init__()
        self.breaks = set(breaks)

    def __call__(self, sent):
        if sent.node in self.breaks and "@@cluster-probe@@" in sent.command:
            self.kinds.append((sent.node, "gather"))
            raise EOFError()
        return super().__call__(sent)


def test_a_gather_that_raises_stops_every_listener_it_may_have_started():
    """The gather's error ends the run, but not before the listeners are stopped: which ones
    started is unknown, so every node with one gets a stop (one left held the head's Ray port
    for its lifetime, and the next `cluster up` failed there: CI, 2026-12-07); the gather's
    own error is the one raised."""
    import pytest

    from playbooks.preflight import run_preflight
    from playbooks.ray_up import gather_facts

    inv = fake_inventory(3)
    log = GatherBreaks({"n3"})
    with pytest.raises(EOFError):
        run_preflight(inv, log.session(inv))
    assert log.sent("stop") == ["n1", "n2", "n3"]
    assert log.sent("probe") == []

    log = GatherBreaks({"n2"})
    with pytest.raises(EOFError):
        gather_facts(log.session(inv), inv, with_preflight=True)
    assert log.sent("stop") == ["n1", "n2", "n3"]

    log = GatherBreaks({"n2"})        # the preflight skipped: no listener, nothing to stop
    with pytest.raises(EOFError):
        gather_facts(log.session(inv), inv, with_preflight=False)
    assert log.sent("stop") == []


class WindowNet:
    """reach.py's socket, selectors and time, faked: every connect is in flight until the
    selector reports it (the oldest first, one a select; to a host in `dropped` never: the fake
    clock then jumps to the select's timeout). A connect opened while `bound` sockets are open
    fails the test: the probe must keep its window."""

    AF_INET, SOCK_STREAM = socket.AF_INET, socket.SOCK_STREAM
    SOL_SOCKET, SO_ERROR = socket.SOL_SOCKET, socket.SO_ERROR
    EVENT_READ, EVENT_WRITE = 1, 2

    def __init__(self, bound: int, dropped=()):
        self.bound, self.dropped = bound, set(dropped)
        self.open: list = []          # sockets not closed, oldest first
        self.peak = self.connects = 0
        self.now = 0.0
        self.said: list[tuple[str, int]] = []
        net = self

        class Sock:
            def __init__(self, *_):
                self.to, self.heard_ack = None, False

            def setblocking(self, _):
                pass

            def connect_ex(self, to):
                assert len(net.open) < net.bound, f"{len(net.open) + 1} connects in flight"
                self.to = to
                net.open.append(self)
                net.connects += 1
                net.peak = max(net.peak, len(net.open))
                return errno.EINPROGRESS

            def getsockopt(self, *_):
                return errno.ECONNREFUSED if self.to[1] == 1 else 0

            def send(self, data):
                net.said.append(self.to)
                return len(data)

            def recv(self, n):
                return b"ok\n"[:n]

            def close(self):
                if self in net.open:
                    net.open.remove(self)

        class Key:
            def __init__(self, fileobj, events, data):
                self.fileobj, self.events, self.data = fileobj, events, data

        class Selector:
            def __init__(self):
                self.keys: dict = {}

            def register(self, s, events, data):
                self.keys[s] = Key(s, events, data)

            def modify(self, s, events, data):
                self.keys[s] = Key(s, events, data)

            def unregister(self, s):
                del self.keys[s]

            def get_map(self):
                return self.keys

            def select(self, timeout):
                for key in self.keys.values():
                    if key.fileobj.to[0] not in net.dropped:
                        return [(key, key.events)]
                net.now += timeout
                return []

        self.socket = type("socket_module", (), {"socket": Sock, "AF_INET": self.AF_INET,
                                                  "SOCK_STREAM": self.SOCK_STREAM,
                                                  "SOL_SOCKET": self.SOL_SOCKET,
                                                  "SO_ERROR": self.SO_ERROR})
        self.selectors = type("selectors_module", (), {
            "DefaultSelector": Selector, "EVENT_READ": self.EVENT_READ,
            "EVENT_WRITE": self.EVENT_WRITE})
        self.time = type("time_module", (), {"monotonic": staticmethod(lambda: net.now)})

    def install(self, monkeypatch, module) -> None:
        for name in ("socket", "selectors", "time"):
            monkeypatch.setattr(module, name, getattr(self, name))


def test_a_probe_keeps_at_most_its_window_of_connects_in_flight(monkeypatch):
    """At 1,000 nodes the head's probe sent 512 connects at once, each to a node it had no ARP
    entry for yet, and 1,536 of them timed out in the flood: a probe now keeps at most
    --at-once connects open, each with its own timeout, and still reports every target."""
    from cluster.node_programs import reach

    net = WindowNet(bound=16, dropped={"10.0.0.9"})
    net.install(monkeypatch, reach)
    hosts = [f"10.0.0.{i}" for i in range(1, 41)]
    targets = "/".join(hosts) + ":1+6379+8076"             # 120 connects, port 1 refused
    told = "10.0.0.2:6379,10.0.0.9:6379"
    doc = reach.probe({"--targets": targets, "--timeout": "2", "--at-once": "16",
                       "--deadline": "120", "--tag": "t4test", "--tell": told})
    assert net.connects == 120 and net.peak == 16 and not net.open
    want = {f"{h}:{p}": ("timeout" if h == "10.0.0.9" else "refused" if p == 1 else "ok")
            for h in hosts for p in (1, 6379, 8076)}
    assert doc["results"] == want
    assert doc["acked"] == ["10.0.0.2:6379"] and net.said == [("10.0.0.2", 6379)]


def test_a_probe_starts_no_connect_past_its_deadline(monkeypatch):
    """Every SYN dropped: the window's slots each wait the timeout, so the probe stops starting
    connects at --deadline; the ones never tried are left out (the laptop reads them as not
    answered), and the probe ends within the deadline plus one timeout."""
    from cluster.node_programs import reach

    hosts = [f"10.0.1.{i}" for i in range(1, 101)]
    net = WindowNet(bound=4, dropped=set(hosts))
    net.install(monkeypatch, reach)
    doc = reach.probe({"--targets": "/".join(hosts) + ":6379", "--timeout": "2",
                       "--at-once": "4", "--deadline": "10"})
    assert net.now <= 10 + 2 and not net.open
    assert 0 < len(doc["results"]) < 100 and set(doc["results"].values()) == {"timeout"}


def test_the_probe_command_carries_the_window_and_deadline_of_the_expectations():
    """connects_in_flight and probe_deadline_s are data (expectations.yaml), given to every
    node's probe; the laptop waits for a probe as long as its window of targets can take."""
    from cluster.inspection.reachability import plan_listeners, probe_seconds, run_reachability

    inv = fake_inventory(40)
    th = {**inv.expectations["reachability"], "connects_in_flight": 8, "probe_deadline_s": 30}
    inv.expectations["reachability"].update(th)
    log = CommandLog()
    session = log.session(inv)
    listeners = plan_listeners(inv, session, inv.nodes)
    docs = {n.name: {"listening": sorted(listeners.served[n.name]), "busy": [], "pid": 1}
            for n in inv.nodes}
    run_reachability(inv, session, inv.nodes, listeners, docs)
    assert log.probe_args and all(" --at-once 8 --deadline 30 " in c for c in log.probe_args)
    assert probe_seconds(100, th) == 13 * 2 + 2 and probe_seconds(1000, th) == 30 + 2


def test_a_preflight_plans_the_probes_once_and_again_only_without_a_node(monkeypatch):
    """The plan (every node's targets: the head's is every node's ports) was made twice a
    preflight, for the listeners and for the probes: once now when every node was reached; with
    a node unreachable the probes' plan is made again for the nodes left, without it."""
    from cluster.inspection import reachability
    from playbooks.preflight import run_preflight

    made = []
    real = reachability.plan_targets
    monkeypatch.setattr(reachability, "plan_targets",
                        lambda nodes, *a: made.append([n.name for n in nodes]) or real(nodes, *a))
    inv = fake_inventory(4)
    run_preflight(inv, CommandLog().session(inv))
    assert made == [["n1", "n2", "n3", "n4"]]
    made.clear()
    log = CommandLog(unreachable={"n4"})
    report = run_preflight(inv, log.session(inv))
    assert made == [["n1", "n2", "n3", "n4"], ["n1", "n2", "n3"]]
    gone = inv.nodes[3].ip
    assert len(log.probe_args) == 3 and all(f"{gone}:" not in c and f"/{gone}" not in c
                                            for c in log.probe_args)
    assert [r.status for r in report.results if r.check == "reachability" and r.node is None] \
        == [Status.OK]
