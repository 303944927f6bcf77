"""In-flight weight updates through the trainer (``in_flight_weight_updates=True``, the ``generate`` backend): a
version the trainer publishes while a batch is generated is taken at the next decode step, every token keeps its own
version into the loss (its staleness, its A-3PO interpolation weight), the staleness bound holds per token, the
metrics say how many versions the completions span, and it works with LoRA, with chunked generation and across a
checkpoint and resume.

The switch points are made a function of the schedule, not of timing (``helpers.Lockstep``): batch ``b >= lag``
samples its first 3 tokens with version ``b - lag`` and the rest with ``b - lag + 1``, in every run, the last batches
too (with ``generation_batch_chunk_size``: the tokens of its first 3 forwards, in whichever ``generate`` calls).
"""

import time

import pytest
import torch
from helpers import COMMON, SWITCH_AFTER, Lockstep, logged, make_trainer
from tiny import length_reward, make_model, make_prompts

import a3po_trl.losses
import a3po_trl.proximal.anchor
import a3po_trl.trainer
from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.patches import peft_base_model


class LossRecorder:
    """The per-token staleness and A-3PO proximal log-probs the loss computes at each micro-step."""

    def __init__(self, monkeypatch):
        self.staleness_calls, self.interpolations = [], []
        token_staleness = a3po_trl.losses.token_staleness
        approximate = a3po_trl.proximal.anchor.approximate_proximal_logps

        def recorded_staleness(current_version, token_versions):
            staleness = token_staleness(current_version, token_versions)
            self.staleness_calls.append((current_version, token_versions.clone(), staleness.clone()))
            return staleness

        def recorded_interpolation(behavior, current, staleness):
            proximal = approximate(behavior, current, staleness)
            self.interpolations.append((behavior.clone(), current.detach().clone(), proximal.detach().clone()))
            return proximal

        monkeypatch.setattr(a3po_trl.losses, "token_staleness", recorded_staleness)
        monkeypatch.setattr(a3po_trl.proximal.anchor, "approximate_proximal_logps", recorded_interpolation)


def decode_slowly_after_the_switch(trainer, lockstep: Lockstep, batch: int, seconds: float = 0.2) -> None:
    """Make every forward of the generator after the switch of batch ``batch`` take ``seconds`` longer: long enough
    for the trainer to train a batch and publish a version meanwhile, unless the lockstep holds it back."""
    build = trainer._build_backend

    def build_slow():
        backend = build()

        def slow(module, args, kwargs):
            if lockstep._batch == batch and lockstep._forwards > SWITCH_AFTER:
                time.sleep(seconds)

        peft_base_model(backend.module).register_forward_pre_hook(slow, with_kwargs=True)
        return backend

    trainer._build_backend = build_slow


def _lora_trainer(tokenizer, tmp_path, **overrides):
    """The tiny model with a LoRA adapter (only the adapter is published and loaded mid-batch)."""
    from peft import LoraConfig

    return AsyncA3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=[length_reward],
        args=AsyncA3POConfig(output_dir=str(tmp_path / "out"), **{**COMMON, **overrides}),
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )


@pytest.mark.parametrize("lora", [False, True])
def test_tokens_span_two_versions_and_each_is_staled_by_its_own(tokenizer, tmp_path, monkeypatch, lora):
    settings = dict(max_steps=4, max_staleness=2, in_flight_weight_updates=True, bf16=False)
    trainer = (_lora_trainer if lora else make_trainer)(tokenizer, tmp_path, **settings)
    lockstep = Lockstep(trainer, monkeypatch.setattr, lag=2, num_batches=4)
    # the last batch has no batch after it for the trainer to wait for: it switches once only because the trainer
    # takes batch 2 (whose training publishes version 3) once batch 3 is finished
    decode_slowly_after_the_switch(trainer, lockstep, batch=3)
    loss = LossRecorder(monkeypatch)
    trainer.train()
    if lora:  # only the adapter is published, and loaded between decode steps
        assert lockstep.backend.trainable_names and all("lora_" in n for n in lockstep.backend.trainable_names)

    # batches 2 and 3 start with version b - 2 and switch to b - 1 after their third token; nothing else switches
    assert lockstep.start_versions == {0: 0, 1: 0, 2: 0, 3: 1}
    for index in range(4):
        assert torch.equal(lockstep.token_versions[index], lockstep.expected_versions(index)), index
        assert lockstep.scored_versions[index] == lockstep.start_versions[index]  # a batch's version: its oldest
    assert (lockstep.masks[2].sum(dim=1) > SWITCH_AFTER).any(), "some completion must outlive the switch"

    # the loss stales every token by its own version: at step b, 2 for the first tokens of batch b >= 2, 1 after
    assert [call[0] for call in loss.staleness_calls] == [0, 1, 2, 3]
    for current_version, versions, staleness in loss.staleness_calls:
        generated = versions >= 0
        assert torch.equal(staleness[generated], current_version - versions[generated])
        assert staleness.max() <= trainer.args.max_staleness  # the bound holds for every token, the oldest too
    last_versions, last_staleness = loss.staleness_calls[-1][1], loss.staleness_calls[-1][2]
    row = (last_versions >= 0).sum(dim=1).argmax()
    assert set(last_staleness[row][last_versions[row] >= 0].tolist()) == {1, 2}
    # ... and its A-3PO weight w = 1 / max(d, 1) per token: 1/2 on the tokens of the older version, 1 on the newer
    behavior, current, proximal = loss.interpolations[-1]
    weight = 1.0 / last_staleness.clamp(min=1).to(current.dtype)
    assert torch.allclose(proximal, weight * behavior + (1 - weight) * current, atol=1e-6)
    generated, newer = last_versions[row] >= 0, last_staleness[row] == 1
    assert not torch.allclose(proximal[row][generated], behavior[row][generated])  # w < 1 somewhere in the row
    assert torch.allclose(proximal[row][generated & newer], behavior[row][generated & newer])  # w = 1 there

    frac = logged(trainer, "a3po/multi_version_trajectories_frac")
    assert frac[:2] == [0.0, 0.0] and all(0 < f <= 1 for f in frac[2:])
    assert logged(trainer, "a3po/completion_versions_max") == [1.0, 1.0, 2.0, 2.0]
    assert all(1.0 < v <= 2.0 for v in logged(trainer, "a3po/completion_versions_mean")[2:])
    assert logged(trainer, "async/in_flight_weight_loads") == [0.0, 0.0, 1.0, 1.0]
    assert all(t > 0 for t in logged(trainer, "async/in_flight_weight_load_time")[2:])
    assert max(logged(trainer, "a3po/staleness_max")) == 2.0
    assert all(0 < m < 2 for m in logged(trainer, "a3po/staleness_mean")[2:])  # per token: 2 and 1 mixed


