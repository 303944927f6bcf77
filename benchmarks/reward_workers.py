"""What scoring in worker processes (``reward_num_workers``) pays with a CPU-heavy, pure-Python reward.

    python -m benchmarks.reward_workers [--steps 24] [--repeats 5] [--workers 1]
        [--out benchmarks/results/reward_workers-tiny.json]
    python -m benchmarks.reward_workers --model smollm2 --steps 8 --repeats 3 --rounds 400
        [--out benchmarks/results/reward_workers-smollm2-rounds400.json]
    python -m benchmarks.reward_workers --smoke     # a minute: every arm for 3 steps (the test suite's run)

The reward is :func:`benchmarks.common.math_reward.math_verify_reward` (parsing and checking math answers in pure
Python, as ``math_verify``-style rewards do; its seconds per batch are measured first and recorded). On the tiny model
(:mod:`a3po_trl.tasks.tiny_model`: 8 completions of up to 32 tokens per step, ``max_staleness=1``) or on SmolLM2-135M
(``--model smollm2``, converted offline by :mod:`a3po_trl.tasks.offline_model`; the same shape and prompts, learning
rate 1e-5, bf16 off on a CPU as the README's example sets it; the tiny model's arms keep ``GRPOConfig``'s bf16
default, as their committed records ran), three arms run
interleaved at seeds ``0 .. --repeats - 1`` (the model's initialization and the run's), at the library's defaults
(thread counts and ``OMP_WAIT_POLICY`` as users leave them); the summary pairs the arms seed by seed (mean difference,
95% t interval, Holm within each quantity):

- ``grpo``: TRL's ``GRPOTrainer`` with the same reward (in its training loop);
- ``thread``: ``AsyncA3POTrainer`` with ``reward_num_workers=0``: the reward runs in the generation thread;
- ``workers``: ``AsyncA3POTrainer`` with ``reward_num_workers=--workers``: the reward runs in worker processes.

Each run records per optimizer step its wall time, the training thread's CPU time, its wait for a batch
(``async/trainer_wait_time``), and the training thread's **stall**: the wall time it neither ran nor waited for a
batch (wall - CPU - wait), which is where a reward holding the interpreter lock in the generation thread shows. The
first ``--skip`` steps of each run are left out (the workers' start). Every run and the record carry the provenance
block (:mod:`benchmarks.common.provenance`), with the share of the machine other processes took (the reward
workers, child processes ended with the run, count as the run's own): a busy machine's record says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

from benchmarks.common.machine import LoadMeter
from benchmarks.common.math_reward import DEFAULT_ROUNDS, ROUNDS_ENV, math_verify_reward
from benchmarks.common.provenance import provenance, thread_roles, trainer_threads

ARMS = ("grpo", "thread", "workers")
SHAPE = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=32)
"""8 completions of up to 32 tokens per optimizer step: the launch-bound proxy's shape."""


def reward_seconds_per_batch(batches: int = 20) -> float:
    """Median seconds of one call of the reward on a batch of the benchmark's size (8 completions), in this process."""
    completions = [[{"role": "assistant", "content": f"{i} + {i + 3} = {2 * i + 3}"}] for i in range(8)]
    answers = [str(2 * i + 3) for i in range(8)]
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        math_verify_reward(completions, answers)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


MODELS = ("tiny", "smollm2")
MODEL_NAMES = {
    "tiny": "tiny (a3po_trl.tasks.tiny_model: random 2-layer Llama, hidden 32, byte tokenizer)",
    "smollm2": "SmolLM2-135M-Instruct (a3po_trl.tasks.offline_model, float32, lr 1e-5)",
}


def _model_and_tokenizer(model: str, seed: int):
    """The tiny model initialized from ``seed``, or SmolLM2-135M-Instruct (its pretrained weights: ``seed`` seeds the
    run only), with the settings each model trains with here."""
    if model == "tiny":
        from a3po_trl.tasks.tiny_model import make_byte_tokenizer, make_tiny_llama

        tokenizer = make_byte_tokenizer()
        return make_tiny_llama(tokenizer, seed=seed), tokenizer, dict(learning_rate=1e-2)
    from benchmarks.compare.trainers import load_model_and_tokenizer  # float32, as the compare benchmark loads it

    network, tokenizer, _ = load_model_and_tokenizer({"model": model})
    return network, tokenizer, dict(learning_rate=1e-5, bf16=False)  # the runs are on the CPU (use_cpu)


