"""benchmarks/time_to_accuracy.py: the training-time ratio against TRL, seed by seed, and its geometric mean over the
seeds with a 95% t interval on the log ratios (an interval, not a range of ratios)."""

import math

import pytest

from benchmarks.common.intervals import t_quantile
from benchmarks.time_to_accuracy import same_seed_speedup


def test_the_same_seed_ratios_get_a_geometric_mean_and_an_interval_over_the_seeds():
    # the demo configuration's committed training seconds (loglinear-s1 and trl, seeds 42-44), rounded
    trl = {42: {"train_seconds": 880.4}, 43: {"train_seconds": 1211.5}, 44: {"train_seconds": 899.7}}
    loglinear = {42: {"train_seconds": 779.8}, 43: {"train_seconds": 843.6}, 44: {"train_seconds": 727.2}}
    speedup = same_seed_speedup(loglinear, trl)
    assert speedup["seeds"] == [42, 43, 44]
    assert speedup["ratios"] == pytest.approx([1.129, 1.436, 1.237], abs=1e-3)
    logs = [math.log(r) for r in speedup["ratios"]]
    assert speedup["geometric_mean"] == pytest.approx(math.exp(sum(logs) / 3))
    half = t_quantile(0.975, 2) * (sum((x - sum(logs) / 3) ** 2 for x in logs) / 2) ** 0.5 / math.sqrt(3)
    assert speedup["low"] == pytest.approx(math.exp(sum(logs) / 3 - half))
    # every seed's ratio is above 1, yet the interval over three seeds includes 1
    assert min(speedup["ratios"]) > 1 and speedup["low"] < 1 < speedup["high"]
    assert same_seed_speedup(loglinear, {45: {"train_seconds": 1.0}}) is None  # no seed in common
