"""A test-only vLLM worker extension for a server whose every engine step takes at least ``STEP_SECONDS``.

The server in-flight tests pause the server from the stream that reads a batch's last first token, and need the pause
to land while the batch still has tokens to sample. The tiny test model samples a step in well under a millisecond on a
quiet machine, faster than the pause travels from the stream to the engine (an HTTP request, then a call into the
engine core, answered between two steps), so a 160-token batch could end before it landed. Here each step that runs a
forward sleeps ``STEP_SECONDS`` first: a batch of ``n`` tokens takes at least ``n * STEP_SECONDS``, and the pause lands
within a few steps, on a quiet or a busy machine alike.

`vllm_launch.start_server(..., slow_steps=True)` puts this directory on the server's ``PYTHONPATH`` and names
:class:`SlowStepsWorkerExtension` as the worker extension: vLLM imports this module in the process that runs the
worker, before it builds the worker, which is where the worker's ``execute_model`` is wrapped.
"""

import os
import time

from vllm.v1.worker.gpu_worker import Worker  # the CPU build's CPUWorker inherits its execute_model

from a3po_trl.generation.vllm.worker import A3POWorkerExtension

STEP_SECONDS = float(os.environ.get("A3PO_TEST_VLLM_STEP_SECONDS", "0.02"))

_execute_model = Worker.execute_model


def _slow_execute_model(self, scheduler_output):
    if scheduler_output.total_num_scheduled_tokens > 0:
        time.sleep(STEP_SECONDS)
    return _execute_model(self, scheduler_output)


if not getattr(Worker.execute_model, "_a3po_slow_steps", False):
    _slow_execute_model._a3po_slow_steps = True
    Worker.execute_model = _slow_execute_model


class SlowStepsWorkerExtension(A3POWorkerExtension):
    """The product's worker extension, plus a call that tells a test the steps are slowed (through the dev-mode
    ``/collective_rpc`` route): naming it makes vLLM import this module in the worker's process."""

    def a3po_test_slow_steps(self) -> dict:
        return {"step_seconds": STEP_SECONDS, "wrapped": getattr(type(self).execute_model, "_a3po_slow_steps", False)}
