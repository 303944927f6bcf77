"""One rollout: generate completions for a local generation batch, their behavior log-probs, and their rewards.

Everything here is local to one process and uses only the module it is given (the generator's copy of the
weights), so it can run in the generation thread: no collective, no access to the training module or the trainer.
Advantages need every process's rewards, so the trainer computes them when it takes the batch.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteriaList
from trl.data_utils import is_conversational
from trl.trainer.utils import pad

from .generation import GenerationStopped, ScoredBatch
from .sampling import GenerationLogpsRecorder, OwnStreamSampling
from .scoring import score_completions

logger = logging.getLogger(__name__)

#: Where the behavior log-probs can come from (``AsyncA3POConfig.behavior_logps_source``).
BEHAVIOR_LOGPS_SOURCES = ("generation", "forward")


def per_token_logps_fused(model: nn.Module, input_ids, attention_mask, logits_to_keep: int, chunk_size: int | None):
    """Per-token log-probs of the last ``logits_to_keep`` tokens through TRL's fused LM head (temperature-scaled)."""
    chunk_size = chunk_size or input_ids.size(0)
    out = []
    for start in range(0, input_ids.size(0), chunk_size):
        ids = input_ids[start : start + chunk_size]
        mask = attention_mask[start : start + chunk_size]
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        outputs = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.append(outputs.log_probs[:, -logits_to_keep:].float())
    return torch.cat(out, dim=0)