def _trainer(arm: str, output_dir: str, steps: int, workers: int, seed: int, model: str = "tiny"):
    from a3po_trl.tasks.tiny_model import make_sum_prompts

    network, tokenizer, model_settings = _model_and_tokenizer(model, seed)
    settings = dict(
        output_dir=output_dir,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        max_steps=steps,
        logging_steps=1,
        seed=seed,
        **model_settings,
        **SHAPE,
    )
    kwargs = dict(
        model=network,
        reward_funcs=[math_verify_reward],
        train_dataset=make_sum_prompts(64),
        processing_class=tokenizer,
    )
    if arm == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOTrainer(args=GRPOConfig(**settings), **kwargs)
    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer

    reward_num_workers = workers if arm == "workers" else 0
    args = AsyncA3POConfig(max_staleness=1, reward_num_workers=reward_num_workers, **settings)
    return AsyncA3POTrainer(args=args, **kwargs)


def run(arm: str, steps: int, workers: int, skip: int, seed: int, model: str = "tiny") -> dict:
    """One training run of ``arm`` at ``seed`` (the model's initialization and the run's): per-step wall, CPU, wait
    and stall seconds, their medians after ``skip`` steps, and its provenance block."""
    import torch

    from benchmarks.compare.trainers import step_timer_callback

    started, meter, process = time.time(), LoadMeter(children=True).start(), torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="a3po-reward-workers-") as output_dir:
        trainer = _trainer(arm, output_dir, steps, workers, seed, model)
        timer = step_timer_callback()
        timer.trainer = trainer
        trainer.add_callback(timer)
        train_start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - train_start
    ends = [timer.begin, *timer.step_ends]
    cpu = [0.0, *timer.trainer_cpu]
    wall = [b - a for a, b in zip(ends, ends[1:])]
    cpu = [b - a for a, b in zip(cpu, cpu[1:])]
    waits = [h["async/trainer_wait_time"] for h in trainer.state.log_history if "async/trainer_wait_time" in h]
    waits = waits if len(waits) == len(wall) else [0.0] * len(wall)  # GRPOTrainer waits for nothing
    stalls = [max(0.0, w - c - t) for w, c, t in zip(wall, cpu, waits)]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    threads = thread_roles(None, None, process) if arm == "grpo" else trainer_threads(trainer, process)
    return {
        "arm": arm,
        "seed": seed,
        "train_seconds": train_seconds,
        "step_seconds": wall,
        "training_cpu_seconds": cpu,
        "trainer_wait_seconds": waits,
        "stall_seconds": stalls,
        "step_time_median": statistics.median(wall[skip:]),
        "stall_median": statistics.median(stalls[skip:]),
        "stall_fraction": sum(stalls[skip:]) / sum(wall[skip:]),
        "mean_reward": statistics.fmean(rewards) if rewards else None,
        "provenance": provenance(started, threads, meter.stop()["foreign_cpu_frac"]),
    }


#: The paired comparisons of the summary (one family: Holm within it), each ``(a, b)`` for ``a - b`` per seed.
COMPARISONS = (("workers", "thread"), ("thread", "grpo"), ("workers", "grpo"))


