"""Time to accuracy on the main job: TRL's GRPOTrainer against AsyncA3POTrainer (recompute, loglinear) over seeds.

Every configuration trains the demo's task and model (SmolLM2-135M-Instruct, LoRA r=16, the built-in one-step
problems, the demo's settings of ``examples/train_gsm8k.py``) for the same steps and batch shape, one run per
(configuration, seed) in its own process; the seed moves the data order and the sampling. Each run records held-out
greedy accuracy before/after (200 problems), accuracy every ``--eval-every`` steps on a fixed 100-problem subset
against the training wall-clock, and seconds per step. The adapter is snapshotted at those steps and the snapshots
are evaluated after training: an evaluation inside the run would let the generation thread work during time the
clock leaves out. The asynchronous configurations generate with ``reproducible_generation=True``.

Runs take ~20 minutes each on 2 CPU cores (~13-17 of them training), so the script is resumable: a finished run is a
JSON file under ``<out>/runs/`` and is skipped next time; ``--max-runs`` bounds one invocation (the runs go
configuration by configuration, through :mod:`benchmarks.common.runner`, which also records the machine's load). After
the runs it (re)writes ``<out>/summary.json``, ``<out>/summary.md`` (table: accuracy before/after with spread over
seeds and the paired gain, s/step, total, and the wall-clock each configuration needed to reach the synchronous
baseline's final accuracy on the subset) and ``<out>/accuracy_vs_time.png`` (one line per configuration, a band over
seeds), saying which runs are still missing.

    python -m benchmarks.time_to_accuracy --max-runs 3                    # next 3 missing runs, then the summary
    python -m benchmarks.time_to_accuracy --summary-only                  # the summary of what is there
    python -m benchmarks.time_to_accuracy --quick                         # tiny settings, a few minutes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common.demo import add_run_arguments, apply_quick, demo_trainer
from benchmarks.common.intervals import mean_interval
from benchmarks.common.runner import RunStore, plan, run_study, study_parser

HERE = Path(__file__).resolve().parent
CONFIGS = ("trl", "recompute-s2", "loglinear-s1", "loglinear-s2", "loglinear-s4")


def _parser() -> argparse.ArgumentParser:
    parser = study_parser(__doc__, configs=CONFIGS, seeds=(42, 43, 44), out=HERE / "results" / "time-to-accuracy")
    add_run_arguments(parser)
    return parser


#: The demo's training settings that every configuration shares (:func:`a3po_trl.tasks.demo_settings.demo_defaults`).
_TRAINING_FIELDS = (
    "learning_rate",
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "temperature",
    "reward_weights",
    "logging_steps",
    "report_to",
    "bf16",
)


def _settings(options) -> dict:
    """The demo's settings (``examples/train_gsm8k.py``'s defaults), shrunk by ``--quick``."""
    from a3po_trl.tasks.demo_settings import DEMO_SYSTEM_PROMPT, demo_defaults

    defaults = demo_defaults([])
    training = {k: v for k, v in defaults.items() if k in _TRAINING_FIELDS}
    training.update(max_steps=options.steps, save_strategy="no", use_cpu=not _cuda())
    if options.quick:
        training["max_completion_length"] = 16
    return {"training": training, "threads": _recorded_thread_split(), "system_prompt": DEMO_SYSTEM_PROMPT}


def _recorded_thread_split() -> dict:
    """The asynchronous runs' CPU thread counts: this process's cores split between the generation and the training
    thread, as the demo set them when the study's records were taken (the demo now leaves them to ``train()``, which
    keeps PyTorch's count in both threads for SmolLM2); kept here so the study reruns what its records ran."""
    cores = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    generation = max(1, cores // 2)
    return {"generation_num_threads": generation, "training_num_threads": max(1, cores - generation)}


def _method_and_staleness(name: str) -> tuple[str, int]:
    """``"loglinear-s2"`` -> ``("loglinear", 2)``."""
    method, staleness = name.rsplit("-s", 1)
    return method, int(staleness)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _data(options, system_prompt):
    from a3po_trl.tasks import make_math_splits

    train, held_out = make_math_splits(1000, options.held_out, "basic", 0, system_prompt=system_prompt)
    return train, held_out, held_out.select(range(min(options.eval_problems, len(held_out))))


def _run_one(options, name: str, seed: int, overrides: dict | None = None, run_name: str | None = None) -> dict:
    """One (configuration, seed) run, in this process (the runner adds when it ran and the machine's load).
    Another study's arm: ``overrides`` (``AsyncA3POConfig`` fields, training settings included, set over those of
    configuration ``name``) under ``run_name`` (its work folder and the record's ``config``)."""
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
    from a3po_trl.tasks import evaluate_accuracy
    from benchmarks.common.provenance import run_settings, thread_roles, trainer_threads

    run_name = run_name or name
    settings = _settings(options)
    train, held_out, subset = _data(options, settings["system_prompt"])
    common = dict(output_dir=str(Path(options.out) / "work" / f"{run_name}@{seed}"), seed=seed, **settings["training"])
    if name == "trl":
        args, trainer_class = GRPOConfig(**common), GRPOTrainer
    else:
        method, staleness = _method_and_staleness(name)
        fields = dict(
            common,
            prox_logp_method=method,
            max_staleness=staleness,
            reproducible_generation=True,
            **(settings["threads"] if not _cuda() else {}),
        )
        args, trainer_class = AsyncA3POConfig(**{**fields, **(overrides or {})}), AsyncA3POTrainer
    trainer = demo_trainer(trainer_class, options.model, args, train)
    max_tokens = args.max_completion_length

    def accuracy(dataset):
        model = trainer.accelerator.unwrap_model(trainer.model)
        with torch.no_grad():
            return evaluate_accuracy(model, trainer.processing_class, dataset, max_tokens, batch_size=50)

    # Evaluating inside the run would leave the generation thread generating (and, up to the staleness bound,
    # getting ahead) during evaluation time the clock leaves out. The adapter weights are therefore snapshotted at
    # each evaluation step (a copy of ~19 MiB, timed and left out) and evaluated after training.
    snapshots, clock = [], {"snapshot": 0.0, "start": None}

    class SnapshotEvery(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % options.eval_every == 0 or state.global_step == state.max_steps:
                begin = time.perf_counter()
                training_seconds = begin - clock["start"] - clock["snapshot"]
                model = trainer.accelerator.unwrap_model(trainer.model)
                weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
                clock["snapshot"] += time.perf_counter() - begin
                snapshots.append((state.global_step, training_seconds, weights))
                print(f"[tta] {run_name}@{seed} step {state.global_step}: {training_seconds / 60:.1f} min", flush=True)

    before = accuracy(held_out)
    curve = [{"step": 0, "seconds": 0.0, "accuracy": accuracy(subset)["accuracy"]}]
    trainer.add_callback(SnapshotEvery())
    process_threads = torch.get_num_threads()
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start - clock["snapshot"]
    after = accuracy(held_out)  # the final weights, before the snapshots are loaded
    model = trainer.accelerator.unwrap_model(trainer.model)
    for step, seconds, weights in snapshots:
        set_peft_model_state_dict(model, weights)
        loaded = get_peft_model_state_dict(model).values()
        adapter_norm = torch.sqrt(sum((v.detach().double() ** 2).sum() for v in loaded)).item()
        result = accuracy(subset)
        curve.append({"step": step, "seconds": seconds, "accuracy": result["accuracy"], "adapter_norm": adapter_norm})
        print(f"[tta] {run_name}@{seed} step {step}: {result['accuracy']:.1%} on the subset", flush=True)
    steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    if not lengths:  # s/step follows the completions' length: a record without it cannot be compared
        raise RuntimeError(f"{run_name}@{seed}: the trainer logged no completions/mean_length")
    # GRPOTrainer: one thread (the process's) generates and trains
    threads = thread_roles(process=process_threads) if name == "trl" else trainer_threads(trainer, process_threads)
    return {
        "config": run_name,
        "seed": seed,
        "steps": args.max_steps,
        "before": before["accuracy"],
        "after": after["accuracy"],
        "before_correct": before["correct"],
        "after_correct": after["correct"],
        "curve": curve,
        "train_seconds": total,
        "seconds_per_step": statistics.median(steps) if steps else total / args.max_steps,
        "completion_mean_length": statistics.fmean(lengths),  # s/step follows it; every configuration logs it
        # the trainer's logged metrics per step (rewards, clip ratios, importance weights, staleness, timings)
        "training_log": [
            {k: round(v, 6) for k, v in h.items() if isinstance(v, (int, float)) and k not in ("epoch", "step")}
            | {"step": h["step"]}
            for h in trainer.state.log_history
            if "step" in h and "loss" in h
        ],
        # the threads it set, for its provenance block (the runner adds when, where and the load)
        "provenance": run_settings(threads),
    }


def _summarize(store: RunStore, options, names, seeds) -> str:
    from a3po_trl.tasks.evaluation import paired_accuracy_test

    runs = {}
    for cell, run in store.records().items():
        runs.setdefault(cell.config, []).append(run)
    missing = [str(cell) for cell in store.missing(plan(names, seeds, by_seed=False))]
    tests = {
        (r["config"], r["seed"]): paired_accuracy_test(r["before_correct"], r["after_correct"])
        for done in runs.values()
        for r in done
    }
    baseline = runs.get("trl", [])
    target = statistics.fmean(r["curve"][-1]["accuracy"] for r in baseline) if baseline else None
    rows, summary = [], {}
    for name in names:
        done = runs.get(name, [])
        if not done:
            continue
        before = [r["before"] for r in done]
        after = [r["after"] for r in done]
        gains = [tests[(r["config"], r["seed"])]["gain"] for r in done]
        reach = []
        for r in done:
            hits = [p["seconds"] for p in r["curve"] if target is not None and p["accuracy"] >= target]
            reach.append(hits[0] if hits else None)
        entry = {
            "runs": len(done),
            "before_mean": statistics.fmean(before),
            "after_mean": statistics.fmean(after),
            "after_spread": [min(after), max(after)],
            "gain_mean": statistics.fmean(gains),
            "seconds_per_step": statistics.fmean(r["seconds_per_step"] for r in done),
            "train_minutes": statistics.fmean(r["train_seconds"] for r in done) / 60,
            "minutes_to_baseline_final": [None if t is None else t / 60 for t in reach],
            "per_seed": {str(r["seed"]): _seed_entry(r, tests[(r["config"], r["seed"])]) for r in done},
        }
        speedup = same_seed_speedup({r["seed"]: r for r in done}, {r["seed"]: r for r in baseline})
        if speedup is not None and name != "trl":
            entry["speedup_vs_trl"] = speedup
        summary[name] = entry
        reached = [t for t in entry["minutes_to_baseline_final"] if t is not None]
        reach_text = f"{statistics.fmean(reached):.1f} ({len(reached)}/{len(done)})" if reached else "-"
        rows.append(
            f"| {name} | {len(done)} | {entry['before_mean']:.1%} | {entry['after_mean']:.1%} "
            f"({entry['after_spread'][0]:.1%}-{entry['after_spread'][1]:.1%}) | {entry['gain_mean']:+.1%} "
            f"({min(gains):+.1%} to {max(gains):+.1%}) | "
            f"{entry['seconds_per_step']:.1f} | {entry['train_minutes']:.1f} | {reach_text} |"
        )
    table = "\n".join(
        [
            f"Time to accuracy, {options.steps} steps, seeds {','.join(map(str, seeds))}; baseline final accuracy on "
            f"the {options.eval_problems}-problem subset: {'-' if target is None else f'{target:.1%}'}.",
            "",
            "| configuration | runs | before | after (min-max) | paired gain (min to max) | s/step | train min "
            "| min to baseline |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Missing runs: {', '.join(missing) if missing else 'none'}.",
            "",
            *_speedup_lines(summary),
            "Per run:",
            "",
            *_per_run_table(runs, tests, names, seeds),
        ]
    )
    out = Path(options.out)
    (out / "summary.json").write_text(json.dumps({"target": target, "configs": summary, "missing": missing}, indent=2))
    (out / "summary.md").write_text(table + "\n")
    _plot(runs, names, out / "accuracy_vs_time.png")
    return table


def _seed_entry(run: dict, test: dict) -> dict:
    """What the per-run table shows of one run: held-out accuracy before and after, the paired gain with its standard
    error and McNemar p-value, and its timings."""
    return {
        "before": run["before"],
        "after": run["after"],
        "gain": test["gain"],
        "gain_stderr": test["stderr"],
        "p_value": test["p_value"],
        "seconds_per_step": run["seconds_per_step"],
        "train_minutes": run["train_seconds"] / 60,
        "completion_mean_length": run.get("completion_mean_length"),
    }


def same_seed_speedup(runs: dict[int, dict], baseline: dict[int, dict]) -> dict | None:
    """TRL's training seconds over the configuration's, seed by seed (same data order), and their geometric mean
    over the seeds with its 95% t interval (taken on the log ratios); ``None`` without a seed both have. Each ratio
    also carries the two runs' own completion lengths: a wall-clock ratio of whole runs, not the step-time speed-up
    of a controlled benchmark."""
    seeds = sorted(runs.keys() & baseline.keys())
    if not seeds:
        return None
    ratios = [baseline[s]["train_seconds"] / runs[s]["train_seconds"] for s in seeds]
    logs = mean_interval([math.log(ratio) for ratio in ratios])
    return {
        "seeds": seeds,
        "ratios": ratios,
        "geometric_mean": math.exp(logs.mean),
        "low": math.exp(logs.low),
        "high": math.exp(logs.high),
    }


def _speedup_lines(summary: dict) -> list[str]:
    """The same-seed training-time ratios against TRL, per configuration, with their geometric mean."""
    rows = [
        f"| {name} | {' / '.join(f'{r:.2f}x' for r in s['ratios'])} | {s['geometric_mean']:.2f}x "
        f"[{s['low']:.2f}, {s['high']:.2f}] |"
        for name, entry in summary.items()
        if (s := entry.get("speedup_vs_trl")) and len(s["seeds"]) > 1
    ]
    if not rows:
        return []
    return [
        "Training time against TRL on the same seed (TRL's training minutes / the configuration's; seed by seed, "
        "then the geometric mean over seeds with its 95% t interval, taken on the log ratios, uncorrected for the "
        "number of configurations). Each ratio carries "
        "the two runs' own completion lengths, so it is a wall-clock ratio of whole runs, not the trainer's step-time "
        "speed-up:",
        "",
        "| configuration | per seed | geometric mean [95% interval] |",
        "|---|---:|---:|",
        *rows,
        "",
    ]


def _label(name: str) -> str:
    if name == "trl":
        return "TRL `GRPOTrainer` (2 threads)"
    method, staleness = _method_and_staleness(name)
    return f"{method}, staleness {staleness}"


def _per_run_table(runs, tests, names, seeds) -> list[str]:
    """One row per finished run, by seed then configuration (the README's table); ``tests``: each run's paired test."""
    by_key = {(r["config"], r["seed"]): r for done in runs.values() for r in done}
    if not by_key:
        return []
    eval_steps = " / ".join(str(p["step"]) for p in next(iter(by_key.values()))["curve"][1:])
    rows = [
        f"| configuration | seed | held-out before -> after | paired gain (p) | subset at steps {eval_steps} "
        "| tokens per completion | s/step | training min | vs TRL, same seed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seed in seeds:
        baseline = by_key.get(("trl", seed))
        for name in names:
            run = by_key.get((name, seed))
            if run is None:
                continue
            test = tests[(name, seed)]
            subset = " / ".join(f"{p['accuracy']:.0%}" for p in run["curve"][1:])
            length = run.get("completion_mean_length")
            speedup = f"{baseline['train_seconds'] / run['train_seconds']:.2f}x" if baseline else "-"
            rows.append(
                f"| {_label(name)} | {seed} | {run['before']:.1%} -> {run['after']:.1%} | "
                f"{test['gain']:+.1%} +- {test['stderr']:.1%} ({test['p_value']:.3f}) | {subset} | "
                f"{'-' if length is None else f'{length:.1f}'} | {run['seconds_per_step']:.2f} | "
                f"{run['train_seconds'] / 60:.1f} | {speedup} |"
            )
    return rows


def _plot(runs, names, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in names:
        done = runs.get(name, [])
        if not done:
            continue
        steps = sorted({p["step"] for r in done for p in r["curve"]})
        points = [[p for r in done for p in r["curve"] if p["step"] == s] for s in steps]
        minutes = [statistics.fmean(p["seconds"] for p in group) / 60 for group in points]
        accuracy = [[p["accuracy"] for p in group] for group in points]
        (line,) = axis.plot(
            minutes, [statistics.fmean(a) for a in accuracy], marker="o", label=f"{name} ({len(done)})"
        )
        axis.fill_between(
            minutes, [min(a) for a in accuracy], [max(a) for a in accuracy], alpha=0.15, color=line.get_color()
        )
    axis.set_xlabel("training wall-clock (minutes; snapshots evaluated after training)")
    axis.set_ylabel("greedy accuracy, fixed held-out subset")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = _parser().parse_args(argv)
    apply_quick(options)
    run_study(
        argv,
        options,
        module="benchmarks.time_to_accuracy",
        cells=plan(options.configs, options.seeds, by_seed=False),
        run=lambda cell: _run_one(options, cell.config, cell.seed),
        summarize=lambda store: _summarize(store, options, options.configs, options.seeds),
    )


if __name__ == "__main__":
    main()
