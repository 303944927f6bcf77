"""Where A-3PO's interpolated anchor holds: its error against the recomputed anchor, step by step within a batch.

With several optimizer steps per generation batch, decoupled PPO's proximal policy (``recompute``) is the policy as
it was when the batch was taken, while the trained weights move on within the batch; A-3PO's log-linear anchor is
interpolated between the behavior log-probs and the log-probs of the weights being trained. Each configuration
trains with ``prox_logp_method="metrics"`` (recompute's anchor, with A-3PO's computed beside it) and logs, at every
optimizer step, the per-token error of the log-linear anchor against the recomputed one
(``a3po/anchor_approx_logp_abs_error``, mean |difference| in nats; ``a3po/anchor_approx_rho_abs_error``, the same
on the behavior weight ``pi_prox / pi_behav``) and how many versions the trained weights are past the recomputed
anchor (``a3po/anchor_age``: 0 on a batch's first step). Configurations, on SmolLM2-135M-Instruct with LoRA r=16 and
the word-choice task (``benchmarks/staleness.py``'s settings otherwise):

- ``k4-lr<rate>``: 4 optimizer steps per generation batch (``steps_per_generation=4``, one micro-batch each);
- ``iter2-lr<rate>``: every batch trained twice (``num_iterations=2``);

each at the study's learning rate (``hi``: 1e-3) and the time-to-accuracy study's (``lo``: 2e-4), at the smallest
``max_staleness`` the schedule allows with ``reproducible_generation``. The summary gives the errors by the anchor's
age, per configuration (mean over the steps of that age, with its 95% t interval over those steps), and a plot::

    python -m benchmarks.approximation                      # 4 runs on SmolLM2, resumable
    python -m benchmarks.approximation --summary-only
    python -m benchmarks.approximation --quick --model <dir> --out /tmp/approximation   # a smoke run
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from benchmarks.common.intervals import mean_interval
from benchmarks.common.machine import kernel_info
from benchmarks.common.runner import RunStore, plan, run_study, study_parser

HERE = Path(__file__).resolve().parent
RATES = {"hi": 1e-3, "lo": 2e-4}
CONFIGS = tuple(f"{regime}-lr{rate}" for regime in ("k4", "iter2") for rate in RATES)
LOGGED = (
    "a3po/anchor_age",
    "a3po/anchor_approx_logp_abs_error",
    "a3po/anchor_approx_rho_abs_error",
    "a3po/behavior_drift_per_version_mean",
    "a3po/staleness_mean",
    "clip_ratio/region_mean",
    "reward",
)


def _parser():
    parser = study_parser(__doc__, configs=CONFIGS, seeds=(42,), out=HERE / "results" / "approximation")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the offline SmolLM2, or a model path")
    parser.add_argument("--quick", action="store_true", help="4 steps, tiny batches (a smoke run)")
    return parser


def parse_config(name: str) -> tuple[int, int, float]:
    """``"k4-lrhi"`` -> ``(4, 1, 1e-3)``: steps per generation batch, iterations over a batch, learning rate."""
    regime, _, rate = name.partition("-lr")
    if rate not in RATES or regime not in ("k4", "iter2"):
        raise SystemExit(f"configuration {name!r} is not one of {CONFIGS}")
    return (4, 1, RATES[rate]) if regime == "k4" else (1, 2, RATES[rate])


def _run_one(options, name: str, seed: int) -> dict:
    from peft import LoraConfig

    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
    from a3po_trl.tasks.offline_model import resolve_model_path
    from a3po_trl.tasks.word_choice import make_word_choice_splits, word_choice_reward

    steps_per_batch, iterations, learning_rate = parse_config(name)
    train, _ = make_word_choice_splits(num_train=1000, num_held_out=4, seed=0)
    prompts_per_step, generations, length = (1, 4, 8) if options.quick else (2, 8, 16)
    args = AsyncA3POConfig(
        output_dir=tempfile.mkdtemp(prefix="a3po-approximation-"),
        seed=seed,
        prox_logp_method="metrics",
        per_device_train_batch_size=prompts_per_step * generations,
        num_generations=generations,
        steps_per_generation=steps_per_batch,
        num_iterations=iterations,
        max_staleness=steps_per_batch * iterations - 1,
        reproducible_generation=True,
        max_completion_length=length,
        temperature=0.7,
        learning_rate=learning_rate,
        max_steps=options.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        disable_tqdm=True,
        timeline=False,
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = AsyncA3POTrainer(
        model=resolve_model_path(options.model),
        reward_funcs=[word_choice_reward],
        args=args,
        train_dataset=train,
        peft_config=lora,
    )
    trainer.train()
    steps = [
        {"step": h["step"], **{k: h[k] for k in LOGGED if k in h}}
        for h in trainer.state.log_history
        if "step" in h and "loss" in h
    ]
    return {
        "config": name,
        "seed": seed,
        "steps_per_batch": steps_per_batch,
        "num_iterations": iterations,
        "learning_rate": learning_rate,
        "steps": steps,
        "kernels": kernel_info(),
    }


def summarize(store: RunStore, options) -> str:
    records = store.records()
    lines = [
        "Error of A-3PO's log-linear anchor against the recomputed anchor, by the anchor's age (versions the trained "
        "weights are past it; 0 on a batch's first step), mean over the steps of that age with its 95% t interval "
        "over them; drift: the policy's movement per optimizer step on sampled tokens (nats).",
        "",
        "| configuration | steps/batch x iterations | lr | anchor age | steps | mean abs log-prob error (nats) | "
        "mean abs behavior-weight error | drift/step |",
        "|---|---|---:|---:|---:|---|---|---:|",
    ]
    table = {}
    for cell, record in sorted(records.items()):
        by_age = defaultdict(list)
        drifts = [
            s["a3po/behavior_drift_per_version_mean"]
            for s in record["steps"]
            if s.get("a3po/behavior_drift_per_version_mean") is not None
        ]
        for step in record["steps"]:
            if "a3po/anchor_age" in step:
                by_age[round(step["a3po/anchor_age"])].append(step)
        drift = sum(drifts) / len(drifts) if drifts else None
        for age, steps in sorted(by_age.items()):
            logp = mean_interval(s["a3po/anchor_approx_logp_abs_error"] for s in steps)
            rho = mean_interval(s["a3po/anchor_approx_rho_abs_error"] for s in steps)
            table[f"{cell}/age{age}"] = {"logp": logp.__dict__, "rho": rho.__dict__, "steps": len(steps)}
            shape = f"{record['steps_per_batch']} x {record['num_iterations']}"
            lines.append(
                f"| {cell.config} | {shape} | {record['learning_rate']:g} | {age} | {len(steps)} | {logp} | {rho} | "
                f"{'-' if drift is None else f'{drift:.3f}'} |"
            )
    missing = [f"{c}@{s}" for c in options.configs for s in options.seeds if f"{c}@{s}" not in map(str, records)]
    if missing:
        lines += ["", "Missing runs: " + ", ".join(missing)]
    out = Path(options.out)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"by_age": table, "missing": missing}, indent=1) + "\n")
    if table:
        _plot(records, out / "approximation.png")
    return "\n".join(lines)


def _plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6.5, 4))
    for cell, record in sorted(records.items()):
        by_age = defaultdict(list)
        for step in record["steps"]:
            if "a3po/anchor_age" in step:
                by_age[round(step["a3po/anchor_age"])].append(step["a3po/anchor_approx_logp_abs_error"])
        ages = sorted(by_age)
        intervals = [mean_interval(by_age[a]) for a in ages]
        errors = [[i.mean - i.low for i in intervals], [i.high - i.mean for i in intervals]]
        ax.errorbar(ages, [i.mean for i in intervals], yerr=errors, marker="o", capsize=3, label=cell.config)
    ax.set_xlabel("anchor age (optimizer steps since the batch was taken)")
    ax.set_ylabel("mean |log-linear - recomputed| (nats/token)")
    ax.set_xticks(range(4))
    ax.grid(alpha=0.3)
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = _parser().parse_args(argv)
    if options.quick:
        options.steps = 4
    for name in options.configs:
        parse_config(name)
    run_study(
        argv,
        options,
        module="benchmarks.approximation",
        cells=plan(options.configs, options.seeds),
        run=lambda cell: _run_one(options, cell.config, cell.seed),
        summarize=lambda store: summarize(store, options),
    )


if __name__ == "__main__":
    main()
