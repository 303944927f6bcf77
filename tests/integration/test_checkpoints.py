"""Checkpoints that survive an interruption: written whole or not at all, resumed from the newest complete one."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import StopAt, free_port, make_trainer, run_process_tree
from safetensors.torch import save_file
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from a3po_trl.checkpoints import checkpoint_problems, newest_complete_checkpoint, resolve_resume_checkpoint, run_state
from a3po_trl.checkpoints.files import MANIFEST_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKPOINTS = dict(save_strategy="steps", save_steps=1)


def _truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as file:
        file.truncate(int(size * keep))


def _break(checkpoint):
    """What a Ctrl-C during an in-place write leaves: a truncated optimizer state and no trainer state."""
    _truncate(os.path.join(checkpoint, "optimizer.pt"))
    os.remove(os.path.join(checkpoint, "trainer_state.json"))


def test_a_checkpoint_is_complete_only_if_its_state_and_files_are_whole(tmp_path):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    torch.save({"state": torch.ones(1000)}, folder / "optimizer.pt")
    save_file({"w": torch.ones(1000)}, str(folder / "model.safetensors"))
    (folder / "legacy.bin").write_bytes(b"\x80\x02legacy pickle")  # not a zip: cannot be checked, accepted
    assert checkpoint_problems(str(folder)) == []

    _truncate(folder / "model.safetensors", 0.9)
    assert checkpoint_problems(str(folder)) == [
        "model.safetensors is truncated (its tensors end past the end of the file)"
    ]
    save_file({"w": torch.ones(1000)}, str(folder / "model.safetensors"))
    _truncate(folder / "optimizer.pt", 0.99)
    (folder / "trainer_state.json").write_text('{"global_step": ')
    assert checkpoint_problems(str(folder)) == [
        "trainer_state.json is not valid JSON",
        "optimizer.pt is truncated (no zip directory at its end)",
    ]
    os.remove(folder / "trainer_state.json")
    assert checkpoint_problems(str(folder))[0] == "trainer_state.json is missing"


class _RecordResumedStep(TrainerCallback):
    def __init__(self):
        self.started_at = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started_at = state.global_step


def test_resume_true_skips_a_partial_newest_checkpoint(tokenizer, tmp_path, caplog):
    first = make_trainer(tokenizer, tmp_path, max_steps=2, **CHECKPOINTS)
    first.train()
    out = tmp_path / "out"
    assert sorted(p for p in os.listdir(out) if "checkpoint" in p) == ["checkpoint-1", "checkpoint-2"]
    _break(str(out / "checkpoint-2"))
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")  # what transformers alone would resume from

    with pytest.raises(ValueError, match=r"checkpoint-2.*incomplete.*optimizer.pt is truncated.*checkpoint-1"):
        make_trainer(tokenizer, tmp_path, max_steps=3, **CHECKPOINTS).train(
            resume_from_checkpoint=str(out / "checkpoint-2")
        )

    resumed = make_trainer(tokenizer, tmp_path, max_steps=3, **CHECKPOINTS)
    recorder = _RecordResumedStep()
    resumed.add_callback(recorder)
    with caplog.at_level(logging.WARNING, logger="a3po_trl.checkpoints.saves"):
        resumed.train(resume_from_checkpoint=True)
    assert f"skips {out / 'checkpoint-2'}" in caplog.text and "trainer_state.json is missing" in caplog.text
    assert recorder.started_at == 1 and resumed.state.global_step == 3
    # the partial checkpoint-2 was replaced whole when step 2 was saved again; no staging folder is left
    assert newest_complete_checkpoint(str(out)) == (str(out / "checkpoint-3"), [])
    assert checkpoint_problems(str(out / "checkpoint-2")) == []
    assert not [p for p in os.listdir(out) if p.startswith("tmp-")]


class _SaveAgainAndDieAt(TrainerCallback):
    """Saves step ``step`` a second time right after its regular save, as ``enable_jit_checkpoint`` does when a
    SIGTERM arrives then, and the process dies while that save writes the optimizer state."""

    def __init__(self, trainer, step):
        self.trainer, self.step = trainer, step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        real_save = torch.save

        def dies_mid_write(obj, f, *args, **kwargs):
            if os.fspath(f).endswith("optimizer.pt"):
                raise KeyboardInterrupt
            return real_save(obj, f, *args, **kwargs)

        with mock.patch.object(torch, "save", dies_mid_write):
            self.trainer._save_checkpoint(self.trainer.model, trial=None)


def test_a_kill_while_a_step_is_saved_again_leaves_it_resumable(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, max_steps=2, save_total_limit=1, **CHECKPOINTS)
    trainer.add_callback(_SaveAgainAndDieAt(trainer, 2))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    out = tmp_path / "out"
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-2"]
    assert checkpoint_problems(str(out / "checkpoint-2")) == []

    resumed = make_trainer(tokenizer, tmp_path, max_steps=3, save_total_limit=1, **CHECKPOINTS)
    recorder = _RecordResumedStep()
    resumed.add_callback(recorder)
    resumed.train(resume_from_checkpoint=True)
    assert recorder.started_at == 2 and resumed.state.global_step == 3


def test_a_checkpoint_that_lost_a_file_its_manifest_lists_is_not_resumed_from(tokenizer, tmp_path):
    make_trainer(tokenizer, tmp_path, max_steps=2, **CHECKPOINTS).train()
    out = tmp_path / "out"
    os.remove(out / "checkpoint-2" / "rng_state.pth")  # whole otherwise: every remaining file is intact
    assert checkpoint_problems(str(out / "checkpoint-2")) == ["rng_state.pth is missing (the manifest lists it)"]
    assert resolve_resume_checkpoint(make_trainer(tokenizer, tmp_path), True) == str(out / "checkpoint-1")


def test_a_path_given_as_resume_from_checkpoint_restores_the_generators_kept_versions(tokenizer, tmp_path):
    settings = dict(reproducible_generation=True, max_staleness=2, max_steps=4, save_steps=2, save_strategy="steps")
    first = make_trainer(tokenizer, tmp_path, **settings)
    first.add_callback(StopAt(2))
    with pytest.raises(KeyboardInterrupt):
        first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "a3po_generator_versions.pt").is_file()  # versions a batch after step 2 still needs

    loaded = []

    def load_kept_versions(directory):
        loaded.append(directory)
        return real_load(directory)

    real_load = run_state.load_kept_versions
    resumed = make_trainer(tokenizer, tmp_path, **settings)
    with mock.patch.object(run_state, "load_kept_versions", load_kept_versions):
        resumed.train(resume_from_checkpoint=Path(checkpoint))
    assert loaded == [str(checkpoint)] and real_load(loaded[0])
    assert resumed.state.global_step == 4


def test_rotation_keeps_the_newest_checkpoints(tokenizer, tmp_path):
    make_trainer(tokenizer, tmp_path, max_steps=3, save_total_limit=2, **CHECKPOINTS).train()
    assert sorted(p for p in os.listdir(tmp_path / "out") if "checkpoint" in p) == ["checkpoint-2", "checkpoint-3"]


def test_sigterm_while_a_checkpoint_is_written_leaves_the_previous_one_newest(tokenizer, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "writing"
    script = os.path.join(ROOT, "tests", "scripts", "sigterm_during_checkpoint.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    process = subprocess.Popen(
        [sys.executable, script, str(out), str(marker), "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():  # the slow disk is in the middle of checkpoint-2's optimizer.pt
            assert process.poll() is None, process.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the script never reached the checkpoint write"
            time.sleep(0.1)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        assert time.monotonic() - sent < 10  # it stops within seconds
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGTERM
    assert not (out / "checkpoint-2").exists()  # the half-written checkpoint never got its final name
    assert checkpoint_problems(str(out / "tmp-checkpoint-2" / "checkpoint-2"))  # it is there, incomplete
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-1")  # transformers' own choice is safe too
    assert newest_complete_checkpoint(str(out)) == (str(out / "checkpoint-1"), [])

    resumed = make_trainer(tokenizer, tmp_path, max_steps=2, **CHECKPOINTS)
    recorder = _RecordResumedStep()
    resumed.add_callback(recorder)
    resumed.train(resume_from_checkpoint=True)
    assert recorder.started_at == 1 and resumed.state.global_step == 2
    assert checkpoint_problems(str(out / "checkpoint-2")) == []
    assert not (out / "tmp-checkpoint-2").exists()  # the interrupted write is cleaned up by the next save
    shutil.rmtree(out)


def _written_on_one_process(tokenizer, tmp_path):
    make_trainer(tokenizer, tmp_path, max_steps=1, **CHECKPOINTS).train()
    return tmp_path / "out" / "checkpoint-1"


def test_a_resume_on_another_number_of_processes_is_refused_before_training_naming_both(tokenizer, tmp_path):
    checkpoint = _written_on_one_process(tokenizer, tmp_path)
    manifest = checkpoint / MANIFEST_NAME
    recorded = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**recorded, "num_processes": 4}))  # as a run on 4 processes writes it
    resumed = make_trainer(tokenizer, tmp_path, max_steps=3, **CHECKPOINTS)
    untouched = {name: p.detach().clone() for name, p in resumed.model.named_parameters()}
    for requested in (True, "auto", str(checkpoint)):
        with pytest.raises(
            ValueError, match=r"written by a run on 4 processes; this one has 1.*resume on 4 processes"
        ):
            resumed.train(resume_from_checkpoint=requested)
    assert resumed.last_batch_producer is None and resumed.state.global_step == 0  # refused before training
    assert all(torch.equal(p, untouched[name]) for name, p in resumed.model.named_parameters())


@pytest.mark.slow
def test_every_process_resumes_from_the_checkpoint_the_main_process_chose(tokenizer, tmp_path):
    """Two processes (DDP on CPU) whose views of the disk differ: the main process decides for both. And a resume on
    another number of processes is refused before training, on every process, naming both counts: a checkpoint of
    one process resumed on two, and the two processes' checkpoint resumed on one."""
    single = _written_on_one_process(tokenizer, tmp_path / "single")
    config = tmp_path / "ddp.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: all\n"
        f"mixed_precision: 'no'\nnum_machines: 1\nmachine_rank: 0\nmain_process_port: {free_port()}\n"
    )
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "tests", "scripts", "resume_agreement.py")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), script, str(out)]
    result = run_process_tree([*cmd, str(single)], env=env, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["resumed_from"] == "checkpoint-1" and report["started_at"] == 1 and report["global_step"] == 3
        message, step, started = report["one_process_checkpoint"]
        assert f"{single} was written by a run on 1 process; this one has 2" in message
        assert "resume on 1 process," in message and step == 0 and not started

    on_one = make_trainer(tokenizer, tmp_path, max_steps=4, **CHECKPOINTS)  # output_dir: the two processes' out
    with pytest.raises(ValueError, match=r"checkpoint-3 was written by a run on 2 processes; this one has 1"):
        on_one.train(resume_from_checkpoint=True)
    assert on_one.last_batch_producer is None and on_one.state.global_step == 0


@pytest.mark.slow
def test_two_processes_raise_together_when_a_save_or_a_resume_fails_on_one_of_them(tmp_path):
    """tests/scripts/checkpoint_agreement.py on two gloo processes: a failure on one process (a write, the rename,
    the scan for resume) raises on both, within the deadline, instead of leaving the other in a collective."""
    script = os.path.join(ROOT, "tests", "scripts", "checkpoint_agreement.py")
    port = free_port()
    processes = []
    for rank in range(2):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        processes.append(
            subprocess.Popen([sys.executable, script, str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
        )
    try:
        errors = [process.communicate(timeout=300)[1] for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert [process.returncode for process in processes] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    main, other = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))

    assert main["save"] is None and other["save"] is None
    assert main["flushed_own_files"] and other["flushed_own_files"]  # each process flushes its own files
    assert main["manifest"] == ["optimizer.pt", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]

    assert other["write_fails_on_process_1"][0] in ("FileNotFoundError", "PermissionError", "OSError")
    assert main["write_fails_on_process_1"][0] == "CheckpointError"
    assert "on process 1" in main["write_fails_on_process_1"][1]

    assert main["rename_fails_on_the_main_process"] == ["OSError", "[Errno 5] Input/output error"]
    assert other["rename_fails_on_the_main_process"][0] == "CheckpointError"

    assert main["resume_scan_fails_on_the_main_process"][0] == "PermissionError"
    assert other["resume_scan_fails_on_the_main_process"][0] == "CheckpointError"
    # checkpoint-3 was written whole before its rename failed: resuming finishes its save
    assert main["resumed_from"] == other["resumed_from"] == "checkpoint-3"

    assert main["explicit_path_incomplete_on_the_main_process"][0] == "ValueError"
    assert other["explicit_path_incomplete_on_the_main_process"][0] == "ValueError"
    assert main["checkpoints"] == ["checkpoint-1", "checkpoint-3"]
