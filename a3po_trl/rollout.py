"""One rollout: generate completions for a local generation batch, score them, and compute group advantages.

Everything here is local to one process and uses only the module it is given (the generator's copy of the
weights), so it can run in the generation thread: no collective, no access to the training module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteriaList
from trl.data_utils import is_conversational
from trl.trainer.utils import nanstd, pad

from .generation import GenerationStopped, ScoredBatch


def group_advantages(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-relative advantages over whole groups of ``num_generations`` consecutive rows, as TRL computes them.

    Args:
        rewards_per_func: ``(B, F)`` rewards, NaN where a reward function returned None.
        reward_weights: ``(F,)`` weights of the reward functions.
        num_generations: group size; ``B`` must be a multiple of it.
        scale_rewards: ``"group"`` (divide by the group's std), ``"batch"`` (by the batch's std) or ``"none"``.
        aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"`` (TRL's ``multi_objective_aggregation``).

    Returns:
        ``(advantages, rewards, is_std_zero)``, each ``(B,)``; a row every function left unscored gets advantage 0.
    """
    if rewards_per_func.size(0) % num_generations:
        raise ValueError(f"{rewards_per_func.size(0)} rows do not form whole groups of {num_generations}.")
    weights = reward_weights.to(rewards_per_func.device, rewards_per_func.dtype)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        grouped = rewards.view(-1, num_generations)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
        if scale_rewards in ("group", "none"):
            std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
        elif scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            raise ValueError(f"scale_rewards={scale_rewards!r} must be 'group', 'batch' or 'none'.")
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
        normalized = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (
            nanstd(grouped, dim=1, keepdim=True) + 1e-4
        )
        rewards = (normalized.view(-1, rewards_per_func.size(1)) * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise ValueError(f"multi_objective_aggregation={aggregation!r} is not supported.")
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), rewards, is_std_zero


