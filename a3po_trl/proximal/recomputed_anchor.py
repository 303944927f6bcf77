"""The recomputed proximal anchor of the generation batch in training, kept with a checkpoint written inside it so
that a run resumed there trains the rest of the batch with the anchor the uninterrupted run uses.

The methods that anchor at the current weights (``recompute``, ``metrics``, and ``guarded`` while its guard chose the
recomputed anchor) train a batch spanning several optimizer steps with the log-probs of the weights of its first
step, computed by one no-grad forward at its first micro-step (:mod:`.anchor`) and carried by its buffered
micro-batches as ``recomputed_proximal_logps`` and ``recompute_version``. A run resumed inside the batch starts at a
later micro-step, with newer weights: computing the anchor there would give the rest of the batch another one. So
every process writes its micro-batches' anchors (``a3po_recomputed_anchor-rank<process>.pt``, with a digest of the
sequences they were computed on) when the checkpoint falls inside the batch, and the resumed run, which generates
the batch again, attaches them to its micro-batches instead of computing them, where the sequences are the same on
every process (``reproducible_generation=True`` regenerates the batch bit for bit). Where they are not (the batch is
generated anew by newer weights), the kept anchor belongs to other samples, and the rest of the batch anchors at the
resumed weights, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os

import torch
from accelerate.utils import gather_object

logger = logging.getLogger(__name__)

FILE_NAME = "a3po_recomputed_anchor-rank{rank}.pt"
_SEQUENCE_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


def recomputed_anchor_path(directory: str, process_index: int) -> str:
    return os.path.join(directory, FILE_NAME.format(rank=process_index))


def sequences_digest(micro_batches: list[dict]) -> str:
    """A digest of the sequences (token ids and masks, with their shapes) of ``micro_batches``, in order: what a
    recomputed anchor is a function of, besides the weights."""
    digest = hashlib.sha256()
    for batch in micro_batches:
        for key in _SEQUENCE_KEYS:
            tensor = batch[key].detach().to("cpu", torch.int64).contiguous()
            digest.update(f"{key}{tuple(tensor.shape)}".encode())
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def inside_a_batch(plan, micro_steps_done: int) -> bool:
    """Whether the run, ``micro_steps_done`` micro-steps into ``plan``, stands inside a generation batch: the next
    micro-step trains the batch of the last one. At the run's end, whether the last batch was cut short (a run
    continued with a larger ``max_steps`` goes on inside it)."""
    if plan is None or not 0 < micro_steps_done <= len(plan.micro_steps):
        return False
    per_batch = plan.micro_steps_per_batch
    last = plan.micro_steps[micro_steps_done - 1]
    if micro_steps_done == len(plan.micro_steps):
        return last.position % per_batch != per_batch - 1
    following = plan.micro_steps[micro_steps_done]
    return (following.epoch, following.position // per_batch) == (last.epoch, last.position // per_batch)


def save_recomputed_anchor(trainer, directory: str) -> bool:
    """When the checkpoint falls inside the batch being trained (:func:`inside_a_batch`) and its buffered
    micro-batches carry a recomputed anchor: write this process's, per micro-batch position, into ``directory``.
    Returns whether it wrote."""
    micro_batches, order = trainer._buffered_inputs, trainer._batch_order
    if not micro_batches or order is None or any("recomputed_proximal_logps" not in b for b in micro_batches):
        return False
    if not inside_a_batch(trainer._plan, trainer._step - trainer._run_start_step):
        return False
    kept = {
        "epoch": order["epoch"],
        "index_in_epoch": order["index_in_epoch"],
        "sequences": sequences_digest(micro_batches),
        "logps": [batch["recomputed_proximal_logps"].detach().cpu() for batch in micro_batches],
        "versions": [batch["recompute_version"].detach().cpu() for batch in micro_batches],
    }
    os.makedirs(directory, exist_ok=True)
    torch.save(kept, recomputed_anchor_path(directory, trainer.accelerator.process_index))
    return True


def _kept_anchor(directory: str | None, process_index: int, planned, micro_batches: list[dict]):
    """``(anchor, why not)``: this process's kept anchor of batch ``planned`` if it belongs to ``micro_batches``'s
    sequences, else ``None`` and the reason."""
    path = recomputed_anchor_path(directory, process_index) if directory else None
    if path is None or not os.path.isfile(path):
        return None, f"{directory} holds no recomputed anchor for it (written by another method or an older version)"
    kept = torch.load(path, map_location="cpu", weights_only=True)
    if (kept["epoch"], kept["index_in_epoch"]) != (planned.epoch, planned.index_in_epoch):
        return None, f"{path} holds the anchor of another batch"
    if len(kept["logps"]) != len(micro_batches) or kept["sequences"] != sequences_digest(micro_batches):
        return None, (
            "the batch was generated anew with other completions than those the checkpoint's anchor was computed on "
            "(reproducible_generation=False: newer weights generate it)"
        )
    return kept, None


def restore_recomputed_anchor(trainer, checkpoint: str | None, planned, micro_batches: list[dict]) -> bool:
    """For the first batch of a run resumed inside it (``planned.first_offset > 0``) that anchors at the weights of
    its first optimizer step: attach ``checkpoint``'s kept anchor to ``micro_batches`` where it belongs to their
    sequences on every process (all processes decide together: the recompute forward the others would skip is a
    collective under ZeRO-3 and FSDP2). Otherwise warns once, and the loss anchors at the resumed weights. Returns
    whether it attached."""
    anchor = trainer.proximal_anchor
    if planned.first_offset == 0 or anchor.entry.anchor != "current":
        return False
    accelerator = trainer.accelerator
    kept, why_not = _kept_anchor(checkpoint, accelerator.process_index, planned, micro_batches)
    if accelerator.num_processes > 1:
        reasons = [reason for reason in gather_object([why_not]) if reason is not None]
        why_not = reasons[0] if reasons else None
    if why_not is not None:
        if accelerator.is_main_process:
            logger.warning(
                "Resuming inside generation batch %d of epoch %d, whose proximal anchor (prox_logp_method=%r) is the "
                "log-probs of the weights of its first optimizer step, but %s: the rest of the batch anchors at the "
                "resumed weights instead (set reproducible_generation=True to resume bit for bit).",
                planned.index_in_epoch,
                planned.epoch,
                anchor.method,
                why_not,
            )
        return False
    device = accelerator.device
    for batch, logps, versions in zip(micro_batches, kept["logps"], kept["versions"]):
        batch["recomputed_proximal_logps"] = logps.to(device)
        batch["recompute_version"] = versions.to(device)
    return True
