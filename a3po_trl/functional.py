"""The A-3PO math as pure functions of tensors.

Nothing here knows about a trainer, a model or a queue: every function takes tensors and returns tensors (and, for
the loss, a dictionary of statistics to log). The trainer wires them together; tests pin their properties.

Conventions, for a batch of ``B`` sequences with ``T`` completion tokens:

- ``*_logps`` are per-token log-probabilities of the sampled tokens, shape ``(B, T)``.
- ``staleness`` is ``v_now - v_token`` (optimizer steps between the weights that generated a token and the weights
  being trained), either per sequence ``(B,)`` / ``(B, 1)`` or per token ``(B, T)``.
- ``mask`` is the completion mask ``(B, T)`` (1 for tokens that enter the loss).

The method (see A-3PO, arXiv 2512.06547, and the AReaL reference implementation):

    w         = 1 / max(d, 1)
    logp_prox = w * logp_behav + (1 - w) * logp_theta.detach()
    r         = exp(logp_theta - logp_prox)                  # trust-region ratio, clipped
    rho       = exp(logp_prox - logp_behav).detach()         # behavior importance weight, capped
    loss_tok  = rho * max(-A * r, -A * clamp(r, 1 - eps_low, 1 + eps_high))
"""

from __future__ import annotations

import torch

PROXIMAL_METHODS = ("loglinear", "recompute", "metrics")
"""How the proximal log-probs are obtained: A-3PO's interpolation, a forward pass, or both (to measure the error)."""

CAP_MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")
"""How the behavior importance weight is capped: per token or per sequence (geometric mean), masked or clamped."""

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
"""TRL's GRPOTrainer loss types, each of which the decoupled loss has a form of."""


