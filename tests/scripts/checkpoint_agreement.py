"""Two processes (gloo, CPU) save and resume checkpoints while one of them fails: both must raise, none may wait
forever in a collective (test_checkpoints.py launches this and gives it a deadline).

RANK=k WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/scripts/checkpoint_agreement.py OUT_DIR

Uses the stand-in trainer of tests/helpers.py (no model: each process writes its ``rng_state_{k}.pth``, the main
one an optimizer state and the trainer state). Each scenario's outcome on this process (the exception's type and
message, or None) goes to ``OUT_DIR/rank{k}.json``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch.distributed  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from helpers import StandInTrainer  # noqa: E402

from a3po_trl.checkpoints import files as checkpoint_files  # noqa: E402
from a3po_trl.checkpoints import saves as checkpoints  # noqa: E402


def outcome(scenario):
    try:
        scenario()
    except Exception as error:  # noqa: BLE001 - reported
        return [type(error).__name__, str(error)]
    return None


def main():
    out_dir = sys.argv[1]
    accelerator = Accelerator(cpu=True)
    rank, run_dir = accelerator.process_index, os.path.join(out_dir, "run")
    trainer = StandInTrainer(run_dir, accelerator=accelerator)
    report = {"rank": rank}

    flushed = []
    real_fsync_files = checkpoints.fsync_files
    checkpoints.fsync_files = lambda folder: flushed.append(folder) or real_fsync_files(folder)
    report["save"] = outcome(lambda: trainer.save(1))
    report["flushed_own_files"] = bool(flushed)
    checkpoints.fsync_files = real_fsync_files
    if accelerator.is_main_process:
        with open(os.path.join(run_dir, "checkpoint-1", checkpoint_files.MANIFEST_NAME)) as file:
            report["manifest"] = sorted(json.load(file)["files"])

    real_save = trainer.save

    def write_fails_on_process_1():
        if rank == 1:
            trainer.args.output_dir = "/proc/cannot-write-here"  # its rng_state write fails
        try:
            real_save(2)
        finally:
            trainer.args.output_dir = run_dir

    report["write_fails_on_process_1"] = outcome(write_fails_on_process_1)

    real_publish = checkpoints._publish

    def rename_fails(staged, final, replaced):
        raise OSError(5, "Input/output error")

    if accelerator.is_main_process:
        checkpoints._publish = rename_fails
    report["rename_fails_on_the_main_process"] = outcome(lambda: trainer.save(3))
    checkpoints._publish = real_publish

    real_newest = checkpoints.newest_complete_checkpoint
    if accelerator.is_main_process:

        def unreadable(output_dir):
            raise PermissionError(13, "Permission denied", output_dir)

        checkpoints.newest_complete_checkpoint = unreadable
    report["resume_scan_fails_on_the_main_process"] = outcome(
        lambda: checkpoints.resolve_resume_checkpoint(trainer, True)
    )
    checkpoints.newest_complete_checkpoint = real_newest
    report["resumed_from"] = os.path.basename(checkpoints.resolve_resume_checkpoint(trainer, True))

    real_problems = checkpoints.checkpoint_problems
    if accelerator.is_main_process:  # only the main process sees the checkpoint as incomplete
        checkpoints.checkpoint_problems = lambda folder: ["optimizer.pt is truncated"]
    explicit = os.path.join(run_dir, "checkpoint-1")
    report["explicit_path_incomplete_on_the_main_process"] = outcome(
        lambda: checkpoints.resolve_resume_checkpoint(trainer, explicit)
    )
    checkpoints.checkpoint_problems = real_problems

    report["checkpoints"] = sorted(name for name in os.listdir(run_dir) if name.startswith("checkpoint-"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(report, file, indent=1)
    # tear the gloo group down before the interpreter exits: a group left to process exit can abort it ("terminate
    # called without an active exception", seen once in a full-suite run)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
