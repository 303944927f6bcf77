"""Properties of the A-3PO math (a3po_trl.functional), pinned with examples and hypothesis, and GRPOTrainer's group
advantages."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po_trl import (
    CAP_MODES,
    aggregate_loss,
    approximate_proximal_logps,
    behavior_importance_weight,
    decoupled_ppo_loss,
    proximal_approximation_error,
    staleness_weight,
)
from a3po_trl.functional import group_advantages

logps_values = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw, max_b=4, max_t=6):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    behavior = torch.tensor(draw(st.lists(logps_values, min_size=b * t, max_size=b * t)), dtype=torch.float64)
    current = torch.tensor(draw(st.lists(logps_values, min_size=b * t, max_size=b * t)), dtype=torch.float64)
    per_token = draw(st.booleans())
    n = b * t if per_token else b
    staleness = torch.tensor(draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)))
    staleness = staleness.view(b, t) if per_token else staleness
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).view(b, t)
    advantages = torch.tensor(draw(st.lists(st.floats(-3, 3), min_size=b, max_size=b)), dtype=torch.float64)
    return behavior.view(b, t), current.view(b, t), staleness, mask, advantages


def test_staleness_weight_values():
    d = torch.tensor([0, 1, 2, 4, 10])
    assert torch.allclose(staleness_weight(d), torch.tensor([1.0, 1.0, 0.5, 0.25, 0.1]))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_sandwich_property(batch):
    behavior, current, staleness, _, _ = batch
    prox = approximate_proximal_logps(behavior, current, staleness)
    low, high = torch.minimum(behavior, current), torch.maximum(behavior, current)
    assert torch.all(prox >= low - 1e-9) and torch.all(prox <= high + 1e-9)
    assert torch.isfinite(prox).all()


@settings(max_examples=200, deadline=None)
@given(batches())
def test_ratio_times_behavior_weight_is_full_correction(batch):
    behavior, current, staleness, _, _ = batch
    prox = approximate_proximal_logps(behavior, current, staleness)
    log_r, log_rho = current - prox, prox - behavior
    full = current - behavior
    assert torch.allclose(log_r + log_rho, full, atol=1e-9)
    w = staleness_weight(staleness).to(torch.float64)
    w = w if w.dim() == 2 else w.unsqueeze(1)
    assert torch.allclose(log_r, w * full, atol=1e-9)  # r = (pi_theta / pi_behav) ** w
    assert torch.allclose(log_rho, (1 - w) * full, atol=1e-9)  # rho = (pi_theta / pi_behav) ** (1 - w)
    assert torch.all(log_rho.abs() <= full.abs() + 1e-9)  # contraction


def test_staleness_up_to_one_gives_behavior_policy_exactly():
    behavior = torch.randn(3, 5)
    current = torch.randn(3, 5)
    for d in (0, 1):
        prox = approximate_proximal_logps(behavior, current, torch.full((3,), d))
        assert torch.equal(prox, behavior)


def test_large_staleness_moves_anchor_toward_current():
    behavior, current = torch.zeros(1, 1), torch.ones(1, 1)
    values = [approximate_proximal_logps(behavior, current, torch.tensor([d])).item() for d in (1, 2, 4, 100)]
    assert values == sorted(values) and values[0] == 0.0 and math.isclose(values[-1], 0.99, rel_tol=1e-6)


def test_staleness_shapes_broadcast_the_same():
    behavior, current = torch.randn(2, 4), torch.randn(2, 4)
    d = torch.tensor([3, 1])
    a = approximate_proximal_logps(behavior, current, d)
    b = approximate_proximal_logps(behavior, current, d.unsqueeze(1))
    c = approximate_proximal_logps(behavior, current, d.unsqueeze(1).expand(2, 4))
    assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="per-sequence"):
        approximate_proximal_logps(behavior, current, torch.tensor([1, 2, 3]))


def _coupled_ppo(current, old, advantages, mask, eps_low, eps_high):
    ratio = torch.exp(current - old)
    a = advantages.unsqueeze(1)
    loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    return loss * mask


@settings(max_examples=100, deadline=None)
@given(batches(), st.sampled_from(CAP_MODES))
def test_staleness_at_most_one_reduces_to_coupled_ppo(batch, cap_mode):
    behavior, current, staleness, mask, advantages = batch
    staleness = staleness.clamp(max=1)
    prox = approximate_proximal_logps(behavior, current, staleness)
    loss, stats = decoupled_ppo_loss(current, prox, behavior, advantages, mask, 0.2, 0.28, 5.0, cap_mode)
    expected = _coupled_ppo(current, behavior, advantages, mask, 0.2, 0.28)
    assert torch.allclose(loss, expected, atol=1e-9)
    assert torch.equal(stats["behavior_weight"][mask], torch.ones_like(stats["behavior_weight"][mask]))


def test_gradient_flows_only_through_current_logps():
    behavior = torch.randn(2, 3, requires_grad=True)
    current = torch.randn(2, 3, requires_grad=True)
    prox = approximate_proximal_logps(behavior.detach(), current, torch.tensor([3, 5]))
    assert not prox.requires_grad  # current enters detached
    loss, _ = decoupled_ppo_loss(current, prox, behavior, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    loss.sum().backward()
    assert current.grad is not None and current.grad.abs().sum() > 0
    assert behavior.grad is None  # rho is detached, and behavior only enters through rho


def test_gradient_of_decoupled_loss_matches_closed_form():
    # Unclipped tokens: d/dcur [-A * rho * exp(cur - prox)] = -A * rho * r.
    current = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behavior = torch.tensor([[-1.05, -1.9]])
    staleness = torch.tensor([4])
    prox = approximate_proximal_logps(behavior, current, staleness)
    adv = torch.tensor([0.7])
    loss, stats = decoupled_ppo_loss(current, prox, behavior, adv, torch.ones(1, 2), 0.2, 0.2, None)
    loss.sum().backward()
    expected = -0.7 * stats["behavior_weight"] * stats["ratio"]
    assert torch.allclose(current.grad, expected)


def test_token_mask_drops_tokens_above_cap():
    behavior = torch.tensor([[-5.0, -1.0]])
    current = torch.tensor([[-1.0, -1.0]])
    prox = approximate_proximal_logps(behavior, current, torch.tensor([2]))  # rho_0 = exp(2) > 5
    loss, stats = decoupled_ppo_loss(
        current, prox, behavior, torch.tensor([1.0]), torch.ones(1, 2), cap_mode="token_mask"
    )
    assert stats["keep"].tolist() == [[False, True]]
    assert loss[0, 0] == 0 and loss[0, 1] != 0


def test_token_truncate_clamps_weight():
    rho, keep = behavior_importance_weight(
        torch.tensor([[0.0, 0.0]]), torch.tensor([[-3.0, -0.1]]), torch.ones(1, 2), 5.0, "token_truncate"
    )
    assert keep.all()
    assert torch.allclose(rho, torch.tensor([[5.0, math.exp(0.1)]]))


def test_sequence_modes_use_geometric_mean_over_masked_tokens():
    prox = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    behavior = torch.tensor([[-1.0, -3.0, -100.0], [-0.1, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rho, keep = behavior_importance_weight(prox, behavior, mask, 5.0, "sequence_mask")
    assert torch.allclose(rho[0, :2], torch.full((2,), math.exp(2.0)))  # exp(mean(1, 3)), padding ignored
    assert not keep[0].any() and keep[1].all()
    rho, keep = behavior_importance_weight(prox, behavior, mask, 5.0, "sequence_truncate")
    assert torch.allclose(rho[0, :2], torch.full((2,), 5.0)) and keep[0, :2].all() and not keep[0, 2]


def test_unknown_cap_mode_is_rejected():
    with pytest.raises(ValueError, match="cap mode"):
        behavior_importance_weight(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 5.0, "bogus")


@settings(max_examples=100, deadline=None)
@given(batches(), st.sampled_from(CAP_MODES), st.floats(1.01, 10.0))
def test_loss_finite_and_cap_respected(batch, cap_mode, cap):
    behavior, current, staleness, mask, advantages = batch
    prox = approximate_proximal_logps(behavior, current, staleness)
    loss, stats = decoupled_ppo_loss(current, prox, behavior, advantages, mask, 0.2, 0.2, cap, cap_mode)
    assert torch.isfinite(loss).all()
    kept_rho = stats["behavior_weight"][stats["keep"]]
    assert torch.all(kept_rho <= cap + 1e-9)
    assert not (stats["keep"] & ~mask).any()
    assert torch.all(loss[~stats["keep"]] == 0)


def test_nonfinite_behavior_logps_are_masked_and_counted():
    current = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    behavior = torch.tensor([[float("-inf"), float("nan"), -0.4]])
    prox = approximate_proximal_logps(behavior, current, torch.tensor([3]))
    loss, stats = decoupled_ppo_loss(current, prox, behavior, torch.tensor([1.0]), torch.ones(1, 3))
    assert torch.isfinite(loss).all()
    assert stats["nonfinite_behavior"].tolist() == [[True, True, False]]
    assert stats["keep"].tolist() == [[False, False, True]]
    loss.sum().backward()
    assert torch.isfinite(current.grad).all()


@settings(max_examples=100, deadline=None)
@given(batches(), st.lists(st.floats(0.05, 1.0), min_size=24, max_size=24), st.sampled_from(CAP_MODES))
def test_truncated_sampling_keeps_on_policy_ratios_at_one_and_weights_by_the_kept_mass(batch, masses, cap_mode):
    """A sampler that kept mass m of the policy's distribution (top-p, top-k, min-p) gives the sampled token the
    log-prob logp - log m. On-policy, the trust-region ratio must stay 1 and the kept mass go to the behavior weight
    (GRPOTrainer's ratio and its vLLM importance weight); anchoring at the sampling log-probs instead makes the ratio
    m, so that at m < 0.8 every negative-advantage token is clipped away."""
    policy, _, _, mask, advantages = batch
    b, t = policy.shape
    kept_mass = torch.tensor(masses[: b * t], dtype=torch.float64).view(b, t)
    sampling = policy - kept_mass.log()
    current = policy.clone().requires_grad_(True)  # the weights that generated the tokens: staleness 0
    staleness = torch.zeros(b, dtype=torch.long)
    prox = approximate_proximal_logps(policy, current, staleness)
    _, stats = decoupled_ppo_loss(
        current, prox, policy, advantages, mask, behavior_weight_cap=None, cap_mode=cap_mode, sampling_logps=sampling
    )
    assert torch.allclose(stats["ratio"], torch.ones_like(stats["ratio"]))
    assert not (stats["is_low_clipped"] | stats["is_high_clipped"]).any()
    if cap_mode.startswith("token"):
        assert torch.allclose(stats["behavior_weight"][mask], kept_mass[mask])
    # Without the sampling log-probs the sampler's distribution is taken for the policy: the on-policy ratio is m.
    wrong_prox = approximate_proximal_logps(sampling, current, staleness)
    _, wrong = decoupled_ppo_loss(current, wrong_prox, sampling, advantages, mask, behavior_weight_cap=None)
    assert torch.allclose(wrong["ratio"], kept_mass)


def test_aggregate_loss_types():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert torch.isclose(aggregate_loss(per_token, mask, "grpo"), torch.tensor((2.0 + 4.0) / 2))
    assert torch.isclose(
        aggregate_loss(per_token, mask, "bnpo", gradient_accumulation_steps=2), torch.tensor(10 / 4 / 2)
    )
    assert torch.isclose(aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=5), torch.tensor(10 / 10))
    dapo = aggregate_loss(
        per_token,
        mask,
        "dapo",
        num_items_in_batch=torch.tensor(8.0),
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_processes=2,
    )
    assert torch.isclose(dapo, torch.tensor(10 / (8 / 2 * 2 / 2)))
    assert torch.isclose(aggregate_loss(per_token, mask, "sapo"), aggregate_loss(per_token, mask, "grpo"))
    luspo = aggregate_loss(per_token, mask, "luspo", gradient_accumulation_steps=2)
    assert torch.isclose(luspo, torch.tensor((6.0 + 4.0) / 2 / 2))  # sequence sums, their mean
    for loss_type in ("cispo", "vespo"):
        same = aggregate_loss(per_token, mask, loss_type, num_items_in_batch=torch.tensor(8.0))
        assert torch.isclose(same, aggregate_loss(per_token, mask, "dapo", num_items_in_batch=torch.tensor(8.0)))
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_loss(per_token, mask, "ppo")
    with pytest.raises(ValueError, match="num_items_in_batch"):
        aggregate_loss(per_token, mask, "dapo")


def test_approximation_error_is_zero_for_exact_estimate():
    exact = torch.randn(2, 3)
    behavior = torch.randn(2, 3)
    errors = proximal_approximation_error(exact, exact, behavior, torch.ones(2, 3))
    assert all(v.item() == 0 for v in errors.values())
    errors = proximal_approximation_error(exact + 0.1, exact, behavior, torch.ones(2, 3))
    assert math.isclose(errors["logp_abs_error"].item(), 0.1, rel_tol=1e-5)


def _std(values):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_group_scaling_normalises_within_each_group():
    rewards = torch.tensor([[1.0], [0.0], [3.0], [3.0]])
    advantages, total, is_std_zero = group_advantages(rewards, torch.ones(1), num_generations=2)
    assert torch.allclose(advantages[:2], torch.tensor([0.5, -0.5]) / (_std([1.0, 0.0]) + 1e-4))
    assert advantages[2:].tolist() == [0.0, 0.0]
    assert is_std_zero.tolist() == [False, False, True, True]
    assert total.tolist() == [1.0, 0.0, 3.0, 3.0]


def test_batch_and_no_scaling():
    rewards = torch.tensor([[1.0], [0.0], [3.0], [5.0]])
    adv_none, _, _ = group_advantages(rewards, torch.ones(1), 2, scale_rewards="none")
    assert adv_none.tolist() == [0.5, -0.5, -1.0, 1.0]
    adv_batch, _, _ = group_advantages(rewards, torch.ones(1), 2, scale_rewards="batch")
    assert torch.allclose(adv_batch, adv_none / (_std([1.0, 0.0, 3.0, 5.0]) + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, torch.ones(1), 2, scale_rewards="sometimes")


def test_weights_nan_rows_and_normalize_then_sum():
    rewards = torch.tensor([[1.0, float("nan")], [0.0, 2.0], [float("nan"), float("nan")], [1.0, 1.0]])
    weights = torch.tensor([2.0, 0.5])
    adv, total, _ = group_advantages(rewards, weights, 2, scale_rewards="none")
    assert total[0] == 2.0 and total[1] == 1.0 and math.isnan(total[2]) and total[3] == 2.5
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]  # the unscorable row gets 0 and is left out of its group's mean
    adv2, _, _ = group_advantages(rewards, weights, 2, aggregation="normalize_then_sum")
    assert torch.isfinite(adv2).all() and adv2[2] == 0.0
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(rewards[:3], weights, 2)
