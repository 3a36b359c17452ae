"""Node-health verdicts (cluster/inspection/checks/health.py) on parsed real fixtures and the default thresholds.

Each verdict function is fed what the parsers make of the fixtures under tests/fixtures/
(real public outputs, labelled in tests/fixtures/labels/) and the `health` section of
cluster/data/expectations.yaml; a few cases edit the parsed data to reach a state no fixture
shows (said so where done).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cluster.inspection.checks import health
from cluster.base.errors import InventoryError
from cluster.nodes.inventory import default_expectations
from cluster.inspection.parsers import parse
from cluster.inspection.parsers.ip_addr import Interface, IpAddr
from cluster.base.results import Status

FIXTURES = Path(__file__).parent / "fixtures"
TH = default_expectations()["health"]


def _data(kind: str, name: str):
    """The parser's frozen reading of a fixture (what the checks get)."""
    return parse(kind, (FIXTURES / kind / name).read_text())


def _edited(q, **changes):
    """nvidia-smi -q's reading with its first GPU's fields changed (a state no fixture shows)."""
    return replace(q, gpus=(replace(q.gpus[0], **changes),) + tuple(q.gpus[1:]))


# ---------------------------------------------------------------- acs

def test_acs_enabled_on_a_multi_gpu_node_fails_with_the_bridge_and_the_fix():
    lspci = _data("lspci", "h2-001-rccl547-amd-starship-gpp-bridge-acs-enabled.txt")
    verdict = health.acs(lspci, gpu_count=4, rdma_nics=0, th=TH)
    assert verdict.status is Status.FAIL and "40:01.1" in verdict.summary
    assert "setpci" in verdict.fix and "BIOS" in verdict.fix and "boot" in verdict.fix


def test_acs_grep_excerpt_fails_with_rdma_nics_even_on_one_gpu():
    lspci = _data("lspci", "h2-002-nccl606-grep-acsctl-srcvalid-only.txt")
    assert health.acs(lspci, gpu_count=1, rdma_nics=2, th=TH).status is Status.FAIL
    assert health.acs(lspci, gpu_count=1, rdma_nics=0, th=TH).status is Status.OK


def test_acs_disabled_is_ok_and_unknown_is_skip():
    disabled = _data("lspci", "h2-004-nccl1405-grep-acsctl-all-disabled.txt")
    assert health.acs(disabled, gpu_count=8, rdma_nics=8, th=TH).status is Status.OK
    plain = _data("lspci", "x02-nccl19-grep-plx-pex8747-device-list.txt")
    assert health.acs(plain, gpu_count=8, rdma_nics=8, th=TH).status is Status.SKIP


# ---------------------------------------------------------------- fabric manager

def test_fabricmanager_stopped_on_nvswitch_fails_with_its_reason():
    fm = _data("fabricmanager", "102-cubestudio29-2x4090-pre-nvl5-nothing-to-do.txt")
    verdict = health.fabricmanager(fm, None, TH, nvswitch=True)
    assert verdict.status is Status.FAIL and "NV_WARN_NOTHING_TO_DO" in verdict.summary
    assert "systemctl enable --now nvidia-fabricmanager" in verdict.fix


def test_fabricmanager_skips_without_nvswitch():
    fm = _data("fabricmanager", "102-cubestudio29-2x4090-pre-nvl5-nothing-to-do.txt")
    q = _data("nvidia-smi-q", "x06-xml-tesla-t4-515-link-x8-telegraf.txt")   # fabric N/A
    assert health.fabricmanager(fm, q, TH).status is Status.SKIP


@pytest.mark.parametrize("name,state", [
    ("h2-007-gpuoperator2511-fabric-in-progress.txt", "In Progress"),
    ("104-fabric-completed-insufficient-resources-clique0-zero-uuid.txt", "Completed"),
])
def test_fabric_not_completed_success_fails(name: str, state: str):
    q = _data("nvidia-smi-q", name)
    running = _data("fabricmanager", "h2-001-bottlerocket142-systemctl-status-active-running.txt")
    verdict = health.fabricmanager(running, q, TH)
    assert verdict.status is Status.FAIL and state in verdict.summary


