"""The one place that reads a trainer's internals to build what the generation thread needs.

GRPOTrainer keeps what it has set up (the generation config, the tokenizer, tools and environments, reward functions,
ZeRO-3 and FSDP2 state) as attributes of the trainer. The generation thread must never read the trainer while it
trains, so everything it needs is read here once, in the main thread, and copied into plain settings: the generation
backend (Hugging Face ``generate`` or vLLM) and its sampling settings, the batch producer of each ``train()`` call
(the run's plan of micro-steps and batches, its prompt batches, the oldest version allowed for each batch), the
rollout settings (tokenizers of its own, reward functions, the seed of each batch's random stream) and the multi-turn
settings.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn
from trl.data_utils import is_conversational
from trl.trainer.utils import add_fused_lm_head

from .generation.backend import GenerationBackend
from .generation.hf import HFGenerateBackend, HFGenerationSettings
from .generation.hf.continuous_batching import ContinuousBatchingBackend, check_continuous_batching_sampling
from .generation.hf.sampling import processed_sampling, records_logps, samples_with_own_stream, sampling_deviations
from .generation.producer import BatchProducer
from .generation.schedule import (
    MicroStep,
    PlannedBatch,
    TrainingLoopShape,
    oldest_allowed_version,
    plan_run_batches,
)
from .generation.vllm.make_backend import engine_dtype
from .generation.vllm.sampling import VLLMSamplingSettings
from .generation.vllm.weight_loading import active_lora, unsupported_lora_reason
from .generation.weights import (
    ContextGather,
    DTensorGather,
    ParameterGather,
    checkpoint_dtype,
    generator_dtype,
    mixed_precision_dtype,
)
from .generation.weights.memory_plan import (
    GeneratorSetup,
    available_host_memory,
    free_device_memory,
    kv_bytes_per_token,
    plan_generator_memory_choosing_staging,
    processes_on_node,
)
from .patches import align_position_ids_with_generation, cast_lm_head_to_fp32, peft_base_model
from .rollout import RolloutSettings, decode_completions, run_rollout
from .rollout.dynamic_sampling import DynamicSampler, resolve_group_filter
from .rollout.multi_turn import AgentSettings
from .rollout.prompt_batches import repeated_prompt_batches
from .rollout.seeds import sampling_seeds
from .runtime.devices import explicit_device
from .runtime.distributed import private_store

logger = logging.getLogger(__name__)


def uses_zero3(trainer) -> bool:
    return bool(trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3)


def uses_fsdp2(trainer) -> bool:
    return bool(trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2)


def shards_parameters(trainer) -> bool:
    """Whether every process holds only a shard of each parameter (ZeRO-3, FSDP2): reading one whole, or running a
    forward, is then a collective."""
    return uses_zero3(trainer) or uses_fsdp2(trainer)


def weight_gather(trainer) -> ParameterGather | None:
    """How the main thread reads the training weights whole for the generator (every process together): ZeRO-3's
    ``GatheredParameters``, FSDP2's ``full_tensor()`` per parameter, or None (whole already)."""
    if uses_fsdp2(trainer):
        return DTensorGather()
    if not uses_zero3(trainer):
        return None
    import deepspeed

    def gather(params):
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    return ContextGather(gather)


# ---- the generation backend ------------------------------------------------------------------------------------
def build_backend(trainer) -> GenerationBackend:
    """The generation backend: Hugging Face ``generate`` on the generator's own copy (with transformers' continuous
    batching: ``use_transformers_continuous_batching``), or vLLM (``use_vllm``).

    Its memory is planned first (:mod:`a3po_trl.generation.weights.memory_plan`: where colocated vLLM stages its
    versions, on the GPU or in pinned host memory, is chosen there), logged, and on CUDA refused before anything is
    allocated when it cannot fit on a device or in the host memory of this machine; the plan is kept as the
    backend's ``memory_plan`` (its ``figures()``: what a GPU check measures against)."""
    setup = generator_setup(trainer)
    free = free_device_memory([setup.generation_device, setup.training_device])
    plan = plan_generator_memory_choosing_staging(trainer._unwrapped_model(), setup, free)
    logger.info("Process %d: %s", trainer.accelerator.process_index, plan.describe())
    plan.check(free, available_host_memory() if plan.pinned_host_bytes else None)
    warning = plan.reserve_warning(free)
    if warning:
        logger.warning("Process %d: %s", trainer.accelerator.process_index, warning)
    if trainer._use_vllm_backend:
        backend = _build_vllm_backend(trainer, plan.staging_device)
    else:
        backend = _build_hf_backend(trainer, setup.dtype, plan.staging_device)
    backend.memory_plan = plan
    logger.info("Process %d: generation engine: %s", trainer.accelerator.process_index, generation_engine(trainer))
    return backend


