"""The generator's own copies of the training module, built in the main thread directly on their device and in their
dtype: of a whole module (:func:`generator_copy`, frozen weights shared where they can be), and of a sharded (ZeRO-3,
FSDP2) one from weights gathered one tensor at a time (:func:`unsharded_copy`). The Hugging Face ``generate`` backend
generates with one; a vLLM engine merges adapters vLLM cannot serve into one. Also the class a checkpoint written from
gathered tensors names (:func:`unsharded_class`)."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ...patches import peft_base_model, strip_instance_forwards
from .names import without_checkpoint_wrapper
from .store import staged_dtype


def generator_copy(
    module: nn.Module, device: torch.device, dtype: torch.dtype | None, share_frozen: bool
) -> nn.Module:
    """The generator's copy of a whole (unsharded) training module on ``device``: every frozen parameter the trainer's
    own tensor when ``share_frozen`` (same device), every other parameter its own tensor in ``dtype`` (floating ones;
    None: the trainer's dtype), created directly on ``device`` in that dtype, never as a second full-precision copy
    first. Instance ``forward`` patches are removed (they close over the training module)."""
    memo = {}
    for param in module.parameters():
        if share_frozen and not param.requires_grad:
            memo[id(param)] = param
        else:
            value = param.detach().to(device=device, dtype=staged_dtype(param.dtype, dtype), copy=True)
            memo[id(param)] = nn.Parameter(value, requires_grad=False)
    copied = copy.deepcopy(module, memo)
    strip_instance_forwards(copied)
    _move_buffers(copied, device)
    return copied


def unsharded_copy(
    module: nn.Module, gather, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> nn.Module:
    """An unsharded copy of a sharded (ZeRO-3, FSDP2) causal LM or PEFT model on ``device``, its floating weights in
    ``dtype`` (None: each as the training module holds it): built from its config on the meta device, then filled
    with its weights gathered one tensor at a time, each cast and placed on ``device`` as it arrives. The copy never
    exists in another dtype or on another device first (a 7B model built at random in float32 on the host would take
    30 GB of host memory per process before the first weight arrived), and never draws from the global RNG (a
    resumed run has just restored it from its checkpoint). Names are matched without activation-checkpointing
    wrappers (the copy has none). Its parameters do not require gradients."""
    from accelerate import init_empty_weights

    is_peft = hasattr(module, "get_base_model") and hasattr(module, "peft_config")
    base = peft_base_model(module)
    config = copy.deepcopy(base.config)
    with _without_zero3_init(), torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):
        fresh = unsharded_class(base)(config)
        if is_peft:
            from peft import get_peft_model

            adapters = list(module.peft_config)
            fresh = get_peft_model(fresh, module.peft_config[adapters[0]], adapter_name=adapters[0])
            for name in adapters[1:]:
                fresh.add_adapter(name, module.peft_config[name])
    device = torch.device(device)
    _move_buffers(fresh, device)  # built for real, on the host
    own = dict(fresh.named_parameters(remove_duplicate=False))
    owners = _parameter_owners(fresh)
    tied = _tied_names(module)  # the copy ties what the trainer's module ties (meta construction may untie them)
    filled, unexpected = set(), []
    # One gather per parameter, each whole tensor replacing the copy's empty one at once: never the whole model
    # twice. Every process gathers every parameter (the names are the same everywhere), errors are raised after.
    for name, param in module.named_parameters():
        for _, tensor in gather.full_tensors([(name, param)]):
            keys = tied[without_checkpoint_wrapper(name)]
            if any(key not in own for key in keys):
                unexpected.append(name)
                continue
            value = tensor.detach().to(device=device, dtype=staged_dtype(tensor.dtype, dtype), copy=True)
            replacement = nn.Parameter(value, requires_grad=False)
            for key in keys:
                for owner, attribute in owners[id(own[key])]:
                    owner._parameters[attribute] = replacement
            filled.update(keys)
    missing = sorted(set(own) - filled)
    if missing or unexpected:
        raise RuntimeError(f"Could not rebuild the generator's weights: missing {missing}, unexpected {unexpected}.")
    _mark_available_for_zero3(fresh)
    return fresh


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s buffers (rotary frequencies, ...) to ``device``, leaving its parameters where they are (a
    module's ``to`` would also copy them, or fail on the meta device)."""
    for submodule in module.modules():
        for attribute, buffer in submodule._buffers.items():
            if buffer is not None:
                submodule._buffers[attribute] = buffer.to(device)


def _tied_names(module: nn.Module) -> dict[str, list[str]]:
    """For each parameter name of ``module`` (without activation-checkpointing wrappers), every name that holds the
    same tensor (a tied LM head and embedding), itself included."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(without_checkpoint_wrapper(name))
    return {name: names for names in groups.values() for name in names}


def _parameter_owners(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """For each parameter (by identity), every ``(module, attribute)`` that holds it."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for submodule in module.modules():
        for attribute, param in submodule._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((submodule, attribute))
    return owners


def unsharded_class(module: nn.Module) -> type:
    """The model class of ``module``; for a module FSDP2 has sharded in place (``fully_shard`` swaps its class for
    ``FSDP<Class>``, a subclass of ``FSDPModule`` and the original), the original class."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return type(module)
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def _mark_available_for_zero3(module: nn.Module) -> None:
    """Tell ZeRO-3-aware code (TRL's fused LM head gathers `lm_head` when ZeRO-3 is on) that these whole,
    unsharded parameters need no gathering."""
    try:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    except ImportError:  # pragma: no cover - only reached with ZeRO-3, where deepspeed is installed
        return
    for param in module.parameters():
        param.ds_status = ZeroParamStatus.AVAILABLE


@contextlib.contextmanager
def _without_zero3_init():
    """Build a module unsharded even where transformers would wrap construction in `deepspeed.zero.Init`."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # pragma: no cover - transformers without the integration
        yield
        return
    saved = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
