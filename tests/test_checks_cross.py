"""Cross-node checks (cluster/inspection/checks/cross.py): what must match on every node, and clock skew.

The per-node facts they compare are the facts the node checks give on real captures (tests/
fixtures through the real parsers, judged as preflight does: tests/fakes.py), so a fact's
shape here is the one preflight produces. The clock samples come from a scripted session and
a scripted clock: no network, no timing in the assertions.
"""

from __future__ import annotations

import pytest

from cluster.inspection.checks import cross
from cluster.inspection import clock
from cluster.inspection.clock import ClockSample
from cluster.inspection.node_summary import NodeFactsSummary
from cluster.nodes.inventory import default_expectations, loads
from cluster.base.errors import CommandTimeout
from cluster.base.results import Status
from fakes import FakeRunner, exchange_of, fixture_text, judge, probe_output, result

ONE_NODE = "nodes:\n  - {name: x, address: 10.0.0.9, role: head}\n"
H100 = ("nvidia-smi-query", "001-h100-name-busid-vbios-elided.txt")
RTX = ("nvidia-smi-query", "005-noheader-nounits-rtx2080-command-and-raw-line.txt")
DRIVER_570 = ("nvidia-smi", "007-l4-570-single-gpu.txt")
DRIVER_550 = ("nvidia-smi", "001-a100-80gb-pcie-550-partial.txt")
EXPECT = default_expectations()


def facts_of(*captures: tuple[str, str]) -> dict:
    """The facts the gpus/driver checks report for a node printing these captures."""
    facts: dict = {}
    for kind, name in captures:
        check, probe = {"nvidia-smi-query": ("gpus", "gpu-query"),
                        "nvidia-smi": ("driver", "nvidia-smi")}[kind]
        verdict = judge(check, ONE_NODE,
                        **{probe.replace("-", "_"): probe_output(probe, fixture_text(kind, name))})
        facts.update(verdict.facts.to_dict())
    return facts


def typed(facts: dict) -> dict:
    """Each node's facts as the preflight hands them to the cross-node checks (typed)."""
    return {n: NodeFactsSummary.from_dict(f) for n, f in facts.items()}


def rows(results) -> list[tuple]:
    return [(r.check, r.node, r.status) for r in results]


# ---------------------------------------------------------------- GPU model, driver


def test_same_gpu_model_everywhere_is_ok():
    facts = {n: facts_of(H100) for n in ("n1", "n2", "n3")}
    (res,) = cross.gpu_consistency(typed(facts), "n1")
    assert (res.check, res.node, res.status) == ("gpu-match", None, Status.OK)
    assert res.summary == "GPU model NVIDIA H100 80GB HBM3 on all 3 nodes"
    assert res.evidence.data["reference"] == "NVIDIA H100 80GB HBM3"


def test_an_odd_gpu_model_warns_on_the_cluster_and_names_the_node():
    facts = {"n1": facts_of(H100), "n2": facts_of(H100), "n3": facts_of(RTX)}
    results = cross.gpu_consistency(typed(facts), "n1")
    assert rows(results) == [("gpu-match", None, Status.WARN), ("gpu-match", "n3", Status.WARN)]
    assert results[0].summary == ("GPU model differs: NVIDIA H100 80GB HBM3 on n1, n2; "
                                  "GeForce RTX 2080 on n3")
    assert results[1].summary == "GPU model GeForce RTX 2080 differs from NVIDIA H100 80GB HBM3 (n1, n2)"
    assert all(r.fix == "a TP/PP group runs at the smallest GPU: keep one model per group"
               for r in results)


def test_the_majority_is_the_reference_even_against_the_head():
    facts = {"n1": facts_of(RTX), "n2": facts_of(H100), "n3": facts_of(H100)}
    results = cross.gpu_consistency(typed(facts), "n1")
    assert [r.node for r in results] == [None, "n1"]
    assert results[1].summary.startswith("GPU model GeForce RTX 2080 differs from NVIDIA H100")


def test_on_a_tie_the_head_is_the_reference():
    facts = {"n1": facts_of(H100), "n2": facts_of(RTX)}
    assert [r.node for r in cross.gpu_consistency(typed(facts), "n1")] == [None, "n2"]
    assert [r.node for r in cross.gpu_consistency(typed(facts), "n2")] == [None, "n1"]


