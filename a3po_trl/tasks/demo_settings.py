"""The demo's settings (``examples/train_gsm8k.py``): its system prompt and the defaults in which it differs from
`AsyncA3POConfig` and `trl.ModelConfig` (a CPU-friendly run of SmolLM2-135M-Instruct with LoRA). Here rather than in
the example so that the other examples and the time-to-accuracy benchmark train with the very same settings."""

from __future__ import annotations

import sys

import torch

from .offline_model import DEFAULT_MODEL

#: System prompt of the demo: short answers fit the small completion budget a CPU run can afford.
DEMO_SYSTEM_PROMPT = "Answer briefly. End with '#### <number>'."


def _flag_is_set(argv: list[str], name: str) -> bool:
    """Whether a boolean flag ``--name`` is turned on in ``argv`` (``--name``, ``--name true``, ``--name=1``)."""
    for index, arg in enumerate(argv):
        if arg == f"--{name}":
            following = argv[index + 1].lower() if index + 1 < len(argv) else ""
            return following not in ("false", "0", "no")
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1].lower() not in ("false", "0", "no")
    return False


def demo_defaults(argv: list[str] | None = None) -> dict:
    """Defaults of ``examples/train_gsm8k.py`` that differ from `AsyncA3POConfig`'s / `ModelConfig`'s (a CPU-friendly
    demo).

    On CPU (no CUDA device, or ``--use_cpu``): bf16 off (GRPOConfig turns it on by default, which makes CPU runs
    slow). The thread counts are left to ``train()``, which chooses them from the model (docs/USAGE.md, CPU threads):
    SmolLM2-135M keeps PyTorch's count in both threads, measured faster than one thread each
    (``benchmarks/results/launch-bound/defaults-smollm2.md``).
    """
    argv = sys.argv[1:] if argv is None else argv
    on_cpu = not torch.cuda.is_available() or _flag_is_set(argv, "use_cpu")
    defaults = dict(
        model_name_or_path=DEFAULT_MODEL,
        output_dir="outputs/train_gsm8k",
        # LoRA r=16 on every linear layer at lr 2e-4 (the measured demo: docs/LIMITATIONS.md); `--use_peft false`
        # fine-tunes every weight (then lower the learning rate, e.g. 2e-5)
        use_peft=True,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        lora_target_modules="all-linear",
        learning_rate=2e-4,
        max_steps=60,
        per_device_train_batch_size=8,
        num_generations=4,  # two problems per step: more distinct problems for the same compute
        max_completion_length=64,
        # a low sampling temperature keeps the training samples close to the greedy answers that the held-out
        # accuracy scores (measured: T=0.7 gave +3 points, T=0.4 +12 points, same everything else)
        temperature=0.4,
        # correctness only: the format reward is computed and logged, but rewarding it pulled SmolLM2 towards terse
        # "#### N" answers with wrong arithmetic within 50 steps
        reward_weights=[1.0, 0.0],
        max_staleness=1,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=42,
    )
    if on_cpu:
        defaults.update(bf16=False)
    return defaults
