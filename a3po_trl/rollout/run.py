"""One rollout: generate completions for a local generation batch, their behavior log-probs, and their rewards.

Everything here is local to one process and uses only the backend it is given (whatever generates, with one weight
version), so it can run in the generation thread: no collective, no access to the training module or the trainer.
Advantages need every process's rewards, so the trainer computes them when it takes the batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.data_utils import is_conversational

from ..generation.backend import GenerationBackend
from ..padding import pad_rows, pad_values
from ..timeline import record_in_batch_span
from ..types import ScoredBatch, ToolStats
from .multi_turn import AgentSettings, generate_with_tools, prepare_agent_prompts, prompt_tools
from .reward_workers import RewardWorkers
from .rollout_func import run_rollout_func
from .scoring import score_completions
from .trajectories import NO_VERSION, Trajectories


@dataclass
class RolloutSettings:
    """What a rollout needs from the trainer, copied once so the thread never reads the trainer."""

    tokenize_prompts: Callable[[list, list | None], list[list[int]]]
    """``tokenize_prompts(prompts, tools)``: prompt ids, prompt ``i`` rendered with ``tools[i]`` (None: no tools)."""
    decode: Callable[[list[list[int]], list[list[int]], list], list]
    """``decode(completion_ids, prompt_ids, prompts)``: completions as reward functions receive them."""
    eos_token_ids: list[int]
    pad_token_id: int
    reward_funcs: list
    reward_func_names: list[str]
    reward_processing_classes: list
    mask_truncated_completions: bool = False
    pad_to_multiple_of: int | None = None
    sampling_seeds: Callable[[int], int] | None = None
    """``sampling_seeds(index)``: the seed of batch ``index``'s random stream, so a batch's samples depend on the seed
    and the batch, not on what was generated before (a resumed run samples the same); ``None``: no fixed seed."""
    deferred_reward_columns: frozenset[int] = frozenset()
    """Reward functions left to the trainer's main thread (reward models partitioned by ZeRO-3)."""
    async_loop: Any = None
    """Event loop that runs ``async def`` reward functions (TRL's daemon loop)."""
    reward_workers: RewardWorkers | None = None
    """The worker processes that call the plain and ``async def`` reward functions (``reward_num_workers > 0``), or
    None: they run in the generation thread."""
    chat_template_kwargs: dict = field(default_factory=dict)
    agent: AgentSettings | None = None
    """Tools and environments (multi-turn rollouts), or None."""
    rollout_func: Callable | None = None
    """GRPOTrainer's ``rollout_func(prompts, trainer)`` (see :mod:`a3po_trl.rollout.rollout_func`), or None."""
    rollout_owner: Any = None
    """What ``rollout_func`` receives as its trainer."""


