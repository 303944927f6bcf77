"""``prox_logp_method="guarded"`` (:mod:`a3po_trl.proximal.guard`): the interpolation checked against its exact
target, the recomputed anchor while it is off by more than the budget, and back when a later check is within it."""

import copy
import math

import pytest
import torch
from helpers import (
    StopAt,
    WrongInterpolation,
    first_batch_with_logps,
    logged,
    logged_after,
    make_trainer,
    model_weights,
)
from peft import LoraConfig
from tiny import make_model
from transformers import TrainerCallback

import a3po_trl.proximal.anchor
from a3po_trl.proximal.guard import STATE_FILE, WEIGHTS_FILE

#: Two optimizer steps per generation batch (8 completions, 4 per micro-batch), each batch generated with the
#: version before its first step: every trained token is 1 to 2 versions old; the batches 1, 2, ... are checked.
SETTINGS = dict(
    prox_logp_method="guarded",
    prox_check_interval=1,
    prox_error_budget=3.0,
    steps_per_generation=2,
    max_staleness=2,
    reproducible_generation=True,
    max_steps=12,
)


def _guarded(tokenizer, tmp_path, monkeypatch, wrong_steps=(), **overrides):
    trainer = make_trainer(tokenizer, tmp_path, **{**SETTINGS, **overrides})
    monkeypatch.setattr(
        a3po_trl.proximal.anchor, "approximate_proximal_logps", WrongInterpolation(trainer, wrong_steps)
    )
    return trainer


def test_the_guard_switches_to_recompute_while_the_interpolation_is_wrong_and_back_when_it_is_right(
    tokenizer, tmp_path, monkeypatch
):
    # batch b trains steps 2b and 2b + 1; the interpolation is wrong while batches 1 and 2 train
    trainer = _guarded(tokenizer, tmp_path, monkeypatch, wrong_steps=range(2, 6))
    trainer.train()
    # batch 1's check settles when batch 2 is taken: batches 2 and 3 train with recompute (batch 2's check is wrong
    # too), batch 3's check is right again, and batches 4 and 5 train with the interpolation
    assert logged(trainer, "a3po/prox_recompute_fraction") == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    relative = logged(trainer, "a3po/prox_check_error_relative")
    assert len(relative) == 4  # batches 1-4's checks settled (batch 5's when a batch 6 would be taken)
    assert relative[0] > 3.0 and relative[1] > 3.0 and relative[2] < 3.0 and relative[3] < 3.0
    guard = trainer.proximal_anchor.guard
    assert (guard.checks, guard.switches, guard.recompute) == (4, 2, False)
    assert all(seconds >= 0 for seconds in logged(trainer, "a3po/prox_check_time"))


def test_a_batch_the_guard_sends_to_recompute_has_recompute_s_loss_and_the_others_loglinear_s(tokenizer, tmp_path):
    source = make_trainer(tokenizer, tmp_path / "source", **SETTINGS)
    source.model.train()
    source.state.max_steps = 2
    inputs, logps = first_batch_with_logps(source)
    # two versions old, with behavior log-probs away from the current ones: the anchors differ
    inputs = {**inputs, "token_versions": torch.ones_like(inputs["token_versions"]), "behavior_logps": logps - 0.8}
    inputs["advantages"] = torch.linspace(0.5, 1.0, inputs["advantages"].numel()).view_as(inputs["advantages"])

    def loss(method, guard_recompute=None):
        trainer = make_trainer(tokenizer, tmp_path / method, **{**SETTINGS, "prox_logp_method": method})
        trainer.state.global_step, trainer.current_gradient_accumulation_steps = 3, 1
        trainer.model.train()
        if guard_recompute is not None:  # the anchor the guard chose for the batch
            trainer.proximal_anchor.guard.recompute = guard_recompute
        return trainer.compute_loss(trainer.model, dict(inputs)).detach()

    recompute, loglinear = loss("recompute"), loss("loglinear")
    assert not torch.equal(recompute, loglinear)
    assert torch.equal(loss("guarded", guard_recompute=True), recompute)
    assert torch.equal(loss("guarded", guard_recompute=False), loglinear)


