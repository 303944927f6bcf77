"""What a checkpoint of ``AsyncA3POTrainer`` holds beyond Trainer's: the state of the run that lives outside the
model, the optimizer and the random streams, written by every process into the checkpoint's (staging) folder.

- the order of the rows of the batch being trained and, where the checkpoint falls inside a batch trained with the
  recomputed anchor, that anchor (:mod:`.batch_order`, :mod:`.recomputed_anchor`);
- with ``reproducible_generation``, the weight versions a resumed run may still generate with
  (:mod:`a3po_trl.generation.weights.version_checkpoint`);
- with ``prox_logp_method="guarded"``, the guard's state (:mod:`a3po_trl.proximal_guard`);
- with dynamic sampling, where each process's prompts stand (:mod:`a3po_trl.rollout.prompt_draws`).

And under FSDP2, the model files ``save_model`` writes whole from every process's shards
(:func:`save_fsdp2_model`).
"""

from __future__ import annotations

import os

from ..builders import prompt_draws_to_keep, weight_gather
from ..generation.weights.gather import whole_state_dict
from ..generation.weights.names import ACTIVATION_CHECKPOINT_PREFIX, strip_checkpoint_wrapper_from_files
from ..generation.weights.version_checkpoint import save_kept_versions
from ..rollout.prompt_draws import save_prompt_draws
from .batch_order import save_batch_order
from .recomputed_anchor import save_recomputed_anchor


def save_run_state(trainer, directory: str) -> None:
    """Write this process's part of the run's state into the checkpoint folder ``directory`` (every process calls
    it, after Trainer's own save)."""
    process, args = trainer.accelerator.process_index, trainer.args
    if trainer._batch_order is not None:  # every process: the order of its rows of the batch it is in
        save_batch_order(directory, process, trainer._batch_order)
        save_recomputed_anchor(trainer, directory)  # and, where the checkpoint falls inside it, its anchor
    if args.reproducible_generation and trainer._backend is not None and args.should_save:
        save_kept_versions(trainer._backend, directory, trainer.state.global_step, args.max_staleness)
    if trainer.proximal_guard is not None:  # every process: the anchor in use, the check in progress
        trainer.proximal_guard.save(directory, process)
    if args.dynamic_sampling and trainer._producer is not None:  # every process: where its prompts stand
        os.makedirs(directory, exist_ok=True)
        draws = prompt_draws_to_keep(trainer)
        save_prompt_draws(directory, process, trainer.accelerator.num_processes, draws)


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
