"""What the trainer's loss adds to GRPOTrainer's: the cap on the KL correction, like-with-like approximation error."""

import torch
from helpers import first_batch_with_logps, logged, make_trainer
from tiny import make_model

from a3po_trl.functional import aggregate_loss, kl_to_reference


def _batch(trainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.state.max_steps = 2
    return first_batch_with_logps(trainer)


def test_bias_corrected_kl_drops_the_tokens_the_cap_drops(tokenizer, tmp_path):
    make_model(tokenizer).save_pretrained(tmp_path / "model")  # a path: the reference model loads from it too
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        model=str(tmp_path / "model"),
        beta=0.1,
        use_bias_correction_kl=True,
        loss_type="bnpo",
        prox_logp_method="recompute",
        behavior_weight_cap=1.5,
        behavior_weight_cap_mode="token_mask",
        bf16=False,
        max_staleness=0,
        async_generation=False,
    )
    inputs, logps = _batch(trainer)
    mask = inputs["completion_mask"].bool()
    far = torch.zeros_like(mask)
    far[:, ::2] = True  # every other token: rho = e^1 > cap, dropped from the loss
    inputs["recomputed_proximal_logps"] = logps
    inputs["behavior_logps"] = torch.where(far, logps - 1.0, logps)
    inputs["ref_per_token_logps"] = logps - 3.0  # a large KL everywhere
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])  # only the KL term is left
    loss = trainer.compute_loss(trainer.model, inputs)
    kl = kl_to_reference(logps, inputs["ref_per_token_logps"])
    kept = mask & ~far
    expected = aggregate_loss(0.1 * kl * kept, mask, "bnpo")
    assert torch.allclose(loss, expected, atol=1e-6), (loss.item(), expected.item())
    assert loss < aggregate_loss(0.1 * kl * torch.where(far, torch.e, 1.0), mask, "bnpo")  # with the dropped tokens
    assert trainer._metrics["train"]["a3po/importance_weight_masked_frac"][-1] > 0.3


def test_approximation_error_compares_the_estimate_with_a_recompute_of_the_same_version(tokenizer, tmp_path):
    """A batch trained over two optimizer steps is recomputed once, with the first step's weights: the error of the
    log-linear estimate is measured on the micro-steps trained with those weights only."""
    trainer = make_trainer(
        tokenizer, tmp_path, prox_logp_method="metrics", steps_per_generation=2, max_staleness=1, max_steps=6
    )
    trainer.train()
    errors = logged(trainer, "a3po/approx_logp_abs_error")
    assert trainer.last_batch_producer.consumed == 3
    assert len(errors) == 3  # one per batch: its first micro-step; the second trains with newer weights
    assert all(e >= 0 for e in errors)
