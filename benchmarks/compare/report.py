"""The report (written as ``<out>/<name>.json``): summaries, aggregates, analysis and raw records of the runs, the
machine and software, py-spy profile summaries, and ``--merge-from`` (reusing a previous report's runs)."""

from __future__ import annotations

import os
import shlex
import sys
from collections import defaultdict

from benchmarks.common.internals import GENERATION_THREAD_FRAMES, PROFILE_ACTIVITIES, TRAINING_LOOP_FRAME
from benchmarks.common.machine import machine_info
from benchmarks.common.provenance import provenance, thread_roles
from benchmarks.common.runner import Cell, RunStore

from .analysis import evaluate_targets, pipeline_analysis, reward_comparison
from .metrics import aggregate, summarize_run
from .plan import config_names, split_variant


def profile_summary(path: str) -> dict | None:
    """Share of py-spy samples per thread and activity (the generation thread: the engine's ``_run``)."""
    if not path or not os.path.exists(path) or path.endswith(".pstats"):
        return None
    threads = defaultdict(lambda: defaultdict(int))
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            if all(frame in stack for frame in GENERATION_THREAD_FRAMES):
                thread = "generation thread"
            elif TRAINING_LOOP_FRAME in stack:
                thread = "training (main) thread"
            else:
                thread = "outside training (imports, model loading, other threads)"
            category = next(
                (label for label, needles in PROFILE_ACTIVITIES if all(n in stack for n in needles)), "other"
            )
            threads[thread][category] += int(count)
    out = {}
    for thread, counts in threads.items():
        total = sum(counts.values())
        out[thread] = {
            "samples": total,
            "seconds_at_20hz": total / 20,
            "share": {k: round(v / total, 3) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])},
        }
    return out


def build_report(records, options, common, started, finished) -> dict:
    summaries, errors, microbench = [], [], None
    env = next((r["env"] for r in records if r.get("env")), {})
    model_name = None
    for record in records:
        if "error" in record:
            errors.append({"run_id": record["config"]["run_id"], "error": record["error"]})
            continue
        model_name = model_name or record["result"].get("model_name")
        if record["config"]["kind"] == "microbench":
            microbench = {**record["result"], "peak_rss_mb": record.get("peak_rss_mb")}
            continue
        summary = summarize_run(record, common, options.final_window)
        if record.get("profile_file"):
            summary["profile_file"] = os.path.relpath(record["profile_file"], options.out)
            summary["profile"] = profile_summary(record["profile_file"])
        summary["discarded_attempts"] = record.get("discarded_attempts", [])
        summary["provenance"] = record.get("provenance")  # where and when this run ran
        summary["reused_from"] = record.get("reused_from")
        summaries.append(summary)
    configs = aggregate(summaries)
    cpu = options.device == "cpu"
    report = {
        "meta": {
            "command": "python -m benchmarks.compare " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "started": started,
            "finished": finished,
            "machine": machine_info(),
            "software": env,
            "model": options.model,
            "model_key": common["model_key"],
            "model_name": model_name,
            "device": options.device,
            "bf16": common["bf16"],
            "batch": {
                "per_device_train_batch_size": options.batch_size,
                "num_generations": options.num_generations,
                "max_completion_length": options.max_completion_length,
                "prompts_per_step": options.batch_size // options.num_generations,
                "steps_per_generation": 1,
            },
            "steps": options.steps,
            "warmup_steps": options.warmup_steps,
            "final_window": options.final_window,
            "learning_rate": options.learning_rate,
            "seeds": sorted({r["config"]["seed"] for r in records}),
            "extra_seeds_for": options.extra_seeds_for,
            "staleness": options.staleness,
            "threads": {
                "trl": (options.sync_threads or os.cpu_count()) if cpu else None,
                "a3po_training": options.training_threads if cpu else None,
                "a3po_generation": options.generation_threads if cpu else None,
                "pieces": options.training_threads if cpu else None,
                **({"variants": options.thread_variants} if getattr(options, "thread_variants", "") else {}),
            },
            "isolation": options.isolation,
            "omp_wait_policy": env.get("env", {}).get("OMP_WAIT_POLICY"),
            "data": f"a3po_trl.tasks.generate_arithmetic_problems({options.num_prompts}, {options.difficulty!r}, "
            "seed=0)" + (", no system prompt" if options.model == "tiny" else ""),
            "rewards": ["correctness_reward", "format_reward"]
            + (["tiny.digit_reward"] if options.model == "tiny" else []),
            "quick": options.quick,
        },
        "configs": configs,
        "runs": summaries,
        "microbench": microbench,
        "errors": errors,
    }
    report["pipeline"] = pipeline_analysis(configs, options.staleness)
    report["reward_comparison"] = reward_comparison(configs, options.staleness)
    baselines = [c for c in configs.values() if c["kind"] == "trl" and c["step_time_median"]]
    trl = min(baselines, key=lambda c: c["step_time_median"]) if baselines else None
    report["baseline"] = trl["name"] if trl else None
    report["speedup_vs_trl"] = {
        name: trl["step_time_median"] / c["step_time_median"]
        for name, c in configs.items()
        if trl and c["step_time_median"]
    }
    report["targets"] = evaluate_targets(report)
    report["meta"]["provenance"] = report_provenance(started, summaries, report["meta"], env)
    report["records"] = [{k: v for k, v in r.items() if k != "env"} for r in records]  # raw, for --merge-from
    return report


