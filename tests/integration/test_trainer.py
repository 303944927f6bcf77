"""AsyncA3POTrainer behaviour: drop-in equivalence with GRPOTrainer, staleness bounds, forwards, lifecycle."""

import threading

import pytest
import torch
from helpers import COMMON, generator_matches, logged, make_trainer
from tiny import length_reward, make_model, make_prompts
from transformers import TrainerCallback, TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer, builders


@pytest.mark.parametrize("max_staleness", [1, 3])
def test_staleness_bounded_reached_and_nothing_dropped(tokenizer, tmp_path, max_staleness):
    trainer = make_trainer(tokenizer, tmp_path, max_staleness=max_staleness, max_steps=8)
    trainer.train()
    producer = trainer.last_batch_producer
    staleness_max = logged(trainer, "a3po/staleness_max")
    assert len(staleness_max) == 8
    assert max(staleness_max) <= max_staleness
    assert max(staleness_max) > 0
    # every generated batch was consumed, in order; none was thrown away
    assert producer.produced == producer.consumed == producer.num_batches == 8
    assert producer.queue.max_depth_seen <= max_staleness + 1
    assert len(producer.queue) == 0


def test_synchronous_mode_is_on_policy(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, max_staleness=0, max_steps=4)
    trainer.train()
    assert logged(trainer, "a3po/staleness_max") == [0.0] * 4
    assert logged(trainer, "a3po/importance_weight_max") == [1.0] * 4


#: prefixes of the metrics of features a default run leaves off (in-flight weight loads, versions per completion,
#: dynamic sampling, tools): logged only when the feature is on
FEATURE_METRICS = (
    "async/in_flight_",
    "a3po/multi_version_trajectories_frac",
    "a3po/completion_versions_",
    "a3po/dynamic_sampling_",
    "tools/",
)


def test_a_default_run_logs_no_metrics_of_features_that_are_off(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, max_steps=2)
    trainer.train()
    keys = set().union(*(entry for entry in trainer.state.log_history if "reward" in entry))
    assert {"reward", "async/generation_time", "async/weight_load_time", "a3po/staleness_mean"} <= keys
    assert sorted(key for key in keys if key.startswith(FEATURE_METRICS)) == []


def test_rewards_that_are_all_none_log_what_grpo_trainer_logs(tokenizer, tmp_path):
    """A reward function returning None for every completion: the reward metrics are GRPOTrainer's (TRL 1.16 logs
    None where no value is left, so that JSON loggers do not meet a float NaN)."""

    def no_reward(completions, **kwargs):
        return [None] * len(completions)

    ours = make_trainer(tokenizer, tmp_path / "a", reward_funcs=(no_reward,), max_steps=1)
    ours.train()
    settings = {**COMMON, "max_steps": 1, "bf16": False}
    theirs = GRPOTrainer(
        model=make_model(tokenizer),
        reward_funcs=[no_reward],
        args=GRPOConfig(output_dir=str(tmp_path / "b"), **settings),
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
    )
    theirs.train()
    names = ("reward", "reward_std", "rewards/no_reward/mean", "rewards/no_reward/std", "frac_reward_zero_std")
    logged_by = [{name: trainer.state.log_history[0][name] for name in names} for trainer in (ours, theirs)]
    assert repr(logged_by[0]) == repr(logged_by[1])  # repr: a NaN would equal a NaN
    assert logged_by[0]["reward"] is None


def test_steps_spanning_a_generation_batch_respect_the_bound(tokenizer, tmp_path):
    # steps_per_generation=2 with gradient_accumulation_steps=1: one batch trains over 2 optimizer steps.
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncA3POConfig(output_dir=str(tmp_path), steps_per_generation=2, max_staleness=0, **COMMON)
    trainer = make_trainer(tokenizer, tmp_path, steps_per_generation=2, max_staleness=1, max_steps=6)
    trainer.train()
    staleness_max = logged(trainer, "a3po/staleness_max")
    assert max(staleness_max) == 1 and min(staleness_max) == 0


