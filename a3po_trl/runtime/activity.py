"""What the thread producing generation batches is doing now, so that an error can say why a process is late.

A process whose generation thread is stuck (a reward function, a tool or a vLLM server that does not return) keeps
every other process waiting for it; the bound on that wait (:class:`~a3po_trl.runtime.distributed.ArrivalGate`, the
batch producer's ``get``) then fails with an error that should say what the late process was doing. The producer opens
:func:`reporting_activity` on the thread that produces (the generation thread, or the main thread with
``async_generation=False``), and marks its own phases with :func:`doing`, as do the code deep inside a rollout that
does not hold the producer (generation, reward functions, tool calls): each change is passed to the producer's report
(kept for its own error, and published to the process group's store for the others' errors). Outside an open report
:func:`doing` is a no-op, so backends and rollouts used on their own are unaffected.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

#: What an error about a late batch suggests: why generation stops, and the setting that bounds the wait.
LATE_BATCH_HINT = (
    "stuck in a reward function, a tool or a vLLM server (its stack: faulthandler.dump_traceback()), or only slower "
    "than the bound (dynamic sampling drawing many batches): raise generation_batch_timeout then"
)

_current = threading.local()


@contextlib.contextmanager
def reporting_activity(report: Callable[[str], None]):
    """Pass every activity the calling thread marks with :func:`doing` inside the block to ``report``."""
    previous = getattr(_current, "report", None), getattr(_current, "what", None)
    _current.report, _current.what = report, None
    try:
        yield
    finally:
        _current.report, _current.what = previous


@contextlib.contextmanager
def doing(what: str):
    """Mark the block as what the calling thread is doing, within the activity around it (``"rolling out batch 3: in
    the reward function 'f'"``): reported when it starts, and the outer activity again when it ends; a no-op outside
    :func:`reporting_activity`."""
    report = getattr(_current, "report", None)
    if report is None:
        yield
        return
    outer = _current.what
    _current.what = what if outer is None else f"{outer}: {what}"
    report(_current.what)
    try:
        yield
    finally:
        _current.what = outer
        if outer is not None:
            report(outer)


class Activity:
    """The latest activity a thread reported and when (``time.time()``, comparable across processes on synchronised
    clocks), and :meth:`report` to pass to :func:`reporting_activity`, which also forwards it to ``publish`` (a
    failure to publish is ignored: the report only serves an error message)."""

    def __init__(self, publish: Callable[[str, float], None] | None = None):
        self.publish = publish
        self.what: str | None = None
        self.since = time.time()

    def report(self, what: str) -> None:
        self.what, self.since = what, time.time()
        if self.publish is not None:
            with contextlib.suppress(Exception):
                self.publish(what, self.since)

    def describe(self) -> str:
        """``"<activity> for the last N s"``, or that nothing was reported."""
        return describe_activity(self.what, self.since)


def describe_activity(what: str | None, since: float | None) -> str:
    """Words for an activity reported at ``since`` (``time.time()``); ``what`` None: nothing was reported."""
    if what is None or since is None:
        return "had reported no generation activity"
    return f"was {what} for the last {max(0.0, time.time() - since):.0f} s"
