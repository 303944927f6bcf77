"""A constrained-answer task chosen for SmolLM2-135M-Instruct to learn in a few dozen steps: reply with a listed word.

Each prompt lists 3-5 common nouns and asks for exactly one of them as the whole reply ("Choose one word from this
list: river, candle, apple, ladder. Reply with that single word and nothing else."). Any listed word is right; the
task tests following the constraint, not knowledge.

Why this task, for studies that compare training methods (``benchmarks/staleness.py``): differences between methods
only show if the reward moves quickly and alike across seeds, which needs a behaviour the model already samples now
and then (GRPO learns only from groups whose rewards differ), far from saturated, and needing no knowledge the model
lacks. ``python -m benchmarks.task_probe`` (SmolLM2-135M-Instruct before training, 8 prompts x 8 samples at
temperature 0.7, 16 new tokens; seeds 0 and 1): mean reward 0.10 and 0.13 of a possible 1.0, 4 and 5 of 64 replies
exact, at most 1 of 8 groups without spread. With the same settings, "What is a + b? Reply with only the number."
(a, b up to 20) scored 0.04 with no exact reply and 6 of 8 groups without spread: the model gets most sums wrong, so
its reward cannot move by formatting alone; the demo's word problems need 60 steps and still vary by up to 17 points
between seeds. Two other phrasings of the instruction ("Answer with exactly one of them", "Your whole reply must be
that one word"), tried while choosing, made exact replies rarer, so only the first is used. Replies are short
once learned (one or two tokens), so ``max_completion_length=16`` keeps steps fast on a CPU.

The reward is graded, so that a group with no exact reply still carries a signal towards one
(:func:`word_choice_reward`): 1.0 for exactly one listed word, 0.5 for a listed word within at most three words,
0.25 for a listed word in a longer reply, 0.0 otherwise.

Training and held-out prompts use disjoint word lists (as sets) drawn from :data:`WORD_CHOICE_VOCABULARY`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import datasets

from .rewards import completion_to_text

__all__ = [
    "WORD_CHOICE_TEMPLATES",
    "WORD_CHOICE_VOCABULARY",
    "make_word_choice_splits",
    "score_word_choice",
    "word_choice_reward",
]

#: Common one-word nouns the lists are drawn from (lower case, letters only).
WORD_CHOICE_VOCABULARY = tuple(
    "apple river chair cloud pencil garden window candle bridge rocket violin forest button mirror ladder basket "
    "bottle carpet island lemon orange pillow planet rabbit saddle ticket tunnel wallet hammer jacket kettle "
    "lantern meadow needle pepper pocket silver spoon tiger tomato".split()
)

#: Phrasings of the instruction; ``{words}`` is the comma-separated list (one: the others tried were worse, see above).
WORD_CHOICE_TEMPLATES = ("Choose one word from this list: {words}. Reply with that single word and nothing else.",)

_WORD = re.compile(r"[a-z]+")


def score_word_choice(text: str, choices: Sequence[str]) -> float:
    """Reward of one reply ``text`` for the listed ``choices``: 1.0 if its only word is a listed one (case,
    quotes and punctuation ignored: ``"Apple."`` counts), 0.5 if a listed word appears among at most three words,
    0.25 if one appears in a longer reply, 0.0 otherwise (also for an empty reply)."""
    words = _WORD.findall(text.lower())
    listed = {choice.lower() for choice in choices}
    if not any(word in listed for word in words):
        return 0.0
    if len(words) == 1:
        return 1.0
    return 0.5 if len(words) <= 3 else 0.25


def word_choice_reward(completions: Sequence[Any], choices: Sequence[Sequence[str]], **kwargs) -> list[float]:
    """TRL reward function: :func:`score_word_choice` of each completion (a string or a conversational message list)
    against its row's ``choices`` column."""
    return [score_word_choice(completion_to_text(c), row) for c, row in zip(completions, choices)]


def _prompt(words: Sequence[str], template: str) -> list[dict[str, str]]:
    # No system message: the model's chat template adds its own default one, as it would for a user.
    return [{"role": "user", "content": template.format(words=", ".join(words))}]


def make_word_choice_splits(
    num_train: int = 1000,
    num_held_out: int = 64,
    seed: int = 0,
    vocabulary: Sequence[str] = WORD_CHOICE_VOCABULARY,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training and held-out word-choice prompts, generated offline and deterministically from ``seed``.

    Every row has ``prompt`` (a one-message conversation), ``choices`` (the listed words, for
    :func:`word_choice_reward`) and ``template`` (the index of its phrasing). Each list has 3-5 distinct words of
    ``vocabulary`` in random order; no held-out list has the same set of words as a training list, and no two
    held-out lists are the same set (so ``vocabulary`` must allow ``num_held_out`` sets and some more).
    """
    if num_train < 1 or num_held_out < 1:
        raise ValueError(f"num_train={num_train} and num_held_out={num_held_out} must both be positive.")
    if len(set(vocabulary)) < 5:
        raise ValueError(f"vocabulary has {len(set(vocabulary))} distinct words; lists need up to 5.")
    vocabulary = list(dict.fromkeys(vocabulary))  # distinct words, in the given order
    rng = random.Random(seed)

    def draw() -> dict[str, Any]:
        words = rng.sample(vocabulary, rng.randint(3, 5))
        template = rng.randrange(len(WORD_CHOICE_TEMPLATES))
        return {"prompt": _prompt(words, WORD_CHOICE_TEMPLATES[template]), "choices": words, "template": template}

    held_out, held_out_sets = [], set()
    while len(held_out) < num_held_out:
        row = draw()
        if frozenset(row["choices"]) not in held_out_sets:
            held_out_sets.add(frozenset(row["choices"]))
            held_out.append(row)
    train = []
    while len(train) < num_train:
        row = draw()
        if frozenset(row["choices"]) not in held_out_sets:
            train.append(row)
    return datasets.Dataset.from_list(train), datasets.Dataset.from_list(held_out)
