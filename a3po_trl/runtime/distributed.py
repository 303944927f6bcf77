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
gloo's threads during finalization; not reproduced here).

:func:`raise_together` is the other half: a step every process takes together (taking a generation batch, saving or
resuming a checkpoint) that fails on one process raises on all of them, so none is left in a collective.

:func:`take_together` is that step for a wait of unknown length: each process takes its generation batch, then waits
for the others at an :class:`ArrivalGate` (through the store, no collective) before the collective that agrees on the
outcome. A process whose generation thread must draw many batches (dynamic sampling) can keep the others waiting
longer than the process group's timeout (``ddp_timeout``, 30 min by default); in a collective they would fail with a
timeout that says nothing of why.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

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
    try:
        if "gloo" in str(dist.get_backend()).lower() and dist.get_world_size() > 1:
            # every rank finishes its last collective before any rank tears its connections down; bounded on every
            # rank, so a rank that crashed delays the others' exit (and a failed rank its own) by at most the timeout
            store = dist.distributed_c10d._get_default_store()
            exit_barrier(store, dist.get_world_size(), EXIT_BARRIER_TIMEOUT_SECONDS)
            # every rank is here: a gloo barrier on each group now meets the others, and finishes the work still
            # queued on the group (work nobody waited for, e.g. ZeRO-3's prefetching all-gathers) while the
            # interpreter is whole, rather than on gloo's threads during finalization
            drain_pending_work(gloo_groups(), EXIT_BARRIER_TIMEOUT_SECONDS)
    except Exception as error:
        logger.warning("barrier before destroy_process_group at exit failed: %r", error)
    try:
        dist.destroy_process_group()
    except Exception as error:  # never let shutdown hide the original outcome of the run
        logger.warning("destroy_process_group at exit failed: %r", error)
        return False
    return True


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


class ArrivalGate:
    """A point every process passes together, one call of :meth:`wait` after another, waited for through the process
    group's store: no collective, so a wait as long as another process needs (its generation drawing many batches)
    never runs into the process group's timeout. A process killed meanwhile leaves the others waiting until the
    launcher ends them on its exit, or, when it was process 0 (the store's host), until their next look fails.

    Built by every process together, in the main thread (:func:`private_store`: one broadcast); nothing with one
    process. ``poll_interval`` bounds the pause between two looks at the store (the first look comes after 1 ms, each
    next one after twice as long)."""

    def __init__(self, accelerator, name: str, poll_interval: float):
        self.world_size = accelerator.num_processes
        self.process_index = accelerator.process_index
        self.poll_interval = poll_interval
        self.store = private_store(name) if self.world_size > 1 else None
        self.passed = 0

    def wait(self, what: str) -> None:
        """Return once every process called this as often as this one; ``what`` names the step in the log when the
        wait is long."""
        if self.store is None:
            return
        key = f"arrived/{self.passed}"
        arrived, pause, start = self.store.add(key, 1), 0.001, time.monotonic()
        report_after = GATE_REPORT_AFTER_SECONDS
        while arrived < self.world_size:
            time.sleep(pause)
            pause = min(2 * pause, self.poll_interval)
            arrived = self.store.add(key, 0)
            waited = time.monotonic() - start
            if arrived < self.world_size and waited >= report_after:
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
        if self.passed > 0 and self.process_index == 0:
            # every process passed the previous gate before it arrived at this one, which all have now
            self.store.delete_key(f"arrived/{self.passed - 1}")
        self.passed += 1


def take_together(accelerator, gate: ArrivalGate, take: Callable[[], object], what: str):
    """``take()`` on every process, then its result; if it raised on any process, raises on every one
    (:func:`raise_together`). The processes meet at ``gate`` first, so that however long one of them takes, the others
    wait for it outside the collective that agrees on the outcome."""
    taken, error = None, None
    try:
        taken = take()
    except Exception as failure:  # noqa: BLE001 - raised on every process by raise_together
        error = failure
    gate.wait(what)
    raise_together(accelerator, error, what)
    return taken


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
