"""Reward functions scored in worker processes (``reward_num_workers > 0``), off the trainer's interpreter.

Everything a step does in Python competes for one interpreter lock: a CPU-heavy pure-Python reward (parsing and
checking math answers) run in the generation thread stalls the training thread's kernel launches for as long as it
runs. :class:`RewardWorkers` keeps a pool of worker processes (``concurrent.futures.ProcessPoolExecutor``, started
with ``spawn``: forking a process that runs torch threads is unsafe) and calls each plain or ``async def`` reward
function there, once per batch with the whole batch, exactly as GRPOTrainer calls it in its own process: the same
keyword arguments (dataset columns, ``trainer_state``, a ``rollout_func``'s extra fields), and ``log_extra`` /
``log_metric`` proxied (the calls are recorded in the worker and replayed in the trainer, in order). The values come
back as the function returned them and are converted in the trainer (:mod:`.scoring`), so ``None`` is NaN and a bad
value is refused as in the thread. Reward models (``nn.Module``) stay in the trainer's process.

Functions are sent to each worker once, when it starts, as pickled references; :func:`check_sendable` refuses, when
the trainer is built, a function that cannot be sent (a lambda, a locally defined function or a closure, a function
of an interactive session). A function's exception is raised from ``train()`` with its name and the worker's
traceback; a worker that dies (``os._exit``, killed, out of memory) makes the batch fail with the names of the
functions it was scoring, and the trainer closes the pool (its processes ended) when the generation thread stops.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

from torch import nn
from trl.trainer.utils import is_async_callable

from ..runtime.child_errors import CapturedError

logger = logging.getLogger(__name__)

PROXIED_CALLBACKS = ("log_extra", "log_metric")
"""Keyword arguments GRPOTrainer passes as bound methods of the trainer: recorded in the worker, replayed here."""

FIX = "define it with `def` at the top level of an importable module, or set reward_num_workers=0"


def scored_in_workers(func) -> bool:
    """Whether ``reward_num_workers > 0`` sends ``func`` to the workers (plain and ``async def`` functions), or keeps
    it in the trainer's process (reward models)."""
    return not isinstance(func, nn.Module)


def check_sendable(reward_funcs: list, reward_func_names: list[str]) -> list[bytes]:
    """Each reward function the workers score, pickled (a reference to it), or a ``ValueError`` naming the first that
    cannot be sent to a process and the fix."""
    payloads = []
    for func, name in zip(reward_funcs, reward_func_names, strict=True):
        if not scored_in_workers(func):
            continue
        module = getattr(func, "__module__", None)
        if module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
            raise ValueError(
                f"The reward function {name!r} is defined in an interactive session (a notebook or the REPL), which "
                f"reward worker processes cannot import (reward_num_workers > 0): move it to a .py file and import "
                f"it from there, or set reward_num_workers=0."
            )
        try:
            payloads.append(pickle.dumps(func))
        except Exception as error:  # PicklingError, AttributeError ("Can't pickle local object"), TypeError
            raise ValueError(
                f"The reward function {name!r} cannot be sent to a reward worker process (reward_num_workers > 0): "
                f"{type(error).__name__}: {error}. Lambdas, functions defined inside another function and closures "
                f"(e.g. over a model) cannot cross a process boundary: {FIX}."
            ) from error
    return payloads


def start_reward_workers(trainer) -> RewardWorkers | None:
    """The reward workers of a ``train()`` run with ``reward_num_workers > 0`` and a function for them to call (None
    otherwise), said once at INFO on the main process."""
    num_workers = trainer.args.reward_num_workers
    names = [n for f, n in zip(trainer.reward_funcs, trainer.reward_func_names) if scored_in_workers(f)]
    if not num_workers or not names:
        return None
    if trainer.accelerator.is_main_process:
        logger.info("Reward functions %s are called in %d worker processes (reward_num_workers)", names, num_workers)
    return RewardWorkers(trainer.reward_funcs, trainer.reward_func_names, num_workers)


