"""``use_transformers_continuous_batching=True``: the generation thread generates with transformers' continuous
batching (a3po_trl/generation/hf/continuous_batching.py) on the generator's own copy, samples from its own random
stream, and returns behavior log-probs that a forward of the generator reproduces."""

import pytest
import torch
from helpers import COMMON, logged, make_trainer, model_weights
from tiny import length_reward, make_model, make_prompts

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer, builders
from a3po_trl.generation.hf import continuous_batching
from a3po_trl.generation.hf.backend import HFGenerateBackend
from a3po_trl.types import GenerationStopped

CB = dict(use_transformers_continuous_batching=True)
#: fp32 (no mixed precision) and a temperature that is not 1, so a log-prob of the wrong distribution shows.
EXACT = dict(bf16=False, temperature=0.7, max_completion_length=12)


def _backend(tokenizer, tmp_path, model=None, **overrides):
    """The trainer's continuous batching backend with version 0 loaded (outside ``train()``)."""
    trainer = make_trainer(tokenizer, tmp_path, model=model, **{**CB, **EXACT, **overrides})
    backend = builders.build_backend(trainer)
    backend.publish(trainer._unwrapped_model(), 0)
    assert backend.refresh()
    return trainer, backend


def _prompts(tokenizer, count=6):
    return [tokenizer(f"prompt number {i} " + "x" * i)["input_ids"] for i in range(count)]


def _assert_versions_within_staleness(trainer, max_staleness):
    """Every sample carried the version that generated it: step ``i`` trained on a version in
    ``[i - max_staleness, i]``, and its staleness is the difference."""
    versions = [int(v) for v in logged(trainer, "async/generator_version")]
    staleness = logged(trainer, "a3po/staleness_max")
    assert len(versions) == trainer.state.global_step
    for step, (version, stale) in enumerate(zip(versions, staleness)):
        assert max(step - max_staleness, 0) <= version <= step and stale == step - version


