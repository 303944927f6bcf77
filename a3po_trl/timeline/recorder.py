"""A timeline of the pipeline: the spans of the generation thread and the training thread on one clock.

Why a run is not faster is a question about two threads: is the trainer waiting for samples, the generator waiting
for the staleness bound (or for room in the queue), or weight publication stalling both? The scalars ``async/*``
answer it on average; the timeline shows it step by step. Both threads record spans ``(lane, name, start, end,
args)`` into one :class:`TimelineRecorder`, on ``time.perf_counter`` (one clock for the whole process), and the
recorder writes them as a Chrome trace (``traceEvents``, opened by Perfetto or ``chrome://tracing``), one file per
process. :mod:`a3po_trl.timeline.plot` draws the last steps of it as a picture.

Spans are recorded where the code already measures its times (the batch producer's waits and weight loads, the
backend's generation and behavior log-probs, the rollout's rewards and tool calls, the trainer's recompute forward and
weight publication), so nothing is timed twice. Code deep inside a rollout does not hold the recorder: the producer
opens a :func:`batch_span` around each batch, and :func:`record_in_batch_span` records on the calling thread's open
batch span (a no-op outside one), so backends and rollouts stay unaware of the recorder.

Memory is bounded: the recorder keeps the newest ``max_spans`` spans (a deque), and counts the ones it dropped.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

GENERATION_LANE = "generation"
"""The lane of the generation thread (or of inline generation, ``async_generation=False``)."""
TRAINING_LANE = "training"
"""The lane of the training (main) thread."""
LANES = {TRAINING_LANE: (1, "training (main thread)"), GENERATION_LANE: (2, "generation thread")}
"""Lane -> (Chrome trace thread id, thread name shown by the viewer)."""

MAX_SPANS = 50_000
"""Spans kept by default: about 20 per optimizer step with a few micro-steps, so the last few thousand steps (about
17 MB of memory and a 7 MB trace at most)."""

BATCH_SPAN = "batch"
"""Name of the span covering the whole production of one generation batch (its parts are nested in it)."""
STEP_SPAN = "step"
"""Name of the span covering one optimizer step of the trainer (its parts are nested in it)."""
THREAD_CPU_ARG = "thread_cpu_s"
"""The arg of each batch span: the CPU seconds its thread ran during it (``time.thread_time()``, read in that thread;
the training thread's are the process's main thread's, which a caller can read itself), against the span's wall
seconds: a thread near its wall time was bound by its own work (its Python, kernel launches, CPU ops, a spin-wait for
a device), one far below it waited (for the other thread, a lock, the GIL, I/O or a blocking device wait)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One recorded interval: ``start`` and ``end`` are ``time.perf_counter()`` seconds."""

    lane: str
    name: str
    start: float
    end: float
    args: dict[str, Any]


class TimelineRecorder:
    """Thread-safe, bounded store of spans, written as a Chrome trace.

    Args:
        enabled: ``False`` makes every method a no-op (nothing is kept or written).
        max_spans: how many of the newest spans are kept.
    """

    def __init__(self, enabled: bool = True, max_spans: int = MAX_SPANS):
        if max_spans < 1:
            raise ValueError(f"max_spans={max_spans} must be at least 1.")
        self.enabled = enabled
        self.origin = time.perf_counter()
        """Clock value of the trace's zero."""
        self.wall_clock_origin = time.time()
        """Wall-clock time (seconds since the epoch) at ``origin``, to line up the traces of several processes."""
        self._spans: deque[Span] = deque(maxlen=max_spans)
        self._lock = threading.Lock()
        self._recorded = 0

    @property
    def dropped(self) -> int:
        """Spans recorded but no longer kept (older than the newest ``max_spans``)."""
        with self._lock:
            return self._recorded - len(self._spans)

    def record(self, lane: str, name: str, start: float, end: float, args: dict[str, Any] | None = None) -> None:
        """Keep the span ``[start, end]`` (``time.perf_counter()`` seconds) of ``name`` on ``lane``."""
        if not self.enabled:
            return
        span = Span(lane, name, start, end, dict(args) if args else {})
        with self._lock:
            self._spans.append(span)
            self._recorded += 1

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args):
        """Record the with-block as a span; yields its ``args`` dict, which the block may fill in (a version known
        only once the block ran)."""
        start = time.perf_counter()
        try:
            yield args
        finally:
            self.record(lane, name, start, time.perf_counter(), args)

    def spans(self) -> list[Span]:
        """A copy of the kept spans, oldest first by recording time."""
        with self._lock:
            return list(self._spans)

    def chrome_trace(self, process_index: int = 0) -> dict:
        """The kept spans as a Chrome trace: complete events (``ph: "X"``, ``ts``/``dur`` in microseconds since
        ``origin``) with ``pid`` = :func:`trace_pid` and one ``tid`` per lane, plus the process and thread names."""
        pid = trace_pid(process_index)
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"process {process_index}"}}
        ]
        for tid, thread_name in LANES.values():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread_name}})
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        spans = sorted(self.spans(), key=lambda span: (span.start, -span.end))  # parents before their children
        for span in spans:
            events.append(
                {
                    "name": span.name,
                    "cat": span.lane,
                    "ph": "X",
                    "ts": round((span.start - self.origin) * 1e6, 3),
                    "dur": round(max(span.end - span.start, 0.0) * 1e6, 3),
                    "pid": pid,
                    "tid": LANES[span.lane][0],
                    "args": span.args,
                }
            )
        start = datetime.datetime.fromtimestamp(self.wall_clock_origin, tz=datetime.timezone.utc)
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "process_index": process_index,
                "wall_clock_start": start.isoformat(),
                "spans_dropped": self.dropped,
            },
        }

    def write_chrome_trace(self, path: str, process_index: int = 0) -> str | None:
        """Write :meth:`chrome_trace` to ``path`` (through a temporary file and a rename, so a reader never sees a
        half-written trace). Returns the path, or ``None`` when disabled."""
        if not self.enabled:
            return None
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = f"{path}.tmp"
        text = json.dumps(self.chrome_trace(process_index), separators=(",", ":"))  # one shot: the C encoder
        with open(temporary, "w") as file:
            file.write(text)
        os.replace(temporary, path)
        return path


