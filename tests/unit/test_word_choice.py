"""The word-choice task of the staleness study: its graded reward and its disjoint, deterministic splits."""

import pytest

from a3po_trl.tasks import make_word_choice_splits, score_word_choice, word_choice_reward
from a3po_trl.tasks.word_choice import WORD_CHOICE_VOCABULARY

CHOICES = ["river", "candle", "apple"]


@pytest.mark.parametrize(
    "reply, reward",
    [
        ("candle", 1.0),
        ("  Apple.\n", 1.0),  # case, whitespace and punctuation do not count as words
        ('"river"', 1.0),
        ("ladder", 0.0),  # one word, but not a listed one
        ("The word: river", 0.5),  # a listed word among at most three
        ("apple, river, candle", 0.5),
        ("I pick the river", 0.25),  # four words: longer than the limit of three
        ("I would choose the river today", 0.25),
        ("I'm sorry, I cannot help with that.", 0.0),
        ("", 0.0),
        ("rivers", 0.0),  # whole words only
    ],
)
def test_score_grades_how_close_a_reply_is_to_one_listed_word(reply, reward):
    assert score_word_choice(reply, CHOICES) == reward


def test_reward_function_reads_conversational_completions_and_the_choices_column():
    completions = [[{"role": "assistant", "content": "Candle"}], "the apple", [{"role": "assistant", "content": "x"}]]
    assert word_choice_reward(completions=completions, choices=[CHOICES, CHOICES, CHOICES]) == [1.0, 0.5, 0.0]


def test_splits_are_deterministic_disjoint_and_well_formed():
    train, held_out = make_word_choice_splits(num_train=300, num_held_out=40, seed=3)
    again_train, again_held_out = make_word_choice_splits(num_train=300, num_held_out=40, seed=3)
    assert train.to_list() == again_train.to_list() and held_out.to_list() == again_held_out.to_list()
    assert make_word_choice_splits(num_train=300, num_held_out=40, seed=4)[1].to_list() != held_out.to_list()
    held_out_sets = {frozenset(row["choices"]) for row in held_out}
    assert len(held_out_sets) == 40  # no held-out list repeats
    assert not held_out_sets & {frozenset(row["choices"]) for row in train}
    for row in [*train, *held_out]:
        words = row["choices"]
        assert 3 <= len(words) <= 5 and len(set(words)) == len(words) and set(words) <= set(WORD_CHOICE_VOCABULARY)
        (message,) = row["prompt"]
        assert message["role"] == "user" and ", ".join(words) in message["content"]
        assert score_word_choice(words[0], words) == 1.0


def test_held_out_lists_stay_out_of_training_even_when_lists_must_repeat():
    """Six words make only 41 distinct lists, so 200 training rows repeat them all the time: still none is held out."""
    train, held_out = make_word_choice_splits(num_train=200, num_held_out=10, seed=0, vocabulary="abcdef")
    held_out_sets = {frozenset(row["choices"]) for row in held_out}
    assert len(held_out_sets) == 10
    assert not held_out_sets & {frozenset(row["choices"]) for row in train}


def test_splits_refuse_empty_sizes():
    with pytest.raises(ValueError, match="num_held_out=0"):
        make_word_choice_splits(num_train=10, num_held_out=0)
