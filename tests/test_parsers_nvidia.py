"""NVIDIA parsers against every fixture of their kinds (labelled facts), bad input and variants.

Fixtures: tests/fixtures/<kind>/*.txt; expected facts: tests/fixtures/labels/<kind>.yaml, each
entry's `expect` block (paths into parse(text).to_dict(); see the header of those files).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.base.errors import ParseError
from fakes import assert_labels_cover_fixtures, check_label, fixture_cases, fixture_labels
from cluster.inspection.parsers import (nvcc, nvidia_smi, nvidia_smi_nvlink, nvidia_smi_q, nvidia_smi_query,
                             nvidia_smi_topo, proc_driver_nvidia_version)

FIXTURES = Path(__file__).parent / "fixtures"
MODULES = {
    "nvidia-smi": nvidia_smi,
    "nvidia-smi-q": nvidia_smi_q,
    "nvidia-smi-query": nvidia_smi_query,
    "nvidia-smi-topo": nvidia_smi_topo,
    "nvidia-smi-nvlink": nvidia_smi_nvlink,
    "nvcc": nvcc,
    "proc-driver-nvidia-version": proc_driver_nvidia_version,
}


CASES = fixture_cases(MODULES)
BY_KIND_CASES = [pytest.param(kind, path, id=f"{kind}/{path.name}") for kind, path in CASES]


def _check(data: dict, path: str, expected) -> None:
    """check_label, and `pix`: the NICs each GPU reaches over a single PCIe switch."""
    if path == "pix":
        for gpu, nic in expected.items():
            pix = [n for n, kind in data["gpu_nic_paths"][gpu].items() if kind == "PIX"]
            assert pix == ([nic] if nic else []), f"{gpu}: PIX NICs {pix}, expected {nic}"
        return
    check_label(data, path, expected)


def test_every_fixture_has_a_label_entry_and_every_entry_a_fixture():
    for kind in MODULES:
        assert_labels_cover_fixtures(kind)


def _parse_error_expected(kind: str, path: Path) -> str | None:
    """The message a fixture of a tool's failure output must raise (`parse_error` label)."""
    return fixture_labels(kind)[path.name]["expect"].get("parse_error")


@pytest.mark.parametrize("kind,path", BY_KIND_CASES)
def test_fixture_parses_to_labelled_facts(kind: str, path: Path):
    module = MODULES[kind]
    message = _parse_error_expected(kind, path)
    if message is not None:
        with pytest.raises(ParseError) as info:
            module.parse(path.read_text())
        assert str(info.value) == message
        return
    result = module.parse(path.read_text())
    data = result.to_dict()
    json.dumps(data)                       # the documented shape is plain JSON
    for key, expected in fixture_labels(kind)[path.name]["expect"].items():
        _check(data, key, expected)


@pytest.mark.parametrize("kind,path", BY_KIND_CASES)
def test_fixture_is_detected_as_its_own_kind_only(kind: str, path: Path):
    text = path.read_text()
    hits = [k for k, m in MODULES.items() if m.detect(text)]
    assert hits == ([] if _parse_error_expected(kind, path) else [kind])


@pytest.mark.parametrize("kind,path", BY_KIND_CASES)
def test_fixture_survives_crlf_and_trailing_junk(kind: str, path: Path):
    text = path.read_text()
    if _parse_error_expected(kind, path):
        for variant in (text.replace("\n", "\r\n"), "\n\n" + text + "\nuser@host:~$ \n"):
            with pytest.raises(ParseError):
                MODULES[kind].parse(variant)
        return
    plain = MODULES[kind].parse(text).to_dict()
    crlf = MODULES[kind].parse(text.replace("\n", "\r\n")).to_dict()
    assert crlf == plain
    junk = MODULES[kind].parse("\n\n" + text + "\nuser@host:~$ \n").to_dict()
    assert junk == plain


@pytest.mark.parametrize("kind,path", BY_KIND_CASES)
def test_other_kinds_refuse_this_fixture(kind: str, path: Path):
    """A parser handed another tool's output raises ParseError instead of guessing."""
    text = path.read_text()
    for other, module in MODULES.items():
        if other == kind:
            continue
        if other == "nvidia-smi-nvlink" and kind == "nvidia-smi" and "nvidia-smi -L" in text:
            continue   # nvidia-smi -L lines are GPU lines of nvlink output too (documented)
        with pytest.raises(ParseError):
            module.parse(text)


GARBAGE = [
    "",
    "   \n\t\n",
    "hello world\nthis is not a tool output\n",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.\n",
    "\x00\x01\x02 binary junk \xff\n",
    "bash: nvidia-smi: command not found\n",
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
    "the latest NVIDIA driver is installed and running.\n",
    "Failed to initialize NVML: Driver/library version mismatch\n",
    "cat: /proc/driver/nvidia/version: No such file or directory\n",
    "Reference ID    : A9FEA97B (169.254.169.123)\nStratum         : 4\n"
    "System time     : 0.000001 seconds fast of NTP time\nLeap status     : Normal\n",
    "CA 'mlx5_0'\n\tCA type: MT4129\n\tPort 1:\n\t\tState: Active\n\t\tRate: 400\n",
]


