"""Devices as the generator uses them: always with an explicit index, compared as memory, waited for per stream.

accelerate gives a one-process CUDA run ``torch.device("cuda")``, with no index, and ``torch.cuda.set_device``,
``torch.cuda.Stream`` and per-device stream queries refuse or reinterpret such a device; several processes get
``cuda:N``. :func:`explicit_device` turns every device the generator is given into the indexed form, once, where the
backend is built, so nothing downstream has to care.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def explicit_device(device: torch.device | str | int, current_index: Callable[[], int] | None = None) -> torch.device:
    """``device`` with an explicit index where its type has several devices: ``cuda`` becomes ``cuda:<current
    device>`` (``current_index`` defaults to ``torch.cuda.current_device``; the same for other accelerator types
    through their ``torch`` module); ``cpu`` and ``meta`` stay as they are (one memory each)."""
    device = torch.device(device)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    if current_index is None:
        backend = getattr(torch, device.type, None)
        if backend is None or not hasattr(backend, "current_device"):
            raise ValueError(
                f"Cannot tell which {device.type} device {device} means: give it an index, e.g. '{device.type}:0'."
            )
        current_index = backend.current_device
    return torch.device(device.type, current_index())


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same memory: ``cpu`` and ``cpu:0`` are; ``cuda`` means the current CUDA device."""
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    return explicit_device(a).index == explicit_device(b).index


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (CPU for a module without parameters)."""
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def cuda_devices(devices: Iterable[torch.device]) -> set[torch.device]:
    """The CUDA devices among ``devices``, each once, with an explicit index."""
    return {explicit_device(d) for d in devices if torch.device(d).type == "cuda"}


def wait_for_copies(devices: Iterable[torch.device]) -> None:
    """Block until the work queued on the calling thread's current stream of every CUDA device in ``devices`` is
    done: asynchronous copies into or out of a buffer another thread reads next (the generation thread has its own
    stream; the main thread writes with the default one). No-op for other devices."""
    for device in cuda_devices(devices):
        torch.cuda.current_stream(device).synchronize()


class StreamFence:
    """A point in the work queued so far on the calling thread's current stream of each CUDA device named: events
    recorded there, which another thread's stream can wait for without the host waiting (:meth:`wait_on_device`),
    or a host thread that reads the memory itself can wait for (:meth:`wait_on_host`). The weight staging fences its
    buffers with these both ways: the generation thread's stream waits for the copies that filled a version, and the
    next fill of the same buffers waits for the generation thread's copies out of them. No CUDA device named: an
    empty fence (the host ran the work itself), and both waits are no-ops."""

    def __init__(self, events: list | None = None):
        self.events = events or []

    @classmethod
    def record(cls, devices: Iterable[torch.device]) -> StreamFence:
        """Events on the calling thread's current stream of every CUDA device in ``devices`` (each once)."""
        events = []
        for device in cuda_devices(devices):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return cls(events)

    def wait_on_device(self, devices: Iterable[torch.device]) -> None:
        """Make the calling thread's current stream of every CUDA device in ``devices`` wait for the fence before it
        runs what is queued next (the host does not wait)."""
        if not self.events:
            return
        for device in cuda_devices(devices):
            stream = torch.cuda.current_stream(device)
            for event in self.events:
                stream.wait_event(event)

    def wait_on_host(self) -> None:
        """Block the calling thread until the fenced work is done (for a reader that reads host memory itself)."""
        for event in self.events:
            event.synchronize()

    def __bool__(self) -> bool:
        return bool(self.events)


#: The priority of the generation thread's CUDA stream: CUDA runs a lower number first, and torch maps -1 to its
#: high-priority streams. The generator's decode steps are many small kernels that the next token waits on; at the
#: training stream's priority (0) they queue behind training's large kernels whenever the two threads overlap.
GENERATION_STREAM_PRIORITY = -1


def generation_stream(device: torch.device) -> torch.cuda.Stream:
    """The generation thread's own CUDA stream on ``device`` (an indexed CUDA device), at high priority."""
    return torch.cuda.Stream(device, priority=GENERATION_STREAM_PRIORITY)
