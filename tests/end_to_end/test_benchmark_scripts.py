"""Every script in benchmarks/ runs in the suite at a tiny size, so none can rot unnoticed; docs/TIMELINE.md quotes the
committed timeline-overhead results.

Most scripts have their run in a file of their own (``SMOKE_TESTS`` names it); the two small ones run here.
"""

import ast
import importlib
import json
import math
import os
import re

from benchmarks.common.provenance import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
SMOKE_TESTS = {
    "approximation": (
        "tests/end_to_end/test_approximation.py",
        "test_quick_approximation_run_records_the_error_by_anchor_age",
    ),
    "backends": ("tests/integration/test_vllm.py", "test_backends_benchmark_reports_every_field"),
    "compare": ("tests/end_to_end/test_benchmark.py", "test_quick_benchmark_writes_a_complete_report"),
    "compiled_decode": ("tests/end_to_end/test_benchmark_scripts.py", "test_compiled_decode_measures_each_path"),
    "dynamic_sampling": (
        "tests/end_to_end/test_arm_studies.py",
        "test_dynamic_sampling_study_records_the_filter_and_pairs_the_arms",
    ),
    "in_flight": ("tests/end_to_end/test_arm_studies.py", "test_in_flight_study_records_the_loads_and_pairs_the_arms"),
    "lora_memory": ("tests/end_to_end/test_benchmark.py", "test_lora_memory_report_on_the_tiny_model"),
    "guard_smollm2": (
        "tests/end_to_end/test_oracle_and_guard.py",
        "test_quick_guard_smollm2_runs_the_three_methods_on_one_seed",
    ),
    "guard_map": (
        "tests/end_to_end/test_oracle_and_guard.py",
        "test_quick_guard_map_pairs_the_guard_with_both_methods",
    ),
    "oracle": ("tests/end_to_end/test_oracle_and_guard.py", "test_quick_oracle_records_every_token_and_decides"),
    "proximal_map": (
        "tests/end_to_end/test_proximal_map.py",
        "test_quick_map_records_the_schedule_summarizes_with_intervals_and_resumes",
    ),
    "regenerate": (
        "tests/end_to_end/test_regenerate.py",
        "test_committed_summaries_and_documents_equal_what_their_records_regenerate",
    ),
    "same_runs": ("tests/end_to_end/test_proximal_map.py", "test_same_runs_names_the_first_step_where_two_runs_part"),
    "soak": ("tests/end_to_end/test_soak.py", "test_short_soak_has_no_leaks"),
    "staleness": (
        "tests/end_to_end/test_staleness_study.py",
        "test_quick_study_records_every_field_summarizes_and_resumes",
    ),
    "task_probe": ("tests/end_to_end/test_benchmark_scripts.py", "test_task_probe_runs_on_a_tiny_model"),
    "time_to_accuracy": (
        "tests/end_to_end/test_time_to_accuracy.py",
        "test_quick_run_summarizes_and_skips_finished_runs",
    ),
    "reward_workers": (
        "tests/end_to_end/test_benchmark_scripts.py",
        "test_reward_workers_smoke_run_records_every_arm",
    ),
    "timeline_overhead": (
        "tests/end_to_end/test_benchmark_scripts.py",
        "test_timeline_overhead_smoke_run_measures_everything",
    ),
}
"""Benchmark script (``python -m benchmarks.<script>``) -> the test that runs it at a tiny size."""


def benchmark_scripts() -> list[str]:
    """The modules of benchmarks/ that run as scripts: its files, and its packages with a ``__main__``
    (``common``, the shared library, has none)."""
    entries = os.listdir(BENCHMARKS)
    files = [name.removesuffix(".py") for name in entries if name.endswith(".py") and name != "__init__.py"]
    packages = [name for name in entries if os.path.exists(os.path.join(BENCHMARKS, name, "__main__.py"))]
    return sorted(files + packages)


def load_script(name):
    return importlib.import_module(f"benchmarks.{name}")


def test_every_benchmark_script_has_a_smoke_test():
    assert benchmark_scripts() == sorted(SMOKE_TESTS), "add the new script's tiny run to SMOKE_TESTS"
    for script, (path, function) in SMOKE_TESTS.items():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{script}: {path}::{function} does not exist"


def test_timeline_overhead_smoke_run_measures_everything(tmp_path):
    results = load_script("timeline_overhead").main(["--smoke", "--out", str(tmp_path / "overhead.json")])
    assert json.loads((tmp_path / "overhead.json").read_text()) == json.loads(json.dumps(results))
    for key in ("record_seconds_on", "record_seconds_off", "trace_write_seconds_1k_spans", "step_time_on"):
        assert math.isfinite(results[key]) and results[key] > 0, key
    assert results["spans_per_step"] >= 8  # a step, its parts, the batch and its parts, the publication
    assert len(results["step_times_on"]) == len(results["step_times_off"]) == 1
    assert validate(results["provenance"], "overhead.json")["unrecorded"] == []