@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("text", GARBAGE, ids=[f"garbage{i}" for i in range(len(GARBAGE))])
def test_garbage_raises_parse_error(kind: str, text: str):
    with pytest.raises(ParseError) as info:
        MODULES[kind].parse(text)
    assert info.value.kind == kind
    assert not MODULES[kind].detect(text) or "NVIDIA-SMI has failed" in text


@pytest.mark.parametrize("kind", list(MODULES))
def test_non_text_raises_parse_error(kind: str):
    with pytest.raises(ParseError):
        MODULES[kind].parse(None)  # type: ignore[arg-type]


def test_results_are_frozen():
    result = nvcc.parse((FIXTURES / "nvcc" / "005-cuda-12.5.txt").read_text())
    with pytest.raises(Exception):
        result.cuda_version = "1.0"  # type: ignore[misc]


# ---------------------------------------------------------------- nvidia-smi (table) variants

WINDOWS_TABLE = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 546.12                 Driver Version: 546.12         CUDA Version: 12.3     |
|-----------------------------------------+----------------------+----------------------+
| GPU  Name                     TCC/WDDM  | Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |         Memory-Usage | GPU-Util  Compute M. |
|                                         |                      |               MIG M. |
|=========================================+======================+======================|
|   0  NVIDIA GeForce RTX 3080      WDDM  | 00000000:01:00.0  On |                  N/A |
|  0%   44C    P8              21W / 320W |   1143MiB / 10240MiB |      3%      Default |
|                                         |                      |                  N/A |
+-----------------------------------------+----------------------+----------------------+

+---------------------------------------------------------------------------------------+
| Processes:                                                                            |
|  GPU   GI   CI        PID   Type   Process name                            GPU Memory |
|        ID   ID                                                             Usage      |
|=======================================================================================|
|    0   N/A  N/A      1234    C+G   C:\\Windows\\explorer.exe                    N/A      |
+---------------------------------------------------------------------------------------+
"""

OLD_R3XX_TABLE = """\
+------------------------------------------------------+
| NVIDIA-SMI 340.29     Driver Version: 340.29         |
|-------------------------------+----------------------+----------------------+
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |
|===============================+======================+======================|
|   0  Tesla K20m          Off  | 0000:03:00.0     Off |                    0 |
| N/A   28C    P0    50W / 225W |     11MiB /  4799MiB |     98%      Default |
+-------------------------------+----------------------+----------------------+
|   1  Tesla K20m          Off  | 0000:83:00.0     Off |                    0 |
| N/A   27C    P0    49W / 225W |     11MiB /  4799MiB |      0%      Default |
+-------------------------------+----------------------+----------------------+

+-----------------------------------------------------------------------------+
| Compute processes:                                               GPU Memory |
|  GPU       PID  Process name                                     Usage      |
|=============================================================================|
|  No running compute processes found                                         |
+-----------------------------------------------------------------------------+
"""


def test_windows_wddm_table():
    """Shape written from the R5xx Windows layout (TCC/WDDM column); not a captured sample."""
    data = nvidia_smi.parse(WINDOWS_TABLE).to_dict()
    gpu = data["gpus"][0]
    assert gpu["driver_model"] == "WDDM" and gpu["persistence_mode"] is None
    assert gpu["name"] == "NVIDIA GeForce RTX 3080" and gpu["memory_total_mib"] == 10240
    assert data["gpu_count"] == 1
    assert data["processes"][0]["pid"] == 1234 and data["processes"][0]["memory_mib"] is None


def test_old_r3xx_table_without_cuda_version_or_mig_row():
    """Shape written from the R340 layout (no CUDA Version, no MIG row); not a captured sample."""
    data = nvidia_smi.parse(OLD_R3XX_TABLE).to_dict()
    assert data["driver_version"] == "340.29" and data["cuda_version"] is None
    assert [g["bus_id"] for g in data["gpus"]] == ["0000:03:00.0", "0000:83:00.0"]
    assert data["gpu_count"] == 2 and data["complete"] is True
    assert all(g["mig_mode"] is None and g["memory_total_mib"] == 4799 for g in data["gpus"])


def test_processes_and_mig_sections_are_not_gpus():
    text = (FIXTURES / "nvidia-smi" / "007-l4-570-single-gpu.txt").read_text()
    text = text.rstrip("\n").rsplit("\n", 1)[0] + "\n" + "\n".join([
        "+-----------------------------------------------------------------------------------------+",
        "| Processes:                                                                              |",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|=========================================================================================|",
        "|    0   N/A  N/A          412345      C   python3                                 20112MiB |",
        "+-----------------------------------------------------------------------------------------+",
    ]) + "\n"
    data = nvidia_smi.parse(text).to_dict()
    assert data["gpu_count"] == 1
    assert data["processes"] == [{"gpu": 0, "gi": None, "ci": None, "pid": 412345, "type": "C",
                                  "name": "python3", "memory_mib": 20112}]


def test_no_devices_found_is_zero_gpus_not_an_error():
    data = nvidia_smi.parse("$ nvidia-smi\nNo devices were found\n").to_dict()
    assert data["gpus"] == [] and data["gpu_count"] == 0


def test_pdsh_prefix_in_front_of_table_lines():
    text = (FIXTURES / "nvidia-smi" / "007-l4-570-single-gpu.txt").read_text()
    prefixed = "\n".join("gpu-node-1: " + line for line in text.splitlines())
    plain = nvidia_smi.parse(text).to_dict()
    data = nvidia_smi.parse(prefixed).to_dict()
    assert data["gpus"] == plain["gpus"] and data["driver_version"] == plain["driver_version"]


def test_driver_failure_message_is_a_parse_error_naming_it():
    with pytest.raises(ParseError, match="couldn't communicate"):
        nvidia_smi.parse(GARBAGE[6])


# ---------------------------------------------------------------- nvidia-smi -q variants

Q_REPORT = """\
==============NVSMI LOG==============

