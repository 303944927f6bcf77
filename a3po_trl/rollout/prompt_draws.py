"""Where each process's prompt stream stands, kept with a checkpoint (dynamic sampling).

Without dynamic sampling a process draws one prompt batch per training batch, so a resumed run knows where to draw
from the batch it restarts at. With it, each process draws as many as it needed to fill each batch (a different
number on each process): every process writes, with each checkpoint, how many prompt batches it had drawn before each
batch a resumed run may restart at (the one being trained, those drawn after it, and once the run's last batch is
drawn the batch after it, where a run resumed with a larger ``max_steps`` restarts), and a resumed run skips exactly
those, so that no prompt is drawn twice or skipped across the resume, and a reproducible run draws (and seeds) its
batches as the uninterrupted run did. A record that lacks the batch a run restarts at is refused, never guessed at.
"""

from __future__ import annotations

import json
import os


def file_name(process_index: int) -> str:
    return f"a3po_prompt_draws_rank{process_index}.json"


def save_prompt_draws(directory: str, process_index: int, num_processes: int, draws_before: dict[int, int]) -> None:
    """Write ``{global batch number: prompt batches this process drew before it}`` into the checkpoint folder."""
    path = os.path.join(directory, file_name(process_index))
    record = {"num_processes": num_processes, "draws_before": {str(k): v for k, v in sorted(draws_before.items())}}
    with open(path, "w") as file:
        json.dump(record, file)


def load_prompt_draws(directory: str | None, process_index: int, num_processes: int) -> dict[int, int] | None:
    """What :func:`save_prompt_draws` wrote into ``directory`` for this process, or None when it holds nothing (no
    checkpoint, or one written without dynamic sampling: one prompt batch per training batch). A checkpoint of a run
    with another number of processes is refused: each process draws its own slice of the prompt stream."""
    if not directory:
        return None
    path = os.path.join(directory, file_name(process_index))
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        record = json.load(file)
    if record["num_processes"] != num_processes:
        raise ValueError(
            f"{directory} was written by a run with dynamic_sampling=True on {record['num_processes']} processes; "
            f"this one has {num_processes}. Each process draws its own slice of the prompt stream, so where each "
            "stood cannot be carried over: resume with the same number of processes, or start a new run."
        )
    return {int(k): v for k, v in record["draws_before"].items()}


def prompt_draws_before(
    directory: str | None, process_index: int, num_processes: int, batch: int, without_record: int
) -> int:
    """How many prompt batches this process drew before global batch ``batch``, the one a run resumed from
    ``directory`` restarts at: what the checkpoint recorded, or ``without_record`` (one prompt batch per batch
    before it) when it recorded nothing. A record that does not name ``batch`` is refused: guessing would draw
    prompts twice or skip some."""
    drawn = load_prompt_draws(directory, process_index, num_processes)
    if drawn is None:
        return without_record
    if batch not in drawn:
        raise ValueError(
            f"{os.path.join(directory, file_name(process_index))} records where this process's prompt stream stood "
            f"(dynamic_sampling=True) before batches {sorted(drawn)} of the run, not before batch {batch}, where "
            "this run restarts, so which prompts it would draw next is unknown. Resume with the same "
            "per_device_train_batch_size, steps_per_generation, gradient_accumulation_steps and num_iterations as "
            "the run that wrote the checkpoint, or start a new run. (A checkpoint written at the last step of a "
            "run by an older a3po_trl lacks the batch after that run's last: resume from an earlier checkpoint.)"
        )
    return drawn[batch]
