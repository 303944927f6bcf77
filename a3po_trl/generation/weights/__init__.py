"""The weight path from the trainer to the generator, in one room.

- :mod:`.gather`: how the main thread reads sharded (ZeRO-3, FSDP2) training parameters whole, one at a time, on
  every process together;
- :mod:`.precision`: which dtype the generator holds its weights in (mixed precision, vLLM's ``auto``);
- :mod:`.store`: :class:`VersionedWeights`, the published versions in staging buffers, and their layout;
- :mod:`.copies`: the generator's own copy of the weights (a sharded model's whole copy is built on the meta device
  and filled one gathered tensor at a time);
- :mod:`.memory_plan`: what the generator adds to each process's memory, estimated before anything is built;
- :mod:`.version_checkpoint`: the versions kept for a reproducible resume, in a checkpoint;
- :mod:`.names`: parameter names across wrappers (activation checkpointing, PEFT);
- :func:`vllm_weight_name`: a training parameter's name as a Hugging Face checkpoint (and vLLM) names it.
"""

from .gather import ContextGather, DTensorGather, ParameterGather, as_parameter_gather
from .names import vllm_weight_name
from .precision import checkpoint_dtype, generator_dtype, mixed_precision_dtype
from .store import StagingLayout, VersionedWeights, full_shape

__all__ = [
    "ContextGather",
    "DTensorGather",
    "ParameterGather",
    "StagingLayout",
    "VersionedWeights",
    "as_parameter_gather",
    "checkpoint_dtype",
    "full_shape",
    "generator_dtype",
    "mixed_precision_dtype",
    "vllm_weight_name",
]
