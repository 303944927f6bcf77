"""The batch producer: the admission-controlled loop that generates and scores batches into the versioned sample
queue, in a background thread or inline.

The producer knows nothing of which backend generates (:mod:`a3po_trl.generation.backend`): it asks the backend to load
the newest published weights (or, reproducibly, the assigned ones) between batches and tags the batch with that
version; a multi-turn rollout may load newer weights between turns, and records the version of every token. It never
runs a collective: everything it does is local to its process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..runtime.activity import LATE_BATCH_HINT, Activity, doing, reporting_activity
from ..runtime.devices import explicit_device, generation_stream
from ..timeline import GENERATION_LANE, TRAINING_LANE, TimelineRecorder, batch_span, record_in_batch_span
from ..types import GenerationStopped, ScoredBatch
from .backend import GenerationBackend
from .queue import VersionedSampleQueue

logger = logging.getLogger(__name__)


class GenerationTimedOut(TimeoutError):
    """The trainer waited longer than the producer's ``timeout`` for its next batch."""


class BatchProducer:
    """Admission-controlled producer of scored batches, in a background thread or inline.

    Batch ``i`` (counted from the start of this run) may be generated only with weights of version at least
    ``min_version(i)``: the generator waits for the trainer to publish such weights instead of producing samples that
    would exceed the staleness bound when consumed. Nothing generated is dropped. If the trainer asks for batch ``i``
    while the generator still waits for newer weights (the loop did not follow the predicted schedule), the trainer
    cannot publish anything before it gets the batch, so the generator uses the newest weights it has instead of
    waiting forever; ``schedule_misses`` counts these batches.

    Args:
        backend: what generates (see :class:`GenerationBackend`), holding the published weights.
        prompt_batches: iterator of local generation batches (lists of dataset rows).
        rollout: ``rollout(backend, rows, should_stop, trainer_state, draw) -> ScoredBatch`` (index and version
            filled in here), with ``trainer_state`` the trainer state published with the weights' version (see
            :meth:`GenerationBackend.publish`) and ``draw`` the position in the run of the prompt batch ``rows`` was
            drawn as (the batch's position in the run, unless ``refill`` draws more than one per batch).
        min_version: ``min_version(i)`` is the oldest weight version allowed to generate batch ``i``.
        num_batches: how many batches this run needs.
        queue_size: bound of the sample queue.
        asynchronous: run the loop in a thread (``True``) or produce each batch in ``get`` (``False``).
        num_threads: CPU intra-op threads for the generation thread.
        exact_versions: generate batch ``i`` with exactly version ``min_version(i)`` (the backend keeps the published
            versions a later batch may still need) instead of the newest one: which weights generate a batch then no
            longer depends on timing.
        publish_through: with ``exact_versions``, the newest version :meth:`publish` stages; newer ones are skipped
            (no batch loads them). The trainer passes the version of the run's last micro-step: a checkpoint keeps
            the versions a run continued from it with a larger ``max_steps`` needs, also those no batch of this run
            is assigned. None: the newest version any batch is assigned.
        poll_interval: seconds between health checks while waiting.
        timeline: where the producer records its spans (each batch, its waits and weight loads, and the trainer's
            wait for it); backends and rollouts record their parts inside the batch's span. ``None``: not recorded.
        refill: dynamic sampling (:class:`~a3po_trl.rollout.dynamic_sampling.DynamicSampler`'s ``fill``):
            ``refill(first, draw_more) -> ScoredBatch`` makes the batch from its first scored draw, calling
            ``draw_more()`` for each further one; each further draw loads the newest published weights (exactly the
            batch's version with ``exact_versions``) and takes the next prompt batch. ``None``: one draw per batch.
        timeout: seconds :meth:`get` waits for a batch before it raises :class:`GenerationTimedOut`, saying what the
            generation thread was doing; ``None``: no bound. Inline generation (not ``asynchronous``) is not bounded:
            it runs in the caller.
        publish_activity: ``publish_activity(what, since)`` is told each activity of the thread that produces
            (:mod:`a3po_trl.runtime.activity`), for the other processes' errors when this one is late.
        process_index: this process's index, for the error.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        prompt_batches: Iterator[list[dict]],
        rollout: Callable[[GenerationBackend, list[dict], Callable[[], bool], Any, int], ScoredBatch],
        min_version: Callable[[int], int],
        num_batches: int,
        queue_size: int,
        asynchronous: bool = True,
        num_threads: int | None = None,
        poll_interval: float = 0.1,
        exact_versions: bool = False,
        timeline: TimelineRecorder | None = None,
        refill: Callable[[ScoredBatch, Callable[[], ScoredBatch]], ScoredBatch] | None = None,
        first_draw: int = 0,
        publish_through: int | None = None,
        timeout: float | None = None,
        publish_activity: Callable[[str, float], None] | None = None,
        process_index: int = 0,
    ):
        self.backend = backend
        self.prompt_batches = prompt_batches
        self.rollout = rollout
        self.min_version = min_version
        self.num_batches = num_batches
        self.queue = VersionedSampleQueue(queue_size)
        self.asynchronous = asynchronous
        self.num_threads = num_threads
        self.poll_interval = poll_interval
        self.exact_versions = exact_versions
        self.timeline = timeline if timeline is not None else TimelineRecorder(enabled=False)
        self.refill = refill
        self.timeout = timeout
        self.process_index = process_index
        self.activity = Activity(publish_activity)
        """What the thread producing batches reported doing last (see :mod:`a3po_trl.runtime.activity`)."""
        backend.keep_versions = exact_versions
        if publish_through is None:
            publish_through = max((min_version(i) for i in range(num_batches)), default=-1)
        self.publish_through = publish_through
        """With ``exact_versions``, the newest version published: no batch is generated with a newer one."""
        self.stop_event = threading.Event()
        self._version_cond = threading.Condition()
        self._trainer_version = -1
        self._requested = -1
        self._error: BaseException | None = None
        self._error_reported = False
        self._error_after_stop = False
        self._thread: threading.Thread | None = None
        self._next_inline = 0
        self.produced = 0
        """Batches generated so far."""
        self.consumed = 0
        """Batches handed to the trainer so far."""
        self.schedule_misses = 0
        """Batches generated with older weights than ``min_version`` asked for, because the trainer needed them."""
        self.first_draw = first_draw
        self.draws = 0
        """Prompt batches drawn in this run so far (one per batch, more with ``refill``)."""
        self._draw_starts: dict[int, int] = {}
        self._draw_lock = threading.Lock()
        self.thread_cpu_at_exit: float | None = None
        """The generation thread's CPU seconds when it ended (its clock cannot be read after), None before."""

    # ---- main thread -------------------------------------------------------------------------------------------
    def start(self, module: torch.nn.Module, version: int, trainer_state: Any = None, earlier_versions=None) -> None:
        """Publish the starting weights and, if asynchronous, start the generation thread. ``earlier_versions``
        (``{version: (weights, trainer_state)}``, from a checkpoint) are published again first, for batches still to
        be generated with them."""
        self.backend.reset()
        for earlier, (weights, earlier_state) in sorted((earlier_versions or {}).items()):
            self.backend.restore_weights(earlier, weights, earlier_state)
        self.publish(module, version, trainer_state)
        if self.asynchronous and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="a3po-generation", daemon=True)
            self._thread.start()

    def publish(self, module: torch.nn.Module, version: int, trainer_state: Any = None) -> float:
        """Publish the trainer's weights as ``version`` (with the trainer state) and wake the generator. Returns
        seconds.

        Called on every process together: under ZeRO-3 or FSDP2 the publication gathers the weights (a collective),
        so whether it is skipped must not depend on anything local to a process, such as how far its generation
        thread has got. With ``exact_versions`` a version newer than ``publish_through`` is skipped: that depends
        only on the batch schedule, which every process shares."""
        seconds = 0.0
        if not (self.exact_versions and version > self.publish_through):  # nobody would load or keep it
            seconds = self.backend.publish(module, version, trainer_state)
        with self._version_cond:
            self._trainer_version = version
            self._version_cond.notify_all()
        return seconds

    def get(self) -> tuple[ScoredBatch, float]:
        """Next scored batch, in order, and the seconds the caller waited for it.

        Re-raises, with its original traceback, any exception raised in the generation thread; raises
        :class:`GenerationTimedOut` after waiting ``timeout`` seconds.
        """
        if self.consumed >= self.num_batches:
            raise RuntimeError(f"All {self.num_batches} generation batches of this run were already consumed.")
        start = time.perf_counter()
        with self._version_cond:
            self._requested = self.consumed
            self._version_cond.notify_all()
        if not self.asynchronous:
            with reporting_activity(self.activity.report):
                batch = self._produce(self._next_inline)
            self._next_inline += 1
        else:
            while True:
                self._raise_if_failed()
                batch = self.queue.get(timeout=self.poll_interval)
                if batch is not None:
                    break
                if self._thread is None or not self._thread.is_alive():
                    self._raise_if_failed()
                    raise RuntimeError("The generation thread stopped without producing the next batch.")
                if self.timeout is not None and time.perf_counter() - start >= self.timeout:
                    raise GenerationTimedOut(
                        f"Process {self.process_index} had no generation batch {self.consumed} after "
                        f"{self.timeout:g} s (generation_batch_timeout): its generation thread "
                        f"{self.activity.describe()}; {LATE_BATCH_HINT}."
                    )
        if batch.index != self.consumed:
            raise RuntimeError(f"Generation batches out of order: expected {self.consumed}, got {batch.index}.")
        self.consumed += 1
        end = time.perf_counter()
        self.timeline.record(
            TRAINING_LANE,
            "wait for batch",
            start,
            end,
            {"batch": batch.index, "version": batch.version, "staleness": self._trainer_version - batch.version},
        )
        if self.exact_versions:
            # versions older than this batch's: no batch still to be trained (or regenerated after a resume from a
            # checkpoint taken while this one trains) is generated with them
            self.backend.release_versions_before(self.min_version(batch.index))
        return batch, end - start

    def stop(self, timeout: float = 30.0) -> bool:
        """Ask the thread to stop (ending a running ``generate`` early) and join it.

        Returns whether the thread has ended. A thread stuck in user code (a reward function that never returns)
        cannot be killed: it is a daemon thread, so it does not keep the process alive, and the caller is told.
        """
        self.stop_event.set()
        with self._version_cond:
            self._version_cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def shut_down(self, timeout: float = 30.0) -> BaseException | None:
        """:meth:`stop`, for good: returns the thread's exception that no :meth:`get` re-raised (it failed after the
        trainer's last batch), if any. A thread that does not end within ``timeout`` (left behind: a daemon) and an
        exception raised while it was being stopped (most likely by the stop itself) are logged instead."""
        if not self.stop(timeout=timeout):
            logger.warning(
                "The a3po generation thread did not stop within %s s (stuck in a reward function or generate?); "
                "it is a daemon thread and is left behind, and this trainer refuses to train again while it runs.",
                timeout,
            )
        unreported = self.unreported_error()
        if unreported is None:
            return None
        error, after_stop = unreported
        if after_stop:
            logger.warning("The a3po generation thread raised while it was being stopped: %r", error)
            return None
        return error

    def draw_starts(self) -> dict[int, int]:
        """``{batch index: prompt batches drawn before it, counted from first_draw}`` for every batch begun so far,
        and the batch after the last one finished (what a checkpoint keeps, so that a resumed run draws where the
        batch it restarts at drew)."""
        with self._draw_lock:
            return dict(self._draw_starts)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def unreported_error(self) -> tuple[BaseException, bool] | None:
        """The generation thread's exception if no :meth:`get` re-raised it (it was raised after the trainer's last
        batch, or while the trainer stopped early), and whether it was raised after :meth:`stop` was asked (possibly
        a consequence of the stop); None if there is none."""
        if self._error is None or self._error_reported:
            return None
        return self._error, self._error_after_stop

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self._error_reported = True
            error = self._error
            raise error.with_traceback(error.__traceback__)

    # ---- generation thread ---------------------------------------------------------------------------------------
    def _should_stop(self) -> bool:
        return self.stop_event.is_set()

    def _wait_for_version(self, needed: int, index: int) -> tuple[float, bool]:
        """Wait until the trainer has published version ``needed``; returns the seconds waited and whether it was."""
        start = time.perf_counter()
        with self._version_cond:
            while self._trainer_version < needed:
                if self.stop_event.is_set():
                    raise GenerationStopped
                if self._requested >= index:  # the trainer is blocked on this batch: it cannot publish newer weights
                    self.schedule_misses += 1
                    return time.perf_counter() - start, False
                self._version_cond.wait(self.poll_interval)
        return time.perf_counter() - start, True

    def _produce(self, index: int) -> ScoredBatch:
        next_version = self.min_version(index + 1) if self.exact_versions and index + 1 < self.num_batches else None
        try:
            batch = self._produce_batch(index)
        except GenerationStopped:
            self.backend.finish_batch(None)
            raise
        except BaseException as error:
            self.backend.finish_batch(None, error)
            raise
        self.backend.finish_batch(next_version)
        return batch

    def _produce_batch(self, index: int) -> ScoredBatch:
        needed = self.min_version(index)
        with batch_span(self.timeline, GENERATION_LANE, batch=index) as span_args:
            wait_start = time.perf_counter()
            with doing(f"waiting for the weights of version {needed} for batch {index}"):
                waited, published = self._wait_for_version(needed, index)
            start = time.perf_counter()
            with doing(f"loading weights for batch {index}"):
                self.backend.refresh(needed if self.exact_versions and published else None, self._should_stop)
            loaded = time.perf_counter() - start
            version = self.backend.version
            # staleness of a generation span: versions published since the one generating (how far behind it is)
            span_args.update(version=version, staleness=self._trainer_version - version)
            record_in_batch_span("wait for staleness bound", wait_start, wait_start + waited, needed_version=needed)
            record_in_batch_span("weight load", start, start + loaded)
            with self._draw_lock:
                self._draw_starts[index] = self.first_draw + self.draws
            start = time.perf_counter()
            with doing(f"rolling out batch {index}"):
                batch = self._draw()
                if self.refill is not None:
                    exact = needed if self.exact_versions and published else None
                    batch = self.refill(batch, lambda: self._draw_again(exact))
            with self._draw_lock:
                self._draw_starts[index + 1] = self.first_draw + self.draws
            batch.index = index
            batch.version = version
            batch.timings["generator_wait_for_staleness_bound"] = waited
            batch.timings["weight_load"] = loaded + batch.timings.get("weight_load", 0.0)  # + between turns
            batch.timings["rollout"] = time.perf_counter() - start
            self.produced += 1
        return batch

    def _draw(self) -> ScoredBatch:
        """Roll out the next prompt batch with the loaded weights."""
        rows = next(self.prompt_batches)
        draw, self.draws = self.draws, self.draws + 1
        return self.rollout(self.backend, rows, self._should_stop, self.backend.trainer_state, draw)

    def _draw_again(self, exact: int | None) -> ScoredBatch:
        """A further draw of the same batch (dynamic sampling): the newest published weights (``exact``: that
        version, the batch's), then the next prompt batch. The backend is told the draw before is done, as between
        batches."""
        if self.stop_event.is_set():
            raise GenerationStopped
        self.backend.finish_batch(exact)
        start = time.perf_counter()
        self.backend.refresh(exact, self._should_stop)
        loaded = time.perf_counter() - start
        record_in_batch_span("weight load", start, start + loaded)
        batch = self._draw()
        batch.timings["weight_load"] = loaded + batch.timings.get("weight_load", 0.0)
        return batch

    def _run(self) -> None:
        try:
            if self.num_threads is not None:
                torch.get_num_threads()  # a new thread re-reads the process-wide value at its first parallel op
                torch.set_num_threads(self.num_threads)
            device = explicit_device(self.backend.device)  # torch.cuda.set_device refuses "cuda" without an index
            stream = None
            if device.type == "cuda":
                torch.cuda.set_device(device)
                stream = generation_stream(device)  # high priority: decode kernels never queue behind training's
            with (
                torch.inference_mode(),
                torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
                reporting_activity(self.activity.report),
            ):
                for index in range(self.num_batches):
                    if self.stop_event.is_set():
                        return
                    batch = self._produce(index)
                    if stream is not None:
                        stream.synchronize()
                    start = time.perf_counter()
                    with doing(f"waiting for room in the sample queue for batch {index}"):
                        self.queue.put(batch, self._should_stop, self.poll_interval)
                    self.timeline.record(
                        GENERATION_LANE,
                        "wait for queue room",
                        start,
                        time.perf_counter(),
                        {"batch": index, "version": batch.version},
                    )
                self.activity.report("done: every batch of the run was generated")
        except GenerationStopped:
            return
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            if hasattr(error, "add_note"):
                error.add_note("(raised in the a3po-trl generation thread)")
            self._error_after_stop = self.stop_event.is_set()
            self._error = error
        finally:
            self.thread_cpu_at_exit = time.thread_time()


def refuse_a_second_generation_thread(alive_somewhere: bool, stop_timeout: float) -> None:
    """Refuse to start a generation thread while the one of an earlier ``train()`` call on the same trainer is still
    running (on any process: ``alive_somewhere``): it shares the trainer's generation backend."""
    if alive_somewhere:
        raise RuntimeError(
            "The generation thread of an earlier train() call on this trainer is still running (it did not stop "
            f"within generation_stop_timeout={stop_timeout} s: stuck in a reward function, a tool or generate) and "
            "shares this trainer's generation backend, so this trainer cannot train again in this process. Restart "
            "the process and resume with resume_from_checkpoint=True, or find what blocks the thread (its stack: "
            "faulthandler.dump_traceback())."
        )
