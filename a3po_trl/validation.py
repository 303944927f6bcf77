"""What the trainer cannot honour, refused with the fix before training starts: settings and datasets before any model
loads, then what the loaded model and its generation config show (dropout, the sampling distribution's temperature).
"""

from __future__ import annotations

import copy
import logging

from datasets import IterableDataset
from torch import nn
from trl import GRPOConfig

from .generation.hf.continuous_batching import (
    check_continuous_batching_available,
    check_continuous_batching_config,
    check_continuous_batching_sampling,
)
from .generation.hf.sampling import processed_sampling, samples_with_own_stream, sampling_deviations
from .generation.vllm.in_flight import IN_FLIGHT_LORA_REFUSAL
from .generation.vllm.server_in_flight import IN_FLIGHT_SERVER_LORA_REFUSAL
from .patches import peft_base_model
from .rollout.reward_workers import check_sendable

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
    records both log-probs (:class:`~a3po_trl.generation.hf.sampling.GenerationLogpsRecorder`)."""
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


def check_continuous_batching_settings(args) -> None:
    """Refuse, before any model is loaded, what ``use_transformers_continuous_batching=True`` cannot honour: together
    with vLLM, sampling settings that process the distribution, an invalid ``transformers_continuous_batching_config``
    (see :mod:`a3po_trl.generation.hf.continuous_batching`)."""
    if not args.use_transformers_continuous_batching:
        return
    if args.use_vllm:
        raise ValueError(
            "use_transformers_continuous_batching=True and use_vllm=True both choose how completions are generated. "
            "Set one of them (GRPOTrainer would silently use vLLM)."
        )
    check_continuous_batching_available()
    settings = {name: getattr(args, name) for name in ("top_p", "top_k", "min_p", "repetition_penalty")}
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    settings.update({name: value for name, value in kwargs.items() if name in _NEUTRAL_SAMPLING})
    processed = [f"{name}={value!r}" for name, value in settings.items() if value not in _NEUTRAL_SAMPLING[name]]
    if processed:
        raise ValueError(
            f"use_transformers_continuous_batching=True samples from softmax(logits / temperature) only, but "
            f"{', '.join(processed)} processes that distribution (continuous batching drops the processors it does "
            "not support, and its log-probs are those of the processed distribution). Leave them at their neutral "
            "values (top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0), or set "
            "use_transformers_continuous_batching=False: the generate backend records both log-probs."
        )
    check_continuous_batching_config(args.transformers_continuous_batching_config, args.reproducible_generation)


def check_in_flight_updates(args, kwargs: dict) -> None:
    """Refuse, before any model is loaded, what ``in_flight_weight_updates=True`` cannot do yet (or at all), naming
    the setting and the fix: it is never silently degraded to loading versions between batches."""
    if not getattr(args, "in_flight_weight_updates", False):
        return
    prefix = "in_flight_weight_updates=True"
    if args.use_vllm and kwargs.get("peft_config") is not None:
        raise NotImplementedError(
            IN_FLIGHT_SERVER_LORA_REFUSAL if args.vllm_mode == "server" else IN_FLIGHT_LORA_REFUSAL
        )
    if getattr(args, "behavior_logps_source", "generation") != "generation":
        raise ValueError(
            f"{prefix} needs behavior_logps_source='generation': each token's behavior log-prob must be the one the "
            "weights that sampled it gave it, recorded while generating; a forward after generation would score "
            "every token with the weights loaded last. Set behavior_logps_source='generation'."
        )
    if getattr(args, "reproducible_generation", False):
        raise ValueError(
            f"{prefix} cannot be combined with reproducible_generation=True: where a completion switches to a newer "
            "version depends on when the trainer publishes it (timing), so two runs would not be identical. Set "
            "in_flight_weight_updates=False for reproducible runs, or reproducible_generation=False."
        )
    if not getattr(args, "async_generation", True):
        raise ValueError(
            f"{prefix} needs async_generation=True: with the generator in the main thread, the trainer publishes "
            "nothing while a batch is generated, so there is never a version to load mid-batch. Set "
            "async_generation=True, or in_flight_weight_updates=False."
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise NotImplementedError(
            f"{prefix} is not supported with use_transformers_continuous_batching=True yet: continuous batching runs "
            "its own decode loop, which this library does not yet interrupt to load a version. Set "
            "use_transformers_continuous_batching=False, or in_flight_weight_updates=False."
        )
    if kwargs.get("rollout_func") is not None:
        raise NotImplementedError(
            f"{prefix} is not supported with a rollout_func yet: a rollout_func drives its own generation and returns "
            "one version per call, not the version of each token. Set in_flight_weight_updates=False, or use "
            "tools / environment_factory (multi-turn rollouts tag every token)."
        )


def check_supported(args: GRPOConfig, kwargs: dict) -> None:
    """Reject, before any model is loaded, the GRPOTrainer options this trainer cannot honour."""
    check_vllm_settings(args)
    check_continuous_batching_settings(args)
    check_in_flight_updates(args, kwargs)
    if args.use_vllm and getattr(args, "behavior_logps_source", "generation") == "forward":
        raise ValueError(
            "behavior_logps_source='forward' needs the generator's own Hugging Face model; with use_vllm=True the "
            "behavior log-probs are the engine's (of the temperature-scaled distribution, processed_logprobs). Set "
            "behavior_logps_source='generation'."
        )
    processed = [
        f"{name}={getattr(args, name)!r}"
        for name, neutral in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0))
        if getattr(args, name) not in (neutral, None)
    ]
    if not args.use_vllm and getattr(args, "behavior_logps_source", "generation") == "forward" and processed:
        raise ValueError(
            f"Sampling with {', '.join(processed)} draws tokens from a processed distribution, whose log-probs the "
            "behavior weight needs; behavior_logps_source='forward' computes the untruncated ones only. Set "
            "behavior_logps_source='generation' (the generator records both while generating), or leave the sampling "
            "settings at their neutral values."
        )
    if getattr(args, "generation_process", False) and (kwargs.get("tools") or kwargs.get("environment_factory")):
        raise NotImplementedError(
            "generation_process=True is built and tested for single-turn rollouts only: multi-turn rollouts (tools, "
            "environment_factory) are not supported with it yet. Set generation_process=False."
        )
    if kwargs.get("rollout_func") is not None and (kwargs.get("tools") or kwargs.get("environment_factory")):
        raise NotImplementedError(
            "rollout_func together with tools or environment_factory is not supported by AsyncA3POTrainer: pass "
            "either a rollout_func (which then runs its own tool calls) or tools / environment_factory."
        )


def check_train_dataset(dataset, environment_owns_prompts: bool = False) -> None:
    """A dataset the trainer can draw generation batches from (with an ``environment_factory``, the environment's
    ``reset`` may supply the prompts, so a ``prompt`` column is optional, as in GRPOTrainer)."""
    if dataset is None or isinstance(dataset, IterableDataset):
        return
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty; it needs at least one generation batch worth of prompts.")
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns and not environment_owns_prompts:
        raise ValueError(
            f"train_dataset has no 'prompt' column (columns: {columns}). Rename the column holding the prompts, "
            "e.g. dataset.rename_column('question', 'prompt')."
        )


def check_trainer(trainer) -> None:
    """Refuse, once GRPOTrainer has set the trainer up, what needs the loaded model or dataset to be seen; warn about
    dropout left on."""
    if trainer._is_vlm:
        raise NotImplementedError(
            "AsyncA3POTrainer does not support vision-language models yet (its generator scores text only); "
            "train them with trl.GRPOTrainer, or pass a text-only causal LM."
        )
    if trainer.is_fsdp_enabled and not trainer.accelerator.is_fsdp2:
        raise NotImplementedError(
            "FSDP1 (fsdp_version: 1) is not supported: the generator's weights are gathered per parameter with "
            "FSDP2's DTensor.full_tensor(). Set `fsdp_version: 2` in the accelerate config "
            "(examples/accelerate_configs/fsdp2.yaml), or fsdp_config={'version': 2} in the training arguments; or "
            "use DDP or DeepSpeed ZeRO-2/3."
        )
    if trainer.train_dataset is not None and hasattr(trainer.train_dataset, "__len__"):
        prompts_needed = trainer.args.generation_batch_size // trainer.num_generations
        if len(trainer.train_dataset) < prompts_needed:
            raise ValueError(
                f"train_dataset has {len(trainer.train_dataset)} prompts, fewer than one generation batch needs "
                f"({prompts_needed} = generation_batch_size {trainer.args.generation_batch_size} / num_generations "
                f"{trainer.num_generations}). Add prompts or lower per_device_train_batch_size or "
                "steps_per_generation."
            )
    _check_dynamic_sampling(trainer)
    _check_reward_workers(trainer)
    _warn_about_dropout(trainer)


def _check_reward_workers(trainer) -> None:
    """With ``reward_num_workers > 0`` every reward function must be sendable to a process, and no environment may be
    passed to them (environments live in the trainer's process, and their state is what ``get_reward`` reads)."""
    if not trainer.args.reward_num_workers:
        return
    if getattr(trainer, "environment_factories", None) is not None:
        raise ValueError(
            "reward_num_workers > 0 cannot be combined with environment_factory: reward functions receive the "
            "environments of the trainer's process, whose state a worker process cannot see. Set "
            "reward_num_workers=0."
        )
    check_sendable(trainer.reward_funcs, trainer.reward_func_names)


def _check_dynamic_sampling(trainer) -> None:
    """Dynamic sampling filters groups in the generation thread, so every reward must be scored there: a reward
    model whose forward is a collective (partitioned by ZeRO-3, sharded by FSDP2) is scored in the main thread."""
    args = trainer.args
    if not args.dynamic_sampling:
        return
    from .rollout.dynamic_sampling import resolve_group_filter

    resolve_group_filter(args.dynamic_sampling_filter)  # a dotted path that does not import fails now
    zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    fsdp2 = trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2
    if (zero3 or fsdp2) and any(isinstance(func, nn.Module) for func in trainer.reward_funcs):
        raise NotImplementedError(
            "dynamic_sampling=True with a reward model under "
            f"{'DeepSpeed ZeRO-3' if zero3 else 'FSDP2'} is not supported: the groups are filtered in the generation "
            "thread, but such a reward model's forward is a collective, scored in the main thread. Use reward "
            "functions, a reward model under DDP or ZeRO-1/2, or set dynamic_sampling=False."
        )


def _warn_about_dropout(trainer) -> None:
    if trainer.args.disable_dropout:
        return
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in trainer.model.modules()):
        logger.warning(
            "disable_dropout=False leaves dropout on in the training forward, while the generator samples and "
            "scores its tokens without dropout: on-policy importance ratios then differ from 1 by the dropout "
            "noise. Set disable_dropout=True (AsyncA3POConfig's default; GRPOConfig's is False) for unbiased "
            "A-3PO updates."
        )


