"""The proximal methods and what each computes: one entry per option of ``prox_logp_method``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProximalMethod:
    """What one ``prox_logp_method`` computes."""

    anchor: str
    """The proximal log-probs the loss trains with: ``"loglinear"`` (A-3PO's interpolation between the behavior and
    the current log-probs), ``"current"`` (the log-probs of the weights of the batch's first optimizer step: the
    training forward's own where those weights train the micro-batch, else a recompute forward's) or ``"behavior"``
    (the behavior log-probs themselves: no proximal policy, no behavior weight)."""
    interpolates: bool
    """Whether the log-linear estimate is computed (trained with, or measured against the ``"current"`` anchor)."""


PROXIMAL_METHOD_TABLE = {
    "loglinear": ProximalMethod(anchor="loglinear", interpolates=True),
    "recompute": ProximalMethod(anchor="current", interpolates=False),
    "metrics": ProximalMethod(anchor="current", interpolates=True),
    "behavior": ProximalMethod(anchor="behavior", interpolates=False),
    # ``guarded`` is one of the two, batch by batch (``batch_method``): the interpolation is always computed, for
    # the checks
    "guarded-loglinear": ProximalMethod(anchor="loglinear", interpolates=True),
    "guarded-recompute": ProximalMethod(anchor="current", interpolates=True),
}
"""``prox_logp_method`` -> what it computes (one entry per option of :data:`a3po_trl.PROXIMAL_METHODS`; ``guarded``
through :func:`batch_method`)."""


def batch_method(prox_logp_method: str, recompute: bool = False) -> str:
    """The entry of :data:`PROXIMAL_METHOD_TABLE` a batch trains with: ``prox_logp_method``, except under
    ``guarded``, where the guard chose for it (``recompute``: the recomputed anchor)."""
    if prox_logp_method != "guarded":
        return prox_logp_method
    return "guarded-recompute" if recompute else "guarded-loglinear"


def needs_recompute_forward(method: str, versions_training_batch: int) -> bool:
    """Whether ``method`` needs a no-grad forward when a batch is taken: it anchors at the weights of the batch's
    first optimizer step, and ``versions_training_batch`` (the number of weight versions its micro-steps train with,
    :attr:`PlannedBatch.whole_span <a3po_trl.generation.schedule.PlannedBatch.whole_span>`, the run's end
    notwithstanding) says later micro-steps train newer weights, whose own forward is not that anchor."""
    return PROXIMAL_METHOD_TABLE[method].anchor == "current" and versions_training_batch > 1
