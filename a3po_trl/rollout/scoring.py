"""Rewards, with GRPOTrainer's semantics.

:func:`score_completions` calls the reward functions on one process's completions (no collective), so it can run in
the generation thread: plain and ``async def`` functions, reward models, ``None`` as "not scored". The advantages need
every process's rewards: the trainer computes them in its main thread
(:func:`a3po_trl.functional.group_advantages`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from torch import nn
from trl.data_utils import apply_chat_template, is_conversational
from trl.trainer.utils import is_async_callable

from ..runtime.activity import doing
from .reward_workers import RewardWorkers, note_function_name

logger = logging.getLogger(__name__)


def score_completions(
    reward_funcs: list,
    reward_func_names: list[str],
    reward_processing_classes: list,
    rows: list[dict],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    extra_kwargs: dict[str, Any] | None = None,
    *,
    skip: frozenset[int] | set[int] = frozenset(),
    async_loop: asyncio.AbstractEventLoop | None = None,
    chat_template_kwargs: dict | None = None,
    workers: RewardWorkers | None = None,
) -> torch.Tensor:
    """``(B, F)`` float32 rewards from each reward function, locally (no gather). None becomes NaN.

    Reward functions follow TRL's signature ``f(prompts, completions, completion_ids, **columns, **extra_kwargs)``;
    ``async def`` functions run concurrently on ``async_loop`` (TRL's daemon loop; a private one when ``None``);
    reward models (``nn.Module``) score the prompt + completion text. Columns listed in ``skip`` are left NaN (scored
    elsewhere). A function that raises has its name added to the error. With ``workers``
    (:class:`~a3po_trl.rollout.reward_workers.RewardWorkers`), plain and ``async def`` functions are called in its
    processes while the reward models score here; their values are converted here, as in the thread.
    """
    rewards = torch.full((len(prompts), len(reward_funcs)), torch.nan, dtype=torch.float32)
    columns = {
        key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")
    }
    columns.update(extra_kwargs or {})
    in_workers = [] if workers is None else [i for i in workers.worker_indices if i not in skip]
    in_flight = workers.submit(in_workers, prompts, completions, completion_ids, columns) if in_workers else None
    pending_async = []
    for i, (func, name, processing_class) in enumerate(
        zip(reward_funcs, reward_func_names, reward_processing_classes, strict=True)
    ):
        if i in skip or i in in_workers:
            continue
        if is_async_callable(func):
            pending_async.append((i, func, name))
            continue
        with _named_errors(name), doing(f"in the reward function {name!r}"):
            if isinstance(func, nn.Module):
                values = score_with_reward_model(func, processing_class, prompts, completions, chat_template_kwargs)
            else:
                values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        rewards[:, i] = torch.tensor(_as_reward_list(values, name, len(prompts)), dtype=torch.float32)
    if in_flight is not None:
        names = ", ".join(repr(reward_func_names[i]) for i in in_workers)
        with doing(f"waiting for the reward workers' {names}"):
            scored = in_flight.results()
        for i, values in scored.items():
            rewards[:, i] = torch.tensor(
                _as_reward_list(values, reward_func_names[i], len(prompts)), dtype=torch.float32
            )
    if pending_async:

        async def call(func, name):
            with _named_errors(name):
                return await func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

        async def call_all():
            return await asyncio.gather(*(call(func, name) for _, func, name in pending_async))

        names = ", ".join(repr(name) for _, _, name in pending_async)
        with doing(f"in the async reward functions {names}"):
            if async_loop is not None:
                results = asyncio.run_coroutine_threadsafe(call_all(), async_loop).result()
            else:
                results = asyncio.run(call_all())
        for (i, _, name), values in zip(pending_async, results):
            rewards[:, i] = torch.tensor(_as_reward_list(values, name, len(prompts)), dtype=torch.float32)
    return rewards


class _named_errors:
    """Adds the reward function's name to any exception it raises."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, exc_type, error, traceback):
        if error is not None and isinstance(error, Exception):
            note_function_name(error, self.name, f"(raised by the reward function {self.name!r})")
        return False


def warn_about_unscorable_rows(rewards_per_func: torch.Tensor, rows: list[dict], prompts: list, completions: list):
    """GRPOTrainer's warning when every reward function returned None for a completion (its advantage becomes 0)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if not unscorable.any():
        return
    index = int(unscorable.nonzero()[0, 0])
    kwargs = {key: value for key, value in rows[index].items() if key != "prompt"}
    kwargs["prompt"], kwargs["completion"] = prompts[index], completions[index]
    logger.warning(
        f"All reward functions returned None for the following kwargs:\n{kwargs}\n"
        "Please ensure that at least one reward function returns a valid reward."
    )


def _as_reward_list(values, name: str, expected: int) -> list[float]:
    """A reward function's result as floats (NaN for None), refusing what GRPOTrainer refuses.

    GRPOTrainer turns the list into ``torch.tensor(values, dtype=torch.float32)``: numbers pass (``int``, ``float``,
    ``bool``, numpy scalars, one-element tensors, ``Decimal``, ``Fraction``), ``None`` means "not applicable", and a
    string raises, even a numeric one. ``float()`` would accept ``"1.0"`` and ``b"1"``, so an LLM judge's raw text
    would train silently: each value goes through GRPOTrainer's conversion instead, with the function's name in the
    error.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().float().cpu().flatten().tolist()
    rewards = None
    if not isinstance(values, (str, bytes)):  # iterable, but one value, not a list of them
        try:
            rewards = list(values)
        except TypeError:
            pass
    if rewards is None:
        raise TypeError(
            f"The reward function {name!r} returned {type(values).__name__}; it must return a list of floats "
            f"(one per completion, None to skip)."
        )
    if len(rewards) != expected:
        raise ValueError(
            f"The reward function {name!r} returned {len(rewards)} rewards, but {expected} were expected (one per "
            "prompt-completion pair). Make sure it returns exactly one reward per completion."
        )
    return [float("nan") if value is None else _as_reward(value, name) for value in rewards]


def _as_reward(value, name: str) -> float:
    """One reward converted as ``torch.tensor([...], dtype=torch.float32)`` converts it in GRPOTrainer."""
    try:
        converted = torch.tensor([value.detach() if isinstance(value, torch.Tensor) else value], dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        converted = None
    if converted is None or converted.shape != (1,):  # strings raise; bytes and nested lists add a dimension
        raise TypeError(
            f"The reward function {name!r} returned a non-numeric reward {value!r} ({type(value).__name__}); return "
            "numbers (int, float, bool, numpy or one-element torch scalars), or None to skip a completion. Parse "
            "text, e.g. an LLM judge's answer, into a float inside the reward function."
        )
    return converted.item()


def score_with_reward_model(model, processing_class, prompts, completions, chat_template_kwargs=None) -> list[float]:
    """A sequence-classification reward model's score of each prompt + completion (its first logit), as TRL does."""
    if is_conversational({"prompt": prompts[0]}):
        texts = [
            apply_chat_template({"messages": p + c}, processing_class, **(chat_template_kwargs or {}))["text"]
            for p, c in zip(prompts, completions)
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
