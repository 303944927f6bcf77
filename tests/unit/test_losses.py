"""The proximal methods' table (a3po_trl/proximal/methods.py): one entry per option, and when ``recompute`` pays a
forward."""

import pytest

from a3po_trl import PROXIMAL_METHODS
from a3po_trl.proximal import PROXIMAL_METHOD_TABLE, batch_method, needs_recompute_forward


def test_every_proximal_method_resolves_to_an_entry_and_every_entry_is_reached():
    reached = {batch_method(method) for method in PROXIMAL_METHODS}
    reached |= {batch_method("guarded", recompute=flag) for flag in (False, True)}
    assert reached == set(PROXIMAL_METHOD_TABLE)


def test_a_guarded_batch_trains_with_the_anchor_its_guard_chose():
    assert batch_method("guarded", recompute=True) == "guarded-recompute"
    assert batch_method("guarded", recompute=False) == "guarded-loglinear"
    assert PROXIMAL_METHOD_TABLE["guarded-recompute"].anchor == PROXIMAL_METHOD_TABLE["recompute"].anchor
    assert PROXIMAL_METHOD_TABLE["guarded-loglinear"] == PROXIMAL_METHOD_TABLE["loglinear"]
    assert all(PROXIMAL_METHOD_TABLE[f"guarded-{anchor}"].interpolates for anchor in ("loglinear", "recompute"))


@pytest.mark.parametrize("method", sorted(PROXIMAL_METHOD_TABLE))
def test_only_a_batch_trained_over_several_versions_pays_a_recompute_forward(method):
    assert not needs_recompute_forward(method, versions_training_batch=1)
    expected = method in ("recompute", "metrics", "guarded-recompute")
    assert needs_recompute_forward(method, versions_training_batch=2) == expected
