"""What the trainer logs when a micro-batch enters the loss, reduced across processes in the main thread:
GRPOTrainer's entropy, KL and clipping statistics, plus staleness, behavior weights, the drift from the behavior
policy, the generator's mismatch and the error of the log-linear estimate. Every function takes tensors and the
accelerator and returns a ``{name: 0-dim tensor}`` dictionary on the device, NaN where a metric has no value at this
micro-step: nothing here reads a device tensor on the host, so the training thread never waits for the device at a
micro-step. The trainer appends them to its ``_metrics``, and ``log`` turns them into floats
(:func:`~a3po_trl.metrics.deferred.resolve_metrics`) and averages them like GRPOTrainer's own."""

from __future__ import annotations

import math

import torch

from ..functional import proximal_approximation_error
from .deferred import nan_if_empty


def _nanmin(values: torch.Tensor) -> torch.Tensor:
    """TRL's ``nanmin`` without its host-side ``if``: the minimum ignoring NaNs, NaN when all are NaN."""
    smallest = torch.where(torch.isnan(values), torch.full_like(values, math.inf), values).min()
    return torch.where(torch.isnan(values).all(), torch.full_like(smallest, math.nan), smallest)


def _nanmax(values: torch.Tensor) -> torch.Tensor:
    """TRL's ``nanmax`` without its host-side ``if``: the maximum ignoring NaNs, NaN when all are NaN."""
    return -_nanmin(-values)


def _sum_and_count(values: torch.Tensor, mask_f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPOTrainer's ``global_masked_mean`` before its reduction: ``(B, 1)`` values are one per sequence (all of them
    count), ``(B, T)`` values count over the mask."""
    values = values.detach().float()
    if values.size(1) == 1:
        return values.sum(), torch.tensor(float(values.size(0)), device=values.device)
    return (values * mask_f).sum(), mask_f.sum()


def _per_sequence_mean(values: torch.Tensor, mask_f: torch.Tensor) -> torch.Tensor:
    """GRPOTrainer's ``masked_seq_mean``, for its clip-ratio extremes: NaN for a sequence without tokens (so that
    ``nanmin``/``nanmax`` skip it), where the loss's per-sequence mean in :mod:`a3po_trl.functional` gives 0."""
    values = values.float()
    if values.size(1) == 1:
        return values.squeeze(1)
    return (values * mask_f).sum(-1) / mask_f.sum(-1)


