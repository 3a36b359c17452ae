"""The health checks as preflight runs them: probe outputs (real captures) -> NodeContext -> verdict.

The verdict functions themselves are tested in test_checks_health.py; here the wiring: which
probe feeds which check, what a missing tool or an unreadable log does, how the NCCL/Gloo
interface is chosen, and the MTU comparison across nodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.inspection.node_summary import NodeFactsSummary
from cluster.inspection.checks import cross, node_health
from cluster.inspection.checks.node import NODE_CHECKS
from cluster.nodes.inventory import loads
from cluster.base.results import Status
import fakes
from fakes import MISSING, TIMED_OUT

FIXTURES = Path(__file__).parent / "fixtures"
INVENTORY = """
nodes:
  - {name: n1, address: 10.1.0.5, role: head}
  - {name: n2, address: gpu-b.example, nccl_socket_ifname: "=bond0"}
"""


def fixture(rel: str) -> str:
    return (FIXTURES / rel).read_text()


output = fakes.probe_output


def judge(check: str, node: str = "n1", inventory: str = INVENTORY, **outputs) -> object:
    """The check's verdict as preflight judges it (tests/fakes.py); absent probes: 127."""
    return fakes.judge(check, inventory, node, **outputs)


def test_every_health_check_is_in_preflight_with_its_probes():
    ids = [c.id for c in NODE_CHECKS]
    for check in ("acs", "fabricmanager", "gpu-health", "pcie-link", "persistence",
                  "nic-locality", "iface"):
        assert ids.count(check) == 1
    # One command per probe name across all checks (preflight keeps the first of a name).
    inv = loads(INVENTORY)
    seen: dict[str, str] = {}
    for c in NODE_CHECKS:
        for build in c.probes:
            p = build(inv.nodes[0], inv)
            if p is not None:
                assert seen.setdefault(p.name, p.command) == p.command, p.name


def test_every_health_check_skips_on_a_node_without_the_tools():
    for check in ("acs", "fabricmanager", "gpu-health", "pcie-link", "persistence",
                  "nic-locality"):
        verdict = judge(check)
        assert verdict.status is Status.SKIP, (check, verdict)


# ---------------------------------------------------------------- acs


EIGHT_GPUS = "nvidia-smi-query/001-h100-name-busid-vbios-elided.txt"


def test_acs_enabled_on_a_multi_gpu_node_fails_with_the_bridges():
    verdict = judge("acs", lspci=output("lspci", fixture(
        "lspci/h2-001-rccl547-amd-starship-gpp-bridge-acs-enabled.txt")),
        gpu_query=output("gpu-query", fixture(EIGHT_GPUS)))
    assert verdict.status is Status.FAIL
    assert "setpci" in verdict.fix


def test_acs_disabled_is_ok_and_missing_lspci_skips_naming_pciutils():
    verdict = judge("acs", lspci=output("lspci", fixture(
        "lspci/h2-004-nccl1405-grep-acsctl-all-disabled.txt")))
    assert verdict.status is Status.OK
    missing = judge("acs", lspci=output("lspci", **MISSING))
    assert missing.status is Status.SKIP and "pciutils" in missing.summary


# ---------------------------------------------------------------- fabric manager


IN_PROGRESS = "nvidia-smi-q/h2-007-gpuoperator2511-fabric-in-progress.txt"


def test_fabric_manager_failed_on_an_nvswitch_node_fails():
    verdict = judge("fabricmanager", nvidia_smi_q=output("nvidia-smi-q", fixture(IN_PROGRESS)),
                    fabricmanager=output("fabricmanager", fixture(
                        "fabricmanager/h2-002-gpuoperator610-journal-failed-nothing-to-do.txt"),
                        exit_code=3))
    assert verdict.status is Status.FAIL
    assert "not running" in verdict.summary


def test_without_systemd_the_fabric_state_still_decides():
    no_systemd = output("fabricmanager", "System has not been booted with systemd as init "
                                         "system (PID 1). Can't operate.\n", exit_code=1)
    verdict = judge("fabricmanager", nvidia_smi_q=output("nvidia-smi-q", fixture(IN_PROGRESS)),
                    fabricmanager=no_systemd)
    assert verdict.status is Status.FAIL and "In Progress" in verdict.summary


# ---------------------------------------------------------------- gpu health


HEALTHY_Q = "nvidia-smi-q/h2-005-dra626-nvsmi-q-fabric-completed-health-unhealthy.txt"


def test_an_xid_in_the_kernel_log_fails_gpu_health():
    verdict = judge("gpu-health", nvidia_smi_q=output("nvidia-smi-q", "", **MISSING),
                    kernel_log=output("kernel-log", fixture(
                        "dmesg/h2-003-chia-gigahorse301-xid31-62-45-cascade.txt")))
    # nvidia-smi missing: no GPU here to judge, whatever the log says.
    assert verdict.status is Status.SKIP
    verdict = judge("gpu-health", nvidia_smi_q=output("nvidia-smi-q", fixture(IN_PROGRESS)),
                    kernel_log=output("kernel-log", fixture(
                        "dmesg/h2-003-chia-gigahorse301-xid31-62-45-cascade.txt")))
    assert verdict.status is Status.FAIL and "Xid 62" in verdict.summary