def trace_pid(process_index: int) -> int:
    """The Chrome trace ``pid`` of process ``process_index``: ``process_index + 1``, since viewers treat pid 0 as
    the idle process (Perfetto draws it apart, or not at all)."""
    return process_index + 1


def trace_path(output_dir: str, process_index: int, run: int = 1) -> str:
    """The trace of process ``process_index`` for the ``run``-th run in ``output_dir``:
    ``output_dir/timeline/trace-rank{k}.json`` for the first, ``trace-rank{k}-run{r}.json`` after it."""
    suffix = "" if run == 1 else f"-run{run}"
    return os.path.join(output_dir, "timeline", f"trace-rank{process_index}{suffix}.json")


def new_trace_path(output_dir: str, process_index: int) -> str:
    """The trace file of a run starting now: the first :func:`trace_path` that does not exist yet, so a resumed run
    keeps the trace of the run it resumes."""
    run = 1
    while os.path.exists(trace_path(output_dir, process_index, run)):
        run += 1
    return trace_path(output_dir, process_index, run)


class TraceWriter:
    """Writes one process's timeline to its trace file (at every checkpoint and when ``train()`` ends), best effort:
    the first of ``output_dir/timeline/trace-rank{k}.json``, ``trace-rank{k}-run2.json``, ... that did not exist when
    it first wrote there, so a resumed run keeps the earlier run's trace. A failure (a full disk, no permission) is a
    warning, once per distinct failure, never an error: the run and its checkpoints matter more than its trace."""

    def __init__(self, recorder: TimelineRecorder):
        self.recorder = recorder
        self._file: tuple[str, str] | None = None
        """(output_dir, the trace file this writer writes in it)."""
        self._warned: set[str] = set()

    def write(self, output_dir: str, process_index: int) -> str | None:
        """Write the recorder's spans (when it is enabled); returns the path, or None."""
        if not self.recorder.enabled:
            return None
        path = None
        try:
            if self._file is None or self._file[0] != output_dir:
                self._file = (output_dir, new_trace_path(output_dir, process_index))
            path = self._file[1]
            return self.recorder.write_chrome_trace(path, process_index)
        except Exception as error:  # noqa: BLE001 - best effort, reported
            message = f"{type(error).__name__}: {error}"
            if message not in self._warned:  # once per distinct failure, not at every checkpoint
                self._warned.add(message)
                logger.warning(
                    "Could not write the timeline trace %s (%s); training goes on without it. Make "
                    "output_dir/timeline writable, or set timeline=False.",
                    path or os.path.join(output_dir, "timeline"),
                    message,
                )
            return None


