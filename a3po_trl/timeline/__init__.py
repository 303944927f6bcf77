"""The timeline of the pipeline: both threads' spans on one clock (:mod:`.recorder`), and the picture of its last
steps (:mod:`.plot`, matplotlib, imported only when a picture is drawn)."""

from .recorder import (
    BATCH_SPAN,
    GENERATION_LANE,
    LANES,
    MAX_SPANS,
    STEP_SPAN,
    THREAD_CPU_ARG,
    TRAINING_LANE,
    Span,
    TimelineRecorder,
    TraceWriter,
    TrainingStepTimeline,
    batch_span,
    new_trace_path,
    record_in_batch_span,
    trace_path,
    trace_pid,
)

__all__ = [
    "BATCH_SPAN",
    "GENERATION_LANE",
    "LANES",
    "MAX_SPANS",
    "STEP_SPAN",
    "THREAD_CPU_ARG",
    "TRAINING_LANE",
    "Span",
    "TimelineRecorder",
    "TraceWriter",
    "TrainingStepTimeline",
    "batch_span",
    "new_trace_path",
    "record_in_batch_span",
    "trace_path",
    "trace_pid",
]
