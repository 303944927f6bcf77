"""The trainer's loss: GRPOTrainer's ``_compute_loss``, step for step, with A-3PO's decoupled policy term.

The pieces that are A-3PO's own are pure functions in :mod:`a3po_trl.functional`, and the proximal log-probs come
from one object, the trainer's :class:`~a3po_trl.proximal.ProximalAnchor`; what is GRPOTrainer's (the entropy bonus
and its adaptive controller, the high-entropy token mask, the off-policy sequence mask, the MoE auxiliary loss, the
reference KL) is applied as GRPOTrainer applies it, reusing its helpers and its state attributes, so that with
on-policy samples the loss, its gradient and its metrics are GRPOTrainer's. Nothing here waits for the device at a
micro-step (docs/ARCHITECTURE.md, "The loss").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .functional import aggregate_loss, decoupled_ppo_loss, kl_to_reference, token_staleness
from .metrics.loss import behavior_drift_metrics, behavior_mismatch_metrics, loss_metrics

#: Loss types whose scalar GRPOTrainer divides by the accumulation steps after computing it (its ``policy_loss`` is
#: logged before that division); the others are normalized by the generation batch's token count.
_PER_STEP_NORMALIZED = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings, read once from the trainer (GRPOTrainer's derived attributes and the config)."""

    loss_type: str
    importance_sampling_level: str
    epsilon_low: float
    epsilon_high: float
    behavior_weight_cap: float | None
    cap_mode: str
    delta: float | None
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    beta: float
    use_bias_correction_kl: bool
    off_policy_mask_threshold: float | None
    top_entropy_quantile: float
    max_completion_length: int
    steps_per_generation: int
    max_staleness: int
    in_flight_weight_updates: bool

    @classmethod
    def of(cls, trainer) -> LossSettings:
        args = trainer.args
        return cls(
            loss_type=trainer.loss_type,
            importance_sampling_level=trainer.importance_sampling_level,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            behavior_weight_cap=args.behavior_weight_cap,
            cap_mode=args.behavior_weight_cap_mode,
            delta=args.delta,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            beta=trainer.beta,
            use_bias_correction_kl=args.use_bias_correction_kl,
            off_policy_mask_threshold=trainer.off_policy_mask_threshold,
            top_entropy_quantile=trainer.top_entropy_quantile,
            max_completion_length=trainer.max_completion_length,
            steps_per_generation=args.steps_per_generation,
            max_staleness=args.max_staleness,
            in_flight_weight_updates=args.in_flight_weight_updates,
        )

    def policy_loss_options(self) -> dict:
        """The keyword arguments of :func:`~a3po_trl.functional.decoupled_ppo_loss`."""
        names = (
            "epsilon_low",
            "epsilon_high",
            "behavior_weight_cap",
            "cap_mode",
            "loss_type",
            "importance_sampling_level",
            "delta",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "vespo_k_pos",
            "vespo_lambda_pos",
            "vespo_k_neg",
            "vespo_lambda_neg",
        )
        return {name: getattr(self, name) for name in names}


