"""What a checkpoint of ``AsyncA3POTrainer`` holds beyond Trainer's, saved (:func:`save_run_state`) and restored
(:func:`restore_run_state`) here, piece by piece: the state of the run that lives outside the model, the optimizer
and the random streams, written by every process into the checkpoint's (staging) folder. Each piece's file is written
and read by one module, its save beside its load:

- the order of the rows of the batch being trained (:mod:`.batch_order`) and, where the checkpoint falls inside a
  batch trained with the recomputed anchor, that anchor (:mod:`a3po_trl.proximal.recomputed_anchor`);
- with ``reproducible_generation``, the weight versions a resumed run may still generate with
  (:mod:`a3po_trl.generation.weights.version_checkpoint`);
- with ``prox_logp_method="guarded"``, the guard's state (:mod:`a3po_trl.proximal.guard`);
- with dynamic sampling, where each process's prompts stand (:mod:`a3po_trl.rollout.prompt_draws`).

One rule for a piece the checkpoint lacks (written by another method, setting or version): the resumed run starts
that piece as a fresh run does, with a warning where it then departs from the uninterrupted run; a piece it holds that
contradicts the resumed run's settings (batch shape or ``max_staleness``) is refused, naming the fix. A checkpoint
written on another number of processes is refused as a whole, before anything is loaded
(:func:`~a3po_trl.checkpoints.saves.refuse_another_number_of_processes`): every piece here is per process.

And under FSDP2, the model files ``save_model`` writes whole from every process's shards
(:func:`save_fsdp2_model`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..builders import batch_numbers, prompt_draws_to_keep, weight_gather
from ..generation.weights.gather import whole_state_dict
from ..generation.weights.names import ACTIVATION_CHECKPOINT_PREFIX, strip_checkpoint_wrapper_from_files
from ..generation.weights.version_checkpoint import load_kept_versions, save_kept_versions
from ..proximal.recomputed_anchor import restore_recomputed_anchor, save_recomputed_anchor
from ..rollout.prompt_draws import prompt_draws_before, save_prompt_draws
from .batch_order import order_rows, save_batch_order


def save_run_state(trainer, directory: str) -> None:
    """Write this process's part of the run's state into the checkpoint folder ``directory`` (every process calls
    it, after Trainer's own save)."""
    process, args = trainer.accelerator.process_index, trainer.args
    if trainer._batch_order is not None:  # every process: the order of its rows of the batch it is in
        save_batch_order(directory, process, trainer._batch_order)
        save_recomputed_anchor(trainer, directory)  # and, where the checkpoint falls inside it, its anchor
    if args.reproducible_generation and trainer._backend is not None and args.should_save:
        save_kept_versions(trainer._backend, directory, trainer.state.global_step, args.max_staleness)
    guard = trainer.proximal_anchor.guard
    if guard is not None:  # every process: the anchor in use, the check in progress
        guard.save(directory, process)
    if args.dynamic_sampling and trainer._producer is not None:  # every process: where its prompts stand
        os.makedirs(directory, exist_ok=True)
        draws = prompt_draws_to_keep(trainer)
        save_prompt_draws(directory, process, trainer.accelerator.num_processes, draws)


@dataclass
class RestoredRunState:
    """What a run takes from the checkpoint it resumes from (``checkpoint``; None: a run started afresh, every piece
    at its default): what the batch producer starts from, and what the run's first batch takes when it arrives."""

    checkpoint: str | None
    process_index: int
    first_prompt_draw: int = 0
    """The prompt batches this process drew before the run's first batch (its position in the prompt stream)."""
    kept_versions: dict = field(default_factory=dict)
    """``{version: (weights, trainer_state)}`` the generator regenerates the run's next batches with."""

    def order_rows(self, batch: dict, planned) -> tuple[dict, dict]:
        """``batch``'s rows shuffled as GRPOTrainer does, or, for the first batch of a run resumed inside it, in the
        order the checkpoint kept (:func:`~a3po_trl.checkpoints.batch_order.order_rows`); and the order to keep."""
        return order_rows(batch, planned, self.process_index, self.checkpoint)

    def attach_recomputed_anchor(self, trainer, planned, micro_batches: list[dict]) -> bool:
        """For the first batch of a run resumed inside it: the recomputed anchor the checkpoint kept, where it belongs
        (:func:`~a3po_trl.proximal.recomputed_anchor.restore_recomputed_anchor`)."""
        return restore_recomputed_anchor(trainer, self.checkpoint, planned, micro_batches)


def restore_run_state(trainer, plan) -> RestoredRunState:
    """What a run (``plan``) starting now takes from the checkpoint it resumes from (``trainer._resume_checkpoint``),
    on every process: the guard's state (restored now), the prompt batches drawn before its first batch and the
    generator's kept versions (for the batch producer), and, through the returned object, the order of the rows and
    the recomputed anchor of its first batch, when that batch arrives."""
    checkpoint, args = trainer._resume_checkpoint, trainer.args
    process, processes = trainer.accelerator.process_index, trainer.accelerator.num_processes
    guard = trainer.proximal_anchor.guard
    if guard is not None and checkpoint is not None:
        guard.load(checkpoint, process, trainer.accelerator.device)
    restored = RestoredRunState(checkpoint, process)
    if plan.batches:  # a checkpoint of a run with dynamic sampling says where its varying number of draws left off
        first = batch_numbers(trainer, plan)(0)
        restored.first_prompt_draw = prompt_draws_before(checkpoint, process, processes, first, first)
    if args.reproducible_generation:  # the versions a resumed reproducible run regenerates its next batches with
        restored.kept_versions = load_kept_versions(checkpoint)
    return restored


def save_fsdp2_model(trainer, output_dir: str) -> None:
    """``save_model`` under FSDP2 (whatever the plugin's ``state_dict_type``): a normal model or PEFT adapter built
    from every process's shards, the whole tensors gathered on every process together (called on all of them, as
    Trainer's own is), written by the main process. Under PEFT only the adapters' tensors (every adapter's, e.g. TRL's
    frozen ``ref`` copy too) and whatever else is trainable are gathered."""
    model = trainer._unwrapped_model()
    if hasattr(model, "peft_config"):
        adapters = set(model.peft_config)
        wanted = [(n, p) for n, p in model.named_parameters() if p.requires_grad or adapters & set(n.split("."))]
        state_dict = whole_state_dict(weight_gather(trainer), wanted)
    else:
        state_dict = trainer.accelerator.get_state_dict(trainer.model)  # full, on the main process, in CPU memory
    trainer._save(output_dir, state_dict=state_dict)
    if trainer.args.should_save and any(ACTIVATION_CHECKPOINT_PREFIX in name for name in state_dict):
        # PEFT picks the adapter's entries by the model's own (wrapped) module names, and writes them so: the files
        # must name them as the model without activation-checkpointing wrappers does, to load anywhere
        strip_checkpoint_wrapper_from_files(output_dir)
