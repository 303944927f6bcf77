"""Soak test: hundreds of asynchronous A-3PO steps on a tiny model, watching memory, threads and file handles.

    python -m benchmarks.soak --steps 400 --max-staleness 4 --out soak.json

Prints one line per sample and a summary: resident memory after warm-up and at the end, the growth between them,
the largest queue depth, and the thread and open-file counts before, during and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from transformers import TrainerCallback

from benchmarks.common import internals
from benchmarks.common.tiny import tiny_trainer


def resident_memory_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc; falls back to peak RSS elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def open_file_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


class _Probe(TrainerCallback):
    def __init__(self, trainer, every: int, verbose: bool):
        self.trainer, self.every, self.verbose = trainer, every, verbose
        self.samples = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
        producer = internals.batch_producer(self.trainer)
        sample = {
            "step": state.global_step,
            "rss_mb": round(resident_memory_mb(), 1),
            "threads": threading.active_count(),
            "open_files": open_file_count(),
            "queue_depth": internals.queue_depth(producer) if producer else 0,
            "time": round(time.perf_counter(), 2),
        }
        self.samples.append(sample)
        if self.verbose:
            print(json.dumps(sample), flush=True)


def run_soak(steps: int = 400, max_staleness: int = 4, every: int = 10, warmup_fraction: float = 0.25, verbose=True):
    """Train a tiny model for `steps` asynchronous steps and return the memory/thread/file report."""
    threads_before, files_before = threading.active_count(), open_file_count()
    shape = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8)  # one prompt per step
    settings = dict(max_steps=steps, max_staleness=max_staleness, logging_steps=every, bf16=False, learning_rate=1e-3)
    with tiny_trainer(num_prompts=64, **shape, **settings) as trainer:
        probe = _Probe(trainer, every, verbose)
        trainer.add_callback(probe)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        counts = internals.producer_counts(internals.batch_producer(trainer))
    samples = probe.samples
    warm = samples[max(1, int(len(samples) * warmup_fraction)) - 1]
    second_half = samples[len(samples) // 2 :]
    report = {
        "steps": steps,
        "max_staleness": max_staleness,
        "seconds": round(seconds, 1),
        "rss_after_warmup_mb": warm["rss_mb"],
        "rss_end_mb": samples[-1]["rss_mb"],
        "rss_growth_after_warmup_mb": round(samples[-1]["rss_mb"] - warm["rss_mb"], 1),
        "rss_slope_second_half_mb_per_100_steps": round(_slope(second_half) * 100, 2),
        "max_queue_depth": counts["max_queue_depth"],
        "queue_bound": counts["queue_bound"],
        "batches_produced": counts["produced"],
        "batches_consumed": counts["consumed"],
        "threads_before": threads_before,
        "threads_during_max": max(s["threads"] for s in samples),
        "threads_after": threading.active_count(),
        "open_files_before": files_before,
        "open_files_during_max": max(s["open_files"] for s in samples),
        "open_files_after": open_file_count(),
        "samples": samples,
    }
    return report


def _slope(samples) -> float:
    """Least-squares slope of RSS (MiB) against step."""
    if len(samples) < 2:
        return 0.0
    xs = [s["step"] for s in samples]
    ys = [s["rss_mb"] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--every", type=int, default=10, help="sample every N optimizer steps")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    options = parser.parse_args()
    report = run_soak(options.steps, options.max_staleness, options.every)
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if options.out:
        with open(options.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
