"""``python -m benchmarks.compare``: the plan covers every configuration, and a short run writes a complete, sane
report.

Timings are never asserted (the machine is shared and small); only that they were measured and are positive.
"""

import json
import math
import os
import subprocess
import sys

from a3po_trl.generation.weights.store import STAGING_ALIGNMENT
from benchmarks.common.provenance import validate
from benchmarks.compare import cli as compare
from benchmarks.compare.plan import build_plan, common_settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STALENESS = (0, 1, 2, 4)


def expected_names(single_thread_trl: bool) -> set[str]:
    names = {"microbench", "trl", "pieces-loglinear", "pieces-recompute"}
    names |= {f"{method}-s{d}" for method in ("recompute", "loglinear") for d in STALENESS}
    return names | ({"trl-t1"} if single_thread_trl else set())


def test_quick_plan_keeps_every_configuration():
    options = compare.parse_args(["--quick"])
    plan = build_plan(options)
    assert options.model == "tiny" and options.staleness == list(STALENESS)
    assert options.steps > options.warmup_steps
    assert {c["name"] for c in plan} == expected_names((os.cpu_count() or 1) > 1)
    assert len(plan) == len({c["run_id"] for c in plan})
    assert all(c["threads"]["training"] == 1 and c["threads"]["generation"] == 1 for c in plan if c["kind"] == "a3po")
    assert common_settings(options)["bf16"] is False  # GRPOConfig's bf16=True default is overridden on CPU


def test_extra_seeds_only_for_the_selected_configurations():
    options = compare.parse_args(
        ["--model", "smollm2", "--seeds", "3", "--sync-threads", "2", "--extra-seeds-for", "trl,loglinear-s1"]
    )
    plan = build_plan(options)
    repeated = {c["run_id"] for c in plan if c["seed"] > 0}
    assert repeated == {f"{n}@seed{s}" for n in ("trl", "trl-t1", "loglinear-s1") for s in (1, 2)}
    assert sum(c["name"] == "microbench" for c in plan) == 1
    assert options.batch_size == 8 and options.num_generations == 8 and options.max_completion_length == 32


def test_generation_process_adds_each_asynchronous_configuration_in_a_process_of_its_own():
    options = compare.parse_args(
        ["--configs", "loglinear-s1", "--staleness", "1", "--thread-variants", "t1g1", "--generation-process"]
    )
    plan = {c["name"]: c for c in build_plan(options) if c["seed"] == 0}
    assert set(plan) == {"loglinear-s1", "loglinear-s1-t1g1", "loglinear-s1-proc", "loglinear-s1-proc-t1g1"}
    assert {name for name, c in plan.items() if c.get("generation_process")} == {
        "loglinear-s1-proc",
        "loglinear-s1-proc-t1g1",
    }
    process = plan["loglinear-s1-proc-t1g1"]
    assert process["method"] == "loglinear" and process["max_staleness"] == 1
    assert process["threads"]["training"] == 1 and process["threads"]["generation"] == 1
    without = compare.parse_args(["--configs", "loglinear-s1", "--staleness", "1"])
    assert [c["name"] for c in build_plan(without) if c["seed"] == 0] == ["loglinear-s1"]


def run_compare(tmp_path, *args, name="bench", timeout=900):
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.compare", "--quiet-wait", "0", "--out", str(out), "--name", name]
    command += args
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    with open(out / f"{name}.json") as f:
        report = json.load(f)
    return report, out


def positive(value) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def non_negative(value) -> bool:
    return value is not None and math.isfinite(value) and value >= 0


