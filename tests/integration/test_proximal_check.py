"""The exact reference of A-3PO's anchor (:mod:`a3po_trl.proximal.previous_weights`): the log-probs of the version one
before the trained weights, computed by exchanging that version's trainable weights into the model for one forward."""

import copy

import pytest
import torch
from helpers import make_trainer, model_weights
from peft import LoraConfig, get_peft_model
from tiny import make_model
from transformers import TrainerCallback

from a3po_trl.proximal.previous_weights import PreviousVersionWeights


class _ReferenceRecorder:
    """Keeps version ``v``'s weights before the optimizer step that ends it, and at every training micro-step the
    reference log-probs of its micro-batch; with ``copies``, also a whole copy of the model at every version."""

    def __init__(self, trainer, copies: bool):
        self.previous = PreviousVersionWeights()
        self.references = []  # (global_step, inputs, reference log-probs)
        self.models = {}
        recorder = self

        class Keep(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                if copies:
                    recorder.models[state.global_step] = copy.deepcopy(trainer._unwrapped_model())

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                recorder.previous.keep(trainer._unwrapped_model(), state.global_step)

            def on_step_end(self, args, state, control, **kwargs):
                if copies:
                    recorder.models[state.global_step] = copy.deepcopy(trainer._unwrapped_model())

        trainer.add_callback(Keep())
        original = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            step = trainer.state.global_step
            if model.training and recorder.previous.version == step - 1:
                logps = recorder.previous.logps(trainer, model, inputs, trainer._unwrapped_model())
                recorder.references.append((step, {k: v for k, v in inputs.items()}, logps))
            return original(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss


def _forward(trainer, model, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].size(1))[0]


@pytest.mark.parametrize("steps_per_generation", [1, 2], ids=["one-step-per-batch", "two-steps-per-batch"])
def test_the_reference_is_the_forward_of_the_version_before_the_trained_weights(
    tokenizer, tmp_path, steps_per_generation
):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        max_steps=4,
        steps_per_generation=steps_per_generation,
        per_device_train_batch_size=4 // steps_per_generation * steps_per_generation,
        max_staleness=2,
        reproducible_generation=True,
    )
    recorder = _ReferenceRecorder(trainer, copies=True)
    trainer.train()
    steps = [step for step, _, _ in recorder.references]
    assert steps == [1, 2, 3]  # every step but the first has a version before it
    differs = []
    for step, inputs, reference in recorder.references:
        torch.testing.assert_close(reference, _forward(trainer, recorder.models[step - 1], inputs), rtol=0, atol=0)
        differs.append(not torch.equal(reference, _forward(trainer, recorder.models[step], inputs)))
    assert any(differs)  # not the trained weights' own (where a step moved them): the check measures something


def test_taking_the_reference_leaves_training_unchanged(tokenizer, tmp_path):
    settings = dict(max_steps=3, steps_per_generation=2, max_staleness=2, reproducible_generation=True)
    plain = make_trainer(tokenizer, tmp_path / "plain", **settings)
    plain.train()
    checked = make_trainer(tokenizer, tmp_path / "checked", **settings)
    recorder = _ReferenceRecorder(checked, copies=False)
    checked.train()
    assert len(recorder.references) == 2
    for name, value in model_weights(plain).items():
        torch.testing.assert_close(model_weights(checked)[name], value, rtol=0, atol=0)


def test_with_lora_only_the_adapters_are_kept_and_exchanged(tokenizer):
    model = get_peft_model(make_model(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    kept = PreviousVersionWeights()
    kept.keep(model, version=3)
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    assert kept.nbytes == adapters and kept.version == 3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.add_(1.0)
    moved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with kept.swapped_in(model):
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter, before[name], rtol=0, atol=0)
    for name, parameter in model.named_parameters():  # exchanged back, and the kept copy is version 3's again
        torch.testing.assert_close(parameter, moved[name], rtol=0, atol=0)
    with kept.swapped_in(model):
        torch.testing.assert_close(dict(model.named_parameters())[name], before[name], rtol=0, atol=0)


def test_swapping_into_another_model_is_refused(tokenizer):
    kept = PreviousVersionWeights()
    with pytest.raises(RuntimeError, match="before any keep"):
        with kept.swapped_in(make_model(tokenizer)):
            pass
    kept.keep(make_model(tokenizer), version=0)
    other = make_model(tokenizer, num_layers=1)
    with pytest.raises(RuntimeError, match="not those kept"):
        with kept.swapped_in(other):
            pass
    state = kept.state()  # kept under another sharding: half of each parameter, as one of two processes holds it
    kept.load_state({**state, "values": [value.flatten()[: value.numel() // 2] for value in state["values"]]})
    with pytest.raises(RuntimeError, match="another sharding"):
        with kept.swapped_in(make_model(tokenizer)):
            pass


@pytest.fixture
def one_gloo_process(monkeypatch):
    """A one-process gloo group (FSDP2's ``fully_shard`` over a world of one), destroyed after the test."""
    import torch.distributed as dist
    from helpers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_under_fsdp2_the_modules_kept_gathered_train_with_the_trained_weights_after_the_exchange(
    tokenizer, one_gloo_process, tied
):
    """FSDP2 keeps the root's parameters (final norm, lm_head, tied embeddings) gathered after a forward
    (``reshard_after_forward=False``): the exchanged forward leaves them holding the kept version, and the next forward
    (the training one) must gather the trained version again, not run with the kept one."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(tokenizer, tie_word_embeddings=tied)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=False)
    ids = torch.randint(0, len(tokenizer), (2, 6), generator=torch.Generator().manual_seed(0))

    def logits():
        with torch.no_grad():
            return model(ids).logits

    version_0 = logits()  # also leaves the root gathered, as a training forward before keep() does
    kept = PreviousVersionWeights()
    kept.keep(model, version=0)
    with torch.no_grad():  # an optimizer step: every shard moves
        for parameter in model.parameters():
            parameter.to_local().add_(0.05)
    version_1 = logits()
    assert not torch.equal(version_0, version_1)
    with kept.swapped_in(model):
        torch.testing.assert_close(logits(), version_0, rtol=0, atol=0)
    torch.testing.assert_close(logits(), version_1, rtol=0, atol=0)  # not the kept version's root
    with kept.swapped_in(model):  # and the kept copy is version 0's again
        torch.testing.assert_close(logits(), version_0, rtol=0, atol=0)


def test_the_random_state_is_saved_and_restored_only_where_the_forward_draws(tokenizer):
    """With dropout off (TRL's default) the check leaves the process's random generators alone: restoring them would
    rewind the generation thread's draws made meanwhile. With dropout on, in training mode, it restores them."""
    from a3po_trl.proximal.previous_weights import _draws_random_numbers, _random_state_restored

    model = make_model(tokenizer)
    model.train()
    assert not _draws_random_numbers(model)  # the tiny model's dropouts are 0
    model.model.layers[0].self_attn.attention_dropout = 0.1
    assert _draws_random_numbers(model)
    model.eval()
    assert not _draws_random_numbers(model)
    model.train()
    model.model.layers[0].self_attn.attention_dropout = 0.0
    model.model.layers[0].mlp.add_module("dropout", torch.nn.Dropout(0.2))
    assert _draws_random_numbers(model)

    before = torch.get_rng_state()
    with _random_state_restored("cpu", restore=False):
        torch.rand(3)  # another thread's draw, say
    assert not torch.equal(torch.get_rng_state(), before)
    before = torch.get_rng_state()
    with _random_state_restored("cpu", restore=True):
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
