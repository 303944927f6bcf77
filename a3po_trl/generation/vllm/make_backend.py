"""From a trainer's ``GRPOConfig`` vLLM fields to a vLLM backend (the checks of what cannot be honoured are in
:mod:`a3po_trl.validation`).

``use_vllm=True`` keeps every GRPOConfig vLLM field's meaning where this trainer can honour it, and refuses the rest
with the fix:

- ``vllm_mode``: ``"colocate"`` (:class:`~a3po_trl.generation.vllm.colocate.VLLMColocateBackend`) or ``"server"``
  (:class:`~a3po_trl.generation.vllm.server.VLLMServerBackend`);
- ``vllm_gpu_memory_utilization``, ``vllm_max_model_length``, ``vllm_model_impl``, ``trust_remote_code``: passed to
  the in-process engine (colocate); the server's are set where it is started;
- ``vllm_server_base_url`` / ``vllm_server_host`` / ``vllm_server_port``, ``vllm_server_timeout``,
  ``vllm_group_port``: the server (see :mod:`.server`);
- ``vllm_importance_sampling_*``: the inference/training mismatch is what A-3PO's behavior weight
  ``pi_prox / pi_behav`` already corrects (the behavior log-probs are vLLM's); it is capped by ``behavior_weight_cap``
  and ``behavior_weight_cap_mode``, so TRL's separate correction is not applied again. Changing its settings is an
  error that names the fields to use instead;
- ``vllm_enable_sleep_mode``, ``vllm_structured_outputs_regex``, ``vllm_tensor_parallel_size > 1`` in colocate mode:
  refused (see :func:`a3po_trl.validation.check_vllm_settings`);
- ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and the ``generation_kwargs`` that process the sampling
  distribution (penalties, banned or biased tokens, minimum lengths): refused unless neutral. vLLM reports the
  log-probs of the processed distribution it samples from (``processed_logprobs``) and nothing else, while A-3PO
  anchors its trust region at the untruncated policy that the trainer's forward reproduces; the ``generate`` backend
  records both and supports these settings.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile

import torch

from ...patches import peft_base_model
from ...runtime.devices import explicit_device
from ..weights import as_parameter_gather, checkpoint_dtype, generator_dtype, vllm_weight_name
from ..weights.precision import bf16_supported, vllm_dtype_name
from ..weights.store import staged_dtype
from .sampling import VLLMSamplingSettings
from .weight_loading import base_checkpoint_tensors, is_base_weight

logger = logging.getLogger(__name__)


def engine_dtype(module: torch.nn.Module, device: torch.device, mixed_precision: str | None) -> torch.dtype:
    """The dtype the engine holds the weights in (:func:`~a3po_trl.generation.weights.generator_dtype`): the trainer's
    mixed-precision dtype; on a GPU in full precision the checkpoint's (vLLM's ``auto``, as TRL's engines); on CPU
    in full precision the training weights' (vLLM's ``auto`` would serve a float32 model in bfloat16 there)."""
    base = peft_base_model(module)
    dtype = generator_dtype(
        backend="vllm",
        device=device,
        mixed_precision=mixed_precision,
        checkpoint=checkpoint_dtype(base.config),
        bf16_supported=bf16_supported(device),
    )
    if dtype is not None:
        return dtype
    return next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)


def base_model_path(module: torch.nn.Module, gather=None, dtype: torch.dtype | None = None) -> str:
    """Where the engine loads the base model of the training ``module`` from: its local directory or hub id, else a
    copy saved now. ``gather``: the trainer's :class:`~a3po_trl.generation.weights.ParameterGather`; when the
    parameters are sharded (FSDP2, ZeRO-3) the copy is written from whole tensors gathered one at a time, which is a
    collective: called in the main thread of every process together (the backends are built in ``_start_producer``),
    and every process gathers every tensor whatever its own checks found: the processes first agree whether any of
    them needs the copy (a checkpoint directory may exist on one machine and not on another)."""
    base = peft_base_model(module)
    name = str(getattr(base.config, "_name_or_path", "") or "")
    gather = as_parameter_gather(gather)
    found = _existing_model_path(name)
    if gather.sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, found is not None)
        found = found if all(everyone) else None
    if found is not None:
        return found
    directory = tempfile.mkdtemp(prefix="a3po-vllm-model-")
    logger.info("Saving the base model to %s for the vLLM engine (it has no checkpoint directory).", directory)
    if gather.sharded:
        write_gathered_checkpoint(module, directory, gather, dtype=dtype)
    elif hasattr(module, "get_base_model"):  # the base weights under their checkpoint names, without the adapters
        base.save_pretrained(directory, state_dict=base_checkpoint_tensors(module))
    else:
        base.save_pretrained(directory)
    return directory


def _existing_model_path(name: str) -> str | None:
    """``name`` when it is a local checkpoint directory or a hub id (the engine downloads it as GRPOTrainer's does)."""
    if os.path.isfile(os.path.join(name, "config.json")):
        return name
    if name.count("/") == 1 and not name.startswith((".", "/")) and not os.path.exists(name):
        return name
    return None


def write_gathered_checkpoint(
    module: torch.nn.Module, directory: str, gather, shard_bytes: int = 2**30, dtype: torch.dtype | None = None
) -> None:
    """Write the base model of a sharded ``module`` (a causal LM, or a PEFT model around one: its base weights
    only, under their checkpoint names) as a Hugging Face checkpoint vLLM loads: ``config.json`` naming the
    unsharded class (``fully_shard`` renames it ``FSDP<Class>``) and safetensors files of at most ``shard_bytes``
    each with their index. Each parameter is gathered whole on every process (``gather``, in order), copied to CPU
    and written once ``shard_bytes`` have been collected: the whole model never sits in memory beside the shards.
    Floating tensors are written in ``dtype`` (the engine's; None: as gathered).
    Parameters tied to another (a tied LM head) appear once, under the first name, as ``save_pretrained`` writes
    them; buffers are not written (vLLM does not load them). A process that fails to write keeps gathering to the
    end, so that the others are not left in a collective, and raises then."""
    from safetensors.torch import save_file

    from ..weights.copies import unsharded_class

    base = peft_base_model(module)
    is_peft = hasattr(module, "get_base_model")
    named = [(n, p) for n, p in module.named_parameters() if not is_peft or is_base_weight(module, n)]
    files, weight_map, pending, size, failure = [], {}, {}, 0, None

    def flush():
        nonlocal pending, size, failure
        if pending and failure is None:
            try:
                files.append(f"model-{len(files) + 1:05d}.safetensors")
                save_file(pending, os.path.join(directory, files[-1]), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(pending, files[-1]))
            except Exception as error:  # noqa: BLE001 - raised once every tensor was gathered
                failure = error
        pending, size = {}, 0

    for name, tensor in gather.full_tensors(named):
        if failure is None:
            value = tensor.to("cpu", dtype=staged_dtype(tensor.dtype, dtype), copy=True).contiguous()
            pending[vllm_weight_name(name)] = value
            size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    if failure is not None:
        raise RuntimeError(f"Could not write the gathered base model to {directory} for the vLLM engine.") from failure
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = copy.deepcopy(base.config)
    config.architectures = [unsharded_class(base).__name__]
    config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)


