"""`cluster fix --checks model` over real SSH against three simulated nodes: node3 lacks a model
file, holds another with other bytes and an interrupted download (.part); the fix copies them
from the reference node (node1: the head, holding the majority copy) node to node, resumes the
.part, verifies by sha256; a second run changes nothing and preflight's model-match passes.

The model lives under /tmp, which is private to each simulated node (docs/simcluster.md)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from integration_kit import REPO, ClusterCli, ModuleRunDir

pytestmark = pytest.mark.integration
RUN_DIR = ModuleRunDir("fix-model")
MODEL = "/tmp/cluster-fix-model/tiny"
WEIGHTS = "weights/model-00001-of-00001.safetensors"


cli = ClusterCli(timeout=400, env={"CLUSTER_RUN_DIR": RUN_DIR}, stdin=subprocess.DEVNULL,
                 python=sys.executable, no_traceback=True).json


def model_files() -> dict[str, bytes]:
    rng = random.Random(13)
    return {"config.json": b'{"model_type": "llama", "hidden_size": 64}\n',
            "generation_config.json": b'{"do_sample": false}\n',
            "tokenizer.json": bytes(rng.getrandbits(8) for _ in range(20000)),
            "tokenizer_config.json": b'{"model_max_length": 512}\n',
            WEIGHTS: bytes(rng.getrandbits(8) for _ in range(3 * (1 << 20) + 5))}


@pytest.fixture
def setup(simcluster_factory, tmp_path):
    c = simcluster_factory(3)
    files = model_files()
    # The host's /var/tmp is every node's /var/tmp: the source of the nodes' private copies.
    src = Path(tempfile.mkdtemp(prefix="cluster-fix-model-", dir="/var/tmp"))
    for path, data in files.items():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_bytes(data)
    for node in c.names:
        c.exec(node, "rm", "-rf", str(Path(MODEL).parent), check=True)
        c.exec(node, "mkdir", "-p", str(Path(MODEL).parent), check=True)
        c.exec(node, "cp", "-r", str(src), MODEL, check=True)
    # node3: tokenizer.json missing, config.json different, the weights half downloaded.
    c.exec("node3", "rm", f"{MODEL}/tokenizer.json", check=True)
    c.exec("node3", "sh", "-c", f"echo '{{\"model_type\": \"other\"}}' > {MODEL}/config.json",
           check=True)
    c.exec("node3", "sh", "-c", f"head -c 1048576 {MODEL}/{WEIGHTS} > {MODEL}/{WEIGHTS}.part "
                                f"&& rm {MODEL}/{WEIGHTS}", check=True)
    c.exec("node3", "sh", "-c", f"echo mine > {MODEL}/notes.txt", check=True)
    doc = yaml.safe_load(c.inventory_path.read_text())
    doc["model"] = {"path": MODEL}
    doc["run_dir"] = str(tmp_path / "runs")
    inv = tmp_path / "cluster.yaml"
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    yield c, inv, files
    shutil.rmtree(src, ignore_errors=True)
    for node in c.names:
        c.exec(node, "rm", "-rf", str(Path(MODEL).parent))


def model_match(inv: Path) -> dict:
    _, report = cli(inv, "preflight", "--no-clock-skew", "--no-reachability")
    return {r["node"]: r for r in report["results"] if r["check"] == "model-match"}


def sha_on(c, node: str, path: str) -> str | None:
    p = c.exec(node, "sha256sum", f"{MODEL}/{path}")
    return p.stdout.split()[0] if p.returncode == 0 else None


def copy_servers(c, node: str) -> list[str]:
    p = c.exec(node, "ps", "-eo", "args=", check=True)
    return [line for line in p.stdout.splitlines() if "node_program" in line and " relay " in line]


def test_fix_copies_the_model_node_to_node_and_converges(setup):
    c, inv, files = setup
    before = model_match(inv)
    assert before["node3"]["status"] == "fail" and before[None]["status"] == "fail"
    assert "node1" not in before and "node2" not in before

    # Opt-in: without --checks model nothing is copied.
    code, plain = cli(inv, "fix", "--dry-run")
    (r,) = [r for r in plain["results"] if r["node"] == "node3" and r["check"] == "model"]
    assert r["status"] == "skipped" and "--checks model" in r["summary"]

    code, done = cli(inv, "fix", "--checks", "model", "--yes")
    by = {(r["node"], r["check"]): r for r in done["results"]}
    r = by[("node3", "model")]
    assert code == 0, done
    assert r["status"] == "changed" and r["before"] == "fail" and r["after"] == "ok", r
    assert "from node1" in r["summary"] and "notes.txt" in r["summary"]
    assert "undo does not restore" in r["note"]
    for path, data in files.items():
        assert sha_on(c, "node3", path) == hashlib.sha256(data).hexdigest(), path
    assert c.exec("node3", "test", "-e", f"{MODEL}/{WEIGHTS}.part").returncode != 0
    assert c.exec("node3", "cat", f"{MODEL}/notes.txt", check=True).stdout == "mine\n"
    assert copy_servers(c, "node1") == []                      # the relays were stopped
    assert copy_servers(c, "node3") == []
    record = json.loads(Path(done["undo"]).read_text())["entries"]
    (copied,) = [e for e in record if e.get("kind") == "model-files"]
    assert copied["node"] == "node3" and copied["source"] == "node1"
    assert copied["replaced"] == ["config.json"]
    assert sorted(copied["created"]) == ["tokenizer.json", WEIGHTS]

    # Converged: a second run copies nothing, model-match passes.
    code, again = cli(inv, "fix", "--checks", "model", "--yes")
    assert code == 0 and {r["status"] for r in again["results"]} == {"ok"}, again
    after = model_match(inv)
    assert after[None]["status"] == "ok" and set(after) == {None}

    # Undo says the model files stay.
    code, undone = cli(inv, "fix", "--undo", str(Path(done["undo"]).parent), "--yes")
    (kept,) = [r for r in undone["results"] if r["check"] == "model"]
    assert code == 1 and kept["status"] == "skipped" and "not restored" in kept["summary"]
    assert sha_on(c, "node3", "tokenizer.json") == hashlib.sha256(files["tokenizer.json"]).hexdigest()


def test_a_blocked_port_fails_with_the_reason_and_a_rerun_resumes(setup):
    c, inv, files = setup
    low, high = yaml.safe_load((REPO / "cluster" / "data" / "expectations.yaml").read_text()
                               )["model_relay"]["ports"]
    c.firewall("node1", "drop", f"{low}-{high}", "--from", "node3")
    try:
        code, done = cli(inv, "fix", "--checks", "model", "--yes")
        (r,) = [r for r in done["results"] if r["node"] == "node3" and r["check"] == "model"]
        assert code == 2 and r["status"] == "failed" and "cannot download" in r["summary"], r
        assert "not tried" in r["summary"]                # one timeout, not one per file
    finally:
        c.firewall("node1", "clear")
    code, done = cli(inv, "fix", "--checks", "model", "--yes")
    (r,) = [r for r in done["results"] if r["node"] == "node3" and r["check"] == "model"]
    assert code == 0 and r["status"] == "changed", r
    assert sha_on(c, "node3", WEIGHTS) == hashlib.sha256(files[WEIGHTS]).hexdigest()
