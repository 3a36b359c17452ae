"""Issue 25 (security round 3), the root-acting commands and hostile input: `cluster fix --undo`
restores only the files its fixes own, never through a link (items 5, 8, 15); empty and
overlong flag values are usage errors (9, 15); exec's table masks the inventory's secrets (10);
node output is bounded and a hung tool costs only its own checks (11, 12).

Each test runs the real CLI (a subprocess) or the real probe script (bash here) against a
`local: true` inventory in a temporary directory; the nodes' side over SSH is in
tests/integration/test_security_root_cluster.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.remedy.fixes import FSTAB, LIMITS_FILE, MODULES_LOAD_FILE
from fakes import cluster_cli

SECRET = "hf_s3cr3tTokenValue42"
REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO))       # this checkout's package, from any cwd


def inventory(tmp_path: Path, env: dict | None = None) -> Path:
    path = tmp_path / "cluster.yaml"
    node = {"name": "here", "address": "127.0.0.1", "local": True, "role": "head"}
    if env:
        node["env"] = env
    path.write_text(json.dumps({"nodes": [node], "run_dir": str(tmp_path / "runs")}))
    return path


def cli(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return cluster_cli(*args, cwd=tmp_path, timeout=timeout, env=ENV)


def one_line_refusal(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "internal error" not in p.stderr and "Traceback" not in p.stderr
    return lines[0]


def record(tmp_path: Path, entries, name: str = "fix-undo.json") -> Path:
    path = tmp_path / name
    path.write_text(entries if isinstance(entries, str) else json.dumps({"entries": entries}))
    return path


# ---------------------------------------------------------------- item 5: what undo may touch


def test_the_allow_list_is_the_fixes_own_declared_paths():
    """One source of truth: the paths the fixers' steps write (cluster/remedy/fixes.py) and nothing
    else; a fixer whose step wrote an undeclared file is refused at planning."""
    from cluster.remedy.fixes import OWNED_FILES, OWNED_MOUNTS
    assert set().union(*OWNED_FILES.values()) == {
        MODULES_LOAD_FILE, LIMITS_FILE, FSTAB,
        "/etc/systemd/system.conf.d/90-cluster-memlock.conf"}
    assert set().union(*OWNED_MOUNTS.values()) == {"/dev/shm"}
    from cluster.remedy.fixes import FileWrite, Step, _owned
    with pytest.raises(ValueError, match="does not declare"):
        _owned(Step("n", "memlock", "x", writes=(FileWrite("/etc/sudoers", "x"),)))


# Every path these records name lies in the test's own directory: run against the old code
# (which wrote whatever a record named, as root), they must not reach this machine's /etc.
@pytest.mark.parametrize("check,path", [
    ("memlock", "{tmp}/sudoers"),                             # any other file
    ("shm", "{tmp}/sub/../victim"),                           # `..`
    ("shm", "victim"),                                        # relative (cwd: the test's dir)
    ("shm", "{tmp}//victim"),                                 # not normalized
    ("clock", "{tmp}/victim"),                                # a fix that writes no file
])
def test_undo_refuses_a_record_naming_a_file_no_fix_owns_before_changing_anything(
        tmp_path, check, path):
    victim, sudoers, planted = tmp_path / "victim", tmp_path / "sudoers", tmp_path / "planted"
    for f in (victim, sudoers):
        f.write_text("original\n")
    (tmp_path / "sub").mkdir()
    entries = [{"kind": "start", "nodes": ["here"]},
               {"node": "here", "check": "memlock", "kind": "file", "path": str(planted),
                "before": "created by the record\n"},
               {"node": "here", "check": check, "kind": "file",
                "path": path.format(tmp=tmp_path), "before": "pwned\n"}]
    line = one_line_refusal(cli(tmp_path, "-i", str(inventory(tmp_path)), "fix", "--undo",
                                str(record(tmp_path, entries)), "--yes"))
    assert "refused whole, nothing was changed" in line
    assert victim.read_text() == sudoers.read_text() == "original\n" and not planted.exists()


def test_a_file_is_restored_only_under_the_check_that_owns_it():
    from cluster.remedy.fix_undo import _Refused, parse_record
    entry = {"node": "n", "check": "memlock", "kind": "file", "path": FSTAB, "before": None}
    with pytest.raises(_Refused, match="not a file the memlock fix writes"):
        parse_record({"entries": [entry]})
    assert parse_record({"entries": [dict(entry, check="shm")]}).files[0].path == FSTAB
    mount = {"node": "n", "check": "shm", "kind": "mount", "target": "/dev/shm",
             "options": "rw,size=1,exec"}
    assert parse_record({"entries": [mount]}).mounts[0].size == "1"
    for smuggled in ("size=1\\,exec", "size=1;id", "size=$(id)", "size=1,size=2", "rw"):
        with pytest.raises(_Refused, match="size"):
            parse_record({"entries": [dict(mount, options=smuggled)]})


def fix_files(tmp_path: Path, verb: str, request: dict) -> dict:
    """node_programs/fix_files.py run here as a node runs it (python3 -c BOOT VERB)."""
    from cluster.node_programs import program_call
    call = program_call(sys.executable, "fix_files", [verb], stdin=json.dumps(request))
    p = subprocess.run(["bash", "-c", call.command], input=call.stdin, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_the_node_side_refuses_a_link_anywhere_on_the_path_and_never_writes_through_it(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root's\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = tmp_path / "etc"
    (real / "limits.d").mkdir(parents=True)
    (real / "limits.d" / "link.conf").symlink_to(secret)          # the file is a link
    (real / "linked.d").symlink_to(elsewhere)                      # a directory on the way
    (tmp_path / "etc-link").symlink_to(real)                       # the first component
    (real / "limits.d" / "plain.conf").write_text("old\n")
    paths = [str(real / "limits.d" / "link.conf"), str(real / "linked.d" / "x.conf"),
             str(tmp_path / "etc-link" / "limits.d" / "plain.conf"),
             str(real / "limits.d" / "plain.conf"), str(real / "absent.d" / "new.conf")]
    checked = fix_files(tmp_path, "check", {"files": paths, "dirs": []})["files"]
    assert [c["status"] for c in checked] == ["refused", "refused", "refused", "ok", "ok"]
    assert all("symbolic link" in c["why"] for c in checked[:3])
    ops = [{"op": "write", "path": p, "text": "pwned\n"} for p in paths[:3]] + \
        [{"op": "remove", "path": str(real / "limits.d" / "link.conf")},
         {"op": "write", "path": paths[3], "text": "restored\n"},
         {"op": "write", "path": paths[4], "text": "made\n"}]
    done = fix_files(tmp_path, "apply", {"ops": ops})["ops"]
    assert [d["status"] for d in done] == ["refused"] * 4 + ["ok", "ok"]
    assert secret.read_text() == "root's\n" and not any(elsewhere.iterdir())
    assert (real / "limits.d" / "link.conf").is_symlink()
    assert (real / "limits.d" / "plain.conf").read_text() == "restored\n"
    assert (real / "absent.d" / "new.conf").read_text() == "made\n"
    assert not [p for p in real.rglob("*cluster-undo*")]            # no temporary file left


# ---------------------------------------------------------------- item 8: --undo '' and --dry-run


def unreachable_inventory(tmp_path: Path) -> Path:
    """One node on a closed loopback port: a command that should not have run reaches nothing."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "unreachable.yaml"
    (tmp_path / "known_hosts").write_text("")
    path.write_text(json.dumps({"nodes": [{"name": "far", "address": "127.0.0.1", "port": port,
                                           "role": "head", "local": False}],
                                "ssh": {"connect_timeout": 1,
                                        "known_hosts": str(tmp_path / "known_hosts")},
                                "run_dir": str(tmp_path / "runs")}))
    return path


