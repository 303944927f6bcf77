"""The versioned staging store: the trainer's trainable weights, one version at a time, for the generation thread.

- main thread: :meth:`VersionedWeights.publish` copies a module's trainable weights into a staging buffer set as
  version ``v``, one whole tensor at a time (gathered under ZeRO-3 and FSDP2 by a
  :class:`~a3po_trl.generation.weights.gather.ParameterGather`, on every process together), cast to the generator's
  dtype on the way;
- generation thread: :meth:`VersionedWeights.load_newer` and :meth:`VersionedWeights.holding` hand a backend a
  version's buffers, which the main thread does not overwrite until the backend is done with them.

The store's lock guards only the bookkeeping (which buffer set holds which version, which ones a reader uses, which
one is being written): it is never held across a gather (a collective under sharding), a copy, an allocation or a
backend's load (a file write, an engine's reload). A publication claims a buffer set under the lock, fills it without
it, and publishes it under the lock again; a reader marks a version's set as in use under the lock, loads from it
without it, and releases it. A publication that needs the set a reader uses waits for the reader (on a condition,
the lock released), and a reader that wants a version being written waits for the publication.

On CUDA neither thread's host waits for the other's copies (:class:`~a3po_trl.runtime.devices.StreamFence`): a fill
records an event after its copies on the main thread's stream, and a reader's stream waits for it before loading; a
reader records an event after its load, and the next fill of the same set makes the main thread's stream wait for it
before overwriting the buffers. The training thread queues the copies and goes on (the optimizer step before them and
the copies themselves run on the device meanwhile). A reader that reads the buffers on the host (a file written for a
vLLM server, a checkpoint's copy, an engine loading on streams of its own) waits for the fill's event on its own host
thread instead.

Each version is one allocation (:class:`StagingLayout`): a flat byte buffer with one view per weight, each at an
offset aligned to :data:`STAGING_ALIGNMENT`, so a version's staged bytes are its weights' bytes in the generator's
dtype (plus at most that alignment per weight). Pinned host memory is pinned by registering that one buffer with
CUDA (``cudaHostRegister``): torch's caching host allocator (``pin_memory=True``) rounds every allocation up to a power
of two, which would make a 7B model's 15.2 GB version take 17.2 GB of page-locked memory, and one allocation per
weight ~1.9x. The buffers live on the generation device (``generate``; vLLM colocated when the memory plan finds
room, see :mod:`.memory_plan`) or in host memory, pinned when the engine is on a GPU, shared when generation runs in
a process of its own (``generation_process``: the process maps each version's buffer). They are allocated at the first
publication and reused; with ``keep_versions`` (``reproducible_generation``) one set per version a later batch may
still need.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...runtime.devices import StreamFence
from ...runtime.timing import DeferredSeconds, IntervalTimer
from .gather import ParameterGather

logger = logging.getLogger(__name__)

STAGING_ALIGNMENT = 256
"""Byte alignment of each weight's view in a version's buffer: what ``cudaMalloc`` guarantees, a multiple of every
dtype's size, so every view is aligned for its dtype and for vectorized copies."""


