"""Train a tiny model with a checkpoint every step, on a "slow disk" that stalls in the middle of writing the
optimizer state of checkpoint ``STALL_STEP`` (used by test_checkpoints.py, which sends SIGTERM during the stall).

python tests/scripts/sigterm_during_checkpoint.py OUT_DIR MARKER_FILE STALL_STEP

The stand-in for a slow filesystem: ``torch.save`` of that ``optimizer.pt`` writes half of the file's bytes, flushes
them, creates MARKER_FILE (the test's cue that the write is in progress) and then blocks, as a write to a slow disk
would, until the process is killed. No timing luck is involved: the signal always lands mid-write.
"""

import io
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from helpers import distributed_script_config  # noqa: E402
from tiny import length_reward, make_model, make_prompts, make_tokenizer  # noqa: E402

from a3po_trl import AsyncA3POTrainer  # noqa: E402


def main():
    out_dir, marker, stall_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real_save = torch.save

    def slow_disk_save(obj, f, *args, **kwargs):
        path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else ""
        if path.endswith("optimizer.pt") and f"checkpoint-{stall_step}" in path:
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(path, "wb") as file:
                file.write(data[: len(data) // 2])
                file.flush()
                with open(marker, "w") as cue:
                    cue.write(path)
                while True:  # the rest of the write never comes: the disk is stalled until SIGTERM
                    time.sleep(0.05)
        return real_save(obj, f, *args, **kwargs)

    torch.save = slow_disk_save
    tokenizer = make_tokenizer()
    args = distributed_script_config(out_dir, max_steps=stall_step + 1, save_strategy="steps", save_steps=1)
    trainer = AsyncA3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
    )
    trainer.train()


if __name__ == "__main__":
    main()
