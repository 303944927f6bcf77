"""Metrics that stay on the device until the trainer logs them, and timings that never wait for the device.

Reading a CUDA tensor on the host (``.item()``, ``.tolist()``, ``float(t)``, ``if t:``) waits until the training
stream has run every kernel queued before it: the training thread stops launching, and the overlap with the
generation thread shrinks by the time it waits. So the loss's metrics are appended to the trainer's ``_metrics`` as
0-dim device tensors, and :func:`resolve_metrics` turns them into floats when ``log`` averages them: one transfer per
device and dtype per logging step instead of one per value per micro-step.

A tensor entry that is NaN means *no value at this micro-step* (for instance the behavior mismatch of a micro-batch
without on-policy tokens): it is dropped, as if it had never been appended, and a name left without values is not
logged. (GRPOTrainer's ``log`` skips NaN values too; a float entry, GRPOTrainer's own, is left as it is.)

:class:`~a3po_trl.runtime.timing.IntervalTimer` times work on the device the same way; its
:class:`~a3po_trl.runtime.timing.DeferredSeconds` are read here too.
"""

from __future__ import annotations

import math

import torch

from ..runtime.timing import DeferredSeconds


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
