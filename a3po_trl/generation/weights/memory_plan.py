"""What the generator adds to each process's memory, estimated before anything is built; refused when it cannot fit.

The estimate needs only parameter counts and dtypes, so it runs on the meta device (a 7B model's plan costs nothing)
and, in a run, before the generator's copy, staging buffers or engine exist. It lists, per process:

- the generator's own copy of the weights (``generate``: the trainable ones, or the whole model when the training
  weights are sharded or the generator is on another device; vLLM: a private merge copy for LoRA configs vLLM cannot
  serve as adapters);
- the vLLM engine (colocate): on a GPU the share of the GPU it reserves (``vllm_gpu_memory_utilization``), which must
  hold its weights in the engine's dtype; on CPU its weights;
- the staging buffers, one set of the trainable weights per version held (more with ``reproducible_generation``), on
  the generation device (``generate``) or in pinned host memory (vLLM);
- what training has not allocated yet when the generator is built (at the first step): gradients and the optimizer's
  states, sharded as the run shards them. Activations are not counted.

On CUDA the device total is compared with the memory free at that moment; a plan that cannot fit is refused with the
numbers and the settings that lower it (:class:`GeneratorMemoryError`). On CPU it is only logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .store import full_shape, staged_dtype

GIB = 2**30


class GeneratorMemoryError(RuntimeError):
    """The generator, with training's pending state, would not fit in the free memory of a device."""


@dataclass(frozen=True)
class GeneratorSetup:
    """What decides the generator's memory in a run (the plain facts, read from the trainer once)."""

    backend: str
    """``"generate"``, ``"vllm-colocate"`` or ``"vllm-server"``."""
    generation_device: torch.device
    training_device: torch.device
    dtype: torch.dtype | None
    """The generator's dtype (:func:`~a3po_trl.generation.weights.generator_dtype`; the engine's for vLLM); None: as
    the trainer holds each weight."""
    sharded: bool = False
    """The training weights are sharded (ZeRO-3, FSDP2): a ``generate`` copy is the whole model."""
    staging_sets: int = 1
    """Staging buffer sets held at most: 1, or ``max_staleness + 2`` with ``reproducible_generation`` (the kept
    versions and the one being published)."""
    vllm_gpu_memory_utilization: float = 0.3
    vllm_merges_adapters: bool = False
    """vLLM cannot serve the PEFT config as an adapter: every version is merged into a private whole copy."""
    device_total_bytes: int | None = None
    """The generation device's total memory (CUDA), for the vLLM engine's reservation."""
    gradient_shards: int = 1
    """Over how many processes gradients are sharded (ZeRO-2/3, FSDP2: the number of processes)."""
    optimizer_shards: int = 1
    """Over how many processes the optimizer's states are sharded (ZeRO-1/2/3, FSDP2: the number of processes)."""
    optimizer_states_per_parameter: int = 2
    """Tensors the optimizer keeps per trainable parameter, in its dtype (Adam/AdamW: 2; SGD with momentum: 1)."""
    training_state_allocated: bool = False
    """Gradients and optimizer states exist already (a later ``train()`` call): not counted again."""


@dataclass(frozen=True)
class MemoryItem:
    what: str
    bytes: int
    device: torch.device


@dataclass
class GeneratorMemoryPlan:
    """The estimate: one :class:`MemoryItem` per thing the generator (or training, still to come) allocates."""

    setup: GeneratorSetup
    items: list[MemoryItem] = field(default_factory=list)
    engine_weights_bytes: int = 0
    """vLLM colocate on a GPU: the engine's weights, which its reservation must hold (0 otherwise)."""

    def bytes_on(self, device: torch.device) -> int:
        return sum(item.bytes for item in self.items if _same(item.device, device))

    @property
    def devices(self) -> list[torch.device]:
        seen: list[torch.device] = []
        for item in self.items:
            if not any(_same(item.device, d) for d in seen):
                seen.append(item.device)
        return seen

    def describe(self) -> str:
        """A few lines: each item in GiB, and the total per device."""
        lines = [f"Generator memory plan ({self.setup.backend}, dtype {_dtype_name(self.setup.dtype)}), per process:"]
        for item in self.items:
            lines.append(f"  {item.what:<58} {_size(item.bytes)} on {item.device}")
        for device in self.devices:
            lines.append(f"  {'total':<58} {_size(self.bytes_on(device))} on {device}")
        return "\n".join(lines)

    def check(self, free_bytes: dict[str, int]) -> None:
        """Raise :class:`GeneratorMemoryError` if the items on a device exceed its free memory (``free_bytes`` by
        device string, e.g. ``{"cuda:0": ...}``; devices not given are not checked), or a vLLM engine's weights
        exceed its reservation."""
        setup = self.setup
        if self.engine_weights_bytes:
            reserved = _item_bytes(self, "vLLM engine")
            if self.engine_weights_bytes > reserved:
                raise GeneratorMemoryError(
                    f"The vLLM engine's weights take {self.engine_weights_bytes / GIB:.1f} GiB in "
                    f"{_dtype_name(setup.dtype)}, more than the {reserved / GIB:.1f} GiB it may use "
                    f"(vllm_gpu_memory_utilization={setup.vllm_gpu_memory_utilization} of "
                    f"{(setup.device_total_bytes or 0) / GIB:.1f} GiB). Raise vllm_gpu_memory_utilization (the "
                    "engine also needs room for its KV cache), train in bf16 mixed precision (bf16=True) so that the "
                    "engine holds bf16 weights, or serve the model from a separate vLLM server (vllm_mode='server')."
                )
        for device in self.devices:
            free = free_bytes.get(str(device))
            if free is None or device.type == "cpu":
                continue
            needed = self.bytes_on(device)
            if needed > free:
                raise GeneratorMemoryError(
                    f"{self.describe()}\nThat is {needed / GIB:.1f} GiB on {device}, where {free / GIB:.1f} GiB are "
                    f"free now (activations not counted). To lower it: {'; '.join(self._remedies())}."
                )

    def _remedies(self) -> list[str]:
        setup, remedies = self.setup, []
        if setup.dtype is None or setup.dtype == torch.float32:
            remedies.append("train in bf16 mixed precision (bf16=True): the generator then holds bf16 weights")
        if setup.staging_sets > 2:
            remedies.append(
                f"reproducible_generation=False or a smaller max_staleness (it keeps {setup.staging_sets} staged "
                "versions)"
            )
        if setup.backend == "generate":
            remedies.append("LoRA (peft_config): the generator then copies only the adapter")
            if not setup.sharded and _same(setup.generation_device, setup.training_device):
                remedies.append("generation_device on another GPU")
            remedies.append("use_vllm=True with vllm_mode='server' (generation on other GPUs)")
        elif setup.backend == "vllm-colocate":
            remedies.append(
                f"a lower vllm_gpu_memory_utilization (now {setup.vllm_gpu_memory_utilization}), or vllm_mode='server'"
            )
            if setup.vllm_merges_adapters:
                remedies.append("a plain LoRA config vLLM serves as an adapter (no private merge copy)")
        if setup.gradient_shards == 1 and setup.optimizer_shards == 1 and not setup.training_state_allocated:
            remedies.append("shard training state over the GPUs (DeepSpeed ZeRO-2/3 or FSDP2)")
        return remedies


