"""Rewards with GRPOTrainer's semantics (a3po_trl/rollout/scoring.py): dataset columns passed on, failures named,
the reward types GRPOTrainer accepts and refuses, ``async def`` functions beside plain ones, what they log."""

import math

import numpy as np
import pytest
import torch

from a3po_trl.rollout.scoring import score_completions


def test_score_completions_passes_columns_and_names_failures():
    rows = [{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "2"}]

    def echo_answer(prompts, completions, answer, **kwargs):
        return [float(a) for a in answer]

    def fails(prompts, completions, **kwargs):
        raise KeyError("boom")

    scores = score_completions([echo_answer], ["echo_answer"], [None], rows, ["p", "q"], ["a", "b"], [[1], [2]])
    assert scores.tolist() == [[1.0], [2.0]]
    with pytest.raises(KeyError) as info:
        score_completions([fails], ["fails"], [None], rows, ["p", "q"], ["a", "b"], [[1], [2]])
    assert "fails" in "".join(info.value.__notes__)


# What GRPOTrainer's torch.tensor(rewards, dtype=torch.float32) accepts, and what it refuses (text, even numeric text).
NUMERIC_REWARDS = [1, 2.5, True, np.float32(0.5), np.int64(2), np.bool_(False), torch.tensor(1.5), torch.tensor([3.0])]
NON_NUMERIC_REWARDS = ["1.0", np.str_("0.5"), b"1", np.array(1.5), [1.0], 1 + 2j]


def test_rewards_of_grpo_trainers_types_are_scored():
    rows = [{"prompt": "p"}] * (len(NUMERIC_REWARDS) + 1)
    n = len(rows)
    scores = score_completions(
        [lambda **kwargs: [*NUMERIC_REWARDS, None]], ["judge"], [None], rows, ["p"] * n, ["c"] * n, [[1]] * n
    )
    assert scores[:-1, 0].tolist() == [1.0, 2.5, 1.0, 0.5, 2.0, 0.0, 1.5, 3.0] and math.isnan(scores[-1, 0])


@pytest.mark.parametrize("value", NON_NUMERIC_REWARDS, ids=repr)
def test_non_numeric_rewards_are_refused_naming_the_function(value):
    rows = [{"prompt": "p"}, {"prompt": "q"}]

    def judge(prompts, completions, **kwargs):
        return [1.0, value]

    with pytest.raises(TypeError, match=r"reward function 'judge' returned a non-numeric reward"):
        score_completions([judge], ["judge"], [None], rows, ["p", "q"], ["a", "b"], [[1], [2]])


def test_async_reward_functions_run_beside_plain_ones_and_log(tokenizer):
    rows = [{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "2"}]

    async def async_answer(prompts, completions, answer, log_metric, **kwargs):
        log_metric("async_calls", 1.0)
        return [float(a) * 10 for a in answer]

    def plain(prompts, completions, log_extra, **kwargs):
        log_extra("first_letter", [c[0] for c in completions])
        return [0.5, None]

    extra, metrics = {}, {}
    scores = score_completions(
        [async_answer, plain],
        ["async_answer", "plain"],
        [None, None],
        rows,
        ["p", "q"],
        ["ab", "cd"],
        [[1], [2]],
        {"log_extra": extra.__setitem__, "log_metric": metrics.__setitem__},
    )
    assert scores[:, 0].tolist() == [10.0, 20.0]
    assert scores[0, 1] == 0.5 and math.isnan(scores[1, 1])
    assert extra == {"first_letter": ["a", "c"]} and metrics == {"async_calls": 1.0}

    async def broken(prompts, completions, **kwargs):
        raise KeyError("async boom")

    with pytest.raises(KeyError) as info:
        score_completions([broken], ["broken"], [None], rows, ["p", "q"], ["a", "b"], [[1], [2]])
    assert "broken" in "".join(info.value.__notes__)
