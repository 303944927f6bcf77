"""The oracle study's summary (``benchmarks/oracle.py``): every estimator's error against the exact target, per
configuration, by anchor age, per batch, and the registered decision (``results/oracle/PREREGISTRATION.md``).

Errors are mean ``|estimate - exact|`` in nats per token over the scored tokens (staleness >= 2, where the estimators
differ, outside each run's first batch), pooled over a configuration's seeds; *relative* errors divide that by the
drift of one optimizer step on the same tokens, mean ``|current - exact|`` (the error of anchoring at the current
weights): one scale at every learning rate. The per-batch relative errors that set the guard's defaults are what the
guard's check measures, over the tokens it counts (staleness >= 1: :func:`batch_check_sums`). The fitted weight's
reduction is ``1 - error(fitted) / error(fixed)``; its 95% t interval is over seeds where a configuration has several,
else over its batches (each unit's paired difference over the pooled fixed error).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.common.anchor_estimators import (
    ESTIMATORS,
    absolute_errors,
    decode_tokens,
    estimates,
    scored_tokens,
)
from benchmarks.common.intervals import mean_interval

#: The registered threshold: a fitted weight is built if it cuts the error by at least this much ...
REDUCTION_THRESHOLD = 0.25
#: ... on at least this share of the configurations (strictly more than half).
MAJORITY = 0.5
ORDER = ("k4-lrhi", "k4-lrlo", "iter2-lrhi", "iter2-lrlo", "map-s4-k4-lrhi", "map-s8-k4-lrhi", "map-s4-k1-lrhi")
ORDER += ("map-s8-k1-lrhi",)


def scored_run(record: dict) -> dict[str, np.ndarray]:
    """One run's scored tokens: each estimator's absolute error, the drift, the age, staleness, batch and step;
    also ``numerics`` over its staleness-1 tokens (``|behavior - exact|``: the generator against the target
    version's own forward, the same weights)."""
    tokens = decode_tokens(record["tokens_npz"])
    errors = absolute_errors(tokens)
    scored = scored_tokens(tokens)
    exact = tokens["exact"].astype(np.float64)
    one = (tokens["staleness"] == 1) & (tokens["batch"] != tokens["batch"].min())
    run = {name: errors[name][scored] for name in ESTIMATORS}
    run["drift"] = np.abs(tokens["current"].astype(np.float64) - exact)[scored]
    run["numerics"] = np.abs(tokens["behavior"].astype(np.float64) - exact)[one]
    for field in ("age", "staleness", "batch", "step"):
        run[field] = tokens[field][scored]
    run["checks"] = batch_check_sums(tokens, estimates(tokens)["fixed"])
    return run


def batch_check_sums(tokens: dict[str, np.ndarray], fixed: np.ndarray) -> np.ndarray:
    """What the guard's check would sum over each batch but the run's first, in batch order: ``[error, drift, count]``
    per batch (shape ``(batches, 3)``), from the library's own :func:`~a3po_trl.functional.interpolation_check_sums`,
    so the study's per-batch relative errors count the tokens a check counts (staleness >= 1, finite)."""
    import torch

    from a3po_trl.functional import interpolation_check_sums

    batches = [batch for batch in np.unique(tokens["batch"]) if batch != tokens["batch"].min()]
    values = {
        name: torch.from_numpy(np.asarray(array, dtype=np.float64)).view(1, -1)
        for name, array in (("fixed", fixed), ("current", tokens["current"]), ("exact", tokens["exact"]))
    }
    staleness = torch.from_numpy(np.asarray(tokens["staleness"], dtype=np.int64)).view(1, -1)
    rows = [
        interpolation_check_sums(
            values["fixed"],
            values["current"],
            values["exact"],
            staleness,
            torch.from_numpy(tokens["batch"] == batch).view(1, -1),
        ).numpy()
        for batch in batches
    ]
    return np.stack(rows) if rows else np.zeros((0, 3))


def _units(runs: dict[int, dict]) -> list[dict[str, np.ndarray]]:
    """The units of a configuration's interval: its seeds, or with one seed its batches."""
    return list(runs.values()) if len(runs) > 1 else _batches(runs)


def configuration_summary(runs: dict[int, dict]) -> dict:
    """Pooled errors, relative errors, the fitted weights' reductions with intervals, by age, per batch."""
    pooled = {k: np.concatenate([run[k] for run in runs.values()]) for k in next(iter(runs.values()))}
    drift = float(pooled["drift"].mean()) if pooled["drift"].size else float("nan")
    summary = {
        "seeds": sorted(runs),
        "tokens": int(pooled["drift"].size),
        "drift": drift,
        "numerics": float(pooled["numerics"].mean()) if pooled["numerics"].size else None,
        "error": {name: float(pooled[name].mean()) for name in ESTIMATORS},
        "relative": {name: float(pooled[name].mean()) / drift for name in ESTIMATORS},
    }
    units = [unit for unit in _units(runs) if unit["drift"].size]
    fixed = summary["error"]["fixed"]
    summary["interval_over"] = "seeds" if len(runs) > 1 else "batches"
    summary["reduction"] = {}
    for name in ("fitted_d", "fitted_d_age", "probability", "in_sample_d"):
        differences = [(unit["fixed"].mean() - unit[name].mean()) / fixed for unit in units]
        interval = mean_interval(differences) if differences else None
        summary["reduction"][name] = {
            "pooled": float(1.0 - summary["error"][name] / fixed),
            "interval": None if interval is None else [float(interval.low), float(interval.high)],
            "units": len(differences),
            "units_better": int(sum(d > 0 for d in differences)),
        }
    summary["by_age"] = {}
    for age in np.unique(pooled["age"]):
        at = pooled["age"] == age
        age_drift = float(pooled["drift"][at].mean())
        summary["by_age"][str(int(age))] = {
            "tokens": int(at.sum()),
            "staleness": sorted(int(d) for d in np.unique(pooled["staleness"][at])),
            "drift": age_drift,
            **{name: float(pooled[name][at].mean()) / age_drift for name in ("fixed", "fitted_d", "fitted_d_age")},
        }
    series = batch_relative_errors(runs)
    summary["guard"] = {
        "exceed": {str(b): exceed_fraction(series, b) for b in BUDGETS},
        "agreement": {str(b): {str(lag): lag_agreement(series, b, lag) for lag in LAGS} for b in BUDGETS},
    }
    per_batch = [value for run in series for value in run]
    summary["fixed_relative_per_batch"] = {
        "batches": len(per_batch),
        "median": float(np.median(per_batch)) if per_batch else None,
        "p90": float(np.quantile(per_batch, 0.9)) if per_batch else None,
        "max": float(np.max(per_batch)) if per_batch else None,
    }
    return summary


def batch_relative_errors(runs: dict[int, dict]) -> list[list[float]]:
    """Per run (seed), the fixed weight's relative error of each batch as the guard's check measures it
    (:func:`~a3po_trl.functional.interpolation_check_verdict` of :func:`batch_check_sums`), in batch order: the
    batches where the check has a verdict (tokens checked, and a step that moved them)."""
    from a3po_trl.functional import interpolation_check_verdict

    series = []
    for run in runs.values():
        relatives = (interpolation_check_verdict(sums, budget=1.0)[1] for sums in run["checks"])
        series.append([relative for relative in relatives if relative is not None])
    return series


def exceed_fraction(series: list[list[float]], budget: float) -> float:
    values = [value for run in series for value in run]
    return sum(value > budget for value in values) / len(values) if values else float("nan")


def lag_agreement(series: list[list[float]], budget: float, lag: int) -> float | None:
    """How often a check of batch ``i - lag`` decides for batch ``i`` as batch ``i``'s own check does (exceeds the
    budget or not), over every run's batches that have one ``lag`` before them."""
    pairs = [(run[i - lag] > budget, run[i] > budget) for run in series for i in range(lag, len(run))]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


BUDGETS = (1.0, 1.5, 2.0)
LAGS = (1, 2, 4, 8)


def guard_defaults(summaries: dict[str, dict]) -> dict:
    """The guard's defaults by the addendum's rules: the budget (1.0 unless more than half of the configurations
    exceed it in more than half of their batches), and the interval (the largest lag whose pooled agreement is at most
    5 points below lag 1's)."""
    budget = BUDGETS[-1]
    for candidate in BUDGETS:
        mostly_over = [n for n, s in summaries.items() if s["guard"]["exceed"][str(candidate)] > 0.5]
        if len(mostly_over) <= len(summaries) / 2:
            budget = candidate
            break
    pooled = {}
    for lag in LAGS:
        values = [s["guard"]["agreement"][str(budget)][str(lag)] for s in summaries.values()]
        values = [v for v in values if v is not None]
        pooled[str(lag)] = float(np.mean(values)) if values else None
    interval = max(lag for lag in LAGS if pooled[str(lag)] is not None and pooled[str(lag)] >= pooled["1"] - 0.05)
    return {"budget": budget, "interval": interval, "pooled_agreement": pooled}


def _batches(runs: dict[int, dict]) -> list[dict[str, np.ndarray]]:
    """Every run's scored tokens, batch by batch (the per-run ``numerics`` and ``checks`` left out)."""
    return [
        {k: v[run["batch"] == batch] for k, v in run.items() if k not in ("numerics", "checks")}
        for run in runs.values()
        for batch in np.unique(run["batch"])
    ]


def decision(summaries: dict[str, dict]) -> dict:
    """The registered rule: build the fitted weight iff its pooled reduction is at least 25% on more than half of
    the configurations."""
    meeting = [name for name, s in summaries.items() if s["reduction"]["fitted_d"]["pooled"] >= REDUCTION_THRESHOLD]
    build = len(meeting) > MAJORITY * len(summaries)
    return {"configurations": len(summaries), "meeting": meeting, "build_fitted_weight": build}


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.{digits}f}"


