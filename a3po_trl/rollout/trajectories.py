"""What a rollout produces for one local batch, token by token: completion ids, behavior log-probs and the weight
version of each token, before they are padded into the batch's tensors (:mod:`a3po_trl.rollout.run`)."""

from __future__ import annotations

from dataclasses import dataclass, field

NO_VERSION = -1
"""Version recorded for tokens no model generated (tool results)."""


@dataclass
class Trajectories:
    """The completions of one local batch, token by token, as the trainer needs them."""

    completion_ids: list[list[int]]
    logps: list[list[float]]
    """Behavior log-probs per completion token (of the policy's temperature-scaled distribution); 0 for tool-result
    tokens."""
    token_versions: list[list[int]]
    """Weight version that generated each completion token; :data:`NO_VERSION` for tool-result tokens."""
    completions: list
    """As reward functions receive them: a list of messages per row (assistant, tool, assistant, ...)."""
    tool_mask: list[list[int]] | None = None
    """1 for generated tokens, 0 for tool-result tokens (None: no tools)."""
    turns: list[int] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    tool_timeouts: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    sampling_logps: list[list[float]] | None = None
    """Log-probs under the processed distribution each token was drawn from (see
    :attr:`~a3po_trl.generation.backend.GeneratedCompletions.sampling_logps`), 0 for tool-result tokens; None when
    the sampler drew from the policy's distribution itself."""
