"""The Hugging Face ``generate`` backend (:mod:`.backend`) and how it samples and records what it samples
(:mod:`.sampling`)."""

from .backend import HFGenerateBackend, HFGenerationSettings, generation_target

__all__ = ["HFGenerateBackend", "HFGenerationSettings", "generation_target"]