def test_a_short_training_run_generates_with_continuous_batching(tokenizer, tmp_path, monkeypatch):
    batches = []
    generate_batch = continuous_batching.ContinuousBatchingBackend._generate_batch

    def counted(self, prompt_ids, should_stop):
        batches.append(len(prompt_ids))
        return generate_batch(self, prompt_ids, should_stop)

    def refused(*args, **kwargs):
        raise AssertionError("the generate backend's generate ran")

    monkeypatch.setattr(continuous_batching.ContinuousBatchingBackend, "_generate_batch", counted)
    monkeypatch.setattr(HFGenerateBackend, "_generate", refused)
    trainer = make_trainer(tokenizer, tmp_path, max_staleness=1, max_steps=4, **CB)
    before = model_weights(trainer)
    trainer.train()
    assert isinstance(trainer.last_batch_producer.backend, continuous_batching.ContinuousBatchingBackend)
    assert batches == [4, 4, 4, 4]
    _assert_versions_within_staleness(trainer, 1)
    after = model_weights(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(abs(m) < 0.05 for m in logged(trainer, "a3po/behavior_mismatch_mean"))


def test_behavior_log_probs_match_a_forward_of_the_generator(tokenizer, tmp_path):
    _, backend = _backend(tokenizer, tmp_path)
    prompts = _prompts(tokenizer)
    generated = backend.generate(prompts, None, seed=3)
    assert generated.timings == {}  # the log-probs came with the generation, no forward
    forward = backend._forward_logps(prompts, generated.completion_ids)
    assert [len(c) for c in generated.completion_ids] == [len(f) for f in forward]
    assert sum(len(c) for c in generated.completion_ids) > len(prompts)
    for recorded, scored in zip(generated.logps, forward):
        torch.testing.assert_close(recorded, scored, rtol=0, atol=1e-5)


def test_behavior_log_probs_from_a_forward_when_asked_or_when_none_are_returned(tokenizer, tmp_path, monkeypatch):
    _, backend = _backend(tokenizer, tmp_path / "a", behavior_logps_source="forward")
    prompts = _prompts(tokenizer, 3)
    generated = backend.generate(prompts, None, seed=3)
    assert generated.timings["behavior_logps"] > 0
    for row, scored in zip(generated.logps, backend._forward_logps(prompts, generated.completion_ids)):
        assert torch.equal(row, scored)
    # a transformers whose continuous batching returns no log-probs: scored with a forward too
    configure = continuous_batching.continuous_batching_config

    def without_logprobs(*args, **kwargs):
        config = configure(*args, **kwargs)
        config.return_logprobs = False
        return config

    monkeypatch.setattr(continuous_batching, "continuous_batching_config", without_logprobs)
    _, backend = _backend(tokenizer, tmp_path / "b")
    generated = backend.generate(prompts, None, seed=3)
    assert generated.timings["behavior_logps"] > 0
    for row, scored in zip(generated.logps, backend._forward_logps(prompts, generated.completion_ids)):
        torch.testing.assert_close(row, scored, rtol=0, atol=1e-5)


def test_sampling_uses_the_generators_own_seeded_stream_and_leaves_the_global_rng_alone(
    tokenizer, tmp_path, monkeypatch
):
    _, backend = _backend(tokenizer, tmp_path)
    prompts = _prompts(tokenizer)

    def refused(*args, **kwargs):
        raise AssertionError("drew from the global RNG")

    monkeypatch.setattr(torch, "multinomial", refused)
    monkeypatch.setattr(torch, "manual_seed", refused)
    state = torch.get_rng_state()
    first = backend.generate(prompts, None, seed=11)
    torch.rand(1000)  # another global RNG state
    again = backend.generate(prompts, None, seed=11)
    other = backend.generate(prompts, None, seed=12)
    assert first.completion_ids == again.completion_ids
    assert all(torch.equal(a, b) for a, b in zip(first.logps, again.logps))
    assert first.completion_ids != other.completion_ids
    torch.set_rng_state(state)
    backend.generate(prompts, None, seed=13)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_stop_request_ends_the_batch_and_restores_the_attention(tokenizer, tmp_path):
    model = make_model(tokenizer)
    model.set_attn_implementation("eager")
    _, backend = _backend(tokenizer, tmp_path, model=model)
    model = backend.module
    assert model.config._attn_implementation == "eager"  # continuous batching runs it as "paged|eager"
    calls = []

    def stop_after_two_steps():
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(GenerationStopped):
        backend.generate(_prompts(tokenizer), stop_after_two_steps, seed=0)
    assert len(calls) == 3
    assert model.config._attn_implementation == "eager"
    assert len(backend.generate(_prompts(tokenizer, 2), None, seed=0).completion_ids) == 2


def test_an_error_inside_continuous_batching_reaches_the_caller_with_its_cause(tokenizer, tmp_path, monkeypatch):
    _, backend = _backend(tokenizer, tmp_path)

    def broken(self, scores, output_ids):
        raise ValueError("sampler broke")

    monkeypatch.setattr(continuous_batching._OwnStreamSampler, "__call__", broken)
    with pytest.raises(RuntimeError, match="continuous batching failed") as failure:
        backend.generate(_prompts(tokenizer), None, seed=0)
    assert isinstance(failure.value.__cause__, ValueError)


def test_the_paged_cache_is_sized_for_the_batch_unless_the_config_sizes_it():
    prompts = [[1] * 300, [2] * 10]
    sized = continuous_batching.continuous_batching_config({}, prompts, max_new_tokens=20)
    assert sized.num_blocks == 2 + 1 + 1 and sized.max_batch_tokens == 310  # pages of 256 tokens
    assert sized.return_logprobs and not sized.auto_switch_to_flash and sized.use_cuda_graph is False
    user = continuous_batching.continuous_batching_config({"max_memory_percent": 0.3}, prompts, max_new_tokens=20)
    assert user.num_blocks is None and user.max_batch_tokens is None and user.max_memory_percent == 0.3


def test_lora_generates_with_the_adapter_and_trains_it(tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer, backend = _backend(tokenizer, tmp_path / "gen", model=get_peft_model(make_model(tokenizer), lora))
    prompts = _prompts(tokenizer)
    generated = backend.generate(prompts, None, seed=3)
    for recorded, scored in zip(generated.logps, backend._forward_logps(prompts, generated.completion_ids)):
        torch.testing.assert_close(recorded, scored, rtol=0, atol=1e-5)
    # the adapter changes what is generated: the same seed without it samples something else
    with backend.module.disable_adapter():
        plain = backend.generate(prompts, None, seed=3)
    assert plain.completion_ids != generated.completion_ids

    trainer = AsyncA3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=[length_reward],
        args=AsyncA3POConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "max_steps": 3, "max_staleness": 1, **CB}),
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    before = model_weights(trainer)
    trainer.train()
    after = model_weights(trainer)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed and all("lora_" in n for n in changed)
    _assert_versions_within_staleness(trainer, 1)


def test_two_reproducible_runs_are_identical(tokenizer, tmp_path):
    def run(folder):
        trainer = make_trainer(
            tokenizer, tmp_path / folder, reproducible_generation=True, max_staleness=2, max_steps=4, **CB
        )
        trainer.train()
        return trainer

    first, second = run("a"), run("b")
    for key in ("loss", "reward", "grad_norm", "async/generator_version"):
        assert logged(first, key) == logged(second, key), key
    a, b = model_weights(first), model_weights(second)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_model_generation_config_that_truncates_sampling_is_refused(tokenizer, tmp_path):
    model = make_model(tokenizer)
    model.generation_config.no_repeat_ngram_size = 2  # from the model's own generation config, not TRL's
    with pytest.raises(ValueError, match="no_repeat_ngram_size=2.*use_transformers_continuous_batching=False"):
        make_trainer(tokenizer, tmp_path, model=model, **CB)