def score_completions(
    reward_funcs: list,
    reward_func_names: list[str],
    reward_processing_classes: list,
    rows: list[dict],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    extra_kwargs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``(B, F)`` float32 rewards from each reward function, locally (no gather). None becomes NaN.

    Reward functions follow TRL's signature ``f(prompts, completions, completion_ids, **columns)``; reward models
    (``nn.Module``) score the prompt + completion text. A function that raises has its name added to the error.
    """
    rewards = torch.zeros(len(prompts), len(reward_funcs), dtype=torch.float32)
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    columns.update(extra_kwargs or {})
    for i, (func, name, processing_class) in enumerate(
        zip(reward_funcs, reward_func_names, reward_processing_classes, strict=True)
    ):
        try:
            if isinstance(func, nn.Module):
                values = _score_with_reward_model(func, processing_class, prompts, completions)
            else:
                values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(f"(raised by the reward function {name!r})")
            raise
        values = _as_reward_list(values, name, len(prompts))
        rewards[:, i] = torch.tensor(values, dtype=torch.float32)
    return rewards


def _as_reward_list(values, name: str, expected: int) -> list[float]:
    if isinstance(values, torch.Tensor):
        values = values.detach().float().cpu().flatten().tolist()
    try:
        values = list(values)
    except TypeError:
        raise TypeError(
            f"The reward function {name!r} returned {type(values).__name__}; it must return a list of floats "
            f"(one per completion, None to skip)."
        ) from None
    if len(values) != expected:
        raise ValueError(
            f"The reward function {name!r} returned {len(values)} rewards, but {expected} were expected (one per "
            "prompt-completion pair). Make sure it returns exactly one reward per completion."
        )
    out = []
    for value in values:
        if value is None:
            out.append(float("nan"))
            continue
        try:
            out.append(float(value))
        except (TypeError, ValueError):
            raise TypeError(
                f"The reward function {name!r} returned a non-numeric reward {value!r}; return floats (or None to "
                "skip a completion)."
            ) from None
    return out


def _score_with_reward_model(model, processing_class, prompts, completions) -> list[float]:
    from trl.data_utils import apply_chat_template

    if is_conversational({"prompt": prompts[0]}):
        texts = [
            apply_chat_template({"messages": p + c}, processing_class)["text"] for p, c in zip(prompts, completions)
        ]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    inputs = processing_class(
        text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.inference_mode():
        return model(**inputs).logits[:, 0].float().cpu().tolist()


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


#: Where the behavior log-probs can come from (``AsyncA3POConfig.behavior_logps_source``).
BEHAVIOR_LOGPS_SOURCES = ("generation", "forward")


class GenerationLogpsRecorder:
    """Records, while ``generate`` runs, the temperature-scaled log-prob of every token it picks.

    A forward hook on the causal LM that ``generate`` calls sees each step's logits (the raw ones, before any logits
    processor) and the token ids fed into the next step, which are the tokens picked from those logits. Only the
    latest step's ``(B, V)`` log-softmax is kept, so the cost is one log-softmax per step and ``(B, steps)`` floats:
    the behavior log-probs come out of the generation itself instead of a second forward over the whole batch.
    They score the same distribution as the training log-probs (raw logits / temperature, no top-k/top-p), with the
    numerics of incremental decoding (KV cache) instead of one full-sequence forward.
    """

    def __init__(self, model: nn.Module, temperature: float):
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be positive to score the sampled tokens.")
        self.temperature = temperature
        self._latest: torch.Tensor | None = None
        self._columns: list[torch.Tensor] = []
        self._picked: list[torch.Tensor] = []  # the token each column scores, checked against the output
        self._handle = model.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if input_ids is None or logits is None:
            raise RuntimeError(
                "Behavior log-probs from generation need the model's forward to take input_ids and return logits; "
                "set behavior_logps_source='forward' for this model."
            )
        if self._latest is not None:
            picked = input_ids[:, -1:].to(self._latest.device)
            self._columns.append(self._latest.gather(1, picked).squeeze(1))
            self._picked.append(picked.squeeze(1))
        self._latest = torch.log_softmax(logits[:, -1, :].float() / self.temperature, dim=-1)

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """``(B, N)`` log-probs of the ``N`` generated tokens ``generated`` (after :meth:`close`)."""
        num_tokens = generated.size(1)
        if len(self._columns) < num_tokens and self._latest is not None:
            last = generated[:, len(self._columns) : len(self._columns) + 1].to(self._latest.device)
            self._columns.append(self._latest.gather(1, last).squeeze(1))
            self._picked.append(last.squeeze(1))
        self._latest = None
        if num_tokens == 0:
            return generated.new_zeros(generated.size(0), 0, dtype=torch.float32)
        picked = torch.stack(self._picked[:num_tokens], dim=1) if len(self._picked) >= num_tokens else None
        if picked is None or not torch.equal(picked, generated.to(picked.device)):
            # e.g. chunked prefill or assisted decoding: forwards that are not one step per generated token
            raise RuntimeError(
                "The behavior log-probs recorded during generation do not line up with the generated tokens (this "
                "generation setup runs forwards that are not one per generated token); set "
                "behavior_logps_source='forward'."
            )
        return torch.stack(self._columns[:num_tokens], dim=1)

    def close(self) -> None:
        self._handle.remove()


def generation_target(module: nn.Module) -> nn.Module:
    """The causal LM whose forward ``generate`` calls (the base model of a PEFT model)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


@dataclass
class RolloutSettings:
    """What a rollout needs from the trainer, copied once so the thread never reads the trainer."""

    tokenize_prompts: Callable[[list], list[list[int]]]
    decode: Callable[[list[list[int]]], list[str]]
    generation_config: GenerationConfig
    eos_token_ids: list[int]
    pad_token_id: int
    num_generations: int
    reward_funcs: list
    reward_func_names: list[str]
    reward_processing_classes: list
    reward_weights: torch.Tensor
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    mask_truncated_completions: bool = False
    chunk_size: int | None = None
    pad_to_multiple_of: int | None = None
    autocast_dtype: torch.dtype | None = None
    """Mixed-precision dtype of the trainer's forward (bf16/fp16), applied to generation and behavior log-probs so
    they come from the same numerics as the training log-probs; None for full precision."""
    reward_extra_kwargs: dict[str, Any] = field(default_factory=dict)
    behavior_logps_source: str = "generation"
    """``"generation"``: record the log-probs while generating (:class:`GenerationLogpsRecorder`); ``"forward"``:
    one extra no-grad forward over prompts and completions after generation."""
    temperature: float = 1.0
    """Temperature of the training log-probs (TRL's ``temperature``), used by ``"generation"``."""


