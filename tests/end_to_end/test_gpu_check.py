"""scripts/gpu_check.py: ``--cpu`` passes and reports every step; a broken generator or a crash makes it fail; its
checking function flags each kind of bad number.

The ``--cpu`` runs are subprocesses (as CI runs the script); the fault runs load the script in a subprocess, break one
thing (the generator never loads new weights; a reward function that raises in the generation thread) and call its
``main``. Timings are never asserted, only that they were measured.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")
PAIRS = ["lora-bf16", "full-bf16", "full-fp32", "lora-fp32"]
KINDS = {"a3po-s1": 1, "a3po-s0": 0, "grpo": None}


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env():
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(command, timeout=300):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())


# ---- the CPU plan ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "cpu.json"
    completed = _run([sys.executable, SCRIPT, "--cpu", "--out", str(out)])
    with open(out) as f:
        report = json.load(f)
    return completed, report


def test_cpu_plan_passes(cpu_run):
    completed, report = cpu_run
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert completed.stdout.rstrip().endswith("GPU CHECK PASSED")
    assert report["passed"] is True and report["failures"] == [] and report["warnings"] == []
    assert report["environment"]["device"] == "cpu" and report["environment"]["parameters"] > 0


def test_cpu_plan_runs_every_pair_and_prints_every_step(cpu_run):
    completed, report = cpu_run
    names = [f"{kind}/{pair}" for pair in PAIRS for kind in KINDS]
    assert [run["name"] for run in report["runs"]] == names
    for name in names:
        for step in (1, 2, 3):
            assert re.search(rf"^  \[{re.escape(name)}\] step {step}, [0-9.]+ s, loss ", completed.stdout, re.M), name
        assert re.search(rf"^\| {re.escape(name)} \| (bfloat16|float32) \| [0-9.]+ \|", completed.stdout, re.M), name
    for name in names:
        if not name.startswith("grpo"):
            assert re.search(rf"^  {re.escape(name)} : grpo/\S+ = [0-9.]+$", completed.stdout, re.M), name


def test_cpu_plan_numbers_are_sane(cpu_run):
    _, report = cpu_run
    for run in report["runs"]:
        name, steps = run["name"], run["steps"]
        assert run["error"] is None, name
        assert run["max_staleness"] == KINDS[run["kind"]], name
        assert [step["step"] for step in steps] == [1, 2, 3], name
        for step in steps:
            assert step["seconds"] > 0 and step["peak_memory_gib"] is None, name  # no GPU memory on CPU
            assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]), name
        if run["trainer"] == "GRPOTrainer":
            assert run["dtypes"] == {} and "staleness_max" not in steps[0], name
            continue
        # on-policy tokens at step 1 always, at every step with staleness 0: generator and trainer agree to bf16
        # rounding of a 2-layer model (about 1e-4)
        measured = [step for step in steps if "behavior_mismatch_mean" in step]
        assert [step["step"] for step in measured] == ([1, 2, 3] if run["max_staleness"] == 0 else [1]), name
        assert all(0 <= step["behavior_mismatch_mean"] < 5e-3 for step in measured), name
        assert steps[0]["staleness_max"] == 0 and all(s["staleness_max"] <= run["max_staleness"] for s in steps), name
        if run["max_staleness"] == 1:  # stale tokens: one step moved the policy by more than the mismatch threshold
            assert all(s["drift_per_step"] > load_gpu_check().MAX_BEHAVIOR_MISMATCH for s in steps[1:]), name
        assert set(run["dtypes"]) == {"training weights", "generator copy", "staging buffer"}, name
        assert "not found" not in run["dtypes"].values(), (name, run["dtypes"])  # the introspection names are current
        expected = "bfloat16" if run["model_dtype"] == "bfloat16" else "float32"
        assert run["dtypes"]["training weights"].startswith(expected), (name, run["dtypes"])
        ratio = report["ratios"][name]
        assert math.isfinite(ratio) and ratio > 0, name


# ---- faults the CPU plan must catch ---------------------------------------------------------------------------------
def _run_with_fault(fault: str, runs: str, tmp_path):
    """Run the script's ``main`` in a subprocess after ``fault`` (Python code with ``gpu_check`` the loaded script)."""
    out = tmp_path / "report.json"
    driver = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("gpu_check", {SCRIPT!r})
        gpu_check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gpu_check)
        """
    )
    driver += textwrap.dedent(fault)
    driver += f"\nsys.exit(gpu_check.main(['--cpu', '--runs', {runs!r}, '--out', {str(out)!r}]))\n"
    completed = _run([sys.executable, "-c", driver])
    with open(out) as f:
        return completed, json.load(f)


def test_a_generator_that_misses_weight_syncs_fails(tmp_path):
    """The generator keeps its first weights: at staleness 0 its log-probs drift from the trainer's by about one
    optimizer step's movement per step, above the threshold."""
    fault = """
        from a3po_trl.generation.hf.backend import HFGenerateBackend
        HFGenerateBackend.load_weights = lambda self, weights, version: None
        """
    completed, report = _run_with_fault(fault, "full-bf16", tmp_path)
    assert completed.returncode == 1, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "GPU CHECK FAILED" in completed.stdout and "GPU CHECK PASSED" not in completed.stdout
    assert report["passed"] is False and report["failures"]
    assert all(f.startswith("a3po-s0/full-bf16: step ") and "log-prob mismatch" in f for f in report["failures"])