@pytest.mark.parametrize("method", ["loglinear", "recompute", "metrics", "behavior"])
@pytest.mark.parametrize("steps_per_batch", [1, 2])
def test_forward_passes_per_batch(tokenizer, tmp_path, method, steps_per_batch):
    """One training forward per micro-step; ``recompute`` and ``metrics`` add one no-grad forward per batch only
    where a batch is trained over several optimizer steps (its anchor is then older than the weights a later
    micro-step trains); with one optimizer step per batch the training forward's own log-probs are the anchor."""
    steps = 4 if steps_per_batch == 2 else 3
    schedule = dict(steps_per_generation=2, max_staleness=1) if steps_per_batch == 2 else {}
    trainer = make_trainer(tokenizer, tmp_path, prox_logp_method=method, max_steps=steps, **schedule)
    calls = []
    original = trainer._get_per_token_logps_and_entropies

    def counting(*args, **kwargs):
        calls.append(kwargs.get("compute_entropy", False))
        return original(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counting
    trainer.train()
    batches = steps // steps_per_batch
    training_forwards = sum(calls)  # the loss forward computes entropies
    extra_forwards = len(calls) - training_forwards
    assert training_forwards == steps
    recomputes = method in ("recompute", "metrics") and steps_per_batch > 1
    assert extra_forwards == (batches if recomputes else 0)
    if method == "metrics":  # against the anchor of the weights being trained: every micro-step, or a batch's first
        errors = logged(trainer, "a3po/approx_logp_abs_error")
        assert len(errors) == batches if steps_per_batch > 1 else steps
        assert all(e >= 0 for e in errors)
    else:  # the approximation error is measured only against the recompute anchor
        assert logged(trainer, "a3po/approx_logp_abs_error") == []
    if method == "behavior":  # no proximal policy to compute, and no behavior weight
        assert logged(trainer, "a3po/prox_time") == [0.0] * steps
        assert logged(trainer, "a3po/importance_weight_mean") == [1.0] * steps


def test_parameters_change_and_generator_matches_after_publication(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, max_staleness=1, max_steps=3)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    policy = trainer.last_batch_producer.backend
    assert policy.published_version == trainer.state.global_step == 3
    assert not generator_matches(policy, trainer.model) or policy.version == 3
    policy.refresh()
    assert policy.version == 3 and generator_matches(policy, trainer.model)
    # the generator owns its copy: changing the trainer's weights does not change the generator's
    with torch.no_grad():
        next(trainer.model.parameters()).add_(1.0)
    assert not generator_matches(policy, trainer.model)


def test_generator_copy_does_not_call_the_training_module(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, max_steps=1)
    calls = []
    # the hook is deep-copied into the generator's module too: count only calls on the training module itself
    hook = trainer.model.register_forward_pre_hook(lambda module, args: calls.append(module is trainer.model))
    trainer.train()
    hook.remove()
    assert (
        sum(calls) == 1 and len(calls) > 1
    )  # only the training forward of the single step; generation used the generator's copy


class _Boom(RuntimeError):
    pass


def test_exception_in_generation_thread_surfaces_from_train(tokenizer, tmp_path):
    state = {"calls": 0}

    def flaky_reward(completions, **kwargs):
        state["calls"] += 1
        if state["calls"] == 3:
            raise _Boom("reward service down")
        return [0.0] * len(completions)

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(flaky_reward,), max_staleness=2, max_steps=10)
    with pytest.raises(_Boom, match="reward service down") as info:
        trainer.train()
    assert any(frame.name == "flaky_reward" for frame in info.traceback)  # original traceback kept
    assert "flaky_reward" in "".join(getattr(info.value, "__notes__", []))
    assert not [t for t in threading.enumerate() if t.name.startswith("a3po-generation")]


class _InterruptAt(TrainerCallback):
    def __init__(self, step, error):
        self.step, self.error = step, error

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ValueError("main thread failed")])
def test_main_thread_interruption_joins_generation_thread(tokenizer, tmp_path, error):
    trainer = make_trainer(tokenizer, tmp_path, max_staleness=2, max_steps=20)
    trainer.add_callback(_InterruptAt(2, error))
    with pytest.raises(type(error)):
        trainer.train()
    producer = trainer.last_batch_producer
    assert producer.thread is not None and not producer.thread.is_alive()


def test_thread_off_runs_are_identical(tokenizer, tmp_path):
    losses = []
    for run in range(2):
        trainer = make_trainer(tokenizer, tmp_path / str(run), async_generation=False, max_staleness=1, max_steps=3)
        trainer.train()
        losses.append(logged(trainer, "loss"))
        assert logged(trainer, "a3po/staleness_max") == [0.0] * 3
    assert losses[0] == losses[1]


def test_a_grpo_config_is_converted_with_a3po_defaults(tokenizer, tmp_path, caplog):
    args = GRPOConfig(output_dir=str(tmp_path), **{**COMMON, "steps_per_generation": 2, "max_steps": 2})
    with caplog.at_level("WARNING", logger="a3po_trl"):
        trainer = AsyncA3POTrainer(
            model=make_model(tokenizer),
            reward_funcs=[length_reward],
            args=args,
            train_dataset=make_prompts(16),
            processing_class=tokenizer,
        )
    assert isinstance(trainer.args, AsyncA3POConfig)
    assert (trainer.args.steps_per_generation, trainer.args.generation_batch_size) == (2, 8)
    assert trainer.args.max_staleness == 2 and trainer.args.prox_logp_method == "loglinear"
    assert len([r for r in caplog.records if "from_grpo_config" in r.getMessage()]) == 1
    trainer.train()
    assert trainer.state.global_step == 2


