"""Reliability: bad input is caught before work starts, faults surface cleanly, checkpoints resume exactly.

The refusals that load no model are unit tests of the config (tests/unit/test_config.py) and of the validation
(tests/unit/test_validation.py)."""

import math
import os
import threading

import pytest
import torch
from helpers import StopAt, logged, logged_after, make_trainer, model_weights
from tiny import length_reward, make_model, make_prompts
from transformers import AutoModelForCausalLM, TrainerCallback


def test_a_dataset_smaller_than_one_generation_batch_is_rejected(tokenizer, tmp_path):
    """Refusals that need no model are unit tests of the config and the validation (tests/unit); this one needs the
    loaded trainer's generation batch size."""
    with pytest.raises(ValueError, match="fewer than one generation batch"):
        make_trainer(tokenizer, tmp_path, dataset=make_prompts(1), per_device_train_batch_size=8, num_generations=4)


def _no_generation_thread_alive():
    return not [t for t in threading.enumerate() if t.name.startswith("a3po-generation")]


def test_reward_function_exception_names_the_function(tokenizer, tmp_path):
    def broken_reward(completions, **kwargs):
        return [1 / 0 for _ in completions]

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(broken_reward,))
    with pytest.raises(ZeroDivisionError) as info:
        trainer.train()
    assert "broken_reward" in "".join(info.value.__notes__)
    assert any(frame.name == "<listcomp>" or frame.name == "broken_reward" for frame in info.traceback)
    assert _no_generation_thread_alive()


@pytest.mark.parametrize(
    "result, error, message",
    [
        (lambda n: [1.0] * (n - 1), ValueError, "returned 3 rewards, but 4 were expected"),
        (lambda n: ["good"] * n, TypeError, "non-numeric reward 'good'"),
        (lambda n: ["1.0"] * n, TypeError, "'odd_reward' returned a non-numeric reward '1.0'"),
        (lambda n: 3.0, TypeError, "returned float"),
    ],
)
def test_bad_reward_results_are_clear_errors(tokenizer, tmp_path, result, error, message):
    def odd_reward(completions, **kwargs):
        return result(len(completions))

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(odd_reward,), num_generations=4)
    with pytest.raises(error, match=message):
        trainer.train()
    assert _no_generation_thread_alive()


def test_none_and_nan_rewards_are_ignored(tokenizer, tmp_path):
    def sometimes_none(completions, **kwargs):
        return [None if i % 2 else float("nan") if i % 3 == 0 else 1.0 for i in range(len(completions))]

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(sometimes_none, length_reward), max_steps=2)
    trainer.train()
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))
    assert all(math.isfinite(v) for v in logged(trainer, "rewards/sometimes_none/mean"))


def test_all_masked_batches_and_zero_advantages_stay_finite(tokenizer, tmp_path):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    # every completion is truncated at 2 tokens and masked out; the constant reward gives zero advantages
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        reward_funcs=(constant,),
        max_completion_length=2,
        mask_truncated_completions=True,
        max_steps=2,
        loss_type="dapo",
    )
    trainer.train()
    assert logged(trainer, "loss") == [0.0, 0.0]
    assert all(math.isfinite(v) for key in ("entropy", "a3po/staleness_mean") for v in logged(trainer, key))


