"""Dynamic sampling on the main job: the same trainer with and without DAPO's filter of the groups that carry no
signal, paired by seed (``results/dynamic-sampling/PREREGISTRATION.md`` fixes the outcomes and the margin).

The two arms train the demo's task and model (SmolLM2-135M-Instruct, LoRA r=16, the built-in one-step problems, the
demo's settings of ``examples/train_gsm8k.py``: ``loglinear`` at ``max_staleness=1``, ``reproducible_generation=True``)
for the same optimizer steps, each run by :func:`benchmarks.time_to_accuracy._run_one` (held-out greedy accuracy on 200
problems before and after, accuracy on a fixed 100-problem subset every ``--eval-every`` steps against the training
wall-clock, from adapter snapshots evaluated after training, and the trainer's logged metrics per step):

- ``off``: ``dynamic_sampling=False`` (every group trained, flat ones included);
- ``on``: ``dynamic_sampling=True`` (groups whose weighted rewards all agree dropped in the generation thread, which
  draws new prompts until the batch is full of groups with a signal, at most ``dynamic_sampling_max_gen_batches=10``
  generation batches per training batch).

The runs go seed by seed, ``off`` then ``on``: the two arms of a seed run next to each other, since wall-clock is an
outcome and the machine is shared (the runner records its load during each run). Paired by seed (``on - off``), each
outcome its own family (one comparison each), with its 95% t interval, its t-test p-value and two one-sided tests
(TOST) against the pre-registered margin:

- held-out accuracy at equal optimizer steps (the 200 held-out problems after the last step);
- subset accuracy at equal wall-clock: at the shorter of the seed's two training times, each arm's accuracy at its last
  snapshot taken within it;
- generation seconds per optimizer step (``async/generation_time``, every draw of a batch included, summed over the
  run, over the optimizer steps);
- seconds per optimizer step (the median of ``step_time``).

Described, not tested: the fraction of the groups drawn that the filter dropped over training, the extra generation
batches per training batch, how often the bound was reached, and ``frac_reward_zero_std`` of the batches trained.

    python -m benchmarks.dynamic_sampling --max-runs 2      # the next 2 missing runs, then the summary
    python -m benchmarks.dynamic_sampling --summary-only    # the summary of what is there
    python -m benchmarks.dynamic_sampling --quick           # tiny settings, a smoke run
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from benchmarks import time_to_accuracy
from benchmarks.common.paired_arms import (
    arms_parser,
    compare,
    decide,
    equal_wall_clock,
    logged,
    machine_cells,
    run_arm_study,
    runs_by_configuration,
    shown,
    table,
    write_summary,
)
from benchmarks.common.runner import RunStore, plan

HERE = Path(__file__).resolve().parent
#: The arms: their AsyncA3POConfig fields on top of the main job's ``loglinear-s1``.
ARMS = {"off": {"dynamic_sampling": False}, "on": {"dynamic_sampling": True}}
BASE_CONFIG = "loglinear-s1"
SEEDS = (42, 43, 44)
#: The equivalence margin on accuracy declared in results/dynamic-sampling/PREREGISTRATION.md.
ACCURACY_MARGIN = 0.05
#: The equivalence margin on seconds, as a fraction of the ``off`` arm's mean (PREREGISTRATION.md).
TIME_MARGIN_FRACTION = 0.10


def _parser():
    return arms_parser(__doc__, configs=ARMS, seeds=SEEDS, out=HERE / "results" / "dynamic-sampling")


def _run_one(options, arm: str, seed: int) -> dict:
    record = time_to_accuracy._run_one(options, BASE_CONFIG, seed, overrides=ARMS[arm], run_name=arm)
    return record | {"arm": arm, "base_config": BASE_CONFIG, "overrides": ARMS[arm]}


def run_outcomes(run: dict) -> dict:
    """Per run: the tested outcomes but the equal-wall-clock one (which needs its pair), and the described ones."""
    steps = run["steps"]
    filtered = sum(logged(run, "a3po/dynamic_sampling_filtered_groups"))
    drawn = sum(logged(run, "a3po/dynamic_sampling_prompts_per_step"))
    zero_std = logged(run, "frac_reward_zero_std")
    return {
        "held_out_after": run["after"],
        "generation_seconds_per_step": sum(logged(run, "async/generation_time")) / steps,
        "seconds_per_step": run["seconds_per_step"],
        "train_minutes": run["train_seconds"] / 60,
        "filtered_frac": filtered / drawn if drawn else 0.0,
        "extra_batches_mean": statistics.fmean(logged(run, "a3po/dynamic_sampling_extra_batches") or [0.0]),
        "bound_reached_steps": int(sum(logged(run, "a3po/dynamic_sampling_bound_reached"))),
        "frac_reward_zero_std_trained": statistics.fmean(zero_std) if zero_std else None,
    }


def paired_outcomes(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """``runs``: ``{arm: {seed: record}}``. Each tested outcome, ``on - off`` paired by seed (each its own family:
    :mod:`benchmarks.common.paired_arms`), against its pre-registered margin."""
    off, on = runs.get("off", {}), runs.get("on", {})
    seeds = sorted(off.keys() & on.keys())
    if not seeds:
        return []
    values = {arm: {seed: run_outcomes(runs[arm][seed]) for seed in seeds} for arm in ("off", "on")}

    def outcome(key):
        return ({s: values["on"][s][key] for s in seeds}, {s: values["off"][s][key] for s in seeds})

    compared = {
        "held-out accuracy, equal steps": outcome("held_out_after"),
        "subset accuracy, equal wall-clock": equal_wall_clock(on, off, seeds),
        "generation s per optimizer step": outcome("generation_seconds_per_step"),
        "s per optimizer step": outcome("seconds_per_step"),
    }
    rows = []
    for name, (on_values, off_values) in compared.items():
        off_mean = sum(off_values.values()) / len(off_values)
        margin = ACCURACY_MARGIN if "accuracy" in name else TIME_MARGIN_FRACTION * off_mean
        rows.append(compare(name, on_values, off_values, margin, family=name))
    return decide(rows)


def summarize(store: RunStore, options) -> str:
    runs = runs_by_configuration(store)
    missing = [str(cell) for cell in store.missing(plan(options.configs, options.seeds))]
    per_run = [
        "| run | started (UTC) | held-out before -> after | subset at steps "
        + " / ".join(str(p["step"]) for p in next(iter(next(iter(runs.values())).values()))["curve"])
        + " | groups filtered | extra batches / batch | bound reached | flat groups trained | generation s/step "
        "| s/step | training min | load at start | other processes' CPU |"
        if runs
        else "| run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" if runs else "|---|",
    ]
    for arm in options.configs:
        for seed, run in sorted(runs.get(arm, {}).items()):
            o = run_outcomes(run)
            curve = " / ".join(f"{p['accuracy']:.0%}" for p in run["curve"])
            per_run.append(
                f"| {arm}@{seed} | {run.get('started_at', '-')} | {run['before']:.1%} -> {run['after']:.1%} | {curve} "
                f"| {o['filtered_frac']:.1%} | {o['extra_batches_mean']:.2f} | {o['bound_reached_steps']} | "
                f"{shown(o['frac_reward_zero_std_trained'], '.1%')} | {o['generation_seconds_per_step']:.2f} | "
                f"{o['seconds_per_step']:.2f} | {o['train_minutes']:.1f} | {machine_cells(run)} |"
            )
    paired = paired_outcomes(runs)
    lines = [
        f"Dynamic sampling on the main job ({BASE_CONFIG} of the time-to-accuracy study, {options.steps} steps), arms "
        f"{', '.join(f'{arm}: {fields}' for arm, fields in ARMS.items())}, seeds {','.join(map(str, options.seeds))}.",
        "",
        "Per run (groups filtered: of the groups drawn over training; flat groups trained: mean over steps of "
        "frac_reward_zero_std of the batches trained; generation s/step: async/generation_time summed over the run, "
        "every draw included, over the optimizer steps; s/step: median):",
        "",
        *per_run,
    ]
    if paired:
        lines += [
            "",
            "Paired by seed, on - off: mean with its 95% t interval; each outcome its own family (Holm p = p); "
            f"verdict: a difference where p <= 0.05, equivalent where two one-sided tests show it within the margin "
            f"(accuracy: +-{ACCURACY_MARGIN}; seconds: +-{TIME_MARGIN_FRACTION:.0%} of the off arm's mean; "
            "PREREGISTRATION.md), otherwise not resolved. Equal wall-clock: at the shorter of the seed's two training "
            "times, each arm's subset accuracy at its last snapshot within it.",
            "",
            *table(paired),
        ]
    return write_summary(options.out, lines, runs, run_outcomes, paired, missing)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = _parser().parse_args(argv)
    unknown = [arm for arm in options.configs if arm not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}: use {', '.join(ARMS)}")
    run_arm_study(argv, options, module="benchmarks.dynamic_sampling", run_one=_run_one, summarize=summarize)


if __name__ == "__main__":
    main()
