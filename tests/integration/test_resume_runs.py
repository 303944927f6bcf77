"""Resuming runs as a cluster scheduler does: a finished run started again with ``resume_from_checkpoint=True``
exits cleanly, a requeued job with ``resume_from_checkpoint="auto"`` starts fresh then resumes, and a run interrupted
after a checkpoint trains every prompt exactly as the uninterrupted run does."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import RecordingTrainer, StopAt, logged_after, make_trainer, model_weights
from tiny import make_model, make_prompts


def _checkpoints(tmp_path):
    return sorted(name for name in os.listdir(tmp_path / "out") if name.startswith("checkpoint-"))


def _files(tmp_path):
    """Every file under the run's output_dir, with its modification time."""
    found = {}
    for root, _, names in os.walk(tmp_path / "out"):
        for name in names:
            found[os.path.join(root, name)] = os.stat(os.path.join(root, name)).st_mtime_ns
    return found


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
    before = _files(tmp_path)
    assert f"checkpoint-{end}" in _checkpoints(tmp_path)

    again = make_trainer(tokenizer, tmp_path, model=make_model(tokenizer, seed=5), **settings)
    with caplog.at_level(logging.INFO, logger="a3po_trl"):
        result = again.train(resume_from_checkpoint=True)
    assert result.global_step == end and again.state.global_step == end
    assert logged_after(again, "loss", 0) == logged_after(first, "loss", 0)  # the checkpoint's history, nothing new
    assert _files(tmp_path) == before  # no checkpoint (nor trace) written or rewritten
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


def test_a_requeued_job_with_resume_auto_starts_fresh_then_resumes_from_its_last_checkpoint(tokenizer, tmp_path):
    """The same command for every launch of a job a scheduler may requeue: ``resume_from_checkpoint="auto"`` trains
    from the beginning when the output folder holds no checkpoint, and from the newest one after a kill."""
    settings = dict(dataset=make_prompts(4), save_strategy="steps", save_steps=2, max_staleness=1, max_steps=4)
    first = make_trainer(tokenizer, tmp_path, **settings)
    first.add_callback(StopAt(2))  # killed right after checkpoint-2 is written
    with pytest.raises(KeyboardInterrupt):
        first.train(resume_from_checkpoint="auto")
    assert first.state.global_step == 2 and _checkpoints(tmp_path) == ["checkpoint-2"]
    requeued = make_trainer(tokenizer, tmp_path, model=make_model(tokenizer, seed=5), **settings)
    requeued.train(resume_from_checkpoint="auto")
    assert requeued.state.global_step == 4
    assert len(logged_after(requeued, "loss", 2)) == 2  # steps 3 and 4 only: steps 1 and 2 came from the checkpoint
    assert logged_after(requeued, "loss", 0)[:2] == logged_after(first, "loss", 0)
    assert _checkpoints(tmp_path) == ["checkpoint-2", "checkpoint-4"]


def _recording_trainer(tokenizer, tmp_path, seed=0, **settings):
    return make_trainer(
        tokenizer, tmp_path, model=make_model(tokenizer, seed=seed), trainer_class=RecordingTrainer, **settings
    )


@pytest.mark.parametrize(
    "mode",
    [dict(reproducible_generation=True), dict(), dict(async_generation=False)],
    ids=["reproducible_generation", "async", "synchronous"],
)
def test_an_interrupted_and_resumed_run_trains_every_prompt_as_the_uninterrupted_run(tokenizer, tmp_path, mode):
    # Generation batches of 2 prompts x 4 completions, trained over 2 optimizer steps (steps_per_generation=2): the
    # checkpoint at step 3 falls inside batch 1, with batches 2 and 3 generated ahead and not trained yet.
    settings = dict(
        dataset=make_prompts(8),
        steps_per_generation=2,
        max_staleness=3,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        **mode,
    )
    uninterrupted = _recording_trainer(tokenizer, tmp_path / "a", **settings)
    uninterrupted.train()
    interrupted = _recording_trainer(tokenizer, tmp_path / "b", **settings)
    interrupted.add_callback(StopAt(3))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    resumed = _recording_trainer(tokenizer, tmp_path / "b", seed=123, **settings)
    resumed.train(resume_from_checkpoint=True)
    assert len(interrupted.trained) == 3 and len(resumed.trained) == 3
    # every micro-batch trains the prompts it trains in the uninterrupted run: none lost, none trained twice
    assert interrupted.trained + resumed.trained == uninterrupted.trained
    # every micro-step of the regenerated batch 1 and after it holds the same rows; with reproducible_generation the
    # same samples too (the kept version 2 regenerates batch 1), so the rest of the run is the same bit for bit.
    # Without it, batch 1 is generated again by the restored weights (version 3), so its samples differ.
    if mode.get("reproducible_generation"):
        assert logged_after(resumed, "loss", 3) == logged_after(uninterrupted, "loss", 3)
        a, b = model_weights(uninterrupted), model_weights(resumed)
        assert all(torch.equal(a[n], b[n]) for n in a)
