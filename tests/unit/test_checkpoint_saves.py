"""Checkpoint saves under interruption, with a stand-in trainer (one process) whose ``write`` makes a small checkpoint:
a kill in each window of a save leaves a complete checkpoint that ``resume_from_checkpoint=True`` finds.

A kill is a ``KeyboardInterrupt`` raised where the process would die: no cleanup runs after it in the save's code,
so what is on disk afterwards is what a SIGKILL at that point would leave.
"""

import logging
import os
import shutil

import pytest
import torch
from helpers import StandInTrainer

from a3po_trl.checkpoints import checkpoint_problems, resolve_resume_checkpoint, saves


def payload(folder):
    return torch.load(os.path.join(folder, "optimizer.pt"))["weights"][0].item()


def checkpoint_names(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith("checkpoint-"))


def test_a_kill_while_an_existing_checkpoint_is_saved_again_leaves_the_earlier_copy(tmp_path):
    trainer = StandInTrainer(tmp_path, save_total_limit=1)
    trainer.save(2, payload=1.0)
    with pytest.raises(KeyboardInterrupt):  # step 2 saved again (a JIT checkpoint on SIGTERM, a rollback), killed
        trainer.save(2, payload=2.0, interrupt_after_optimizer=True)
    assert checkpoint_names(tmp_path) == ["checkpoint-2"]
    assert checkpoint_problems(str(tmp_path / "checkpoint-2")) == [] and payload(tmp_path / "checkpoint-2") == 1.0
    assert resolve_resume_checkpoint(StandInTrainer(tmp_path), True) == str(tmp_path / "checkpoint-2")

    trainer.save(2, payload=3.0)  # saved again, whole: it replaces the earlier copy
    assert payload(tmp_path / "checkpoint-2") == 3.0 and os.listdir(tmp_path) == ["checkpoint-2"]


@pytest.mark.parametrize("killed_at_rename", [1, 2], ids=["before moving the old copy", "between the renames"])
def test_a_kill_during_the_renames_leaves_a_save_that_resume_finishes(tmp_path, monkeypatch, caplog, killed_at_rename):
    trainer = StandInTrainer(tmp_path)
    trainer.save(2, payload=1.0)
    renames, real_rename = [], os.rename

    def rename(source, target):
        renames.append(source)
        if len(renames) == killed_at_rename and "tmp-checkpoint-2" in f"{source} {target}":
            raise KeyboardInterrupt
        real_rename(source, target)

    monkeypatch.setattr(saves.os, "rename", rename)
    monkeypatch.setattr(saves, "checkpoint_filesystem_problem", lambda run_dir: None, raising=False)
    with pytest.raises(KeyboardInterrupt):
        trainer.save(2, payload=2.0)
    monkeypatch.setattr(saves.os, "rename", real_rename)
    assert (tmp_path / "tmp-checkpoint-2" / "checkpoint-2").is_dir()  # written whole, never renamed

    with caplog.at_level(logging.WARNING, logger="a3po_trl.checkpoints.saves"):
        chosen = resolve_resume_checkpoint(StandInTrainer(tmp_path), True)
    assert chosen == str(tmp_path / "checkpoint-2") and payload(chosen) == 2.0  # the save that was interrupted
    assert "finished the interrupted save" in caplog.text
    assert checkpoint_problems(chosen) == []


def test_the_next_save_publishes_a_staged_checkpoint_written_whole_instead_of_deleting_it(tmp_path, monkeypatch):
    trainer = StandInTrainer(tmp_path)
    real_rename = os.rename

    def rename(source, target):
        if str(source).endswith("tmp-checkpoint-1/checkpoint-1"):
            raise KeyboardInterrupt  # killed right before the rename: the folder is whole
        real_rename(source, target)

    monkeypatch.setattr(saves.os, "rename", rename)
    monkeypatch.setattr(saves, "checkpoint_filesystem_problem", lambda run_dir: None, raising=False)
    with pytest.raises(KeyboardInterrupt):
        trainer.save(1)
    monkeypatch.setattr(saves.os, "rename", real_rename)
    trainer.save(2)  # a run started again without resume_from_checkpoint
    assert checkpoint_names(tmp_path) == ["checkpoint-1", "checkpoint-2"]
    assert checkpoint_problems(str(tmp_path / "checkpoint-1")) == []
    assert not [name for name in os.listdir(tmp_path) if name.startswith("tmp-")]


