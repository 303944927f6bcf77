"""What the trainer logs when a scored batch enters it, reduced across processes in the main thread: GRPOTrainer's
completion and reward statistics, the generator's timings and queue state, and the tool calls. Every function takes
tensors and the accelerator and returns a plain ``{name: float}`` dictionary; the trainer appends them to its
``_metrics`` so that ``log`` averages them like GRPOTrainer's own."""

from __future__ import annotations

import torch
from trl.trainer.utils import nanstd

from ..types import ToolStats


def batch_metrics(
    accelerator,
    scored,
    *,
    completion_lengths: torch.Tensor,
    prompt_lengths: torch.Tensor,
    is_truncated: torch.Tensor,
    rewards_per_func: torch.Tensor,
    is_std_zero: torch.Tensor,
    waited: float,
    queue_depth: int,
    reward_weights: torch.Tensor,
    reward_func_names: list[str],
    in_flight: bool,
) -> tuple[dict[str, float], int]:
    """GRPOTrainer's metrics of one generation batch plus the generator's timings.

    ``completion_lengths``, ``prompt_lengths`` and ``is_truncated`` are this process's ``(B,)`` tensors;
    ``rewards_per_func`` ``(B_total, F)`` and ``is_std_zero`` ``(B_total,)`` are already gathered; ``in_flight``:
    whether versions are loaded between decode steps (``in_flight_weight_updates``), the only runs that log
    ``async/in_flight_weight_load_time`` and ``async/in_flight_weight_loads``. Returns ``(metrics, tokens_seen)``:
    the prompt and completion tokens of the batch over all processes.
    """
    values: dict[str, float] = {}
    lengths = accelerator.gather(completion_lengths).float()
    truncated = accelerator.gather(is_truncated)
    prompt_tokens = accelerator.gather(prompt_lengths).sum()
    values["completions/mean_length"] = lengths.mean().item()
    values["completions/min_length"] = lengths.min().item()
    values["completions/max_length"] = lengths.max().item()
    values["completions/clipped_ratio"] = truncated.float().mean().item()
    terminated = lengths[~truncated.bool()]
    if terminated.numel() == 0:
        terminated = torch.zeros(1, device=lengths.device)
    values["completions/mean_terminated_length"] = terminated.mean().item()
    values["completions/min_terminated_length"] = terminated.min().item()
    values["completions/max_terminated_length"] = terminated.max().item()

    for i, name in enumerate(reward_func_names):
        values[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        values[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    values["reward"] = torch.nanmean(rewards).item()
    values["reward_std"] = nanstd(rewards).item()
    values["frac_reward_zero_std"] = is_std_zero.float().mean().item()

    timings = scored.timings
    local = torch.tensor(
        [
            timings.get("generation", 0.0),
            timings.get("behavior_logps", 0.0),
            timings.get("rewards", 0.0),
            timings.get("generator_wait_for_staleness_bound", 0.0),
            timings.get("weight_load", 0.0),
            timings.get("in_flight_weight_load", 0.0),
            timings.get("in_flight_weight_loads", 0.0),
            waited,
            float(queue_depth),
            float(scored.version),
        ],
        device=accelerator.device,
    )
    mean = accelerator.reduce(local, reduction="mean").tolist()
    names = (
        "async/generation_time",
        "async/behavior_logps_time",
        "async/reward_time",
        "async/generator_wait_time",
        "async/weight_load_time",
        "async/in_flight_weight_load_time",
        "async/in_flight_weight_loads",
        "async/trainer_wait_time",
        "async/queue_depth",
        "async/generator_version",
    )
    values.update(zip(names, mean))
    if not in_flight:  # no loads between decode steps: both would read 0 at every step
        del values["async/in_flight_weight_load_time"], values["async/in_flight_weight_loads"]
    if mean[0] > 0:
        # completion tokens of all processes over the (mean) time one process took to generate its share
        values["async/completion_tokens_per_second"] = lengths.sum().item() / mean[0]
    return values, int((prompt_tokens + lengths.sum()).item())


def completions_can_span_versions(args, multi_turn: bool) -> bool:
    """Whether the tokens of one completion can come from more than one weight version, so that
    :func:`version_metrics` is logged: with ``in_flight_weight_updates`` (a version loaded between decode steps), or
    in multi-turn rollouts (``multi_turn``: ``tools`` or ``environment_factory``) that load the newest weights between
    turns (``refresh_weights_between_turns``, which ``reproducible_generation`` turns off). Otherwise one version
    generates every token of a completion (a ``rollout_func``'s too: the backend keeps the batch's version through
    the call) and the metrics would read 0 and 1 at every step."""
    if args.in_flight_weight_updates:
        return True
    return multi_turn and args.refresh_weights_between_turns and not args.reproducible_generation


def version_metrics(accelerator, versions: torch.Tensor) -> dict[str, float]:
    """How many weight versions the completions of one generation batch span, over every process (one sum-reduce
    and one gather), from the ``(B, T)`` version of each token (negative for tokens no model generated: tool
    results, padding). ``a3po/multi_version_trajectories_frac``: the fraction of completions whose generated tokens
    come from more than one version (turns generated across an update, or in-flight weight updates);
    ``a3po/completion_versions_mean|max``: distinct versions per completion (over completions with a generated
    token)."""
    ordered = versions.sort(dim=1).values
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    distinct = (starts & (ordered >= 0)).sum(dim=1)
    local = torch.stack(
        [
            torch.tensor(versions.size(0), device=versions.device),
            (distinct > 0).sum(),
            distinct.sum(),
            (distinct > 1).sum(),
        ]
    ).float()
    rows, rows_generated, version_sum, mixed = accelerator.reduce(local, reduction="sum").tolist()
    most = accelerator.gather(distinct.max().view(1).float())
    return {
        "a3po/multi_version_trajectories_frac": mixed / max(rows, 1.0),
        "a3po/completion_versions_mean": version_sum / max(rows_generated, 1.0),
        "a3po/completion_versions_max": most.max().item(),
    }


def tool_metrics(accelerator, stats: ToolStats | None, completion_lengths: torch.Tensor) -> dict:
    """Multi-turn statistics of one generation batch over every process (one sum-reduce and one gather), from the
    tool-call loop's ``stats``. Empty for batches without tools.

    GRPOTrainer's ``tools/call_frequency`` (tool calls per trajectory) and ``tools/failure_frequency`` (failed calls
    per call), and: ``tools/timeout_frequency`` (calls past ``tool_call_timeout`` per call), ``tools/turns_mean|max``
    (model turns per trajectory), ``tools/generated_tokens_mean`` and ``tools/tool_result_tokens_mean`` (per
    trajectory). How many versions a trajectory's tokens span is :func:`version_metrics`'.
    """
    if stats is None:
        return {}
    device = completion_lengths.device
    turns, tool_lengths = stats.turns.to(device), stats.tool_result_lengths.to(device)
    local = torch.stack(
        [
            torch.tensor(stats.calls, device=device),
            torch.tensor(stats.failures, device=device),
            torch.tensor(stats.timeouts, device=device),
            torch.tensor(turns.numel(), device=device),
            turns.sum(),
            completion_lengths.sum(),
            tool_lengths.sum(),
        ]
    ).float()
    calls, failures, timeouts, rows, turn_sum, generated_sum, tool_sum = accelerator.reduce(
        local, reduction="sum"
    ).tolist()
    most_turns = accelerator.gather(turns.max().view(1).float()).max().item()
    rows = max(rows, 1.0)
    return {
        "tools/call_frequency": calls / rows,
        "tools/failure_frequency": failures / calls if calls > 0 else 0.0,
        "tools/timeout_frequency": timeouts / calls if calls > 0 else 0.0,
        "tools/turns_mean": turn_sum / rows,
        "tools/turns_max": most_turns,
        "tools/generated_tokens_mean": generated_sum / rows,
        "tools/tool_result_tokens_mean": tool_sum / rows,
    }


def dynamic_sampling_metrics(accelerator, stats: dict[str, float], optimizer_steps_per_batch: float) -> dict:
    """What filling one training batch took with dynamic sampling, over every process (one gather): the groups the
    filter dropped (``a3po/dynamic_sampling_filtered_groups``, summed), the generation batches drawn beyond the first
    (``a3po/dynamic_sampling_extra_batches``, mean per process), 1 where a process reached the bound
    (``a3po/dynamic_sampling_bound_reached``, the largest) and the prompts drawn over every process per optimizer
    step that trains on the batch (``a3po/dynamic_sampling_prompts_per_step``)."""
    local = torch.tensor(
        [stats["filtered_groups"], stats["draws"] - 1.0, stats["bound_reached"], stats["prompts_drawn"]],
        dtype=torch.float32,
        device=accelerator.device,
    )
    everyone = accelerator.gather(local.view(1, -1)).view(-1, 4)
    return {
        "a3po/dynamic_sampling_filtered_groups": everyone[:, 0].sum().item(),
        "a3po/dynamic_sampling_extra_batches": everyone[:, 1].mean().item(),
        "a3po/dynamic_sampling_bound_reached": everyone[:, 2].max().item(),
        "a3po/dynamic_sampling_prompts_per_step": everyone[:, 3].sum().item() / optimizer_steps_per_batch,
    }
