"""The generator samples and scores with the numerics, positions and random stream the method assumes.

Each test here pins a way the generation thread used to differ silently from the training forward or from GRPOTrainer:
the random stream it drew from, the LM head it scored with, the positions of left-padded rows, sampling settings
that change the sampled distribution, dropout, and the state reward functions see.
"""

import logging
import threading

import pytest
import torch
from datasets import Dataset
from helpers import first_batch_with_logps, logged, make_trainer
from tiny import length_reward, make_model, make_prompts
from transformers import GPT2Config, GPT2LMHeadModel

from a3po_trl import builders
from a3po_trl.generation.hf import sampling


def _generation_thread() -> bool:
    return threading.current_thread().name.startswith("a3po-generation")


def test_generator_draws_from_its_own_stream_never_the_global_rng(tokenizer, tmp_path, monkeypatch):
    """Gradient checkpointing forks and restores the global RNG in the training thread; a generator drawing from it
    replays random numbers. The generator must draw from its own stream, and that stream must never repeat."""
    global_draws, states = [], []
    multinomial = torch.multinomial

    def watched_multinomial(*args, **kwargs):
        if _generation_thread():
            global_draws.append(1)
        return multinomial(*args, **kwargs)

    noise = sampling._GumbelMaxNoise.__call__

    def recorded_noise(self, input_ids, scores):
        states.append(bytes(self.generator.get_state().numpy()))
        return noise(self, input_ids, scores)

    monkeypatch.setattr(torch, "multinomial", watched_multinomial)
    monkeypatch.setattr(sampling._GumbelMaxNoise, "__call__", recorded_noise)
    trainer = make_trainer(tokenizer, tmp_path, gradient_checkpointing=True, max_staleness=2, max_steps=6)
    trainer.train()
    assert global_draws == []
    assert len(states) >= 6 * 8 and len(set(states)) == len(states)


def test_runs_with_the_same_seed_sample_the_same_and_other_seeds_do_not(tokenizer, tmp_path):
    completions = {}
    for run, seed in (("a", 0), ("b", 0), ("c", 1)):
        seen = []

        def recording_reward(completions, seen=seen, **kwargs):
            seen.extend(c[0]["content"] for c in completions)
            return length_reward(completions)

        trainer = make_trainer(
            tokenizer, tmp_path / run, reward_funcs=(recording_reward,), async_generation=False, max_steps=2, seed=seed
        )
        torch.manual_seed(1234 if run == "a" else 99)  # the global RNG plays no part in sampling
        trainer.train()
        completions[run] = seen
    assert completions["a"] == completions["b"]
    assert completions["a"] != completions["c"]


def test_generator_keeps_the_fp32_lm_head(tokenizer, tmp_path):
    """cast_lm_head_to_fp32 on a bf16 model: the generator's copy must run the head in float32 too (it used to crash
    without autocast, and score with a bf16 head under autocast)."""
    for bf16 in (False, True):
        model = make_model(tokenizer).to(torch.bfloat16)
        trainer = make_trainer(
            tokenizer, tmp_path / str(bf16), model=model, bf16=bf16, cast_lm_head_to_fp32=True, max_steps=2
        )
        trainer.train()
        head = trainer.last_batch_producer.backend.module.lm_head
        assert head.weight.dtype == torch.float32
        dtypes = []
        hook = head.register_forward_hook(lambda module, args, output, dtypes=dtypes: dtypes.append(output.dtype))
        trainer.last_batch_producer.backend.module.generate(
            input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False
        )
        hook.remove()
        assert dtypes and set(dtypes) == {torch.float32}


def _gpt2(tokenizer):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def test_left_padded_rows_are_scored_at_the_positions_they_were_generated_at(tokenizer, tmp_path):
    """An absolute-position model (GPT-2): generate places left-padded rows by the attention mask; the training forward
    must too, or the behavior and training log-probs of the same tokens differ (0.29 nats seen)."""
    dataset = Dataset.from_dict({"prompt": ["1+1=", "What is twelve plus thirty, written in digits?"]})
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        model=_gpt2(tokenizer),
        dataset=dataset,
        per_device_train_batch_size=8,
        bf16=False,
        max_staleness=0,
        max_steps=2,
    )
    trainer.model.train()
    trainer.state.max_steps = 2
    inputs, logps = first_batch_with_logps(trainer)
    prompt_mask = inputs["prompt_mask"]
    assert (prompt_mask.sum(1) < prompt_mask.size(1)).any(), "want left-padded prompts"
    completion = inputs["completion_mask"].bool()
    assert (logps - inputs["behavior_logps"])[completion].abs().max() < 1e-4


