"""Whether the generation thread's overlap with training pays: a run whose threads take turns says so, once.

Where Python rather than compute bounds both threads (a tiny model on CPU, a GPU at small scale launching one kernel
at a time), one interpreter lock serialises them: generation is not hidden behind training, and every hand-off of the
lock adds to the step, so the asynchronous step can take longer than the two threads' work done one after the other
(what ``GRPOTrainer`` does). The wall-clock spans of the timeline cannot show it: under contention both threads' spans
stretch, and their sum always exceeds the step. Each thread's CPU time does not stretch (a thread waiting for the lock
is not running), so it measures each thread's own work:

- S: wall seconds per step over a window of steps; T: the training (main) thread's CPU seconds per step; G: the
  generation thread's (read from the main thread through its CPU clock, ``time.pthread_getcpuclockid``);
- the overlap costs more than it hides when ``S >= SLOWER * (G + T)`` (the step takes longer than the two threads'
  work one after the other) while ``G + T >= BUSY * S`` (the threads' own work fills most of the step: it is
  Python-bound, not waiting for a device, whose time neither clock counts).

The figures count a thread's torch operations only where they run on that thread: kernel launches on a GPU, and on
CPU the ops of a thread with one intra-op thread (``generation_num_threads=1``, ``training_num_threads=1``); with more
intra-op threads the work runs on worker threads, the threads' CPU time undercounts it, and the rule stays silent. A
GPU-bound step (the device's time fills it) has ``G + T`` far under ``S`` and is not reported, provided the threads
sleep while they wait for the device. CUDA's synchronizations spin by default (``cudaDeviceScheduleAuto`` busy-waits
while a process has fewer contexts than cores): a thread blocked in ``.item()``, ``synchronize()`` or a blocking copy
counts CPU time while the device works, so on a GPU a device-bound step can read as Python-bound and the warning can
fire where the overlap does hide work. Neither clock tells spinning from work; on a GPU the warning is a hint, to be
confirmed by ``scripts/gpu_check.py``'s ``bound`` (which profiles the device's busy share first, docs/GPU.md) before
acting on it. Where two cores run the threads at once, ``S`` is under ``G + T``: not reported either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

#: The step takes at least this much longer than the two threads' own work one after the other.
SLOWER = 1.05
#: The two threads' own work fills at least this share of the step (Python-bound, not waiting for a device).
BUSY = 0.5
#: Steps per window (the first generation batch, generated while the trainer waited, is left out).
WINDOW_STEPS = 8


def thread_cpu_clock(thread: threading.Thread | None) -> Callable[[], float] | None:
    """A reader of ``thread``'s CPU seconds from any thread (Linux and other POSIX systems with per-thread CPU
    clocks); None where there is none, or the thread is not running. The clock is taken while the thread runs (for a
    thread that has ended, ``pthread_getcpuclockid`` may name the calling thread's clock instead): once it ends,
    reading it raises ``OSError``."""
    if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid") or not thread.is_alive():
        return None
    try:
        clock = time.pthread_getcpuclockid(thread.ident)
        time.clock_gettime(clock)
    except (OSError, OverflowError):
        return None
    if not thread.is_alive():  # it may have ended while the clock was taken: the clock may not be its own
        return None
    return lambda: time.clock_gettime(clock)


def overlap_costs(step_seconds: float, trainer_cpu: float, generator_cpu: float) -> bool:
    """The rule (per step, over a window): the step is Python-bound and longer than both threads' work in turn."""
    work = trainer_cpu + generator_cpu
    return step_seconds > 0 and work >= BUSY * step_seconds and step_seconds >= SLOWER * work


def overlap_message(steps: tuple[int, int], step_seconds: float, trainer_cpu: float, generator_cpu: float) -> str:
    return (
        f"The generation thread is not hiding generation behind training: over steps {steps[0]}-{steps[1]} a step "
        f"took {step_seconds:.2f} s, while the training thread's own work was {trainer_cpu:.2f} s and the generation "
        f"thread's {generator_cpu:.2f} s per step (CPU time), {trainer_cpu + generator_cpu:.2f} s one after the "
        "other. The two threads take turns on Python's interpreter lock (a small model, or a GPU launching small "
        "kernels), and the overlap costs more than it hides: GRPOTrainer's synchronous step is likely faster here. "
        "Generate with vLLM (use_vllm=True, vllm_mode='colocate' or 'server': its engine keeps Python off the "
        "per-token path), or set async_generation=False; on a CPU, generation_process=True generates in a process of "
        "its own, off this interpreter (docs/USAGE.md). See docs/GPU.md, 'Which generation path on a GPU'. On a GPU, "
        "first rule out a device-bound step: a thread waiting for the GPU spins in CUDA's synchronizations and counts "
        "CPU time too (scripts/gpu_check.py's 'bound' profiles the device)."
    )


class OverlapMonitor(TrainerCallback):
    """Applies the rule to consecutive windows of :data:`WINDOW_STEPS` steps of a ``train()`` call with a
    generation thread, from the second generation batch on, and logs :func:`overlap_message` at the first window it
    holds in (once per call, on the main process); silent with ``generation_process`` (the generation thread only
    coordinates there, and the process's CPU is on no clock it reads). ``producer``: returns the trainer's batch
    producer now (or None);
    ``is_main_process``: whether this process logs."""

    def __init__(self, producer: Callable[[], object], is_main_process: Callable[[], bool]):
        self._producer = producer
        self._is_main_process = is_main_process
        self.warned: tuple | None = None
        """The figures of the window that was reported (``(steps, S, T, G)``), if any."""
        self._done = False
        """Nothing more to measure in this call: reported, no per-thread CPU clock, or the thread ended."""
        self._start: tuple | None = None
        self._generator_clock: Callable[[], float] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.warned, self._done, self._start, self._generator_clock = None, False, None, None

    def on_step_end(self, args, state, control, **kwargs):
        producer = self._producer()
        if self._done or producer is None or not getattr(producer, "asynchronous", False):
            return
        if getattr(args, "generation_process", False):  # generation runs in a process whose CPU no clock here reads
            return
        if self._generator_clock is None:
            if producer.consumed < 2:  # the first batch was generated while the trainer waited: not a turn
                return
            self._generator_clock = thread_cpu_clock(producer.thread)
            if self._generator_clock is None:
                self._done = True  # no per-thread CPU clock here: nothing to measure
                return
        try:
            now = (state.global_step, time.perf_counter(), time.thread_time(), self._generator_clock())
        except OSError:  # the generation thread ended (its last batch is done): nothing more to measure
            self._done = True
            return
        if self._start is None:
            self._start = now
            return
        steps = now[0] - self._start[0]
        if steps < WINDOW_STEPS:
            return
        step_seconds, trainer_cpu, generator_cpu = ((now[i] - self._start[i]) / steps for i in (1, 2, 3))
        self._start = now
        if overlap_costs(step_seconds, trainer_cpu, generator_cpu):
            window = (now[0] - steps + 1, now[0])
            self.warned, self._done = (window, step_seconds, trainer_cpu, generator_cpu), True
            if self._is_main_process():
                logger.warning(overlap_message(window, step_seconds, trainer_cpu, generator_cpu))
