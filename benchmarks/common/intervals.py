"""Means with 95% confidence intervals over seeds, and paired differences between two configurations.

A study's seeds are independent runs; a cell's mean over them gets Student's t interval. Two configurations run on
the same seeds share the model's initial weights and the data order, so their difference is taken seed by seed
(paired) before its interval: the seed-to-seed spread common to both drops out.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist


def t_quantile(probability: float, degrees_of_freedom: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion around the normal one; within 1e-3 of the exact value for 3
    or more degrees of freedom at the usual probabilities)."""
    if degrees_of_freedom < 1:
        raise ValueError("a t quantile needs at least one degree of freedom (two values)")
    z, v = NormalDist().inv_cdf(probability), float(degrees_of_freedom)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4)
    )


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


def mean_interval(values, confidence: float = 0.95) -> Interval:
    """The mean of ``values`` with its t interval (``low == high == mean`` for a single value)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Interval(mean, mean, mean, 1)
    half = t_quantile(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half, len(values))


def paired_difference(a: dict, b: dict, confidence: float = 0.95) -> Interval:
    """The mean of ``a[seed] - b[seed]`` over the seeds both have, with its t interval."""
    seeds = sorted(a.keys() & b.keys())
    return mean_interval([a[seed] - b[seed] for seed in seeds], confidence)