def run_rollout(settings: RolloutSettings, module: nn.Module, rows: list[dict], should_stop=None) -> ScoredBatch:
    """Generate, compute behavior log-probs with the same weights, score, and compute advantages for ``rows``."""
    device = next(module.parameters()).device
    timings = {}
    prompts = [row["prompt"] for row in rows]
    prompt_ids_list = settings.tokenize_prompts(prompts)

    if settings.behavior_logps_source not in BEHAVIOR_LOGPS_SOURCES:
        raise ValueError(
            f"behavior_logps_source={settings.behavior_logps_source!r} must be one of {BEHAVIOR_LOGPS_SOURCES}."
        )
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
    if record:
        behavior_logps = pad(recorded_logps, padding_value=0.0, padding_side="right")
        behavior_logps = torch.nn.functional.pad(behavior_logps, (0, completion_ids.size(1) - behavior_logps.size(1)))
    else:
        with torch.no_grad(), _autocast(device, settings.autocast_dtype):
            behavior_logps = per_token_logps_fused(
                module,
                torch.cat([prompt_ids, completion_ids], dim=1).to(device),
                torch.cat([prompt_mask, completion_mask], dim=1).to(device),
                completion_ids.size(1),
                settings.chunk_size,
            )
    timings["behavior_logps"] = time.perf_counter() - start

    if is_conversational({"prompt": prompts[0]}):
        completions = [[{"role": "assistant", "content": text}] for text in settings.decode(completion_ids_list)]
    else:
        completions = settings.decode(completion_ids_list)

    start = time.perf_counter()
    rewards_per_func = score_completions(
        settings.reward_funcs,
        settings.reward_func_names,
        settings.reward_processing_classes,
        rows,
        prompts,
        completions,
        completion_ids_list,
        settings.reward_extra_kwargs,
    )
    advantages, rewards, is_std_zero = group_advantages(
        rewards_per_func,
        settings.reward_weights,
        settings.num_generations,
        settings.scale_rewards,
        settings.multi_objective_aggregation,
    )
    timings["rewards"] = time.perf_counter() - start

    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "behavior_logps": behavior_logps.cpu() if device.type != "cpu" else behavior_logps,
        "advantages": advantages,
        "is_truncated": is_truncated,
        "is_std_zero": is_std_zero,
    }
    texts = {"prompt": prompts, "completion": completions}
    return ScoredBatch(
        index=-1, version=-1, tensors=tensors, rewards_per_func=rewards_per_func, texts=texts, timings=timings
    )


def _generate(
    settings: RolloutSettings, module, prompt_ids_list, device, should_stop, record_logps: bool
) -> tuple[list[list[int]], list[torch.Tensor] | None]:
    """Completion ids per row, cut after the first EOS, and (``record_logps``) their behavior log-probs."""
    chunk = settings.chunk_size or len(prompt_ids_list)
    stopping = None
    if should_stop is not None:
        stopping = StoppingCriteriaList([_CallableStop(should_stop)])
    completions: list[list[int]] = []
    logps: list[torch.Tensor] | None = [] if record_logps else None
    eos = torch.tensor(settings.eos_token_ids, device=device)
    for start in range(0, len(prompt_ids_list), chunk):
        ids, mask = _pad_rows(prompt_ids_list[start : start + chunk], settings.pad_token_id, "left", None)
        ids, mask = ids.to(device), mask.to(device)
        recorder = GenerationLogpsRecorder(generation_target(module), settings.temperature) if record_logps else None
        try:
            output = module.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=settings.generation_config,
                stopping_criteria=stopping,
                synced_gpus=False,  # transformers turns it on under ZeRO-3: a collective per token would deadlock
            )
        finally:
            if recorder is not None:
                recorder.close()
        generated = output[:, ids.size(1) :]
        chunk_logps = recorder.finish(generated).cpu() if recorder is not None else None
        is_eos = torch.isin(generated, eos)
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        has_eos = is_eos.any(dim=1)
        eos_idx[has_eos] = is_eos.int().argmax(dim=1)[has_eos]
        keep = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
        keep = keep.cpu()
        completions.extend(row[m].tolist() for row, m in zip(generated.cpu(), keep))
        if logps is not None:
            logps.extend(row[m] for row, m in zip(chunk_logps, keep))
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
