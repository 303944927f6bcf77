"""Measurements: per-step series read from the trainers' logs, one run's summary, and the aggregate over seeds."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

# Per-step metrics read from the trainers' logs (name in the report -> key in log_history).
LOGGED_METRICS = {
    "prox_time": "a3po/prox_time",
    "generation_time": "async/generation_time",
    "behavior_logps_time": "async/behavior_logps_time",
    "reward_time": "async/reward_time",
    "trainer_wait_time": "async/trainer_wait_time",
    "generator_wait_time": "async/generator_wait_time",
    "weight_sync_time": "async/weight_sync_time",
    "queue_depth": "async/queue_depth",
    "generation_tokens_per_second": "async/completion_tokens_per_second",
    "staleness_mean": "a3po/staleness_mean",
    "staleness_max": "a3po/staleness_max",
    "behavior_policy_weight_mean": "a3po/behavior_policy_weight_mean",
    "importance_weight_mean": "a3po/importance_weight_mean",
    "importance_weight_max": "a3po/importance_weight_max",
    "importance_weight_masked_frac": "a3po/importance_weight_masked_frac",
    "clip_ratio_low": "clip_ratio/low_mean",
    "clip_ratio_high": "clip_ratio/high_mean",
    "clip_ratio_region": "clip_ratio/region_mean",
    "reward": "reward",
    "reward_std": "reward_std",
    "completion_mean_length": "completions/mean_length",
    "entropy": "entropy",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "trl_step_time": "step_time",
    # measured by the benchmark's GRPOTrainer subclass (TRL does not log these)
    "trl_generation_time": "bench/generation_time",
    "trl_reward_time": "bench/reward_time",
}


def per_step_series(log_history, steps: int) -> dict[str, list]:
    series = {name: [None] * steps for name in LOGGED_METRICS}
    for entry in log_history:
        step = entry.get("step")
        if not step or step > steps or "train_runtime" in entry:
            continue
        for name, key in LOGGED_METRICS.items():
            if key in entry and entry[key] is not None:
                series[name][step - 1] = float(entry[key])
    return series


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _std(values):
    values = [v for v in values if v is not None]
    return statistics.stdev(values) if len(values) > 1 else None


def summarize_run(record, common, final_window: int) -> dict:
    """Scalar summary of one training run: medians/means over the steps after warm-up."""
    config, result = record["config"], record["result"]
    warmup = common["warmup_steps"]
    ends = result["step_end_seconds"]
    durations = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
    post = list(range(min(warmup, max(len(durations) - 1, 0)), len(durations)))
    series = result["series"]

    def post_values(name):
        return [series[name][i] for i in post if i < len(series[name]) and series[name][i] is not None]

    summary = {
        "name": config["name"],
        "run_id": config["run_id"],
        "kind": config["kind"],
        "method": config.get("method"),
        "max_staleness": config.get("max_staleness"),
        "seed": config["seed"],
        "threads": config.get("threads"),
        "steps_done": len(durations),
        "step_times": durations,
        "step_time_median": _median([durations[i] for i in post]),
        "step_time_mean": _mean([durations[i] for i in post]),
        "train_seconds": result["train_seconds"],
    }
    for name in LOGGED_METRICS:
        summary[name] = _mean(post_values(name))
    summary["staleness_max"] = max((v for v in series["staleness_max"] if v is not None), default=None)
    summary["importance_weight_max"] = max((v for v in series["importance_weight_max"] if v is not None), default=None)
    if config["kind"] == "trl":
        summary["generation_time"] = summary.pop("trl_generation_time")
        summary["reward_time"] = summary.pop("trl_reward_time")
        summary["staleness_mean"], summary["staleness_max"] = 0.0, 0.0  # on-policy by construction
        tokens = [series["completion_mean_length"][i] for i in post]
        gen = [series["trl_generation_time"][i] for i in post]
        per_step = [t * common["batch_size"] / g for t, g in zip(tokens, gen) if t is not None and g]
        summary["generation_tokens_per_second"] = _mean(per_step)
    else:
        summary.pop("trl_generation_time")
        summary.pop("trl_reward_time")
    tokens = [series["completion_mean_length"][i] for i in post]
    if all(t is not None for t in tokens) and post:
        summary["completion_tokens_per_second"] = sum(tokens) * common["batch_size"] / sum(durations[i] for i in post)
    else:
        summary["completion_tokens_per_second"] = None
    rewards = [r for r in series["reward"] if r is not None]
    summary["reward_per_step"] = series["reward"]
    summary["reward_final"] = _mean(rewards[-final_window:]) if rewards else None
    summary["reward_mean_all_steps"] = _mean(rewards)
    summary["peak_rss_mb"] = record.get("peak_rss_mb")
    summary["peak_rss_method"] = record.get("peak_rss_method")
    summary["cuda_peak_allocated_mb"] = result.get("cuda_peak_allocated_mb")
    for key in ("foreign_cpu_frac", "steal_frac", "own_cpu_frac"):  # during training
        summary[key] = result.get(key)
    for key in ("quiet_wait_seconds", "foreign_cpu_frac_before"):  # the runner's; reports of 2026 have them in result
        summary[key] = record[key] if key in record else result.get(key)
    summary["engine"] = result.get("engine")
    summary.update(thread_cpu_per_step(result, post))
    summary["overlap_warning"] = result.get("overlap_warning")
    summary["cpu_threads"] = result.get("cpu_threads")
    if config["kind"] == "pieces":
        waits = [series["trainer_wait_time"][i] for i in post]
        summary["generation_piece"] = _median(waits)
        summary["training_piece"] = _median(
            [durations[i] - w for i, w in zip(post, waits) if w is not None and i < len(durations)]
        )
    return summary


def thread_cpu_per_step(result: dict, post: list[int]) -> dict:
    """Each thread's CPU seconds per step over the steps ``post`` (consecutive indices, after warm-up), from the
    cumulative readings at each step end (train begin reads 0 for the training thread): ``trainer_cpu`` (the
    training thread: GRPOTrainer's only one) and ``generator_cpu`` (None without a generation thread, or where a
    reading is missing)."""
    out = {"trainer_cpu": None, "generator_cpu": None}
    for key, name in (("step_end_trainer_cpu", "trainer_cpu"), ("step_end_generator_cpu", "generator_cpu")):
        readings = result.get(key) or []
        if not post or post[-1] >= len(readings):
            continue
        before = readings[post[0] - 1] if post[0] > 0 else (0.0 if name == "trainer_cpu" else None)
        if before is not None and readings[post[-1]] is not None:
            out[name] = (readings[post[-1]] - before) / len(post)
    return out


AGGREGATED = (
    "step_time_median",
    "step_time_mean",
    "prox_time",
    "generation_time",
    "behavior_logps_time",
    "reward_time",
    "trainer_wait_time",
    "generator_wait_time",
    "weight_sync_time",
    "completion_tokens_per_second",
    "generation_tokens_per_second",
    "peak_rss_mb",
    "staleness_mean",
    "staleness_max",
    "importance_weight_mean",
    "importance_weight_max",
    "importance_weight_masked_frac",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_region",
    "entropy",
    "completion_mean_length",
    "reward_mean_all_steps",
    "foreign_cpu_frac",
    "generation_piece",
    "training_piece",
    "trainer_cpu",
    "generator_cpu",
)


def aggregate(summaries) -> dict[str, dict]:
    """Per configuration name: the mean over seeds of each scalar, and mean/std/values of the final reward."""
    by_name = defaultdict(list)
    for s in summaries:
        by_name[s["name"]].append(s)
    out = {}
    for name, runs in by_name.items():
        first = runs[0]
        entry = {
            "name": name,
            "kind": first["kind"],
            "method": first["method"],
            "max_staleness": first["max_staleness"],
            "threads": first["threads"],
            "seeds": [r["seed"] for r in runs],
        }
        for key in AGGREGATED:
            values = [r.get(key) for r in runs]
            entry[key] = (
                _mean(values) if key != "staleness_max" else max((v for v in values if v is not None), default=None)
            )
        entry["step_time_median_per_seed"] = [r["step_time_median"] for r in runs]
        finals = [r["reward_final"] for r in runs if r["reward_final"] is not None]
        entry["reward_final_mean"] = _mean(finals)
        entry["reward_final_std"] = _std(finals)
        entry["reward_final_values"] = finals
        out[name] = entry
    return out
