"""The Hugging Face ``generate`` backend: generation on the generator's own copy of the policy, in-process.

The copy is a ``deepcopy`` of the (unwrapped) training module in which every frozen parameter is the *same* tensor as
the trainer's (shared when on the same device) and every trainable parameter is its own tensor in the generator's
dtype (:func:`~a3po_trl.generation.weights.generator_dtype`: the mixed-precision dtype when the trainer computes in
one), refreshed between batches from the staging buffer (on the generation device, in the same dtype). Any
instance-level ``forward`` patch (TRL's fused LM head, accelerate's autocast wrapper) is removed from the copy, so it
never closes over the training module; ``patch_fn`` re-applies a patch to the copy itself.

When the training module's parameters are sharded (DeepSpeed ZeRO-3, FSDP2), ``gather`` (a
:class:`~a3po_trl.generation.weights.ParameterGather`) makes them whole: the copy is built from the model's config on
the meta device and filled with the gathered weights, one parameter at a time (nothing can be shared), and every
publication gathers the trainable weights; both happen in the main thread, on every process together.

With ``in_flight_weight_updates`` (:attr:`HFGenerationSettings.in_flight_updates`), a version published while a batch
is being generated is loaded between two decode steps and the batch continues with it; every token records the
version that sampled it (:mod:`.in_flight`).

Sampling draws from the backend's own ``torch.Generator`` (:class:`~.sampling.OwnStreamSampling`) for
plain sampling, and the behavior log-probs are recorded while generating
(:class:`~.sampling.GenerationLogpsRecorder`) or, where ``generate`` does not run one forward per token,
computed with one extra forward. When the sampler truncates or penalises the policy's distribution (top-k/p, min-p,
repetition penalties, ...), the log-probs of the distribution each token was drawn from are recorded as well
(:attr:`GeneratedCompletions.sampling_logps`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteriaList

from ...config import BEHAVIOR_LOGPS_SOURCES
from ...padding import pad_rows
from ...patches import peft_base_model
from ...runtime.devices import explicit_device, module_device, same_device, wait_for_copies
from ...types import GeneratedCompletions, GenerationStopped
from ..backend import GenerationBackend
from ..weights import StagingLayout, VersionedWeights, as_parameter_gather
from ..weights.copies import generator_copy, unsharded_copy
from ..weights.names import without_checkpoint_wrapper
from .in_flight import InFlightLoads
from .sampling import GenerationLogpsRecorder, OwnStreamSampling

logger = logging.getLogger(__name__)


def per_token_logps_fused(model: nn.Module, input_ids, attention_mask, logits_to_keep: int, chunk_size: int | None):
    """Per-token log-probs of the last ``logits_to_keep`` tokens through TRL's fused LM head (temperature-scaled)."""
    chunk_size = chunk_size or input_ids.size(0)
    out = []
    for start in range(0, input_ids.size(0), chunk_size):
        ids = input_ids[start : start + chunk_size]
        mask = attention_mask[start : start + chunk_size]
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        outputs = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.append(outputs.log_probs[:, -logits_to_keep:].float())
    return torch.cat(out, dim=0)


@dataclass
class HFGenerationSettings:
    """How the ``generate`` backend samples, copied from the trainer once so the thread never reads the trainer."""

    generation_config: GenerationConfig
    eos_token_ids: list[int]
    pad_token_id: int
    chunk_size: int | None = None
    """Rows per ``generate`` call (None: the whole batch at once)."""
    autocast_dtype: torch.dtype | None = None
    """Mixed-precision dtype of the trainer's forward (bf16/fp16), applied to generation and behavior log-probs so
    they come from the same numerics as the training log-probs; None for full precision."""
    behavior_logps_source: str = "generation"
    """``"generation"``: record the log-probs while generating (:class:`GenerationLogpsRecorder`); ``"forward"``:
    one extra no-grad forward over prompts and completions after generation."""
    temperature: float = 1.0
    """Temperature of the training log-probs (TRL's ``temperature``), used by ``"generation"``."""
    own_random_stream: bool = True
    """Sample from the backend's own ``torch.Generator`` (plain sampling only, see
    :func:`~.sampling.samples_with_own_stream`); False leaves token selection to ``generate`` (the global
    RNG)."""
    record_sampling_logps: bool = False
    """The generation config processes the distribution before sampling (see
    :func:`~.sampling.processed_sampling`): also record the log-probs of the processed distribution the
    tokens are drawn from. Needs ``behavior_logps_source="generation"`` and ``own_random_stream``."""
    in_flight_updates: bool = False
    """Load a version published while a batch is being generated between two decode steps and continue with it
    (:mod:`.in_flight`); every token records the version that sampled it. Needs
    ``behavior_logps_source="generation"`` and a generation config that runs one forward per token."""