Timestamp                                 : Mon Mar  3 10:00:00 2025
Driver Version                            : 550.54.15
CUDA Version                              : 12.4

Attached GPUs                             : 2
GPU 00000000:18:00.0
    Product Name                          : NVIDIA H100 80GB HBM3
    Persistence Mode                      : Enabled
    MIG Mode
        Current                           : Disabled
        Pending                           : Disabled
    GPU UUID                              : GPU-11111111-2222-3333-4444-555555555555
    PCI
        Bus Id                            : 00000000:18:00.0
        GPU Link Info
            PCIe Generation
                Max                       : 5
                Current                   : 5
            Link Width
                Max                       : 16x
                Current                   : 16x
    FB Memory Usage
        Total                             : 81559 MiB
        Reserved                          : 328 MiB
        Used                              : 0 MiB
        Free                              : 81231 MiB
    BAR1 Memory Usage
        Total                             : 131072 MiB
        Used                              : 1 MiB
    ECC Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 2
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 5
            DRAM Uncorrectable            : 1
            SRAM Threshold Exceeded       : No
        Aggregate Uncorrectable SRAM Sources
            SRAM L2                       : 0
            SRAM SM                       : 0
    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 0
        Pending                           : No
        Remapping Failure Occurred        : No
    Temperature
        GPU Current Temp                  : 31 C
    GPU Power Readings
        Average Power Draw                : 71.25 W
        Instantaneous Power Draw          : 70.90 W
        Current Power Limit               : 700.00 W
    Processes                             : None

GPU 00000000:2A:00.0
    Product Name                          : NVIDIA H100 80GB HBM3
    FB Memory Usage
        Total                             : 81559 MiB
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 3
                Total                     : 3
            Double Bit
                Device Memory             : 0
                Total                     : 0