def test_fabric_registered_but_unhealthy_fails_and_healthy_is_ok():
    """The labelled fact: Completed/Success with Health Summary Unhealthy is not a working
    fabric; the healthy and limited cases edit that summary."""
    q = _data("nvidia-smi-q", "h2-005-dra626-nvsmi-q-fabric-completed-health-unhealthy.txt")
    running = _data("fabricmanager", "h2-001-bottlerocket142-systemctl-status-active-running.txt")
    verdict = health.fabricmanager(running, q, TH)
    assert verdict.status is Status.FAIL and "Unhealthy" in verdict.summary
    q = _edited(q, fabric_health_summary="Limited Capacity")
    assert health.fabricmanager(running, q, TH).status is Status.WARN
    q = _edited(q, fabric_health_summary="Healthy")
    verdict = health.fabricmanager(running, q, TH)
    assert verdict.status is Status.OK and "fabric manager running" in verdict.summary


# ---------------------------------------------------------------- gpu health

def test_xid79_and_fallen_off_bus_fail_by_name():
    log = _data("dmesg", "101-nvsentinel-fallen-off-bus-no-xid-probe-failed-570.txt")
    verdict = health.gpu_health(None, log, TH)
    assert verdict.status is Status.FAIL and "0000:b3:00.0 fell off the bus" in verdict.summary
    assert "RMA" in verdict.fix


def test_hardware_xid_fails_application_xid_warns():
    gsp = _data("dmesg", "105-vllm40652-dmesg-T-xid119-gsp-timeout-domain-0001.txt")
    verdict = health.gpu_health(None, gsp, TH)
    assert verdict.status is Status.FAIL and "Xid 119 (GSP RPC timeout) on 0001:6c:00" in verdict.summary
    app = _data("dmesg", "h2-005-sglang29160-single-xid31-unrecognized-client.txt")
    verdict = health.gpu_health(None, app, TH)
    assert verdict.status is Status.WARN and "Xid 31 (GPU memory page fault)" in verdict.summary


def test_pending_row_remap_fails():
    q = _data("nvidia-smi-q", "h2-005-gpud80-remapped-rows-pending-yes.txt")
    verdict = health.gpu_health(q, None, TH)
    assert verdict.status is Status.FAIL and "row remapping pending" in verdict.summary


def test_hw_power_brake_warns_and_idle_is_ok():
    brake = _data("nvidia-smi-q", "h2-001-l4rz-v100-sxm2-32gb-hw-power-brake-active.txt")
    verdict = health.gpu_health(brake, None, TH)
    assert verdict.status is Status.WARN and "HW Power Brake Slowdown" in verdict.summary
    idle = _data("nvidia-smi-q", "h2-003-kubeflow68-grep-clocks-throttle-old-format.txt")
    healthy_log = _data("dmesg", "h2-007-ollama1769-multi-gpu-driver-load-no-xid.txt")
    assert health.gpu_health(idle, healthy_log, TH).status is Status.OK


def test_uncorrectable_ecc_thresholds():
    """Counts edited into a real report: no fixture shows a volatile uncorrectable error."""
    q = _data("nvidia-smi-q", "x05-xml-a100-sxm4-535-mig-telegraf.txt")
    assert health.gpu_health(q, None, TH).status is Status.OK
    broken = _edited(q, ecc_uncorrectable_volatile=2)
    verdict = health.gpu_health(broken, None, TH)
    assert verdict.status is Status.FAIL and "2 uncorrectable ECC" in verdict.summary
    old = _edited(q, ecc_uncorrectable_aggregate=1)
    assert health.gpu_health(old, None, TH).status is Status.WARN
    assert health.gpu_health(broken, None, dict(TH, ecc_uncorrectable_volatile_max=5)
                             ).status is Status.OK


# ---------------------------------------------------------------- pcie link / persistence

def test_pcie_link_x8_of_x16_warns_full_link_is_ok():
    t4 = _data("nvidia-smi-q", "x06-xml-tesla-t4-515-link-x8-telegraf.txt")
    verdict = health.pcie_link(t4, TH)
    assert verdict.status is Status.WARN and "x8 of x16" in verdict.summary
    a100 = _data("nvidia-smi-q", "x05-xml-a100-sxm4-535-mig-telegraf.txt")
    assert health.pcie_link(a100, TH).status is Status.OK
    assert health.pcie_link(_data("nvidia-smi-q", "003-uuid-list-8gpu.txt"), TH).status \
        is Status.SKIP


def test_pcie_generation_counts_only_under_load():
    """Generation edited down in a real report (P0) and the state set to P8."""
    q = _data("nvidia-smi-q", "x05-xml-a100-sxm4-535-mig-telegraf.txt")
    q = _edited(q, pcie_gen_current=1)
    assert health.pcie_link(q, TH).status is Status.WARN
    q = _edited(q, performance_state="P8")
    verdict = health.pcie_link(q, TH)
    assert verdict.status is Status.OK and "while idle" in verdict.summary


