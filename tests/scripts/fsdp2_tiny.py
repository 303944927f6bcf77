"""Train a tiny model under FSDP2 on two CPU processes and write one JSON report per rank (used by test_fsdp2.py).

accelerate launch --config_file FSDP2_CONFIG tests/scripts/fsdp2_tiny.py OUT_DIR [--lora] [--resume] [--extras]
    [--in-flight] [--full-and-lora]

``--full-and-lora`` makes the launch's run twice, full weights then LoRA, one after the other in the same processes
(they start once for both), the reports in ``OUT_DIR/full`` and ``OUT_DIR/lora``; not with ``--extras`` (run
second, the LoRA run of process 1 could not load the base model it had just saved: "Unrecognized model").

accelerate keeps FSDP off on a CPU-only machine; ``force_fsdp_on_cpu`` (tests/fsdp_cpu.py, docs/FSDP2.md) turns it on,
so the Trainer shards the model with ``fully_shard`` over gloo as it would on GPUs.

The report says whether the model really was sharded, and compares, for every weight version the generator loaded
(in its thread, right after loading) and the last one (loaded after training), the generator's log-probs of a fixed
completion with the training forward's at that version (computed after each optimizer step, on both processes).
With ``--lora`` the main process saves the adapter with ``save_model()`` and loads it with
``PeftModel.from_pretrained``. With ``--resume`` (``reproducible_generation``) a second run is stopped after its
checkpoint at step 2 and resumed from it by a third, started from other weights: the report holds both runs' logs after
step 2 and whether their final weights are equal; without ``--lora``, also, for ``loglinear``, ``recompute``,
``metrics`` and ``guarded``, a 3-step run continued to 6 steps, stopped at step 5 and resumed, against the
uninterrupted 6-step run (:func:`continue_and_resume`). With ``--extras`` the run adds what runs sharded in the main
thread: a reference model (``beta > 0``; from a saved copy of the base, or the adapter-disabled model under LoRA), a
reward model given as a module, ``prox_logp_method="metrics"`` and evaluation, at ``max_staleness=0`` so that the
generator loads every version. At one optimizer step per batch ``metrics`` anchors at the training forward's own
log-probs, so the recompute forward a batch trained over several steps gets is run after training, sharded, on the
fixed completion.
With ``--in-flight`` the run trains with ``in_flight_weight_updates=True`` and the switch points fixed by the schedule
(``helpers.Lockstep``): the report holds each batch's token versions and the ones the schedule fixes.
"""

import functools
import json
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fsdp_cpu import force_fsdp_on_cpu  # noqa: E402

force_fsdp_on_cpu()

import torch  # noqa: E402
from helpers import Lockstep, StopAt, distributed_script_config, generator_matches, logged, logged_after  # noqa: E402
from tiny import length_reward, make_model, make_prompts, make_reward_model, make_tokenizer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from a3po_trl import AsyncA3POTrainer  # noqa: E402
from a3po_trl.builders import weight_gather  # noqa: E402
from a3po_trl.generation.hf.backend import per_token_logps_fused  # noqa: E402
from a3po_trl.generation.weights.names import without_checkpoint_wrapper  # noqa: E402

MAX_STEPS = 4
LOGGED = ("loss", "reward", "async/generator_version", "a3po/staleness_max")
#: What each proximal method logs of its anchor, compared across a continuation and a resume.
METHOD_LOGGED = {
    "metrics": ("a3po/anchor_age", "a3po/anchor_approx_logp_abs_error"),
    "guarded": ("a3po/prox_recompute_fraction", "a3po/prox_check_error", "a3po/prox_check_error_relative"),
}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )


