"""Node-health parsers (lspci ACS, dmesg Xids, fabric manager, ip addr) over every fixture and its labels.

Fixtures: tests/fixtures/<kind>/*.txt, verbatim public outputs; expected facts: the `expect`
block of each entry in tests/fixtures/labels/<kind>.yaml (paths into parse(text).to_dict()).
The variant tests use outputs written from each tool's documented format (other flags and
states than the fixtures show; each says so), garbage, and hostile inputs of a few MB.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.inspection import parsers
from cluster.base.errors import ParseError
from cluster.inspection.parsers import dmesg, fabricmanager, ip_addr, lspci
from fakes import assert_labels_cover_fixtures, check_label, fixture_cases, fixture_labels

FIXTURES = Path(__file__).parent / "fixtures"
MODULES = {"lspci": lspci, "dmesg": dmesg, "fabricmanager": fabricmanager, "ip-addr": ip_addr}


CASES = [pytest.param(kind, path, id=f"{kind}/{path.name}") for kind, path in fixture_cases(MODULES)]
# every fixture of every other kind in the tree (nvidia, net, clock, nccl...)
# A paste that really holds an lspci line inside another tool's output is lspci too.
HOLDS_LSPCI = {"101-open-555.58-nonascii-date-hyprctl-embedded.txt"}
OTHER_FIXTURES = [pytest.param(path, id=f"{path.parent.name}/{path.name}")
                  for path in sorted(FIXTURES.glob("*/*.txt"))
                  if path.parent.name not in MODULES and path.name not in HOLDS_LSPCI]


def test_every_fixture_has_a_label_entry_and_every_entry_a_fixture():
    for kind in MODULES:
        assert_labels_cover_fixtures(kind)


@pytest.mark.parametrize("kind,path", CASES)
def test_fixture_parses_to_labelled_facts(kind: str, path: Path):
    data = MODULES[kind].parse(path.read_text()).to_dict()
    json.dumps(data)
    for key, expected in fixture_labels(kind)[path.name]["expect"].items():
        check_label(data, key, expected)


@pytest.mark.parametrize("kind,path", CASES)
def test_fixture_is_detected_as_its_own_kind(kind: str, path: Path):
    text = path.read_text()
    assert parsers.detect(text) == kind
    assert [k for k, m in MODULES.items() if m.detect(text)] == [kind]


@pytest.mark.parametrize("kind,path", CASES)
def test_fixture_survives_crlf_prefix_and_trailing_junk(kind: str, path: Path):
    text = path.read_text()
    plain = MODULES[kind].parse(text).to_dict()
    assert MODULES[kind].parse(text.replace("\n", "\r\n")).to_dict() == plain
    assert MODULES[kind].parse("\n\n" + text + "\nuser@host:~$ \n").to_dict() == plain
    prefixed = "\n".join(f"gpu-node-07: {line}" for line in text.splitlines())
    assert parsers.parse(kind, prefixed).to_dict() == plain


@pytest.mark.parametrize("kind,path", CASES)
def test_other_node_kinds_refuse_this_fixture(kind: str, path: Path):
    text = path.read_text()
    for other, module in MODULES.items():
        if other != kind:
            with pytest.raises(ParseError):
                module.parse(text)


@pytest.mark.parametrize("path", OTHER_FIXTURES)
def test_these_parsers_refuse_every_other_kinds_fixture(path: Path):
    text = path.read_text(errors="replace")
    for kind, module in MODULES.items():
        assert not module.detect(text), f"{kind} detects {path.parent.name}/{path.name}"
        with pytest.raises(ParseError):
            module.parse(text)


GARBAGE = ["", "  \n\t\n", "hello world\nthis is not a tool output\n",
           "\x00\x01\x02 binary junk \xff\n", "bash: lspci: command not found\n",
           "Lorem ipsum dolor sit amet: consectetur adipiscing elit\n"]


@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("text", GARBAGE, ids=[f"garbage{i}" for i in range(len(GARBAGE))])
def test_garbage_raises_parse_error(kind: str, text: str):
    with pytest.raises(ParseError) as info:
        MODULES[kind].parse(text)
    assert info.value.kind == kind
    assert not MODULES[kind].detect(text)


@pytest.mark.parametrize("kind", list(MODULES))
def test_non_text_raises_parse_error(kind: str):
    with pytest.raises(ParseError):
        MODULES[kind].parse(None)  # type: ignore[arg-type]


def test_registry_knows_the_new_kinds():
    for kind, module in MODULES.items():
        assert parsers.PARSERS[kind] is module and kind in parsers.KINDS


# ---------------------------------------------------------------- lspci variants

LSPCI_FULL = """\
0000:3b:00.0 3D controller: NVIDIA Corporation GH100 [H100 SXM5 80GB] (rev a1)
\tSubsystem: NVIDIA Corporation Device 16c1
\tCapabilities: [60] Power Management version 3
\tCapabilities: [2a0 v1] Access Control Services
\t\tACSCap:\tSrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-
\t\tACSCtl:\tSrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-

