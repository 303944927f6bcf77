"""The main thread's half of the batch path: a scored batch from the generation thread becomes a training batch.

What the generation thread cannot do is done here, once per generation batch, when the trainer takes it: everything
that needs every process (the rewards of reward models partitioned by ZeRO-3 or sharded by FSDP2, the group advantages
over every process's rewards, the generation batch's token count) or the training weights (the reference log-probs).
The proximal log-probs of a recompute forward are left to the trainer's anchor, which computes them at the generation
batch's first micro-step (:mod:`a3po_trl.proximal`, which owns the method): this file only tags the batch with what it
needs to decide (``versions_training_batch``, ``batch_index``). :func:`make_training_batch` runs the stages in order,
each a function of its own:

1. :func:`on_device`: the batch's tensors on the training device;
2. :func:`score_deferred_rewards`: the reward models left to the main thread;
3. :func:`advantages_over_processes`: GRPOTrainer's group advantages from every process's rewards, this process's rows;
4. :func:`count_loss_tokens`: the generation batch's loss tokens over every process (``num_items_in_batch``);
5. the batch's schedule tags, for the proximal log-probs, and the anchor's batch begun (with
   ``prox_logp_method="guarded"``, the guard settles its check and chooses the batch's anchor:
   :mod:`a3po_trl.proximal.guard`);
6. :func:`reference_logps`: the reference model's log-probs (``beta != 0``);
7. :func:`log_batch`: GRPOTrainer's batch metrics, the generator's timings, the completions table (with dynamic
   sampling, what filling the batch took: :func:`~a3po_trl.metrics.batch.dynamic_sampling_metrics`).

The collectives run in the same order on every process.
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object
from trl.trainer.utils import use_adapter

from .builders import deferred_reward_columns
from .functional import group_advantages
from .generation.schedule import PlannedBatch
from .metrics.batch import (
    batch_metrics,
    completions_can_span_versions,
    dynamic_sampling_metrics,
    tool_metrics,
    version_metrics,
)
from .rollout.scoring import score_with_reward_model, warn_about_unscorable_rows
from .timeline import TRAINING_LANE
from .types import ScoredBatch


def make_training_batch(
    trainer, scored: ScoredBatch, waited: float, planned: PlannedBatch, weight_sync_seconds: float
) -> dict:
    """The training batch of ``scored`` (this process's rows), as ``_prepare_inputs`` buffers and splits it:
    ``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask``, ``behavior_logps``,
    ``token_versions``, ``advantages``, ``num_items_in_batch``, ``versions_training_batch`` and ``batch_index`` (0-dim:
    copied into every micro-batch), and where they apply ``sampling_logps``, ``tool_mask``, ``ref_per_token_logps``.

    ``waited``: the seconds the trainer waited for it; ``planned``: the micro-steps and versions that train on it (the
    batch schedule); ``weight_sync_seconds``: the seconds spent publishing weights since the last batch (logged)."""
    data, is_truncated, completion_lengths = on_device(scored, trainer.accelerator.device)
    rewards_per_func = trainer.accelerator.gather(score_deferred_rewards(trainer, scored))
    local_rows = data["completion_ids"].size(0)
    data["advantages"], advantages, is_std_zero = advantages_over_processes(trainer, rewards_per_func, local_rows)
    loss_mask = data["completion_mask"] * data["tool_mask"] if "tool_mask" in data else data["completion_mask"]
    data["num_items_in_batch"] = count_loss_tokens(trainer, loss_mask)
    agent_values = tool_metrics(trainer.accelerator, scored.tool_stats, completion_lengths)
    multi_turn = bool(trainer.tools) or getattr(trainer, "environment_factories", None) is not None
    if completions_can_span_versions(trainer.args, multi_turn):
        agent_values.update(version_metrics(trainer.accelerator, data["token_versions"]))
    if scored.environments is not None:
        trainer.environments = scored.environments  # GRPOTrainer's attribute: the latest batch's environments

    # what the loss's anchor needs to know to recompute the proximal log-probs at the batch's first micro-step (over
    # the whole batch: a run that ends inside it keeps the anchor for a continuation); on the host, so that reading
    # them at every micro-step never waits for the GPU
    data["versions_training_batch"] = torch.tensor(planned.whole_span)
    data["batch_index"] = torch.tensor(scored.index)
    anchor_metrics = trainer.proximal_anchor.begin_batch(planned, trainer.accelerator)  # "guarded": settle, choose
    if trainer.beta != 0.0:
        input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
        attention_mask = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1)
        logits_to_keep = data["completion_ids"].size(1)
        with trainer.timeline.span(TRAINING_LANE, "reference forward", batch=scored.index):
            data["ref_per_token_logps"] = reference_logps(trainer, input_ids, attention_mask, logits_to_keep)

    values = {**agent_values, **anchor_metrics, "async/weight_sync_time": weight_sync_seconds}
    if trainer.args.dynamic_sampling:
        args = trainer.args
        steps = args.steps_per_generation * trainer.num_iterations / args.gradient_accumulation_steps
        values.update(dynamic_sampling_metrics(trainer.accelerator, scored.sampling_stats, steps))
    log_batch(trainer, scored, waited, data, is_truncated, completion_lengths, rewards_per_func, is_std_zero, values)
    log_reward_function_outputs(trainer, scored, rewards_per_func, advantages)
    return data


def on_device(scored: ScoredBatch, device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """``(tensors, is_truncated, completion_lengths)`` of the batch on ``device``."""
    data = {k: v.to(device) for k, v in scored.tensors.items()}
    return data, scored.is_truncated.to(device), scored.completion_lengths.to(device)


def score_deferred_rewards(trainer, scored: ScoredBatch) -> torch.Tensor:
    """This process's ``(B, F)`` rewards, with the columns of the reward models whose forward is a collective
    (partitioned by ZeRO-3, sharded by FSDP2) scored here, in the main thread, on every process together; rows no
    function could score are reported."""
    device = trainer.accelerator.device
    prompts, completions = scored.texts["prompt"], scored.texts["completion"]
    rewards = scored.rewards_per_func.to(device)
    for i in deferred_reward_columns(trainer):
        values = score_with_reward_model(
            trainer.reward_funcs[i],
            trainer.reward_processing_classes[i],
            prompts,
            completions,
            trainer.chat_template_kwargs,
        )
        rewards[:, i] = torch.tensor(values, dtype=torch.float32, device=device)
    warn_about_unscorable_rows(rewards, scored.rows, prompts, completions)
    return rewards


def advantages_over_processes(trainer, rewards_per_func: torch.Tensor, local_rows: int):
    """``(this process's advantages, every process's advantages, is_std_zero)`` from the gathered ``(B_total, F)``
    rewards, as GRPOTrainer computes them (groups are whole on each process: every process generates its own);
    this process's are its ``local_rows`` rows."""
    advantages, _, is_std_zero = group_advantages(
        rewards_per_func,
        trainer.reward_weights,
        trainer.num_generations,
        trainer.scale_rewards,
        trainer.multi_objective_aggregation,
    )
    index = trainer.accelerator.process_index
    return advantages[index * local_rows : (index + 1) * local_rows], advantages, is_std_zero


def count_loss_tokens(trainer, loss_mask: torch.Tensor) -> torch.Tensor:
    """The generation batch's loss tokens over every process (0-dim): what ``dapo``-style losses divide by."""
    return trainer.accelerator.gather(loss_mask.sum()).sum()


@torch.no_grad()
def reference_logps(trainer, input_ids, attention_mask, logits_to_keep) -> torch.Tensor:
    """The reference policy's log-probs of the completions: the reference model's, or under PEFT the policy's with
    the adapter disabled (TRL's ``ref`` adapter when it has one)."""
    batch_size = trainer.args.per_device_train_batch_size
    if trainer.ref_model is not None:
        return trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]
    model = trainer.accelerator.unwrap_model(trainer.model)
    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
        return trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]


