"""Process-group shutdown that does not depend on interpreter-exit order, and failing together.

A gloo process group that is still alive when the Python interpreter finalizes can abort the process after training
has finished (``terminate called without an active exception``): gloo's C++ worker threads still hold work objects
whose tensors reference Python objects, and destroying them during finalization is not safe (pytorch/pytorch#190489,
and the analysis in pytorch/pytorch#179291). Scripts that end with ``destroy_process_group()`` never see it; TRL-style
scripts usually do not call it. :func:`destroy_process_group_at_exit` registers that call with :mod:`atexit`, which
runs while the interpreter is still whole, so every script that builds an `AsyncA3POTrainer` shuts down cleanly.
Before destroying the group the handler waits, with a timeout, for every rank: with the teardown alone a rank could
still tear its connections down while another finished its last collective (measured: 2 aborts in 14 two-process
ZeRO-3 + LoRA runs; 0 in 26 with the barrier). The wait goes through the process group's store, not a collective, so
it is bounded on every rank: gloo's ``monitored_barrier`` bounds rank 0's wait only, and a rank that failed while
another was left in a collective waiting for it then waited for rank 0's answer for the process group's whole
timeout (30 min) instead of exiting, which is what lets the launcher end the others. Once every rank is there, a gloo
barrier on each gloo group (bounded too) finishes the work still queued on it, which gloo runs before a barrier: with
the store's wait alone a two-process ZeRO-3 run with a reward model still aborted a rank at exit once in CI (an
asynchronous collective nobody waited for, ZeRO-3's prefetching, is the candidate: its tensors would be released on
gloo's threads during finalization; not reproduced here). When that barrier times out it stays queued, and tearing
the group down would wait for it until the process group's timeout: the process then ends at once
(:func:`exit_without_finalizing`), so the exit is bounded for real.

:func:`raise_together` is the other half: a step every process takes together (taking a generation batch, saving or
resuming a checkpoint) that fails on one process raises on all of them, so none is left in a collective.

:func:`take_together` is that step for a wait of unknown length: each process takes its generation batch, then waits
for the others at an :class:`ArrivalGate` (through the store, no collective) before the collective that agrees on the
outcome. A process whose generation thread must draw many batches (dynamic sampling) can keep the others waiting
longer than the process group's timeout (``ddp_timeout``, 30 min by default); in a collective they would fail with a
timeout that says nothing of why. The gate's own wait is bounded (``generation_batch_timeout``, by default that same
timeout): a process that does not arrive (its generation thread stuck in a reward function, or the process dead) fails
every process with an error naming it and what it was doing, which each process publishes to the store
(:mod:`a3po_trl.runtime.activity`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from .activity import LATE_BATCH_HINT, describe_activity

logger = logging.getLogger(__name__)

#: Longest wait, at exit, for the other ranks to arrive before the process group is destroyed.
EXIT_BARRIER_TIMEOUT_SECONDS = 30.0

_registered = False
_lock = threading.Lock()


def destroy_process_group_if_initialized() -> bool:
    """Destroy the default process group if one is initialized; returns whether one was destroyed.

    Safe to call more than once and after the group was destroyed elsewhere (``accelerate``'s ``end_training`` or
    the user's own ``destroy_process_group``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    drained = True
    try:
        if "gloo" in str(dist.get_backend()).lower() and dist.get_world_size() > 1:
            # every rank finishes its last collective before any rank tears its connections down; bounded on every
            # rank, so a rank that crashed delays the others' exit (and a failed rank its own) by at most the timeout
            store = dist.distributed_c10d._get_default_store()
            exit_barrier(store, dist.get_world_size(), EXIT_BARRIER_TIMEOUT_SECONDS)
            # every rank is here: a gloo barrier on each group now meets the others, and finishes the work still
            # queued on the group (work nobody waited for, e.g. ZeRO-3's prefetching all-gathers) while the
            # interpreter is whole, rather than on gloo's threads during finalization
            drained = False
            drain_pending_work(gloo_groups(), EXIT_BARRIER_TIMEOUT_SECONDS)
            drained = True
    except Exception as error:
        logger.warning("barrier before destroy_process_group at exit failed: %r", error)
    if not drained:
        exit_without_finalizing(EXIT_BARRIER_TIMEOUT_SECONDS)
    try:
        dist.destroy_process_group()
    except Exception as error:  # never let shutdown hide the original outcome of the run
        logger.warning("destroy_process_group at exit failed: %r", error)
        return False
    return True


def exit_without_finalizing(waited_seconds: float) -> None:
    """End the process now, with status 1, after flushing its output and logs: what :func:`drain_pending_work` waited
    for did not finish within ``waited_seconds``, and its barrier stays queued on gloo's threads, which
    ``destroy_process_group`` (or the interpreter's own finalization) joins: that would hold the exit for the rest of
    the process group's timeout (30 min by default; measured: 18 s of a 20-s timeout after a 2-s drain), and no abort
    of the group releases them (``ProcessGroup.abort`` and ``_abort_process_group`` wait the same). The work left is
    a collective some process never joined, so the run did not end cleanly: status 1. :mod:`atexit` handlers
    registered before the trainer's are skipped."""
    logger.error(
        "The process group's work at exit did not finish within %g s; exiting now (status 1) rather than waiting "
        "for the process group's timeout in its teardown.",
        waited_seconds,
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def exit_barrier(store, world_size: int, timeout_seconds: float) -> None:
    """Wait until all ``world_size`` processes called this (each once, at exit) or ``timeout_seconds`` passed, through
    ``store`` (no collective: the wait is bounded on every process). Raises ``RuntimeError`` naming how many arrived
    when the time is up."""
    arrived = store.add("a3po/exit_barrier", 1)
    if arrived == world_size:
        store.set("a3po/exit_barrier_done", "1")
    try:
        store.wait(["a3po/exit_barrier_done"], datetime.timedelta(seconds=timeout_seconds))
    except Exception as error:  # the store's timeout error
        arrived = store.add("a3po/exit_barrier", 0)
        raise RuntimeError(
            f"{arrived} of {world_size} processes reached the exit within {timeout_seconds:g} s ({error})"
        ) from error


def gloo_groups() -> list:
    """This process's gloo process groups (the default one and every group made with ``new_group`` that it belongs
    to), in the order they were made (torch's group map is a dict filled as they are made), which is the same on
    every process."""
    return [group for group in dist.distributed_c10d._world.pg_map if str(dist.get_backend(group)).lower() == "gloo"]


def drain_pending_work(groups, timeout_seconds: float) -> None:
    """A barrier on each of ``groups`` (gloo groups), each waited for at most ``timeout_seconds``: gloo runs a barrier
    only after all the work queued on its group before it (asynchronous collectives whose handles nobody waited for),
    so once it returns none of that work is left for gloo's threads to finish, and release the tensors it holds,
    during interpreter finalization. Every process of each group must call this (a collective). Raises the first
    group's error or timeout."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    for group in groups:
        group.barrier().wait(timeout)


class PeerProcessFailed(RuntimeError):
    """Another training process failed at a step every process takes together, so this one stops too."""


def raise_together(accelerator, error: BaseException | None, what: str, peer_error=PeerProcessFailed) -> None:
    """Tell every process whether ``what`` failed on this one; every process raises if it failed on any: a process's
    own error with its traceback, the others a ``peer_error`` naming each process that failed and its error. So no
    process goes on to a collective a failed process would never join (it would wait there until that process exited,
    then fail with the backend's "connection closed by peer", or wait out the process group's timeout). A collective:
    every process calls it together."""
    from accelerate.utils import gather_object

    mine = f"{type(error).__name__}: {error}" if error is not None else None
    if accelerator.num_processes > 1:
        everyone = gather_object([(accelerator.process_index, mine)])
    else:
        everyone = [(accelerator.process_index, mine)]
    if error is not None:
        raise error
    failures = [f"on process {index}: {message}" for index, message in everyone if message is not None]
    if failures:
        raise peer_error(f"{what} failed {'; '.join(failures)}")


#: Seconds a process waits at an :class:`ArrivalGate` before it first says so in the log (then after twice as long).
GATE_REPORT_AFTER_SECONDS = 300.0

#: The outcome of a gate every process arrived at (any other outcome is the error of the process that gave up).
_PASSED = "passed"


class ProcessDidNotArrive(PeerProcessFailed):
    """Another process did not arrive at an :class:`ArrivalGate` within its timeout, so every process stops."""


class ArrivalGate:
    """A point every process passes together, one call of :meth:`wait` after another, waited for through the process
    group's store: no collective, so a wait as long as another process needs (its generation drawing many batches)
    does not run into the process group's timeout, and is bounded by the gate's own ``timeout``. When a process gives
    up, the gate's outcome is its error, and every process raises it (:class:`ProcessDidNotArrive`), also one that
    arrives later: the outcome is set once, by the first process to see every process there or to give up, so no
    process passes a gate another gave up on (it would wait for it in the collective after the gate). The error names
    each process that did not arrive and what it last published with :meth:`publish_activity` (its generation
    thread's activity, :mod:`a3po_trl.runtime.activity`); a process killed meanwhile stays with its last one.

    ``store``: the store every process reaches, under a prefix private to the gate (:meth:`of_processes` makes one);
    None with one process (nothing to wait for). ``poll_interval`` bounds the pause between two looks at the store
    (the first look comes after 1 ms, each next one after twice as long); ``timeout``: seconds a process waits at the
    gate before it gives up, None for no bound."""

    def __init__(self, store, process_index: int, world_size: int, poll_interval: float, timeout: float | None):
        self.store = store if world_size > 1 else None
        self.process_index = process_index
        self.world_size = world_size
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.passed = 0

    @classmethod
    def of_processes(cls, accelerator, name: str, poll_interval: float, timeout: float | None) -> ArrivalGate:
        """The gate of every process of ``accelerator``, built by all of them together, in the main thread
        (:func:`private_store`: one broadcast); with one process, a gate that never waits."""
        world_size = accelerator.num_processes
        store = private_store(name) if world_size > 1 else None
        return cls(store, accelerator.process_index, world_size, poll_interval, timeout)

    def publish_activity(self, what: str, since: float) -> None:
        """Publish what this process is doing (since ``since``, ``time.time()``) for the others' error should it not
        arrive. Any thread may call it."""
        if self.store is not None:
            self.store.set(f"doing/{self.process_index}", json.dumps([what, since]))

    def wait(self, what: str) -> None:
        """Return once every process called this as often as this one; ``what`` names the step in the log when the
        wait is long, and in the error. Raises :class:`ProcessDidNotArrive` when a process gave up waiting (this one,
        after ``timeout`` seconds, or another)."""
        if self.store is None:
            return
        key = f"arrived/{self.passed}"
        self.store.set(f"{key}/{self.process_index}", "1")  # who arrived: for the error naming who did not
        arrived, pause, start = self.store.add(key, 1), 0.001, time.monotonic()
        report_after = GATE_REPORT_AFTER_SECONDS
        outcome = None
        while outcome is None:
            waited = time.monotonic() - start
            if arrived >= self.world_size:
                outcome = self._decide(key, _PASSED)
            elif self.timeout is not None and waited >= self.timeout:
                outcome = self._decide(key, self._absence(key, what))
            elif self.store.check([f"{key}/outcome"]):  # another process gave up
                outcome = self.store.get(f"{key}/outcome").decode()
            else:
                if waited >= report_after:
                    report_after *= 2
                    logger.warning(
                        "%s: process %d has waited %.0f s for the other processes (%d of %d are there); one whose "
                        "generation draws many batches (dynamic sampling) takes that long.",
                        what,
                        self.process_index,
                        waited,
                        arrived,
                        self.world_size,
                    )
                time.sleep(pause)
                pause = min(2 * pause, self.poll_interval)
                arrived = self.store.add(key, 0)
        if outcome != _PASSED:
            raise ProcessDidNotArrive(outcome)
        if self.passed > 0 and self.process_index == 0:
            # every process passed the previous gate before it arrived at this one, which all have now
            previous = f"arrived/{self.passed - 1}"
            for done in (previous, f"{previous}/outcome", *(f"{previous}/{i}" for i in range(self.world_size))):
                self.store.delete_key(done)
        self.passed += 1

    def _decide(self, key: str, outcome: str) -> str:
        """Set the gate's outcome unless a process set it first; returns the outcome that holds."""
        return self.store.compare_set(f"{key}/outcome", "", outcome).decode()

    def _absence(self, key: str, what: str) -> str:
        """The error of a gate this process gives up on: each process that did not arrive and what it was doing."""
        missing = [i for i in range(self.world_size) if not self.store.check([f"{key}/{i}"])]
        described = []
        for index in missing:
            doing = None, None
            if self.store.check([f"doing/{index}"]):
                doing = json.loads(self.store.get(f"doing/{index}"))
            described.append(f"process {index} {describe_activity(*doing)}")
        return (
            f"{what}: process {', '.join(map(str, missing))} did not arrive within {self.timeout:g} s "
            f"(generation_batch_timeout; None takes the process group's timeout, ddp_timeout) while process "
            f"{self.process_index} waited: {'; '.join(described)}. A process is late when its generation is "
            f"{LATE_BATCH_HINT}; or it died."
        )


def take_together(accelerator, gate: ArrivalGate, take: Callable[[], object], what: str):
    """``take()`` on every process, then its result; if it raised on any process, raises on every one
    (:func:`raise_together`). The processes meet at ``gate`` first, so that however long one of them takes, the others
    wait for it outside the collective that agrees on the outcome; a process that does not arrive within the gate's
    timeout fails every process, the late one with its own error if it has one."""
    taken, error = None, None
    try:
        taken = take()
    except Exception as failure:  # noqa: BLE001 - raised on every process by raise_together
        error = failure
    try:
        gate.wait(what)
    except ProcessDidNotArrive:
        if error is not None:
            raise error from None  # this process is the late one: its own error says why
        raise
    raise_together(accelerator, error, what)
    return taken


def process_group_timeout(default: float) -> float:
    """Seconds of the default process group's timeout (``ddp_timeout``, or accelerate's ``InitProcessGroupKwargs``),
    read from its store, which the process group was made with; ``default`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return default
    return dist.distributed_c10d._get_default_store().timeout.total_seconds()


def private_store(prefix: str):
    """A key-value store every process of the default process group reaches (its ``TCPStore``), under a prefix that
    is new for every call: the processes agree on it with one broadcast, so every process must call this together,
    in the main thread. Store calls are not collectives: any thread may use the store afterwards."""
    import uuid

    from accelerate.utils import broadcast_object_list

    tag = [uuid.uuid4().hex]
    broadcast_object_list(tag, from_process=0)
    return dist.PrefixStore(f"{prefix}/{tag[0]}", dist.distributed_c10d._get_default_store())


def teardown_registered() -> bool:
    """Whether :func:`destroy_process_group_at_exit` registered its atexit handler in this process."""
    return _registered


def destroy_process_group_at_exit(backends: tuple[str, ...] = ("gloo",)) -> bool:
    """Register :func:`destroy_process_group_if_initialized` with :mod:`atexit` once per process.

    Only for process groups whose backend is in ``backends`` (default: gloo, the CPU backend the exit abort was seen
    with; NCCL has its own shutdown path and only warns). Returns whether a handler is registered after the call.
    """
    global _registered
    if not (dist.is_available() and dist.is_initialized()):
        return _registered
    backend = str(dist.get_backend()).lower()
    if not any(name in backend for name in backends):
        return _registered
    with _lock:
        if not _registered:
            atexit.register(destroy_process_group_if_initialized)
            _registered = True
    return True
