"""How many intra-op threads the training thread and the generation thread use on a CPU when the user sets neither
``training_num_threads`` nor ``generation_num_threads``.

The two threads share one process. With PyTorch's count each (every core), each thread runs its own OpenMP team,
and a team's workers spin after every parallel region on the cores the other thread needs; where kernels are small
(a small model, a short micro-batch) that costs more than the threads gain: measured on 2 cores with the random
tiny model (:mod:`benchmarks.compare`, ``benchmarks/results/launch-bound/``), one thread each trains 1.3-1.8x
faster than PyTorch's count each; on SmolLM2-135M, whose products are large, PyTorch's count each is the faster.
So: when the generation thread shares the CPU, the training forward's largest matrix product decides, estimated
from the model's config and the batch shape (:func:`largest_product`): below :data:`SMALL_PRODUCT` multiply-adds,
one intra-op thread each; at or above it, PyTorch's count each (unchanged). The choice is logged once per ``train()``.

With ``generation_process=True`` generation runs in a process of its own on the same cores. Measured on SmolLM2
with 2 cores, PyTorch's count in both processes made the step more than twice as long as the thread's: each process's
OpenMP team spins on the cores the other process needs (GNU OpenMP throttles its spinning where one process runs more
threads than cores, and cannot see another process's threads). So with the process, large products split the cores
between the two (:func:`split_cores`) instead of keeping PyTorch's count; small ones run one thread each, as with the
thread.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Multiply-adds of the largest matrix product of a training micro-batch below which intra-op threads cost more than
#: they gain while two threads share the CPU. Measured on 2 cores: the tiny model (hidden 32-256, up to 3.4e7) gains
#: from one thread each, SmolLM2-135M (1.4e10 at the README's batch) from PyTorch's count; the threshold sits between.
SMALL_PRODUCT = 2**29


@dataclass(frozen=True)
class CPUThreads:
    """The intra-op thread counts ``train()`` sets: ``None`` leaves the thread's count as it is."""

    training: int | None
    generation: int | None
    #: Why, for the log; ``None`` where nothing was chosen for the user.
    reason: str | None = None


def largest_product(model_config, batch_size: int, completion_length: int) -> int | None:
    """Multiply-adds of the largest matrix product in a training forward of one micro-batch: its completion tokens
    (``batch_size x completion_length``, prompts left out) times the hidden size times the widest of the MLP and
    the vocabulary. ``None`` where the config does not say its sizes."""
    config = getattr(model_config, "text_config", None) or model_config
    hidden = getattr(config, "hidden_size", None)
    widths = [getattr(config, name, None) for name in ("intermediate_size", "vocab_size")]
    widths = [width for width in widths if isinstance(width, int)]
    if not isinstance(hidden, int) or not widths:
        return None
    return batch_size * completion_length * hidden * max(widths)


def split_cores(available: int) -> tuple[int, int]:
    """``(training, generation)`` intra-op threads that share ``available`` cores between two processes: half each,
    the odd core to training (whose step is the one waited for), at least one each."""
    generation = max(1, available // 2)
    return max(1, available - generation), generation


def choose_cpu_threads(
    args, model_config, generation_shares_cpu: bool, available: int, generation_in_process: bool = False
) -> CPUThreads:
    """The thread counts for ``args``: the user's where set; with neither set and the generation thread sharing the
    CPU, one each where the largest product is small (:data:`SMALL_PRODUCT`), else PyTorch's count (``available``),
    or, where generation runs in a process of its own on these cores (``generation_in_process``), the cores split
    between the two processes (:func:`split_cores`)."""
    if args.training_num_threads is not None or args.generation_num_threads is not None:
        return CPUThreads(args.training_num_threads, args.generation_num_threads)
    if not generation_shares_cpu or available <= 1:
        return CPUThreads(None, None)
    product = largest_product(model_config, args.per_device_train_batch_size, args.max_completion_length)
    if product is not None and product < SMALL_PRODUCT:
        return CPUThreads(
            1,
            1,
            f"the largest product of a training micro-batch is small ({product:.1e} multiply-adds < "
            f"{SMALL_PRODUCT:.1e}): one intra-op thread each for training and generation, of {available}",
        )
    if product is None:
        why = "the model's config does not give its sizes"
    else:
        why = f"the largest product of a training micro-batch is large ({product:.1e} multiply-adds >= "
        why += f"{SMALL_PRODUCT:.1e})"
    if generation_in_process:
        training, generation = split_cores(available)
        return CPUThreads(
            training,
            generation,
            f"{why} and generation runs in a process of its own (generation_process): the {available} cores are "
            f"split, {training} intra-op threads for training and {generation} for the generation process (each "
            f"process's OpenMP team would spin on the other's cores)",
        )
    return CPUThreads(None, None, f"{why}: both threads keep PyTorch's {available} intra-op threads")
