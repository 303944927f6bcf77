"""The one interface every generation backend implements, and the versioned weights they all share.

A backend generates completions and their behavior log-probs with *one* weight version at a time:

- main thread: :meth:`GenerationBackend.publish` copies the trainer's trainable weights into a staging buffer as
  version ``v``, one whole tensor at a time (gathered under ZeRO-3 and FSDP2 by the injected
  :class:`~a3po_trl.generation.gather.ParameterGather`, on every process together);
- generation thread: :meth:`GenerationBackend.refresh`, called only between batches, loads the newest staged version
  into whatever generates (:meth:`GenerationBackend.load_weights`: a module copy for Hugging Face ``generate``, the
  engine's weights or a new LoRA adapter for vLLM), then :meth:`GenerationBackend.generate` runs a batch with it;
- :meth:`GenerationBackend.close` releases the engine.

The staging lock is held while a backend loads a version, so the main thread never overwrites the buffer it reads.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..timeline import record_in_batch_span
from ..types import GeneratedCompletions
from .gather import ParameterGather, as_parameter_gather


class GenerationBackend(ABC):
    """Weights versioned by the trainer, and a way to generate with one version.

    Args:
        trainable_names: names (as in the training module's ``named_parameters``) of the weights each version carries;
            everything else is fixed for the run (e.g. the base model under LoRA).
        staging: one buffer per name, shaped and typed like the whole weight, where :meth:`publish` copies it.
        gather: how the main thread reads sharded parameters whole (:class:`~.gather.ParameterGather`; a ZeRO-3
            context-manager factory or ``None`` are converted by :func:`~.gather.as_parameter_gather`).
        device: where generation runs.
    """

    def __init__(
        self,
        trainable_names: list[str],
        staging: dict[str, torch.Tensor],
        gather: ParameterGather | Callable | None,
        device: torch.device,
    ):
        self.trainable_names = list(trainable_names)
        self._gather = as_parameter_gather(gather)
        self.device = torch.device(device)
        self.version = -1
        """Version of the weights generation uses now (-1 before the first refresh)."""
        self.trainer_state: Any = None
        """The trainer state published with :attr:`version` (what reward functions receive as ``trainer_state``)."""
        self.keep_versions = False
        """Keep every published version that a later batch may still be generated with (see :meth:`refresh`'s
        ``exact``), instead of only the newest: up to ``max_staleness + 1`` staging buffers then."""
        self._template = staging
        self._free_buffers = [staging]
        self._published: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
        self._staging_version = -1
        self._lock = threading.Lock()

    # ---- main thread ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self, module: nn.Module, version: int, trainer_state: Any = None) -> float:
        """Copy ``module``'s trainable weights into a staging buffer as ``version``, with a snapshot of the trainer
        state at that version, loaded with them. Returns seconds.

        Main thread, on every process together when the weights are sharded: every trainable parameter goes through
        the gather, one at a time, straight into the staging buffer (never a second whole copy of the weights)."""
        start = time.perf_counter()
        params = dict(module.named_parameters())
        with self._lock:
            if not self.keep_versions:
                self._drop_versions(lambda v: True)  # one buffer, overwritten by each version
            whole = self._gather.full_tensors((name, params[name]) for name in self.trainable_names)
            self._store(version, whole, trainer_state)
        return time.perf_counter() - start

    def reset(self) -> None:
        """Forget the versions (e.g. when training resumes from an older checkpoint); the next publish is loaded."""
        with self._lock:
            self.version = -1
            self._staging_version = -1
            self._drop_versions(lambda v: True)

    @property
    def published_version(self) -> int:
        with self._lock:
            return self._staging_version

    @property
    def kept_versions(self) -> list[int]:
        """The published versions held in staging buffers now."""
        with self._lock:
            return sorted(self._published)

    def _store(self, version: int, weights: Iterable[tuple[str, torch.Tensor]], trainer_state: Any) -> None:
        """Under the lock: copy ``weights`` (``(name, tensor)`` for every trainable name, consumed one at a time) into
        a free staging buffer (reused, or new) as ``version``, replacing an earlier copy of the same version."""
        self._drop_versions(lambda v: v == version)
        buffers = self._free_buffers.pop() if self._free_buffers else self._new_buffers()
        copied = set()
        try:
            for name, tensor in weights:
                buffers[name].copy_(tensor, non_blocking=True)
                copied.add(name)
            if copied != set(self.trainable_names):
                raise RuntimeError(f"Weights of version {version} lack {sorted(set(self.trainable_names) - copied)}.")
        except BaseException:
            self._free_buffers.append(buffers)  # a half-written buffer is free again, never published
            raise
        if buffers and next(iter(buffers.values())).device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # whole before the generation thread's stream reads it
        self._published[version] = (buffers, trainer_state)
        self._staging_version = max(self._staging_version, version)  # versions only grow between resets

    def _new_buffers(self) -> dict[str, torch.Tensor]:
        return {name: torch.empty_like(tensor) for name, tensor in self._template.items()}

    def _drop_versions(self, which) -> None:
        for version in [v for v in self._published if which(v)]:
            self._free_buffers.append(self._published.pop(version)[0])

    # ---- generation thread ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self, exact: int | None = None, should_stop: Callable[[], bool] | None = None) -> bool:
        """Load the newest published weights if they are newer than the loaded ones, or (``exact``) exactly version
        ``exact``, which must have been published and kept (:attr:`keep_versions`). Returns whether it loaded.

        ``should_stop``: a backend that may wait here for something outside this process (a server shared with other
        training processes) raises :class:`GenerationStopped` when it turns true; loading itself is not
        interrupted."""
        with self._lock:
            target = self._staging_version if exact is None else exact
            if target == self.version or (exact is None and target < self.version) or target < 0:
                return False
            if target not in self._published:
                raise RuntimeError(
                    f"Weight version {target} is not held any more (kept: {sorted(self._published)}); it is kept only "
                    "with keep_versions=True and until the batch generated with it has been consumed."
                )
            buffers, trainer_state = self._published[target]
            self.load_weights(buffers, target)
            self.version = target
            self.trainer_state = trainer_state
        return True

    def finish_batch(self, next_version: int | None, error: BaseException | None = None) -> None:
        """The generation thread is done with the batch it refreshed for (``error``: the batch failed with it). Its
        next batch is generated with exactly version ``next_version`` (``refresh(exact=...)``), or with the newest
        (None). A backend whose weights others share uses this to let them move on; by default nothing to do."""
        return None

    def release_versions_before(self, version: int) -> None:
        """Drop the kept versions older than ``version`` (no batch still to be generated or trained needs them)."""
        with self._lock:
            self._drop_versions(lambda v: v < version and v != self._staging_version)

    def kept_weights(self, before: int) -> dict[int, tuple[dict[str, torch.Tensor], Any]]:
        """Copies of the kept versions older than ``before`` with the trainer state published with them (for a
        checkpoint)."""
        with self._lock:
            return {
                v: ({name: t.detach().to("cpu", copy=True) for name, t in buffers.items()}, trainer_state)
                for v, (buffers, trainer_state) in self._published.items()
                if v < before
            }

    @torch.no_grad()
    def restore_weights(self, version: int, weights: dict[str, torch.Tensor], trainer_state: Any = None) -> None:
        """Publish ``weights`` (from :meth:`kept_weights` of a checkpoint) as ``version`` again, without a module."""
        with self._lock:
            self._store(version, ((name, weights[name]) for name in self.trainable_names), trainer_state)

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

    def timed_generate(
        self,
        prompt_ids: list[list[int]],
        should_stop: Callable[[], bool] | None,
        seed: int | None,
        timings: dict[str, float],
    ) -> GeneratedCompletions:
        """:meth:`generate`, adding its seconds to ``timings``: ``"generation"``, and ``"behavior_logps"`` for the
        part a separate log-prob forward took (what a rollout reports as ``async/generation_time`` and
        ``async/behavior_logps_time``)."""
        start = time.perf_counter()
        generated = self.generate(prompt_ids, should_stop, seed)
        end = time.perf_counter()
        forward = generated.timings.get("behavior_logps", 0.0)
        timings["generation"] = timings.get("generation", 0.0) + end - start - forward
        timings["behavior_logps"] = timings.get("behavior_logps", 0.0) + forward
        # On the timeline, a separate log-prob forward is drawn as the end of the call (it runs after generating)
        record_in_batch_span("generation", start, end - forward, sequences=len(prompt_ids))
        if forward > 0:
            record_in_batch_span("behavior log-probs", end - forward, end)
        return generated

    def close(self) -> None:
        """Release what the backend holds (an engine, a server connection). Idempotent."""
        return None


def full_shape(param: torch.Tensor) -> torch.Size:
    """The whole shape of a parameter, also when ZeRO-3 has partitioned it (``ds_shape``); an FSDP2 ``DTensor``'s
    ``shape`` is its whole shape already."""
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
