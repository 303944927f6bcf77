"""Unsharded copies of sharded (ZeRO-3, FSDP2) models, built in the main thread from weights gathered one tensor at a
time: the generator's own copy (Hugging Face ``generate``), the copy a vLLM engine merges adapters into, and the class
a checkpoint written from gathered tensors names."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ..patches import peft_base_model


def unsharded_copy(module: nn.Module, gather) -> nn.Module:
    """An unsharded copy of a sharded (ZeRO-3, FSDP2) causal LM or PEFT model: built from its config, loaded with its
    weights gathered one tensor at a time.

    Building it initializes random weights (then overwritten): that must not draw from the global RNG, whose state a
    resumed run has just restored from its checkpoint (the copy is built at the first training step, so a resumed run
    would draw where the uninterrupted one did not, and shuffle its batches differently)."""
    is_peft = hasattr(module, "get_base_model") and hasattr(module, "peft_config")
    base = peft_base_model(module)
    config = copy.deepcopy(base.config)
    with _without_zero3_init(), torch.random.fork_rng(devices=[]):
        fresh = unsharded_class(base)(config)
        if is_peft:
            from peft import get_peft_model

            adapters = list(module.peft_config)
            fresh = get_peft_model(fresh, module.peft_config[adapters[0]], adapter_name=adapters[0])
            for name in adapters[1:]:
                fresh.add_adapter(name, module.peft_config[name])
    own = dict(fresh.named_parameters())
    unexpected = []
    # One gather per parameter, each whole tensor replacing the copy's random one at once: never the whole model
    # twice. Every process gathers every parameter (the names are the same everywhere), errors are raised after.
    for name, param in module.named_parameters():
        for _, tensor in gather.full_tensors([(name, param)]):
            if name in own:
                own[name].data = tensor.to("cpu", copy=True)  # each keeps its own dtype (e.g. an fp32 LM head)
            else:
                unexpected.append(name)
    missing = sorted(set(own) - set(dict(module.named_parameters())))
    if missing or unexpected:
        raise RuntimeError(f"Could not rebuild the generator's weights: missing {missing}, unexpected {unexpected}.")
    _mark_available_for_zero3(fresh)
    return fresh


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
