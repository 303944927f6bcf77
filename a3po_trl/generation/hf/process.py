"""The ``generate`` backend in a process of its own (``generation_process``), off the trainer's interpreter.

Everything the trainer does in Python competes for one interpreter lock: the training thread's kernel launches and
the generation thread's decode loop take turns. :class:`ProcessGenerateBackend` runs
:class:`~.backend.HFGenerateBackend` (the same sampling code, so the same samples at the same seed and thread count)
in a child process started with ``spawn`` (forking a process that runs torch threads is unsafe), and the generation
thread stays in the trainer as the coordinator: it keeps the versioned queue, scores the rewards, and waits on the
pipe (without the interpreter lock) while the child generates.

- Start (:meth:`ProcessGenerateBackend.__init__`, in the main thread): a copy of the model in the generator's dtype,
  its hooks removed, is sent once through shared memory (its tensors are mapped by the child, not copied through the
  pipe); the child builds its generator from it exactly as the thread backend builds its own (its trainable weights
  its own tensors, the frozen ones the shared ones), re-applies the library's patches, and answers with the staging
  layout of its trainable weights.
- Versions: the trainer's staging store (:class:`~..weights.VersionedWeights`) allocates its version buffers in
  shared memory; :meth:`~ProcessGenerateBackend.load_weights` sends a buffer's handle the first time the buffer is
  loaded, and afterwards only which buffer and version to load, then waits for the child's answer: the store keeps
  the main thread from overwriting a buffer until ``load_weights`` returns, which is after the child copied it.
- Errors: an exception in the child is raised in the trainer with the child's traceback as its cause; a child that
  dies is named (pid, exit code) instead of being waited for; :meth:`~ProcessGenerateBackend.close` ends the child
  within a deadline (the trainer closes it with the generation thread, so no child outlives ``train()``).

CPU only: on a GPU the versions would cross through CUDA IPC handles with events between the processes, which is not
built (see docs/GPU.md).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing
from torch import nn

from ...patches import strip_forward_hooks
from ...runtime.child_errors import CapturedError
from ...types import GeneratedCompletions, GenerationStopped
from ..backend import GenerationBackend
from ..weights import StagingLayout, VersionedWeights, as_parameter_gather
from ..weights.copies import generator_copy
from .backend import HFGenerateBackend, HFGenerationSettings

logger = logging.getLogger(__name__)

FIX = "Set generation_process=False to generate in the trainer's process"


@dataclasses.dataclass
class GeneratorRecipe:
    """What the child builds its generator from, sent once: the model (its tensors in shared memory), which of its
    parameters the trainer trains, and how the thread backend would be built."""

    model: nn.Module
    trainable_names: list[str]
    settings: HFGenerationSettings
    patch_fn: Callable[[nn.Module], None] | None
    """Re-applies the library's patches to the child's copy: a picklable callable (a module-level function or a
    ``functools.partial`` of one)."""
    dtype: torch.dtype | None
    num_threads: int | None
    """The child's intra-op threads (``torch.set_num_threads``); None: PyTorch's count."""


class ProcessGenerateBackend(GenerationBackend):
    """The ``generate`` backend in a spawned child process (see the module doc). Same arguments as
    :class:`HFGenerateBackend` (CPU only), plus the child's intra-op thread count, ``poll_interval`` (seconds between
    checks that the child is alive while waiting for it) and ``stop_timeout`` (seconds :meth:`close` gives it)."""

    def __init__(
        self,
        module: nn.Module,
        settings: HFGenerationSettings,
        patch_fn: Callable[[nn.Module], None] | None = None,
        gather=None,
        dtype: torch.dtype | None = None,
        num_threads: int | None = None,
        poll_interval: float = 0.1,
        stop_timeout: float = 30.0,
    ):
        if settings.in_flight_updates:
            raise ValueError(
                "in_flight_weight_updates=True loads versions between decode steps, which a generation process does "
                f"not do yet. {FIX}, or in_flight_weight_updates=False."
            )
        gather = as_parameter_gather(gather)
        if gather.sharded:
            raise ValueError(
                "generation_process=True is not built for sharded training weights (DeepSpeed ZeRO-3, FSDP2): the "
                f"process would need the gathered model. {FIX}."
            )
        self.poll_interval = poll_interval
        self.stop_timeout = stop_timeout
        self._lock = threading.Lock()
        """Serializes the messages to the child (the generation thread's requests, the main thread's close)."""
        self._sent_buffers: set[int] = set()
        """Version buffers (by their storage's address) whose handle the child holds already."""
        self._process = None
        context = torch.multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._stop = context.Event()
        """Set while the generation thread should stop: the child's generate ends at its next decode step."""
        started = time.perf_counter()
        self._process = context.Process(
            target=serve, args=(child_end, self._stop), name="a3po-generation-process", daemon=True
        )
        try:
            self._process.start()
            child_end.close()
            trainable_names = [name for name, p in module.named_parameters() if p.requires_grad]
            model = sendable_copy(module, dtype)
            recipe = GeneratorRecipe(model, trainable_names, settings, patch_fn, dtype, num_threads)
            try:
                with self._lock:
                    self._connection.send(recipe)  # the model's tensors move to shared memory on the way
            except (pickle.PicklingError, TypeError, AttributeError) as error:
                raise ValueError(
                    f"The model cannot be sent to a generation process (generation_process=True): "
                    f"{type(error).__name__}: {error}. {FIX}."
                ) from error
            layout = self._wait("building its generator")  # the copy's tensors stay alive until it is built
            del model, recipe
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - started
        """Seconds from spawning the child to its generator being built (imports included)."""
        layout = dataclasses.replace(layout, pin_memory=False, shared_memory=True)
        super().__init__(VersionedWeights(layout, gather), torch.device("cpu"))

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def load_weights(self, weights, version):
        flat = flat_buffer(weights)
        key = flat.untyped_storage().data_ptr()
        handle = None if key in self._sent_buffers else flat
        self._request(("load", key, version, handle), f"loading weight version {version}")
        self._sent_buffers.add(key)

    def generate(self, prompt_ids, should_stop, seed) -> GeneratedCompletions:
        self._stop.clear()
        if should_stop is not None and should_stop():
            self._stop.set()  # stopped already: the child stops at its first decode step
        return self._request(
            ("generate", prompt_ids, seed, should_stop is not None),
            f"generating {len(prompt_ids)} completions",
            should_stop,
        )

    def close(self) -> None:
        """Ask the child to end, give it :attr:`stop_timeout` seconds (a batch it is generating is stopped at its next
        decode step), then end it. Idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        self._stop.set()
        try:
            with self._lock:
                self._connection.send(("close",))
        except (OSError, ValueError):  # the child is gone, or the connection closed
            pass
        process.join(self.stop_timeout)
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        self._connection.close()

    # ---- the generation thread's side of the pipe ------------------------------------------------------------------
    def _request(self, message: tuple, what: str, should_stop: Callable[[], bool] | None = None):
        process = self._process
        if process is None:
            raise RuntimeError(f"The generation process was closed; it cannot be {what}.")
        try:
            with self._lock:
                self._connection.send(message)
        except (OSError, ValueError) as error:
            raise self._died(process, what) from error
        return self._wait(what, should_stop, process)

    def _wait(self, what: str, should_stop: Callable[[], bool] | None = None, process=None):
        """The child's answer to the message just sent (without the interpreter lock while waiting), checking every
        :attr:`poll_interval` that it is alive and passing a stop on to it."""
        process = process or self._process
        try:
            while not self._connection.poll(self.poll_interval):
                if should_stop is not None and should_stop():
                    self._stop.set()  # the child's generate ends at its next decode step
                if not process.is_alive():
                    raise self._died(process, what)
            kind, payload = pickle.loads(self._connection.recv_bytes())
        except (EOFError, OSError) as error:
            raise self._died(process, what) from error
        if kind == "stopped":
            raise GenerationStopped
        if kind == "error":
            raise payload.rebuilt(what)
        return payload

    @staticmethod
    def _died(process, what: str) -> RuntimeError:
        process.join(1.0)
        return RuntimeError(
            f"The generation process (pid {process.pid}) died while {what} (exit code {process.exitcode}: killed, "
            "out of memory, or a training script without `if __name__ == '__main__':` that the spawned process "
            f"started again); the run cannot generate further batches. {FIX}."
        )


def sendable_copy(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A copy of ``module`` on the CPU, its floating weights in ``dtype``, that can be sent to another process: every
    tensor its own (the trainer's parameters never move to shared memory), without instance ``forward`` patches or
    forward hooks (:func:`~a3po_trl.patches.strip_forward_hooks`)."""
    copy = generator_copy(module, torch.device("cpu"), dtype, share_frozen=False)
    strip_forward_hooks(copy)
    return copy


def flat_buffer(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one flat ``uint8`` buffer that a version's views (:meth:`StagingLayout.views`) are views of."""
    storage = next(iter(weights.values())).untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))