def loss_metrics(
    accelerator,
    mask: torch.Tensor,
    staleness: torch.Tensor,
    entropies: torch.Tensor,
    stats: dict[str, torch.Tensor],
    per_token_kl: torch.Tensor | None,
    max_staleness: int,
    loss_type: str,
) -> dict[str, torch.Tensor]:
    """Statistics of one micro-batch's loss over every process: one sum-reduce and one gather.

    GRPOTrainer's, computed as it does: ``entropy``, ``kl`` (with a reference), and by loss type the clip fractions
    (``clip_ratio/*``: a fraction of tokens, or of sequences with sequence-level ratios), ``cispo_clip_ratio`` or
    ``vespo/phi_seq_mean``. A-3PO's: staleness (mean, max, fraction of tokens at each staleness
    ``0..max_staleness``), the behavior-policy weight ``w``, the behavior importance weight ``rho`` (mean, max,
    fraction dropped by the cap), non-finite behavior log-probs.
    """
    mask_b = mask.bool()
    mask_f = mask_b.float()
    staleness_tok = staleness.float()
    if staleness_tok.dim() == 1:
        staleness_tok = staleness_tok.unsqueeze(1)
    staleness_tok = staleness_tok.expand_as(mask_f)
    weight = 1.0 / staleness_tok.clamp(min=1.0)
    rho = stats["behavior_weight"]
    count = mask_f.sum()
    zero = count.new_zeros(())
    low, high = stats["is_low_clipped"].float(), stats["is_high_clipped"].float()
    trl_pairs = [
        _sum_and_count(entropies, mask_f),
        _sum_and_count(per_token_kl, mask_f) if per_token_kl is not None else (zero, zero),
        _sum_and_count(low, mask_f),
        _sum_and_count(high, mask_f),
        _sum_and_count(stats["phi_seq"], mask_f) if "phi_seq" in stats else (zero, zero),
    ]
    histogram = [((staleness_tok == d) & mask_b).float().sum() for d in range(max_staleness + 1)]
    sums = torch.stack(
        [
            count,
            (staleness_tok * mask_f).sum(),
            (weight * mask_f).sum(),
            (rho * mask_f).sum(),
            (mask_b & ~stats["keep"]).float().sum(),
            stats["nonfinite_behavior"].float().sum(),
            *[value for pair in trl_pairs for value in pair],
            *histogram,
        ]
    )
    zeros = torch.zeros_like(staleness_tok)
    maxima = torch.stack(
        [
            torch.where(mask_b, staleness_tok, zeros).max(),
            torch.where(mask_b, rho, zeros).max(),
            _nanmin(_per_sequence_mean(low, mask_f)),
            _nanmax(_per_sequence_mean(high, mask_f)),
        ]
    ).to(count.device)
    sums = accelerator.reduce(sums, reduction="sum")
    gathered = accelerator.gather(maxima.unsqueeze(0))
    total = sums[0].clamp(min=1.0)

    def trl_mean(index: int) -> torch.Tensor:
        value_sum, value_count = sums[6 + 2 * index], sums[7 + 2 * index]
        return value_sum / value_count.clamp(min=1.0)

    values = {
        "entropy": trl_mean(0),
        "a3po/staleness_mean": sums[1] / total,
        "a3po/staleness_max": gathered[:, 0].max(),
        **{f"a3po/staleness_frac_{d}": sums[16 + d] / total for d in range(max_staleness + 1)},
        "a3po/behavior_policy_weight_mean": sums[2] / total,
        "a3po/importance_weight_mean": sums[3] / total,
        "a3po/importance_weight_max": gathered[:, 1].max(),
        "a3po/importance_weight_masked_frac": sums[4] / total,
        "a3po/nonfinite_behavior_tokens": sums[5],
    }
    if per_token_kl is not None:
        values["kl"] = trl_mean(1)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        values["clip_ratio/low_mean"] = trl_mean(2)
        values["clip_ratio/high_mean"] = trl_mean(3)
        values["clip_ratio/region_mean"] = trl_mean(2) + trl_mean(3)
        values["clip_ratio/low_min"] = _nanmin(gathered[:, 2])
        values["clip_ratio/high_max"] = _nanmax(gathered[:, 3])
    elif loss_type == "cispo":
        values["cispo_clip_ratio"] = trl_mean(3)
    elif loss_type == "vespo":
        values["vespo/phi_seq_mean"] = trl_mean(4)
    return values


