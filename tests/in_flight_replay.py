"""What the in-flight weight update tests with vLLM (colocate and server) check generation against: a later version
of a model, and the log-probs each token got when it was sampled, replayed with the same switch points."""

import copy

import torch
from tiny import make_vllm_model
from transformers import DynamicCache

#: fp32 engine against an fp32 Hugging Face forward: what vLLM's CPU kernels differ by (measured ~1e-6 on this model).
LOGP_TOLERANCE = 1e-4
BLOCK = 128  # vLLM's CPU KV-cache block: the prefix cache serves whole blocks only


def plain_copy(trainer):
    """The trainer's model as a plain Hugging Face model (the trainer's own has a patched ``forward``), to publish and
    to score with."""
    model = make_vllm_model(trainer._tokenizer)
    model.load_state_dict(trainer._unwrapped_model().state_dict())
    return model.eval()


def moved(module, scale: float = 0.3, seed: int = 7):
    """A copy of the plain model ``module`` with every weight moved (a later version)."""
    new = copy.deepcopy(module).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return new


@torch.no_grad()
def replay(models_by_version, prompt_ids, generated, step_versions, temperature) -> torch.Tensor:
    """Teacher-forced decoding of ``generated`` (one row) after ``prompt_ids`` over one KV cache, each step's forward
    run by the version that sampled that step: the log-prob each token got when it was sampled."""
    prompt, tokens = torch.tensor([prompt_ids]), torch.tensor([generated])
    cache = DynamicCache()
    out = models_by_version[step_versions[0]](input_ids=prompt, past_key_values=cache, use_cache=True)
    values = []
    for step in range(tokens.size(1)):
        logps = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
        values.append(logps[0, tokens[0, step]])
        if step + 1 < tokens.size(1):
            model = models_by_version[step_versions[step + 1]]
            out = model(input_ids=tokens[:, step : step + 1], past_key_values=cache, use_cache=True)
    return torch.stack(values)


@torch.no_grad()
def full_forward(model, prompt_ids, generated, temperature) -> torch.Tensor:
    """Log-probs of ``generated`` (one row) under one forward of ``model`` over the whole sequence."""
    ids = torch.tensor([list(prompt_ids) + list(generated)])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, torch.tensor(generated)[:, None])[:, 0]


def long_prompts(tokenizer, count: int) -> list[list[int]]:
    """Prompts longer than a KV-cache block, so that a prefix-cache hit would serve the block of the prompt."""
    texts = [f"Question {i}: " + "what is the sum of the numbers " * 5 for i in range(count)]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    assert all(BLOCK < len(p) < 200 for p in prompts)
    return prompts
