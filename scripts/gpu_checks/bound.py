"""Which limit bound a step: each thread's CPU seconds against the step's wall seconds, and on a GPU the device's
busy seconds in one profiled step (:class:`.profiling.StepProfiler`: ``torch.profiler``, its kernels per stream); the
rule is :data:`BOUND_RULE` (:func:`bound_by`). No torch here: the parent process reads the rule for its report."""

from __future__ import annotations

#: A limit bound the step when it was busy for at least this share of the step's wall seconds.
BOUND_SHARE = 0.8

BOUND_RULE = (
    "Per run, over its timed steps: S = wall seconds per step; T = the training (main) thread's CPU seconds per step "
    "and G = the generation thread's (time.thread_time() read in each thread: the main thread's between step ends, "
    "the generation thread's over its batch spans, shared out over the steps by when it was busy); on a GPU, D = "
    "the device's busy seconds in one profiled steady step (the union of every stream's kernels and copies, from "
    "torch.profiler) over that step's wall seconds. The step was bound by: 'gpu' when D >= 0.8 of the step (tested "
    "first: CUDA's synchronizations spin, so a thread waiting for the device counts CPU time); else "
    "'generator_python' or 'trainer_python' when that thread's CPU time is >= 0.8 S (the larger, if both); else "
    "'both_pythons' when G + T >= 0.8 S (the two threads ran one after the other: the GIL, or too few cores); else "
    "'waiting' (neither thread nor the device was busy most of the step: the threads waited for each other, a lock, "
    "a weight load or I/O). On CPU there is no D, and a thread's CPU time includes its torch ops (one intra-op thread "
    "each). GRPOTrainer has one thread: its generation and training are T."
)


def bound_by(
    step_seconds: float | None,
    trainer_cpu: float | None,
    generator_cpu: float | None,
    device_busy_share: float | None,
    cuda: bool,
) -> dict:
    """What bound the step, by :data:`BOUND_RULE`: ``{"by", "shares": {...}}`` (``by`` None, with ``why``, when the
    figures the rule needs are missing)."""
    shares = {
        "device_busy": device_busy_share,
        "trainer_cpu": trainer_cpu / step_seconds if trainer_cpu is not None and step_seconds else None,
        "generator_cpu": generator_cpu / step_seconds if generator_cpu is not None and step_seconds else None,
    }
    trainer, generator = shares["trainer_cpu"], shares["generator_cpu"]
    if trainer is None:
        return {"by": None, "why": "no step timed, or no CPU time measured", "shares": shares}
    if cuda and device_busy_share is None:
        return {"by": None, "why": "no device busy time (the profiled step failed: see profile)", "shares": shares}
    if cuda and device_busy_share >= BOUND_SHARE:
        by = "gpu"
    elif max(trainer, generator or 0.0) >= BOUND_SHARE:
        by = "generator_python" if generator is not None and generator > trainer else "trainer_python"
    elif generator is not None and trainer + generator >= BOUND_SHARE:
        by = "both_pythons"
    else:
        by = "waiting"
    return {"by": by, "shares": shares}


# ---- the profiled step ----------------------------------------------------------------------------------------------
#: Chrome-trace categories of the device's work in a torch.profiler trace.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_busy(events: list[dict]) -> dict:
    """Busy seconds of the device in a torch.profiler Chrome trace: per stream and in all (the union of every
    stream's kernels, copies and fills: two streams running at once count once), and how many there were."""
    intervals: dict[str, list[tuple[float, float]]] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in DEVICE_CATEGORIES:
            stream = str((event.get("args") or {}).get("stream", "?"))
            intervals.setdefault(stream, []).append((event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6))
    every = [interval for spans in intervals.values() for interval in spans]
    return {
        "busy_seconds": union_length(every),
        "streams": {stream: union_length(spans) for stream, spans in sorted(intervals.items())},
        "operations": len(every),
    }


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
