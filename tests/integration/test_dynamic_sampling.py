"""Dynamic sampling with the trainer (tiny model, CPU): the batches trained carry a reward signal only, the bound ends
an all-flat run with its warning, reproducible runs stay identical, and a resume draws on exactly where the
interrupted run stood: from a run's last checkpoint with a larger ``max_steps``, and inside a generation batch trained
over several optimizer steps, where it trains what the uninterrupted run trains."""

import json
import logging
import random
import threading
import time

import pytest
import torch
from helpers import RecordingTrainer, StopAt, logged, logged_after, make_trainer, model_weights
from tiny import length_reward, make_model

#: Two groups of 4 per batch; a prompt whose answer is 3 mod 4 (every other one) gets a flat reward.
SETTINGS = dict(dynamic_sampling=True, per_device_train_batch_size=8, max_steps=4)


def half_flat_reward(draws, jitter=False):
    """``length_reward`` for half the prompts, a constant for the others; ``draws`` records each call's answers (one
    call per generation batch drawn). ``jitter``: a random pause, so the generation thread's timing varies."""

    def half_flat(completions, answer, **kwargs):
        if jitter:
            time.sleep(random.Random().uniform(0.0, 0.1))
        draws.append(list(answer[::4]))
        lengths = length_reward(completions)
        return [1.0 if int(a) % 4 == 3 else value for a, value in zip(answer, lengths)]

    return half_flat


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_trained_group_carries_signal_and_the_filtered_ones_are_counted(tokenizer, tmp_path, lora):
    draws = []
    model = make_model(tokenizer)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(half_flat_reward(draws),), model=model, **SETTINGS)
    trainer.train()
    assert trainer.state.global_step == 4
    drawn = [answer for draw in draws for answer in draw]
    flat_drawn = sum(int(a) % 4 == 3 for a in drawn)
    assert flat_drawn > 0 and len(draws) > 4  # flat groups were drawn, so refills were needed
    assert logged(trainer, "frac_reward_zero_std") == [0.0] * 4  # ... and none of them was trained
    filtered = logged(trainer, "a3po/dynamic_sampling_filtered_groups")
    extra = logged(trainer, "a3po/dynamic_sampling_extra_batches")
    assert sum(filtered) >= flat_drawn - 1  # all but possibly flat groups of the last draws
    assert sum(extra) == len(draws) - 4
    assert logged(trainer, "a3po/dynamic_sampling_bound_reached") == [0.0] * 4
    prompts_per_step = logged(trainer, "a3po/dynamic_sampling_prompts_per_step")
    assert sum(prompts_per_step) == 2 * len(draws)  # two prompts per draw, one optimizer step per batch


def test_an_all_flat_dataset_trains_to_the_end_at_the_bound_with_a_warning(tokenizer, tmp_path, caplog):
    trainer = make_trainer(
        tokenizer, tmp_path, reward_funcs=(constant_reward,), dynamic_sampling_max_gen_batches=3, **SETTINGS
    )
    caplog.set_level(logging.WARNING, logger="a3po_trl.rollout.dynamic_sampling")
    thread = threading.Thread(target=trainer.train, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "training on an all-flat dataset did not end"
    assert trainer.state.global_step == 4
    assert logged(trainer, "a3po/dynamic_sampling_bound_reached") == [1.0] * 4
    assert logged(trainer, "a3po/dynamic_sampling_extra_batches") == [2.0] * 4
    assert logged(trainer, "frac_reward_zero_std") == [1.0] * 4  # the filler describes the trained batch
    assert any("dynamic_sampling_max_gen_batches=3" in record.getMessage() for record in caplog.records)


REPRODUCIBLE = dict(SETTINGS, reproducible_generation=True, max_staleness=2, max_steps=5)


def _run(tokenizer, tmp_path, draws, seed=0, callbacks=(), resume=None, **overrides):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        reward_funcs=(half_flat_reward(draws, jitter=True),),
        model=make_model(tokenizer, seed=seed),
        **{**REPRODUCIBLE, **overrides},
    )
    for callback in callbacks:
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_reproducible_runs_are_identical_and_a_resume_draws_on_where_the_run_stood(tokenizer, tmp_path):
    checkpointing = dict(save_steps=2, save_strategy="steps")
    first_draws, second_draws = [], []
    first = _run(tokenizer, tmp_path / "a", first_draws, **checkpointing)
    second = _run(tokenizer, tmp_path / "b", second_draws)
    assert first_draws == second_draws and len(first_draws) > 5
    for key in ("loss", "reward", "a3po/dynamic_sampling_filtered_groups", "a3po/staleness_max"):
        assert logged(first, key) == logged(second, key), key
    a, b = model_weights(first), model_weights(second)
    assert all(torch.equal(a[n], b[n]) for n in a)

    interrupted_draws, resumed_draws = [], []
    with pytest.raises(KeyboardInterrupt):
        _run(tokenizer, tmp_path / "c", interrupted_draws, callbacks=[StopAt(2)], **checkpointing)
    resumed = _run(
        tokenizer, tmp_path / "c", resumed_draws, seed=123, resume=str(tmp_path / "c" / "out" / "checkpoint-2")
    )
    # the resumed run starts drawing at the batch after step 2, exactly where the uninterrupted run drew it: no
    # prompt is drawn twice, none is skipped
    before = first.last_batch_producer.draw_starts()[2]
    assert first_draws[:before] == interrupted_draws[:before]
    assert resumed_draws == first_draws[before:]
    for key in ("loss", "reward", "a3po/dynamic_sampling_filtered_groups"):
        assert logged_after(resumed, key, 2) == logged_after(first, key, 2), key
    a, b = model_weights(first), model_weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def prompt_flat_reward(draws):
    """A constant for the prompts whose answer is 3 mod 4, each completion's place in its group for the others: which
    groups the filter drops, and so which prompt batches a run draws, follows from the prompts alone. ``draws``
    records each call's answers (one call per generation batch drawn)."""

    def prompt_flat(completions, answer, **kwargs):
        draws.append(list(answer[::4]))
        return [1.0 if int(a) % 4 == 3 else float(row % 4) for row, a in enumerate(answer)]

    return prompt_flat