def test_resume_matches_uninterrupted_run(tokenizer, tmp_path):
    settings = dict(async_generation=False, max_staleness=1, max_steps=6, save_steps=3, save_strategy="steps")
    model = make_model(tokenizer)
    uninterrupted = make_trainer(tokenizer, tmp_path / "a", model=model, **settings)
    uninterrupted.train()

    model = make_model(tokenizer)
    interrupted = make_trainer(tokenizer, tmp_path / "b", model=model, **settings)
    interrupted.add_callback(StopAt(3))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-3"
    assert checkpoint.is_dir()
    AutoModelForCausalLM.from_pretrained(checkpoint)  # intact and loadable

    resumed = make_trainer(tokenizer, tmp_path / "b", model=make_model(tokenizer, seed=123), **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    for key in ("loss", "learning_rate", "reward", "async/generator_version"):
        assert logged_after(resumed, key, 3) == logged_after(uninterrupted, key, 3), key
        assert len(logged_after(resumed, key, 3)) == 3
    a, b = model_weights(uninterrupted), model_weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_resume_with_thread_starts_generator_at_restored_version(tokenizer, tmp_path):
    settings = dict(max_staleness=2, max_steps=4, save_steps=2, save_strategy="steps")
    first = make_trainer(tokenizer, tmp_path, **settings)
    first.add_callback(StopAt(2, ValueError))
    with pytest.raises(ValueError):
        first.train()
    resumed = make_trainer(tokenizer, tmp_path, model=make_model(tokenizer, seed=7), **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    versions = logged_after(resumed, "async/generator_version", 2)
    staleness = logged_after(resumed, "a3po/staleness_max", 2)
    assert versions[0] == 2 and min(versions) >= 2  # generator restarted from the restored weights
    assert len(staleness) == 2 and max(staleness) <= 2
    assert resumed.last_batch_producer.consumed == 2


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupt_leaves_last_checkpoint_loadable(tokenizer, tmp_path, error):
    class _FailAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise error("stop")

    trainer = make_trainer(tokenizer, tmp_path, max_steps=10, save_steps=2, save_strategy="steps", max_staleness=2)
    trainer.add_callback(_FailAt())
    with pytest.raises(error):
        trainer.train()
    assert _no_generation_thread_alive()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert sorted(p for p in os.listdir(tmp_path / "out") if p.startswith("checkpoint")) == ["checkpoint-2"]
    assert (checkpoint / "trainer_state.json").exists()
    AutoModelForCausalLM.from_pretrained(checkpoint)


def test_thread_on_runs_are_reproducible_within_tolerance(tokenizer, tmp_path):
    """With the thread on, sampling interleaves with the main thread; staleness stays bounded and rewards agree."""
    rewards = []
    for run in range(2):
        trainer = make_trainer(tokenizer, tmp_path / str(run), max_staleness=2, max_steps=6)
        trainer.train()
        assert max(logged(trainer, "a3po/staleness_max")) <= 2
        rewards.append(sum(logged(trainer, "reward")) / 6)
    assert abs(rewards[0] - rewards[1]) <= 0.15, rewards


def test_sigint_while_waiting_for_generation_joins_thread_quickly(tokenizer, tmp_path):
    """A real Ctrl-C (SIGINT to the process) while the trainer waits on a slow generator stops everything."""
    import signal
    import time

    def slow_reward(completions, **kwargs):
        time.sleep(0.5)
        return [0.0] * len(completions)

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(slow_reward,), max_staleness=0, max_steps=50)
    # A process started in the background by a non-interactive shell inherits SIGINT as ignored, and Python keeps
    # it ignored: install Python's own Ctrl-C handler so the test does not depend on how pytest was launched.
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    start = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        elapsed = time.perf_counter() - start
        timer.cancel()
        signal.signal(signal.SIGINT, previous_handler)
    assert _no_generation_thread_alive()
    assert elapsed < 2.0 + 10.0  # liveness bound, generous for a loaded machine: no hang
    assert trainer.state.global_step < 50


class _StopWhen(TrainerCallback):
    """After optimizer step ``step``, waits until ``ready()`` (the generation thread reached a given point), then
    ends training (``interrupt``: with Ctrl-C, else as a callback that ends training early does); once."""

    def __init__(self, step, ready, interrupt=False):
        self.step, self.ready, self.interrupt, self.done = step, ready, interrupt, False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.done:
            self.done = True
            assert self.ready(), "the generation thread never got there"
            if self.interrupt:
                raise KeyboardInterrupt
            control.should_training_stop = True


def test_a_generation_error_after_the_last_batch_taken_surfaces_from_train(tokenizer, tmp_path):
    calls = []

    def fails_on_the_second_batch(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 2:
            raise RuntimeError("the reward server went away")
        return [0.0] * len(completions)

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(fails_on_the_second_batch,), max_staleness=2)

    def thread_ended():  # it fails on batch 1, which the trainer, stopping after step 1, never takes
        trainer.last_batch_producer.thread.join(60)
        return not trainer.last_batch_producer.thread.is_alive()

    trainer.add_callback(_StopWhen(1, thread_ended))
    with pytest.raises(RuntimeError, match="the reward server went away"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_a_second_train_is_refused_while_the_first_ones_generation_thread_is_still_running(tokenizer, tmp_path):
    calls, release = [], threading.Event()

    def stuck_on_the_second_batch(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 2:
            release.wait(120)  # a reward function that does not return
        return [0.0] * len(completions)

    trainer = make_trainer(
        tokenizer,
        tmp_path,
        reward_funcs=(stuck_on_the_second_batch,),
        max_staleness=2,
        max_steps=2,
        generation_stop_timeout=0.1,
    )
    trainer.add_callback(_StopWhen(1, lambda: _wait_for(lambda: len(calls) >= 2), interrupt=True))
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        stuck = trainer.last_batch_producer.thread
        assert stuck.is_alive()
        with pytest.raises(RuntimeError, match=r"generation thread of an earlier train\(\) call .* still running"):
            trainer.train()
    finally:
        release.set()
        trainer.last_batch_producer.thread.join(60)
    trainer.remove_callback(_StopWhen)
    trainer.train()  # once the thread has ended, the trainer trains again
    assert trainer.state.global_step == 2


def _wait_for(condition, seconds=60.0):
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
