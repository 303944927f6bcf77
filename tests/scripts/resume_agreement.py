"""Two processes resume from the same checkpoint even when their views of the disk differ (test_checkpoints.py).

accelerate launch --config_file CONFIG tests/scripts/resume_agreement.py OUT_DIR SINGLE_PROCESS_CHECKPOINT

Trains 2 steps with a checkpoint per step, then breaks checkpoint-2 as an interrupted in-place write would
(truncated optimizer state, no trainer state). Process 1 is then given a stale view of the disk in which every
checkpoint looks complete (as a lagging network filesystem could show it): deciding alone it would pick checkpoint-2.
Both resume with ``resume_from_checkpoint=True`` and report the checkpoint and step they resumed from. Last, both try
to resume SINGLE_PROCESS_CHECKPOINT (written by a run on one process) and report the error that refuses it.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from accelerate.utils import gather_object  # noqa: E402
from helpers import distributed_script_config  # noqa: E402
from tiny import length_reward, make_model, make_prompts, make_tokenizer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from a3po_trl import AsyncA3POTrainer, checkpoints  # noqa: E402


class RecordStart(TrainerCallback):
    started_at = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started_at = state.global_step


def make(out_dir, tokenizer, max_steps):
    args = distributed_script_config(out_dir, max_steps=max_steps, save_strategy="steps", save_steps=1)
    return AsyncA3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(32),
        processing_class=tokenizer,
    )


def main():
    out_dir = sys.argv[1]
    tokenizer = make_tokenizer()
    first = make(out_dir, tokenizer, max_steps=2)
    first.train()
    accelerator = first.accelerator
    broken = os.path.join(out_dir, "checkpoint-2")
    if accelerator.is_main_process:
        optimizer = os.path.join(broken, "optimizer.pt")
        with open(optimizer, "r+b") as file:
            file.truncate(os.path.getsize(optimizer) // 2)
        os.remove(os.path.join(broken, "trainer_state.json"))
    accelerator.wait_for_everyone()
    if accelerator.process_index == 1:
        checkpoints.checkpoint_problems = lambda folder: []  # a stale view: checkpoint-2 looks complete here

    resumed = make(out_dir, tokenizer, max_steps=3)
    # what train(resume_from_checkpoint=True) will resume from, compared first: processes that disagree would run
    # mismatched collectives and hang, so they stop here instead
    decisions = gather_object([checkpoints.resolve_resume_checkpoint(resumed, True)])
    if len(set(decisions)) != 1:
        sys.exit(f"processes disagree on the checkpoint to resume from: {decisions}")
    recorder = RecordStart()
    resumed.add_callback(recorder)
    resumed.train(resume_from_checkpoint=True)
    report = {
        "rank": accelerator.process_index,
        "resumed_from": os.path.basename(resumed._resume_checkpoint or ""),
        "started_at": recorder.started_at,
        "global_step": resumed.state.global_step,
    }
    elsewhere = make(os.path.join(out_dir, "from-one-process"), tokenizer, max_steps=3)
    try:
        elsewhere.train(resume_from_checkpoint=sys.argv[2])
    except ValueError as error:
        started = elsewhere.last_batch_producer is not None
        report["one_process_checkpoint"] = [str(error), elsewhere.state.global_step, started]
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()
