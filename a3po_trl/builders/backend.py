"""The generation backend, read off the trainer once: Hugging Face ``generate`` (or transformers' continuous
batching) on the generator's own copy, or vLLM, its memory planned first, and its sampling settings."""

from __future__ import annotations

import copy
import functools
import logging

import torch
from trl.trainer.utils import add_fused_lm_head

from ..generation.backend import GenerationBackend
from ..generation.cpu_threads import CPUThreads, choose_cpu_threads
from ..generation.hf import HFGenerateBackend, HFGenerationSettings
from ..generation.hf.continuous_batching import ContinuousBatchingBackend, check_continuous_batching_sampling
from ..generation.hf.process import ProcessGenerateBackend
from ..generation.hf.sampling import processed_sampling, records_logps, samples_with_own_stream, sampling_deviations
from ..generation.vllm.make_backend import engine_dtype
from ..generation.vllm.sampling import VLLMSamplingSettings
from ..generation.vllm.weight_loading import active_lora, unsupported_lora_reason
from ..generation.weights import (
    checkpoint_dtype,
    generator_dtype,
    mixed_precision_dtype,
)
from ..generation.weights.memory_plan import (
    GeneratorSetup,
    available_host_memory,
    free_device_memory,
    kv_bytes_per_token,
    plan_generator_memory_choosing_staging,
    processes_on_node,
)
from ..patches import align_position_ids_with_generation, cast_lm_head_to_fp32, peft_base_model
from ..runtime.devices import explicit_device
from ..runtime.distributed import private_store
from .sharding import shards_parameters, uses_fsdp2, weight_gather

logger = logging.getLogger(__name__)


def cpu_threads(trainer, available: int) -> CPUThreads:
    """The intra-op thread counts ``train()`` sets (:mod:`a3po_trl.generation.cpu_threads`): the generation thread
    shares the CPU where it runs ``generate`` on this process's CPU beside training (not vLLM, not synchronous)."""
    args = trainer.args
    device = torch.device(args.generation_device or trainer.accelerator.device)
    on_cpu = device.type == "cpu" and trainer.accelerator.device.type == "cpu"
    shares = on_cpu and args.async_generation and not trainer._use_vllm_backend
    in_process = shares and getattr(args, "generation_process", False)
    return choose_cpu_threads(args, trainer._unwrapped_model().config, shares, available, in_process)


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
    """Which engine generates the run's completions, and in which thread (or process), as the log names it: ``HF
    generate``, ``transformers continuous batching``, ``vLLM colocate`` or ``vLLM server``."""
    if trainer._use_vllm_backend:
        engine = f"vLLM {trainer.args.vllm_mode}"
    elif trainer.args.use_transformers_continuous_batching:
        engine = "transformers continuous batching"
    else:
        engine = "HF generate"
    thread = "the generation thread" if trainer.args.async_generation else "the main thread (async_generation=False)"
    if trainer.args.generation_process and not trainer._use_vllm_backend:
        return f"{engine}, in a process of its own (generation_process), coordinated by {thread}"
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
        keeps_previous_weights=args.prox_logp_method == "guarded",
        parameter_shards=processes if shards_parameters(trainer) else 1,
        training_device_total_bytes=(
            torch.cuda.get_device_properties(training_device).total_memory if training_device.type == "cuda" else None
        ),
        **generation,
    )


def patch_generator_copy(module, temperature: float, cast_fp32: bool) -> None:
    """Re-apply to the generator's copy what the trainer applied to the training model (the copy is stripped of the
    instance patches, which close over the training module). A module-level function, so that
    ``functools.partial(patch_generator_copy, ...)`` can be sent to a generation process."""
    target = peft_base_model(module)
    if cast_fp32:
        cast_lm_head_to_fp32(target)
    add_fused_lm_head(target, temperature=temperature, cast_lm_head_to_fp32=cast_fp32)
    align_position_ids_with_generation(module)


def _build_hf_backend(trainer, dtype: torch.dtype | None, staging_device=None) -> GenerationBackend:
    """The ``generate`` backend on the generator's own copy; with ``use_transformers_continuous_batching``, the same
    copy generating with transformers' continuous batching (:class:`ContinuousBatchingBackend`); with
    ``generation_process``, in a process of its own (:class:`ProcessGenerateBackend`). Its versions are staged on
    ``staging_device`` (the memory plan's choice; None: the generation device)."""
    patch = functools.partial(
        patch_generator_copy, temperature=trainer.temperature, cast_fp32=trainer.args.cast_lm_head_to_fp32
    )
    if trainer.args.generation_process:
        return _build_process_backend(trainer, dtype, patch)
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


def _build_process_backend(trainer, dtype: torch.dtype | None, patch) -> ProcessGenerateBackend:
    """The ``generate`` backend in a process of its own (``generation_process``), refused where it is not built:
    a GPU, sharded weights. Its start-up seconds are said once at INFO."""
    check_generation_process_devices(trainer)
    if shards_parameters(trainer):
        raise ValueError(
            "generation_process=True is not built for sharded training weights (DeepSpeed ZeRO-3, FSDP2): the "
            "process would need the gathered model. Set generation_process=False."
        )
    backend = ProcessGenerateBackend(
        trainer._unwrapped_model(),
        hf_generation_settings(trainer),
        patch_fn=patch,
        gather=weight_gather(trainer),
        dtype=dtype,
        num_threads=trainer.cpu_threads.generation,
        poll_interval=trainer.args.generation_poll_interval,
        stop_timeout=trainer.args.generation_stop_timeout,
    )
    logger.info(
        "Process %d: generation runs in a process of its own (generation_process, pid %d, %s intra-op threads): "
        "started in %.1f s",
        trainer.accelerator.process_index,
        backend.pid,
        trainer.cpu_threads.generation or "PyTorch's count of",
        backend.start_seconds,
    )
    return backend


def check_generation_process_devices(trainer) -> None:
    """Refuse ``generation_process`` where generation or training runs on a GPU: the versions would cross through
    CUDA IPC handles, which are not built."""
    devices = {
        explicit_device(trainer.args.generation_device or trainer.accelerator.device),
        trainer.accelerator.device,
    }
    if any(torch.device(device).type != "cpu" for device in devices):
        raise ValueError(
            f"generation_process=True runs on the CPU only (devices here: {sorted(map(str, devices))}): on a GPU the "
            "weight versions would cross to the process through CUDA IPC handles, which is not built yet. Set "
            "generation_process=False (on a GPU the generation thread's kernels do not wait for the interpreter: "
            "see docs/GPU.md)."
        )


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
    from ..generation.vllm.make_backend import build_vllm_backend

    args = trainer.args
    module = trainer._unwrapped_model()
    shared = None
    processes = trainer.accelerator.num_processes
    if args.vllm_mode == "server" and processes > 1 and active_lora(module) is None:
        # one full-weight server for every process: they agree on the version it holds through the process group's
        # store (built here, in the main thread, every process together)
        from ..generation.vllm.shared_server import SharedServerVersions

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
