"""The proximal methods' table (a3po_trl/losses.py): one entry per option, and when ``recompute`` pays a forward."""

import pytest

from a3po_trl import PROXIMAL_METHODS
from a3po_trl.losses import PROXIMAL_METHOD_TABLE, needs_recompute_forward


def test_every_proximal_method_has_an_entry():
    assert tuple(PROXIMAL_METHOD_TABLE) == PROXIMAL_METHODS


@pytest.mark.parametrize("method", PROXIMAL_METHODS)
def test_only_a_batch_trained_over_several_versions_pays_a_recompute_forward(method):
    assert not needs_recompute_forward(method, versions_training_batch=1)
    assert needs_recompute_forward(method, versions_training_batch=2) == (method in ("recompute", "metrics"))
