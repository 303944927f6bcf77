"""The Hugging Face ``generate`` backend (:mod:`.backend`) and how it samples and records what it samples
(:mod:`.sampling`)."""

from .backend import HFGenerateBackend, HFGenerationSettings

__all__ = ["HFGenerateBackend", "HFGenerationSettings"]
