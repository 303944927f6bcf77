"""Process-group shutdown that does not depend on interpreter-exit order.

A gloo process group that is still alive when the Python interpreter finalizes can abort the process after training
has finished (``terminate called without an active exception``): gloo's C++ worker threads still hold work objects
whose tensors reference Python objects, and destroying them during finalization is not safe (pytorch/pytorch#190489,
and the analysis in pytorch/pytorch#179291). Scripts that end with ``destroy_process_group()`` never see it; TRL-style
scripts usually do not call it. :func:`destroy_process_group_at_exit` registers that call with :mod:`atexit`, which
runs while the interpreter is still whole, so every script that builds an `AsyncA3POTrainer` shuts down cleanly.
"""

from __future__ import annotations

import atexit
import logging
import threading

import torch.distributed as dist

logger = logging.getLogger(__name__)

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
        dist.destroy_process_group()
    except Exception as error:  # never let shutdown hide the original outcome of the run
        logger.warning("destroy_process_group at exit failed: %r", error)
        return False
    return True


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
