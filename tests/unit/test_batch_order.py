"""The order of a generation batch's rows kept with a checkpoint (a3po_trl/checkpoints/batch_order.py)."""

import pytest
import torch

from a3po_trl.checkpoints.batch_order import load_batch_order, permute_rows, save_batch_order


def test_the_saved_order_is_found_only_for_its_own_batch(tmp_path):
    save_batch_order(str(tmp_path), 1, {"epoch": 2, "index_in_epoch": 3, "permutation": [2, 0, 1]})
    assert load_batch_order(str(tmp_path), 1, 2, 3, rows=3).tolist() == [2, 0, 1]
    assert load_batch_order(str(tmp_path), 1, 2, 4, rows=3) is None  # the checkpoint ended another batch
    assert load_batch_order(str(tmp_path), 0, 2, 3, rows=3) is None  # another process's order
    assert load_batch_order(None, 1, 2, 3, rows=3) is None
    with pytest.raises(ValueError, match="other batch settings.*steps_per_generation"):
        load_batch_order(str(tmp_path), 1, 2, 3, rows=4)


def test_rows_are_permuted_as_trl_shuffles_them():
    batch = {"ids": torch.arange(6).reshape(3, 2), "texts": ["a", "b", "c"], "count": torch.tensor(7), "none": None}
    permuted = permute_rows(batch, torch.tensor([2, 0, 1]))
    assert permuted["ids"].tolist() == [[4, 5], [0, 1], [2, 3]]
    assert permuted["texts"] == ["c", "a", "b"] and permuted["count"] == 7 and permuted["none"] is None