def plan_generator_memory(module: nn.Module, setup: GeneratorSetup) -> GeneratorMemoryPlan:
    """The memory plan of ``setup`` for the (unwrapped) training ``module``, which may live on the meta device."""
    params = list(_unique_parameters(module))
    trainable = [p for p in params if p.requires_grad]
    plan = GeneratorMemoryPlan(setup)
    generation, training = setup.generation_device, setup.training_device

    def size(tensors, dtype=setup.dtype) -> int:
        return sum(full_shape(p).numel() * _element_size(staged_dtype(p.dtype, dtype)) for p in tensors)

    staged = size(trainable)
    if setup.backend == "generate":
        whole = setup.sharded or not _same(generation, training)
        copied = params if whole else trainable
        what = "generator copy (whole model)" if whole else "generator copy (trainable weights; frozen ones shared)"
        plan.items.append(MemoryItem(what, size(copied), generation))
        staging_device = generation
    else:
        if setup.backend == "vllm-colocate":
            engine_weights = size(params)
            if generation.type == "cuda" and setup.device_total_bytes:
                reserved = int(setup.vllm_gpu_memory_utilization * setup.device_total_bytes)
                what = "vLLM engine (its reservation: weights + KV cache)"
                plan.items.append(MemoryItem(what, reserved, generation))
                plan.engine_weights_bytes = engine_weights
            else:
                plan.items.append(MemoryItem("vLLM engine weights (KV cache not counted)", engine_weights, generation))
            if setup.vllm_merges_adapters:
                plan.items.append(MemoryItem("merge copy (whole model, adapters merged)", size(params), generation))
        staging_device = torch.device("cpu")
    plan.items.append(MemoryItem("staging, one version", staged, staging_device))
    if setup.staging_sets > 1:
        what = f"staging, {setup.staging_sets - 1} more versions (reproducible_generation)"
        plan.items.append(MemoryItem(what, staged * (setup.staging_sets - 1), staging_device))
    if not setup.training_state_allocated:
        gradients = size(trainable, None) // max(setup.gradient_shards, 1)
        states = setup.optimizer_states_per_parameter * size(trainable, None) // max(setup.optimizer_shards, 1)
        plan.items.append(MemoryItem("training, not allocated yet: gradients", gradients, training))
        plan.items.append(MemoryItem("training, not allocated yet: optimizer states", states, training))
    return plan


def free_device_memory(devices) -> dict[str, int]:
    """Free bytes of each CUDA device in ``devices`` now (others are left out)."""
    free = {}
    for device in devices:
        if device.type == "cuda":
            free[str(device)] = torch.cuda.mem_get_info(device)[0]
    return free


def _unique_parameters(module: nn.Module):
    """Each parameter once (tied weights counted once, as in memory)."""
    seen = set()
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            yield param


def _item_bytes(plan: GeneratorMemoryPlan, prefix: str) -> int:
    return sum(item.bytes for item in plan.items if item.what.startswith(prefix))


def _size(size: int) -> str:
    return f"{size / GIB:8.2f} GiB" if size >= GIB // 100 else f"{size / 2**20:8.2f} MiB"


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "as trained" if dtype is None else str(dtype).removeprefix("torch.")


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type == "cpu" or a.index == b.index)