def test_resume_true_without_a_complete_checkpoint_raises_naming_each_candidate(tmp_path):
    trainer = StandInTrainer(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        trainer.save(1, interrupt_after_optimizer=True)  # the first save was interrupted
    (tmp_path / "checkpoint-2").mkdir()  # an in-place write that never got its trainer state
    with pytest.raises(ValueError) as raised:
        resolve_resume_checkpoint(StandInTrainer(tmp_path), True)
    message = str(raised.value)
    assert message.startswith(f"No valid checkpoint found in output directory ({tmp_path})")
    assert "checkpoint-2 is incomplete (trainer_state.json is missing)" in message
    assert "tmp-checkpoint-1 is an interrupted save" in message
    with pytest.raises(ValueError, match="holds no checkpoint-N folder"):
        resolve_resume_checkpoint(StandInTrainer(tmp_path / "empty"), True)


def test_resume_auto_starts_from_the_beginning_without_a_complete_checkpoint_else_resumes(tmp_path, caplog):
    """``"auto"``, for a job a scheduler requeues: no checkpoint yet, or none complete, starts from the beginning
    (``None``, saying why) where ``True`` raises; once one is complete it resumes from the newest complete one."""
    with caplog.at_level(logging.WARNING, logger="a3po_trl"):
        assert resolve_resume_checkpoint(StandInTrainer(tmp_path / "fresh"), "auto") is None
    assert "holds no checkpoint-N folder. Starting from the beginning." in caplog.text
    trainer = StandInTrainer(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        trainer.save(1, interrupt_after_optimizer=True)  # the first save was interrupted
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="a3po_trl"):
        assert resolve_resume_checkpoint(StandInTrainer(tmp_path), "auto") is None
    assert "tmp-checkpoint-1 is an interrupted save" in caplog.text and "Starting from the beginning" in caplog.text
    trainer.save(2)
    (tmp_path / "checkpoint-3").mkdir()  # an in-place write that never got its trainer state
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="a3po_trl"):
        assert resolve_resume_checkpoint(StandInTrainer(tmp_path), "auto") == str(tmp_path / "checkpoint-2")
    assert "resume_from_checkpoint='auto' skips" in caplog.text and "checkpoint-3 is incomplete" in caplog.text


def test_rotation_deletes_a_half_deleted_checkpoint_first_whatever_its_modification_time(tmp_path):
    trainer = StandInTrainer(tmp_path, save_total_limit=2)
    trainer.save(1)
    trainer.save(2)
    os.remove(tmp_path / "checkpoint-1" / "trainer_state.json")  # a deletion killed half-way touched it last
    os.utime(tmp_path / "checkpoint-1", (4e9, 4e9))
    trainer.save(3)
    assert checkpoint_names(tmp_path) == ["checkpoint-2", "checkpoint-3"]


def test_a_kill_during_rotation_never_leaves_a_half_deleted_checkpoint(tmp_path, monkeypatch):
    trainer = StandInTrainer(tmp_path, save_total_limit=1)
    trainer.save(1)
    real_rmtree = shutil.rmtree

    def killed_rmtree(path, *args, **kwargs):
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            os.remove(os.path.join(path, "trainer_state.json"))  # the first file goes, then the process dies
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_rmtree)
    with pytest.raises(KeyboardInterrupt):
        trainer.save(2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    for name in checkpoint_names(tmp_path):
        assert checkpoint_problems(str(tmp_path / name)) == [], name
    trainer.save(3)  # the next save deletes what the killed rotation left
    assert os.listdir(tmp_path) == ["checkpoint-3"]


def test_an_object_store_mount_is_refused_at_the_first_save(tmp_path, monkeypatch):
    monkeypatch.setattr("a3po_trl.checkpoints.files.filesystem_type", lambda path: "fuse.s3fs")
    with pytest.raises(RuntimeError) as raised:
        StandInTrainer(tmp_path).save(1)
    message = str(raised.value)
    assert "object-store mount (fuse.s3fs)" in message and "Set output_dir to such a folder" in message
    assert checkpoint_names(tmp_path) == []


def test_a_filesystem_that_cannot_rename_a_directory_is_refused_at_the_first_save(tmp_path, monkeypatch):
    real_rename = os.rename

    def no_directory_renames(source, target):
        if os.path.isdir(source):
            raise OSError(95, "Operation not supported")
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", no_directory_renames)
    with pytest.raises(RuntimeError, match=r"renaming a directory failed: .*Operation not supported.*Set output_dir"):
        StandInTrainer(tmp_path).save(1)
    assert checkpoint_names(tmp_path) == []
