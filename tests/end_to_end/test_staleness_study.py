"""benchmarks/staleness.py end to end on a tiny random model: runs, every reported field, the summary, the plot, and
resuming (finished runs are skipped, missing ones are named)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import make_model

from benchmarks import staleness as study
from benchmarks.common.provenance import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_study_records_every_field_summarizes_and_resumes(tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "study"
    configs = "behavior-s2,loglinear-s0"
    command = [sys.executable, "-m", "benchmarks.staleness", "--quick", "--configs", configs, "--seeds", "1"]
    # both runs in one launch: the interpreter and the libraries start once (a launch per run: the runner's tests)
    command += ["--model", str(model_dir), "--out", str(out), "--cells-per-launch", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(command, check=True, timeout=900, env=env, capture_output=True, text=True, cwd=ROOT)
    assert "[staleness] behavior-s2@1,loglinear-s0@1 (1 of 1" in first.stdout  # the launch's line: not when resumed

    runs = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*.json")}
    assert set(runs) == {"behavior-s2@1", "loglinear-s0@1"}
    for name, run in runs.items():
        method, staleness = name.split("@")[0].rsplit("-s", 1)
        assert (run["method"], run["staleness"], run["seed"], run["steps"]) == (method, int(staleness), 1, 4)
        assert run["settings"]["reproducible_generation"] is True and run["settings"]["learning_rate"] == 1e-3
        block = validate(run["provenance"], name)  # the threads it set, with the runner's when and where
        assert block["unrecorded"] == [] and block["threads"]["training"] == run["settings"]["training_num_threads"]
        assert (run["settings"]["eval_every"], run["settings"]["held_out"], run["settings"]["kl_samples"]) == (2, 4, 1)
        # held-out reward and KL at steps 0, 2, 4, from adapter snapshots: the initial policy has KL 0 to itself
        assert [point["step"] for point in run["curve"]] == [0, 2, 4]
        assert run["curve"][0]["seconds"] == 0 and 0 < run["curve"][1]["seconds"] < run["curve"][2]["seconds"]
        assert run["curve"][0]["kl_to_initial"] == pytest.approx(0.0, abs=1e-6)
        assert run["curve"][-1]["kl_to_initial"] >= 0  # the random model earns no reward, so it may not move at all
        for point in run["curve"]:
            assert 0 <= point["reward"] <= 1 and 0 <= point["exact"] <= 1
        log = run["training_log"]
        assert [entry["step"] for entry in log] == [1, 2, 3, 4]
        assert all("reward" in entry and "clip_ratio/region_mean" in entry for entry in log)
        assert all(entry["a3po/staleness_mean"] <= run["staleness"] for entry in log)
        assert run["seconds_per_step"] > 0 and run["train_seconds"] > 0
        assert len(run["load_average_start"]) == 3 and len(run["load_average_end"]) == 3
        assert 0 <= run["foreign_cpu_frac"] <= 1 and run["quiet_wait_seconds"] >= 0
        assert 0 <= run["foreign_cpu_frac_run"] <= 1 and run["run_seconds"] > run["train_seconds"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", run["started_at"])
    # reproducible_generation: after the first batches, the behavior run trains on samples exactly 2 steps old
    stale = runs["behavior-s2@1"]["training_log"]
    assert [entry["a3po/staleness_mean"] for entry in stale] == [0, 1, 2, 2]
    assert all(entry["a3po/importance_weight_mean"] == 1.0 for entry in stale)  # no behavior weight
    assert "a3po/behavior_drift_per_version_mean" in stale[-1]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["missing"] == [] and set(summary["configs"]) == {"behavior-s2", "loglinear-s0"}
    reported = summary["configs"]["behavior-s2"]
    for key in ("held_out_reward_final", "kl_to_initial_final", "clipped_frac_mean", "capped_frac_mean"):
        assert len(reported[key]) == 1 and reported[key][0] is not None, key
    for key in (
        "train_reward_last5",
        "seconds_per_step",
        "load_average_start",
        "drift_per_version_mean",
        "foreign_cpu_frac",
    ):
        assert reported[key][0] is not None, key
    table = (out / "summary.md").read_text()
    assert "| behavior-s2 | 1 |" in table and "| loglinear-s0 | 1 |" in table and "Missing runs: none." in table
    # one row per run: when it started, its held-out curve, its load
    curve = " / ".join(f"{point['reward']:.3f}" for point in runs["behavior-s2@1"]["curve"])
    assert f"| behavior-s2@1 | {runs['behavior-s2@1']['started_at']} | {curve} |" in table
    assert (out / "staleness.png").stat().st_size > 0

    # a second invocation skips the finished runs; a wider plan names the run it has not made
    kept = {path.name: path.read_text() for path in (out / "runs").glob("*.json")}
    again = subprocess.run(command, check=True, timeout=600, env=env, capture_output=True, text=True, cwd=ROOT)
    assert "(1 of" not in again.stdout  # no launch: finished runs are not run again
    assert {path.name: path.read_text() for path in (out / "runs").glob("*.json")} == kept
    wider = [*command, "--configs", f"{configs},recompute-s4", "--summary-only"]
    subprocess.run(wider, check=True, timeout=600, env=env, capture_output=True, text=True, cwd=ROOT)
    assert "Missing runs: recompute-s4@1." in (out / "summary.md").read_text()


def test_kl_to_initial_is_the_exact_per_token_kl_of_the_adapter_against_the_base_model(tokenizer):
    """The study's KL: zero for an adapter that changes nothing, and on one unpadded prompt the mean over sampled
    tokens of the full-vocabulary KL(adapted || base) at the sampling temperature, computed here independently."""
    tokenizer.padding_side = "left"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(make_model(tokenizer), lora).eval()
    rows = [{"prompt": [{"role": "user", "content": "Choose one word: a, b, c."}], "choices": ["a", "b", "c"]}]
    assert study._kl_to_initial(model, tokenizer, rows, 6, 0.7, samples=1, seed=0) == pytest.approx(0.0, abs=1e-7)

    generator = torch.Generator().manual_seed(0)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data = 0.5 * torch.randn(parameter.shape, generator=generator)
    kl = study._kl_to_initial(model, tokenizer, rows, 6, 0.7, samples=1, seed=0)
    assert kl > 1e-3

    prompt = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    with torch.no_grad():
        sequence = model.generate(
            input_ids=prompt_ids, do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=6,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        completion_length = sequence.size(1) - prompt_ids.size(1)
        adapted = torch.log_softmax(model(sequence).logits[0, -completion_length - 1 : -1] / 0.7, dim=-1)
        with model.disable_adapter():
            base = torch.log_softmax(model(sequence).logits[0, -completion_length - 1 : -1] / 0.7, dim=-1)
    expected = torch.nn.functional.kl_div(base, adapted, log_target=True, reduction="none").sum(-1).mean()
    assert tokenizer.eos_token_id not in sequence[0, prompt_ids.size(1) :].tolist()  # every token counts
    assert kl == pytest.approx(expected.item(), rel=1e-4)


def test_configurations_name_the_method_the_bound_and_the_steps_per_generation_batch():
    assert study._parse_config("loglinear-s4") == ("loglinear", 4, 1)
    assert study._parse_config("recompute-s4-k4") == ("recompute", 4, 4)
    for bad in ("loglinear-s4-k0", "adam-s4", "loglinear-4", "loglinear-s4-kx"):
        with pytest.raises(SystemExit, match="unknown configuration"):
            study._parse_config(bad)


def test_paired_comparison_is_loglinear_minus_each_method_over_shared_seeds_per_regime():
    """The pre-registered primary comparison: per staleness bound and steps per batch, loglinear's final held-out
    reward minus each other method's, over the seeds both have; resolved only with an interval that excludes 0."""
    final = {
        "loglinear-s4-k4": {42: 0.9, 43: 0.8, 44: 0.85},
        "recompute-s4-k4": {42: 0.5, 43: 0.45, 44: 0.55, 45: 0.1},  # seed 45 has no loglinear run: left out
        "behavior-s4-k4": {42: 1.0, 43: 0.6, 44: 0.7},
        "loglinear-s4": {42: 0.5},
        "behavior-s4": {42: 0.25},
        "recompute-s8": {42: 0.3},  # no loglinear at staleness 8: no comparison
    }
    comparisons = {(c["staleness"], c["steps_per_batch"], c["difference"]): c for c in study.paired_comparisons(final)}
    assert set(comparisons) == {
        (4, 4, "loglinear - recompute"),
        (4, 4, "loglinear - behavior"),
        (4, 1, "loglinear - behavior"),
    }
    ahead = comparisons[(4, 4, "loglinear - recompute")]
    assert ahead["seeds"] == [42, 43, 44] and ahead["mean"] == pytest.approx(0.35) and ahead["resolved"]
    assert ahead["low"] < 0.35 < ahead["high"] and ahead["low"] > 0
    mixed = comparisons[(4, 4, "loglinear - behavior")]
    assert mixed["mean"] == pytest.approx(0.25 / 3) and not mixed["resolved"] and mixed["low"] < 0 < mixed["high"]
    single = comparisons[(4, 1, "loglinear - behavior")]
    assert single["seeds"] == [42] and single["mean"] == pytest.approx(0.25) and not single["resolved"]
    assert single["p"] is None and single["holm_p"] is None and not single["equivalent"]
    # a family of one: Holm's p is the raw p, below 0.05 exactly where the interval excludes 0
    assert ahead["holm_p"] == ahead["p"] < 0.05 and mixed["holm_p"] == mixed["p"] > 0.05


