"""What the GPU check trains: a random Qwen2 model (Qwen2.5-0.5B's architecture, or a tiny one on CPU), a word-level
tokenizer covering its vocabulary, arithmetic-looking prompts and a reward with variance on random weights."""

from __future__ import annotations

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
PROMPT_WORDS = ["user", "assistant", "system", "What", "is", "plus", "?", *map(str, range(100))]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Vocabulary: Qwen2.5's on a GPU, a small one on CPU.
VOCAB_SIZE = {"gpu": 151936, "cpu": 1024}

#: Model sizes. ``full``: Qwen2.5-0.5B-Instruct (hidden 896, 24 layers, 14 query and 2 key/value heads, MLP 4864);
#: ``tiny``: the CPU model; ``tiny-vllm``: a CPU model vLLM's CPU kernels accept (head size 64).
SIZES = {
    "full": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "tiny-vllm": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2),
}

#: Mean entropy (nats per position) of the peaked model's next-token distributions (see :func:`peak`): about a trained
#: language model's, so the sampled tokens carry much of the probability and bf16's rounding of the logits (about
#: 0.4% of their size) moves their log-probs visibly, unlike the near-uniform distributions of random weights.
PEAKED_ENTROPY = 1.0


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary is exactly ``vocab_size`` words (ChatML specials, the prompt words,
    then ``w<id>`` for every other id), so every id a model of that vocabulary samples decodes to a word."""
    words = SPECIAL_TOKENS + PROMPT_WORDS
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


def model_config(tokenizer, size: str) -> Qwen2Config:
    """Qwen2.5-0.5B-Instruct's architecture (its config.json) at ``size`` (a key of ``SIZES``). The special token ids
    are this script's tokenizer's (Qwen's own are 151643-151645; only the ids differ)."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        num_key_value_heads=2 if size != "tiny-vllm" else 1,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SIZES[size],
    )


def build_model(config: Qwen2Config, dtype: torch.dtype, device: str, seed: int = 0, peaked: bool = False):
    """Random weights, the same for every run (same seed and device), in ``dtype``; ``peaked``: see :func:`peak`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if peaked:
        peak(model)
    return model.to(dtype)


@torch.no_grad()
def peak(model: Qwen2ForCausalLM, entropy: float = PEAKED_ENTROPY) -> float:
    """Scale the final norm's weight (the logits scale with it: the LM head has no bias) so that the mean entropy of
    the next-token distributions over a few positions is ``entropy`` nats: a confident model, where the trainer's and
    the generator's bf16 numerics differ visibly. Returns the factor applied."""
    device = model.model.norm.weight.device
    ids = torch.arange(4, 68, device=device).unsqueeze(0) % model.config.vocab_size
    logits = model(input_ids=ids).logits[0].float()

    def mean_entropy(factor: float) -> float:
        logps = (factor * logits).log_softmax(-1)
        return -(logps.exp() * logps).sum(-1).mean().item()

    low, high = 0.0, 1.0
    while mean_entropy(high) > entropy and high < 1e6:
        low, high = high, high * 2
    for _ in range(40):  # bisection: the entropy falls as the factor grows
        middle = (low + high) / 2
        low, high = (middle, high) if mean_entropy(middle) > entropy else (low, middle)
    model.model.norm.weight.mul_(high)
    return high


def build_prompts(count: int = 256) -> Dataset:
    prompts = [[{"role": "user", "content": f"What is {i % 100} plus {(7 * i) % 100} ?"}] for i in range(count)]
    return Dataset.from_dict({"prompt": prompts})


def even_digit_reward(completions, **kwargs) -> list[float]:
    """Fraction of the completion's words that end in an even digit (``w4``, ``12``): about half of a random
    completion's, so rewards vary within a group and the advantages are not zero."""
    rewards = []
    for completion in completions:
        words = completion[0]["content"].split()
        rewards.append(sum(word[-1] in "02468" for word in words) / max(len(words), 1))
    return rewards


#: Learning rates, by device and weights: large enough that one optimizer step moves the policy by more than
#: ``verdict.MAX_BEHAVIOR_MISMATCH`` on the sampled tokens (printed as drift/step), so that a generator left on older
#: weights (a weight sync that did not happen) fails the mismatch check instead of passing it.
LEARNING_RATES = {("cpu", "lora"): 1e-2, ("cpu", "full"): 3e-3, ("cuda", "lora"): 1e-3, ("cuda", "full"): 1e-4}

#: The shape of a step: per-device batch, completions per prompt, completion tokens.
SHAPES = {
    "cpu": dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=16),
    "cuda": dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=48),
}


def training_settings(cpu: bool, weights: str, steps: int, output_dir: str, **overrides) -> dict:
    """The settings both trainers share (GRPOConfig fields); ``overrides`` replace any of them."""
    device = "cpu" if cpu else "cuda"
    settings = dict(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=LEARNING_RATES[device, weights],
        bf16=True,  # mixed precision: autocast to bf16 (on CPU too), whatever dtype the weights are loaded in
        use_cpu=cpu,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **SHAPES[device],
    )
    settings.update(overrides)
    return settings
