"""cluster/base/bounds.py: the one home of number bounds (limits.yaml) and their checks."""

from __future__ import annotations

import math

import pytest

from cluster.base.bounds import bound, limits, reply_number


@pytest.mark.parametrize("value", [True, False, None, "7", math.nan, math.inf, -math.inf, [1]])
def test_a_reply_number_that_is_not_a_finite_number_is_missing(value):
    assert reply_number(value) is None


def test_a_reply_number_is_kept_in_range_as_a_float_or_as_an_int_when_asked():
    assert reply_number(3, lo=0, hi=3) == 3.0 and isinstance(reply_number(3), float)
    assert reply_number(4, lo=0, hi=3) is None and reply_number(-1, lo=0) is None
    assert reply_number(7, integer=True) == 7 and isinstance(reply_number(7, integer=True), int)
    assert reply_number(7.0, integer=True) is None


def test_every_limit_is_a_finite_number_and_min_max_pairs_are_ordered():
    for section, keys in limits().items():
        for key, value in keys.items():
            assert not isinstance(value, bool) and isinstance(value, (int, float)), (section, key)
            assert math.isfinite(value) and value >= 0, (section, key)
            if key.endswith("_min"):
                base = key[:-len("_min")]
                top = keys.get(base + "_max", keys.get(base))
                assert top is not None and value <= top, (section, key)
    assert bound("plan", "max_model_len_min") <= bound("plan", "max_model_len")
