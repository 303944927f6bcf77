"""Where each process's prompt stream stands, kept with a checkpoint (dynamic sampling).

Without dynamic sampling a process draws one prompt batch per training batch, so a resumed run knows where to draw
from the batch it restarts at. With it, each process draws as many as it needed to fill each batch (a different
number on each process): every process writes, with each checkpoint, how many prompt batches it had drawn before each
batch a resumed run may restart at, and a resumed run skips exactly those, so that no prompt is drawn twice or
skipped across the resume, and a reproducible run draws (and seeds) its batches as the uninterrupted run did.
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
