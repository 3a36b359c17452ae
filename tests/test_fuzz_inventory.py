"""Fuzz: malformed inventories (systematic bad values for every field, broken YAML) always give
one clear InventoryError naming file:line and key, and through the CLI exit 2 without a traceback.
Random mutations of a good file either load or raise InventoryError, never anything else."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
import yaml

from cluster.nodes import inventory
from cluster.base.errors import InventoryError
from fakes import write_inventory

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
    f = write_inventory(tmp_path, text)
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


# ---------------------------------------------------------------- Hypothesis (issue 17)
# Random YAML documents and mutated real inventories: the loader returns an Inventory or raises
# InventoryError (one line, naming the file), never anything else; through the CLI: exit 0/1/2,
# one stderr line on error, no traceback.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FIELDS = sorted(inventory._NODE_KEYS | inventory._SSH_KEYS | set(inventory._RAY_INT_KEYS)
                 | {"dashboard_host", "nodes", "ssh", "ray", "expectations", "clock",
                    "max_offset_ms", "shm_min_bytes", "nvlink", "infiniband", "required",
                    "secrets", "extra_names", "run_dir", "model", "path"})
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["2020-01-01", "2020-13-45", "2001-12-14t21:59:43.10-05:00", ".nan", ".inf",
                     "-.inf", "yes", "no", "~", "0x1F", "022", "22:00", "!!binary aGk=",
                     "!!binary a", "127.0.0.\u0661", "\uff12\uff12", "999.999.999.999",
                     "host:99999", "host:0", "x\n", "0.0.0.0", "*undefined", "&a x",
                     "!!python/object:os.system ls", "'quoted'", "\"esc\\e[2J\"", "1e400",
                     "1.0e+400", "- a", "{a: 1}", "[1, 2"]),
    st.text(max_size=12))
_KEYS = st.one_of(st.sampled_from(_FIELDS), st.text(max_size=8))


def _yaml_value(depth: int):
    if depth <= 0:
        return _SCALARS
    child = _yaml_value(depth - 1)
    return st.one_of(_SCALARS, st.lists(child, max_size=4),
                     st.dictionaries(_KEYS, child, max_size=5))


def _render(value, indent: int = 0) -> str:
    """Hand-made YAML (flow style) so raw scalars like `2020-13-45` or `!!binary a` reach the
    loader as written, not as yaml.safe_dump would quote them."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)}: {_render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    if isinstance(value, str) and value and value.isprintable() and "," not in value \
            and "}" not in value and "]" not in value:
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _key(k) -> str:
    return k if isinstance(k, str) and k.isidentifier() else json.dumps(str(k))


_DOCS = st.one_of(
    _yaml_value(3).map(_render),
    st.dictionaries(_KEYS, _yaml_value(2), max_size=6).map(
        lambda d: "\n".join(f"{_key(k)}: {_render(v)}" for k, v in d.items()) + "\n"),
    st.builds(lambda nodes, extra: "nodes:\n" + "".join(f"  - {_render(n)}\n" for n in nodes)
              + "".join(f"{_key(k)}: {_render(v)}\n" for k, v in extra.items()),
              st.lists(st.dictionaries(st.sampled_from(sorted(inventory._NODE_KEYS)), _SCALARS,
                                       max_size=6), min_size=1, max_size=3),
              st.dictionaries(st.sampled_from(["ssh", "ray", "expectations", "secrets"]),
                              st.dictionaries(_KEYS, _SCALARS, max_size=4), max_size=3)),
)


def _load_or_inventory_error(text: str, path: str = "fuzz.yaml") -> None:
    try:
        inv = inventory.loads(text, path=path)
    except InventoryError as exc:
        message = str(exc)
        assert message.startswith(path) and "\n" not in message, message
        return
    assert inv.nodes and all(isinstance(n.port, int) and not isinstance(n.port, bool)
                             and 1 <= n.port <= 65535 for n in inv.nodes)
    assert math.isfinite(inv.ssh.connect_timeout) and math.isfinite(inv.ssh.command_timeout)
    json.dumps(inv.to_dict(), allow_nan=False, default=str)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_DOCS)
