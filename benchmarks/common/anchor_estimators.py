"""Estimators of the proximal anchor, scored against its exact value: the oracle study's arithmetic, pure numpy.

Every estimator here estimates, for each token, the log-prob ``t`` of the version one before the trained weights (the
target of A-3PO's interpolation, :mod:`a3po_trl.proximal.previous_weights`) from what the loss has without an extra
forward: the behavior log-prob ``b`` (version ``v - d``), the current one ``c`` (version ``v``) and the token's
staleness ``d``, plus, for the fitted ones, the tokens of *earlier* batches of the same run whose ``t`` was computed (a
causal fit: what a run that checked every batch would have known when it trained this one).

With ``x = b - c`` and ``y = t - c``, an interpolation with weight ``w`` on the behavior log-prob estimates
``c + w x``; its least-squares weight over a set of tokens is ``sum(x y) / sum(x x)``, and shrunk toward a prior
weight ``w0`` with the strength of ``prior_tokens`` tokens of the set's mean ``x x``:
``(sum(x y) + lam w0) / (sum(x x) + lam)``, ``lam = prior_tokens * mean(x x)``.

The tokens a fitted weight applies to: ``d >= 2`` (at ``d <= 1`` every estimator here is the behavior log-prob,
which is the target version's own up to the generator's numerics at ``d = 1``).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable

import numpy as np

#: Per-token arrays a record keeps, and their dtypes.
TOKEN_FIELDS = {
    "step": np.int32,
    "batch": np.int32,
    "age": np.int16,
    "staleness": np.int16,
    "behavior": np.float32,
    "current": np.float32,
    "exact": np.float32,
}


def encode_tokens(tokens: dict[str, np.ndarray]) -> str:
    """The per-token arrays as a base64 ``.npz`` (compressed), for a JSON record."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **tokens)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_tokens(text: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(base64.b64decode(text))) as arrays:
        return {name: arrays[name] for name in arrays.files}


#: Weight of the prior ``1/d`` in the fitted estimators, in tokens (see the module's docstring).
PRIOR_TOKENS = 32.0


def fixed_weight(staleness: np.ndarray) -> np.ndarray:
    """A-3PO's weight on the behavior log-prob, ``1 / max(d, 1)``."""
    return 1.0 / np.maximum(staleness, 1).astype(np.float64)


def shrunk_least_squares(sum_xy: float, sum_xx: float, count: int, prior: float, prior_tokens: float) -> float:
    """The least-squares weight of ``count`` tokens with sums ``sum_xy``, ``sum_xx``, shrunk toward ``prior``."""
    if count == 0 or sum_xx <= 0.0:
        return prior
    strength = prior_tokens * sum_xx / count
    return (sum_xy + strength * prior) / (sum_xx + strength)


def causal_weights(
    tokens: dict[str, np.ndarray],
    key: Callable[[dict[str, np.ndarray]], np.ndarray],
    prior_tokens: float = PRIOR_TOKENS,
) -> np.ndarray:
    """Per token, the weight fitted on the tokens of earlier batches with the same ``key`` (e.g. the staleness, or
    the staleness and the anchor's age), shrunk toward ``1/d``; ``1/d`` where no earlier batch has the key. Tokens of
    ``d <= 1`` keep ``1``."""
    staleness, batches = tokens["staleness"], tokens["batch"]
    x = tokens["behavior"].astype(np.float64) - tokens["current"]
    y = tokens["exact"].astype(np.float64) - tokens["current"]
    keys = key(tokens)
    weights = fixed_weight(staleness)
    sums: dict = {}
    for batch in np.unique(batches):  # in order: a batch is fitted on the batches before it
        in_batch = batches == batch
        for value in np.unique(keys[in_batch & (staleness >= 2)]):
            sum_xy, sum_xx, count = sums.get(value, (0.0, 0.0, 0))
            chosen = in_batch & (keys == value)
            prior = float(fixed_weight(staleness[chosen][:1])[0])
            weights[chosen] = shrunk_least_squares(sum_xy, sum_xx, count, prior, prior_tokens)
        for value in np.unique(keys[in_batch & (staleness >= 2)]):
            chosen = in_batch & (keys == value) & (staleness >= 2)
            sum_xy, sum_xx, count = sums.get(value, (0.0, 0.0, 0))
            sums[value] = (
                sum_xy + float(x[chosen] @ y[chosen]),
                sum_xx + float(x[chosen] @ x[chosen]),
                count + int(chosen.sum()),
            )
    return weights


