"""Weights in the forms vLLM loads them: where each version is staged, LoRA adapters written as adapter folders
(and the ranks of vLLM's adapter slots), and the merged or base checkpoint tensors of adapters vLLM cannot serve."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch import nn

from ..weights import StagingLayout, vllm_weight_name
from ..weights.names import without_checkpoint_wrapper

#: The ranks of vLLM LoRA slots go by powers of two up to this (``max_lora_rank`` must be one of them).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def active_lora(module) -> tuple[str, object] | None:
    """``(adapter name, its PEFT config)`` of a PEFT model's active adapter, or None for a plain model."""
    if not hasattr(module, "peft_config"):
        return None
    adapter = module.active_adapter
    adapter = adapter[0] if isinstance(adapter, list) else adapter
    return adapter, module.peft_config[adapter]


def vllm_staging_layout(
    module, dtype: torch.dtype | None, device: torch.device, staging_device: torch.device | None = None
) -> StagingLayout:
    """The staging layout of a vLLM backend: ``module``'s trainable weights, whole-shaped (also under ZeRO-3 and
    FSDP2), in the engine's ``dtype``; on ``staging_device`` when it is the engine's GPU (the memory plan found room
    there: :func:`~a3po_trl.generation.weights.memory_plan.plan_generator_memory_choosing_staging`), else in host
    memory, pinned when the engine is on a GPU."""
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    if staging_device is not None and torch.device(staging_device).type != "cpu":
        return StagingLayout.of(module, trainable, staging_device, dtype)
    return StagingLayout.of(module, trainable, torch.device("cpu"), dtype, pin_memory=device.type == "cuda")


def base_checkpoint_tensors(peft_module) -> dict[str, torch.Tensor]:
    """A PEFT model's base weights (merged, when its adapters are merged) under their checkpoint names, without the
    adapter weights and the originals of ``modules_to_save``."""
    return {
        vllm_weight_name(name): param.detach()
        for name, param in peft_module.named_parameters()
        if is_base_weight(peft_module, name)
    }


@torch.no_grad()
def merged_checkpoint_tensors(peft_module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` of a PEFT model's weights with its active adapters merged, as
    :func:`base_checkpoint_tensors` names them, computed without ever writing its base weights.

    Merging and unmerging in place (``merge_adapter`` / ``unmerge_adapter``) leaves the base rounded a little
    differently each time, and a copy that merges every version drifts away from the trainer's base: a few ulps in
    fp32 after 1,000 versions, 1e-2 in bf16, NaN within ten versions for bf16 DoRA. Here each adapted module is merged
    by PEFT's own ``merge`` into a scratch copy of its base weights, and gets its untouched weights back before the
    next, so every version is an exact merge of the same base; at most one module's scratch weights exist at a time.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers: dict[int, list[BaseTunerLayer]] = {}  # by the module they adapt (nested wrappers share one)
    for module in peft_module.modules():
        if isinstance(module, BaseTunerLayer):
            layers.setdefault(id(module.get_base_layer()), []).append(module)
    adapted = {id(p) for group in layers.values() for p in group[0].get_base_layer().parameters(recurse=False)}
    names = {id(param): name for name, param in peft_module.named_parameters()}
    for name, param in peft_module.named_parameters():
        if is_base_weight(peft_module, name) and id(param) not in adapted:
            yield vllm_weight_name(name), param.detach()
    for group in layers.values():
        merged = _merged_out_of_place(group)
        for param, tensor in merged:
            yield vllm_weight_name(names[id(param)]), tensor


def _merged_out_of_place(layers) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """The weights of the module ``layers`` adapt, with their adapters merged, as new tensors; the module's own
    tensors are put back untouched (the merge writes a scratch copy, then PEFT's ``unmerge`` keeps its bookkeeping,
    e.g. DoRA's cached weight norms, consistent)."""
    params = list(layers[0].get_base_layer().parameters(recurse=False))
    originals = [param.data for param in params]
    try:
        for param in params:
            param.data = param.data.clone()
        for layer in layers:
            layer.merge()
        return [(param, param.detach().clone()) for param in params]  # a copy: unmerge writes the scratch
    finally:
        for layer in layers:
            if layer.merged:
                layer.unmerge()
        for param, original in zip(params, originals):
            param.data = original


def is_base_weight(peft_module, name: str) -> bool:
    """Whether a PEFT model's parameter belongs in the base model's checkpoint: not an adapter weight, not the
    original of a ``modules_to_save`` module (its trainable copy is)."""
    return peft_module.prefix not in name and "original_module" not in name


def unsupported_lora_reason(peft_config) -> str | None:
    """Why vLLM cannot serve this PEFT config as a LoRA adapter (so its weights are merged instead), or None."""
    if type(peft_config).__name__ != "LoraConfig":
        return f"{type(peft_config).__name__} is not LoRA"
    if getattr(peft_config, "use_dora", False):
        return "DoRA (use_dora=True)"
    if getattr(peft_config, "modules_to_save", None):
        return f"modules_to_save={peft_config.modules_to_save}"
    if getattr(peft_config, "trainable_token_indices", None):
        return "trainable_token_indices"
    if getattr(peft_config, "bias", "none") != "none":
        return f"bias={peft_config.bias!r}"
    if getattr(peft_config, "rank_pattern", None) or getattr(peft_config, "alpha_pattern", None):
        return "rank_pattern/alpha_pattern"
    if lora_slot_rank(peft_config.r) is None:
        return f"r={peft_config.r} (vLLM's largest LoRA rank is {_VLLM_LORA_RANKS[-1]})"
    return None


def lora_slot_rank(rank: int) -> int | None:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    return next((r for r in _VLLM_LORA_RANKS if r >= rank), None)


def write_lora_adapter(directory: str, weights: dict[str, torch.Tensor], peft_config, adapter_name: str) -> None:
    """Write the LoRA weights of one version as a PEFT adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``, keys without the adapter name, as ``save_pretrained`` writes them)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    marker = f".{adapter_name}."
    tensors = {
        without_checkpoint_wrapper(name).replace(marker, "."): tensor.detach().to("cpu", copy=True).contiguous()
        for name, tensor in weights.items()
        if marker in name
    }
    if not tensors:
        raise RuntimeError(f"No weights of adapter {adapter_name!r} among the published ones: {sorted(weights)[:5]}")
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    config = peft_config.to_dict()
    config["target_modules"] = (
        sorted(config["target_modules"])
        if isinstance(config.get("target_modules"), set)
        else config.get("target_modules")
    )
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, default=_json_default)


def _json_default(value):
    if isinstance(value, set):
        return sorted(value)
    if hasattr(value, "value"):  # enums (task_type, ...)
        return value.value
    return str(value)
