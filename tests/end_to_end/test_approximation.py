"""benchmarks/approximation.py at a tiny size: the anchor's error is recorded at every optimizer step with the
anchor's age, and the summary groups it by age."""

import json
import os
import subprocess
import sys

import pytest
from tiny import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_approximation_run_records_the_error_by_anchor_age(tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "approximation"
    command = [sys.executable, "-m", "benchmarks.approximation", "--quick", "--model", str(model_dir)]
    command += ["--configs", "k4-lrhi,iter2-lrlo", "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, timeout=900, env=env, capture_output=True, text=True, cwd=ROOT)
    k4 = json.loads((out / "runs" / "k4-lrhi@42.json").read_text())
    assert [s["a3po/anchor_age"] for s in k4["steps"]] == [0, 1, 2, 3]  # one batch trained over 4 steps
    assert k4["steps"][0]["a3po/anchor_approx_logp_abs_error"] >= 0
    iterated = json.loads((out / "runs" / "iter2-lrlo@42.json").read_text())
    assert [s["a3po/anchor_age"] for s in iterated["steps"]] == [0, 1, 0, 1]  # each batch trained twice
    summary = (out / "summary.md").read_text()
    assert "| k4-lrhi | 4 x 1 | 0.001 | 3 | 1 |" in summary and "| iter2-lrlo | 1 x 2 | 0.0002 | 1 | 2 |" in summary
    assert (out / "approximation.png").stat().st_size > 0
