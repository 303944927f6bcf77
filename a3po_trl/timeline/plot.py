"""The timeline of the last steps of a run as a picture: one lane per thread, batches coloured by version.

Reads Chrome trace events (what :class:`~a3po_trl.timeline.TimelineRecorder` writes, from memory or from
``output_dir/timeline/trace-rank{k}.json``). :func:`layout_timeline` turns them into bars and figures (pure, no
matplotlib); :func:`draw_timeline` draws them. Each lane is a bar row and, under it, a phase row:

- the bar row shows each generation batch (top lane) and each optimizer step (bottom lane) coloured by the weight
  version that generated the batch, so a colour travels from the top lane to the bottom one; waiting is light grey and
  hatched (the trainer waiting for a batch, the generator for the staleness bound or for queue room), weight loads and
  publications black, checkpoint saves red. The colour bar lists the versions batches were generated with, only.
- the phase row shows the parts of each batch or step (generation, behavior log-probs, rewards, tool calls; recompute
  and reference forwards, forward/backward, optimizer step) in colours of their own, at least a pixel or so wide.

The dashed line is the pipelined ideal: where the drawn steps would end if the two threads overlapped perfectly. It
is the longer of the two threads' busy times (waits left out; the trainer's publications and checkpoint saves
counted), each with what no overlap can hide: after the generator's last batch, the trainer's remaining work (the
pipeline's drain), and when the window starts at a run's first step, the generation before the trainer has anything
to train (its fill). The gap between that line and the real end is what better overlap could still win.

matplotlib (the ``plots`` extra) is imported only here, when a picture is drawn, and pyplot's global backend is left
alone (the Agg canvas renders the figure directly).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .recorder import BATCH_SPAN, GENERATION_LANE, LANES, STEP_SPAN, TRAINING_LANE

WAITS = {"wait for staleness bound", "wait for queue room", "wait for batch"}
"""Spans that are idle time of their thread."""
MARKS = {"weight load", "weight load between turns", "publish weights"}
"""Spans drawn as black marks: weights moving between the threads."""
PHASES = {
    "generation": "#4c72b0",
    "behavior log-probs": "#dd8452",
    "rewards": "#55a868",
    "tool calls": "#8172b3",
    "recompute forward": "#c44e52",
    "reference forward": "#937860",
    "forward/backward": "#da8bc3",
    "optimizer step": "#8c8c8c",
}
"""Parts of a batch or step, drawn on the lane's phase row in these colours."""
SOLID = {"save checkpoint": "tab:red"}
"""Spans of their own (outside any step), drawn in a fixed colour."""
MIN_PHASE_FRACTION = 1 / 600
"""Narrowest phase drawn, as a fraction of the window (about a pixel and a half in the shipped 14-inch figure)."""
ROWS = {GENERATION_LANE: 1.0, TRAINING_LANE: 0.0}
"""Height of each lane's bar row; its phase row is just below."""


def load_trace_events(path: str) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace JSON file written by the trainer."""
    with open(path) as file:
        return json.load(file)["traceEvents"]


# ---- intervals (seconds) ------------------------------------------------------------------------------------------
def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _measure(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in _union(intervals))


def _subtract(intervals, removed) -> list[tuple[float, float]]:
    """``union(intervals)`` minus ``union(removed)``."""
    result = []
    removed = _union(removed)
    for start, end in _union(intervals):
        cursor = start
        for r_start, r_end in removed:
            if r_end <= cursor or r_start >= end:
                continue
            if r_start > cursor:
                result.append((cursor, r_start))
            cursor = max(cursor, r_end)
        if cursor < end:
            result.append((cursor, end))
    return result


def _busy(spans: Sequence[dict]) -> list[tuple[float, float]]:
    """When a thread was working (any of its spans, minus its waits), in seconds."""
    every = [(s["ts"] / 1e6, (s["ts"] + s["dur"]) / 1e6) for s in spans]
    waits = [(s["ts"] / 1e6, (s["ts"] + s["dur"]) / 1e6) for s in spans if s["name"] in WAITS]
    return _subtract(every, waits)


# ---- the layout ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bar:
    lane: str
    row: float
    """Centre height: ``ROWS[lane]`` for the bar row, below it for the phase row."""
    start: float
    """Seconds since the first step drawn."""
    width: float
    kind: str
    """``"batch"``/``"step"`` (coloured by ``version``), ``"wait"``, ``"mark"``, ``"solid"`` or ``"phase"``."""
    name: str
    version: int | None = None
    label: str = ""


@dataclass(frozen=True)
class Overlap:
    """Seconds of the drawn window: how long it took, and how long it would have with perfect overlap."""

    actual: float
    ideal: float
    training_busy: float
    generation_busy: float
    drain: float
    """Trainer work after the generator's last batch: nothing is left to overlap it with."""
    fill: float
    """Generation before the trainer's first work, when the window starts at the run's first step."""
    trainer_waited: float
    generator_waited: float


