"""Transformers' continuous batching (paged attention) as a backend: ``use_transformers_continuous_batching``.

:class:`ContinuousBatchingBackend` is the ``generate`` backend (:class:`~.backend.HFGenerateBackend`: the generator's
own copy of the policy, its weight versions, its behavior log-prob settings) with another way to generate a batch:
every prompt is a request to transformers' continuous batching manager (``model.init_continuous_batching``), which
schedules prefill and decoding of all of them over a paged KV cache, with no padding.

What it changes in the manager, and why (each is a pitfall of the generation thread, see DESIGN.md):

- Its loop runs in the generation thread itself, not in the background thread the manager would start: grad mode,
  autocast, the thread count and on CUDA the device and stream are per thread, and the generation thread has set them.
- It samples from the backend's own ``torch.Generator`` (seeded per batch, as the ``generate`` backend), never from the
  global RNG: the manager's sampler draws with ``torch.multinomial`` on the global RNG, which the training thread also
  uses (gradient checkpointing forks and restores it), and every batch processor the manager builds calls
  ``torch.manual_seed`` (``set_tp_seed``), which would reset the training thread's RNG once per batch.
- The behavior log-probs are the ones continuous batching returns (``return_logprobs``): the log-prob of each sampled
  token under the distribution it was drawn from, ``softmax`` of the *processed* scores. Sampling settings that
  process the distribution (top-k/p, min-p, penalties) are refused (:func:`check_continuous_batching_sampling`), so
  the processed scores are ``logits / temperature`` and these log-probs are those of the temperature-scaled,
  untruncated policy the training forward scores. The replacement sampler computes them as ``log_softmax`` of those
  scores (transformers takes ``log`` of the ``softmax``; the same value, without underflow) and writes them where
  transformers writes its own. ``behavior_logps_source="forward"`` (or a transformers that returns none) scores the
  completions with one forward of the generator instead, as the ``generate`` backend does.
- Unless ``transformers_continuous_batching_config`` sets ``num_blocks``, ``max_memory_percent`` or
  ``max_batch_tokens``, the paged cache is sized for the batch (every request resident at once) instead of a share of
  the device's free memory: a size that does not depend on what else runs, so a batch is scheduled the same way every
  time (``reproducible_generation``), and on a CPU it does not take half the host's memory. Unless it sets
  ``auto_switch_to_flash``, the model keeps its attention implementation (transformers would switch a half-precision
  model to flash attention, fetching the kernel from the Hub).

These hooks use the manager's internals (``_run_generation_loop``, ``_create_batch_processor``,
``ModelRunner._sample``); :func:`check_continuous_batching_available` refuses a transformers without them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import queue
import time

import torch

from ...patches import peft_base_model
from ...types import GeneratedCompletions, GenerationStopped
from .backend import HFGenerateBackend, _autocast
from .sampling import processed_sampling, sampling_deviations

#: Settings of ``transformers_continuous_batching_config`` that size the paged cache; when none is set, the backend
#: sizes it for each batch.
CACHE_SIZE_SETTINGS = ("num_blocks", "max_memory_percent", "max_batch_tokens")
#: transformers' default ``max_batch_tokens`` (tokens per forward), the cap of the batch-sized one.
_MAX_BATCH_TOKENS = 8192


def check_continuous_batching_available() -> None:
    """Refuse a transformers whose continuous batching lacks what the backend drives (its loop, batch processor and
    sampler), naming the fix."""
    try:
        from transformers.generation import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.continuous_api import (
            BackgroundThreadStatus,
            ContinuousBatchingManager,
        )
        from transformers.generation.continuous_batching.model_runner import ModelRunner
    except ImportError as error:
        raise NotImplementedError(
            "use_transformers_continuous_batching=True needs transformers' continuous batching (transformers>=5.8), "
            "which this transformers does not have. Upgrade transformers, or set "
            "use_transformers_continuous_batching=False."
        ) from error
    missing = [
        name
        for owner, name in (
            (ContinuousBatchingManager, "_run_generation_loop"),
            (ContinuousBatchingManager, "_create_batch_processor"),
            (ModelRunner, "_sample"),
            (BackgroundThreadStatus, "request_stop"),
        )
        if not hasattr(owner, name)
    ]
    if missing or "num_blocks" not in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}:
        import transformers

        raise NotImplementedError(
            f"use_transformers_continuous_batching=True: transformers {transformers.__version__}'s continuous "
            f"batching lacks {', '.join(missing) or 'num_blocks'}, which the generation thread drives it with (its "
            "loop in the generation thread, sampling from the generator's own random stream). Use the transformers "
            "version this package is tested with, or set use_transformers_continuous_batching=False."
        )


def check_continuous_batching_sampling(config) -> None:
    """Refuse an effective generation config (merged with the model's) under which continuous batching would not
    sample ``softmax(logits / temperature)``: processed distributions (top-k/p, min-p, penalties: continuous batching
    drops the processors it does not support, and its log-probs would be those of the processed distribution), beams
    or assisted decoding. Greedy decoding is allowed (it is refused or warned about like with ``generate``)."""
    refused = processed_sampling(config) + [d for d in sampling_deviations(config) if d.startswith("num_beams")]
    if refused:
        raise ValueError(
            f"use_transformers_continuous_batching=True samples from softmax(logits / temperature) only, but the "
            f"generation config sets {', '.join(refused)} (in the config, generation_kwargs, or the model's "
            "generation_config). Leave them at their neutral values (top_p=1.0, top_k=0, min_p=None, "
            "repetition_penalty=1.0, num_beams=1), or set use_transformers_continuous_batching=False: the generate "
            "backend records the log-probs of processed distributions."
        )


def check_continuous_batching_config(kwargs: dict | None, reproducible: bool = False) -> None:
    """Refuse a ``transformers_continuous_batching_config`` that ``ContinuousBatchingConfig`` rejects, or (with
    ``reproducible_generation``) one that sizes the cache from the free memory."""
    from transformers.generation import ContinuousBatchingConfig

    kwargs = dict(kwargs or {})
    try:
        ContinuousBatchingConfig(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"transformers_continuous_batching_config={kwargs!r} is not a valid ContinuousBatchingConfig: {error}. "
            "Pass only its fields (e.g. {'num_blocks': 64, 'max_batch_tokens': 1024})."
        ) from error
    if kwargs.get("use_cuda_graph") not in (None, False, (False, False)):
        raise ValueError(
            f"transformers_continuous_batching_config['use_cuda_graph']={kwargs['use_cuda_graph']!r} is not "
            "supported: the generator samples from its own random stream, which a captured CUDA graph would replay "
            "with the same random numbers at every step. Leave 'use_cuda_graph' unset (off)."
        )
    if reproducible and kwargs.get("max_memory_percent") is not None and kwargs.get("num_blocks") is None:
        raise ValueError(
            "reproducible_generation=True with transformers_continuous_batching_config['max_memory_percent'] and no "
            "'num_blocks': the paged cache would be sized from the free memory when each batch starts, so the same "
            "batch could be scheduled (and sampled) differently. Set 'num_blocks' too, or leave both unset (the "
            "cache is then sized for each batch)."
        )


def continuous_batching_config(kwargs: dict | None, prompt_ids: list[list[int]], max_new_tokens: int):
    """The ``ContinuousBatchingConfig`` of one batch: the user's settings, log-probs on, and unless the user sized the
    cache (:data:`CACHE_SIZE_SETTINGS`), a cache that holds every request of the batch at full length and forwards
    of at most the batch's prompt tokens (capped at transformers' default 8192). ``auto_switch_to_flash`` is off
    unless set: generation keeps the model's attention implementation (the training forward's), and transformers
    never fetches a flash-attention kernel from the Hub when a batch starts. CUDA graphs are off: a captured graph
    would replay the sampler's random numbers."""
    from transformers.generation import ContinuousBatchingConfig

    kwargs = {"auto_switch_to_flash": False, **(kwargs or {}), "return_logprobs": True, "use_cuda_graph": False}
    if all(kwargs.get(name) is None for name in CACHE_SIZE_SETTINGS):
        page_size = kwargs.get("page_size") or ContinuousBatchingConfig().page_size
        kwargs["num_blocks"] = sum(math.ceil((len(p) + max_new_tokens) / page_size) for p in prompt_ids) + 1
        kwargs["max_batch_tokens"] = min(_MAX_BATCH_TOKENS, max(sum(len(p) for p in prompt_ids), len(prompt_ids)))
    return ContinuousBatchingConfig(**kwargs)