def effective_generation_config(trainer):
    """The generation config ``generate`` will really use (TRL's, completed from the model's own), checked: its
    temperature must be the one the training log-probs are scaled by; what makes it sample from another distribution
    than ``softmax(logits / temperature)`` is reported (processed distributions the generator records are said once,
    the rest is a warning)."""
    target = peft_base_model(trainer._unwrapped_model())
    config = copy.deepcopy(trainer.generation_config)
    try:
        if not trainer._use_vllm_backend:  # vLLM samples with TRL's settings only, not the model's generation_config
            config, _ = target._prepare_generation_config(config)
    except (AttributeError, TypeError):  # a transformers without the merge helper: use TRL's config as it is
        pass
    if config.temperature is not None and abs(config.temperature - trainer.temperature) > 1e-12:
        # A conflicting temperature in generation_kwargs is refused by the config already (before loading).
        in_kwargs = (trainer.args.generation_kwargs or {}).get("temperature")
        source = "generation_kwargs" if in_kwargs == config.temperature else "the model's generation_config"
        raise ValueError(
            f"{source} sets temperature={config.temperature}, but the training log-probs are scaled by "
            f"temperature={trainer.temperature}: behavior and training log-probs would score different "
            f"distributions. Set temperature={config.temperature} in the config instead of in {source}."
        )
    if getattr(trainer.args, "use_transformers_continuous_batching", False):
        check_continuous_batching_sampling(config)  # the model's own generation_config may set top-k/p
    # The generate backend records the log-probs of a processed sampling distribution (top-k/p, penalties, ...)
    # under plain sampling; vLLM refuses such settings before any model loads (validation.check_vllm_sampling).
    recorded = [] if trainer._use_vllm_backend or not samples_with_own_stream(config) else processed_sampling(config)
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