def generation_engine(trainer) -> str:
    """Which engine generates the run's completions, and in which thread, as the log names it: ``HF generate``,
    ``transformers continuous batching``, ``vLLM colocate`` or ``vLLM server``."""
    if trainer._use_vllm_backend:
        engine = f"vLLM {trainer.args.vllm_mode}"
    elif trainer.args.use_transformers_continuous_batching:
        engine = "transformers continuous batching"
    else:
        engine = "HF generate"
    thread = "the generation thread" if trainer.args.async_generation else "the main thread (async_generation=False)"
    updates = ", weights loaded mid-batch (in_flight_weight_updates)" if trainer.args.in_flight_weight_updates else ""
    return f"{engine}, in {thread}{updates}"


def generator_setup(trainer) -> GeneratorSetup:
    """The facts of this run that decide the generator's memory (see :class:`GeneratorSetup`)."""
    args, accelerator = trainer.args, trainer.accelerator
    module = trainer._unwrapped_model()
    training_device = explicit_device(accelerator.device)
    generation_device = explicit_device(args.generation_device or training_device)
    mixed_precision = accelerator.mixed_precision
    if not trainer._use_vllm_backend:
        kind = "generate"
        checkpoint = checkpoint_dtype(peft_base_model(module).config)
        dtype = generator_dtype(
            backend="generate", device=generation_device, mixed_precision=mixed_precision, checkpoint=checkpoint
        )
    elif args.vllm_mode == "colocate":
        kind, dtype = "vllm-colocate", engine_dtype(module, generation_device, mixed_precision)
    else:  # the server's own dtype is known once it answers: planned as vLLM's `auto` (trl vllm-serve's default)
        kind, dtype = "vllm-server", engine_dtype(module, generation_device, mixed_precision)
    lora = active_lora(module)
    processes = accelerator.num_processes
    generation = {}
    if kind == "generate":  # what generate's own pool holds at a decode step
        config = peft_base_model(module).config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        held = dtype or next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        generation = dict(
            generation_rows=args.generation_batch_chunk_size or max(args.generation_batch_size // processes, 1),
            completion_tokens=args.max_completion_length or 0,
            kv_bytes_per_token=kv_bytes_per_token(config, held),
            vocab_size=getattr(text, "vocab_size", 0) or 0,
        )
    half = mixed_precision_dtype(mixed_precision)
    casts_weights = half is not None and not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled)
    zero_stage = accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else 0
    optim = str(getattr(args.optim, "value", args.optim)).lower()
    return GeneratorSetup(
        backend=kind,
        generation_device=generation_device,
        training_device=training_device,
        dtype=dtype,
        sharded=shards_parameters(trainer),
        staging_sets=args.max_staleness + 2 if args.reproducible_generation else 1,
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_merges_adapters=bool(kind == "vllm-colocate" and lora and unsupported_lora_reason(lora[1])),
        device_total_bytes=(
            torch.cuda.get_device_properties(generation_device).total_memory
            if generation_device.type == "cuda"
            else None
        ),
        gradient_shards=processes if uses_fsdp2(trainer) or zero_stage >= 2 else 1,
        optimizer_shards=processes if uses_fsdp2(trainer) or zero_stage >= 1 else 1,
        optimizer_states_per_parameter=2 if "adam" in optim else 1 if ("sgd" in optim or "lion" in optim) else 0,
        # DeepSpeed allocates its partitioned states when it wraps the model; a later train() has them already
        training_state_allocated=bool(trainer.is_deepspeed_enabled or getattr(trainer.optimizer, "state", None)),
        processes_on_node=processes_on_node(),
        autocast_copy_dtype=half if casts_weights else None,  # DeepSpeed holds half weights; FSDP casts per layer
        **generation,
    )