def test_sampling_settings_that_change_the_distribution_are_reported(tokenizer, tmp_path, caplog):
    with pytest.raises(ValueError, match=r"generation_kwargs sets temperature=0.5.*temperature=0.5 in the config"):
        make_trainer(tokenizer, tmp_path, generation_kwargs={"temperature": 0.5})
    # Processed sampling (truncation, penalties) is recorded, and said so; what cannot be recorded is a warning.
    with caplog.at_level(logging.INFO, logger="a3po_trl"):
        make_trainer(tokenizer, tmp_path, generation_kwargs={"top_k": 3, "typical_p": 0.9})
    assert "top_k=3" in caplog.text and "typical_p=0.9" in caplog.text
    assert "records the log-probs of the processed distribution" in caplog.text
    assert "biases the importance ratios" not in caplog.text
    caplog.clear()
    model = make_model(tokenizer)
    model.generation_config.no_repeat_ngram_size = 2  # from the model's own generation config, not TRL's
    with caplog.at_level(logging.INFO, logger="a3po_trl"):
        trainer = make_trainer(tokenizer, tmp_path, model=model)
    assert "no_repeat_ngram_size=2" in caplog.text
    assert builders.hf_generation_settings(trainer).record_sampling_logps
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="a3po_trl"):
        make_trainer(tokenizer, tmp_path, generation_kwargs={"do_sample": False})
    assert "do_sample=False" in caplog.text and "biases the importance ratios" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="a3po_trl"):
        trainer = make_trainer(tokenizer, tmp_path)
    assert "biases the importance ratios" not in caplog.text and "processed distribution" not in caplog.text
    assert not builders.hf_generation_settings(trainer).record_sampling_logps


def test_truncated_sampling_records_both_the_policy_and_the_sampling_log_probs(tokenizer, tmp_path):
    """With top-k, the behavior log-probs stay the untruncated policy's (what the training forward scores, so an
    on-policy ratio is 1) and the sampling log-probs are those of the renormalised top-k distribution each token was
    drawn from, checked against a forward of the generating weights."""
    top_k, temperature = 3, 0.7
    trainer = make_trainer(
        tokenizer, tmp_path, top_k=top_k, temperature=temperature, bf16=False, max_staleness=0, max_steps=2
    )
    trainer.model.train()
    trainer.state.max_steps = 2
    inputs, logps = first_batch_with_logps(trainer)
    mask = inputs["completion_mask"].bool()
    assert (logps - inputs["behavior_logps"])[mask].abs().max() < 1e-4
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].size(1)
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -width - 1 : -1].float()
    scaled = logits / temperature
    kth = scaled.topk(top_k, dim=-1).values[..., -1:]
    truncated = torch.log_softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
    expected = truncated.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    assert torch.isfinite(expected[mask]).all(), "every sampled token is among the top k"
    assert (inputs["sampling_logps"] - expected)[mask].abs().max() < 1e-4
    assert (inputs["sampling_logps"] > inputs["behavior_logps"])[mask].all()


def test_truncated_on_policy_training_has_ratio_one_and_the_kept_mass_as_behavior_weight(tokenizer, tmp_path):
    """top_p=0.7, on-policy: no token is clipped (the anchor is the untruncated policy) and the behavior weight is
    the mass the sampler kept, below 1 (as GRPOTrainer's vLLM importance weight): the truncation is not ignored."""
    trainer = make_trainer(tokenizer, tmp_path, top_p=0.7, max_staleness=0, max_steps=3)
    trainer.train()
    assert logged(trainer, "a3po/staleness_max") == [0.0] * 3
    assert logged(trainer, "clip_ratio/low_mean") == [0.0] * 3
    assert logged(trainer, "clip_ratio/high_mean") == [0.0] * 3
    weights = logged(trainer, "a3po/importance_weight_mean")
    assert all(0.5 < w < 0.9 for w in weights), weights


def test_beam_search_trains_with_behavior_log_probs_from_a_forward(tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(
            tokenizer, tmp_path, generation_kwargs={"num_beams": 2, "length_penalty": -0.1}, max_steps=2
        )
        trainer.train()
    assert "num_beams=2" in caplog.text
    assert trainer.last_batch_producer.produced == 2


def test_dropout_left_on_is_reported(tokenizer, tmp_path, caplog):
    model = _gpt2(tokenizer)  # GPT-2 has dropout layers (p=0.1)
    with caplog.at_level(logging.WARNING, logger="a3po_trl"):
        make_trainer(tokenizer, tmp_path, model=model, disable_dropout=False)
    assert "disable_dropout=False" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="a3po_trl"):
        make_trainer(tokenizer, tmp_path, model=_gpt2(tokenizer))
    assert "disable_dropout" not in caplog.text


def test_reward_functions_get_the_state_of_the_batchs_version_and_their_own_tokenizers(tokenizer, tmp_path):
    steps_seen, states, threads = [], [], []

    def state_reward(completions, trainer_state, **kwargs):
        steps_seen.append(trainer_state.global_step)
        states.append(trainer_state)
        threads.append(threading.current_thread().name)
        return length_reward(completions)

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(state_reward,), max_staleness=2, max_steps=6)
    trainer.train()
    assert all(name.startswith("a3po-generation") for name in threads)
    assert steps_seen == [int(v) for v in logged(trainer, "async/generator_version")]
    assert all(state is not trainer.state for state in states)  # a snapshot, never the training thread's live state


def test_reward_processing_classes_are_copied_for_the_generation_thread(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, dataset=make_prompts(8))
    trainer.reward_processing_classes = [tokenizer]
    trainer._backend = trainer._build_backend()
    settings = builders.rollout_settings(trainer)
    assert settings.reward_processing_classes[0] is not tokenizer
    assert settings.reward_processing_classes[0].get_vocab() == tokenizer.get_vocab()