# ---- in the child process ----------------------------------------------------------------------------------------


class ChildFailure(CapturedError):
    """An exception as the child saw it (:class:`~a3po_trl.runtime.child_errors.CapturedError`)."""

    def rebuilt(self, what: str) -> BaseException:
        """The child's exception, noted with what the child was doing, the child's traceback as its cause."""
        error = self.raised_here(GenerationProcessTraceback)
        error.add_note(f"(raised in the generation process while {what}; generation_process=True)")
        return error


class GenerationProcessTraceback(Exception):
    """The traceback of an exception raised in the generation process (the cause of the one ``train()`` raises)."""

    def __str__(self):
        return "the generation process's traceback:\n" + self.args[0]


def build_generator(recipe: GeneratorRecipe) -> HFGenerateBackend:
    """The child's generator, built as the thread backend builds its own: the received model's trainable
    parameters marked again (the copy sent holds none that require gradients), then copied."""
    if recipe.num_threads is not None:
        torch.set_num_threads(recipe.num_threads)
    params = dict(recipe.model.named_parameters())
    for name in recipe.trainable_names:
        params[name].requires_grad_(True)
    return HFGenerateBackend(recipe.model, recipe.settings, device="cpu", patch_fn=recipe.patch_fn, dtype=recipe.dtype)