def _build_hf_backend(trainer, dtype: torch.dtype | None, staging_device=None) -> HFGenerateBackend:
    """The ``generate`` backend on the generator's own copy; with ``use_transformers_continuous_batching``, the same
    copy generating with transformers' continuous batching (:class:`ContinuousBatchingBackend`). Its versions are
    staged on ``staging_device`` (the memory plan's choice; None: the generation device)."""
    temperature = trainer.temperature
    cast_fp32 = trainer.args.cast_lm_head_to_fp32

    def patch(module):
        # Re-apply to the copy what the trainer applied to the training model (HFGenerateBackend strips the instance
        # patches, which close over the training module).
        target = peft_base_model(module)
        if cast_fp32:
            cast_lm_head_to_fp32(target)
        add_fused_lm_head(target, temperature=temperature, cast_lm_head_to_fp32=cast_fp32)
        align_position_ids_with_generation(module)

    device = trainer.args.generation_device or trainer.accelerator.device
    common = dict(
        device=device, patch_fn=patch, gather=weight_gather(trainer), dtype=dtype, staging_device=staging_device
    )
    if trainer.args.use_transformers_continuous_batching:
        check_continuous_batching_sampling(trainer._generation_config_checked)  # before the settings' own checks
    settings = hf_generation_settings(trainer)
    if trainer.args.use_transformers_continuous_batching:
        return ContinuousBatchingBackend(
            trainer._unwrapped_model(),
            settings,
            continuous_batching=trainer.args.transformers_continuous_batching_config,
            **common,
        )
    return HFGenerateBackend(trainer._unwrapped_model(), settings, **common)


def hf_generation_settings(trainer) -> HFGenerationSettings:
    """How the ``generate`` backend samples, from the trainer's effective generation config."""
    effective = trainer._generation_config_checked
    own_stream = samples_with_own_stream(effective)
    if not own_stream:
        logger.warning(
            "This generation config is not plain sampling (%s): the generator leaves token selection to "
            "generate, which draws from the global RNG that the training thread also uses.",
            ", ".join(sampling_deviations(effective)),
        )
    behavior_logps_source = trainer.args.behavior_logps_source
    in_flight = trainer.args.in_flight_weight_updates
    if in_flight and not records_logps(effective):
        raise ValueError(
            "in_flight_weight_updates=True needs a generation config that runs one forward per generated token "
            "(no beams, assisted decoding or chunked prefill): each token's version and behavior log-prob are "
            "recorded from the forward that sampled it. Use plain sampling (num_beams=1), or set "
            "in_flight_weight_updates=False."
        )
    if behavior_logps_source == "generation" and not records_logps(effective):
        behavior_logps_source = "forward"  # beams or assisted decoding: no one-forward-per-token to record from
    processed = processed_sampling(effective) if own_stream else []
    if processed and behavior_logps_source != "generation":
        raise ValueError(
            f"Sampling with {', '.join(processed)} draws tokens from a processed distribution, whose log-probs "
            "the behavior weight needs; they are recorded only while generating, one forward per token "
            f"(behavior_logps_source={trainer.args.behavior_logps_source!r} with this generation config computes "
            "the untruncated ones only). Set behavior_logps_source='generation' without chunked prefill or "
            "assisted decoding, or leave the sampling settings at their neutral values (top_p=1.0, top_k=0, "
            "min_p=None, repetition_penalty=1.0)."
        )
    return HFGenerationSettings(
        generation_config=copy.deepcopy(trainer.generation_config),
        eos_token_ids=list(trainer.eos_token_ids),
        pad_token_id=trainer._tokenizer.pad_token_id,
        chunk_size=trainer.args.generation_batch_chunk_size,
        autocast_dtype=mixed_precision_dtype(trainer.accelerator.mixed_precision),
        behavior_logps_source=behavior_logps_source,
        temperature=trainer.temperature,
        own_random_stream=own_stream,
        record_sampling_logps=bool(processed),
        in_flight_updates=in_flight,
    )


