"""The tolerance ``benchmarks.regenerate --check`` compares summaries with: host noise in the last bits passes, an
edit of a shown digit is named."""

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from benchmarks.common.equivalence import REL_TOL, differences, json_differences, text_differences

finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12)


def _with_significant_digit_changed(value: float, digit: int) -> float:
    """``value`` with its ``digit``-th significant digit moved by one."""
    exponent = math.floor(math.log10(abs(value)))
    return value + 10.0 ** (exponent - digit + 1)


def test_a_change_in_the_14th_significant_digit_passes_and_one_in_the_3rd_is_named():
    committed = json.dumps({"k4-lrhi": {"probability": {"interval": [-0.18038404659336943, 0.07053909967435767]}}})
    host = committed.replace("0.07053909967435767", "0.07053909967435758")  # seen on another host
    assert json_differences(committed, host) == []
    fourteenth = _with_significant_digit_changed(0.07053909967435767, 14)
    assert fourteenth != 0.07053909967435767
    fourteenth = committed.replace("0.07053909967435767", repr(fourteenth))
    assert json_differences(committed, fourteenth) == []
    third = _with_significant_digit_changed(0.07053909967435767, 3)
    found = json_differences(committed, committed.replace("0.07053909967435767", repr(third)))
    assert found == [f"$.k4-lrhi.probability.interval[1]: committed 0.07053909967435767 regenerated {third!r}"]


@given(finite, st.floats(min_value=-1e-12, max_value=1e-12))
def test_host_noise_in_any_number_passes(value, noise):
    assert json_differences(json.dumps([value]), json.dumps([value * (1 + noise)])) == []
    assert text_differences(f"| a | {value!r} |", f"| a | {value * (1 + noise)!r} |") == []


@given(finite.filter(lambda v: abs(v) > 1e-3), st.floats(min_value=1e-6, max_value=1.0))  # above ABS_TOL
def test_a_change_beyond_the_tolerance_is_named(value, change):
    assert REL_TOL < change
    assert json_differences(json.dumps({"x": value}), json.dumps({"x": value * (1 + change)})) != []


def test_a_shown_digit_differs_by_one_unit_only_where_the_json_had_host_noise():
    committed, rounded_the_other_way = "| k4-lrhi | 0.0705 | 12% |", "| k4-lrhi | 0.0706 | 12% |"
    assert text_differences(committed, rounded_the_other_way, noisy=True) == []
    found = text_differences(committed, rounded_the_other_way)
    assert found and "number 0.0705 (regenerated 0.0706)" in found[0] and "| k4-lrhi | 0.0706 | 12% |" in found[0]
    # two units is an edit, even with noise; so is a word
    assert text_differences(committed, "| k4-lrhi | 0.0707 | 12% |", noisy=True) != []
    assert text_differences(committed, "| k4-lrlo | 0.0705 | 12% |", noisy=True) != []
    # a zero that prints with the sign of its noise
    assert text_differences("+0.000 [-0.010, +0.010]", "-0.000 [-0.010, +0.010]") == []
    # thousands separators and exponents
    assert text_differences("1,960 tok/s, 1.2e-05", "1,960 tok/s, 1.2e-05") == []
    assert text_differences("1,960 tok/s", "1,961 tok/s") != []
    assert text_differences("1.2e-05", "1.3e-05", noisy=True) == []
    assert text_differences("1.2e-05", "1.4e-05", noisy=True) != []


def test_structure_and_kind_decide_as_well_as_numbers():
    assert differences("a.json", '{"a": 1, "b": [1, 2]}', '{"a": 1, "b": [1, 2, 3]}') != []
    assert differences("a.json", '{"a": 1}', '{"b": 1}') != []
    assert differences("a.json", '{"verdict": "equivalent"}', '{"verdict": "not resolved"}') != []
    assert differences("a.json", '{"a": NaN}', '{"a": NaN}') == []
    assert differences("a.json", '{"a": true}', '{"a": 1}') != []
    assert differences("a.md", "line\none", "line\none\ntwo") != []
    assert differences("a.md", "p 0.05", "p 0.05000000000001") == []
