"""Hostile and careless inventories and plans (issue 17): every reproduction is kept here.

Each bad input gives one InventoryError / PlanFileError `FILE:LINE: key.path: why` (through the
CLI: one stderr line, exit 2, no traceback), in bounded memory and time: the loader caps the
bytes it reads, the nesting depth and the size of the document once aliases are expanded, and
builds every scalar where its key path is known (`port: 2020-13-45` is an invalid date that
PyYAML refuses inside its constructor). Also: numbers finite and in range, validators that
match the whole string with ASCII digits only, real IP parsing, ports 1-65535 including jump
hosts, strict booleans, `cluster runs` on broken run records, secret-looking env names, and
the warning for a dashboard bound beyond loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.nodes import inventory
from cluster.base import yamlfile
from cluster.base.errors import InventoryError, UsageError
from cluster.planning.plan_file import PlanFileError, load_plan, parse_plan
from cluster.report.rundir import RunDir, list_runs
from fakes import cluster_cli, write_inventory

REPO = Path(__file__).resolve().parents[1]
ONE = "nodes:\n  - name: a\n    address: 10.0.0.1\n"


def _cli(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return cluster_cli(*args, timeout=timeout, env=env, cwd=cwd or REPO)


def _one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _error(text: str, path: str = "inv.yaml") -> InventoryError:
    with pytest.raises(InventoryError) as err:
        inventory.loads(text, path=path)
    assert "\n" not in str(err.value)
    assert err.value.line is not None, str(err.value)
    assert str(err.value).startswith(f"{path}:{err.value.line}: "), str(err.value)
    return err.value


# ---------------------------------------------------------------- issue 12: port: 2020-13-45


def test_port_2020_13_45_is_file_line_key_exit_2(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text("nodes:\n  - name: a\n    address: 10.0.0.1\n    port: 2020-13-45\n")
    with pytest.raises(InventoryError) as err:
        inventory.load(str(f))
    assert (err.value.line, err.value.key) == (4, "nodes[0].port")
    assert "2020-13-45" in str(err.value)
    _one_line_exit_2(_cli("-i", str(f), "inventory"), f"{f}:4: nodes[0].port: ")


# Every YAML scalar type that can land in a typed field: (value as written, field, key path).
SCALAR_TYPES = [
    ("date", "port: 2020-01-01", "nodes[0].port"),
    ("invalid date", "port: 2020-13-45", "nodes[0].port"),
    ("timestamp", "port: 2001-12-14t21:59:43.10-05:00", "nodes[0].port"),
    ("invalid timestamp", "port: !!timestamp not-a-time", "nodes[0].port"),
    ("float", "port: 22.0", "nodes[0].port"),
    ("nan", "port: .nan", "nodes[0].port"),
    ("inf", "port: -.inf", "nodes[0].port"),
    ("bool", "port: yes", "nodes[0].port"),
    ("string", "port: '22'", "nodes[0].port"),
    ("binary", "port: !!binary aGVsbG8=", "nodes[0].port"),
    ("invalid binary", "port: !!binary 'a'", "nodes[0].port"),
    ("octal", "port: 022", "nodes[0].port"),
    ("sexagesimal", "port: 22:00", "nodes[0].port"),
    ("hex", "port: 0x16", "nodes[0].port"),
    ("huge int", "port: " + "9" * 5000, "nodes[0].port"),
    ("fullwidth digits", "port: ２２", "nodes[0].port"),
    ("python tag", "port: !!python/object:os.system ls", "nodes[0].port"),
    ("null name", "name: ~", "nodes[0].name"),
    ("date name", "name: 2020-01-01", "nodes[0].name"),
    ("bool local", "local: 'true'", "nodes[0].local"),
    ("null local", "local: 1", "nodes[0].local"),
    ("binary address", "address: !!binary MTAuMC4wLjE=", "nodes[0].address"),
    ("date env", "env: {X: 2020-01-01}", "nodes[0].env.X"),
    ("nan env", "env: {X: .nan}", "nodes[0].env.X"),
]


@pytest.mark.parametrize("label,line,key", SCALAR_TYPES, ids=[s[0] for s in SCALAR_TYPES])
def test_every_scalar_type_in_a_typed_node_field(label, line, key):
    field = line.split(":")[0]
    base = {"name": "name: a", "address": "address: 10.0.0.1"}
    items = [v for k, v in base.items() if k != field] + [line]
    doc = "nodes:\n  - " + items[0] + "\n" + "".join(f"    {x}\n" for x in items[1:])
    err = _error(doc)
    assert err.key == key, str(err)
    assert err.line == len(items) + 1, str(err)


EXPECTATION_TYPES = [
    ("shm inf", "shm_min_bytes: .inf", "expectations.shm_min_bytes"),
    ("shm float", "shm_min_bytes: 1.5", "expectations.shm_min_bytes"),
    ("shm null", "shm_min_bytes: null", "expectations.shm_min_bytes"),
    ("shm date", "shm_min_bytes: 2020-01-01", "expectations.shm_min_bytes"),
    ("clock nan", "clock: {max_offset_ms: .nan}", "expectations.clock.max_offset_ms"),
    ("clock inf", "clock: {max_skew_ms: .inf}", "expectations.clock.max_skew_ms"),
    ("clock null", "clock: {warn_skew_ms: ~}", "expectations.clock.warn_skew_ms"),
    ("clock bool", "clock: {max_offset_ms: true}", "expectations.clock.max_offset_ms"),
    ("clock negative", "clock: {max_offset_ms: -1}", "expectations.clock.max_offset_ms"),
    ("nvlink yes", "nvlink: 'yes'", "expectations.nvlink"),
    ("nvlink 1", "nvlink: 1", "expectations.nvlink"),
    ("ib maybe", "infiniband: {required: maybe}", "expectations.infiniband.required"),
    ("ib 1", "infiniband: {required: 1}", "expectations.infiniband.required"),
    ("ib null", "infiniband: {required: null}", "expectations.infiniband.required"),
    ("ib layer", "infiniband: {link_layer: Infiniband}", "expectations.infiniband.link_layer"),
    ("ib rate nan", "infiniband: {min_rate_gbps: .nan}", "expectations.infiniband.min_rate_gbps"),
    ("rdma maybe", "gpudirect_rdma: maybe", "expectations.gpudirect_rdma"),
    ("gpus float", "gpus_per_node: 8.0", "expectations.gpus_per_node"),
    ("gpus bool", "gpus_per_node: true", "expectations.gpus_per_node"),
    ("gpus negative", "gpus_per_node: -1", "expectations.gpus_per_node"),
    ("memlock word", "memlock_min_kib: lots", "expectations.memlock_min_kib"),
    ("memlock inf", "memlock_min_kib: .inf", "expectations.memlock_min_kib"),
    ("driver bool", "driver_version: true", "expectations.driver_version"),
    ("driver date", "driver_version: 2020-01-01", "expectations.driver_version"),
    ("versions string", "versions_must_match: ray", "expectations.versions_must_match"),
    ("versions bad name", "versions_must_match: ['ray;id']", "expectations.versions_must_match[0]"),
]


@pytest.mark.parametrize("label,line,key", EXPECTATION_TYPES, ids=[s[0] for s in EXPECTATION_TYPES])
def test_expectations_are_typed(label, line, key):
    err = _error(ONE + "expectations:\n  " + line + "\n")
    assert err.key == key and err.line == 5, str(err)


def test_expectations_kept_as_written_and_every_default_key_has_a_type():
    inv = inventory.loads(ONE + "expectations:\n  cuda_version: 12.10\n  driver_version: 550.54\n"
                          "  clock: {max_offset_ms: 0.5}\n  memlock_min_kib: 65536\n"
                          "  infiniband: {required: auto, min_rate_gbps: 200}\n  nvlink: true\n")
    exp = inv.expectations
    assert exp["cuda_version"] == "12.10" and exp["driver_version"] == "550.54"
    assert exp["clock"]["max_offset_ms"] == 0.5 and exp["memlock_min_kib"] == 65536
    assert exp["infiniband"]["required"] == "auto" and exp["nvlink"] is True

    def leaves(d, at=()):
        for k, v in d.items():
            yield from (leaves(v, at + (k,)) if isinstance(v, dict) else [".".join(at + (k,))])
    assert set(leaves(inventory.default_expectations())) == set(inventory._EXPECT_SPEC)


# ---------------------------------------------------------------- numbers where they enter

NUMBERS = [
    ("ssh:\n  connect_timeout: .nan\n", "ssh.connect_timeout"),
    ("ssh:\n  connect_timeout: .inf\n", "ssh.connect_timeout"),
    ("ssh:\n  connect_timeout: 100000\n", "ssh.connect_timeout"),
    ("ssh:\n  connect_timeout: -1\n", "ssh.connect_timeout"),
    ("ssh:\n  connect_timeout: true\n", "ssh.connect_timeout"),
    ("ssh:\n  command_timeout: .inf\n", "ssh.command_timeout"),
    ("ssh:\n  command_timeout: .nan\n", "ssh.command_timeout"),
    ("ssh:\n  command_timeout: 1.0e+400\n", "ssh.command_timeout"),
    ("ssh:\n  command_timeout: 10000000\n", "ssh.command_timeout"),
    ("ssh:\n  port: 0\n", "ssh.port"),
    ("ssh:\n  port: true\n", "ssh.port"),
    ("ray:\n  port: 65536\n", "ray.port"),
    ("ray:\n  object_store_memory: .inf\n", "ray.object_store_memory"),
    ("ray:\n  num_cpus: 1.5\n", "ray.num_cpus"),
    ("ray:\n  dashboard_port: false\n", "ray.dashboard_port"),
]


@pytest.mark.parametrize("text,key", NUMBERS, ids=[n[1] + ":" + n[0].split(": ")[-1].strip()
                                                   for n in NUMBERS])
def test_numbers_finite_in_range_not_bool(text, key):
    err = _error(ONE + text)
    assert err.key == key and err.line == 5, str(err)


def test_good_numbers_still_load():
    inv = inventory.loads(ONE + "ssh:\n  connect_timeout: 2.5\n  command_timeout: 3600\n"
                          "ray:\n  object_store_memory: 10737418240\n")
    assert inv.ssh.connect_timeout == 2.5 and inv.ssh.command_timeout == 3600.0
    assert inv.ray.object_store_memory == 10737418240


def test_run_dir_that_is_a_file_warns_then_one_error(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text("nodes:\n  - {name: a, address: 127.0.0.1, local: true}\nrun_dir: /etc/passwd\n")
    inv = inventory.load(str(f))
    assert any("run_dir" in w and "not a directory" in w for w in inv.warnings)
    with pytest.raises(UsageError, match="/etc/passwd"):
        RunDir.create("/etc/passwd", "exec")
    _one_line_exit_2(_cli("-i", str(f), "exec", "--", "true"), "/etc/passwd", "run_dir")


# ---------------------------------------------------------------- validators mean what they say

VALIDATORS = [
    ('name: "x\\n"', "nodes[0].name"),
    ('name: "gpu01\\n"', "nodes[0].name"),
    ('node_ip: "10.0.0.1\\n"', "nodes[0].node_ip"),
    ('user: "root\\n"', "nodes[0].user"),
    ('nccl_socket_ifname: "eth0\\n"', "nodes[0].nccl_socket_ifname"),
    ('identity_file: "/k\\n"', "nodes[0].identity_file"),
    ('profile: "p\\n"', "nodes[0].profile"),
    ('ib_hcas: ["mlx5_0\\n"]', "nodes[0].ib_hcas[0]"),
    ("ib_hcas: ['mlx5_0:١']", "nodes[0].ib_hcas[0]"),
    ("node_ip: 127.0.0.١", "nodes[0].node_ip"),
    ("node_ip: １２７.0.0.1", "nodes[0].node_ip"),
    ("node_ip: 999.999.999.999", "nodes[0].node_ip"),
    ("node_ip: 10.0.0.256", "nodes[0].node_ip"),
    ("node_ip: 10.0.0", "nodes[0].node_ip"),
    ("node_ip: gpu01.example.org", "nodes[0].node_ip"),
    ("node_ip: '[::1'", "nodes[0].node_ip"),
    ("node_ip: '::g'", "nodes[0].node_ip"),
    ("address: 999.999.999.999", "nodes[0].address"),
    ("address: 127.0.0.١", "nodes[0].address"),
    ("address: -bad.example.org", "nodes[0].address"),
    ("address: bad-.example.org", "nodes[0].address"),
    ("address: a..b", "nodes[0].address"),
    ("address: under_score.example.org", "nodes[0].address"),
    ("address: " + "a" * 64 + ".org", "nodes[0].address"),
    ("jump_host: 'host:99999'", "nodes[0].jump_host"),
    ("jump_host: 'host:0'", "nodes[0].jump_host"),
    ("jump_host: 'host:２２'", "nodes[0].jump_host"),
    ("jump_host: 'host:'", "nodes[0].jump_host"),
    ("jump_host: 'root;id@host'", "nodes[0].jump_host"),
    ("jump_host: 'admin@999.1.1.1:22'", "nodes[0].jump_host"),
    ('jump_host: "host:22\\n"', "nodes[0].jump_host"),
    ("env: {X: \"a\\e]0;title\\a\"}", "nodes[0].env.X"),
]


@pytest.mark.parametrize("line,key", VALIDATORS, ids=[f"v{i:02d}" for i in range(len(VALIDATORS))])
def test_validators_full_string_ascii_real_ip(line, key):
    err = _error(ONE + "    " + line + "\n")
    assert err.key == key and err.line == 4, str(err)


@pytest.mark.parametrize("text,key", [
    ("ssh:\n  jump_host: 'bastion:99999'\n", "ssh.jump_host"),
    ("ssh:\n  jump_host: 'bastion:0'\n", "ssh.jump_host"),
    ("ray:\n  dashboard_host: 999.0.0.1\n", "ray.dashboard_host"),
    ("ray:\n  dashboard_host: \"127.0.0.1\\n\"\n", "ray.dashboard_host"),
    ("secrets:\n  extra_names: ['A B']\n", "secrets.extra_names[0]"),
    ("secrets:\n  extra_names: PIN\n", "secrets.extra_names"),
    ("secrets:\n  names: [PIN]\n", "secrets.names"),
])
def test_cluster_wide_validators(text, key):
    err = _error(ONE + text)
    assert err.key == key and err.line == 5, str(err)


def test_good_hosts_and_jump_hosts_load():
    inv = inventory.loads("nodes:\n  - {name: a, address: 10.0.0.1, jump_host: 'admin@bastion:2222'}\n"
                          "  - {name: b, address: 'fe80::1', node_ip: '::1'}\n"
                          "  - {name: c, address: gpu-03.example.org., jump_host: 10.0.0.9}\n"
                          "  - {name: d, address: '[2001:db8::1]', jump_host: 'b:65535'}\n"
                          "ssh: {jump_host: 'root@j1:1'}\n")
    assert inv.node("a").jump_host == "admin@bastion:2222"
    assert inv.node("b").address == "fe80::1" and inv.node("b").node_ip == "::1"
    assert inv.node("d").jump_host == "b:65535"


def test_a_node_without_address_needs_a_host_name():
    assert inventory.loads("nodes: [{name: gpu01}]\n").nodes[0].address == "gpu01"
    err = _error("nodes:\n  - name: gpu_01\n")
    assert err.key == "nodes[0].name" and "address" in str(err)


# ---------------------------------------------------------------- bounded resources

def _laughs(levels: int = 9, under: str = "ib_hcas") -> str:
    """The 'billion laughs': each level lists the previous one nine times (9**9 leaves)."""
    out = ["nodes:", "  - name: a", "    address: 10.0.0.1", f"    {under}: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        out.append(f"    env{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    out.append(f"    last: *l{levels - 1}")
    return "\n".join(out) + "\n"


def test_billion_laughs_under_ib_hcas_is_refused_not_expanded():
    text = _laughs()
    assert len(text) < 700
    err = _error(text)
    assert "aliases" in str(err) and err.key.startswith("nodes[0]")


def test_billion_laughs_through_the_cli_inventory_and_deploy_plan(tmp_path):
    inv = write_inventory(tmp_path, _laughs())
    _one_line_exit_2(_cli("-i", str(inv), "inventory"), str(inv), "aliases")
    plan = tmp_path / "plan.yaml"
    levels = ["model: /models/m", "reasons: &l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"warnings: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" if i == 1 else
               f"rules: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" if i == 2 else
               f"capacity: {{k{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]}"
               for i in range(1, 3)]
    levels.append("gpu: {a: &l3 [*l2, *l2, *l2, *l2, *l2, *l2, *l2, *l2, *l2], "
                  "b: &l4 [*l3, *l3, *l3, *l3, *l3, *l3, *l3, *l3, *l3], "
                  "c: &l5 [*l4, *l4, *l4, *l4, *l4, *l4, *l4, *l4, *l4], "
                  "d: &l6 [*l5, *l5, *l5, *l5, *l5, *l5, *l5, *l5, *l5]}")
    plan.write_text("\n".join(levels) + "\n")
    with pytest.raises(PlanFileError, match="aliases"):
        load_plan(plan)
    ok = tmp_path / "ok.yaml"
    ok.write_text("nodes:\n  - {name: h, address: 127.0.0.1, local: true}\n"
                  f"run_dir: {tmp_path / 'runs'}\n")
    _one_line_exit_2(_cli("-i", str(ok), "deploy", "--plan", str(plan), "--yes"),
                     str(plan), "aliases")


@pytest.mark.parametrize("text,what", [
    ("nodes: &x [*x]\n", "recursive"),
    ("nodes:\n  - &n {name: a, env: *n}\n", "recursive"),
    ("nodes: " + "[" * 5000 + "]" * 5000 + "\n", "nest"),
    ("nodes: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nest"),
    ("nodes:\n  " + "- " * 5000 + "x\n", "nest"),
    ("nodes:\n" + "".join(" " * i + "a:\n" for i in range(1, 200)) + " " * 200 + "b: 1\n", "nest"),
    ("nodes: [" + "x," * 300_000 + "]\n", "more than 250000 values"),
])
def test_recursive_aliases_and_deep_nesting(text, what):
    assert what in str(_error(text))


def test_aliases_within_bounds_and_merge_keys_still_work():
    inv = inventory.loads("nodes:\n  - &base {name: a, address: 10.0.0.1, port: 2200,"
                          " env: &env {NCCL_DEBUG: INFO}}\n"
                          "  - {<<: *base, name: b, address: 10.0.0.2, env: *env}\n")
    assert inv.node("b").port == 2200 and inv.node("b").env == {"NCCL_DEBUG": "INFO"}
    err = _error("nodes:\n  - &b {name: a, address: 10.0.0.1}\n"
                 "  - {<<: *b, name: c, port: 70000}\n")
    assert err.key == "nodes[1].port" and err.line == 3


def test_dev_zero_and_big_files_end_at_the_cap(tmp_path):
    with pytest.raises(InventoryError, match="larger than 1 MiB"):
        inventory.load("/dev/zero")
    big = tmp_path / "big.yaml"
    big.write_text(ONE + "#" * (2 << 20) + "\n")
    with pytest.raises(InventoryError, match="larger than"):
        inventory.load(str(big))
    with pytest.raises(InventoryError, match="larger than"):
        inventory.loads(ONE + "#" * (2 << 20))
    _one_line_exit_2(_cli("-i", "/dev/zero", "inventory"), "/dev/zero", "larger than")


@pytest.mark.parametrize("content,needle", [
    ("nodes: [{name: a}]\n".encode("utf-16"), "UTF-16"),
    ("nodes: [{name: a}]\n".encode("utf-16-le"), "UTF-16"),
    ("nodes: [{name: a}]\n".encode("utf-16-be"), "UTF-16"),
    ("nodes: [{name: a}]\n".encode("utf-32"), "UTF-32"),
    ("nodes: [{name: ä}]\n".encode("latin-1"), "not UTF-8"),
    (b"nodes: [{name: a}]\n\x00\x01\x02", "binary"),
    (b"nodes: [{name: a\x07}]\n", "control character"),
])
def test_encodings_and_binary_are_one_error(tmp_path, content, needle):
    f = tmp_path / "cluster.yaml"
    f.write_bytes(content)
    with pytest.raises(InventoryError, match=needle) as err:
        inventory.load(str(f))
    assert "\n" not in str(err.value) and str(err.value).startswith(str(f))


def test_utf8_bom_is_fine(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_bytes(b"\xef\xbb\xbf" + ONE.encode())
    assert inventory.load(str(f)).nodes[0].name == "a"


@pytest.mark.parametrize("target", ["/bin/ls", "/dev/zero", "/etc"])
def test_cli_on_files_that_are_not_inventories(target):
    if not Path(target).exists():
        pytest.skip(f"{target} not on this system")
    _one_line_exit_2(_cli("-i", target, "inventory", timeout=30), target)


def test_plan_files_share_the_loader(tmp_path):
    with pytest.raises(PlanFileError, match="larger than"):
        load_plan("/dev/zero")
    with pytest.raises(PlanFileError) as err:
        parse_plan("model: /m\nreplicas: 2020-13-45\n", "p.yaml")
    assert (err.value.line, err.value.key) == (2, "replicas")
    with pytest.raises(PlanFileError, match="UTF-16"):
        f = tmp_path / "p.yaml"
        f.write_bytes("model: /m\n".encode("utf-16"))
        load_plan(f)
    for value in (".nan", ".inf"):
        with pytest.raises(PlanFileError) as err:
            parse_plan(f"model: /m\nengine_args:\n  temperature: {value}\n", "p.yaml")
        assert err.value.key == "engine_args.temperature"
    with pytest.raises(PlanFileError) as err:
        parse_plan("model: /m\nplacement: {strategy: PACK, bundle: {GPU: .nan}}\n", "p.yaml")
    assert err.value.key == "placement.bundle.GPU"
    with pytest.raises(PlanFileError) as err:
        parse_plan('model: /m\nserved_model_name: "x\\n"\n', "p.yaml")
    assert err.value.key == "served_model_name"


def test_yamlfile_api():
    doc = yamlfile.parse("a:\n  b: [1, 1.6e+1]\n  c: 2020-01-01\n", path="f.yaml",
                         error=InventoryError)
    assert doc.data["a"]["b"] == [1, 16]
    assert doc.line(("a", "b", 1)) == 2 and doc.line(("a", "c")) == 3
    assert doc.line(("a", "nope", 3)) == 1 and doc.line(("a", "b", 7)) == 2
    assert doc.text(("a", "b", 1)) == "1.6e+1" and doc.text(("a",)) is None
    e = doc.fail(("a", "b", 1), "why")
    assert isinstance(e, InventoryError) and str(e) == "f.yaml:2: a.b[1]: why"
    assert yamlfile.dotted(()) == "(document)" and yamlfile.dotted(("x", 0, "y")) == "x[0].y"


# ---------------------------------------------------------------- cluster runs

@pytest.mark.parametrize("content,needle", [
    ("[1, 2]", "not a JSON object"),
    ("{", "not valid JSON"),
    ("[" * 100_000, "not valid JSON"),
    ('{"command": "x", "started": "s", "finished": null, "exit_code": NaN}', "not valid JSON"),
    ('{"command": "x", "started": "s", "finished": null, "exit_code": true}', "exit_code"),
    ('{"command": ["x"], "started": "s", "finished": null, "exit_code": 0}', "command"),
    ('{"command": "x", "started": "s", "finished": null, "exit_code": 99999}', "exit_code"),
    ("\xff", "not valid JSON"),
])
def test_runs_with_a_broken_run_json(tmp_path, content, needle):
    runs = tmp_path / "runs"
    (runs / "20260101-000000-000000-up").mkdir(parents=True)
    (runs / "20260101-000000-000000-up" / "run.json").write_text(content, encoding="latin-1")
    good = runs / "20260102-000000-000000-exec"
    good.mkdir()
    (good / "run.json").write_text(json.dumps({"command": "exec", "started": "t",
                                               "finished": "u", "exit_code": 0}))
    listed = list_runs(runs)
    assert [r["command"] for r in listed] == ["exec", None]
    assert needle in listed[1]["error"] and "error" not in listed[0]
    inv = tmp_path / "cluster.yaml"
    inv.write_text(f"nodes:\n  - {{name: a, address: 127.0.0.1, local: true}}\nrun_dir: {runs}\n")
    for extra in ((), ("--json",)):
        proc = _cli("-i", str(inv), "runs", *extra)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(_cli("-i", str(inv), "runs", "--json").stdout)
    assert data["runs"][1]["error"] == listed[1]["error"]


def test_runs_table_escapes_control_characters_and_markup(tmp_path):
    runs = tmp_path / "runs"
    (runs / "r1").mkdir(parents=True)
    (runs / "r1" / "run.json").write_text(json.dumps({
        "command": "up\x1b]0;owned\x07[bold red]", "started": "s", "finished": None,
        "exit_code": None}))
    inv = tmp_path / "cluster.yaml"
    inv.write_text(f"nodes:\n  - {{name: a, address: 127.0.0.1, local: true}}\nrun_dir: {runs}\n")
    proc = _cli("-i", str(inv), "runs")
    assert proc.returncode == 0 and "\x1b" not in proc.stdout and "[bold red]" in proc.stdout


def test_huge_run_json_is_not_read_whole(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "run.json").write_text('{"command": "' + "x" * (2 << 20) + '"}')
    assert "larger than" in list_runs(tmp_path)[0]["error"]


# ---------------------------------------------------------------- secrets

@pytest.mark.parametrize("name", ["DB_PASS", "X_AUTH", "MY_SESSION", "AWS_CREDENTIALS",
                                  "PRIVATE_PEM", "SMTP_PASSWORD", "HF_TOKEN", "API_KEY",
                                  "GH_AUTH", "db_pass", "SESSION_ID", "APP_COOKIE"])
def test_secret_looking_names(name):
    assert inventory.is_secret_name(name)


@pytest.mark.parametrize("name", ["RAY_AUTH_MODE", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME",
                                  "VLLM_HOST_IP", "RAY_SERVE_ENABLE_HA_PROXY", "BYPASS_X",
                                  "PATH", "PWD", "RAY_USAGE_STATS_ENABLED"])
def test_setting_names_are_not_secret(name):
    assert not inventory.is_secret_name(name)


def test_configurable_secret_names_redact_everywhere():
    inv = inventory.loads(ONE + "    env: {MY_PIN: '12345678', DB_PASS: hunter22, LOGLEVEL: x}\n"
                          "secrets:\n  extra_names: [PIN]\n")
    assert inv.secret_names == ("PIN",) and inv.nodes[0].secret_names == ("PIN",)
    shown = inv.to_dict()["nodes"][0]["env"]
    assert shown == {"MY_PIN": "***", "DB_PASS": "***", "LOGLEVEL": "x"}
    assert inv.to_dict()["secrets"] == {"extra_names": ["PIN"]}
    assert "secret_names" not in inv.to_dict()["nodes"][0]
    assert inventory.public_env(inv.nodes[0].env, inv.secret_names) == {"LOGLEVEL": "x"}
    assert inventory.is_secret_name("my_pin", inv.nodes[0].secret_names)
    assert not inventory.is_secret_name("MY_PIN")
    assert set(inv.secret_values()) == {"12345678", "hunter22"}


def test_extra_secret_names_stay_off_the_ray_start_command_line():
    from cluster.inspection.facts import gather_command
    from cluster.ray.ray_cluster import secret_env_stdin, start_command
    inv = inventory.loads(ONE + "    env: {MY_PIN: s3cr3t-pin, DB_PASS: hunter22}\n"
                          "secrets:\n  extra_names: [PIN]\n")
    node = inv.nodes[0]
    command = start_command(node, inv, gpus=[])
    assert "s3cr3t-pin" not in command and "hunter22" not in command
    assert "s3cr3t-pin" not in gather_command(node, inv)
    assert "MY_PIN=s3cr3t-pin" in secret_env_stdin(node)


def test_cli_inventory_redacts_widened_names(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text(ONE + "    env: {DB_PASS: hunter22, X_AUTH: abcd1234, MY_PIN: '98765432'}\n"
                 "secrets: {extra_names: [PIN]}\n")
    for extra in ((), ("--json",)):
        proc = _cli("-i", str(f), "inventory", *extra)
        assert proc.returncode == 0, proc.stderr
        for secret in ("hunter22", "abcd1234", "98765432"):
            assert secret not in proc.stdout + proc.stderr


# ---------------------------------------------------------------- dashboard warning

@pytest.mark.parametrize("host,warns", [("0.0.0.0", True), ("10.0.0.1", True), ("::", True),
                                        ("gpu01.example.org", True), ("127.0.0.1", False),
                                        ("127.1.2.3", False), ("localhost", False),
                                        ("::1", False)])
def test_dashboard_host_beyond_loopback_warns(host, warns):
    inv = inventory.loads(ONE + f"ray:\n  dashboard_host: '{host}'\n")
    got = [w for w in inv.warnings if "dashboard_host" in w]
    assert bool(got) == warns
    if warns:
        assert "no authentication" in got[0] and "\n" not in got[0]
    assert inventory.loads(ONE).warnings == ()


def test_cli_inventory_prints_the_warning_and_exits_1(tmp_path):
    f = write_inventory(tmp_path, ONE + "ray: {dashboard_host: 0.0.0.0}\n")
    proc = _cli("-i", str(f), "inventory", "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "dashboard_host" in proc.stderr
    assert json.loads(proc.stdout)["warnings"]


# ---------------------------------------------------------------- init, --engine-arg

@pytest.mark.parametrize("target,force", [("{tmp}/no/such/dir/cluster.yaml", False),
                                          ("{tmp}", True), ("/dev/null", True)])
def test_init_into_a_bad_place_is_one_error(tmp_path, target, force):
    target = target.format(tmp=tmp_path)
    _one_line_exit_2(_cli("init", target, *(["--force"] if force else [])), target)


def test_engine_arg_values_use_the_bounded_loader():
    from cluster.commands.deploy import _engine_pair
    bomb = "[&a [1,1,1,1,1,1,1,1,1,1], " + ", ".join(
        f"&l{i} [" + ", ".join([f"*{'a' if i == 0 else f'l{i - 1}'}"] * 10) + "]"
        for i in range(6)) + "]"
    assert _engine_pair("x=" + bomb) == ("x", bomb)         # refused as YAML: the text as given
    assert _engine_pair("d=2020-13-45") == ("d", "2020-13-45")
    assert _engine_pair("n=[1, 2]") == ("n", [1, 2]) and _engine_pair("m=8") == ("m", 8)
    with pytest.raises(ValueError, match="aliases"):
        yamlfile.parse_value(bomb)
