"""Post-start reading (cluster/serving/engine_transport.py): the engine's own init lines -> what each group
runs over; real NCCL logs from the fixtures placed where a rank's log is read."""

from __future__ import annotations

from cluster.serving.engine_transport import (engine_ranks, mismatches, placement_warnings, read_engine,
                                      unconfirmed)
from cluster.planning.fabric_groups import Layout, NodeSlots, layout_groups, rank_slots
from fakes import fixture_text

IB_GDR_LOG = "041-ray-vllm-deepseek-16rank-ib-gdrdma-truncated-lines.log"
SOCKET_LOG = "009-pytorch-lightning-2.11.4-nccl-net-socket-dgx-a100.log"

# vLLM 0.x CPU build, both ranks of TP 1 x PP 2 (lines as parallel_state.py logs them)
GLOO_NODE1 = (
    "(ServeReplica:tiny:LLMServer pid=812) INFO 12-01 22:10:01 [parallel_state.py:1208] "
    "world_size=2 rank=0 local_rank=0 distributed_init_method=tcp://198.18.5.1:29500 "
    "backend=gloo\n"
    "(ServeReplica:tiny:LLMServer pid=812) INFO 12-01 22:10:03 [parallel_state.py:1400] rank 0 "
    "in world size 2 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 0, EP rank 0\n")
GLOO_NODE2 = (
    "(RankActor pid=401) INFO 12-01 22:10:01 [parallel_state.py:1208] world_size=2 rank=1 "
    "local_rank=0 distributed_init_method=tcp://198.18.5.1:29500 backend=gloo\n"
    "(RankActor pid=401) INFO 12-01 22:10:03 [parallel_state.py:1400] rank 1 in world size 2 "
    "is assigned as DP rank 0, PP rank 1, PCP rank 0, TP rank 0, EP rank 0\n")


def _pp2(names=("gpu1", "gpu2")):
    layout = Layout(tp=1, pp=2)
    nodes = [NodeSlots(n, f"10.0.0.{i + 1}", 1) for i, n in enumerate(names)]
    return layout_groups(layout, rank_slots(layout, nodes))


def _proof_group(transport, gdr):
    return {"kind": "pp", "ranks": [0, 1], "nodes": ["gpu1", "gpu2"], "backend": "nccl",
            "transport": transport, "gdr": gdr, "busbw_gbps": 40.0, "threshold_gbps": 38.0,
            "verdict": f"OK: pp r0 [0,1] on gpu1 -> gpu2 over {transport}"}


def test_ib_gdr_log_gives_ib_gdr_with_its_channel_line():
    groups = _pp2()
    reading = read_engine(groups, {"gpu1": [fixture_text("nccl", IB_GDR_LOG)], "gpu2": []},
                          "nccl")[0]
    assert (reading.transport, reading.gdr) == ("IB", True)
    assert "via NET/IB/15/GDRDMA" in reading.evidence
    assert mismatches([_proof_group("IB", True)], [reading], "IB") == []


def test_socket_log_gives_socket_and_fails_where_ib_is_expected():
    groups = _pp2()
    reading = read_engine(groups, {"gpu1": [fixture_text("nccl", SOCKET_LOG)]}, "nccl")[0]
    assert reading.transport == "SOCKET" and reading.gdr is False
    assert "Using network Socket" in reading.evidence
    problems = mismatches([_proof_group("IB", True)], [reading], "IB")
    assert len(problems) == 1
    assert "over sockets where the inventory expects InfiniBand" in problems[0]
    assert "Using network Socket" in problems[0]
    # no IB expected: the proof's IB/GDR against the engine's sockets is still a mismatch,
    # with both lines
    both = mismatches([_proof_group("IB", True)], [reading], None,
                      [{"evidence": "via NET/IB/0/GDRDMA (proof)"}])
    assert len(both) == 1 and "proof ran over IB/GDR" in both[0]
    assert "via NET/IB/0/GDRDMA (proof)" in both[0] and "Using network Socket" in both[0]


def test_gloo_lines_give_tcp_and_the_ranks_the_engine_reports():
    groups = _pp2(("node1", "node2"))
    logs = {"node1": [GLOO_NODE1], "node2": [GLOO_NODE2]}
    ranks = engine_ranks(logs, world_size=2)
    assert {r: [(v.node, v.backend, v.pp_rank) for v in per.values()]
            for r, per in ranks.items()} == {0: [("node1", "gloo", 0)], 1: [("node2", "gloo", 1)]}
    assert engine_ranks(logs, world_size=4) == {}          # another engine's lines
    reading = read_engine(groups, logs, "gloo")[0]
    assert reading.transport == "TCP" and reading.engine_ranks == {0: "node1", 1: "node2"}
    assert "backend=gloo" in reading.evidence
    assert mismatches([], [reading], None) == []


def test_engine_ranks_on_other_nodes_than_the_proof_tested_are_named():
    groups = _pp2(("node1", "node2"))
    logs = {"node1": [GLOO_NODE1 + GLOO_NODE2.replace("RankActor", "Other")]}
    reading = read_engine(groups, logs, "gloo", world_size=2)[0]
    assert placement_warnings([reading]) == [
        "pp [0,1]: the engine placed rank 1 on node1 (proven on node2): not proven there"]
    # the same rank number logged by another engine elsewhere does not hide the right node
    both = {"node1": [GLOO_NODE1 + GLOO_NODE2], "node2": [GLOO_NODE2]}
    assert placement_warnings(read_engine(groups, both, "gloo", world_size=2)) == []


