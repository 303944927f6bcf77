"""The batch producer of each ``train()`` call: the run's plan of micro-steps and batches, its prompt batches, the
oldest version allowed for each batch, and where each process's prompt stream stands (for a checkpoint)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..generation.producer import BatchProducer
from ..generation.schedule import (
    MicroStep,
    PlannedBatch,
    TrainingLoopShape,
    oldest_allowed_version,
    plan_run_batches,
)
from ..rollout import run_rollout
from ..rollout.dynamic_sampling import DynamicSampler, resolve_group_filter
from ..rollout.prompt_batches import repeated_prompt_batches
from .rollout import rollout_settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    """The shape of one ``train()`` call's loop: every micro-step, and the generation batches they train on."""

    micro_steps: list[MicroStep]
    batches: list[PlannedBatch]
    """Batch ``i`` of the run (the scored batch whose ``index`` is ``i``), with the micro-steps and versions that
    train on it."""
    micro_steps_per_batch: int
    """``steps_per_generation * num_iterations``: the micro-steps that train on one generation batch."""

    def micro_step(self, run_step: int, global_step: int, warned: bool) -> tuple[MicroStep, bool]:
        """The run's micro-step ``run_step`` (counted from the run's start), and whether the schedule's warning has
        been given: once, where the loop's optimizer step is not the one the plan predicts (the staleness bound may
        then not hold). Raises where the loop runs past the plan."""
        if run_step >= len(self.micro_steps):
            raise RuntimeError(
                f"The training loop ran more micro-steps ({run_step + 1}) than its shape predicts "
                f"({len(self.micro_steps)}); the generation batches of this run are used up."
            )
        step = self.micro_steps[run_step]
        if step.version != global_step and not warned:
            logger.warning(
                "The training loop is at optimizer step %d where its shape predicts %d; the staleness bound may not "
                "hold for this run (the generator never waits for weights the trainer cannot publish).",
                global_step,
                step.version,
            )
            warned = True
        return step, warned


def plan_run(trainer) -> RunPlan:
    """The micro-steps and generation batches of the run starting now, following the loop transformers runs
    (:mod:`a3po_trl.generation.schedule`); the trainer has read the loop's shape (``set_initial_training_values``)."""
    args = trainer.args
    shape = TrainingLoopShape(
        steps_in_epoch=trainer._steps_in_epoch,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=trainer.state.max_steps,
        start_step=trainer.state.global_step,
        skip_trained_data=not args.ignore_data_skip,
    )
    every = args.steps_per_generation * trainer.num_iterations
    micro_steps, batches = plan_run_batches(shape, every)
    return RunPlan(micro_steps, batches, every)


