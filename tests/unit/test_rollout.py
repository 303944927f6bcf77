"""One rollout (a3po_trl/rollout/run.py) with the ``generate`` backend: the behavior log-probs recorded while sampling
(a3po_trl/generation/hf/sampling.py) equal a forward pass's, and the fallback to one when they cannot be recorded."""

import pytest
import torch
from tiny import length_reward, make_model
from transformers import GenerationConfig
from trl.trainer.utils import add_fused_lm_head

from a3po_trl.generation import HFGenerateBackend, HFGenerationSettings
from a3po_trl.rollout import RolloutSettings, run_rollout


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