class _OwnStreamSampler:
    """Stands in for the continuous batching ``ModelRunner._sample``: draws each next token of ``softmax(scores)`` with
    the Gumbel-max trick from ``generator`` (argmax when not sampling), and writes its log-prob,
    ``log_softmax(scores)`` at the token, where the runner writes its own (``return_logprobs``)."""

    def __init__(self, runner, generator: torch.Generator | None):
        self.runner = runner
        self.generator = generator

    def __call__(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        logps = torch.log_softmax(scores[0].float(), dim=-1)  # [num_logits, vocab]
        if self.runner.do_sample:
            noise = torch.empty_like(logps).exponential_(generator=self.generator)
            tokens = (logps - noise.log()).argmax(dim=-1, keepdim=True)
        else:
            tokens = logps.argmax(dim=-1, keepdim=True)
        count = tokens.size(0)
        output_ids[0, :count].copy_(tokens.squeeze(-1))
        if self.runner.return_logprobs:
            # the runner stores the float32 log-probs in its int32 output tensor, bit for bit
            output_ids[1, :count].copy_(logps.gather(1, tokens).squeeze(-1).view(dtype=torch.int32))


class ContinuousBatchingBackend(HFGenerateBackend):
    """The ``generate`` backend, generating each batch with transformers' continuous batching (see the module doc).

    Args:
        continuous_batching: the ``transformers_continuous_batching_config`` settings (``ContinuousBatchingConfig``
            fields); ``return_logprobs`` is always on, ``seed`` is replaced by the backend's own random stream.
        Others: as :class:`~.backend.HFGenerateBackend`.
    """

    def __init__(self, module, settings, continuous_batching: dict | None = None, **kwargs):
        check_continuous_batching_available()
        if settings.record_sampling_logps:
            raise ValueError(
                "use_transformers_continuous_batching=True does not record the log-probs of a processed sampling "
                "distribution (top-k/p, min-p, penalties); leave the sampling settings at their neutral values."
            )
        super().__init__(module, settings, **kwargs)
        check_continuous_batching_config(continuous_batching)
        self.continuous_batching = dict(continuous_batching or {})
        if self._sampling_generator is None:  # greedy decoding draws nothing, but the sampler takes a stream
            self._sampling_generator = torch.Generator(device=self.device)

    def generate(self, prompt_ids, should_stop, seed):
        settings = self.settings
        if seed is not None:
            self._sampling_generator.manual_seed(seed)
        timings = {}
        with torch.no_grad(), _autocast(self.device, settings.autocast_dtype):
            completion_ids, logps = self._generate_batch(prompt_ids, should_stop)
        if settings.behavior_logps_source != "generation" or logps is None:
            start = time.perf_counter()
            logps = self._forward_logps(prompt_ids, completion_ids)
            timings["behavior_logps"] = time.perf_counter() - start
        return GeneratedCompletions(completion_ids=completion_ids, logps=logps, sampling_logps=None, timings=timings)

    def _generate_batch(self, prompt_ids: list[list[int]], should_stop):
        """Completion ids per prompt (ending with the first EOS, if any) and their log-probs as continuous batching
        returned them (None when it returned none)."""
        from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus
        from transformers.generation.continuous_batching.utils import WorkloadHints

        if not prompt_ids:
            return [], []
        generation_config = copy.deepcopy(self.settings.generation_config)
        generation_config.eos_token_id = list(self.settings.eos_token_ids)
        max_new_tokens = generation_config.max_new_tokens
        model = peft_base_model(self.module)  # the causal LM (under LoRA, with the adapter layers in it)
        config = continuous_batching_config(self.continuous_batching, prompt_ids, max_new_tokens)
        manager = model.init_continuous_batching(
            generation_config=generation_config,
            continuous_batching_config=config,
            workload_hints=WorkloadHints(
                max_prompt_length=max(len(p) for p in prompt_ids),
                max_generated_length=max_new_tokens,
                num_requests=len(prompt_ids),
            ),
        )
        status = manager.background_thread_status
        rank = manager.distributed_helper.global_rank
        stopped = False
        try:
            # Every batch processor calls torch.manual_seed: the global RNG belongs to the training thread.
            manager.distributed_helper.set_tp_seed = lambda seed, device: None
            # All requests are queued before the loop starts, and the loop ends when they are done (flush): the
            # schedule depends on the batch only.
            request_ids = manager.add_requests(inputs=prompt_ids, max_new_tokens=max_new_tokens)
            status.request_stop(BackgroundThreadStatus.FLUSH_AND_STOP, rank)
            processor = self._batch_processor(manager, model)
            manager.batch_processor = processor  # the loop resets and reuses it
            processor.model_runner._sample = _OwnStreamSampler(processor.model_runner, self._sampling_generator)
            prepare = processor.prepare_next_batch

            def prepare_unless_stopped():
                nonlocal stopped
                if not stopped and should_stop is not None and should_stop():
                    stopped = True
                    status.request_stop(BackgroundThreadStatus.HARD_STOP, rank)  # the loop ends at this step
                return prepare()

            processor.prepare_next_batch = prepare_unless_stopped
            manager._run_generation_loop(use_inference_mode=torch.is_inference_mode_enabled())
            outputs = _drain(manager.output_router.output_queue)
        finally:
            manager.batch_processor = None
            if getattr(manager, "_original_attn_impl", None) is not None:  # the manager switched it (eager: paged)
                model.set_attn_implementation(manager._original_attn_impl)
                manager._original_attn_impl = None
            manager.destroy()
        if stopped:
            raise GenerationStopped
        if status.fatal_error is not None:
            raise RuntimeError(
                f"transformers' continuous batching failed while generating a batch: {status.fatal_error!r}"
            ) from status.fatal_error
        completions, logps = [], []
        for request_id in request_ids:
            output = outputs.get(request_id)
            if output is None or output.error is not None:
                reason = "no result" if output is None else output.error
                raise RuntimeError(f"transformers' continuous batching failed request {request_id}: {reason}")
            completions.append(list(output.generated_tokens))
            if logps is not None and len(output.logprobs) == len(output.generated_tokens):
                logps.append(torch.tensor(output.logprobs, dtype=torch.float32))
            else:
                logps = None
        return completions, logps

    def _batch_processor(self, manager, model):
        """The manager's batch processor, in the autocast dtype under mixed precision: the cache then holds keys and
        values in the dtype attention computes in (a LoRA generator's shared base keeps the trainer's float32
        weights, so the model's own dtype is float32, and its keys leave the rotary embedding in float32 while its
        values leave an autocast projection in bf16); attention under autocast casts them to it anyway."""
        cache_dtype = self.settings.autocast_dtype
        if cache_dtype is None:
            return manager._create_batch_processor()
        manager.model = _ReportedDtype(model, cache_dtype)
        try:
            processor = manager._create_batch_processor()
        finally:
            manager.model = model
        update = processor.cache.update

        def update_in_cache_dtype(key_states, value_states, layer_idx, kwargs):
            return update(key_states.to(cache_dtype), value_states.to(cache_dtype), layer_idx, kwargs)

        processor.cache.update = update_in_cache_dtype
        return processor


class _ReportedDtype:
    """``model`` with another ``dtype``: what the manager sizes and types its cache and inputs by."""

    def __init__(self, model, dtype: torch.dtype):
        self._model = model
        self.dtype = dtype

    def __getattr__(self, name):
        return getattr(self._model, name)


def _drain(results: queue.Queue) -> dict:
    outputs = {}
    while True:
        try:
            output = results.get_nowait()
        except queue.Empty:
            return outputs
        outputs[output.request_id] = output