def fixed_completion(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    completion = tokenizer("The answer is 4.")["input_ids"]
    ids = torch.tensor([prompt + completion])
    return ids, torch.ones_like(ids), len(completion)


class TrainerLogps(TrainerCallback):
    """The training forward's log-probs of the fixed completion at every version (on every process together: under
    FSDP2 a forward is a collective). Added after the trainer's own callbacks, so it runs after each publication."""

    def __init__(self, trainer, fixed):
        self.trainer, self.fixed, self.by_version = trainer, fixed, {}

    def record(self, version):
        ids, mask, keep = self.fixed
        with torch.no_grad():
            logps = self.trainer._get_per_token_logps_and_entropies(self.trainer.model, ids, mask, keep)[0]
        self.by_version[version] = logps.cpu()

    def on_train_begin(self, args, state, control, **kwargs):
        self.record(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.record(state.global_step)


def record_generator_logps(trainer, fixed, by_version):
    """Wrap the backend the trainer builds so that every version it loads is scored right after loading (in the
    generation thread, between batches, with the generator's own forward)."""
    build = trainer._build_backend

    def recording_build():
        backend = build()
        load = backend.load_weights

        def recording_load(weights, version):
            load(weights, version)
            ids, mask, keep = fixed
            with torch.no_grad():
                by_version[version] = per_token_logps_fused(backend.module, ids, mask, keep, None).cpu()

        backend.load_weights = recording_load
        return backend

    trainer._build_backend = recording_build


def make(out_dir, tokenizer, lora, seed=0, reward_funcs=(length_reward,), model=None, **overrides):
    """The trainer; ``seed`` draws the trainable weights' initial values (under LoRA the adapter's: the base model is
    the same pretrained one in every run, and a resume loads the adapter only)."""
    extra = {k: overrides.pop(k) for k in ("eval_dataset", "reward_processing_classes") if k in overrides}
    args = distributed_script_config(out_dir, **{"max_steps": MAX_STEPS, **overrides})
    model = model if model is not None else make_model(tokenizer, seed=0 if lora else seed)
    if lora:
        from peft import get_peft_model

        torch.manual_seed(seed)
        model = get_peft_model(model, lora_config())
    return AsyncA3POTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=make_prompts(32),
        processing_class=tokenizer,
        **extra,
    )


def extras(out_dir, tokenizer, lora):
    """The settings and the reward-model thread log of an ``--extras`` run."""
    from transformers import AutoModelForCausalLM

    base_dir = os.path.join(out_dir, f"base-rank{os.environ['RANK']}")
    make_model(tokenizer).save_pretrained(base_dir)  # a path, for GRPOTrainer to load the reference model from
    reward_model = make_reward_model(tokenizer)
    threads = []
    reward_model.register_forward_pre_hook(lambda *args: threads.append(threading.current_thread().name))
    settings = dict(
        max_staleness=0,  # every version is loaded by the generator (and so compared with the trainer's)
        beta=0.04,
        prox_logp_method="metrics",
        reward_funcs=(length_reward, reward_model),
        reward_processing_classes=[None, tokenizer],
        eval_dataset=make_prompts(4),
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        model=AutoModelForCausalLM.from_pretrained(base_dir) if lora else base_dir,
    )
    return settings, threads


def full_weights(trainer):
    """Every parameter whole (gathered on every process together), on CPU."""
    params = list(trainer._unwrapped_model().named_parameters())
    return {name: t.to("cpu", copy=True) for name, t in weight_gather(trainer).full_tensors(params)}


def train_and_check(out_dir, tokenizer, lora, with_extras=False):
    from torch.distributed.tensor import DTensor

    fixed = fixed_completion(tokenizer)
    settings, reward_model_threads = extras(out_dir, tokenizer, lora) if with_extras else ({}, [])
    trainer = make(out_dir, tokenizer, lora, **settings)
    trainer_logps, generator_logps = TrainerLogps(trainer, fixed), {}
    trainer.add_callback(trainer_logps)
    record_generator_logps(trainer, fixed, generator_logps)
    trainer.train()
    policy = trainer.last_batch_producer.backend
    policy.refresh()  # the last published version (= global_step), loaded here in the main thread
    model = trainer._unwrapped_model()
    sharded = [
        name for name, p in model.named_parameters() if isinstance(p, DTensor) and p.to_local().numel() < p.numel()
    ]
    report = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "is_fsdp_enabled": trainer.is_fsdp_enabled,
        "is_fsdp2": trainer.accelerator.is_fsdp2,
        "sharded_parameters": len(sharded),
        "parameters": len(list(model.parameters())),
        "global_step": trainer.state.global_step,
        "generator_version": policy.version,
        "generator_matches_trainer": generator_matches(policy, model),
        "copied_parameters": policy.copied_parameter_count,
        "logps_max_abs_diff": {
            v: (generator_logps[v] - trainer_logps.by_version[v]).abs().max().item() for v in sorted(generator_logps)
        },
        "logps_versions_trainer": sorted(trainer_logps.by_version),
        "trainer_logps_change": (trainer_logps.by_version[MAX_STEPS] - trainer_logps.by_version[0]).abs().max().item(),
        "max_staleness_seen": max(
            h["a3po/staleness_max"] for h in trainer.state.log_history if "a3po/staleness_max" in h
        ),
        "batches_consumed": trainer.last_batch_producer.consumed,
        "reward_model_threads": sorted(set(reward_model_threads)),
        "mixed_precision": trainer.accelerator.mixed_precision,
        "trainable_dtypes": sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}),
        "generator_copy_dtypes": sorted({str(p.dtype) for p in policy._own.values()}),
        "generator_frozen_dtypes": sorted(
            {str(p.dtype) for p in policy.module.parameters() if all(p is not q for q in policy._own.values())}
        ),
        "staging_dtypes": sorted({str(d) for d in policy.weights.layout.dtypes.values()}),
        "staging_device": str(policy.weights.layout.device),
        "staged_weight_bytes": sum(map(policy.weights.layout.weight_bytes, policy.weights.layout.shapes)),
        "staged_weights": len(policy.weights.layout.shapes),
        "memory_plan": [[item.what, item.bytes, str(item.device)] for item in policy.memory_plan.items],
        "checkpoint_wrapped_parameters": sum(
            "_checkpoint_wrapped_module" in name for name, _ in model.named_parameters()
        ),
        "ref_model": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
        "logged_keys": sorted({key for h in trainer.state.log_history for key in h}),
    }
    if with_extras:  # the recompute forward (main thread, every process together), against the training forward's
        ids, mask, keep = fixed
        batch = {"prompt_ids": ids[:, :-keep], "completion_ids": ids[:, -keep:]}
        batch |= {"prompt_mask": mask[:, :-keep], "completion_mask": mask[:, -keep:]}
        trainer.proximal_anchor.attach_proximal_logps(trainer, [batch], batch_index=0, versions_training_batch=2)
        recomputed = batch["recomputed_proximal_logps"].cpu()
        report["recompute_max_abs_diff"] = (recomputed - trainer_logps.by_version[MAX_STEPS]).abs().max().item()
    if lora:
        report.update(check_saved_adapter(trainer, out_dir, tokenizer, policy, fixed))
    return trainer, report