def test_an_empty_grep_is_a_clean_log_and_an_unreadable_log_is_said():
    clean = judge("gpu-health", nvidia_smi_q=output("nvidia-smi-q", fixture(IN_PROGRESS)),
                  kernel_log=output("kernel-log", ""))
    assert clean.status is Status.OK and "not readable" not in clean.summary
    unreadable = judge("gpu-health", nvidia_smi_q=output("nvidia-smi-q", fixture(IN_PROGRESS)),
                       kernel_log=output("kernel-log", "", exit_code=3,
                                         stderr="dmesg: read kernel buffer failed: "
                                                "Operation not permitted\n"))
    assert unreadable.status is Status.OK and "not readable" in unreadable.summary


def test_a_fallen_off_gpu_in_the_log_fails():
    verdict = judge("gpu-health", nvidia_smi_q=output("nvidia-smi-q", fixture(IN_PROGRESS)),
                    kernel_log=output("kernel-log", fixture(
                        "dmesg/101-nvsentinel-fallen-off-bus-no-xid-probe-failed-570.txt")))
    assert verdict.status is Status.FAIL and "fell off the bus" in verdict.summary


# ---------------------------------------------------------------- persistence


def test_persistence_off_in_the_nvidia_smi_table_warns_and_is_a_fact():
    verdict = judge("persistence", nvidia_smi=output("nvidia-smi", fixture(
        "nvidia-smi/001-a100-80gb-pcie-550-partial.txt")))
    assert verdict.status is Status.WARN and "nvidia-smi -pm 1" in verdict.fix
    assert verdict.facts.to_dict() == {"persistence_off": True}


# ---------------------------------------------------------------- interface


DOCKER_HOST = "ip-addr/103-docker-host-eth0-altname-docker0-bridge-no-carrier.txt"
DOCKER_INV = """
nodes:
  - {name: n1, address: 172.22.42.25, role: head}
  - {name: n2, address: 172.22.42.25, port: 2202, nccl_socket_ifname: "^docker,lo,br-"}
  - {name: n3, address: 172.22.42.25, port: 2203, nccl_socket_ifname: br-}
  - {name: n4, address: 10.9.9.9}
  - {name: n5, address: gpu5.example}
"""


def test_the_interface_carrying_node_ip_is_found_without_a_setting():
    verdict = judge("iface", inventory=DOCKER_INV, ip_addr=output("ip-addr", fixture(DOCKER_HOST)))
    assert verdict.status is Status.OK and "eth0" in verdict.summary
    assert verdict.facts.to_dict() == {"mtu": 1500}


def test_an_exclusion_list_selects_the_remaining_interface():
    verdict = judge("iface", "n2", DOCKER_INV, ip_addr=output("ip-addr", fixture(DOCKER_HOST)))
    assert verdict.status is Status.OK and "eth0" in verdict.summary


def test_a_setting_that_selects_a_down_bridge_fails():
    verdict = judge("iface", "n3", DOCKER_INV, ip_addr=output("ip-addr", fixture(DOCKER_HOST)))
    assert verdict.status is Status.FAIL and "DOWN" in verdict.summary


def test_node_ip_on_no_interface_fails_and_a_host_name_skips():
    verdict = judge("iface", "n4", DOCKER_INV, ip_addr=output("ip-addr", fixture(DOCKER_HOST)))
    assert verdict.status is Status.FAIL and "10.9.9.9" in verdict.summary
    verdict = judge("iface", "n5", DOCKER_INV, ip_addr=output("ip-addr", fixture(DOCKER_HOST)))
    assert verdict.status is Status.SKIP


def test_an_exact_name_that_does_not_exist_fails():
    verdict = judge("iface", "n2", ip_addr=output("ip-addr", fixture(DOCKER_HOST)))
    assert verdict.status is Status.FAIL and "NCCL_SOCKET_IFNAME==bond0" in verdict.summary


@pytest.mark.parametrize("spec, want", [
    ("eth", ["eth0", "eth1"]), ("=eth0", ["eth0"]), ("^lo,docker", ["eth0", "eth1", "ib0"]),
    ("^=eth0", ["lo", "eth1", "docker0", "ib0"]), ("ib,eth1", ["eth1", "ib0"]), ("x", []),
])
def test_nccl_interface_selection_syntax(spec, want):
    names = ["lo", "eth0", "eth1", "docker0", "ib0"]
    assert node_health.matching_interfaces(spec, names) == want


# ---------------------------------------------------------------- MTU across nodes


def test_mtu_differences_name_the_odd_node():
    facts = {"a": {"mtu": 9000}, "b": {"mtu": 9000}, "c": {"mtu": 1500}, "d": {}}
    results = cross.mtu_consistency({n: NodeFactsSummary.from_dict(f) for n, f in facts.items()},
                                    "a")
    assert results[0].status is Status.FAIL and results[0].node is None
    assert [(r.node, r.status) for r in results[1:]] == [("c", Status.FAIL)]
    nine = NodeFactsSummary(mtu=9000)
    assert cross.mtu_consistency({"a": nine, "b": nine}, "a")[0].status is Status.OK
    assert cross.mtu_consistency({"a": nine}, "a")[0].status is Status.SKIP


