"""The generator-mismatch metric with in-flight weight updates: tokens sampled after a version switch within their
turn (over a KV cache older weights computed) are measured apart from the generator's numerics."""

from types import SimpleNamespace

import pytest
import torch

from a3po_trl.metrics.loss import behavior_mismatch_metrics, sampled_after_a_switch

#: One process: every reduction is the identity.
ONE_PROCESS = SimpleNamespace(reduce=lambda tensor, reduction: tensor)


def _switched_batch():
    """Two completions trained at version 3: the first switches from version 2 to 3 after its second token, the
    second is all version 3 and one token shorter (-1: padding)."""
    versions = torch.tensor([[2, 2, 3, 3], [3, 3, 3, -1]])
    mask = (versions >= 0).long()
    staleness = torch.where(versions >= 0, 3 - versions, 0)
    current = torch.zeros(2, 4)
    # the generator's numerics: 0.01 nats on every token; the mixed cache: 0.5 more on the tokens after the switch
    behavior = torch.tensor([[0.01, 0.01, 0.51, 0.52], [0.01, 0.02, 0.01, 0.0]])
    return current, behavior, mask, staleness, versions


def test_tokens_after_a_switch_are_those_of_a_later_version_than_their_turns_first():
    # a completion switching twice; two turns, the second generated afresh by version 6 (tool result: -1) and
    # switching to 7; no switch
    versions = torch.tensor([[2, 2, 3, 4, -1, -1], [5, 5, -1, 6, 6, 7], [1, 1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]]).bool()
    assert torch.equal(sampled_after_a_switch(versions), expected)  # tool results and padding (-1) never are
    assert not sampled_after_a_switch(torch.tensor([1, 2])).any()  # one version per completion


def test_the_mismatch_leaves_out_the_tokens_after_a_switch_and_the_after_switch_metric_sees_them():
    current, behavior, mask, staleness, versions = _switched_batch()
    values = behavior_mismatch_metrics(ONE_PROCESS, current, behavior, mask, staleness, versions)
    # staleness 0 outside the switch: the second completion only (the first's version-2 tokens are stale)
    assert values["a3po/behavior_mismatch_mean"].item() == pytest.approx((0.01 + 0.02 + 0.01) / 3)
    assert values["a3po/behavior_mismatch_max"].item() == pytest.approx(0.02)
    assert values["a3po/behavior_mismatch_after_switch_mean"].item() == pytest.approx((0.51 + 0.52) / 2)
    assert values["a3po/behavior_mismatch_after_switch_max"].item() == pytest.approx(0.52)

    # without per-token versions (in-flight updates off) every staleness-0 token counts, and nothing else is logged
    plain = behavior_mismatch_metrics(ONE_PROCESS, current, behavior, mask, staleness)
    assert set(plain) == {"a3po/behavior_mismatch_mean", "a3po/behavior_mismatch_max"}
    assert plain["a3po/behavior_mismatch_mean"].item() == pytest.approx((0.51 + 0.52 + 0.01 + 0.02 + 0.01) / 5)
    assert plain["a3po/behavior_mismatch_max"].item() == pytest.approx(0.52)


def test_a_batch_without_a_switch_has_no_after_switch_value():
    current, behavior, mask, staleness, _ = _switched_batch()
    versions = torch.tensor([[3, 3, 3, 3], [3, 3, 3, -1]])
    staleness = torch.zeros_like(versions)
    values = behavior_mismatch_metrics(ONE_PROCESS, current, behavior, mask, staleness, versions)
    assert values["a3po/behavior_mismatch_after_switch_mean"].isnan()
    assert values["a3po/behavior_mismatch_after_switch_max"].isnan()
    assert values["a3po/behavior_mismatch_max"].item() == pytest.approx(0.52)
