"""What the generator adds to each process's memory, estimated before anything is built; refused when it cannot fit.

From parameter counts and dtypes alone (on the meta device: a 7B model's plan costs nothing), per process: the
generator's own copy, the vLLM engine, the staging buffers (where colocated vLLM stages is chosen here:
:func:`plan_generator_memory_choosing_staging`), ``generate``'s KV cache and logits, what training has not
allocated yet, and ``prox_logp_method="guarded"``'s kept copy of the trainable weights. On CUDA a plan that cannot
fit is refused (:class:`GeneratorMemoryError`); on CPU it is only logged. What it counts, and why:
docs/ARCHITECTURE.md, "The generator's memory plan".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .store import full_shape, packed_bytes, staged_dtype

logger = logging.getLogger(__name__)

GIB = 2**30

DEVICE_STAGING_RESERVE = 0.2
"""``generate`` and colocated vLLM stage on the GPU only if, with the staged copy, this share of the GPU's total memory
stays free for what the plan does not count (activations, prompts' KV cache, the allocator's fragmentation);
otherwise in pinned host memory."""

LOGITS_COPIES = 2
"""Vocabulary-wide float32 tensors per row ``generate`` holds at a decode step (the next token's logits, and the
probabilities it samples from)."""


KEPT_WEIGHTS = "guarded: kept copy of the trainable weights (previous version)"
"""The plan's item for ``prox_logp_method="guarded"``'s kept weights: the trainable weights in the dtype training holds
them in (with LoRA the adapters), divided by the number of processes under FSDP2 and ZeRO-3."""


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
    staging_device: torch.device | None = None
    """Where the staging buffers live; None: the backend's default (``generate``: the generation device; vLLM: host
    memory, pinned when the generation device is a GPU)."""
    processes_on_node: int = 1
    """Training processes on this machine (``LOCAL_WORLD_SIZE``), each staging its own copy in host memory."""
    generation_rows: int = 0
    """Completions one ``generate`` call decodes together on this process (0: generation's own pool not planned)."""
    completion_tokens: int = 0
    """Tokens of a completion at most (``max_completion_length``)."""
    kv_bytes_per_token: int = 0
    """KV-cache bytes per row and token in the generator's dtype: 2 x layers x key-value heads x head size x bytes."""
    vocab_size: int = 0
    autocast_copy_dtype: torch.dtype | None = None
    """Training runs under this half-precision autocast with float32 weights held whole on the training device:
    autocast keeps a copy of each float32 weight in it through the forward and the backward. None: no such copies
    (full precision, half-precision weights, or sharded weights cast layer by layer)."""
    keeps_previous_weights: bool = False
    """``prox_logp_method="guarded"``: the check keeps a copy of the trainable weights (the version before the trained
    one, :mod:`a3po_trl.proximal.previous_weights`) on the training device, in the dtype training holds them in."""
    parameter_shards: int = 1
    """Over how many processes the parameters are sharded (ZeRO-3, FSDP2: the number of processes): each process
    keeps its shard of that copy."""
    training_device_total_bytes: int | None = None
    """The training device's total memory (CUDA), for the reserve where it is not the generation device."""


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
    staging_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the staging buffers live."""
    staging_pinned: bool = False
    """The staging buffers are page-locked host memory (vLLM with its engine on a GPU)."""
    staging_bytes_per_version: int = 0
    """One version's staging buffer (one allocation), in bytes."""
    staging_reason: str = ""
    """Why the staging lives where it does (logged at start)."""

    @property
    def staging_location(self) -> str:
        """``"device cuda:0"``, ``"pinned host memory"`` or ``"host memory"``."""
        if self.staging_device.type != "cpu":
            return f"device {self.staging_device}"
        return "pinned host memory" if self.staging_pinned else "host memory"

    @property
    def staging_bytes(self) -> int:
        """The staging buffers of every version held at most, per process."""
        return self.staging_bytes_per_version * max(self.setup.staging_sets, 1)

    @property
    def pinned_host_bytes(self) -> int:
        """Page-locked host memory this process allocates (its staging buffers when pinned), in bytes."""
        return self.staging_bytes if self.staging_pinned else 0

    @property
    def pinned_host_bytes_on_node(self) -> int:
        """:attr:`pinned_host_bytes` of every process on this machine (``LOCAL_WORLD_SIZE``)."""
        return self.pinned_host_bytes * max(self.setup.processes_on_node, 1)

    def reserve_warning(self, free_bytes: dict[str, int]) -> str | None:
        """A warning when this plan leaves less than :data:`DEVICE_STAGING_RESERVE` of a GPU free for what it does
        not count (``free_bytes`` as :meth:`check` takes them), on the generation device or on the training device
        where the guarded method's kept weights go; None when it does, or nothing is known."""
        setup = self.setup
        for device in self.devices:
            free = free_bytes.get(str(device))
            generation = _same(device, setup.generation_device)
            kept = _item_bytes(self, KEPT_WEIGHTS) if _same(device, setup.training_device) else 0
            total = setup.device_total_bytes if generation else setup.training_device_total_bytes
            if device.type != "cuda" or free is None or not total or not (generation or kept):
                continue
            left = free - self.bytes_on(device)
            if left < DEVICE_STAGING_RESERVE * total:
                own = (
                    f" Of the plan, {kept / GIB:.1f} GiB are prox_logp_method='guarded''s kept copy of the trainable "
                    "weights (the version before the trained one, held for its checks)."
                    if kept
                    else ""
                )
                return (
                    f"The generator and training's pending state leave {left / GIB:.1f} GiB of {device} free, under "
                    f"the {DEVICE_STAGING_RESERVE:.0%} ({DEVICE_STAGING_RESERVE * total / GIB:.1f} GiB) kept for "
                    f"activations, prompts' KV cache and fragmentation: the first steps may run out of memory.{own} "
                    "With two threads allocating on two streams, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                    "(set before the process starts) keeps their pools from fragmenting the GPU. To lower the plan: "
                    f"{'; '.join(self._remedies())}."
                )
        return None

    @property
    def device_bytes(self) -> int:
        """What the plan adds on the generation device, per process (the engine's whole reservation included)."""
        return self.bytes_on(self.setup.generation_device)

    def figures(self) -> dict:
        """The plan's predictions, JSON-ready (for a GPU check to measure against)."""
        return {
            "backend": self.setup.backend,
            "dtype": _dtype_name(self.setup.dtype),
            "staging_location": self.staging_location,
            "staging_reason": self.staging_reason,
            "staging_sets": self.setup.staging_sets,
            "staging_bytes_per_version": self.staging_bytes_per_version,
            "pinned_host_bytes": self.pinned_host_bytes,
            "pinned_host_bytes_on_node": self.pinned_host_bytes_on_node,
            "processes_on_node": self.setup.processes_on_node,
            "device_bytes": {str(device): self.bytes_on(device) for device in self.devices if device.type != "cpu"},
            "host_bytes": self.bytes_on(torch.device("cpu")),
            "items": [[item.what, item.bytes, str(item.device)] for item in self.items],
        }

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
        lines.append(f"  staging in {self.staging_location}: {self.staging_reason}")
        if self.staging_pinned:
            lines.append(
                f"  {'pinned host memory on this node':<58} {_size(self.pinned_host_bytes_on_node)} "
                f"({self.setup.processes_on_node} processes, LOCAL_WORLD_SIZE)"
            )
        return "\n".join(lines)

    def check(self, free_bytes: dict[str, int], host_available_bytes: int | None = None) -> None:
        """Raise :class:`GeneratorMemoryError` if the items on a device exceed its free memory (``free_bytes`` by
        device string, e.g. ``{"cuda:0": ...}``, from :func:`free_device_memory`; devices not given are not checked),
        a vLLM engine's weights exceed its reservation, or the pinned staging of every process on this machine
        exceeds ``host_available_bytes`` (:func:`available_host_memory`; None: not checked)."""
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
        pinned = self.pinned_host_bytes_on_node
        if host_available_bytes is not None and pinned > host_available_bytes:
            raise GeneratorMemoryError(
                f"{self.describe()}\nThe weight staging in pinned host memory takes "
                f"{self.staging_bytes_per_version / GIB:.1f} GiB per version x {setup.staging_sets} version(s) "
                f"x {setup.processes_on_node} process(es) on this machine (LOCAL_WORLD_SIZE) = {pinned / GIB:.1f} GiB "
                f"of page-locked memory, more than the {host_available_bytes / GIB:.1f} GiB of host memory available "
                f"now (MemAvailable). To lower it: {'; '.join(self._host_remedies())}."
            )

    def _host_remedies(self) -> list[str]:
        setup, remedies = self.setup, []
        if setup.staging_sets > 1:
            remedies.append(
                f"reproducible_generation=False or a smaller max_staleness (it keeps {setup.staging_sets} staged "
                "versions)"
            )
        if setup.dtype is None or setup.dtype == torch.float32:
            remedies.append("train in bf16 mixed precision (bf16=True): versions are then staged in bf16")
        remedies.append("LoRA (peft_config): only the adapter is staged")
        if setup.processes_on_node > 1:
            remedies.append(
                f"fewer training processes on this machine (now {setup.processes_on_node}), or a machine with more "
                "host memory"
            )
        if setup.backend == "vllm-colocate" and setup.generation_device.type == "cuda":
            remedies.append(
                "a lower vllm_gpu_memory_utilization (now "
                f"{setup.vllm_gpu_memory_utilization}), so that the staging fits on the GPU instead"
            )
        return remedies

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
        if setup.keeps_previous_weights:
            remedies.append(
                "prox_logp_method='loglinear' (guarded keeps a copy of the trainable weights: "
                f"{_item_bytes(self, KEPT_WEIGHTS) / GIB:.1f} GiB here), or a smaller copy: LoRA (the adapters only), "
                "or parameters sharded over the GPUs (FSDP2 or ZeRO-3: each keeps its shard)"
            )
        return remedies


def plan_generator_memory(module: nn.Module, setup: GeneratorSetup) -> GeneratorMemoryPlan:
    """The memory plan of ``setup`` for the (unwrapped) training ``module``, which may live on the meta device."""
    params = list(_unique_parameters(module))
    trainable = [p for p in params if p.requires_grad]
    plan = GeneratorMemoryPlan(setup)
    generation, training = setup.generation_device, setup.training_device

    def size(tensors, dtype=setup.dtype) -> int:
        return sum(full_shape(p).numel() * _element_size(staged_dtype(p.dtype, dtype)) for p in tensors)

    staged = packed_bytes(full_shape(p).numel() * _element_size(staged_dtype(p.dtype, setup.dtype)) for p in trainable)
    plan.staging_bytes_per_version = staged
    if setup.backend == "generate":
        whole = setup.sharded or not _same(generation, training)
        copied = params if whole else trainable
        what = "generator copy (whole model)" if whole else "generator copy (trainable weights; frozen ones shared)"
        plan.items.append(MemoryItem(what, size(copied), generation))
        if setup.generation_rows and setup.completion_tokens:
            rows, tokens = setup.generation_rows, setup.completion_tokens
            kv = rows * tokens * setup.kv_bytes_per_token
            what = f"generate: KV cache, {rows} rows x {tokens} completion tokens (prompts add theirs)"
            plan.items.append(MemoryItem(what, kv, generation))
            logits = rows * setup.vocab_size * 4 * LOGITS_COPIES
            what = f"generate: sampling logits, {rows} rows x {setup.vocab_size} (float32, x2)"
            plan.items.append(MemoryItem(what, logits, generation))
        staging_device = setup.staging_device or generation
        if staging_device.type != "cpu" or generation.type != "cuda":
            plan.staging_reason = "the generate backend copies each version into its own module there"
        else:
            plan.staging_pinned = True
            plan.staging_reason = "no room on the GPU beside the generator and training's state"
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
        staging_device = setup.staging_device or torch.device("cpu")
        if staging_device.type != "cpu":
            plan.staging_reason = "fits beside the engine and training's state"
        elif generation.type == "cuda":
            plan.staging_pinned = True
            plan.staging_reason = (
                "the vLLM server loads from the host"
                if setup.backend == "vllm-server"
                else "no room on the GPU beside the engine and training's state"
            )
        else:
            plan.staging_reason = "the engine runs on the CPU"
    plan.staging_device = staging_device
    plan.items.append(MemoryItem("staging, one version", staged, staging_device))
    if setup.staging_sets > 1:
        what = f"staging, {setup.staging_sets - 1} more versions (reproducible_generation)"
        plan.items.append(MemoryItem(what, staged * (setup.staging_sets - 1), staging_device))
    if not setup.training_state_allocated:
        gradients = size(trainable, None) // max(setup.gradient_shards, 1)
        states = setup.optimizer_states_per_parameter * size(trainable, None) // max(setup.optimizer_shards, 1)
        plan.items.append(MemoryItem("training, not allocated yet: gradients", gradients, training))
        plan.items.append(MemoryItem("training, not allocated yet: optimizer states", states, training))
    if setup.keeps_previous_weights:
        kept = size(trainable, None) // max(setup.parameter_shards, 1)
        plan.items.append(MemoryItem(KEPT_WEIGHTS, kept, training))
    if setup.autocast_copy_dtype is not None:
        full_precision = [p for p in params if p.dtype == torch.float32]
        what = f"training under {_dtype_name(setup.autocast_copy_dtype)} autocast: copies of its float32 weights"
        plan.items.append(MemoryItem(what, size(full_precision, setup.autocast_copy_dtype), training))
    return plan


def plan_generator_memory_choosing_staging(
    module: nn.Module, setup: GeneratorSetup, free_bytes: dict[str, int]
) -> GeneratorMemoryPlan:
    """:func:`plan_generator_memory`, where the staging's place is chosen here when ``setup`` leaves it open
    (``staging_device=None``) for ``generate`` or colocated vLLM on a GPU: on the GPU when the plan with the staged
    copies there leaves :data:`DEVICE_STAGING_RESERVE` of the GPU free (``free_bytes``, as
    :meth:`GeneratorMemoryPlan.check` takes them) and the engine's weights fit its reservation; in pinned host memory
    otherwise. On the GPU a version
    moves from the gather to the staging buffer to the engine within the GPU's memory; from pinned host memory it
    crosses PCIe twice (see docs/GPU.md)."""
    generation = setup.generation_device
    chooses = setup.backend in ("generate", "vllm-colocate")
    if not chooses or generation.type != "cuda" or setup.staging_device is not None:
        return plan_generator_memory(module, setup)
    on_device = plan_generator_memory(module, _replace(setup, staging_device=generation))
    free, total = free_bytes.get(str(generation)), setup.device_total_bytes
    if free is not None and total:
        reserve = int(DEVICE_STAGING_RESERVE * total)
        left = free - on_device.bytes_on(generation)
        reservation = _item_bytes(on_device, "vLLM engine")
        if left >= reserve and on_device.engine_weights_bytes <= reservation:
            beside = "the engine" if setup.backend == "vllm-colocate" else "the generator"
            on_device.staging_reason = (
                f"fits beside {beside} and training's state, {left / GIB:.1f} GiB of the GPU left free "
                f"(at least {DEVICE_STAGING_RESERVE:.0%} of it is kept for activations)"
            )
            return on_device
        why = (
            f"staged there it would leave {left / GIB:.1f} GiB free, under the {reserve / GIB:.1f} GiB kept for "
            "activations"
        )
    else:
        why = "the GPU's free memory is unknown"
    on_host = plan_generator_memory(module, _replace(setup, staging_device=torch.device("cpu")))
    on_host.staging_reason = f"not on the GPU: {why}"
    return on_host


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV-cache bytes per sequence and token of a decoder with ``config`` (its text config for a multimodal one) in
    ``dtype``: keys and values of every layer, ``num_key_value_heads`` heads of ``head_dim`` each."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", 0) or 0
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    return 2 * text.num_hidden_layers * kv_heads * head_dim * _element_size(dtype)


