"""Metrics that stay on the device until the trainer logs them, and timings that never wait for the device.

Reading a CUDA tensor on the host (``.item()``, ``.tolist()``, ``float(t)``, ``if t:``) waits until the training
stream has run every kernel queued before it: the training thread stops launching, and the overlap with the
generation thread shrinks by the time it waits. So the loss's metrics are appended to the trainer's ``_metrics`` as
0-dim device tensors, and :func:`resolve_metrics` turns them into floats when ``log`` averages them: one transfer per
device and dtype per logging step instead of one per value per micro-step.

A tensor entry that is NaN means *no value at this micro-step* (for instance the behavior mismatch of a micro-batch
without on-policy tokens): it is dropped, as if it had never been appended, and a name left without values is not
logged. (GRPOTrainer's ``log`` skips NaN values too; a float entry, GRPOTrainer's own, is left as it is.)

:class:`IntervalTimer` times work on the device the same way: on CUDA, a pair of events recorded on the current
stream around the work, read (``elapsed_time``) only when the value is logged, after the end event is done; on other
devices, where the host runs the work itself, the wall-clock time around it. The seconds are the device time between
the work's first and last kernel on the training stream, not the time the host spent launching them.
"""

from __future__ import annotations

import contextlib
import math
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


def nan_if_empty(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``, NaN (no value) where ``count`` is 0, computed on the device."""
    return torch.where(count > 0, total / count.clamp(min=1e-30), torch.full_like(total, math.nan))


def resolve_metrics(metrics: dict[str, list]) -> None:
    """Turn the device tensors and :class:`DeferredSeconds` of ``metrics`` (``name -> values``, the trainer's
    ``_metrics[mode]``) into floats, in place: one transfer per device and dtype. NaN tensors are dropped (no value),
    and a name left without values by that is removed."""
    groups: dict[tuple, list[tuple[str, int]]] = {}
    tensors: dict[tuple, list[torch.Tensor]] = {}
    for name, values in metrics.items():
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                key = (value.device, value.dtype)
                groups.setdefault(key, []).append((name, i))
                tensors.setdefault(key, []).append(value.detach().reshape(()))
            elif isinstance(value, DeferredSeconds):
                values[i] = value.seconds()
    dropped: set[tuple[str, int]] = set()
    for key, places in groups.items():
        for (name, i), number in zip(places, torch.stack(tensors[key]).tolist()):
            if isinstance(number, float) and math.isnan(number):
                dropped.add((name, i))
            metrics[name][i] = number
    for name in {name for name, _ in dropped}:
        kept = [v for i, v in enumerate(metrics[name]) if (name, i) not in dropped]
        if kept:
            metrics[name] = kept
        else:
            del metrics[name]