0000:17:01.0 PCI bridge: Broadcom / LSI PEX890xx PCIe Gen 5 Switch (rev b0) (prog-if 00 [Normal decode])
\tCapabilities: [40] Power Management version 3
\tCapabilities: [2a0 v1] Access Control Services
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl+ DirectTrans+
\t\tACSCtl:\tSrcValid- TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd- EgressCtrl- DirectTrans-

0000:00:00.0 Host bridge: Intel Corporation Device 09a2 (rev 04)
\tSubsystem: Intel Corporation Device 0000
"""


def test_lspci_full_vvv_attaches_acsctl_to_its_device():
    """Layout of `lspci -vvv` (device line, tab-indented capabilities); not a captured sample."""
    data = lspci.parse(LSPCI_FULL).to_dict()
    assert [d["bdf"] for d in data["devices"]] == ["0000:3b:00.0", "0000:17:01.0", "0000:00:00.0"]
    gpu, bridge, host = data["devices"]
    assert gpu["acs_ctl"]["ReqRedir"] is False and bridge["acs_ctl"]["ReqRedir"] is True
    assert bridge["acs_ctl"]["SrcValid"] is False and host["acs_ctl"] is None
    assert bridge["description"].startswith("PCI bridge: Broadcom")
    assert data["acs_enabled"] is True
    assert lspci.parse(LSPCI_FULL.replace("ReqRedir+ CmpltRedir+ UpstreamFwd-",
                                          "ReqRedir- CmpltRedir- UpstreamFwd-")
                       ).to_dict()["acs_enabled"] is False


def test_lspci_without_readable_capabilities_is_unknown_not_disabled():
    """`lspci -vvv` as non-root prints `Capabilities: <access denied>`; plain `lspci` none."""
    text = ("3b:00.0 3D controller: NVIDIA Corporation GH100 [H100 SXM5 80GB] (rev a1)\n"
            "\tCapabilities: <access denied>\n"
            "17:01.0 PCI bridge: Broadcom / LSI PEX890xx PCIe Gen 5 Switch (rev b0)\n"
            "\tCapabilities: <access denied>\n")
    data = lspci.parse(text).to_dict()
    assert data["acs_enabled"] is None and all(d["acs_ctl"] is None for d in data["devices"])


def test_lspci_acsctl_bit_not_printed_is_null():
    data = lspci.parse("ACSCtl: SrcValid- TransBlk- ReqRedir-\n").to_dict()
    assert data["devices"][0]["acs_ctl"]["UpstreamFwd"] is None
    assert data["acs_enabled"] is False


# ---------------------------------------------------------------- dmesg variants

def test_dmesg_xid79_and_fallen_off_the_bus_in_journal_form():
    """`journalctl -k` line layout with the Xid 79 wording of NVIDIA's Xid catalog; not a
    captured sample."""
    text = ("Mar 03 10:15:02 gpu07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, "
            "name=python3, GPU has fallen off the bus.\n"
            "Mar 03 10:15:02 gpu07 kernel: NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n"
            "Mar 03 10:15:03 gpu07 kernel: NVRM: GPU 0000:5e:00.0: GPU has fallen off the bus.\n"
            "Mar 03 10:16:40 gpu07 kernel: NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, "
            "Contained: CE User Channel (0x9). RST: No, D-RST: No\n")
    data = dmesg.parse(text).to_dict()
    assert [(x["pci"], x["xid"]) for x in data["xids"]] == [("0000:3b:00", 79), ("0000:01:00", 94)]
    assert data["xids"][0]["message"] == "pid=1234, name=python3, GPU has fallen off the bus."
    assert data["fell_off_bus"] == ["0000:3b:00", "0000:3b:00.0", "0000:5e:00.0"]
    assert parsers.detect(text) == "dmesg"


def test_dmesg_without_nvidia_lines_is_an_empty_result():
    text = "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115)\n"
    assert dmesg.parse(text).to_dict() == {"xids": [], "fell_off_bus": [], "aer": []}


def test_dmesg_relative_stamps_headers_and_bare_aer_lines_are_kernel_lines():
    """Issue 26: `dmesg -d`/`-H` stamps and AER lines printed with no stamp (a mail or a journal
    grep) are read, not refused; each AER error is one entry with its level."""
    for text in ("[  +0.000316] pcieport 0000:00:1d.0: AER: device recovery failed\n",
                 "[Dec 1 10:00] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n",
                 "[+0.000001] nvidia 0000:3b:00.0: enabling device (0000 -> 0002)\n"):
        assert dmesg.parse(text).to_dict() == {"xids": [], "fell_off_bus": [], "aer": []}, text
        assert parsers.detect(text) == "dmesg", text
    bare = ("pcieport 0000:00:02.0: AER: Uncorrected (Non-Fatal) error received: 0000:01:00.0\n"
            "r8169 0000:01:00.0: AER: PCIe Bus Error: severity=Uncorrected (Non-Fatal), "
            "type=Transaction Layer, (Requester ID)\n")
    assert dmesg.parse(bare).to_dict()["aer"] == [
        {"pci": "0000:01:00.0", "driver": "r8169", "severity": "Uncorrected (Non-Fatal)",
         "level": "non_fatal", "type": "Transaction Layer"}]


# ---------------------------------------------------------------- fabric manager variants

def test_fabricmanager_status_failed_and_inactive():
    """`systemctl status` Active-line layouts of systemd 245-255; not captured samples."""
    failed = ("× nvidia-fabricmanager.service - NVIDIA fabric manager service\n"
              "     Loaded: loaded (/lib/systemd/system/nvidia-fabricmanager.service; enabled)\n"
              "     Active: failed (Result: exit-code) since Mon 2025-03-03 10:00:00 UTC; 5min ago\n")
    data = fabricmanager.parse(failed).to_dict()
    assert data["running"] is False and data["failure"].startswith("Active: failed")
    inactive = failed.replace("failed (Result: exit-code)", "inactive (dead)")
    assert fabricmanager.parse(inactive).to_dict() == {"running": False, "failure": None}
    activating = failed.replace("failed (Result: exit-code)", "activating (start)")
    assert fabricmanager.parse(activating).to_dict()["running"] is False


def test_fabricmanager_unit_not_found_and_journal_restart():
    data = fabricmanager.parse("Unit nvidia-fabricmanager.service could not be found.\n").to_dict()
    assert data["running"] is False and "could not be found" in data["failure"]
    journal = ("Mar 03 10:00:01 node systemd[1]: nvidia-fabricmanager.service: Failed with "
               "result 'exit-code'.\n"
               "Mar 03 10:05:01 node systemd[1]: Starting NVIDIA fabric manager service...\n"
               "Mar 03 10:05:04 node systemd[1]: Started NVIDIA fabric manager service.\n")
    assert fabricmanager.parse(journal).to_dict() == {"running": True, "failure": None}
    stopped = journal.rsplit("Mar 03 10:05:04", 1)[0]
    data = fabricmanager.parse(stopped).to_dict()
    assert data["running"] is False and "Failed with result" in data["failure"]


def test_fabricmanager_error_tag_in_its_own_log():
    text = ("Mar 03 10:05:03 node nv-fabricmanager[812]: [Mar 03 2025 10:05:03] [ERROR] "
            "[tid 812] detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch pci bus id "
            "00000000:07:00.0\n")
    data = fabricmanager.parse(text).to_dict()
    assert data["running"] is None
    assert data["failure"].startswith("detected NVSwitch non-fatal error 12028")


# ---------------------------------------------------------------- ip addr variants

def test_ip_brief_form_and_peer_names():
    """`ip -br addr` layout (iproute2 >= 4.14); not a captured sample."""
    text = ("lo               UNKNOWN        127.0.0.1/8 ::1/128\n"
            "eth0@if12        UP             10.42.0.17/24 fe80::a8c1:abff:fe12:3456/64\n"
            "ib0              DOWN           \n"
            "bond0            UP             192.168.10.5/24 192.168.10.6/24\n")
    data = ip_addr.parse(text).to_dict()
    assert [(i["name"], i["state"], i["mtu"], i["ipv4"]) for i in data["interfaces"]] == [
        ("lo", "UNKNOWN", None, ["127.0.0.1/8"]), ("eth0", "UP", None, ["10.42.0.17/24"]),
        ("ib0", "DOWN", None, []), ("bond0", "UP", None, ["192.168.10.5/24", "192.168.10.6/24"])]
    assert parsers.detect(text) == "ip-addr"


def test_ip_brief_link_form_is_not_ip_addr():
    """`ip -br link show` (MACs where addresses go), as quoted in iproute2-cheatsheet#28."""
    text = ("lo               UNKNOWN        00:00:00:00:00:00 <LOOPBACK,UP,LOWER_UP> \n"
            "eth0             UP             b8:27:eb:68:5f:03 <BROADCAST,MULTICAST,UP,LOWER_UP> \n")
    with pytest.raises(ParseError):
        ip_addr.parse(text)
    assert not ip_addr.detect(text)