def sampled_after_a_switch(token_versions: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` whether each token was sampled by another version than the first token of its turn: with in-flight
    weight updates, a token drawn after a version was loaded mid-turn, from the new weights over a KV cache the
    earlier ones computed. A turn is a run of generated tokens (non-negative versions) between tool results or
    padding (negative versions, never sampled after a switch): each turn is a new ``generate`` call whose prefix the
    weights of its first token compute afresh, so a single-turn completion is one turn. ``(B,)`` versions (one per
    completion) never are."""
    if token_versions.dim() < 2:
        return torch.zeros_like(token_versions, dtype=torch.bool).view(-1, 1)
    generated = token_versions >= 0
    before = torch.nn.functional.pad(generated[:, :-1], (1, 0), value=False)
    positions = torch.arange(token_versions.size(1), device=token_versions.device).expand_as(token_versions)
    turn_start = torch.where(generated & ~before, positions, 0).cummax(dim=1).values
    return generated & (token_versions != token_versions.gather(1, turn_start))


def behavior_mismatch_metrics(
    accelerator,
    current_logps: torch.Tensor,
    behavior_logps: torch.Tensor,
    mask: torch.Tensor,
    staleness: torch.Tensor,
    token_versions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``|logp_behavior - logp_trainer|`` over the tokens generated by the weights being trained (staleness 0):
    what the generator's numerics (vLLM's kernels, KV-cache decoding, another dtype) add to the importance ratio
    beyond staleness. ``a3po/behavior_mismatch_mean|max`` over every process (one sum-reduce, one max-reduce), empty
    NaN (no value) when no process has such tokens; it costs no forward (both log-probs are at hand).

    With ``token_versions`` (given with in-flight weight updates), the tokens sampled after a switch within their
    turn (:func:`sampled_after_a_switch`) are left out of it: their behavior log-prob comes from a KV cache that
    older weights computed, which the trainer's forward does not reproduce. They have their own
    ``a3po/behavior_mismatch_after_switch_mean|max`` (that mixed-cache gap plus the numerics), over the same
    reductions."""
    staleness = staleness if staleness.dim() == 2 else staleness.view(-1, 1)
    current = mask.bool() & (staleness == 0) & torch.isfinite(behavior_logps)
    after_switch = None if token_versions is None else sampled_after_a_switch(token_versions).to(current.device)
    difference = torch.where(current, (behavior_logps - current_logps.detach()).abs(), 0.0).float()
    groups = {"a3po/behavior_mismatch": current if after_switch is None else current & ~after_switch}
    if after_switch is not None:
        groups["a3po/behavior_mismatch_after_switch"] = current & after_switch
    local = torch.stack([value for tokens in groups.values() for value in _masked_sum_and_count(difference, tokens)])
    largest = torch.stack([torch.where(tokens, difference, 0.0).max() for tokens in groups.values()])
    totals = accelerator.reduce(local, reduction="sum")
    largest = accelerator.reduce(largest, reduction="max")
    values = {}
    for index, name in enumerate(groups):
        total, count, most = totals[2 * index], totals[2 * index + 1], largest[index]
        values[f"{name}_mean"] = nan_if_empty(total, count)
        values[f"{name}_max"] = torch.where(count > 0, most, torch.full_like(most, math.nan))
    return values


def _masked_sum_and_count(values: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.where(tokens, values, 0.0).sum(), tokens.sum().float()


def behavior_drift_metrics(
    accelerator, current_logps: torch.Tensor, behavior_logps: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the weights being trained have moved from the ones that generated the batch, on its tokens, over every
    process (one sum-reduce): ``a3po/behavior_drift_mean`` is the mean ``|log pi_theta - log pi_behav|`` (nats) over
    the loss tokens, and ``a3po/behavior_drift_per_version_mean`` the same divided by each token's staleness, over the
    stale tokens (``d >= 1``; NaN, no value, unless some process has some): how much one optimizer step moves the
    policy on the sampled tokens (0.05 is about 5%). That movement, times the staleness, is what the proximal policy
    and the behavior weight have to correct; with a small one every method trains alike. It costs no forward."""
    staleness = (staleness if staleness.dim() == 2 else staleness.view(-1, 1)).expand_as(current_logps)
    counted = mask.bool() & torch.isfinite(behavior_logps)
    drift = torch.where(counted, (current_logps.detach() - behavior_logps).abs(), 0.0)
    stale = counted & (staleness >= 1)
    per_version = torch.where(stale, drift / staleness.clamp(min=1).to(drift.dtype), 0.0)
    local = torch.stack([drift.sum(), counted.sum().float(), per_version.sum(), stale.sum().float()])
    totals = accelerator.reduce(local, reduction="sum")
    return {
        "a3po/behavior_drift_mean": nan_if_empty(totals[0], totals[1]),
        "a3po/behavior_drift_per_version_mean": nan_if_empty(totals[2], totals[3]),
    }


def approximation_error_metrics(
    accelerator,
    loglinear_logps: torch.Tensor,
    proximal_logps: torch.Tensor,
    behavior_logps: torch.Tensor,
    compared: torch.Tensor,
    anchor_age: torch.Tensor | None = None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Error of the log-linear estimate against the proximal log-probs ``proximal_logps``, over the ``compared``
    tokens of every process (one sum-reduce): ``a3po/{prefix}approx_{logp,rho}_{abs,rel}_error``
    (:func:`~a3po_trl.functional.proximal_approximation_error`), NaN (no value) when no process compared a token. With
    ``anchor_age`` (``(B,)``: versions between the weights ``proximal_logps`` were computed with and the weights being
    trained), also ``a3po/{prefix}age``, its mean over the compared tokens."""
    errors = proximal_approximation_error(loglinear_logps.detach(), proximal_logps, behavior_logps, compared)
    counted = compared & torch.isfinite(behavior_logps)
    count = counted.sum().float()
    values = [*(v * count for v in errors.values())]
    if anchor_age is not None:
        values.append((anchor_age.unsqueeze(1).to(counted.device) * counted).sum().float())
    totals = accelerator.reduce(torch.stack([*values, count]), reduction="sum")
    names = [f"a3po/{prefix}approx_{name}" for name in errors] + (
        [f"a3po/{prefix}age"] if anchor_age is not None else []
    )
    return dict(zip(names, nan_if_empty(totals[:-1], totals[-1]).unbind()))
