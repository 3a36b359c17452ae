"""The simulated cluster test bed (scripts/simcluster): profiles, node isolation, fault verbs, cleanup.

The profile tests at the top need nothing special; the rest are @pytest.mark.integration and run
over real SSH (OpenSSH client) against network-namespace nodes.
"""
from __future__ import annotations

import importlib.machinery
import json
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SIMCLUSTER = Path(__file__).resolve().parents[2] / "scripts" / "simcluster"
PROFILES_DIR = SIMCLUSTER.parent / "simcluster_profiles"
REQUIRED_PROFILES = ["h100-ib", "h100-ib-port-down", "h100-no-peermem", "h100-clock-off", "h100-driver-diff",
                     "l40s-pcie", "h100-7gpu", "cpu", "small-4gpu", "small-shm",
                     "h100-acs", "h100-fm-stopped", "h100-xid79", "h100-remap-pending", "h100-pcie-x8",
                     "h100-persistence-off", "h100-nic-sys", "h100-mtu-9000"]
HEALTH_FACTS = ("acs_enabled", "fabric_manager", "fabric_state", "xids", "persistence_mode", "pcie_narrow_gpus",
                "remap_pending_gpus", "nearest_nic_relation")
FM_STATUS = ("systemctl", "status", "nvidia-fabricmanager", "--no-pager", "--full")


