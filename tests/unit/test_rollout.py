"""Group advantages (a3po_trl.functional), reward scoring (a3po_trl.rollout.scoring), behavior log-probs and sampling
(a3po_trl.rollout)."""

import math

import numpy as np
import pytest
import torch
from tiny import length_reward, make_model
from transformers import GenerationConfig
from trl.trainer.utils import add_fused_lm_head

from a3po_trl.functional import group_advantages
from a3po_trl.generation import HFGenerateBackend, HFGenerationSettings
from a3po_trl.rollout import RolloutSettings, run_rollout
from a3po_trl.rollout.scoring import score_completions


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


def _rollout_settings(tokenizer) -> RolloutSettings:
    def tokenize(prompts, tools):
        return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]

    return RolloutSettings(
        tokenize_prompts=tokenize,
        decode=lambda ids, prompt_ids, prompts: tokenizer.batch_decode(ids, skip_special_tokens=True),
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        reward_funcs=[length_reward],
        reward_func_names=["length_reward"],
        reward_processing_classes=[None],
    )


def _backend(model, tokenizer, source: str, temperature: float, **generation_kwargs) -> HFGenerateBackend:
    """The generate backend on a copy of ``model`` (whose fused LM head it re-applies), sampling with the global RNG
    as the tests seed it."""
    generation_config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=generation_kwargs.pop("top_k", 0),
        top_p=1.0,
        max_new_tokens=12,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **generation_kwargs,
    )
    settings = HFGenerationSettings(
        generation_config=generation_config,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        behavior_logps_source=source,
        temperature=temperature,
        own_random_stream=False,
    )

    def patch(module):
        target = module.get_base_model() if hasattr(module, "get_base_model") else module
        add_fused_lm_head(target, temperature=temperature)

    return HFGenerateBackend(model, settings, patch_fn=patch)


def _patched_model(tokenizer, temperature: float, lora: bool):
    model = make_model(tokenizer, seed=3).eval()
    add_fused_lm_head(model, temperature=temperature)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return model


@pytest.mark.parametrize("lora, top_k", [(False, 0), (True, 0), (False, 5)])
def test_behavior_logps_recorded_during_generation_equal_a_forward_pass(tokenizer, lora, top_k):
    """The recorded log-probs score each picked token under raw logits / temperature, as the training forward does
    (also when top-k changes what generate samples from), through a PEFT wrapper too, ragged lengths included."""
    temperature = 0.7
    model = _patched_model(tokenizer, temperature, lora)
    rows = [{"prompt": p} for p in ("1+1=", "What is 12 + 30?", "x", "A longer prompt, to pad the others")]
    target = model.get_base_model() if lora else model
    scoring_forwards = []  # full-sequence forwards that score tokens (fused LM head), as opposed to decoding steps
    target.register_forward_pre_hook(
        lambda module, args, kwargs: scoring_forwards.append(bool(kwargs.get("fused_lm_head"))), with_kwargs=True
    )
    batches, scoring = {}, {}
    for source in ("generation", "forward"):
        torch.manual_seed(11)
        scoring_forwards.clear()
        backend = _backend(model, tokenizer, source, temperature, top_k=top_k)
        batches[source] = run_rollout(_rollout_settings(tokenizer), backend, rows)
        scoring[source] = sum(scoring_forwards)
    assert scoring == {"generation": 0, "forward": 1}
    recorded, forward = batches["generation"].tensors, batches["forward"].tensors
    assert torch.equal(recorded["completion_ids"], forward["completion_ids"])  # same samples: no RNG consumed
    mask = forward["completion_mask"].bool()
    assert mask.sum(dim=1).min() >= 1 and mask.sum(dim=1).unique().numel() > 1, "want ragged completions"
    assert recorded["behavior_logps"].shape == forward["behavior_logps"].shape
    assert torch.allclose(recorded["behavior_logps"][mask], forward["behavior_logps"][mask], atol=1e-5)
    assert (recorded["behavior_logps"][mask] < 0).all()
    assert (recorded["behavior_logps"][~mask] == 0).all()


def test_recorder_falls_back_to_a_forward_when_generate_does_not_step_once_per_token(tokenizer, caplog):
    model = _patched_model(tokenizer, 1.0, lora=False)
    with pytest.raises(ValueError, match="behavior_logps_source"):
        _backend(model, tokenizer, "cache", 1.0)
    rows = [{"prompt": "a prompt longer than one prefill chunk"}, {"prompt": "b"}]
    torch.manual_seed(0)
    backend = _backend(model, tokenizer, "generation", 1.0)
    run_rollout(_rollout_settings(tokenizer), backend, rows)
    assert not backend.module._forward_hooks  # nothing is left on the generator's model after a rollout
    # a prefill in chunks runs several forwards before the first token: the recorded columns would be misaligned, so
    # the rollout scores the tokens with a forward pass instead, and says so once
    results = {}
    for source in ("generation", "forward"):
        torch.manual_seed(0)
        chunked = _backend(model, tokenizer, source, 1.0, prefill_chunk_size=4)
        with caplog.at_level("WARNING", logger="a3po_trl"):
            results[source] = run_rollout(_rollout_settings(tokenizer), chunked, rows).tensors
        assert not chunked.module._forward_hooks
    assert caplog.text.count("could not be recorded during generation") == 1
    assert torch.equal(results["generation"]["completion_ids"], results["forward"]["completion_ids"])
    assert torch.equal(results["generation"]["behavior_logps"], results["forward"]["behavior_logps"])


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
