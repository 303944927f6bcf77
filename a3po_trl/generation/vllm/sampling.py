"""How vLLM samples for the trainer, and what it returns: GRPOTrainer's sampling fields as ``SamplingParams``, one seed
per prompt, and vLLM's outputs read back as completions with their behavior log-probs.

Nothing here imports vLLM at module level; :func:`sampling_params` imports it when called.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...types import GeneratedCompletions


@dataclass
class VLLMSamplingSettings:
    """How vLLM samples: GRPOTrainer's sampling fields, as its own vLLM path passes them."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    generation_kwargs: dict = field(default_factory=dict)
    """``GRPOConfig.generation_kwargs``, passed to ``SamplingParams`` as they are."""


def sampling_fields(settings: VLLMSamplingSettings, n: int = 1, seed: int | None = None) -> dict:
    """The fields of vLLM's ``SamplingParams`` that GRPOTrainer's sampling settings give, ``generation_kwargs`` over
    them: ``n`` completions, child ``j`` from the stream of ``seed + j`` (``seed`` only where given), the sampled
    token's log-prob (``logprobs=0``). The in-process engine takes them as they are, the server's routes as JSON."""
    fields = dict(
        n=n,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k if settings.top_k else -1,
        min_p=settings.min_p or 0.0,
        repetition_penalty=settings.repetition_penalty,
        max_tokens=settings.max_tokens,
        logprobs=0,
        stop_token_ids=list(settings.stop_token_ids),
        **({"seed": seed} if seed is not None else {}),
    )
    fields.update(settings.generation_kwargs or {})
    return fields


def sampling_params(settings: VLLMSamplingSettings, seed: int | None):
    """One ``SamplingParams`` for one prompt: one completion, the sampled token's log-prob (``logprobs=0``, which
    the engine reports as ``processed_logprobs``: with the neutral truncation and penalties that
    :func:`~a3po_trl.validation.check_vllm_sampling` enforces, ``log softmax(logits / T)``, what the
    trainer's forward scores), no detokenizing."""
    from vllm import SamplingParams

    return SamplingParams(**{"detokenize": False, **sampling_fields(settings, 1, seed)})


def row_seeds(seed: int | None, count: int) -> list[int | None]:
    """A seed per prompt of a batch from the batch's seed (each row of a group must sample its own completion)."""
    if seed is None:
        return [None] * count
    return [(seed + i) % (2**63 - 1) for i in range(count)]


def completions_from_token_logprobs(rows, stop_token_ids: list[int]) -> GeneratedCompletions:
    """``rows`` of ``(token_ids, sampled-token log-probs)``, each cut after its first stop token."""
    stops = set(stop_token_ids)
    completion_ids, logps = [], []
    for ids, values in rows:
        ids, values = list(ids), list(values)
        end = next((i + 1 for i, token in enumerate(ids) if token in stops), len(ids))
        completion_ids.append(ids[:end])
        logps.append(torch.tensor(values[:end], dtype=torch.float32))
    return GeneratedCompletions(completion_ids=completion_ids, logps=logps)


def completions_from_outputs(outputs, stop_token_ids: list[int]) -> GeneratedCompletions:
    """Token ids and sampled-token log-probs from vLLM ``RequestOutput``s (one completion each), cut after the first
    stop token."""
    rows = []
    for output in outputs:
        completion = output.outputs[0]
        if completion.logprobs is None:
            raise RuntimeError("vLLM returned no log-probs; the request must ask for logprobs=0.")
        ids = list(completion.token_ids)
        rows.append((ids, [position[token].logprob for position, token in zip(completion.logprobs, ids)]))
    return completions_from_token_logprobs(rows, stop_token_ids)
