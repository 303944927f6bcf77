"""benchmarks/oracle.py and benchmarks/guard_map.py end to end at a tiny size: the oracle records every trained
token's behavior, current and exact target log-probs and decides by its registered rules; the guard's map study pairs
the guarded runs with both methods by seed."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny import make_model

from benchmarks.common.anchor_estimators import TOKEN_FIELDS, decode_tokens
from benchmarks.common.provenance import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_quick_oracle_records_every_token_and_decides(tmp_path):
    out = tmp_path / "oracle"
    command = [sys.executable, "-m", "benchmarks.oracle", "--quick", "--out", str(out), "--cells-per-launch", "4"]
    command += ["--configs", "map-s4-k4-lrhi,map-s2-k1-lrhi", "--seeds", "0,1"]
    subprocess.run(command, check=True, timeout=900, env=ENV, capture_output=True, text=True, cwd=ROOT)
    record = json.loads((out / "runs" / "map-s4-k4-lrhi@0.json").read_text())
    assert validate(record["provenance"], "map-s4-k4-lrhi@0")["unrecorded"] == []  # when, where, the threads
    assert record["prox_logp_method"] == "loglinear" and record["steps_per_batch"] == 4
    tokens = decode_tokens(record["tokens_npz"])
    assert set(tokens) == set(TOKEN_FIELDS) and record["tokens"] == tokens["step"].size > 0
    assert tokens["step"].min() == 1  # version 0 has no version before it
    # 4 steps per batch, max_staleness 7: batch b trains steps 4b..4b+3 at ages 0..3
    assert set(np.unique(tokens["age"])) == {0, 1, 2, 3}
    assert np.array_equal(tokens["age"], tokens["step"] - 4 * (tokens["step"] // 4))
    assert np.all(tokens["staleness"] >= tokens["age"])
    moved = tokens["step"] >= 2  # after a step that moved the weights, the target is not the trained weights'
    assert np.any(tokens["exact"][moved] != tokens["current"][moved])
    summary = (out / "summary.md").read_text()
    assert "| map-s4-k4-lrhi | 0,1 |" in summary and "| map-s2-k1-lrhi | 0,1 |" in summary
    assert "**Decision (registered rule:" in summary and "**Guard defaults by the registered rules:" in summary
    payload = json.loads((out / "summary.json").read_text())
    assert payload["decision"]["configurations"] == 2 and payload["missing"] == []
    assert payload["guard_defaults"]["budget"] in (1.0, 1.5, 2.0)
    assert (out / "oracle.png").stat().st_size > 0


@pytest.mark.slow
def test_quick_guard_map_pairs_the_guard_with_both_methods(tmp_path):
    out = tmp_path / "guard"
    configs = "guarded-s2-k1-lrhi,loglinear-s2-k1-lrhi,recompute-s2-k1-lrhi"
    command = [sys.executable, "-m", "benchmarks.guard_map", "--quick", "--steps", "8", "--configs", configs]
    command += ["--out", str(out), "--cells-per-launch", "6"]
    subprocess.run(command, check=True, timeout=900, env=ENV, capture_output=True, text=True, cwd=ROOT)
    guarded = json.loads((out / "runs" / "guarded-s2-k1-lrhi@0.json").read_text())
    assert guarded["method"] == "guarded"
    assert [v for v in guarded["logged"]["a3po/prox_recompute_fraction"] if v is not None]  # the guard logged
    loglinear = json.loads((out / "runs" / "loglinear-s2-k1-lrhi@0.json").read_text())
    assert all(v is None for v in loglinear["logged"]["a3po/prox_recompute_fraction"])
    assert guarded["evaluations"]["0"] == loglinear["evaluations"]["0"]  # the same seed: the same start
    summary = json.loads((out / "summary.json").read_text())
    assert [row["cell"] for row in summary["families"]["guarded - loglinear"]] == ["s2-k1-lrhi"]
    assert [row["cell"] for row in summary["families"]["guarded - recompute"]] == ["s2-k1-lrhi"]
    row = summary["families"]["guarded - recompute"][0]
    assert row["verdict"] in ("difference", "equivalent", "not resolved") and row["n"] == 2


@pytest.mark.slow
def test_quick_guard_smollm2_runs_the_three_methods_on_one_seed(tokenizer, tmp_path):
    """benchmarks/guard_smollm2.py at a tiny size: the three methods of the confirmation's setting on one seed (four
    optimizer steps per batch, max_staleness=4), the guard's metrics kept, the seed paired, no decision from one."""
    model_dir = tmp_path / "model"
    make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "guard"
    command = [sys.executable, "-m", "benchmarks.guard_smollm2", "--quick", "--seeds", "1", "--model", str(model_dir)]
    # the three runs in one launch: the interpreter and the libraries start once (a launch per run: the runner's tests)
    command += ["--out", str(out), "--cells-per-launch", "3"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, timeout=900, env=env, capture_output=True, text=True, cwd=ROOT)
    runs = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*.json")}
    assert set(runs) == {"guarded-s4-k4@1", "loglinear-s4-k4@1", "recompute-s4-k4@1"}
    assert all(run["steps_per_batch"] == 4 and run["staleness"] == 4 for run in runs.values())
    guarded = runs["guarded-s4-k4@1"]["training_log"]
    assert all("a3po/prox_recompute_fraction" in entry for entry in guarded)  # the guard's metrics are kept
    summary = json.loads((out / "summary.json").read_text())
    assert summary["paired_seeds"] == [1] and summary["decision"] is None and summary["families"] == {}
    assert "not decided until all 5 seeds are paired (1 so far)" in (out / "summary.md").read_text()
