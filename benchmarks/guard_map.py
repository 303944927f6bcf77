"""``prox_logp_method="guarded"`` on the proximal map's cells, against ``loglinear`` and ``recompute`` (issue 54).

The runs are the proximal map's (``benchmarks/proximal_map.py``: a tiny random Llama on the token-preference task,
the trained policy's sampled reward; the same run function, settings and record), on the cells registered in
``results/guard/PREREGISTRATION.md``: the two where ``loglinear`` and ``recompute`` differed most in the committed map
(``s8-k1-lrhi``, ``s2-k1-lrhi``) and the largest at four optimizer steps per batch (``s2-k4-lrlo``), each with the
three methods, seeds 0-15 (each record names its commit). The guard runs with its defaults.

The summary: per cell and method the final reward and its area under the curve (mean over seeds, 95% t interval),
the guard's share of micro-steps trained with the recomputed anchor and its checks' mean relative error; then the
two registered families, ``guarded - loglinear`` and ``guarded - recompute`` in final reward across the cells: paired
by seed, Holm within the family for the differences and for the equivalence tests (TOST, +-0.05)::

    python -m benchmarks.guard_map --cells-per-launch 16        # 144 runs, resumable
    python -m benchmarks.guard_map --summary-only
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks.common.intervals import holm, mean_interval, paired_test
from benchmarks.common.runner import RunStore
from benchmarks.proximal_map import EQUIVALENCE_MARGIN, SEEDS, _parser, parse_config, run_map_study

HERE = Path(__file__).resolve().parent
CELLS = ("s8-k1-lrhi", "s2-k1-lrhi", "s2-k4-lrlo")
METHODS = ("guarded", "loglinear", "recompute")
CONFIGS = tuple(f"{method}-{cell}" for cell in CELLS for method in METHODS)
FAMILIES = (("guarded", "loglinear"), ("guarded", "recompute"))


def _values(runs: dict, key: str) -> list[float]:
    return [value for run in runs.values() for value in run["logged"].get(key, []) if value is not None]


def family(by_config: dict, a: str, b: str, margin: float = EQUIVALENCE_MARGIN) -> list[dict]:
    """``a - b`` in final reward in every cell, with Holm within the family for the t tests and for the TOSTs."""
    rows = []
    for cell in CELLS:
        runs_a, runs_b = by_config.get(f"{a}-{cell}", {}), by_config.get(f"{b}-{cell}", {})
        if len(runs_a.keys() & runs_b.keys()) < 2:
            continue
        finals = [{seed: run["final_reward"] for seed, run in runs.items()} for runs in (runs_a, runs_b)]
        test = paired_test(*finals, margin)
        row = {"cell": cell, **{k: test[k] for k in ("mean", "low", "high")}, "n": len(test["seeds"])}
        # the same reward at every logged step of every paired seed: the same runs (the guard that never switched)
        identical = all(runs_a[s]["logged"].get("reward") == runs_b[s]["logged"].get("reward") for s in test["seeds"])
        rows.append({**row, "p": test["p"], "equivalence_p": test["equivalence_p"], "identical": identical})
    for row, p, tost in zip(rows, holm([r["p"] for r in rows]), holm([r["equivalence_p"] for r in rows])):
        row["holm_p"], row["holm_equivalence_p"] = p, tost
        equivalent = "identical" if row["identical"] else "equivalent"
        row["verdict"] = "difference" if p <= 0.05 else (equivalent if tost <= 0.05 else "not resolved")
    return rows


def summarize(store: RunStore, options) -> str:
    records = store.records()
    by_config: dict[str, dict[int, dict]] = {}
    for cell, record in records.items():
        by_config.setdefault(cell.config, {})[cell.seed] = record
    missing = [f"{c}@{s}" for c in options.configs for s in options.seeds if s not in by_config.get(c, {})]
    lines = [
        f"The guard on the proximal map: {len(records)} runs of {len(options.configs) * len(options.seeds)}. Means "
        "over seeds with 95% t intervals; recomputed: the guard's share of micro-steps trained with the recomputed "
        "anchor; check error: its checks' mean error over one optimizer step's drift.",
        "",
        "| cell | method | runs | final reward | reward AUC | recomputed | check error | s/step |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    cells = {}
    for config in options.configs:
        runs = by_config.get(config, {})
        if not runs:
            continue
        method, d, k, rate = parse_config(config)
        recomputed, errors = (
            _values(runs, "a3po/prox_recompute_fraction"),
            _values(runs, "a3po/prox_check_error_relative"),
        )
        row = {
            "final": mean_interval(r["final_reward"] for r in runs.values()).__dict__,
            "auc": mean_interval(r["reward_auc"] for r in runs.values()).__dict__,
            "recomputed": statistics.fmean(recomputed) if recomputed else None,
            "check_error": statistics.fmean(e for e in errors if e != float("inf")) if errors else None,
            "seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs.values()),
        }
        cells[config] = row
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        interval = lambda i: f"{i['mean']:.3f} [{i['low']:.3f}, {i['high']:.3f}]"  # noqa: E731
        lines.append(
            f"| s{d}-k{k}-lr{rate} | {method} | {len(runs)} | {interval(row['final'])} | {interval(row['auc'])} | "
            f"{fmt(row['recomputed'])} | {fmt(row['check_error'])} | {row['seconds_per_step']:.3f} |"
        )
    families = {f"{a} - {b}": family(by_config, a, b) for a, b in FAMILIES}
    for name, rows in families.items():
        lines += [
            "",
            f"**{name}**, final reward, paired by seed (Holm within the family of {len(rows)} cells, for the "
            f"differences and for the equivalence tests within +-{EQUIVALENCE_MARGIN}):",
            "",
            "| cell | difference [95% interval] | Holm p | Holm TOST p | verdict |",
            "|---|---|---:|---:|---|",
        ]
        for row in rows:
            lines.append(
                f"| {row['cell']} | {row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}] | "
                f"{row['holm_p']:.3f} | {row['holm_equivalence_p']:.3f} | {row['verdict']} |"
            )
    if missing:
        lines += ["", f"Missing runs ({len(missing)}): " + ", ".join(missing)]
    out = Path(options.out)
    payload = {"cells": cells, "families": families, "missing": missing}
    (out / "summary.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    parser.set_defaults(configs=list(CONFIGS), seeds=list(SEEDS), out=str(HERE / "results" / "guard" / "map"))
    run_map_study(argv, parser.parse_args(argv), module="benchmarks.guard_map", summarize=summarize)


if __name__ == "__main__":
    main()