def test_ip_addr_full_form_veth_and_invalid_addresses():
    text = ("3: eth0@if12: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 9000 qdisc noqueue state UP "
            "group default\n"
            "    link/ether 0a:58:0a:2a:00:11 brd ff:ff:ff:ff:ff:ff link-netnsid 0\n"
            "    inet 10.42.0.17/24 brd 10.42.0.255 scope global eth0\n"
            "    inet 999.1.1.1/24 scope global eth0\n"
            "    inet 10.0.0.\u0661/8 scope global eth0\n"
            "4: ib0: <BROADCAST,MULTICAST> mtu 2044 qdisc noop\n")
    data = ip_addr.parse(text).to_dict()
    assert data["interfaces"] == [
        {"name": "eth0", "state": "UP", "mtu": 9000, "ipv4": ["10.42.0.17/24"]},
        {"name": "ib0", "state": None, "mtu": 2044, "ipv4": []}]


# ---------------------------------------------------------------- hostile input (issue 17)

HOSTILE = {
    "spaces_line": "x" + " " * 2_000_000 + "x",
    "colons": ":" * 2_000_000,
    "acsctl_tokens": "ACSCtl: " + "SrcValid+ " * 300_000,
    "xid_prefix": "NVRM: Xid (PCI:" * 200_000,
    "fallen_off": "GPU GPU GPU " * 200_000 + "fallen off the bus",
    "ip_header": "1: " + "a" * 2_000_000 + ": <UP> mtu 1",
    "brief_lines": "eth0 UP 10.0.0.1/24\n" * 20_000,
    "journal_lines": "Mar 03 10:00:01 node systemd[1]: x\n" * 100_000,
    "blank_lines": "\n" * 2_000_000,
}