def _reduction(entry: dict) -> str:
    low, high = entry["interval"] or (None, None)
    interval = "" if low is None or entry["units"] < 2 else f" [{low:+.0%}, {high:+.0%}]"
    return f"{entry['pooled']:+.0%}{interval} ({entry['units_better']}/{entry['units']})"


def summary_lines(summaries: dict[str, dict], verdict: dict, missing: list[str]) -> list[str]:
    lines = [
        "Error of each anchor estimator against the exact target (the log-probs of the version one before the trained "
        "weights), tokens of staleness >= 2 outside each run's first batch, pooled over seeds. Relative: over the "
        "drift of one optimizer step on the same tokens (mean |current - exact|).",
        "",
        "| configuration | seeds | tokens | drift/step (nats) | fixed 1/d (nats) | relative: fixed | fitted per d | "
        "fitted per d, age | probability space | behavior (w=1) | current (w=0) | in-sample best per d | "
        "generator numerics, d=1 (nats) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        r = s["relative"]
        lines.append(
            f"| {name} | {','.join(map(str, s['seeds']))} | {s['tokens']} | {_fmt(s['drift'], 4)} | "
            f"{_fmt(s['error']['fixed'], 4)} | {_fmt(r['fixed'], 2)} | {_fmt(r['fitted_d'], 2)} | "
            f"{_fmt(r['fitted_d_age'], 2)} | {_fmt(r['probability'], 2)} | {_fmt(r['behavior'], 2)} | "
            f"{_fmt(r['current'], 2)} | {_fmt(r['in_sample_d'], 2)} | {_fmt(s['numerics'], 5)} |"
        )
    lines += [
        "",
        "Reduction of the error against the fixed 1/d, pooled, with the 95% t interval of the per-unit paired "
        "difference over the pooled fixed error (units: seeds, or batches for a single seed) and how many units it "
        "improved:",
        "",
        "| configuration | interval over | fitted per d (registered) | fitted per d, age | probability space | "
        "in-sample best per d (bound) |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        red = s["reduction"]
        lines.append(
            f"| {name} | {s['interval_over']} | {_reduction(red['fitted_d'])} | {_reduction(red['fitted_d_age'])} | "
            f"{_reduction(red['probability'])} | {_reduction(red['in_sample_d'])} |"
        )
    lines += [
        "",
        "Relative error by anchor age (optimizer steps since the batch's first), fixed / fitted per d / fitted per d "
        "and age, with the staleness of the tokens at that age:",
        "",
        "| configuration | age | staleness | tokens | drift/step | fixed | fitted per d | fitted per d, age |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        for age, a in s["by_age"].items():
            staleness = ",".join(map(str, a["staleness"]))
            lines.append(
                f"| {name} | {age} | {staleness} | {a['tokens']} | {_fmt(a['drift'], 4)} | {_fmt(a['fixed'], 2)} | "
                f"{_fmt(a['fitted_d'], 2)} | {_fmt(a['fitted_d_age'], 2)} |"
            )
    lines += [
        "",
        "The fixed weight's relative error batch by batch, as the guard's check measures it (its tokens: staleness "
        ">= 1, so at staleness 1 the generator's numerics):",
        "",
        "| configuration | batches | median | 90th percentile | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        b = s["fixed_relative_per_batch"]
        lines.append(
            f"| {name} | {b['batches']} | {_fmt(b['median'], 2)} | {_fmt(b['p90'], 2)} | {_fmt(b['max'], 2)} |"
        )
    defaults = guard_defaults(summaries) if summaries else None
    if defaults is not None:
        budget = defaults["budget"]
        lines += [
            "",
            "For the guard's defaults (rules in the addendum of PREREGISTRATION.md): the share of batches whose fixed "
            "weight's relative error exceeds each budget, and how often a check of batch i - L decides for batch i as "
            f"batch i's own check does, at the budget {budget:g}:",
            "",
            "| configuration | "
            + " | ".join(f"over {b:g}" for b in BUDGETS)
            + " | "
            + " | ".join(f"agreement L={lag}" for lag in LAGS)
            + " |",
            "|---|" + "---:|" * (len(BUDGETS) + len(LAGS)),
        ]
        for name, s_ in summaries.items():
            over = " | ".join(f"{s_['guard']['exceed'][str(b)]:.0%}" for b in BUDGETS)
            agree = " | ".join(
                "-" if (v := s_["guard"]["agreement"][str(budget)][str(lag)]) is None else f"{v:.0%}" for lag in LAGS
            )
            lines.append(f"| {name} | {over} | {agree} |")
        pooled = " | ".join(
            "-" if (v := defaults["pooled_agreement"][str(lag)]) is None else f"{v:.0%}" for lag in LAGS
        )
        lines.append(f"| pooled (configurations weighted equally) | | | | {pooled} |")
        lines += [
            "",
            f"**Guard defaults by the registered rules: `prox_error_budget={budget:g}`, "
            f"`prox_check_interval={defaults['interval']}`.**",
        ]
    meeting = ", ".join(verdict["meeting"]) or "none"
    rule = "build" if verdict["build_fitted_weight"] else "do not build"
    lines += [
        "",
        f"**Decision (registered rule: build the fitted weight iff its pooled reduction is >= "
        f"{REDUCTION_THRESHOLD:.0%} on more than half of the configurations): {rule} it.** Configurations meeting "
        f"the threshold: {len(verdict['meeting'])} of {verdict['configurations']} ({meeting}).",
    ]
    if missing:
        lines += ["", "Missing runs: " + ", ".join(missing)]
    return lines


def write_summary(records: dict, out: Path, missing: list[str]) -> str:
    runs: dict[str, dict[int, dict]] = defaultdict(dict)
    for cell, record in records.items():
        runs[cell.config][cell.seed] = scored_run(record)
    names = [name for name in ORDER if name in runs] + sorted(set(runs) - set(ORDER))
    summaries = {name: configuration_summary(runs[name]) for name in names}
    verdict = decision(summaries) if summaries else {"configurations": 0, "meeting": [], "build_fitted_weight": False}
    lines = summary_lines(summaries, verdict, missing)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    defaults = guard_defaults(summaries) if summaries else None
    payload = {"configurations": summaries, "decision": verdict, "guard_defaults": defaults, "missing": missing}
    (out / "summary.json").write_text(json.dumps(payload, indent=1) + "\n")
    if summaries:
        _plot(summaries, out / "oracle.png")
    return "\n".join(lines)


def _plot(summaries: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(7.5, 4))
    names = list(summaries)
    shown = ("fixed", "fitted_d", "fitted_d_age", "probability", "in_sample_d")
    width = 0.8 / len(shown)
    for i, estimator in enumerate(shown):
        values = [summaries[name]["relative"][estimator] for name in names]
        ax.bar(np.arange(len(names)) + (i - len(shown) / 2 + 0.5) * width, values, width, label=estimator)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("error / drift per step")
    ax.set_title("anchor estimators against the exact target (1.0: as far off as the current weights)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
