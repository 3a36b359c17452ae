"""Hostile model manifests and copy inputs (issue 25's hostile-input suite, Hypothesis).

Properties:
- parse_manifest (the laptop's reading of a node's manifest) on random JSON documents and on
  real manifests with fields replaced by random values gives a Manifest whose every entry is
  a plain relative path, a size in range, a 64-hex sha256 and a mode without setuid/setgid/
  sticky or group/other write, or raises ParseError; never another exception;
- the on-node program's file-list reader (read_files) on the same documents accepts only
  entries whose paths stay inside the directory (no "..", no absolute path, no .part) or
  raises Refused;
- the on-node Range parser gives [start, end) inside the file or raises Refused.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.base.errors import ParseError
from cluster.remedy.model_sync import MODE_MASK, parse_manifest
from cluster.node_programs import model_copy

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

_paths = st.one_of(st.text(max_size=30), st.sampled_from([
    "../etc/passwd", "/etc/passwd", "a/../../b", "a//b", "./x", "x.part", "sub/", ".status",
    "a\0b", "a\\b", "config.json", "sub/model.safetensors", "." * 300, "x/" * 3000]))
_numbers = st.one_of(st.integers(min_value=-5, max_value=5), st.integers(),
                     st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                     st.sampled_from([0o4755, 0o777, 0o600, 1 << 50, (1 << 50) - 1, -1]))
_shas = st.one_of(st.text(alphabet="0123456789abcdefABCDEF", min_size=63, max_size=65),
                  st.text(max_size=70), st.just("0" * 64))
_entry = st.fixed_dictionaries({}, optional={"path": _paths, "size": _numbers, "sha256": _shas,
                                             "mode": _numbers, "link": st.booleans()})
_scalars = st.one_of(st.none(), st.booleans(), _numbers, st.text(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
_documents = st.one_of(
    _values,
    st.fixed_dictionaries({"exists": st.one_of(st.booleans(), _scalars),
                           "files": st.one_of(st.lists(_entry, max_size=6), _values)},
                          optional={"skipped": _values, "partial": _numbers, "error": _values}))


def _inside(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and "\0" not in path \
        and not any(p in ("", ".", "..") for p in parts)


@FUZZ
@given(_documents)
def test_parse_manifest_gives_checked_entries_or_a_parse_error(doc):
    try:
        manifest = parse_manifest(doc)
    except ParseError:
        return
    for f in manifest.files:
        assert _inside(f.path) and 0 <= f.size < 1 << 50 and len(f.sha256) == 64
        assert f.mode == f.mode & MODE_MASK
    assert len({f.path for f in manifest.files}) == len(manifest.files)


@FUZZ
@given(_documents)
def test_the_node_reads_only_file_lists_that_stay_inside(doc):
    if not isinstance(doc, dict):
        return
    try:
        files = model_copy.read_files(doc)
    except model_copy.Refused:
        return
    for e in files:
        assert _inside(e["path"]) and not e["path"].endswith(".part")
        assert type(e["size"]) is int and 0 <= e["size"] < 1 << 50
        assert set(e["sha256"]) <= set("0123456789abcdef")


@FUZZ
@given(st.one_of(st.none(), st.text(max_size=40),
                 st.builds(lambda a, b: f"bytes={a}-{b}", st.integers(-3, 1 << 40),
                           st.one_of(st.just(""), st.integers(-3, 1 << 40)))),
       st.integers(min_value=0, max_value=1 << 40))
def test_a_range_header_is_inside_the_file_or_refused(header, size):
    try:
        start, end = model_copy.byte_range(header, size)
    except model_copy.Refused:
        return
    assert 0 <= start <= end <= size and (end > start or size == 0)