def in_sample_weights(tokens: dict[str, np.ndarray]) -> np.ndarray:
    """Per token, the least-squares weight of all tokens of its staleness in the whole run (not causal: the best any
    single weight per staleness could do, a bound, not an estimator a run could use)."""
    staleness = tokens["staleness"]
    x = tokens["behavior"].astype(np.float64) - tokens["current"]
    y = tokens["exact"].astype(np.float64) - tokens["current"]
    weights = fixed_weight(staleness)
    for value in np.unique(staleness[staleness >= 2]):
        chosen = staleness == value
        weights[chosen] = shrunk_least_squares(float(x[chosen] @ y[chosen]), float(x[chosen] @ x[chosen]), 1, 0.0, 0.0)
    return weights


def log_linear(tokens: dict[str, np.ndarray], weights: np.ndarray) -> np.ndarray:
    """``w b + (1 - w) c``: the interpolation in log-prob space with per-token weights."""
    return weights * tokens["behavior"] + (1.0 - weights) * tokens["current"]


def probability_space(tokens: dict[str, np.ndarray], weights: np.ndarray) -> np.ndarray:
    """``log(w p_b + (1 - w) p_c)``: the interpolation of the probabilities instead of their logarithms."""
    with np.errstate(divide="ignore"):
        return np.logaddexp(np.log(weights) + tokens["behavior"], np.log1p(-weights) + tokens["current"])


def estimates(tokens: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every estimator of the study, per token (float64):

    - ``fixed``: A-3PO, ``w = 1/d``;
    - ``fitted_d``: the weight per staleness fitted causally (the issue's estimator (b));
    - ``fitted_d_age``: the weight per staleness and anchor age fitted causally;
    - ``probability``: ``w = 1/d`` on the probabilities;
    - ``behavior`` and ``current``: anchoring at either end (``w = 1``, ``w = 0``), the scale of the problem;
    - ``in_sample_d``: the best single weight per staleness over the whole run (a bound, not causal).
    """
    staleness = tokens["staleness"]
    fixed = fixed_weight(staleness)
    return {
        "fixed": log_linear(tokens, fixed),
        "fitted_d": log_linear(tokens, causal_weights(tokens, lambda t: t["staleness"])),
        "fitted_d_age": log_linear(tokens, causal_weights(tokens, lambda t: t["staleness"] * 1000 + t["age"])),
        "probability": probability_space(tokens, fixed),
        "behavior": tokens["behavior"].astype(np.float64),
        "current": tokens["current"].astype(np.float64),
        "in_sample_d": log_linear(tokens, in_sample_weights(tokens)),
    }


ESTIMATORS = ("fixed", "fitted_d", "fitted_d_age", "probability", "behavior", "current", "in_sample_d")


def scored_tokens(tokens: dict[str, np.ndarray], first_batch: int | None = None) -> np.ndarray:
    """The tokens the study scores: staleness >= 2 (where the estimators differ), outside the run's first batch
    (``first_batch``: the smallest batch index, by default), which the weights it starts from generated."""
    first = tokens["batch"].min() if first_batch is None else first_batch
    return (tokens["staleness"] >= 2) & (tokens["batch"] != first)


def absolute_errors(tokens: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``|estimate - exact|`` per token, every estimator, float64."""
    exact = tokens["exact"].astype(np.float64)
    return {name: np.abs(value - exact) for name, value in estimates(tokens).items()}
