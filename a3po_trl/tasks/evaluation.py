"""Held-out accuracy of a causal LM on math word problems: batched greedy decoding scored by `correctness_reward`."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from .rewards import correctness_reward

__all__ = ["evaluate_accuracy", "paired_accuracy_test"]


def _prompt_texts(tokenizer, prompts: Sequence[Any]) -> list[str]:
    """Prompt strings: the chat template (with the generation prompt) for conversations, plain strings unchanged."""
    texts = []
    for prompt in prompts:
        if isinstance(prompt, str):
            texts.append(prompt)
        else:
            texts.append(tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True))
    return texts


def _eos_token_ids(model, tokenizer) -> list[int]:
    ids = []
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    return sorted(set(ids))


@torch.inference_mode()
def evaluate_accuracy(
    model,
    tokenizer,
    dataset,
    max_new_tokens: int = 128,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    *,
    num_samples: int = 3,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    progress: bool = True,
) -> dict[str, Any]:
    """Greedy-decoding accuracy of ``model`` on ``dataset`` (exact numeric match of the final answer).

    Each conversational ``prompt`` goes through the tokenizer's chat template with the generation prompt (plain
    string prompts are used as they are); prompts are left-padded and decoded greedily in batches of
    ``batch_size`` (sorted by length to limit padding). Every completion is scored with
    :func:`a3po_trl.tasks.rewards.correctness_reward` against the ``answer`` column (a GSM8K solution ending in
    ``#### N`` or a bare number).

    Args:
        model: A causal LM (``transformers`` or ``peft`` model). Unwrap DDP/accelerate wrappers first.
        tokenizer: Its tokenizer (with a chat template for conversational prompts). Its padding side is restored.
        dataset: A ``datasets.Dataset`` (or a list of dicts) with ``prompt`` and ``answer`` columns.
        max_new_tokens: Most tokens generated per problem; unfinished answers usually score 0.
        batch_size: Problems decoded together.
        device: Device to run on; None keeps the model where it is.
        num_samples: How many (question, completion, answer, correct) examples to return.
        prompt_column: Name of the prompt column.
        answer_column: Name of the answer column.
        progress: Show a progress bar (batches decoded, on stderr).

    Returns:
        A dict with ``accuracy`` (fraction correct), ``count``, ``num_correct``, ``stderr`` (binomial standard
        error ``sqrt(p (1 - p) / n)``), ``correct`` (0/1 per problem, in dataset order, for paired comparisons),
        ``samples`` (the first ``num_samples`` problems with their completions), ``completions`` (every completion,
        in dataset order), ``mean_completion_tokens``, ``truncated_fraction`` (completions that hit
        ``max_new_tokens`` without finishing) and ``seconds``.
    """
    rows = [dict(row) for row in dataset] if not isinstance(dataset, list) else dataset
    count = len(rows)
    if count == 0:
        raise ValueError("evaluate_accuracy needs at least one problem; the dataset is empty.")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be positive.")
    if device is not None:
        model = model.to(device)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_token_ids = _eos_token_ids(model, tokenizer)
    start = time.perf_counter()
    try:
        texts = _prompt_texts(tokenizer, [row[prompt_column] for row in rows])
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        order = sorted(range(count), key=lambda i: lengths[i])
        completions: list[str] = [""] * count
        completion_tokens = 0
        truncated = 0
        batches = range(0, count, batch_size)
        for first in tqdm(batches, desc=f"Evaluating {count} problems", unit="batch", disable=not progress):
            indices = order[first : first + batch_size]
            batch = tokenizer(
                [texts[i] for i in indices], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            output = model.generate(
                **batch,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_token_id,
                eos_token_id=eos_token_ids or None,
            )
            new_tokens = output[:, batch["input_ids"].shape[1] :]
            for i, ids in zip(indices, new_tokens):
                ids = ids.tolist()
                ends = [k for k, token in enumerate(ids) if token in eos_token_ids or token == pad_token_id]
                ids = ids[: ends[0]] if ends else ids
                truncated += not ends and len(ids) >= max_new_tokens
                completion_tokens += len(ids)
                completions[i] = tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        if was_training:
            model.train()
    answers = [row[answer_column] for row in rows]
    correct = correctness_reward(completions=completions, answer=answers)
    num_correct = int(sum(correct))
    accuracy = num_correct / count
    samples = [
        {
            "question": rows[i].get("question", texts[i]),
            "completion": completions[i],
            "answer": answers[i],
            "correct": bool(correct[i]),
        }
        for i in range(min(num_samples, count))
    ]
    return {
        "accuracy": accuracy,
        "count": count,
        "num_correct": num_correct,
        "stderr": math.sqrt(accuracy * (1.0 - accuracy) / count),
        "correct": [int(c) for c in correct],
        "samples": samples,
        "completions": completions,
        "mean_completion_tokens": completion_tokens / count,
        "truncated_fraction": truncated / count,
        "seconds": time.perf_counter() - start,
    }


def paired_accuracy_test(before: Sequence[int], after: Sequence[int]) -> dict[str, float]:
    """Compare two 0/1 score lists on the same problems: the accuracy gain, its paired standard error, an exact
    McNemar (sign) test p-value on the discordant problems, and the z-score of the gain.

    Returns:
        ``{"gain", "stderr", "z", "improved", "regressed", "p_value"}``; ``p_value`` is two-sided.
    """
    if len(before) != len(after) or not before:
        raise ValueError("paired_accuracy_test needs two non-empty score lists of the same length.")
    n = len(before)
    diffs = [int(a) - int(b) for a, b in zip(after, before)]
    gain = sum(diffs) / n
    variance = sum((d - gain) ** 2 for d in diffs) / max(n - 1, 1)
    stderr = math.sqrt(variance / n)
    improved, regressed = diffs.count(1), diffs.count(-1)
    discordant = improved + regressed
    if discordant == 0:
        p_value = 1.0
    else:
        tail = sum(math.comb(discordant, k) for k in range(min(improved, regressed) + 1)) / 2**discordant
        p_value = min(1.0, 2.0 * tail)
    return {
        "gain": gain,
        "stderr": stderr,
        "z": gain / stderr if stderr > 0 else (math.copysign(math.inf, gain) if gain else 0.0),
        "improved": improved,
        "regressed": regressed,
        "p_value": p_value,
    }
