"""Resuming runs as a cluster scheduler does: a finished run started again with ``resume_from_checkpoint=True``
exits cleanly, and a run interrupted after a checkpoint trains every prompt exactly as the uninterrupted run does."""

from __future__ import annotations

import logging
import os

import pytest
from helpers import StopAt, logged_after, make_trainer
from tiny import make_model, make_prompts


def _checkpoints(tmp_path):
    return sorted(name for name in os.listdir(tmp_path / "out") if name.startswith("checkpoint-"))


def _checkpoint_times(tmp_path):
    return {name: os.stat(tmp_path / "out" / name).st_mtime_ns for name in _checkpoints(tmp_path)}


@pytest.mark.parametrize(
    "length, end",
    [
        (dict(max_steps=3), 3),
        (dict(max_steps=-1, num_train_epochs=1.5), 6),
        (dict(max_steps=-1, num_train_epochs=1), 4),
    ],
    ids=["max_steps", "num_train_epochs-inside-an-epoch", "num_train_epochs"],
)
def test_a_finished_run_started_again_trains_nothing_and_says_it_is_complete(tokenizer, tmp_path, caplog, length, end):
    # 4 prompts: 4 micro-steps per epoch; max_steps=3 and 1.5 epochs end inside an epoch, 1 epoch at its end
    settings = dict(dataset=make_prompts(4), save_strategy="steps", save_steps=1, max_staleness=1, **length)
    first = make_trainer(tokenizer, tmp_path, **settings)
    first.train()
    assert first.state.global_step == end
    before = _checkpoint_times(tmp_path)
    assert f"checkpoint-{end}" in before

    again = make_trainer(tokenizer, tmp_path, model=make_model(tokenizer, seed=5), **settings)
    with caplog.at_level(logging.INFO, logger="a3po_trl"):
        result = again.train(resume_from_checkpoint=True)
    assert result.global_step == end and again.state.global_step == end
    assert logged_after(again, "loss", 0) == logged_after(first, "loss", 0)  # the checkpoint's history, nothing new
    assert _checkpoint_times(tmp_path) == before  # no checkpoint written or rewritten
    assert again.last_batch_producer is None  # the generator never started
    assert any("the run is complete" in record.getMessage() for record in caplog.records)
    trained = {n: p for n, p in first.model.named_parameters()}
    assert all((p == trained[n]).all() for n, p in again.model.named_parameters())  # the final weights loaded


def test_a_resume_one_step_before_the_end_trains_exactly_that_step(tokenizer, tmp_path):
    settings = dict(dataset=make_prompts(4), save_strategy="steps", save_steps=1, max_staleness=1, max_steps=3)
    first = make_trainer(tokenizer, tmp_path, **settings)
    first.train()
    again = make_trainer(tokenizer, tmp_path, model=make_model(tokenizer, seed=5), **settings)
    again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert again.state.global_step == 3
    assert len(logged_after(again, "loss", 2)) == 1
    assert again.last_batch_producer.consumed == 1
    assert _checkpoints(tmp_path) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
