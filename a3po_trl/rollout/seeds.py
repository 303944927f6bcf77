"""The seeds of a rollout's random streams: one per generation batch (from the run's seed, the process and the batch's
number, so a resumed run samples a batch as it did), and one per generate call within a batch."""

from __future__ import annotations

import numpy as np


def sampling_seeds(seed: int, process_index: int, batch_numbers):
    """Seed of each batch's random stream: from ``seed``, the process and the batch's global number, so every process
    and batch has its own stream and a resumed run regenerates a batch with the stream it had."""

    def batch_seed(index: int) -> int:
        sequence = np.random.SeedSequence([seed, process_index, batch_numbers(index)])
        return int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1)

    return batch_seed


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Seed of a batch's ``turn``-th generate call (turn 0 uses the batch seed itself)."""
    if seed is None or turn == 0:
        return seed
    return (seed * 6364136223846793005 + 1442695040888963407 * turn) % (1 << 63)
