"""Checkpoint saves that survive an interruption: written whole or not at all, the newest complete one resumed.

transformers writes ``checkpoint-N`` in place, file after file (model, optimizer, scheduler, RNG states, trainer
state), so a Ctrl-C or a SIGTERM during the write leaves a folder with the final name and half its files, and
``resume_from_checkpoint=True`` (``get_last_checkpoint``: the highest ``checkpoint-N``) picks it and fails. Here:

- :func:`save_checkpoint_atomically` lets transformers (and the trainer's own additions, such as the generator's kept
  versions) write into ``tmp-checkpoint-N/checkpoint-N``; each process flushes the files it sees to disk; once every
  process has written its part, the saving process writes the manifest (every file and its size,
  :mod:`a3po_trl.checkpoints.files`) and renames the folder to ``checkpoint-N``. An existing ``checkpoint-N`` (the same
  step saved again) is moved aside only then, so some complete copy of step N exists at every moment. Rotation
  (``save_total_limit``) then deletes by step, incomplete folders first, each renamed out of the way before it is
  deleted. ``get_last_checkpoint``'s pattern ignores ``tmp-checkpoint-*``.
- An interrupted save is finished or cleaned up later (:func:`finish_interrupted_saves`): a staged folder with a
  valid manifest was written whole and only missed its rename, so it gets its name (never deleted); anything else
  under ``tmp-checkpoint-*`` is deleted by the next save.
- :func:`resolve_resume_checkpoint` resolves ``resume_from_checkpoint=True`` to the newest complete checkpoint, warning
  for each newer incomplete one it skips, and raises, naming every candidate and why it was skipped, when none is
  complete; ``resume_from_checkpoint="auto"`` (a job a scheduler may requeue) resolves the same way but starts from
  the beginning when none is complete.

Every step that can fail on one process (a file that vanishes, a full disk, a failed rename) is caught there and
shared with the others, so all processes raise together instead of some waiting forever in a collective.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable

from accelerate.utils import broadcast_object_list, gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from ..runtime.distributed import raise_together
from .files import (
    STAGING_PREFIX,
    TRAINER_STATE_NAME,
    checkpoint_filesystem_problem,
    checkpoint_problems,
    fsync_directory,
    fsync_files,
    list_checkpoint_files,
    whole_with_manifest,
    write_manifest,
    written_by_processes,
)

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_STAGING = re.compile(rf"^{STAGING_PREFIX}-(\d+)$")
REPLACED_NAME = "replaced"
"""``tmp-checkpoint-N/replaced``: the earlier copy of ``checkpoint-N``, moved aside for the new one."""
DELETING_SUFFIX = "-deleting"
"""``tmp-checkpoint-N-deleting``: a rotated checkpoint being deleted."""
SHARED_DISK_PROBE_PREFIX = ".a3po-save-on-each-node-"
"""``.a3po-save-on-each-node-<token>-<process>``: a saving process's file in ``output_dir`` while the first save with
``save_on_each_node=True`` checks that no other saving process writes there (:func:`_refuse_a_shared_disk`)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or resumed from, on this process or another one."""


# ---- deciding together --------------------------------------------------------------------------------------------
def _decide_on_main(accelerator, decide: Callable[[], object], what: str):
    """``decide()`` on the main process, its result on every process; if it raised, every process raises."""
    error, outcome = None, [None, None]
    if accelerator.is_main_process:
        try:
            outcome = [decide(), None]
        except Exception as caught:  # noqa: BLE001 - re-raised below, after the others were told
            error, outcome = caught, [None, f"{type(caught).__name__}: {caught}"]
    if accelerator.num_processes > 1:
        outcome = broadcast_object_list(outcome, from_process=0)
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise CheckpointError(f"{what} failed on the main process: {outcome[1]}")
    return outcome[0]


# ---- which checkpoints there are -----------------------------------------------------------------------------------
def _step(folder: str) -> int:
    return int(folder.rsplit("-", 1)[1])


def checkpoints_newest_first(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of ``output_dir`` (those ``get_last_checkpoint`` considers), highest N first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        if _CHECKPOINT.match(name) and os.path.isdir(os.path.join(output_dir, name)):
            found.append(os.path.join(output_dir, name))
    return sorted(found, key=_step, reverse=True)


def newest_complete_checkpoint(output_dir: str) -> tuple[str | None, list[tuple[str, list[str]]]]:
    """``(newest complete checkpoint or None, [(newer incomplete checkpoint, its problems), ...])``."""
    skipped = []
    for folder in checkpoints_newest_first(output_dir):
        problems = checkpoint_problems(folder)
        if not problems:
            return folder, skipped
        skipped.append((folder, problems))
    return None, skipped


def _leftovers(run_dir: str) -> list[str]:
    """Names of the ``tmp-checkpoint-*`` entries of ``run_dir``: interrupted saves, replacements and deletions."""
    if not os.path.isdir(run_dir):
        return []
    return sorted(name for name in os.listdir(run_dir) if name.startswith(STAGING_PREFIX))


# ---- publishing, finishing and deleting ---------------------------------------------------------------------------
def _publish(staged: str, final: str, replaced: str) -> None:
    """Give the whole folder ``staged`` the name ``final``. An existing ``final`` (the same step saved again) is
    moved to ``replaced`` only now, so some complete copy of the step has a name at every moment: ``final``, or
    ``staged`` and ``replaced`` together, which :func:`finish_interrupted_saves` resolves."""
    try:
        os.rename(final, replaced)
    except FileNotFoundError:  # no earlier copy, or another saving process (save_on_each_node) moved it
        pass
    try:
        os.rename(staged, final)
    except OSError:
        if not (os.path.isdir(final) and not os.path.exists(staged)):  # not renamed by another saving process
            raise


def finish_interrupted_saves(run_dir: str, delete_the_rest: bool) -> list[str]:
    """Resolve the leftovers of saves interrupted in ``run_dir``; returns what was done, for the log.

    A ``tmp-checkpoint-N/checkpoint-N`` whose manifest checks out was written whole and only missed its rename: it
    becomes ``checkpoint-N`` (replacing the earlier copy, as the interrupted save would have). An earlier copy moved
    aside (``tmp-checkpoint-N/replaced``) whose replacement is gone gets its name back. With ``delete_the_rest``,
    every other ``tmp-checkpoint-*`` entry (writes cut short, copies already replaced, half-deleted rotations) is
    deleted: saves run one at a time, so none of them is in progress.
    """
    done = []
    for name in _leftovers(run_dir):
        path = os.path.join(run_dir, name)
        match = _STAGING.match(name)
        if match:
            final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{match.group(1)}")
            staged, replaced = os.path.join(path, os.path.basename(final)), os.path.join(path, REPLACED_NAME)
            if os.path.isdir(staged) and whole_with_manifest(staged):
                _publish(staged, final, replaced)
                done.append(f"finished the interrupted save of {final} (written whole, not yet renamed)")
            elif not os.path.isdir(final) and os.path.isdir(replaced) and not checkpoint_problems(replaced):
                os.rename(replaced, final)
                done.append(f"restored {final}, whose replacement was never written whole")
        if delete_the_rest:
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"deleted {path}")
    return done


def _delete_checkpoint(folder: str) -> None:
    """Delete a checkpoint folder, renaming it out of ``checkpoint-N`` first: a kill during the deletion leaves a
    ``tmp-checkpoint-N-deleting`` folder (deleted by the next save), never a half-deleted ``checkpoint-N``."""
    doomed = os.path.join(os.path.dirname(folder), f"{STAGING_PREFIX}-{_step(folder)}{DELETING_SUFFIX}")
    try:
        os.rename(folder, doomed)
    except OSError:
        doomed = folder
    shutil.rmtree(doomed, ignore_errors=True)


def rotate_checkpoints_by_step(run_dir: str, save_total_limit: int | None, keep: str, best: str | None) -> list[str]:
    """Delete old checkpoints beyond ``save_total_limit``, oldest step first, incomplete ones (older than ``keep``, the
    checkpoint just written) before any complete one; ``keep`` and ``best`` are never deleted. Returns the deleted.

    transformers orders by modification time; deleting files touches a folder, so a half-deleted folder would look
    newest and a complete one be deleted instead. Steps order checkpoints as a resume does."""
    if not save_total_limit or save_total_limit <= 0:
        return []
    checkpoints = sort_checkpoints(run_dir, use_mtime=False)  # oldest step first
    protected = {os.path.abspath(path) for path in (keep, best) if path}
    candidates = [path for path in checkpoints if os.path.abspath(path) not in protected]
    incomplete = [path for path in candidates if _step(path) < _step(keep) and checkpoint_problems(path)]
    order = incomplete + [path for path in candidates if path not in incomplete]
    excess = len(checkpoints) - max(save_total_limit, len(checkpoints) - len(candidates))
    deleted = order[: max(excess, 0)]
    for path in deleted:
        _delete_checkpoint(path)
    return deleted


# ---- writing a checkpoint -------------------------------------------------------------------------------------------
def _refuse_a_shared_disk(trainer, run_dir: str) -> None:
    """With ``save_on_each_node=True`` the main process of every machine writes its own copy of each checkpoint into
    ``output_dir``, which must then be on each machine's own disk: on a filesystem the machines share they would
    stage, publish and rotate one folder together, one rename failing after the other's (a checkpoint was lost so,
    with two machines on one disk). Each saving process leaves a file named with a token every process agrees on in
    ``run_dir`` and looks for the others'; if it finds one, every process raises, naming the setting and the fix.
    Every process calls it together (collectives)."""
    args, accelerator = trainer.args, trainer.accelerator
    token = broadcast_object_list([uuid.uuid4().hex], from_process=0)[0]
    prefix = f"{SHARED_DISK_PROBE_PREFIX}{token}-"
    probe = os.path.join(run_dir, f"{prefix}{accelerator.process_index}")
    error = None
    try:
        if args.should_save:
            try:
                os.makedirs(run_dir, exist_ok=True)
                open(probe, "w").close()
            except OSError as caught:
                error = caught
        raise_together(accelerator, error, f"Checking where {run_dir} is", CheckpointError)
        if args.should_save:  # every saving process has written its file
            try:
                others = sorted(
                    int(name[len(prefix) :])
                    for name in os.listdir(run_dir)
                    if name.startswith(prefix) and name != os.path.basename(probe)
                )
            except OSError as caught:
                error = caught
            else:
                if others:
                    error = CheckpointError(
                        f"save_on_each_node=True makes the main process of every machine write its own copy of each "
                        f"checkpoint into output_dir, but process {accelerator.process_index} sees the files process"
                        f"{'es' if len(others) > 1 else ''} {', '.join(map(str, others))} of another machine wrote "
                        f"into {run_dir}: output_dir is on a filesystem the machines share, where they would write "
                        "and rename the same folders. Set save_on_each_node=False (the default: process 0 writes the "
                        "one copy, every process its RNG state into it), or point output_dir at each machine's own "
                        "disk."
                    )
        raise_together(accelerator, error, f"Checking where {run_dir} is", CheckpointError)
    finally:  # after the collective above: every saving process has looked
        if args.should_save:
            try:
                os.remove(probe)
            except OSError:
                pass


def _prepare(trainer, run_dir: str, staging_root: str) -> None:
    """On a saving process: check the filesystem (first save only), resolve earlier interrupted saves, and create
    the staging folder."""
    checked = trainer.__dict__.setdefault("_checkpoint_filesystems_checked", set())
    if run_dir not in checked:
        os.makedirs(run_dir, exist_ok=True)
        problem = checkpoint_filesystem_problem(run_dir)
        if problem:
            raise CheckpointError(problem)
        checked.add(run_dir)
    for action in finish_interrupted_saves(run_dir, delete_the_rest=True):
        logger.info("Checkpoints: %s.", action)
    os.makedirs(staging_root, exist_ok=True)


def _flush_own_files(staged: str) -> tuple[list[str], list[str]]:
    """On every process after its write: flush what it sees of the staged folder to disk (its own files among
    them); returns ``(files seen, problems)``."""
    try:
        seen = list(list_checkpoint_files(staged)) if os.path.isdir(staged) else []
    except OSError as error:
        return [], [f"{staged} cannot be listed ({error})"]
    return seen, fsync_files(staged) if os.path.isdir(staged) else []


def _publish_staged(trainer, run_dir: str, staged: str, final: str, files_seen: list[list[str]]) -> None:
    """On a saving process, once every process has written and flushed its files: the manifest, the rename, the
    rotation."""
    args, state = trainer.args, trainer.state
    if state.best_model_checkpoint == staged:  # transformers recorded the staging path: the final one
        state.best_model_checkpoint = final
        state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
    files = list_checkpoint_files(staged)
    if not args.save_on_each_node:  # one copy, on a disk every process shares: every process's files are in it
        unseen = sorted({name for seen in files_seen for name in seen} - set(files))
        if unseen:
            raise CheckpointError(
                f"Files other processes wrote into {staged} are not visible to the saving process ({unseen[:5]}): "
                "output_dir must be on a filesystem every process shares, or set save_on_each_node=True."
            )
    problems = checkpoint_problems(staged)
    if problems:
        raise CheckpointError(f"{staged} is not whole after every process wrote it: {'; '.join(problems)}")
    write_manifest(staged, files, trainer.accelerator.num_processes)
    staging_root = os.path.dirname(staged)
    for folder in (staged, staging_root, run_dir):  # the entries leading to the staged folder are on disk too
        fsync_directory(folder)
    _publish(staged, final, os.path.join(staging_root, REPLACED_NAME))
    shutil.rmtree(staging_root, ignore_errors=True)
    fsync_directory(run_dir)
    rotate_checkpoints_by_step(run_dir, args.save_total_limit, keep=final, best=state.best_model_checkpoint)


def save_checkpoint_atomically(trainer, trial, write: Callable[[], None]) -> str:
    """Write checkpoint ``global_step`` with ``write()`` (transformers' ``_save_checkpoint`` plus the trainer's own
    files) into a staging folder, and rename it to ``checkpoint-N`` once every process has written its part.

    ``write`` runs while ``trainer._checkpoint_staging_dir`` is set: the trainer's ``_get_output_dir`` returns it,
    so transformers writes ``<staging>/checkpoint-N``. Pushing to the Hub is held back until the rename (it uploads
    in the background from the folder's path). Returns the final folder. A failure on any process (the filesystem,
    a write, a flush, the rename) raises on every process, and leaves every complete checkpoint in place.
    """
    args, accelerator = trainer.args, trainer.accelerator
    run_dir = trainer._get_output_dir(trial=trial)
    folder_name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    final = os.path.join(run_dir, folder_name)
    staging_root = os.path.join(run_dir, f"{STAGING_PREFIX}-{trainer.state.global_step}")
    staged = os.path.join(staging_root, folder_name)

    checked_disks = trainer.__dict__.setdefault("_save_on_each_node_disks_checked", set())
    if args.save_on_each_node and accelerator.num_processes > 1 and run_dir not in checked_disks:
        _refuse_a_shared_disk(trainer, run_dir)
        checked_disks.add(run_dir)
    error = None
    if args.should_save:
        try:
            _prepare(trainer, run_dir, staging_root)
        except Exception as caught:  # noqa: BLE001 - raised on every process by raise_together
            error = caught
    raise_together(accelerator, error, f"Preparing {final}", CheckpointError)

    push_to_hub, args.push_to_hub = args.push_to_hub, False
    trainer._checkpoint_staging_dir = staging_root
    error, seen = None, []
    try:
        write()
        seen, problems = _flush_own_files(staged)
        if problems:
            error = CheckpointError(f"Writing {final}: {'; '.join(problems)}")
    except Exception as caught:  # noqa: BLE001 - raised on every process by raise_together
        error = caught
    finally:
        trainer._checkpoint_staging_dir = None
        args.push_to_hub = push_to_hub
    files_seen = gather_object([seen]) if accelerator.num_processes > 1 else [seen]
    raise_together(accelerator, error, f"Writing {final}", CheckpointError)

    error = None
    if args.should_save:
        try:
            _publish_staged(trainer, run_dir, staged, final, files_seen)
        except Exception as caught:  # noqa: BLE001 - raised on every process by raise_together
            error = caught
    raise_together(accelerator, error, f"Publishing {final}", CheckpointError)
    if push_to_hub:
        trainer._push_from_checkpoint(final)
    return final


# ---- resuming -----------------------------------------------------------------------------------------------------
def _resume_decision(output_dir: str, setting: str) -> tuple[str | None, list[str]]:
    """What ``resume_from_checkpoint=True`` (or ``"auto"``: ``setting`` as the messages write it) means in
    ``output_dir``: ``(checkpoint, warnings)``, or ``(None, [why there is none])``. Finishes saves that were written
    whole but interrupted before their rename first."""
    for action in finish_interrupted_saves(output_dir, delete_the_rest=False):
        logger.warning("resume_from_checkpoint=%s %s.", setting, action)
    chosen, skipped = newest_complete_checkpoint(output_dir)
    reasons = [f"{os.path.basename(folder)} is incomplete ({'; '.join(problems)})" for folder, problems in skipped]
    if chosen is not None:
        warnings = [
            f"resume_from_checkpoint={setting} skips {output_dir}/{reason}, probably from an interrupted save."
            for reason in reasons
        ]
        if skipped:
            warnings.append(f"Resuming from {chosen}, the newest complete checkpoint.")
        return chosen, warnings
    reasons += [f"{name} is an interrupted save (never written whole)" for name in _leftovers(output_dir)]
    found = "; ".join(reasons) if reasons else "it holds no checkpoint-N folder"
    return None, [
        f"No valid checkpoint found in output directory ({output_dir}) for resume_from_checkpoint={setting}: {found}."
    ]


def _explicit_path_problem(path: str) -> str | None:
    if not os.path.isdir(path):
        return None  # transformers says it cannot find it
    problems = checkpoint_problems(path)
    if not problems:
        return None
    newest, _ = newest_complete_checkpoint(os.path.dirname(os.path.abspath(path)))
    alternative = f"the newest complete one is {newest}; " if newest else ""
    return (
        f"resume_from_checkpoint={path!r} is an incomplete checkpoint ({'; '.join(problems)}), probably from an "
        f"interrupted save. Resume from another one: {alternative}resume_from_checkpoint=True picks the newest "
        "complete one."
    )


def resolve_resume_checkpoint(trainer, requested):
    """``train()``'s ``resume_from_checkpoint`` as it should reach transformers.

    ``True`` becomes the newest complete checkpoint of ``output_dir``, with a warning naming each newer, incomplete
    one it skips; when none is complete it raises, naming every candidate and why it was skipped. ``"auto"`` (for a
    job a scheduler may requeue: the same command starts the run, then resumes it) becomes the same checkpoint, or
    ``None`` when none is complete: the run starts from the beginning, saying why. A path (``str`` or
    ``os.PathLike``) becomes a ``str``, refused with its problems and the fix if it is incomplete. The main process
    decides, once, and tells the others: every process resumes from the same checkpoint, or raises, together. A
    checkpoint written on another number of processes is refused (:func:`refuse_another_number_of_processes`).
    """
    checkpoint = _resolve(trainer, requested)
    if isinstance(checkpoint, str):
        refuse_another_number_of_processes(trainer.accelerator, checkpoint)
    return checkpoint


def refuse_another_number_of_processes(accelerator, checkpoint: str) -> None:
    """Refuse, on every process together and before anything is loaded, a resume from ``checkpoint`` on another
    number of processes than wrote it (:func:`~a3po_trl.checkpoints.files.written_by_processes`, read by the main
    process): each process's state (its rows of the batch being trained, its random streams, the guard's check in
    progress and kept weights, the recomputed anchor, where its prompt draws stand) and the batch it trains follow
    from the number of processes, so such a resume could only depart from the run silently, or hang."""
    recorded = _decide_on_main(accelerator, lambda: written_by_processes(checkpoint), f"Reading {checkpoint}")
    if recorded is None or recorded == accelerator.num_processes:
        return
    now = accelerator.num_processes
    raise ValueError(
        f"{checkpoint} was written by a run on {_processes(recorded)}; this one has {now}. Each process's part of "
        "the run (its rows of each batch, its random streams, the proximal guard's check in progress and kept "
        "weights, the recomputed anchor, its prompt draws) cannot be carried over to another number of processes: "
        f"resume on {_processes(recorded)}, or start a new run on {_processes(now)} without resume_from_checkpoint "
        "(loading the checkpoint's model as its starting weights)."
    )


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _resolve(trainer, requested):
    accelerator = trainer.accelerator
    auto = isinstance(requested, str) and requested == "auto"
    if (isinstance(requested, bool) and requested) or auto:
        setting = "'auto'" if auto else "True"
        chosen, messages = _decide_on_main(
            accelerator,
            lambda: _resume_decision(trainer.args.output_dir, setting),
            "Choosing the checkpoint to resume from",
        )
        if chosen is None and not auto:
            raise ValueError(
                f"{messages[0]} Resume from a complete checkpoint's path, start from the beginning without "
                "resume_from_checkpoint (the next save deletes interrupted saves), or pass "
                "resume_from_checkpoint='auto', which starts from the beginning when there is no complete checkpoint."
            )
        if accelerator.is_main_process:
            for message in messages:
                logger.warning(message if chosen is not None else f"{message} Starting from the beginning.")
        return chosen
    if isinstance(requested, (str, os.PathLike)):
        path = os.fspath(requested)
        problem = _decide_on_main(accelerator, lambda: _explicit_path_problem(path), f"Checking {path}")
        if problem:
            raise ValueError(problem)
        return path
    return requested


def resumed_a_complete_run(checkpoint, global_step: int, max_steps: int) -> bool:
    """Whether a run resumed from ``checkpoint`` is already at (or past) ``max_steps``: a finished run started again
    (a requeued job), which transformers' loop would train one more step (its stop check follows each step). Says so
    once, with the fix."""
    if checkpoint is None or global_step < max_steps:
        return False
    logger.warning(
        "Resuming from %s, at optimizer step %d of max_steps=%d: the run is complete. Nothing is trained and no "
        "checkpoint is written; raise max_steps (or num_train_epochs) to train further.",
        checkpoint,
        global_step,
        max_steps,
    )
    return True