def free_device_memory(devices) -> dict[str, int]:
    """Free bytes of each CUDA device in ``devices`` now (others are left out): what the driver reports free, plus
    what torch's caching allocator has reserved in this process but not allocated (it reuses that first)."""
    free = {}
    for device in devices:
        if device.type == "cuda":
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            free[str(device)] = torch.cuda.mem_get_info(device)[0] + max(cached, 0)
    return free


def available_host_memory(meminfo: str | None = None) -> int | None:
    """Bytes of host memory available now without swapping (psutil's ``available``, else ``MemAvailable`` of
    ``/proc/meminfo``; ``meminfo``: read that file instead); None when neither is there."""
    if meminfo is None:
        try:
            import psutil
        except ImportError:
            meminfo = "/proc/meminfo"
        else:
            return int(psutil.virtual_memory().available)
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, *unit = line.split()[1:]
                    return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    except OSError:
        return None
    return None


def processes_on_node() -> int:
    """Training processes on this machine: ``LOCAL_WORLD_SIZE`` (set by torchrun and accelerate), else 1."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def _replace(setup: GeneratorSetup, **changes) -> GeneratorSetup:
    return GeneratorSetup(**{**setup.__dict__, **changes})


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
    return dtype.itemsize


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "as trained" if dtype is None else str(dtype).removeprefix("torch.")


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type == "cpu" or a.index == b.index)