def summarize(runs: list[dict]) -> dict:
    """Per arm the median over seeds of each run's median step time, median stall, stall share and train() time; the
    ratios of ``workers`` to ``thread`` and of each asynchronous arm to ``grpo``; and per pair of arms the mean paired
    difference of the median step time and of the median stall over the seeds both ran, with its 95% t interval and
    its p-value, Holm-adjusted within each of the two families (step time, stall)."""
    from benchmarks.common.intervals import holm_within, mean_interval, p_value

    summary = {}
    for arm in ARMS:
        of_arm = [r for r in runs if r["arm"] == arm]
        if of_arm:
            summary[arm] = {
                key: statistics.median(r[key] for r in of_arm)
                for key in ("step_time_median", "stall_median", "stall_fraction", "train_seconds")
            }
    step = {arm: values["step_time_median"] for arm, values in summary.items()}
    if "thread" in step and "workers" in step:
        summary["workers_over_thread_step_time"] = step["workers"] / step["thread"]
    for arm in ("thread", "workers"):
        if arm in step and "grpo" in step:
            summary[f"{arm}_over_grpo_step_time"] = step[arm] / step["grpo"]
    by_seed = {arm: {r.get("seed", 0): r for r in runs if r["arm"] == arm} for arm in ARMS}
    rows = []
    for key in ("step_time_median", "stall_median"):
        for a, b in COMPARISONS:
            seeds = sorted(by_seed[a].keys() & by_seed[b].keys())
            if not seeds:
                continue
            differences = [by_seed[a][seed][key] - by_seed[b][seed][key] for seed in seeds]
            interval = mean_interval(differences)
            rows.append(
                {
                    "quantity": key,
                    "comparison": f"{a} - {b}",
                    "seeds": seeds,
                    "mean": interval.mean,
                    "interval": [interval.low, interval.high],
                    "p": p_value(differences) if len(differences) > 1 else None,
                }
            )
    holm_within(rows, "quantity")
    summary["paired"] = rows
    return summary


def measure(steps: int, repeats: int, workers: int, skip: int, rounds: int, model: str = "tiny") -> dict:
    """The reward's cost, then ``repeats`` interleaved runs of every arm (see the module's docstring)."""
    import torch

    os.environ[ROUNDS_ENV] = str(rounds)  # the workers inherit it
    started, meter, process = time.time(), LoadMeter(children=True).start(), torch.get_num_threads()
    meta = {
        "model": MODEL_NAMES[model],
        "model_key": model,
        "reward": "benchmarks.common.math_reward.math_verify_reward",
        "reward_rounds": rounds,
        "reward_seconds_per_batch": reward_seconds_per_batch(),
        "shape": SHAPE,
        "steps": steps,
        "skipped_steps": skip,
        "repeats": repeats,
        "seeds": list(range(repeats)),
        "reward_num_workers": workers,
        "load_average_before": list(os.getloadavg()),
    }
    runs = []
    for seed in range(repeats):
        for arm in ARMS:
            print(f"[reward_workers] {model} {arm} seed {seed} ({len(runs) + 1} of {repeats * len(ARMS)})", flush=True)
            runs.append(run(arm, steps, workers, skip, seed, model))
    meta["load_average_after"] = list(os.getloadavg())
    meta["provenance"] = provenance(started, thread_roles(None, None, process), meter.stop()["foreign_cpu_frac"])
    return {"meta": meta, "runs": runs, "summary": summarize(runs)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="tiny", help="the tiny model or SmolLM2-135M (offline)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5, help="seeds 0 .. repeats - 1, each running every arm")
    parser.add_argument("--workers", type=int, default=1, help="reward_num_workers of the workers arm")
    parser.add_argument("--skip", type=int, default=2, help="first steps of each run left out of its medians")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="the reward's cost (rewritten forms)")
    parser.add_argument("--out", default=None, help="JSON file for the record")
    parser.add_argument("--smoke", action="store_true", help="every arm once for 3 steps, a cheap reward")
    options = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = dict(steps=options.steps, repeats=options.repeats, skip=options.skip, rounds=options.rounds)
    if options.smoke:
        sizes = dict(steps=3, repeats=1, skip=1, rounds=2)
    logging.disable(logging.WARNING)  # the runs' warnings (tiny model, CPU) would bury the results
    try:
        record = measure(workers=options.workers, model=options.model, **sizes)
    finally:
        logging.disable(logging.NOTSET)
    text = json.dumps(record, indent=2)
    print(json.dumps(record["summary"], indent=2))
    if options.out:
        os.makedirs(os.path.dirname(os.path.abspath(options.out)), exist_ok=True)
        with open(options.out, "w") as handle:
            handle.write(text + "\n")
    return record


if __name__ == "__main__":
    main()