# ---------------------------------------------------------------- the remaining wiring branches


CX6_TWO_IB = "ibstat/108-ucx9727-cx6-hdr200-two-active-ib-then-cx4lx-dollar-prompt.txt"
ONE_GPU = "nvidia-smi-query/005-noheader-nounits-rtx2080-command-and-raw-line.txt"
ACS_ON_GREP = "lspci/h2-002-nccl606-grep-acsctl-srcvalid-only.txt"


def test_acs_counts_the_rdma_devices_ibstat_shows():
    """One GPU: ACS on is harmless, unless ibstat shows RDMA devices (GPUDirect crosses it)."""
    alone = judge("acs", lspci=output("lspci", fixture(ACS_ON_GREP)),
                  gpu_query=output("gpu-query", fixture(ONE_GPU)))
    assert alone.status is Status.OK and "harmless with 1 GPU(s) and no RDMA NIC" in alone.summary
    with_nics = judge("acs", lspci=output("lspci", fixture(ACS_ON_GREP)),
                      gpu_query=output("gpu-query", fixture(ONE_GPU)),
                      ibstat=output("ibstat", fixture(CX6_TWO_IB)))
    assert with_nics.status is Status.FAIL and "GPUDirect RDMA" in with_nics.summary


def test_acs_hung_lspci_is_an_error_and_an_empty_listing_skips():
    hung = judge("acs", lspci=output("lspci", **TIMED_OUT))
    assert hung.status is Status.ERROR and hung.summary.startswith("lspci hung")
    empty = judge("acs", lspci=output("lspci", ""))
    assert empty.status is Status.SKIP
    assert empty.summary == "lspci showed no PCI device (a container without the host's PCI tree?)"


def test_pcie_link_reads_nvidia_smi_q():
    narrow = judge("pcie-link", nvidia_smi_q=output("nvidia-smi-q", fixture(
        "nvidia-smi-q/x06-xml-tesla-t4-515-link-x8-telegraf.txt")))
    assert narrow.status is Status.WARN
    assert narrow.summary == "PCIe link below its maximum: 00000000:00:1E.0 x8 of x16"
    assert "reseat the GPU or riser" in narrow.fix
    no_link = judge("pcie-link", nvidia_smi_q=output("nvidia-smi-q", fixture(
        "nvidia-smi-q/001-a100-sxm4-ecc-remapped-rows-pending.txt")))
    assert no_link.status is Status.SKIP and "no PCIe link information" in no_link.summary
    missing = judge("pcie-link")
    assert missing.status is Status.SKIP and missing.summary.startswith("nvidia-smi not found")


def test_nic_locality_reads_the_topology_and_only_counts_ibstat_devices():
    topo = output("gpu-topo", fixture("nvidia-smi-topo/101-8x4090-all-sys-2nic-phb-tabs-nic-rows.txt"))
    every_nic = judge("nic-locality", gpu_topo=topo)             # no ibstat: every NIC column
    assert every_nic.status is Status.WARN
    assert "reach their nearest RDMA NIC only across the CPU socket" in every_nic.summary
    assert "NCCL_IB_HCA" in every_nic.fix and every_nic.facts.to_dict()["nccl_ib_hca_order"]
    assert every_nic.facts.to_dict()["nccl_ib_hca_order"]["GPU0"] == ["NIC0", "NIC1"]
    # ibstat's devices are mlx5_0/1; this matrix names its NICs NIC0/1 with no legend: none counts
    unnamed = judge("nic-locality", gpu_topo=topo, ibstat=output("ibstat", fixture(CX6_TWO_IB)))
    assert unnamed.status is Status.SKIP and unnamed.summary == "no RDMA NIC in the topology matrix"
    # a matrix of 18 mlx5 columns: only the two RDMA devices ibstat shows are ordered
    named = judge("nic-locality", gpu_topo=output("gpu-topo", fixture(
        "nvidia-smi-topo/h2-002-nccl707-a100-18-mlx5-columns.txt")),
        ibstat=output("ibstat", fixture(CX6_TWO_IB)))
    assert named.status is Status.OK and named.summary.startswith("every GPU has an RDMA NIC")
    assert {tuple(v) for v in named.facts.to_dict()["nccl_ib_hca_order"].values()} <= {
        ("mlx5_0", "mlx5_1"), ("mlx5_1", "mlx5_0")}
    hung = judge("nic-locality", gpu_topo=output("gpu-topo", **TIMED_OUT))
    assert hung.status is Status.ERROR


def test_iface_without_ip_skips_and_a_hung_ip_is_an_error():
    missing = judge("iface")
    assert missing.status is Status.SKIP
    assert missing.summary == "ip not found: no network interfaces here (none expected)"
    assert judge("iface", ip_addr=output("ip-addr", **TIMED_OUT)).status is Status.ERROR


def test_persistence_skip_carries_no_fact():
    verdict = judge("persistence")
    assert verdict.status is Status.SKIP and verdict.facts.to_dict() == {}
