"""benchmarks/common/intervals.py: exact t quantiles, intervals, paired differences, Holm's correction and the
equivalence test (TOST) the studies report with."""

import math
import statistics

import pytest

from benchmarks.common.intervals import (
    equivalence,
    equivalence_from_summary,
    holm,
    mean_interval,
    p_value,
    paired_difference,
    paired_test,
    t_quantile,
)


@pytest.mark.parametrize(
    "dof, exact",
    [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (5, 2.570582), (15, 2.131450), (30, 2.042272)],
)
def test_t_quantiles_are_the_table_values(dof, exact):
    assert t_quantile(0.975, dof) == pytest.approx(exact, abs=1e-6)


def test_t_quantile_refuses_what_has_none():
    with pytest.raises(ValueError, match="degree of freedom"):
        t_quantile(0.975, 0)
    with pytest.raises(ValueError, match="between 0 and 1"):
        t_quantile(1.0, 3)


def test_intervals_use_the_exact_quantile():
    interval = mean_interval([1.0, 2.0, 3.0, 4.0])  # mean 2.5, sd 1.290994, t(3) = 3.182446
    assert interval.mean == 2.5 and interval.high - 2.5 == pytest.approx(3.182446 * 1.290994 / 2, rel=1e-6)
    assert not interval.excludes(1.0) and interval.excludes(0.0)
    two = mean_interval([0.0, 1.0])  # sd 0.707107, se 0.5, t(1) = 12.706205: the width the old expansion got wrong
    assert (two.low, two.high) == pytest.approx((0.5 - 6.353102, 0.5 + 6.353102), abs=1e-6)
    assert math.isclose(mean_interval([5.0]).low, 5.0)


def test_paired_difference_drops_the_common_seed_effect():
    a = {seed: 10.0 * seed + 0.1 for seed in range(8)}
    b = {seed: 10.0 * seed for seed in range(9)}  # seed 8 has no partner: left out
    difference = paired_difference(a, b)
    assert difference.n == 8 and difference.mean == pytest.approx(0.1) and difference.excludes(0.0)


def test_p_value_matches_the_interval():
    values = [0.3, 0.1, 0.5, 0.2, 0.4]
    interval = mean_interval(values)
    # the 95% interval's end is the null at which the two-sided p-value is exactly 0.05
    assert p_value(values, null=interval.low) == pytest.approx(0.05, abs=1e-9)
    assert p_value(values) < 0.05 and interval.excludes(0.0)
    assert p_value([0.0, 0.0]) == 1.0 and p_value([1.0, 1.0]) == 0.0


def test_holm_steps_down_and_keeps_order():
    # sorted 0.01, 0.02, 0.03, 0.04 times 4, 3, 2, 1 -> 0.04, 0.06, 0.06, 0.06 (non-decreasing), in the given order
    assert holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.04]) == [0.04]  # a family of one is not corrected
    # three raw p-values below 0.05: Holm keeps the first two only
    adjusted = holm([0.001, 0.012, 0.03, 0.2])
    assert [p <= 0.05 for p in adjusted] == [True, True, False, False]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm([0.1, 1.5])


def test_equivalence_needs_the_whole_90_percent_interval_inside_the_margin():
    tight = [0.01, -0.01, 0.02, 0.0, -0.02, 0.01, 0.0, -0.01]
    shown = equivalence(tight, margin=0.05)
    assert shown.equivalent and shown.p < 0.05 and -0.05 < shown.low < shown.high < 0.05
    # the same mean with a wide spread: the interval reaches past the margin, so equivalence is not shown
    wide = [0.2, -0.2, 0.15, -0.15, 0.0]
    assert not equivalence(wide, margin=0.05).equivalent
    # the boundary: the p-value is 0.05 exactly where the 90% interval's end touches the margin
    values = [0.02, 0.05, -0.01, 0.03]
    result = equivalence(values, margin=0.1)
    touching = equivalence(values, margin=max(abs(result.low), abs(result.high)))
    assert touching.p == pytest.approx(0.05, abs=1e-9)
    # a mean outside the margin is never equivalent, however tight
    assert not equivalence([0.2, 0.2001, 0.1999], margin=0.05).equivalent


def test_equivalence_from_a_summary_equals_the_one_from_values():
    values = [0.1, 0.05, -0.02, 0.07, 0.03]
    direct = equivalence(values, margin=0.15)
    mean, se = sum(values) / 5, (sum((v - 0.046) ** 2 for v in values) / 4) ** 0.5 / 5**0.5
    summary = equivalence_from_summary(mean, se, 4, margin=0.15)
    assert (summary.p, summary.low, summary.high) == pytest.approx((direct.p, direct.low, direct.high))
    assert summary.equivalent == direct.equivalent
    with pytest.raises(ValueError, match="margin must be positive"):
        equivalence_from_summary(0.0, 0.1, 4, margin=0.0)


def test_paired_test_reports_the_90_percent_interval_that_decides_equivalence():
    # the in-flight study's main setting, s per optimizer step (on, off by seed): equivalent within +-1.23 s by TOST,
    # though the 95% interval reaches past the margin; the 90% interval is what lies inside it
    on, off = {42: 12.266, 43: 13.603, 44: 11.307}, {42: 12.310, 43: 13.795, 44: 10.659}
    row = paired_test(on, off, margin=1.2255)
    assert row["equivalent"] and row["equivalence_p"] <= 0.05
    assert row["high"] > 1.2255  # the 95% interval crosses the margin
    assert -1.2255 < row["equivalence_low"] < row["mean"] < row["equivalence_high"] < 1.2255
    half = t_quantile(0.95, 2) * statistics.stdev([on[s] - off[s] for s in on]) / math.sqrt(3)
    assert row["equivalence_high"] - row["mean"] == pytest.approx(half)
    assert paired_test({1: 0.3}, {1: 0.1}, margin=0.05)["equivalence_low"] is None  # one seed: no test