def check_saved_adapter(trainer, out_dir, tokenizer, policy, fixed):
    """``save_model()`` on every process (it gathers), then the main process loads the adapter into a fresh base."""
    adapter_dir = os.path.join(out_dir, "adapter")
    trainer.save_model(adapter_dir)
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return {}
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(make_model(tokenizer), adapter_dir).eval()
    own = dict(loaded.named_parameters())
    ids, mask, keep = fixed
    with torch.no_grad():
        logits = loaded(input_ids=ids, attention_mask=mask).logits[:, -keep - 1 : -1].float()
        logps = torch.log_softmax(logits / trainer.temperature, -1).gather(-1, ids[:, -keep:, None])[..., 0]
        reference = per_token_logps_fused(policy.module, ids, mask, keep, None)
    report = {}
    if "ref" in loaded.peft_config or os.path.isdir(os.path.join(adapter_dir, "ref")):  # TRL's frozen copy (beta > 0)
        from safetensors.torch import load_file

        trained = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
        ref = load_file(os.path.join(adapter_dir, "ref", "adapter_model.safetensors"))
        report["ref_adapter_saved"] = sorted(ref) == sorted(trained) and any(
            not torch.equal(ref[k], trained[k]) for k in ref
        )
    return report | {
        "adapter_files": sorted(os.listdir(adapter_dir)),
        "adapter_equals_generator": all(
            torch.equal(own[without_checkpoint_wrapper(name)].to(policy._own[name].dtype), policy._own[name].cpu())
            for name in policy.trainable_names
        ),
        "adapter_tensors": len(policy.trainable_names),
        "adapter_logps_max_abs_diff": (logps - reference).abs().max().item(),
    }