def full_shape(param: torch.Tensor) -> torch.Size:
    """The whole shape of a parameter, also when ZeRO-3 has partitioned it (``ds_shape``); an FSDP2 ``DTensor``'s
    ``shape`` is its whole shape already."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def aligned(offset: int, alignment: int = STAGING_ALIGNMENT) -> int:
    """``offset`` rounded up to a multiple of ``alignment``."""
    return -(-offset // alignment) * alignment


def packed_bytes(sizes: Iterable[int]) -> int:
    """Bytes of one buffer holding tensors of ``sizes`` bytes one after the other, each at an aligned offset."""
    total = 0
    for size in sizes:
        total = aligned(total) + size
    return total


@dataclass(frozen=True)
class StagingLayout:
    """Shape and dtype of each staged weight (by training-module name), and where a version's buffer lives."""

    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype]
    device: torch.device
    pin_memory: bool = False
    """Page-locked host memory (``device`` is the CPU): copies to and from a GPU run asynchronously and fast."""
    shared_memory: bool = False
    """Host memory another process maps (``device`` is the CPU): a generation process of its own
    (``generation_process``) reads each version where the main thread wrote it, without a copy through a pipe."""

    @classmethod
    def of(cls, module: nn.Module, names: Iterable[str], device, dtype: torch.dtype | None = None, pin_memory=False):
        """The layout of ``module``'s parameters ``names``, whole-shaped (also under ZeRO-3 and FSDP2), in ``dtype``
        (floating ones; ``None``: each parameter's own)."""
        params = dict(module.named_parameters())
        names = list(names)
        return cls(
            shapes={name: full_shape(params[name]) for name in names},
            dtypes={name: staged_dtype(params[name].dtype, dtype) for name in names},
            device=torch.device(device),
            pin_memory=pin_memory,
        )

    def weight_bytes(self, name: str) -> int:
        return self.shapes[name].numel() * self.dtypes[name].itemsize

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each weight's view in a version's buffer (in the layout's order, each aligned)."""
        offsets, end = {}, 0
        for name in self.shapes:
            offsets[name] = aligned(end)
            end = offsets[name] + self.weight_bytes(name)
        return offsets

    @property
    def bytes_per_version(self) -> int:
        """Bytes of one version's buffer: the weights' bytes in their staged dtypes, each at an aligned offset."""
        return packed_bytes(self.weight_bytes(name) for name in self.shapes)

    @property
    def where(self) -> str:
        """Where the buffers live, in words: ``"device cuda:0"``, ``"pinned host memory"`` or ``"host memory"``."""
        if self.device.type != "cpu":
            return f"device {self.device}"
        if self.shared_memory:
            return "shared host memory"
        return "pinned host memory" if self.pin_memory else "host memory"

    def allocate(self) -> dict[str, torch.Tensor]:
        """One version's buffers: one allocation of :attr:`bytes_per_version` bytes (:func:`allocate_flat`), one
        view per weight in its shape and dtype."""
        return self.views(allocate_flat(self.bytes_per_version, self.device, self.pin_memory, self.shared_memory))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """One view per weight, in its shape and dtype, of a version's flat ``uint8`` buffer ``flat`` (of
        :meth:`allocate`, or the same buffer mapped by another process)."""
        views = {}
        for name, offset in self.offsets.items():
            dtype, shape = self.dtypes[name], self.shapes[name]
            views[name] = flat[offset : offset + self.weight_bytes(name)].view(dtype).view(shape)
        return views


def allocate_flat(nbytes: int, device: torch.device, pin_memory: bool = False, shared: bool = False) -> torch.Tensor:
    """A flat ``uint8`` buffer of exactly ``nbytes`` on ``device``; host memory pinned (``pin_memory``) by registering
    it with CUDA (unregistered when the buffer is freed), not through torch's caching host allocator, which rounds
    each allocation up to a power of two; or (``shared``) in shared memory, which another process can map."""
    flat = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    if shared:
        flat.share_memory_()
    if pin_memory and nbytes > 0:
        _host_register(flat.data_ptr(), flat.numel())
        finalizer = weakref.finalize(flat, _host_unregister, flat.untyped_storage(), flat.data_ptr())
        finalizer.atexit = False  # at exit CUDA may be gone; the process's memory goes with it
    return flat


def _host_register(pointer: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``pointer`` for CUDA (``cudaHostRegister``, portable to every device)."""
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 1))  # 1: cudaHostRegisterPortable
    if error != 0:
        raise RuntimeError(
            f"Could not pin {nbytes / 2**30:.2f} GiB of host memory for the weight staging (cudaError {error}): the "
            "node may be short of host memory, or the process may not lock that much (ulimit -l). See the memory "
            "plan in the log."
        )


def _host_unregister(storage, pointer: int) -> None:
    """Undo :func:`_host_register` before ``storage`` (kept alive until now) is freed; best effort at teardown."""
    try:
        torch.cuda.cudart().cudaHostUnregister(pointer)
    except Exception:  # noqa: BLE001 - CUDA shut down already
        pass
    del storage


def staged_dtype(own: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """A floating tensor's dtype in the generator: ``target`` (None: its own); integer tensors keep theirs."""
    return target if target is not None and own.is_floating_point else own


class VersionedWeights:
    """Published weight versions in staging buffers (see the module doc).

    Args:
        layout: the buffers' shapes, dtypes and place.
        gather: how the main thread reads the training parameters whole.
    """

    def __init__(self, layout: StagingLayout, gather: ParameterGather):
        self.layout = layout
        self.names = list(layout.shapes)
        self.gather = gather
        self.keep_versions = False
        """Keep every published version that a later batch may still be generated with, instead of only the
        newest: up to ``max_staleness + 1`` buffer sets then, and one more while a version is published."""
        self.allocated_sets = 0
        """Buffer sets allocated so far (each one allocation holding a whole copy of the trainable weights)."""
        self._free: list[dict[str, torch.Tensor]] = []
        self._published: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
        self._writing: dict[int, dict[str, torch.Tensor]] = {}
        """Versions the main thread is filling now, and their sets (not readable yet)."""
        self._readers: dict[int, int] = {}
        """Readers of each set in use by the generation thread (by ``id`` of the set)."""
        self._retired: dict[int, dict[str, torch.Tensor]] = {}
        """Sets dropped while in use: free once their last reader is done (by ``id``)."""
        self._newest = -1
        self._filled: dict[int, StreamFence] = {}
        """The fence after the copies that filled each set (by ``id`` of the set): readers wait for it."""
        self._read: dict[int, list[StreamFence]] = {}
        """Fences after the reads of each set since its last fill (by ``id``): its next fill waits for them."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        """Notified whenever a set is freed or a version is published (the lock is the condition's)."""

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffer sets allocated so far (pinned host bytes when :attr:`StagingLayout.pin_memory`)."""
        return self.allocated_sets * self.layout.bytes_per_version

    # ---- main thread ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self, module: nn.Module, version: int, trainer_state: Any = None) -> DeferredSeconds | float:
        """Copy ``module``'s trainable weights into a staging buffer as ``version``, with the trainer state at that
        version. Returns the seconds it took: on CUDA the device time of the gathers and copies, from events read at
        log time (the host does not wait for them here); elsewhere the wall-clock time. On every process together
        when the weights are sharded: every parameter goes through the gather, one at a time, straight into the
        buffer (never a second whole copy of the weights). The store's lock is not held during the gather: a reader
        is never kept waiting by another process's collective."""
        params = dict(module.named_parameters())
        weights = lambda: self.gather.full_tensors((name, params[name]) for name in self.names)  # noqa: E731
        timer = IntervalTimer()
        with timer.time(next(iter(params.values())).device if params else self.layout.device):
            self._write(version, weights, trainer_state)
        return timer.take()

    @torch.no_grad()
    def restore(self, version: int, weights: dict[str, torch.Tensor], trainer_state: Any = None) -> None:
        """Publish ``weights`` (from :meth:`kept` of a checkpoint) as ``version`` again, without a module."""
        self._write(version, lambda: ((name, weights[name]) for name in self.names), trainer_state)

    def reset(self) -> None:
        """Forget every version (training resumes from another step: versions may go back)."""
        with self._lock:
            self._newest = -1
            self._drop(lambda v: True)

    @property
    def newest(self) -> int:
        """The newest published version (-1: none since the last reset)."""
        with self._lock:
            return self._newest

    @property
    def versions(self) -> list[int]:
        """The published versions held in staging buffers now."""
        with self._lock:
            return sorted(self._published)

    def release_before(self, version: int) -> None:
        """Drop the kept versions older than ``version`` (never the newest)."""
        with self._lock:
            self._drop(lambda v: v < version and v != self._newest)

    def kept(self, before: int, since: int = 0) -> dict[int, tuple[dict[str, torch.Tensor], Any]]:
        """CPU copies of the kept versions from ``since`` to ``before - 1``, with their trainer states (for a
        checkpoint); each its own tensor (never a view of a version's buffer), copied without the lock (after the
        copies that filled them are done: a host read)."""
        with self._lock:
            held = {v: entry for v, entry in self._published.items() if since <= v < before}
            fences = [self._use(buffers) for buffers, _ in held.values()]
        try:
            for fence in fences:
                fence.wait_on_host()
            return {
                v: ({name: t.detach().to("cpu", copy=True) for name, t in buffers.items()}, trainer_state)
                for v, (buffers, trainer_state) in held.items()
            }
        finally:
            with self._lock:
                for buffers, _ in held.values():
                    self._done_with(buffers)

    # ---- generation thread ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def holding(self, version: int) -> Iterator[tuple[dict[str, torch.Tensor], Any] | None]:
        """``(buffers, trainer_state)`` of ``version`` while the block runs, the main thread kept from overwriting
        them (the store's lock is not held meanwhile); ``None`` when that version is not held (any more). For a
        reader on the host: the copies that filled the buffers are done when the block starts."""
        with self._lock:
            entry = self._published.get(version)
            fence = self._use(entry[0]) if entry is not None else None
        try:
            if fence is not None:
                fence.wait_on_host()
            yield entry
        finally:
            if entry is not None:
                with self._lock:
                    self._done_with(entry[0])

    def load_newer(
        self,
        loaded: int,
        exact: int | None,
        load: Callable[[dict[str, torch.Tensor], int, Any], None],
        *,
        on_host: bool = True,
        reader_devices: Iterable[torch.device] = (),
    ):
        """Call ``load(buffers, version, trainer_state)`` with the newest version if it is newer than ``loaded``, or
        (``exact``) with exactly version ``exact`` unless it is the one ``loaded``. Returns the version loaded, or
        None when there was nothing to load. A newer version being published when none is held waits for that
        publication. ``load`` runs without the store's lock, its buffers kept from the main thread until it returns.
        An ``exact`` version that is not held is an error: versions are kept only with :attr:`keep_versions`, until
        the batch generated with them has been consumed.

        The fill's copies: ``on_host``, the calling thread waits for them before ``load`` (a reader that reads the
        buffers on the host, or on streams of its own); otherwise ``load`` queues its reads on this thread's current
        streams of ``reader_devices`` (and of the buffers' device), which wait for them on the device, and an event
        recorded after ``load`` keeps the next fill of these buffers from overwriting them before those reads ran."""
        with self._lock:
            while True:
                if exact is None:
                    target = max(self._published, default=-1)
                    writing = max(self._writing, default=-1)
                    if target > loaded:
                        break
                    if writing > loaded:  # the only newer version is being written: wait for it
                        self._changed.wait()
                        continue
                    return None
                target = exact
                if target == loaded or target < 0:
                    return None
                if target in self._published:
                    break
                if target in self._writing:
                    self._changed.wait()
                    continue
                raise RuntimeError(
                    f"Weight version {target} is not held any more (kept: {sorted(self._published)}); it is kept only "
                    "with keep_versions=True and until the batch generated with it has been consumed."
                )
            buffers, trainer_state = self._published[target]
            filled = self._use(buffers)
        devices = [self.layout.device, *reader_devices]
        read = None
        try:
            if on_host:
                filled.wait_on_host()
            else:
                filled.wait_on_device(devices)
            load(buffers, target, trainer_state)
            read = None if on_host else StreamFence.record(devices)
        finally:
            with self._lock:
                if read:
                    self._read.setdefault(id(buffers), []).append(read)
                self._done_with(buffers)
        return target

    # ---- internals -------------------------------------------------------------------------------------------------
    def _write(self, version: int, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], trainer_state) -> None:
        """Claim a set for ``version`` (under the lock), fill it from ``weights()`` (``(name, tensor)`` for every
        staged name, consumed one at a time, cast to the staged dtypes; without the lock), then publish it (under
        the lock), replacing an earlier copy of the same version. A failed fill frees the set again, unpublished."""
        buffers = self._claim(version)
        new = buffers is None
        try:
            if new:  # a new set: allocated outside the lock (pinning host memory takes a while)
                buffers = self.layout.allocate()
            self._fill(version, buffers, weights())
        except BaseException:
            with self._lock:
                del self._writing[version]
                if buffers is not None:
                    self._free.append(buffers)  # a half-written set is free again, never published
                elif new:
                    self.allocated_sets -= 1  # its allocation failed
                self._changed.notify_all()
            raise
        with self._lock:
            del self._writing[version]
            self._published[version] = (buffers, trainer_state)
            self._newest = max(self._newest, version)  # versions only grow between resets
            self._changed.notify_all()

    def _claim(self, version: int) -> dict[str, torch.Tensor] | None:
        """Under the lock: drop what this publication replaces, then take a free set, or (None) reserve a new one.
        Without :attr:`keep_versions` there is one set at most: wait until its reader is done with it."""
        with self._lock:
            if version in self._writing:
                raise RuntimeError(f"Weight version {version} is being published already.")
            self._drop(lambda v: v == version or not self.keep_versions)
            while not self._free and not (self.keep_versions or self.allocated_sets == 0):
                self._changed.wait()  # the generation thread is loading the only set
            self._writing[version] = buffers = self._free.pop() if self._free else None
            if buffers is None:
                self.allocated_sets += 1
            return buffers

    def _fill(self, version: int, buffers: dict[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]]):
        """Copy ``weights`` into ``buffers`` on the calling thread's current streams, after the reads of the set
        since its last fill (their fences; no host wait), and fence the copies for the readers."""
        with self._lock:  # the set is claimed: no reader adds to these while it is filled
            reads = self._read.pop(id(buffers), [])
            self._filled.pop(id(buffers), None)
        copied, devices = set(), {self.layout.device}
        for read in reads:
            read.wait_on_device(devices)
        for name, tensor in weights:
            if tensor.device not in devices:  # a device whose stream has not waited for the reads yet
                devices.add(tensor.device)
                for read in reads:
                    read.wait_on_device([tensor.device])
            buffers[name].copy_(tensor, non_blocking=True)
            copied.add(name)
        if copied != set(self.names):
            raise RuntimeError(f"Weights of version {version} lack {sorted(set(self.names) - copied)}.")
        filled = StreamFence.record(devices)  # readers wait for this, on their stream or their host thread
        with self._lock:
            self._filled[id(buffers)] = filled

    def _use(self, buffers) -> StreamFence:
        """Under the lock: one more reader of ``buffers``; returns the fence its reads must wait for."""
        self._readers[id(buffers)] = self._readers.get(id(buffers), 0) + 1
        return self._filled.get(id(buffers), StreamFence())

    def _done_with(self, buffers) -> None:
        key = id(buffers)
        self._readers[key] -= 1
        if self._readers[key] == 0:
            del self._readers[key]
            if key in self._retired:
                self._free.append(self._retired.pop(key))
                self._changed.notify_all()

    def _drop(self, which) -> None:
        """Under the lock: unpublish the versions ``which`` selects; their sets are free, or once their readers are
        done with them."""
        for version in [v for v in self._published if which(v)]:
            buffers = self._published.pop(version)[0]
            if id(buffers) in self._readers:
                self._retired[id(buffers)] = buffers
            else:
                self._free.append(buffers)
        self._changed.notify_all()