class HFGenerateBackend(GenerationBackend):
    """Generation with Hugging Face ``generate`` on the generator's own copy of the policy (see the module doc)."""

    def __init__(
        self,
        module: nn.Module,
        settings: HFGenerationSettings,
        device: torch.device | str | None = None,
        patch_fn=None,
        gather=None,
        dtype: torch.dtype | None = None,
        staging_device: torch.device | str | None = None,
    ):
        if settings.behavior_logps_source not in BEHAVIOR_LOGPS_SOURCES:
            raise ValueError(
                f"behavior_logps_source={settings.behavior_logps_source!r} must be one of {BEHAVIOR_LOGPS_SOURCES}."
            )
        if settings.record_sampling_logps and not (
            settings.own_random_stream and settings.behavior_logps_source == "generation"
        ):
            raise ValueError(
                "The sampling log-probs of a processed distribution (top-k/p, min-p, penalties, ...) are recorded "
                "only while generating with plain sampling: record_sampling_logps needs own_random_stream=True and "
                "behavior_logps_source='generation'."
            )
        if settings.in_flight_updates and settings.behavior_logps_source != "generation":
            raise ValueError(
                "in_flight_weight_updates needs behavior_logps_source='generation': the behavior log-prob of each "
                "token must be recorded from the forward of the weights that sampled it."
            )
        self.settings = settings
        device = explicit_device(device if device is not None else module_device(module))
        gather = as_parameter_gather(gather)
        shares = not gather.sharded and same_device(device, module_device(module))
        if gather.sharded:
            self.module = unsharded_copy(module, gather, device, dtype)
        else:
            self.module = generator_copy(module, device, dtype, share_frozen=shares)
        self.module.eval()
        if patch_fn is not None:
            patch_fn(self.module)  # may change dtypes (an fp32 LM head): the staging layout is read after it

        own = {without_checkpoint_wrapper(name): p for name, p in self.module.named_parameters()}
        trainable_names = [name for name, p in module.named_parameters() if p.requires_grad]
        self._own = {name: own[without_checkpoint_wrapper(name)] for name in trainable_names}
        staging = torch.device(staging_device) if staging_device is not None else device
        layout = StagingLayout(
            shapes={name: p.shape for name, p in self._own.items()},
            dtypes={name: p.dtype for name, p in self._own.items()},
            device=staging,
            pin_memory=staging.type == "cpu" and device.type == "cuda",  # the memory plan's choice on a full GPU
        )
        super().__init__(VersionedWeights(layout, gather), device)
        own_ids = {id(p) for p in self._own.values()}
        self.shared_parameter_count = sum(p.numel() for p in own.values() if id(p) not in own_ids and shares)
        self.copied_parameter_count = sum(p.numel() for p in self._own.values())
        self._sampling_generator = torch.Generator(device=self.device) if settings.own_random_stream else None
        self._fallback_warned = False

    @property
    def reads_staging_on_host(self) -> bool:
        # on a GPU the copies below are queued on the generation thread's stream, ordered by the store's events
        return self.device.type != "cuda"

    def load_weights(self, weights, version):
        for name, param in self._own.items():
            param.copy_(weights[name], non_blocking=True)
        if self.reads_staging_on_host:  # e.g. a CPU generator fed from a GPU: nothing orders these copies but a wait
            wait_for_copies([self.device, *(t.device for t in weights.values())])

    def generate(self, prompt_ids, should_stop, seed):
        settings = self.settings
        if self._sampling_generator is not None and seed is not None:
            self._sampling_generator.manual_seed(seed)
        record = settings.behavior_logps_source == "generation"
        timings = {}
        with torch.no_grad(), _autocast(self.device, settings.autocast_dtype):
            completion_ids, logps, sampling_logps, token_versions = self._generate(
                prompt_ids, should_stop, record, timings
            )
        if logps is None and settings.in_flight_updates:
            raise RuntimeError(
                "in_flight_weight_updates: the behavior log-probs could not be recorded during generation (this "
                "generation setup does not run one forward per generated token), and a forward after generation "
                "would score every token with the weights loaded last. Use plain sampling or greedy decoding "
                "without beams, assisted decoding or chunked prefill, or set in_flight_weight_updates=False."
            )
        if logps is None and settings.record_sampling_logps:
            raise RuntimeError(
                "The log-probs of the processed sampling distribution (top-k/p, min-p, penalties, ...) could not be "
                "recorded: this generation setup does not run one forward per generated token. Leave the sampling "
                "settings at their neutral values (top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)."
            )
        if logps is None:
            if record and not self._fallback_warned:
                self._fallback_warned = True
                logger.warning(
                    "The behavior log-probs could not be recorded during generation (this generation setup runs "
                    "forwards that are not one per generated token); they are computed with one extra forward pass "
                    "instead. Set behavior_logps_source='forward' to silence this."
                )
            start = time.perf_counter()
            logps = self._forward_logps(prompt_ids, completion_ids)
            timings["behavior_logps"] = time.perf_counter() - start
        return GeneratedCompletions(
            completion_ids=completion_ids,
            logps=logps,
            sampling_logps=sampling_logps,
            timings=timings,
            token_versions=token_versions,
        )

    def _forward_logps(self, prompt_ids, completion_ids) -> list[torch.Tensor]:
        settings = self.settings
        prompts, prompt_mask = pad_rows(prompt_ids, settings.pad_token_id, "left")
        completions, completion_mask = pad_rows(completion_ids, settings.pad_token_id, "right")
        with torch.no_grad(), _autocast(self.device, settings.autocast_dtype):
            logps = per_token_logps_fused(
                self.module,
                torch.cat([prompts, completions], dim=1).to(self.device),
                torch.cat([prompt_mask, completion_mask], dim=1).to(self.device),
                completions.size(1),
                settings.chunk_size,
            ).cpu()
        return [row[: len(ids)] for row, ids in zip(logps, completion_ids)]

    def _generate(self, prompt_ids_list, should_stop, record_logps: bool, timings: dict[str, float]):
        """Completion ids per row, cut after the first EOS, and (``record_logps``) their behavior log-probs and, when
        the settings ask for them, their sampling log-probs; the log-probs are ``None`` when they could not be
        recorded. With in-flight updates, also the version of each token (else ``None``), and the loads' count and
        seconds in ``timings``."""
        settings, module, device = self.settings, self.module, self.device
        chunk = settings.chunk_size or len(prompt_ids_list)
        in_flight = settings.in_flight_updates
        token_versions: list[list[int]] | None = [] if in_flight else None
        if in_flight:
            timings.update(in_flight_weight_load=0.0, in_flight_weight_loads=0.0)
        completions: list[list[int]] = []
        logps: list[torch.Tensor] | None = [] if record_logps else None
        sampling_logps: list[torch.Tensor] | None = [] if record_logps and settings.record_sampling_logps else None
        eos = torch.tensor(settings.eos_token_ids, device=device)
        for start in range(0, len(prompt_ids_list), chunk):
            ids, mask = pad_rows(prompt_ids_list[start : start + chunk], settings.pad_token_id, "left")
            ids, mask = ids.to(device), mask.to(device)
            recorder = (
                GenerationLogpsRecorder(
                    peft_base_model(module), settings.temperature, record_sampling=sampling_logps is not None
                )
                if logps is not None
                else None
            )
            loads = InFlightLoads(self) if in_flight else None
            criteria = [_CallableStop(should_stop)] if should_stop is not None else []
            if loads is not None:
                criteria.append(loads)  # after the stop check: it tags the step, then may load a version
            stopping = StoppingCriteriaList(criteria) if criteria else None
            extra = {}
            if self._sampling_generator is not None:
                observer = recorder.sampling_observer if recorder is not None else None
                extra["custom_generate"] = OwnStreamSampling(self._sampling_generator, observe=observer)
            try:
                output = module.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=settings.generation_config,
                    stopping_criteria=stopping,
                    synced_gpus=False,  # transformers turns it on under ZeRO-3: a collective per token would deadlock
                    **extra,
                )
            finally:
                if recorder is not None:
                    recorder.close()
                if loads is not None:
                    timings["in_flight_weight_load"] += loads.seconds
                    timings["in_flight_weight_loads"] += loads.loads
            generated = output[:, ids.size(1) :]
            if loads is not None and len(loads.step_versions) != generated.size(1):
                raise RuntimeError(
                    f"in_flight_weight_updates: generate ran {len(loads.step_versions)} decode steps for "
                    f"{generated.size(1)} generated tokens, so the version of each token is unknown. Use plain "
                    "sampling or greedy decoding without beams or assisted decoding."
                )
            chunk_logps = recorder.finish(generated) if recorder is not None else None
            if recorder is not None and chunk_logps is None:
                logps = sampling_logps = None  # misaligned: the caller computes them with a forward pass instead
            is_eos = torch.isin(generated, eos)
            eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
            has_eos = is_eos.any(dim=1)
            eos_idx[has_eos] = is_eos.int().argmax(dim=1)[has_eos]
            keep = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
            keep = keep.cpu()
            completions.extend(row[m].tolist() for row, m in zip(generated.cpu(), keep))
            if token_versions is not None:
                token_versions.extend(loads.step_versions[: int(m.sum())] for m in keep)
            if logps is not None:
                logps.extend(row[m] for row, m in zip(chunk_logps.float().cpu(), keep))
            if sampling_logps is not None:
                sampling_logps.extend(row[m] for row, m in zip(recorder.sampling_logps.float().cpu(), keep))
        if should_stop is not None and should_stop():
            raise GenerationStopped
        return completions, logps, sampling_logps, token_versions


class _CallableStop:
    """A stopping criterion that ends generation when ``should_stop()`` turns true."""

    def __init__(self, should_stop):
        self.should_stop = should_stop

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), bool(self.should_stop()), dtype=torch.bool, device=input_ids.device)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None)
