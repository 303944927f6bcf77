"""A tiny random model, built offline in milliseconds, for benchmark smoke runs and measurements of the trainer's own
overhead (where the model's quality does not matter): a byte-level tokenizer with a ChatML template, a 2-layer Llama
with hidden size 32, arithmetic prompts, a length reward and a digit reward. The same shapes as the test suite's
fixtures."""

from __future__ import annotations

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens, no merges) with ChatML special tokens and chat template."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        bos_token="<|im_start|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_llama(tokenizer, seed: int = 0, hidden_size: int = 32, num_layers: int = 2) -> LlamaForCausalLM:
    """A random Llama over ``tokenizer``'s vocabulary (``seed`` fixes its weights)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def make_sum_prompts(n: int = 16) -> Dataset:
    """``n`` conversational prompts "What is a + b?" with their answers."""
    pairs = list(zip(range(n), range(3, 3 + n)))
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in pairs],
            "answer": [str(a + b) for a, b in pairs],
        }
    )


def length_reward(completions, **kwargs) -> list[float]:
    """Rewards longer completions: a dense signal that is always defined."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(text) / 10.0 for text in texts]


def digit_reward(completions, **kwargs) -> list[float]:
    """Rewards digits (a quarter per digit): a dense signal on arithmetic prompts, so that a random model's groups
    differ and its advantages are not all zero."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in text) / 4.0 for text in texts]
