"""Generation: the versioned engine (thread, queue, admission control) and the backends it drives.

- :mod:`.engine`: :class:`GenerationEngine`, :class:`VersionedSampleQueue`, :class:`ScoredBatch`; backend-agnostic.
- :mod:`.backend`: :class:`GenerationBackend`, the one interface a backend implements, with the versioned weights.
- :mod:`.hf_generate`: :class:`HFGenerateBackend`, Hugging Face ``generate`` on the generator's own copy (default).
- :mod:`.vllm_colocate` / :mod:`.vllm_server`: vLLM in-process, or a ``trl vllm-serve`` server (``use_vllm=True``);
  imported on demand, so vLLM is needed only when used.
"""

from .backend import GeneratedCompletions, GenerationBackend, GenerationStopped
from .engine import GenerationEngine, ScoredBatch, VersionedSampleQueue
from .hf_generate import HFGenerateBackend, HFGenerationSettings

__all__ = [
    "GeneratedCompletions",
    "GenerationBackend",
    "GenerationEngine",
    "GenerationStopped",
    "HFGenerateBackend",
    "HFGenerationSettings",
    "ScoredBatch",
    "VersionedSampleQueue",
]