@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_inputs_end_in_a_result_or_parse_error(kind: str, name: str):
    """Each input (1-3 MB) ends in a result or ParseError; speed is not asserted here."""
    module = MODULES[kind]
    assert module.detect(HOSTILE[name]) in (True, False)
    try:
        json.dumps(module.parse(HOSTILE[name]).to_dict())
    except ParseError as exc:
        assert exc.kind == kind


# ---------------------------------------------------------------- property-based (issue 17)

from hypothesis import given, settings, strategies as st  # noqa: E402

from cluster.inspection.parsers import nvidia_smi, nvidia_smi_q, nvidia_smi_topo  # noqa: E402

ALL = {**MODULES, "nvidia-smi": nvidia_smi, "nvidia-smi-q": nvidia_smi_q,
       "nvidia-smi-topo": nvidia_smi_topo}
# pieces of every format, so that random texts get deep into the parsers
TOKENS = ["\n", " ", "  ", "\t", ":", " : ", "+", "-", "|", "x", "0", "79", "0000:3b:00.0",
          "ACSCtl:", "SrcValid+", "ReqRedir-", "[  12.345678] ", "NVRM: Xid (PCI:", "): ",
          "fallen off the bus", "GPU ", "GPU0", "NIC0", " X ", "PIX", "SYS", "NV12",
          "Remapped Rows", "Pending", "Yes", "Fabric", "State", "Completed", "Active",
          "<nvidia_smi_log>", "<gpu id=\"00000000:01:00.0\">", "</gpu>", "1: eth0: <UP> mtu ",
          "    inet 10.0.0.1/24", "state UP", "Active: active (running)",
          "nv-fabricmanager[1]: ", "systemd[1]: ", "NVIDIA-SMI 550.54", "Driver Version:",
          "| 0  NVIDIA H100  On | 00000000:18:00.0 Off | 0 |", "\x1b]", "\r\n", "\u0661"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=80).map("".join))
def test_any_text_gives_a_result_or_parse_error(text: str):
    for kind, module in ALL.items():
        assert module.detect(text) in (True, False)
        try:
            data = module.parse(text).to_dict()
        except ParseError as exc:
            assert exc.kind == kind
        else:
            json.dumps(data, allow_nan=False)
