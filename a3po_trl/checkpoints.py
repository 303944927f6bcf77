"""Checkpoints that survive an interruption: written whole or not at all, and resumed from the newest complete one.

transformers writes ``checkpoint-N`` in place, file after file (model, optimizer, scheduler, RNG states, trainer
state), so a Ctrl-C or a SIGTERM during the write leaves a folder with the final name and half its files, and
``resume_from_checkpoint=True`` (``get_last_checkpoint``: the highest ``checkpoint-N``) picks it and fails. Here:

- :func:`save_checkpoint_atomically` lets transformers (and the trainer's own additions, such as the generator's kept
  versions) write into ``tmp-checkpoint-N/checkpoint-N``, waits for every process to finish writing, flushes the
  files to disk, and only then renames the folder to ``checkpoint-N`` (one rename, on the process that saves), before
  transformers' rotation (``save_total_limit``) runs on the real folders. ``get_last_checkpoint``'s pattern ignores
  ``tmp-checkpoint-*``, so an interrupted write is invisible to any resume, this trainer's or transformers'.
- :func:`resolve_resume_checkpoint` resolves ``resume_from_checkpoint=True`` to the newest checkpoint that is
  complete (:func:`checkpoint_problems`: checkpoints written in place by other trainers or versions, copied by hand,
  or cut by a full disk may still be partial), warns naming each newer one it skips, and decides on the main process
  so that every process resumes from the same one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Callable

from accelerate.utils import broadcast_object_list
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

logger = logging.getLogger(__name__)

STAGING_PREFIX = f"tmp-{PREFIX_CHECKPOINT_DIR}"
"""Prefix of the folders checkpoints are written into before their rename (never matched by
``get_last_checkpoint``)."""
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_ZIP_MAGIC = b"PK\x03\x04"


# ---- what a complete checkpoint is --------------------------------------------------------------------------------
def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file is cut short, from its header (the byte ranges of its tensors), or None."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as file:
            (header_length,) = struct.unpack("<Q", file.read(8))
            if header_length > size - 8:
                return "truncated (header longer than the file)"
            header = json.loads(file.read(header_length))
    except (struct.error, ValueError, UnicodeDecodeError):
        return "unreadable header"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    if 8 + header_length + max(ends, default=0) > size:
        return "truncated (its tensors end past the end of the file)"
    return None


def _torch_file_problem(path: str) -> str | None:
    """Why a ``torch.save`` file is cut short, or None. Since PyTorch 1.6 these are zip archives whose directory is at
    their end, so a cut file has none; files in the legacy format cannot be checked without loading them."""
    if os.path.getsize(path) == 0:
        return "empty"
    with open(path, "rb") as file:
        if file.read(4) != _ZIP_MAGIC:
            return None
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return "truncated (no zip directory at its end)"


def checkpoint_problems(folder: str) -> list[str]:
    """Why ``folder`` cannot be resumed from; empty if it is complete.

    Complete means: ``trainer_state.json`` (which transformers writes after the model, optimizer, scheduler and RNG
    states) is present and parses, and no file it loads is cut short: every ``torch.save`` file (``optimizer.pt``,
    ``scheduler.pt``, RNG states, DeepSpeed shards) has its zip directory, every safetensors file holds the bytes its
    header promises. Reads only headers and zip directories, not the tensors.
    """
    problems = []
    state = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        problems.append(f"{TRAINER_STATE_NAME} is missing")
    else:
        try:
            with open(state) as file:
                json.load(file)
        except (ValueError, UnicodeDecodeError):
            problems.append(f"{TRAINER_STATE_NAME} is not valid JSON")
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            problem = None
            if name.endswith(".safetensors"):
                problem = _safetensors_problem(path)
            elif name.endswith(_TORCH_SUFFIXES):
                problem = _torch_file_problem(path)
            if problem:
                problems.append(f"{os.path.relpath(path, folder)} is {problem}")
    return problems


def checkpoints_newest_first(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of ``output_dir`` (those ``get_last_checkpoint`` considers), highest N first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found, reverse=True)]


def newest_complete_checkpoint(output_dir: str) -> tuple[str | None, list[tuple[str, list[str]]]]:
    """``(newest complete checkpoint or None, [(newer incomplete checkpoint, its problems), ...])``."""
    skipped = []
    for folder in checkpoints_newest_first(output_dir):
        problems = checkpoint_problems(folder)
        if not problems:
            return folder, skipped
        skipped.append((folder, problems))
    return None, skipped


def _interrupted_writes(output_dir: str) -> list[str]:
    if not os.path.isdir(output_dir):
        return []
    return sorted(name for name in os.listdir(output_dir) if name.startswith(STAGING_PREFIX))


def _decide_resume(output_dir: str) -> tuple[str | bool | None, list[str]]:
    """What ``resume_from_checkpoint=True`` means in ``output_dir``, and the warnings to give."""
    chosen, skipped = newest_complete_checkpoint(output_dir)
    warnings = [
        f"resume_from_checkpoint=True skips {folder}: it is incomplete ({'; '.join(problems)}), probably from an "
        "interrupted save."
        for folder, problems in skipped
    ]
    interrupted = _interrupted_writes(output_dir)
    if chosen is not None:
        if skipped:
            warnings.append(f"Resuming from {chosen}, the newest complete checkpoint.")
        return chosen, warnings
    if skipped or interrupted:
        warnings.append(
            f"resume_from_checkpoint=True found no complete checkpoint in {output_dir} (interrupted writes: "
            f"{[os.path.basename(folder) for folder, _ in skipped] + interrupted}): training starts from the "
            "beginning."
        )
        return None, warnings
    return True, warnings  # nothing at all: transformers raises its own "no valid checkpoint" error


def resolve_resume_checkpoint(trainer, requested):
    """``train()``'s ``resume_from_checkpoint`` as it should reach transformers.

    ``True`` becomes the newest complete checkpoint of ``output_dir`` (with a warning naming each newer, incomplete
    one it skips), ``None`` when only interrupted writes are there (training starts from the beginning, with a
    warning), or stays ``True`` when there is no checkpoint at all (transformers then says so). The main process
    decides and tells the others, so every process resumes from the same checkpoint even if their views of the
    filesystem differ. A path is checked and refused, with its problems and the fix, if it is incomplete.
    """
    if isinstance(requested, bool) and requested:
        accelerator = trainer.accelerator
        decision = [None, []]
        if accelerator.is_main_process:
            decision = list(_decide_resume(trainer.args.output_dir))
        if accelerator.num_processes > 1:
            decision = broadcast_object_list(decision, from_process=0)
        chosen, warnings = decision
        if accelerator.is_main_process:
            for warning in warnings:
                logger.warning(warning)
        return chosen
    if isinstance(requested, (str, os.PathLike)) and os.path.isdir(requested):
        problems = checkpoint_problems(str(requested))
        if problems:
            newest, _ = newest_complete_checkpoint(os.path.dirname(os.path.abspath(requested)))
            alternative = f"the newest complete one is {newest}; " if newest else ""
            raise ValueError(
                f"resume_from_checkpoint={str(requested)!r} is an incomplete checkpoint ({'; '.join(problems)}), "
                f"probably from an interrupted save. Resume from another one: {alternative}"
                "resume_from_checkpoint=True picks the newest complete one."
            )
    return requested


# ---- writing whole checkpoints --------------------------------------------------------------------------------------
def _fsync_tree(folder: str) -> None:
    """Flush every file of ``folder`` and the folders themselves to disk, so the rename publishes written data even
    across a machine crash (a process killed after the rename needs nothing more: the data is in the page cache)."""
    for root, _, files in os.walk(folder):
        for name in files:
            descriptor = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        _fsync_directory(root)


def _fsync_directory(folder: str) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories (Windows)
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _remove_interrupted_writes(run_dir: str) -> None:
    """Delete the staging folders of earlier, interrupted saves (saves are sequential: none is in progress)."""
    for name in _interrupted_writes(run_dir):
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def save_checkpoint_atomically(trainer, trial, write: Callable[[], None]) -> str:
    """Write checkpoint ``global_step`` with ``write()`` (transformers' ``_save_checkpoint`` plus the trainer's own
    files) into a staging folder, and rename it to ``checkpoint-N`` once every process has written its part.

    ``write`` runs while ``trainer._checkpoint_staging_dir`` is set: the trainer's ``_get_output_dir`` returns it,
    so transformers writes ``<staging>/checkpoint-N``. Pushing to the Hub is held back until the rename (it uploads
    in the background from the folder's path). Returns the final folder.
    """
    args, accelerator = trainer.args, trainer.accelerator
    run_dir = trainer._get_output_dir(trial=trial)
    folder_name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    final = os.path.join(run_dir, folder_name)
    staging_root = os.path.join(run_dir, f"{STAGING_PREFIX}-{trainer.state.global_step}")
    staged = os.path.join(staging_root, folder_name)
    if args.should_save:
        _remove_interrupted_writes(run_dir)
        if os.path.isdir(final):  # the same step saved again (a run resumed from an earlier one): replace it whole
            replaced = f"{staging_root}-replaced"
            try:
                os.rename(final, replaced)
            except FileNotFoundError:  # another saving process (save_on_each_node on a shared disk) moved it
                pass
            shutil.rmtree(replaced, ignore_errors=True)
        os.makedirs(staging_root, exist_ok=True)
    accelerator.wait_for_everyone()

    push_to_hub, args.push_to_hub = args.push_to_hub, False
    trainer._checkpoint_staging_dir = staging_root
    try:
        write()
    finally:
        trainer._checkpoint_staging_dir = None
        args.push_to_hub = push_to_hub
    accelerator.wait_for_everyone()  # every process's files (RNG states, DeepSpeed shards) are in the staging folder

    if args.should_save:
        if trainer.state.best_model_checkpoint == staged:  # transformers recorded the staging path: the final one
            trainer.state.best_model_checkpoint = final
            trainer.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        _fsync_tree(staged)
        try:
            os.rename(staged, final)
        except OSError:
            if not (os.path.isdir(final) and not os.path.exists(staged)):  # not renamed by another saving process
                raise
        shutil.rmtree(staging_root, ignore_errors=True)
        _fsync_directory(run_dir)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )
    accelerator.wait_for_everyone()
    if push_to_hub:
        trainer._push_from_checkpoint(final)
    return final