@dataclass(frozen=True)
class TimelineLayout:
    bars: list[Bar]
    versions: list[int]
    """Versions that generated a drawn batch or a batch a drawn step trains on: the colour bar's entries."""
    overlap: Overlap
    steps: int
    phases_drawn: list[str] = field(default_factory=list)


def _spans(events: Sequence[dict], lane: str) -> list[dict]:
    tid = LANES[lane][0]
    return sorted((e for e in events if e.get("ph") == "X" and e.get("tid") == tid), key=lambda e: e["ts"])


def _overlap(training, generation, start, end, first_step) -> Overlap:
    """The window's actual and ideal duration (``start``/``end`` in seconds), and its parts. ``first_step``: the
    run's first step span when the window starts with it, else None."""
    training_busy, generation_busy = _busy(training), _busy(generation)
    generation_done = max(((g["ts"] + g["dur"]) / 1e6 for g in generation), default=start)
    drain = _measure(training_busy, max(generation_done, start), end) if generation_done < end else 0.0
    fill = 0.0
    if first_step is not None:  # the run's first step waits for the first batch: no overlap can hide that
        step_end = first_step["ts"] + first_step["dur"]
        waits = [w for w in training if w["name"] == "wait for batch" and first_step["ts"] <= w["ts"] < step_end]
        if waits:
            fill = _measure(generation_busy, start, (waits[0]["ts"] + waits[0]["dur"]) / 1e6)
    train, generate = _measure(training_busy, start, end), _measure(generation_busy, start, end)
    idle = [(s["ts"] / 1e6, (s["ts"] + s["dur"]) / 1e6) for s in generation if s["name"] in WAITS]
    return Overlap(
        actual=end - start,
        ideal=max(fill + train, generate + drain),
        training_busy=train,
        generation_busy=generate,
        drain=drain,
        fill=fill,
        trainer_waited=_measure(
            [(s["ts"] / 1e6, (s["ts"] + s["dur"]) / 1e6) for s in training if s["name"] in WAITS], start, end
        ),
        generator_waited=_measure(idle, start, end),
    )


def layout_timeline(events: Sequence[dict], last_steps: int = 20) -> TimelineLayout:
    """The bars, colour-bar versions and overlap figures of the last ``last_steps`` optimizer steps of a trace.

    Raises ``ValueError`` when the trace holds no optimizer step (the timeline was off, or no step finished)."""
    if last_steps < 1:
        raise ValueError(f"last_steps={last_steps} must be at least 1.")
    training, generation = _spans(events, TRAINING_LANE), _spans(events, GENERATION_LANE)
    all_steps = [e for e in training if e["name"] == STEP_SPAN]
    steps = all_steps[-last_steps:]
    if not steps:
        raise ValueError(
            "The trace holds no optimizer step to draw: record it with timeline=True and let at least one step end."
        )
    start_us = steps[0]["ts"]
    end_us = max(e["ts"] + e["dur"] for e in training if e["ts"] >= start_us)
    in_window = [e for e in training + generation if e["ts"] + e["dur"] > start_us and e["ts"] < end_us]
    actual = (end_us - start_us) / 1e6
    min_phase = actual * MIN_PHASE_FRACTION
    bars, phases = [], set()
    for span in in_window:
        lane, args = span["cat"], span.get("args", {})
        x, width = (span["ts"] - start_us) / 1e6, span["dur"] / 1e6
        row = ROWS[lane]
        if span["name"] in (BATCH_SPAN, STEP_SPAN):
            label = f"v{args['version']}" if "version" in args else ""
            if lane == TRAINING_LANE:
                label = f"s{args.get('step', '?')}\n{label}"
            kind = "batch" if span["name"] == BATCH_SPAN else "step"
            bars.append(Bar(lane, row, x, width, kind, span["name"], args.get("version"), label))
        elif span["name"] in WAITS:
            bars.append(Bar(lane, row, x, width, "wait", span["name"]))
        elif span["name"] in SOLID:
            bars.append(Bar(lane, row, x, width, "solid", span["name"]))
        elif span["name"] in MARKS:
            bars.append(Bar(lane, row, x, width, "mark", span["name"]))
        elif span["name"] in PHASES:
            phases.add(span["name"])
            bars.append(Bar(lane, row - 0.42, x, max(width, min_phase), "phase", span["name"]))
    versions = sorted({b.version for b in bars if b.kind in ("batch", "step") and b.version is not None})
    first_step = steps[0] if steps[0] is all_steps[0] else None
    overlap = _overlap(training, generation, start_us / 1e6, end_us / 1e6, first_step)
    return TimelineLayout(bars, versions, overlap, len(steps), [p for p in PHASES if p in phases])


