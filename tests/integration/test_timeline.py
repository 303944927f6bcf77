"""The timeline of the pipeline: a bounded, thread-safe recorder, the Chrome trace a run writes, the picture."""

import json
import logging
import os
import sys
import threading
import time

import pytest
from helpers import make_trainer
from transformers import TrainerCallback

from a3po_trl.checkpoints import checkpoint_problems
from a3po_trl.timeline import (
    GENERATION_LANE,
    LANES,
    THREAD_CPU_ARG,
    TRAINING_LANE,
    TimelineRecorder,
    batch_span,
    record_in_batch_span,
    trace_path,
)
from a3po_trl.timeline.plot import draw_timeline


def test_the_recorder_keeps_the_newest_spans_of_every_thread_within_its_bound():
    recorder = TimelineRecorder(max_spans=1000)

    def record(lane):
        for i in range(5000):
            recorder.record(lane, "span", float(i), i + 0.5, {"i": i})

    threads = [threading.Thread(target=record, args=(lane,)) for lane in (TRAINING_LANE, GENERATION_LANE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spans = recorder.spans()
    assert len(spans) == 1000 and recorder.dropped == 9000
    assert min(span.args["i"] for span in spans) >= 4000  # only the newest are kept, from both threads
    assert {span.lane for span in spans} <= {TRAINING_LANE, GENERATION_LANE}
    trace = recorder.chrome_trace(process_index=3)
    assert trace["otherData"]["spans_dropped"] == 9000
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == 1000


def test_chrome_trace_events_are_complete_events_in_microseconds_with_one_thread_per_lane(tmp_path):
    recorder = TimelineRecorder()
    origin = recorder.origin
    with batch_span(recorder, GENERATION_LANE, batch=7) as args:
        args["version"] = 2
        record_in_batch_span("generation", origin + 1.0, origin + 1.5, sequences=4)
    recorder.record(TRAINING_LANE, "step", origin + 2.0, origin + 2.25, {"step": 3})
    record_in_batch_span("outside any batch", origin, origin + 1)  # no open batch span: nothing recorded
    path = recorder.write_chrome_trace(str(tmp_path / "t" / "trace.json"), process_index=1)
    trace = json.loads(open(path).read())
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert set(spans) == {"batch", "generation", "step"}
    assert spans["generation"]["ts"] == pytest.approx(1e6) and spans["generation"]["dur"] == pytest.approx(5e5)
    assert spans["generation"]["args"] == {"batch": 7, "version": 2, "sequences": 4}  # the batch's args, and its own
    assert spans["step"]["tid"] == LANES[TRAINING_LANE][0] != spans["batch"]["tid"] == LANES[GENERATION_LANE][0]
    assert {e["pid"] for e in trace["traceEvents"]} == {2}  # process 1; pid 0 is the idle process to viewers
    assert {e["pid"] for e in recorder.chrome_trace(process_index=0)["traceEvents"]} == {1}
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {1: "training (main thread)", 2: "generation thread"}


def test_a_batch_span_carries_the_cpu_seconds_of_its_own_thread():
    """Read in the thread that ran the batch (``time.thread_time``): a batch that waits while another thread computes
    records next to nothing; the computing thread's batch records its computation, within its wall time."""
    recorder = TimelineRecorder()

    def compute():
        with batch_span(recorder, TRAINING_LANE, batch=1):
            start = time.thread_time()  # inside the span: the span's CPU time holds all of the loop's
            while time.thread_time() - start < 0.05:
                pass

    with batch_span(recorder, GENERATION_LANE, batch=0):
        thread = threading.Thread(target=compute)
        thread.start()
        thread.join()
    spans = {span.args["batch"]: span for span in recorder.spans()}
    computed, waited = spans[1], spans[0]
    assert 0.05 <= computed.args[THREAD_CPU_ARG] <= computed.end - computed.start + 1e-3
    assert 0 <= waited.args[THREAD_CPU_ARG] < 0.02  # its thread slept in join while the other computed


def test_a_disabled_recorder_keeps_and_writes_nothing(tmp_path):
    recorder = TimelineRecorder(enabled=False)
    recorder.record(TRAINING_LANE, "step", 0.0, 1.0)
    with batch_span(recorder, GENERATION_LANE):
        record_in_batch_span("generation", 0.0, 1.0)
    assert recorder.spans() == []
    assert recorder.write_chrome_trace(str(tmp_path / "trace.json")) is None
    assert not (tmp_path / "trace.json").exists()


def _spans(trace, lane):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == LANES[lane][0]]


def test_a_run_writes_both_threads_spans_with_versions_and_staleness(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, max_steps=4, max_staleness=1)
    trainer.train()
    trace = json.loads(open(trace_path(trainer.args.output_dir, 0)).read())
    generation, training = _spans(trace, GENERATION_LANE), _spans(trace, TRAINING_LANE)
    generation_names = {e["name"] for e in generation}
    assert {"batch", "wait for staleness bound", "weight load", "generation", "rewards"} <= generation_names
    training_names = {e["name"] for e in training}
    expected = {"step", "take batch", "wait for batch", "forward/backward", "optimizer step"}
    assert expected | {"publish weights"} <= training_names
    batches = sorted((e for e in generation if e["name"] == "batch"), key=lambda e: e["args"]["batch"])
    assert [e["args"]["batch"] for e in batches] == [0, 1, 2, 3]
    assert all({"version", "staleness"} <= set(e["args"]) for e in batches)
    assert all(0 <= e["args"][THREAD_CPU_ARG] <= e["dur"] / 1e6 + 1e-3 for e in batches)  # the generation thread's
    steps = sorted((e for e in training if e["name"] == "step"), key=lambda e: e["args"]["step"])
    assert [e["args"]["step"] for e in steps] == [1, 2, 3, 4]
    # staleness of the batch each step trains on, as the loss logs it
    logged = [h["a3po/staleness_max"] for h in trainer.state.log_history if "a3po/staleness_max" in h]
    assert [e["args"]["staleness"] for e in steps] == logged
    assert [e["args"]["step"] - 1 - e["args"]["version"] for e in steps] == logged
    for step in steps:  # the parts of a step lie inside it (nested slices in the viewer)
        parts = [e for e in training if e["name"] == "forward/backward" and e["args"]["step"] == step["args"]["step"]]
        assert len(parts) == 1
        assert step["ts"] <= parts[0]["ts"] and parts[0]["ts"] + parts[0]["dur"] <= step["ts"] + step["dur"] + 1e-3

    png = trainer.save_timeline(str(tmp_path / "timeline.png"), last_steps=3)
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_timeline_off_writes_no_trace(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, max_steps=1, timeline=False)
    trainer.train()
    assert not (tmp_path / "out" / "timeline").exists()
    with pytest.raises(ValueError, match="timeline=True"):
        trainer.save_timeline()


def test_drawing_says_what_is_missing(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no optimizer step"):
        draw_timeline(TimelineRecorder().chrome_trace()["traceEvents"], str(tmp_path / "t.png"))
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r"a3po-trl\[plots\]"):
        draw_timeline([], str(tmp_path / "t.png"))


def _block_the_timeline_folder(tmp_path):
    """``output_dir/timeline`` cannot be created: a file has its name (as a full disk or a missing permission would
    make any write there fail; a file works for root too)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "timeline").write_text("not a folder")


def test_an_unwritable_timeline_folder_lets_training_and_its_checkpoints_finish_with_a_warning(
    tokenizer, tmp_path, caplog
):
    _block_the_timeline_folder(tmp_path)
    trainer = make_trainer(tokenizer, tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    with caplog.at_level(logging.WARNING, logger="a3po_trl.timeline.recorder"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert checkpoint_problems(str(tmp_path / "out" / "checkpoint-2")) == []
    assert caplog.text.count("Could not write the timeline trace") == 1  # once, not at every checkpoint
    assert "timeline=False" in caplog.text


class _CtrlCAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_ctrl_c_surfaces_as_keyboard_interrupt_even_when_the_trace_cannot_be_written(tokenizer, tmp_path):
    _block_the_timeline_folder(tmp_path)
    trainer = make_trainer(tokenizer, tmp_path, max_steps=3)
    trainer.add_callback(_CtrlCAt(1))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()


def _steps_in(path):
    return [e["args"]["step"] for e in json.loads(open(path).read())["traceEvents"] if e["name"] == "step"]


def test_a_resumed_run_keeps_the_trace_of_the_run_it_resumes(tokenizer, tmp_path):
    settings = dict(save_strategy="steps", save_steps=1)
    first = make_trainer(tokenizer, tmp_path, max_steps=2, **settings)
    first.train()
    first.train()  # the same trainer again: its trace (both calls) goes to the same file
    out = tmp_path / "out"
    assert sorted(os.listdir(out / "timeline")) == ["trace-rank0.json"]
    resumed = make_trainer(tokenizer, tmp_path, max_steps=3, **settings)
    resumed.train(resume_from_checkpoint=True)
    assert sorted(os.listdir(out / "timeline")) == ["trace-rank0-run2.json", "trace-rank0.json"]
    assert _steps_in(trace_path(str(out), 0)) == [1, 2, 1, 2]
    assert _steps_in(trace_path(str(out), 0, run=2)) == [3]