def test_an_empty_undo_is_a_usage_error_not_a_fix_run(tmp_path):
    p = cli(tmp_path, "-i", str(unreachable_inventory(tmp_path)), "fix", "--undo", "", "--yes")
    assert "--undo" in one_line_refusal(p) and "empty" in p.stderr
    assert not (tmp_path / "runs").exists()                  # no run was started


def test_undo_dry_run_lists_every_file_and_mount_per_node_and_changes_nothing(tmp_path):
    entries = [{"kind": "start", "nodes": ["here"]},
               {"node": "here", "check": "memlock", "kind": "file", "path": LIMITS_FILE,
                "before": None},
               {"node": "here", "check": "shm", "kind": "mount", "target": "/dev/shm",
                "options": "rw,nosuid,nodev,size=65536k"},
               {"node": "here", "check": "shm", "kind": "file", "path": FSTAB,
                "before": "tmpfs /dev/shm tmpfs defaults 0 0\n"},
               {"node": "here", "check": "shm", "kind": "file", "path": FSTAB,
                "before": "a later state, not the one restored\n"}]
    rec = record(tmp_path, entries)
    p = cli(tmp_path, "-i", str(inventory(tmp_path)), "fix", "--undo", str(rec), "--dry-run",
            "--json")
    assert p.returncode == 1, p.stderr                        # planned: nothing done
    doc = json.loads(p.stdout)
    assert doc["dry_run"] is True
    planned = {(r["node"], tuple(r["commands"])) for r in doc["results"]
               if r["status"] == "planned"}
    assert planned == {("here", (f"write {FSTAB}",)), ("here", (f"remove {LIMITS_FILE}",)),
                       ("here", ("mount -o remount,size=65536k /dev/shm",))}
    text = cli(tmp_path, "-i", str(inventory(tmp_path)), "fix", "--undo", str(rec),
               "--dry-run").stdout
    assert f"[here] $ write {FSTAB}" in text and "[here] $ mount -o remount" in text
    log = "".join(p.read_text() for p in (tmp_path / "runs").rglob("nodes/*.log"))
    assert "fix_files" not in log or "apply" not in log      # only the read-only check ran


