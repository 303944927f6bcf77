"""What the trainer logs, reduced across processes in the main thread (few collectives, one per group of values).

Two moments produce metrics: when a scored batch enters the trainer (rewards, lengths, generation timings, queue
state) and when a micro-batch enters the loss (staleness, behavior weights, clipping, entropy). Both functions return
plain ``{name: float}`` dictionaries; the trainer appends them to its ``_metrics`` so that ``log`` averages them like
GRPOTrainer's own metrics and every ``report_to`` backend sees them.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanstd


def _nanstd(values: torch.Tensor) -> torch.Tensor:
    return nanstd(values) if values.numel() > 1 else torch.zeros((), device=values.device)


def batch_metrics(
    accelerator,
    scored,
    data: dict,
    *,
    waited: float,
    is_truncated: torch.Tensor,
    is_std_zero: torch.Tensor,
    queue_depth: int,
    reward_weights: torch.Tensor,
    reward_func_names: list[str],
    pad_token_id: int,
) -> tuple[dict[str, float], int, torch.Tensor]:
    """Metrics of one scored batch: TRL's reward and completion statistics plus the generator's timings.

    Returns ``(metrics, tokens_seen, rewards_per_func)``: the prompt and completion tokens of the batch over all
    processes (for ``state.num_input_tokens_seen``) and the gathered ``(B_total, F)`` rewards.
    """
    device = accelerator.device
    values: dict[str, float] = {}
    lengths = data["completion_mask"].sum(1).float()
    raw_lengths = (data["completion_ids"] != pad_token_id).sum(1).float()
    lengths = accelerator.gather(torch.maximum(lengths, raw_lengths))  # masked-out truncations still count
    truncated = accelerator.gather(is_truncated.float())
    prompt_tokens = accelerator.gather(data["prompt_mask"].sum()).sum()
    values["completions/mean_length"] = lengths.mean().item()
    values["completions/min_length"] = lengths.min().item()
    values["completions/max_length"] = lengths.max().item()
    values["completions/clipped_ratio"] = truncated.mean().item()

    rewards_per_func = accelerator.gather(scored.rewards_per_func.to(device))
    for i, name in enumerate(reward_func_names):
        values[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        values[f"rewards/{name}/std"] = _nanstd(rewards_per_func[:, i]).item()
    rewards = (rewards_per_func * reward_weights.to(device)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    values["reward"] = torch.nanmean(rewards).item()
    values["reward_std"] = _nanstd(rewards).item()
    values["frac_reward_zero_std"] = accelerator.gather(is_std_zero.float()).mean().item()

    timings = scored.timings
    local = torch.tensor(
        [
            timings.get("generation", 0.0),
            timings.get("behavior_logps", 0.0),
            timings.get("rewards", 0.0),
            timings.get("generator_wait_for_staleness_bound", 0.0),
            waited,
            float(queue_depth),
            float(scored.version),
        ],
        device=device,
    )
    mean = accelerator.reduce(local, reduction="mean").tolist()
    names = (
        "async/generation_time",
        "async/behavior_logps_time",
        "async/reward_time",
        "async/generator_wait_time",
        "async/trainer_wait_time",
        "async/queue_depth",
        "async/generator_version",
    )
    values.update(zip(names, mean))
    if mean[0] > 0:
        # completion tokens of all processes over the (mean) time one process took to generate its share
        values["async/completion_tokens_per_second"] = lengths.sum().item() / mean[0]
    return values, int((prompt_tokens + lengths.sum()).item()), rewards_per_func


def loss_metrics(
    accelerator,
    mask: torch.Tensor,
    staleness: torch.Tensor,
    entropies: torch.Tensor,
    stats: dict[str, torch.Tensor],
    per_token_kl: torch.Tensor | None,
    max_staleness: int,
) -> dict[str, float]:
    """Token-weighted statistics of one micro-batch's loss, over every process: one sum-reduce, one max-gather.

    Staleness (mean, max, and the fraction of tokens at each staleness ``0..max_staleness``), the behavior-policy
    weight ``w``, the behavior importance weight ``rho`` (mean, max, fraction dropped by the cap), PPO clip
    fractions, entropy, non-finite behavior log-probs, and the KL to the reference when there is one.
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
    histogram = [((staleness_tok == d) & mask_b).float().sum() for d in range(max_staleness + 1)]
    kl_sum = (per_token_kl.detach() * mask_f).sum() if per_token_kl is not None else count.new_zeros(())
    sums = torch.stack(
        [
            count,
            (staleness_tok * mask_f).sum(),
            (weight * mask_f).sum(),
            (rho * mask_f).sum(),
            (mask_b & ~stats["keep"]).float().sum(),
            stats["is_low_clipped"].float().sum(),
            stats["is_high_clipped"].float().sum(),
            (entropies.detach() * mask_f).sum(),
            stats["nonfinite_behavior"].float().sum(),
            kl_sum,
            *histogram,
        ]
    )
    zeros = torch.zeros_like(staleness_tok)
    maxima = torch.stack([torch.where(mask_b, staleness_tok, zeros).max(), torch.where(mask_b, rho, zeros).max()])
    sums = accelerator.reduce(sums, reduction="sum")
    maxima = accelerator.gather(maxima.unsqueeze(0)).max(dim=0).values
    total = sums[0].clamp(min=1.0)
    values = {
        "a3po/staleness_mean": (sums[1] / total).item(),
        "a3po/staleness_max": maxima[0].item(),
        **{f"a3po/staleness_frac_{d}": (sums[10 + d] / total).item() for d in range(max_staleness + 1)},
        "a3po/behavior_policy_weight_mean": (sums[2] / total).item(),
        "a3po/importance_weight_mean": (sums[3] / total).item(),
        "a3po/importance_weight_max": maxima[1].item(),
        "a3po/importance_weight_masked_frac": (sums[4] / total).item(),
        "clip_ratio/low_mean": (sums[5] / total).item(),
        "clip_ratio/high_mean": (sums[6] / total).item(),
        "clip_ratio/region_mean": ((sums[5] + sums[6]) / total).item(),
        "entropy": (sums[7] / total).item(),
        "a3po/nonfinite_behavior_tokens": sums[8].item(),
    }
    if per_token_kl is not None:
        values["kl"] = (sums[9] / total).item()
    return values