def test_the_heavy_math_reward_checks_the_last_expression_exactly():
    from benchmarks.common.math_reward import math_verify_reward, parse

    assert parse("(2 + 3) * 4 / -2") == -10 and parse("1.5 * 2") == 3
    texts = ["3 + 4 = 7", "(2*3)+1", "it is 8", "no answer", "7 / 0", "7.0"]
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    assert math_verify_reward(completions, ["7"] * len(texts)) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_reward_workers_smoke_run_records_every_arm(tmp_path):
    record = load_script("reward_workers").main(["--smoke", "--out", str(tmp_path / "reward_workers.json")])
    assert json.loads((tmp_path / "reward_workers.json").read_text()) == json.loads(json.dumps(record))
    assert [run["arm"] for run in record["runs"]] == ["grpo", "thread", "workers"]
    for run in record["runs"]:
        assert len(run["step_seconds"]) == len(run["stall_seconds"]) == len(run["trainer_wait_seconds"]) == 3
        assert all(math.isfinite(value) and value >= 0 for value in run["stall_seconds"])
        assert validate(run["provenance"], run["arm"])["unrecorded"] == []
    assert record["runs"][1]["trainer_wait_seconds"] != [0.0] * 3  # the asynchronous arms' waits are read
    assert record["meta"]["reward_seconds_per_batch"] > 0 and record["meta"]["reward_num_workers"] == 1
    assert set(record["summary"]) >= {"grpo", "thread", "workers", "workers_over_thread_step_time"}
    assert validate(record["meta"]["provenance"], "reward_workers.json")["unrecorded"] == []


def test_task_probe_runs_on_a_tiny_model(tmp_path, capsys):
    from a3po_trl.tasks.tiny_model import make_byte_tokenizer, make_tiny_llama

    tokenizer = make_byte_tokenizer()
    make_tiny_llama(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    load_script("task_probe").main(
        ["--model", str(tmp_path), "--prompts", "2", "--samples", "2", "--max-new-tokens", "3"]
    )
    out = capsys.readouterr().out
    assert re.search(r"^word_choice: mean reward \d\.\d{3}, exact \d+/4, groups without spread \d/2$", out, re.M)
    assert re.search(r"^bare_sum: mean reward \d\.\d{3}, exact \d+/4", out, re.M)


def test_the_timeline_page_quotes_the_committed_timeline_overhead_results():
    results = json.load(open(os.path.join(BENCHMARKS, "results", "timeline_overhead.json")))
    section = open(os.path.join(ROOT, "docs", "TIMELINE.md"), encoding="utf-8").read()
    quoted = [
        f"{results['record_seconds_on'] * 1e6:.1f} us",
        f"{results['record_seconds_off'] * 1e6:.2f} us",
        f"{results['spans_per_step']:.0f} spans per optimizer step",
        f"{results['recording_seconds_per_step'] * 1e6:.0f} us per step",
        f"{results['recording_fraction_of_step']:.2%}",
        f"{results['step_time_on']:.3f} s",
        f"{results['step_time_off']:.3f} s",
        f"{results['trace_write_seconds_50k_spans']:.2f} s",
    ]
    missing = [figure for figure in quoted if figure not in section]
    assert not missing, f"docs/TIMELINE.md's cost paragraph does not quote {missing}"


def test_compiled_decode_measures_each_path(tmp_path):
    """A tiny run: every path timed, the first compiled call compiling, the tokens compared, the rule applied."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "benchmarks.compiled_decode", "--models", "tiny", "--reps", "1", "--rows", "2"]
    command += ["--new-tokens", "4", "--out", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, timeout=900, env=env, capture_output=True, text=True, cwd=ROOT)
    report = json.loads((tmp_path / "compiled-decode.json").read_text())
    tiny = report["results"]["tiny"]
    assert set(tiny["paths"]) == {"eager", "static", "compiled"}
    assert all(p["cpu_per_token"]["median"] > 0 for p in tiny["paths"].values())
    assert (
        tiny["paths"]["compiled"]["first_call"]["wall_seconds"] > tiny["paths"]["eager"]["first_call"]["wall_seconds"]
    )
    assert tiny["token_agreement"] == 1.0 and tiny["max_logp_difference"] < 1e-4  # fp32: the same greedy tokens
    assert report["decision"]["keep"] is (tiny["cpu_ratio"] >= 2.0)
    assert "**Decision**" in (tmp_path / "compiled-decode.md").read_text()
    block = validate(report["provenance"], "compiled-decode.json")  # when, at which commit, where, the load
    assert block["unrecorded"] == [] and all(len(p["cpu_per_token"]["all"]) == 1 for p in tiny["paths"].values())
