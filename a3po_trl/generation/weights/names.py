"""Parameter names across the wrappers a training module may carry.

The names a training module's ``named_parameters`` gives are the generator's keys for its weights. Wrappers add
prefixes the unwrapped model does not have: accelerate's FSDP2 activation checkpointing
(``_checkpoint_wrapped_module.``, ``checkpoint_wrapper``), PEFT (``base_model.model.``, ``.base_layer``,
``modules_to_save.default.``). The generator's own copy of a sharded model is built from the config, without the
checkpointing wrapper; vLLM and LoRA adapter files know neither.
"""

from __future__ import annotations

import os

ACTIVATION_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
"""What ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (accelerate's FSDP2
``fsdp_activation_checkpointing``) inserts into the names of the wrapped module's parameters."""


def without_checkpoint_wrapper(name: str) -> str:
    """``name`` as the module without activation-checkpointing wrappers names it."""
    return name.replace(ACTIVATION_CHECKPOINT_PREFIX, "")


def vllm_weight_name(name: str) -> str:
    """A training module's parameter name as vLLM's ``load_weights`` expects it (Hugging Face checkpoint names): the
    PEFT wrapper's prefixes and ``base_layer`` removed, and any activation-checkpointing wrapper, as TRL's vLLM weight
    sync does (``_fix_param_name_to_vllm``)."""
    name = without_checkpoint_wrapper(name).removeprefix("base_model.model.").replace(".base_layer", "")
    return name.replace("modules_to_save.default.", "")


def strip_checkpoint_wrapper_from_files(directory: str) -> list[str]:
    """Rename the tensors of every ``*.safetensors`` file under ``directory`` (an adapter saved by PEFT from a model
    with activation-checkpointing wrappers, whose tensor names carry them) to the unwrapped names, in place (written
    to a temporary file, then renamed over the original). Returns the files rewritten."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    rewritten = []
    for root, _, files in os.walk(directory):
        for file in sorted(f for f in files if f.endswith(".safetensors")):
            path = os.path.join(root, file)
            with safe_open(path, framework="pt") as opened:
                names, metadata = list(opened.keys()), opened.metadata()
                if not any(ACTIVATION_CHECKPOINT_PREFIX in name for name in names):
                    continue
                tensors = {without_checkpoint_wrapper(name): opened.get_tensor(name) for name in names}
            save_file(tensors, path + ".tmp", metadata=metadata)
            os.replace(path + ".tmp", path)
            rewritten.append(path)
    return rewritten
