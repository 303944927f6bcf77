"""Where the generator's prompts come from: GRPOTrainer's order of prompts, without its dataloader.

Each process generates for its own slice of every global generation batch, in the order GRPOTrainer's sampler gives
the trainer's dataloader (same seed, same shuffling), so the prompts a run trains on are the ones GRPOTrainer would
train on. Every group of ``num_generations`` repeats of a prompt stays on one process.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from itertools import count

from datasets import IterableDataset


def _check_whole_groups(local_batch_size: int, num_processes: int, num_generations: int) -> int:
    global_size = local_batch_size * num_processes
    if global_size % num_generations or local_batch_size % num_generations:
        raise ValueError(
            f"The local generation batch ({local_batch_size} rows per process) must hold whole groups of "
            f"num_generations={num_generations}."
        )
    return global_size


def repeated_prompt_batches(
    dataset,
    num_generations: int,
    local_batch_size: int,
    process_index: int = 0,
    num_processes: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    skip_batches: int = 0,
) -> Iterator[list[dict]]:
    """Endless local generation batches: each prompt repeated ``num_generations`` times, whole groups per process.

    A map-style dataset follows the order of TRL's ``RepeatSampler`` (same seed, same permutation per epoch), an
    ``IterableDataset`` the order of TRL's ``repeat_iterable_dataset`` (buffered ``shuffle(seed)``, reshuffled each
    epoch with ``set_epoch``), over epochs without end. The global generation batch is ``local_batch_size *
    num_processes`` rows of consecutive groups and process ``p`` takes rows ``[p * local_batch_size, (p + 1) *
    local_batch_size)``, so no group is split across processes. The first ``skip_batches`` global batches are skipped
    (a resumed run).
    """
    streamed = isinstance(dataset, IterableDataset)
    if streamed:
        batches = _streamed_global_batches(dataset, num_generations, local_batch_size, num_processes, shuffle, seed)
    else:
        batches = _sampled_global_batches(dataset, num_generations, local_batch_size, num_processes, shuffle, seed)
    for produced, batch in enumerate(batches):
        if produced >= skip_batches:
            local = batch[process_index * local_batch_size : (process_index + 1) * local_batch_size]
            yield local if streamed else [dataset[i] for i in local]  # a map-style batch holds indices


def _sampled_global_batches(dataset, num_generations, local_batch_size, num_processes, shuffle, seed):
    from trl.trainer.grpo_trainer import RepeatSampler

    global_size = _check_whole_groups(local_batch_size, num_processes, num_generations)
    sampler = RepeatSampler(
        data_source=dataset,
        mini_repeat_count=num_generations,
        batch_size=global_size // num_generations,
        repeat_count=1,
        shuffle=shuffle,
        seed=seed,
    )
    while True:
        indices = list(iter(sampler))
        if len(indices) < global_size:
            raise ValueError(
                f"The training dataset has {len(dataset)} prompts, fewer than one generation batch needs "
                f"({global_size // num_generations}); add prompts or lower per_device_train_batch_size / "
                "steps_per_generation."
            )
        for start in range(0, len(indices) - global_size + 1, global_size):
            yield indices[start : start + global_size]


def _streamed_global_batches(dataset, num_generations, local_batch_size, num_processes, shuffle, seed):
    global_size = _check_whole_groups(local_batch_size, num_processes, num_generations)
    prompts_per_batch = global_size // num_generations
    stream = dataset.shuffle(seed=seed) if shuffle else dataset
    for epoch in count():
        stream.set_epoch(epoch)
        prompts, batches_this_epoch = [], 0
        for row in stream:
            prompts.append(row)
            if len(prompts) == prompts_per_batch:
                yield [copy.deepcopy(row) for row in prompts for _ in range(num_generations)]
                prompts, batches_this_epoch = [], batches_this_epoch + 1
        if batches_this_epoch == 0:  # the trailing partial batch is dropped, as RepeatSampler drops it
            raise ValueError(
                f"The training dataset streams fewer prompts than one generation batch needs ({prompts_per_batch}); "
                "add prompts or lower per_device_train_batch_size / steps_per_generation."
            )
