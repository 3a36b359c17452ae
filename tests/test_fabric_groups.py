"""Layout -> groups (cluster/planning/fabric_groups.py): TP x PP, DP x TP and DP + EP layouts."""

import pytest

from cluster.serving import deploy
from cluster.base.errors import UsageError
from cluster.planning.fabric_groups import Layout, NodeSlots, layout_groups, rank_slots, slots_per_node
from cluster.planning.gang import gang_layout, nodes_needed
from cluster.planning.plan_file import parse_plan


def _nodes(n, slots):
    return [NodeSlots(f"node{i + 1}", f"198.18.5.{i + 1}", slots) for i in range(n)]


def _by_kind(groups):
    out = {}
    for g in groups:
        out.setdefault(g.kind, []).append((g.replica, g.ranks, g.nodes))
    return out


def test_tp_x_pp_two_nodes_tp_inside_node_pp_pairs_across():
    layout = Layout(tp=4, pp=2)
    slots = rank_slots(layout, _nodes(2, 4))
    assert [(s.rank, s.node, s.device) for s in slots] == [
        (0, "node1", 0), (1, "node1", 1), (2, "node1", 2), (3, "node1", 3),
        (4, "node2", 0), (5, "node2", 1), (6, "node2", 2), (7, "node2", 3)]
    kinds = _by_kind(layout_groups(layout, slots))
    assert kinds["tp"] == [(0, (0, 1, 2, 3), ("node1",)), (0, (4, 5, 6, 7), ("node2",))]
    assert kinds["pp"] == [(0, (0, 4), ("node1", "node2")), (0, (1, 5), ("node1", "node2")),
                           (0, (2, 6), ("node1", "node2")), (0, (3, 7), ("node1", "node2"))]
    assert set(kinds) == {"tp", "pp"}


def test_pp_three_stages_gives_neighbouring_pairs_only():
    layout = Layout(tp=1, pp=3)
    groups = layout_groups(layout, rank_slots(layout, _nodes(3, 1)))
    assert [(g.kind, g.ranks) for g in groups] == [("pp", (0, 1)), ("pp", (1, 2))]


def test_tp1_pp2_cpu_follows_the_nodes_the_engine_spans():
    """A CPU node takes one rank per CPU (as deploy.engine_nodes counts them): PP 2 fits one
    4-CPU node, so without nnodes both stages are on node1; with nnodes 2 (--nnodes 2, the
    multi-node engine) one stage per node and the pair crosses nodes."""
    per_node = slots_per_node(Layout(tp=1, pp=2), "cpu", 4.0)
    assert per_node == 4
    packed = layout_groups(Layout(tp=1, pp=2), rank_slots(Layout(tp=1, pp=2), _nodes(2, per_node)))
    assert [(g.kind, g.ranks, g.nodes) for g in packed] == [("pp", (0, 1), ("node1",))]
    assert not any(g.crosses_nodes for g in packed)
    spread = Layout(tp=1, pp=2, nnodes=2)
    groups = layout_groups(spread, rank_slots(spread, _nodes(2, per_node)))
    assert [(g.kind, g.ranks, g.nodes) for g in groups] == [("pp", (0, 1), ("node1", "node2"))]
    assert all(g.crosses_nodes for g in groups)


def test_dense_dp_x_tp_replicas_are_separate_engines():
    layout = Layout(tp=2, replicas=2)
    slots = rank_slots(layout, _nodes(2, 2))
    groups = layout_groups(layout, slots)
    assert [(g.kind, g.replica, g.ranks, g.nodes) for g in groups] == [
        ("tp", 0, (0, 1), ("node1",)), ("tp", 1, (0, 1), ("node2",))]
    assert not any(g.crosses_nodes for g in groups)


def test_dp_plus_ep_groups():
    layout = Layout(tp=2, dp=2, ep=True)
    slots = rank_slots(layout, _nodes(2, 2))
    kinds = _by_kind(layout_groups(layout, slots))
    assert kinds["tp"] == [(0, (0, 1), ("node1",)), (0, (2, 3), ("node2",))]
    assert kinds["dp"] == [(0, (0, 2), ("node1", "node2")), (0, (1, 3), ("node1", "node2"))]
    assert kinds["ep"] == [(0, (0, 1, 2, 3), ("node1", "node2"))]
    assert "pp" not in kinds


def test_ep_with_tp1_has_no_separate_dp_group():
    layout = Layout(tp=1, dp=4, ep=True)
    kinds = _by_kind(layout_groups(layout, rank_slots(layout, _nodes(1, 8))))
    assert kinds == {"ep": [(0, (0, 1, 2, 3), ("node1",))]}


def test_tp_group_never_straddles_nodes():
    layout = Layout(tp=2, pp=2)
    # 3 GPUs per node: only one whole TP group per node
    slots = rank_slots(layout, _nodes(2, 3))
    assert [s.node for s in slots] == ["node1", "node1", "node2", "node2"]


