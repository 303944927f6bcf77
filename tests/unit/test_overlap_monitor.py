"""The warning of a run whose generation thread takes turns with training instead of overlapping it (issue 57): the
rule on each thread's CPU time, the windows it is read over, once per call, and a real thread's CPU clock."""

import logging
import threading
import time
from types import SimpleNamespace

import pytest

from a3po_trl.timeline import overlap
from a3po_trl.timeline.overlap import OverlapMonitor, overlap_costs, thread_cpu_clock


@pytest.mark.parametrize(
    "step, trainer, generator, costs",
    [
        (4.5, 2.2, 1.5, True),  # the launch-bound proxy: the step longer than both threads' work in turn
        (12.0, 12.0, 3.4, False),  # two cores, one thread each: both run at once, the step under their sum
        (10.0, 1.0, 1.5, False),  # GPU-bound: the device fills the step, the threads' clocks do not see it
        (3.8, 2.2, 1.5, False),  # within 5% of the work in turn: not worth a warning
        (0.0, 0.0, 0.0, False),
    ],
)
def test_the_rule_reports_a_python_bound_step_longer_than_both_threads_in_turn(step, trainer, generator, costs):
    assert overlap_costs(step, trainer, generator) is costs


class Clocks:
    """The wall clock, the training thread's CPU clock and the generation thread's, advanced by hand."""

    def __init__(self, monkeypatch):
        self.wall = self.trainer = self.generator = 0.0
        monkeypatch.setattr(overlap.time, "perf_counter", lambda: self.wall)
        monkeypatch.setattr(overlap.time, "thread_time", lambda: self.trainer)
        monkeypatch.setattr(overlap, "thread_cpu_clock", lambda thread: lambda: self.generator)

    def step(self, wall, trainer, generator):
        self.wall, self.trainer, self.generator = self.wall + wall, self.trainer + trainer, self.generator + generator


def drive(monitor, clocks, producer, steps, per_step, first=1):
    state = SimpleNamespace(global_step=first - 1)
    for _ in range(steps):
        clocks.step(*per_step)
        state.global_step += 1
        producer.consumed = 1 + state.global_step // 2  # a batch feeds two steps
        monitor.on_step_end(None, state, None)
    return state


def test_the_monitor_warns_once_from_the_second_batch_over_a_window(monkeypatch, caplog):
    clocks = Clocks(monkeypatch)
    producer = SimpleNamespace(asynchronous=True, consumed=0, thread=object())
    monitor = OverlapMonitor(lambda: producer, lambda: True)
    monitor.on_train_begin(None, None, None)
    with caplog.at_level(logging.WARNING, logger=overlap.__name__):
        drive(monitor, clocks, producer, 1 + overlap.WINDOW_STEPS - 1, (4.5, 2.2, 1.5))
        assert monitor.warned is None  # the window starts with the second batch: one step short of a window
        drive(monitor, clocks, producer, 12, (4.5, 2.2, 1.5), first=overlap.WINDOW_STEPS + 1)
    (window, step, trainer, generator) = monitor.warned
    assert window == (3, 10) and step == pytest.approx(4.5) and generator == pytest.approx(1.5)
    warnings = [r.getMessage() for r in caplog.records if "not hiding generation" in r.getMessage()]
    assert len(warnings) == 1  # once per train() call
    for words in ("over steps 3-10 a step took 4.50 s", "2.20 s", "1.50 s", "use_vllm=True", "async_generation=False",
                  "generation_process=True"):  # fmt: skip
        assert words in warnings[0], words
    monitor.on_train_begin(None, None, None)  # a new train() call may warn again
    assert monitor.warned is None


def test_the_monitor_stays_silent_where_the_threads_overlap_or_there_is_no_thread(monkeypatch, caplog):
    clocks = Clocks(monkeypatch)
    producer = SimpleNamespace(asynchronous=True, consumed=0, thread=object())
    monitor = OverlapMonitor(lambda: producer, lambda: True)
    with caplog.at_level(logging.WARNING, logger=overlap.__name__):
        drive(monitor, clocks, producer, 40, (12.0, 12.0, 3.4))  # two cores: both threads at once
        assert monitor.warned is None
        inline = SimpleNamespace(asynchronous=False, consumed=5, thread=None)  # async_generation=False
        silent = OverlapMonitor(lambda: inline, lambda: True)
        drive(silent, clocks, inline, 40, (4.5, 3.7, 0.0))
        assert silent.warned is None
    assert not caplog.records


def test_another_threads_cpu_time_is_read_from_its_clock():
    done, go = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        go.set()
        done.wait(10)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        clock = thread_cpu_clock(thread)
        if clock is None:
            pytest.skip("no per-thread CPU clock on this platform")
        go.wait(10)
        assert 0.2 <= clock() < 5.0  # its own CPU time, not this thread's nor the process's
    finally:
        done.set()
        thread.join()
    assert thread_cpu_clock(None) is None
