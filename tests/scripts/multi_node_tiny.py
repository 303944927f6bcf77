"""Train a tiny model with checkpoints on one process of a multi-machine `accelerate launch` and write its report
(used by test_multi_node.py, which starts two "machines" on the loopback, one process each).

accelerate launch --num_machines 2 --machine_rank R --main_process_ip IP --main_process_port PORT --num_processes 2
    ... tests/scripts/multi_node_tiny.py OUT_DIR [--save-on-each-node]

Trains 4 steps, saving every 2 (``save_strategy="steps"``) into ``OUT_DIR/run`` (``save_on_each_node`` as given),
then writes ``OUT_DIR/rank{R}.json``: the process's place in the run (global rank, machine, local rank), whether it
saved, a hash of its trained weights, and whether the last checkpoint in ``OUT_DIR/run`` holds exactly them.
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import distributed_script_config  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny import length_reward, make_model, make_prompts, make_tokenizer  # noqa: E402

from a3po_trl import AsyncA3POTrainer  # noqa: E402


def weights_hash(state_dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main():
    out_dir = sys.argv[1]
    run_dir = os.path.join(out_dir, "run")
    args = distributed_script_config(
        run_dir, save_strategy="steps", save_steps=2, save_on_each_node="--save-on-each-node" in sys.argv
    )
    tokenizer = make_tokenizer()
    trainer = AsyncA3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(32),
        processing_class=tokenizer,
    )
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    state = model.state_dict()
    saved = load_file(os.path.join(run_dir, f"checkpoint-{trainer.state.global_step}", "model.safetensors"))
    accelerator = trainer.accelerator
    report = {
        "rank": accelerator.process_index,
        "machine": int(os.environ["GROUP_RANK"]),  # torchrun's node rank: accelerate's --machine_rank
        "local_rank": accelerator.local_process_index,
        "world_size": accelerator.num_processes,
        "should_save": args.should_save,
        "global_step": trainer.state.global_step,
        "weights": weights_hash(state),
        "last_checkpoint_holds_these_weights": all(
            name in state and state[name].equal(tensor) for name, tensor in saved.items()
        ),
    }
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()