def generation_target(module: nn.Module) -> nn.Module:
    """The causal LM whose forward ``generate`` calls (the base model of a PEFT model)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


@dataclass
class RolloutSettings:
    """What a rollout needs from the trainer, copied once so the thread never reads the trainer."""

    tokenize_prompts: Callable[[list], list[list[int]]]
    decode: Callable[[list[list[int]], list[list[int]], list], list]
    """``decode(completion_ids, prompt_ids, prompts)``: completions as reward functions receive them."""
    generation_config: GenerationConfig
    eos_token_ids: list[int]
    pad_token_id: int
    reward_funcs: list
    reward_func_names: list[str]
    reward_processing_classes: list
    mask_truncated_completions: bool = False
    chunk_size: int | None = None
    pad_to_multiple_of: int | None = None
    autocast_dtype: torch.dtype | None = None
    """Mixed-precision dtype of the trainer's forward (bf16/fp16), applied to generation and behavior log-probs so
    they come from the same numerics as the training log-probs; None for full precision."""
    behavior_logps_source: str = "generation"
    """``"generation"``: record the log-probs while generating (:class:`GenerationLogpsRecorder`); ``"forward"``:
    one extra no-grad forward over prompts and completions after generation."""
    temperature: float = 1.0
    """Temperature of the training log-probs (TRL's ``temperature``), used by ``"generation"``."""
    sampling_generator: torch.Generator | None = None
    """The generator's own random stream, for a plain-sampling ``generation_config`` only (see
    :func:`~a3po_trl.sampling.samples_with_own_stream`); ``None`` leaves token selection to ``generate`` (the global
    RNG)."""
    sampling_seeds: Callable[[int], int] | None = None
    """``sampling_seeds(index)``: the seed ``sampling_generator`` restarts from for batch ``index`` of the run, so a
    batch's samples depend on the seed and the batch, not on what was generated before (a resumed run samples the
    same); ``None`` continues the stream."""
    deferred_reward_columns: frozenset[int] = frozenset()
    """Reward functions left to the trainer's main thread (reward models partitioned by ZeRO-3)."""
    async_loop: Any = None
    """Event loop that runs ``async def`` reward functions (TRL's daemon loop)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    _fallback_warned: bool = False


def run_rollout(
    settings: RolloutSettings, module: nn.Module, rows: list[dict], should_stop=None, trainer_state=None, index=0
) -> ScoredBatch:
    """Generate, compute behavior log-probs with the same weights, and score ``rows`` with the reward functions.

    ``trainer_state`` is what reward functions receive as ``trainer_state`` (the state of the weights' version);
    ``index`` is the batch's position in the run (for its sampling seed). Values reward functions pass to
    ``log_metric`` and ``log_extra`` are kept with the batch for the trainer to log.
    """
    if settings.behavior_logps_source not in BEHAVIOR_LOGPS_SOURCES:
        raise ValueError(
            f"behavior_logps_source={settings.behavior_logps_source!r} must be one of {BEHAVIOR_LOGPS_SOURCES}."
        )
    device = next(module.parameters()).device
    timings = {}
    prompts = [row["prompt"] for row in rows]
    prompt_ids_list = settings.tokenize_prompts(prompts)
    if settings.sampling_generator is not None and settings.sampling_seeds is not None:
        settings.sampling_generator.manual_seed(settings.sampling_seeds(index))

    record = settings.behavior_logps_source == "generation"
    start = time.perf_counter()
    with torch.no_grad(), _autocast(device, settings.autocast_dtype):
        completion_ids_list, recorded_logps = _generate(settings, module, prompt_ids_list, device, should_stop, record)
    timings["generation"] = time.perf_counter() - start

    prompt_ids, prompt_mask = _pad_rows(prompt_ids_list, settings.pad_token_id, "left", settings.pad_to_multiple_of)
    completion_ids, completion_mask = _pad_rows(
        completion_ids_list, settings.pad_token_id, "right", settings.pad_to_multiple_of
    )
    eos_and_pad = {*settings.eos_token_ids, settings.pad_token_id}
    is_truncated = torch.tensor([len(ids) == 0 or ids[-1] not in eos_and_pad for ids in completion_ids_list])
    if settings.mask_truncated_completions:
        completion_mask = completion_mask * (~is_truncated).unsqueeze(1).long()

    start = time.perf_counter()
    if recorded_logps is not None:
        behavior_logps = pad(recorded_logps, padding_value=0.0, padding_side="right")
        behavior_logps = torch.nn.functional.pad(behavior_logps, (0, completion_ids.size(1) - behavior_logps.size(1)))
    else:
        if record and not settings._fallback_warned:
            settings._fallback_warned = True
            logger.warning(
                "The behavior log-probs could not be recorded during generation (this generation setup runs "
                "forwards that are not one per generated token); they are computed with one extra forward pass "
                "instead. Set behavior_logps_source='forward' to silence this."
            )
        with torch.no_grad(), _autocast(device, settings.autocast_dtype):
            behavior_logps = per_token_logps_fused(
                module,
                torch.cat([prompt_ids, completion_ids], dim=1).to(device),
                torch.cat([prompt_mask, completion_mask], dim=1).to(device),
                completion_ids.size(1),
                settings.chunk_size,
            )
    timings["behavior_logps"] = time.perf_counter() - start

    completions = settings.decode(completion_ids_list, prompt_ids_list, prompts)
    extra_logs: dict[str, list] = defaultdict(list)
    logged_metrics: dict[str, list[float]] = defaultdict(list)
    start = time.perf_counter()
    rewards_per_func = score_completions(
        settings.reward_funcs,
        settings.reward_func_names,
        settings.reward_processing_classes,
        rows,
        prompts,
        completions,
        completion_ids_list,
        {
            "trainer_state": trainer_state,
            "log_extra": lambda column, values: extra_logs[column].extend(values),
            "log_metric": lambda name, value: logged_metrics[name].append(float(value)),
        },
        skip=settings.deferred_reward_columns,
        async_loop=settings.async_loop,
        chat_template_kwargs=settings.chat_template_kwargs,
    )
    timings["rewards"] = time.perf_counter() - start

    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "behavior_logps": behavior_logps.cpu() if device.type != "cpu" else behavior_logps,
        "is_truncated": is_truncated,
        "completion_lengths": torch.tensor([len(ids) for ids in completion_ids_list]),
    }
    return ScoredBatch(
        index=-1,
        version=-1,
        tensors=tensors,
        rewards_per_func=rewards_per_func,
        texts={"prompt": prompts, "completion": completions},
        timings=timings,
        rows=rows,
        extra_logs=dict(extra_logs),
        logged_metrics=dict(logged_metrics),
    )


def _generate(
    settings: RolloutSettings, module, prompt_ids_list, device, should_stop, record_logps: bool
) -> tuple[list[list[int]], list[torch.Tensor] | None]:
    """Completion ids per row, cut after the first EOS, and (``record_logps``) their behavior log-probs, ``None``
    when they could not be recorded."""
    chunk = settings.chunk_size or len(prompt_ids_list)
    stopping = None
    if should_stop is not None:
        stopping = StoppingCriteriaList([_CallableStop(should_stop)])
    extra = {}
    if settings.sampling_generator is not None:
        extra["custom_generate"] = OwnStreamSampling(settings.sampling_generator)
    completions: list[list[int]] = []
    logps: list[torch.Tensor] | None = [] if record_logps else None
    eos = torch.tensor(settings.eos_token_ids, device=device)
    for start in range(0, len(prompt_ids_list), chunk):
        ids, mask = _pad_rows(prompt_ids_list[start : start + chunk], settings.pad_token_id, "left", None)
        ids, mask = ids.to(device), mask.to(device)
        recorder = (
            GenerationLogpsRecorder(generation_target(module), settings.temperature) if logps is not None else None
        )
        try:
            output = module.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=settings.generation_config,
                stopping_criteria=stopping,
                synced_gpus=False,  # transformers turns it on under ZeRO-3: a collective per token would deadlock
                **extra,
            )
        finally:
            if recorder is not None:
                recorder.close()
        generated = output[:, ids.size(1) :]
        chunk_logps = recorder.finish(generated) if recorder is not None else None
        if recorder is not None and chunk_logps is None:
            logps = None  # misaligned: the caller computes them with a forward pass instead
        is_eos = torch.isin(generated, eos)
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        has_eos = is_eos.any(dim=1)
        eos_idx[has_eos] = is_eos.int().argmax(dim=1)[has_eos]
        keep = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
        keep = keep.cpu()
        completions.extend(row[m].tolist() for row, m in zip(generated.cpu(), keep))
        if logps is not None:
            logps.extend(row[m] for row, m in zip(chunk_logps.cpu(), keep))
    if should_stop is not None and should_stop():
        raise GenerationStopped
    return completions, logps


class _CallableStop:
    """A stopping criterion that ends generation when ``should_stop()`` turns true."""

    def __init__(self, should_stop):
        self.should_stop = should_stop

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), bool(self.should_stop()), dtype=torch.bool, device=input_ids.device)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None)


def _pad_rows(rows: list[list[int]], pad_value: int, side: str, pad_to_multiple_of):
    tensors = [torch.tensor(row, dtype=torch.long) for row in rows]
    ids = pad(tensors, padding_value=pad_value, padding_side=side, pad_to_multiple_of=pad_to_multiple_of)
    mask = pad(
        [torch.ones_like(t) for t in tensors],
        padding_value=0,
        padding_side=side,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    return ids, mask


def decode_completions(tokenizer, completion_ids, prompt_ids, prompts):
    """Completions as GRPOTrainer passes them to reward functions: text, or for conversational prompts one assistant
    message (parsed with the tokenizer's response template when it has one)."""
    if not is_conversational({"prompt": prompts[0]}):
        return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        from trl.chat_template_utils import parse_response

        return [[parse_response(tokenizer, ids, prefix=prefix)] for ids, prefix in zip(completion_ids, prompt_ids)]
    contents = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": content}] for content in contents]
