"""Patches that make every forward of the policy compute the same function: generation, behavior scoring, training.

- :func:`cast_lm_head_to_fp32` re-applies TRL's ``cast_lm_head_to_fp32`` to a model TRL did not patch itself (the
  generator's copy), so generation and its behavior log-probs use the float32 head the training log-probs use.
- :func:`align_position_ids_with_generation` makes a plain forward derive ``position_ids`` from the attention mask,
  as ``generate`` does, so left-padded rows of absolute-position models (GPT-2, OPT) are scored at the positions they
  were generated at. Rotary-position models are unaffected up to float rounding (only relative positions matter).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

_ALIGNED_MARKER = "_a3po_position_ids_from_mask"


def peft_base_model(module: nn.Module) -> nn.Module:
    """The model a PEFT wrapper wraps (the causal LM whose forward ``generate`` calls), or ``module`` itself."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def strip_instance_forwards(module: nn.Module) -> None:
    """Remove every instance-level ``forward`` patch (TRL's fused LM head, accelerate's autocast wrapper) from a copy
    of a module: they close over the module they were applied to, so a copy would still run the original's."""
    for submodule in module.modules():
        submodule.__dict__.pop("forward", None)
        submodule.__dict__.pop("_original_forward", None)


def strip_forward_hooks(module: nn.Module) -> None:
    """Remove every forward hook and pre-hook from a copy of a module, and the mark that
    :func:`align_position_ids_with_generation` installed its hook: hooks may be local functions (transformers'
    ``enable_input_require_grads``, :func:`cast_lm_head_to_fp32`'s), which cannot be sent to another process. The
    process that receives the copy re-applies the library's own patches."""
    for submodule in module.modules():
        for attribute in (
            "_forward_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_forward_pre_hooks",
            "_forward_pre_hooks_with_kwargs",
        ):
            getattr(submodule, attribute, {}).clear()
        submodule.__dict__.pop(_ALIGNED_MARKER, None)


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """Run ``model``'s LM head in float32 (weight, bias and activations), outside autocast, like TRL's
    ``cast_lm_head_to_fp32``; with tied embeddings the embedding output keeps the model's dtype."""
    lm_head = model.get_output_embeddings()
    compute_dtype = next(
        (p.dtype for p in model.parameters() if p is not lm_head.weight and p.is_floating_point()), torch.float32
    )
    lm_head.float()

    def forward(hidden_states):
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            return nn.functional.linear(
                hidden_states.float(),
                lm_head.weight.float(),
                None if lm_head.bias is None else lm_head.bias.float(),
            )

    lm_head.forward = forward
    config = getattr(model, "config", None)
    if config is not None and getattr(config.get_text_config(), "tie_word_embeddings", False):

        def keep_embedding_dtype(module, args, output):
            return output.to(compute_dtype)

        model.get_input_embeddings().register_forward_hook(keep_embedding_dtype)


def _positions_from_mask(module, args, kwargs):
    attention_mask = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is not None or attention_mask is None or attention_mask.dim() != 2:
        return args, kwargs
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return args, kwargs  # a cached decoding step: generate passes its positions
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is not None and input_ids.shape[-1] != attention_mask.shape[-1]:
        return args, kwargs
    position_ids = attention_mask.long().cumsum(-1) - 1
    kwargs["position_ids"] = position_ids.masked_fill(attention_mask == 0, 0)  # as generate computes them
    return args, kwargs


def align_position_ids_with_generation(model: nn.Module) -> bool:
    """Make forwards of ``model`` (a causal LM, a PEFT model around one, or a TRL-patched one) that pass no
    ``position_ids`` use ``attention_mask.cumsum(-1) - 1``, the positions ``generate`` gives the same tokens.

    Hooks the backbone, which TRL's fused LM head and the model's own forward both call. Returns whether a hook was
    installed (models whose backbone takes no ``position_ids`` are left alone). Idempotent.
    """
    target = peft_base_model(model)
    backbone = getattr(target, "base_model", None)
    if backbone is None or backbone is target or getattr(backbone, _ALIGNED_MARKER, False):
        return bool(backbone is not None and getattr(backbone, _ALIGNED_MARKER, False))
    try:
        accepts = "position_ids" in inspect.signature(backbone.forward).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        return False
    backbone.register_forward_pre_hook(_positions_from_mask, with_kwargs=True)
    setattr(backbone, _ALIGNED_MARKER, True)
    return True
