"""The staleness study's plot (benchmarks/staleness.py): held-out and training reward per staleness bound."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path


def _values(run: dict, key: str) -> list[float]:
    return [h[key] for h in run["training_log"] if key in h]


def plot_study(runs: dict[str, list[dict]], names: list[str], path: Path, parse_config: Callable) -> None:
    """One column per staleness: held-out reward (top) and training reward (bottom, 5-step running mean) against the
    optimizer step, a line per method (mean over seeds) with a band from its lowest to its highest run
    (``parse_config``: the study's parser of its configuration names)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    staleness_values = sorted({parse_config(n)[1:] for n in names if runs.get(n)})
    if not staleness_values:
        return
    figure, axes = plt.subplots(
        2, len(staleness_values), figsize=(3.6 * len(staleness_values), 6.4), sharey="row", squeeze=False
    )
    colors = {"behavior": "tab:red", "recompute": "tab:blue", "loglinear": "tab:green", "guarded": "tab:purple"}
    for column, staleness in enumerate(staleness_values):
        for name in names:
            method, *value = parse_config(name)
            value = tuple(value)
            done = runs.get(name, [])
            if value != staleness or not done:
                continue
            label = f"{method} ({len(done)})"
            steps = [p["step"] for p in done[0]["curve"]]
            held_out = [[r["curve"][i]["reward"] for r in done] for i in range(len(steps))]
            _line_with_band(axes[0][column], steps, held_out, colors[method], label)
            per_run = [_running_mean(_values(r, "reward"), 5) for r in done]
            length = min(len(v) for v in per_run)
            training = [[v[i] for v in per_run] for i in range(length)]
            _line_with_band(axes[1][column], list(range(1, length + 1)), training, colors[method], label)
        bound, steps_per_batch = staleness
        title = f"max_staleness={bound}" + (f", {steps_per_batch} steps/batch" if steps_per_batch > 1 else "")
        axes[0][column].set_title(title)
        axes[1][column].set_xlabel("optimizer step")
        for axis in axes[:, column]:
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    axes[0][0].set_ylabel("held-out reward (greedy)")
    axes[1][0].set_ylabel("training reward (5-step mean)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _running_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def _line_with_band(axis, xs, per_x_values, color, label) -> None:
    axis.plot(xs, [statistics.fmean(v) for v in per_x_values], color=color, label=label, marker=".")
    axis.fill_between(xs, [min(v) for v in per_x_values], [max(v) for v in per_x_values], color=color, alpha=0.15)
