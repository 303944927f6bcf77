"""The orchestrator: runs the plan in worker subprocesses (``compare.py --worker``), reruns a configuration that
other processes disturbed, and writes the report so far after every run (``<out>/<name>.partial.json``)."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from .paths import COMPARE_SCRIPT, ROOT, TESTS
from .report import build_report


def _find_py_spy(options) -> str | None:
    candidates = [options.py_spy, shutil.which("py-spy"), os.path.join(os.path.dirname(sys.executable), "py-spy")]
    return next((c for c in candidates if c and os.path.exists(c)), None)


def _launch(configs, common, options, log_dir, profile_path=None) -> list[dict]:
    """Run ``configs`` in one fresh worker subprocess; returns its records (an error record per missing one)."""
    with tempfile.TemporaryDirectory(prefix="a3po-compare-spec-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"common": common, "configs": configs}, f)
        command = [sys.executable, COMPARE_SCRIPT, "--worker", spec_path, "--worker-out", out_path]
        if profile_path is not None:
            py_spy = _find_py_spy(options)
            if py_spy:
                command = [py_spy, "record", "--threads", "--nonblocking", "--rate", "20", "--format", "raw"]
                command += ["-o", profile_path]
                command += ["--", sys.executable, COMPARE_SCRIPT, "--worker", spec_path]
                command += ["--worker-out", out_path]
            else:
                print("[compare] py-spy not found: profiling the main thread with cProfile", flush=True)
                command[1:1] = ["-m", "cProfile", "-o", profile_path + ".pstats"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if options.device == "cpu" and options.omp_wait_policy.lower() != "default":
            env.setdefault("OMP_WAIT_POLICY", options.omp_wait_policy)
        log_name = configs[0]["run_id"] if len(configs) == 1 else "shared"
        log_path = os.path.join(log_dir, re.sub(r"[^A-Za-z0-9_.@-]", "_", log_name) + ".log")
        error = None
        with open(log_path, "w") as log:
            try:
                completed = subprocess.run(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=options.config_timeout, cwd=ROOT
                )
                if completed.returncode != 0:
                    error = f"worker exited with status {completed.returncode}"
            except subprocess.TimeoutExpired:
                error = f"worker timed out after {options.config_timeout} s"
        records = []
        if os.path.exists(out_path):
            with open(out_path) as f:
                records = json.load(f)
    if error or len(records) < len(configs):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        done = {r["config"]["run_id"] for r in records}
        for config in configs:
            if config["run_id"] not in done:
                records.append({"config": config, "error": f"{error or 'no result'}; log tail:\n{tail}"})
    return records


def run_plan(plan, common, options, log_dir) -> list[dict]:
    profile = {p.strip() for p in options.profile.split(",") if p.strip()}
    if options.isolation == "shared":
        print(f"[compare] {len(plan)} runs in one shared worker process", flush=True)
        return _launch(plan, common, options, log_dir)
    records, started = [], time.perf_counter()
    for index, config in enumerate(plan, 1):
        profile_path = None
        if config["name"] in profile and config["seed"] == options.seed:
            profile_path = os.path.join(options.out, f"{options.name}-profile-{config['name']}.txt")
        discarded = []
        for attempt in range(options.retries + 1):
            print(f"[compare] ({index}/{len(plan)}) {config['run_id']} attempt {attempt + 1}", flush=True)
            start = time.perf_counter()
            (record,) = _launch([config], common, options, log_dir, profile_path)
            if profile_path is not None:
                record["profile_file"] = profile_path if os.path.exists(profile_path) else profile_path + ".pstats"
            record["subprocess_seconds"] = time.perf_counter() - start
            print(f"[compare]     {_one_line(record)}", flush=True)
            foreign = _foreign(record)
            over_budget = options.budget_minutes and time.perf_counter() - started > 60 * options.budget_minutes
            if foreign is None or foreign <= options.max_foreign or attempt == options.retries or over_budget:
                break
            print(f"[compare]     other processes used {foreign:.0%} of the machine: running it again", flush=True)
            discarded.append({"foreign_cpu_frac": foreign, "error": record.get("error")})
        record["discarded_attempts"] = discarded
        records.append(record)
        _write_partial(records, options, common)
    return records


def partial_path(options) -> str:
    return os.path.join(options.out, options.name + ".partial.json")


def _write_partial(records, options, common) -> None:
    """The report so far, after every run: an interrupted benchmark resumes from it with --merge-from."""
    now = datetime.datetime.now().isoformat(timespec="seconds")
    report = build_report(records, options, common, now, now)
    with open(partial_path(options), "w") as f:
        json.dump(report, f)


def _foreign(record) -> float | None:
    result = record.get("result") or {}
    if "by_threads" in result:
        values = [r.get("foreign_cpu_frac") for r in result["by_threads"] if r.get("foreign_cpu_frac") is not None]
        return max(values) if values else None
    return result.get("foreign_cpu_frac")


def _one_line(record) -> str:
    if "error" in record:
        return "ERROR " + record["error"].splitlines()[0]
    result = record["result"]
    if record["config"]["kind"] == "microbench":
        return " ".join(
            f"threads={r['threads']}: recompute {r['recompute_seconds']:.4f} s, loglinear "
            f"{r['loglinear_seconds'] * 1e6:.1f} us, ratio {r['ratio']:.0f}x"
            for r in result["by_threads"]
        )
    return f"train {result['train_seconds']:.1f} s, foreign cpu {result.get('foreign_cpu_frac')}"
