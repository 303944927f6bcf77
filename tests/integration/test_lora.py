"""LoRA: the generator shares the frozen base, copies only the adapter, and the saved adapter loads back."""

import copy

import pytest
import torch
from helpers import COMMON, generator_matches, logged, make_trainer
from peft import LoraConfig, PeftModel, get_peft_model
from tiny import make_model

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _adapter_and_base_sizes(model):
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return adapter, base


def _lora_trainer(tokenizer, tmp_path, **overrides):
    from tiny import length_reward, make_prompts

    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer

    kwargs = {**COMMON, "max_steps": 3, **overrides}
    return AsyncA3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=[length_reward],
        args=AsyncA3POConfig(output_dir=str(tmp_path / "out"), **kwargs),
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
    )


def test_generator_shares_base_and_copies_only_the_adapter(tokenizer, tmp_path):
    trainer = _lora_trainer(tokenizer, tmp_path)
    trainer.train()
    policy = trainer.last_batch_producer.backend
    adapter, base = _adapter_and_base_sizes(trainer.model)
    assert policy.copied_parameter_count == adapter
    assert policy.shared_parameter_count == base
    assert policy.trainable_names and all("lora_" in name for name in policy.trainable_names)
    # the frozen base tensors are the very same storage as the trainer's
    trainer_params = dict(trainer.model.named_parameters())
    for name, param in policy.module.named_parameters():
        if "lora_" not in name:
            assert param.data_ptr() == trainer_params[name].data_ptr(), name
        else:
            assert param.data_ptr() != trainer_params[name].data_ptr(), name
    policy.refresh()
    assert generator_matches(policy, trainer.model)
    assert any(v > 0 for v in logged(trainer, "a3po/staleness_max"))


def test_ready_peft_model_and_beta_uses_adapter_disabled_reference(tokenizer, tmp_path):
    from tiny import length_reward, make_prompts

    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
    from a3po_trl.training_batch import reference_logps

    base = make_model(tokenizer)
    base_reference = copy.deepcopy(base)
    model = get_peft_model(base, LoraConfig(**LORA))
    args = AsyncA3POConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "max_steps": 3, "beta": 0.1})
    trainer = AsyncA3POTrainer(
        model=model,
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
    )
    trainer.train()
    assert trainer.ref_model is None  # TRL's PEFT reference: the adapter-disabled model
    assert len(logged(trainer, "kl")) == 3
    ids = torch.randint(0, 256, (2, 12))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        reference = reference_logps(trainer, ids, mask, 6)
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(base_reference, temperature=trainer.temperature)
        with trainer.accelerator.autocast():
            untrained = base_reference(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
    expected = untrained.log_probs[:, -6:]
    assert torch.allclose(reference, expected, atol=1e-5)


def test_saved_adapter_loads_and_merges(tokenizer, tmp_path):
    trainer = _lora_trainer(tokenizer, tmp_path, learning_rate=5e-2)
    trainer.train()
    out = tmp_path / "adapter"
    trainer.save_model(str(out))
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(make_model(tokenizer), str(out)).eval()
    trained = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()  # no bf16 autocast
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        merged = loaded.merge_and_unload()(input_ids=ids).logits
        untrained = make_model(tokenizer)(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(merged, expected, atol=1e-4)
    assert not torch.allclose(untrained, expected, atol=1e-4)  # the adapter learned something


@pytest.mark.parametrize("full", [False, True])
def test_generator_memory_is_adapter_sized(tokenizer, tmp_path, full):
    if full:
        trainer = make_trainer(tokenizer, tmp_path, max_steps=1)
    else:
        trainer = _lora_trainer(tokenizer, tmp_path, max_steps=1)
    trainer.train()
    policy = trainer.last_batch_producer.backend
    total = sum(p.numel() for p in trainer.model.parameters())
    extra = policy.copied_parameter_count
    if full:
        assert extra == total
    else:
        assert extra < 0.05 * total