def test_args_of_another_type_are_refused_before_the_model_loads(tmp_path):
    with pytest.raises(TypeError, match="an AsyncA3POConfig or a trl.GRPOConfig, got TrainingArguments"):
        AsyncA3POTrainer(
            model="does-not-exist/never-loaded",
            reward_funcs=[length_reward],
            args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
            train_dataset=make_prompts(8),
        )


def test_model_card_cites_a3po(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path)
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "trained with AsyncA3PO, a method introduced in [A-3PO: Accelerating Asynchronous LLM Training" in card
    assert "https://huggingface.co/papers/2512.06547" in card
    assert "author       = {Xiaocan Li and Shiliang Wu and Zheng Shen}" in card
    assert "@article{shao2024deepseekmath" in card  # GRPO's own entry: the loss is GRPO's, decoupled


def test_num_iterations_reuses_batches_with_growing_staleness(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, num_iterations=2, max_staleness=1, max_steps=4)
    trainer.train()
    staleness = logged(trainer, "a3po/staleness_max")
    assert trainer.last_batch_producer.consumed == 2  # each batch trained on twice
    assert max(staleness) == 1 and len(staleness) == 4


def test_evaluation_runs_beside_the_generation_thread(tokenizer, tmp_path):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        eval_dataset=make_prompts(8),
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
    )
    trainer.train()
    assert len(logged(trainer, "eval_loss")) == 2
    assert len(logged(trainer, "eval_reward")) == 2


def test_truncated_sampling_is_recorded_not_warned_about(tokenizer, tmp_path, caplog):
    """top-k/top-p no longer bias the update: the generator records the truncated distribution's log-probs too."""
    with caplog.at_level("INFO", logger="a3po_trl"):
        trainer = make_trainer(tokenizer, tmp_path, top_p=0.9, top_k=20)
    assert "top_k=20, top_p=0.9" in caplog.text and "records the log-probs of the processed" in caplog.text
    assert "biases the importance ratios" not in caplog.text
    assert builders.hf_generation_settings(trainer).record_sampling_logps


def test_with_generation_in_a_process_large_products_split_the_cores(tokenizer, tmp_path, monkeypatch):
    """generation_process=True and neither count set: where the thread keeps PyTorch's count in both, the two
    processes split the cores instead (a3po_trl.generation.cpu_threads.split_cores); the thread's rule is unchanged."""
    from a3po_trl.generation import cpu_threads

    monkeypatch.setattr(cpu_threads, "SMALL_PRODUCT", 1)  # the tiny model's products count as large

    def counts(trainer, available):
        chosen = builders.cpu_threads(trainer, available)
        return chosen.training, chosen.generation

    in_process = make_trainer(tokenizer, tmp_path / "process", generation_process=True)
    assert counts(in_process, 2) == (1, 1) and counts(in_process, 5) == (3, 2)
    assert counts(make_trainer(tokenizer, tmp_path / "thread"), 2) == (None, None)


@pytest.mark.parametrize("small", [True, False])
def test_without_thread_settings_small_products_train_and_generate_on_one_intra_op_thread_each(
    tokenizer, tmp_path, monkeypatch, caplog, small
):
    """Neither thread count set: the tiny model's products are small, so both threads run one intra-op thread; where
    the products count as large, both keep PyTorch's count. train() restores the count it found, and logs the rule."""
    import logging

    from a3po_trl.generation import cpu_threads

    if not small:
        monkeypatch.setattr(cpu_threads, "SMALL_PRODUCT", 1)
    seen = {}

    def counting_reward(completions, **kwargs):
        seen["generation"] = torch.get_num_threads()
        return [0.0] * len(completions)

    class CountThreads(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen["training"] = torch.get_num_threads()

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(counting_reward,), max_steps=2)
        trainer.add_callback(CountThreads())
        with caplog.at_level(logging.INFO, logger="a3po_trl.trainer"):
            trainer.train()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    assert seen == ({"generation": 1, "training": 1} if small else {"generation": 2, "training": 2})
    assert [r.getMessage() for r in caplog.records if "CPU threads" in r.getMessage()] == [
        f"CPU threads: {trainer.cpu_threads.reason} (training_num_threads / generation_num_threads override)"
    ]