def resume_bit_for_bit(out_dir, tokenizer, lora):
    """The uninterrupted run against a run stopped after its step-2 checkpoint and resumed from it."""
    settings = dict(reproducible_generation=True, save_strategy="steps", save_steps=2)
    uninterrupted = make(os.path.join(out_dir, "a"), tokenizer, lora, **settings)
    uninterrupted.train()
    interrupted = make(os.path.join(out_dir, "b"), tokenizer, lora, **settings)
    interrupted.add_callback(StopAt(2))
    try:
        interrupted.train()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupted run was not stopped")
    checkpoint = os.path.join(out_dir, "b", "checkpoint-2")
    at_stop = full_weights(interrupted)
    resumed = make(os.path.join(out_dir, "b"), tokenizer, lora, seed=123, **settings)
    initial = full_weights(resumed)

    class AtStart(TrainerCallback):  # the weights the sharded checkpoint loaded (every process gathers)
        def on_train_begin(self, args, state, control, **kwargs):
            self.weights = full_weights(resumed)

    at_start = AtStart()
    resumed.add_callback(at_start)
    resumed.train(resume_from_checkpoint=checkpoint)
    a, b = full_weights(uninterrupted), full_weights(resumed)
    return {
        "checkpoint_files": sorted(os.listdir(checkpoint)),
        "uninterrupted": {key: logged_after(uninterrupted, key, 2) for key in LOGGED},
        "resumed": {key: logged_after(resumed, key, 2) for key in LOGGED},
        "loaded_weights_equal_stopped": all(torch.equal(at_stop[n], at_start.weights[n]) for n in at_stop),
        "loaded_weights_differ_from_init": any(not torch.equal(initial[n], at_start.weights[n]) for n in initial),
        "final_weights_equal": sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a),
    }


#: The proximal methods whose continued and resumed runs the full (not LoRA) ``--resume`` launch compares with the
#: uninterrupted run; ``guarded`` with a budget every check exceeds, so that each check switches its anchor.
CHAIN_METHODS = {
    "loglinear": dict(prox_logp_method="loglinear"),
    "recompute": dict(prox_logp_method="recompute"),
    "metrics": dict(prox_logp_method="metrics"),
    "guarded": dict(prox_logp_method="guarded", prox_check_interval=1, prox_error_budget=1e-3),
}


def continue_and_resume(out_dir, tokenizer, lora, method):
    """Batches trained over two optimizer steps (recompute, metrics and guarded switched anchor them at the weights
    of their first): a 3-step run (ending inside batch 1) continued to 6 steps from its last checkpoint, stopped
    after its checkpoint at step 5 (inside batch 2) and resumed from it, against the uninterrupted 6-step run."""
    settings = dict(
        reproducible_generation=True,
        steps_per_generation=2,
        max_staleness=2,
        lr_scheduler_type="constant",  # a decaying one follows max_steps: the 3-step run's own steps would differ
        max_steps=6,
        **CHAIN_METHODS[method],
    )
    uninterrupted = make(os.path.join(out_dir, method, "a"), tokenizer, lora, **settings)
    uninterrupted.train()
    chain = os.path.join(out_dir, method, "b")
    # checkpoints in the chain only (what is trained does not depend on the saves; a resumed run takes save_steps
    # from the checkpoint's trainer state)
    saves = dict(save_strategy="steps", save_steps=1)
    make(chain, tokenizer, lora, **{**settings, **saves, "max_steps": 3}).train()
    continued = make(chain, tokenizer, lora, seed=123, **settings, **saves)
    continued.add_callback(StopAt(5))
    try:
        continued.train(resume_from_checkpoint=os.path.join(chain, "checkpoint-3"))
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the continued run was not stopped")
    resumed = make(chain, tokenizer, lora, seed=321, **settings)
    resumed.train(resume_from_checkpoint=os.path.join(chain, "checkpoint-5"))
    keys = ("loss", "grad_norm", *METHOD_LOGGED.get(method, ()))
    a, b = full_weights(uninterrupted), full_weights(resumed)
    return {
        "uninterrupted": {key: logged(uninterrupted, key) for key in keys},
        "continued_and_resumed": {key: logged(resumed, key) for key in keys},
        "final_weights_equal": sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a),
    }


