"""``prox_logp_method="guarded"`` in the SmolLM2 confirmation's setting against ``loglinear`` and ``recompute`` (#54).

The runs are the staleness study's (``benchmarks/staleness.py``: SmolLM2-135M-Instruct with LoRA on the word-choice
task, 40 steps, held-out greedy reward every 10 steps), in the confirmation's setting: four optimizer steps per
generation batch, ``max_staleness=4``, seeds 42-46, for ``guarded`` (its defaults), ``loglinear`` and ``recompute``,
registered in ``results/guard/PREREGISTRATION.md`` with its addendum: seed by seed, each seed's three runs one after
another on one host, a seed whose three runs did not finish on one host rerun whole.

The summary: per method the held-out reward at step 40 (mean over seeds, 95% t interval), seconds per step (each run's
training seconds over its steps, the registered figure; the median step beside it), the guard's share of micro-steps
trained with the recomputed anchor and its checks' mean relative error; per seed the three runs and their host; the
two registered differences, ``guarded - loglinear`` and ``guarded - recompute``, paired by seed over the seeds whose
three runs share a host, each a family of one (95% t interval, t test, TOST against +-0.05); and, once all five seeds
are in, the registered rule for the default, over these cells and the map's (``results/guard/map/summary.json``)::

    python -m benchmarks.guard_smollm2               # the 15 runs (about 3.5 hours alone), resumable, then the summary
    python -m benchmarks.guard_smollm2 --summary-only
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks.common.intervals import mean_interval, paired_test
from benchmarks.common.runner import RunStore, plan, run_study
from benchmarks.common.study_plot import plot_study

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "guard" / "smollm2"
METHODS = ("guarded", "loglinear", "recompute")
CONFIGS = tuple(f"{method}-s4-k4" for method in METHODS)
SEEDS = (42, 43, 44, 45, 46)
FAMILIES = (("guarded", "loglinear"), ("guarded", "recompute"))
#: The registered equivalence margin on held-out reward (the staleness study's) and the speed bound of the default.
EQUIVALENCE_MARGIN = 0.05
SPEED_BOUND = 1.10
MAP_SUMMARY = HERE / "results" / "guard" / "map" / "summary.json"


def host(run: dict) -> str:
    """The machine a run ran on, in words (CPU model and kernel)."""
    machine = run.get("machine", {})
    return f"{machine.get('cpu_model', '?')} / {machine.get('platform', '?')}"


def seconds_per_step(run: dict) -> float:
    """The registered figure: training seconds over steps (checks included)."""
    return run["train_seconds"] / run["steps"]


def _logged(run: dict, key: str) -> list[float]:
    return [h[key] for h in run["training_log"] if key in h and h[key] is not None]


def paired_seeds(by_method: dict[str, dict[int, dict]]) -> list[int]:
    """The seeds whose three runs are all there and ran on one host."""
    seeds = set.intersection(*(set(by_method.get(m, {})) for m in METHODS))
    return sorted(s for s in seeds if len({host(by_method[m][s]) for m in METHODS}) == 1)


def families(by_method: dict[str, dict[int, dict]], seeds: list[int]) -> dict[str, dict]:
    """``a - b`` in held-out reward at the last step over ``seeds``, each a family of one (no adjustment)."""
    rows = {}
    for a, b in FAMILIES:
        finals = [{s: by_method[m][s]["curve"][-1]["reward"] for s in seeds} for m in (a, b)]
        if len(seeds) < 2:
            continue
        test = paired_test(*finals, EQUIVALENCE_MARGIN)
        # the same held-out reward at every evaluation of every seed: the same runs (the guard that never switched)
        curves = [[[point["reward"] for point in by_method[m][s]["curve"]] for s in seeds] for m in (a, b)]
        equivalent = "identical" if curves[0] == curves[1] else "equivalent"
        verdict = "difference" if test["p"] <= 0.05 else (equivalent if test["equivalent"] else "not resolved")
        rows[f"{a} - {b}"] = {**test, "verdict": verdict}
    return rows


def speed_ratios(by_method: dict[str, dict[int, dict]], seeds: list[int]) -> dict[int, float]:
    """Per seed, ``guarded``'s seconds per step over ``loglinear``'s (same host, one after the other)."""
    return {s: seconds_per_step(by_method["guarded"][s]) / seconds_per_step(by_method["loglinear"][s]) for s in seeds}


def default_decision(smollm2: dict[str, dict], ratios: dict[int, float], map_families: dict | None) -> dict:
    """The registered rule: ``guarded`` becomes the default iff, over the map's cells and SmolLM2's, it is behind
    ``loglinear`` in none (no difference against it), ahead in at least one, and its seconds per step on SmolLM2 are
    within 10% of ``loglinear``'s (the mean of the per-seed ratios at most 1.10)."""
    cells = [("SmolLM2 s4-k4", smollm2["guarded - loglinear"])]
    cells += [(f"map {row['cell']}", row) for row in (map_families or {}).get("guarded - loglinear", [])]
    behind = [name for name, row in cells if row["verdict"] == "difference" and row["mean"] < 0]
    ahead = [name for name, row in cells if row["verdict"] == "difference" and row["mean"] > 0]
    ratio = statistics.fmean(ratios.values())
    becomes = not behind and bool(ahead) and ratio <= SPEED_BOUND
    return {
        "cells": [name for name, _ in cells],
        "behind": behind,
        "ahead": ahead,
        "speed_ratio": ratio,
        "guarded_becomes_default": becomes,
    }


