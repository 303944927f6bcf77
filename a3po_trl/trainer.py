"""`AsyncA3POTrainer`: TRL's GRPOTrainer with a background generator and A-3PO's decoupled loss.

What changes relative to `GRPOTrainer`, and where:

- ``_prepare_inputs`` takes versioned batches from the :class:`~a3po_trl.generation.GenerationEngine` (generated and
  scored in its thread, with the generator's own copy of the weights) instead of generating with the training module,
  computes their advantages from every process's rewards as GRPOTrainer does, then buffers and splits them as TRL does.
- ``compute_loss`` computes per-token staleness, the proximal log-probs (A-3PO interpolation, or a forward pass),
  and the decoupled form of the configured loss (:mod:`a3po_trl.losses`).
- A callback publishes the weights to the generator after every optimizer step.
- ``train`` starts the engine lazily and always stops and joins its thread.

Evaluation is unchanged: it generates synchronously through GRPOTrainer's own path.
"""

from __future__ import annotations

import copy
import logging
import os
import textwrap
import time
import weakref
from collections import defaultdict

import numpy as np
import torch
from accelerate.utils import gather_object
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import add_fused_lm_head, shuffle_sequence_dict, split_tensor_dict, use_adapter

from .config import AsyncA3POConfig, trainer_config
from .distributed import destroy_process_group_at_exit
from .functional import group_advantages
from .generation import GenerationBackend, GenerationEngine, HFGenerateBackend, HFGenerationSettings
from .generation.hf import generation_target
from .generation.hf.sampling import processed_sampling, records_logps, samples_with_own_stream, sampling_deviations
from .generation.schedule import TrainingLoopShape, oldest_allowed_version, plan_generation_batches, run_micro_steps
from .generation.version_checkpoint import load_kept_versions, save_kept_versions
from .losses import DecoupledLossMixin
from .metrics import batch_metrics, tool_metrics
from .patches import align_position_ids_with_generation, cast_lm_head_to_fp32
from .rollout import RolloutSettings, decode_completions, run_rollout
from .rollout.custom import generate_completions
from .rollout.multi_turn import agent_settings
from .rollout.prompt_batches import repeated_prompt_batches
from .rollout.scoring import score_with_reward_model, warn_about_unscorable_rows
from .validation import check_supported, check_train_dataset

logger = logging.getLogger(__name__)