def log_batch(
    trainer, scored, waited, data, is_truncated, completion_lengths, rewards_per_func, is_std_zero, values
) -> None:
    """GRPOTrainer's metrics of the batch, the generator's timings and queue state, and ``values``, appended to the
    trainer's ``_metrics`` (averaged by ``log`` like GRPOTrainer's own); the tokens seen are counted."""
    batch_values, tokens_seen = batch_metrics(
        trainer.accelerator,
        scored,
        completion_lengths=completion_lengths,
        prompt_lengths=data["prompt_mask"].sum(1),
        is_truncated=is_truncated,
        rewards_per_func=rewards_per_func,
        is_std_zero=is_std_zero,
        waited=waited,
        queue_depth=len(trainer._producer.queue),
        reward_weights=trainer.reward_weights,
        reward_func_names=trainer.reward_func_names,
        in_flight=trainer.args.in_flight_weight_updates,
    )
    trainer.state.num_input_tokens_seen += tokens_seen
    metrics = trainer._metrics["train"]
    metrics["num_tokens"] = [trainer.state.num_input_tokens_seen]
    for name, value in {**batch_values, **values}.items():
        metrics[name].append(value)


def log_reward_function_outputs(trainer, scored: ScoredBatch, rewards_per_func, advantages) -> None:
    """GRPOTrainer's completion table and what reward functions logged, gathered over processes in the same
    (sorted) order on every process."""
    prompts, completions = scored.texts["prompt"], scored.texts["completion"]
    logs = trainer._logs
    logs["prompt"].extend(gather_object(prompts))
    logs["completion"].extend(gather_object(completions))
    for i, name in enumerate(trainer.reward_func_names):
        logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
    logs["advantages"].extend(advantages.tolist())
    for column in sorted(set(gather_object(list(scored.extra_logs)))):
        values = scored.extra_logs.get(column, [None] * len(prompts))
        logs["extra"][column].extend(gather_object(values))
    for name in sorted(set(gather_object(list(scored.logged_metrics)))):
        values = scored.logged_metrics.get(name, [])
        local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=trainer.accelerator.device)
        total, count = trainer.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
        trainer._metrics["train"][name].append(total / count)