"""


def test_q_full_report_fields():
    """Layout written from R550 -q key names (and the old Single/Double Bit ECC block)."""
    data = nvidia_smi_q.parse(Q_REPORT).to_dict()
    assert data["gpu_count"] == 2 and len(data["gpus"]) == 2
    first, second = data["gpus"]
    assert first["memory_total_mib"] == 81559 and first["memory_reserved_mib"] == 328
    assert first["mig_mode"] == "Disabled" and first["ecc_mode"] == "Enabled"
    assert first["ecc_errors"]["volatile"] == {"correctable": 2, "uncorrectable": 0}
    assert first["ecc_errors"]["aggregate"] == {"correctable": 5, "uncorrectable": 1}
    assert first["pcie_gen_current"] == 5 and first["pcie_width_max"] == 16
    assert first["temperature_c"] == 31 and first["power_limit_w"] == 700.0
    assert first["power_draw_w"] == 70.9
    assert first["remapped_rows"]["pending"] is False
    assert second["index"] == 1 and second["bus_id"] == "00000000:2A:00.0"
    assert second["ecc_errors"]["volatile"] == {"correctable": 3, "uncorrectable": 0}


def test_q_r610_kmd_and_umd_keys():
    text = Q_REPORT.replace("Driver Version                            : 550.54.15",
                            "KMD Version                               : 610.43.02") \
                   .replace("CUDA Version                              : 12.4",
                            "CUDA UMD Version                          : 13.3")
    data = nvidia_smi_q.parse(text).to_dict()
    assert data["driver_version"] == "610.43.02" and data["cuda_version"] == "13.3"


def test_q_grep_of_two_keys_pairs_them_per_gpu():
    text = ("$ nvidia-smi -q | grep -E 'Product Name|GPU UUID'\n"
            "    Product Name                          : NVIDIA A100-SXM4-80GB\n"
            "    GPU UUID                              : GPU-aaaa\n"
            "    Product Name                          : NVIDIA A100-SXM4-80GB\n"
            "    GPU UUID                              : GPU-bbbb\n")
    data = nvidia_smi_q.parse(text).to_dict()
    assert [(g["name"], g["uuid"]) for g in data["gpus"]] == [
        ("NVIDIA A100-SXM4-80GB", "GPU-aaaa"), ("NVIDIA A100-SXM4-80GB", "GPU-bbbb")]


# ---------------------------------------------------------------- --query-gpu variants

def test_query_header_with_units_and_na_values():
    text = ("name, memory.total [MiB], memory.used [MiB], temperature.memory, power.draw [W], "
            "driver_version, compute_cap\n"
            "NVIDIA H100 80GB HBM3, 81559 MiB, 0 MiB, [N/A], 70.12 W, 535.104.05, 9.0\n"
            "NVIDIA H100 80GB HBM3, 81559 MiB, 3 MiB, 31, [Not Supported], 535.104.05, 9.0\n")
    data = nvidia_smi_query.parse(text).to_dict()
    assert data["units"] == {"memory.total": "MiB", "memory.used": "MiB", "power.draw": "W"}
    assert data["gpus"][0] == {"name": "NVIDIA H100 80GB HBM3", "memory.total": 81559,
                               "memory.used": 0, "temperature.memory": None, "power.draw": 70.12,
                               "driver_version": "535.104.05", "compute_cap": "9.0"}
    assert data["gpus"][1]["power.draw"] is None and data["gpus"][1]["temperature.memory"] == 31


def test_query_driver_version_stays_text():
    data = nvidia_smi_query.parse("driver_version, index\n535.100, 0\n").to_dict()
    assert data["gpus"] == [{"driver_version": "535.100", "index": 0}]


def test_query_noheader_with_echoed_command_and_aliases():
    text = ("[admin@gpu01 ~]$ nvidia-smi --query-gpu=index,gpu_name,gpu_bus_id,memory.total "
            "--format=csv,noheader,nounits\n"
            "0, NVIDIA A100-SXM4-80GB, 00000000:07:00.0, 81920\n"
            "1, NVIDIA A100-SXM4-80GB, 00000000:0F:00.0, 81920\n"
            "[admin@gpu01 ~]$ \n")
    data = nvidia_smi_query.parse(text).to_dict()
    assert data["column_source"] == "command"
    assert data["columns"] == ["index", "name", "pci.bus_id", "memory.total"]
    assert [g["pci.bus_id"] for g in data["gpus"]] == ["00000000:07:00.0", "00000000:0F:00.0"]
    assert not data["looping"]


def test_query_noheader_without_command_is_positional_or_named_by_caller():
    text = "NVIDIA L4, 23034 MiB\nNVIDIA L4, 23034 MiB\n"
    positional = nvidia_smi_query.parse(text).to_dict()
    assert positional["column_source"] == "positional"
    assert positional["gpus"][0] == {"col0": "NVIDIA L4", "col1": 23034}
    named = nvidia_smi_query.parse_query(text, fields=["gpu_name", "memory.total"]).to_dict()
    assert named["column_source"] == "fields"
    assert named["gpus"][1] == {"name": "NVIDIA L4", "memory.total": 23034}


def test_query_single_column_needs_a_name():
    with pytest.raises(ParseError):
        nvidia_smi_query.parse("NVIDIA L4\nNVIDIA L4\n")
    data = nvidia_smi_query.parse_query("NVIDIA L4\nNVIDIA L4\n", fields=["name"]).to_dict()
    assert [g["name"] for g in data["gpus"]] == ["NVIDIA L4", "NVIDIA L4"]


def test_query_ragged_rows_raise_with_line_number():
    with pytest.raises(ParseError) as info:
        nvidia_smi_query.parse("index, name\n0, NVIDIA L4\n1, NVIDIA, L4, extra\n")
    assert info.value.line == 3


def test_query_other_query_kind_is_refused():
    with pytest.raises(ParseError, match="compute-apps"):
        nvidia_smi_query.parse("$ nvidia-smi --query-compute-apps=pid,used_memory --format=csv\n"
                               "pid, used_gpu_memory [MiB]\n1234, 500 MiB\n")


def test_query_invalid_field_message_is_an_error():
    with pytest.raises(ParseError):
        nvidia_smi_query.parse('Field "memory.totl" is not a valid field to query.\n')


# ---------------------------------------------------------------- topo variants

TOPO_WITH_NIC_LEGEND = """\
\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tPXB\tSYS\t0-31\t0\t\tN/A
GPU1\tNV12\t X \tSYS\tPXB\t32-63\t1\t\tN/A
NIC0\tPXB\tSYS\t X \tSYS
NIC1\tSYS\tPXB\tSYS\t X

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""


