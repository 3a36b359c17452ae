"""Property tests for every registered parser kind: garbage in, a result or a ParseError out.

For arbitrary text, and for real fixtures mutated the way pastes get mangled (lines dropped,
duplicated or swapped, junk and control characters inserted, a line made very long, the text
cut anywhere, digits run long), each kind's parse (through the registry, as `cluster parse`
calls it) either returns a result or raises ParseError, nothing else; a result serialises to
JSON without NaN or infinity (json.dumps(..., allow_nan=False) of the CLI's jsonable form), and
kind detection raises nothing but ParseError. Example counts are modest (the fast suite runs
this file); speed on long inputs is measured by scripts/bench_parse_scale.py, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.inspection import parsers
from cluster.commands.parse import reading_data
from cluster.base.errors import ParseError
from cluster.report.render import to_jsonable

FIXTURES = Path(__file__).parent / "fixtures"
KINDS = parsers.KINDS

# Kinds owned by other modules' maintainers that fail a property today: kind -> reason.
# (Empty when every parser holds; an entry here is an xfail(strict=False), not a skip.)
KNOWN_FAILURES: dict[str, str] = {}

# A "long" mutation makes a line this long: past the 4096-character cap of the line cleaner.
LONG_LINE = 6000

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _kind_param(kind: str):
    marks = [pytest.mark.xfail(reason=KNOWN_FAILURES[kind], strict=False)] \
        if kind in KNOWN_FAILURES else []
    return pytest.param(kind, marks=marks, id=kind)


KIND_PARAMS = [_kind_param(kind) for kind in KINDS]


def _fixture_texts(kind: str) -> list[str]:
    folder = FIXTURES / kind
    paths = sorted(p for p in folder.glob("*") if p.suffix in (".txt", ".log") and p.is_file())
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


FIXTURE_TEXTS = {kind: _fixture_texts(kind) for kind in KINDS}
ALL_TEXTS = [t for texts in FIXTURE_TEXTS.values() for t in texts]


def check(kind: str, text: str) -> None:
    """The property: a result that is finite JSON, or ParseError; detection only ParseError."""
    try:
        parsed = parsers.parse(kind, text)
    except ParseError:
        parsed = None
    if parsed is not None:
        json.dumps(to_jsonable(reading_data(parsed, kind)), allow_nan=False)
    try:
        parsers.detect(text)
    except ParseError:
        pass


# Text that looks like tool output: words of its vocabulary, numbers, separators, controls.
_TOKENS = st.sampled_from([
    "NCCL INFO", "NCCL WARN", "GPU", "Link", "port", "==>", "(Up)", "(Down)", "CA", "'mlx5_0'",
    "State:", "Active", "Rate:", "hca_id:", "GID[0]:", "Module", "Size", "Used by", "nvidia",
    "nvidia_peermem", "Reference ID", "System time", ":", "=", ",", "|", "+/-", "ms", "us", "s",
    "^*", "*", "#", "$", "[root@h ~]#", "node01:", "10.1.2.3:", "n1 | CHANGED | rc=0 >>",
    "NTPSynchronized=yes", "Local time:", "max locked memory", "(kbytes, -l)", "unlimited",
    "Filesystem", "Mounted on", "/dev/shm", "tmpfs", "64M", "NVRM version:", "Kernel Module",
    "Cuda compilation tools, release", "--query-gpu=", "index", "[MiB]", "N/A", "0x1f",
    "1e999", "nan", "inf", "-0", "9" * 400, "1.2.3", " " * 50, "\t", "\r\n", "\n", "\x1b[1m",
    "\x1b]0;t\x07", "\x00", "\ufeff", "(", ")", "[", "]", "{", "}", "'", '"', "ümlaut", "١٢",
])
TOOLISH = st.lists(st.one_of(_TOKENS, st.text(max_size=12), st.integers(-10**6, 10**6).map(str)),
                   max_size=80).map(" ".join)
ARBITRARY = st.one_of(st.text(max_size=400), TOOLISH)


@pytest.mark.parametrize("kind", KIND_PARAMS)
@SETTINGS
@given(text=ARBITRARY)
def test_arbitrary_text_gives_a_result_or_parse_error(kind: str, text: str) -> None:
    check(kind, text)


@st.composite
def mutated(draw, texts: list[str]) -> str:
    lines = draw(st.sampled_from(texts)).split("\n")
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["drop", "dup", "swap", "junk", "long", "cut", "digits",
                                   "control", "prefix"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if op == "drop" and len(lines) > 1:
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, max(0, len(lines) - 1)))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "junk":
            lines.insert(i, draw(TOOLISH))
        elif op == "long":
            pad = draw(st.sampled_from([" ", "x", "1", "a ", ":", ",", "(", "="]))
            at = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + pad * (LONG_LINE // len(pad)) + lines[i][at:]
        elif op == "cut":
            at = draw(st.integers(0, len(lines[i])))
            lines = lines[:i] + [lines[i][:at]]
        elif op == "digits":
            at = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + draw(st.sampled_from(["9" * 5000, "1e999", "-0.0e-999"])) \
                + lines[i][at:]
        elif op == "control":
            at = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + draw(st.sampled_from(["\x00", "\r", "\x1b[", "\x1b]", "\x08",
                                                              "\x7f", "\u2028"])) + lines[i][at:]
        elif op == "prefix":
            lines = [f"node07: {ln}" for ln in lines]
    return "\n".join(lines)


@pytest.mark.parametrize("kind", KIND_PARAMS)
@SETTINGS
@given(data=st.data())
def test_mutated_fixture_gives_a_result_or_parse_error(kind: str, data) -> None:
    texts = FIXTURE_TEXTS[kind] or ALL_TEXTS
    check(kind, data.draw(mutated(texts)))


@pytest.mark.parametrize("kind", KIND_PARAMS)
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_another_kinds_fixture_gives_a_result_or_parse_error(kind: str, data) -> None:
    """The wrong --kind: every other kind's real output, mutated."""
    check(kind, data.draw(mutated(ALL_TEXTS)))


