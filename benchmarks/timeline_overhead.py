"""What recording the timeline costs: per span, per optimizer step, and end to end, timeline on vs off.

    python -m benchmarks.timeline_overhead [--steps 12] [--pairs 3] [--out benchmarks/results/timeline_overhead.json]
    python -m benchmarks.timeline_overhead --smoke      # seconds: every measurement at a tiny size (the test suite's)

Three measurements, reported, never asserted:

- per span: ``TimelineRecorder.record`` (with its lock and the deque append), median over 200,000 calls, on and off;
- spans per optimizer step, counted in a real run of the benchmark's quick shape (the tiny random Llama of
  :mod:`a3po_trl.tasks.tiny_model`, 8 completions of up to 16 tokens per step, ``max_staleness=1``), and the time a
  full trace (50,000 spans) takes to write;
- end to end: the same run with ``timeline=True`` and ``timeline=False``, alternated ``--pairs`` times, median step
  time (the first two steps left out). On a shared 2-core machine this difference is within the noise; the first two
  figures give the bound: spans per step x cost per span / step time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

from benchmarks.common.machine import LoadMeter
from benchmarks.common.provenance import provenance, thread_roles
from benchmarks.common.tiny import tiny_trainer


def per_span_seconds(enabled: bool, calls: int = 200_000) -> float:
    from a3po_trl.timeline import TRAINING_LANE, TimelineRecorder

    recorder = TimelineRecorder(enabled=enabled)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(calls // 5):
            recorder.record(TRAINING_LANE, "step", 0.0, 1.0, {"step": i, "version": i, "staleness": 1})
        samples.append((time.perf_counter() - start) / (calls // 5))
    return statistics.median(samples)


def trace_write_seconds(spans: int | None = None) -> float:
    """Seconds to write a trace of ``spans`` spans (default: a full recorder, ``MAX_SPANS``)."""
    from a3po_trl.timeline import GENERATION_LANE, MAX_SPANS, TimelineRecorder

    recorder = TimelineRecorder()
    for i in range(spans or MAX_SPANS):
        recorder.record(GENERATION_LANE, "generation", i, i + 0.5, {"batch": i, "version": i, "staleness": 1})
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        recorder.write_chrome_trace(os.path.join(folder, "trace.json"))
        return time.perf_counter() - start


def run(timeline: bool, steps: int) -> tuple[float, int]:
    """Median step time (s) of one run (the first two steps left out), and the spans it recorded."""
    shape = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=16)  # compare --quick's
    settings = dict(max_steps=steps, max_staleness=1, learning_rate=1e-2, logging_steps=1, seed=0, timeline=timeline)
    with tiny_trainer(num_prompts=16, **shape, **settings) as trainer:
        trainer.train()
        times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][2:]
        return statistics.median(times), len(trainer.timeline.spans())


def measure(calls: int, trace_spans: int, steps: int, pairs: int) -> dict:
    """The three measurements (see the module's docstring), with their provenance block."""
    import torch

    started, meter, process = time.time(), LoadMeter().start(), torch.get_num_threads()
    results = {
        "load_average_before": os.getloadavg(),
        "record_seconds_on": per_span_seconds(True, calls),
        "record_seconds_off": per_span_seconds(False, calls),
        f"trace_write_seconds_{trace_spans // 1000}k_spans": trace_write_seconds(trace_spans),
    }
    on, off, spans = [], [], 0
    for _ in range(pairs):
        step_time, spans = run(True, steps)
        on.append(step_time)
        off.append(run(False, steps)[0])
    results.update(
        spans_per_step=spans / steps,
        step_time_on=statistics.median(on),
        step_time_off=statistics.median(off),
        step_times_on=on,
        step_times_off=off,
        load_average_after=os.getloadavg(),
    )
    results["recording_seconds_per_step"] = results["spans_per_step"] * results["record_seconds_on"]
    results["recording_fraction_of_step"] = results["recording_seconds_per_step"] / results["step_time_off"]
    # the trainer's training and generation threads are left at PyTorch's setting: the process's
    threads = thread_roles(process, process, process)
    results["provenance"] = provenance(started, threads, meter.stop()["foreign_cpu_frac"])
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--smoke", action="store_true", help="every measurement at a tiny size: 3 steps, 1 pair")
    options = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from a3po_trl.timeline import MAX_SPANS

    sizes = dict(calls=200_000, trace_spans=MAX_SPANS, steps=options.steps, pairs=options.pairs)
    if options.smoke:
        sizes = dict(calls=2_000, trace_spans=1_000, steps=3, pairs=1)
    logging.disable(logging.WARNING)  # the runs' warnings (tiny model, CPU) would bury the results
    try:
        results = measure(**sizes)
    finally:
        logging.disable(logging.NOTSET)
    text = json.dumps(results, indent=2)
    print(text)
    if options.out:
        with open(options.out, "w") as file:
            file.write(text + "\n")
    return results


if __name__ == "__main__":
    main()