def test_nodes_without_gpus_are_left_out_and_none_known_skips():
    facts = {"n1": facts_of(H100), "cpu": {"gpu_count": 0, "gpu_model": None}}
    (res,) = cross.gpu_consistency(typed(facts), "n1")
    assert res.status is Status.OK and res.summary.endswith("on all 1 nodes")
    (skip,) = cross.gpu_consistency(typed({"cpu": {}}), "cpu")
    assert skip.status is Status.SKIP and skip.summary == "no GPU model known on any node"


def test_a_different_driver_fails_naming_the_node():
    facts = {"n1": facts_of(DRIVER_570), "n2": facts_of(DRIVER_570), "n3": facts_of(DRIVER_550)}
    results = cross.driver_consistency(typed(facts), "n1")
    assert rows(results) == [("driver-match", None, Status.FAIL),
                             ("driver-match", "n3", Status.FAIL)]
    assert results[0].summary == "NVIDIA driver differs: 570.133.20 on n1, n2; 550.90.12 on n3"
    assert results[1].fix == "install the same driver version on every node"
    same = cross.driver_consistency(typed({"n1": facts_of(DRIVER_570), "n2": facts_of(DRIVER_570)}), "n1")
    assert rows(same) == [("driver-match", None, Status.OK)]
    assert same[0].summary == "NVIDIA driver 570.133.20 on all 2 nodes"


def test_mtu_tie_takes_the_head_and_non_integers_are_ignored():
    results = cross.mtu_consistency(typed({"a": {"mtu": 9000}, "b": {"mtu": 1500},
                                           "c": {"mtu": None}}), "b")
    assert rows(results) == [("mtu-match", None, Status.FAIL), ("mtu-match", "a", Status.FAIL)]
    assert results[0].summary == "MTU differs: 1500 on b; 9000 on a"
    assert "ip link set <if> mtu 9000" in results[0].fix


# ---------------------------------------------------------------- versions


def versions(**per_node: dict) -> dict:
    return {n: {"versions": v} for n, v in per_node.items()}


def test_versions_must_match_the_head_even_when_it_is_the_minority():
    facts = versions(head={"ray": "2.60.0", "vllm": "0.11.0"},
                     w1={"ray": "2.59.1", "vllm": "0.11.0"},
                     w2={"ray": "2.59.1", "vllm": "0.11.0"})
    results = cross.version_consistency(typed(facts), "head", ("ray", "vllm"))
    assert rows(results) == [("ray-match", None, Status.FAIL), ("ray-match", "w1", Status.FAIL),
                             ("ray-match", "w2", Status.FAIL), ("vllm-match", None, Status.OK)]
    assert results[0].summary == "ray differs from the head's 2.60.0: 2.59.1 on w1, 2.59.1 on w2"
    assert results[1].summary == "ray 2.59.1, head has 2.60.0"
    assert results[0].fix == ("install ray 2.60.0 on every node (Ray and vLLM must match the head "
                              "exactly)")
    assert results[3].summary == "vllm 0.11.0 on all 3 nodes"


def test_a_component_known_nowhere_gives_no_result_and_unknown_nodes_are_left_out():
    facts = versions(head={"ray": "2.60.0", "vllm": None}, w1={"ray": "2.60.0"})
    facts["w2"] = {}                                   # no versions fact (probe failed)
    results = cross.version_consistency(typed(facts), "head", ("python", "ray", "vllm"))
    assert rows(results) == [("ray-match", None, Status.OK)]
    assert results[0].summary == "ray 2.60.0 on all 2 nodes"


def test_without_the_head_the_majority_is_the_reference():
    facts = versions(w1={"torch": "2.5.1"}, w2={"torch": "2.5.1"}, w3={"torch": "2.4.0"})
    results = cross.version_consistency(typed(facts), "head", ("torch",))
    assert [r.node for r in results] == [None, "w3"]
    assert results[1].summary == "torch 2.4.0, head has 2.5.1"


# ---------------------------------------------------------------- model files


def model(**files: tuple[int, str]) -> dict:
    return {"model_files": {k: {"size": s, "sha256": h} for k, (s, h) in files.items()}}


A, B = "a" * 64, "b" * 64


def test_model_files_that_differ_fail_naming_the_node_and_the_files():
    facts = {"n1": model(**{"config.json": (10, A), "tokenizer.json": (5, A)}),
             "n2": model(**{"config.json": (10, A), "tokenizer.json": (5, A)}),
             "n3": model(**{"config.json": (10, B), "tokenizer.json": (5, A)}),
             "cpu": {}}
    results = cross.model_consistency(typed(facts), "n1")
    assert rows(results) == [("model-match", None, Status.FAIL), ("model-match", "n3", Status.FAIL)]
    assert results[0].summary == "model files differ on n3"
    assert results[1].summary == "model files differ from the other nodes: config.json"
    assert results[1].fix == "re-sync the model directory (rsync -a --checksum) from a good node"
    assert results[0].evidence.data["n3"]["config.json"] == {"size": 10, "sha256": B}