def build_vllm_backend(
    module: torch.nn.Module,
    args,
    sampling: VLLMSamplingSettings,
    device: torch.device,
    gather,
    process_index: int,
    num_processes: int,
    shared=None,
    mixed_precision: str | None = None,
    staging_device: torch.device | None = None,
):
    """The vLLM backend (``use_vllm=True``), colocate or server, for the unwrapped training ``module`` with the
    trainer's ``args`` (an :class:`~a3po_trl.AsyncA3POConfig`) and sampling settings. ``shared``: a
    :class:`~a3po_trl.generation.vllm.shared_server.SharedServerVersions` when several processes share a server with
    full weights. ``mixed_precision``: the trainer's (accelerate's setting), which sets the engine's dtype
    (:func:`engine_dtype`). ``staging_device``: colocate only, where versions are staged (the memory plan's choice;
    None: host memory)."""
    device = explicit_device(device)
    if args.vllm_mode == "server":
        from .server import VLLMServerBackend

        return VLLMServerBackend(
            module, args, sampling, device=device, gather=gather, shared=shared, mixed_precision=mixed_precision
        )
    from .colocate import VLLMColocateBackend

    if device.type == "cpu" and (args.generation_num_threads or args.training_num_threads):
        logger.warning(
            "generation_num_threads / training_num_threads have no effect with an in-process vLLM engine on CPU: it "
            "turns torch.set_num_threads into a no-op for the whole process. Set OMP_NUM_THREADS before starting "
            "instead (it sets the threads of both the engine and the training thread)."
        )
    local_batch = args.per_device_train_batch_size * args.steps_per_generation
    max_model_len = args.vllm_max_model_length
    dtype = engine_dtype(module, device, mixed_precision)
    engine_kwargs = dict(
        dtype=vllm_dtype_name(dtype),
        max_model_len=max_model_len,
        max_num_seqs=local_batch,
        max_num_batched_tokens=max(4096, max_model_len or 0),
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code,
        seed=args.seed + process_index,
        enforce_eager=device.type == "cpu",
        skip_tokenizer_init=True,  # prompts arrive as token ids, completions leave as token ids
    )
    in_flight = bool(getattr(args, "in_flight_weight_updates", False))
    if in_flight:
        # in-flight loads go between engine steps: no step may still run then (async scheduling overlaps them on GPU;
        # vLLM's CPU platform turns it off anyway)
        engine_kwargs["async_scheduling"] = False
    if num_processes > 1:
        # One engine per training process, as TRL's colocate mode runs them: the engine joins the process group the
        # launcher set up (RANK / LOCAL_RANK / WORLD_SIZE), takes the process's own device, and builds its parallel
        # groups over it while it starts (collectives in the main thread, every process together: backends are
        # built in _start_producer, which every process reaches at the same step). Each group holds this process
        # alone (tensor, pipeline and data parallel size 1), so generating never communicates with another process.
        engine_kwargs["distributed_executor_backend"] = "external_launcher"
    model_path = base_model_path(module, gather, dtype)
    return VLLMColocateBackend(
        module,
        model_path,
        sampling,
        engine_kwargs,
        device=device,
        gather=gather,
        dtype=dtype,
        staging_device=staging_device,
        in_flight_updates=in_flight,
    )