def test_topo_nic_legend_names_the_nics():
    data = nvidia_smi_topo.parse(TOPO_WITH_NIC_LEGEND).to_dict()
    assert data["nics"] == ["mlx5_0", "mlx5_1"]
    assert data["nic_legend"] == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert data["gpu_nic_paths"]["GPU1"] == {"NIC0": "SYS", "NIC1": "PXB"}
    assert data["nvlink"] is True and data["links"] == {"GPU0-GPU1": "NV12"}


def test_topo_single_gpu_cannot_tell_nvlink():
    text = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\t0\t\tN/A\n"
    data = nvidia_smi_topo.parse(text).to_dict()
    assert data["gpus"] == 1 and data["nvlink"] is None and data["links"] == {}


def test_topo_old_soc_legend_value():
    text = ("        GPU0    GPU1    CPU Affinity\n"
            "GPU0     X      SOC     0-7\n"
            "GPU1    SOC      X      8-15\n")
    data = nvidia_smi_topo.parse(text).to_dict()
    assert data["links"] == {"GPU0-GPU1": "SOC"} and data["nvlink"] is False


def test_topo_collapsed_single_spaces_still_parse():
    text = ("GPU0 GPU1 NIC0 CPU Affinity NUMA Affinity\n"
            "GPU0 X NV4 PIX 0-7 0\n"
            "GPU1 NV4 X SYS 8-15 1\n")
    data = nvidia_smi_topo.parse(text).to_dict()
    assert data["nvlink"] is True and data["affinity"]["GPU1"]["numa_affinity"] == "1"


def test_topo_garbled_middle_row_raises():
    text = (FIXTURES / "nvidia-smi-topo" / "007-h100-8gpu-nv18-no-nic-columns.txt").read_text()
    garbled = text.replace("GPU3  NV18  NV18  NV18   X    NV18", "GPU3  NV18  NV18NV18   X    NV18")
    with pytest.raises(ParseError) as info:
        nvidia_smi_topo.parse(garbled)
    assert info.value.line == 6


# ---------------------------------------------------------------- nvlink / nvcc / proc variants

def test_nvlink_gpu_without_links_and_driver_note():
    text = ("GPU 0: NVIDIA L40S (UUID: GPU-12345678-1234-1234-1234-123456789abc)\n"
            "\t NVML: Unable to retrieve NVLink information as all links are inActive\n")
    data = nvidia_smi_nvlink.parse(text).to_dict()
    assert data["gpus"][0]["links"] == [] and data["nvlink"] is None
    assert data["gpus"][0]["messages"] == [
        "NVML: Unable to retrieve NVLink information as all links are inActive"]


def test_nvlink_all_inactive_is_false():
    text = ("GPU 0: Tesla V100-SXM2-16GB (UUID: GPU-x)\n"
            "\t Link 0: <inactive>\n\t Link 1: <inactive>\n")
    assert nvidia_smi_nvlink.parse(text).to_dict()["nvlink"] is False


def test_nvlink_throughput_counters_with_units():
    text = ("GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-y)\n"
            "\t Link 0: Data Tx: 1024 KiB\n\t Link 0: Data Rx: 2048 KiB\n"
            "\t Link 1: Rx0: 0 KBytes, Tx0: 5 KBytes\n")
    links = nvidia_smi_nvlink.parse(text).to_dict()["gpus"][0]["links"]
    assert links[0] == {"link": 0, "data_tx_kib": 1024, "data_rx_kib": 2048}
    assert links[1] == {"link": 1, "rx0_kbytes": 0, "tx0_kbytes": 5}


def test_nvcc_without_release_line_raises():
    with pytest.raises(ParseError):
        nvcc.parse("nvcc: NVIDIA (R) Cuda compiler driver\n"
                   "Copyright (c) 2005-2024 NVIDIA Corporation\n")


def test_proc_version_open_module_in_older_wording():
    """Wording quoted in nix-community/nixGL#220 ('Open Kernel x86_64 Kernel Module')."""
    text = ("NVRM version: NVIDIA UNIX Open Kernel x86_64 Kernel Module  590.48.01  "
            "Mon Dec  8 11:22:45 UTC 2025\n")
    data = proc_driver_nvidia_version.parse(text).to_dict()
    assert data["driver_version"] == "590.48.01" and data["kernel_module"] == "open"
    assert data["arch"] == "x86_64"


def test_proc_version_legacy_without_arch():
    text = "NVRM version: NVIDIA UNIX Kernel Module  304.137  Tue Aug 21 12:33:05 PDT 2018\n"
    data = proc_driver_nvidia_version.parse(text).to_dict()
    assert data["driver_version"] == "304.137" and data["kernel_module"] == "proprietary"
    assert data["arch"] is None and data["gcc"] is None