def check_files(out):
    with open(out / "bench.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "bench.md").read_text()
    assert "| config |" in markdown and "## Targets" in markdown and "## Each thread's CPU time per step" in markdown
    return markdown


def check_training_config(name, config, report):
    kind, staleness = config["kind"], config["max_staleness"]
    for key in ("step_time_median", "step_time_mean", "generation_time", "completion_tokens_per_second"):
        assert positive(config[key]), (name, key, config[key])
    assert positive(config["generation_tokens_per_second"]), name
    assert positive(config["peak_rss_mb"]), name
    assert config["reward_final_mean"] is not None and math.isfinite(config["reward_final_mean"]), name
    assert len(config["reward_final_values"]) == len(config["seeds"]) >= 1
    assert non_negative(config["reward_time"]), name
    assert 0 <= config["clip_ratio_low"] <= 1 and 0 <= config["clip_ratio_high"] <= 1, name
    if staleness == 0:
        assert config["staleness_mean"] == 0 and config["staleness_max"] == 0, name
    assert positive(config["trainer_cpu"]), name  # the training thread's CPU seconds per step
    if kind == "trl":
        assert config["threads"]["process"] >= 1
        assert config["generator_cpu"] is None  # one thread
        return
    if kind != "pieces":  # the generation thread's, read through its CPU clock (0 where it had finished before)
        assert non_negative(config["generator_cpu"]), name
    assert staleness is not None and 0 <= config["staleness_mean"] <= config["staleness_max"] <= staleness, name
    for key in ("prox_time", "trainer_wait_time", "generator_wait_time", "weight_sync_time", "behavior_logps_time"):
        assert non_negative(config[key]), (name, key, config[key])
    if "recompute" in name:  # one optimizer step per batch: the training forward's own log-probs, no forward to time
        assert config["prox_time"] == 0, name
    else:
        assert positive(config["prox_time"]), name  # the interpolation was timed
    assert positive(config["importance_weight_mean"]) and positive(config["importance_weight_max"]), name
    assert 0 <= config["importance_weight_masked_frac"] <= 1, name
    if staleness == 0:
        assert abs(config["importance_weight_max"] - 1.0) < 1e-3, name  # on-policy: pi_prox == pi_behav
    assert config["threads"]["training"] == 1
    if kind == "pieces":
        assert positive(config["generation_piece"]) and positive(config["training_piece"]), name
    else:
        assert config["threads"]["generation"] == 1


def check_runs(report):
    meta = validate(report["meta"]["provenance"], "the report")  # where and when the invocation ran
    assert meta["unrecorded"] == [] and meta["threads"]["process"] == report["meta"]["threads"]["trl"]
    for run in report["runs"]:
        block = validate(run["provenance"], run["run_id"])  # each run's own, with the threads it set
        assert block["unrecorded"] == [] and block["threads"]["process"] == run["threads"]["process"], run["run_id"]
        assert (block["threads"]["generation"] is None) is (run["kind"] != "a3po"), run["run_id"]
        assert run["overlap_warning"] in (None, False) or run["overlap_warning"]["steps"], run["run_id"]
        assert len(run["step_times"]) == run["steps_done"] == report["meta"]["steps"], run["run_id"]
        assert all(positive(t) for t in run["step_times"]), run["run_id"]
        if run["engine"] is not None:  # nothing generated was dropped, the queue stayed within its bound
            engine = run["engine"]
            assert engine["produced"] == engine["consumed"] == engine["num_batches"], run["run_id"]
            assert engine["max_queue_depth"] <= engine["queue_bound"] == run["max_staleness"] + 1
        assert run["peak_rss_method"]


def test_quick_benchmark_writes_a_complete_report(tmp_path):
    """Every configuration kind, on the tiny model, in one shared worker process (fast start-up)."""
    report, out = run_compare(
        tmp_path,
        "--quick",
        "--isolation",
        "shared",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
        "--sync-threads",
        "1",
        "--seeds",
        "2",
        "--extra-seeds-for",
        "loglinear-s1,recompute-s1",
    )
    assert report["errors"] == []
    markdown = check_files(out)
    meta = report["meta"]
    assert meta["bf16"] is False and meta["device"] == "cpu" and meta["model_key"] == "tiny"
    assert meta["threads"] == {"trl": 1, "a3po_training": 1, "a3po_generation": 1, "pieces": 1}
    assert meta["staleness"] == list(STALENESS) and meta["steps"] == 3
    assert set(report["configs"]) | {"microbench"} == expected_names(single_thread_trl=False)
    for name, config in report["configs"].items():
        check_training_config(name, config, report)
        assert f"| {name} |" in markdown
    check_runs(report)
    threaded = [c for c in report["configs"].values() if c["kind"] == "a3po"]
    assert any(positive(c["generator_cpu"]) for c in threaded)  # the generation thread's CPU time was read

    micro = report["microbench"]
    assert micro["batch_shape"] == [
        meta["batch"]["per_device_train_batch_size"],
        meta["batch"]["max_completion_length"],
    ]
    for row in micro["by_threads"]:
        assert positive(row["recompute_seconds"]) and positive(row["loglinear_seconds"]) and positive(row["ratio"])

    for method in ("recompute", "loglinear"):
        pipeline = report["pipeline"][method]
        assert positive(pipeline["generation_alone"]) and positive(pipeline["training_alone"])
        assert pipeline["ideal_pipelined"] == max(pipeline["generation_alone"], pipeline["training_alone"])
        assert set(pipeline["achieved"]) == {str(d) for d in STALENESS}
        assert all(positive(a["ratio_to_ideal"]) for a in pipeline["achieved"].values())
    assert report["baseline"] == "trl"
    assert all(positive(report["speedup_vs_trl"][n]) for n in report["configs"])
    assert set(report["reward_comparison"]) == {str(d) for d in STALENESS}
    comparison = report["reward_comparison"]["1"]  # two seeds: run-to-run noise measured
    assert comparison["n_seeds"] == [2, 2] and comparison["within_noise"] in (True, False)
    assert report["configs"]["loglinear-s1"]["seeds"] == [0, 1] and report["configs"]["trl"]["seeds"] == [0]
    kinds = {t["target"].split(" ")[0] for t in report["targets"]}
    assert {"loglinear", "recompute-s1", "loglinear-s1"} <= kinds
    assert all(t["met"] in (True, False, None) for t in report["targets"])


def test_fresh_subprocess_per_configuration_and_merge(tmp_path):
    """The default isolation (one fresh subprocess per configuration, peak RSS from its ru_maxrss), in two
    invocations: the second asks for both configurations again, reruns nothing of the first (resume) and merges its
    runs (--merge-from)."""
    common = ("--quick", "--sync-threads", "1", "--steps", "3", "--warmup-steps", "1")
    first, out = run_compare(tmp_path, *common, "--configs", "trl", name="first")
    assert set(first["configs"]) == {"trl"} and not os.path.exists(out / "first.runs")  # the report holds them all
    (run,) = first["records"]
    assert run["run_seconds"] > run["result"]["train_seconds"] and run["machine"]["cpu_count"] >= 1  # the runner's
    report, out = run_compare(
        tmp_path, *common, "--configs", "trl,loglinear-s2", "--merge-from", str(out / "first.json"), name="bench"
    )
    assert report["errors"] == []
    check_files(out)
    assert set(report["configs"]) == {"trl", "loglinear-s2"}
    assert {r["run_id"]: r["reused_from"] for r in report["runs"]} == {
        "trl@seed0": "first.json",
        "loglinear-s2@seed0": None,
    }
    for name, config in report["configs"].items():
        check_training_config(name, config, report)
    check_runs(report)
    assert all(run["peak_rss_method"].startswith("ru_maxrss") for run in report["runs"])
    assert report["meta"]["isolation"] == "process" and len(report["meta"]["merged_commands"]) == 1
    assert positive(report["speedup_vs_trl"]["loglinear-s2"])


def test_lora_memory_report_on_the_tiny_model(tmp_path):
    """benchmarks/lora_memory.py: the LoRA generator shares the base and owns only adapter-sized tensors."""
    out = tmp_path / "lora_memory.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.lora_memory", "--model", "tiny", "--lora-r", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads(out.read_text())
    full, lora = report["results"]
    block = validate(report["provenance"], "lora_memory.json")
    assert block["unrecorded"] == [] and block["threads"]["training"] is None and block["threads"]["process"] >= 1
    assert full["shared_parameters"] == 0 and full["copied_parameters"] == full["model_parameters"]
    assert lora["shared_parameters"] == full["model_parameters"]  # the whole base is the trainer's own tensors
    assert 0 < lora["copied_parameters"] < full["copied_parameters"] // 10
    # the generator owns its adapter and a staging buffer of the same size; a full copy owns the whole model twice
    # (one buffer, each weight's view at an aligned offset: less than one alignment of padding a weight)
    assert lora["publish_bytes"] == 4 * lora["copied_parameters"]
    assert 0 <= lora["staging_bytes"] - lora["publish_bytes"] < STAGING_ALIGNMENT * lora["staged_weights"]
    assert lora["generator_weights_bytes"] < full["generator_weights_bytes"] // 5
    assert lora["extra_bytes"] < full["extra_bytes"] // 5
