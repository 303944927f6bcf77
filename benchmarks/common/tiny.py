"""An ``AsyncA3POTrainer`` on the tiny random model (:mod:`a3po_trl.tasks.tiny_model`), for the benchmarks that
measure the trainer itself (memory over hundreds of steps, the timeline's cost) rather than what it learns."""

from __future__ import annotations

import contextlib
import tempfile


@contextlib.contextmanager
def tiny_trainer(num_prompts: int, **settings):
    """A trainer of the tiny Llama (seed 0) on ``num_prompts`` sum prompts with the length reward, on CPU, saving and
    reporting nothing, in an output folder removed afterwards; ``settings``: the other ``AsyncA3POConfig`` fields."""
    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
    from a3po_trl.tasks.tiny_model import length_reward, make_byte_tokenizer, make_sum_prompts, make_tiny_llama

    tokenizer = make_byte_tokenizer()
    with tempfile.TemporaryDirectory(prefix="a3po-tiny-") as output_dir:
        args = AsyncA3POConfig(
            output_dir=output_dir, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, **settings
        )
        yield AsyncA3POTrainer(
            model=make_tiny_llama(tokenizer),
            reward_funcs=[length_reward],
            args=args,
            train_dataset=make_sum_prompts(num_prompts),
            processing_class=tokenizer,
        )
