"""The oracle study's estimators (benchmarks/common/anchor_estimators.py) on synthetic log-probs whose answer is
known."""

import numpy as np

from benchmarks.common.anchor_estimators import (
    absolute_errors,
    causal_weights,
    estimates,
    fixed_weight,
    scored_tokens,
    shrunk_least_squares,
)


def _tokens(step_changes, staleness, batches):
    """Tokens whose log-prob moves by ``step_changes[i, j]`` at the j-th step back from the trained weights:
    current = 0, exact target (one version back) = -change_1, behavior (d back) = -sum of the d changes."""
    current = np.zeros(len(staleness), dtype=np.float32)
    exact = -step_changes[:, 0]
    behavior = -np.array([step_changes[i, :d].sum() for i, d in enumerate(staleness)])
    return {
        "behavior": behavior.astype(np.float32),
        "current": current,
        "exact": exact.astype(np.float32),
        "staleness": np.asarray(staleness, dtype=np.int16),
        "batch": np.asarray(batches, dtype=np.int32),
        "age": np.zeros(len(staleness), dtype=np.int16),
        "step": np.asarray(batches, dtype=np.int32),
    }


def test_log_probs_linear_in_the_version_make_the_fixed_weight_exact_and_the_fit_find_it():
    rng = np.random.default_rng(0)
    n = 400
    per_step = rng.normal(size=(n, 1)) * 0.1
    tokens = _tokens(np.repeat(per_step, 6, axis=1), rng.integers(2, 6, size=n), np.repeat(np.arange(8), n // 8))
    errors = absolute_errors(tokens)
    scored = scored_tokens(tokens)
    assert errors["fixed"][scored].max() < 1e-6
    assert errors["fitted_d"][scored].max() < 1e-5  # the fit recovers 1/d
    assert errors["current"][scored].mean() > 0.05  # and anchoring at an end does not


def test_independent_steps_leave_the_fixed_weight_optimal_and_an_error_no_weight_removes():
    rng = np.random.default_rng(1)
    n = 20000
    staleness = np.full(n, 4)
    tokens = _tokens(rng.normal(size=(n, 4)) * 0.1, staleness, np.repeat(np.arange(10), n // 10))
    weights = causal_weights(tokens, lambda t: t["staleness"])
    later = tokens["batch"] >= 2
    assert np.allclose(weights[later], 0.25, atol=0.02)  # 1/d is the least-squares weight
    errors = absolute_errors(tokens)
    scored = scored_tokens(tokens)
    ratio = errors["fixed"][scored].mean() / errors["current"][scored].mean()
    assert abs(ratio - np.sqrt(3 / 4)) < 0.03  # sqrt((d - 1) / d) of a step's drift, whatever the weight


def test_the_fit_is_causal_and_shrunk_toward_one_over_d():
    rng = np.random.default_rng(2)
    n = 200
    # the first batch's steps are twice as large as the last: a fit on it alone would want another weight
    changes = np.concatenate([np.tile([[0.2, 0.1]], (n, 1)), np.tile([[0.1, 0.1]], (n, 1))])
    tokens = _tokens(changes * rng.choice([-1, 1], size=(2 * n, 1)), [2] * (2 * n), [0] * n + [1] * n)
    weights = causal_weights(tokens, lambda t: t["staleness"])
    assert np.all(weights[:n] == fixed_weight(np.array([2]))[0])  # nothing earlier: 1/d
    sum_xy, sum_xx = float(n * 0.3 * 0.2), float(n * 0.3 * 0.3)  # from batch 0 only
    assert np.allclose(weights[n:], shrunk_least_squares(sum_xy, sum_xx, n, 0.5, 32.0), atol=1e-5)
    assert shrunk_least_squares(sum_xy, sum_xx, n, 0.5, 0.0) == sum_xy / sum_xx
    assert shrunk_least_squares(0.0, 0.0, 0, 0.5, 32.0) == 0.5


def test_the_study_s_per_batch_relative_errors_count_the_tokens_the_guard_s_check_counts():
    """One definition for both: the per-batch relative errors that set the guard's defaults are the check's own
    measure, over staleness >= 1 (at 1, the generator's numerics), not the estimators' staleness >= 2."""
    from benchmarks.common.oracle_summary import batch_check_sums, batch_relative_errors

    # batch 0 (left out, as the first batch); batch 1: a staleness-2 token moving 1 then 1 (fixed weight exact:
    # error 0, drift 1) and a staleness-1 token whose behavior log-prob is off by 0.5 (error 0.5, drift 1)
    changes = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    tokens = _tokens(changes, staleness=[2, 2, 1], batches=[0, 1, 1])
    tokens["behavior"][2] += 0.5
    sums = batch_check_sums(tokens, estimates(tokens)["fixed"])
    assert sums.tolist() == [[0.5, 2.0, 2.0]]
    assert batch_relative_errors({0: {"checks": sums}}) == [[0.25]]
    # a batch whose step moved nothing has no verdict, as in the guard
    assert batch_relative_errors({0: {"checks": np.array([[0.5, 0.0, 2.0]])}}) == [[]]
