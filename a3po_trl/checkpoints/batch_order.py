"""The order of the rows of the generation batch in training, kept with a checkpoint so that a run resumed inside a
batch trains the rest of it as the uninterrupted run does.

A generation batch is shuffled once, when the trainer takes it (as GRPOTrainer shuffles it, from torch's global
random stream), and split into ``steps_per_generation`` micro-batches. A checkpoint written inside a batch (its
micro-batches span several optimizer steps) holds the random state *after* that shuffle, and the resumed run generates
the batch again from the same prompts: drawing a new order there would give its remaining micro-batches other rows
than the uninterrupted run's, training some prompts' rows twice and others' not at all, and would move the random
stream off the uninterrupted run's. So every process writes the order of the batch it is in
(``a3po_batch_order_<process>.json``), and the resumed run applies it to the regenerated batch instead of drawing.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

FILE_PREFIX = "a3po_batch_order_"


def batch_order_path(directory: str, process_index: int) -> str:
    return os.path.join(directory, f"{FILE_PREFIX}{process_index}.json")


def save_batch_order(directory: str, process_index: int, order: dict) -> None:
    """Write ``order`` (``{"epoch", "index_in_epoch", "permutation"}``: the batch and its rows' order) to
    ``directory``."""
    with open(batch_order_path(directory, process_index), "w") as file:
        json.dump(order, file)


def load_batch_order(directory: str | None, process_index: int, epoch: int, index_in_epoch: int, rows: int):
    """The saved order of batch ``(epoch, index_in_epoch)`` of ``rows`` rows as a tensor, or None where the checkpoint
    holds none for it (it was written at the end of another batch, or by another trainer or version)."""
    if not directory or not os.path.isfile(batch_order_path(directory, process_index)):
        return None
    with open(batch_order_path(directory, process_index)) as file:
        order = json.load(file)
    if (order["epoch"], order["index_in_epoch"]) != (epoch, index_in_epoch):
        return None
    permutation = order["permutation"]
    if sorted(permutation) != list(range(rows)):
        raise ValueError(
            f"{batch_order_path(directory, process_index)} orders {len(permutation)} rows where the resumed batch has "
            f"{rows}: the run was resumed with other batch settings (per_device_train_batch_size, "
            "steps_per_generation, num_generations) than the checkpoint's; resume with the checkpoint's settings."
        )
    return torch.tensor(permutation)


def permute_rows(batch: dict[str, Sequence | None], permutation: torch.Tensor) -> dict[str, Sequence | None]:
    """``batch``'s rows in ``permutation``'s order, as TRL's ``shuffle_sequence_dict`` orders them (0-dim tensors
    and None kept)."""

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation]
        return [value[i] for i in permutation]

    return {key: permute(value) for key, value in batch.items()}


def order_rows(batch: dict, planned, process_index: int, checkpoint: str | None) -> tuple[dict, dict]:
    """Shuffle the rows of a new generation batch as GRPOTrainer does (``torch.randperm``, from the global random
    stream); the first batch of a run resumed inside it (``planned.first_offset > 0``) takes the order ``checkpoint``
    kept instead. Returns the ordered batch and the order to keep with the next checkpoint."""
    rows = len(next(value for value in batch.values() if value is not None))
    permutation = None
    if planned.first_offset > 0:
        permutation = load_batch_order(checkpoint, process_index, planned.epoch, planned.index_in_epoch, rows)
        if permutation is None:
            logger.warning(
                "Resuming inside generation batch %d of epoch %d, but %s holds no order for its rows (written by "
                "another trainer or an older version): the rest of the batch is drawn anew, so some of its rows may "
                "be trained twice and others not at all.",
                planned.index_in_epoch,
                planned.epoch,
                checkpoint,
            )
    if permutation is None:
        permutation = torch.randperm(rows)  # GRPOTrainer's shuffle_sequence_dict draws this
    order = {"epoch": planned.epoch, "index_in_epoch": planned.index_in_epoch, "permutation": permutation.tolist()}
    return permute_rows(batch, permutation), order
