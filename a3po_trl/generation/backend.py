"""The one interface every generation backend implements.

A backend generates completions and their behavior log-probs with *one* weight version at a time (the ``generate``
backend and vLLM colocate may switch to a newer one between two decode or engine steps, ``in_flight_weight_updates``,
and then report the version of each token: :attr:`~a3po_trl.types.GeneratedCompletions.token_versions`). The versions
themselves live in its :class:`~a3po_trl.generation.weights.VersionedWeights` (the staging store, with the gather and
dtype rules of :mod:`a3po_trl.generation.weights`):

- main thread: :meth:`GenerationBackend.publish` stages the trainer's trainable weights as version ``v``;
- generation thread: :meth:`GenerationBackend.refresh`, called between batches (and, with in-flight weight updates,
  between the decode steps of the ``generate`` backend or the engine steps of vLLM colocate), loads the newest staged
  version (or exactly an assigned one) into whatever generates (:meth:`GenerationBackend.load_weights`: a module copy
  for Hugging Face ``generate``, the engine's weights or a new LoRA adapter for vLLM), then
  :meth:`GenerationBackend.generate` runs a batch with it;
- :meth:`GenerationBackend.close` releases the engine.

The store keeps the main thread from overwriting the buffers a backend loads from until the load is done. On CUDA no
host waits for the other thread's copies: a backend that reads the buffers on its generation thread's stream
(:attr:`GenerationBackend.reads_staging_on_host` False, the ``generate`` backend on a GPU) has that stream wait for the
copies that filled them, and the next fill wait for its reads, by events; the others wait for the fill on the
generation thread's host (never on the training thread's).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..runtime.activity import doing
from ..runtime.devices import explicit_device
from ..runtime.timing import DeferredSeconds
from ..timeline import record_in_batch_span
from ..types import GeneratedCompletions
from .weights import VersionedWeights


class GenerationBackend(ABC):
    """Weights versioned by the trainer, and a way to generate with one version.

    Args:
        weights: the staging store of the published versions (its layout names the trainable weights each version
            carries, by training-module name; everything else is fixed for the run, e.g. the base model under LoRA).
        device: where generation runs; a CUDA device without an index means the current one, and is stored with it.
    """

    def __init__(self, weights: VersionedWeights, device: torch.device | str):
        self.weights = weights
        self.trainable_names = list(weights.names)
        self.device = explicit_device(device)
        self.version = -1
        """Version of the weights generation uses now (-1 before the first refresh)."""
        self.trainer_state: Any = None
        """The trainer state published with :attr:`version` (what reward functions receive as ``trainer_state``)."""

    @property
    def keep_versions(self) -> bool:
        """Keep every published version that a later batch may still be generated with (see :meth:`refresh`'s
        ``exact``), instead of only the newest: up to ``max_staleness + 1`` staging buffers then."""
        return self.weights.keep_versions

    @keep_versions.setter
    def keep_versions(self, value: bool) -> None:
        self.weights.keep_versions = bool(value)

    @property
    def reads_staging_on_host(self) -> bool:
        """Whether :meth:`load_weights` reads the staging buffers on the host, or on streams of its own (an engine's),
        so that the generation thread's host must wait for the copies that filled them. False only for a backend
        whose loads are queued on the generation thread's current CUDA stream of :attr:`device` (the staging store
        then orders them by events)."""
        return True

    # ---- main thread ---------------------------------------------------------------------------------------------
    def publish(self, module: nn.Module, version: int, trainer_state: Any = None) -> DeferredSeconds | float:
        """Stage ``module``'s trainable weights as ``version``, with a snapshot of the trainer state at that version,
        loaded with them. Returns its seconds (device time read at log time on CUDA). Main thread, on every process
        together when the weights are sharded."""
        return self.weights.publish(module, version, trainer_state)

    def reset(self) -> None:
        """Forget the versions (e.g. when training resumes from an older checkpoint); the next publish is loaded."""
        self.weights.reset()
        self.version = -1

    @property
    def published_version(self) -> int:
        return self.weights.newest

    @property
    def kept_versions(self) -> list[int]:
        """The published versions held in staging buffers now."""
        return self.weights.versions

    # ---- generation thread ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self, exact: int | None = None, should_stop: Callable[[], bool] | None = None) -> bool:
        """Load the newest published weights if they are newer than the loaded ones, or (``exact``) exactly version
        ``exact``, which must have been published and kept (:attr:`keep_versions`). Returns whether it loaded.

        ``should_stop``: a backend that may wait here for something outside this process (a server shared with other
        training processes) raises :class:`GenerationStopped` when it turns true; loading itself is not
        interrupted."""

        def load(buffers, version, trainer_state):
            self.load_weights(buffers, version)
            self.version = version
            self.trainer_state = trainer_state

        loaded = self.weights.load_newer(
            self.version, exact, load, on_host=self.reads_staging_on_host, reader_devices=(self.device,)
        )
        return loaded is not None

    def finish_batch(self, next_version: int | None, error: BaseException | None = None) -> None:
        """The generation thread is done with the batch it refreshed for (``error``: the batch failed with it). Its
        next batch is generated with exactly version ``next_version`` (``refresh(exact=...)``), or with the newest
        (None). A backend whose weights others share uses this to let them move on; by default nothing to do."""
        return None

    def release_versions_before(self, version: int) -> None:
        """Drop the kept versions older than ``version`` (no batch still to be generated or trained needs them)."""
        self.weights.release_before(version)

    def kept_weights(self, before: int, since: int = 0) -> dict[int, tuple[dict[str, torch.Tensor], Any]]:
        """Copies of the kept versions from ``since`` to ``before - 1`` with the trainer state published with them
        (for a checkpoint)."""
        return self.weights.kept(before, since)

    def restore_weights(self, version: int, weights: dict[str, torch.Tensor], trainer_state: Any = None) -> None:
        """Publish ``weights`` (from :meth:`kept_weights` of a checkpoint) as ``version`` again, without a module."""
        self.weights.restore(version, weights, trainer_state)

    @abstractmethod
    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Make generation use ``weights`` (the trainable weights of ``version``, by training-module name). The tensors
        are the staging buffers: copy what must outlive the call. The main thread may overwrite them once it returns:
        a backend whose copies out of them are queued on the generation thread's current stream says so
        (:attr:`reads_staging_on_host` False) and the store orders the next fill after them; any other waits for its
        asynchronous copies before returning (:func:`~a3po_trl.runtime.devices.wait_for_copies`)."""

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
        """:meth:`generate`, adding its seconds to ``timings``: ``"generation"``, ``"behavior_logps"`` for the
        part a separate log-prob forward took, and ``"in_flight_weight_load"`` for the versions loaded between decode
        steps (what a rollout reports as ``async/generation_time``, ``async/behavior_logps_time`` and
        ``async/in_flight_weight_load_time``), with ``"in_flight_weight_loads"`` counting those loads."""
        start = time.perf_counter()
        with doing(f"generating {len(prompt_ids)} completions"):
            generated = self.generate(prompt_ids, should_stop, seed)
        end = time.perf_counter()
        forward = generated.timings.get("behavior_logps", 0.0)
        in_flight = generated.timings.get("in_flight_weight_load", 0.0)
        timings["generation"] = timings.get("generation", 0.0) + end - start - forward - in_flight
        timings["behavior_logps"] = timings.get("behavior_logps", 0.0) + forward
        if "in_flight_weight_load" in generated.timings:
            timings["in_flight_weight_load"] = timings.get("in_flight_weight_load", 0.0) + in_flight
            loads = generated.timings.get("in_flight_weight_loads", 0.0)
            timings["in_flight_weight_loads"] = timings.get("in_flight_weight_loads", 0.0) + loads
        # On the timeline, a separate log-prob forward is drawn as the end of the call (it runs after generating)
        record_in_batch_span("generation", start, end - forward, sequences=len(prompt_ids))
        if forward > 0:
            record_in_batch_span("behavior log-probs", end - forward, end)
        return generated

    def close(self) -> None:
        """Release what the backend holds (an engine, a server connection). Idempotent."""
        return None