def test_in_flight_updates_continue_across_a_checkpoint_and_resume(tokenizer, tmp_path, monkeypatch):
    settings = dict(max_staleness=1, in_flight_weight_updates=True, save_strategy="steps", save_steps=2, bf16=False)
    model = make_model(tokenizer)
    first = make_trainer(tokenizer, tmp_path, model=model, max_steps=2, **settings)
    lockstep = Lockstep(first, monkeypatch.setattr, lag=1, num_batches=2)
    first.train()
    assert torch.equal(lockstep.token_versions[1], lockstep.expected_versions(1))
    assert lockstep.start_versions == {0: 0, 1: 0}

    resumed = make_trainer(tokenizer, tmp_path, max_steps=4, **settings)
    lockstep = Lockstep(resumed, monkeypatch.setattr, lag=1, num_batches=2)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    # the resumed run numbers versions from the checkpoint's step: its second batch switches from 2 to 3
    assert lockstep.start_versions == {0: 2, 1: 2}
    assert torch.equal(lockstep.token_versions[1], lockstep.expected_versions(1))
    assert set(lockstep.token_versions[1][lockstep.masks[1]].tolist()) == {2, 3}
    assert logged(resumed, "async/in_flight_weight_loads")[-1] == 1.0


def test_in_flight_updates_with_generation_chunks_carry_the_loaded_version_into_the_next_chunk(
    tokenizer, tmp_path, monkeypatch
):
    """``generation_batch_chunk_size=2``: a batch of 4 is two ``generate`` calls. The version loaded during the first
    call (after its third token) tags the rest of it and all of the second, which generates with it from its first
    token: only the first call's tokens after the switch are sampled over an older KV cache."""
    settings = dict(max_staleness=1, in_flight_weight_updates=True, bf16=False, generation_batch_chunk_size=2)
    trainer = make_trainer(tokenizer, tmp_path, max_steps=4, **settings)
    lockstep = Lockstep(trainer, monkeypatch.setattr, lag=1, num_batches=4)
    trainer.train()

    assert lockstep.start_versions == {0: 0, 1: 0, 2: 1, 3: 2}
    for index in range(4):
        assert torch.equal(lockstep.token_versions[index], lockstep.expected_versions(index, chunk_size=2)), index
    for index in (1, 2, 3):  # the first call reaches the switch (its longest completion is 8 tokens)
        versions, mask, start = lockstep.token_versions[index], lockstep.masks[index], lockstep.start_versions[index]
        assert mask[:2].sum(dim=1).max() > SWITCH_AFTER
        assert set(versions[:2][mask[:2]].tolist()) == {start, start + 1}
        assert set(versions[2:][mask[2:]].tolist()) == {start + 1}
    assert logged(trainer, "async/in_flight_weight_loads") == [0.0, 1.0, 1.0, 1.0]
    # trained at version b, the tokens after the switch of batch b are on-policy (staleness 0): measured apart from
    # the generator's numerics (fp32 on CPU: the second call's tokens), by the gap of the older cache they came from
    after_switch = logged(trainer, "a3po/behavior_mismatch_after_switch_max")
    mismatch = logged(trainer, "a3po/behavior_mismatch_max")
    assert len(after_switch) == 3 and len(mismatch) == 4  # batch 0 has no switch
    assert max(mismatch) < 1e-4 and min(after_switch) > 100 * max(mismatch)


def test_a_generation_config_without_one_forward_per_token_is_refused(tokenizer, tmp_path):
    trainer = make_trainer(
        tokenizer, tmp_path, in_flight_weight_updates=True, bf16=False, generation_kwargs={"num_beams": 2}
    )
    with pytest.raises(ValueError, match="in_flight_weight_updates=True needs a generation config"):
        trainer.train()
