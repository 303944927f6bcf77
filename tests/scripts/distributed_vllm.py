"""Two training processes generating with vLLM (used by test_vllm.py): an in-process engine each (colocate), or one
server shared by both.

accelerate launch --config_file CONFIG tests/scripts/distributed_vllm.py OUT_DIR MODEL_DIR MODE [--url URL] [--lora]
    [--fail-rank R] [--reproducible] [--steps N] [--kill-server PID --kill-at-step S] [--fsdp2] [--unsaved] [--dora]
    [--staleness K] [--bf16] [--in-flight]

MODE is ``colocate`` or ``server``. ``--fail-rank R``: process R's engine raises on its second batch (a fault in one
process). ``--kill-server PID --kill-at-step S``: process 0 kills the server's process group once checkpoint S is
saved (checkpoints every step then). ``--fsdp2``: launched with an FSDP2 config, turned on for CPU by
tests/fsdp_cpu.py (the report says how many parameters are sharded). ``--unsaved``: the model is built in memory (no
checkpoint directory: the colocated engine starts from a copy the trainer writes). ``--dora``: a LoRA config vLLM
cannot serve as an adapter (merged into a private copy). ``--bf16``: bf16 mixed precision (launched with
``mixed_precision: bf16`` too); the report gives the dtypes of the trainable weights, the engine and the staging
buffers. ``--in-flight``: ``in_flight_weight_updates=True`` (colocate, full weights) with the switch points fixed by
the schedule (``vllm_lockstep.EngineLockstep``, lag 2, 4 steps): the report holds each batch's token versions and the
ones the schedule fixes. One JSON report per rank, written also when training fails.
"""

import json
import os
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import distributed_script_config, fail_second_generation, logged  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tiny import length_reward, make_prompts, make_tokenizer, make_vllm_model  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from a3po_trl import AsyncA3POTrainer  # noqa: E402
from a3po_trl import trainer as trainer_module  # noqa: E402
from a3po_trl import training_batch as training_batch_module  # noqa: E402
from a3po_trl.generation.producer import BatchProducer  # noqa: E402


def option(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def sharding(trainer):
    """How the trained model's parameters are held: DTensor shards smaller than the parameter under FSDP2."""
    from torch.distributed.tensor import DTensor

    params = list(trainer._unwrapped_model().named_parameters())
    sharded = [n for n, p in params if isinstance(p, DTensor) and p.to_local().numel() < p.numel()]
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "model_class": type(trainer._unwrapped_model()).__name__,
        "parameters": len(params),
        "sharded_parameters": len(sharded),
    }


def engine_model(backend):
    """The checkpoint a colocated engine started from, and its files (None for a server)."""
    llm = getattr(backend, "llm", None)
    if llm is None:
        return None
    path = str(llm.llm_engine.model_config.model)
    return {"path": path, "files": sorted(os.listdir(path)) if os.path.isdir(path) else None}