def test_persistence_off_warns_with_the_fix():
    off = _data("nvidia-smi", "001-a100-80gb-pcie-550-partial.txt").gpus
    verdict = health.persistence(off, TH)
    assert verdict.status is Status.WARN and "nvidia-smi -pm 1" in verdict.fix
    on = _data("nvidia-smi-q", "h2-011-persistence-nvidiadocker914-v100-sxm2-enabled.txt")
    assert health.persistence(on.gpus, TH).status is Status.OK
    uuids = _data("nvidia-smi-q", "003-uuid-list-8gpu.txt")
    assert health.persistence(uuids.gpus, TH).status is Status.SKIP


# ---------------------------------------------------------------- nic locality

def test_nics_only_across_the_socket_warn():
    topo = _data("nvidia-smi-topo", "101-8x4090-all-sys-2nic-phb-tabs-nic-rows.txt")
    verdict = health.nic_locality(topo, TH)
    assert verdict.status is Status.WARN and "GPU0 (SYS)" in verdict.summary
    assert verdict.facts.to_dict()["nearest_nic_relation"]["GPU6"] == "PHB"


def test_pix_nics_are_ok_and_give_an_hca_order():
    topo = _data("nvidia-smi-topo", "h2-002-nccl707-a100-18-mlx5-columns.txt")
    verdict = health.nic_locality(topo, TH)
    assert verdict.status is Status.OK
    assert verdict.facts.to_dict()["nccl_ib_hca_order"]["GPU0"][:4] == ["mlx5_4", "mlx5_5", "mlx5_6",
                                                             "mlx5_7"]
    only = health.nic_locality(topo, TH, rdma_nics=["mlx5_16", "mlx5_17"])
    assert only.facts.to_dict()["nccl_ib_hca_order"]["GPU0"] == ["mlx5_16", "mlx5_17"]


def test_no_nic_columns_skip():
    topo = _data("nvidia-smi-topo", "007-h100-8gpu-nv18-no-nic-columns.txt")
    assert health.nic_locality(topo, TH).status is Status.SKIP


# ---------------------------------------------------------------- thresholds

@pytest.mark.parametrize("key,value", [("acs_fail_min_gpus", True), ("acs_fail_min_gpus", -1),
                                       ("acs_fail_min_gpus", 2.5), ("xid_fail", [79, True]),
                                       ("fabric_state_ok", "")])
def test_bad_thresholds_are_named(key: str, value):
    lspci = _data("lspci", "h2-001-rccl547-amd-starship-gpp-bridge-acs-enabled.txt")
    log = _data("dmesg", "h2-005-sglang29160-single-xid31-unrecognized-client.txt")
    q = _data("nvidia-smi-q", "h2-007-gpuoperator2511-fabric-in-progress.txt")
    th = dict(TH, **{key: value})
    with pytest.raises(InventoryError, match=f"health.{key}"):
        health.acs(lspci, 4, 0, th)
        health.gpu_health(None, log, th)
        health.fabricmanager(None, q, th)


# ---------------------------------------------------------------- interface / MTU

def test_iface_up_with_node_ip_is_ok_and_gives_the_mtu():
    data = _data("ip-addr", "103-docker-host-eth0-altname-docker0-bridge-no-carrier.txt")
    verdict = health.iface(data, "eth0", "172.22.42.25")
    assert verdict.status is Status.OK and verdict.facts.to_dict() == {"mtu": 1500}


def test_iface_missing_down_or_without_node_ip_fails():
    data = _data("ip-addr", "h2-001-vllm7429-ip-addr-bond-ib-host.txt")
    missing = health.iface(data, "ib0", None)
    assert missing.status is Status.FAIL and "bond0" in missing.summary
    down = health.iface(data, "enx964498447070", None)
    assert down.status is Status.FAIL and "DOWN" in down.summary
    no_ip = health.iface(data, "bond0", "10.0.0.5")
    assert no_ip.status is Status.FAIL and "no IPv4 address" in no_ip.summary