# ---------------------------------------------------------------- issue 16: new -q / table / topo keys

GREP_A4_UNCORR = """\
$ nvidia-smi -q | grep -A4 -i uncorr
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 2
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 3
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
--
        Uncorrectable Error               : 0
        Pending                           : Yes
        Remapping Failure Occurred        : No
        Bank Remap Availability Histogram
            Max                           : 639 bank(s)
--
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 0
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
--
        Uncorrectable Error               : 0
        Pending                           : No
        Remapping Failure Occurred        : No
        Bank Remap Availability Histogram
            Max                           : 640 bank(s)
"""


def test_q_grep_a4_uncorr_excerpt_without_headers():
    """Layout of `nvidia-smi -q | grep -A4 -i uncorr` on R470-R535 (key order and indentation as
    in the DCGM#50 -q paste); not a captured sample. The `Volatile` and `Remapped Rows` lines
    are cut by grep; the counters are read into their sections, one GPU per repeat."""
    data = nvidia_smi_q.parse(GREP_A4_UNCORR).to_dict()
    assert len(data["gpus"]) == 2
    first, second = data["gpus"]
    assert first["ecc_uncorrectable_volatile"] == 2 and first["ecc_uncorrectable_aggregate"] == 3
    assert first["remapped_rows_pending"] is True and first["remapped_rows_failure"] is False
    assert first["remapped_rows"]["histogram"] == {"max": 639}
    assert first["retired_pages_pending"] is None and first["bus_id"] is None
    assert second["ecc_uncorrectable_volatile"] == 0 and second["remapped_rows_pending"] is False
    assert nvidia_smi_q.detect(GREP_A4_UNCORR)


def test_q_counters_without_section_or_aggregate_stay_null():
    """SRAM/DRAM counters cut from their section with no `Aggregate` after them could be either
    side: left null, not guessed."""
    text = ("    Product Name                          : NVIDIA A100-SXM4-80GB\n"
            "            DRAM Uncorrectable            : 5\n")
    gpu = nvidia_smi_q.parse(text).to_dict()["gpus"][0]
    assert gpu["ecc_uncorrectable_volatile"] is None and gpu["ecc_uncorrectable_aggregate"] is None


def test_q_full_report_new_flat_keys():
    data = nvidia_smi_q.parse(Q_REPORT.replace(
        "    Processes                             : None\n",
        "    Fabric\n        State                             : Completed\n"
        "        Status                            : Success\n"
        "    Processes                             : None\n")).to_dict()
    first, second = data["gpus"]
    assert first["persistence_mode_enabled"] is True
    assert (first["ecc_uncorrectable_volatile"], first["ecc_uncorrectable_aggregate"]) == (0, 1)
    assert first["remapped_rows_pending"] is False and first["remapped_rows_failure"] is False
    assert (first["fabric_state"], first["fabric_status"]) == ("Completed", "Success")
    assert second["ecc_uncorrectable_volatile"] == 0 and second["ecc_uncorrectable_aggregate"] is None
    assert second["persistence_mode_enabled"] is None and second["fabric_state"] is None


def test_q_xml_refuses_entities_and_reads_a_cut_paste():
    xml = (FIXTURES / "nvidia-smi-q" / "x06-xml-tesla-t4-515-link-x8-telegraf.txt").read_text()
    bomb = xml.replace('<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v11.dtd">',
                       '<!DOCTYPE nvidia_smi_log [<!ENTITY a "aaaaaaaaaa">]>')
    assert bomb != xml
    with pytest.raises(ParseError, match="entity"):
        nvidia_smi_q.parse(bomb)
    cut = nvidia_smi_q.parse(xml[:xml.index("<ecc_errors>")]).to_dict()
    assert cut["gpus"][0]["name"] == "Tesla T4" and cut["gpus"][0]["pcie_width_current"] == 8
    assert cut["gpus"][0]["ecc_uncorrectable_volatile"] is None


def test_table_persistence_mode_enabled():
    data = nvidia_smi.parse(OLD_R3XX_TABLE).to_dict()
    assert [g["persistence_mode_enabled"] for g in data["gpus"]] == [False, False]
    windows = nvidia_smi.parse(WINDOWS_TABLE).to_dict()
    assert windows["gpus"][0]["persistence_mode_enabled"] is None


def test_topo_gpu_nic_closest_with_legend_names():
    data = nvidia_smi_topo.parse(TOPO_WITH_NIC_LEGEND).to_dict()
    assert data["gpu_nic"] == {
        "GPU0": {"nics": ["NIC0"], "names": ["mlx5_0"], "relation": "PXB"},
        "GPU1": {"nics": ["NIC1"], "names": ["mlx5_1"], "relation": "PXB"}}


