"""The arm studies end to end on a tiny random model (benchmarks/dynamic_sampling.py, benchmarks/in_flight.py): each
run's record carries its arm and the trainer metrics its summary reads, and the summary pairs the arms by seed."""

import json
import os
import subprocess
import sys

import pytest
from tiny import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_study(module, tmp_path, tokenizer, configs):
    model_dir = tmp_path / "model"
    make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "study"
    command = [sys.executable, "-m", module, "--quick", "--configs", configs, "--seeds", "1"]
    # both runs in one launch: the interpreter and the libraries start once (a launch per run: the runner's tests)
    command += ["--model", str(model_dir), "--out", str(out), "--cells-per-launch", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, timeout=900, env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*.json")}
    return runs, json.loads((out / "summary.json").read_text()), (out / "summary.md").read_text()


@pytest.mark.slow
def test_dynamic_sampling_study_records_the_filter_and_pairs_the_arms(tmp_path, tokenizer):
    runs, summary, table = run_study("benchmarks.dynamic_sampling", tmp_path, tokenizer, "off,on")
    assert set(runs) == {"off@1", "on@1"}
    assert runs["on@1"]["overrides"] == {"dynamic_sampling": True} and runs["off@1"]["arm"] == "off"
    on_log, off_log = runs["on@1"]["training_log"], runs["off@1"]["training_log"]
    assert [entry["step"] for entry in on_log] == [1, 2, 3, 4]
    # the random model rarely earns a reward, so most groups are flat: the generator draws 2 prompts at a time until
    # both groups of a batch carry a signal (then the batch trains no flat group) or it has drawn 10 batches
    for entry in on_log:
        extra, at_bound = entry["a3po/dynamic_sampling_extra_batches"], entry["a3po/dynamic_sampling_bound_reached"]
        assert entry["a3po/dynamic_sampling_prompts_per_step"] == 2 * (extra + 1)
        assert entry["a3po/dynamic_sampling_filtered_groups"] <= 2 * (extra + 1)
        assert extra == 9 if at_bound else extra <= 9  # the bound: 10 generation batches per training batch
        if not at_bound:
            assert entry["frac_reward_zero_std"] == 0.0
    assert not any("a3po/dynamic_sampling_filtered_groups" in entry for entry in off_log)
    outcomes = summary["runs"]["on"]["1"]
    filtered = sum(entry["a3po/dynamic_sampling_filtered_groups"] for entry in on_log)
    drawn = sum(entry["a3po/dynamic_sampling_prompts_per_step"] for entry in on_log)
    assert outcomes["filtered_frac"] == pytest.approx(filtered / drawn) and filtered > 0
    assert outcomes["bound_reached_steps"] == sum(entry["a3po/dynamic_sampling_bound_reached"] for entry in on_log)
    assert [row["verdict"] for row in summary["paired"]] == ["one seed"] * 4
    assert "| on@1 |" in table and "Missing runs: none." in table


@pytest.mark.slow
def test_in_flight_study_records_the_loads_and_pairs_the_arms(tmp_path, tokenizer):
    # the long setting: its quick completions (64 tokens) take longer to generate than a step takes to train, so the
    # trainer publishes versions while a batch is generated
    runs, summary, table = run_study("benchmarks.in_flight", tmp_path, tokenizer, "long-off,long-on")
    assert set(runs) == {"long-off@1", "long-on@1"}
    for name, run in runs.items():
        assert run["overrides"]["reproducible_generation"] is False and run["setting"] == "long"
        assert run["overrides"]["in_flight_weight_updates"] is name.startswith("long-on")
        assert run["overrides"]["max_completion_length"] == 64
        on = name.startswith("long-on")  # the loads are logged only with in-flight weight updates on
        assert all(("async/in_flight_weight_loads" in entry) is on for entry in run["training_log"])
    loads_on = [entry["async/in_flight_weight_loads"] for entry in runs["long-on@1"]["training_log"]]
    assert sum(loads_on) > 0, loads_on  # a version published mid-batch was loaded mid-batch
    assert summary["runs"]["long-on"]["1"]["in_flight_loads_per_step"] == sum(loads_on) / len(loads_on)
    assert {row["setting"] for row in summary["paired"]} == {"long"} and len(summary["paired"]) == 4
    assert "| long-on@1 |" in table