def train_in_flight(out_dir, tokenizer, lora):
    """In-flight weight updates under FSDP2: each process's generator loads a version mid-batch, at the token the
    schedule fixes, from its staging buffer, which every process's (sharded, gathered) publication filled. The
    trainer module's ``make_training_batch``, which the schedule gates, is restored afterwards (a launch may train
    another run after this one)."""
    patched = []

    def patch(owner, name, value):
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    trainer = make(out_dir, tokenizer, lora, in_flight_weight_updates=True)
    lockstep = Lockstep(trainer, patch, lag=1, num_batches=MAX_STEPS)
    try:
        trainer.train()
    finally:
        for owner, name, value in reversed(patched):
            setattr(owner, name, value)
    policy = trainer.last_batch_producer.backend
    policy.refresh()
    return trainer, {
        "global_step": trainer.state.global_step,
        "generator_version": policy.version,
        "generator_matches_trainer": generator_matches(policy, trainer._unwrapped_model()),
        "generator_checksum": sum(p.double().sum().item() for p in policy.module.parameters()),
        "token_versions": [lockstep.token_versions[i].tolist() for i in range(MAX_STEPS)],
        "expected_token_versions": [lockstep.expected_versions(i).tolist() for i in range(MAX_STEPS)],
        "in_flight_weight_loads": logged(trainer, "async/in_flight_weight_loads"),
        "completion_versions_max": logged(trainer, "a3po/completion_versions_max"),
        "max_staleness_seen": max(logged(trainer, "a3po/staleness_max")),
    }


def run_and_report(out_dir, tokenizer, lora):
    """The launch's run (full weights or ``lora``), its report written to ``out_dir/rank<RANK>.json``."""
    if "--resume" in sys.argv:
        report = resume_bit_for_bit(out_dir, tokenizer, lora)
        if not lora:  # one sharded launch holds the continued and resumed runs of the anchoring methods
            report["methods"] = {m: continue_and_resume(out_dir, tokenizer, lora, m) for m in CHAIN_METHODS}
        rank = int(os.environ["RANK"])
    elif "--in-flight" in sys.argv:
        trainer, report = train_in_flight(os.path.join(out_dir, "run"), tokenizer, lora)
        rank = trainer.accelerator.process_index
    else:
        trainer, report = train_and_check(os.path.join(out_dir, "run"), tokenizer, lora, "--extras" in sys.argv)
        rank = trainer.accelerator.process_index
    report["rank"] = rank
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def main():
    out_dir = sys.argv[1]
    global make
    if "--bf16" in sys.argv:  # the launch config's mixed_precision: bf16 as well (launch_fsdp2(mixed_precision=...))
        make = functools.partial(make, bf16=True)
    if "--activation-checkpointing" in sys.argv:  # with fsdp_activation_checkpointing: true in the launch config
        make = functools.partial(make, gradient_checkpointing=False)  # transformers refuses both at once
    if "--full-and-lora" in sys.argv:  # both runs in this launch, one after the other, each in a folder of its own
        for lora, folder in ((False, "full"), (True, "lora")):
            os.makedirs(os.path.join(out_dir, folder), exist_ok=True)
            run_and_report(os.path.join(out_dir, folder), make_tokenizer(), lora)
    else:
        run_and_report(out_dir, make_tokenizer(), "--lora" in sys.argv)


if __name__ == "__main__":
    main()