class _PublishWeightsCallback(TrainerCallback):
    """Publishes the trainer's weights to the generator after every optimizer step (version = global_step)."""

    def __init__(self, trainer: AsyncA3POTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._publish_weights()


class AsyncA3POTrainer(DecoupledLossMixin, GRPOTrainer):
    """GRPO with asynchronous generation and A-3PO's staleness-aware proximal policy.

    Constructed exactly like :class:`trl.GRPOTrainer` (model id or model, ``reward_funcs``, ``args``,
    ``train_dataset``, ``eval_dataset``, ``processing_class``, ``reward_processing_classes``, ``callbacks``,
    ``optimizers``, ``peft_config``), with an :class:`~a3po_trl.AsyncA3POConfig` as ``args``; a plain
    ``GRPOConfig`` is converted with :meth:`~a3po_trl.AsyncA3POConfig.from_grpo_config` (A-3PO settings at their
    defaults, with a warning).

    Reward functions run in the generation thread. They receive what GRPOTrainer passes (``prompts``,
    ``completions``, ``completion_ids``, the dataset columns, ``log_metric``, ``log_extra``), and as ``trainer_state``
    a snapshot of the trainer state at the optimizer step whose weights generated the batch (the live state belongs to
    the training thread). ``async def`` reward functions run on TRL's event loop.

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
    # The model card's paper (TRL's pattern): A-3PO, then GRPO's own entry, since the loss is GRPO's, decoupled.
    _paper = {
        "title": "A-3PO: Accelerating Asynchronous LLM Training with Staleness-aware Proximal Policy Approximation",
        "id": "2512.06547",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{li2025a3po,
                title        = {{A-3PO: Accelerating Asynchronous LLM Training with Staleness-aware Proximal Policy Approximation}},
                author       = {Xiaocan Li and Shiliang Wu and Zheng Shen},
                year         = 2025,
                eprint       = {arXiv:2512.06547},
            }""")  # noqa: E501
        + "\n\n"
        + GRPOTrainer._paper["citation"],
    }

    def __init__(
        self, model, reward_funcs=None, args: AsyncA3POConfig | GRPOConfig | None = None, train_dataset=None, **kwargs
    ):
        args = trainer_config(args, model)
        check_supported(args, kwargs)
        check_train_dataset(train_dataset, environment_owns_prompts=kwargs.get("environment_factory") is not None)
        # vLLM is this trainer's own generation backend (generation/vllm_*.py), driven by the generation thread:
        # GRPOTrainer must not build its synchronous one, so it is constructed as if use_vllm were off.
        self._use_vllm_backend = bool(args.use_vllm)
        args.use_vllm = False
        try:
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        finally:
            args.use_vllm = self._use_vllm_backend
        self._check_supported_after_init()
        self._generation_config_checked = self._checked_generation_config()
        self._warn_about_dropout()
        for module in (self.model, self.accelerator.unwrap_model(self.ref_model) if self.ref_model else None):
            if module is not None:
                align_position_ids_with_generation(module)
        # The accelerator initialized the process group by now; end it before interpreter exit (see distributed.py).
        destroy_process_group_at_exit()

        self._engine: GenerationEngine | None = None
        self.last_generation_engine: GenerationEngine | None = None
        """The engine of the latest `train()` call, kept after it stops for inspection (counters, queue, policy)."""
        self._backend: GenerationBackend | None = None
        self._run_start_step = 0
        self._steps_in_epoch: int | None = None
        self._micro_steps = []
        self._schedule_warned = False
        self._weight_sync_seconds = 0.0
        self._resume_checkpoint = None
        self._a3po_counters = defaultdict(float)
        self.add_callback(_PublishWeightsCallback(self))

    # ---- validation ------------------------------------------------------------------------------------------------
    def _check_supported_after_init(self):
        if self._is_vlm:
            raise NotImplementedError(
                "AsyncA3POTrainer does not support vision-language models yet (its generator scores text only); "
                "train them with trl.GRPOTrainer, or pass a text-only causal LM."
            )
        if self.is_fsdp_enabled:
            raise NotImplementedError(
                "FSDP is not supported yet (the generator's copy of the weights is built from whole parameters); use "
                "DDP or DeepSpeed ZeRO-2/3 (`accelerate launch --config_file examples/accelerate_configs/...`)."
            )
        if self.train_dataset is not None and hasattr(self.train_dataset, "__len__"):
            prompts_needed = self.args.generation_batch_size // self.num_generations
            if len(self.train_dataset) < prompts_needed:
                raise ValueError(
                    f"train_dataset has {len(self.train_dataset)} prompts, fewer than one generation batch needs "
                    f"({prompts_needed} = generation_batch_size {self.args.generation_batch_size} / num_generations "
                    f"{self.num_generations}). Add prompts or lower per_device_train_batch_size or "
                    "steps_per_generation."
                )

    def _checked_generation_config(self):
        """The generation config ``generate`` will really use (TRL's, completed from the model's own), checked: its
        temperature must be the one the training log-probs are scaled by, and whatever else makes it sample from
        another distribution than ``softmax(logits / temperature)`` is reported."""
        target = generation_target(self._unwrapped_model())
        config = copy.deepcopy(self.generation_config)
        try:
            if not self._use_vllm_backend:  # vLLM samples with TRL's settings only, not the model's generation_config
                config, _ = target._prepare_generation_config(config)
        except (AttributeError, TypeError):  # a transformers without the merge helper: use TRL's config as it is
            pass
        if config.temperature is not None and abs(config.temperature - self.temperature) > 1e-12:
            # A conflicting temperature in generation_kwargs is refused by the config already (before loading).
            in_kwargs = (self.args.generation_kwargs or {}).get("temperature")
            source = "generation_kwargs" if in_kwargs == config.temperature else "the model's generation_config"
            raise ValueError(
                f"{source} sets temperature={config.temperature}, but the training log-probs are scaled by "
                f"temperature={self.temperature}: behavior and training log-probs would score different "
                f"distributions. Set temperature={config.temperature} in the config instead of in {source}."
            )
        # The generate backend records the log-probs of a processed sampling distribution (top-k/p, penalties, ...)
        # under plain sampling; vLLM refuses such settings before any model loads (check_vllm_settings).
        recorded = [] if self._use_vllm_backend or not samples_with_own_stream(config) else processed_sampling(config)
        unrecorded = [d for d in sampling_deviations(config) if d not in recorded]
        if unrecorded:
            logger.warning(
                "Sampling with %s draws tokens from a different distribution than the temperature-scaled one the "
                "behavior and training log-probs are computed from, which biases the importance ratios (set in the "
                "config, generation_kwargs, or the model's generation_config). Use plain sampling (do_sample=True, "
                "num_beams=1) for unbiased A-3PO updates.",
                ", ".join(unrecorded),
            )
        if recorded:
            logger.info(
                "Sampling with %s: the generator records the log-probs of the processed distribution it draws each "
                "token from, which enter the behavior weight pi_prox / pi_sampling; the trust region stays anchored "
                "at the untruncated policy (an on-policy token has ratio 1, as in GRPOTrainer).",
                ", ".join(recorded),
            )
        return config

    def _warn_about_dropout(self):
        if self.args.disable_dropout:
            return
        if any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.model.modules()):
            logger.warning(
                "disable_dropout=False leaves dropout on in the training forward, while the generator samples and "
                "scores its tokens without dropout: on-policy importance ratios then differ from 1 by the dropout "
                "noise. Set disable_dropout=True (AsyncA3POConfig's default; GRPOConfig's is False) for unbiased "
                "A-3PO updates."
            )

    # ---- generation engine -----------------------------------------------------------------------------------------
    def _unwrapped_model(self):
        return self.accelerator.unwrap_model(self.model)

    def _build_backend(self) -> GenerationBackend:
        """The generation backend: Hugging Face ``generate`` on the generator's own copy, or vLLM (``use_vllm``)."""
        if self._use_vllm_backend:
            from .generation.vllm.setup import build_vllm_backend

            return build_vllm_backend(self)
        return self._build_hf_backend()

    def _build_hf_backend(self) -> HFGenerateBackend:
        temperature = self.temperature
        cast_fp32 = self.args.cast_lm_head_to_fp32

        def patch(module):
            # Re-apply to the copy what the trainer applied to the training model (HFGenerateBackend strips the
            # instance patches, which close over the training module).
            target = generation_target(module)
            if cast_fp32:
                cast_lm_head_to_fp32(target)
            add_fused_lm_head(target, temperature=temperature, cast_lm_head_to_fp32=cast_fp32)
            align_position_ids_with_generation(module)

        device = self.args.generation_device or self.accelerator.device
        gather = self._zero3_gather()
        return HFGenerateBackend(
            self._unwrapped_model(), self._hf_generation_settings(), device=device, patch_fn=patch, gather=gather
        )

    def _zero3_gather(self):
        """``GatheredParameters`` under ZeRO-3 (every process together, main thread), else None."""
        if not self._zero3:
            return None
        import deepspeed

        def gather(params):
            return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

        return gather

    def _hf_generation_settings(self) -> HFGenerationSettings:
        effective = self._generation_config_checked
        own_stream = samples_with_own_stream(effective)
        if not own_stream:
            logger.warning(
                "This generation config is not plain sampling (%s): the generator leaves token selection to "
                "generate, which draws from the global RNG that the training thread also uses.",
                ", ".join(sampling_deviations(effective)),
            )
        behavior_logps_source = self.args.behavior_logps_source
        if behavior_logps_source == "generation" and not records_logps(effective):
            behavior_logps_source = "forward"  # beams or assisted decoding: no one-forward-per-token to record from
        processed = processed_sampling(effective) if own_stream else []
        if processed and behavior_logps_source != "generation":
            raise ValueError(
                f"Sampling with {', '.join(processed)} draws tokens from a processed distribution, whose log-probs "
                "the behavior weight needs; they are recorded only while generating, one forward per token "
                f"(behavior_logps_source={self.args.behavior_logps_source!r} with this generation config computes "
                "the untruncated ones only). Set behavior_logps_source='generation' without chunked prefill or "
                "assisted decoding, or leave the sampling settings at their neutral values (top_p=1.0, top_k=0, "
                "min_p=None, repetition_penalty=1.0)."
            )
        return HFGenerationSettings(
            generation_config=copy.deepcopy(self.generation_config),
            eos_token_ids=list(self.eos_token_ids),
            pad_token_id=self._tokenizer.pad_token_id,
            chunk_size=self.args.generation_batch_chunk_size,
            autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision),
            behavior_logps_source=behavior_logps_source,
            temperature=self.temperature,
            own_random_stream=own_stream,
            record_sampling_logps=bool(processed),
        )

    @property
    def _zero3(self) -> bool:
        return bool(self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3)

    def _deferred_reward_columns(self) -> frozenset[int]:
        """Reward models whose forward is a collective (partitioned by ZeRO-3) are scored in the main thread."""
        if not self._zero3:
            return frozenset()
        return frozenset(i for i, func in enumerate(self.reward_funcs) if isinstance(func, nn.Module))

    def _rollout_settings(self, batch_numbers=None) -> RolloutSettings:
        """What the generation thread needs, copied. ``batch_numbers(index)`` is the global number of batch ``index``
        of the run (its position in the sampler's order over epochs), from which its sampling seed derives."""
        tokenizer = copy.deepcopy(self.processing_class)  # the thread gets its own tokenizers
        chat_template, template_kwargs = self.chat_template, dict(self.chat_template_kwargs)

        def render(prompts, tools):
            return tokenizer.apply_chat_template(
                conversation=prompts,
                tools=tools or None,  # `or None`, as GRPOTrainer: some templates render tool boilerplate for []
                chat_template=chat_template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **template_kwargs,
            )["input_ids"]

        def tokenize(prompts, tools):
            if not is_conversational({"prompt": prompts[0]}):
                return tokenizer(text=prompts)["input_ids"]
            if tools is None or all(t is tools[0] for t in tools):
                return render(prompts, tools[0] if tools else None)
            return [render([prompt], prompt_tools)[0] for prompt, prompt_tools in zip(prompts, tools, strict=True)]

        return RolloutSettings(
            tokenize_prompts=tokenize,
            decode=lambda ids, prompt_ids, prompts: decode_completions(tokenizer, ids, prompt_ids, prompts),
            eos_token_ids=list(self.eos_token_ids),
            pad_token_id=self._tokenizer.pad_token_id,
            reward_funcs=list(self.reward_funcs),
            reward_func_names=list(self.reward_func_names),
            reward_processing_classes=[copy.deepcopy(c) for c in self.reward_processing_classes],
            mask_truncated_completions=self.mask_truncated_completions,
            pad_to_multiple_of=self.pad_to_multiple_of,
            sampling_seeds=None if batch_numbers is None else self._sampling_seeds(batch_numbers),
            deferred_reward_columns=self._deferred_reward_columns(),
            async_loop=getattr(self, "async_loop", None),
            chat_template_kwargs=template_kwargs,
            agent=agent_settings(
                self, tokenizer, self.args.refresh_weights_between_turns and not self.args.reproducible_generation
            ),
            rollout_func=self.rollout_func,
            rollout_owner=self,
        )

    @staticmethod
    def generate_completions(prompt_ids: list[list[int]]) -> dict[str, list]:
        """For a ``rollout_func``: generate one completion per row of ``prompt_ids`` (token ids) with the weights of
        the batch being rolled out, returning ``{"completion_ids", "logprobs"}`` (the behavior log-probs its output
        must carry). Callable only from inside a ``rollout_func`` (see :mod:`a3po_trl.rollout.custom`)."""
        return generate_completions(prompt_ids)

    def _sampling_seeds(self, batch_numbers):
        """Seed of each batch's random stream: from ``args.seed``, the process and the batch's global number, so every
        process and batch has its own stream and a resumed run regenerates a batch with the stream it had."""
        process = self.accelerator.process_index

        def seed(index: int) -> int:
            sequence = np.random.SeedSequence([self.args.seed, process, batch_numbers(index)])
            return int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1)

        return seed

    def set_initial_training_values(self, args, dataloader):
        # Trainer computes the loop's shape here; the batch schedule must follow the real loop (see schedule.py).
        values = super().set_initial_training_values(args, dataloader)
        self._steps_in_epoch = values[5]
        return values

    def _start_engine(self):
        args = self.args
        if self._backend is None:
            self._backend = self._build_backend()
            weakref.finalize(self, self._backend.close)  # an engine or a server's adapters outlive train() calls
        start_version = self.state.global_step
        if self._steps_in_epoch is None:  # batches taken outside train(): the loop's shape from its dataloader
            self.set_initial_training_values(args, self.get_train_dataloader())
        shape = TrainingLoopShape(
            steps_in_epoch=self._steps_in_epoch,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_steps=self.state.max_steps,
            start_step=start_version,
            skip_trained_data=not args.ignore_data_skip,
        )
        every = args.steps_per_generation * self.num_iterations
        self._micro_steps = run_micro_steps(shape)
        planned = plan_generation_batches(self._micro_steps, every)
        batches_per_epoch = max(self._steps_in_epoch // every, 1)

        def batch_number(index: int) -> int:
            return planned[index].epoch * batches_per_epoch + planned[index].index_in_epoch

        prompt_batches = repeated_prompt_batches(
            self.train_dataset,
            num_generations=self.num_generations,
            local_batch_size=args.per_device_train_batch_size * args.steps_per_generation,
            process_index=self.accelerator.process_index,
            num_processes=self.accelerator.num_processes,
            shuffle=self.shuffle_dataset,
            seed=args.seed,
            skip_batches=batch_number(0) if planned else 0,
        )
        settings = self._rollout_settings(batch_number)
        # A resumed reproducible run regenerates its next batches with the versions the checkpoint kept for them.
        earlier = load_kept_versions(self._resume_checkpoint) if args.reproducible_generation else {}
        first_version = min([*earlier, start_version])
        self._engine = GenerationEngine(
            backend=self._backend,
            prompt_batches=prompt_batches,
            rollout=lambda *args: run_rollout(settings, *args),
            min_version=lambda index: oldest_allowed_version(planned[index], args.max_staleness, first_version),
            num_batches=len(planned),
            queue_size=args.max_staleness + 1,
            asynchronous=args.async_generation,
            num_threads=args.generation_num_threads,
            poll_interval=args.generation_poll_interval,
            exact_versions=args.reproducible_generation,
        )
        self.last_generation_engine = self._engine
        self._engine.start(self._unwrapped_model(), start_version, self._state_snapshot(), earlier_versions=earlier)

    def _stop_engine(self):
        if self._engine is not None:
            engine, self._engine = self._engine, None
            if not engine.stop(timeout=self.args.generation_stop_timeout):
                logger.warning(
                    "The a3po generation thread did not stop within %s s (stuck in a reward function or generate?); "
                    "it is a daemon thread and is left behind.",
                    self.args.generation_stop_timeout,
                )

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.reproducible_generation and self._backend is not None and self.args.should_save:
            directory = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            save_kept_versions(self._backend, directory, before=self.state.global_step)

    def _state_snapshot(self):
        """A copy of the trainer state as it is now, for reward functions running beside the training thread."""
        snapshot = copy.copy(self.state)
        snapshot.log_history = list(self.state.log_history)
        return snapshot

    def _publish_weights(self):
        if self._engine is not None:
            model = self._unwrapped_model()
            self._weight_sync_seconds += self._engine.publish(model, self.state.global_step, self._state_snapshot())

    def train(self, *args, **kwargs):
        previous_threads = torch.get_num_threads()
        if self.args.training_num_threads is not None:
            torch.set_num_threads(self.args.training_num_threads)
        # Micro-steps are counted from the start of this run: its first one takes a new batch (see _prepare_inputs).
        self._run_start_step = self._step
        self._buffered_inputs = None
        self._schedule_warned = False
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume is True:
            resume = get_last_checkpoint(self.args.output_dir)
        self._resume_checkpoint = resume or None
        try:
            return super().train(*args, **kwargs)
        finally:
            self._stop_engine()
            torch.set_num_threads(previous_threads)

    # ---- batches -------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        if self._engine is None:
            self._start_engine()
        run_step = self._step - self._run_start_step
        if run_step >= len(self._micro_steps):
            raise RuntimeError(
                f"The training loop ran more micro-steps ({run_step + 1}) than its shape predicts "
                f"({len(self._micro_steps)}); the generation batches of this run are used up."
            )
        planned = self._micro_steps[run_step]
        if planned.version != self.state.global_step and not self._schedule_warned:
            self._schedule_warned = True
            logger.warning(
                "The training loop is at optimizer step %d where its shape predicts %d; the staleness bound may not "
                "hold for this run (the generator never waits for weights the trainer cannot publish).",
                self.state.global_step,
                planned.version,
            )
        position = planned.position % (self.args.steps_per_generation * self.num_iterations)
        if position == 0 or self._buffered_inputs is None:
            batch = shuffle_sequence_dict(self._take_scored_batch())
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[position % self.args.steps_per_generation]

    def _take_scored_batch(self) -> dict:
        """Main thread: the next scored batch, with everything that needs every process (advantages, the token
        count, reward models partitioned by ZeRO-3) or the training weights (recomputed and reference log-probs)."""
        device = self.accelerator.device
        scored, waited = self._engine.get()
        data = {k: v.to(device) for k, v in scored.tensors.items()}
        is_truncated, completion_lengths = scored.is_truncated.to(device), scored.completion_lengths.to(device)
        batch_size = data["completion_ids"].size(0)
        prompts, completions = scored.texts["prompt"], scored.texts["completion"]

        local_rewards = scored.rewards_per_func.to(device)
        for i in self._deferred_reward_columns():
            values = score_with_reward_model(
                self.reward_funcs[i],
                self.reward_processing_classes[i],
                prompts,
                completions,
                self.chat_template_kwargs,
            )
            local_rewards[:, i] = torch.tensor(values, dtype=torch.float32, device=device)
        warn_about_unscorable_rows(local_rewards, scored.rows, prompts, completions)
        rewards_per_func = self.accelerator.gather(local_rewards)
        advantages, _, is_std_zero = group_advantages(
            rewards_per_func,
            self.reward_weights,
            self.num_generations,
            self.scale_rewards,
            self.multi_objective_aggregation,
        )
        process_slice = slice(
            self.accelerator.process_index * batch_size, (self.accelerator.process_index + 1) * batch_size
        )
        data["advantages"] = advantages[process_slice]
        data["policy_version"] = data.pop("token_versions")  # (B, T): the version that generated each token
        loss_mask = data["completion_mask"] * data["tool_mask"] if "tool_mask" in data else data["completion_mask"]
        data["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        agent_values = tool_metrics(
            self.accelerator, scored.tool_stats, data["policy_version"], loss_mask, completion_lengths
        )
        if scored.environments is not None:
            self.environments = scored.environments  # GRPOTrainer's attribute: the latest batch's environments

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
            data["recompute_version"] = torch.full((batch_size,), self.state.global_step, device=device)
            self._sync_if_cuda()
            self._a3po_counters["recompute_seconds"] += time.perf_counter() - start
        if self.beta != 0.0:
            data["ref_per_token_logps"] = self._reference_logps(prompt_completion_ids, attention_mask, logits_to_keep)

        values, tokens_seen = batch_metrics(
            self.accelerator,
            scored,
            completion_lengths=completion_lengths,
            prompt_lengths=data["prompt_mask"].sum(1),
            is_truncated=is_truncated,
            rewards_per_func=rewards_per_func,
            is_std_zero=is_std_zero,
            waited=waited,
            queue_depth=len(self._engine.queue),
            reward_weights=self.reward_weights,
            reward_func_names=self.reward_func_names,
        )
        self.state.num_input_tokens_seen += tokens_seen
        metrics = self._metrics["train"]
        metrics["num_tokens"] = [self.state.num_input_tokens_seen]
        values.update(agent_values)
        values["async/weight_sync_time"] = self._weight_sync_seconds
        self._weight_sync_seconds = 0.0
        for name, value in values.items():
            metrics[name].append(value)
        self._log_reward_function_outputs(scored, prompts, completions, rewards_per_func, advantages)
        return data

    def _log_reward_function_outputs(self, scored, prompts, completions, rewards_per_func, advantages):
        """GRPOTrainer's completion table and what reward functions logged, gathered over processes in the same
        (sorted) order on every process."""
        self._logs["prompt"].extend(gather_object(prompts))
        self._logs["completion"].extend(gather_object(completions))
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        self._logs["advantages"].extend(advantages.tolist())
        for column in sorted(set(gather_object(list(scored.extra_logs)))):
            values = scored.extra_logs.get(column, [None] * len(prompts))
            self._logs["extra"][column].extend(gather_object(values))
        for name in sorted(set(gather_object(list(scored.logged_metrics)))):
            values = scored.logged_metrics.get(name, [])
            local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=self.accelerator.device)
            total, count = self.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
            self._metrics["train"][name].append(total / count)

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
