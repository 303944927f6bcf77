"""Train a tiny model under `accelerate launch` and write one JSON report per rank (used by test_distributed.py).

accelerate launch --config_file CONFIG tests/scripts/distributed_tiny.py OUT_DIR [--lora] [--reward-model] [--tools]
    [--dynamic-sampling]
    [--in-flight] [--generation-process] [--fail-rank R] [--slow-rank R] [--stuck-rank R]

``--tools`` trains with an environment (a counter tool and an environment-owned reward) through a scripted
``generate`` that calls the tool on a third of the rows: the report then says which threads ran the tool calls and
the logged tool statistics.

``--dynamic-sampling`` trains with ``dynamic_sampling=True`` and a reward that is flat for every other prompt: the
report then holds the prompts this process drew, and how many generation batches it drew beyond one per batch.
``--in-flight`` trains with ``in_flight_weight_updates=True`` and deterministic switch points (``helpers.Lockstep``,
lag 1): the report then holds each batch's token versions and the versions the schedule says they must be.

``--generation-process`` trains with ``generation_process=True`` and ``reproducible_generation=True`` (``--thread``:
the same with the thread, the reference): the report then holds the trainer's weights before and after training (a
hash of each one's bytes), the generation processes' pids seen during training, and the children alive after it.

``--slow-rank R`` starts the process group with a timeout of ``SLOW_TIMEOUT`` seconds (what ``ddp_timeout`` sets, but
transformers passes it on only off the CPU) and makes process R's second ``generate`` call take ``SLOW_GENERATION``
seconds more, three times that timeout, with ``generation_batch_timeout`` above it: the other process waits that long
for R to take its batch.

``--stuck-rank R`` starts the process group with a timeout of ``SLOW_TIMEOUT`` seconds, and process R's reward function
(``stuck_reward``) never returns from its second call: each process's report then holds only the error its
``train()`` raised (with ``generation_batch_timeout`` left None: the process group's timeout bounds the wait), when it
was raised and when process R's reward function got stuck (``time.time()``), and the process exits with 1.

``--fail-rank R``: process R's generation raises on its second batch, while the other process has its own second
batch: each process's report then holds only the error its ``train()`` raised and the threads left, and the process
exits with 1.

``--reward-model`` adds a reward model beside the reward function and normalises advantages with the batch's std
(``scale_rewards="batch"``), both of which need every process: the report then says which thread ran the reward
model and holds this process's rewards and advantages, for the test to recompute them globally.
"""

import datetime
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import (  # noqa: E402
    Lockstep,
    distributed_script_config,
    fail_second_generation,
    generator_matches,
    logged,
    slow_second_generation,
)
from tiny import (  # noqa: E402
    CALL,
    DONE,
    length_reward,
    make_model,
    make_prompts,
    make_reward_model,
    make_tokenizer,
    make_tool_tokenizer,
    scripted_generate,
)

from a3po_trl import AsyncA3POTrainer  # noqa: E402
from a3po_trl import trainer as trainer_module  # noqa: E402
from a3po_trl import training_batch as training_batch_module  # noqa: E402
from a3po_trl.runtime.distributed import teardown_registered  # noqa: E402

#: ``--slow-rank``: the process group's timeout (``ddp_timeout``), and how much longer the slow process's generation
#: takes once.
SLOW_TIMEOUT = 10
SLOW_GENERATION = 3 * SLOW_TIMEOUT


