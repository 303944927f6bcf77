"""The batch schedule follows transformers' real training loop (a3po_trl.generation.schedule), so max_staleness
always holds."""

import logging

import pytest
from helpers import COMMON, logged, make_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import make_prompts
from transformers import TrainerCallback

from a3po_trl.config import largest_version_span
from a3po_trl.generation.schedule import (
    TrainingLoopShape,
    micro_step_after,
    oldest_allowed_version,
    plan_generation_batches,
    plan_run_batches,
    run_micro_steps,
)


class _RecordVersions(TrainerCallback):
    """Records the optimizer step (version) each micro-step actually trains at."""

    def __init__(self):
        self.versions = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.versions.append(("begin", state.global_step))

    def on_substep_end(self, args, state, control, **kwargs):
        self.versions.append(("sub", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.versions.append(("end", state.global_step - 1))


def _assert_bound_held(trainer, max_staleness, caplog):
    producer = trainer.last_batch_producer
    staleness_max = logged(trainer, "a3po/staleness_max")
    assert staleness_max and max(staleness_max) <= max_staleness, staleness_max
    for entry in trainer.state.log_history:
        if "a3po/staleness_max" in entry:
            histogram = sum(v for k, v in entry.items() if k.startswith("a3po/staleness_frac_"))
            assert histogram == pytest.approx(1.0), entry
    assert producer.produced == producer.consumed == producer.num_batches
    assert producer.schedule_misses == 0
    assert "its shape predicts" not in caplog.text


# (prompts, per-device batch, steps_per_generation, gradient_accumulation_steps, num_iterations, max_staleness, epochs)
LOOP_SHAPES = [
    (3, 4, 1, 2, 1, 0, 3),  # 3 micro-steps per epoch, windows of 2: the last window of each epoch holds one
    (3, 4, 3, 2, 1, 1, 3),  # one 3-micro-step batch per epoch over windows [2, 1]
    (5, 4, 1, 3, 1, 0, 2),  # 5 micro-steps per epoch, windows [3, 2]
    (4, 4, 2, 3, 2, 2, 2),  # batches of 4 micro-steps over windows of 3 (num_iterations=2), 8 per epoch: [3, 3, 2]
    (6, 2, 2, 1, 1, 1, 1),  # batches spanning two optimizer steps
]


@pytest.mark.parametrize("prompts, batch, spg, ga, iterations, max_staleness, epochs", LOOP_SHAPES)
def test_staleness_bound_holds_when_an_epoch_ends_in_a_short_window(
    tokenizer, tmp_path, caplog, prompts, batch, spg, ga, iterations, max_staleness, epochs
):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        dataset=make_prompts(prompts),
        per_device_train_batch_size=batch,
        steps_per_generation=spg,
        gradient_accumulation_steps=ga,
        num_iterations=iterations,
        max_staleness=max_staleness,
        max_steps=-1,
        num_train_epochs=epochs,
        max_completion_length=4,
    )
    with caplog.at_level(logging.WARNING, logger="a3po_trl"):
        trainer.train()
    _assert_bound_held(trainer, max_staleness, caplog)


def test_predicted_versions_are_the_versions_the_loop_trains_at(tokenizer, tmp_path):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        dataset=make_prompts(5),
        steps_per_generation=1,
        gradient_accumulation_steps=3,
        max_staleness=0,
        max_steps=-1,
        num_train_epochs=2,
        max_completion_length=4,
    )
    recorder = _RecordVersions()
    trainer.add_callback(recorder)
    trainer.train()
    actual = [version for kind, version in recorder.versions if kind in ("sub", "end")]
    assert [step.version for step in trainer._plan.micro_steps] == actual
    assert actual == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]  # windows [3, 2] in each 5-micro-step epoch