def test_tp_larger_than_a_node_spans_whole_nodes_like_the_gang():
    layout = Layout(tp=8)
    groups = layout_groups(layout, rank_slots(layout, _nodes(2, 4)))
    assert [(g.kind, g.ranks, g.nodes) for g in groups] == [
        ("tp", tuple(range(8)), ("node1", "node2"))]


def test_too_few_nodes_refused():
    with pytest.raises(UsageError, match="needs 4 node"):
        rank_slots(Layout(tp=2, pp=4), _nodes(2, 2))
    with pytest.raises(UsageError, match="needs 3 node"):
        rank_slots(Layout(tp=3, pp=1), _nodes(2, 2))
    with pytest.raises(UsageError, match="no node"):
        rank_slots(Layout(), [])


def test_layout_from_spec_and_plan_matches():
    plan = parse_plan("model: /models/m\ntensor_parallel_size: 2\npipeline_parallel_size: 2\n"
                      "replicas: 1\n", "p.yaml")
    spec = deploy.spec_from_plan(plan)
    assert Layout.from_spec(spec) == Layout(tp=2, pp=2) == Layout.from_plan(plan)
    moe = deploy.spec_from_flags("/models/m", tp=2, dp=4, expert_parallel=True)
    assert Layout.from_spec(moe) == Layout(tp=2, dp=4, ep=True)
    dense = deploy.spec_from_flags("/models/m", tp=2, dp=3)
    assert Layout.from_spec(dense) == Layout(tp=2, replicas=3)


def test_bad_layout_numbers_refused():
    with pytest.raises(UsageError):
        Layout(tp=0)
    with pytest.raises(UsageError):
        Layout(tp=True)
    with pytest.raises(UsageError):
        Layout(dp=2)


def test_nodes_needed_matches_vllm_even_split():
    assert nodes_needed(1, 2, 1) == 2
    assert nodes_needed(4, 2, 8) == 1
    assert nodes_needed(4, 2, 4) == 2
    assert nodes_needed(2, 3, 4) == 3     # 6 ranks: 2 per node


@pytest.mark.parametrize("layout, per_node", [
    (Layout(tp=1, dp=16, ep=True), 8), (Layout(tp=2, dp=4, ep=True), 4),
    (Layout(tp=2, pp=2), 2), (Layout(tp=8), 4), (Layout(tp=4, pp=2, replicas=2), 4)])
def test_proof_ranks_sit_where_the_gang_runs_them(layout, per_node):
    """One rule (cluster/planning/gang.py): the proof's rank -> node rank is the gang's layout."""
    slots = rank_slots(layout, _nodes(4, per_node))
    nnodes = nodes_needed(layout.tp, layout.pp, per_node, dp=layout.dp)
    gang = gang_layout(layout.tp, layout.pp, nnodes, layout.dp)
    names = {}
    for s in slots:
        names.setdefault(s.replica, []).append(s.node)
    for s in slots:
        node_rank = list(dict.fromkeys(names[s.replica])).index(s.node)
        assert s.rank in gang.nodes[node_rank].ranks


def test_moe_dp16_ep_on_two_8_gpu_nodes_dp_ep_groups_follow_the_dp_layout():
    """DP 16 x TP 1 with EP on 2 x 8 GPUs: DP ranks 0-7 on node1, 8-15 on node2 (the gang's
    data_parallel_start_rank 0 / 8), one EP group of all 16 ranks across both nodes."""
    layout = Layout(tp=1, dp=16, ep=True)
    slots = rank_slots(layout, _nodes(2, 8))
    assert [s.node for s in slots] == ["node1"] * 8 + ["node2"] * 8
    assert [s.device for s in slots] == list(range(8)) * 2
    kinds = _by_kind(layout_groups(layout, slots))
    assert kinds == {"ep": [(0, tuple(range(16)), ("node1", "node2"))]}


def test_replicas_take_their_own_nodes_when_full():
    layout = Layout(tp=1, pp=2, replicas=2)
    slots = rank_slots(layout, _nodes(4, 1))
    assert [(s.replica, s.rank, s.node) for s in slots] == [
        (0, 0, "node1"), (0, 1, "node2"), (1, 0, "node3"), (1, 1, "node4")]


def test_a_fixed_nnodes_splits_the_engine_evenly_as_vllm_does():
    # CPU nodes with room for 4: by the fewest-nodes rule PP 2 stays on one node...
    layout = Layout(tp=1, pp=2)
    assert {s.node for s in rank_slots(layout, _nodes(2, 4))} == {"node1"}
    # ... the deployment's --nnodes 2 puts stage 1 on node2 (node rank 1)
    spread = Layout(tp=1, pp=2, nnodes=2)
    groups = layout_groups(spread, rank_slots(spread, _nodes(2, 4)))
    assert [(g.kind, g.ranks, g.nodes) for g in groups] == [("pp", (0, 1), ("node1", "node2"))]
    with pytest.raises(UsageError, match="nnodes"):
        Layout(tp=1, pp=2, nnodes=3)
