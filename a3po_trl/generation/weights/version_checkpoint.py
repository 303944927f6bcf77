"""The generator's kept weight versions in a checkpoint, so a resumed ``reproducible_generation`` run regenerates its
next batches with the versions the uninterrupted run used (older than the checkpoint's own weights).

A checkpoint at step ``g`` keeps the versions ``g - max_staleness`` to ``g - 1`` (those of them the store holds; it
holds every one a batch from step ``g`` on may be assigned): whatever ``max_steps`` the run is continued with, every
batch it generates is trained at version ``g`` or later, so is assigned version ``g - max_staleness`` or later, and
versions from ``g`` on are the run's own. At most ``max_staleness`` copies of the trainable weights."""

from __future__ import annotations

import os

import torch

FILE_NAME = "a3po_generator_versions.pt"


def save_kept_versions(backend, directory: str, before: int, max_staleness: int) -> None:
    """Write the versions ``backend`` keeps from ``before - max_staleness`` to ``before - 1`` (``before``: the
    checkpoint's step) to ``directory``."""
    kept = backend.kept_weights(before, since=before - max_staleness)
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
