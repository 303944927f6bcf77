"""The report as markdown (``<out>/<name>.md``): per-configuration table, pipelining, micro-benchmark, final reward,
targets, errors and profiles."""

from __future__ import annotations

import math

from .report import ordered_configs


def _fmt(value, digits=2, unit=""):
    if value is None:
        return "–"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (int, float)) and abs(value) >= 1000:
        return f"{value:,.0f}{unit}"
    return f"{value:.{digits}f}{unit}"


def _count(threads) -> str:
    """A thread count as the options gave it: 0 is the library's default (train() chooses, or PyTorch's count)."""
    return "the library's default" if threads == 0 else str(threads)


def write_markdown(report, path: str) -> None:
    meta, lines = report["meta"], []
    batch = meta["batch"]
    lines += [
        f"# AsyncA3POTrainer vs TRL GRPOTrainer — {meta['model_name'] or meta['model']} on {meta['device']}",
        "",
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['machine']['cpu_model']}, {meta['machine']['cpu_count']} cores, "
        f"{meta['machine']['memory_gib']} GiB; torch {meta['software'].get('torch')}, transformers "
        f"{meta['software'].get('transformers')}, trl {meta['software'].get('trl')}",
        f"- Batch: {batch['per_device_train_batch_size']} completions per step ({batch['prompts_per_step']} "
        f"prompt(s) x {batch['num_generations']} generations), up to {batch['max_completion_length']} completion "
        f"tokens, one optimizer step per generation batch; {meta['steps']} steps per run, first "
        f"{meta['warmup_steps']} left out of timings; lr {meta['learning_rate']}; bf16={meta['bf16']}",
        f"- Threads: TRL {meta['threads']['trl']}; AsyncA3PO training {_count(meta['threads']['a3po_training'])} + "
        f"generation {_count(meta['threads']['a3po_generation'])}; pieces (generation in the main thread) "
        f"{_count(meta['threads']['pieces'])}"
        + (f"; variants {meta['threads']['variants']}" if meta["threads"].get("variants") else "")
        + f"; OMP_WAIT_POLICY={meta['omp_wait_policy'] or 'unset'}",
        f"- Seeds: {meta['seeds']} (repeated configurations: {meta['extra_seeds_for']}); isolation: "
        f"{meta['isolation']}; data: {meta['data']}; rewards: {', '.join(meta['rewards'])}",
        "",
        "## Per configuration (means over seeds of per-run values; times in seconds per optimizer step)",
        "",
        f"`vs TRL`: speedup over the fastest synchronous baseline, `{report['baseline']}` (`trl`: TRL GRPOTrainer on "
        f"{meta['threads']['trl']} threads, `trl-t1`: on one thread).",
        "",
        "| config | s/step median | s/step mean | vs TRL | prox | generation | trainer wait | generator wait | "
        "tok/s | gen tok/s | peak RSS MB | staleness mean/max | IW mean/max/masked | clip low/high | "
        "final reward (mean ± sd, n) | foreign CPU |",
        "|" + "---|" * 16,
    ]
    speedups = report["speedup_vs_trl"]
    for c in ordered_configs(report["configs"]):
        reward = _fmt(c["reward_final_mean"], 3)
        if c["reward_final_std"] is not None:
            reward += f" ± {c['reward_final_std']:.3f}"
        reward += f" (n={len(c['reward_final_values'])})"
        iw = "–"
        if c["importance_weight_mean"] is not None:
            iw = (
                f"{c['importance_weight_mean']:.3f}/{c['importance_weight_max']:.2f}/"
                f"{c['importance_weight_masked_frac']:.3f}"
            )
        clip = "–"
        if c["clip_ratio_low"] is not None:
            clip = f"{c['clip_ratio_low']:.3f}/{c['clip_ratio_high']:.3f}"
        lines.append(
            f"| {c['name']} | {_fmt(c['step_time_median'])} | {_fmt(c['step_time_mean'])} | "
            f"{_fmt(speedups.get(c['name']), 2, 'x')} | "
            f"{_fmt(c['prox_time'], 4)} | {_fmt(c['generation_time'])} | {_fmt(c['trainer_wait_time'])} | "
            f"{_fmt(c['generator_wait_time'])} | {_fmt(c['completion_tokens_per_second'], 1)} | "
            f"{_fmt(c['generation_tokens_per_second'], 1)} | {_fmt(c['peak_rss_mb'], 0)} | "
            f"{_fmt(c['staleness_mean'])}/{_fmt(c['staleness_max'], 0)} | {iw} | {clip} | {reward} | "
            f"{_fmt(c['foreign_cpu_frac'])} |"
        )
    lines += [
        "",
        "`prox`: a3po/prox_time (recompute: the extra no-grad forward; loglinear: the interpolation). `generation`: "
        "generate() per batch (async/generation_time; TRL: its _generate, timed by the benchmark). `tok/s`: "
        "completion tokens trained per second of wall time; `gen tok/s`: completion tokens per second of "
        "generate(). `foreign CPU`: share of the machine used by other processes during the run.",
        "",
    ]
    if report["pipeline"]:
        lines += [
            "## Pipelining: ideal max(generation, training) vs achieved",
            "",
            "| method | generation alone | training alone | sequential | ideal pipelined | bottleneck | "
            + " | ".join(f"s{d}: step (ratio to ideal)" for d in meta["staleness"])
            + " |",
            "|" + "---|" * (6 + len(meta["staleness"])),
        ]
        for method, entry in report["pipeline"].items():
            cells = []
            for d in meta["staleness"]:
                achieved = entry["achieved"].get(str(d))
                cells.append(
                    f"{achieved['step_time_median']:.2f} ({achieved['ratio_to_ideal']:.2f})" if achieved else "–"
                )
            lines.append(
                f"| {method} | {entry['generation_alone']:.2f} | {entry['training_alone']:.2f} | "
                f"{entry['sequential']:.2f} | {entry['ideal_pipelined']:.2f} | {entry['bottleneck']} | "
                + " | ".join(cells)
                + " |"
            )
        lines += [
            "",
            "Generation alone and training alone come from the `pieces-*` runs (async_generation=False, both in the "
            "main thread on the training thread count): generation = rollout + behavior log-probs + rewards, "
            "training = step time minus that. s0 is synchronous by construction (not a pipelining target).",
            "",
        ]
    lines += _thread_cpu_lines(report)
    micro = report.get("microbench")
    if micro:
        lines += [
            f"## Proximal log-probs micro-benchmark: one (B, T) = {tuple(micro['batch_shape'])} batch, "
            f"{micro['sequence_tokens']} tokens per sequence",
            "",
            "| threads | recompute forward (s) | loglinear (s) | ratio |",
            "|---|---|---|---|",
        ]
        for row in micro["by_threads"]:
            lines.append(
                f"| {row['threads']} | {row['recompute_seconds']:.4f} | {row['loglinear_seconds']:.2e} | "
                f"{row['ratio']:,.0f}x |"
            )
        lines.append("")
    if report["reward_comparison"]:
        lines += ["## Final reward: loglinear vs recompute", ""]
        lines.append("| staleness | loglinear | recompute | diff | within noise |")
        lines.append("|---|---|---|---|---|")
        for d, e in report["reward_comparison"].items():
            lines.append(
                f"| {d} | {_fmt(e['loglinear_mean'], 3)} ± {_fmt(e['loglinear_std'], 3)} (n={e['n_seeds'][0]}) | "
                f"{_fmt(e['recompute_mean'], 3)} ± {_fmt(e['recompute_std'], 3)} (n={e['n_seeds'][1]}) | "
                f"{e['difference']:+.3f} | {e['within_noise']} ({e['note']}) |"
            )
        lines.append("")
    lines += ["## Targets", "", "| target | measured | met | note |", "|---|---|---|---|"]
    for t in report["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {_fmt(t['measured'], 3)} | {met} | {t['note'] or ''} |")
    if report["errors"]:
        lines += ["", "## Errors", ""]
        lines += [f"- {e['run_id']}: `{e['error'].splitlines()[0]}`" for e in report["errors"]]
    profiled = [r for r in report["runs"] if r.get("profile")]
    if profiled:
        lines += ["", "## Profiles (py-spy samples, share per thread)", ""]
        for run in profiled:
            for thread, entry in run["profile"].items():
                top = ", ".join(f"{k} {v:.0%}" for k, v in list(entry["share"].items())[:8])
                lines.append(f"- {run['run_id']} — {thread} ({entry['seconds_at_20hz']:.0f} s busy): {top}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _thread_cpu_lines(report) -> list[str]:
    """Each configuration's threads' CPU seconds per step against its step, the overlap rule of
    ``a3po_trl.timeline.overlap`` on the means, and the seeds whose run logged the overlap warning."""
    from a3po_trl.timeline.overlap import overlap_costs

    configs = [c for c in report["configs"].values() if c.get("trainer_cpu") is not None]
    if not configs:
        return []
    lines = [
        "## Each thread's CPU time per step",
        "",
        "| config | s/step mean | training thread CPU | generation thread CPU | together / step | overlap costs "
        "more than it hides | runs that logged the warning |",
        "|---|---|---|---|---|---|---|",
    ]
    by_name: dict[str, list] = {}
    for run in report.get("runs", []):
        by_name.setdefault(run["name"], []).append(run.get("overlap_warning"))
    for c in configs:
        step, trainer, generator = c["step_time_mean"], c["trainer_cpu"], c.get("generator_cpu")
        together = (trainer + (generator or 0.0)) / step if step else None
        costs = "-" if generator is None else ("yes" if overlap_costs(step, trainer, generator) else "no")
        warnings = [w for w in by_name.get(c["name"], []) if w is not None]
        warned = f"{sum(1 for w in warnings if w)} of {len(warnings)}" if warnings else "-"
        lines.append(
            f"| {c['name']} | {_fmt(step)} | {_fmt(trainer)} | {_fmt(generator)} | {_fmt(together)} | {costs} | "
            f"{warned} |"
        )
    lines += [
        "",
        "CPU seconds per step after warm-up, mean over seeds (`time.thread_time()` of the training thread, the "
        "generation thread's CPU clock). The rule (docs/GPU.md, 'Which generation path on a GPU'): the overlap costs "
        "more than it hides when the step is at least 1.05 x the two threads' CPU time together while that fills at "
        "least half of the step. GRPOTrainer has one thread.",
        "",
    ]
    return lines