def test_topo_gpu_nic_sys_only_and_no_nic_columns():
    text = ("        GPU0    GPU1    mlx5_0  CPU Affinity\n"
            "GPU0     X      SOC     SOC     0-7\n"
            "GPU1    SOC      X      SOC     8-15\n"
            "mlx5_0  SOC     SOC      X\n")
    data = nvidia_smi_topo.parse(text).to_dict()
    assert data["gpu_nic"]["GPU0"] == {"nics": ["mlx5_0"], "names": ["mlx5_0"], "relation": "SYS"}
    none = nvidia_smi_topo.parse((FIXTURES / "nvidia-smi-topo" /
                                  "007-h100-8gpu-nv18-no-nic-columns.txt").read_text()).to_dict()
    assert none["gpu_nic"] == {}


# ---------------------------------------------------------------- issue 17: linear time on hostile input

HOSTILE = {
    "x_spaces_line": "x" + " " * 1_000_000 + "x" + " " * 1_000_000 + "x",
    "key_colon_spaces": "x" + " " * 1_000_000 + ":" + " " * 1_000_000 + "y" + " " * 100_000,
    "banner_equals": "=" * 3_000_000,
    "blank_lines": "\n" * 1_000_000 + " " * 1_000_000,
    "unterminated_osc": "\x1b]" * 1_000_000,
    "deep_indent": "".join(" " * i + "Sec\n" for i in range(2_500)),
    "distinct_keys": "".join(f"    Key{i}   : v\n" for i in range(50_000)),
    "table_row_spaces": "| 0 " + " " * 1_000_000 + "x |00000000:01:00.0 Off|  0 |\n",
    "power_digits": "|  " + "1" * 1_000_000 + " / " + " " * 1_000_000 + "|  x   |  y  |\n",
    "memory_digits": "|" + "1" * 2_000_000 + "MiB |",
    "process_row": "| Processes: |\n| 0 " + " " * 1_000_000 + " 1 C x" + " " * 1_000_000 + " 5 MiB |\n",
    "topo_long_row": "GPU0 GPU1\nGPU0 X " + "NV1 " * 500_000 + "\n",
    "tabs_spaces": " \t" * 1_500_000,
    "xml_deep": "<nvidia_smi_log>" + "<a>" * 100_000,
}