def report_provenance(started: str, runs: list[dict], meta: dict, env: dict) -> dict:
    """The report's own provenance block (each run has its own): the invocation's start (``started``, this machine's
    local time) and commit, this machine, the largest share of the machine other processes took during any of its
    ``runs``, and the threads of ``meta``: training and generation those of the asynchronous trainer, process those
    of TRL's GRPOTrainer (the baseline)."""
    import datetime

    foreign = [run["foreign_cpu_frac"] for run in runs if run.get("foreign_cpu_frac") is not None]
    threads = meta["threads"]
    training, generation = (_chosen(threads[f"a3po_{role}"], role, runs) for role in ("training", "generation"))
    block = provenance(
        datetime.datetime.fromisoformat(started).astimezone(datetime.timezone.utc),
        thread_roles(training, generation, threads["trl"]),
        max(foreign) if foreign else None,
        wait_policy=(env.get("env") or {}).get("OMP_WAIT_POLICY") or "unset",
    )
    for role, count in (("training", training), ("generation", generation)):
        if count is None and threads[f"a3po_{role}"] == 0:  # the library's choice, not seen agreeing in the runs
            block["unrecorded"].append(f"threads.{role}")
    block["notes"] = [
        "foreign_cpu_frac: the largest of its runs'",
        "threads: training and generation the asynchronous trainer's, process TRL GRPOTrainer's",
    ]
    return block


def _chosen(option: int | None, role: str, runs: list[dict]) -> int | None:
    """A thread count of the options as it ran: 0 (the library's default) is the count ``train()`` chose, as the
    asynchronous runs at the options' counts (no thread variant) recorded it in their blocks; None where they do not
    agree or there are none."""
    if option != 0:
        return option
    chosen = {
        run["provenance"]["threads"][role]
        for run in runs
        if run.get("kind") == "a3po" and run.get("provenance") and split_variant(run["name"])[1] is None
    }
    return chosen.pop() if len(chosen) == 1 else None


def ordered_records(records: list[dict]) -> list[dict]:
    """Records in plan order: seed by seed, configurations in the order of ``config_names``."""
    order = {name: i for i, name in enumerate(config_names(_staleness_of(records), single_thread_trl=True))}
    return sorted(records, key=lambda r: (r["config"]["seed"], order.get(r["config"]["name"], 99)))


def _staleness_of(records: list[dict]) -> list[int]:
    return sorted({r["config"].get("max_staleness") or 0 for r in records})


MERGE_KEYS = ("model", "device", "bf16", "steps", "warmup_steps", "batch", "learning_rate", "staleness", "threads")


def import_previous(previous: dict, source: str, store: RunStore) -> list[str]:
    """Keep the finished runs of a ``previous`` report (from the file ``source``) in ``store``, unless it holds them
    already, marked ``reused_from``; returns the command that made them."""
    for record in previous.get("records", []):
        cell = Cell(record["config"]["name"], record["config"]["seed"])
        if "error" not in record and cell not in store:
            store.save(cell, {**record, "reused_from": source})
    return [previous["meta"]["command"]]


def _merge_key(meta: dict, key: str):
    """``meta[key]`` as the merge compares it: the thread variants (``--thread-variants``) left out of ``threads``,
    since a variant only adds configurations, each run carrying its own counts."""
    value = meta.get(key)
    if key == "threads" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "variants"}
    return value


def check_mergeable(previous_meta: dict, report_meta: dict) -> None:
    """Refuse to merge a previous report run under other settings (:data:`MERGE_KEYS`; other thread variants may
    merge)."""
    different = [k for k in MERGE_KEYS if _merge_key(previous_meta, k) != _merge_key(report_meta, k)]
    if different:
        raise SystemExit(f"--merge-from: the previous report differs in {different}; rerun with the same settings.")


def ordered_configs(configs):
    """The aggregated configurations in plan order: the order of the markdown tables and of the plot."""
    staleness = sorted({c["max_staleness"] or 0 for c in configs.values()})
    order = {name: i for i, name in enumerate(config_names(staleness, single_thread_trl=True))}
    return sorted(configs.values(), key=lambda c: order.get(c["name"], 99))
