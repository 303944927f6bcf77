"""A trainer of the demo's task (``examples/train_gsm8k.py``) for the benchmarks that train it (time to accuracy, the
generation backends): an offline model (SmolLM2-135M-Instruct by default), the correctness and format rewards, and the
demo's LoRA adapter (:func:`a3po_trl.tasks.demo_settings.demo_defaults`: r=16 on every linear layer); and the
options of one such run, which the studies that reuse its runs share."""

from __future__ import annotations

import argparse


def demo_lora_config():
    """The demo's LoRA adapter, as a ``peft.LoraConfig``."""
    from peft import LoraConfig

    from a3po_trl.tasks.demo_settings import demo_defaults

    defaults = demo_defaults([])
    return LoraConfig(
        r=defaults["lora_r"],
        lora_alpha=defaults["lora_alpha"],
        lora_dropout=defaults["lora_dropout"],
        target_modules=defaults["lora_target_modules"],
        task_type="CAUSAL_LM",
    )


def demo_trainer(trainer_class, model: str, args, train_dataset, lora: bool = True):
    """``trainer_class`` (TRL's ``GRPOTrainer`` or ``AsyncA3POTrainer``) on ``model`` (a name
    :func:`~a3po_trl.tasks.offline_model.resolve_model_path` knows, or a path) with the demo's rewards and, with
    ``lora``, its LoRA adapter (else every weight trains)."""
    from a3po_trl.tasks.offline_model import resolve_model_path
    from a3po_trl.tasks.rewards import correctness_reward, format_reward

    return trainer_class(
        model=resolve_model_path(model),
        reward_funcs=[correctness_reward, format_reward],
        args=args,
        train_dataset=train_dataset,
        peft_config=demo_lora_config() if lora else None,
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of one run of the demo's task (time to accuracy's runs), for the studies that make such runs."""
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-problems", type=int, default=100, help="fixed subset evaluated during training")
    parser.add_argument("--held-out", type=int, default=200, help="held-out problems before/after")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quick", action="store_true", help="4 steps, 8 problems, 16 tokens (a smoke run)")


def apply_quick(options) -> None:
    """``--quick``: 4 steps, snapshots every 2 steps, 8 problems (completions of 16 tokens: the study's settings)."""
    if options.quick:
        options.steps, options.eval_every, options.eval_problems, options.held_out = 4, 2, 8, 8
