"""``a3po_trl.tasks.tiny_model``, the benchmarks' tiny model, is the test suite's (``tests/tiny.py``): the same
tokenizer, the same weights for a seed, the same prompts and rewards, so a benchmark's smoke run trains what the tests
train."""

import tiny
import torch

from a3po_trl.tasks import tiny_model


def test_the_byte_tokenizer_encodes_and_templates_as_the_tests_one():
    ours, theirs = tiny_model.make_byte_tokenizer(), tiny.make_tokenizer()
    conversation = [{"role": "user", "content": "What is 2 + 3?"}]
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.apply_chat_template(conversation, add_generation_prompt=True) == theirs.apply_chat_template(
        conversation, add_generation_prompt=True
    )


def test_the_tiny_llama_has_the_tests_weights_for_a_seed():
    tokenizer = tiny.make_tokenizer()
    for seed in (0, 3):
        ours, theirs = tiny_model.make_tiny_llama(tokenizer, seed=seed), tiny.make_model(tokenizer, seed=seed)
        assert ours.config.to_dict() == theirs.config.to_dict()
        theirs_state = theirs.state_dict()
        assert all(torch.equal(value, theirs_state[name]) for name, value in ours.state_dict().items())


def test_prompts_and_rewards_are_the_tests_ones():
    assert tiny_model.make_sum_prompts(5).to_dict() == tiny.make_prompts(5).to_dict()
    completions = [[{"content": "12 + 7 = 19"}], "no digits", [{"content": ""}]]
    assert tiny_model.length_reward(completions) == tiny.length_reward(completions)
    assert tiny_model.digit_reward(completions) == tiny.digit_reward(completions) == [1.25, 0.0, 0.0]