def test_a_missing_file_counts_as_a_difference_and_identical_is_ok():
    facts = {"n1": model(**{"config.json": (10, A), "tokenizer.json": (5, A)}),
             "n2": model(**{"config.json": (10, A)})}
    results = cross.model_consistency(typed(facts), "n1")
    assert results[1].node == "n2" and results[1].summary.endswith(": tokenizer.json")
    same = cross.model_consistency(typed({"n1": model(**{"config.json": (10, A)}),
                                          "n2": model(**{"config.json": (10, A)})}), "n1")
    assert rows(same) == [("model-match", None, Status.OK)]
    assert same[0].summary == "identical model config/index on 2 nodes"
    assert cross.model_consistency(typed({"n1": {}, "n2": {"model_files": {}}}), "n1") == []


# ---------------------------------------------------------------- clock skew


def samples(**offsets: float | None) -> dict[str, ClockSample]:
    """Samples with a 10 ms round trip (+-5 ms uncertainty); None: the node did not answer."""
    return {n: ClockSample(n, o, 0.01) if o is not None else ClockSample(n, None, None, "no answer")
            for n, o in offsets.items()}


def test_skew_within_the_warning_is_ok():
    (res,) = cross.clock_skew(samples(a=0.0, b=0.05, c=0.02), EXPECT)
    assert (res.check, res.node, res.status) == ("clock-skew", None, Status.OK)
    assert res.summary == "max skew 50.0 ms (+-5.0 ms) across 3 nodes"
    assert res.evidence.command == clock.CLOCK_COMMAND
    assert res.evidence.data["max_skew_s"] == pytest.approx(0.05)


def test_skew_above_the_warning_warns():
    (res,) = cross.clock_skew(samples(a=0.0, b=0.2), EXPECT)
    assert res.status is Status.WARN and res.summary == "max skew 200.0 ms (+-5.0 ms) across 2 nodes"
    assert res.fix == "sync clocks with chrony on every node (same NTP sources)"


def test_skew_above_the_limit_fails_naming_the_node_off_the_median():
    results = cross.clock_skew(samples(a=0.0, b=0.01, c=2.5, d=None), EXPECT)
    assert rows(results) == [("clock-skew", None, Status.FAIL), ("clock-skew", "c", Status.FAIL)]
    assert results[0].summary == "max skew 2500.0 ms (+-5.0 ms) across 3 nodes, limit 500 ms"
    assert results[1].summary == "clock +2.490 s from the other nodes' median"
    assert results[0].evidence.data["nodes"]["d"] == {"offset_s": None, "rtt_s": None,
                                                      "error": "no answer"}


def test_the_round_trip_uncertainty_is_given_the_benefit_of_the_doubt():
    slow = {"a": ClockSample("a", 0.0, 0.5), "b": ClockSample("b", 0.6, 0.5)}
    (res,) = cross.clock_skew(slow, EXPECT)          # 600 ms apart, +-250 ms: not a failure
    assert res.status is Status.WARN and "(+-250.0 ms)" in res.summary


def test_fewer_than_two_answers_skip():
    (res,) = cross.clock_skew(samples(a=0.0, b=None), EXPECT)
    assert res.status is Status.SKIP
    assert res.summary == "fewer than two nodes answered: no skew to measure"


_ONE_NODE = loads("nodes:\n  - {name: n1, address: 10.0.0.1, role: head}\n")


def _sample(answer):
    """sample_clock on n1 through a real Session whose node gives `answer`; and the node."""
    nodes = FakeRunner({"n1": answer})
    return clock.sample_clock(nodes.session(_ONE_NODE), _ONE_NODE.head), nodes


def test_sample_clock_keeps_the_quickest_round_trip():
    # three samples on one command, round trips 0.2, 0.05 and 0.1 s: the second one's offset
    sample, nodes = _sample(exchange_of("n1", (100.0, "1000.1", 100.2),
                                        (101.0, "1001.525", 101.05), (102.0, "1002.0", 102.1)))
    assert sample.offset_s == pytest.approx(1001.525 - 101.025)
    assert sample.rtt_s == pytest.approx(0.05) and sample.error is None
    assert [(s.node, s.command) for s in nodes.sent] == [("n1", clock.CLOCK_COMMAND)]