def test_no_init_lines_leave_the_group_unconfirmed():
    groups = _pp2()
    readings = read_engine(groups, {"gpu1": ["nothing here\n"]}, "nccl")
    assert readings[0].transport is None and unconfirmed(readings) == ["pp [0,1]"]
    assert mismatches([_proof_group("IB", True)], readings, "IB") == []


def _run_collector(logs_dir, since=0.0):
    import json
    import subprocess
    import sys

    from cluster.node_programs import source

    p = subprocess.run([sys.executable, "-", str(logs_dir), str(since)],
                       input=source("engine_logs"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _ray_dirs(root, name):
    session = root / name / "session_2026-12-01_22-00-00_000000_1"
    (session / "logs" / "serve").mkdir(parents=True)
    (root / name / "session_latest").symlink_to(session.name)
    return root / name / "session_latest" / "logs", session / "logs"


def test_fixture_logs_placed_where_a_ranks_log_is_read(tmp_path):
    """The node-side collector over Ray's logs dir on each node, then the pure reader: the IB
    fixture gives IB/GDR, the socket one SOCKET, which fails where IB is expected."""
    from cluster.serving.engine_transport import logs_of

    docs = {}
    for node, log in (("gpu1", IB_GDR_LOG), ("gpu2", SOCKET_LOG)):
        latest, real = _ray_dirs(tmp_path, node)
        (real / "worker-0a1b2c-01000000-4242.err").write_text(fixture_text("nccl", log))
        (real / "raylet.out").write_text("NCCL INFO Using network IB\n")   # not a rank's log
        docs[node] = _run_collector(latest)
        assert docs[node]["error"] is None
        assert [f["path"] for f in docs[node]["files"]] == ["worker-0a1b2c-01000000-4242.err"]
    groups = _pp2()
    ib = read_engine(groups, {"gpu1": logs_of(docs)["gpu1"]}, "nccl")[0]
    assert (ib.transport, ib.gdr) == ("IB", True) and "GDRDMA" in ib.evidence
    sock = read_engine(groups, {"gpu1": logs_of(docs)["gpu2"]}, "nccl")[0]
    assert sock.transport == "SOCKET"
    assert "expects InfiniBand" in mismatches([], [sock], "IB")[0]


def test_collector_refuses_a_logs_dir_outside_rays_and_never_follows_file_links(tmp_path):
    latest, real = _ray_dirs(tmp_path, "n")
    secret = tmp_path / "secret.txt"
    secret.write_text("NCCL INFO Using network IB\n")
    (real / "worker-aa-01000000-1.out").symlink_to(secret)
    doc = _run_collector(latest)
    assert doc["files"] == [] and doc["error"] is None
    outside = tmp_path / "elsewhere" / "logs"
    outside.mkdir(parents=True)
    (tmp_path / "n" / "session_evil").symlink_to(outside.parent)
    doc = _run_collector(tmp_path / "n" / "session_evil" / "logs")
    assert doc["error"] and doc["files"] == []


def test_confirmed_by_app_reads_the_newest_deploy_record_of_each_app(tmp_path):
    import json

    from cluster.serving.engine_transport import confirmed_by_app

    def record(run, name, readings):
        (tmp_path / run).mkdir()
        (tmp_path / run / "deploy.json").write_text(json.dumps(
            {"name": name, "status": "RUNNING", "engine_transport": readings}))

    tcp = [{"kind": "pp", "ranks": [0, 1], "transport": "TCP", "gdr": None}]
    ib = [{"kind": "pp", "ranks": [0, 1], "transport": "IB", "gdr": True}]
    record("20261201-220000", "tiny", tcp)
    record("20261201-230000", "tiny", ib)
    record("20261201-230500", "other", None)
    (tmp_path / "20261201-231000").mkdir()
    (tmp_path / "20261201-231000" / "deploy.json").write_text("{not json")
    got = confirmed_by_app(str(tmp_path), ["tiny", "other", "absent"])
    assert got == {"tiny": {"groups": ["pp [0,1]: IB/GDR"], "status": "RUNNING",
                            "deployed_from": str(tmp_path / "20261201-230000")}}


def test_the_collector_keeps_a_ranks_compile_cache_lines_for_compile_cache(tmp_path):
    """Issue 27: the real worker log of a PP 2 rank through the node-side collector, then
    cluster/serving/compile_cache.py: the rank, its cache directory and that it compiled."""
    from cluster.serving.compile_cache import read_ranks
    from cluster.serving.engine_transport import logs_of

    latest, real = _ray_dirs(tmp_path, "node2")
    text = fixture_text("vllm-compile-cache", "pp2_rank1_compiled.txt")
    (real / "worker-0a1b2c-03000000-531.out").write_text(text)
    doc = _run_collector(latest)
    (kept,) = doc["files"]
    assert any("saved AOT compiled function to" in line for line in kept["lines"])
    assert not any("Loading weights took" in line for line in kept["lines"])
    (rank,) = read_ranks(logs_of({"node2": doc}))
    assert (rank.node, rank.rank, rank.state) == ("node2", 1, "compiled")
    assert rank.dir.root == "/tmp/vllm-cache"
