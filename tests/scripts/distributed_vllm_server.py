"""Two training processes against one vLLM server, LoRA (used by test_vllm.py).

accelerate launch --config_file CONFIG tests/scripts/distributed_vllm_server.py OUT_DIR SERVER_URL MODEL_DIR

Each process's generation thread loads its own adapter per version into the server and generates its own prompts;
one JSON report per rank.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import distributed_script_config  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tiny import length_reward, make_prompts, make_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from a3po_trl import AsyncA3POTrainer  # noqa: E402


def main():
    out_dir, url, model_dir = sys.argv[1:4]
    args = distributed_script_config(out_dir, max_steps=3, use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
    trainer = AsyncA3POTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(32),
        processing_class=make_tokenizer(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.train()
    history = trainer.state.log_history
    report = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "batches_consumed": trainer.last_generation_engine.consumed,
        "adapter": trainer._backend._adapter[0],
        "max_staleness_seen": max(h["a3po/staleness_max"] for h in history if "a3po/staleness_max" in h),
        "mismatch_max": [h["a3po/behavior_mismatch_max"] for h in history if "a3po/behavior_mismatch_max" in h],
    }
    trainer._backend.close()
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