# ---- the open batch span of the calling thread ---------------------------------------------------------------------
_open = threading.local()


@contextlib.contextmanager
def batch_span(recorder: TimelineRecorder, lane: str, name: str = BATCH_SPAN, **args):
    """Record the with-block as a span on ``lane`` and make it the calling thread's open batch span: spans recorded
    by :func:`record_in_batch_span` inside the block (from backends and rollouts, which do not hold the recorder) go
    to ``recorder`` on ``lane`` with the same ``args``. Yields ``args``, which the block may fill in. The span itself
    also carries the calling thread's CPU seconds in the block (:data:`THREAD_CPU_ARG`)."""
    previous = getattr(_open, "context", None)
    _open.context = (recorder, lane, args)
    cpu_start, start = time.thread_time(), time.perf_counter()
    try:
        yield args
    finally:
        _open.context = previous
        own = {**args, THREAD_CPU_ARG: time.thread_time() - cpu_start}  # the batch's own: not its parts'
        recorder.record(lane, name, start, time.perf_counter(), own)


def record_in_batch_span(name: str, start: float, end: float, **args) -> None:
    """Record ``[start, end]`` as a part of the calling thread's open batch span (see :func:`batch_span`); a no-op
    when none is open (a backend used outside the batch producer)."""
    context = getattr(_open, "context", None)
    if context is not None:
        recorder, lane, batch_args = context
        recorder.record(lane, name, start, end, {**batch_args, **args})


# ---- the training thread's steps ---------------------------------------------------------------------------------
class TrainingStepTimeline(TrainerCallback):
    """Records the trainer's optimizer steps from transformers' callback events: ``step`` (``on_step_begin`` to
    ``on_step_end``), in it ``forward/backward`` per micro-step (from the moment its inputs are ready, which the
    trainer reports with :meth:`inputs_ready`, to the end of the micro-step) and ``optimizer step`` (gradient
    clipping is before it, the learning-rate scheduler after it). The trainer reports the batch being trained with
    :meth:`batch_taken`, so the spans carry its index, the version that generated it and its staleness."""

    def __init__(self, recorder: TimelineRecorder):
        self.recorder = recorder
        self._step_start: float | None = None
        self._inputs_ready: float | None = None
        self._pre_optimizer: float | None = None
        self._batch: dict[str, int] = {}

    @property
    def batch(self) -> dict[str, int]:
        """``{"batch": index, "version": version}`` of the batch being trained (empty before the first)."""
        return dict(self._batch)

    def batch_taken(self, index: int, version: int) -> None:
        """The trainer took generation batch ``index``, generated by weights of ``version``."""
        self._batch = {"batch": index, "version": version}

    def inputs_ready(self) -> None:
        """The current micro-step's inputs are ready: its forward and backward start now."""
        self._inputs_ready = time.perf_counter()

    def _args(self, state) -> dict[str, int]:
        args = {"step": state.global_step + 1, **self._batch}
        if "version" in self._batch:
            args["staleness"] = state.global_step - self._batch["version"]
        return args

    def _end_micro_step(self, state) -> None:
        if self._inputs_ready is not None:
            self.recorder.record(
                TRAINING_LANE, "forward/backward", self._inputs_ready, time.perf_counter(), self._args(state)
            )
            self._inputs_ready = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_substep_end(self, args, state, control, **kwargs):
        self._end_micro_step(state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._end_micro_step(state)
        self._pre_optimizer = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._pre_optimizer is not None:
            self.recorder.record(
                TRAINING_LANE, "optimizer step", self._pre_optimizer, time.perf_counter(), self._args(state)
            )
            self._pre_optimizer = None

    def on_step_end(self, args, state, control, **kwargs):
        # global_step was incremented before on_step_end: the step just taken produced version global_step
        if self._step_start is not None:
            step_args = {"step": state.global_step, **self._batch}
            if "version" in self._batch:
                step_args["staleness"] = state.global_step - 1 - self._batch["version"]
            self.recorder.record(TRAINING_LANE, STEP_SPAN, self._step_start, time.perf_counter(), step_args)
            self._step_start = None
