"""The vLLM backends, for real, on this CPU (``vllm-cpu``): weight versions reach the engine, log-probs match the
trainer's, training keeps its staleness bound, LoRA versions are adapters, faults end the run cleanly.

These run only where vLLM is installed (``scripts/test_vllm.sh`` builds that environment; CI runs it).
"""

import logging
import os
import threading
import time

import pytest
import torch
from tiny import length_reward, make_prompts, make_tokenizer, make_vllm_model

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer  # noqa: E402
from a3po_trl.generation import GenerationStopped  # noqa: E402
from a3po_trl.generation.backend import pad_rows  # noqa: E402

pytestmark = pytest.mark.vllm

#: fp32 engine against the fp32 training forward: what vLLM's CPU kernels differ by (measured ~1e-6 on this model).
LOGP_TOLERANCE = 1e-4

COMMON = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    save_strategy="no",
    learning_rate=1e-2,
    seed=0,
    bf16=False,  # the trainer's forward in fp32, as the engine: the log-probs must then agree to kernel rounding
    use_vllm=True,
    vllm_mode="colocate",
    vllm_max_model_length=256,
)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def lora_config(**overrides):
    from peft import LoraConfig

    return LoraConfig(
        **{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **overrides}
    )


def make_vllm_trainer(tokenizer, tmp_path, peft_config=None, **overrides):
    args = AsyncA3POConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "max_steps": 4, **overrides})
    return AsyncA3POTrainer(
        model=make_vllm_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def trainer_logps(trainer, prompt_ids, completion_ids):
    """The training forward's log-probs of each completion (one row per prompt), unpadded."""
    pad = trainer._tokenizer.pad_token_id
    prompts, prompt_mask = pad_rows(prompt_ids, pad, "left")
    completions, completion_mask = pad_rows(completion_ids, pad, "right")
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompts, completions], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completions.size(1),
        )[0]
    return [row[: len(ids)] for row, ids in zip(logps, completion_ids)]


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@torch.no_grad()
def perturb(module):
    for param in module.parameters():
        if param.requires_grad:
            param.add_(torch.randn_like(param) * 0.05)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_published_version_reaches_the_engine_and_its_logps_match_the_trainer(tokenizer, tmp_path, lora):
    trainer = make_vllm_trainer(tokenizer, tmp_path, peft_config=lora_config() if lora else None)
    backend = trainer._build_backend()
    try:
        module = trainer._unwrapped_model()
        if lora:
            assert backend.trainable_names and all("lora_" in name for name in backend.trainable_names)
        prompts = [tokenizer(text)["input_ids"] for text in ("hello there", "a", "The quick brown fox jumps")]
        previous = None
        for version in range(3):
            if version:
                perturb(module)
            backend.publish(module, version)
            assert backend.refresh() and backend.version == version
            out = backend.generate(prompts, None, seed=1234)
            again = backend.generate(prompts, None, seed=1234)
            assert out.completion_ids == again.completion_ids  # a batch's seed fixes its samples
            for engine, trained in zip(out.logps, trainer_logps(trainer, prompts, out.completion_ids)):
                assert (engine - trained).abs().max().item() < LOGP_TOLERANCE
            if previous is not None:
                assert out.completion_ids != previous or version == 0
            previous = out.completion_ids
        if lora:
            assert backend._lora_request.lora_name == "a3po-v2"  # one adapter per version, the base never reloaded
    finally:
        backend.close()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_training_with_vllm_keeps_the_staleness_bound_and_matches_the_engine(tokenizer, tmp_path, lora):
    trainer = make_vllm_trainer(
        tokenizer, tmp_path, peft_config=lora_config() if lora else None, max_staleness=1, max_steps=4
    )
    trainer.train()
    engine = trainer.last_generation_engine
    assert engine.produced == engine.consumed == engine.num_batches == 4
    assert max(logged(trainer, "a3po/staleness_max")) == 1
    versions = [int(v) for v in logged(trainer, "async/generator_version")]
    assert versions == sorted(versions) and versions[-1] >= 1  # later batches came from newer weights
    mismatch = logged(trainer, "a3po/behavior_mismatch_max")
    assert mismatch and max(mismatch) < LOGP_TOLERANCE  # tokens of the current version: engine == trainer
    assert all(torch.isfinite(torch.tensor(logged(trainer, "loss"))))
    trainer._backend.close()


def test_lora_configs_vllm_cannot_serve_are_merged_and_still_match(tokenizer, tmp_path, caplog):
    trainer = make_vllm_trainer(tokenizer, tmp_path, peft_config=lora_config(use_dora=True))
    with caplog.at_level(logging.WARNING):
        backend = trainer._build_backend()
    assert "DoRA" in caplog.text and "merged" in caplog.text
    try:
        module = trainer._unwrapped_model()
        prompts = [tokenizer(text)["input_ids"] for text in ("hello", "2+2=")]
        for version in range(2):
            if version:
                perturb(module)
            backend.publish(module, version)
            backend.refresh()
            out = backend.generate(prompts, None, seed=7)
            for engine, trained in zip(out.logps, trainer_logps(trainer, prompts, out.completion_ids)):
                assert (engine - trained).abs().max().item() < LOGP_TOLERANCE
    finally:
        backend.close()


def test_stop_ends_a_running_batch_within_a_decoding_step(tokenizer, tmp_path):
    trainer = make_vllm_trainer(tokenizer, tmp_path, max_completion_length=200)
    backend = trainer._build_backend()
    try:
        backend.publish(trainer._unwrapped_model(), 0)
        backend.refresh()
        prompts = [tokenizer("count to a thousand")["input_ids"]] * 4
        stop = threading.Event()
        timer = threading.Timer(0.2, stop.set)
        timer.start()
        start = time.perf_counter()
        with pytest.raises(GenerationStopped):
            backend.generate(prompts, stop.is_set, seed=0)
        assert time.perf_counter() - start < 5
        assert not backend.llm.llm_engine.has_unfinished_requests()  # aborted, nothing left running
        assert len(backend.generate(prompts[:1], None, seed=0).completion_ids) == 1  # the engine is still usable
    finally:
        backend.close()
