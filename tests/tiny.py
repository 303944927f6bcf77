"""Tiny, local, offline test fixtures: a byte-level tokenizer with a chat template and small random causal LMs."""

from __future__ import annotations

import os
import time

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens, no merges) with ChatML special tokens."""
    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_to_unicode))}
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


def make_model(
    tokenizer,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    return LlamaForCausalLM(config)


def make_reward_model(tokenizer, seed: int = 1) -> LlamaForSequenceClassification:
    """A small random sequence-classification reward model (one label)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    return LlamaForSequenceClassification(config)


def make_moe_model(tokenizer, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A small mixture-of-experts causal LM that returns its router logits (for the load-balancing loss)."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
        output_router_logits=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(config)


def make_prompts(n: int = 16, conversational: bool = True) -> Dataset:
    questions = [f"What is {a} + {b}?" for a, b in zip(range(n), range(3, 3 + n))]
    answers = [str(a + b) for a, b in zip(range(n), range(3, 3 + n))]
    if conversational:
        prompts = [[{"role": "user", "content": q}] for q in questions]
    else:
        prompts = questions
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def length_reward(completions, **kwargs):
    """Rewards longer completions: a dense, always-defined signal for tests."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / 10.0 for t in texts]


def digit_reward(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / 4.0 for t in texts]


def answer_reward(completions, answer, trainer_state, log_extra, log_metric, **kwargs):
    """Uses what GRPOTrainer passes besides the completions: a dataset column, the trainer state, both logging
    callbacks; and leaves completions without a digit unscored (None). Module-level, so that reward worker processes
    (``reward_num_workers``) can import it."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    log_extra("answer_seen", list(answer))
    log_metric("answer_reward/step", float(trainer_state.global_step) if trainer_state is not None else -1.0)
    return [None if not any(ch.isdigit() for ch in t) else float(a in t) for t, a in zip(texts, answer)]


async def async_length_reward(completions, log_metric, **kwargs):
    """``length_reward``, as an ``async def`` function that logs a metric."""
    log_metric("async_length_reward/calls", 1.0)
    return length_reward(completions)


def failing_reward(completions, **kwargs):
    """Raises, as a reward function with a bug does."""
    raise ValueError(f"cannot score {len(completions)} completions")


def sleeping_reward(completions, started_file=None, **kwargs):
    """Never returns in a test's time, as a reward stuck on a network call does; creates ``started_file`` first."""
    if started_file is not None:
        open(started_file, "w").close()
    time.sleep(3600)
    return [0.0] * len(completions)


def exiting_reward(completions, **kwargs):
    """Ends its process without a word, as a worker killed by the out-of-memory killer does."""
    os._exit(3)


def make_vllm_model(tokenizer, seed: int = 0, tie_word_embeddings: bool = True) -> LlamaForCausalLM:
    """A small random Llama that vLLM's CPU kernels accept (head size 64), with tied embeddings by default (the case
    where vLLM's packed LM head must be refreshed after a weight load)."""
    return make_model(
        tokenizer,
        seed,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie_word_embeddings,
    )


CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'
"""A tool call in Qwen3's syntax (``CALL.format(name=..., arguments='{"a": 1}')``)."""
DONE = "Done!<|im_end|>"


def make_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with Qwen3's chat template (tool calls in <tool_call> tags), its response parser, and
    the prefix-preserving training template GRPOTrainer switches to for tools."""
    from pathlib import Path

    import trl
    from trl.chat_template_utils import add_response_schema, get_training_chat_template

    tokenizer = make_tokenizer()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    tokenizer = add_response_schema(tokenizer)
    tokenizer.chat_template = get_training_chat_template(tokenizer)
    return tokenizer


def multiply(a: int, b: int) -> int:  # a tool: TRL reads its schema from the docstring
    """
    Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


def tool_script(arguments='{"a": 3, "b": 4}'):
    """A ``script`` for :func:`scripted_generate`: call ``multiply`` with ``arguments``, then answer."""

    def script(text):
        return DONE if "<tool_response>" in text else CALL.format(name="multiply", arguments=arguments)

    return script


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def scripted_generate(tokenizer, script):
    """A stand-in for a model's ``generate`` (set on the model before training; the generator's copy keeps it):
    each row continues with ``script(decoded_row)``."""

    def generate(input_ids, attention_mask=None, **kwargs):
        rows = [encode(tokenizer, script(tokenizer.decode(ids, skip_special_tokens=False))) for ids in input_ids]
        width = max(len(r) for r in rows)
        rows = [r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(rows, dtype=input_ids.dtype)], dim=1)

    return generate


def make_meta_qwen25(size: str):
    """Qwen2.5-1.5B or -7B (``size``: ``"1.5b"``, ``"7b"``) built on the meta device: real parameter counts for memory
    arithmetic, no memory used. 1.5B ties its LM head to its embedding (1.54 B parameters); 7B does not (7.62 B)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shapes = {
        "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                     vocab_size=151936, tie_word_embeddings=True),
        "7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                   vocab_size=152064, tie_word_embeddings=False),
    }  # fmt: skip
    config = Qwen2Config(num_hidden_layers=28, dtype="bfloat16", **shapes[size])
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)