def summarize(store: RunStore, options) -> str:
    by_method: dict[str, dict[int, dict]] = {}
    for cell, run in store.records().items():
        by_method.setdefault(run["method"], {})[cell.seed] = run
    seeds = paired_seeds(by_method)
    missing = [
        f"{c}@{s}" for s in options.seeds for c in options.configs if s not in by_method.get(c.split("-")[0], {})
    ]
    lines = [
        '`prox_logp_method="guarded"` in the SmolLM2 confirmation\'s setting (four optimizer steps per generation '
        "batch, max_staleness=4, 40 steps): held-out reward at step 40, mean over seeds with its 95% t interval; "
        "s/step: training seconds over steps (checks included; median step in brackets); recomputed: the guard's "
        "share of micro-steps trained with the recomputed anchor; check error: its checks' mean error over one "
        "optimizer step's drift; other CPU: other processes' share of the machine while the runs trained.",
        "",
        "| method | runs | held-out reward, step 40 | s/step (median) | recomputed | check error | other CPU |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    methods = {}
    for method in METHODS:
        runs = by_method.get(method, {})
        if not runs:
            continue
        final = mean_interval(r["curve"][-1]["reward"] for r in runs.values())
        recomputed = [v for r in runs.values() for v in _logged(r, "a3po/prox_recompute_fraction")]
        errors = [v for r in runs.values() for v in _logged(r, "a3po/prox_check_error_relative")]
        row = {
            "runs": len(runs),
            "final": final.__dict__,
            "seconds_per_step": statistics.fmean(seconds_per_step(r) for r in runs.values()),
            "median_step": statistics.fmean(r["seconds_per_step"] for r in runs.values()),
            "recomputed": statistics.fmean(recomputed) if recomputed else None,
            "check_error": statistics.fmean(errors) if errors else None,
            "foreign_cpu_frac": statistics.fmean(r.get("foreign_cpu_frac") or 0.0 for r in runs.values()),
        }
        methods[method] = row
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(
            f"| {method} | {len(runs)} | {final.mean:.3f} [{final.low:.3f}, {final.high:.3f}] | "
            f"{row['seconds_per_step']:.2f} ({row['median_step']:.2f}) | {fmt(row['recomputed'])} | "
            f"{fmt(row['check_error'])} | {row['foreign_cpu_frac']:.0%} |"
        )
    lines += [
        "",
        "Per seed (held-out reward at steps 0 / 10 / 20 / 30 / 40; s/step):",
        "",
        "| seed | host | started (UTC) | " + " | ".join(METHODS) + " |",
        "|---:|---|---|" + "---|" * len(METHODS),
    ]
    for seed in sorted({s for runs in by_method.values() for s in runs}):
        runs = [by_method.get(m, {}).get(seed) for m in METHODS]
        present = [r for r in runs if r is not None]
        hosts = {host(r) for r in present}
        cells = [
            "-"
            if r is None
            else " / ".join(f"{p['reward']:.3f}" for p in r["curve"]) + f"; {seconds_per_step(r):.2f} s"
            for r in runs
        ]
        where = hosts.pop() if len(hosts) == 1 else "several hosts: not paired"
        lines.append(f"| {seed} | {where} | {present[0].get('started_at', '-')} | " + " | ".join(cells) + " |")
    paired = families(by_method, seeds)
    ratios = speed_ratios(by_method, seeds) if seeds else {}
    if paired:
        lines += [
            "",
            f"Paired by seed over the seeds whose three runs share a host ({', '.join(map(str, seeds))}); each "
            f"difference a family of one: a difference where p <= 0.05, equivalent where TOST within "
            f"+-{EQUIVALENCE_MARGIN} has p <= 0.05, otherwise not resolved.",
            "",
            "| difference | seeds | mean [95% interval] | p | TOST p | verdict |",
            "|---|---:|---|---:|---:|---|",
        ]
        for name, row in paired.items():
            lines.append(
                f"| {name} | {len(row['seeds'])} | {row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}] | "
                f"{row['p']:.3f} | {row['equivalence_p']:.3f} | {row['verdict']} |"
            )
        per_seed = ", ".join(f"{s}: {r:.3f}" for s, r in ratios.items())
        lines += ["", f"Seconds per step, guarded over loglinear, per seed: {per_seed}."]
    decision = None
    if len(seeds) == len(SEEDS) and paired:
        map_families = json.loads(MAP_SUMMARY.read_text())["families"] if MAP_SUMMARY.exists() else None
        decision = default_decision(paired, ratios, map_families)
        outcome = "`guarded` becomes the default" if decision["guarded_becomes_default"] else "`loglinear` stays"
        lines += [
            "",
            f"**The default, by the registered rule**: {outcome}. Over {len(decision['cells'])} cells "
            f"({', '.join(decision['cells'])}): behind `loglinear` in {', '.join(decision['behind']) or 'none'}, "
            f"ahead in {', '.join(decision['ahead']) or 'none'}; seconds per step {decision['speed_ratio']:.3f}x "
            f"`loglinear`'s (bound {SPEED_BOUND:.2f}x).",
        ]
    else:
        lines += ["", f"The default is not decided until all {len(SEEDS)} seeds are paired ({len(seeds)} so far)."]
    if missing:
        lines += ["", f"Missing runs ({len(missing)}): {', '.join(missing)}."]
    out = Path(options.out)
    payload = {
        "methods": methods,
        "paired_seeds": seeds,
        "families": paired,
        "speed_ratios": ratios,
        "decision": decision,
        "missing": missing,
    }
    (out / "summary.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    runs = {c: list(by_method.get(c.split("-")[0], {}).values()) for c in options.configs}
    plot_study(runs, list(options.configs), out / "guard.png", _parse_config)
    return "\n".join(lines)


def _parse_config(name: str):
    from benchmarks.staleness import _parse_config as parse

    return parse(name)


def main(argv: list[str] | None = None) -> None:
    from benchmarks import staleness

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = staleness._parser()
    parser.set_defaults(configs=list(CONFIGS), seeds=list(SEEDS), out=str(OUT))
    options = parser.parse_args(argv)
    run_study(
        argv,
        options,
        module="benchmarks.guard_smollm2",
        cells=plan(options.configs, options.seeds),  # seed by seed: each seed's three runs one after another
        run=lambda cell: staleness._run_one(options, cell.config, cell.seed),
        summarize=lambda store: summarize(store, options),
    )


if __name__ == "__main__":
    main()