def load_simcluster_module():
    loader = importlib.machinery.SourceFileLoader("simcluster_script", str(SIMCLUSTER))
    spec = importlib.util.spec_from_loader("simcluster_script", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    loader.exec_module(module)
    return module


sim = load_simcluster_module()
ALL_PROFILES = sim.profile_names()


# ----------------------------------------------------------------------------- profiles (no root needed)

def test_required_profiles_exist():
    assert set(REQUIRED_PROFILES) <= set(ALL_PROFILES)


@pytest.mark.parametrize("name", ALL_PROFILES)
def test_profile_yaml_reader_agrees_with_pyyaml(name):
    yaml = pytest.importorskip("yaml")
    text = (PROFILES_DIR / name / "profile.yaml").read_text()
    assert sim.parse_yaml(text, name) == yaml.safe_load(text)


def test_yaml_reader_handles_the_subset_and_rejects_garbage():
    yaml = pytest.importorskip("yaml")
    doc = ('a: 1\nb: "x: y # not a comment"\nc: [p, "q, r", 3]  # comment\nd:\n  - k: v\n    l: [ ]\n'
           "  - plain text\n  -\n    deep: {}\ne:\n- 1.5\n- 'it''s'\nf: ~\ng: no\n")
    assert sim.parse_yaml(doc) == yaml.safe_load(doc)
    for bad in ("a: 1\na: 2\n", "a: [1, 2\n", "a:\n    b: 1\n  c: 2\n"):
        with pytest.raises(sim.SimError):
            sim.parse_yaml(bad)


@pytest.mark.parametrize("name", ALL_PROFILES)
def test_profile_documents_the_source_and_edits_of_every_file(name):
    prof = sim.load_profile(name)
    doc = sim.parse_yaml((PROFILES_DIR / name / "profile.yaml").read_text())
    own = {p.name for p in (PROFILES_DIR / name).iterdir()} - {"profile.yaml"}
    listed = {k for k, v in (doc.get("outputs") or {}).items() if v is not None}
    assert own == listed, "every file in the profile directory is listed under outputs, and only those"
    for fname in listed:
        meta = doc["outputs"][fname]
        assert meta["sources"], f"{fname} has no source"
        assert all(s.startswith("fixtures node/") for s in meta["sources"]), meta["sources"]
        assert isinstance(meta.get("edits"), list)
    assert prof.description
    for key in ("gpu_count", "gpu_model", "driver_version", "ib_hcas", "nvidia_peermem", "dev_shm", "memlock",
                *HEALTH_FACTS):
        assert key in prof.facts, f"{name}: fact {key} missing"


@pytest.mark.parametrize("name", ALL_PROFILES)
def test_profile_facts_match_what_its_tools_print(name):
    prof = sim.load_profile(name)
    facts, files = prof.facts, prof.outputs

    def tool(*argv):
        return sim.run_tool(argv[0], list(argv[1:]), files, name)

    tools = sim.tools_of(files)
    if facts["gpu_count"]:
        rows = tool("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader").splitlines()
        assert len(rows) == facts["gpu_count"]
        assert {r.split(", ")[0] for r in rows} == {facts["gpu_model"]}
        assert {r.split(", ")[1] for r in rows} == {facts["driver_version"]}
        table = tool("nvidia-smi")
        assert f"Driver Version: {facts['driver_version']}" in table
        assert f"CUDA Version: {facts['cuda_version']}" in table
        assert table.count(facts["gpu_model"]) == facts["gpu_count"]
        assert tool("nvidia-smi", "-q").count("Product Name") == facts["gpu_count"]
        assert f"{facts['driver_version']}" in files["proc-driver-nvidia-version.txt"].read_text()
        topo = tool("nvidia-smi", "topo", "-m")
        assert re.search(r"\bNV\d+\b", topo) if facts["nvlink"] else not re.search(r"\bNV\d+\b", topo.split("Legend")[0])
    else:
        assert "nvidia-smi" not in tools and "nvcc" not in tools
    if facts["ib_hcas"]:
        cas = tool("ibstat", "-l").split()
        assert cas == facts["ib_hcas"]
        for ca in cas:
            block = tool("ibstat", ca)
            down = ca in facts["ib_ports_down"]
            assert ("State: Down" in block) == down and ("State: Active" in block) == (not down)
            assert f"Rate: {facts['ib_rate_gbps']}" in block and f"Link layer: {facts['ib_link_layer']}" in block
            assert ("PORT_DOWN" in tool("ibv_devinfo", "-d", ca)) == down
    else:
        assert not {"ibstat", "ibv_devinfo", "ibdev2netdev"} & set(tools)
    if "lsmod" in tools:
        assert bool(re.search(r"^nvidia_peermem\s", tool("lsmod"), re.M)) == facts["nvidia_peermem"]
    peer_files = [p for p in prof.node_files if "peermem" in p or "memory_peers/" in p]
    assert bool(peer_files) == facts["nvidia_peermem"]
    if "chronyc" in tools:
        m = re.search(r"System time\s*: ([0-9.]+) seconds", tool("chronyc", "tracking"))
        assert abs(float(m.group(1)) - facts["clock_offset_seconds"]) < 1e-9
        assert facts["clock_synchronized"] == (float(m.group(1)) < 1.0)
    check_health_facts(name, prof, tool, tools)


def check_health_facts(name, prof, tool, tools):
    """The node-health facts against what the toolkit's own parsers read from the profile's tools."""
    from cluster.inspection.parsers import dmesg, fabricmanager, lspci, nvidia_smi, nvidia_smi_q, nvidia_smi_topo
    facts = prof.facts
    if not facts["gpu_count"]:
        assert all(facts[k] is None for k in HEALTH_FACTS), "a node without GPUs has no GPU health facts"
        return
    # A GPU node without its own dmesg would run the host's: every GPU profile has one.
    assert {"dmesg", "lspci", "systemctl"} <= set(tools)
    gpus = nvidia_smi_q.parse(tool("nvidia-smi", "-q")).gpus
    assert len(gpus) == facts["gpu_count"]
    buses = {g.bus_id for g in gpus}
    assert lspci.parse(tool("lspci", "-vvv")).acs_enabled is facts["acs_enabled"]
    fm = fabricmanager.parse(tool(*FM_STATUS))
    code = sim.tool_exit_code(FM_STATUS[0], list(FM_STATUS[1:]), prof.exit_codes)
    assert (fm.running, code) == {"running": (True, 0), "failed": (False, 3), "absent": (False, 4)}[
        facts["fabric_manager"]]
    assert {g.fabric_state for g in gpus} == {facts["fabric_state"]}
    assert all(g.fabric_status == "Success" for g in gpus) == (facts["fabric_state"] == "Completed")
    kernel = "\n".join(ln for ln in tool("dmesg").splitlines() if "NVRM" in ln or "fallen off the bus" in ln)
    log = dmesg.parse(kernel)
    assert sorted({x.xid for x in log.xids}) == facts["xids"]
    known = buses | set(facts.get("lost_gpus") or ())       # a GPU off the bus leaves nvidia-smi
    for pci in [x.pci for x in log.xids] + list(log.fell_off_bus):   # 0000:0a:00 names GPU 00000000:0A:00.0
        assert any(b.lower().endswith(pci[5:].lower() + ".0") for b in known), (pci, known)
    assert not buses & set(facts.get("lost_gpus") or ()), "a lost GPU is not listed"
    assert {g.persistence_mode_enabled for g in gpus} == {facts["persistence_mode"]}
    table = nvidia_smi.parse(tool("nvidia-smi")).gpus
    assert {g.persistence_mode_enabled for g in table} == {facts["persistence_mode"]}, "nvidia-smi agrees with -q"
    assert [g.bus_id for g in gpus if g.pcie_width_current < g.pcie_width_max] == facts["pcie_narrow_gpus"]
    assert [g.bus_id for g in gpus if g.remapped_rows_pending] == facts["remap_pending_gpus"]
    assert all(g.ecc_uncorrectable_volatile == 0 and g.ecc_uncorrectable_aggregate == 0 for g in gpus)
    assert all(g.clocks_event_reasons_active == () for g in gpus)
    topo = nvidia_smi_topo.parse(tool("nvidia-smi", "topo", "-m"))
    relations = [v["relation"] for v in topo.gpu_nic.values()]
    rank = ["PIX", "PXB", "PHB", "NODE", "SYS"]
    assert (max(relations, key=rank.index) if relations else None) == facts["nearest_nic_relation"]
    if facts["ib_hcas"]:   # the topology's NICs are the HCAs ibstat lists
        assert sorted(topo.nic_legend.values()) == sorted(facts["ib_hcas"])


def test_query_gpu_renders_nvidia_smi_csv_formats():
    files = sim.load_profile("h100-ib").outputs

    def q(*args):
        return sim.run_tool("nvidia-smi", list(args), files, "h100-ib")

    out = q("--query-gpu=index,name,uuid,memory.total,memory.used,pci.bus_id,driver_version,compute_cap,"
            "clocks.max.sm,temperature.gpu,utilization.gpu", "--format=csv")
    lines = out.splitlines()
    assert lines[0] == ("index, name, uuid, memory.total [MiB], memory.used [MiB], pci.bus_id, driver_version, "
                        "compute_cap, clocks.max.sm [MHz], temperature.gpu, utilization.gpu [%]")
    assert lines[1].startswith("0, NVIDIA H100 80GB HBM3, GPU-") and ", 81559 MiB, 0 MiB, 00000000:04:00.0," in lines[1]
    assert lines[1].endswith(", 9.0, 1980 MHz, 32, 0 %") and len(lines) == 9
    assert q("--query-gpu=memory.total,utilization.gpu", "--format=csv,noheader,nounits").splitlines()[0] == "81559, 0"
    assert q("--query-gpu=memory.total", "--format=csv,nounits").splitlines()[0] == "memory.total [MiB]"
    assert q("--query-gpu=gpu_name,count", "--format=csv,noheader", "-i", "3").strip() == "NVIDIA H100 80GB HBM3, 8"
    assert q("-L").splitlines()[7].startswith("GPU 7: NVIDIA H100 80GB HBM3 (UUID: GPU-")
    with pytest.raises(sim.ToolError):
        q("--query-gpu=no.such.field", "--format=csv")


def test_tool_verb_prints_profile_output_and_127_for_missing_tools():
    run = [sys.executable, str(SIMCLUSTER), "tool"]
    p = subprocess.run(run + ["h100-ib", "--", "nvidia-smi", "topo", "-m"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == (PROFILES_DIR / "h100-ib" / "nvidia-smi-topo.txt").read_text()
    p = subprocess.run(run + ["cpu", "--", "nvidia-smi"], capture_output=True, text=True)
    assert p.returncode == 127 and "command not found" in p.stderr
    p = subprocess.run(run + ["h100-ib", "--", "nvidia-smi", "--bogus"], capture_output=True, text=True)
    assert p.returncode == 2 and "no recorded output" in p.stderr
    for profile, code in (("h100-ib", 0), ("h100-fm-stopped", 3), ("l40s-pcie", 4)):
        p = subprocess.run(run + [profile, "--", *FM_STATUS], capture_output=True, text=True)
        want = (PROFILES_DIR / profile / "systemctl-status-nvidia-fabricmanager.txt").read_text()
        assert (p.returncode, p.stdout) == (code, want), profile   # systemctl's own exit codes


def test_profile_exit_codes_and_mtu_are_inherited_and_checked(tmp_path, monkeypatch):
    assert sim.load_profile("h100-fm-stopped").exit_codes == {"systemctl-status-nvidia-fabricmanager.txt": 3}
    assert sim.load_profile("h100-ib").exit_codes == {} and sim.load_profile("h100-ib").mtu is None
    assert sim.load_profile("h100-mtu-9000").mtu == 9000
    base = (PROFILES_DIR / "h100-mtu-9000" / "profile.yaml").read_text()
    (tmp_path / "h100-ib").symlink_to(PROFILES_DIR / "h100-ib")   # the base the variants name
    monkeypatch.setattr(sim, "PROFILES_DIR", tmp_path)
    for i, bad in enumerate(("mtu: 100000", "mtu: true", "mtu: 9000.5", "mtu: 100")):
        (tmp_path / f"bad{i}").mkdir()
        (tmp_path / f"bad{i}" / "profile.yaml").write_text(base.replace("mtu: 9000", bad))
        with pytest.raises(sim.SimError, match="mtu must be"):
            sim.load_profile(f"bad{i}")


def test_firewall_ruleset_and_port_parsing():
    assert sim.port_range("8265") == (8265, 8265) and sim.port_range("6379-6381") == (6379, 6381)
    for bad in ("0", "70000", "9-8", "a", "", "1-2-3"):
        with pytest.raises(sim.UsageError):
            sim.port_range(bad)
    text = sim.firewall_ruleset([{"low": 6379, "high": 6379, "from": None, "from_ip": None},
                                 {"low": 8000, "high": 8100, "from": "node3", "from_ip": "198.18.0.3"}])
    assert "tcp dport 6379 drop" in text and "ip saddr 198.18.0.3 tcp dport 8000-8100 drop" in text
    assert text.startswith("table inet simcluster\ndelete table inet simcluster\n")


def write_node_tools(name: str, node_dir: Path) -> None:
    """The tool files `up` writes into a node of profile `name` (bin/, rendered/, profile/)."""
    cfg = sim.Config(node_dir.parent, "t", 0, None)
    files = sim.node_files_for(cfg, node_dir.name, sim.load_profile(name), "ssh-ed25519 AAAA test\n")
    for rel, (data, mode) in files.items():
        if rel.split("/")[0] in ("bin", "rendered", "profile") or rel in ("profile-name", "exit-codes.json"):
            (node_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (node_dir / rel).write_bytes(data)
            os.chmod(node_dir / rel, mode)


@pytest.mark.parametrize("name", ALL_PROFILES)
def test_shell_tools_print_exactly_what_the_python_tool_prints(name, tmp_path, capsys):
    node_dir = tmp_path / "node1"
    write_node_tools(name, node_dir)
    (node_dir / "bin" / "simtool").unlink()  # what the shell tools answer, they answer alone
    files = sim.load_profile(name).outputs
    env = {"PATH": os.environ["PATH"], "LC_ALL": "C"}
    rendered = 0
    for tool in sim.tools_of(files):
        assert (node_dir / "bin" / tool).read_text().startswith("#!/bin/sh\n")
        for argv in sim.fast_argvs(tool):
            code = sim.tool_main([str(node_dir / "bin" / tool), *argv[1:]])  # the Python tool
            py = capsys.readouterr()
            sh = subprocess.run([str(node_dir / "bin" / tool), *argv[1:]], capture_output=True, env=env)
            if py.err:  # no such output in this profile: left to the Python tool's message
                assert code != 0 and sh.returncode != 0 and b"simtool" in sh.stderr, argv
                continue
            assert code == sim.tool_exit_code(tool, list(argv[1:]), sim.load_profile(name).exit_codes)
            assert (sh.returncode, sh.stderr) == (code, b""), (argv, sh.stderr)
            assert sh.stdout == py.out.encode(), argv
            rendered += 1
    assert rendered or not sim.tools_of(files)


def test_shell_tools_hand_other_argument_lists_to_the_python_tool(tmp_path):
    node_dir = tmp_path / "node1"
    write_node_tools("h100-ib", node_dir)
    stub = node_dir / "bin" / "simtool"
    stub.write_text(stub.read_text().replace("/run/simcluster-pycache", str(tmp_path / "pycache")))
    smi = str(node_dir / "bin" / "nvidia-smi")
    files = sim.load_profile("h100-ib").outputs
    for args in (["--query-gpu=index,uuid", "--format=csv"], ["-i", "0", "-L"], ["-L", "extra"], ["-l"]):
        p = subprocess.run([smi, *args], capture_output=True, text=True)
        try:
            want = (0, sim.run_tool("nvidia-smi", args, files, "h100-ib"), "")
        except sim.ToolError as e:
            want = (e.code, "", f"{e}\n")
        assert (p.returncode, p.stdout, p.stderr) == want, args
    assert "lsmod" in sim.tools_of(files) and "ntpq" not in sim.tools_of(files)
    assert not (node_dir / "bin" / "ntpq").exists()


def test_fixtures_skip_with_a_reason_when_not_root(monkeypatch):
    spec = importlib.util.spec_from_file_location("simcluster_conftest", Path(__file__).with_name("conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, conftest)
    spec.loader.exec_module(conftest)
    monkeypatch.setattr(conftest.os, "geteuid", lambda: 1000)
    assert "needs root" in conftest.simcluster_unavailable()


# ----------------------------------------------------------------------------- over SSH

def ssh_ok(cluster, node: str, command: str = "true") -> subprocess.CompletedProcess:
    r = cluster.ssh(node, command)
    assert r.returncode == 0, f"ssh {node} {command!r}: exit {r.returncode}: {r.stderr}"
    return r


@pytest.mark.integration
def test_each_node_answers_with_its_own_hostname_over_ssh(simcluster):
    assert simcluster.names == ["node1", "node2", "node3"]
    for node in simcluster.nodes:
        assert ssh_ok(simcluster, node.name, "hostname").stdout.strip() == node.name
        assert ssh_ok(simcluster, node.ip, "hostname").stdout.strip() == node.name
        assert node.ip == f"198.18.{os.environ.get('SIMCLUSTER_SUBNET', '0')}.{node.name[4:]}"


@pytest.mark.integration
def test_host_keys_are_checked_strictly(simcluster, tmp_path):
    forged = tmp_path / "known_hosts"
    lines = simcluster.known_hosts.read_text().splitlines()
    key_of_node1 = lines[0].split()[2]
    forged.write_text("".join(f"{ln.split()[0]} {ln.split()[1]} {key_of_node1}\n" for ln in lines))
    r = subprocess.run(["ssh", "-F", str(simcluster.ssh_config), "-o", f"UserKnownHostsFile={forged}",
                        "node2", "true"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 255 and "Host key verification failed" in r.stderr


@pytest.mark.integration
def test_inventory_has_the_documented_shape(simcluster):
    yaml = pytest.importorskip("yaml")
    inv = yaml.safe_load(simcluster.inventory_path.read_text())
    assert set(inv) == {"ssh", "nodes", "expectations", "ray"}
    assert inv["ssh"] == {"known_hosts": str(simcluster.known_hosts),
                          "identity_file": str(simcluster.identity_file), "connect_timeout": 5}
    assert [n["role"] for n in inv["nodes"]] == ["head", "worker", "worker"]
    for entry, node in zip(inv["nodes"], simcluster.nodes):
        assert entry == {"name": node.name, "role": entry["role"], "address": node.ip, "user": "root",
                         "port": 22, "node_ip": node.ip, "nccl_socket_ifname": "eth0",
                         "gloo_socket_ifname": "eth0", "ib_hcas": entry["ib_hcas"], "profile": "h100-ib"}
        assert len(entry["ib_hcas"]) == 8
    import resource
    # runtime_imports off: the nodes share this machine's cores, and `import vllm` on each of
    # them at once costs seconds of CPU a node (the runtime check's smoke test, issue 40)
    expected = {"gpu_model": "NVIDIA H100 80GB HBM3", "gpus_per_node": 8, "runtime_imports": False}
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    if hard != resource.RLIM_INFINITY and "memlock_min_kib" in inv["expectations"]:
        expected["memlock_min_kib"] = hard // 1024   # the host cannot give nodes more
    assert inv["expectations"] == expected
    assert inv["ray"]["num_cpus"] >= 1 and inv["ray"]["object_store_memory"] >= 78643200


@pytest.mark.integration
def test_node_tools_print_their_profile_outputs(simcluster_factory):
    c = simcluster_factory(4, {"node2": "cpu", "node3": "small-shm", "node4": "h100-no-peermem"})
    h100 = PROFILES_DIR / "h100-ib"
    r = ssh_ok(c, "node1", "nvidia-smi")
    assert r.stdout == (h100 / "nvidia-smi.txt").read_text()
    r = ssh_ok(c, "node1", "nvidia-smi --query-gpu=index,name --format=csv,noheader")
    assert r.stdout.splitlines() == [f"{i}, NVIDIA H100 80GB HBM3" for i in range(8)]
    args = ["--query-gpu=index,pci.bus_id", "--format=csv,noheader"]  # not rendered: the Python tool
    r = ssh_ok(c, "node1", "nvidia-smi " + " ".join(args))
    assert r.stdout == sim.run_tool("nvidia-smi", args, sim.load_profile("h100-ib").outputs, "h100-ib")
    r = c.ssh("node1", "nvidia-smi --bogus")
    assert r.returncode == 2 and "no recorded output" in r.stderr
    assert ssh_ok(c, "node1", "ibstat").stdout == (h100 / "ibstat.txt").read_text()
    assert ssh_ok(c, "node1", "chronyc tracking").stdout == (h100 / "chronyc-tracking.txt").read_text()
    assert ssh_ok(c, "node1", "cat /proc/driver/nvidia/version").stdout == \
        (h100 / "proc-driver-nvidia-version.txt").read_text()
    assert ssh_ok(c, "node1", "cat /sys/module/nvidia_peermem/version "
                              "/sys/kernel/mm/memory_peers/nv_mem*/version").stdout == "570.133.20\n" * 2
    import resource
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    want = "unlimited" if hard == resource.RLIM_INFINITY else str(hard // 1024)
    assert ssh_ok(c, "node1", "ulimit -l").stdout.strip() in ("unlimited", want)
    path = ssh_ok(c, "node1", "echo $PATH; command -v python").stdout.split()
    assert path[0].startswith("/run/simcluster/bin:") and path[1].endswith("/bin/python")
    assert path[1] != "/root/.pyenv/shims/python", "the host's ~/.bashrc leaked into the node"
    # every session's environment beside PATH (NODE_ENV: what `ray start` and the engines under it
    # inherit): over SSH, through sudo (env_keep), and `simcluster exec`
    for name, value in sim.NODE_ENV.items():
        for command in (f"echo ${name}", f"sudo -n sh -c 'echo ${name}'"):
            assert ssh_ok(c, "node1", command).stdout.strip() == value, command
        assert c.exec("node1", "sh", "-c", f"echo ${name}", check=True).stdout.strip() == value
    for tool in ("nvidia-smi", "nvcc --version", "ibstat", "chronyc tracking"):
        r = c.ssh("node2", tool)
        assert r.returncode == 127 and "command not found" in r.stderr, (tool, r)
    assert ssh_ok(c, "node2", "timedatectl").stdout == (PROFILES_DIR / "cpu" / "timedatectl.txt").read_text()
    assert c.ssh("node2", "cat /proc/driver/nvidia/version").returncode != 0
    assert ssh_ok(c, "node3", "df -k --output=size /dev/shm").stdout.split()[-1] == str(64 * 1024)
    assert int(ssh_ok(c, "node1", "df -k --output=size /dev/shm").stdout.split()[-1]) == 2 * 1024 * 1024
    assert "nvidia_peermem" not in ssh_ok(c, "node4", "lsmod").stdout
    r = ssh_ok(c, "node4", "ls /sys/module/nvidia_peermem 2>&1; ls -A /sys/kernel/mm/memory_peers; ls /sys/kernel/mm")
    assert "No such file" in r.stdout and "transparent_hugepage" in r.stdout and "nv_mem" not in r.stdout
    inv = c.inventory_path.read_text()
    assert "profile: cpu" in inv and "ib_hcas: []" in inv


@pytest.mark.integration
def test_each_node_has_its_own_pid_mount_and_tmp(simcluster):
    for node in simcluster.names:
        assert ssh_ok(simcluster, node, "cat /proc/1/comm").stdout.strip() == "sshd"
    ssh_ok(simcluster, "node1", "nohup sleep 4242 >/dev/null 2>&1 & echo marker > /tmp/marker; "
                                "echo shm > /dev/shm/marker")
    try:
        assert "sleep 4242" in simcluster.exec("node1", "ps", "-eo", "args").stdout
        assert "sleep 4242" not in simcluster.exec("node2", "ps", "-eo", "args").stdout
        assert "sleep 4242" not in ssh_ok(simcluster, "node2", "ps -eo args").stdout
        assert simcluster.ssh("node2", "cat /tmp/marker").returncode != 0
        assert simcluster.ssh("node2", "cat /dev/shm/marker").returncode != 0
        assert ssh_ok(simcluster, "node1", "cat /tmp/marker /dev/shm/marker").stdout == "marker\nshm\n"
        assert not Path("/tmp/marker").exists(), "the node's /tmp is not the host's"
    finally:
        simcluster.exec("node1", "pkill", "-f", "sleep 4242")
        simcluster.exec("node1", "rm", "-f", "/tmp/marker", "/dev/shm/marker")


@pytest.mark.integration
def test_freeze_makes_ssh_hang_until_thaw(simcluster):
    simcluster.freeze("node2")
    try:
        t0 = time.monotonic()
        r = simcluster.ssh("node2", "true", connect_timeout=2, timeout=30)
        assert r.returncode == 255 and time.monotonic() - t0 < 15
        ssh_ok(simcluster, "node1")
        assert [n["sshd"] for n in simcluster.status()["nodes"]] == ["running", "frozen", "running"]
    finally:
        simcluster.thaw("node2")
    assert ssh_ok(simcluster, "node2", "hostname").stdout.strip() == "node2"


@pytest.mark.integration
def test_link_down_makes_the_node_unreachable_until_up(simcluster):
    simcluster.link("node3", "down")
    try:
        r = simcluster.ssh("node3", "true", connect_timeout=2, timeout=30)
        assert r.returncode == 255
        ssh_ok(simcluster, "node2")
        assert simcluster.status()["nodes"][2]["link"] == "down"
    finally:
        simcluster.link("node3", "up")
    ssh_ok(simcluster, "node3")


@pytest.mark.integration
def test_kill_ends_the_node_and_up_restarts_it_with_the_same_host_key(simcluster_factory, simcluster):
    ssh_ok(simcluster, "node2", "nohup sleep 4343 >/dev/null 2>&1 &")
    keys = simcluster.known_hosts.read_text()
    simcluster.kill("node2")
    assert simcluster.status()["nodes"][1]["sshd"] == "dead"
    assert simcluster.ssh("node2", "true", connect_timeout=2).returncode == 255
    again = simcluster_factory(3)
    assert "node2 restarted (sshd was dead)" in simcluster_factory.last_up_output
    assert "sleep 4343" not in again.exec("node2", "ps", "-eo", "args").stdout
    assert again.known_hosts.read_text() == keys
    ssh_ok(again, "node2")


@pytest.mark.integration
def test_a_node_removed_and_added_again_answers_at_once(simcluster_factory):
    simcluster_factory(4)
    assert ssh_ok(simcluster_factory(4), "node4", "hostname").stdout.strip() == "node4"
    simcluster_factory(3)  # removes node4; the host still caches its eth0's MAC
    c = simcluster_factory(4)  # a new eth0: up waits for its sshd (20 s at most) over TCP
    assert ssh_ok(c, "node4", "hostname").stdout.strip() == "node4"


@pytest.mark.integration
def test_second_up_changes_nothing(simcluster_factory, simcluster):
    before = simcluster.status()
    files = {p: p.stat().st_mtime_ns for p in simcluster.dir.iterdir() if p.is_file()}
    simcluster_factory(3)
    assert ", no changes" in simcluster_factory.last_up_output
    assert simcluster.status() == before
    assert {p: p.stat().st_mtime_ns for p in simcluster.dir.iterdir() if p.is_file()} == files


def machine_state(prefix: str, instance_dir: Path) -> dict:
    netns = sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else []
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()]
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(instance_dir) in cmd:
            procs.append((pid, cmd))
    return {
        "netns": [n for n in netns if n.startswith(prefix + "-")],
        "links": sorted(n for n in os.listdir("/sys/class/net") if n.startswith(prefix + "-")),
        "netns_mounts": sorted(m for m in mounts if m == "/run/netns" or m.startswith(f"/run/netns/{prefix}-")),
        "instance_mounts": sorted(m for m in mounts if str(instance_dir) in m),
        "run_netns_dir": os.path.isdir("/run/netns"),
        "processes": procs,
    }


def alive(pid: int, start: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[19] == start
    except (OSError, IndexError):
        return False


@pytest.mark.integration
def test_up_down_up_down_leaves_the_machine_as_it_was(simcluster_factory):
    simcluster_factory.down()
    prefix = os.environ.get("SIMCLUSTER_PREFIX", "sim")
    status = simcluster_factory.run("status", "--json", check=False)
    instance_dir = Path(json.loads(status.stdout)["dir"])
    before = machine_state(prefix, instance_dir)
    ours = []
    for _ in range(2):
        c = simcluster_factory(3)
        ours += [(n["sshd_pid"], Path(f"/proc/{n['sshd_pid']}/stat").read_text().split(")")[1].split()[19])
                 for n in c.status()["nodes"]]
        assert machine_state(prefix, instance_dir)["netns"] == [f"{prefix}-node{i}" for i in (1, 2, 3)]
        assert "removed 3 nodes and the bridge" in simcluster_factory.down()
    after = machine_state(prefix, instance_dir)
    assert after == before
    assert not any(alive(pid, start) for pid, start in ours)
    assert not instance_dir.exists() or not any(instance_dir.iterdir())


# ----------------------------------------------------------------------------- network conditions

LISTENER = """
import os, socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(16)
open("/tmp/listener-%s.pid" % sys.argv[1], "w").write(str(os.getpid()))
s.settimeout(1.0)
deadline = time.monotonic() + 120          # never outlives the test by much
while time.monotonic() < deadline:
    try:
        s.accept()[0].close()
    except socket.timeout:
        pass
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except socket.timeout:
    print("timeout")
except OSError as e:
    print("error", e)
"""


def connect(cluster, src: str, dst: str, port: int, timeout: float = 2.0) -> str:
    r = cluster.exec(src, "python3", "-c", CONNECT, cluster.node(dst).ip, str(port), str(timeout), check=True)
    return r.stdout.strip()


@pytest.fixture
def listener(simcluster):
    """A TCP listener on node2, port 47123 (stopped by its pid afterwards)."""
    port = 47123
    simcluster.exec("node2", "sh", "-c", f"nohup python3 -c '{LISTENER}' {port} >/dev/null 2>&1 &", check=True)
    deadline = time.monotonic() + 20
    while connect(simcluster, "node1", "node2", port) != "connected":
        assert time.monotonic() < deadline, "the listener on node2 did not come up"
        time.sleep(0.2)
    yield port
    pid = simcluster.exec("node2", "cat", f"/tmp/listener-{port}.pid").stdout.strip()
    if pid.isdigit():
        simcluster.exec("node2", "kill", pid)


@pytest.mark.integration
def test_firewall_drops_inbound_tcp_until_cleared(simcluster, simcluster_factory, listener):
    fw = lambda *a, **kw: simcluster_factory.run("firewall", *a, **kw)   # noqa: E731
    try:
        assert "node2 drops inbound TCP 47120-47130" in fw("node2", "drop", "47120-47130").stdout
        assert connect(simcluster, "node1", "node2", listener) == "timeout"
        assert "(already)" in fw("node2", "drop", "47120-47130").stdout             # idempotent
        listed = fw("node2", "list").stdout
        assert listed.count("tcp dport 47120-47130 drop") == 1, listed
        assert simcluster.status()["nodes"][1]["firewall"] == [
            {"low": 47120, "high": 47130, "from": None, "from_ip": None}]
        ssh_ok(simcluster, "node2")                                                   # port 22 untouched
        assert "firewall cleared" in fw("node2", "clear").stdout
        assert connect(simcluster, "node1", "node2", listener) == "connected"
        assert "firewall cleared" in fw("node2", "clear").stdout                      # idempotent
        assert "no firewall rules" in fw("node2", "list").stdout
        fw("node2", "drop", str(listener), "--from", "node3")
        assert connect(simcluster, "node3", "node2", listener) == "timeout"
        assert connect(simcluster, "node1", "node2", listener) == "connected"
        assert f"ip saddr {simcluster.node('node3').ip} tcp dport {listener} drop" in fw("node2", "list").stdout
    finally:
        fw("node2", "clear", check=False)
    assert connect(simcluster, "node3", "node2", listener) == "connected"
    for bad in (["node2", "drop"], ["node2", "drop", "0"], ["node2", "drop", "80", "--from", "node9"],
                ["node2", "clear", "80"], ["node9", "drop", "80"]):
        p = fw(*bad, check=False)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, (bad, p.stderr)


JUMBO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 2)     # IP_MTU_DISCOVER = IP_PMTUDISC_DO: never fragment
try:
    s.sendto(b"x" * 8972, (sys.argv[1], 9))  # 8972 + 28 header bytes = 9000
    print("sent")
except OSError as e:
    print("errno", e.errno)
"""


def send_jumbo(cluster, node: str, dst: str) -> str:
    return cluster.exec(node, "python3", "-c", JUMBO, dst, check=True).stdout.strip()


def eth0_mtu(cluster, node: str) -> int:
    out = cluster.exec(node, "cat", "/sys/class/net/eth0/mtu", check=True).stdout
    return int(out)


@pytest.mark.integration
def test_profile_mtu_is_set_for_real_on_the_nodes_link(simcluster_factory):
    c = simcluster_factory(3, {"node2": "h100-mtu-9000"})
    prefix = os.environ.get("SIMCLUSTER_PREFIX", "sim")
    try:
        assert [eth0_mtu(c, n) for n in c.names] == [1500, 9000, 1500]
        assert Path(f"/sys/class/net/{prefix}-node2/mtu").read_text().strip() == "9000"   # the host side
        r = ssh_ok(c, "node2", "ip -o link show eth0")
        assert " mtu 9000 " in r.stdout
        # the kernel enforces it: a 9000-byte datagram with DF set leaves node2, not node1 (EMSGSIZE)
        assert send_jumbo(c, "node2", c.node("node1").ip) == "sent"
        assert send_jumbo(c, "node1", c.node("node2").ip) == "errno 90"
    finally:
        c = simcluster_factory(3)
    assert [eth0_mtu(c, n) for n in c.names] == [1500, 1500, 1500]
    assert Path(f"/sys/class/net/{prefix}-node2/mtu").read_text().strip() == "1500"


# ----------------------------------------------------------------------------- node state (cluster fix)

def test_each_state_variant_is_its_profile_with_only_that_aspects_files_changed():
    """STATE_VARIANTS pairs profiles that differ exactly in the aspect's files: what a node prints
    after a state change is the other profile's capture, and nothing else moves."""
    for name, aspects in sim.STATE_VARIANTS.items():
        prof = sim.load_profile(name)
        spec = sim.state_spec(prof)
        for aspect, variants in aspects.items():
            names, paths = sim.STATE_FILES[aspect]
            for state, other_name in variants.items():
                other = sim.load_profile(other_name)
                assert sim.default_states(other.facts, other.outputs)[aspect] == state
                for f in set(prof.outputs) | set(other.outputs):
                    same = (f in prof.outputs and f in other.outputs
                            and prof.outputs[f].read_bytes() == other.outputs[f].read_bytes())
                    assert same or f in names, (name, other_name, f)
                assert {f for f in names if f in prof.outputs and (f not in other.outputs or
                        prof.outputs[f].read_bytes() != other.outputs[f].read_bytes())}, (name, aspect)
                outs, codes, nfiles = sim.apply_states(prof.outputs, prof.exit_codes,
                                                       {p: sim.node_file_text(prof, p) for p in prof.node_files},
                                                       spec, {aspect: state},
                                                       lambda a, s, f: other.outputs[f])
                assert {f: p.read_bytes() for f, p in outs.items()} == \
                       {f: p.read_bytes() for f, p in other.outputs.items()}
                assert {f: c for f, c in codes.items()} == other.exit_codes
                for p in paths:
                    assert nfiles.get(p) == sim.node_file_text(other, p), (name, p)


def test_apply_states_refuses_states_without_outputs():
    prof = sim.load_profile("h100-clock-off")
    spec = sim.state_spec(prof)
    with pytest.raises(sim.ToolError, match="no recorded outputs for persistence off"):
        sim.apply_states(prof.outputs, {}, {}, spec, {"persistence": "off"}, lambda a, s, f: None)
    assert sim.state_spec(sim.load_profile("cpu")) == {}
    assert sim.state_spec(sim.load_profile("l40s-pcie"))["peermem"] == {"default": "unloaded", "variants": {}}


def host_etc_snapshot() -> dict[str, bytes | None]:
    out = {}
    for path in sim.NODE_ETC + sim.USER_ETC:
        p = Path(path)
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                out[str(f)] = f.read_bytes() if f.is_file() else b"<dir>"
        out[path] = p.read_bytes() if p.is_file() else (b"<dir>" if p.is_dir() else None)
    return out


def fresh(factory, n: int, profiles: dict[str, str], users: bool = True):
    """Nodes in their profiles' start state: a profile change resets a node's state and /etc."""
    factory.run("up", str(n), "--default-profile", "cpu", *(["--users"] if users else []))
    args = [a for node, p in sorted(profiles.items()) for a in ("--profile", f"{node}={p}")]
    factory.run("up", str(n), *args, *(["--users"] if users else []))
    return sim_cluster(factory)


class Running:
    """The running instance after a plain `factory.run("up", ...)` (the factory itself has no --users)."""

    def __init__(self, factory):
        self.factory = factory
        self.dir = Path(json.loads(factory.run("status", "--json").stdout)["dir"])
        self.ssh_config = self.dir / "ssh_config"

    def ssh(self, node: str, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", "-F", str(self.ssh_config), node, command],
                              capture_output=True, text=True, timeout=60)

    def kill(self, node: str) -> None:
        self.factory.run("kill", node)


def sim_cluster(factory):
    return Running(factory)


def tool_out(profile: str, *argv: str) -> str:
    return sim.run_tool(argv[0], list(argv[1:]), sim.load_profile(profile).outputs, profile)


FIXED = {  # node: (profile, the fix command, [(command after it, the h100-ib output it must print)])
    "node1": ("h100-no-peermem", "modprobe nvidia_peermem", [("lsmod", "lsmod")]),
    "node2": ("h100-clock-off", "chronyc makestep", [("chronyc tracking", "chronyc tracking"),
                                                     ("chronyc sources", "chronyc sources")]),
    "node3": ("h100-persistence-off", "nvidia-smi -pm 1", [("nvidia-smi", "nvidia-smi"),
                                                          ("nvidia-smi -q", "nvidia-smi -q")]),
    "node4": ("h100-fm-stopped", "systemctl enable --now nvidia-fabricmanager",
              [("nvidia-smi -q", "nvidia-smi -q"), (" ".join(FM_STATUS), " ".join(FM_STATUS))]),
}


@pytest.mark.integration
def test_fix_commands_change_that_nodes_outputs_for_the_next_session_only(simcluster_factory):
    profiles = {node: p for node, (p, _, _) in FIXED.items()}
    profiles["node5"] = "h100-no-peermem"                      # a twin of node1 that nobody fixes
    c = fresh(simcluster_factory, 5, profiles)
    try:
        before = {n: {cmd: c.ssh(n, cmd).stdout for _, _, checks in [FIXED[n]] for cmd, _ in checks}
                  for n in FIXED}
        for node, (profile, fix, checks) in FIXED.items():
            for cmd, _ in checks:
                assert before[node][cmd] == tool_out(profile, *cmd.split()), (node, cmd)
        assert "nvidia_peermem" not in before["node1"]["lsmod"]
        assert "7.800260112 seconds fast" in before["node2"]["chronyc tracking"]
        assert c.ssh("node1", "cat /sys/module/nvidia_peermem/version").returncode != 0
        assert c.ssh("node4", " ".join(FM_STATUS)).returncode == 3
        assert c.ssh("node4", "systemctl is-active nvidia-fabricmanager").stdout == "failed\n"
        for node, (_, fix, _) in FIXED.items():
            ssh_ok(c, node, fix)
        for node, (_, _, checks) in FIXED.items():       # new sessions see the fixed node
            for cmd, healthy in checks:
                assert ssh_ok(c, node, cmd).stdout == tool_out("h100-ib", *healthy.split()), (node, cmd)
        r = ssh_ok(c, "node1", "cat /sys/module/nvidia_peermem/version /sys/kernel/mm/memory_peers/nv_mem*/version")
        assert r.stdout == "570.133.20\n570.133.20\n"
        assert ssh_ok(c, "node4", "systemctl is-active nvidia-fabricmanager").stdout == "active\n"
        assert ssh_ok(c, "node2", "systemctl is-active chrony chronyd").stdout == "active\ninactive\n"
        states = {n["name"]: n["state"] for n in json.loads(simcluster_factory.run("status", "--json").stdout)["nodes"]}
        assert (states["node1"]["peermem"], states["node2"]["clock"], states["node3"]["persistence"],
                states["node4"]["fabricmanager"], states.get("node5", {}).get("peermem")) == \
               ("loaded", "synced", "on", "running", None)
        # only that node: its twin and the others still print their own profiles' outputs
        assert c.ssh("node5", "lsmod").stdout == before["node1"]["lsmod"]
        assert c.ssh("node5", "cat /sys/module/nvidia_peermem/version").returncode != 0
        assert c.ssh("node1", "chronyc tracking").stdout == tool_out("h100-ib", "chronyc", "tracking")
        # the state survives an `up` that changes nothing and a restart of the node
        assert "no changes" in simcluster_factory.run("up", "5", *[a for n, p in sorted(profiles.items())
                                                                    for a in ("--profile", f"{n}={p}")],
                                                      "--users").stdout
        c.kill("node1")
        simcluster_factory.run("up", "5", *[a for n, p in sorted(profiles.items()) for a in ("--profile", f"{n}={p}")],
                               "--users")
        assert ssh_ok(c, "node1", "lsmod").stdout == tool_out("h100-ib", "lsmod")
        assert ssh_ok(c, "node1", "cat /sys/module/nvidia_peermem/version").stdout == "570.133.20\n"
        # and back: modprobe -r, -pm 0 print the broken captures again
        ssh_ok(c, "node1", "modprobe -r nvidia_peermem")
        assert c.ssh("node1", "lsmod").stdout == tool_out("h100-no-peermem", "lsmod")
        assert c.ssh("node1", "ls /sys/module/nvidia_peermem").returncode != 0
        ssh_ok(c, "node3", "nvidia-smi -pm 0")
        assert c.ssh("node3", "nvidia-smi -q").stdout == tool_out("h100-persistence-off", "nvidia-smi", "-q")
        r = c.ssh("node1", "modprobe nv_peer_mem")
        assert r.returncode == 1 and "Module nv_peer_mem not found" in r.stderr
        # a profile change forgets it all
        ssh_ok(c, "node5", "modprobe nvidia_peermem")
        simcluster_factory.run("up", "5", "--profile", "node5=h100-ib", "--users")
        simcluster_factory.run("up", "5", "--profile", "node5=h100-no-peermem", "--users")
        assert c.ssh("node5", "lsmod").stdout == before["node1"]["lsmod"]
    finally:
        simcluster_factory(3)


@pytest.mark.integration
def test_node_etc_is_the_nodes_own_and_dev_shm_really_remounts(simcluster_factory):
    host = host_etc_snapshot()
    c = fresh(simcluster_factory, 2, {"node1": "small-shm", "node2": "small-shm"})
    d = Path(c.dir) / "nodes"
    try:
        script = ("echo nvidia_peermem > /etc/modules-load.d/cluster-peermem.conf && "
                  "printf '* soft memlock unlimited\\n' > /etc/security/limits.d/90-cluster-memlock.conf && "
                  "mkdir -p /etc/systemd/system.conf.d && "
                  "printf '[Manager]\\nDefaultLimitMEMLOCK=infinity\\n' > /etc/systemd/system.conf.d/90-cluster-memlock.conf && "
                  "echo 'tmpfs /dev/shm tmpfs defaults,size=1073741824 0 0' >> /etc/fstab && "
                  "echo '# x' >> /etc/security/limits.conf && "
                  "mount -o remount,size=1073741824 /dev/shm && df -k /dev/shm")
        r = ssh_ok(c, "node1", script)
        assert " 1048576 " in r.stdout.splitlines()[-1]
        assert " 65536 " in ssh_ok(c, "node2", "df -k /dev/shm").stdout.splitlines()[-1]
        assert host_etc_snapshot() == host                      # the host never sees it
        r = c.ssh("node2", "ls /etc/modules-load.d/cluster-peermem.conf /etc/systemd/system.conf.d/; grep -c size= /etc/fstab")
        assert "No such file" in r.stderr and r.stdout.strip().endswith("0")
        assert (d / "node1/etc/modules-load.d/cluster-peermem.conf").read_text() == "nvidia_peermem\n"
        assert "size=1073741824" in ssh_ok(c, "node1", "cat /etc/fstab").stdout
        # kept across `up` and a restart; the node boots with its fstab's /dev/shm size
        c.kill("node1")
        simcluster_factory.run("up", "2", "--default-profile", "small-shm", "--users")
        r = ssh_ok(c, "node1", "cat /etc/systemd/system.conf.d/90-cluster-memlock.conf; df -k /dev/shm")
        assert r.stdout.startswith("[Manager]\nDefaultLimitMEMLOCK=infinity\n")
        assert " 1048576 " in r.stdout.splitlines()[-1]
        # a new profile starts from the host's files again
        simcluster_factory.run("up", "2", "--default-profile", "small-shm", "--profile", "node1=h100-ib", "--users")
        assert not (d / "node1/etc/modules-load.d/cluster-peermem.conf").exists()
        assert ssh_ok(c, "node1", "cat /etc/fstab").stdout == Path("/etc/fstab").read_text()
        # a rename over an /etc file works (atomic writes), and stays on the node
        ssh_ok(c, "node2", "cp /etc/fstab /etc/fstab.tmp && echo '# node2' >> /etc/fstab.tmp && "
                           "mv /etc/fstab.tmp /etc/fstab && rm /etc/security/limits.conf")
        assert ssh_ok(c, "node2", "tail -1 /etc/fstab; ls /etc/security/limits.conf 2>&1 | grep -c 'No such'"
                      ).stdout == "# node2\n1\n"
        assert host_etc_snapshot() == host
    finally:
        simcluster_factory(3)
    assert host_etc_snapshot() == host


def host_memlock_cap() -> str:
    import resource
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    return "unlimited" if hard == resource.RLIM_INFINITY else str(hard // 1024)


@pytest.mark.integration
def test_limits_d_sets_memlock_at_the_next_login_as_pam_limits_does(simcluster_factory):
    c = fresh(simcluster_factory, 2, {"node1": "h100-memlock-64", "node2": "h100-memlock-64"})
    cap = host_memlock_cap()
    try:
        assert ssh_ok(c, "node1", "ulimit -l; ulimit -H -l").stdout == "64\n64\n"
        assert ssh_ok(c, "node1", "ulimit -l", ).stdout == "64\n"
        ssh_ok(c, "node1", "printf '* soft memlock unlimited\\n* hard memlock unlimited\\n' "
                           "> /etc/security/limits.d/90-cluster-memlock.conf")
        assert ssh_ok(c, "node1", "ulimit -l").stdout == "64\n"           # '*' is not for root (pam_limits)
        assert c.ssh("node1", "true").returncode == 0
        r = subprocess.run(["ssh", "-F", str(c.ssh_config), "-l", "fixer", "node1", "ulimit -l; ulimit -H -l"],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout == f"{cap}\n{cap}\n", r.stderr
        ssh_ok(c, "node1", "printf 'root - memlock unlimited\\n' > /etc/security/limits.d/91-root.conf")
        assert ssh_ok(c, "node1", "ulimit -l").stdout == f"{cap}\n"
        assert ssh_ok(c, "node2", "ulimit -l").stdout == "64\n"           # another node: its own limits.d
        # systemd's DefaultLimitMEMLOCK is what sshd gets at boot (a restart of the node here)
        ssh_ok(c, "node2", "mkdir -p /etc/systemd/system.conf.d && printf '[Manager]\\nDefaultLimitMEMLOCK=infinity\\n' "
                           "> /etc/systemd/system.conf.d/90-cluster-memlock.conf")
        assert ssh_ok(c, "node2", "ulimit -l").stdout == "64\n"
        c.kill("node2")
        simcluster_factory.run("up", "2", "--default-profile", "h100-memlock-64", "--users")
        assert ssh_ok(c, "node2", "ulimit -l; ulimit -H -l").stdout == f"{cap}\n{cap}\n"
    finally:
        simcluster_factory(3)


def ssh_as(c, user: str, node: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(c.ssh_config), "-l", user, node, command],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.integration
def test_users_fixer_has_passwordless_sudo_and_askers_sudo_asks(simcluster_factory):
    c = fresh(simcluster_factory, 2, {"node1": "h100-no-peermem", "node2": "h100-no-peermem"})
    try:
        r = ssh_as(c, "fixer", "node1", "id -un; sudo -n true && echo ok; sudo -n bash -c 'command -v modprobe'")
        assert r.stdout == "fixer\nok\n/run/simcluster/bin/modprobe\n", r.stderr
        r = ssh_as(c, "asker", "node1", "id -un; sudo -n true")
        assert r.returncode == 1 and r.stdout == "asker\n" and "a password is required" in r.stderr
        r = ssh_as(c, "asker", "node1", "modprobe nvidia_peermem")
        assert r.returncode == 1 and "Operation not permitted" in r.stderr
        assert "nvidia_peermem" not in c.ssh("node1", "lsmod").stdout
        r = ssh_as(c, "fixer", "node1", "sudo -n modprobe nvidia_peermem && lsmod")
        assert r.returncode == 0 and r.stdout == tool_out("h100-ib", "lsmod"), r.stderr
        assert "nvidia_peermem" not in c.ssh("node2", "lsmod").stdout
        for u in ("fixer", "asker"):
            inv = (Path(c.dir) / f"cluster-{u}.yaml").read_text()
            assert f"    user: {u}\n" in inv and "    user: root\n" not in inv
        assert "fixer" not in Path("/etc/passwd").read_text()           # the users live on the nodes only
    finally:
        simcluster_factory(3)
    assert not (Path(c.dir) / "cluster-fixer.yaml").exists()


@pytest.mark.integration
def test_up_fresh_restarts_only_a_node_that_commands_changed(simcluster_factory):
    c = simcluster_factory(2, {"node1": "h100-no-peermem", "node2": "h100-no-peermem"})
    c.exec("node1", "modprobe", "nvidia_peermem", check=True)
    assert "nvidia_peermem" in c.exec("node1", "lsmod").stdout
    kept = simcluster_factory.run("up", "2", "--profile", "node1=h100-no-peermem",
                                  "--profile", "node2=h100-no-peermem").stdout
    assert "no changes" in kept                                  # without --fresh: kept
    assert "nvidia_peermem" in c.exec("node1", "lsmod").stdout
    simcluster_factory(2, {"node1": "h100-no-peermem", "node2": "h100-no-peermem"})
    out = simcluster_factory.last_up_output
    assert "node1 restarted (--fresh" in out and "node2" not in out
    assert "nvidia_peermem" not in c.exec("node1", "lsmod").stdout
    assert c.exec("node1", "cat", "/sys/module/nvidia_peermem/version").returncode != 0
