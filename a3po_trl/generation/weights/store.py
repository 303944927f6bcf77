"""The versioned staging store: the trainer's trainable weights, one version at a time, for the generation thread.

- main thread: :meth:`VersionedWeights.publish` copies a module's trainable weights into a staging buffer as version
  ``v``, one whole tensor at a time (gathered under ZeRO-3 and FSDP2 by a
  :class:`~a3po_trl.generation.weights.gather.ParameterGather`, on every process together), cast to the generator's
  dtype on the way;
- generation thread: :meth:`VersionedWeights.loading` holds a version's buffers (under the store's lock) while a
  backend loads them into whatever generates.

The buffers live where :class:`StagingLayout` says: on the generation device (the ``generate`` backend copies them
into its own module there) or in pinned host memory (vLLM: the engine holds the device copy, and host staging keeps
a second whole model off the GPU). They are allocated at the first publication and reused; with
``keep_versions`` (``reproducible_generation``) one set per version a later batch may still need.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...devices import wait_for_copies
from .gather import ParameterGather


def full_shape(param: torch.Tensor) -> torch.Size:
    """The whole shape of a parameter, also when ZeRO-3 has partitioned it (``ds_shape``); an FSDP2 ``DTensor``'s
    ``shape`` is its whole shape already."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


@dataclass(frozen=True)
class StagingLayout:
    """Shape and dtype of each staged weight (by training-module name), and where the buffers live."""

    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype]
    device: torch.device
    pin_memory: bool = False
    """Page-locked host memory (``device`` is the CPU): copies to and from a GPU run asynchronously and fast."""

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

    @property
    def bytes_per_version(self) -> int:
        return sum(
            shape.numel() * torch.empty((), dtype=self.dtypes[name]).element_size()
            for name, shape in self.shapes.items()
        )

    def allocate(self) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(shape, dtype=self.dtypes[name], device=self.device, pin_memory=self.pin_memory)
            for name, shape in self.shapes.items()
        }


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
        newest: up to ``max_staleness + 1`` buffer sets then."""
        self.allocated_sets = 0
        """Buffer sets allocated so far (each a whole copy of the trainable weights)."""
        self._free: list[dict[str, torch.Tensor]] = []
        self._published: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
        self._newest = -1
        self._lock = threading.Lock()

    # ---- main thread ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self, module: nn.Module, version: int, trainer_state: Any = None) -> float:
        """Copy ``module``'s trainable weights into a staging buffer as ``version``, with the trainer state at that
        version. Returns seconds. On every process together when the weights are sharded: every parameter goes through
        the gather, one at a time, straight into the buffer (never a second whole copy of the weights)."""
        start = time.perf_counter()
        params = dict(module.named_parameters())
        with self._lock:
            if not self.keep_versions:
                self._drop(lambda v: True)  # one buffer set, overwritten by each version
            self._store(version, self.gather.full_tensors((name, params[name]) for name in self.names), trainer_state)
        return time.perf_counter() - start

    @torch.no_grad()
    def restore(self, version: int, weights: dict[str, torch.Tensor], trainer_state: Any = None) -> None:
        """Publish ``weights`` (from :meth:`kept` of a checkpoint) as ``version`` again, without a module."""
        with self._lock:
            self._store(version, ((name, weights[name]) for name in self.names), trainer_state)

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

    def kept(self, before: int) -> dict[int, tuple[dict[str, torch.Tensor], Any]]:
        """CPU copies of the kept versions older than ``before``, with their trainer states (for a checkpoint)."""
        with self._lock:
            return {
                v: ({name: t.detach().to("cpu", copy=True) for name, t in buffers.items()}, trainer_state)
                for v, (buffers, trainer_state) in self._published.items()
                if v < before
            }

    # ---- generation thread ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def holding(self, version: int) -> Iterator[tuple[dict[str, torch.Tensor], Any] | None]:
        """``(buffers, trainer_state)`` of ``version`` while the block runs, the main thread kept from overwriting
        them; ``None`` when that version is not held (any more)."""
        with self._lock:
            yield self._published.get(version)

    def load_newer(self, loaded: int, exact: int | None, load: Callable[[dict[str, torch.Tensor], int, Any], None]):
        """Under the lock, call ``load(buffers, version, trainer_state)`` with the newest version if it is newer than
        ``loaded``, or (``exact``) with exactly version ``exact`` unless it is the one ``loaded``. Returns the version
        loaded, or None when there was nothing to load. An ``exact`` version that is not held is an error: versions
        are kept only with :attr:`keep_versions`, until the batch generated with them has been consumed."""
        with self._lock:
            target = self._newest if exact is None else exact
            if target == loaded or (exact is None and target < loaded) or target < 0:
                return None
            if target not in self._published:
                raise RuntimeError(
                    f"Weight version {target} is not held any more (kept: {sorted(self._published)}); it is kept only "
                    "with keep_versions=True and until the batch generated with it has been consumed."
                )
            buffers, trainer_state = self._published[target]
            load(buffers, target, trainer_state)
            return target

    # ---- internals -------------------------------------------------------------------------------------------------
    def _store(self, version: int, weights: Iterable[tuple[str, torch.Tensor]], trainer_state: Any) -> None:
        """Under the lock: copy ``weights`` (``(name, tensor)`` for every staged name, consumed one at a time) into a
        free buffer set as ``version``, cast to the staged dtypes, replacing an earlier copy of the same version."""
        self._drop(lambda v: v == version)
        buffers = self._free.pop() if self._free else self._allocate()
        copied, devices = set(), {self.layout.device}
        try:
            for name, tensor in weights:
                buffers[name].copy_(tensor, non_blocking=True)
                copied.add(name)
                devices.add(tensor.device)
            if copied != set(self.names):
                raise RuntimeError(f"Weights of version {version} lack {sorted(set(self.names) - copied)}.")
            wait_for_copies(devices)  # whole before the generation thread's stream reads them
        except BaseException:
            self._free.append(buffers)  # a half-written buffer set is free again, never published
            raise
        self._published[version] = (buffers, trainer_state)
        self._newest = max(self._newest, version)  # versions only grow between resets

    def _allocate(self) -> dict[str, torch.Tensor]:
        self.allocated_sets += 1
        return self.layout.allocate()

    def _drop(self, which) -> None:
        for version in [v for v in self._published if which(v)]:
            self._free.append(self._published.pop(version)[0])
