"""The recomputed proximal anchor kept with a checkpoint inside a batch (a3po_trl/proximal/recomputed_anchor.py):
written only inside a batch that carries one, attached again only to the same batch's same sequences."""

import logging
from types import SimpleNamespace

import torch

from a3po_trl.builders import RunPlan
from a3po_trl.generation.schedule import MicroStep, PlannedBatch
from a3po_trl.proximal import ProximalAnchor
from a3po_trl.proximal.recomputed_anchor import inside_a_batch, restore_recomputed_anchor, save_recomputed_anchor

#: Two micro-steps per generation batch, one optimizer step each: batch 0 trains versions 0 and 1, batch 1 2 and 3.
PLAN = RunPlan([MicroStep(0, position, position) for position in range(4)], [], micro_steps_per_batch=2)


def _micro_batches(completion_offset=0, anchored=True):
    batches = []
    for i in range(2):
        batch = {
            "prompt_ids": torch.full((2, 3), i),
            "prompt_mask": torch.ones(2, 3, dtype=torch.long),
            "completion_ids": torch.arange(8).reshape(2, 4) + i + completion_offset,
            "completion_mask": torch.ones(2, 4, dtype=torch.long),
        }
        if anchored:
            batch["recomputed_proximal_logps"] = torch.randn(2, 4)
            batch["recompute_version"] = torch.full((2,), 2)
        batches.append(batch)
    return batches


def _trainer(directory, micro_batches=None, micro_steps_done=3, method="recompute"):
    accelerator = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True, device="cpu")
    return SimpleNamespace(
        proximal_anchor=ProximalAnchor(method),
        accelerator=accelerator,
        checkpoint=str(directory),
        _buffered_inputs=micro_batches,
        _batch_order={"epoch": 0, "index_in_epoch": 1, "permutation": [0, 1, 2, 3]},
        _plan=PLAN,
        _step=micro_steps_done,
        _run_start_step=0,
    )


def _restore(trainer, planned, micro_batches):
    return restore_recomputed_anchor(trainer, trainer.checkpoint, planned, micro_batches)


def _resumed_batch(index_in_epoch=1, first_offset=1):
    return PlannedBatch(0, index_in_epoch, first_offset, micro_steps=1, first_version=3, last_version=3)


def test_inside_a_batch_is_between_two_micro_steps_of_one_batch_or_at_a_run_end_that_cuts_one_short():
    assert [inside_a_batch(PLAN, done) for done in range(5)] == [False, True, False, True, False]
    cut_short = RunPlan(PLAN.micro_steps[:3], [], micro_steps_per_batch=2)
    assert inside_a_batch(cut_short, 3)  # a run continued with a larger max_steps goes on inside batch 1
    assert not inside_a_batch(None, 1)


def test_only_a_checkpoint_inside_a_batch_that_carries_an_anchor_keeps_it(tmp_path):
    assert not save_recomputed_anchor(_trainer(tmp_path, _micro_batches(), micro_steps_done=2), str(tmp_path))
    assert not save_recomputed_anchor(_trainer(tmp_path, _micro_batches(anchored=False)), str(tmp_path))
    assert not any(tmp_path.iterdir())
    assert save_recomputed_anchor(_trainer(tmp_path, _micro_batches()), str(tmp_path))
    assert (tmp_path / "a3po_recomputed_anchor-rank0.pt").exists()


def test_the_kept_anchor_is_attached_to_the_same_sequences_of_the_same_batch(tmp_path):
    kept = _micro_batches()
    save_recomputed_anchor(_trainer(tmp_path, kept), str(tmp_path))
    regenerated = _micro_batches(anchored=False)
    assert _restore(_trainer(tmp_path), _resumed_batch(), regenerated)
    for batch, original in zip(regenerated, kept):
        assert torch.equal(batch["recomputed_proximal_logps"], original["recomputed_proximal_logps"])
        assert batch["recompute_version"].tolist() == [2, 2]


def test_the_kept_anchor_is_not_attached_where_it_does_not_belong(tmp_path, caplog):
    save_recomputed_anchor(_trainer(tmp_path, _micro_batches()), str(tmp_path))
    not_resumed_inside = _micro_batches(anchored=False)
    assert not _restore(_trainer(tmp_path), _resumed_batch(first_offset=0), not_resumed_inside)
    interpolating = _micro_batches(anchored=False)
    assert not _restore(_trainer(tmp_path, method="loglinear"), _resumed_batch(), interpolating)
    assert not caplog.records  # neither needs the anchor: nothing to say
    with caplog.at_level(logging.WARNING):
        generated_anew = _micro_batches(completion_offset=1, anchored=False)
        assert not _restore(_trainer(tmp_path), _resumed_batch(), generated_anew)
        assert "generated anew" in caplog.text and "reproducible_generation=False" in caplog.text
        another_batch = _micro_batches(anchored=False)
        assert not _restore(_trainer(tmp_path), _resumed_batch(index_in_epoch=2), another_batch)
        assert not _restore(_trainer(tmp_path / "elsewhere"), _resumed_batch(), another_batch)
        assert "holds no recomputed anchor" in caplog.text
    for batch in not_resumed_inside + interpolating + generated_anew + another_batch:
        assert "recomputed_proximal_logps" not in batch
