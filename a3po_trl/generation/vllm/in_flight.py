"""In-flight weight updates in the colocated vLLM engine: a version the trainer publishes while a batch is generated
is loaded between two engine steps, and the batch's requests continue with it.

The generation thread drives the in-process engine step by step (:meth:`~.colocate.VLLMColocateBackend.generate`).
Before each step, :class:`InFlightEngineLoads` loads the newest published version if it is newer than the loaded one
(:meth:`~a3po_trl.generation.backend.GenerationBackend.refresh`: the same full-weight load as between batches, under
the staging store's lock, labelled with ``update_weight_version``). vLLM 0.32 on CPU steps synchronously
(``EngineCore.step``: schedule, execute, sample, then the outputs, which carry the label of that moment), so nothing
runs while weights load, and every token of the next step is sampled by the new weights and labelled with their
version. The KV cache of the tokens before the switch stays as the older weights computed it (as in PipelineRL): a
token sampled after it is drawn from the new weights over that cache, and its log-prob, vLLM's own of the token it
sampled, is that distribution's exactly (see docs/ARCHITECTURE.md).

The prefix cache. vLLM looks a request's blocks up in its prefix cache when it schedules the request from its waiting
queue (a new request, or one preempted for cache space), and resets the cache only when no request holds a block
(``BlockPool.reset_prefix_cache`` returns False otherwise; ``reset_running_requests=True`` would preempt every
running request and recompute it, discarding the cache the feature keeps). So: every request of a batch is added
before its first step, a version is loaded mid-batch only while no request waits to be scheduled (a load is put off
by a step or more otherwise), and the cache is reset before the next batch's requests are added
(:meth:`~.colocate.VLLMColocateBackend.generate`). No block computed by older weights serves a new request; a request
preempted after a load finds its own earlier blocks where the cache still holds them, and recomputes the others with
the weights loaded then.

LoRA: each version is an adapter the requests name when they are added (``lora_request``), fixed for a request's
life; vLLM 0.32 cannot move a running request to another adapter, so LoRA is refused with in-flight updates
(:data:`IN_FLIGHT_LORA_REFUSAL`).
"""

from __future__ import annotations

import time

from ...timeline import record_in_batch_span

IN_FLIGHT_LORA_REFUSAL = (
    "in_flight_weight_updates=True is not supported with use_vllm=True and LoRA (peft_config) yet: the colocated "
    "engine serves each LoRA version as its own adapter, which a request names when it is added and keeps to its end "
    "(vLLM 0.32 cannot switch a running request to another adapter), so a version cannot be taken mid-completion. "
    "Set use_vllm=False (the generate backend does it with LoRA), train full weights, or set "
    "in_flight_weight_updates=False."
)


class StepVersions:
    """Per request of a batch, the version the backend had loaded at the engine step that sampled each token (from
    the step's cumulative outputs: the tokens a request has beyond those already counted came from this step)."""

    def __init__(self, request_ids):
        self._versions: dict[str, list[int]] = {r: [] for r in request_ids}

    def record(self, output, version: int) -> None:
        row = self._versions.get(output.request_id)
        if row is not None:
            row.extend([version] * (len(output.outputs[0].token_ids) - len(row)))

    def count(self) -> int:
        """Tokens sampled so far, all requests together."""
        return sum(len(row) for row in self._versions.values())

    def of(self, request_ids) -> list[list[int]]:
        return [self._versions[r] for r in request_ids]


class InFlightEngineLoads:
    """Loads newer published weights into the colocated engine between two engine steps (see the module doc)."""

    def __init__(self, backend, llm_engine):
        self.backend = backend
        self._scheduler = _in_process_scheduler(llm_engine)

    def waiting_requests(self) -> int:
        """Requests the engine has not scheduled yet (new or preempted): they would look the prefix cache up."""
        return self._scheduler.get_request_counts()[1]

    def maybe_load(self, timings: dict[str, float], tokens_sampled) -> bool:
        """Load the newest published version if it is newer and no request waits to be scheduled; adds the load's
        seconds and count to ``timings`` (``in_flight_weight_load``, ``in_flight_weight_loads``). Returns whether it
        loaded. ``tokens_sampled``: a callable, the batch's tokens so far (for the timeline)."""
        backend = self.backend
        if backend.published_version <= backend.version:  # cheap check first: a load takes the store's lock
            return False
        if self.waiting_requests():
            return False
        replaced = backend.version
        start = time.perf_counter()
        if not backend.refresh():
            return False
        end = time.perf_counter()
        timings["in_flight_weight_load"] += end - start
        timings["in_flight_weight_loads"] += 1
        record_in_batch_span(
            "in-flight weight load",
            start,
            end,
            tokens=tokens_sampled(),
            replaced_version=replaced,
            loaded_version=backend.version,
        )
        return True


def _in_process_scheduler(llm_engine):
    """The scheduler of the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ``LLMEngine.engine_core`` is
    an ``InprocClient`` holding the ``EngineCore``)."""
    core = getattr(getattr(llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None or not hasattr(scheduler, "get_request_counts"):
        raise RuntimeError(
            "in_flight_weight_updates=True with vLLM colocate needs the engine core in the trainer's process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0, which the backend sets unless the environment set it otherwise) to "
            "know which requests are still to be scheduled. Unset VLLM_ENABLE_V1_MULTIPROCESSING, or set "
            "in_flight_weight_updates=False."
        )
    if getattr(core, "batch_queue", None) is not None:
        raise RuntimeError(
            "in_flight_weight_updates=True with vLLM colocate needs an engine that runs one step at a time: this one "
            "overlaps steps (async scheduling or pipeline parallelism: EngineCore.step_with_batch_queue), so a "
            "forward may still run while weights load. Set async_scheduling=False (the trainer does), or "
            "in_flight_weight_updates=False."
        )
    return scheduler
