"""Timings of device work that never wait for the device: read when they are logged.

:class:`IntervalTimer` times work on a device: on CUDA, a pair of events recorded on the current stream around the
work, read (``elapsed_time``) only when the value is logged, after the end event is done; on other devices, where the
host runs the work itself, the wall-clock time around it. The seconds are the device time between the work's first
and last kernel on the stream, not the time the host spent launching them. Both threads use it (the loss's
``a3po/prox_time``, a weight publication's ``async/weight_sync_time``); :mod:`a3po_trl.metrics.deferred` turns the
:class:`DeferredSeconds` it returns into floats when the trainer logs.
"""

from __future__ import annotations

import contextlib
import time

import torch


class DeferredSeconds:
    """Seconds measured by an :class:`IntervalTimer`, read when logged (:meth:`seconds`)."""

    def __init__(self, host_seconds: float = 0.0, events: list | None = None):
        self.host_seconds = host_seconds
        self.events = events or []

    def seconds(self) -> float:
        """The total: for CUDA event pairs, waits for each end event (log time only) and sums ``elapsed_time``."""
        total = self.host_seconds
        for start, end in self.events:
            end.synchronize()  # this event only, not the device; done already at log time in practice
            total += start.elapsed_time(end) / 1000.0
        return total

    def __float__(self) -> float:
        return self.seconds()

    def __add__(self, other: DeferredSeconds | float) -> DeferredSeconds:
        """The two totals together, still unread (seconds accumulated over several publications)."""
        if isinstance(other, DeferredSeconds):
            return DeferredSeconds(self.host_seconds + other.host_seconds, self.events + other.events)
        if isinstance(other, (int, float)):
            return DeferredSeconds(self.host_seconds + other, list(self.events))
        return NotImplemented

    __radd__ = __add__


class IntervalTimer:
    """Accumulates the time of intervals of device work without waiting for the device (see the module's doc)."""

    def __init__(self):
        self._host_seconds = 0.0
        self._events: list = []

    @contextlib.contextmanager
    def time(self, device: torch.device):
        """Time the work queued in the ``with`` block on ``device`` (its current stream on CUDA)."""
        if torch.device(device).type == "cuda":
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                yield
            finally:
                end.record(stream)
                self._events.append((start, end))
        else:
            begin = time.perf_counter()
            try:
                yield
            finally:
                self._host_seconds += time.perf_counter() - begin

    def take(self) -> DeferredSeconds | float:
        """The time since the last ``take`` (a float when nothing ran on CUDA), and start again from zero."""
        host, events = self._host_seconds, self._events
        self._host_seconds, self._events = 0.0, []
        return DeferredSeconds(host, events) if events else host