def test_a_run_resumed_from_its_last_checkpoint_with_more_steps_draws_on_where_it_ended(tokenizer, tmp_path):
    def run(path, draws, max_steps, resume=None):
        trainer = make_trainer(
            tokenizer,
            path,
            reward_funcs=(prompt_flat_reward(draws),),
            **{**SETTINGS, "max_steps": max_steps, "save_strategy": "steps", "save_steps": 2},
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    uninterrupted_draws, first_draws, resumed_draws = [], [], []
    uninterrupted = run(tmp_path / "a", uninterrupted_draws, max_steps=4)
    run(tmp_path / "b", first_draws, max_steps=2)  # ends with its checkpoint
    checkpoint = tmp_path / "b" / "out" / "checkpoint-2"
    run(tmp_path / "b", resumed_draws, max_steps=4, resume=str(checkpoint))  # as the trainer's warning advises
    before = uninterrupted.last_batch_producer.draw_starts()[2]
    assert len(uninterrupted_draws) > 4  # flat groups were drawn: the batches drew more than one prompt batch each
    assert first_draws == uninterrupted_draws[:before]
    assert resumed_draws == uninterrupted_draws[before:]  # none drawn twice, none skipped

    # a record that does not say where the batch the run restarts at drew is refused, not guessed at (batch 2
    # renamed 9: the file keeps the size the checkpoint's manifest lists)
    record_path = checkpoint / "a3po_prompt_draws_rank0.json"
    record = json.loads(record_path.read_text())
    record["draws_before"]["9"] = record["draws_before"].pop("2")
    record_path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="not before batch 2, where this run restarts"):
        run(tmp_path / "b", [], max_steps=4, resume=str(checkpoint))


@pytest.mark.parametrize(
    "mode",
    [dict(reproducible_generation=True), dict(), dict(async_generation=False)],
    ids=["reproducible_generation", "async", "synchronous"],
)
def test_a_resume_inside_a_generation_batch_trains_what_the_uninterrupted_run_trains(tokenizer, tmp_path, mode):
    # Generation batches of 4 groups trained over 2 optimizer steps (steps_per_generation=2, 2 groups per micro-batch):
    # the checkpoint at step 3 falls inside batch 1, whose draws the resumed run repeats from where they began,
    # keeping the same groups, and of which it trains the second micro-batch, in the checkpoint's row order.
    settings = dict(
        SETTINGS, steps_per_generation=2, max_staleness=2, max_steps=6, save_strategy="steps", save_steps=3, **mode
    )

    def trainer(path, draws, seed=0):
        return make_trainer(
            tokenizer,
            path,
            reward_funcs=(prompt_flat_reward(draws),),
            model=make_model(tokenizer, seed=seed),
            trainer_class=RecordingTrainer,
            **settings,
        )

    uninterrupted_draws, interrupted_draws, resumed_draws = [], [], []
    uninterrupted = trainer(tmp_path / "a", uninterrupted_draws)
    uninterrupted.train()
    interrupted = trainer(tmp_path / "b", interrupted_draws)
    interrupted.add_callback(StopAt(3))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    resumed = trainer(tmp_path / "b", resumed_draws, seed=123)
    resumed.train(resume_from_checkpoint=True)
    assert len(interrupted.trained) == 3 and len(resumed.trained) == 3
    # every micro-batch trains the prompts it trains in the uninterrupted run: none lost, none trained twice
    assert interrupted.trained + resumed.trained == uninterrupted.trained
    # batch 1 is drawn again from the prompt batch its first draw took, and the run draws on as the uninterrupted one
    assert len(uninterrupted_draws) > 3  # the batches drew more than one prompt batch each
    assert resumed_draws == uninterrupted_draws[uninterrupted.last_batch_producer.draw_starts()[1] :]
    # with reproducible_generation the regenerated batch 1 holds the same samples too (the checkpoint keeps the
    # version that generated it), so the rest of the run is the same bit for bit
    if mode.get("reproducible_generation"):
        assert logged_after(resumed, "loss", 3) == logged_after(uninterrupted, "loss", 3)
        a, b = model_weights(uninterrupted), model_weights(resumed)
        assert all(torch.equal(a[n], b[n]) for n in a)