def main():
    out_dir = sys.argv[1]
    lora = "--lora" in sys.argv
    with_reward_model = "--reward-model" in sys.argv
    with_tools = "--tools" in sys.argv
    dynamic_sampling = "--dynamic-sampling" in sys.argv
    in_flight = "--in-flight" in sys.argv
    generation_process = "--generation-process" in sys.argv
    reproducible = generation_process or "--thread" in sys.argv
    fail_rank = int(sys.argv[sys.argv.index("--fail-rank") + 1]) if "--fail-rank" in sys.argv else None
    slow_rank = int(sys.argv[sys.argv.index("--slow-rank") + 1]) if "--slow-rank" in sys.argv else None
    stuck_rank = int(sys.argv[sys.argv.index("--stuck-rank") + 1]) if "--stuck-rank" in sys.argv else None
    tokenizer = make_tool_tokenizer() if with_tools else make_tokenizer()
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    reward_funcs, reward_processing_classes = [length_reward], None
    reward_model_threads, advantage_calls = [], []
    if with_reward_model:  # built before the config, which would make transformers build it partitioned (ZeRO-3)
        reward_model = make_reward_model(tokenizer)
        reward_model.register_forward_pre_hook(
            lambda *args: reward_model_threads.append(threading.current_thread().name)
        )
        reward_funcs, reward_processing_classes = [length_reward, reward_model], [None, tokenizer]
        group_advantages = training_batch_module.group_advantages

        def recording_group_advantages(rewards_per_func, *args, **kwargs):
            result = group_advantages(rewards_per_func, *args, **kwargs)
            advantage_calls.append({"rewards": rewards_per_func.tolist(), "advantages": result[0].tolist()})
            return result

        training_batch_module.group_advantages = recording_group_advantages
    if slow_rank is not None or stuck_rank is not None:  # before the config, whose device setup would start the
        import torch.distributed as dist  # group with the default timeout

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=SLOW_TIMEOUT))
    stuck_since = []
    if stuck_rank is not None:
        reward_funcs = [_stuck_on_second_call(stuck_since, stuck=dist.get_rank() == stuck_rank)]
    drawn = []
    if dynamic_sampling:  # a flat reward for every other prompt: the generator draws more to fill each batch
        reward_funcs = [_half_flat_reward(drawn)]
    args = distributed_script_config(
        out_dir,
        scale_rewards="batch" if with_reward_model else "group",
        dynamic_sampling=dynamic_sampling,
        in_flight_weight_updates=in_flight,
        # the slow process's generation outlasts the process group's timeout: the bound on the wait must be longer
        generation_batch_timeout=20 * SLOW_TIMEOUT if slow_rank is not None else None,
        generation_stop_timeout=1.0 if stuck_rank is not None else 30.0,
        generation_process=generation_process,
        reproducible_generation=reproducible,
    )
    model, tool_threads, extra = make_model(tokenizer), [], {}
    if with_tools:
        model = make_model(tokenizer, max_position_embeddings=2048)
        model.generate = scripted_generate(tokenizer, _counter_script)
        extra["environment_factory"] = _counter_environment(tool_threads)
        reward_funcs = []
        args.max_completion_length = 256
    trainer = AsyncA3POTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=make_prompts(32),
        processing_class=tokenizer,
        reward_processing_classes=reward_processing_classes,
        peft_config=peft_config,
        **extra,
    )
    lockstep = Lockstep(trainer, setattr, lag=1, num_batches=4) if in_flight else None
    local_advantages = []
    make_training_batch = trainer_module.make_training_batch

    def recording_make_training_batch(*args, **kwargs):
        data = make_training_batch(*args, **kwargs)
        local_advantages.append(data["advantages"].tolist())
        return data

    trainer_module.make_training_batch = recording_make_training_batch
    if fail_rank is not None:
        return _fail_second_batch_in(trainer, fail_rank, out_dir)  # exits with 1
    if stuck_rank is not None:
        return _train_expecting_an_error(trainer, out_dir, stuck_since=stuck_since)  # exits with 1
    if slow_rank == trainer.accelerator.process_index:
        slow_second_generation(trainer, SLOW_GENERATION)
    if reproducible:
        return _train_and_report_weights(trainer, out_dir)
    trainer.train()
    policy = trainer.last_batch_producer.backend
    policy.refresh()  # load the last published weights (version = final global_step)
    state = trainer.accelerator.state
    report = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(state.distributed_type),
        "zero_stage": state.deepspeed_plugin.zero_stage if state.deepspeed_plugin else None,
        "global_step": trainer.state.global_step,
        "generator_version": policy.version,
        "generator_checksum": sum(p.double().sum().item() for p in policy.module.parameters()),
        "generator_matches_trainer": generator_matches(policy, trainer.accelerator.unwrap_model(trainer.model)),
        "copied_parameters": policy.copied_parameter_count,
        "shared_parameters": policy.shared_parameter_count,
        "batches_consumed": trainer.last_batch_producer.consumed,
        "max_staleness_seen": max(
            h["a3po/staleness_max"] for h in trainer.state.log_history if "a3po/staleness_max" in h
        ),
        "threads_alive": sorted(t.name for t in threading.enumerate()),
        "process_group_teardown_registered": teardown_registered(),
        "reward_model_threads": sorted(set(reward_model_threads)),
        "advantage_calls": advantage_calls,
        "local_advantages": local_advantages,
        "tool_threads": sorted(set(tool_threads)),
        "environment_counts": [e.count for e in trainer.environments or []],
        "tool_call_frequency": [
            h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h
        ],
        "drawn_prompts": drawn,
        "frac_reward_zero_std": [h["frac_reward_zero_std"] for h in trainer.state.log_history if "reward" in h],
        "extra_batches": [
            h["a3po/dynamic_sampling_extra_batches"]
            for h in trainer.state.log_history
            if "a3po/dynamic_sampling_extra_batches" in h
        ],
        "micro_steps": trainer._step,
        "environment_rewards": [
            h["rewards/Counter/mean"] for h in trainer.state.log_history if "rewards/Counter/mean" in h
        ],
    }
    if lockstep is not None:
        report["token_versions"] = [lockstep.token_versions[i].tolist() for i in range(4)]
        report["expected_token_versions"] = [lockstep.expected_versions(i).tolist() for i in range(4)]
        report["in_flight_weight_loads"] = logged(trainer, "async/in_flight_weight_loads")
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    # No explicit destroy_process_group here, as in TRL's own scripts: the trainer registered it with atexit
    # (a3po_trl/distributed.py), which is what keeps gloo from aborting a rank at interpreter exit.


