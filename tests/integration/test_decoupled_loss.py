"""What the trainer's loss adds to GRPOTrainer's: the cap on the KL correction, like-with-like approximation error."""

import pytest
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
    log-linear estimate against the weights being trained is measured on the micro-steps trained with those weights
    only; against recompute's anchor (``a3po/anchor_*``) on every micro-step, with its age."""
    trainer = make_trainer(
        tokenizer, tmp_path, prox_logp_method="metrics", steps_per_generation=2, max_staleness=1, max_steps=6
    )
    trainer.train()
    errors = logged(trainer, "a3po/approx_logp_abs_error")
    assert trainer.last_batch_producer.consumed == 3
    assert len(errors) == 3  # one per batch: its first micro-step; the second trains with newer weights
    assert all(e >= 0 for e in errors)
    # against recompute's anchor at every micro-step, with the versions the trained weights are past it
    assert logged(trainer, "a3po/anchor_age") == [0.0, 1.0] * 3
    anchor_errors = logged(trainer, "a3po/anchor_approx_logp_abs_error")
    assert len(anchor_errors) == 6 and anchor_errors[0::2] == errors  # a batch's first step: the same comparison
    assert all(e >= 0 for e in anchor_errors)


def _taken_micro_batches(trainer):
    """The micro-batches of the first generation batch, as ``_prepare_inputs`` buffers them when it takes it."""
    trainer.model.train()
    trainer.state.max_steps = 2
    try:
        trainer._prepare_inputs(None)
        return [dict(micro_batch) for micro_batch in trainer._buffered_inputs]
    finally:
        trainer._stop_producer()


def test_recompute_at_one_step_per_batch_trains_with_the_training_forward_and_todays_loss_and_gradients(
    tokenizer, tmp_path
):
    """Both micro-batches of a generation batch are trained before its optimizer step: the recompute anchor is the
    training forward's own log-probs, detached, and no forward runs when the batch is taken. Loss and gradients are
    those of the recompute forward the batch would otherwise get (run here on the same micro-batches), behavior
    weights and the cap included."""
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        prox_logp_method="recompute",
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_staleness=0,
        async_generation=False,
        behavior_weight_cap=1.3,
    )
    trainer.current_gradient_accumulation_steps = 2
    micro_batches = _taken_micro_batches(trainer)
    assert len(micro_batches) == 2 and all("recomputed_proximal_logps" not in m for m in micro_batches)
    generator = torch.Generator().manual_seed(0)
    for micro_batch in micro_batches:  # off-policy behavior log-probs: weights differ from 1, the cap drops some
        noise = 0.3 * torch.randn(micro_batch["behavior_logps"].shape, generator=generator)
        micro_batch["behavior_logps"] = micro_batch["behavior_logps"] + noise
    for reused in micro_batches:
        forward_based = dict(reused)
        anchor = trainer.proximal_anchor
        anchor.attach_proximal_logps(trainer, [forward_based], 0, versions_training_batch=2)  # the separate forward
        assert "recomputed_proximal_logps" in forward_based
        results = []
        for inputs in (reused, forward_based):
            trainer.model.zero_grad()
            loss = trainer.compute_loss(trainer.model, inputs)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
            results.append((loss.detach(), grads, trainer._metrics["train"]["a3po/importance_weight_masked_frac"][-1]))
        (loss_reused, grads_reused, dropped_reused), (loss_forward, grads_forward, dropped_forward) = results
        assert torch.allclose(loss_reused, loss_forward, atol=1e-7, rtol=1e-5), (loss_reused, loss_forward)
        assert dropped_reused == dropped_forward > 0
        assert grads_reused.keys() == grads_forward.keys() and any(g.abs().sum() > 0 for g in grads_reused.values())
        for name, grad in grads_reused.items():
            assert torch.allclose(grad, grads_forward[name], atol=1e-7, rtol=1e-5), name


def _forwards_of_the_training_module(trainer):
    """Train, counting the forward calls of the training module (the hook is copied into the generator's own module
    too; its calls are not counted)."""
    calls = []
    hook = trainer.model.register_forward_pre_hook(lambda module, args: calls.append(module is trainer.model))
    try:
        trainer.train()
    finally:
        hook.remove()
    return sum(calls)


@pytest.mark.parametrize("schedule", [{}, {"steps_per_generation": 2, "gradient_accumulation_steps": 2}])
def test_recompute_at_one_step_per_batch_runs_the_model_as_often_as_loglinear(tokenizer, tmp_path, schedule):
    forwards = {}
    for method in ("loglinear", "recompute", "metrics"):
        trainer = make_trainer(tokenizer, tmp_path / method, prox_logp_method=method, max_steps=3, **schedule)
        forwards[method] = _forwards_of_the_training_module(trainer)
        assert not any(span.name == "recompute forward" for span in trainer.timeline.spans())
        assert max(logged(trainer, "clip_ratio/region_mean")) == 0.0 or method == "loglinear"
    micro_steps = 3 * schedule.get("gradient_accumulation_steps", 1)
    assert forwards == {"loglinear": micro_steps, "recompute": micro_steps, "metrics": micro_steps}


def test_recompute_with_several_optimizer_steps_per_batch_runs_its_forward_and_its_clip_engages(tokenizer, tmp_path):
    """Four optimizer steps per generation batch: the batch's anchor is recomputed once, with the weights of its
    first step, and the later steps' ratios against it leave the clip range."""
    settings = dict(steps_per_generation=4, max_staleness=3, max_steps=8, learning_rate=5e-2)
    loglinear = make_trainer(tokenizer, tmp_path / "loglinear", prox_logp_method="loglinear", **settings)
    recompute = make_trainer(tokenizer, tmp_path / "recompute", prox_logp_method="recompute", **settings)
    # one no-grad forward per batch of 16 rows, in micro-batches of 4 (per_device_train_batch_size)
    assert _forwards_of_the_training_module(recompute) == _forwards_of_the_training_module(loglinear) + 2 * 4
    recomputes = [span for span in recompute.timeline.spans() if span.name == "recompute forward"]
    assert [span.args["batch"] for span in recomputes] == [0, 1]
    clipped = logged(recompute, "clip_ratio/region_mean")
    assert clipped[0] == clipped[4] == 0.0  # a batch's first step: the anchor is the weights being trained
    assert max(clipped) > 0
