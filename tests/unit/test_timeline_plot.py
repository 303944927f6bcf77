"""The timeline picture's layout (a3po_trl/timeline/plot.py), from hand-made traces: what the pipelined ideal counts,
which versions the colour bar lists, the phase rows, and where the ideal's label is drawn."""

import pytest

from a3po_trl.timeline import GENERATION_LANE, TRAINING_LANE, TimelineRecorder
from a3po_trl.timeline.plot import MIN_PHASE_FRACTION, PHASES, ROWS, draw_timeline, layout_timeline


def trace(generation=(), training=()):
    """Chrome trace events of spans ``(name, start, end, args)`` (seconds) on each lane."""
    recorder = TimelineRecorder()
    for lane, spans in ((GENERATION_LANE, generation), (TRAINING_LANE, training)):
        for name, start, end, args in spans:
            recorder.record(lane, name, recorder.origin + start, recorder.origin + end, args)
    return recorder.chrome_trace()["traceEvents"]


def test_the_ideal_counts_publications_and_checkpoint_saves_as_training_work():
    events = trace(
        generation=[("batch", 0, 1, {"version": 0}), ("batch", 1, 2, {"version": 0}), ("batch", 2, 3, {"version": 1})],
        training=[
            ("step", 1.0, 2.0, {"step": 1, "version": 0}),
            ("publish weights", 2.0, 2.2, {"version": 1}),
            ("step", 2.2, 3.2, {"step": 2, "version": 0}),
            ("save checkpoint", 3.2, 4.2, {"step": 2}),
            ("step", 4.2, 5.2, {"step": 3, "version": 1}),
            ("publish weights", 5.2, 5.4, {"version": 3}),  # a version no batch was generated with
        ],
    )
    layout = layout_timeline(events)
    overlap = layout.overlap
    assert overlap.actual == pytest.approx(4.4)
    assert overlap.training_busy == pytest.approx(4.4)  # the trainer never idled: nothing left to win
    assert overlap.ideal == pytest.approx(overlap.actual)
    assert layout.versions == [0, 1]  # the colour bar: versions that generated a batch, not every one published


def test_the_ideal_counts_the_drain_after_the_last_batch_as_unavoidable():
    """A generator-bound run's end: the trainer waits for each batch, and trains the last one after the generator
    has nothing left to do. Perfect overlap would take as long."""
    events = trace(
        generation=[("batch", 0, 2, {"version": 0}), ("batch", 2, 4, {"version": 0}), ("batch", 4, 6, {"version": 1})],
        training=[
            ("step", 2, 3, {"step": 1, "version": 0}),
            ("step", 3, 5, {"step": 2, "version": 0}),
            ("wait for batch", 3, 4, {}),
            ("step", 5, 7, {"step": 3, "version": 1}),
            ("wait for batch", 5, 6, {}),
        ],
    )
    overlap = layout_timeline(events).overlap
    assert (overlap.actual, overlap.training_busy, overlap.generation_busy) == pytest.approx((5, 3, 4))
    assert overlap.drain == pytest.approx(1) and overlap.trainer_waited == pytest.approx(2)
    assert overlap.ideal == pytest.approx(5)


def test_each_phase_gets_a_row_of_its_own_and_a_visible_width():
    events = trace(
        generation=[("batch", 10, 20, {"version": 1}), ("generation", 10, 16, {}), ("rewards", 16, 20, {})],
        training=[
            ("step", 10, 20, {"step": 1, "version": 0}),
            ("forward/backward", 10, 19.999, {}),
            ("optimizer step", 19.999, 20, {}),  # a millisecond in a ten-second window
        ],
    )
    layout = layout_timeline(events)
    phases = {bar.name: bar for bar in layout.bars if bar.kind == "phase"}
    assert set(phases) == {"generation", "rewards", "forward/backward", "optimizer step"}
    assert layout.phases_drawn == [name for name in PHASES if name in phases]
    assert phases["optimizer step"].width == pytest.approx(10 * MIN_PHASE_FRACTION)
    assert phases["forward/backward"].row < ROWS[TRAINING_LANE] and phases["rewards"].row < ROWS[GENERATION_LANE]
    assert {bar.row for bar in layout.bars if bar.kind == "step"} == {ROWS[TRAINING_LANE]}


def test_the_ideal_counts_the_fill_only_when_the_window_starts_the_run():
    """The run's first step waits for the first batch: no overlap can hide that generation."""
    events = trace(
        generation=[("batch", 0, 2, {"version": 0}), ("batch", 2, 3, {"version": 0})],
        training=[
            ("step", 0, 3, {"step": 1, "version": 0}),
            ("wait for batch", 0, 2, {}),
            ("step", 3, 4, {"step": 2, "version": 0}),
        ],
    )
    whole = layout_timeline(events).overlap
    assert (whole.fill, whole.training_busy, whole.ideal, whole.actual) == pytest.approx((2, 2, 4, 4))
    last = layout_timeline(events, last_steps=1).overlap
    assert last.fill == 0 and last.ideal == pytest.approx(last.actual)


@pytest.mark.parametrize("ideal_at", ["the right edge", "the left half"])
def test_the_ideal_label_stays_inside_the_axes_clear_of_the_colour_bar(tmp_path, monkeypatch, ideal_at):
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig

    def recording_savefig(figure, *args, **kwargs):
        saved.append(figure)
        return savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    if ideal_at == "the right edge":  # the trainer never idles: the ideal is the window's end
        generation = [("batch", 0, 1, {"version": 0}), ("batch", 1, 2, {"version": 1})]
        training = [("step", 1, 2, {"step": 1, "version": 0}), ("step", 2, 3, {"step": 2, "version": 1})]
    else:  # a long wait: the ideal lies early in the window
        generation = [("batch", 0, 1, {"version": 0}), ("batch", 1, 2, {"version": 1})]
        training = [("step", 1, 1.2, {"step": 1, "version": 0}), ("step", 9.8, 10, {"step": 2, "version": 1})]
    draw_timeline(trace(generation, training), str(tmp_path / "timeline.png"))
    (figure,) = saved
    axes, colour_bar = figure.axes[:2]
    (label,) = [text for text in axes.texts if text.get_text().strip() == "pipelined ideal"]
    renderer = figure.canvas.get_renderer()
    box, inside = label.get_window_extent(renderer), axes.get_window_extent(renderer)
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1
    assert box.x1 < colour_bar.get_window_extent(renderer).x0
