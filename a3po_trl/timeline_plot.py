"""The timeline of the last steps of a run as a picture: one lane per thread, batches coloured by version.

Reads Chrome trace events (what :class:`~a3po_trl.timeline.TimelineRecorder` writes, from memory or from
``output_dir/timeline/trace-rank{k}.json``). The generation lane shows each batch coloured by the weight version that
generated it; the training lane shows each optimizer step coloured by the version that generated the batch it trains
on, so a colour travels from the top lane to the bottom one. Waiting is drawn light grey and hatched (the trainer
waiting for a batch, the generator waiting for the staleness bound or for queue room), weight loads and
publications black. The dashed line marks where the window would end if generation and training overlapped
perfectly: the busier thread never waiting, so the window takes as long as that thread's busy time.

matplotlib (the ``plots`` extra) is imported only here, when a picture is drawn, and pyplot's global backend is left
alone (the Agg canvas renders the figure directly).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from .timeline import BATCH_SPAN, GENERATION_LANE, LANES, STEP_SPAN, TRAINING_LANE

WAITS = {"wait for staleness bound", "wait for queue room", "wait for batch"}
"""Spans that are idle time of their thread."""
MARKS = {"weight load", "weight load between turns", "publish weights"}
"""Spans drawn as black marks: weights moving between the threads."""
HATCHES = {
    "behavior log-probs": "//",
    "rewards": "xx",
    "tool calls": "..",
    "recompute forward": "//",
    "reference forward": "\\\\",
    "optimizer step": "||",
}
"""Parts of a batch or step drawn as hatched overlays on its coloured bar."""
SOLID = {"save checkpoint": "tab:red"}
"""Spans of their own (outside any step), drawn in a fixed colour."""


def load_trace_events(path: str) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace JSON file written by the trainer."""
    with open(path) as file:
        return json.load(file)["traceEvents"]


def _spans(events: Sequence[dict], lane: str) -> list[dict]:
    tid = LANES[lane][0]
    return sorted((e for e in events if e.get("ph") == "X" and e.get("tid") == tid), key=lambda e: e["ts"])


def _busy_seconds(parents: list[dict], children: list[dict], idle: set[str], start: float, end: float) -> float:
    """Seconds of ``parents`` inside ``[start, end]`` (µs) minus their ``idle`` children."""
    total = 0.0
    for span in parents:
        total += max(0.0, min(span["ts"] + span["dur"], end) - max(span["ts"], start))
    for span in children:
        if span["name"] in idle:
            total -= max(0.0, min(span["ts"] + span["dur"], end) - max(span["ts"], start))
    return max(total, 0.0) / 1e6


