"""The one interface every generation backend implements, and the versioned weights they all share.

A backend generates completions and their behavior log-probs with *one* weight version at a time:

- main thread: :meth:`GenerationBackend.publish` copies the trainer's trainable weights into a staging buffer as
  version ``v`` (gathering them first under ZeRO-3, on every process together);
- generation thread: :meth:`GenerationBackend.refresh`, called only between batches, loads the newest staged version
  into whatever generates (:meth:`GenerationBackend.load_weights`: a module copy for Hugging Face ``generate``, the
  engine's weights or a new LoRA adapter for vLLM), then :meth:`GenerationBackend.generate` runs a batch with it;
- :meth:`GenerationBackend.close` releases the engine.

The staging lock is held while a backend loads a version, so the main thread never overwrites the buffer it reads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from trl.trainer.utils import pad


class GenerationStopped(Exception):
    """Raised inside the generation thread when the engine is asked to stop; never escapes the engine."""


@dataclass
class GeneratedCompletions:
    """What a backend returns for a batch of prompts."""

    completion_ids: list[list[int]]
    """Per prompt, the generated token ids, cut after the first EOS token."""
    logps: list[torch.Tensor]
    """Per prompt, the behavior log-probs of those tokens under the temperature-scaled distribution of the weights
    that generated them (1-D float tensors, one value per token)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent on parts of the call worth reporting apart (e.g. ``behavior_logps`` for a separate forward)."""


class GenerationBackend(ABC):
    """Weights versioned by the trainer, and a way to generate with one version.

    Args:
        trainable_names: names (as in the training module's ``named_parameters``) of the weights each version carries;
            everything else is fixed for the run (e.g. the base model under LoRA).
        staging: one buffer per name, shaped and typed like the whole weight, where :meth:`publish` copies it.
        gather: context manager factory making a list of sharded parameters whole (ZeRO-3), or ``None``.
        device: where generation runs.
    """

    name = "backend"
    """Short name used in logs and metrics."""

    def __init__(
        self,
        trainable_names: list[str],
        staging: dict[str, torch.Tensor],
        gather: Callable | None,
        device: torch.device,
    ):
        self.trainable_names = list(trainable_names)
        self._staging = staging
        self._gather = gather or _no_gather
        self.device = torch.device(device)
        self.version = -1
        """Version of the weights generation uses now (-1 before the first refresh)."""
        self.info: Any = None
        """What was published with :attr:`version`."""
        self.load_seconds = 0.0
        """Seconds spent in :meth:`load_weights` so far (generation thread)."""
        self._staging_version = -1
        self._staging_info: Any = None
        self._lock = threading.Lock()

    # ---- main thread ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self, module: nn.Module, version: int, info: Any = None) -> float:
        """Copy ``module``'s trainable weights into the staging buffer as ``version``, with ``info`` (what else
        describes this version, e.g. a snapshot of the trainer state), loaded with them. Returns seconds."""
        start = time.perf_counter()
        params = dict(module.named_parameters())
        with self._gather([params[name] for name in self.trainable_names]), self._lock:
            for name in self.trainable_names:
                self._staging[name].copy_(params[name].detach(), non_blocking=True)
            if self._staging and next(iter(self._staging.values())).device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self._staging_version = version
            self._staging_info = info
        return time.perf_counter() - start

    def reset(self) -> None:
        """Forget the versions (e.g. when training resumes from an older checkpoint); the next publish is loaded."""
        with self._lock:
            self.version = -1
            self._staging_version = -1

    @property
    def published_version(self) -> int:
        with self._lock:
            return self._staging_version

    def staging_tensors(self) -> list[torch.Tensor]:
        """The staging buffers that :meth:`publish` fills (one per trainable parameter), e.g. to measure memory."""
        return list(self._staging.values())

    # ---- generation thread ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> bool:
        """Load the latest published weights if they are newer. Returns whether it did."""
        with self._lock:
            if self._staging_version <= self.version:
                return False
            start = time.perf_counter()
            self.load_weights(self._staging, self._staging_version)
            self.load_seconds += time.perf_counter() - start
            self.version = self._staging_version
            self.info = self._staging_info
        return True

    @abstractmethod
    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Make generation use ``weights`` (the trainable weights of ``version``, by training-module name). The tensors
        are the staging buffers: copy what must outlive the call."""

    @abstractmethod
    def generate(
        self, prompt_ids: list[list[int]], should_stop: Callable[[], bool] | None, seed: int | None
    ) -> GeneratedCompletions:
        """Sample one completion per prompt with the loaded version, and its behavior log-probs. ``seed`` (when not
        None) fixes the batch's random stream, so the same batch samples the same whenever it runs. Raises
        :class:`GenerationStopped` if ``should_stop()`` turns true."""

    def close(self) -> None:
        """Release what the backend holds (an engine, a server connection). Idempotent."""
        return None

    def metrics(self) -> dict[str, float]:
        """Backend-specific values to log (e.g. the inference/training log-prob mismatch); empty by default."""
        return {}


@contextlib.contextmanager
def _no_gather(params):
    yield


def full_shape(param: torch.Tensor) -> torch.Size:
    """The whole shape of a parameter, also when ZeRO-3 has partitioned it (``ds_shape``)."""
    return getattr(param, "ds_shape", param.shape)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same memory: `cpu` and `cpu:0` are; `cuda` means the current CUDA device."""
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True

    def index(device):
        if device.index is not None:
            return device.index
        return torch.cuda.current_device() if device.type == "cuda" else 0

    return index(a) == index(b)


def module_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def pad_rows(rows: list[list[int]], pad_value: int, side: str, pad_to_multiple_of: int | None = None):
    """Token id rows padded into ``(ids, mask)`` tensors on the given side."""
    tensors = [torch.tensor(row, dtype=torch.long) for row in rows]
    ids = pad(tensors, padding_value=pad_value, padding_side=side, pad_to_multiple_of=pad_to_multiple_of)
    mask = pad(
        [torch.ones_like(t) for t in tensors],
        padding_value=0,
        padding_side=side,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    return ids, mask