def test_iface_public_node_ip_warns():
    data = _data("ip-addr", "x01-iproute2cheatsheet28-brief-addr-show.txt")   # 192.0.2.1
    assert health.iface(data, "eth0", "192.0.2.1").status is Status.OK   # TEST-NET-1: reserved
    assert health.iface(data, "eth0", "8.8.8.8").status is Status.FAIL   # not on eth0
    public = IpAddr((Interface("eth0", "UP", 1500, ("8.8.8.8/24",)),))
    assert health.iface(public, "eth0", "8.8.8.8").status is Status.WARN


# ---------------------------------------------------------------- every failing class: summary and fix

RUNNING_FM = ("fabricmanager", "h2-001-bottlerocket142-systemctl-status-active-running.txt")
STOPPED_FM = ("fabricmanager", "102-cubestudio29-2x4090-pre-nvl5-nothing-to-do.txt")
FM_FIX = ("install nvidia-fabricmanager of exactly the driver's version and "
          "`systemctl enable --now nvidia-fabricmanager`")
GPU_FIX = "drain the node; reset the GPU (`nvidia-smi -r -i <n>`, no process on it)"
CLOCK_FIX = "HW slowdown / power brake: check cooling, PSUs and the BMC's power capping"


@pytest.mark.parametrize("verdict, status, summary, fix", [
    pytest.param(lambda: health.fabricmanager(_data(*STOPPED_FM), None, TH, nvswitch=True),
                 Status.FAIL, "nvidia-fabricmanager is not running: ", FM_FIX, id="fm-stopped"),
    pytest.param(lambda: health.fabricmanager(_data(*RUNNING_FM), _data(
        "nvidia-smi-q", "h2-007-gpuoperator2511-fabric-in-progress.txt"), TH),
                 Status.FAIL, "1 GPU(s) not registered with the NVLink fabric (state/status ",
                 FM_FIX, id="fm-in-progress"),
    pytest.param(lambda: health.fabricmanager(_data(*RUNNING_FM), _data(
        "nvidia-smi-q", "h2-005-dra626-nvsmi-q-fabric-completed-health-unhealthy.txt"), TH),
                 Status.FAIL, "registered (Completed/Success) but the fabric health summary says",
                 "`journalctl -u nvidia-fabricmanager` for link errors", id="fm-unhealthy"),
    pytest.param(lambda: health.gpu_health(_data(
        "nvidia-smi-q", "001-a100-sxm4-ecc-remapped-rows-pending.txt"), None, TH),
                 Status.FAIL, "00000000:10:1C.0: row remapping pending (needs a GPU reset)",
                 GPU_FIX, id="gpu-remap-pending"),
    pytest.param(lambda: health.gpu_health(None, _data(
        "dmesg", "h2-003-chia-gigahorse301-xid31-62-45-cascade.txt"), TH),
                 Status.FAIL, "Xid 62 (internal micro-controller halt)", GPU_FIX, id="gpu-xid62"),
    pytest.param(lambda: health.gpu_health(_data(
        "nvidia-smi-q", "h2-001-l4rz-v100-sxm2-32gb-hw-power-brake-active.txt"), None, TH),
                 Status.WARN, "clocks held down (HW Slowdown, HW Power Brake Slowdown)", CLOCK_FIX,
                 id="gpu-power-brake"),
    pytest.param(lambda: health.pcie_link(_data(
        "nvidia-smi-q", "x06-xml-tesla-t4-515-link-x8-telegraf.txt"), TH),
                 Status.WARN, "PCIe link below its maximum: 00000000:00:1E.0 x8 of x16",
                 "`lspci -vv` LnkSta against LnkCap", id="pcie-x8"),
    pytest.param(lambda: health.persistence(_data(
        "nvidia-smi-q", "h2-013-persistence-k8sdp307-gtx1080ti-disabled.txt").gpus, TH),
                 Status.WARN, "persistence mode off on 1 of 1 GPU(s) (00000000:65:00.0)",
                 "`sudo systemctl enable --now nvidia-persistenced`", id="persistence-off"),
    pytest.param(lambda: health.nic_locality(_data(
        "nvidia-smi-topo", "101-8x4090-all-sys-2nic-phb-tabs-nic-rows.txt"), TH),
                 Status.WARN, "7 GPU(s) reach their nearest RDMA NIC only across the CPU socket: "
                              "GPU0 (SYS), GPU1 (SYS), GPU2 (SYS), GPU3 (SYS) and 3 more",
                 "set NCCL_IB_HCA per GPU from the facts' nccl_ib_hca_order", id="nic-sys"),
    pytest.param(lambda: health.iface(_data(
        "ip-addr", "103-docker-host-eth0-altname-docker0-bridge-no-carrier.txt"), "ib0", None),
                 Status.FAIL, "interface ib0 does not exist (have: lo, eth0, docker0",
                 "set nccl_socket_ifname / gloo_socket_ifname", id="iface-missing"),
])
def test_each_failing_class_says_what_and_how_to_fix(verdict, status, summary, fix):
    v = verdict()
    assert v.status is status, v
    assert summary in v.summary, v.summary
    assert v.fix and fix in v.fix, v.fix