def draw_timeline(events: Sequence[dict] | str, path: str, last_steps: int = 20, title: str | None = None) -> str:
    """Draw the last ``last_steps`` optimizer steps of a trace (its events, or the path of a trace file) into the
    PNG ``path`` (parent folders are created). Returns ``path``.

    Raises ``ValueError`` when the trace holds no optimizer step (the timeline was off, or no step finished), and
    ``ImportError`` naming the fix when matplotlib is missing.
    """
    if isinstance(events, (str, os.PathLike)):
        events = load_trace_events(str(events))
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError(
            "Drawing the timeline needs matplotlib: pip install 'a3po-trl[plots]' (or pip install matplotlib). The "
            "trace itself (output_dir/timeline/trace-rank*.json) opens without it in https://ui.perfetto.dev."
        ) from error
    if last_steps < 1:
        raise ValueError(f"last_steps={last_steps} must be at least 1.")
    training, generation = _spans(events, TRAINING_LANE), _spans(events, GENERATION_LANE)
    steps = [e for e in training if e["name"] == STEP_SPAN][-last_steps:]
    if not steps:
        raise ValueError(
            "The trace holds no optimizer step to draw: record it with timeline=True and let at least one step end."
        )
    start = steps[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in training if e["ts"] >= start)
    in_window = [e for e in training + generation if e["ts"] + e["dur"] > start and e["ts"] < end]
    versions = [e["args"]["version"] for e in in_window if "version" in e.get("args", {})]
    norm = Normalize(vmin=min(versions, default=0), vmax=max(max(versions, default=0), min(versions, default=0) + 1))
    colormap = "viridis"
    mappable = ScalarMappable(norm=norm, cmap=colormap)

    fig = Figure(figsize=(14, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.09, 0.2, 0.79, 0.62))
    rows = {GENERATION_LANE: 1.0, TRAINING_LANE: 0.0}
    height = 0.6

    def seconds(ts: float) -> float:
        return (ts - start) / 1e6

    for lane, parent_name in ((GENERATION_LANE, BATCH_SPAN), (TRAINING_LANE, STEP_SPAN)):
        y = rows[lane]
        for span in (e for e in in_window if e["cat"] == lane):
            x, width = seconds(span["ts"]), span["dur"] / 1e6
            args = span.get("args", {})
            if span["name"] == parent_name:
                color = mappable.to_rgba(args["version"]) if "version" in args else "tab:gray"
                ax.broken_barh([(x, width)], (y - height / 2, height), facecolors=color, edgecolor="white", lw=0.5)
                label = f"v{args['version']}" if "version" in args else ""
                if lane == TRAINING_LANE:
                    label = f"s{args.get('step', '?')}\n{label}"
                if width > (seconds(end) / 60):
                    ax.text(x + width / 2, y, label, ha="center", va="center", fontsize=6, color="white")
            elif span["name"] in WAITS:
                ax.broken_barh(
                    [(x, width)], (y - height / 2, height), facecolors="#dddddd", edgecolor="#999999", hatch="///"
                )
            elif span["name"] in SOLID:
                ax.broken_barh([(x, width)], (y - height / 2, height), facecolors=SOLID[span["name"]])
            elif span["name"] in MARKS:
                ax.broken_barh([(x, max(width, 0.0))], (y - height / 2, height), facecolors="black")
            elif span["name"] in HATCHES:
                ax.broken_barh(
                    [(x, width)],
                    (y - height / 2, height * 0.45),
                    facecolors="none",
                    edgecolor="white",
                    hatch=HATCHES[span["name"]],
                    lw=0,
                )

    # the pipelining ideal: the busier thread never waits, so the window lasts as long as its busy time
    train_busy = _busy_seconds(
        [e for e in training if e["name"] == STEP_SPAN and e["ts"] >= start],
        [e for e in training if e["ts"] >= start],
        WAITS,
        start,
        end,
    )
    generation_busy = _busy_seconds([e for e in generation if e["name"] == BATCH_SPAN], generation, WAITS, start, end)
    actual = seconds(end)
    ideal = max(train_busy, generation_busy)
    ax.axvline(ideal, color="tab:red", linestyle="--", lw=1.2)
    ax.text(ideal, 1.45, " pipelined ideal", color="tab:red", fontsize=8, va="center")
    trainer_wait = sum(
        max(0.0, min(e["ts"] + e["dur"], end) - max(e["ts"], start)) / 1e6
        for e in training
        if e["name"] == "wait for batch"
    )
    generator_wait = sum(
        max(0.0, min(e["ts"] + e["dur"], end) - max(e["ts"], start)) / 1e6 for e in generation if e["name"] in WAITS
    )
    ax.set_yticks([0, 1], ["training\n(main thread)", "generation\nthread"])
    ax.set_ylim(-0.6, 1.7)
    ax.set_xlim(0, actual * 1.01)
    ax.set_xlabel("seconds since the first step drawn")
    ax.grid(axis="x", alpha=0.3)
    summary = (
        f"last {len(steps)} steps: {actual:.1f} s; pipelined ideal {ideal:.1f} s "
        f"(training busy {train_busy:.1f} s, generation busy {generation_busy:.1f} s); "
        f"trainer waited {trainer_wait / max(actual, 1e-9):.0%}, "
        f"generator waited {generator_wait / max(actual, 1e-9):.0%}"
    )
    fig.suptitle(title or "Timeline of the pipeline", fontsize=11, y=0.97)
    fig.text(0.09, 0.87, summary, fontsize=8)
    colorbar = fig.colorbar(mappable, cax=fig.add_axes((0.9, 0.2, 0.012, 0.62)))
    colorbar.locator = MaxNLocator(integer=True)
    colorbar.update_ticks()
    colorbar.set_label("weight version that generated the batch", fontsize=8)
    legend = [
        Patch(facecolor="#dddddd", edgecolor="#999999", hatch="///", label="waiting"),
        Patch(facecolor="black", label="weight load / publish"),
        *[Patch(facecolor="gray", hatch=h, edgecolor="white", label=n) for n, h in HATCHES.items()],
        *[Patch(facecolor=color, label=name) for name, color in SOLID.items()],
    ]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=7, frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
