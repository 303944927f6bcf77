"""benchmarks/proximal_map.py end to end at a tiny size (runs, every recorded field, the exact staleness schedule,
the summary with intervals and paired differences, resuming); the interval arithmetic:
tests/unit/test_intervals.py."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.common.provenance import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_map_records_the_schedule_summarizes_with_intervals_and_resumes(tmp_path):
    out = tmp_path / "map"
    command = [
        sys.executable,
        "-m",
        "benchmarks.proximal_map",
        "--quick",
        "--out",
        str(out),
        "--cells-per-launch",
        "4",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(command, check=True, timeout=900, env=env, capture_output=True, text=True, cwd=ROOT)
    runs = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*@*.json")}
    assert set(runs) == {"loglinear-s2-k4-lrhi@0", "loglinear-s2-k4-lrhi@1", "recompute-s2-k4-lrhi@0",
                         "recompute-s2-k4-lrhi@1"}  # fmt: skip
    for name, run in runs.items():
        assert (run["method"], run["staleness"], run["steps_per_batch"]) == (name.split("-")[0], 2, 4)
        assert run["learning_rate"] == 3e-2 and list(run["evaluations"]) == ["0", "3", "6"]
        assert all(0 <= value <= 1 for value in run["evaluations"].values())
        assert run["final_reward"] == run["evaluations"]["6"]
        assert run["reward_auc"] == pytest.approx((run["evaluations"]["3"] + run["evaluations"]["6"]) / 2)
        # max_staleness = d + k - 1 = 5 with reproducible generation: the first batch (versions 0..3) trains on
        # staleness 0..3; the second, which the run's 6 steps cut after 2 of its 4, is generated as a longer run
        # generates it (the oldest version the bound allows for the whole batch, 7 - 5 = 2): staleness 2..3
        assert run["logged"]["a3po/staleness_mean"] == [0, 1, 2, 3, 2, 3]
        assert run["drift_per_step"] > 0 and 0 <= run["clipped_frac"] <= 1
        assert len(run["load_average_start"]) == 3 and run["machine"]["cpu_count"] >= 1
        assert run["kernels"]["cpu_capability"] and run["kernels"]["torch"].startswith("2.")
        block = validate(run["provenance"], name)  # the threads it set, with the runner's when and where
        assert block["unrecorded"] == [] and block["threads"] == {"training": 1, "generation": 1, "process": 1}
    # the two methods start from the same weights on the same seed: the same first evaluation
    assert runs["loglinear-s2-k4-lrhi@0"]["evaluations"]["0"] == runs["recompute-s2-k4-lrhi@0"]["evaluations"]["0"]
    summary = (out / "summary.md").read_text()
    assert "| 2 | loglinear - recompute |" in summary and "[" in summary and (out / "proximal_map.png").stat().st_size
    assert "Missing runs" not in summary
    # the Holm families and the equivalence test, from the same differences (2 seeds: one degree of freedom)
    families = json.loads((out / "families.json").read_text())["families"]
    assert [len(families[f"loglinear - recompute, {outcome}"]) for outcome in ("final", "auc")] == [1, 1]
    cell = families["loglinear - recompute, final"][0]
    assert cell["holm_p"] == cell["p"] and cell["verdict"] in ("difference", "equivalent", "not resolved")
    assert "| loglinear - recompute, final | 1 |" in (out / "families.md").read_text()
    again = subprocess.run(command, check=True, timeout=300, env=env, capture_output=True, text=True, cwd=ROOT)
    assert "(1 of" not in again.stdout and "(1 of" in first.stdout  # finished runs are not run again
    with pytest.raises(subprocess.CalledProcessError):  # other settings never mix into these runs
        subprocess.run(
            [*command, "--learning-rates", "hi=1e-2,lo=1e-3"], check=True, env=env, capture_output=True, cwd=ROOT
        )


def test_same_runs_names_the_first_step_where_two_runs_part(tmp_path):
    from benchmarks.same_runs import compare

    record = {
        "logged": {"reward": [0.1, 0.2, 0.3], "step_time": [1.0, 2.0, 3.0]},
        "kernels": {"cpu_capability": "AVX512"},
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        (tmp_path / folder / "x@1.json").write_text(json.dumps(record))
    parted = {
        "logged": {"reward": [0.1, 0.25, 0.3], "step_time": [9.0, 9.0, 9.0]},
        "kernels": {"cpu_capability": "AVX2"},
    }
    (tmp_path / "a" / "y@1.json").write_text(json.dumps(record))
    (tmp_path / "b" / "y@1.json").write_text(json.dumps(parted))
    (tmp_path / "b" / "z@1.json").write_text(json.dumps(record))  # only in one folder: not compared
    lines = compare(tmp_path / "a", tmp_path / "b")
    assert lines[0] == "x@1: identical over 3 steps"  # timings differ between identical computations: ignored
    assert lines[1].startswith("y@1: parts at step 2 (reward: 0.2 against 0.25); kernels differ")
    assert "AVX2" in lines[1] and len(lines) == 2