class RewardWorkers:
    """A pool of ``num_workers`` processes that score batches with ``reward_funcs`` (those :func:`scored_in_workers`
    says), started here and warmed up (their imports overlap the first batch's generation); :meth:`close` ends it."""

    def __init__(self, reward_funcs: list, reward_func_names: list[str], num_workers: int):
        self.names = list(reward_func_names)
        self.worker_indices = [i for i, func in enumerate(reward_funcs) if scored_in_workers(func)]
        """Columns the workers score, in order; the payloads are in the same order."""
        self.is_async = {i: is_async_callable(reward_funcs[i]) for i in self.worker_indices}
        payloads = check_sendable(reward_funcs, reward_func_names)
        self._executor = ProcessPoolExecutor(
            max_workers=num_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_keep_functions,
            initargs=(dict(zip(self.worker_indices, payloads)),),
        )
        for _ in range(num_workers):  # each submit without an idle worker starts one
            self._executor.submit(_ready)

    def submit(self, indices: list[int], prompts, completions, completion_ids, kwargs: dict) -> PendingRewards:
        """Start calling the functions at ``indices`` with the batch in the workers (one task per plain function, one
        for the ``async def`` ones); ``kwargs``'s proxied callbacks are recorded there."""
        proxied = [name for name in PROXIED_CALLBACKS if callable(kwargs.get(name))]
        sent = {key: value for key, value in kwargs.items() if key not in proxied}
        call = _pickled_call(prompts, completions, completion_ids, sent)
        groups = [[i] for i in indices if not self.is_async[i]]
        in_async = [i for i in indices if self.is_async[i]]
        if in_async:  # concurrently on one event loop, as GRPOTrainer gathers them
            groups.append(in_async)
        tasks = [(group, self._executor.submit(_score, group, call, proxied)) for group in groups]
        return PendingRewards(tasks, self.names, {name: kwargs[name] for name in proxied})

    def close(self, timeout: float = 30.0) -> None:
        """End the pool: cancel what is queued, give running calls ``timeout`` seconds, then end the processes; on
        return every worker has ended and been reaped, and the pool's manager thread is done.

        Whether a worker has ended is read from its sentinel (ready once the process exits), not from ``is_alive()``:
        the pool's manager thread reaps the workers too (a broken pool's at once), and a worker it reaped reads as
        alive here until that thread records the exit code; signalling a reaped pid could reach another process."""
        executor = self._executor
        processes = list((getattr(executor, "_processes", None) or {}).values())
        # shutdown() drops its references (the manager thread, the processes) at once, wait or not: a second call
        # would join nothing, so the manager thread is kept here and joined below
        manager = getattr(executor, "_executor_manager_thread", None)
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for process in processes:
            if not wait_for_sentinels([process.sentinel], max(0.0, deadline - time.monotonic())):
                process.terminate()  # a reward call that does not return (Python < 3.14 has no terminate_workers)
                if not wait_for_sentinels([process.sentinel], 5.0):
                    process.kill()
        if manager is not None:
            manager.join(timeout=30.0)  # its workers have ended: it joins them and returns
            if manager.is_alive():
                logger.warning("The reward worker pool's manager thread did not end within 30 s of its workers")
        for process in processes:
            process.join(5.0)  # the exit code of a worker this thread reaped (the manager records its own)


class PendingRewards:
    """The workers' calls of one batch, from :meth:`RewardWorkers.submit`."""

    def __init__(self, tasks: list[tuple[list[int], Future]], names: list[str], callbacks: dict):
        self.tasks, self.names, self.callbacks = tasks, names, callbacks

    def results(self) -> dict[int, Any]:
        """``{column: values}`` as each function returned them, once every call returned (waiting without the
        interpreter lock), after replaying the proxied callbacks' calls in column order (plain functions first, then
        the ``async def`` ones, as GRPOTrainer calls them). Raises the first function's error with its name and the
        worker's traceback, or names the functions a dead worker was scoring."""
        results, replays = {}, []
        for position, (group, future) in enumerate(self.tasks):
            try:
                outcome = future.result()
            except BrokenProcessPool as error:
                unfinished = [self.names[i] for pending, _ in self.tasks[position:] for i in pending]
                raise RuntimeError(
                    f"A reward worker process died while scoring with the reward functions {unfinished} (killed, out "
                    "of memory, os._exit, or a training script without `if __name__ == '__main__':` that the spawned "
                    "worker started again); the pool cannot score further batches. Set reward_num_workers=0 to score "
                    "in the trainer's process."
                ) from error
            if isinstance(outcome, _Failure):
                raise outcome.rebuilt(self.names[outcome.index])
            for i, (values, calls) in zip(group, outcome, strict=True):
                results[i] = values
                replays.extend(calls)
        for name, args in replays:
            self.callbacks[name](*args)
        return results


