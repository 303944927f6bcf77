"""evaluate_accuracy (batched greedy decoding scored by correctness_reward) and paired_accuracy_test."""

import math
import re

import pytest
import torch
from tiny import make_model, make_prompts

from a3po_trl.tasks import evaluate_accuracy
from a3po_trl.tasks.evaluation import paired_accuracy_test


class ScriptedModel(torch.nn.Module):
    """A stand-in causal LM whose `generate` answers "What is a + b?" with `#### a+b` (wrong when a is odd).

    It checks that prompts arrive left-padded and returns the answer tokens followed by EOS and padding, like
    `transformers` does for finished sequences.
    """

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = None
        self.batch_sizes = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **kwargs):
        assert kwargs["do_sample"] is False
        assert (attention_mask[:, -1] == 1).all(), "prompts must be left-padded"
        self.batch_sizes.append(input_ids.size(0))
        replies = []
        for ids, mask in zip(input_ids, attention_mask):
            text = self.tokenizer.decode(ids[mask.bool()])
            a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", text)[0])
            answer = a + b + (1 if a % 2 else 0)
            replies.append(self.tokenizer(f"So #### {answer}", add_special_tokens=False)["input_ids"])
        width = max(len(r) for r in replies) + 1
        rows = [r + [self.tokenizer.eos_token_id] + [pad_token_id] * (width - len(r) - 1) for r in replies]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


def test_scores_every_problem_in_dataset_order(tokenizer, capsys, monkeypatch):
    # the session's tokenizer may have been left-padded by a trainer built before: start from right padding
    monkeypatch.setattr(tokenizer, "padding_side", "right")
    dataset = make_prompts(10)
    model = ScriptedModel(tokenizer)
    model.train()
    result = evaluate_accuracy(model, tokenizer, dataset, max_new_tokens=16, batch_size=4, num_samples=3)
    assert "Evaluating 10 problems" in capsys.readouterr().err  # a progress bar, not minutes of silence
    expected = [int(a % 2 == 0) for a in range(10)]
    assert result["correct"] == expected
    assert result["count"] == 10 and result["num_correct"] == 5
    assert result["accuracy"] == 0.5
    assert result["stderr"] == pytest.approx(math.sqrt(0.25 / 10))
    assert model.batch_sizes == [4, 4, 2]
    assert [s["completion"] for s in result["samples"]] == ["So #### 3", "So #### 6", "So #### 7"]
    assert [s["correct"] for s in result["samples"]] == [True, False, True]
    assert model.training, "the model's training mode is restored"
    assert tokenizer.padding_side == "right", "the tokenizer's padding side is restored"


def test_plain_string_prompts(tokenizer):
    dataset = [{"prompt": f"What is {a} + 1?", "answer": f"#### {a + 1}"} for a in (2, 4)]
    result = evaluate_accuracy(ScriptedModel(tokenizer), tokenizer, dataset, batch_size=8)
    assert result["accuracy"] == 1.0 and result["count"] == 2


def test_real_tiny_model_greedy_is_deterministic(tokenizer):
    model = make_model(tokenizer)
    model.eval()
    dataset = make_prompts(5)
    first = evaluate_accuracy(model, tokenizer, dataset, max_new_tokens=6, batch_size=5)
    second = evaluate_accuracy(model, tokenizer, dataset, max_new_tokens=6, batch_size=5)
    assert first["correct"] == second["correct"]
    assert [s["completion"] for s in first["samples"]] == [s["completion"] for s in second["samples"]]
    assert 0 <= first["mean_completion_tokens"] <= 6
    assert not model.training


def test_empty_dataset_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="empty"):
        evaluate_accuracy(ScriptedModel(tokenizer), tokenizer, [])


def test_paired_accuracy_test():
    before = [0] * 100
    after = [1] * 20 + [0] * 80
    result = paired_accuracy_test(before, after)
    assert result["gain"] == pytest.approx(0.2)
    assert result["improved"] == 20 and result["regressed"] == 0
    assert result["p_value"] == pytest.approx(2 * 0.5**20)
    assert result["stderr"] == pytest.approx(math.sqrt(0.2 * 0.8 * 100 / 99 / 100))
    same = paired_accuracy_test([1, 0, 1], [1, 0, 1])
    assert same["gain"] == 0 and same["p_value"] == 1.0 and same["z"] == 0.0
    mixed = paired_accuracy_test([1, 0, 1, 0], [0, 1, 1, 0])
    assert mixed["gain"] == 0 and mixed["p_value"] == 1.0
    with pytest.raises(ValueError):
        paired_accuracy_test([1], [1, 0])
