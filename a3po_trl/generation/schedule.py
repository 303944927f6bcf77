"""Which policy version trains on each micro-step, and so which weights may generate each batch.

Admission control needs to know, before a batch is generated, the versions (optimizer steps applied) at which it will
be trained. These follow the shape of transformers' training loop, which is not uniform:

- an epoch is ``steps_in_epoch`` micro-steps (the length of the train dataloader);
- each epoch is cut into accumulation windows of ``gradient_accumulation_steps`` micro-steps, and the *last* window of
  an epoch is shorter when ``steps_in_epoch`` is not a multiple of it; every window ends with one optimizer step;
- a run resumed from a checkpoint at global step ``g`` starts in epoch ``g // updates_per_epoch`` at window
  ``g % updates_per_epoch`` (at the epoch's start with ``ignore_data_skip``), and stops at ``max_steps``.

Generation batches are consumed every ``E = steps_per_generation * num_iterations`` micro-steps, aligned with the
epoch as GRPOTrainer's dataloader is (an epoch holds a whole number of batches), so a resumed run restarts inside the
batch the uninterrupted run was in: that batch is generated again and its remaining micro-batches trained.

The oldest version allowed to generate a batch follows from the version of its last micro-step. A run whose
``max_steps`` ends inside a batch trains only part of its last batch; that batch's bound is computed over the whole
batch all the same (:func:`plan_run_batches`), so every batch is assigned the same version whatever the run's length,
and a run continued from a checkpoint with a larger ``max_steps`` generates what the longer run would.

Everything here is a pure function of these integers; the trainer reads the numbers off the loop it runs in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TrainingLoopShape:
    """The integers that fix transformers' training loop for one ``train()`` call."""

    steps_in_epoch: int
    """Micro-steps per epoch (the length of the train dataloader on this process)."""
    gradient_accumulation_steps: int
    max_steps: int
    """Optimizer steps at which training stops."""
    start_step: int = 0
    """``state.global_step`` when the run starts (non-zero when resuming from a checkpoint)."""
    skip_trained_data: bool = True
    """Whether a resumed run skips the micro-steps already trained in its epoch (``not ignore_data_skip``)."""

    def __post_init__(self):
        if self.steps_in_epoch < 1 or self.gradient_accumulation_steps < 1:
            raise ValueError(f"Invalid training loop shape {self}.")

    @property
    def updates_per_epoch(self) -> int:
        return max(math.ceil(self.steps_in_epoch / self.gradient_accumulation_steps), 1)

    def windows(self):
        """``(epoch, first_position, size)`` of each accumulation window of the run, one per optimizer step."""
        per_epoch = self.updates_per_epoch
        accumulation = self.gradient_accumulation_steps
        last_size = self.steps_in_epoch % accumulation or accumulation
        epoch = self.start_step // per_epoch
        update = self.start_step % per_epoch if self.skip_trained_data else 0
        for _ in range(max(self.max_steps - self.start_step, 0)):
            if update == per_epoch:
                epoch, update = epoch + 1, 0
            size = accumulation if update != per_epoch - 1 else last_size
            yield epoch, update * accumulation, size
            update += 1


@dataclass(frozen=True)
class MicroStep:
    """One micro-step of the run: where it is in its epoch and the version of the weights it trains."""

    epoch: int
    position: int
    """Position in the epoch (0-based micro-step index of the epoch's dataloader)."""
    version: int
    """Optimizer steps applied before this micro-step (``state.global_step`` while it runs)."""