def build_batch_producer(trainer, plan: RunPlan, restored) -> BatchProducer:
    """The batch producer of the run ``plan`` describes, generating with the trainer's backend: its prompt batches
    (from where the run starts in the sampler's order), its rollouts, and the oldest version allowed to generate each
    batch. ``restored`` (:class:`~a3po_trl.checkpoints.run_state.RestoredRunState`) says where a resumed run's prompt
    stream stands and the versions it regenerates its next batches with (kept by the checkpoint, published again
    before the current weights: ``earlier_versions`` of :meth:`BatchProducer.start`)."""
    args = trainer.args
    planned = plan.batches
    batch_number = batch_numbers(trainer, plan)
    local_batch_size = args.per_device_train_batch_size * args.steps_per_generation
    process, processes = trainer.accelerator.process_index, trainer.accelerator.num_processes
    first_draw = restored.first_prompt_draw
    prompt_batches = repeated_prompt_batches(
        trainer.train_dataset,
        num_generations=trainer.num_generations,
        local_batch_size=local_batch_size,
        process_index=process,
        num_processes=processes,
        shuffle=trainer.shuffle_dataset,
        seed=args.seed,
        skip_batches=first_draw,
    )
    refill = None
    if args.dynamic_sampling:
        # every prompt batch a process draws has its own seed, from its position in the process's prompt stream
        settings = rollout_settings(trainer, lambda draw: first_draw + draw)
        refill = DynamicSampler(
            groups_needed=local_batch_size // trainer.num_generations,
            num_generations=trainer.num_generations,
            max_draws=args.dynamic_sampling_max_gen_batches,
            reward_weights=trainer.reward_weights.detach().float().cpu(),
            pad_token_id=trainer._tokenizer.pad_token_id,
            group_filter=resolve_group_filter(args.dynamic_sampling_filter),
            aggregation=trainer.multi_objective_aggregation,
        ).fill
    else:
        settings = rollout_settings(trainer, batch_number)
    earlier = restored.kept_versions
    first_version = min([*earlier, trainer.state.global_step])

    def min_version(index: int) -> int:
        return oldest_allowed_version(planned[index], args.max_staleness, first_version)

    check_kept_versions(trainer, earlier, [min_version(i) for i in range(len(planned))])
    producer = BatchProducer(
        backend=trainer._backend,
        prompt_batches=prompt_batches,
        rollout=lambda *args: run_rollout(settings, *args),
        min_version=min_version,
        num_batches=len(planned),
        queue_size=args.max_staleness + 1,
        asynchronous=args.async_generation,
        num_threads=trainer.cpu_threads.generation,
        poll_interval=args.generation_poll_interval,
        exact_versions=args.reproducible_generation,
        timeline=trainer.timeline,
        refill=refill,
        first_draw=first_draw,
        # every version a micro-step trains with: a checkpoint keeps those a longer continuation needs
        # (version_checkpoint.py)
        publish_through=plan.micro_steps[-1].version if plan.micro_steps else None,
        timeout=trainer.generation_batch_timeout,
        publish_activity=trainer._batch_gate.publish_activity if trainer._batch_gate is not None else None,
        process_index=trainer.accelerator.process_index,
    )
    return producer


def check_kept_versions(trainer, earlier: dict, assigned: list[int]) -> None:
    """Refuse a resumed ``reproducible_generation`` run that would generate a batch with a version older than the
    checkpoint's step that the checkpoint did not keep, before the generation thread fails on it: a checkpoint
    written by an older a3po-trl (which kept only the versions its own run's ``max_steps`` needed), or resumed with a
    larger ``max_staleness`` than it was written with."""
    missing = sorted({v for v in assigned if v < trainer.state.global_step} - set(earlier)) if earlier else []
    if missing:
        raise ValueError(
            f"Resuming from {trainer._resume_checkpoint} with reproducible_generation=True: this run generates "
            f"batches with weight versions {missing}, which the checkpoint does not keep (it keeps "
            f"{sorted(earlier)}). It was written by an older a3po-trl, which kept only the versions its own run's "
            "max_steps needed, or with a smaller max_staleness. Resume with the max_steps (or num_train_epochs) and "
            "max_staleness it was written with, or with reproducible_generation=False (those batches are then "
            "generated with the newest weights)."
        )


def batch_numbers(trainer, plan: RunPlan):
    """``batch_number(index)``: the global number of batch ``index`` of the run ``plan`` describes (its position in
    the sampler's order over epochs)."""
    batches_per_epoch = max(trainer._steps_in_epoch // plan.micro_steps_per_batch, 1)

    def batch_number(index: int) -> int:
        return plan.batches[index].epoch * batches_per_epoch + plan.batches[index].index_in_epoch

    return batch_number


def prompt_draws_to_keep(trainer) -> dict[int, int]:
    """``{global batch number: prompt batches this process drew before it}`` for the batches a run resumed from a
    checkpoint taken now may restart at (the one being trained and those drawn after it, up to the batch after the
    run's last: where a run resumed from its last checkpoint with a larger ``max_steps`` restarts), for the
    checkpoint."""
    producer, plan = trainer._producer, trainer._plan
    if producer is None or plan is None or not plan.batches:
        return {}
    number = batch_numbers(trainer, plan)
    last = len(plan.batches) - 1
    oldest = max(producer.consumed - 1, 0)
    kept = {}
    for index, draws in producer.draw_starts().items():
        if oldest <= index <= last:
            kept[number(index)] = draws
        elif index == last + 1:  # the run's last batch is drawn: the next batch, in its epoch or the next epoch's
            kept[number(last) + 1] = draws  # first (an epoch holds whole generation batches)
    return kept
