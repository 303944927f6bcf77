"""Two arms of one trainer compared paired by seed, as the arm studies report them (dynamic sampling, in-flight weight
updates): per outcome the difference ``on - off`` over the seeds both arms have, with its 95% t interval (scipy's
exact quantile), its t-test p-value, Holm's adjustment within its family, two one-sided tests (TOST) against a
margin, and a verdict: a *difference* where Holm's p <= 0.05, *equivalent* where TOST shows it, otherwise *not
resolved* (one seed: no test). Runs are the records :func:`benchmarks.time_to_accuracy._run_one` writes."""

from __future__ import annotations

import json
import statistics

from .intervals import holm_within, paired_test


def logged(run: dict, key: str) -> list[float]:
    """The values of the trainer's metric ``key`` over the run's logged steps."""
    return [h[key] for h in run["training_log"] if key in h]


def accuracy_within(run: dict, seconds: float) -> float:
    """Subset accuracy at the run's last snapshot taken within ``seconds`` of training (step 0 counts as 0 s)."""
    return [p for p in run["curve"] if p["seconds"] <= seconds + 1e-9][-1]["accuracy"]


def equal_wall_clock(on: dict[int, dict], off: dict[int, dict], seeds) -> tuple[dict, dict]:
    """Per seed, each arm's subset accuracy at the shorter of the seed's two training times."""
    limit = {seed: min(on[seed]["train_seconds"], off[seed]["train_seconds"]) for seed in seeds}
    return (
        {seed: accuracy_within(on[seed], limit[seed]) for seed in seeds},
        {seed: accuracy_within(off[seed], limit[seed]) for seed in seeds},
    )


def compare(outcome: str, on: dict[int, float], off: dict[int, float], margin: float, family: str) -> dict:
    """One outcome, ``on - off`` paired by seed (:func:`~.intervals.paired_test`) with each arm's mean over those
    seeds; its verdict is set by :func:`decide` once its family is complete."""
    row = {"outcome": outcome, "family": family, **paired_test(on, off, margin)}
    row["off_mean"] = statistics.fmean(off[s] for s in row["seeds"])
    row["on_mean"] = statistics.fmean(on[s] for s in row["seeds"])
    return row


def decide(rows: list[dict]) -> list[dict]:
    """Holm's adjustment within each family (the rows sharing ``family``), then each row's verdict."""
    holm_within(rows, "family")
    for row in rows:
        if row["p"] is None:
            row["verdict"] = "one seed"
        elif row["holm_p"] <= 0.05:
            row["verdict"] = "difference"
        else:
            row["verdict"] = "equivalent" if row["equivalent"] else "not resolved"
    return rows


def table(rows: list[dict], first_column: str = "outcome") -> list[str]:
    """The rows as a Markdown table (``first_column``: the key naming each row)."""
    lines = [
        f"| {first_column} | seeds | off | on | on - off [95% interval] | p | Holm p | margin | TOST p | verdict |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        p, holm_p, tost = ("-" if row[key] is None else f"{row[key]:.3f}" for key in ("p", "holm_p", "equivalence_p"))
        interval = f"[{row['low']:+.3f}, {row['high']:+.3f}]" if len(row["seeds"]) > 1 else "(one seed: no interval)"
        lines.append(
            f"| {row[first_column]} | {','.join(map(str, row['seeds']))} | {row['off_mean']:.3f} | "
            f"{row['on_mean']:.3f} | {row['mean']:+.3f} {interval} | {p} | {holm_p} | "
            f"{row['equivalence_margin']:.3f} | {tost} | {row['verdict']} |"
        )
    return lines


def runs_by_configuration(store) -> dict[str, dict[int, dict]]:
    """A :class:`~.runner.RunStore`'s records as ``{configuration: {seed: record}}``."""
    runs: dict[str, dict[int, dict]] = {}
    for cell, run in store.records().items():
        runs.setdefault(cell.config, {})[cell.seed] = run
    return runs


def write_summary(out, lines: list[str], runs: dict, outcomes, paired: list[dict], missing: list[str]) -> str:
    """Writes ``<out>/summary.md`` (``lines``, then the runs still missing) and ``<out>/summary.json`` (each run's
    ``outcomes(record)``, the paired comparisons, the missing runs); returns the Markdown."""
    from pathlib import Path

    text = "\n".join([*lines, "", f"Missing runs: {', '.join(missing) if missing else 'none'}."])
    report = {
        "runs": {name: {str(seed): outcomes(run) for seed, run in done.items()} for name, done in runs.items()},
        "paired": paired,
        "missing": missing,
    }
    out = Path(out)
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "summary.md").write_text(text + "\n")
    return text


def arms_parser(description: str, *, configs, seeds, out):
    """An arm study's command line: the runner's options and a time-to-accuracy run's, snapshots every 10 steps."""
    from .demo import add_run_arguments
    from .runner import study_parser

    parser = study_parser(description, configs=configs, seeds=seeds, out=out)
    add_run_arguments(parser)
    parser.set_defaults(eval_every=10)
    return parser


def shown(value, form: str) -> str:
    """``value`` in ``form``, or ``-`` where there is none."""
    return "-" if value is None else format(value, form)


def machine_cells(run: dict) -> str:
    """A per-run table's last two cells: the 1-minute load average when the run started, and the other processes'
    share of the CPU while it ran."""
    load = (run.get("load_average_start") or [None])[0]
    return f"{shown(load, '.1f')} | {shown(run.get('foreign_cpu_frac_run'), '.0%')}"


def run_arm_study(argv: list[str], options, *, module: str, run_one, summarize) -> None:
    """An arm study's ``main`` once its options are parsed and checked: ``--quick`` applied, then the runner over its
    configurations seed by seed (the arms of a seed next to each other), ``run_one(options, configuration, seed)``
    per run and ``summarize(store, options)``."""
    from .demo import apply_quick
    from .runner import plan, run_study

    apply_quick(options)
    run_study(
        argv,
        options,
        module=module,
        cells=plan(options.configs, options.seeds),
        run=lambda cell: run_one(options, cell.config, cell.seed),
        summarize=lambda store: summarize(store, options),
    )
