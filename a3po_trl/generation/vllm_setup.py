"""From a trainer's ``GRPOConfig`` vLLM fields to a vLLM backend, and the checks of what cannot be honoured.

``use_vllm=True`` keeps every GRPOConfig vLLM field's meaning where this trainer can honour it, and refuses the rest
with the fix:

- ``vllm_mode``: ``"colocate"`` (:class:`~a3po_trl.generation.vllm_colocate.VLLMColocateBackend`) or ``"server"``
  (:class:`~a3po_trl.generation.vllm_server.VLLMServerBackend`);
- ``vllm_gpu_memory_utilization``, ``vllm_max_model_length``, ``vllm_model_impl``, ``trust_remote_code``: passed to
  the in-process engine (colocate); the server's are set where it is started;
- ``vllm_server_base_url`` / ``vllm_server_host`` / ``vllm_server_port``, ``vllm_server_timeout``,
  ``vllm_group_port``: the server (see :mod:`.vllm_server`);
- ``vllm_importance_sampling_*``: the inference/training mismatch is what A-3PO's behavior weight
  ``pi_prox / pi_behav`` already corrects (the behavior log-probs are vLLM's); it is capped by ``behavior_weight_cap``
  and ``behavior_weight_cap_mode``, so TRL's separate correction is not applied again. Changing its settings is an
  error that names the fields to use instead;
- ``vllm_enable_sleep_mode``, ``vllm_structured_outputs_regex``, ``vllm_tensor_parallel_size > 1`` in colocate mode:
  refused (see :func:`check_vllm_settings`);
- ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and the ``generation_kwargs`` that process the sampling
  distribution (penalties, banned or biased tokens, minimum lengths): refused unless neutral. vLLM reports the
  log-probs of the processed distribution it samples from (``processed_logprobs``) and nothing else, while A-3PO
  anchors its trust region at the untruncated policy that the trainer's forward reproduces; the ``generate`` backend
  records both and supports these settings.
"""

from __future__ import annotations

import logging
import os
import tempfile

import torch
from trl import GRPOConfig

from .vllm_common import VLLMSamplingSettings, active_lora, base_checkpoint_tensors, unsupported_lora_reason

logger = logging.getLogger(__name__)

_VLLM_MODES = ("colocate", "server")

#: vLLM sampling parameters that process the distribution tokens are drawn from, with their neutral values.
_NEUTRAL_SAMPLING = {
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "min_tokens": (None, 0),
    "bad_words": (None, []),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "logits_processors": (None, []),
    "structured_outputs": (None,),
    "guided_decoding": (None,),
}


def check_vllm_sampling(args) -> None:
    """Refuse sampling settings under which vLLM draws from a processed distribution (``use_vllm=True``).

    vLLM returns one log-prob per sampled token, of the distribution it sampled from after penalties, temperature,
    min-p and top-k/top-p, renormalised over the kept tokens. That is the true behavior policy, but not the
    untruncated ``softmax(logits / T)`` that the trainer's forward scores and that A-3PO's proximal policy is anchored
    at: a fully on-policy token would get the ratio ``pi_theta / pi_prox`` equal to the kept probability mass instead
    of 1 (0.8 at ``top_p=0.8``; at 0.7 every negative-advantage token is clipped away). The ``generate`` backend
    records both log-probs (:class:`~a3po_trl.sampling.GenerationLogpsRecorder`)."""
    settings = {name: getattr(args, name) for name in ("top_p", "top_k", "min_p", "repetition_penalty")}
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    settings.update({name: value for name, value in kwargs.items() if name in _NEUTRAL_SAMPLING})
    for name, value in settings.items():
        neutral = _NEUTRAL_SAMPLING[name]
        if value not in neutral:
            where = "generation_kwargs" if name in kwargs else "the config"
            raise ValueError(
                f"{name}={value!r} (in {where}) is not supported with use_vllm=True: vLLM reports only the log-probs "
                f"of the distribution it samples from after {name}, not those of the untruncated policy that "
                "A-3PO's trust region is anchored at, so even on-policy tokens would be clipped by the kept "
                f"probability mass. Set {name}={neutral[1]!r}, or generate with use_vllm=False: the generate "
                f"backend records both log-probs and supports {name}."
            )