def test_sample_clock_stops_after_a_quick_sample():
    # the first round trip is 4 ms: the later (slower, wrong) answers are never asked for
    sample, _ = _sample(exchange_of("n1", (50.0, "51.002", 50.004), (51.0, "9999", 51.5),
                                    (52.0, "x", 52.5)))
    assert sample.offset_s == pytest.approx(1.0) and sample.rtt_s == pytest.approx(0.004)
    assert sample.error is None


def test_sample_clock_errors_are_samples_not_exceptions():
    failed, _ = _sample(CommandTimeout("n1", 10.0))
    assert failed == ClockSample("n1", None, None, "n1: no answer within 10 s")
    code, _ = _sample(result("n1", status="failed", code=127, error=""))
    assert code.error == "exit 127"
    silent, _ = _sample(result("n1", ""))
    assert silent == ClockSample("n1", None, None, "no date output")
    for line in ("+%s.%N", "nan", "inf"):
        garbage, _ = _sample(exchange_of("n1", (1.0, line, 1.1)))
        assert garbage.offset_s is None and garbage.error == f"unreadable date output {line!r}"


def test_clock_command_answers_each_newline_with_the_clock_until_eof(tmp_path):
    """The command itself, in a real shell: one line a newline read, exit 0 at EOF."""
    import subprocess
    import time
    before = time.time()
    p = subprocess.run(["sh", "-c", clock.CLOCK_COMMAND], input="\n\n\n", capture_output=True,
                       text=True, timeout=30)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 3, (p.returncode, p.stdout, p.stderr)
    assert all(before - 1 < float(x) < time.time() + 1 for x in lines)


def test_sample_clock_on_this_machine_is_one_command_per_ask():
    """A local node (LocalRunner): each ask is one run of the command with a newline on stdin;
    the offset from this machine's own clock is about nothing."""
    from cluster.nodes.remote import Session
    inv = loads("nodes:\n  - {name: here, address: 127.0.0.1, role: head, local: true}\n")
    recorded = []
    with Session(inv, hooks=[recorded.append]) as session:
        sample = clock.sample_clock(session, inv.head)
    assert sample.error is None and abs(sample.offset_s) < 1.0, sample
    assert [r.status for r in recorded] == ["ok"] and recorded[0].command == clock.CLOCK_COMMAND


def test_measure_skew_samples_every_node():
    inv = loads("nodes:\n  - {name: a, address: 10.0.0.1, role: head}\n"
                "  - {name: b, address: 10.0.0.2}\n")
    nodes = FakeRunner({"a": exchange_of("a", (0.5, "1.0", 0.51)),
                        "b": result("b", status="unreachable", code=None)})
    out = clock.measure_skew(nodes.session(inv), inv.nodes)
    assert set(out) == {"a", "b"}
    assert out["a"] == ClockSample("a", pytest.approx(0.495), pytest.approx(0.01))
    assert out["b"] == ClockSample("b", None, None, "b: boom")


# ---------------------------------------------------------------- all of them


def test_cross_node_checks_run_every_comparison_from_the_inventory():
    inv = loads("nodes:\n  - {name: n1, address: 10.0.0.1, role: head}\n"
                "  - {name: n2, address: 10.0.0.2}\n"
                "expectations: {versions_must_match: [ray]}\n")
    facts = {"n1": facts_of(H100, DRIVER_570) | {"mtu": 9000, "versions": {"ray": "2.60.0",
                                                                            "vllm": "0.11.0"}},
             "n2": facts_of(H100, DRIVER_550) | {"mtu": 9000, "versions": {"ray": "2.60.0",
                                                                            "vllm": "0.10.0"}}}
    results = cross.cross_node_checks(typed(facts), inv, samples(n1=0.0, n2=0.001))
    assert [(r.check, r.node, r.status) for r in results] == [
        ("gpu-match", None, Status.OK),
        ("driver-match", None, Status.FAIL), ("driver-match", "n2", Status.FAIL),
        ("mtu-match", None, Status.OK),
        ("ray-match", None, Status.OK),            # vllm differs, but only ray must match here
        ("ray-client", None, Status.SKIP),          # no command uses Ray's client
        ("clock-skew", None, Status.OK)]
    without_skew = cross.cross_node_checks(typed(facts), inv, None)
    assert "clock-skew" not in {r.check for r in without_skew}
