"""The check of A-3PO's interpolation as pure functions: what it sums over which tokens, and its verdict."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po_trl.functional import approximate_proximal_logps, interpolation_check_sums, interpolation_check_verdict

logps = st.floats(min_value=-12.0, max_value=0.0, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=1, max_value=3),
    st.integers(min_value=1, max_value=6),
    st.data(),
)
def test_the_sums_are_the_errors_and_drifts_of_the_masked_stale_finite_tokens(rows, columns, data):
    shape = (rows, columns)

    def tensor(strategy):
        return torch.tensor(data.draw(st.lists(strategy, min_size=rows * columns, max_size=rows * columns))).view(
            shape
        )

    behavior, current, exact = tensor(logps), tensor(logps), tensor(logps)
    staleness = tensor(st.integers(min_value=0, max_value=5))
    mask = tensor(st.booleans())
    loglinear = approximate_proximal_logps(behavior, current, staleness)
    sums = interpolation_check_sums(loglinear, current, exact, staleness, mask)
    error = drift = count = 0.0
    for i in range(rows):
        for j in range(columns):
            if mask[i, j] and staleness[i, j] >= 1:
                error += abs(float(loglinear[i, j]) - float(exact[i, j]))
                drift += abs(float(current[i, j]) - float(exact[i, j]))
                count += 1
    assert sums.dtype == torch.float64 and sums.shape == (3,)
    assert math.isclose(float(sums[0]), error, abs_tol=1e-5)
    assert math.isclose(float(sums[1]), drift, abs_tol=1e-5)
    assert float(sums[2]) == count


def test_on_policy_and_nonfinite_tokens_are_left_out():
    current = torch.tensor([[-1.0, -1.0, -1.0]])
    exact = torch.tensor([[-1.5, -1.5, -1.5]])
    behavior = torch.tensor([[-2.0, -float("inf"), -2.0]])
    staleness = torch.tensor([[0, 2, 2]])
    loglinear = approximate_proximal_logps(behavior, current, staleness)
    sums = interpolation_check_sums(loglinear, current, exact, staleness, torch.ones(1, 3, dtype=torch.bool))
    # only the third token: interpolation -1.5 (exact), drift 0.5
    assert sums.tolist() == [0.0, 0.5, 1.0]


def test_at_one_version_old_the_error_is_the_generators_numerics():
    """At ``d = 1`` the interpolation is the behavior log-prob: the check measures it against the trainer's forward
    of the same version, the generator's numerics (a bf16 engine's mismatch, say)."""
    behavior, exact, current = torch.tensor([[-2.0]]), torch.tensor([[-2.25]]), torch.tensor([[-1.0]])
    loglinear = approximate_proximal_logps(behavior, current, torch.tensor([[1]]))
    sums = interpolation_check_sums(loglinear, current, exact, torch.tensor([[1]]), torch.ones(1, 1))
    assert sums.tolist() == [0.25, 1.25, 1.0]


def test_the_verdict_is_the_error_over_the_drift_against_the_budget():
    assert interpolation_check_verdict([3.0, 6.0, 10.0], budget=1.0) == (0.3, 0.5, False)
    assert interpolation_check_verdict([6.0, 3.0, 10.0], budget=1.0) == (0.6, 2.0, True)
    assert interpolation_check_verdict([6.0, 3.0, 10.0], budget=2.0) == (0.6, 2.0, False)  # at the budget: accepted
    assert interpolation_check_verdict([0.0, 0.0, 0.0], budget=1.0) == (None, None, None)  # nothing measured


@settings(max_examples=40, deadline=None)
@given(st.floats(min_value=0.0, max_value=1e6), st.integers(min_value=1, max_value=10**6), st.floats(1e-3, 1e12))
def test_a_step_that_moved_no_token_decides_nothing_whatever_the_budget(error_sum, count, budget):
    """Drift 0 (advantages all 0, a learning rate of 0): the error is reported in nats, with no relative error and
    no verdict, never an infinite relative error that exceeds every budget."""
    error, relative, exceeds = interpolation_check_verdict([error_sum, 0.0, float(count)], budget=budget)
    assert math.isclose(error, error_sum / count) and relative is None and exceeds is None
