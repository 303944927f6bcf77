"""Which dtype the generator holds its weights in: its copy of the policy, the vLLM engine and the staging buffers.

The training weights are often float32 where the trainer does not compute in float32: accelerate's FSDP2 upcasts
trainable parameters to float32 master weights under ``mixed_precision: bf16``, and TRL's ``ModelConfig.dtype``
loads models in float32 by default. Sizing or typing the generator from them would double its memory (a 7B model:
30.5 GB instead of 15.2 GB per copy) and slow vLLM's decoding. :func:`generator_dtype` is the one rule:

1. the trainer computes in a mixed-precision dtype (``bf16``/``fp16``): the generator holds that dtype, on every
   device (its forwards then see the weights the trainer's autocast or FSDP2 ``param_dtype`` computes with);
2. vLLM on a GPU, in full precision: the checkpoint's dtype, a float32 checkpoint served in bfloat16 (float16 where
   the GPU has no bfloat16): vLLM's own ``dtype="auto"``, which TRL's engines use;
3. otherwise (CPU runs in full precision, ``generate`` without mixed precision): each tensor keeps the dtype the
   trainer holds it in (``None``), so a float32 CPU run generates with exactly the training weights.

A module kept in float32 on purpose (TRL's ``cast_lm_head_to_fp32``) stays float32 in the generator's copy too.
"""

from __future__ import annotations

import torch

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""accelerate's ``mixed_precision`` values that compute in a lower-precision dtype."""

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def mixed_precision_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The dtype an accelerate ``mixed_precision`` setting computes in (``None`` for ``"no"`` and fp8 recipes)."""
    return MIXED_PRECISION_DTYPES.get(str(mixed_precision or "no"))


def checkpoint_dtype(config) -> torch.dtype | None:
    """The dtype a model's config says its checkpoint is stored in (``dtype``, formerly ``torch_dtype``), or None."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for holder in (config, text_config):
        for attribute in ("dtype", "torch_dtype"):
            value = getattr(holder, attribute, None)
            if isinstance(value, str) and value != "auto":
                value = getattr(torch, value, None)
            if isinstance(value, torch.dtype):
                return value
    return None


def generator_dtype(
    *,
    backend: str,
    device: torch.device,
    mixed_precision: str | None,
    checkpoint: torch.dtype | None,
    bf16_supported: bool = True,
) -> torch.dtype | None:
    """The dtype of every floating tensor the generator owns (see the module doc), or ``None``: as the trainer holds
    each one. ``backend`` is ``"generate"`` or ``"vllm"``; ``checkpoint`` the dtype the model's checkpoint is stored
    in (:func:`checkpoint_dtype`); ``bf16_supported`` whether ``device`` computes in bfloat16."""
    if backend not in ("generate", "vllm"):
        raise ValueError(f"backend={backend!r} must be 'generate' or 'vllm'.")
    computed = mixed_precision_dtype(mixed_precision)
    if computed is not None:
        return computed
    if backend == "vllm" and torch.device(device).type == "cuda":
        if checkpoint in (torch.bfloat16, torch.float16):
            return checkpoint
        return torch.bfloat16 if bf16_supported else torch.float16
    return None


def vllm_dtype_name(dtype: torch.dtype) -> str:
    """The ``dtype`` argument of ``vllm.LLM`` for a torch dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"vLLM cannot hold weights in {dtype}: use float32, bfloat16 or float16.") from None


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 (CUDA: compute capability 8.0 or newer; CPU: yes)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True