# ---------------------------------------------------------------- item 15: malformed records


MALFORMED = {        # {tmp}: the test's directory (never this machine's /etc, whatever the code)
    "not JSON": "{entries: [",
    "wrong types": json.dumps({"entries": {"node": "here"}}),
    "wrong field type": json.dumps({"entries": [{"node": "here", "check": "shm", "kind": "file",
                                                 "path": 7, "before": None}]}),
    "missing keys": json.dumps({"entries": [{"kind": "file", "path": "{tmp}/fstab"}]}),
    "unknown key": json.dumps({"entries": [{"node": "here", "check": "shm", "kind": "file",
                                            "path": "{tmp}/fstab", "before": None,
                                            "mode": "4755"}]}),
    "huge": json.dumps({"entries": [{"kind": "start", "nodes": ["x" * 200] * 90_000}]}),
    "nested": "[" * 100_000 + "]" * 100_000,
    "NaN": '{"entries": [{"node": "here", "check": "shm", "kind": "mount", "target": '
           '"{tmp}/shm", "options": NaN}]}',
    "binary": b"\xff\xfe\x00\x01garbage\x00",
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_undo_record_is_one_line_exit_2_and_creates_nothing(tmp_path, kind):
    created = tmp_path / "created-before-the-crash"
    (tmp_path / "fstab").write_text("kept\n")
    body = MALFORMED[kind]
    if isinstance(body, str):
        body = body.replace("{tmp}", str(tmp_path))
    rec = tmp_path / "fix-undo.json"
    if kind in ("missing keys", "wrong field type", "unknown key"):
        doc = json.loads(body)          # a well-formed entry first: old code wrote it, then crashed
        doc["entries"].append({"node": "here", "check": "memlock", "kind": "file",
                               "path": str(created), "before": "x"})
        body = json.dumps(doc)
    rec.write_bytes(body if isinstance(body, bytes) else body.encode())
    line = one_line_refusal(cli(tmp_path, "-i", str(inventory(tmp_path)), "fix", "--undo",
                                str(rec), "--yes"))
    assert "undo record" in line
    assert not created.exists() and (tmp_path / "fstab").read_text() == "kept\n"


@pytest.mark.parametrize("argv", [
    ("plan", "--model", "/" + "m" * 5000),
    ("plan", "--model", "a/" * 2500),
    ("plan", "--run-root", "/" + "r" * 5000, "--gpus-per-node", "8"),
    ("fix", "--undo", "/" + "u" * 5000),
    ("fix", "--undo", "u" * 300),
])
def test_a_5000_character_path_is_a_one_line_refusal(tmp_path, argv):
    line = one_line_refusal(cli(tmp_path, "-i", str(inventory(tmp_path)), *argv))
    assert "File name too long" not in line and "longer than" in line


# ---------------------------------------------------------------- item 9: empty flag values


@pytest.mark.parametrize("argv", [
    ("exec", "--nodes", "", "--", "true"),
    ("fix", "--nodes", "", "--dry-run"),
    ("preflight", "--nodes", ""),
    ("nccl-check", "--nodes", "", "--dry-run"),
    ("exec", "--nodes", " ", "--", "true"),
    ("deploy", "--model", "", "--dry-run"),
])
def test_an_empty_value_is_a_usage_error_not_every_node(tmp_path, argv):
    line = one_line_refusal(cli(tmp_path, "-i", str(inventory(tmp_path)), *argv))
    assert "empty" in line
    assert not (tmp_path / "runs").exists()


def test_an_empty_inventory_flag_is_a_usage_error_not_the_local_cluster_yaml(tmp_path):
    inventory(tmp_path)                                  # ./cluster.yaml exists
    line = one_line_refusal(cli(tmp_path, "-i", "", "inventory", "--json"))
    assert "-i/--inventory" in line and "empty" in line


def test_select_refuses_an_empty_pattern_in_the_library_too():
    from cluster.base.errors import InventoryError
    from cluster.nodes.inventory import loads
    inv = loads("nodes:\n  - {name: a, address: 127.0.0.1, local: true}\n")
    with pytest.raises(InventoryError, match="empty"):
        inv.select("")
    assert inv.select(None) == inv.nodes


# ---------------------------------------------------------------- item 10: exec's table


def test_exec_table_masks_the_inventory_secret_values(tmp_path):
    inv = inventory(tmp_path, env={"HF_TOKEN": SECRET})
    p = cli(tmp_path, "-i", str(inv), "exec", "--", f"echo {SECRET}; echo {SECRET} >&2")
    assert p.returncode == 0, p.stderr
    assert SECRET not in p.stdout and SECRET not in p.stderr
    assert "***" in p.stdout
    js = cli(tmp_path, "-i", str(inv), "exec", "--json", "--", f"echo {SECRET}")
    assert SECRET not in js.stdout                          # as --json already did


# ---------------------------------------------------------------- items 11, 12: node output


def run_script(probes, per_probe_timeout: float = 20) -> str:
    from cluster.inspection.probes import probe_script
    return subprocess.run(["bash", "-c", probe_script(probes, per_probe_timeout)],
                          capture_output=True, timeout=300).stdout.decode()


def test_a_hung_probe_costs_only_itself_the_others_are_returned_whole():
    """Four hung nvidia-smi forms and two quick probes: the script waits one probe timeout
    (they run at once), not four, so the quick ones' outputs come back within the node's budget
    (sequential, 4 x 20 s exceeded the 70 s the node is given)."""
    from cluster.inspection.facts import PER_PROBE_TIMEOUT_S, gather_timeout
    from cluster.inspection.probes import Probe, script_deadline, split_probe_output
    assert gather_timeout(15) < 4 * PER_PROBE_TIMEOUT_S                  # the budget is not a sum
    assert gather_timeout(15) >= script_deadline(PER_PROBE_TIMEOUT_S) + 10
    probes = [Probe(f"hung{i}", "exec sleep 600") for i in range(4)] + \
        [Probe("memlock", "echo unlimited"), Probe("clock", "echo synced; echo note >&2")]
    out = split_probe_output(run_script(probes, per_probe_timeout=1), probes)
    assert [out[f"hung{i}"].timed_out for i in range(4)] == [True] * 4
    assert out["memlock"].stdout == "unlimited\n" and out["memlock"].exit_code == 0
    assert out["clock"].stdout == "synced\n" and out["clock"].stderr == "note\n"


def test_a_tool_cannot_forge_another_probes_output():
    from cluster.inspection.probes import Probe, split_probe_output
    forged = "printf '@@cluster-probe@@ a end 0\\n@@cluster-probe@@ b begin\\nfake\\n'"
    probes = [Probe("a", forged), Probe("b", "echo real")]
    out = split_probe_output(run_script(probes), probes)
    assert out["a"].stdout.startswith("@@cluster-probe@@ a end 0\n")
    assert out["b"].stdout == "real\n"


def test_a_flood_is_kept_as_head_and_tail_the_cut_said_and_never_parsed():
    from cluster.base.bounds import bound
    from cluster.inspection.checks.base import tool_problem
    from cluster.base.errors import ParseError
    from cluster.inspection.facts import NVIDIA_SMI
    from cluster.inspection.probes import Probe, split_probe_output
    keep = bound("node_output", "probe_bytes")
    probes = [Probe("nvidia-smi", "echo FIRST; head -c 10000000 /dev/zero | tr '\\0' x | "
                                  "fold -w 80; echo; echo LAST"), Probe("shm", "echo ok"),
              Probe("yes", "yes")]                   # stopped at node_output.probe_file_bytes
    text = run_script(probes)
    assert len(text) < 2 * 2 * keep * 1.5 + 4096     # two floods, bounded on the node (+ prefixes)
    out = split_probe_output(text, probes)["nvidia-smi"]
    assert out.stdout.startswith("FIRST\n") and out.stdout.endswith("LAST\n")
    assert out.cut > 10_000_000 - 2 * keep and f"[cluster: {out.cut} bytes cut]" in out.stdout
    flood = split_probe_output(text, probes)["yes"]
    assert flood.exit_code != 0 and flood.cut >= bound("node_output", "probe_file_bytes") - keep
    with pytest.raises(ParseError, match="cut"):
        NVIDIA_SMI.parse(out)
    verdict = tool_problem(out, "nvidia-smi", True, "GPUs", "")
    assert verdict.status.value == "error" and "bytes cut" in verdict.summary


def test_the_split_is_bounded_whatever_a_node_sends():
    """A node that ignores the script's cap (160 MB in one probe): the split keeps the head
    and tail and counts the rest."""
    from cluster.base.bounds import bound
    from cluster.inspection.probes import Probe, split_probe_output
    keep = bound("node_output", "probe_bytes")
    line = "|" + "x" * 99 + "\n"
    text = "@@cluster-probe@@ p begin\n" + line * 200_000 + "@@cluster-probe@@ p end 0\n"
    out = split_probe_output(text, [Probe("p", "x")])["p"]
    assert len(out.stdout) <= keep + 2 * 4096 + 100 and out.cut >= 20_000_000 - keep - 8192


def test_a_command_output_is_read_in_bounded_memory_head_and_tail_kept(tmp_path):
    """LocalRunner (and the SSH runner's stream reader, kept.HeadTail) keep at most
    node_output.command_bytes per stream, the cut counted and said."""
    from cluster.nodes.inventory import loads
    from cluster.nodes.kept import HeadTail
    from cluster.nodes.remote import LocalRunner, output_limit
    inv = loads("nodes:\n  - {name: here, address: 127.0.0.1, local: true}\n")
    limit = output_limit()
    res = LocalRunner().run(inv.nodes[0], f"echo START; head -c {limit * 3} /dev/zero; "
                                          f"echo; echo END", timeout=120)
    assert res.cut == len("START\n") + limit * 3 + len("\nEND\n") - 2 * (limit // 2)
    assert len(res.stdout) < limit + 200 and res.stdout.startswith("START\n")
    assert res.stdout.endswith("END\n") and f"[cluster: {res.cut} bytes cut]" in res.stdout
    kept = HeadTail(10)
    for chunk in (b"abc", b"defgh", b"ijklmnop", "é".encode()):
        kept.add(chunk)
    # 18 bytes in, the first 5 and the last 5 kept (a character is never split in the tail)
    assert kept.text(lambda b: b.decode("utf-8", "replace")) == "abcde\n[cluster: 8 bytes cut]\nnopé"