def test_hypothesis_random_documents_load_or_raise_inventory_error(text):
    _load_or_inventory_error(text)


_GOOD = yaml.safe_dump(BASE)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_GOOD)), st.integers(0, 3),
                          st.one_of(st.sampled_from(list(":-[]{}&*!|>'\"%@`#,\n\t ;$()\\")
                                                    + ["x", "1", "\x00", "\x1b", "\ufeff", "\u0661",
                                                       ".nan", "2020-13-45", "&a ", "*a", "<<: ",
                                                       "!!binary ", "99999"]),
                                    st.text(max_size=3))),
                min_size=1, max_size=5))
def test_hypothesis_mutated_real_inventory(edits):
    text = _GOOD
    for pos, cut, insert in edits:
        pos = min(pos, len(text))
        text = text[:pos] + insert + text[pos + cut:]
    _load_or_inventory_error(text)


_FIELD_PATHS = list(_paths(BASE))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_FIELD_PATHS), _yaml_value(1))
def test_hypothesis_one_field_of_a_real_inventory_gets_any_yaml_value(at, value):
    """Every field of a good inventory given any scalar as written (dates, .nan, !!binary,
    2020-13-45, ...) or a small collection: it loads with sane values or is one clear error."""
    text = yaml.safe_dump(_set(BASE, at, "@@PLACEHOLDER@@"), width=10**6)
    text = text.replace("'@@PLACEHOLDER@@'", _render(value)).replace("@@PLACEHOLDER@@",
                                                                       _render(value))
    _load_or_inventory_error(text)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(_DOCS, min_size=10, max_size=10))
def test_hypothesis_cli_exit_0_1_2_one_line_no_traceback(tmp_path, texts):
    # One interpreter for a batch of files (an interpreter per example would take minutes).
    files = []
    for i, text in enumerate(texts):
        f = tmp_path / f"h{i}.yaml"
        f.write_bytes(text.encode("utf-8", "replace"))
        files.append(str(f))
    proc = subprocess.run([sys.executable, "-c", _CLI_SCRIPT, *files], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bad = [line for line in proc.stdout.splitlines() if not line.startswith("OK")]
    assert not bad and len(proc.stdout.splitlines()) == len(files), bad[:3]


_CLI_SCRIPT = (
    "import sys, io, contextlib, json\n"
    "from cluster.cli import main\n"
    "for f in sys.argv[1:]:\n"
    "    err, out = io.StringIO(), io.StringIO()\n"
    "    try:\n"
    "        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):\n"
    "            code = main(['-i', f, 'inventory', '--json'])\n"
    "    except BaseException as exc:\n"
    "        print(f'BAD {f} raised {type(exc).__name__}: {exc}'); continue\n"
    "    text = err.getvalue()\n"
    "    lines = text.strip().splitlines()\n"
    "    ok = code in (0, 1, 2) and 'Traceback' not in text\n"
    "    ok = ok and (code != 2 or (len(lines) == 1 and f in lines[0]))\n"
    "    ok = ok and (code == 2 or 'NaN' not in out.getvalue() and 'Infinity' not in out.getvalue())\n"
    "    print('OK' if ok else f'BAD {f} {code} {text!r}')\n")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=300),
                 st.text(alphabet=st.characters(codec="utf-8"), max_size=300),
                 st.binary(max_size=300).map(lambda b: b.decode("latin-1"))))
def test_hypothesis_any_text_at_all(text):
    _load_or_inventory_error(text)


def test_lone_surrogate_is_one_error():
    with pytest.raises(InventoryError, match="Unicode"):
        inventory.loads("nodes: [{name: \ud800}]\n", path="s.yaml")
