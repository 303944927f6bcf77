"""The data that crosses module boundaries: what a backend generates, and the scored batch the generator hands the
trainer. Nothing here computes; every stage (backends, rollouts, the batch producer, the trainer) shares these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class GenerationStopped(Exception):
    """Raised inside the generation thread when the batch producer is asked to stop; never escapes the producer."""


@dataclass
class GeneratedCompletions:
    """What a backend returns for a batch of prompts."""

    completion_ids: list[list[int]]
    """Per prompt, the generated token ids, cut after the first EOS token."""
    logps: list[torch.Tensor]
    """Per prompt, the behavior log-probs of those tokens under the temperature-scaled distribution of the weights
    that generated them (1-D float tensors, one value per token): what the trainer's forward scores, the anchor of
    A-3PO's proximal policy."""
    sampling_logps: list[torch.Tensor] | None = None
    """Per prompt, the log-probs of those tokens under the distribution they were drawn from, when the sampler
    processed the policy's distribution first (top-k/p, min-p, penalties: truncated and renormalised); ``None`` when
    it sampled ``softmax(logits / temperature)`` itself, i.e. the same values as :attr:`logps`."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent on parts of the call worth reporting apart (e.g. ``behavior_logps`` for a separate forward,
    ``in_flight_weight_load`` for versions loaded between decode steps), and ``in_flight_weight_loads`` (a count)."""
    token_versions: list[list[int]] | None = None
    """Per prompt, the weight version that sampled each token, when the backend loaded newer weights between decode
    steps (``in_flight_weight_updates``); ``None``: every token comes from the version loaded when the call began."""


@dataclass
class ToolStats:
    """What the tool-call loop of a multi-turn batch did, for the ``tools/*`` metrics (this process's rows)."""

    turns: torch.Tensor
    """``(B,)`` model turns per trajectory."""
    tool_result_lengths: torch.Tensor
    """``(B,)`` tool-result tokens per trajectory."""
    calls: int = 0
    failures: int = 0
    timeouts: int = 0


@dataclass
class ScoredBatch:
    """One generation batch, scored, as the generator hands it to the trainer."""

    index: int
    """Position of the batch in this run's sequence of generation batches (0-based)."""
    version: int
    """Policy version (optimizer steps applied) of the weights the batch started generating with, the oldest of its
    tokens. Every token of a single-turn batch comes from it unless the generator loads newer weights between decode
    steps (``in_flight_weight_updates``); later turns of a multi-turn batch may come from newer versions too.
    ``tensors["token_versions"]`` records the version of each token."""
    tensors: dict[str, torch.Tensor]
    """The padded ``(B, T)`` tensors the loss trains on, by their names in the training batch: ``prompt_ids``,
    ``prompt_mask``, ``completion_ids``, ``completion_mask``, ``behavior_logps``, ``token_versions``, and where they
    apply ``sampling_logps`` (a processed sampling distribution) and ``tool_mask`` (multi-turn)."""
    rewards_per_func: torch.Tensor
    """``(B, num_reward_funcs)`` raw rewards of this process's rows, NaN where a function returned None (or was left
    to the trainer)."""
    is_truncated: torch.Tensor
    """``(B,)`` completions that ended without an EOS token."""
    completion_lengths: torch.Tensor
    """``(B,)`` generated tokens per completion (tool-result tokens excluded)."""
    tool_stats: ToolStats | None = None
    """The tool-call loop's statistics (``tools`` / ``environment_factory`` with tools), or None."""
    texts: dict[str, list] = field(default_factory=dict)
    """Prompts and completions, as the reward functions received them."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent generating, scoring, and waiting for the staleness bound."""
    rows: list[dict] = field(default_factory=list)
    """The dataset rows the batch was generated for."""
    extra_logs: dict[str, list] = field(default_factory=dict)
    """Columns reward functions added to the completions table (``log_extra``)."""
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)
    """Values reward functions logged (``log_metric``)."""
    environments: list | None = None
    """The environment instances of the batch's rollouts (``environment_factory``), or None."""
    sampling_stats: dict[str, float] = field(default_factory=dict)
    """With dynamic sampling, what filling the batch took on this process (``draws``, ``filtered_groups``,
    ``bound_reached``, ``prompts_drawn``: see :mod:`a3po_trl.rollout.dynamic_sampling`); empty otherwise."""