def serve(connection, stop) -> None:
    """The child's loop: build the generator from the recipe, answer with its staging layout, then load versions and
    generate batches as the trainer asks, until it says ``close`` or its end of the pipe closes."""

    def answer(kind: str, payload: Any = None) -> bool:
        try:
            connection.send_bytes(pickle.dumps((kind, payload)))
            return True
        except (OSError, ValueError):  # the trainer is gone
            return False

    try:
        generator = build_generator(connection.recv())
    except BaseException as error:  # noqa: BLE001 - reported to the trainer
        answer("error", ChildFailure(error))
        return
    layout: StagingLayout = generator.weights.layout
    if not answer("ok", layout):
        return
    buffers: dict[int, dict[str, torch.Tensor]] = {}
    with torch.inference_mode():
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                return
            try:
                if message[0] == "close":
                    return
                if message[0] == "load":
                    _, key, version, handle = message
                    if handle is not None:
                        buffers[key] = layout.views(handle)
                    generator.load_weights(buffers[key], version)
                    result = None
                else:
                    _, prompt_ids, seed, stoppable = message
                    result = generator.generate(prompt_ids, stop.is_set if stoppable else None, seed)
            except GenerationStopped:
                sent = answer("stopped")
            except BaseException as error:  # noqa: BLE001 - reported to the trainer
                sent = answer("error", ChildFailure(error))
            else:
                sent = answer("ok", result)
            if not sent:
                return
