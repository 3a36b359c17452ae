"""`cluster plan`'s fabric needs (cluster/planning/fabric_needs.py): which groups cross nodes and the bus
bandwidth they need, from the model's size and the layout."""

from dataclasses import replace

import pytest

from cluster.planning.fabric_needs import fabric_needs, render
from cluster.planning.fabric_thresholds import load_table
from cluster.planning.plan_file import parse_plan
from fakes import model_config as model, plan_cluster as cluster, plan_for


def test_405b_on_two_h100_nodes_has_pp_pairs_across_nodes_tp_inside():
    plan = plan_for("llama-3.1-405b-instruct", "2x8-h100")
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (8, 2)
    info = model("llama-3.1-405b-instruct")
    needs = fabric_needs(info, plan, cluster("2x8-h100"))
    by_kind = {e["kind"]: e for e in needs["groups"]}
    assert needs["crossing_kinds"] == ["pp"]
    assert by_kind["tp"]["crossing_nodes"] == 0 and by_kind["tp"]["groups"] == 2
    assert by_kind["pp"]["crossing_nodes"] == 8
    assert by_kind["pp"]["example_nodes"] == ["node1", "node2"]
    rate = load_table().plan_reference_tokens_per_s
    hidden, act = info.hidden_size, info.dtype_bytes
    assert by_kind["pp"]["bytes_per_token"] == 2 * hidden * act
    assert by_kind["pp"]["needed_busbw_gbps"] == pytest.approx(2 * hidden * act * rate / 1e9,
                                                              rel=1e-3)
    layers = -(-info.num_layers // 2)
    assert by_kind["tp"]["bytes_per_token"] == round(2 * layers * hidden * act * 2 * 7 / 8)
    assert any("cross nodes (node1 -> node2)" in line for line in render(needs))


def test_single_gpu_plan_has_no_group():
    plan = plan_for("llama-3.1-8b", "1x8-h100")
    needs = fabric_needs(model("llama-3.1-8b"), replace(plan, tensor_parallel_size=1,
                                                          pipeline_parallel_size=1),
                         cluster("1x8-h100"))
    assert needs["groups"] == [] and needs["crossing_kinds"] == []


def test_a_plan_file_with_the_fabric_key_still_loads():
    plan = parse_plan("model: /m\nfabric: {groups: [], crossing_kinds: []}\n", "p.yaml")
    assert plan.tensor_parallel_size == 1
