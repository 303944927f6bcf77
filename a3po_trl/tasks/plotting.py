"""Training curves of an A-3PO run: reward, held-out accuracy (when the run was evaluated), staleness and step time,
as one PNG.

matplotlib is imported only when a plot is drawn, and the figure is rendered by the Agg canvas directly (pyplot's
global backend is left alone, so this also works inside notebooks); the package does not need matplotlib to import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_metrics", "plot_training"]

#: Log keys read for each panel (the first that is present wins for reward).
REWARD_KEYS = ("reward", "rewards/correctness_reward/mean")
STALENESS_KEYS = ("a3po/staleness_mean", "a3po/staleness_max")
STEP_TIME_KEY = "step_time"
#: Keys of periodic evaluations that count as held-out accuracy when present in the log history.
EVAL_ACCURACY_KEYS = ("eval_accuracy", "eval_rewards/correctness_reward/mean")


def load_metrics(source: str | os.PathLike[str] | Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Log records from a JSONL file (one JSON object per line) or from an iterable of dicts (a log history)."""
    if isinstance(source, (str, os.PathLike)):
        records = []
        with open(source, encoding="utf-8") as handle:
            for line in handle:
                line = line.strip()
                if line:
                    records.append(json.loads(line))
        return records
    return [dict(record) for record in source]


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the training records that log ``key`` (records with an ``accuracy`` are evaluations)."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "step" in record:
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _eval_points(records: Sequence[Mapping[str, Any]], eval_points) -> list[tuple[float, float, float | None, str]]:
    """(step, accuracy, stderr or None, label) from ``eval_points`` and from evaluation records in ``records``.

    ``eval_points`` may be a mapping ``{step: accuracy}`` or a sequence of ``(step, accuracy)`` pairs or of dicts with
    ``step``, ``accuracy`` and optional ``stderr`` and ``label``. Records with an ``accuracy`` key (as the example
    script writes them) and records with a periodic-evaluation key (:data:`EVAL_ACCURACY_KEYS`) are added.
    """
    points: list[tuple[float, float, float | None, str]] = []
    if eval_points is not None:
        items = eval_points.items() if isinstance(eval_points, Mapping) else eval_points
        for item in items:
            if isinstance(item, Mapping):
                points.append((item["step"], item["accuracy"], item.get("stderr"), str(item.get("label", ""))))
            else:
                points.append((item[0], item[1], None, ""))
    for record in records:
        if "step" not in record:
            continue
        if isinstance(record.get("accuracy"), (int, float)):
            points.append((record["step"], record["accuracy"], record.get("stderr"), str(record.get("label", ""))))
            continue
        for key in EVAL_ACCURACY_KEYS:
            if isinstance(record.get(key), (int, float)):
                points.append((record["step"], record[key], None, "eval"))
                break
    return sorted(points, key=lambda point: point[0])


def plot_training(
    log_history_or_jsonl_path: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
    out_png: str | os.PathLike[str],
    eval_points=None,
    title: str | None = None,
) -> Path:
    """Draw reward, held-out accuracy, staleness (mean and max) and step time over training steps into a PNG.

    The held-out accuracy panel is drawn only when there is an accuracy to show (``eval_points``, or evaluation
    records in the log); without one the figure has the three training panels in a row.

    Args:
        log_history_or_jsonl_path: ``trainer.state.log_history`` (a list of dicts), or the path of a JSONL file
            with one record per line (training logs with ``step``; evaluation records with ``step`` and
            ``accuracy``, optionally ``stderr`` and ``label``).
        out_png: Where to write the PNG; parent directories are created.
        eval_points: Extra held-out accuracy points: ``{step: accuracy}``, ``[(step, accuracy), ...]`` or
            ``[{"step", "accuracy", "stderr", "label"}, ...]`` (e.g. before and after training).
        title: Figure title.

    Returns:
        The path of the PNG. A training panel with no data says so instead of failing.
    """
    fig = _training_figure(load_metrics(log_history_or_jsonl_path), eval_points, title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _training_figure(records: Sequence[Mapping[str, Any]], eval_points, title: str | None):
    """The figure :func:`plot_training` saves: 2 x 2 panels with a held-out accuracy, else 3 in a row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [r for r in records if "accuracy" not in r]
    points = _eval_points(records, eval_points)
    if points:
        fig = Figure(figsize=(11, 7.5))
        axes = fig.subplots(2, 2)
        (ax_reward, ax_acc), (ax_stale, ax_time) = axes
    else:  # a run without an evaluation: no held-out panel
        fig = Figure(figsize=(15, 4.2))
        axes = fig.subplots(1, 3)
        ax_reward, ax_stale, ax_time = axes
    FigureCanvasAgg(fig)  # the Agg canvas, without touching pyplot's global backend (safe inside notebooks)

    reward_key = next((k for k in REWARD_KEYS if _series(train, k)[0]), REWARD_KEYS[0])
    _line(ax_reward, *_series(train, reward_key), label=reward_key, marker=".")
    ax_reward.set_title("Reward (train)")

    if points:
        steps, accuracies, errors, labels = zip(*points)
        if any(e is not None for e in errors):
            ax_acc.errorbar(steps, accuracies, yerr=[e or 0.0 for e in errors], fmt="o-", capsize=4, color="tab:green")
        else:
            ax_acc.plot(steps, accuracies, "o-", color="tab:green")
        for step, accuracy, _, label in points:
            ax_acc.annotate(
                f"{label} {accuracy:.1%}".strip(),
                (step, accuracy),
                textcoords="offset points",
                xytext=(4, 6),
                fontsize=8,
            )
        ax_acc.set_ylim(0, min(1.0, max(accuracies) * 1.3 + 0.05))
        ax_acc.set_title("Held-out accuracy (greedy)")

    for key, style in zip(STALENESS_KEYS, ("-", "--")):
        _line(ax_stale, *_series(train, key), label=key.split("/")[-1], linestyle=style, marker=".")
    ax_stale.set_title("Staleness (optimizer steps)")

    _line(ax_time, *_series(train, STEP_TIME_KEY), label=STEP_TIME_KEY, marker=".", color="tab:purple")
    ax_time.set_title("Step time (s)")

    all_steps = [r["step"] for r in train if isinstance(r.get("step"), (int, float))] + [p[0] for p in points]
    last_step = max(all_steps, default=0)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if last_step > 0:  # one step axis for all panels, so accuracy points line up with the training curves
            ax.set_xlim(-0.02 * last_step, 1.05 * last_step)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _line(ax, steps, values, label, **kwargs) -> None:
    if not steps:
        if not ax.lines:
            _no_data(ax)
        return
    ax.plot(steps, values, label=label, **kwargs)
    ax.legend(fontsize=8)


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