# ---- drawing ------------------------------------------------------------------------------------------------------
def draw_timeline(events: Sequence[dict] | str, path: str, last_steps: int = 20, title: str | None = None) -> str:
    """Draw the last ``last_steps`` optimizer steps of a trace (its events, or the path of a trace file) into the
    PNG ``path`` (parent folders are created). Returns ``path``.

    Raises ``ValueError`` when the trace holds no optimizer step (the timeline was off, or no step finished), and
    ``ImportError`` naming the fix when matplotlib is missing.
    """
    if isinstance(events, (str, os.PathLike)):
        events = load_trace_events(str(events))
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import BoundaryNorm, ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError(
            "Drawing the timeline needs matplotlib: pip install 'a3po-trl[plots]' (or pip install matplotlib). The "
            "trace itself (output_dir/timeline/trace-rank*.json) opens without it in https://ui.perfetto.dev."
        ) from error
    layout = layout_timeline(events, last_steps)
    versions, overlap = layout.versions or [0], layout.overlap
    colours = colormaps["viridis"].resampled(max(len(versions), 2))(range(len(versions)))
    colour_of = dict(zip(versions, colours))
    mappable = ScalarMappable(
        norm=BoundaryNorm([i - 0.5 for i in range(len(versions) + 1)], len(versions)), cmap=ListedColormap(colours)
    )

    fig = Figure(figsize=(14, 4.6))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.09, 0.22, 0.79, 0.6))
    height, phase_height = 0.5, 0.22
    for bar in layout.bars:
        if bar.kind == "phase":
            ax.broken_barh(
                [(bar.start, bar.width)], (bar.row - phase_height / 2, phase_height), facecolors=PHASES[bar.name]
            )
            continue
        extent = (bar.row - height / 2, height)
        if bar.kind in ("batch", "step"):
            colour = colour_of[bar.version] if bar.version is not None else "tab:gray"
            ax.broken_barh([(bar.start, bar.width)], extent, facecolors=colour, edgecolor="white", lw=0.5)
            if bar.width > overlap.actual / 60:
                ax.text(bar.start + bar.width / 2, bar.row, bar.label, ha="center", va="center", fontsize=6, color="w")
        elif bar.kind == "wait":
            ax.broken_barh([(bar.start, bar.width)], extent, facecolors="#dddddd", edgecolor="#999999", hatch="///")
        elif bar.kind == "solid":
            ax.broken_barh([(bar.start, bar.width)], extent, facecolors=SOLID[bar.name])
        else:
            ax.broken_barh([(bar.start, bar.width)], extent, facecolors="black")

    ax.axvline(overlap.ideal, color="tab:red", linestyle="--", lw=1.2)
    # the label on the side of the line with room: the ideal is often the axes' right edge, by the colour bar
    right_half = overlap.ideal > overlap.actual / 2
    label = "pipelined ideal " if right_half else " pipelined ideal"
    ax.text(overlap.ideal, 1.42, label, color="tab:red", fontsize=8, va="center", ha="right" if right_half else "left")
    ticks = [1.0, 1.0 - 0.42, 0.0, -0.42]
    ax.set_yticks(ticks, ["generation\nthread", "phases", "training\n(main thread)", "phases"], fontsize=8)
    ax.set_ylim(-0.65, 1.6)
    ax.set_xlim(0, overlap.actual * 1.01)
    ax.set_xlabel("seconds since the first step drawn")
    ax.grid(axis="x", alpha=0.3)
    summary = (
        f"last {layout.steps} steps: {overlap.actual:.1f} s; pipelined ideal {overlap.ideal:.1f} s (training busy "
        f"{overlap.training_busy:.1f} s, generation busy {overlap.generation_busy:.1f} s, drain {overlap.drain:.1f} s"
        f"{f', fill {overlap.fill:.1f} s' if overlap.fill else ''}); trainer waited "
        f"{overlap.trainer_waited / max(overlap.actual, 1e-9):.0%}, generator waited "
        f"{overlap.generator_waited / max(overlap.actual, 1e-9):.0%}"
    )
    fig.suptitle(title or "Timeline of the pipeline", fontsize=11, y=0.97)
    fig.text(0.09, 0.87, summary, fontsize=8)
    colorbar = fig.colorbar(mappable, cax=fig.add_axes((0.9, 0.22, 0.012, 0.6)))
    step = max(1, len(versions) // 12)
    colorbar.set_ticks(range(0, len(versions), step), labels=[str(v) for v in versions[::step]])
    colorbar.set_label("weight version that generated the batch", fontsize=8)
    legend = [
        Patch(facecolor="#dddddd", edgecolor="#999999", hatch="///", label="waiting"),
        Patch(facecolor="black", label="weight load / publish"),
        *[Patch(facecolor=colour, label=name) for name, colour in SOLID.items()],
        *[Patch(facecolor=PHASES[name], label=name) for name in layout.phases_drawn],
    ]
    fig.legend(handles=legend, loc="lower center", ncol=min(len(legend), 7), fontsize=7, frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
