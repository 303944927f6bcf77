"""Generation: the batch producer (thread, queue, admission control, schedule) and the backends it drives.

- :mod:`.producer`: :class:`BatchProducer`, the admission-controlled producer thread; :mod:`.queue`:
  :class:`VersionedSampleQueue`; both backend-agnostic.
- :mod:`.schedule`: which weight version trains on each micro-step, and so which versions may generate each batch.
- :mod:`.backend`: :class:`GenerationBackend`, the one interface a backend implements;
- :mod:`.weights`: the weight path from the trainer to the generator (gathering sharded weights, the generator's
  dtype, the versioned staging store, the generator's own copies, the memory plan, kept versions in a checkpoint).
- :mod:`.hf`: :class:`HFGenerateBackend`, Hugging Face ``generate`` on the generator's own copy (default); its
  subclass :class:`~.hf.continuous_batching.ContinuousBatchingBackend`, the same copy generating with transformers'
  continuous batching (``use_transformers_continuous_batching``).
- :mod:`.vllm`: vLLM in-process (colocate), or a ``trl vllm-serve`` server (``use_vllm=True``); imported on demand, so
  vLLM is needed only when used.
"""

from ..types import GeneratedCompletions, GenerationStopped, ScoredBatch
from .backend import GenerationBackend
from .hf import HFGenerateBackend, HFGenerationSettings
from .producer import BatchProducer
from .queue import VersionedSampleQueue

__all__ = [
    "GeneratedCompletions",
    "GenerationBackend",
    "BatchProducer",
    "GenerationStopped",
    "HFGenerateBackend",
    "HFGenerationSettings",
    "ScoredBatch",
    "VersionedSampleQueue",
]