def test_paired_comparisons_correct_within_a_family_and_test_equivalence_against_the_margin():
    """Holm within one difference across the regimes; TOST against the declared margin; else not resolved."""
    final = {
        "loglinear-s2": {42: 0.90, 43: 0.80, 44: 0.85, 45: 0.70},
        "recompute-s2": {42: 0.80, 43: 0.71, 44: 0.74, 45: 0.62},  # +0.095 +- small: p about 0.002
        "loglinear-s4": {42: 0.90, 43: 0.80, 44: 0.85, 45: 0.70},
        "recompute-s4": {42: 0.86, 43: 0.74, 44: 0.83, 45: 0.60},  # +0.055 with more spread: p 0.049
        "loglinear-s8": {42: 0.5, 43: 0.6, 44: 0.55, 45: 0.52},
        "recompute-s8": {42: 0.49, 43: 0.61, 44: 0.55, 45: 0.51},  # tight around 0: equivalent within 0.05
    }
    comparisons = {c["staleness"]: c for c in study.paired_comparisons(final)}
    assert study.EQUIVALENCE_MARGIN == 0.05 and comparisons[8]["equivalence_margin"] == 0.05
    raw = sorted(c["p"] for c in comparisons.values())
    assert comparisons[2]["holm_p"] == pytest.approx(3 * raw[0])
    assert comparisons[4]["p"] < 0.05 < comparisons[4]["holm_p"] == pytest.approx(max(3 * raw[0], 2 * raw[1]))
    assert comparisons[2]["resolved"] and not comparisons[4]["resolved"] and comparisons[4]["low"] > 0
    assert comparisons[8]["equivalent"] and not comparisons[8]["resolved"]
    assert not comparisons[4]["equivalent"]  # ahead by 0.06, more than the margin: neither
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in study._comparison_lines(list(comparisons.values()))[4:]]
    assert verdicts == ["difference", "not resolved", "equivalent"]


def test_confirmation_runs_the_preregistered_plan_in_its_own_folder(tmp_path):
    """``--confirmation`` is the plan PREREGISTRATION.md fixes (three methods at s4-k4, seeds 42-46); with nothing run
    its summary names every run as missing, in its own folder, and the first study's summary is not touched."""
    registered = open(os.path.join(ROOT, "benchmarks", "results", "staleness", "PREREGISTRATION.md")).read()
    assert study.CONFIRMATION_SEEDS == (42, 43, 44, 45, 46) and "42, 43, 44, 45, 46" in registered
    assert all(f"`{name}`" in registered for name in study.CONFIRMATION_CONFIGS)
    out = tmp_path / "confirmation"
    command = [sys.executable, "-m", "benchmarks.staleness", "--confirmation", "--summary-only", "--out", str(out)]
    subprocess.run(command, check=True, timeout=300, capture_output=True, text=True, cwd=ROOT)
    missing = json.loads((out / "summary.json").read_text())["missing"]
    assert missing == [f"{name}@{seed}" for name in study.CONFIRMATION_CONFIGS for seed in study.CONFIRMATION_SEEDS]