def _pickled_call(prompts, completions, completion_ids, kwargs: dict) -> bytes:
    """The batch's arguments, pickled once for every task; a ``TypeError`` naming an argument that cannot be sent."""
    try:
        return pickle.dumps((prompts, completions, completion_ids, kwargs))
    except Exception:
        for key, value in {"prompts": prompts, "completions": completions, **kwargs}.items():
            try:
                pickle.dumps(value)
            except Exception as error:
                raise TypeError(
                    f"The reward keyword argument {key!r} ({type(value).__name__}) cannot be sent to a reward worker "
                    f"process (reward_num_workers > 0): {error}. Set reward_num_workers=0 to score in the trainer's "
                    "process."
                ) from error
        raise


# ---- in the worker process --------------------------------------------------------------------------------------

_payloads: dict[int, bytes] = {}
_functions: dict[int, Any] = {}
_loop: asyncio.AbstractEventLoop | None = None


def _keep_functions(payloads: dict[int, bytes]) -> None:
    """The pool's initializer: keep the pickled functions (loaded at their first call, where an error is reported)."""
    _payloads.update(payloads)


def _ready() -> None:
    """The warm-up task: the worker has started and imported what unpickling its task needs."""


class _Recorder:
    """Stands for a proxied callback in the worker: records each call's arguments for the trainer to replay."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def __call__(self, *args):
        self.calls.append((self.name, args))


class _Failure(CapturedError):
    """A reward function's exception as the worker saw it (:class:`~a3po_trl.runtime.child_errors.CapturedError`)."""

    def __init__(self, error: BaseException, index: int, loading: bool):
        super().__init__(error)
        self.index, self.loading = index, loading

    def rebuilt(self, name: str) -> BaseException:
        """The function's exception with ``name`` in a note and the worker's traceback as its cause."""
        error = self.raised_here(WorkerTraceback)
        if self.loading:
            note = f"(the reward function {name!r} could not be loaded in a reward worker process: {FIX})"
        else:
            note = f"(raised by the reward function {name!r} in a reward worker process)"
        note_function_name(error, name, note)
        return error


def note_function_name(error: BaseException, name: str, note: str) -> None:
    """Add ``note`` to ``error`` unless one of its notes already names the reward function ``name`` (an error raised
    through several layers is named once)."""
    if not any(name in existing for existing in getattr(error, "__notes__", [])):
        error.add_note(note)


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a reward worker process (the cause of the one ``train()`` raises)."""

    def __str__(self):
        return "the reward worker's traceback:\n" + self.args[0]


def _function(index: int):
    if index not in _functions:
        _functions[index] = pickle.loads(_payloads[index])
    return _functions[index]


def _score(indices: list[int], call: bytes, proxied: list[str]) -> list[tuple[Any, list]] | _Failure:
    """Call the functions at ``indices`` (one plain function, or ``async def`` ones gathered on the worker's event
    loop) with the batch; returns each one's values and its proxied callback calls, or the first failure."""
    functions = []
    for index in indices:
        try:
            functions.append(_function(index))
        except Exception as error:  # e.g. a function of a script that the worker cannot import
            return _Failure(error, index, loading=True)
    prompts, completions, completion_ids, kwargs = pickle.loads(call)
    recorded = [[] for _ in indices]
    all_kwargs = [{**kwargs, **{name: _Recorder(name, calls) for name in proxied}} for calls in recorded]
    if len(functions) == 1 and not is_async_callable(functions[0]):
        try:
            values = [
                functions[0](prompts=prompts, completions=completions, completion_ids=completion_ids, **all_kwargs[0])
            ]
        except Exception as error:
            return _Failure(error, indices[0], loading=False)
        return list(zip(values, recorded))

    async def call_one(index, func, func_kwargs):
        try:
            return await func(prompts=prompts, completions=completions, completion_ids=completion_ids, **func_kwargs)
        except Exception as error:
            return _Failure(error, index, loading=False)

    async def call_all():
        return await asyncio.gather(*(call_one(*arguments) for arguments in zip(indices, functions, all_kwargs)))

    values = _event_loop().run_until_complete(call_all())
    failures = [value for value in values if isinstance(value, _Failure)]
    return failures[0] if failures else list(zip(values, recorded))


def _event_loop() -> asyncio.AbstractEventLoop:
    """The worker's event loop, kept across batches as TRL keeps its daemon loop (clients may bind to it)."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
    return _loop
