"""a3po-trl: asynchronous RL post-training of LLMs with A-3PO, as a drop-in TRL trainer.

The GSM8K / SmolLM2 demo helpers (problems, rewards, evaluation, plots, the offline model) are in
:mod:`a3po_trl.tasks`, which this package does not import."""

from .config import CAP_MODES, LOSS_TYPES, PROXIMAL_METHODS, AsyncA3POConfig
from .functional import (
    aggregate_loss,
    approximate_proximal_logps,
    behavior_importance_weight,
    decoupled_ppo_loss,
    kl_to_reference,
    proximal_approximation_error,
    staleness_weight,
)
from .generation import BatchProducer, GenerationBackend, HFGenerateBackend, ScoredBatch, VersionedSampleQueue
from .trainer import AsyncA3POTrainer

__version__ = "0.1.0"

__all__ = [
    "AsyncA3POConfig",
    "AsyncA3POTrainer",
    "CAP_MODES",
    "BatchProducer",
    "GenerationBackend",
    "HFGenerateBackend",
    "LOSS_TYPES",
    "PROXIMAL_METHODS",
    "ScoredBatch",
    "VersionedSampleQueue",
    "aggregate_loss",
    "approximate_proximal_logps",
    "behavior_importance_weight",
    "decoupled_ppo_loss",
    "kl_to_reference",
    "proximal_approximation_error",
    "staleness_weight",
]
