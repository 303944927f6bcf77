"""The decoupled loss is GRPOTrainer's loss: the same scalar, gradients and metrics, for every loss type and option.

On-policy (behavior = proximal = the weights being trained) the loss must be GRPOTrainer's ``_compute_loss``. Off
policy it must be GRPOTrainer's loss with its "old" policy replaced by the proximal one and its importance-sampling
correction (the one it applies to vLLM samples) replaced by the capped behavior weight ``rho``.
"""

import pytest
import torch
from helpers import first_batch_with_logps
from tiny import digit_reward, length_reward, make_model, make_moe_model, make_prompts
from trl import GRPOConfig, GRPOTrainer

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer, behavior_importance_weight
from a3po_trl.losses import LossSettings
from a3po_trl.metrics.deferred import resolve_metrics
from a3po_trl.patches import align_position_ids_with_generation
from a3po_trl.proximal import ProximalAnchor

SETTINGS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    report_to="none",
    use_cpu=True,
    bf16=False,
    save_strategy="no",
    learning_rate=1e-2,
    seed=0,
    max_steps=3,
    epsilon_high=0.28,
    gradient_accumulation_steps=2,
)

CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "vespo": dict(loss_type="vespo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "gspo-dapo": dict(loss_type="dapo", importance_sampling_level="sequence"),
    "delta": dict(loss_type="grpo", delta=1.2),
    "off-policy-mask": dict(loss_type="dapo", off_policy_mask_threshold=0.01),
    "entropy-mask": dict(loss_type="grpo", top_entropy_quantile=0.5),
    "entropy-bonus": dict(loss_type="dr_grpo", entropy_coef=0.05),
    "adaptive-entropy": dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=9.0),
    "kl": dict(loss_type="bnpo", beta=0.05),
    "kl-bias-corrected": dict(loss_type="dapo", beta=0.05, use_bias_correction_kl=True),
    "moe-aux-loss": dict(loss_type="grpo", model="moe", router_aux_loss_coef=0.01),
}


def _pair(tokenizer, tmp_path, options, method="loglinear"):
    """Our trainer (``prox_logp_method=method``, synchronous, staleness 0) and GRPOTrainer on the same model."""
    options = dict(options)
    model_kind = options.pop("model", "dense")
    settings = {**SETTINGS, **options}
    model_dir = str(tmp_path / "model")
    (make_moe_model if model_kind == "moe" else make_model)(tokenizer).save_pretrained(model_dir)
    common = dict(
        model=model_dir,
        reward_funcs=[length_reward, digit_reward],
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
    )
    ours = AsyncA3POTrainer(
        args=AsyncA3POConfig(
            output_dir=str(tmp_path / "a"),
            max_staleness=0,
            async_generation=False,
            prox_logp_method=method,
            **settings,
        ),
        **common,
    )
    theirs = GRPOTrainer(args=GRPOConfig(output_dir=str(tmp_path / "b"), **settings), **common)
    align_position_ids_with_generation(theirs.model)  # the same forward as ours (tested on its own elsewhere)
    for trainer in (ours, theirs):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
        trainer.state.max_steps = 3
    return ours, theirs


def _read_the_config_again(trainer):
    """The loss's settings and anchor as ``trainer.args`` says now (the trainer reads them once, when it is built)."""
    trainer.loss_settings, trainer.proximal_anchor = LossSettings.of(trainer), ProximalAnchor.from_config(trainer.args)


def _compare(ours, theirs, inputs, trl_inputs):
    loss_ours = ours.compute_loss(ours.model, inputs)
    loss_ours.backward()
    loss_theirs = theirs._compute_loss(theirs.model, trl_inputs)
    loss_theirs.backward()
    assert torch.allclose(loss_ours, loss_theirs, atol=1e-7, rtol=1e-6), (loss_ours.item(), loss_theirs.item())
    grads_theirs = dict(theirs.model.named_parameters())
    for name, param in ours.model.named_parameters():
        theirs_grad = grads_theirs[name].grad
        if theirs_grad is None:
            assert param.grad is None or not param.grad.any(), name
            continue
        difference = (param.grad - theirs_grad).abs().max()
        assert torch.allclose(param.grad, theirs_grad, atol=1e-7, rtol=1e-5), (name, difference)
    ours_metrics, theirs_metrics = ours._metrics["train"], theirs._metrics["train"]
    resolve_metrics(ours_metrics)  # ours are device tensors until logged
    for name, values in theirs_metrics.items():
        assert name in ours_metrics, f"GRPOTrainer logs {name!r}, AsyncA3POTrainer does not"
        assert ours_metrics[name][-1] == pytest.approx(values[-1], rel=1e-5, abs=1e-7, nan_ok=True), name


@pytest.mark.parametrize("method", ["loglinear", "behavior"])
@pytest.mark.parametrize("case", list(CASES))
def test_on_policy_loss_gradients_and_metrics_are_grpo_trainers(tokenizer, tmp_path, case, method):
    ours, theirs = _pair(tokenizer, tmp_path, CASES[case], method)
    if CASES[case].get("use_adaptive_entropy"):  # an entropy below target at the last step: the bonus applies now
        ours._last_world_entropy = theirs._last_world_entropy = 1.0
    inputs, logps = first_batch_with_logps(ours)
    assert (inputs["token_versions"] == 0).all()
    # On-policy: the behavior log-probs are the training forward's own (GRPOTrainer's "old" = current, detached).
    inputs["behavior_logps"] = logps
    trl_inputs = {k: v for k, v in inputs.items() if k not in ("behavior_logps", "token_versions")}
    _compare(ours, theirs, inputs, trl_inputs)
    if CASES[case].get("use_adaptive_entropy"):
        assert ours.entropy_coef == theirs.entropy_coef and ours._last_world_entropy == theirs._last_world_entropy


