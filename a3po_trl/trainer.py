"""`AsyncA3POTrainer`: TRL's GRPOTrainer with a background generator and A-3PO's decoupled loss.

What changes relative to `GRPOTrainer`, and where:

- ``_prepare_inputs`` takes scored, versioned batches from the :class:`~a3po_trl.generation.GenerationEngine`
  instead of generating with the training module, then buffers and splits them exactly as TRL does.
- ``compute_loss`` computes per-token staleness, the proximal log-probs (A-3PO interpolation, or a forward pass),
  and the decoupled PPO loss from :mod:`a3po_trl.functional`, aggregated per ``loss_type``.
- A callback publishes the weights to the generator after every optimizer step.
- ``train`` starts the engine lazily and always stops and joins its thread.

Evaluation is unchanged: it generates synchronously through GRPOTrainer's own path.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import defaultdict

import torch
from datasets import IterableDataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import add_fused_lm_head, shuffle_sequence_dict, split_tensor_dict, use_adapter

from .config import AsyncA3POConfig
from .distributed import destroy_process_group_at_exit
from .functional import (
    LOSS_TYPES,
    aggregate_loss,
    approximate_proximal_logps,
    decoupled_ppo_loss,
    kl_to_reference,
    proximal_approximation_error,
)
from .generation import (
    GenerationEngine,
    GeneratorPolicy,
    batches_needed,
    repeated_prompt_batches,
    staleness_bound_schedule,
)
from .metrics import batch_metrics, loss_metrics
from .rollout import RolloutSettings, generation_target, run_rollout

logger = logging.getLogger(__name__)


class _PublishWeightsCallback(TrainerCallback):
    """Publishes the trainer's weights to the generator after every optimizer step (version = global_step)."""

    def __init__(self, trainer: AsyncA3POTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._publish_weights()


class AsyncA3POTrainer(GRPOTrainer):
    """GRPO with asynchronous generation and A-3PO's staleness-aware proximal policy.

    Constructed exactly like :class:`trl.GRPOTrainer` (model id or model, ``reward_funcs``, ``args``,
    ``train_dataset``, ``eval_dataset``, ``processing_class``, ``reward_processing_classes``, ``callbacks``,
    ``optimizers``, ``peft_config``), with an :class:`~a3po_trl.AsyncA3POConfig` as ``args``.

    Example:

    ```python
    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer

    trainer = AsyncA3POTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        reward_funcs=my_reward,
        args=AsyncA3POConfig(output_dir="out", max_staleness=2),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    _tag_names = ["trl", "grpo", "a3po", "async"]
    _name = "AsyncA3PO"

    def __init__(self, model, reward_funcs=None, args: AsyncA3POConfig | None = None, train_dataset=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = AsyncA3POConfig(f"{str(name).split('/')[-1]}-A3PO")
        if not isinstance(args, AsyncA3POConfig):
            raise TypeError(
                f"AsyncA3POTrainer needs `args` to be an AsyncA3POConfig, got {type(args).__name__}. Build it with "
                "the same arguments: AsyncA3POConfig(**your_grpo_kwargs)."
            )
        _check_supported(args, kwargs)
        _check_train_dataset(train_dataset)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        self._check_supported_after_init()
        self._warn_about_biased_sampling()
        # The accelerator initialized the process group by now; end it before interpreter exit (see distributed.py).
        destroy_process_group_at_exit()

        self._engine: GenerationEngine | None = None
        self.last_generation_engine: GenerationEngine | None = None
        """The engine of the latest `train()` call, kept after it stops for inspection (counters, queue, policy)."""
        self._policy: GeneratorPolicy | None = None
        self._run_start_version = 0
        self._weight_sync_seconds = 0.0
        self._a3po_counters = defaultdict(float)
        self._generator_metrics = defaultdict(list)
        self._generator_metrics_lock = threading.Lock()
        self.add_callback(_PublishWeightsCallback(self))

    # ---- validation ------------------------------------------------------------------------------------------------
    def _warn_about_biased_sampling(self):
        """Behavior log-probs score the temperature-scaled distribution; truncated sampling draws from another one."""
        truncations = []
        if self.top_p is not None and self.top_p < 1.0:
            truncations.append(f"top_p={self.top_p}")
        if self.top_k:
            truncations.append(f"top_k={self.top_k}")
        if self.min_p:
            truncations.append(f"min_p={self.min_p}")
        if self.repetition_penalty not in (None, 1.0):
            truncations.append(f"repetition_penalty={self.repetition_penalty}")
        if truncations:
            logger.warning(
                "Sampling with %s draws tokens from a different distribution than the temperature-scaled one the "
                "behavior and training log-probs are computed from, which biases the importance ratios. Unset them "
                "(top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0) for unbiased A-3PO updates.",
                ", ".join(truncations),
            )

    def _check_supported_after_init(self):
        if self._is_vlm:
            raise NotImplementedError(
                "AsyncA3POTrainer does not support vision-language models yet; pass a text-only causal LM."
            )
        if self.aux_loss_enabled:
            raise NotImplementedError(
                "AsyncA3POTrainer does not support the MoE router auxiliary loss yet; set router_aux_loss_coef=0.0."
            )
        if self.train_dataset is not None:
            prompts_needed = self.args.generation_batch_size // self.num_generations
            if len(self.train_dataset) < prompts_needed:
                raise ValueError(
                    f"train_dataset has {len(self.train_dataset)} prompts, fewer than one generation batch needs "
                    f"({prompts_needed} = generation_batch_size {self.args.generation_batch_size} / num_generations "
                    f"{self.num_generations}). Add prompts or lower per_device_train_batch_size or "
                    "steps_per_generation."
                )
        if self.is_fsdp_enabled:
            raise NotImplementedError("FSDP is not supported yet; use DDP or DeepSpeed ZeRO-2.")

    # ---- generation engine -----------------------------------------------------------------------------------------
    def _unwrapped_model(self):
        return self.accelerator.unwrap_model(self.model)

    def _build_policy(self) -> GeneratorPolicy:
        temperature = self.temperature
        cast_fp32 = self.args.cast_lm_head_to_fp32

        def patch(module):
            add_fused_lm_head(generation_target(module), temperature=temperature, cast_lm_head_to_fp32=cast_fp32)

        device = self.args.generation_device or self.accelerator.device
        gather = None
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed

            def gather(params):
                return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

        return GeneratorPolicy(self._unwrapped_model(), device=device, patch_fn=patch, gather=gather)

    def _rollout_settings(self) -> RolloutSettings:
        tokenizer = copy.deepcopy(self.processing_class)  # the thread gets its own tokenizer
        chat_template, template_kwargs = self.chat_template, dict(self.chat_template_kwargs)

        def tokenize(prompts):
            if is_conversational({"prompt": prompts[0]}):
                return tokenizer.apply_chat_template(
                    conversation=prompts,
                    chat_template=chat_template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **template_kwargs,
                )["input_ids"]
            return tokenizer(text=prompts)["input_ids"]

        generation_config = copy.deepcopy(self.generation_config)
        return RolloutSettings(
            tokenize_prompts=tokenize,
            decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
            generation_config=generation_config,
            eos_token_ids=list(self.eos_token_ids),
            pad_token_id=self._tokenizer.pad_token_id,
            num_generations=self.num_generations,
            reward_funcs=self.reward_funcs,
            reward_func_names=self.reward_func_names,
            reward_processing_classes=self.reward_processing_classes,
            reward_weights=self.reward_weights.clone(),
            scale_rewards=self.scale_rewards,
            multi_objective_aggregation=self.multi_objective_aggregation,
            mask_truncated_completions=self.mask_truncated_completions,
            chunk_size=self.args.generation_batch_chunk_size,
            pad_to_multiple_of=self.pad_to_multiple_of,
            autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision),
            reward_extra_kwargs={"trainer_state": self.state, "log_metric": self._log_generator_metric},
            behavior_logps_source=self.args.behavior_logps_source,
            temperature=self.temperature,
        )

    def _log_generator_metric(self, name: str, value: float):
        """`log_metric` for reward functions running in the generation thread: buffered, merged at batch intake."""
        with self._generator_metrics_lock:
            self._generator_metrics[name].append(float(value))

    def _start_engine(self):
        args = self.args
        if self._policy is None:
            self._policy = self._build_policy()
        start_version = self.state.global_step
        self._run_start_version = start_version
        consumed = batches_needed(
            start_version, args.steps_per_generation, self.num_iterations, args.gradient_accumulation_steps
        )
        num_batches = batches_needed(
            self.state.max_steps - start_version,
            args.steps_per_generation,
            self.num_iterations,
            args.gradient_accumulation_steps,
        )
        prompt_batches = repeated_prompt_batches(
            self.train_dataset,
            num_generations=self.num_generations,
            local_batch_size=args.per_device_train_batch_size * args.steps_per_generation,
            process_index=self.accelerator.process_index,
            num_processes=self.accelerator.num_processes,
            shuffle=self.shuffle_dataset,
            seed=args.seed,
            skip_batches=consumed,
        )
        settings = self._rollout_settings()
        self._engine = GenerationEngine(
            policy=self._policy,
            prompt_batches=prompt_batches,
            rollout=lambda module, rows, should_stop: run_rollout(settings, module, rows, should_stop),
            min_version=staleness_bound_schedule(
                start_version,
                args.steps_per_generation,
                self.num_iterations,
                args.gradient_accumulation_steps,
                args.max_staleness,
            ),
            num_batches=num_batches,
            queue_size=args.max_staleness + 1,
            asynchronous=args.async_generation,
            num_threads=args.generation_num_threads,
            poll_interval=args.generation_poll_interval,
        )
        self.last_generation_engine = self._engine
        self._engine.start(self._unwrapped_model(), start_version)

    def _stop_engine(self):
        if self._engine is not None:
            engine, self._engine = self._engine, None
            if not engine.stop(timeout=self.args.generation_stop_timeout):
                logger.warning(
                    "The a3po generation thread did not stop within %s s (stuck in a reward function or generate?); "
                    "it is a daemon thread and is left behind.",
                    self.args.generation_stop_timeout,
                )

    def _publish_weights(self):
        if self._engine is not None:
            self._weight_sync_seconds += self._engine.publish(self._unwrapped_model(), self.state.global_step)

    def train(self, *args, **kwargs):
        previous_threads = torch.get_num_threads()
        if self.args.training_num_threads is not None:
            torch.set_num_threads(self.args.training_num_threads)
        try:
            return super().train(*args, **kwargs)
        finally:
            self._stop_engine()
            torch.set_num_threads(previous_threads)

    # ---- batches -------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            if self._engine is None:
                self._start_engine()
            batch = self._take_scored_batch()
            batch = shuffle_sequence_dict(batch)
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _take_scored_batch(self) -> dict:
        """Main thread: the next scored batch, moved to the device, with the collectives it needs (token count)."""
        device = self.accelerator.device
        scored, waited = self._engine.get()
        data = {k: v.to(device) for k, v in scored.tensors.items()}
        is_truncated, is_std_zero = data.pop("is_truncated"), data.pop("is_std_zero")
        batch_size = data["completion_ids"].size(0)
        data["policy_version"] = torch.full((batch_size,), scored.version, dtype=torch.long, device=device)
        data["num_items_in_batch"] = self.accelerator.gather(data["completion_mask"].sum()).sum()

        prompt_completion_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
        attention_mask = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1)
        logits_to_keep = data["completion_ids"].size(1)
        if self.args.prox_logp_method in ("recompute", "metrics"):
            start = time.perf_counter()
            with torch.no_grad():
                data["recomputed_proximal_logps"] = self._get_per_token_logps_and_entropies(
                    self.model,
                    prompt_completion_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size=self.args.per_device_train_batch_size,
                )[0]
            self._sync_if_cuda()
            self._a3po_counters["recompute_seconds"] += time.perf_counter() - start
        if self.beta != 0.0:
            data["ref_per_token_logps"] = self._reference_logps(prompt_completion_ids, attention_mask, logits_to_keep)

        self._log_batch_metrics(scored, data, waited, is_truncated, is_std_zero)
        return data

    @torch.no_grad()
    def _reference_logps(self, input_ids, attention_mask, logits_to_keep):
        batch_size = self.args.per_device_train_batch_size
        if self.ref_model is not None:
            return self._get_per_token_logps_and_entropies(
                self.ref_model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
            )[0]
        model = self._unwrapped_model()
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
            )[0]

    def _sync_if_cuda(self):
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)

    def _log_batch_metrics(self, scored, data, waited, is_truncated, is_std_zero):
        values, tokens_seen, rewards_per_func = batch_metrics(
            self.accelerator,
            scored,
            data,
            waited=waited,
            is_truncated=is_truncated,
            is_std_zero=is_std_zero,
            queue_depth=len(self._engine.queue),
            reward_weights=self.reward_weights,
            reward_func_names=self.reward_func_names,
            pad_token_id=self._tokenizer.pad_token_id,
        )
        self.state.num_input_tokens_seen += tokens_seen
        metrics = self._metrics["train"]
        metrics["num_tokens"] = [self.state.num_input_tokens_seen]
        values["async/weight_sync_time"] = self._weight_sync_seconds
        self._weight_sync_seconds = 0.0
        with self._generator_metrics_lock:
            values.update({name: sum(v) / len(v) for name, v in self._generator_metrics.items() if v})
            self._generator_metrics.clear()
        for name, value in values.items():
            metrics[name].append(value)

        if self.log_completions:
            from accelerate.utils import gather_object

            self._logs["prompt"].extend(gather_object(scored.texts["prompt"]))
            self._logs["completion"].extend(gather_object(scored.texts["completion"]))
            for i, name in enumerate(self.reward_func_names):
                self._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
            self._logs["advantages"].extend(self.accelerator.gather(data["advantages"]).tolist())

    # ---- loss ------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The AsyncA3POTrainer does not support returning outputs")
        if "behavior_logps" not in inputs:  # evaluation batches come from GRPOTrainer's synchronous path
            return self._compute_loss(model, inputs)
        return self._compute_a3po_loss(model, inputs)

    def _compute_a3po_loss(self, model, inputs):
        args = self.args
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        current_logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy=True
        )
        behavior_logps = inputs["behavior_logps"]
        staleness = (self.state.global_step - inputs["policy_version"]).clamp(min=0)

        start = time.perf_counter()
        loglinear_logps = None
        if args.prox_logp_method in ("loglinear", "metrics"):
            loglinear_logps = approximate_proximal_logps(behavior_logps, current_logps, staleness)
        if args.prox_logp_method == "loglinear":
            self._sync_if_cuda()
            self._a3po_counters["loglinear_seconds"] += time.perf_counter() - start
            proximal_logps = loglinear_logps
        else:
            proximal_logps = inputs["recomputed_proximal_logps"]

        per_token_loss, stats = decoupled_ppo_loss(
            current_logps,
            proximal_logps,
            behavior_logps,
            inputs["advantages"],
            mask,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            behavior_weight_cap=args.behavior_weight_cap,
            cap_mode=args.behavior_weight_cap_mode,
        )
        if self.beta != 0.0:
            per_token_kl = kl_to_reference(current_logps, inputs["ref_per_token_logps"])
            if args.use_bias_correction_kl:
                # Unbiased reverse-KL gradient under samples from the behavior policy: weight by pi_theta / pi_behav,
                # written r * rho so the weight carries the same cap as the policy term.
                finite_prox = torch.where(torch.isfinite(proximal_logps), proximal_logps, current_logps.detach())
                per_token_kl = per_token_kl * torch.exp(current_logps - finite_prox) * stats["behavior_weight"]
            per_token_loss = per_token_loss + self.beta * per_token_kl
        train = mode == "train"
        loss = aggregate_loss(
            per_token_loss,
            mask,
            self.loss_type,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps if train else 1,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs["num_items_in_batch"],
            num_processes=self.accelerator.num_processes,
            steps_per_generation=args.steps_per_generation if train else 1,
        )
        self._log_loss_metrics(mode, mask, staleness, entropies, stats, per_token_kl if self.beta != 0.0 else None)
        if args.prox_logp_method == "metrics":
            errors = proximal_approximation_error(loglinear_logps, proximal_logps, behavior_logps, mask)
            reduced = self.accelerator.reduce(torch.stack(list(errors.values())), reduction="mean")
            for name, value in zip(errors, reduced.tolist()):
                self._metrics[mode][f"a3po/approx_{name}"].append(value)
        return loss

    def _log_loss_metrics(self, mode, mask, staleness, entropies, stats, per_token_kl):
        values = loss_metrics(
            self.accelerator, mask, staleness, entropies, stats, per_token_kl, max_staleness=self.args.max_staleness
        )
        counters = self._a3po_counters
        values["a3po/prox_time"] = counters.pop("loglinear_seconds", 0.0) + counters.pop("recompute_seconds", 0.0)
        for name, value in values.items():
            self._metrics[mode][name].append(value)


_UNSUPPORTED_ARGS = {
    "use_vllm": (True, "generation runs in the trainer's own generator thread; set use_vllm=False"),
    "use_transformers_continuous_batching": (True, "set use_transformers_continuous_batching=False"),
    "importance_sampling_level": (
        "sequence",
        "the decoupled loss is per token; set importance_sampling_level='token'",
    ),
    "use_adaptive_entropy": (True, "set use_adaptive_entropy=False"),
}


def _check_supported(args: GRPOConfig, kwargs: dict) -> None:
    """Reject, before any model is loaded, the GRPOConfig options this trainer cannot honour."""
    if args.loss_type not in LOSS_TYPES:
        raise NotImplementedError(
            f"loss_type={args.loss_type!r} is not supported by AsyncA3POTrainer; choose one of {LOSS_TYPES}."
        )
    for name, (bad_value, fix) in _UNSUPPORTED_ARGS.items():
        if getattr(args, name, None) == bad_value:
            raise NotImplementedError(f"{name}={bad_value!r} is not supported by AsyncA3POTrainer: {fix}.")
    if args.top_entropy_quantile < 1.0:
        raise NotImplementedError("top_entropy_quantile < 1.0 is not supported yet; set top_entropy_quantile=1.0.")
    if args.off_policy_mask_threshold is not None:
        raise NotImplementedError(
            "off_policy_mask_threshold is not supported: A-3PO's behavior weight cap handles off-policy tokens; "
            "unset off_policy_mask_threshold and use behavior_weight_cap."
        )
    if args.delta is not None:
        raise NotImplementedError("delta (two-sided clipping) is not supported yet; set delta=None.")
    if args.entropy_coef != 0.0:
        raise NotImplementedError("entropy_coef != 0 (entropy bonus) is not supported yet; set entropy_coef=0.0.")
    for name in ("tools", "rollout_func", "environment_factory"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"`{name}` is not supported by AsyncA3POTrainer yet; leave it unset.")


def _check_train_dataset(dataset) -> None:
    if dataset is None:
        return
    if isinstance(dataset, IterableDataset):
        raise NotImplementedError(
            "An IterableDataset train_dataset is not supported yet: the generator samples prompts by index. Convert "
            "it with datasets.Dataset.from_generator or .from_list."
        )
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty; it needs at least one generation batch worth of prompts.")
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"train_dataset has no 'prompt' column (columns: {columns}). Rename the column holding the prompts, "
            "e.g. dataset.rename_column('question', 'prompt')."
        )
