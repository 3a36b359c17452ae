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

from cluster import parsers
from cluster.commands.parse import _as_data
from cluster.errors import ParseError
from cluster.render import to_jsonable

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
        json.dumps(to_jsonable(_as_data(parsed)), allow_nan=False)
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