def check_vllm_settings(args) -> None:
    """Refuse, before any model is loaded, the vLLM settings this trainer cannot honour (``use_vllm=True``)."""
    if not args.use_vllm:
        return
    if args.vllm_mode not in _VLLM_MODES:
        raise ValueError(f"vllm_mode={args.vllm_mode!r} must be one of {_VLLM_MODES}.")
    check_vllm_sampling(args)
    defaults = GRPOConfig.__dataclass_fields__
    if not args.vllm_importance_sampling_correction:
        raise ValueError(
            "vllm_importance_sampling_correction=False cannot be honoured by AsyncA3POTrainer: the behavior log-probs "
            "are vLLM's, and the decoupled objective's behavior weight pi_prox / pi_behav corrects both staleness "
            "and the vLLM/trainer mismatch; it cannot be turned off. Leave it True (its cap is behavior_weight_cap)."
        )
    for name in (
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
    ):
        if getattr(args, name) != defaults[name].default:
            raise ValueError(
                f"{name}={getattr(args, name)!r} is not used by AsyncA3POTrainer: the vLLM/trainer mismatch is "
                "corrected by the decoupled objective's behavior weight pi_prox / pi_behav, capped by "
                "behavior_weight_cap and behavior_weight_cap_mode (modes token_mask, token_truncate, sequence_mask, "
                f"sequence_truncate). Set those instead and leave {name} at its default."
            )
    if args.vllm_enable_sleep_mode:
        raise ValueError(
            "vllm_enable_sleep_mode=True is not supported: the engine generates while the trainer trains, so its "
            "memory cannot be released between steps. Lower vllm_gpu_memory_utilization to leave the trainer room."
        )
    if args.vllm_structured_outputs_regex is not None:
        raise ValueError(
            "vllm_structured_outputs_regex is not supported by AsyncA3POTrainer: constrained decoding samples from a "
            "masked distribution that the training log-probs do not score. Remove it, or use trl.GRPOTrainer."
        )
    if args.vllm_mode == "colocate" and args.vllm_tensor_parallel_size != 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} is not supported in colocate mode (each "
            "process's generation thread drives its own engine, and tensor parallelism would need collectives from "
            "that thread). Use vllm_mode='server' with a tensor-parallel server (`trl vllm-serve "
            "--tensor-parallel-size N`), or vllm_tensor_parallel_size=1."
        )


def sampling_settings(trainer) -> VLLMSamplingSettings:
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


def engine_dtype(module: torch.nn.Module) -> str:
    """The engine's dtype: the training weights' (vLLM's ``auto`` would turn an fp32 model into bf16 on CPU)."""
    dtype = next(module.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


def base_model_path(trainer) -> str:
    """Where the engine loads the base model from: the model's local directory or hub id, else a copy saved now."""
    module = trainer._unwrapped_model()
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    name = str(getattr(base.config, "_name_or_path", "") or "")
    if os.path.isfile(os.path.join(name, "config.json")):
        return name  # a local checkpoint
    if name.count("/") == 1 and not name.startswith((".", "/")) and not os.path.exists(name):
        return name  # a hub id: the engine downloads it as GRPOTrainer's does
    directory = tempfile.mkdtemp(prefix="a3po-vllm-model-")
    logger.info("Saving the base model to %s for the vLLM engine (it has no checkpoint directory).", directory)
    if hasattr(module, "get_base_model"):  # the base weights under their checkpoint names, without the adapters
        base.save_pretrained(directory, state_dict=base_checkpoint_tensors(module))
    else:
        base.save_pretrained(directory)
    return directory


def _serves_as_adapter(module) -> bool:
    lora = active_lora(module)
    return lora is not None and unsupported_lora_reason(lora[1]) is None


def build_vllm_backend(trainer):
    """The vLLM backend for ``trainer`` (``use_vllm=True``), colocate or server."""
    args = trainer.args
    module = trainer._unwrapped_model()
    device = torch.device(args.generation_device) if args.generation_device else trainer.accelerator.device
    processes = trainer.accelerator.num_processes
    if processes > 1 and not (args.vllm_mode == "server" and _serves_as_adapter(module)):
        raise NotImplementedError(
            f"use_vllm=True with {processes} training processes works with vllm_mode='server' and a LoRA adapter "
            "only (each process loads its own adapter per version into the server, so no process changes weights "
            "another one generates with). An in-process engine (colocate) would join the training process group, "
            "and a full-weight reload on a shared server would change the weights under the other processes' "
            "requests. Use a LoRA peft_config with a server, one training process, or the default generate backend "
            "(use_vllm=False) with DDP / DeepSpeed."
        )
    sampling = sampling_settings(trainer)
    gather = trainer._zero3_gather()
    if args.vllm_mode == "server":
        from .vllm_server import VLLMServerBackend

        return VLLMServerBackend(module, args, sampling, device=device, gather=gather)
    from .vllm_colocate import VLLMColocateBackend

    if device.type == "cpu" and (args.generation_num_threads or args.training_num_threads):
        logger.warning(
            "generation_num_threads / training_num_threads have no effect with an in-process vLLM engine on CPU: it "
            "turns torch.set_num_threads into a no-op for the whole process. Set OMP_NUM_THREADS before starting "
            "instead (it sets the threads of both the engine and the training thread)."
        )
    local_batch = args.per_device_train_batch_size * args.steps_per_generation
    max_model_len = args.vllm_max_model_length
    engine_kwargs = dict(
        dtype=engine_dtype(module),
        max_model_len=max_model_len,
        max_num_seqs=local_batch,
        max_num_batched_tokens=max(4096, max_model_len or 0),
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code,
        seed=args.seed + trainer.accelerator.process_index,
        enforce_eager=device.type == "cpu",
        skip_tokenizer_init=True,  # prompts arrive as token ids, completions leave as token ids
    )
    return VLLMColocateBackend(module, base_model_path(trainer), sampling, engine_kwargs, device=device, gather=gather)
