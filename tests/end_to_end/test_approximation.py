"""benchmarks/approximation.py at a tiny size: the anchor's error is recorded at every optimizer step with the
anchor's age, and the summary groups it by age."""

import json
import os
import subprocess
import sys

import pytest
from tiny import make_model

from benchmarks.common.provenance import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_approximation_run_records_the_error_by_anchor_age(tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "approximation"
    command = [sys.executable, "-m", "benchmarks.approximation", "--quick", "--model", str(model_dir)]
    # both runs in one launch: the interpreter and the libraries start once (a launch per run: the runner's tests)
    command += ["--configs", "k4-lrhi,iter2-lrlo", "--out", str(out), "--cells-per-launch", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, timeout=900, env=env, capture_output=True, text=True, cwd=ROOT)
    k4 = json.loads((out / "runs" / "k4-lrhi@42.json").read_text())
    assert validate(k4["provenance"], "k4-lrhi@42")["unrecorded"] == []  # when, where, each thread's setting
    assert [s["a3po/anchor_age"] for s in k4["steps"]] == [0, 1, 2, 3] * 2  # each batch trained over 4 steps
    # the first batch is fresh; the second was generated one version before its first step
    assert [s["a3po/staleness_mean"] for s in k4["steps"]] == [0, 1, 2, 3, 1, 2, 3, 4]
    assert k4["steps"][0]["a3po/anchor_approx_logp_abs_error"] >= 0
    iterated = json.loads((out / "runs" / "iter2-lrlo@42.json").read_text())
    assert [s["a3po/anchor_age"] for s in iterated["steps"]] == [0, 1] * 4  # each batch trained twice
    assert [s["a3po/staleness_mean"] for s in iterated["steps"]] == [0, 1] + [1, 2] * 3
    summary = (out / "summary.md").read_text()
    # by age, over the stale batches only: one step of each age for k4, three for iter2
    assert "| k4-lrhi | 4 x 1 | 0.001 | 3 | 1 |" in summary and "| iter2-lrlo | 1 x 2 | 0.0002 | 1 | 3 |" in summary
    # the compact table: one row per configuration, one column per anchor age (iter2 has no age 2 or 3)
    assert "| configuration | age 0 | age 1 | age 2 | age 3 | age 1 error / drift per step |" in summary
    k4_error = k4["steps"][7]["a3po/anchor_approx_logp_abs_error"]
    k4_row = next(line for line in summary.splitlines() if line.startswith("| k4-lrhi | 0."))
    at_one = k4["steps"][5]  # the stale batch's step at age 1: the interpolation's error over the drift
    drift = at_one.get("a3po/behavior_drift_per_version_mean", 0.0)
    ratio = f"{at_one['a3po/anchor_approx_logp_abs_error'] / drift:.2f}" if drift > 0 else "-"
    assert k4_row.endswith(f" | {k4_error:.4f} [{k4_error:.4f}, {k4_error:.4f}] | {ratio} |")  # one step of age 3
    iter2_row = next(line for line in summary.splitlines() if line.startswith("| iter2-lrlo | 0."))
    assert " | - | - | " in iter2_row  # no age 2 or 3
    assert (out / "approximation.png").stat().st_size > 0
