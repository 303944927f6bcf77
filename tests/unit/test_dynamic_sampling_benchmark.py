"""benchmarks/dynamic_sampling.py's outcomes from run records: accuracy at equal wall-clock, the paired intervals
(exact t quantile), the verdicts against the pre-registered margins, and the per-run descriptions."""

import pytest

from benchmarks import dynamic_sampling as study
from benchmarks.common import paired_arms


def record(after, seconds, curve, generation=(1.0, 1.0), filtered=(0.0, 0.0), drawn=(4.0, 4.0), extra=(0.0, 0.0)):
    """A run record as benchmarks.time_to_accuracy writes it: ``curve`` is ``[(seconds, accuracy), ...]`` at steps
    0, 10, 20...; the training log has one entry per optimizer step."""
    steps = len(generation)
    log = [
        {
            "step": i + 1,
            "async/generation_time": generation[i],
            "a3po/dynamic_sampling_filtered_groups": filtered[i],
            "a3po/dynamic_sampling_prompts_per_step": drawn[i],
            "a3po/dynamic_sampling_extra_batches": extra[i],
            "a3po/dynamic_sampling_bound_reached": float(extra[i] >= 9),
            "frac_reward_zero_std": 0.25,
        }
        for i in range(steps)
    ]
    points = [{"step": 10 * i, "seconds": s, "accuracy": a} for i, (s, a) in enumerate(curve)]
    return {
        "steps": steps,
        "after": after,
        "before": 0.25,
        "train_seconds": seconds,
        "seconds_per_step": seconds / steps,
        "curve": points,
        "training_log": log,
    }


def test_accuracy_at_equal_wall_clock_is_the_last_snapshot_within_it():
    run = record(0.4, 300.0, [(0.0, 0.2), (100.0, 0.3), (200.0, 0.35), (300.0, 0.4)])
    assert paired_arms.accuracy_within(run, 250.0) == 0.35
    assert paired_arms.accuracy_within(run, 200.0) == 0.35  # a snapshot at the limit counts
    assert paired_arms.accuracy_within(run, 99.0) == 0.2  # step 0 is at 0 s


def test_run_outcomes_count_the_groups_filtered_of_those_drawn():
    run = record(0.4, 20.0, [(0.0, 0.2), (20.0, 0.4)], generation=(3.0, 5.0), filtered=(4.0, 2.0), drawn=(8.0, 8.0))
    outcomes = study.run_outcomes(run)
    assert outcomes["filtered_frac"] == pytest.approx(6 / 16)
    assert outcomes["generation_seconds_per_step"] == pytest.approx(4.0)
    assert outcomes["frac_reward_zero_std_trained"] == pytest.approx(0.25)
    assert study.run_outcomes(record(0.4, 20.0, [(0.0, 0.2)], drawn=(0.0, 0.0)))["filtered_frac"] == 0.0


def test_paired_outcomes_are_on_minus_off_by_seed_with_exact_intervals_and_verdicts():
    off = {
        42: record(0.30, 600.0, [(0, 0.2), (300, 0.25), (600, 0.30)], generation=(2.0, 2.0)),
        43: record(0.32, 610.0, [(0, 0.2), (305, 0.26), (610, 0.31)], generation=(2.1, 2.1)),
        44: record(0.31, 590.0, [(0, 0.2), (295, 0.27), (590, 0.29)], generation=(1.9, 1.9)),
    }
    # on: slower (more generation per step), ahead at equal steps
    on = {
        42: record(0.40, 900.0, [(0, 0.2), (450, 0.33), (900, 0.40)], generation=(4.0, 4.0)),
        43: record(0.44, 915.0, [(0, 0.2), (458, 0.35), (915, 0.42)], generation=(4.2, 4.2)),
        44: record(0.36, 885.0, [(0, 0.2), (443, 0.30), (885, 0.37)], generation=(3.8, 3.8)),
    }
    rows = {row["outcome"]: row for row in study.paired_outcomes({"off": off, "on": on})}
    steps = rows["held-out accuracy, equal steps"]
    assert steps["seeds"] == [42, 43, 44]
    differences = [0.10, 0.12, 0.05]
    mean = sum(differences) / 3
    sd = (sum((d - mean) ** 2 for d in differences) / 2) ** 0.5
    half = 4.302653 * sd / 3**0.5  # t quantile at 2 degrees of freedom
    assert (steps["mean"], steps["low"], steps["high"]) == pytest.approx((mean, mean - half, mean + half), abs=1e-6)
    assert steps["verdict"] == "difference" and steps["equivalence_margin"] == study.ACCURACY_MARGIN
    # equal wall-clock: at off's (shorter) training time, on's last snapshot within it is its middle one
    wall = rows["subset accuracy, equal wall-clock"]
    assert wall["on_mean"] == pytest.approx((0.33 + 0.35 + 0.30) / 3)
    assert wall["off_mean"] == pytest.approx((0.30 + 0.31 + 0.29) / 3)
    generation = rows["generation s per optimizer step"]
    assert generation["mean"] == pytest.approx(2.0) and generation["verdict"] == "difference"
    assert generation["equivalence_margin"] == pytest.approx(0.1 * 2.0)  # 10% of off's mean


def test_equal_arms_are_equivalent_and_one_seed_is_no_test():
    base = {s: record(0.30 + s / 1000, 600.0, [(0, 0.2), (600, 0.3)]) for s in (42, 43, 44)}
    close = {s: record(0.30 + s / 1000 + (0.001 if s % 2 else -0.001), 600.0, [(0, 0.2), (600, 0.3)]) for s in base}
    rows = {row["outcome"]: row for row in study.paired_outcomes({"off": base, "on": close})}
    assert rows["held-out accuracy, equal steps"]["verdict"] == "equivalent"
    single = study.paired_outcomes({"off": {42: base[42]}, "on": {42: close[42]}})
    assert all(row["verdict"] == "one seed" and row["p"] is None for row in single)
    shown = paired_arms.table(single)[2:]  # one seed has no interval: the table says so instead of a zero-width one
    assert all("(one seed: no interval)" in line and "[" not in line for line in shown)
    assert study.paired_outcomes({"off": base}) == []