def test_a_crash_fails_and_the_other_runs_still_run(tmp_path):
    """A reward function that raises in AsyncA3POTrainer's generation thread: both AsyncA3POTrainer runs crash,
    GRPOTrainer (rewards in the main thread) completes, and the script exits 1 naming the error."""
    fault = """
        import threading
        def broken_reward(completions, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("reward server unreachable")
            return [0.0] * len(completions)
        gpu_check.even_digit_reward = broken_reward
        """
    completed, report = _run_with_fault(fault, "lora-bf16", tmp_path)
    assert completed.returncode == 1, completed.stdout[-4000:] + completed.stderr[-4000:]
    runs = {run["name"]: run for run in report["runs"]}
    assert "reward server unreachable" in runs["a3po-s1/lora-bf16"]["error"]
    assert "reward server unreachable" in runs["a3po-s0/lora-bf16"]["error"]
    assert runs["grpo/lora-bf16"]["error"] is None and len(runs["grpo/lora-bf16"]["steps"]) == 3
    assert "  - a3po-s1/lora-bf16: crashed: " in completed.stdout
    assert "| grpo/lora-bf16 |" in completed.stdout  # the summary is printed after a crash


# ---- the checking function, fed bad numbers -------------------------------------------------------------------------
def good_run(trainer="AsyncA3POTrainer", max_staleness=1, steps=3):
    a3po = trainer == "AsyncA3POTrainer"
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "seconds": 1.0, "peak_memory_gib": 2.0, "loss": 0.01, "grad_norm": 0.5}
        if a3po:
            staleness = 0 if step == 1 else max_staleness
            record.update(staleness_mean=float(staleness), staleness_max=float(staleness))
            if staleness == 0:
                record.update(behavior_mismatch_mean=0.004, behavior_mismatch_max=0.2)
            else:
                record.update(drift_per_step=0.3)
        records.append(record)
    kind = f"a3po-s{max_staleness}" if a3po else "grpo"
    return {
        "name": f"{kind}/full-bf16",
        "pair": "full-bf16",
        "kind": kind,
        "trainer": trainer,
        "planned_steps": steps,
        "max_staleness": max_staleness if a3po else None,
        "steps": records,
        "error": None,
    }


def test_good_runs_have_no_failures():
    gpu_check = load_gpu_check()
    runs = [good_run(), good_run(max_staleness=0), good_run("GRPOTrainer")]
    assert gpu_check.find_failures(runs) == []
    assert gpu_check.blind_spots(runs) == []


def _set(step, key, value):
    step[key] = value


FAULTS = {
    "crash": (lambda run: run.update(error="CUDA error: out of memory"), "crashed: CUDA error: out of memory"),
    "no step": (lambda run: run.update(steps=[], error=None), "no optimizer step completed"),
    "too few steps": (lambda run: run["steps"].pop(), "completed 2 of 3 steps"),
    "nan loss": (lambda run: _set(run["steps"][1], "loss", float("nan")), "step 2 loss is nan"),
    "inf grad norm": (lambda run: _set(run["steps"][2], "grad_norm", float("inf")), "step 3 grad_norm is inf"),
    "no loss logged": (lambda run: run["steps"][0].pop("loss"), "step 1 logged no loss"),
    "mismatch": (lambda run: _set(run["steps"][0], "behavior_mismatch_mean", 0.08), "log-prob mismatch 0.08 nats"),
    "nan mismatch": (lambda run: _set(run["steps"][0], "behavior_mismatch_mean", float("nan")), "mismatch nan"),
    "mismatch never measured": (
        lambda run: run["steps"][0].pop("behavior_mismatch_mean"),
        "behavior mismatch never measured",
    ),
    "too stale": (lambda run: _set(run["steps"][2], "staleness_max", 2.0), "step 3 staleness 2.0 > max_staleness 1"),
    "no staleness logged": (lambda run: run["steps"][1].pop("staleness_max"), "step 2 logged no staleness"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_bad_number_fails(fault):
    gpu_check = load_gpu_check()
    run = good_run()
    breaks, message = FAULTS[fault]
    breaks(run)
    failures = gpu_check.find_failures([good_run("GRPOTrainer"), run])
    assert len(failures) == 1 and failures[0].startswith("a3po-s1/full-bf16: ") and message in failures[0], failures


def test_the_mismatch_threshold_is_inclusive_and_configurable():
    gpu_check = load_gpu_check()
    run = good_run()
    run["steps"][0]["behavior_mismatch_mean"] = gpu_check.MAX_BEHAVIOR_MISMATCH
    assert gpu_check.find_failures([run]) == []
    assert len(gpu_check.find_failures([run], max_behavior_mismatch=0.01)) == 1


def test_grpo_runs_need_no_a3po_metrics_but_their_own_checks():
    gpu_check = load_gpu_check()
    run = good_run("GRPOTrainer")
    run["steps"][0]["loss"] = float("-inf")
    assert gpu_check.find_failures([run]) == ["grpo/full-bf16: step 1 loss is -inf"]


def test_a_step_too_small_to_show_a_missed_weight_sync_is_a_warning():
    gpu_check = load_gpu_check()
    run = good_run()
    for step in run["steps"][1:]:
        step["drift_per_step"] = 0.01
    assert gpu_check.find_failures([run]) == []
    warnings = gpu_check.blind_spots([run])
    assert len(warnings) == 1 and warnings[0].startswith("a3po-s1/full-bf16: one optimizer step moved the policy")


def test_ratios_use_the_steps_after_the_first():
    gpu_check = load_gpu_check()
    a3po, grpo = good_run(), good_run("GRPOTrainer")
    for run, seconds in ((a3po, [9.0, 1.0, 2.0]), (grpo, [5.0, 3.0, 3.0])):
        for step, value in zip(run["steps"], seconds):
            step["seconds"] = value
    assert gpu_check.seconds_per_step(a3po) == 1.5
    assert gpu_check.speed_ratios([a3po, grpo]) == {"a3po-s1/full-bf16": 0.5}
