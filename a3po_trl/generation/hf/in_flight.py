"""In-flight weight updates in the ``generate`` backend: a version the trainer publishes while a batch is being
generated is loaded between two decode steps, and the batch's completions continue with it.

``generate`` calls its stopping criteria once per generated token, after the token is appended and before the next
forward: :class:`InFlightLoads` is one of them. At each call it records the version whose forward produced the token
just appended (the logits it was drawn from, and so its behavior log-prob, which
:class:`~.sampling.GenerationLogpsRecorder` took from that same forward), then loads the newest published version if
it is newer (:meth:`~a3po_trl.generation.backend.GenerationBackend.refresh`, under the staging store's lock, in the
generation thread). The next forward runs with the new weights over the KV cache as it is: the keys and values of
the earlier tokens stay those the earlier weights computed (as in PipelineRL), so a token sampled after a switch is
drawn from the new weights conditioned on a cache that no single version would have computed. Its recorded behavior
log-prob is exactly that distribution's, which is what the importance weights need (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import time

import torch

from ...timeline import record_in_batch_span


class InFlightLoads:
    """A stopping criterion (it never stops anything) that tags each generated step with the version that sampled it
    and loads newer published weights between steps.

    Attributes:
        step_versions: per generated step (column of the output), the version whose forward sampled it.
        loads: versions loaded between steps.
        seconds: seconds spent loading them.
    """

    def __init__(self, backend):
        self.backend = backend
        self.step_versions: list[int] = []
        self.loads = 0
        self.seconds = 0.0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        backend = self.backend
        self.step_versions.append(backend.version)
        if backend.published_version > backend.version:  # cheap check first: a load takes the store's lock
            replaced = backend.version
            start = time.perf_counter()
            if backend.refresh():
                end = time.perf_counter()
                self.loads += 1
                self.seconds += end - start
                record_in_batch_span(
                    "in-flight weight load",
                    start,
                    end,
                    step=len(self.step_versions),
                    replaced_version=replaced,
                    loaded_version=backend.version,
                )
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