def test_fabricmanager_on_nvswitch_with_no_gpu_listed_skips():
    verdict = health.fabricmanager(_data(*RUNNING_FM), None, TH, nvswitch=True)
    assert verdict.status is Status.SKIP and verdict.summary == "no per-GPU fabric state to judge"


def test_fabricmanager_ok_without_a_systemctl_reading_does_not_claim_it_runs():
    q = _data("nvidia-smi-q", "h2-005-dra626-nvsmi-q-fabric-completed-health-unhealthy.txt")
    q = _edited(q, fabric_health_summary="Healthy")     # edited, as above
    verdict = health.fabricmanager(None, q, TH)
    assert verdict.status is Status.OK and verdict.summary == "1 GPU(s) fabric Completed/Success"


def test_remap_failure_and_pending_retirement_fail():
    """States no fixture shows (edited into the parsed pending-remap report, said so here)."""
    q = _data("nvidia-smi-q", "h2-005-gpud80-remapped-rows-pending-yes.txt")
    q = _edited(q, remapped_rows_pending=False)
    q = _edited(q, remapped_rows_failure=True)
    failed = health.gpu_health(q, None, TH)
    assert failed.status is Status.FAIL and "row remapping failed" in failed.summary
    assert "a remap failure, repeated uncorrectable ECC or Xid 79 after a reboot means RMA" \
        in failed.fix
    q = _edited(q, remapped_rows_failure=False)
    q = _edited(q, retired_pages_pending=True)
    retired = health.gpu_health(q, None, TH)
    assert retired.status is Status.FAIL
    assert "page retirement pending (needs a GPU reset)" in retired.summary


def test_gpu_health_with_nothing_read_skips_and_a_failure_keeps_the_warnings_as_data():
    nothing = health.gpu_health(None, None, TH)
    assert nothing.status is Status.SKIP
    assert nothing.summary == "neither nvidia-smi -q nor the kernel log was read"
    log = _data("dmesg", "h2-003-chia-gigahorse301-xid31-62-45-cascade.txt")
    verdict = health.gpu_health(None, log, TH)
    assert verdict.summary == "Xid 62 (internal micro-controller halt) on 0000:0a:00"
    assert verdict.data == {"fail": ["Xid 62 (internal micro-controller halt) on 0000:0a:00"],
                            "warn": ["Xid 31 (GPU memory page fault) on 0000:0a:00",
                                     "Xid 45 (preemptive cleanup) on 0000:0a:00"],
                            "xids": [{"xid": 62, "text": "Xid 62 (internal micro-controller "
                                                         "halt) on 0000:0a:00"}],
                            "gpu_fail": []}


def test_nic_locality_ok_names_the_relations():
    verdict = health.nic_locality(_data(
        "nvidia-smi-topo", "003-dgx2-16gpu-nv6-mlx5-columns-old-format.txt"), TH)
    assert verdict.status is Status.OK
    assert verdict.summary == "every GPU has an RDMA NIC on its side of the socket (PIX)"
    assert verdict.fix is None


def test_pcie_aer_fatal_fails_corrected_warns():
    """Issue 26: AER errors without any Xid reach the GPU health verdict (real fixtures)."""
    fatal = _data("dmesg", "201-returnn1500-reltime-aer-fatal-nvidia-no-xid.txt")
    verdict = health.gpu_health(None, fatal, TH)
    assert verdict.status == "fail" and "PCIe AER Uncorrected (Fatal) on 0000:00:03.0" in verdict.summary
    corrected = _data("dmesg", "203-popos3363-journal-aer-correctable-no-xid.txt")
    verdict = health.gpu_health(None, corrected, TH)
    assert verdict.status == "warn" and "Correctable on 0000:00:03.1 (3x)" in verdict.summary
    quiet = _data("dmesg", "202-bugzilla208891-dmesg-H-header-reltime-wrapped-no-xid.txt")
    assert health.gpu_health(None, quiet, TH).status == "ok"