def test_every_kind_is_covered() -> None:
    assert set(KINDS) == set(parsers.MODULES) and len(KINDS) >= 18
    assert all(FIXTURE_TEXTS[k] for k in KINDS), [k for k in KINDS if not FIXTURE_TEXTS[k]]


# ---- issue 26: the new formats keep the facts ------------------------------------------------

from cluster.inspection.parsers import dmesg as _dmesg, nccl as _nccl, nvidia_smi_q as _smi_q  # noqa: E402

_NCCL_FACTS = ("inter_node_transport", "gdr", "n_ranks", "intra_node_transports")
_NCCL_LOGS = sorted((FIXTURES / "nccl").glob("2*.log")) + sorted((FIXTURES / "nccl").glob("0[0-4]*.log"))


def _facts(text: str) -> dict:
    d = _nccl.parse(text).to_dict()
    return {k: d[k] for k in _NCCL_FACTS} | {"errors": sorted(e["kind"] for e in d["errors"])}


@SETTINGS
@given(path=st.sampled_from(_NCCL_LOGS), host=st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True),
       pid=st.integers(1, 10**6), ip=st.tuples(*[st.integers(0, 255)] * 4))
def test_nccl_doubled_fleet_and_ray_prefixes_keep_the_facts(path: Path, host: str, pid: int, ip) -> None:
    """pdsh on top of srun (`host: ` before every line) and a Ray actor prefix change nothing."""
    lines = path.read_text().splitlines()
    want = _facts("\n".join(lines))
    assert _facts("\n".join(f"{host}: {line}" for line in lines)) == want
    ray = f"(RayWorkerWrapper pid={pid}, ip={'.'.join(map(str, ip))}) "
    assert _facts("\n".join(ray + line for line in lines)) == want


@SETTINGS
@given(path=st.sampled_from(_NCCL_LOGS), data=st.data())
def test_nccl_lines_cut_mid_word_give_a_result_or_parse_error(path: Path, data) -> None:
    """Ray cuts an actor's line anywhere: each line cut at a drawn place still parses or refuses."""
    lines = path.read_text().splitlines()
    cuts = data.draw(st.lists(st.integers(0, 400), min_size=len(lines), max_size=len(lines)))
    text = "\n".join(line[:c] if c < len(line) else line for line, c in zip(lines, cuts))
    try:
        d = _nccl.parse(text).to_dict()
    except ParseError:
        return
    assert d["inter_node_transport"] in _nccl.INTER_NODE_TRANSPORTS
    json.dumps(d, allow_nan=False)


_MONO = __import__("re").compile(r"^\[ {0,12}\d{1,10}\.\d{1,9}\]")
_DMESG_MONO = [p for p in sorted((FIXTURES / "dmesg").glob("*.txt"))
               if any(_MONO.match(line) for line in p.read_text().splitlines())]


@SETTINGS
@given(path=st.sampled_from(_DMESG_MONO), delta=st.floats(0, 99999, allow_nan=False), head=st.booleans())
def test_dmesg_relative_stamps_keep_xids_and_aer(path: Path, delta: float, head: bool) -> None:
    """`dmesg -d`/`-H`: every monotonic stamp replaced by a relative one (and a minute header on
    top) gives the same Xids, fallen-off GPUs and AER errors."""
    text = path.read_text()
    rel = "\n".join(_MONO.sub(f"[  +{delta:.6f}]", line) for line in text.splitlines())
    if head:
        rel = "[Dec 1 10:00] usb 1-1: new device\n" + rel
    assert _dmesg.parse(rel).to_dict() == _dmesg.parse(text).to_dict()


_XML_Q = [p for p in sorted((FIXTURES / "nvidia-smi-q").glob("*.txt")) if "<nvidia_smi_log" in p.read_text()]


@SETTINGS
@given(path=st.sampled_from(_XML_Q), data=st.data())
def test_smi_q_xml_fragments_give_a_result_or_parse_error(path: Path, data) -> None:
    """Any contiguous run of lines of a real `nvidia-smi -q -x`, root or not, gives finite JSON
    (with null where the piece does not show a fact) or ParseError."""
    lines = path.read_text().splitlines()
    a = data.draw(st.integers(0, len(lines) - 1))
    b = data.draw(st.integers(a + 1, len(lines)))
    try:
        d = _smi_q.parse("\n".join(lines[a:b])).to_dict()
    except ParseError:
        return
    json.dumps(d, allow_nan=False)