def main():
    out_dir, model_dir, mode = sys.argv[1:4]
    if "--fsdp2" in sys.argv:
        from fsdp_cpu import force_fsdp_on_cpu

        force_fsdp_on_cpu()
    lora = "--lora" in sys.argv or "--dora" in sys.argv
    fail_rank = option("--fail-rank")
    settings = dict(
        max_steps=int(option("--steps", 3)),
        use_vllm=True,
        vllm_mode=mode,
        vllm_max_model_length=256,
        scale_rewards="batch",
    )
    if mode == "server":
        settings["vllm_server_base_url"] = option("--url")
    if option("--staleness") is not None:
        settings["max_staleness"] = int(option("--staleness"))
    if "--reproducible" in sys.argv:
        settings["reproducible_generation"] = True
    if "--bf16" in sys.argv:
        settings["bf16"] = True
    in_flight = "--in-flight" in sys.argv
    if in_flight and mode == "colocate":  # batch b >= 2 starts with version b - 2 and takes b - 1 after its 3rd step
        settings.update(in_flight_weight_updates=True, max_staleness=2, max_completion_length=12)
    elif in_flight:  # long completions on a server that sleeps before each step: versions arrive mid-batch
        settings.update(
            in_flight_weight_updates=True, max_staleness=2, max_completion_length=96,
            generation_kwargs={"ignore_eos": True},
        )  # fmt: skip
    kill_pid, kill_step = option("--kill-server"), int(option("--kill-at-step", 0))
    if kill_pid is not None:
        settings.update(save_strategy="steps", save_steps=1, max_staleness=1)
    args = distributed_script_config(out_dir, **settings)
    advantage_calls, local_advantages = [], []
    group_advantages = training_batch_module.group_advantages

    def recording_group_advantages(rewards_per_func, *args, **kwargs):
        result = group_advantages(rewards_per_func, *args, **kwargs)
        advantage_calls.append({"rewards": rewards_per_func.tolist(), "advantages": result[0].tolist()})
        return result

    training_batch_module.group_advantages = recording_group_advantages
    lora_settings = dict(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    peft_config = LoraConfig(**lora_settings, use_dora="--dora" in sys.argv) if lora else None
    tokenizer = make_tokenizer()
    unsaved = "--unsaved" in sys.argv
    trainer = AsyncA3POTrainer(
        model=make_vllm_model(tokenizer) if unsaved else AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(32),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    rank = trainer.accelerator.process_index
    report = {"rank": rank, "world_size": trainer.accelerator.num_processes}
    lockstep = None
    if in_flight and mode == "colocate":
        from vllm_lockstep import EngineLockstep

        lockstep = EngineLockstep(trainer, setattr, lag=2, num_batches=settings["max_steps"])
    make_training_batch = trainer_module.make_training_batch

    def recording_make_training_batch(*args, **kwargs):
        data = make_training_batch(*args, **kwargs)
        local_advantages.append(data["advantages"].tolist())
        return data

    trainer_module.make_training_batch = recording_make_training_batch
    batches = []  # (index, version, oldest allowed version, completion ids) of every batch, as the trainer takes them
    token_versions = []  # each batch's token versions (with in_flight_weight_updates; -1 past a completion's end)
    get = BatchProducer.get

    def recording_get(producer):
        batch, waited = get(producer)
        completions = batch.tensors["completion_ids"].tolist()
        batches.append((batch.index, batch.version, producer.min_version(batch.index), completions))
        if "token_versions" in batch.tensors:
            token_versions.append(batch.tensors["token_versions"].tolist())
        return batch, waited

    BatchProducer.get = recording_get
    if kill_pid is not None and rank == 0:

        class KillServer(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                if state.global_step == kill_step:
                    os.killpg(int(kill_pid), signal.SIGKILL)
                    report["killed_at"] = time.time()

        trainer.add_callback(KillServer())
    if fail_rank is not None and rank == int(fail_rank):
        fail_second_generation(trainer, f"engine failure injected in process {rank}")
    try:
        trainer.train()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(error).__name__}: {error}"
        report["traceback"] = traceback.format_exc()[-3000:]
    history = trainer.state.log_history
    producer = trainer.last_batch_producer
    shared = getattr(trainer._backend, "_shared", None)
    report.update(
        ended_at=time.time(),
        batches=batches,
        shared_switches=shared.switches if shared is not None else None,
        shared_wait_seconds=shared.wait_seconds if shared is not None else None,
        global_step=trainer.state.global_step,
        batches_consumed=producer.consumed if producer is not None else 0,
        adapter=getattr(trainer._backend, "_adapter", None),
        lora_request=getattr(getattr(trainer._backend, "_lora_request", None), "lora_name", None),
        engine_model=engine_model(trainer._backend),
        merge_copy=type(getattr(trainer._backend, "_merge_copy", None)).__name__,
        mixed_precision=trainer.accelerator.mixed_precision,
        trainable_dtypes=sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}),
        engine_dtype=str(trainer._backend.llm.llm_engine.model_config.dtype)
        if hasattr(trainer._backend, "llm")
        else None,
        staging_dtypes=sorted({str(d) for d in trainer._backend.weights.layout.dtypes.values()}),
        staging_device=str(trainer._backend.weights.layout.device),
        max_staleness_seen=max([h["a3po/staleness_max"] for h in history if "a3po/staleness_max" in h] or [-1]),
        mismatch_max=[h["a3po/behavior_mismatch_max"] for h in history if "a3po/behavior_mismatch_max" in h],
        generator_versions=[h["async/generator_version"] for h in history if "async/generator_version" in h],
        advantage_calls=advantage_calls,
        local_advantages=local_advantages,
        threads_alive=sorted(t.name for t in threading.enumerate()),
        **sharding(trainer),  # after train(): the Trainer prepares (shards) the model there
    )
    if in_flight:
        report["batch_token_versions"] = token_versions
        report["in_flight_weight_loads"] = logged(trainer, "async/in_flight_weight_loads")
        report["completion_versions_max"] = logged(trainer, "a3po/completion_versions_max")
    if lockstep is not None and "error" not in report:
        report["token_versions"] = [lockstep.token_versions[i].tolist() for i in sorted(lockstep.token_versions)]
        report["expected_token_versions"] = [
            lockstep.expected_versions(i).tolist() for i in sorted(lockstep.token_versions)
        ]
        report["start_versions"] = lockstep.start_versions
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if trainer._backend is not None:
        trainer._backend.close()
    if "error" in report:
        sys.exit(1)


if __name__ == "__main__":
    main()