def run_rollout(
    settings: RolloutSettings,
    backend: GenerationBackend,
    rows: list[dict],
    should_stop=None,
    trainer_state=None,
    index=0,
) -> ScoredBatch:
    """Generate with ``backend`` (its loaded weight version), and score ``rows`` with the reward functions.

    ``trainer_state`` is what reward functions receive as ``trainer_state`` (the state of the weights' version);
    ``index`` is the batch's position in the run (for its sampling seed). Values reward functions pass to
    ``log_metric`` and ``log_extra`` are kept with the batch for the trainer to log. With tools or environments
    (``settings.agent``) the rollout is multi-turn (:mod:`a3po_trl.rollout.multi_turn`).
    """
    seed = settings.sampling_seeds(index) if settings.sampling_seeds is not None else None
    environments, extra_fields = None, {}
    if settings.rollout_func is not None:
        prompts = [row["prompt"] for row in rows]
        prompt_ids_list, trajectories, extra_fields = run_rollout_func(
            settings.rollout_func, settings.rollout_owner, backend, prompts, settings.decode, should_stop, seed
        )
    elif settings.agent is not None:
        prompts, environments, names = prepare_agent_prompts(settings.agent, rows)
        if not is_conversational({"prompt": prompts[0]}):
            raise ValueError(
                "tools and environment_factory need conversational prompts (lists of messages), as in "
                "GRPOTrainer: the tool calls are parsed from assistant messages. Give the dataset a conversational "
                "'prompt' column."
            )
        tools = prompt_tools(settings.agent, names, len(prompts))
        prompt_ids_list = settings.tokenize_prompts(prompts, tools)
        trajectories = generate_with_tools(
            settings.agent, backend, prompt_ids_list, environments, names, should_stop, seed
        )
    else:
        prompts = [row["prompt"] for row in rows]
        prompt_ids_list = settings.tokenize_prompts(prompts, None)
        trajectories = generate_single_turn(settings, backend, prompts, prompt_ids_list, should_stop, seed)
    timings = dict(trajectories.timings)
    completion_ids_list = trajectories.completion_ids

    prompt_ids, prompt_mask = pad_rows(prompt_ids_list, settings.pad_token_id, "left", settings.pad_to_multiple_of)
    completion_ids, completion_mask = pad_rows(
        completion_ids_list, settings.pad_token_id, "right", settings.pad_to_multiple_of
    )
    width = completion_ids.size(1)
    eos_and_pad = {*settings.eos_token_ids, settings.pad_token_id}
    is_truncated = torch.tensor([len(ids) == 0 or ids[-1] not in eos_and_pad for ids in completion_ids_list])
    if settings.mask_truncated_completions:
        completion_mask = completion_mask * (~is_truncated).unsqueeze(1).long()
    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "behavior_logps": pad_values(trajectories.logps, 0.0, width, torch.float32),
        "token_versions": pad_values(trajectories.token_versions, NO_VERSION, width, torch.long),
    }
    if trajectories.sampling_logps is not None:  # the sampler drew from a processed (truncated, penalised) policy
        tensors["sampling_logps"] = pad_values(trajectories.sampling_logps, 0.0, width, torch.float32)
    if trajectories.tool_mask is not None:
        tool_mask = pad_values(trajectories.tool_mask, 1, width, torch.long)
        if settings.mask_truncated_completions:
            tool_mask = tool_mask * (~is_truncated).unsqueeze(1).long()
        tensors["tool_mask"] = tool_mask
        completion_lengths = torch.tensor([sum(mask) for mask in trajectories.tool_mask])
    else:
        completion_lengths = torch.tensor([len(ids) for ids in completion_ids_list])
    tool_stats = None
    if settings.agent is not None and trajectories.tool_mask is not None:  # logged as GRPOTrainer logs them
        tool_stats = ToolStats(
            turns=torch.tensor(trajectories.turns),
            tool_result_lengths=torch.tensor([len(m) - sum(m) for m in trajectories.tool_mask]),
            calls=trajectories.tool_calls,
            failures=trajectories.tool_failures,
            timeouts=trajectories.tool_timeouts,
        )

    completions = trajectories.completions
    extra_logs: dict[str, list] = defaultdict(list)
    logged_metrics: dict[str, list[float]] = defaultdict(list)
    extra_kwargs = {
        "trainer_state": trainer_state,
        "log_extra": lambda column, values: extra_logs[column].extend(values),
        "log_metric": lambda name, value: logged_metrics[name].append(float(value)),
    }
    if environments is not None:
        extra_kwargs["environments"] = environments
    extra_kwargs.update(extra_fields)  # what a rollout_func returned besides ids and log-probs
    start = time.perf_counter()
    rewards_per_func = score_completions(
        settings.reward_funcs,
        settings.reward_func_names,
        settings.reward_processing_classes,
        rows,
        prompts,
        completions,
        completion_ids_list,
        extra_kwargs,
        skip=settings.deferred_reward_columns,
        async_loop=settings.async_loop,
        chat_template_kwargs=settings.chat_template_kwargs,
        workers=settings.reward_workers,
    )
    end = time.perf_counter()
    timings["rewards"] = end - start
    record_in_batch_span("rewards", start, end)
    return ScoredBatch(
        index=-1,
        version=-1,
        tensors=tensors,
        rewards_per_func=rewards_per_func,
        is_truncated=is_truncated,
        completion_lengths=completion_lengths,
        tool_stats=tool_stats,
        texts={"prompt": prompts, "completion": completions},
        timings=timings,
        rows=rows,
        extra_logs=dict(extra_logs),
        logged_metrics=dict(logged_metrics),
        environments=environments,
    )


def generate_single_turn(settings, backend, prompts, prompt_ids, should_stop, seed) -> Trajectories:
    """One generate call for the batch: every token from the version loaded when it starts, or (in-flight weight
    updates) from the version the backend reports for it."""
    timings: dict[str, float] = {}
    version = backend.version  # before the call: an in-flight update changes it mid-batch
    generated = backend.timed_generate(prompt_ids, should_stop, seed, timings)
    sampling_logps = generated.sampling_logps
    token_versions = generated.token_versions
    if token_versions is None:
        token_versions = [[version] * len(ids) for ids in generated.completion_ids]
    return Trajectories(
        completion_ids=generated.completion_ids,
        logps=[lp.float().cpu() for lp in generated.logps],
        sampling_logps=[lp.float().cpu() for lp in sampling_logps] if sampling_logps is not None else None,
        token_versions=[list(row) for row in token_versions],
        completions=settings.decode(generated.completion_ids, prompt_ids, prompts),
        timings=timings,
    )


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
