"""benchmarks/reward_workers.py's summary: the arms paired seed by seed, with t intervals and Holm within a family."""

import math

import pytest

from benchmarks.reward_workers import summarize


def _run(arm, seed, step, stall):
    return {
        "arm": arm,
        "seed": seed,
        "step_time_median": step,
        "stall_median": stall,
        "stall_fraction": stall / step,
        "train_seconds": 24 * step,
    }


def test_the_arms_are_paired_seed_by_seed_with_t_intervals_and_holm_within_each_quantity():
    runs = [
        _run("grpo", 0, 1.0, 0.0),
        _run("thread", 0, 0.8, 0.3),
        _run("workers", 0, 0.5, 0.1),
        _run("grpo", 1, 1.2, 0.0),
        _run("thread", 1, 0.9, 0.2),
        _run("workers", 1, 0.6, 0.1),
        _run("thread", 2, 5.0, 1.0),  # a seed one arm alone ran is in no pair
    ]
    summary = summarize(runs)
    rows = {(row["quantity"], row["comparison"]): row for row in summary["paired"]}
    assert set(rows) == {
        (q, c)
        for q in ("step_time_median", "stall_median")
        for c in ("workers - thread", "thread - grpo", "workers - grpo")
    }
    row = rows[("step_time_median", "workers - thread")]
    assert row["seeds"] == [0, 1] and row["mean"] == pytest.approx(-0.3)
    # differences -0.3, -0.3: no spread, so the interval is the mean itself and the test rejects
    assert row["interval"] == pytest.approx([-0.3, -0.3]) and row["p"] == 0.0
    spread = rows[("step_time_median", "thread - grpo")]  # -0.2, -0.3: t interval with 1 degree of freedom
    half = 12.7062047361747 * 0.05  # t(0.975, 1 degree of freedom) times the standard error, 0.0707 / sqrt(2)
    assert spread["interval"][0] == pytest.approx(-0.25 - half, rel=1e-9)
    assert spread["interval"][1] == pytest.approx(-0.25 + half, rel=1e-9)
    # Holm within the step-time family: three tests, the adjusted p-values are at least the raw ones
    family = [r for r in summary["paired"] if r["quantity"] == "step_time_median"]
    assert all(r["holm_p"] >= r["p"] for r in family) and not math.isnan(spread["holm_p"])
    assert summary["workers_over_thread_step_time"] == pytest.approx(0.55 / 0.9)
