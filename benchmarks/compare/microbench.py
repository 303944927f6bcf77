"""The proximal log-probs micro-benchmark: one loglinear interpolation vs one recompute forward on a (B, T) batch."""

from __future__ import annotations

import tempfile
import time

from benchmarks.common.machine import LoadMeter

from .trainers import make_trainer


def run_microbench(config, common) -> dict:
    """Median seconds of one loglinear proximal computation vs one recompute forward, on the same (B, T) batch."""
    import statistics as stats

    import torch

    from a3po_trl import approximate_proximal_logps

    cuda = common["device"] == "cuda"
    # the trainer of a recompute configuration, for its forward; it never trains
    recompute_config = {"kind": "a3po", "method": "recompute", "max_staleness": 0, "async_generation": False}
    with tempfile.TemporaryDirectory(prefix="a3po-compare-") as output_dir:
        trainer, model_name = make_trainer({**config, **recompute_config}, common, output_dir)
        tokenizer, dataset = trainer.processing_class, trainer.train_dataset
        trainer.model.train()  # as in training (the recompute forward runs while the model is in train mode)
        device = trainer.accelerator.device
        batch, length = common["batch_size"], common["max_completion_length"]
        prompt = tokenizer.apply_chat_template(
            dataset[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        generator = torch.Generator().manual_seed(0)
        vocab = min(len(tokenizer), trainer.model.config.vocab_size)
        completion = torch.randint(0, vocab, (batch, length), generator=generator)
        input_ids = torch.cat([torch.tensor(prompt).expand(batch, -1), completion], dim=1).to(device)
        attention_mask = torch.ones_like(input_ids)
        behavior = (-torch.rand(batch, length, generator=generator) * 5).to(device)
        current = (-torch.rand(batch, length, generator=generator) * 5).to(device)
        staleness = torch.full((batch,), 2, dtype=torch.long, device=device)  # w = 1/2: a real interpolation

        def sync():
            if cuda:
                torch.cuda.synchronize(device)

        def recompute():
            with torch.no_grad():
                trainer._get_per_token_logps_and_entropies(
                    trainer.model, input_ids, attention_mask, length, batch_size=batch
                )
            sync()

        def loglinear():
            approximate_proximal_logps(behavior, current, staleness)
            sync()

        def median_time(fn, reps, warmup):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return stats.median(times), times

        results = []
        for threads in config["thread_counts"]:
            if threads is not None:
                torch.set_num_threads(threads)
            meter = LoadMeter().start()
            recompute_s, recompute_all = median_time(recompute, config["reps"], warmup=2)
            loglinear_s, _ = median_time(loglinear, max(200, config["reps"]), warmup=20)
            results.append(
                {
                    "threads": threads,
                    "recompute_seconds": recompute_s,
                    "recompute_seconds_all": recompute_all,
                    "loglinear_seconds": loglinear_s,
                    "ratio": recompute_s / loglinear_s if loglinear_s > 0 else None,
                    **meter.stop(),
                }
            )
    return {
        "model_name": model_name,
        "batch_shape": [batch, length],
        "prompt_tokens": len(prompt),
        "sequence_tokens": int(input_ids.size(1)),
        "staleness": 2,
        "by_threads": results,
    }
