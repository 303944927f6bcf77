"""scripts/gpu_check.py: ``--cpu --report`` runs every check, each in its own process, and writes a report whose every
check passed with its figures; a generator that misses weight syncs, a crash and a hang each fail their check (and a
hang costs only that check); the report is on disk after every check, so a run killed mid-way leaves what it finished;
a deadline skips the checks it leaves no time for, saying so; a library outside its declared window stops the run at
the environment check; the verdict flags each kind of bad number, and the rule of what bound a step reads its figures.

The script runs as a subprocess, as CI runs it; faults are put into its check processes by a ``sitecustomize`` module
on their ``PYTHONPATH`` (it runs at every interpreter start). Timings are never asserted, only that they were measured.
"""

import gzip
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")
#: Every check the plan must run, in order (written out here: a check dropped from the script fails the test).
CHECKS = [
    "environment",
    "lora-bf16",
    "full-bf16",
    "full-fp32",
    "lora-fp32",
    "balanced",
    "peaked",
    "reproducible-resume",
    "recompute",
    "compiled-decode",
    "vllm-colocate",
]
PAIRS = ["lora-bf16", "full-bf16", "full-fp32", "lora-fp32"]
KINDS = {"a3po-s1": 1, "a3po-s0": 0, "grpo": None}
TIME_PARTS = ["generation", "training", "weight_sync", "trainer_idle", "generator_idle", "step"]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
BOUND_BY = {"gpu", "generator_python", "trainer_python", "both_pythons", "waiting"}


