"""Train a tiny model with ``prox_logp_method="guarded"`` under `accelerate launch` and write one JSON report per rank
(used by test_proximal_guard_distributed.py).

accelerate launch --config_file CONFIG tests/scripts/guarded_tiny.py OUT_DIR [--lora] [--fsdp2] [--invariant full,lora]

Two optimizer steps per generation batch, every batch from the first checked, and on process 1 only the
interpolation made wrong on purpose while batch 1 trains (steps 2 and 3): the check pools both processes' tokens, so
both must switch to the recomputed anchor for batch 2 (process 0's own tokens alone would not) and back for batch 3.
The report holds each process's logged anchor per step, the checks' relative errors and the guard's counts.

``--invariant full,lora`` then trains, for each model listed (``full``: every weight; ``lora``: adapters), the same
run twice in the same launch, guarded with a budget no check reaches and loglinear, with gradient accumulation 2 and
the default check interval, and reports whether each process holds the same trained weights bit for bit after both
(its shard under FSDP2, its partition under ZeRO-3: together, the whole model), and how far each check's reference
is from the forward of the version before the trained weights on the same inputs.
``--fsdp2`` turns FSDP on for the CPU processes (tests/fsdp_cpu.py), for a launch with an FSDP2 configuration.
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from helpers import WrongInterpolation, distributed_script_config, logged  # noqa: E402
from tiny import length_reward, make_model, make_prompts, make_tokenizer  # noqa: E402

import a3po_trl.proximal.anchor  # noqa: E402
from a3po_trl import AsyncA3POTrainer  # noqa: E402
from a3po_trl.functional import approximate_proximal_logps  # noqa: E402


def build(tokenizer, out_dir, lora, **settings):
    model = make_model(tokenizer)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return AsyncA3POTrainer(
        model=model,
        reward_funcs=[length_reward],
        args=distributed_script_config(out_dir, reproducible_generation=True, max_staleness=2, **settings),
        train_dataset=make_prompts(32),
        processing_class=tokenizer,
    )


def held_weights(trainer) -> dict[str, torch.Tensor]:
    """What this process holds of each trainable parameter: its ZeRO-3 partition, its FSDP2 shard, or the whole."""
    held = {}
    for name, parameter in trainer.model.named_parameters():
        if parameter.requires_grad:
            values = parameter.ds_tensor if hasattr(parameter, "ds_tensor") else parameter.detach()
            held[name] = (values.to_local() if hasattr(values, "to_local") else values).detach().clone()
    return held


def pooled_check(tokenizer, out_dir, lora) -> dict:
    trainer = build(
        tokenizer,
        out_dir,
        lora,
        prox_logp_method="guarded",
        prox_check_interval=1,
        prox_error_budget=3.0,
        steps_per_generation=2,
        max_steps=8,
    )
    # wrong on purpose on process 1 only, while batch 1 trains
    a3po_trl.proximal.anchor.approximate_proximal_logps = WrongInterpolation(trainer, wrong_steps=(2, 3), process=1)
    try:
        trainer.train()
    finally:
        a3po_trl.proximal.anchor.approximate_proximal_logps = approximate_proximal_logps
    guard = trainer.proximal_anchor.guard
    return {
        "rank": trainer.accelerator.process_index,
        "recompute": logged(trainer, "a3po/prox_recompute_fraction"),
        "relative": logged(trainer, "a3po/prox_check_error_relative"),
        "checks": guard.checks,
        "switches": guard.switches,
        "weights": {name: p.detach().sum().item() for name, p in trainer.model.named_parameters() if p.requires_grad},
    }


INPUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


def record_references(trainer) -> list:
    """``(step, inputs, reference log-probs, bytes kept)`` of every checked micro-step of ``trainer``'s run, as the
    check computed them (the kept version's forward), appended as it trains."""
    references, previous = [], trainer.proximal_anchor.guard.previous
    computed = previous.logps

    def logps(trainer_, model, inputs, weights_of):
        reference = computed(trainer_, model, inputs, weights_of)
        step, kept = trainer.state.global_step, previous.nbytes
        references.append((step, {key: inputs[key].clone() for key in INPUT_KEYS}, reference.clone(), kept))
        return reference

    previous.logps = logps
    return references


def forward_before(trainer, references) -> list:
    """Where ``trainer``'s run (the same as the guarded one) takes its first micro-step at version ``step - 1``, the
    training forward (no grad) of every reference's inputs at ``step``: that version's own log-probs, appended as it
    trains (one entry per reference, in order)."""
    forwards, original = [None] * len(references), trainer.compute_loss

    def compute_loss(model, inputs, *args, **kwargs):
        for index, (step, reference_inputs, _, _) in enumerate(references):
            if model.training and step - 1 == trainer.state.global_step and forwards[index] is None:
                ids = torch.cat([reference_inputs["prompt_ids"], reference_inputs["completion_ids"]], dim=1)
                mask = torch.cat([reference_inputs["prompt_mask"], reference_inputs["completion_mask"]], dim=1)
                with torch.no_grad():
                    forwards[index] = trainer._get_per_token_logps_and_entropies(
                        model, ids, mask, reference_inputs["completion_ids"].size(1)
                    )[0]
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss
    return forwards


def guarded_within_budget_as_loglinear(tokenizer, out_dir, lora) -> dict:
    """The outcome invariant: guarded with a budget no check reaches trains what loglinear trains, bit for bit; and
    each check's reference equals the forward of the version before the trained weights (the same inputs, forwarded
    by the loglinear run when it held that version)."""
    settings = dict(gradient_accumulation_steps=2, steps_per_generation=4, max_steps=6)  # batch 1 checked
    guarded = build(tokenizer, out_dir, lora, prox_logp_method="guarded", prox_error_budget=1e9, **settings)
    references = record_references(guarded)
    guarded.train()
    loglinear = build(tokenizer, out_dir, lora, prox_logp_method="loglinear", **settings)
    forwards = forward_before(loglinear, references)
    loglinear.train()
    a, b = held_weights(guarded), held_weights(loglinear)
    return {
        "checks": guarded.proximal_anchor.guard.checks,
        "equal": sorted(a) == sorted(b) and all(torch.equal(a[name], b[name]) for name in a),
        "losses_equal": logged(guarded, "loss") == logged(loglinear, "loss"),
        "trained": all(norm > 0 for norm in logged(loglinear, "grad_norm")),  # every step moved the weights
        "reference_steps": [step for step, _, _, _ in references],
        "reference_max_abs_diff": max(
            (reference - forward).abs().max().item() for (_, _, reference, _), forward in zip(references, forwards)
        ),
        "kept_bytes": max(kept for _, _, _, kept in references),
        "trainable_bytes": sum(
            math.prod(getattr(p, "ds_shape", p.shape)) * p.element_size()
            for p in guarded.model.parameters()
            if p.requires_grad
        ),
    }


def main():
    out_dir = sys.argv[1]
    if "--fsdp2" in sys.argv:
        from fsdp_cpu import force_fsdp_on_cpu

        force_fsdp_on_cpu()
    tokenizer = make_tokenizer()
    report = pooled_check(tokenizer, out_dir, "--lora" in sys.argv)
    if "--invariant" in sys.argv:
        models = sys.argv[sys.argv.index("--invariant") + 1].split(",")
        report["invariant"] = {
            model: guarded_within_budget_as_loglinear(tokenizer, out_dir, model == "lora") for model in models
        }
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()
