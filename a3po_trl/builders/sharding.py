"""How the trainer's weights are held across processes (ZeRO-3, FSDP2), and how the main thread reads them whole."""

from __future__ import annotations

from ..generation.weights import (
    ContextGather,
    DTensorGather,
    ParameterGather,
)


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
