"""What the proximal policy buys, with enough seeds to tell: a many-seed map of the methods on a tiny model.

Every configuration ``<method>-s<d>-k<k>-lr<rate>`` trains a tiny random Llama (2 layers, hidden 32) with the trainer
itself on the token-preference task (:mod:`a3po_trl.tasks.token_preference`: a reward without flat plateaus) with
``prox_logp_method=<method>``, ``k`` optimizer steps per generation batch (``steps_per_generation=k``, one
micro-batch per optimizer step) and ``reproducible_generation=True`` at ``max_staleness = d + k - 1``, so that after
the first batches every generation batch's first optimizer step trains on samples exactly ``d`` versions old, and its
later steps on samples ``d + 1`` .. ``d + k - 1`` old:

- methods: ``behavior`` (the trust region around the behavior policy, no behavior weight: the ablation),
  ``recompute`` (decoupled PPO, the proximal policy recomputed when the batch is taken), ``loglinear`` (A-3PO);
- ``d``: 0, 2, 4, 8; ``k``: 1 (where the three differ only in how wide a trust region they keep around the stale
  behavior policy) and 4 (where recompute's anchor falls behind the trained weights within a batch, and its clip
  engages);
- two learning rates (``--learning-rates``, ``hi`` and ``lo``): a method that wins only at the high one wins by its
  step size, one that wins at both by its anchor.

Each run: ``--steps`` optimizer steps of ``--prompts-per-step`` prompts x 8 completions of 8 tokens. Outcomes, from
the trained policy itself (not the stale training samples): every ``--eval-every`` steps the mean reward of
``--eval-samples`` completions per class sampled at the training temperature (seeded, and the global random state
restored after, so evaluating changes nothing in training); the final one, and the area under that curve (its mean
over the evaluations after step 0). Beside them, from the training log: the policy's movement per optimizer step on
the sampled tokens (``a3po/behavior_drift_per_version_mean``), the clipped and capped token fractions, seconds per
step.

The summary gives, per cell, the mean over seeds with its 95% t interval, and for each pair of methods the
paired-by-seed difference with its interval (the seed fixes the initial weights and the data order, shared by every
method), writes ``<out>/summary.md``, ``summary.json`` and ``proximal_map.png``, and names the runs still missing.
Runs are resumable, one JSON per run under ``<out>/runs/``::

    python -m benchmarks.proximal_map --cells-per-launch 16        # the whole map (768 runs), resumable
    python -m benchmarks.proximal_map --summary-only
    python -m benchmarks.proximal_map --quick --out /tmp/map       # a smoke run: 2 configurations, 2 seeds
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.intervals import (
    equivalence_from_summary,
    holm,
    mean_interval,
    paired_difference,
    t_quantile,
    t_test_p,
)
from benchmarks.common.machine import kernel_info
from benchmarks.common.provenance import run_settings, trainer_threads
from benchmarks.common.runner import RunStore, plan, run_study, study_parser

HERE = Path(__file__).resolve().parent
METHODS = ("behavior", "recompute", "loglinear")
#: Methods a configuration may name beyond the map's own (``benchmarks/guard_map.py`` runs the guarded one).
OTHER_METHODS = ("guarded",)
STALENESS = (0, 2, 4, 8)
STEPS_PER_BATCH = (1, 4)
RATES = ("hi", "lo")
CONFIGS = tuple(
    f"{method}-s{d}-k{k}-lr{rate}" for rate in RATES for k in STEPS_PER_BATCH for d in STALENESS for method in METHODS
)
SEEDS = tuple(range(16))
#: Per-step metrics of the trainer kept in each run's JSON.
LOGGED = (
    "reward",
    "clip_ratio/region_mean",
    "a3po/importance_weight_masked_frac",
    "a3po/behavior_drift_per_version_mean",
    "a3po/staleness_mean",
    "step_time",
    "a3po/prox_recompute_fraction",  # the guarded method's (absent from the others' logs)
    "a3po/prox_check_error_relative",
)
#: The equivalence margin on reward (final and AUC): the SmolLM2 confirmation's, declared in
#: results/staleness/PREREGISTRATION.md, for the same reason (below the smallest gain the map reports).
EQUIVALENCE_MARGIN = 0.05
OUTCOMES = {"final": "final reward", "auc": "reward AUC"}
MAX_COMPLETION_LENGTH = 8
NUM_GENERATIONS = 8


def _parser():
    parser = study_parser(__doc__, configs=CONFIGS, seeds=SEEDS, out=HERE / "results" / "proximal_map")
    parser.add_argument("--steps", type=int, default=48, help="optimizer steps per run")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per optimizer step (x 8 completions)")
    parser.add_argument("--learning-rates", default="hi=3e-2,lo=1e-2", help="the two rates, as name=value")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--eval-samples", type=int, default=64, help="completions per class at each evaluation")
    parser.add_argument("--quick", action="store_true", help="2 configurations, 2 seeds, 6 steps (a smoke run)")
    return parser


def parse_config(name: str) -> tuple[str, int, int, str]:
    """``"loglinear-s4-k1-lrhi"`` -> ``("loglinear", 4, 1, "hi")``."""
    parts = name.split("-")
    if (
        len(parts) != 4
        or parts[0] not in METHODS + OTHER_METHODS
        or not (parts[1][:1] == "s" and parts[1][1:].isdigit())
        or not (parts[2][:1] == "k" and parts[2][1:].isdigit())
        or not parts[3].startswith("lr")
    ):
        methods = METHODS + OTHER_METHODS
        raise SystemExit(f"configuration {name!r} is not <method>-s<d>-k<k>-lr<rate>, method one of {methods}")
    return parts[0], int(parts[1][1:]), int(parts[2][1:]), parts[3][2:]


def _rates(options) -> dict[str, float]:
    return {name: float(value) for name, value in (item.split("=") for item in options.learning_rates.split(","))}


# ---- one run (in the subprocess) --------------------------------------------------------------------------------
def map_trainer(
    method: str, staleness: int, steps_per_batch: int, learning_rate: float, seed: int, *, steps: int,
    prompts_per_step: int, temperature: float, prefix: str = "a3po-proximal-map-",
):  # fmt: skip
    """A map cell's trainer (the tiny Llama of ``seed`` on the token-preference task, one thread each), with its
    tokenizer and reward: ``benchmarks/oracle.py`` trains the same cells."""
    import torch
    from transformers import PrinterCallback

    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
    from a3po_trl.tasks.tiny_model import make_tiny_llama
    from a3po_trl.tasks.token_preference import (
        make_token_preference_prompts,
        make_token_preference_tokenizer,
        token_preference_reward,
    )

    torch.set_num_threads(1)
    tokenizer = make_token_preference_tokenizer()
    model = make_tiny_llama(tokenizer, seed=seed)
    reward = token_preference_reward(tokenizer, MAX_COMPLETION_LENGTH)
    prompts = make_token_preference_prompts(steps * prompts_per_step * 2, seed=seed)
    args = AsyncA3POConfig(
        output_dir=tempfile.mkdtemp(prefix=prefix),
        per_device_train_batch_size=prompts_per_step * NUM_GENERATIONS,
        steps_per_generation=steps_per_batch,
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=temperature,
        learning_rate=learning_rate,
        max_steps=steps,
        max_staleness=staleness + steps_per_batch - 1,
        reproducible_generation=True,
        prox_logp_method=method,
        beta=0.0,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        timeline=False,
        generation_num_threads=1,
        training_num_threads=1,
    )
    trainer = AsyncA3POTrainer(
        model=model, reward_funcs=[reward], args=args, train_dataset=prompts, processing_class=tokenizer
    )
    trainer.remove_callback(PrinterCallback)  # the per-step numbers go into the record, not into the log
    return trainer, tokenizer, reward


def _run_one(options, name: str, seed: int) -> dict:
    import torch
    from transformers import TrainerCallback

    method, staleness, steps_per_batch, rate = parse_config(name)
    trainer, tokenizer, reward = map_trainer(
        method, staleness, steps_per_batch, _rates(options)[rate], seed, steps=options.steps,
        prompts_per_step=options.prompts_per_step, temperature=options.temperature,
    )  # fmt: skip
    args = trainer.args
    evaluations: dict[int, float] = {}

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            evaluations[0] = _evaluate(trainer, tokenizer, reward, options, seed)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % options.eval_every == 0 or state.global_step == state.max_steps:
                evaluations[state.global_step] = _evaluate(trainer, tokenizer, reward, options, seed)

    trainer.add_callback(Evaluate())
    process_threads = torch.get_num_threads()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    history = [h for h in trainer.state.log_history if "loss" in h]
    logged = {key: [h.get(key) for h in history] for key in LOGGED}
    after_start = [value for step, value in sorted(evaluations.items()) if step > 0]
    return {
        "config": name,
        "seed": seed,
        "method": method,
        "staleness": staleness,
        "steps_per_batch": steps_per_batch,
        "learning_rate": args.learning_rate,
        "evaluations": {str(step): value for step, value in sorted(evaluations.items())},
        "final_reward": evaluations[max(evaluations)],
        "reward_auc": statistics.fmean(after_start),
        "drift_per_step": _mean(logged["a3po/behavior_drift_per_version_mean"]),
        "clipped_frac": _mean(logged["clip_ratio/region_mean"]),
        "capped_frac": _mean(logged["a3po/importance_weight_masked_frac"]),
        "seconds_per_step": statistics.median(v for v in logged["step_time"] if v is not None),
        "train_seconds": seconds,
        "kernels": kernel_info(),
        "logged": logged,
        "provenance": run_settings(trainer_threads(trainer, process_threads)),  # the runner adds the rest
    }


def _evaluate(trainer, tokenizer, reward, options, seed: int) -> float:
    """Mean reward of ``options.eval_samples`` completions per class sampled from the training model now, at the
    training temperature, from a seeded stream; the global random state is left as it was."""
    import torch

    from a3po_trl.tasks.token_preference import class_token_ids

    model = trainer.accelerator.unwrap_model(trainer.model)
    classes = len(class_token_ids(tokenizer))
    ids = tokenizer([f"c{k}" for k in range(classes)], return_tensors="pt")["input_ids"]
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(10_000 + seed)
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=options.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=MAX_COMPLETION_LENGTH,
            num_return_sequences=options.eval_samples,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    model.train(was_training)
    completions = output[:, ids.size(1) :].tolist()
    completions = [c[: c.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in c else c for c in completions]
    targets = [k for k in range(classes) for _ in range(options.eval_samples)]
    return statistics.fmean(reward(completion_ids=completions, target=targets))


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


# ---- the summary ----------------------------------------------------------------------------------------------
PAIRS = (("loglinear", "recompute"), ("loglinear", "behavior"), ("recompute", "behavior"))


def summarize(store: RunStore, options) -> str:
    records = store.records()
    by_config: dict[str, dict[int, dict]] = {}
    for cell, record in records.items():
        by_config.setdefault(cell.config, {})[cell.seed] = record
    missing = [f"{c}@{s}" for c in options.configs for s in options.seeds if s not in by_config.get(c, {})]
    cells, pairs, lines = {}, {}, []
    lines.append(
        f"Proximal map: {len(records)} runs of {len(options.configs) * len(options.seeds)} "
        f"({len(options.seeds)} seeds per configuration). Means over seeds with 95% t intervals; differences paired "
        "by seed. Reward: the trained policy's, sampled (from 1/5 at the start to 1.0); AUC: mean over the "
        "evaluations after step 0; drift: the policy's movement per optimizer step on sampled tokens (nats)."
    )
    for rate in RATES:
        for k in STEPS_PER_BATCH:
            block = [c for c in options.configs if c.endswith(f"-k{k}-lr{rate}")]
            if not block:
                continue
            lines += ["", f"### {k} optimizer step(s) per generation batch, learning rate {rate}", ""]
            lines.append("| staleness | method | runs | final reward | reward AUC | drift/step | clipped | capped |")
            lines.append("|---:|---|---:|---|---|---:|---:|---:|")
            for d in STALENESS:
                for method in METHODS:
                    name = f"{method}-s{d}-k{k}-lr{rate}"
                    runs = by_config.get(name, {})
                    if name not in block or not runs:
                        continue
                    row = {
                        "final": mean_interval(r["final_reward"] for r in runs.values()),
                        "auc": mean_interval(r["reward_auc"] for r in runs.values()),
                        "drift": _mean(r["drift_per_step"] for r in runs.values()),
                        "clipped": _mean(r["clipped_frac"] for r in runs.values()),
                        "capped": _mean(r["capped_frac"] for r in runs.values()),
                    }
                    cells[name] = row
                    lines.append(
                        f"| {d} | {method} | {len(runs)} | {row['final']} | {row['auc']} | {_fmt(row['drift'])} | "
                        f"{_fmt(row['clipped'])} | {_fmt(row['capped'])} |"
                    )
            lines += ["", "| staleness | difference | final reward | reward AUC |", "|---:|---|---|---|"]
            for d in STALENESS:
                for a, b in PAIRS:
                    runs_a = by_config.get(f"{a}-s{d}-k{k}-lr{rate}", {})
                    runs_b = by_config.get(f"{b}-s{d}-k{k}-lr{rate}", {})
                    if len(runs_a.keys() & runs_b.keys()) < 2:
                        continue
                    final = paired_difference(
                        {s: r["final_reward"] for s, r in runs_a.items()},
                        {s: r["final_reward"] for s, r in runs_b.items()},
                    )
                    auc = paired_difference(
                        {s: r["reward_auc"] for s, r in runs_a.items()},
                        {s: r["reward_auc"] for s, r in runs_b.items()},
                    )
                    pairs[f"{a}-{b}-s{d}-k{k}-lr{rate}"] = {"final": final, "auc": auc}
                    lines.append(f"| {d} | {a} - {b} | {_marked(final)} | {_marked(auc)} |")
    lines += [
        "",
        "Differences in **bold** have a 95% interval that excludes 0, uncorrected for multiple comparisons; "
        "`families.md` corrects each family (one pair of methods on one outcome across the cells) with Holm and "
        f"tests equivalence within +-{EQUIVALENCE_MARGIN}.",
    ]
    if missing:
        lines += ["", f"Missing runs ({len(missing)}): " + ", ".join(missing)]
    table = "\n".join(lines)
    out = Path(options.out)
    summary = {
        "cells": {name: _as_json(row) for name, row in cells.items()},
        "differences": {name: _as_json(row) for name, row in pairs.items()},
        "missing": missing,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(table + "\n")
    write_families(summary, out, "from the runs' records")
    if cells:
        _plot(cells, out / "proximal_map.png")
    return table


def family_tests(differences: dict, margin: float = EQUIVALENCE_MARGIN) -> dict[str, list[dict]]:
    """Per family, one pair of methods on one outcome across the map's cells (``"loglinear - recompute, final"``):
    each cell's difference, its two-sided t-test p-value and the TOST p-value against ``margin``, each with Holm's
    adjustment within the family (``holm_p``, ``holm_equivalence_p``), and a verdict (``difference``: Holm p <= 0.05;
    ``equivalent``: Holm-adjusted TOST p <= 0.05; else ``not resolved``). A family makes 16 claims of "no difference"
    as much as 16 of a difference, so both get the correction. ``differences``: a summary's (name -> outcome -> mean,
    low, high, n); the standard error is read back from the 95% interval's half-width, so a committed summary is
    enough."""
    families: dict[str, list[dict]] = {}
    for a, b in PAIRS:
        for outcome in OUTCOMES:
            rows = []
            for rate in RATES:
                for k in STEPS_PER_BATCH:
                    for d in STALENESS:
                        interval = differences.get(f"{a}-{b}-s{d}-k{k}-lr{rate}", {}).get(outcome)
                        if interval is None or interval["n"] < 2:
                            continue
                        dof = interval["n"] - 1
                        se = (interval["high"] - interval["low"]) / 2 / t_quantile(0.975, dof)
                        rows.append(
                            {"steps_per_batch": k, "lr": rate, "staleness": d, **interval,
                             "p": t_test_p(interval["mean"], se, dof),
                             "equivalence_p": equivalence_from_summary(interval["mean"], se, dof, margin).p}
                        )  # fmt: skip
            adjusted = zip(holm([row["p"] for row in rows]), holm([row["equivalence_p"] for row in rows]))
            for row, (holm_p, holm_equivalence_p) in zip(rows, adjusted):
                row["holm_p"], row["holm_equivalence_p"] = holm_p, holm_equivalence_p
                verdict = "equivalent" if holm_equivalence_p <= 0.05 else "not resolved"
                row["verdict"] = "difference" if holm_p <= 0.05 else verdict
            families[f"{a} - {b}, {outcome}"] = rows
    return families


def family_lines(families: dict[str, list[dict]], margin: float, source: str) -> list[str]:
    """``families.md``: a count per family, then a table per pair of methods."""
    lines = [
        f"Proximal map, multiple comparisons and equivalence ({source}). A family is one pair of methods on one "
        "outcome across the map's cells; Holm p: the paired t test's p-value adjusted within its family; Holm TOST p: "
        f"the two one-sided tests' p-value against +-{margin}, adjusted within its family the same way. Verdict: a "
        f"difference where Holm p <= 0.05; equivalent where Holm TOST p <= 0.05; otherwise not resolved. The margin "
        "is the SmolLM2 confirmation's (its PREREGISTRATION.md), applied to the map after the map's first run: it "
        "was not registered for the map.",
        "",
        "| family | cells | uncorrected: interval excludes 0 | Holm: difference (ahead / behind) | equivalent | "
        "not resolved |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, rows in families.items():
        ahead = sum(r["verdict"] == "difference" and r["mean"] > 0 for r in rows)
        behind = sum(r["verdict"] == "difference" and r["mean"] < 0 for r in rows)
        lines.append(
            f"| {name} | {len(rows)} | {sum(r['p'] <= 0.05 for r in rows)} | {ahead + behind} ({ahead} / {behind}) | "
            f"{sum(r['verdict'] == 'equivalent' for r in rows)} | "
            f"{sum(r['verdict'] == 'not resolved' for r in rows)} |"
        )
    for a, b in PAIRS:
        final, auc = families.get(f"{a} - {b}, final", []), families.get(f"{a} - {b}, auc", [])
        lines += ["", f"### {a} - {b}", ""]
        lines += [
            "| steps/batch | lr | staleness | final reward | Holm p | Holm TOST p | verdict | reward AUC | Holm p | "
            "Holm TOST p | verdict |",
            "|---:|---|---:|---|---:|---:|---|---|---:|---:|---|",
        ]
        for f, r in zip(final, auc):
            lines.append(
                f"| {f['steps_per_batch']} | {f['lr']} | {f['staleness']} | {_row_interval(f)} | {f['holm_p']:.3f} | "
                f"{f['holm_equivalence_p']:.3f} | {f['verdict']} | {_row_interval(r)} | {r['holm_p']:.3f} | "
                f"{r['holm_equivalence_p']:.3f} | {r['verdict']} |"
            )
    return lines


def write_families(summary: dict, out: Path, source: str, margin: float = EQUIVALENCE_MARGIN) -> None:
    """Write ``families.md`` and ``families.json`` next to the summary, from its differences."""
    families = family_tests(summary["differences"], margin)
    (out / "families.json").write_text(json.dumps({"margin": margin, "families": families}, indent=1) + "\n")
    (out / "families.md").write_text("\n".join(family_lines(families, margin, source)) + "\n")


def _row_interval(row: dict) -> str:
    return f"{row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _marked(interval) -> str:
    return f"**{interval}**" if interval.excludes(0.0) else str(interval)


def _as_json(row: dict) -> dict:
    return {
        key: {"mean": v.mean, "low": v.low, "high": v.high, "n": v.n} if hasattr(v, "low") else v
        for key, v in row.items()
    }


def _plot(cells: dict, path: Path) -> None:
    """Final reward against staleness, a panel per (steps per batch, learning rate), a line per method with its
    95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(RATES), len(STEPS_PER_BATCH), figsize=(10, 7), sharey=True, squeeze=False)
    for row, rate in enumerate(RATES):
        for column, k in enumerate(STEPS_PER_BATCH):
            ax = axes[row][column]
            for offset, method in enumerate(METHODS):
                points = [(d, cells.get(f"{method}-s{d}-k{k}-lr{rate}")) for d in STALENESS]
                points = [(d + (offset - 1) * 0.12, c["final"]) for d, c in points if c is not None]
                if not points:
                    continue
                xs = [x for x, _ in points]
                means = [i.mean for _, i in points]
                errors = [[i.mean - i.low for _, i in points], [i.high - i.mean for _, i in points]]
                ax.errorbar(xs, means, yerr=errors, marker="o", capsize=3, label=method)
            ax.set_title(f"{k} step(s) per generation batch, lr {rate}")
            ax.set_xlabel("staleness of a batch's first step")
            ax.set_xticks(STALENESS)
            ax.grid(alpha=0.3)
            if column == 0:
                ax.set_ylabel("final reward (mean, 95% interval)")
    handles, labels = next(
        (ax.get_legend_handles_labels() for ax in axes.flat if ax.get_legend_handles_labels()[0]), ([], [])
    )
    figure.legend(handles, labels, loc="upper center", ncol=len(METHODS))
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_map_study(argv, options, *, module: str, summarize, quick_configs=None, default_configs=CONFIGS) -> None:
    """Run (or summarize) a study of the map's runs: ``options`` parsed from ``argv`` by :func:`_parser`, the study
    ``module`` run in the subprocesses, its ``summarize(store, options)``; ``--quick`` shrinks the runs (and replaces
    the default configurations with ``quick_configs``, where given)."""
    if options.quick:
        options.steps, options.eval_every, options.eval_samples, options.prompts_per_step = 6, 3, 8, 2
        if quick_configs and options.configs == list(default_configs):
            options.configs = list(quick_configs)
        if options.seeds == list(SEEDS):
            options.seeds = [0, 1]
    for name in options.configs:
        parse_config(name)
    if not options.run_one:
        RunStore(Path(options.out) / "runs").check_settings(
            {k: getattr(options, k) for k in ("steps", "prompts_per_step", "learning_rates", "temperature")}
            | {"eval_every": options.eval_every, "eval_samples": options.eval_samples}
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_study(
        argv,
        options,
        module=module,
        cells=plan(options.configs, options.seeds),
        run=lambda cell: _run_one(options, cell.config, cell.seed),
        summarize=lambda store: summarize(store, options),
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = _parser().parse_args(argv)
    quick = ("loglinear-s2-k4-lrhi", "recompute-s2-k4-lrhi")
    run_map_study(argv, options, module="benchmarks.proximal_map", summarize=summarize, quick_configs=quick)


if __name__ == "__main__":
    main()