def load_module(name):
    """A module of scripts/gpu_checks with no relative imports (verdict, bound, versions), loaded from its file."""
    spec = importlib.util.spec_from_file_location(
        f"gpu_check_{name}", os.path.join(ROOT, "scripts", "gpu_checks", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_verdict():
    return load_module("verdict")


def _env(fault_dir=None):
    paths = [fault_dir, ROOT, os.environ.get("PYTHONPATH")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("OUT", None)  # the report and the trace go where the test says
    return env


def _run(arguments, fault_dir=None, timeout=900):
    command = [sys.executable, SCRIPT, "--cpu", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env(fault_dir))


def _with_fault(tmp_path, code: str) -> str:
    """A folder holding a ``sitecustomize`` that runs ``code`` in the check processes (not in the parent)."""
    folder = tmp_path / "fault"
    folder.mkdir()
    guard = "import sys\nif '--child' in sys.argv:\n"
    (folder / "sitecustomize.py").write_text(guard + textwrap.indent(textwrap.dedent(code), "    "))
    return str(folder)


def _entries(report):
    return {entry["name"]: entry for entry in report["checks"]}


# ---- the CPU plan ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "r.json"
    completed = _run(["--report", str(out)])
    assert out.is_file(), completed.stdout[-4000:] + completed.stderr[-4000:]
    with open(out) as f:
        report = json.load(f)
    return completed, report


def test_cpu_plan_passes_every_check(cpu_run):
    completed, report = cpu_run
    failures = [(e["name"], e["failures"], e["error"]) for e in report["checks"] if not e["passed"]]
    assert completed.returncode == 0 and not failures, (failures, completed.stdout[-3000:])
    assert completed.stdout.rstrip().endswith("GPU CHECK PASSED")
    assert report["passed"] is True
    assert [entry["name"] for entry in report["checks"]] == CHECKS  # one entry per check, none missing
    for entry in report["checks"]:
        assert entry["passed"] is True and entry["error"] is None and entry["failures"] == [], entry["name"]
        assert isinstance(entry["seconds"], float), entry["name"]
        if entry["skipped"]:  # only the vLLM checks, only where vLLM is missing, with the reason
            assert entry["name"].startswith("vllm") and not HAVE_VLLM and "vLLM is not installed" in entry["skipped"]
        else:
            assert entry["seconds"] > 0, entry["name"]
            # the one warning the CPU plan may give: after a resume, the same samples from the same versions, but
            # losses that differ in the last bits (reported by the check, see docs/GPU.md)
            expected = "a3po-s2/resumed: the same samples, but losses differ"
            assert all(warning.startswith(expected) for warning in entry["warnings"]), entry["warnings"]
    environment = report["environment"]
    assert environment["device"] == "cpu" and environment["parameters"] > 0
    assert environment["versions"]["trl"] and environment["versions"]["torch"]
    assert environment["versions_outside_windows"] == []
    # the whole plan ran inside the default deadline; the report says so, and says how to read it
    assert report["complete"] is True and report["finished"] is True and report["running"] is None
    assert report["deadline"] == {"seconds": 540, "not_run": [], "stopped": [], "note": None}
    assert report["steps"] == 3 and "a3po-s0" in report["ideal"] and "'waiting'" in report["bound_rule"]


def test_progress_is_printed_check_by_check(cpu_run):
    completed, _ = cpu_run
    headers = re.findall(r"^=== \[(\d+)/(\d+)\] ([\w-]+)", completed.stdout, re.M)
    assert [name for _, _, name in headers] == CHECKS
    assert [int(number) for number, _, _ in headers] == list(range(1, len(CHECKS) + 1))
    for name in CHECKS[:-1]:
        assert re.search(rf"^=== {re.escape(name)}: PASSED \(\d+ s\)$", completed.stdout, re.M), name
    for pair in PAIRS:
        for kind in KINDS:
            for step in (1, 2, 3):
                line = rf"^    \[{re.escape(kind)}/{pair}\] step {step}, [0-9.]+ s, main thread cpu [0-9.]+ s, loss "
                assert re.search(line, completed.stdout, re.M), (kind, pair, step)


def _a3po_runs(report):
    for entry in report["checks"]:
        for run in entry.get("runs", []):
            if run["trainer"] == "AsyncA3POTrainer":
                yield entry["name"], run


def test_every_async_run_reports_weights_memory_and_time(cpu_run):
    _, report = cpu_run
    runs = list(_a3po_runs(report))
    assert len(runs) >= 14
    for check, run in runs:
        name = f"{check}/{run['name']}"
        assert run["error"] is None and run["steps"], name
        assert all(math.isfinite(s["loss"]) and s["peak_memory_bytes"] is None for s in run["steps"]), name
        if run.get("backend", "generate") == "generate":
            sync = run["weights_after_sync"]
            assert sync["identical"] is True and sync["max_abs_diff"] == 0.0 and sync["weights"] > 0, name
            assert sync["version"] == sync["trainer_step"] == run["final_step"], name
        memory = run["memory"]
        assert memory["peak_device_bytes"] is None and memory["pinned_host_bytes"] is None, name  # GPU-only figures
        assert memory["plan_device_bytes"] > 0 and memory["plan_host_bytes"] == 0 and "total" in memory["plan"], name
        assert memory["predicted_device_bytes"] == memory["model_bytes"] + memory["plan_device_bytes"], name
        assert memory["peak_reserved_bytes"] is None and memory["num_alloc_retries"] is None, name
        timing = run["time"]
        assert all(timing[part] >= 0 for part in TIME_PARTS), name
        assert timing["step"] > 0 and timing["training"] > 0 and timing["generation_busy"] > 0, name
        # the steady steps: not the first (it fills the pipeline), not the last (it drains it)
        recorded = [step["step"] for step in run["steps"]]
        steady = recorded[1:-1] if len(recorded) > 2 else recorded[1:]
        assert (
            timing["steps_timed"]
            == run["steps_timed"]
            == [s for s in steady if s != (run["profile"] or {}).get("step")]
        )
        assert timing["steps_timed"], name


def test_each_thread_cpu_time_and_what_bound_the_step_are_reported(cpu_run):
    """Per run, each thread's CPU seconds per timed step (the main thread's for GRPOTrainer), within the step's wall
    seconds (a thread cannot run longer than the clock), and the bound the rule names; no device figures on CPU."""
    _, report = cpu_run
    runs = [(entry["name"], run) for entry in report["checks"] for run in entry.get("runs", [])]
    assert len(runs) >= 21  # 4 pairs of 3, balanced's 4, peaked's 2, reproducible-resume's 2, recompute's 1
    for check, run in runs:
        name = f"{check}/{run['name']}"
        for step in run["steps"]:
            assert 0 < step["thread_cpu_s"] <= step["seconds"] + 0.01, (name, step)
            assert step["peak_memory_bytes"] is None and step["peak_reserved_bytes"] is None, name
        threads, wall = run["threads"], run["seconds_per_step"]
        assert 0 < threads["training_cpu_per_step"] <= wall + 0.01, name
        if run["trainer"] == "AsyncA3POTrainer":
            assert 0 < threads["generation_cpu_per_step"] <= wall + 0.01, name
            assert threads["generation_cpu_per_step"] == run["time"]["generation_thread_cpu"], name
        else:
            assert threads["generation_cpu_per_step"] is None, name
        assert run["bound"]["by"] in BOUND_BY - {"gpu"} and run["bound"]["shares"]["device_busy"] is None, name


def test_one_steady_asynchronous_step_is_traced(cpu_run, tmp_path_factory):
    """The traced run (a3po-s1/full-bf16) trains one step more and profiles its second to last, untimed; the trace
    (beside the report without $OUT) holds both threads' ops."""
    _, report = cpu_run
    run = next(run for run in _entries(report)["full-bf16"]["runs"] if run["name"] == "a3po-s1/full-bf16")
    assert run["planned_steps"] == 4 and run["profile"]["step"] == 3 and run["profile"]["error"] is None
    assert 3 not in run["steps_timed"]
    assert report["trace"] == run["profile"]["trace"] and report["trace"].endswith("gpu_check_trace.json.gz")
    with gzip.open(report["trace"], "rt") as file:
        events = json.load(file)["traceEvents"]
    threads = {event["tid"] for event in events if event.get("ph") == "X" and event.get("cat") == "cpu_op"}
    assert len(threads) >= 2  # the training thread's ops and the generation thread's
    others = [r for e in report["checks"] for r in e.get("runs", []) if r is not run]
    assert all(other["profile"] is None for other in others)  # on CPU only the traced run is profiled


def test_each_check_reports_its_own_figures(cpu_run):
    _, report = cpu_run
    entries = _entries(report)
    for pair in PAIRS:
        entry = entries[pair]
        assert [run["name"] for run in entry["runs"]] == [f"{kind}/{pair}" for kind in KINDS]
        for kind, staleness in KINDS.items():
            run = next(r for r in entry["runs"] if r["kind"] == kind)
            traced = (pair, kind) == ("full-bf16", "a3po-s1")  # one step more: the traced step is not timed
            assert run["max_staleness"] == staleness and len(run["steps"]) == 3 + traced, (pair, kind)
        grpo = entry["runs"][2]
        assert grpo["time"]["generation"] > 0 and grpo["time"]["step"] > 0, pair
        assert grpo["memory"] == {"peak_device_bytes": None, "peak_reserved_bytes": None, "num_alloc_retries": None}
        # the ideal: max(generation, training) busy per step of the synchronous run of the same pair
        ideal, synchronous = entry["ideal"], entry["runs"][1]
        assert ideal["from"] == f"a3po-s0/{pair}", pair
        busy = (synchronous["time"]["generation_busy"], synchronous["time"]["training_busy"])
        assert (ideal["generation_busy"], ideal["training_busy"]) == busy and ideal["seconds_per_step"] == max(busy)
        for kind in ("a3po-s1", "a3po-s0"):
            run = next(r for r in entry["runs"] if r["kind"] == kind)
            assert entry["vs_grpo"][f"{kind}/{pair}"] > 0, pair
            assert entry["vs_ideal"][f"{kind}/{pair}"] == run["seconds_per_step"] / ideal["seconds_per_step"], pair
    balanced = entries["balanced"]
    assert balanced["gradient_accumulation_steps"] >= 1 and balanced["generation_over_training"] > 0
    assert balanced["calibration"]["generation"] > 0 and balanced["calibration"]["training"] > 0
    k = balanced["gradient_accumulation_steps"]
    assert [run["name"] for run in balanced["runs"][1:]] == [f"{kind}/balanced-x{k}" for kind in KINDS]
    assert balanced["ideal"]["from"] == f"a3po-s0/balanced-x{k}"
    peaked = entries["peaked"]["mismatch"]
    # the peaked model shows bf16's mismatch (about 1e-2 nats), far above fp32's rounding (about 1e-6)
    assert peaked["bf16"]["mean"] > 1e-3 and peaked["fp32"]["mean"] < 1e-4
    resume = entries["reproducible-resume"]
    assert resume["resume"]["rewards_identical"] is True and resume["resume"]["generator_versions_identical"] is True
    assert [s["step"] for s in resume["runs"][1]["steps"]] == [3, 4]
    assert resume["runs"][0]["settings"]["reproducible_generation"] is True
    assert entries["recompute"]["recompute_forward_seconds_per_step"] > 0
    decode = entries["compiled-decode"]["compiled_decode"]  # reported, not judged
    assert set(decode["paths"]) == {"eager", "static", "compiled"}
    for path, figures in decode["paths"].items():
        assert 0 < figures["cpu_per_token"]["median"] and 0 < figures["wall_per_token"]["median"], path
    assert (
        decode["paths"]["compiled"]["first_call"]["wall_seconds"]
        > decode["paths"]["eager"]["first_call"]["wall_seconds"]
    )  # the first compiled call compiles
    assert 0 <= decode["token_agreement"] <= 1 and math.isfinite(decode["max_logp_difference"])


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM (scripts/setup_vllm.sh builds its environment)")
def test_the_vllm_check_runs_where_vllm_is_installed(tmp_path):
    out = tmp_path / "r.json"
    completed = _run(["--checks", "vllm-colocate", "--report", str(out)])
    entry = _entries(json.loads(out.read_text()))["vllm-colocate"]
    assert completed.returncode == 0 and entry["passed"] is True, completed.stdout[-4000:]
    assert entry["skipped"] is None and [run["name"] for run in entry["runs"]] == [
        "a3po-s0/vllm-colocate",
        "a3po-s1/vllm-colocate",
    ]
    for run in entry["runs"]:
        assert run["weights_after_sync"] is None and run["time"]["generation"] > 0, run["name"]
        assert all(s.get("behavior_mismatch_mean", 0) < 1e-4 for s in run["steps"]), run["name"]  # fp32 on CPU


# ---- faults the plan must catch -------------------------------------------------------------------------------------
def test_a_generator_that_misses_weight_syncs_fails(tmp_path):
    """The generator keeps its first weights: its log-probs drift from the trainer's and its weights differ."""
    fault = _with_fault(
        tmp_path,
        """
        from a3po_trl.generation.hf.backend import HFGenerateBackend
        HFGenerateBackend.load_weights = lambda self, weights, version: None
        """,
    )
    out = tmp_path / "r.json"
    completed = _run(["--checks", "environment,recompute", "--report", str(out)], fault)
    assert completed.returncode == 1, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "GPU CHECK FAILED" in completed.stdout and "GPU CHECK PASSED" not in completed.stdout
    report = json.loads(out.read_text())
    entries = _entries(report)
    assert report["passed"] is False and entries["environment"]["passed"] is True
    failures = entries["recompute"]["failures"]
    assert entries["recompute"]["passed"] is False
    assert any("generator's weights differ from the trainer's" in f for f in failures), failures


def test_a_hang_costs_one_check_and_a_crash_is_recorded(tmp_path):
    """One check hangs at start (killed at its timeout, with its whole process group); the next still runs; a
    reward that raises in the generation thread crashes its run, recorded as the check's failure."""
    pid_file = tmp_path / "hung.pid"
    fault = _with_fault(
        tmp_path,
        f"""
        import os, time
        if "peaked" in sys.argv:
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(3600)
        if "recompute" in sys.argv:
            sys.path.insert(0, {os.path.join(ROOT, "scripts")!r})
            import threading
            from gpu_checks import model

            def broken_reward(completions, **kwargs):
                if threading.current_thread() is not threading.main_thread():
                    raise RuntimeError("reward server unreachable")
                return [0.0] * len(completions)

            model.even_digit_reward = broken_reward
        """,
    )
    out = tmp_path / "r.json"
    completed = _run(["--checks", "peaked,recompute", "--timeout", "peaked=15", "--report", str(out)], fault)
    assert completed.returncode == 1, completed.stdout[-4000:] + completed.stderr[-4000:]
    entries = _entries(json.loads(out.read_text()))
    assert entries["peaked"]["passed"] is False and entries["peaked"]["error"].startswith("timed out after 15 s")
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # killed, not left behind
    recompute = entries["recompute"]
    assert recompute["passed"] is False and "reward server unreachable" in recompute["runs"][0]["error"]
    assert any("crashed: RuntimeError: reward server unreachable" in f for f in recompute["failures"])
    assert "  - a3po-s1/recompute: crashed: " in completed.stdout


# ---- a run cut short: the report on disk after every check, the deadline -------------------------------------------
def _poll_report(path, process, ready, timeout=600):
    """The report at ``path`` once ``ready(report)`` holds (read as the script rewrites it), or fail."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            pytest.fail(f"the check ended (status {process.returncode}) before the report was ready")
        if os.path.exists(path):
            with open(path) as file:
                report = json.load(file)  # whole at every moment: written to a temporary file and renamed
            if ready(report):
                return report
        time.sleep(0.5)
    pytest.fail(f"no report ready after {timeout} s")


def test_a_run_killed_mid_way_leaves_its_finished_checks_and_runs_in_the_report(tmp_path):
    """The whole run is killed (as a command past its time limit is) while its second check hangs in its second run:
    the report on disk holds the first check's entry and the second check's finished run."""
    pid_file = tmp_path / "hung.pid"
    fault = _with_fault(
        tmp_path,
        f"""
        import os, time
        if "full-bf16" in sys.argv:
            sys.path.insert(0, {os.path.join(ROOT, "scripts")!r})
            from gpu_checks import checks

            original, calls = checks.run_one, []

            def run_one(*args, **kwargs):
                calls.append(1)
                if len(calls) == 2:  # the second run of the check hangs
                    open({str(pid_file)!r}, "w").write(str(os.getpid()))
                    time.sleep(3600)
                return original(*args, **kwargs)

            checks.run_one = run_one
        """,
    )
    out = tmp_path / "r.json"
    command = [sys.executable, SCRIPT, "--cpu", "--checks", "environment,full-bf16", "--report", str(out)]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=_env(fault),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        report = _poll_report(out, process, lambda r: r["running"] == "full-bf16" and r["running_runs"])
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the script; its check runs in a process group of its own
        process.wait()
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    report = json.loads(out.read_text())  # what the killed run left
    assert report["finished"] is False and report["running"] == "full-bf16" and report["pending"] == []
    assert [entry["name"] for entry in report["checks"]] == ["environment"]
    assert report["checks"][0]["passed"] is True and report["environment"]["device"] == "cpu"
    [run] = report["running_runs"]
    assert run["name"] == "a3po-s1/full-bf16" and run["error"] is None and len(run["steps"]) == 4


def test_a_short_deadline_skips_the_checks_it_leaves_no_time_for_and_says_so(tmp_path):
    out = tmp_path / "r.json"
    completed = _run(["--checks", "environment,recompute", "--deadline", "31", "--report", str(out)])
    report = json.loads(out.read_text())
    entries = _entries(report)
    # recompute cannot start with under 30 s left; the environment check either finished or was stopped at 31 s
    assert entries["recompute"]["skipped"] == "deadline" and entries["recompute"]["seconds"] == 0.0
    assert entries["environment"]["skipped"] in (None, "deadline")
    assert "recompute" in report["deadline"]["not_run"] and report["complete"] is False and report["passed"] is True
    assert "deadline (31 s)" in report["deadline"]["note"] and "--checks" in report["deadline"]["note"]
    assert completed.returncode == 2, completed.stdout[-3000:]
    assert completed.stdout.rstrip().splitlines()[-1].startswith("GPU CHECK INCOMPLETE: nothing failed, but the run")


def test_a_library_outside_its_declared_window_stops_the_run_at_the_environment_check(tmp_path):
    fault = _with_fault(
        tmp_path,
        f"""
        sys.path.insert(0, {os.path.join(ROOT, "scripts")!r})
        from gpu_checks import versions

        original = versions.installed_version
        versions.installed_version = lambda package: "5.26.0" if package == "transformers" else original(package)
        """,
    )
    out = tmp_path / "r.json"
    completed = _run(["--checks", "environment,recompute", "--report", str(out)], fault)
    assert completed.returncode == 1, completed.stdout[-4000:] + completed.stderr[-4000:]
    report = json.loads(out.read_text())
    entries = _entries(report)
    problem = "transformers 5.26.0 is installed, outside the window pyproject.toml declares (transformers>=5.19.0,"
    assert entries["environment"]["passed"] is False
    assert any(f.startswith(problem) for f in entries["environment"]["failures"]), entries["environment"]
    assert report["environment"]["versions_outside_windows"][0].startswith(problem)
    recompute = entries["recompute"]
    assert recompute["skipped"].startswith("the environment check failed: transformers 5.26.0 is installed")
    assert recompute["passed"] is False and "runs" not in recompute


def test_the_version_gate_reads_the_windows_from_pyproject(monkeypatch, tmp_path):
    versions = load_module("versions")
    assert versions.declared_windows()["trl"] == "==1.16.0"
    assert versions.outside_windows() == []  # the installed versions (this environment is inside the windows)
    real = importlib.metadata.version
    fake = {"accelerate": "1.17.0", "peft": "0.17.9"}
    monkeypatch.setattr(importlib.metadata, "version", lambda package: fake.get(package) or real(package))
    problems = versions.outside_windows()
    assert len(problems) == 2 and problems[0].startswith("peft 0.17.9 is installed, outside the window")
    assert (
        "(accelerate>=1.10.1,<=1.16.0)" in problems[1] and "pip install 'accelerate>=1.10.1,<=1.16.0'" in problems[1]
    )
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.6,<3", "absent-package>=1"]\n')
    assert versions.outside_windows(pyproject=str(pyproject)) == [
        "absent-package is not installed: the window pyproject.toml declares (absent-package>=1)"
    ]
    nightly = versions.outside_windows({"torch": "2.14.0.dev20260101+cu130"}, str(pyproject))
    assert not any(problem.startswith("torch") for problem in nightly)  # inside the window, pre-release or not
    assert versions.outside_windows({"torch": "3.0.0"}, str(pyproject))[0].startswith("torch 3.0.0 is installed")


# ---- what bound a step ----------------------------------------------------------------------------------------------
def test_the_bound_rule():
    bound = load_module("bound")
    cases = [  # (step, trainer cpu, generator cpu, device busy share, cuda) -> bound by
        ((1.0, 0.95, 0.9, 0.85, True), "gpu"),  # tested first: CUDA's waits spin, counting CPU time
        ((1.0, 0.95, 0.3, 0.5, True), "trainer_python"),
        ((1.0, 0.85, 0.9, 0.5, True), "generator_python"),
        ((1.0, 0.5, 0.4, 0.2, True), "both_pythons"),
        ((1.0, 0.3, 0.2, 0.2, True), "waiting"),
        ((2.0, 1.8, None, None, False), "trainer_python"),  # GRPOTrainer on CPU: one thread
        ((2.0, 1.0, None, None, False), "waiting"),
    ]
    for arguments, expected in cases:
        assert bound.bound_by(*arguments)["by"] == expected, arguments
    assert bound.bound_by(1.0, 0.5, 0.4, None, True)["by"] is None  # on a GPU without the device's time: no verdict
    assert bound.bound_by(None, None, None, None, False)["by"] is None


def test_the_device_busy_time_is_each_streams_and_their_union():
    bound = load_module("bound")
    events = [
        {"ph": "X", "cat": "kernel", "ts": 0.0, "dur": 100.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "ts": 50.0, "dur": 100.0, "args": {"stream": 7}},  # overlaps the one before
        {"ph": "X", "cat": "gpu_memcpy", "ts": 120.0, "dur": 80.0, "args": {"stream": 13}},
        {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 1000.0, "args": {}},  # the host: not the device
    ]
    busy = bound.device_busy(events)
    assert busy["streams"] == {"13": pytest.approx(80e-6), "7": pytest.approx(150e-6)}
    assert busy["busy_seconds"] == pytest.approx(200e-6) and busy["operations"] == 3


# ---- the verdict, fed bad numbers -----------------------------------------------------------------------------------
def good_run(trainer="AsyncA3POTrainer", max_staleness=1, steps=3):
    a3po = trainer == "AsyncA3POTrainer"
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "seconds": 1.0, "peak_memory_bytes": 2**31, "loss": 0.01, "grad_norm": 0.5}
        if a3po:
            staleness = 0 if step == 1 else max_staleness
            record.update(staleness_mean=float(staleness), staleness_max=float(staleness))
            if staleness == 0:
                record.update(behavior_mismatch_mean=0.004, behavior_mismatch_max=0.2)
            else:
                record.update(drift_per_step=0.3)
        records.append(record)
    kind = f"a3po-s{max_staleness}" if a3po else "grpo"
    run = {
        "name": f"{kind}/full-bf16",
        "kind": kind,
        "trainer": trainer,
        "planned_steps": steps,
        "max_staleness": max_staleness if a3po else None,
        "steps": records,
        "error": None,
    }
    if a3po:
        run["weights_after_sync"] = {"identical": True, "max_abs_diff": 0.0, "version": steps}
        run["time"] = {"step": 1.0}
    return run


def test_good_runs_have_no_failures():
    verdict = load_verdict()
    for run in (good_run(), good_run(max_staleness=0), good_run("GRPOTrainer")):
        assert verdict.run_failures(run) == [] and verdict.blind_spots(run) == []
    assert verdict.check_failures({"runs": [good_run()], "requirements": [["fine", True]]}) == []


def _set(step, key, value):
    step[key] = value


FAULTS = {
    "crash": (lambda run: run.update(error="CUDA error: out of memory"), "crashed: CUDA error: out of memory"),
    "no step": (lambda run: run.update(steps=[]), "no optimizer step completed"),
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
    "weights differ": (
        lambda run: run["weights_after_sync"].update(identical=False, max_abs_diff=0.01),
        "the generator's weights differ from the trainer's (max |diff| 0.01",
    ),
    "weights not compared": (lambda run: run.update(weights_after_sync=None), "weights were not compared"),
    "no timeline": (lambda run: run.update(time=None), "the timeline recorded no step"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_bad_number_fails(fault):
    verdict = load_verdict()
    run = good_run()
    breaks, message = FAULTS[fault]
    breaks(run)
    failures = verdict.check_failures({"runs": [good_run("GRPOTrainer"), run]})
    assert len(failures) == 1 and failures[0].startswith("a3po-s1/full-bf16: ") and message in failures[0], failures


def test_a_check_fails_on_a_requirement_it_judged():
    verdict = load_verdict()
    result = {"runs": [good_run()], "requirements": [["resumed at step 2 and reached step 4", False]]}
    assert verdict.check_failures(result) == ["resumed at step 2 and reached step 4"]


def test_the_mismatch_threshold_is_inclusive_and_a_shown_mismatch_is_not_judged():
    verdict = load_verdict()
    run = good_run()
    run["steps"][0]["behavior_mismatch_mean"] = verdict.MAX_BEHAVIOR_MISMATCH
    assert verdict.run_failures(run) == []
    assert len(verdict.run_failures(run, max_behavior_mismatch=0.01)) == 1
    run["steps"][0]["behavior_mismatch_mean"] = 0.5
    run["judge_mismatch"] = False  # the peaked check's bf16 run: the mismatch is what it shows
    assert verdict.run_failures(run) == []


def test_a_step_too_small_to_show_a_missed_weight_sync_is_a_warning():
    verdict = load_verdict()
    run = good_run()
    for step in run["steps"][1:]:
        step["drift_per_step"] = 0.01
    assert verdict.run_failures(run) == []
    warnings = verdict.check_warnings({"runs": [run]})
    assert len(warnings) == 1 and warnings[0].startswith("a3po-s1/full-bf16: one optimizer step moved the policy")
