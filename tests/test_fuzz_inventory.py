"""Fuzz: malformed inventories (systematic bad values for every field, broken YAML) always give
one clear InventoryError naming file:line and key, and through the CLI exit 2 without a traceback.
Random mutations of a good file either load or raise InventoryError, never anything else."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import yaml

from cluster import inventory
from cluster.errors import InventoryError

BASE = {
    "ssh": {"user": "root", "port": 22, "identity_file": "/keys/id", "known_hosts": "/keys/kh",
            "connect_timeout": 5, "command_timeout": 60, "jump_host": "admin@bastion:22",
            "accept_unknown_host_keys": False},
    "nodes": [
        {"name": "gpu01", "role": "head", "address": "10.0.0.1", "node_ip": "10.0.0.1",
         "nccl_socket_ifname": "eth0", "gloo_socket_ifname": "eth0", "ib_hcas": ["mlx5_0"],
         "env": {"NCCL_DEBUG": "INFO"}, "port": 22, "user": "root", "identity_file": "/k",
         "jump_host": "b:22", "local": False},
        {"name": "gpu02", "address": "10.0.0.2"},
    ],
    "expectations": {"gpu_model": "NVIDIA H100 80GB HBM3", "gpus_per_node": 8,
                     "clock": {"max_skew_ms": 200}, "infiniband": {"min_rate_gbps": 400}},
    "ray": {"port": 6379, "dashboard_port": 8265, "dashboard_host": "127.0.0.1",
            "python": "/opt/venv/bin/python3", "object_store_memory": 1073741824},
    "model": {"path": "/models/llama"},
    "run_dir": "/var/lib/cluster/runs",
}

SHELL_BAD = ["a;reboot", "$(id)", "`id`", "a b", "a|b", "a&&b", "a>b", "x\nreboot", "'q'", "a\\b"]
TYPE_BAD = [["list"], {"map": 1}, True, 3.5, -1]


def _paths(value, at=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, at + (k,))
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        for i, v in enumerate(value):
            yield from _paths(v, at + (i,))
    else:
        yield at


def _set(doc, at, value):
    import copy
    doc = copy.deepcopy(doc)
    cur = doc
    for k in at[:-1]:
        cur = cur[k]
    cur[at[-1]] = value
    return doc


STRING_FIELDS = {"user", "identity_file", "known_hosts", "jump_host", "name", "address", "node_ip",
                 "nccl_socket_ifname", "gloo_socket_ifname", "dashboard_host", "python", "path",
                 "run_dir"}
NUMBER_FIELDS = {"port", "connect_timeout", "command_timeout", "dashboard_port",
                 "object_store_memory", "gpus_per_node", "max_skew_ms", "min_rate_gbps"}


def malformed_cases():
    cases = []
    for at in _paths(BASE):
        field = at[-1]
        if field in STRING_FIELDS:
            for bad in SHELL_BAD[:4] + [["x"]]:
                cases.append((f"{'.'.join(map(str, at))}={bad!r}", yaml.safe_dump(_set(BASE, at, bad))))
        elif field in NUMBER_FIELDS:
            for bad in ("eight", ["8"]) + ((-5,) if field != "max_skew_ms" else ()):
                cases.append((f"{'.'.join(map(str, at))}={bad!r}", yaml.safe_dump(_set(BASE, at, bad))))
        elif field in ("local", "accept_unknown_host_keys"):
            cases.append((f"{field}=maybe", yaml.safe_dump(_set(BASE, at, "maybe"))))
    for name in ("unknown_top", "nodez"):
        cases.append((f"unknown key {name}", yaml.safe_dump({**BASE, name: 1})))
    cases.append(("node unknown key", yaml.safe_dump(_set(BASE, ("nodes", 1, "gpus"), 8))))
    cases.append(("env bad name", yaml.safe_dump(_set(BASE, ("nodes", 0, "env"), {"A-B": "1"}))))
    cases.append(("two heads", yaml.safe_dump(_set(BASE, ("nodes", 1, "role"), "head"))))
    cases.append(("dup name", yaml.safe_dump(_set(BASE, ("nodes", 1, "name"), "gpu01"))))
    good = yaml.safe_dump(BASE)
    cases.append(("tab indentation", good.replace("  ", "\t", 3)))
    cases.append(("unclosed flow", "nodes: [{name: a\n"))
    cases.append(("bad anchor", "nodes: *nothing\n"))
    cases.append(("document is a string", "just text\n"))
    return cases


CASES = malformed_cases()


def test_enough_cases():
    assert len(CASES) >= 50


@pytest.mark.parametrize("label,text", CASES, ids=[c[0][:60] for c in CASES])
def test_malformed_inventory_is_one_clear_error(tmp_path, label, text):
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    with pytest.raises(InventoryError) as err:
        inventory.load(str(f))
    message = str(err.value)
    assert message.startswith(f"{f}:") and err.value.line is not None and err.value.key
    assert "\n" not in message


def test_cli_on_every_malformed_case_exit_2_no_traceback(tmp_path):
    # One interpreter per case would take minutes: run the CLI's main() in one subprocess.
    files = []
    for i, (_, text) in enumerate(CASES):
        f = tmp_path / f"c{i}.yaml"
        f.write_text(text)
        files.append(str(f))
    script = (
        "import sys, io, contextlib\n"
        "from cluster.cli import main\n"
        "for f in sys.argv[1:]:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "        code = main(['-i', f, 'inventory', '--json'])\n"
        "    lines = err.getvalue().strip().splitlines()\n"
        "    ok = code == 2 and len(lines) == 1 and f in lines[0] and 'Traceback' not in err.getvalue()\n"
        "    print('OK' if ok else f'BAD {f} {code} {err.getvalue()!r}')\n")
    proc = subprocess.run([sys.executable, "-c", script, *files], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    bad = [line for line in proc.stdout.splitlines() if not line.startswith("OK")]
    assert not bad and len(proc.stdout.splitlines()) == len(files), bad[:5]


def test_random_mutations_load_or_raise_inventory_error(tmp_path):
    rng = random.Random(1234)
    good = yaml.safe_dump(BASE)
    alphabet = list(":-[]{}&*!|>'\"%@`#,\n\t ;$()") + ["x", "1"]
    for i in range(300):
        chars = list(good)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(chars))
            op = rng.random()
            if op < 0.4:
                del chars[pos]
            elif op < 0.8:
                chars.insert(pos, rng.choice(alphabet))
            else:
                chars[pos] = rng.choice(alphabet)
        try:
            inventory.loads("".join(chars), path=f"mut{i}.yaml")
        except InventoryError as exc:
            assert str(exc).startswith(f"mut{i}.yaml")
