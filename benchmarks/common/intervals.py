"""Means with 95% confidence intervals over seeds, paired differences, and the tests the studies report with them.

A study's seeds are independent runs; a cell's mean over them gets Student's t interval (scipy's exact quantile).
Two configurations run on the same seeds share the model's initial weights and the data order, so their difference
is taken seed by seed (paired) before its interval: the seed-to-seed spread common to both drops out.

Two corrections the studies apply on top:

- :func:`holm`: one contrast on one outcome across a study's cells (e.g. ``loglinear - recompute`` in final reward
  over the proximal map's 16 cells) is one family of tests; Holm's step-down correction keeps the chance of any
  false "difference" in the family at ``alpha``.
- :func:`equivalence`: "no difference" is a claim too, and an interval that includes 0 does not make it. Two
  one-sided t tests (TOST) against a declared margin ``m`` show ``-m < mean < m``; otherwise the comparison is not
  resolved.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats


def t_quantile(probability: float, degrees_of_freedom: int) -> float:
    """Student's t quantile: the value below which ``probability`` of the t distribution lies (exact, scipy)."""
    if degrees_of_freedom < 1:
        raise ValueError("a t quantile needs at least one degree of freedom (two values)")
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must lie strictly between 0 and 1, got {probability}")
    return float(stats.t.ppf(probability, degrees_of_freedom))


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values and its two-sided confidence interval."""

    mean: float
    low: float
    high: float
    n: int

    def excludes(self, value: float) -> bool:
        return value < self.low or value > self.high

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _standard_error(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values))


def mean_interval(values, confidence: float = 0.95) -> Interval:
    """The mean of ``values`` with its t interval (``low == high == mean`` for a single value)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Interval(mean, mean, mean, 1)
    half = t_quantile(0.5 + confidence / 2, len(values) - 1) * _standard_error(values)
    return Interval(mean, mean - half, mean + half, len(values))


def paired_difference(a: dict, b: dict, confidence: float = 0.95) -> Interval:
    """The mean of ``a[seed] - b[seed]`` over the seeds both have, with its t interval."""
    seeds = sorted(a.keys() & b.keys())
    return mean_interval([a[seed] - b[seed] for seed in seeds], confidence)


def paired_values(a: dict, b: dict) -> list[float]:
    """``a[seed] - b[seed]`` over the seeds both have, in seed order."""
    return [a[seed] - b[seed] for seed in sorted(a.keys() & b.keys())]


def t_test_p(mean: float, standard_error: float, degrees_of_freedom: int, null: float = 0.0) -> float:
    """Two-sided p-value of the one-sample t test of ``mean == null`` (1.0 where there is no spread and the mean is
    the null; 0.0 where there is no spread and it is not)."""
    if degrees_of_freedom < 1:
        raise ValueError("a t test needs at least one degree of freedom (two values)")
    if standard_error == 0.0:
        return 1.0 if mean == null else 0.0
    return float(2.0 * stats.t.sf(abs(mean - null) / standard_error, degrees_of_freedom))


def p_value(values, null: float = 0.0) -> float:
    """Two-sided p-value of the one-sample t test that the mean of ``values`` is ``null`` (paired differences: 0)."""
    values = [float(v) for v in values]
    if len(values) < 2:
        raise ValueError("a t test needs at least two values")
    return t_test_p(statistics.fmean(values), _standard_error(values), len(values) - 1, null)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p (from 0) is multiplied by
    ``len(p_values) - i``, made non-decreasing in that order and capped at 1. A test of the family is a difference at
    level ``alpha`` exactly where its adjusted p-value is at most ``alpha``."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        p = p_values[index]
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"a p-value lies in [0, 1], got {p}")
        running = max(running, min(1.0, (len(p_values) - rank) * p))
        adjusted[index] = running
    return adjusted


def holm_within(rows: list[dict], family: str) -> None:
    """Sets each row's ``holm_p``: its ``p`` adjusted by Holm within the rows with the same ``row[family]`` (``None``
    for a row without a test)."""
    for name in dict.fromkeys(row[family] for row in rows):
        tested = [row for row in rows if row[family] == name and row["p"] is not None]
        for row, adjusted in zip(tested, holm([row["p"] for row in tested])):
            row["holm_p"] = adjusted
    for row in rows:
        row.setdefault("holm_p", None)


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided t tests of ``|mean| < margin``: ``p`` is the larger of the two one-sided p-values, and the mean
    is shown within the margin (``equivalent``) exactly where ``p <= alpha``, which is where the ``1 - 2 alpha``
    interval (``low``, ``high``) lies inside ``(-margin, margin)``."""

    margin: float
    p: float
    low: float
    high: float
    equivalent: bool


def equivalence_from_summary(
    mean: float, standard_error: float, degrees_of_freedom: int, margin: float, alpha: float = 0.05
) -> Equivalence:
    """TOST from a mean, its standard error and degrees of freedom (where only a summary is at hand)."""
    if margin <= 0.0:
        raise ValueError(f"an equivalence margin must be positive, got {margin}")
    if degrees_of_freedom < 1:
        raise ValueError("an equivalence test needs at least one degree of freedom (two values)")
    if standard_error == 0.0:
        p = 0.0 if abs(mean) < margin else 1.0
        return Equivalence(margin, p, mean, mean, p <= alpha)
    p_lower = float(stats.t.sf((mean + margin) / standard_error, degrees_of_freedom))  # H0: mean <= -margin
    p_upper = float(stats.t.cdf((mean - margin) / standard_error, degrees_of_freedom))  # H0: mean >= +margin
    half = t_quantile(1.0 - alpha, degrees_of_freedom) * standard_error
    p = max(p_lower, p_upper)
    return Equivalence(margin, p, mean - half, mean + half, p <= alpha)


def equivalence(values, margin: float, alpha: float = 0.05) -> Equivalence:
    """TOST of ``values`` (paired differences) against ``margin``: is their mean shown to lie within it?"""
    values = [float(v) for v in values]
    if len(values) < 2:
        raise ValueError("an equivalence test needs at least two values")
    return equivalence_from_summary(statistics.fmean(values), _standard_error(values), len(values) - 1, margin, alpha)


def paired_test(a: dict, b: dict, margin: float) -> dict:
    """``a[seed] - b[seed]`` over the seeds both have: the seeds, the mean with its 95% t interval, the t test's
    p-value and two one-sided tests (TOST) against ``margin`` with the 90% interval that decides them
    (``equivalence_low``, ``equivalence_high``: equivalent exactly where it lies inside the margin; the 95% interval
    may cross the margin where TOST shows equivalence). ``p``, ``equivalence_p`` and the 90% interval are ``None``
    for one seed: no test."""
    values = paired_values(a, b)
    interval = paired_difference(a, b)
    test = equivalence(values, margin) if len(values) > 1 else None
    return {
        "seeds": sorted(a.keys() & b.keys()),
        "mean": interval.mean,
        "low": interval.low,
        "high": interval.high,
        "p": p_value(values) if test else None,
        "equivalence_margin": margin,
        "equivalence_p": test.p if test else None,
        "equivalence_low": test.low if test else None,
        "equivalence_high": test.high if test else None,
        "equivalent": bool(test and test.equivalent),
    }
