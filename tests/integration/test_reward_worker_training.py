"""``reward_num_workers``: a run whose reward functions are called in worker processes trains the same weights, bit for
bit, and logs the same values as one that calls them in the generation thread; a function's error fails ``train()``
with its name; a function that cannot be sent is refused when the trainer is built; no worker outlives ``train()``."""

import multiprocessing

import pytest
import torch
from helpers import logged, make_trainer, model_weights
from tiny import answer_reward, async_length_reward, exiting_reward, failing_reward, length_reward

REWARDS = (length_reward, answer_reward, async_length_reward)
SETTINGS = dict(reproducible_generation=True, max_staleness=1, max_steps=3, logging_steps=1)
LOGGED = [
    "loss",
    "reward",
    "reward_std",
    "grad_norm",
    "rewards/length_reward/mean",
    "rewards/answer_reward/mean",
    "rewards/async_length_reward/mean",
    "answer_reward/step",
    "async_length_reward/calls",
]


def _new_children(before: set) -> list:
    """The multiprocessing children started since ``before`` that are still alive (a test's own, not another's)."""
    return [child for child in multiprocessing.active_children() if child not in before]


def test_rewards_in_workers_train_the_threads_weights_bit_for_bit(tokenizer, tmp_path):
    before, runs = set(multiprocessing.active_children()), {}
    for workers in (0, 2):
        trainer = make_trainer(
            tokenizer, tmp_path / str(workers), reward_funcs=REWARDS, reward_num_workers=workers, **SETTINGS
        )
        trainer.train()
        runs[workers] = trainer
        assert not _new_children(before)  # the pool ended with train()
    in_thread, in_workers = runs[0], runs[2]
    for key in LOGGED:
        assert logged(in_thread, key) and logged(in_thread, key) == logged(in_workers, key), key
    assert logged(in_workers, "answer_reward/step") == [0.0, 0.0, 1.0]  # the state of the batch's weights
    a, b = model_weights(in_thread), model_weights(in_workers)
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize(
    "reward, error, message",
    [(failing_reward, ValueError, "cannot score"), (exiting_reward, RuntimeError, "died .*'exiting_reward'")],
    ids=["raises", "dies"],
)
def test_a_reward_functions_error_or_death_in_a_worker_fails_train_with_its_name(
    tokenizer, tmp_path, reward, error, message
):
    before = set(multiprocessing.active_children())
    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(reward,), reward_num_workers=1, max_steps=2)
    with pytest.raises(error, match=message) as info:
        trainer.train()
    if reward is failing_reward:
        assert "'failing_reward' in a reward worker process" in "".join(info.value.__notes__)
        assert "the reward worker's traceback" in str(info.value.__cause__)
    assert not _new_children(before)


def test_a_reward_function_that_cannot_be_sent_is_refused_when_the_trainer_is_built(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="'<lambda>' cannot be sent to a reward worker process.*reward_num_workers=0"):
        make_trainer(tokenizer, tmp_path, reward_funcs=(lambda completions, **kwargs: [0.0],), reward_num_workers=1)
