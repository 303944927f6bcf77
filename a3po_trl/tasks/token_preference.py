"""A synthetic task for many-seed method studies on a tiny model: prefer the tokens of the prompt's class.

The vocabulary is tiny (:func:`make_token_preference_tokenizer`): ``num_classes`` prompt tokens ``c0``, ``c1``, ...,
``symbols`` answer tokens ``t0``, ``t1``, ... and the special tokens. A prompt is one class token ``ck``; a completion
earns the fraction of its ``max_completion_length`` token slots that hold an answer token of that class (``tj`` with
``j % num_classes == k``). A tiny random model starts near the uniform policy (about 0.2 with the defaults) and can
reach 1.0.

Why this task, for studies that compare the proximal methods (``benchmarks/proximal_map.py``): its reward has no
flat plateau. Every completion's reward is one of ``max_completion_length + 1`` evenly spaced values, so a group of
8 completions almost never has zero spread (GRPO learns from every group), and a run does not get caught on a
partial-credit level the way the word-choice task's graded replies do (``benchmarks/staleness.py``, its 0.25 and 0.5
plateaus). It needs no pretrained knowledge and a step of a 2-layer model takes milliseconds, so hundreds of seeds
fit in hours on two CPU cores; how fast a run learns depends on the learning rate, the staleness and the method,
which is what such a study varies. The vocabulary is small so that every answer token is sampled many times per
step: with a byte-level vocabulary of 259 tokens the same model did not learn in 60 steps at any learning rate tried.
"""

from __future__ import annotations

import random

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")


def make_token_preference_tokenizer(num_classes: int = 4, symbols: int = 16) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``<pad> <eos> <bos> c0 .. c{num_classes-1} t0 .. t{symbols-1}`` (whitespace
    separated), with ``<eos>`` as its end and ``<pad>`` as its padding token."""
    words = [*SPECIAL_TOKENS, *(f"c{k}" for k in range(num_classes)), *(f"t{j}" for j in range(symbols))]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>", unk_token="<pad>"
    )


def make_token_preference_prompts(n: int, num_classes: int = 4, seed: int = 0) -> Dataset:
    """``n`` plain-text prompts ``ck`` with their class ``k`` in the ``target`` column, in a seeded order (each class
    ``n // num_classes`` times or once more)."""
    classes = [i % num_classes for i in range(n)]
    random.Random(seed).shuffle(classes)
    return Dataset.from_dict({"prompt": [f"c{k}" for k in classes], "target": classes})


def class_token_ids(tokenizer, num_classes: int = 4) -> list[set[int]]:
    """For each class ``k``, the ids of its answer tokens ``tj`` (``j % num_classes == k``)."""
    classes: list[set[int]] = [set() for _ in range(num_classes)]
    for word, token_id in tokenizer.get_vocab().items():
        if word.startswith("t") and word[1:].isdigit():
            classes[int(word[1:]) % num_classes].add(token_id)
    return classes


def token_preference_reward(tokenizer, max_completion_length: int, num_classes: int = 4):
    """The reward function: for each completion, the fraction of its ``max_completion_length`` slots that hold an
    answer token of the prompt's class; a completion that stops early earns nothing for the slots it left empty. It
    reads ``completion_ids`` and the dataset's ``target`` column, as GRPOTrainer passes them to a reward function."""
    targets = class_token_ids(tokenizer, num_classes)

    def token_preference(completion_ids, target, **kwargs) -> list[float]:
        return [
            sum(1 for token in ids if token in targets[int(k)]) / max_completion_length
            for ids, k in zip(completion_ids, target, strict=True)
        ]

    return token_preference