@pytest.mark.parametrize("kind", ["nvidia-smi-q", "nvidia-smi", "nvidia-smi-topo"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_megabyte_inputs_end_in_a_result_or_parse_error(kind: str, name: str):
    """Issue 17: a 1 MB line of `x   ...   x` ran for minutes in the -q key-value pattern.
    Each of these inputs (1-6 MB) must end, in a result or ParseError (speed is measured by
    scripts/bench_parsers_nvidia.py, not here)."""
    module = MODULES[kind]
    text = HOSTILE[name]
    assert module.detect(text) in (True, False)
    try:
        data = module.parse(text).to_dict()
    except ParseError as exc:
        assert exc.kind == kind
    else:
        json.dumps(data)


OTHER_TOOL_FIXTURES = [pytest.param(path, id=f"{path.parent.name}/{path.name}")
                       for path in sorted(FIXTURES.glob("*/*"))
                       if path.parent.name not in MODULES and path.parent.name != "labels"]


@pytest.mark.parametrize("path", OTHER_TOOL_FIXTURES)
def test_q_table_topo_refuse_every_other_tools_fixture(path: Path):
    """The header-less -q excerpts widened detect(): no other tool's real output may pass."""
    text = path.read_text(errors="replace")
    for module in (nvidia_smi_q, nvidia_smi, nvidia_smi_topo):
        assert not module.detect(text), f"{module.KIND} detects {path.parent.name}/{path.name}"
        with pytest.raises(ParseError):
            module.parse(text)


# ---- issue 26: pieces of a report, read for what they show ------------------------------------


def _lines(kind: str, name: str) -> list[str]:
    return (FIXTURES / kind / name).read_text().splitlines()


def test_xml_gpu_element_without_its_root_is_read():
    """A contiguous piece of a real `nvidia-smi -q -x` (x06): the `<gpu>` element alone."""
    lines = _lines("nvidia-smi-q", "x06-xml-tesla-t4-515-link-x8-telegraf.txt")
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("<gpu id="))
    end = next(i for i, line in enumerate(lines) if line.strip() == "</gpu>")
    whole = nvidia_smi_q.parse("\n".join(lines)).to_dict()["gpus"][0]
    piece = nvidia_smi_q.parse("\n".join(lines[start:end + 1])).to_dict()
    assert piece["driver_version"] is None and piece["attached_gpus"] is None
    assert piece["gpus"][0] == whole


def test_xml_section_without_gpu_or_root_is_read_into_one_gpu():
    """Only the `<ecc_errors>` section of x06: its counters, the bus id not shown."""
    lines = _lines("nvidia-smi-q", "x06-xml-tesla-t4-515-link-x8-telegraf.txt")
    start = next(i for i, line in enumerate(lines) if line.strip() == "<ecc_errors>")
    end = next(i for i, line in enumerate(lines) if line.strip() == "</ecc_errors>")
    whole = nvidia_smi_q.parse("\n".join(lines)).to_dict()["gpus"][0]
    gpu = nvidia_smi_q.parse("\n".join(lines[start:end + 1])).to_dict()["gpus"][0]
    assert gpu["bus_id"] is None and gpu["ecc_errors"] == whole["ecc_errors"]
    assert gpu["ecc_unplaced"] is None


def test_grepped_ecc_counters_without_their_section_keep_the_scope_null():
    """`nvidia-smi -q | grep Uncorrectable` of a real report (001): the counters are read, which
    of Volatile / Aggregate they count is not shown, so those stay null with the reason."""
    lines = [line for line in _lines("nvidia-smi-q", "001-a100-sxm4-ecc-remapped-rows-pending.txt")
             if "Uncorrectable" in line and "Error" not in line][:2]
    assert lines and all(line.strip().startswith(("SRAM", "DRAM")) for line in lines)
    gpu = nvidia_smi_q.parse("\n".join(lines)).to_dict()["gpus"][0]
    assert gpu["ecc_uncorrectable_volatile"] is None and gpu["ecc_uncorrectable_aggregate"] is None
    assert gpu["ecc_unplaced"]["uncorrectable"] == 0 and "not shown" in gpu["ecc_unplaced"]["reason"]


def test_nvidia_smi_q_reads_plain_key_lines_in_one_pass(monkeypatch):
    """An indented `Key : value` line without a tab or noise (most of a 584-line report) is
    read by _node_of alone: prompt, echo, elision and section tests (_clean_line) only for the
    others. The result is the same as the full path's (every fixture's expected output)."""
    text = (FIXTURES / "nvidia-smi-q" / "001-a100-sxm4-ecc-remapped-rows-pending.txt").read_text()
    full = []
    real = nvidia_smi_q._clean_line
    monkeypatch.setattr(nvidia_smi_q, "_clean_line", lambda line: full.append(line) or real(line))
    report = nvidia_smi_q.parse(text)
    plain = [line for line in text.splitlines() if line.startswith(" ") and line.strip()
             and not nvidia_smi_q.is_elision(line)]     # `    [...]`: noise, the full path's
    assert report.gpus and len(plain) > 20
    assert not set(full) & set(plain)


def test_nvidia_smi_q_tests_a_line_only_for_the_noise_its_text_holds(monkeypatch):
    """The tab, elision, banner, echo and '<' tests run once over the whole text (_noise_of),
    not on each of its lines: a report holding only its banner has each line searched for the
    banner alone, one that holds none has its lines searched for nothing."""
    lines = (FIXTURES / "nvidia-smi-q" / "001-a100-sxm4-ecc-remapped-rows-pending.txt").read_text() \
        .splitlines()
    clean = "\n".join(line for line in lines if "..." not in line)   # its `[...]` elision
    text = "==============NVSMI LOG==============\n" + clean
    assert not any(s in clean for s in nvidia_smi_q._NOISE) and len(clean.splitlines()) > 20
    patterns = []
    real = nvidia_smi_q._noise_of
    monkeypatch.setattr(nvidia_smi_q, "_noise_of",
                        lambda joined: patterns.append(real(joined)) or patterns[-1])
    report, without_banner = nvidia_smi_q.parse(text), nvidia_smi_q.parse(clean)
    assert report.gpus and without_banner.gpus == report.gpus
    assert [p and p.pattern for p in patterns] == ["NVSMI\\ LOG", None]


def test_nvidia_smi_q_reads_a_repeated_line_once(monkeypatch):
    """A report repeats most of its lines once per GPU (`Idle : Not Active`, counters at 0):
    _node_of reads each distinct plain line once a parse; every GPU still gets its own nodes."""
    lines = (FIXTURES / "nvidia-smi-q" / "001-a100-sxm4-ecc-remapped-rows-pending.txt").read_text() \
        .splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("GPU "))
    gpu = [line for line in lines[at + 1:] if "..." not in line]
    text = "\n".join(lines[:at + 1] + gpu + ["GPU 00000000:20:1C.0"] + gpu)
    reads = []
    real = nvidia_smi_q._node_of
    monkeypatch.setattr(nvidia_smi_q, "_node_of", lambda line, *body: reads.append(line)
                        or real(line, *body))
    first, second = nvidia_smi_q.parse(text).gpus
    plain = [line for line in gpu if line.startswith(" ")]
    assert len(plain) > 20 and sorted(r for r in reads if r[:1] == " ") == sorted(set(plain))
    assert second == replace(first, index=1, bus_id="00000000:20:1C.0")
    assert first.ecc_errors is not second.ecc_errors and first.ecc_errors == second.ecc_errors