def vllm_sampling_settings(trainer) -> VLLMSamplingSettings:
    """GRPOTrainer's sampling fields as its vLLM path passes them."""
    return VLLMSamplingSettings(
        max_tokens=trainer.max_completion_length,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k or 0,
        min_p=trainer.min_p,
        repetition_penalty=trainer.repetition_penalty,
        stop_token_ids=list(trainer.eos_token_ids),
        generation_kwargs=dict(trainer.args.generation_kwargs or {}),
    )


def _build_vllm_backend(trainer, staging_device: torch.device | None = None) -> GenerationBackend:
    from .generation.vllm.make_backend import build_vllm_backend

    args = trainer.args
    module = trainer._unwrapped_model()
    shared = None
    processes = trainer.accelerator.num_processes
    if args.vllm_mode == "server" and processes > 1 and active_lora(module) is None:
        # one full-weight server for every process: they agree on the version it holds through the process group's
        # store (built here, in the main thread, every process together)
        from .generation.vllm.shared_server import SharedServerVersions

        shared = SharedServerVersions(
            private_store("a3po-vllm-server"),
            trainer.accelerator.process_index,
            processes,
            in_flight=args.in_flight_weight_updates,
        )
    return build_vllm_backend(
        module,
        args,
        vllm_sampling_settings(trainer),
        device=torch.device(args.generation_device) if args.generation_device else trainer.accelerator.device,
        gather=weight_gather(trainer),
        process_index=trainer.accelerator.process_index,
        num_processes=processes,
        shared=shared,
        mixed_precision=trainer.accelerator.mixed_precision,
        staging_device=staging_device,
    )


# ---- the batch producer --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunPlan:
    """The shape of one ``train()`` call's loop: every micro-step, and the generation batches they train on."""

    micro_steps: list[MicroStep]
    batches: list[PlannedBatch]
    """Batch ``i`` of the run (the scored batch whose ``index`` is ``i``), with the micro-steps and versions that
    train on it."""
    micro_steps_per_batch: int
    """``steps_per_generation * num_iterations``: the micro-steps that train on one generation batch."""

    def micro_step(self, run_step: int, global_step: int, warned: bool) -> tuple[MicroStep, bool]:
        """The run's micro-step ``run_step`` (counted from the run's start), and whether the schedule's warning has
        been given: once, where the loop's optimizer step is not the one the plan predicts (the staleness bound may
        then not hold). Raises where the loop runs past the plan."""
        if run_step >= len(self.micro_steps):
            raise RuntimeError(
                f"The training loop ran more micro-steps ({run_step + 1}) than its shape predicts "
                f"({len(self.micro_steps)}); the generation batches of this run are used up."
            )
        step = self.micro_steps[run_step]
        if step.version != global_step and not warned:
            logger.warning(
                "The training loop is at optimizer step %d where its shape predicts %d; the staleness bound may not "
                "hold for this run (the generator never waits for weights the trainer cannot publish).",
                global_step,
                step.version,
            )
            warned = True
        return step, warned


def plan_run(trainer) -> RunPlan:
    """The micro-steps and generation batches of the run starting now, following the loop transformers runs
    (:mod:`a3po_trl.generation.schedule`); the trainer has read the loop's shape (``set_initial_training_values``)."""
    args = trainer.args
    shape = TrainingLoopShape(
        steps_in_epoch=trainer._steps_in_epoch,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=trainer.state.max_steps,
        start_step=trainer.state.global_step,
        skip_trained_data=not args.ignore_data_skip,
    )
    every = args.steps_per_generation * trainer.num_iterations
    micro_steps, batches = plan_run_batches(shape, every)
    return RunPlan(micro_steps, batches, every)


