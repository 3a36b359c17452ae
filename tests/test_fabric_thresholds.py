"""The fabric thresholds table (cluster/data/fabric.yaml): every row judged on both sides."""

import pytest

from cluster.planning import fabric_thresholds as ft
from cluster.base.errors import UsageError
from cluster.nodes.inventory import default_expectations

TABLE = ft.load_table()


def _group_for(row):
    """A group that this row (and no earlier one) should match: (kwargs, port rates)."""
    crosses = row.scope == "inter_node"
    count = row.ranks[0]
    kwargs = dict(backend=row.backend, crosses=crosses, transport=row.transport,
                  gpu_model=row.gpus[-1] if row.gpus else None,
                  ranks=count if crosses else count, ranks_per_node=1 if crosses else count)
    return kwargs, [400.0]


@pytest.mark.parametrize("row", TABLE.rows, ids=lambda r: r.id)
def test_every_row_judged_on_both_sides(row):
    kwargs, ports = _group_for(row)
    matched = ft.find_row(TABLE, **kwargs)
    th = ft.threshold_for(TABLE, port_rates_gbps=ports, **kwargs)
    assert matched is row, f"{row.id} is shadowed by {matched and matched.id}"
    assert th.row == row.id and th.source == row.source
    if row.reference_gbps is not None:
        assert th.gbps == pytest.approx(TABLE.pass_fraction * row.reference_gbps)
    else:
        assert th.gbps == pytest.approx(TABLE.pass_fraction * row.line_rate_efficiency * 50.0)
    assert ft.meets(th.gbps * 1.001, th) is True
    assert ft.meets(th.gbps * 0.999, th) is False


def test_every_row_reachable_by_some_group():
    reached = set()
    for row in TABLE.rows:
        crosses = row.scope == "inter_node"
        for count in range(row.ranks[0], min(row.ranks[1], 8) + 1):
            for gpu in row.gpus or [None]:
                found = ft.find_row(TABLE, backend=row.backend, crosses=crosses,
                                    transport=row.transport, gpu_model=gpu, ranks=count,
                                    ranks_per_node=1 if crosses else count)
                if found:
                    reached.add(found.id)
    assert reached == {r.id for r in TABLE.rows}


def test_h100_8_gpu_nvls_and_h200():
    h100 = ft.threshold_for(TABLE, backend="nccl", crosses=False, transport="NVLINK",
                            gpu_model="NVIDIA H100 80GB HBM3", ranks=8, ranks_per_node=8)
    assert h100.gbps == pytest.approx(0.8 * 480)
    h200 = ft.threshold_for(TABLE, backend="nccl", crosses=False, transport="NVLINK",
                            gpu_model="H200", ranks=8, ranks_per_node=8)
    assert h200.gbps == pytest.approx(0.8 * 475)
    ring = ft.threshold_for(TABLE, backend="nccl", crosses=False, transport="NVLINK_RING",
                            gpu_model="NVIDIA H100 80GB HBM3", ranks=8, ranks_per_node=8)
    assert ring.gbps == pytest.approx(0.8 * 370)


def test_ib_400g_one_port_for_a_pp_pair_all_ports_for_a_full_node_group():
    one = ft.threshold_for(TABLE, backend="nccl", crosses=True, transport="IB_GDR",
                           gpu_model=None, ranks=2, ranks_per_node=1,
                           port_rates_gbps=[400.0] * 8)
    assert one.gbps == pytest.approx(0.8 * 0.95 * 50)          # 380 Gb/s per port, x 0.8
    eight = ft.threshold_for(TABLE, backend="nccl", crosses=True, transport="IB_GDR",
                             gpu_model=None, ranks=16, ranks_per_node=8,
                             port_rates_gbps=[400.0] * 8)
    assert eight.gbps == pytest.approx(8 * one.gbps)
    none = ft.threshold_for(TABLE, backend="nccl", crosses=True, transport="IB_GDR",
                            gpu_model=None, ranks=2, ranks_per_node=1, port_rates_gbps=[])
    assert none.gbps is None and "preflight" in none.basis


def test_overrides_win():
    over = dict(default_expectations()["fabric"], gloo_min_busbw_gbps=2.5,
                network_min_busbw_gbps=10)
    g = ft.threshold_for(TABLE, backend="gloo", crosses=True, transport="TCP", gpu_model=None,
                         ranks=2, ranks_per_node=1, overrides=over)
    assert g.gbps == 2.5 and g.basis == "expectations.fabric.gloo_min_busbw_gbps"
    n = ft.threshold_for(TABLE, backend="nccl", crosses=True, transport="IB_GDR",
                         gpu_model=None, ranks=2, ranks_per_node=1, overrides=over)
    assert n.gbps == 10.0


def test_no_row_means_not_judged():
    th = ft.threshold_for(TABLE, backend="nccl", crosses=False, transport="PCIE",
                          gpu_model="Tesla T4", ranks=2, ranks_per_node=2)
    assert th.gbps is None and ft.meets(1.0, th) is None


def test_transport_key():
    assert ft.transport_key("gloo", True, None, None) == "TCP"
    assert ft.transport_key("nccl", False, None, None) == "NVLINK"
    assert ft.transport_key("nccl", True, "IB", True) == "IB_GDR"
    assert ft.transport_key("nccl", True, "IB", False) == "IB"
    assert ft.transport_key("nccl", True, "ROCE", True) == "ROCE_GDR"
    assert ft.transport_key("nccl", True, "SOCKET", False) == "SOCKET"
    assert ft.transport_key("nccl", True, "UNKNOWN", None) is None


def test_expected_network():
    exp = default_expectations()
    assert ft.expected_network(exp, any_node_lists_hcas=False) is None
    assert ft.expected_network(exp, any_node_lists_hcas=True) == "IB"
    roce = dict(exp, infiniband=dict(exp["infiniband"], link_layer="Ethernet"))
    assert ft.expected_network(roce, any_node_lists_hcas=True) == "ROCE"
    forced = dict(exp, fabric=dict(exp["fabric"], interconnect="infiniband"))
    assert ft.expected_network(forced, any_node_lists_hcas=False) == "IB"
    anything = dict(exp, fabric=dict(exp["fabric"], interconnect="any"))
    assert ft.expected_network(anything, any_node_lists_hcas=True) is None


@pytest.mark.parametrize("text, match", [
    ("rows: []", "pass_fraction"),
    ("pass_fraction: 0.8\nrows: [{id: x, backend: nccl, scope: intra_node, transport: NVLINK, "
     "ranks: [2, 8], reference_gbps: 1}]", "source"),
    ("pass_fraction: 0.8\nrows: [{id: x, backend: nccl, scope: intra_node, transport: NVLINK, "
     "ranks: [2, 8], reference_gbps: .nan, source: 'https://a.b/c'}]", "reference_gbps"),
    ("pass_fraction: 0.8\nrows: [{id: x, backend: nccl, scope: intra_node, transport: NVLINK, "
     "ranks: [2, 8], source: 'https://a.b/c'}]", "reference_gbps or"),
    ("pass_fraction: 2\nrows: []", "pass_fraction"),
])
def test_bad_tables_refused(text, match):
    with pytest.raises(UsageError, match=match):
        ft.parse_table(text)
