"""benchmarks/in_flight.py's outcomes from run records: per setting, on - off paired by seed, each outcome over the
two settings one family (Holm within it), and what each run reports of its in-flight loads."""

import pytest

from benchmarks import in_flight as study
from benchmarks.common.intervals import holm, p_value


def record(step_seconds, idle, staleness, accuracy, loads=(0.0, 0.0), multi=(0.0, 0.0)):
    log = [
        {
            "step": i + 1,
            "step_time": step_seconds,
            "async/generator_wait_time": idle,
            "a3po/staleness_mean": staleness,
            "async/in_flight_weight_loads": loads[i],
            "async/in_flight_weight_load_time": 0.05 * loads[i],
            "a3po/multi_version_trajectories_frac": multi[i],
            "a3po/completion_versions_mean": 1.0 + multi[i],
        }
        for i in range(2)
    ]
    curve = [
        {"step": 0, "seconds": 0.0, "accuracy": 0.2},
        {"step": 2, "seconds": 2 * step_seconds, "accuracy": accuracy},
    ]
    return {
        "steps": 2,
        "before": 0.2,
        "after": accuracy,
        "seconds_per_step": step_seconds,
        "train_seconds": 2 * step_seconds,
        "curve": curve,
        "training_log": log,
        "completion_mean_length": 40.0,
    }


def test_run_outcomes_report_the_loads_per_step_and_the_completions_that_span_versions():
    outcomes = study.run_outcomes(record(10.0, 1.0, 0.6, 0.3, loads=(1.0, 2.0), multi=(0.5, 0.25)))
    assert outcomes["in_flight_loads_per_step"] == 1.5
    assert outcomes["in_flight_load_seconds_per_step"] == pytest.approx(0.075)
    assert outcomes["multi_version_frac"] == pytest.approx(0.375)
    assert outcomes["completion_versions_mean"] == pytest.approx(1.375)
    assert (outcomes["generator_idle_seconds"], outcomes["token_staleness_mean"]) == (1.0, 0.6)


def test_each_outcome_over_the_two_settings_is_one_holm_family():
    seeds = (42, 43, 44)
    runs = {
        "main-off": {s: record(10.0 + i, 2.0, 1.0, 0.30) for i, s in enumerate(seeds)},
        "main-on": {s: record(9.0 + i + 0.1 * i * i, 1.0, 0.8, 0.31) for i, s in enumerate(seeds)},
        "long-off": {s: record(30.0 + i, 6.0, 1.0, 0.30) for i, s in enumerate(seeds)},
        "long-on": {s: record(27.0 + 1.5 * i, 2.0, 0.7 - 0.01 * i, 0.33) for i, s in enumerate(seeds)},
    }
    rows = study.paired_outcomes(runs)
    assert [(r["setting"], r["outcome"]) for r in rows[:4]] == [("main", name) for name in [*study.OUTCOMES,
                                                                "subset accuracy, equal wall-clock"]]  # fmt: skip
    step = {r["setting"]: r for r in rows if r["outcome"] == "s per optimizer step"}
    differences = {
        "main": [(9.0 + i + 0.1 * i * i) - (10.0 + i) for i in range(3)],
        "long": [(27.0 + 1.5 * i) - (30.0 + i) for i in range(3)],
    }
    raw = [p_value(differences["main"]), p_value(differences["long"])]
    assert [step["main"]["p"], step["long"]["p"]] == pytest.approx(raw)
    assert [step["main"]["holm_p"], step["long"]["holm_p"]] == pytest.approx(holm(raw))
    assert step["long"]["equivalence_margin"] == pytest.approx(0.1 * 31.0)  # 10% of off's mean s/step
    staleness = {r["setting"]: r for r in rows if r["outcome"] == "mean token staleness"}
    assert staleness["main"]["equivalence_margin"] == study.STALENESS_MARGIN
    assert staleness["main"]["mean"] == pytest.approx(-0.2)


def test_a_setting_without_both_arms_is_left_out():
    runs = {"main-off": {42: record(10.0, 1.0, 1.0, 0.3)}, "long-on": {42: record(10.0, 1.0, 1.0, 0.3)}}
    assert study.paired_outcomes(runs) == []
    with pytest.raises(SystemExit, match="unknown configuration"):
        study._parse("short-on")
