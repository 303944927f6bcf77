"""In-flight weight updates on vs off, paired by seed, in two settings (``results/in-flight/PREREGISTRATION.md`` fixes
the outcomes and the margins before any run).

Each configuration ``<setting>-<arm>`` trains the demo's task and model (SmolLM2-135M-Instruct, LoRA r=16, the
built-in one-step problems, ``loglinear`` at ``max_staleness=1``), each run
:func:`benchmarks.time_to_accuracy._run_one`'s (held-out greedy accuracy before and after, a fixed 100-problem subset
every ``--eval-every`` steps against the training wall-clock from adapter snapshots evaluated after training, the
trainer's metrics per step). Both arms generate with
``reproducible_generation=False``: in-flight updates refuse it (where a completion switches versions depends on
timing), and the ``off`` arm must differ from ``on`` in the setting under test only.

- settings: ``main``, the main job (``examples/train_gsm8k.py``'s defaults: 60 steps, completions of up to 64
  tokens); ``long``, where completion lengths vary most and a batch's longest completion decides when it ends
  (``max_completion_length=256``, 40 steps);
- arms: ``off`` (``in_flight_weight_updates=False``: a version published mid-batch waits for the batch's end) and
  ``on`` (``True``: the generator loads it at its next decode step).

The runs go seed by seed, the four configurations of a seed next to each other (wall-clock is an outcome and the
machine may be shared; the runner records its load). Paired by seed, ``on - off``, per setting; each outcome over
the two settings is one family (Holm within it): seconds per optimizer step (median ``step_time``), the generator's
idle seconds per batch (``async/generator_wait_time``: waiting for the staleness bound), mean token staleness
(``a3po/staleness_mean``, per token), and subset accuracy at equal wall-clock (at the shorter of the seed's two
training times, each arm's accuracy at its last snapshot within it). Described, not tested: held-out accuracy after
the last step, in-flight loads per batch and their seconds, the fraction of completions spanning two versions, and
versions per completion.

    python -m benchmarks.in_flight --max-runs 4      # the next 4 missing runs (one seed), then the summary
    python -m benchmarks.in_flight --summary-only    # the summary of what is there
    python -m benchmarks.in_flight --quick           # tiny settings, a smoke run (4 steps; completions of 16 tokens,
                                                     # 64 in the long setting)
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
BASE_CONFIG = "loglinear-s1"
#: Per setting, the training fields set over the main job's.
SETTINGS = {"main": {}, "long": {"max_completion_length": 256, "max_steps": 40}}
#: ``--quick``: the long setting's completions, 4 times the smoke run's main ones (16 tokens) as 256 is the main job's
#: 64. On a tiny model, generating them takes longer than a training step, so versions are published mid-batch.
QUICK_LONG_COMPLETION_LENGTH = 64
ARMS = {"off": {"in_flight_weight_updates": False}, "on": {"in_flight_weight_updates": True}}
CONFIGS = tuple(f"{setting}-{arm}" for setting in SETTINGS for arm in ARMS)
SEEDS = (42, 43, 44)
#: Margins declared in results/in-flight/PREREGISTRATION.md.
ACCURACY_MARGIN = 0.05
TIME_MARGIN_FRACTION = 0.10  # of the off arm's median seconds per optimizer step, for every outcome in seconds
STALENESS_MARGIN = 0.1  # versions per token
MAIN_JOB = "the main job"
#: The tested outcomes: record statistic, margin kind.
OUTCOMES = {
    "s per optimizer step": ("seconds_per_step", "seconds"),
    "generator idle s per batch": ("generator_idle_seconds", "seconds"),
    "mean token staleness": ("token_staleness_mean", "staleness"),
}


def _parser():
    return arms_parser(__doc__, configs=CONFIGS, seeds=SEEDS, out=HERE / "results" / "in-flight")


def _parse(name: str) -> tuple[str, str]:
    setting, _, arm = name.partition("-")
    if setting not in SETTINGS or arm not in ARMS:
        raise SystemExit(f"unknown configuration {name!r}: use one of {', '.join(CONFIGS)}")
    return setting, arm


def _run_one(options, name: str, seed: int) -> dict:
    setting, arm = _parse(name)
    overrides = {**SETTINGS[setting], **ARMS[arm], "reproducible_generation": False}
    if options.quick:  # the smoke run's steps for every setting, and its lengths
        overrides.pop("max_steps", None)
        overrides.pop("max_completion_length", None)
        if setting == "long":
            overrides["max_completion_length"] = QUICK_LONG_COMPLETION_LENGTH
    record = time_to_accuracy._run_one(options, BASE_CONFIG, seed, overrides=overrides, run_name=name)
    return record | {"setting": setting, "arm": arm, "base_config": BASE_CONFIG, "overrides": overrides}


def run_outcomes(run: dict) -> dict:
    """Per run: the tested outcomes but the equal-wall-clock one (which needs its pair), and the described ones."""
    steps = run["steps"]
    multi = logged(run, "a3po/multi_version_trajectories_frac")
    versions = logged(run, "a3po/completion_versions_mean")
    return {
        "seconds_per_step": run["seconds_per_step"],
        "generator_idle_seconds": statistics.fmean(logged(run, "async/generator_wait_time") or [0.0]),
        "token_staleness_mean": statistics.fmean(logged(run, "a3po/staleness_mean") or [0.0]),
        "held_out_after": run["after"],
        "train_minutes": run["train_seconds"] / 60,
        "in_flight_loads_per_step": sum(logged(run, "async/in_flight_weight_loads")) / steps,
        "in_flight_load_seconds_per_step": sum(logged(run, "async/in_flight_weight_load_time")) / steps,
        "multi_version_frac": statistics.fmean(multi) if multi else None,
        "completion_versions_mean": statistics.fmean(versions) if versions else None,
        "completion_mean_length": run.get("completion_mean_length"),
    }


def paired_outcomes(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """``runs``: ``{configuration: {seed: record}}``. Per setting, each tested outcome ``on - off`` paired by seed;
    an outcome over the settings is one family."""
    rows = []
    for setting in SETTINGS:
        on, off = runs.get(f"{setting}-on", {}), runs.get(f"{setting}-off", {})
        seeds = sorted(on.keys() & off.keys())
        if not seeds:
            continue
        values = {arm: {s: run_outcomes(done[s]) for s in seeds} for arm, done in (("on", on), ("off", off))}
        step = statistics.fmean(values["off"][s]["seconds_per_step"] for s in seeds)
        margins = {"seconds": TIME_MARGIN_FRACTION * step, "staleness": STALENESS_MARGIN}
        for outcome, (key, kind) in OUTCOMES.items():
            on_values = {s: values["on"][s][key] for s in seeds}
            off_values = {s: values["off"][s][key] for s in seeds}
            rows.append(compare(outcome, on_values, off_values, margins[kind], family=outcome) | {"setting": setting})
        on_accuracy, off_accuracy = equal_wall_clock(on, off, seeds)
        outcome = "subset accuracy, equal wall-clock"
        rows.append(
            compare(outcome, on_accuracy, off_accuracy, ACCURACY_MARGIN, family=outcome) | {"setting": setting}
        )
    rows = decide(rows)
    for row in rows:
        row["setting, outcome"] = f"{row['setting']}: {row['outcome']}"
    return rows


def summarize(store: RunStore, options) -> str:
    runs = runs_by_configuration(store)
    missing = [str(cell) for cell in store.missing(plan(options.configs, options.seeds))]
    per_run = [
        "| run | started (UTC) | held-out before -> after | tokens per completion | s/step | generator idle s/batch "
        "| token staleness | in-flight loads / step | load s / step | multi-version completions | versions / "
        "completion | training min | load at start | other processes' CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    for name in options.configs:
        for seed, run in sorted(runs.get(name, {}).items()):
            o = run_outcomes(run)
            per_run.append(
                f"| {name}@{seed} | {run.get('started_at', '-')} | {run['before']:.1%} -> {run['after']:.1%} | "
                f"{shown(o['completion_mean_length'], '.1f')} | {o['seconds_per_step']:.2f} | "
                f"{o['generator_idle_seconds']:.2f} | {o['token_staleness_mean']:.3f} | "
                f"{o['in_flight_loads_per_step']:.2f} | {o['in_flight_load_seconds_per_step']:.3f} | "
                f"{shown(o['multi_version_frac'], '.1%')} | {shown(o['completion_versions_mean'], '.2f')} | "
                f"{o['train_minutes']:.1f} | {machine_cells(run)} |"
            )
    paired = paired_outcomes(runs)
    lines = [
        f"In-flight weight updates on vs off ({BASE_CONFIG} of the time-to-accuracy study, reproducible_generation="
        f"False), settings {', '.join(f'{k}: {v or MAIN_JOB}' for k, v in SETTINGS.items())}, seeds "
        f"{','.join(map(str, options.seeds))}.",
        "",
        "Per run (s/step: median; generator idle: mean seconds per batch waiting for the staleness bound; token "
        "staleness: mean over steps of a3po/staleness_mean; multi-version completions: mean over steps of "
        "a3po/multi_version_trajectories_frac):",
        "",
        *per_run,
    ]
    if paired:
        lines += [
            "",
            "Paired by seed, on - off, per setting: mean with its 95% t interval; family: one outcome over the two "
            "settings (Holm within it); verdict: a difference where Holm p <= 0.05, equivalent where two one-sided "
            f"tests show it within the margin (seconds: +-{TIME_MARGIN_FRACTION:.0%} of the off arm's s/step; "
            f"staleness: +-{STALENESS_MARGIN}; accuracy: +-{ACCURACY_MARGIN}; PREREGISTRATION.md), otherwise not "
            "resolved.",
            "",
            *table(paired, first_column="setting, outcome"),
        ]
    return write_summary(options.out, lines, runs, run_outcomes, paired, missing)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = _parser().parse_args(argv)
    for name in options.configs:
        _parse(name)
    run_arm_study(argv, options, module="benchmarks.in_flight", run_one=_run_one, summarize=summarize)


if __name__ == "__main__":
    main()