def _broadcast_to_tokens(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Give per-sequence values ``(B,)`` a token axis ``(B, 1)``; leave ``(B, 1)`` and ``(B, T)`` unchanged."""
    if values.dim() == 1:
        values = values.unsqueeze(-1)
    if values.dim() != 2 or values.size(0) != like.size(0) or values.size(1) not in (1, like.size(1)):
        raise ValueError(
            f"Expected per-sequence (B,), (B, 1) or per-token (B, T) values for a (B, T) = {tuple(like.shape)} batch, "
            f"got shape {tuple(values.shape)}."
        )
    return values


def staleness_weight(staleness: torch.Tensor) -> torch.Tensor:
    """Weight of the behavior policy in the proximal interpolation: ``w = 1 / max(d, 1)``, elementwise.

    ``d <= 1`` (on-policy or one version behind) gives ``w = 1``: the proximal policy is the behavior policy.
    Larger staleness moves the anchor toward the current policy. Returns a float tensor of ``staleness``'s shape.
    """
    staleness = torch.as_tensor(staleness)
    return 1.0 / staleness.to(torch.get_default_dtype()).clamp(min=1.0)


def approximate_proximal_logps(
    behavior_logps: torch.Tensor, current_logps: torch.Tensor, staleness: torch.Tensor
) -> torch.Tensor:
    """A-3PO's log-linear proximal log-probs: ``w * behavior + (1 - w) * current.detach()`` with ``w = 1/max(d, 1)``.

    Args:
        behavior_logps: ``(B, T)`` log-probs of the policy that generated the tokens.
        current_logps: ``(B, T)`` log-probs of the policy being trained; detached here, so no gradient flows through
            the proximal policy.
        staleness: ``(B,)``, ``(B, 1)`` or ``(B, T)`` version gap ``v_now - v_token`` (non-negative).

    Returns:
        ``(B, T)`` proximal log-probs, in the dtype of ``current_logps``.
    """
    weight = staleness_weight(_broadcast_to_tokens(staleness, current_logps)).to(
        device=current_logps.device, dtype=current_logps.dtype
    )
    current = current_logps.detach()
    # w * behavior + (1 - w) * current: w = 1 (staleness <= 1) gives the behavior log-probs exactly.
    return weight * behavior_logps.to(current.dtype) + (1.0 - weight) * current


def _masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the masked tokens of each sequence, ``(B, 1)``; 0 for sequences with no token."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def behavior_importance_weight(
    proximal_logps: torch.Tensor,
    behavior_logps: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None = 5.0,
    cap_mode: str = "token_mask",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (detached) behavior importance weight ``rho = pi_prox / pi_behav`` and the tokens it keeps.

    Cap modes:
        - ``token_mask``: tokens with ``rho > cap`` are dropped from the loss (AReaL's default).
        - ``token_truncate``: ``rho`` is clamped to ``cap``.
        - ``sequence_mask`` / ``sequence_truncate``: every token of a sequence uses the sequence's geometric-mean
          ``rho`` (over its masked tokens), and sequences above ``cap`` are dropped / clamped.

    Returns:
        ``(weight, keep)``: ``weight`` is ``(B, T)`` (already capped for truncate modes), ``keep`` is a boolean
        ``(B, T)`` mask, a subset of ``mask``.
    """
    if cap_mode not in CAP_MODES:
        raise ValueError(f"Unknown behavior weight cap mode {cap_mode!r}; choose one of {CAP_MODES}.")
    log_rho = (proximal_logps - behavior_logps).detach()
    mask = mask.bool()
    if cap_mode.startswith("sequence"):
        log_rho = _masked_sequence_mean(log_rho, mask).expand_as(log_rho)
    rho = torch.exp(log_rho)
    keep = mask.clone()
    if cap is not None:
        if cap_mode.endswith("mask"):
            keep = keep & (rho <= cap)
        else:
            rho = rho.clamp(max=cap)
    return rho, keep


def decoupled_ppo_loss(
    current_logps: torch.Tensor,
    proximal_logps: torch.Tensor,
    behavior_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    behavior_weight_cap: float | None = 5.0,
    cap_mode: str = "token_mask",
    *,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token decoupled policy loss for each of GRPOTrainer's loss types: the proximal policy anchors the trust
    region, the (detached, capped) behavior weight ``rho = pi_prox / pi_behav`` corrects for off-policy samples.

    This is GRPOTrainer's loss with its "old" policy replaced by the proximal one and its importance-sampling
    correction (the one it applies to vLLM samples) replaced by ``rho``: with ``r = pi_theta / pi_prox`` (per token,
    or its geometric mean over the sequence for ``importance_sampling_level="sequence"``, GSPO),

    - ``grpo``/``bnpo``/``dr_grpo``/``dapo``/``luspo``:
      ``rho * max(-A * r', -A * clamp(r, 1 - eps_low, 1 + eps_high))`` with ``r' = min(r, delta)`` when ``delta`` is
      set (two-sided clipping);
    - ``cispo``: ``-rho * sg(min(r, eps_high)) * A * logp_theta``;
    - ``sapo``: ``-rho * sigmoid(tau * (r - 1)) * 4 / tau * A`` with ``tau`` by the sign of ``A``;
    - ``vespo``: ``-phi(w) * A * logp_theta`` with TRL's gamma weight ``phi`` of the sequence ratio, ``rho``
      entering ``w`` as the importance ratio (as TRL does with vLLM's).

    With the behavior policy as proximal policy (staleness <= 1 under A-3PO) ``rho = 1`` and this is GRPOTrainer's
    loss for samples generated by the weights it trains. The loss is zero where the token is masked, dropped by the
    cap, or where the behavior log-prob is not finite (a token the generator could not score).

    Args:
        current_logps: ``(B, T)`` log-probs of the policy being trained (the only input that carries gradient).
        proximal_logps: ``(B, T)`` proximal log-probs (from :func:`approximate_proximal_logps` or a forward pass).
        behavior_logps: ``(B, T)`` log-probs of the policy that generated the tokens.
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` advantages.
        mask: ``(B, T)`` completion mask.
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]`` (``epsilon_high`` is the
            truncation of ``cispo``).
        behavior_weight_cap: cap on ``rho`` (``None`` disables it).
        cap_mode: one of :data:`CAP_MODES`.
        loss_type: one of :data:`LOSS_TYPES`.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO: one ratio per sequence).
        delta: upper clamp of the unclipped ratio (two-sided clipping), ``None`` for none.
        sapo_temperature_pos, sapo_temperature_neg, vespo_*: the parameters of those loss types (TRL's names).

    Returns:
        ``(per_token_loss, stats)``: ``per_token_loss`` is ``(B, T)``; ``stats`` holds ``importance_ratio`` (``r``
        with its gradient, ``(B, T)`` or ``(B, 1)``, for the bias-corrected KL), and detached: ``ratio`` (``r`` after
        ``delta``), ``behavior_weight`` (``rho``), ``keep``, ``is_low_clipped``, ``is_high_clipped`` (for ``cispo``:
        truncated by ``epsilon_high``; both unmasked, shaped like ``ratio`` broadcast with ``A``),
        ``nonfinite_behavior`` (``(B, T)`` booleans) and, for ``vespo``, ``phi_seq``
        (``(B, 1)``).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; the decoupled loss supports {LOSS_TYPES}.")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r} must be 'token' or 'sequence'.")
    advantages = _broadcast_to_tokens(advantages, current_logps).to(current_logps.dtype)
    mask = mask.bool()
    # A token whose behavior (or proximal) log-prob is -inf/NaN carries no usable correction: mask it and replace the
    # values so that no NaN reaches the loss or its gradient.
    finite = torch.isfinite(behavior_logps) & torch.isfinite(proximal_logps)
    nonfinite_behavior = mask & ~finite
    detached = current_logps.detach()
    behavior_logps = torch.where(finite, behavior_logps.to(detached.dtype), detached)
    proximal_logps = torch.where(finite, proximal_logps.to(detached.dtype), detached)
    usable = mask & finite

    log_ratio = current_logps - proximal_logps
    if importance_sampling_level == "token":
        log_importance = log_ratio
    else:
        maskf = mask.to(log_ratio.dtype)
        log_importance = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_importance)
    stats: dict[str, torch.Tensor] = {"importance_ratio": ratio}

    rho, keep = behavior_importance_weight(proximal_logps, behavior_logps, usable, behavior_weight_cap, cap_mode)
    # The correction TRL multiplies its loss by: rho on kept tokens, 0 on dropped ones, 1 outside the completion.
    importance_weight = torch.where(keep, rho, torch.where(mask, torch.zeros_like(rho), torch.ones_like(rho)))

    if loss_type == "cispo":
        policy_loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * current_logps
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        policy_loss = -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages
    elif loss_type == "vespo":
        from trl import GRPOTrainer

        phi_seq = GRPOTrainer.get_gamma_weights(
            advantages=advantages[:, :1],
            log_ratio_per_token=log_ratio,
            mask=mask.to(log_ratio.dtype),
            importance_sampling_ratio=importance_weight,
            k_pos=vespo_k_pos,
            lambda_pos=vespo_lambda_pos,
            k_neg=vespo_k_neg,
            lambda_neg=vespo_lambda_neg,
        )
        policy_loss = -phi_seq * advantages * current_logps
        stats["phi_seq"] = phi_seq
    else:
        clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)
        policy_loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    if loss_type != "vespo":
        policy_loss = policy_loss * importance_weight
    per_token_loss = torch.where(usable, policy_loss, torch.zeros_like(policy_loss))

    detached_ratio = ratio.detach()
    if loss_type == "cispo":
        high = detached_ratio > epsilon_high
        low = torch.zeros_like(high)
    else:
        low, high = detached_ratio < 1.0 - epsilon_low, detached_ratio > 1.0 + epsilon_high
    stats.update(
        ratio=detached_ratio,
        behavior_weight=rho,
        keep=keep,
        is_low_clipped=low & (advantages < 0),
        is_high_clipped=high & (advantages > 0),
        nonfinite_behavior=nonfinite_behavior,
    )
    return per_token_loss, stats


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    gradient_accumulation_steps: int = 1,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_processes: int = 1,
    steps_per_generation: int = 1,
) -> torch.Tensor:
    """Reduce a per-token loss to the scalar TRL's GRPOTrainer would backpropagate, for each ``loss_type``.

    - ``grpo``, ``sapo``: mean over each sequence's tokens, then over sequences.
    - ``bnpo``: mean over all tokens of the micro-batch.
    - ``dr_grpo``: sum over tokens divided by ``B * max_completion_length``.
    - ``dapo``, ``cispo``, ``vespo``: sum over tokens divided by the token count of the whole generation batch
      (``num_items_in_batch``, global over processes), rescaled to one accumulation window.
    - ``luspo``: sum over each sequence's tokens, mean over sequences.

    The result is already divided for gradient accumulation (TRL sets ``loss_is_scaled_for_ga``); pass
    ``gradient_accumulation_steps=1`` (and ``steps_per_generation=1``) in evaluation.
    """
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        return loss / gradient_accumulation_steps
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs `max_completion_length`.")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length) / gradient_accumulation_steps
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            raise ValueError(
                f"loss_type={loss_type!r} needs `num_items_in_batch` (the generation batch's token count)."
            )
        normalizer = torch.as_tensor(num_items_in_batch, dtype=per_token_loss.dtype, device=per_token_loss.device)
        normalizer = normalizer.clamp(min=1.0) / num_processes
        normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        return masked.sum() / normalizer
    if loss_type == "luspo":
        return masked.sum(-1).mean() / gradient_accumulation_steps
    raise ValueError(f"Unknown loss_type {loss_type!r}; the decoupled loss supports {LOSS_TYPES}.")


def kl_to_reference(current_logps: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref), as TRL's GRPOTrainer computes it."""
    delta = reference_logps - current_logps
    return torch.exp(delta) - delta - 1


def proximal_approximation_error(
    approximate_logps: torch.Tensor,
    exact_logps: torch.Tensor,
    behavior_logps: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """How far A-3PO's proximal log-probs are from the recomputed ones, over the masked tokens.

    Returns 0-dim tensors: mean absolute and relative error of the log-probs (relative to ``|exact|``), and the mean
    absolute and relative error of the behavior weight ``rho = exp(prox - behavior)``.
    """
    mask = mask.bool() & torch.isfinite(behavior_logps)
    count = mask.sum().clamp(min=1)
    zeros = torch.zeros_like(exact_logps)
    abs_err = torch.where(mask, (approximate_logps - exact_logps).abs(), zeros)
    rel_err = torch.where(mask, abs_err / exact_logps.abs().clamp(min=1e-8), zeros)
    rho_approx = torch.exp(torch.where(mask, approximate_logps - behavior_logps, zeros))
    rho_exact = torch.exp(torch.where(mask, exact_logps - behavior_logps, zeros))
    rho_abs = torch.where(mask, (rho_approx - rho_exact).abs(), zeros)
    rho_rel = torch.where(mask, rho_abs / rho_exact.clamp(min=1e-8), zeros)
    return {
        "logp_abs_error": abs_err.sum() / count,
        "logp_rel_error": rel_err.sum() / count,
        "rho_abs_error": rho_abs.sum() / count,
        "rho_rel_error": rho_rel.sum() / count,
    }
