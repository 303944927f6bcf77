"""The trainer's loss: GRPOTrainer's ``_compute_loss``, step for step, with A-3PO's decoupled policy term, and the
one place the proximal method is decided (:data:`PROXIMAL_METHOD_TABLE`).

The pieces that are A-3PO's own are pure functions in :mod:`a3po_trl.functional`; what is GRPOTrainer's (the entropy
bonus and its adaptive controller, the high-entropy token mask, the off-policy sequence mask, the MoE auxiliary loss,
the reference KL) is applied as GRPOTrainer applies it, reusing its helpers and its state attributes, so that with
on-policy samples the loss, its gradient and its metrics are GRPOTrainer's.

The proximal log-probs of the methods that anchor at the current weights (``recompute``, ``metrics``) are those of
the weights the batch's first optimizer step trains. When no optimizer step falls between a batch's first micro-step
and its last (one optimizer step per generation batch, or several batches per step), those are the weights every
micro-step of the batch trains, and the training forward's own log-probs, detached, are the anchor: no other forward
runs. Otherwise (``steps_per_generation > gradient_accumulation_steps``, ``num_iterations > 1``) one no-grad forward
over the whole generation batch computes them at its first micro-step, before any of its optimizer steps
(:meth:`DecoupledLossMixin.attach_proximal_logps`), for all its micro-batches at once; a run resumed inside such a
batch takes them from the checkpoint instead (:mod:`a3po_trl.checkpoints.recomputed_anchor`).

Nothing here waits for the device at a micro-step: the metrics stay device tensors until ``log``
(:mod:`a3po_trl.metrics.deferred`), and the proximal log-probs are timed with CUDA events read at log time. The one
host read left is GRPOTrainer's adaptive entropy controller (``entropy_target`` set), once per optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .functional import (
    aggregate_loss,
    approximate_proximal_logps,
    decoupled_ppo_loss,
    kl_to_reference,
    token_staleness,
)
from .metrics.loss import approximation_error_metrics, behavior_drift_metrics, behavior_mismatch_metrics, loss_metrics
from .timeline import TRAINING_LANE
from .timing import IntervalTimer

#: Loss types whose scalar GRPOTrainer divides by the accumulation steps after computing it (its ``policy_loss`` is
#: logged before that division); the others are normalized by the generation batch's token count.
_PER_STEP_NORMALIZED = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")


@dataclass(frozen=True)
class ProximalMethod:
    """What one ``prox_logp_method`` computes."""

    anchor: str
    """The proximal log-probs the loss trains with: ``"loglinear"`` (A-3PO's interpolation between the behavior and
    the current log-probs), ``"current"`` (the log-probs of the weights of the batch's first optimizer step: the
    training forward's own where those weights train the micro-batch, else a recompute forward's) or ``"behavior"``
    (the behavior log-probs themselves: no proximal policy, no behavior weight)."""
    interpolates: bool
    """Whether the log-linear estimate is computed (trained with, or measured against the ``"current"`` anchor)."""


PROXIMAL_METHOD_TABLE = {
    "loglinear": ProximalMethod(anchor="loglinear", interpolates=True),
    "recompute": ProximalMethod(anchor="current", interpolates=False),
    "metrics": ProximalMethod(anchor="current", interpolates=True),
    "behavior": ProximalMethod(anchor="behavior", interpolates=False),
    # ``guarded`` is one of the two, batch by batch (``batch_method``): the interpolation is always computed, for
    # the checks
    "guarded-loglinear": ProximalMethod(anchor="loglinear", interpolates=True),
    "guarded-recompute": ProximalMethod(anchor="current", interpolates=True),
}
"""``prox_logp_method`` -> what it computes (one entry per option of :data:`a3po_trl.PROXIMAL_METHODS`; ``guarded``
through :func:`batch_method`)."""


def batch_method(prox_logp_method: str, batch: dict) -> str:
    """The entry of :data:`PROXIMAL_METHOD_TABLE` a micro-batch trains with: ``prox_logp_method``, except under
    ``guarded``, where the guard chose for its generation batch (``guard_recompute``, a host tensor)."""
    if prox_logp_method != "guarded":
        return prox_logp_method
    return "guarded-recompute" if bool(batch.get("guard_recompute", False)) else "guarded-loglinear"


def needs_recompute_forward(method: str, versions_training_batch: int) -> bool:
    """Whether ``method`` needs a no-grad forward when a batch is taken: it anchors at the weights of the batch's
    first optimizer step, and ``versions_training_batch`` (the number of weight versions its micro-steps train with,
    :attr:`PlannedBatch.span <a3po_trl.generation.schedule.PlannedBatch.span>`) says later micro-steps train newer
    weights, whose own forward is not that anchor."""
    return PROXIMAL_METHOD_TABLE[method].anchor == "current" and versions_training_batch > 1


class DecoupledLossMixin:
    """``compute_loss`` of :class:`~a3po_trl.AsyncA3POTrainer`, with the proximal log-probs a generation batch needs
    (:meth:`attach_proximal_logps`, run at its first micro-step), mixed into a GRPOTrainer subclass.

    What it reads of the trainer is GRPOTrainer's own state (``args``, ``state``, ``accelerator``, ``_metrics``, the
    loss settings it derives from the config, the entropy controller's attributes,
    ``_get_per_token_logps_and_entropies`` and the mask helpers) and its ``timeline``, plus what a batch carries
    (``behavior_logps``, ``token_versions``, ``versions_training_batch``, ``batch_index``, and where they apply
    ``sampling_logps``, ``ref_per_token_logps``) and the micro-batches of the generation batch being trained
    (GRPOTrainer's ``_buffered_inputs``), to which it adds ``recomputed_proximal_logps`` and ``recompute_version``.
    Its own state is the timer of the proximal log-probs (``a3po/prox_time``: the seconds since the last micro-step's
    metrics, device time on CUDA, read at log time).
    """

    @property
    def _proximal_timer(self) -> IntervalTimer:
        timer = self.__dict__.get("_proximal_timer_instance")
        if timer is None:
            timer = self.__dict__["_proximal_timer_instance"] = IntervalTimer()
        return timer

    def _attach_proximal_logps_if_due(self, inputs: dict) -> None:
        """At the first micro-step of a generation batch whose method anchors at the weights of its first optimizer
        step while later micro-steps train newer ones (:func:`needs_recompute_forward`): compute those log-probs for
        every micro-batch of the generation batch now, before any of its optimizer steps. Nothing otherwise, or when
        this micro-batch has them already (a later micro-step, or a later iteration over the batch)."""
        if "recomputed_proximal_logps" in inputs or "versions_training_batch" not in inputs:
            return
        buffered = getattr(self, "_buffered_inputs", None) or []
        micro_batches = buffered if any(batch is inputs for batch in buffered) else [inputs]
        self.attach_proximal_logps(micro_batches, int(inputs["batch_index"]), int(inputs["versions_training_batch"]))

    def attach_proximal_logps(self, micro_batches: list[dict], batch_index: int, versions_training_batch: int) -> None:
        """Add ``recomputed_proximal_logps`` (one no-grad forward of the current weights) and ``recompute_version``
        to each of ``micro_batches``, the generation batch ``batch_index``, if the method needs them
        (:func:`needs_recompute_forward`); otherwise nothing, and the loss anchors as the method says."""
        if not needs_recompute_forward(
            batch_method(self.args.prox_logp_method, micro_batches[0]), versions_training_batch
        ):
            return
        device = self.accelerator.device
        start = time.perf_counter()
        with self._proximal_timer.time(device):
            # the micro-batches were split from one padded batch: one call over their rows, in micro-batches
            input_ids = torch.cat([torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1) for b in micro_batches])
            attention_mask = torch.cat(
                [torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1) for b in micro_batches]
            )
            with torch.no_grad():
                logps = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    micro_batches[0]["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size,
                )[0]
        rows = [b["prompt_ids"].size(0) for b in micro_batches]
        for batch, batch_logps in zip(micro_batches, logps.split(rows)):
            batch["recomputed_proximal_logps"] = batch_logps
            batch["recompute_version"] = torch.full((batch_logps.size(0),), self.state.global_step, device=device)
        # on CUDA the host's span: the forward's launch, which ends before its kernels do (a3po/prox_time has the
        # device time); waiting for them here would stall the training thread
        self.timeline.record(TRAINING_LANE, "recompute forward", start, time.perf_counter(), {"batch": batch_index})

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The AsyncA3POTrainer does not support returning outputs")
        if "behavior_logps" not in inputs:  # evaluation batches come from GRPOTrainer's synchronous path
            return self._compute_loss(model, inputs)
        exact_logps = None
        if self.model.training:
            self._attach_proximal_logps_if_due(inputs)
            guard = getattr(self, "proximal_guard", None)
            if guard is not None:  # before the training forward: the reference's weights are exchanged in and out
                exact_logps = guard.reference(self, model, inputs)
        return self._compute_a3po_loss(model, inputs, exact_logps)

    def _proximal_logps(self, method: ProximalMethod, inputs, current_logps, staleness):
        """``(proximal, loglinear)`` log-probs as the method's table entry says: the A-3PO interpolation, the current
        weights' (the recomputed ones, or this forward's own, detached), both (``metrics``), or the behavior log-probs
        themselves (the ``behavior`` ablation). Only the interpolation is timed here (a recompute forward is timed
        where it runs, and reusing this forward's log-probs costs nothing)."""
        if method.anchor == "behavior":
            return inputs["behavior_logps"], None
        loglinear = None
        if method.interpolates:
            with self._proximal_timer.time(self.accelerator.device):
                loglinear = approximate_proximal_logps(inputs["behavior_logps"], current_logps, staleness)
        if method.anchor == "loglinear":
            return loglinear, loglinear
        recomputed = inputs.get("recomputed_proximal_logps")
        return (current_logps.detach() if recomputed is None else recomputed), loglinear

    def _compute_a3po_loss(self, model, inputs, exact_logps=None):
        args = self.args
        mode = "train" if self.model.training else "eval"
        train = mode == "train"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
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
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)

        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        behavior_logps = inputs["behavior_logps"]
        # The distribution the tokens were drawn from, where the sampler truncated or penalised the policy's: the
        # denominator of the behavior weight (the anchor stays the untruncated behavior policy).
        sampling_logps = inputs.get("sampling_logps", behavior_logps)
        staleness = token_staleness(self.state.global_step, inputs["token_versions"])
        method_name = batch_method(args.prox_logp_method, inputs)
        method = PROXIMAL_METHOD_TABLE[method_name]
        proximal_logps, loglinear_logps = self._proximal_logps(method, inputs, current_logps, staleness)
        if exact_logps is not None:  # a checked micro-batch of prox_logp_method="guarded"
            self.proximal_guard.add(loglinear_logps, current_logps, exact_logps, staleness, mask)
        # The ``behavior`` ablation has no behavior weight: rho = pi_prox / pi_sampling with pi_prox = pi_behav would
        # still carry the sampler's truncation, so the weight's denominator is the behavior policy too (rho = 1
        # exactly), and the loss is GRPOTrainer's with the generating weights as "old" policy.
        weight_denominator = behavior_logps if method.anchor == "behavior" else sampling_logps

        per_token_loss, stats = decoupled_ppo_loss(
            current_logps,
            proximal_logps,
            behavior_logps,
            advantages,
            mask,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            behavior_weight_cap=args.behavior_weight_cap,
            cap_mode=args.behavior_weight_cap_mode,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            delta=args.delta,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            sampling_logps=weight_denominator,
        )
        if self.off_policy_mask_threshold is not None:
            # The off-policy sequence mask compares the current policy with the distribution that sampled the tokens
            # (GRPOTrainer passes vLLM's sampling log-probs).
            sampled_from = torch.where(torch.isfinite(sampling_logps), sampling_logps, current_logps.detach())
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=current_logps,
                sampling_per_token_logps=sampled_from,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        per_token_kl = None
        if self.beta != 0.0:
            per_token_kl = kl_to_reference(current_logps, inputs["ref_per_token_logps"])
            if args.use_bias_correction_kl:
                # The reverse-KL gradient under samples from the behavior policy is weighted by pi_theta / pi_behav,
                # written r * rho so it carries the cap of the policy term: a token the cap drops gets no KL either.
                kept_weight = torch.where(stats["keep"], stats["behavior_weight"], 0.0)
                per_token_kl = per_token_kl * stats["importance_ratio"] * kept_weight
            per_token_loss = per_token_loss + self.beta * per_token_kl

        accumulation = self.current_gradient_accumulation_steps if train else 1
        loss = aggregate_loss(
            per_token_loss,
            mask,
            self.loss_type,
            gradient_accumulation_steps=accumulation,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs["num_items_in_batch"],
            num_processes=self.accelerator.num_processes,
            steps_per_generation=args.steps_per_generation if train else 1,
        )
        policy_loss = loss.detach() * (accumulation if self.loss_type in _PER_STEP_NORMALIZED else 1)
        if self._entropy_bonus_enabled:
            loss = self._add_entropy_bonus(loss, entropies, mask, entropy_mask, policy_loss, mode, accumulation)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean())

        self._log_loss_metrics(mode, mask, staleness, entropies, stats, per_token_kl)
        # with in-flight updates, the tokens sampled after a switch (over an older cache) are measured apart
        versions = inputs["token_versions"] if args.in_flight_weight_updates else None
        self._log(
            mode, behavior_mismatch_metrics(self.accelerator, current_logps, behavior_logps, mask, staleness, versions)
        )
        self._log(mode, behavior_drift_metrics(self.accelerator, current_logps, behavior_logps, mask, staleness))
        if args.prox_logp_method == "guarded" and train:
            guard_values = {"a3po/prox_recompute_fraction": float(method_name == "guarded-recompute")}
            self._log(mode, {**guard_values, "a3po/prox_check_time": self.proximal_guard.timer.take()})
        if args.prox_logp_method == "metrics":
            compared = mask.bool()
            if "recompute_version" in inputs:  # recomputed with the weights of the batch's first optimizer step only
                # against recompute's anchor at every micro-step, with how many versions the trained weights are
                # past it (0 on a batch's first step): where A-3PO's interpolation holds within a batch
                age = (self.state.global_step - inputs["recompute_version"]).float()
                self._log(
                    mode,
                    approximation_error_metrics(
                        self.accelerator, loglinear_logps, proximal_logps, sampling_logps, compared, age, "anchor_"
                    ),
                )
                compared = compared & (inputs["recompute_version"] == self.state.global_step).unsqueeze(1)
            errors = approximation_error_metrics(
                self.accelerator, loglinear_logps, proximal_logps, sampling_logps, compared
            )
            self._log(mode, errors)
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

    def _log_loss_metrics(self, mode, mask, staleness, entropies, stats, per_token_kl):
        values = loss_metrics(
            self.accelerator,
            mask,
            staleness,
            entropies,
            stats,
            per_token_kl,
            max_staleness=self.args.max_staleness,
            loss_type=self.loss_type,
        )
        values["a3po/prox_time"] = self._proximal_timer.take()
        self._log(mode, values)

    def _log(self, mode: str, values: dict) -> None:
        """Append ``values`` (floats, device tensors, deferred seconds) to ``_metrics``; ``log`` resolves them."""
        for name, value in values.items():
            self._metrics[mode][name].append(value.detach() if isinstance(value, torch.Tensor) else value)