class DecoupledLossMixin:
    """``compute_loss`` of :class:`~a3po_trl.AsyncA3POTrainer`, mixed into a GRPOTrainer subclass.

    It reads GRPOTrainer's state (``state``, ``accelerator``, ``_metrics``, the entropy controller's attributes,
    ``_get_per_token_logps_and_entropies`` and the mask helpers), the trainer's :attr:`loss_settings`
    (:class:`LossSettings`) and :attr:`proximal_anchor`, and what a batch carries (``behavior_logps``,
    ``token_versions``, ``advantages``, ``num_items_in_batch``, and where they apply ``sampling_logps``,
    ``tool_mask``, ``ref_per_token_logps``).
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The AsyncA3POTrainer does not support returning outputs")
        if "behavior_logps" not in inputs:  # evaluation batches come from GRPOTrainer's synchronous path
            return self._compute_loss(model, inputs)
        exact_logps = None
        if self.model.training:  # before the training forward: the anchor's own forwards
            exact_logps = self.proximal_anchor.prepare(self, model, inputs)
        return self._compute_a3po_loss(model, inputs, exact_logps)

    def _compute_a3po_loss(self, model, inputs, exact_logps=None):
        settings = self.loss_settings
        train = self.model.training
        mode = "train" if train else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        # Tool-result tokens (multi-turn) are attended to but are not the model's: they never enter the loss.
        mask = completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask
        current_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
        )
        entropy_mask = None
        if settings.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - settings.top_entropy_quantile)

        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        behavior_logps = inputs["behavior_logps"]
        # The distribution the tokens were drawn from, where the sampler truncated or penalised the policy's: the
        # denominator of the behavior weight (the anchor stays the untruncated behavior policy).
        sampling_logps = inputs.get("sampling_logps", behavior_logps)
        staleness = token_staleness(self.state.global_step, inputs["token_versions"])
        device = self.accelerator.device
        anchor = self.proximal_anchor.of(inputs, current_logps, staleness, mask, device, exact_logps)
        # The ``behavior`` ablation has no behavior weight: rho = pi_prox / pi_sampling with pi_prox = pi_behav would
        # still carry the sampler's truncation, so the weight's denominator is the behavior policy too (rho = 1
        # exactly), and the loss is GRPOTrainer's with the generating weights as "old" policy.
        weight_denominator = behavior_logps if self.proximal_anchor.entry.anchor == "behavior" else sampling_logps
        per_token_loss, stats = decoupled_ppo_loss(
            current_logps,
            anchor.proximal,
            behavior_logps,
            advantages,
            mask,
            sampling_logps=weight_denominator,
            **settings.policy_loss_options(),
        )
        if settings.off_policy_mask_threshold is not None:
            # The off-policy sequence mask compares the current policy with the distribution that sampled the tokens
            # (GRPOTrainer passes vLLM's sampling log-probs).
            sampled_from = torch.where(torch.isfinite(sampling_logps), sampling_logps, current_logps.detach())
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=current_logps,
                sampling_per_token_logps=sampled_from,
                mask=mask,
                off_policy_threshold=settings.off_policy_mask_threshold,
            )
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        per_token_kl = None
        if settings.beta != 0.0:
            per_token_kl = kl_to_reference(current_logps, inputs["ref_per_token_logps"])
            if settings.use_bias_correction_kl:
                # The reverse-KL gradient under samples from the behavior policy is weighted by pi_theta / pi_behav,
                # written r * rho so it carries the cap of the policy term: a token the cap drops gets no KL either.
                kept_weight = torch.where(stats["keep"], stats["behavior_weight"], 0.0)
                per_token_kl = per_token_kl * stats["importance_ratio"] * kept_weight
            per_token_loss = per_token_loss + settings.beta * per_token_kl

        accumulation = self.current_gradient_accumulation_steps if train else 1
        loss = aggregate_loss(
            per_token_loss,
            mask,
            settings.loss_type,
            gradient_accumulation_steps=accumulation,
            max_completion_length=settings.max_completion_length,
            num_items_in_batch=inputs["num_items_in_batch"],
            num_processes=self.accelerator.num_processes,
            steps_per_generation=settings.steps_per_generation if train else 1,
        )
        policy_loss = loss.detach() * (accumulation if settings.loss_type in _PER_STEP_NORMALIZED else 1)
        if self._entropy_bonus_enabled:
            loss = self._add_entropy_bonus(loss, entropies, mask, entropy_mask, policy_loss, mode, accumulation)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean())
        self._record_loss_metrics(
            mode, inputs, mask, staleness, entropies, stats, per_token_kl, current_logps, anchor, sampling_logps
        )
        return loss

    def _add_entropy_bonus(self, loss, entropies, mask, entropy_mask, policy_loss, mode, accumulation):
        """GRPOTrainer's entropy bonus ``loss - coef * H`` (``H`` the mean entropy of the tokens the loss acts on),
        with its adaptive controller, on the same state attributes so that checkpoints save and restore it."""
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            apply_coef = self.entropy_coef
        loss = loss - apply_coef * entropy_loss
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean())
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            window = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            self._entropy_window_stats = window
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(window, reduction="sum")
                # the controller decides on the host: the one read of the device per optimizer step (opt-in)
                world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
                delta = self.args.entropy_coef_delta
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + delta, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - delta, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

    def _record_loss_metrics(
        self, mode, inputs, mask, staleness, entropies, stats, per_token_kl, current_logps, anchor, sampling_logps
    ) -> None:
        """The micro-batch's metrics: GRPOTrainer's and A-3PO's of the loss, the drift from the behavior policy, the
        generator's mismatch, and what the anchor cost and measured."""
        settings, accelerator, behavior_logps = self.loss_settings, self.accelerator, inputs["behavior_logps"]
        values = loss_metrics(
            accelerator,
            mask,
            staleness,
            entropies,
            stats,
            per_token_kl,
            max_staleness=settings.max_staleness,
            loss_type=settings.loss_type,
        )
        values["a3po/prox_time"] = self.proximal_anchor.timer.take()
        self._log(mode, values)
        # with in-flight updates, the tokens sampled after a switch (over an older cache) are measured apart
        versions = inputs["token_versions"] if settings.in_flight_weight_updates else None
        behavior = (accelerator, current_logps, behavior_logps, mask, staleness)
        self._log(mode, behavior_mismatch_metrics(*behavior, versions))
        self._log(mode, behavior_drift_metrics(*behavior))
        step, train = self.state.global_step, mode == "train"
        self._log(mode, self.proximal_anchor.metrics(accelerator, inputs, anchor, sampling_logps, mask, step, train))

    def _log(self, mode: str, values: dict) -> None:
        """Append ``values`` (floats, device tensors, deferred seconds) to ``_metrics``; ``log`` resolves them."""
        for name, value in values.items():
            self._metrics[mode][name].append(value.detach() if isinstance(value, torch.Tensor) else value)
