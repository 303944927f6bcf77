"""The generator's kept weight versions in a checkpoint, so a resumed ``reproducible_generation`` run regenerates its
next batches with the versions the uninterrupted run used (older than the checkpoint's own weights)."""

from __future__ import annotations

import os

import torch

FILE_NAME = "a3po_generator_versions.pt"


def save_kept_versions(backend, directory: str, before: int) -> None:
    """Write the versions ``backend`` keeps that are older than ``before`` (the checkpoint's step) to ``directory``."""
    kept = backend.kept_weights(before)
    if kept:
        torch.save(kept, os.path.join(directory, FILE_NAME))


def load_kept_versions(directory: str | None) -> dict:
    """``{version: (weights, trainer_state)}`` saved with a checkpoint, or ``{}``."""
    if not directory:
        return {}
    path = os.path.join(directory, FILE_NAME)
    if not os.path.isfile(path):
        return {}
    return torch.load(path, map_location="cpu", weights_only=False)  # our own file: tensors and TrainerState
