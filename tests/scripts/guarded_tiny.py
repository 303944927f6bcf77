"""Train a tiny model with ``prox_logp_method="guarded"`` under `accelerate launch` and write one JSON report per rank
(used by test_proximal_guard_distributed.py).

accelerate launch --config_file CONFIG tests/scripts/guarded_tiny.py OUT_DIR [--lora] [--fsdp2]

Two optimizer steps per generation batch, every batch from the first checked, and on process 1 only the
interpolation made wrong on purpose while batch 1 trains (steps 2 and 3): the check pools both processes' tokens, so
both must switch to the recomputed anchor for batch 2 (process 0's own tokens alone would not) and back for batch 3.
The report holds each process's logged anchor per step, the checks' relative errors and the guard's counts.
``--fsdp2`` turns FSDP on for the CPU processes (tests/fsdp_cpu.py), for a launch with an FSDP2 configuration.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import WrongInterpolation, distributed_script_config, logged  # noqa: E402
from tiny import length_reward, make_model, make_prompts, make_tokenizer  # noqa: E402

import a3po_trl.proximal.anchor  # noqa: E402
from a3po_trl import AsyncA3POTrainer  # noqa: E402


def main():
    out_dir = sys.argv[1]
    if "--fsdp2" in sys.argv:
        from fsdp_cpu import force_fsdp_on_cpu

        force_fsdp_on_cpu()
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    if "--lora" in sys.argv:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    args = distributed_script_config(
        out_dir,
        prox_logp_method="guarded",
        prox_check_interval=1,
        prox_error_budget=3.0,
        steps_per_generation=2,
        max_staleness=2,
        reproducible_generation=True,
        max_steps=8,
    )
    trainer = AsyncA3POTrainer(
        model=model,
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(32),
        processing_class=tokenizer,
    )

    # wrong on purpose on process 1 only, while batch 1 trains
    a3po_trl.proximal.anchor.approximate_proximal_logps = WrongInterpolation(trainer, wrong_steps=(2, 3), process=1)
    trainer.train()
    guard = trainer.proximal_anchor.guard
    report = {
        "rank": trainer.accelerator.process_index,
        "recompute": logged(trainer, "a3po/prox_recompute_fraction"),
        "relative": logged(trainer, "a3po/prox_check_error_relative"),
        "checks": guard.checks,
        "switches": guard.switches,
        "weights": {name: p.detach().sum().item() for name, p in trainer.model.named_parameters() if p.requires_grad},
    }
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()