def build_batch_producer(trainer, plan: RunPlan, restored) -> BatchProducer:
    """The batch producer of the run ``plan`` describes, generating with the trainer's backend: its prompt batches
    (from where the run starts in the sampler's order), its rollouts, and the oldest version allowed to generate each
    batch. ``restored`` (:class:`~a3po_trl.checkpoints.run_state.RestoredRunState`) says where a resumed run's prompt
    stream stands and the versions it regenerates its next batches with (kept by the checkpoint, published again
    before the current weights: ``earlier_versions`` of :meth:`BatchProducer.start`)."""
    args = trainer.args
    planned = plan.batches
    batch_number = batch_numbers(trainer, plan)
    local_batch_size = args.per_device_train_batch_size * args.steps_per_generation
    process, processes = trainer.accelerator.process_index, trainer.accelerator.num_processes
    first_draw = restored.first_prompt_draw
    prompt_batches = repeated_prompt_batches(
        trainer.train_dataset,
        num_generations=trainer.num_generations,
        local_batch_size=local_batch_size,
        process_index=process,
        num_processes=processes,
        shuffle=trainer.shuffle_dataset,
        seed=args.seed,
        skip_batches=first_draw,
    )
    refill = None
    if args.dynamic_sampling:
        # every prompt batch a process draws has its own seed, from its position in the process's prompt stream
        settings = rollout_settings(trainer, lambda draw: first_draw + draw)
        refill = DynamicSampler(
            groups_needed=local_batch_size // trainer.num_generations,
            num_generations=trainer.num_generations,
            max_draws=args.dynamic_sampling_max_gen_batches,
            reward_weights=trainer.reward_weights.detach().float().cpu(),
            pad_token_id=trainer._tokenizer.pad_token_id,
            group_filter=resolve_group_filter(args.dynamic_sampling_filter),
            aggregation=trainer.multi_objective_aggregation,
        ).fill
    else:
        settings = rollout_settings(trainer, batch_number)
    earlier = restored.kept_versions
    first_version = min([*earlier, trainer.state.global_step])

    def min_version(index: int) -> int:
        return oldest_allowed_version(planned[index], args.max_staleness, first_version)

    check_kept_versions(trainer, earlier, [min_version(i) for i in range(len(planned))])
    producer = BatchProducer(
        backend=trainer._backend,
        prompt_batches=prompt_batches,
        rollout=lambda *args: run_rollout(settings, *args),
        min_version=min_version,
        num_batches=len(planned),
        queue_size=args.max_staleness + 1,
        asynchronous=args.async_generation,
        num_threads=args.generation_num_threads,
        poll_interval=args.generation_poll_interval,
        exact_versions=args.reproducible_generation,
        timeline=trainer.timeline,
        refill=refill,
        first_draw=first_draw,
        # every version a micro-step trains with: a checkpoint keeps those a longer continuation needs
        # (version_checkpoint.py)
        publish_through=plan.micro_steps[-1].version if plan.micro_steps else None,
    )
    return producer


def check_kept_versions(trainer, earlier: dict, assigned: list[int]) -> None:
    """Refuse a resumed ``reproducible_generation`` run that would generate a batch with a version older than the
    checkpoint's step that the checkpoint did not keep, before the generation thread fails on it: a checkpoint
    written by an older a3po-trl (which kept only the versions its own run's ``max_steps`` needed), or resumed with a
    larger ``max_staleness`` than it was written with."""
    missing = sorted({v for v in assigned if v < trainer.state.global_step} - set(earlier)) if earlier else []
    if missing:
        raise ValueError(
            f"Resuming from {trainer._resume_checkpoint} with reproducible_generation=True: this run generates "
            f"batches with weight versions {missing}, which the checkpoint does not keep (it keeps "
            f"{sorted(earlier)}). It was written by an older a3po-trl, which kept only the versions its own run's "
            "max_steps needed, or with a smaller max_staleness. Resume with the max_steps (or num_train_epochs) and "
            "max_staleness it was written with, or with reproducible_generation=False (those batches are then "
            "generated with the newest weights)."
        )


