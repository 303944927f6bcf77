"""benchmarks/time_to_accuracy.py: a quick run of two configurations writes runs, a summary and a plot, and resumes."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.common.provenance import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_run_summarizes_and_skips_finished_runs(tmp_path):
    out = tmp_path / "tta"
    command = [sys.executable, "-m", "benchmarks.time_to_accuracy", "--quick", "--configs", "trl,loglinear-s1"]
    # both runs in one launch: the interpreter and the libraries start once (each run still sets its own seeds; a
    # launch per run is the runner's, tested in tests/unit/test_benchmark_runner.py)
    command += ["--seeds", "1", "--out", str(out), "--cells-per-launch", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(command, timeout=1200, env=env, capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    runs = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*.json")}
    assert set(runs) == {"trl@1", "loglinear-s1@1"}
    for run in runs.values():
        assert [point["step"] for point in run["curve"]] == [0, 2, 4]
        assert run["curve"][0]["seconds"] == 0 and run["curve"][-1]["seconds"] > run["curve"][1]["seconds"] > 0
        assert 0 <= run["before"] <= 1 and 0 <= run["after"] <= 1 and len(run["after_correct"]) == 8
        # the curve evaluates the adapter as it was at each step (snapshots), the last one being the final weights
        # (in --quick the subset is the whole held-out set)
        norms = [point["adapter_norm"] for point in run["curve"][1:]]
        assert len(set(norms)) == len(norms), norms
        assert run["curve"][-1]["accuracy"] == run["after"]
        assert run["run_seconds"] > run["train_seconds"] > 0 and len(run["load_average_end"]) == 3  # the runner's
        assert run["completion_mean_length"] > 0  # every configuration's, TRL's too: s/step follows it
        block = validate(run["provenance"], run["config"])  # where and when it ran, each thread's setting
        assert block["unrecorded"] == [] and block["threads"]["process"] >= 1
        assert (block["threads"]["training"] is None) is (run["config"] == "trl")
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["configs"]) == {"trl", "loglinear-s1"} and summary["missing"] == []
    assert (out / "accuracy_vs_time.png").stat().st_size > 0
    # a second invocation finds every run done and only rewrites the summary; a wider plan names what is missing
    kept = {path.name: path.read_text() for path in (out / "runs").glob("*.json")}
    again = subprocess.run(command, check=True, timeout=600, env=env, capture_output=True, text=True, cwd=ROOT)
    assert "[time_to_accuracy] trl@1,loglinear-s1@1 (1 of 1" in first.stdout  # the launch's line
    assert "(1 of" not in again.stdout  # no launch: finished runs are not run again
    assert {path.name: path.read_text() for path in (out / "runs").glob("*.json")} == kept
    wider = [*command, "--configs", "trl,loglinear-s1,loglinear-s2", "--summary-only"]
    subprocess.run(wider, check=True, timeout=600, env=env, capture_output=True, text=True, cwd=ROOT)
    assert "Missing runs: loglinear-s2@1." in (out / "summary.md").read_text()