@dataclass(frozen=True)
class PlannedBatch:
    """One generation batch of the run and the versions that train on it."""

    epoch: int
    index_in_epoch: int
    first_offset: int
    """Micro-step of the batch the run starts at: 0, except for the first batch of a run resumed mid-batch."""
    micro_steps: int
    """Micro-steps of the run that train on this batch."""
    first_version: int
    last_version: int
    """Version of the last micro-step of the run that trains on the batch."""
    whole_last_version: int | None = None
    """Version of the batch's last micro-step had the run gone on to the batch's end, when the run ends inside it
    (None: ``last_version``, the run trains the whole batch)."""

    @property
    def span(self) -> int:
        """Number of distinct versions that train on the batch."""
        return self.last_version - self.first_version + 1

    @property
    def whole_span(self) -> int:
        """Number of distinct versions that train on the batch had the run gone on to its end: :attr:`span`, except
        for a last batch the run's end cuts short, which a run continued with a larger ``max_steps`` trains on."""
        last = self.last_version if self.whole_last_version is None else self.whole_last_version
        return last - self.first_version + 1


def run_micro_steps(shape: TrainingLoopShape) -> list[MicroStep]:
    """Every micro-step of the run, in order."""
    steps = []
    for version, (epoch, first, size) in enumerate(shape.windows(), start=shape.start_step):
        steps.extend(MicroStep(epoch, position, version) for position in range(first, first + size))
    return steps


def micro_step_after(last: MicroStep, steps_in_epoch: int) -> MicroStep:
    """The micro-step that follows ``last``, the last micro-step of a run (which ends an optimizer step), in the
    same loop run on: where a run continued from its last checkpoint with a larger ``max_steps`` starts."""
    if last.position + 1 < steps_in_epoch:
        return MicroStep(last.epoch, last.position + 1, last.version + 1)
    return MicroStep(last.epoch + 1, 0, last.version + 1)


def plan_generation_batches(micro_steps: list[MicroStep], micro_steps_per_batch: int) -> list[PlannedBatch]:
    """Group the run's micro-steps into generation batches of ``micro_steps_per_batch``, aligned with each epoch."""
    batches: list[PlannedBatch] = []
    key = None
    for step in micro_steps:
        step_key = (step.epoch, step.position // micro_steps_per_batch)
        if step_key != key:
            key = step_key
            batches.append(
                PlannedBatch(
                    epoch=step.epoch,
                    index_in_epoch=step_key[1],
                    first_offset=step.position % micro_steps_per_batch,
                    micro_steps=1,
                    first_version=step.version,
                    last_version=step.version,
                )
            )
        else:
            last = batches[-1]
            batches[-1] = PlannedBatch(
                last.epoch,
                last.index_in_epoch,
                last.first_offset,
                last.micro_steps + 1,
                last.first_version,
                step.version,
            )
    return batches


def plan_run_batches(
    shape: TrainingLoopShape, micro_steps_per_batch: int
) -> tuple[list[MicroStep], list[PlannedBatch]]:
    """Every micro-step of the run and its generation batches (:func:`plan_generation_batches`); a last batch the
    run's end cuts short gets the ``whole_last_version`` the same loop reaches at that batch's end when run on."""
    micro_steps = run_micro_steps(shape)
    batches = plan_generation_batches(micro_steps, micro_steps_per_batch)
    if batches:
        # each optimizer step trains at least one micro-step: this many more complete any batch
        longer = replace(shape, max_steps=shape.max_steps + micro_steps_per_batch)
        whole = plan_generation_batches(run_micro_steps(longer), micro_steps_per_batch)[len(batches) - 1]
        if whole.last_version != batches[-1].last_version:
            batches[-1] = replace(batches[-1], whole_last_version=whole.last_version)
    return micro_steps, batches


def oldest_allowed_version(batch: PlannedBatch, max_staleness: int, start_version: int) -> int:
    """The oldest weights that may generate ``batch`` so that no micro-step of the whole batch (also the part after
    the run's end, ``whole_last_version``) trains on it more than ``max_staleness`` versions later. Never newer than
    the weights the trainer has when it needs the batch (``first_version``)."""
    last = batch.last_version if batch.whole_last_version is None else batch.whole_last_version
    return min(max(start_version, last - max_staleness), batch.first_version)