def batch_numbers(trainer, plan: RunPlan):
    """``batch_number(index)``: the global number of batch ``index`` of the run ``plan`` describes (its position in
    the sampler's order over epochs)."""
    batches_per_epoch = max(trainer._steps_in_epoch // plan.micro_steps_per_batch, 1)

    def batch_number(index: int) -> int:
        return plan.batches[index].epoch * batches_per_epoch + plan.batches[index].index_in_epoch

    return batch_number


def prompt_draws_to_keep(trainer) -> dict[int, int]:
    """``{global batch number: prompt batches this process drew before it}`` for the batches a run resumed from a
    checkpoint taken now may restart at (the one being trained and those drawn after it, up to the batch after the
    run's last: where a run resumed from its last checkpoint with a larger ``max_steps`` restarts), for the
    checkpoint."""
    producer, plan = trainer._producer, trainer._plan
    if producer is None or plan is None or not plan.batches:
        return {}
    number = batch_numbers(trainer, plan)
    last = len(plan.batches) - 1
    oldest = max(producer.consumed - 1, 0)
    kept = {}
    for index, draws in producer.draw_starts().items():
        if oldest <= index <= last:
            kept[number(index)] = draws
        elif index == last + 1:  # the run's last batch is drawn: the next batch, in its epoch or the next epoch's
            kept[number(last) + 1] = draws  # first (an epoch holds whole generation batches)
    return kept


# ---- the rollout ---------------------------------------------------------------------------------------------------
def rollout_settings(trainer, batch_numbers=None) -> RolloutSettings:
    """What the generation thread needs for its rollouts, copied. ``batch_numbers(index)`` is the global number of
    batch ``index`` of the run (its position in the sampler's order over epochs), from which its sampling seed
    derives."""
    tokenizer = copy.deepcopy(trainer.processing_class)  # the thread gets its own tokenizers
    chat_template, template_kwargs = trainer.chat_template, dict(trainer.chat_template_kwargs)

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

    args = trainer.args
    return RolloutSettings(
        tokenize_prompts=tokenize,
        decode=lambda ids, prompt_ids, prompts: decode_completions(tokenizer, ids, prompt_ids, prompts),
        eos_token_ids=list(trainer.eos_token_ids),
        pad_token_id=trainer._tokenizer.pad_token_id,
        reward_funcs=list(trainer.reward_funcs),
        reward_func_names=list(trainer.reward_func_names),
        reward_processing_classes=[copy.deepcopy(c) for c in trainer.reward_processing_classes],
        mask_truncated_completions=trainer.mask_truncated_completions,
        pad_to_multiple_of=trainer.pad_to_multiple_of,
        sampling_seeds=(
            None
            if batch_numbers is None
            else sampling_seeds(args.seed, trainer.accelerator.process_index, batch_numbers)
        ),
        deferred_reward_columns=deferred_reward_columns(trainer),
        async_loop=getattr(trainer, "async_loop", None),
        chat_template_kwargs=template_kwargs,
        agent=agent_settings(
            trainer, tokenizer, args.refresh_weights_between_turns and not args.reproducible_generation
        ),
        rollout_func=trainer.rollout_func,
        rollout_owner=trainer,
    )


def deferred_reward_columns(trainer) -> frozenset[int]:
    """Reward models whose forward is a collective (partitioned by ZeRO-3, sharded by FSDP2) are scored in the main
    thread."""
    if not shards_parameters(trainer):
        return frozenset()
    return frozenset(i for i, func in enumerate(trainer.reward_funcs) if isinstance(func, nn.Module))


def agent_settings(trainer, tokenizer, refresh_between_turns: bool) -> AgentSettings | None:
    """The multi-turn settings of a GRPOTrainer set up with ``tools`` or ``environment_factory`` (None otherwise);
    ``tokenizer`` is the generation thread's own copy."""
    factories = getattr(trainer, "environment_factories", None)
    if not trainer.tools and factories is None:
        return None
    environment_tools = dict(trainer._env_tools) if factories is not None else {}
    backend_limit = trainer.args.vllm_max_model_length if trainer.args.use_vllm else None
    config = trainer._unwrapped_model().config
    model_limit = getattr(getattr(config, "text_config", config), "max_position_embeddings", None)
    return AgentSettings(
        tokenizer=tokenizer,
        chat_template=trainer.chat_template,
        chat_template_kwargs=dict(trainer.chat_template_kwargs),
        standalone_tools=list(trainer._standalone_tools),
        environment_factories=factories,
        environment_tools=environment_tools,
        multi_environment=bool(getattr(trainer, "_multi_environment", False)),
        max_tool_calling_iterations=trainer.max_tool_calling_iterations,
        max_completion_length=trainer.max_completion_length,
        max_model_len=backend_limit or model_limit or (1 << 62),
        tool_call_timeout=trainer.args.tool_call_timeout,
        refresh_between_turns=refresh_between_turns,
        async_loop=getattr(trainer, "async_loop", None),
    )