def test_resume_inside_a_batch_and_an_epoch_keeps_the_bound(tokenizer, tmp_path, caplog):
    # 4 prompts -> 2 batches of 4 micro-steps per epoch (8 micro-steps), windows of 3: [3, 3, 2]. A checkpoint at
    # step 1 resumes at micro-step 3 of the epoch, inside the first batch.
    overrides = dict(
        dataset=make_prompts(4),
        per_device_train_batch_size=4,
        steps_per_generation=2,
        num_iterations=2,
        gradient_accumulation_steps=3,
        max_staleness=1,
        max_completion_length=4,
        max_steps=5,
        save_strategy="steps",
        save_steps=1,
    )
    first = make_trainer(tokenizer, tmp_path, **overrides)
    first.train()
    resumed = make_trainer(tokenizer, tmp_path, **overrides)
    with caplog.at_level(logging.WARNING, logger="a3po_trl"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    _assert_bound_held(resumed, 1, caplog)
    steps = resumed._plan.micro_steps
    assert (steps[0].epoch, steps[0].position, steps[0].version) == (0, 3, 1)
    planned = plan_generation_batches(steps, 4)
    assert planned[0].first_offset == 3 and planned[0].micro_steps == 1  # the rest of the interrupted batch
    assert resumed.last_batch_producer.consumed == len(planned)


def _shapes():
    return st.builds(
        lambda batches, every, ga, extra_steps, start, skip: (batches * every, every, ga, extra_steps, start, skip),
        st.integers(1, 4),
        st.integers(1, 6),
        st.integers(1, 5),
        st.integers(1, 12),
        st.integers(0, 10),
        st.booleans(),
    )


@settings(max_examples=300, deadline=None)
@given(_shapes())
def test_planned_batches_never_span_more_than_the_configured_span(shape):
    steps_in_epoch, every, ga, extra_steps, start, skip = shape
    loop = TrainingLoopShape(
        steps_in_epoch, ga, max_steps=start + extra_steps, start_step=start, skip_trained_data=skip
    )
    steps = run_micro_steps(loop)
    assert len({s.version for s in steps}) == extra_steps  # one version per optimizer step of the run
    assert steps[0].version == start
    planned = plan_generation_batches(steps, every)
    assert sum(b.micro_steps for b in planned) == len(steps)
    span = largest_version_span(every, ga)
    for batch in planned:
        assert batch.span <= span
        oldest = oldest_allowed_version(batch, max_staleness=span - 1, start_version=start)
        assert batch.last_version - oldest <= span - 1  # the bound holds
        assert oldest <= batch.first_version  # and the trainer can publish these weights before it needs the batch


@settings(max_examples=200, deadline=None)
@given(_shapes(), st.integers(1, 12))
def test_a_batch_is_assigned_the_same_version_whatever_the_runs_length(shape, more_steps):
    """A run ending inside a batch assigns it the version a longer run does: a run continued from its checkpoint with
    a larger max_steps generates what the longer run generates. The shorter run's last batch spans, whole, the
    versions the longer run trains it with (the anchoring methods recompute it as the longer run does), and the
    micro-step after the shorter run is the longer run's next one (where the guard's kept weights are needed)."""
    steps_in_epoch, every, ga, extra_steps, start, skip = shape
    span = largest_version_span(every, ga)
    assigned, plans = [], []
    for max_steps in (start + extra_steps, start + extra_steps + more_steps):
        loop = TrainingLoopShape(steps_in_epoch, ga, max_steps=max_steps, start_step=start, skip_trained_data=skip)
        micro_steps, planned = plan_run_batches(loop, every)
        assert micro_steps == run_micro_steps(loop)
        plans.append((micro_steps, planned))
        assigned.append([oldest_allowed_version(batch, span - 1, start) for batch in planned])
        for batch, oldest in zip(planned, assigned[-1], strict=True):
            assert batch.last_version - oldest <= span - 1 and oldest <= batch.first_version
    shorter, longer = assigned
    assert longer[: len(shorter)] == shorter
    (short_steps, short_batches), (long_steps, long_batches) = plans
    if short_batches:
        assert short_batches[-1].whole_span == long_batches[len(short_batches) - 1].whole_span
        assert micro_step_after(short_steps[-1], steps_in_epoch) == long_steps[len(short_steps)]


def test_unset_max_staleness_admits_the_schedule_plus_one_step_and_a_too_small_one_names_the_setting(tmp_path):
    from a3po_trl import AsyncA3POConfig

    def config(**overrides):
        return AsyncA3POConfig(output_dir=str(tmp_path), **{**COMMON, **overrides})

    assert config().max_staleness == 1  # GRPOConfig's defaults: one batch per optimizer step, one step of overlap
    assert config(steps_per_generation=4).max_staleness == 4
    assert config(generation_batch_size=16).max_staleness == 4  # per_device_train_batch_size=4: 4 steps a batch
    assert config(steps_per_generation=4, gradient_accumulation_steps=4).max_staleness == 1
    assert config(steps_per_generation=4, max_staleness=3).max_staleness == 3
    with pytest.raises(ValueError, match=r"max_staleness=1 is too small: with generation_batch_size=16.*unset"):
        config(generation_batch_size=16, max_staleness=1)
    with pytest.raises(ValueError, match=r"with steps_per_generation=4"):
        config(steps_per_generation=4, max_staleness=2)