def _train_and_report_weights(trainer, out_dir):
    """Train (``--generation-process`` / ``--thread``); write the trainer's weights before and after (a hash of each
    one's bytes), the generation processes' pids seen at each step and the children alive after ``train()``."""
    import hashlib
    import multiprocessing

    from transformers import TrainerCallback

    pids = []

    class RecordGenerationPid(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            pids.append(getattr(trainer._backend, "pid", None))

    def hashes(model):
        return {name: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for name, p in model.named_parameters()}

    trainer.add_callback(RecordGenerationPid())
    before = hashes(trainer.model)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    report = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "pid": os.getpid(),
        "global_step": trainer.state.global_step,
        "weights_before": before,
        "weights": hashes(model),
        "generator_versions": logged(trainer, "async/generator_version"),
        "generation_pids": pids,
        "children_alive": [child.pid for child in multiprocessing.active_children()],
        "threads_alive": sorted(t.name for t in threading.enumerate()),
    }
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)


def _fail_second_batch_in(trainer, fail_rank, out_dir):
    """Make process ``fail_rank``'s backend raise on its second batch, then train: each process writes its error."""
    rank = trainer.accelerator.process_index
    if rank == fail_rank:
        fail_second_generation(trainer, f"generation failure injected in process {rank}")
    _train_expecting_an_error(trainer, out_dir)


def _train_expecting_an_error(trainer, out_dir, **extra):
    """Train; each process writes the error its ``train()`` raised (with ``extra``) and exits with 1."""
    rank = trainer.accelerator.process_index
    try:
        trainer.train()
    except Exception as error:
        threads = sorted(t.name for t in threading.enumerate())
        report = {"error": f"{type(error).__name__}: {error}", "threads_alive": threads, "raised_at": time.time()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({**report, **extra}, f)
        sys.exit(1)
    raise AssertionError(f"train() ended without an error in process {rank}")


def _stuck_on_second_call(stuck_since, stuck: bool):
    """``length_reward`` (named alike on every process), but when ``stuck`` its second call never returns (a reward
    function waiting on something that never comes); records when it got stuck."""
    calls = []

    def stuck_reward(completions, **kwargs):
        calls.append(1)
        if stuck and len(calls) == 2:
            stuck_since.append(time.time())
            threading.Event().wait()
        return length_reward(completions)

    return stuck_reward


def _half_flat_reward(drawn):
    """``length_reward``, but a constant for prompts whose answer is 3 mod 4 (every other one); records the prompt of
    each group drawn."""

    def half_flat(completions, answer, prompts, **kwargs):
        drawn.extend(p[-1]["content"] for p in prompts[::4])
        return [1.0 if int(a) % 4 == 3 else r for a, r in zip(answer, length_reward(completions))]

    return half_flat


def _counter_script(text):
    """Every third row (by its number in the prompt) calls the environment's tool, the others answer."""
    if "<tool_response>" in text:
        return DONE
    number = int(text.split("What is ")[-1].split(" ")[0])
    return CALL.format(name="increment", arguments='{"step": 1}') if number % 3 == 0 else "No.<|im_end|>"


def _counter_environment(tool_threads):
    class Counter:
        def reset(self, **kwargs):
            self.count = 0

        def increment(self, step: int) -> int:
            """
            Increment the counter.

            Args:
                step: Value to add.
            """
            tool_threads.append(threading.current_thread().name)
            self.count += step
            return self.count

        def get_reward(self) -> float:
            return float(self.count)

    return Counter


if __name__ == "__main__":
    main()
