"""Group advantages and local reward scoring (a3po_trl.rollout), against hand-computed values."""

import math

import pytest
import torch

from a3po_trl.rollout import group_advantages, score_completions


def _std(values):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_group_scaling_normalises_within_each_group():
    rewards = torch.tensor([[1.0], [0.0], [3.0], [3.0]])
    advantages, total, is_std_zero = group_advantages(rewards, torch.ones(1), num_generations=2)
    assert torch.allclose(advantages[:2], torch.tensor([0.5, -0.5]) / (_std([1.0, 0.0]) + 1e-4))
    assert advantages[2:].tolist() == [0.0, 0.0]
    assert is_std_zero.tolist() == [False, False, True, True]
    assert total.tolist() == [1.0, 0.0, 3.0, 3.0]


def test_batch_and_no_scaling():
    rewards = torch.tensor([[1.0], [0.0], [3.0], [5.0]])
    adv_none, _, _ = group_advantages(rewards, torch.ones(1), 2, scale_rewards="none")
    assert adv_none.tolist() == [0.5, -0.5, -1.0, 1.0]
    adv_batch, _, _ = group_advantages(rewards, torch.ones(1), 2, scale_rewards="batch")
    assert torch.allclose(adv_batch, adv_none / (_std([1.0, 0.0, 3.0, 5.0]) + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, torch.ones(1), 2, scale_rewards="sometimes")


def test_weights_nan_rows_and_normalize_then_sum():
    rewards = torch.tensor([[1.0, float("nan")], [0.0, 2.0], [float("nan"), float("nan")], [1.0, 1.0]])
    weights = torch.tensor([2.0, 0.5])
    adv, total, _ = group_advantages(rewards, weights, 2, scale_rewards="none")
    assert total[0] == 2.0 and total[1] == 1.0 and math.isnan(total[2]) and total[3] == 2.5
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]  # the unscorable row gets 0 and is left out of its group's mean
    adv2, _, _ = group_advantages(rewards, weights, 2, aggregation="normalize_then_sum")
    assert torch.isfinite(adv2).all() and adv2[2] == 0.0
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(rewards[:3], weights, 2)


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