def test_the_check_compares_with_the_forward_of_the_version_before_the_trained_weights(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, **{**SETTINGS, "max_steps": 6})
    versions, references = {}, []

    class Copies(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            versions[state.global_step] = copy.deepcopy(trainer._unwrapped_model())

        def on_step_end(self, args, state, control, **kwargs):
            versions[state.global_step] = copy.deepcopy(trainer._unwrapped_model())

    trainer.add_callback(Copies())
    reference = trainer.proximal_anchor.guard.reference

    def recording(trainer_, model, inputs):
        logps = reference(trainer_, model, inputs)
        if logps is not None:
            references.append((trainer_.state.global_step, dict(inputs), logps))
        return logps

    trainer.proximal_anchor.guard.reference = recording
    trainer.train()
    # batches 1 and 2 are checked, at steps 2-3 and 4-5; step 2's version before it (1) was kept at step 1's end
    assert [step for step, _, _ in references] == [2, 3, 4, 5]
    for step, inputs, logps in references:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            target = trainer._get_per_token_logps_and_entropies(
                versions[step - 1], ids, mask, inputs["completion_ids"].size(1)
            )[0]
        torch.testing.assert_close(logps, target, rtol=0, atol=0)
    # the kept weights are freed when the run ends (its last step kept version 5: a continuation checks step 6)
    assert trainer.proximal_anchor.guard.previous.version is None


def test_an_interval_checks_every_nth_batch_and_keeps_the_weights_only_for_them(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, **{**SETTINGS, "prox_check_interval": 3, "max_steps": 16})
    kept = []

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            kept.append(trainer.proximal_anchor.guard.previous.version)

    trainer.add_callback(Watch())
    trainer.train()
    # batches 1, 4, 7 are checked: steps 2-3, 8-9, 14-15 need the version before them
    assert [step for step, version in enumerate(kept) if version is not None] == [2, 3, 8, 9, 14, 15]
    assert all(version == step - 1 for step, version in enumerate(kept) if version is not None)
    assert len(logged(trainer, "a3po/prox_check_error")) == 2  # batch 7's settles only with a batch 8


def test_resume_keeps_the_guard_state_and_trains_as_the_uninterrupted_run(tokenizer, tmp_path, monkeypatch):
    checkpointing = dict(save_strategy="steps", save_steps=4)
    uninterrupted = _guarded(tokenizer, tmp_path / "a", monkeypatch, wrong_steps=range(2, 6), **checkpointing)
    uninterrupted.train()

    interrupted = _guarded(tokenizer, tmp_path / "b", monkeypatch, wrong_steps=range(2, 6), **checkpointing)
    interrupted.add_callback(StopAt(4))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-4"
    # at step 4, between batches: batch 1's (wrong) check is in progress, to settle when batch 2 is taken, and batch
    # 2's first step (checked) needs version 3's weights
    assert (checkpoint / STATE_FILE.format(rank=0)).exists() and (checkpoint / WEIGHTS_FILE.format(rank=0)).exists()
    resumed = _guarded(
        tokenizer,
        tmp_path / "b",
        monkeypatch,
        wrong_steps=range(2, 6),
        model=make_model(tokenizer, seed=9),
        **checkpointing,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for key in ("loss", "a3po/prox_recompute_fraction", "a3po/prox_check_error_relative"):
        assert logged_after(resumed, key, 4) == logged_after(uninterrupted, key, 4), key
    assert logged_after(resumed, "a3po/prox_recompute_fraction", 4) == [1, 1, 1, 1, 0, 0, 0, 0]
    a, b = model_weights(uninterrupted), model_weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_with_lora_the_guard_keeps_only_the_adapters(tokenizer, tmp_path):
    from peft import get_peft_model

    model = get_peft_model(make_model(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    trainer = make_trainer(tokenizer, tmp_path, model=model, **{**SETTINGS, "max_steps": 6})
    sizes = []

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sizes.append(trainer.proximal_anchor.guard.previous.nbytes)

    trainer.add_callback(Watch())
    trainer.train()
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad)
    assert sizes == [0, 0, adapters, adapters, adapters, adapters]
    assert len(logged(trainer, "a3po/prox_check_error")) == 1


def _with_attention_dropout(model, probability=0.3):
    """``model`` (tiny.py's Llama) with dropout on its attention weights while training."""
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = probability
    return model


#: Outcome invariant (docs/RELIABILITY.md): with a budget no check reaches, the guarded run trains what loglinear
#: trains, bit for bit: every batch checked (interval 1, two optimizer steps per batch); gradient accumulation 2 at
#: the default interval with dropout on (the check's forward draws the training forward's dropout masks and leaves
#: its random state as it found it); LoRA (only the adapters kept and exchanged). Each run settles two checks.
WITHIN_BUDGET = {
    "interval-1": dict(),
    "accumulation-2-default-interval-dropout": dict(
        max_steps=10,
        prox_check_interval=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        disable_dropout=False,
    ),
    "lora-accumulation-2": dict(
        max_steps=10, prox_check_interval=2, gradient_accumulation_steps=2, steps_per_generation=4
    ),
}


@pytest.mark.parametrize("case", list(WITHIN_BUDGET))
def test_within_budget_the_guarded_run_trains_exactly_as_loglinear(tokenizer, tmp_path, case):
    settings = {**SETTINGS, "max_steps": 8, **WITHIN_BUDGET[case]}

    def model():
        if case.startswith("lora"):
            from peft import get_peft_model

            return get_peft_model(make_model(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        return _with_attention_dropout(make_model(tokenizer)) if settings.get("disable_dropout") is False else None

    guarded = make_trainer(tokenizer, tmp_path / "guarded", model=model(), **{**settings, "prox_error_budget": 1e9})
    guarded.train()
    loglinear = make_trainer(
        tokenizer, tmp_path / "loglinear", model=model(), **{**settings, "prox_logp_method": "loglinear"}
    )
    loglinear.train()
    assert len(logged(guarded, "a3po/prox_check_error")) == 2  # it checked, and the checks changed nothing
    assert logged(guarded, "loss") == logged(loglinear, "loss")
    a, b = model_weights(guarded), model_weights(loglinear)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_step_that_moves_no_weight_decides_nothing_and_logs_the_error_in_nats(tokenizer, tmp_path):
    """Learning rate 0: no step moves the policy, so a check's drift is 0 and its relative error undefined. The guard
    keeps the interpolation (a budget no finite error reaches stays unreached) and logs the error in nats only; an
    infinite relative error used to send every later batch to recompute."""
    trainer = make_trainer(
        tokenizer, tmp_path, **{**SETTINGS, "max_steps": 8, "prox_error_budget": 1e9, "learning_rate": 0.0}
    )
    trainer.train()
    guard = trainer.proximal_anchor.guard
    assert logged(trainer, "a3po/prox_recompute_fraction") == [0] * 8
    assert (guard.checks, guard.switches, guard.recompute) == (0, 0, False)
    errors = logged(trainer, "a3po/prox_check_error")
    assert len(errors) == 2 and all(math.isfinite(error) for error in errors)
    assert logged(trainer, "a3po/prox_check_error_relative") == []


@pytest.mark.parametrize(
    "setting, message",
    [(dict(prox_check_interval=0), "prox_check_interval=0"), (dict(prox_error_budget=0.0), "prox_error_budget=0.0")],
)
def test_bad_guard_settings_are_refused_naming_the_setting(tokenizer, tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tokenizer, tmp_path, prox_logp_method="guarded", **setting)