OFF_POLICY_CASES = [
    "grpo",
    "bnpo",
    "dr_grpo",
    "dapo",
    "cispo",
    "sapo",
    "vespo",
    "luspo",
    "gspo",
    "delta",
    "off-policy-mask",
]


@pytest.mark.parametrize("cap_mode", ["token_mask", "token_truncate", "sequence_mask"])
@pytest.mark.parametrize("case", OFF_POLICY_CASES)
def test_off_policy_loss_is_grpo_trainers_with_proximal_old_policy_and_rho_correction(
    tokenizer, tmp_path, case, cap_mode
):
    options = {**CASES[case], "prox_logp_method": "recompute", "behavior_weight_cap": 1.2}
    options["behavior_weight_cap_mode"] = cap_mode
    trl_options = {k: v for k, v in options.items() if not k.startswith(("prox_", "behavior_"))}
    ours, theirs = _pair(tokenizer, tmp_path, trl_options)
    ours.args.prox_logp_method, ours.args.behavior_weight_cap = "recompute", 1.2
    ours.args.behavior_weight_cap_mode = cap_mode
    _read_the_config_again(ours)
    inputs, logps = first_batch_with_logps(ours)
    generator = torch.Generator().manual_seed(0)
    mask = inputs["completion_mask"]
    proximal = logps + 0.3 * torch.randn(logps.shape, generator=generator)
    offset = 0.3 * torch.randn(logps.shape[:1], generator=generator).unsqueeze(1)  # whole sequences cross the cap
    behavior = proximal + offset + 0.3 * torch.randn(logps.shape, generator=generator)
    inputs["recomputed_proximal_logps"], inputs["behavior_logps"] = proximal, behavior
    rho, keep = behavior_importance_weight(proximal, behavior, mask, 1.2, cap_mode)
    assert keep.sum() < mask.sum() or (rho[mask.bool()] == 1.2).any()  # the cap drops or clamps some tokens
    importance = torch.where(keep, rho, torch.where(mask.bool(), 0.0, 1.0))
    trl_inputs = {k: v for k, v in inputs.items() if k not in ("behavior_logps", "token_versions")}
    trl_inputs.pop("recomputed_proximal_logps")
    trl_inputs.update(
        old_per_token_logps=proximal, importance_sampling_ratio=importance, sampling_per_token_logps=behavior
    )
    theirs.use_vllm = theirs.vllm_importance_sampling_correction = True  # TRL's IS-corrected loss path
    _compare(ours, theirs, inputs, trl_inputs)


@pytest.mark.parametrize("case", OFF_POLICY_CASES)
def test_behavior_ablation_is_grpo_trainers_loss_against_stale_weights_without_correction(tokenizer, tmp_path, case):
    """``prox_logp_method="behavior"`` at staleness 4, with truncated sampling: GRPOTrainer's loss with the behavior
    log-probs as its "old" policy and no importance weight at all (neither staleness nor truncation is reweighted),
    which is what TRL's ``generate`` path computes. A-3PO on the same batch is another loss."""
    ours, theirs = _pair(tokenizer, tmp_path, CASES[case], method="behavior")
    inputs, logps = first_batch_with_logps(ours)
    generator = torch.Generator().manual_seed(0)
    behavior = logps + 0.3 * torch.randn(logps.shape, generator=generator)  # four optimizer steps of drift
    # a truncating sampler renormalises the kept mass: each token's sampling log-prob is above its policy log-prob
    sampling = behavior + 0.2 * torch.rand(logps.shape, generator=generator)
    inputs.update(behavior_logps=behavior, sampling_logps=sampling)
    ours.state.global_step = 4  # the batch was generated by version 0
    trl_inputs = {k: v for k, v in inputs.items() if k not in ("behavior_logps", "token_versions", "sampling_logps")}
    # GRPOTrainer's off-policy mask compares with the sampling distribution when it has one, as ours does
    trl_inputs.update(old_per_token_logps=behavior, sampling_per_token_logps=sampling)
    _compare(ours, theirs, inputs, trl_inputs)
    metrics = ours._metrics["train"]
    assert metrics["a3po/staleness_max"][-1] == 4
    assert metrics["a3po/importance_weight_mean"][-1] == metrics["a3po/importance_weight_max"][-1] == 1.0
    assert metrics["a3po/importance_weight_masked_frac"][-1] == 0.0
    # how far the policy moved from the generating weights: in all, and per optimizer step of staleness
    drift = (logps - behavior).abs()[inputs["completion_mask"].bool()].mean().item()
    assert metrics["a3po/behavior_drift_mean"][-1] == pytest.approx(drift, rel=1e-4)
    assert metrics["a3po/behavior_drift_per_version_mean"][-1] == pytest.approx(drift / 4, rel=1e-4)

    ours.args.prox_logp_method = "loglinear"  # anchor a quarter of the way from the behavior policy, rho != 1
    _read_the_config_again(ours)
    assert not torch.allclose(ours.compute_loss(ours.model, inputs), theirs._compute_loss(theirs.model, trl_inputs))
    resolve_metrics(metrics)
    assert metrics["a3po/importance_weight_mean"][-1] != 1.0
