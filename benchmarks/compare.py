"""TRL's GRPOTrainer vs AsyncA3POTrainer (recompute / loglinear at several staleness bounds), in one invocation.

    python benchmarks/compare.py --quick                          # tiny random Llama, a few minutes on 2 CPU cores
    python benchmarks/compare.py --model smollm2 --steps 16       # SmolLM2-135M-Instruct, offline
    python benchmarks/compare.py --model smollm2 --device cuda    # the same on a GPU (generator on cuda:1 if present)

Every configuration runs on the same model, data, seed, batch shape and step count, one after another, each in its
own fresh subprocess (``--isolation process``, the default) so that peak memory and thread settings never leak from
one configuration into the next:

- ``trl``: TRL's synchronous ``GRPOTrainer`` (the baseline);
- ``recompute-s{d}`` / ``loglinear-s{d}``: ``AsyncA3POTrainer`` with ``prox_logp_method`` recompute or loglinear and
  ``max_staleness=d`` for every ``d`` of ``--staleness`` (default 0, 1, 2, 4);
- ``pieces-{method}``: ``AsyncA3POTrainer`` with ``async_generation=False`` (generation in the main thread, on the
  training thread's thread count): per step, generation alone (``async/trainer_wait_time``: rollout, behavior
  log-probs, rewards) and training alone (step time minus that), so the ideal pipelined step time
  ``max(generation, training)`` can be compared with what the asynchronous trainer achieved;
- ``microbench``: one ``loglinear`` proximal computation (``a3po_trl.approximate_proximal_logps`` on a ``(B, T)``
  batch) vs one ``recompute`` forward (the trainer's own no-grad ``_get_per_token_logps_and_entropies``) on the same
  batch, median over repetitions.

It writes ``<out>/<name>.json`` (every run, raw per-step series and summaries, the targets and whether they were
met), ``<out>/<name>.md`` (tables) and ``<out>/<name>.png``. Timings are measured, never asserted.

While a configuration runs, the CPU time used by *other* processes is measured from ``/proc/stat`` and reported
(``foreign_cpu_frac``); before each configuration the benchmark waits (at most ``--quiet-wait`` seconds) until the
machine is quiet, because on a small shared machine another process taking one core slows a two-thread run many
times over.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")

DEFAULT_STALENESS = (0, 1, 2, 4)
METHODS = ("recompute", "loglinear")

# Per-step metrics read from the trainers' logs (name in the report -> key in log_history).
LOGGED_METRICS = {
    "prox_time": "a3po/prox_time",
    "generation_time": "async/generation_time",
    "behavior_logps_time": "async/behavior_logps_time",
    "reward_time": "async/reward_time",
    "trainer_wait_time": "async/trainer_wait_time",
    "generator_wait_time": "async/generator_wait_time",
    "weight_sync_time": "async/weight_sync_time",
    "queue_depth": "async/queue_depth",
    "generation_tokens_per_second": "async/completion_tokens_per_second",
    "staleness_mean": "a3po/staleness_mean",
    "staleness_max": "a3po/staleness_max",
    "behavior_policy_weight_mean": "a3po/behavior_policy_weight_mean",
    "importance_weight_mean": "a3po/importance_weight_mean",
    "importance_weight_max": "a3po/importance_weight_max",
    "importance_weight_masked_frac": "a3po/importance_weight_masked_frac",
    "clip_ratio_low": "clip_ratio/low_mean",
    "clip_ratio_high": "clip_ratio/high_mean",
    "clip_ratio_region": "clip_ratio/region_mean",
    "reward": "reward",
    "reward_std": "reward_std",
    "completion_mean_length": "completions/mean_length",
    "entropy": "entropy",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "trl_step_time": "step_time",
    # measured by the benchmark's GRPOTrainer subclass (TRL does not log these)
    "trl_generation_time": "bench/generation_time",
    "trl_reward_time": "bench/reward_time",
}

MODEL_PRESETS = {
    # batch shapes chosen for 2 CPU cores: one optimizer step per generation batch, one group per step for smollm2
    "tiny": dict(batch_size=8, num_generations=4, max_completion_length=16, learning_rate=1e-3, steps=24, quick=8),
    "smollm2": dict(batch_size=8, num_generations=8, max_completion_length=32, learning_rate=1e-5, steps=16, quick=4),
    "other": dict(batch_size=8, num_generations=8, max_completion_length=32, learning_rate=1e-5, steps=16, quick=4),
}


# =====================================================================================================================
# Command line and plan
# =====================================================================================================================


#: Run-length defaults of ``--quick`` and of a full run (the number of steps comes from the model's preset).
RUN_DEFAULTS = {
    "quick": dict(seeds=1, warmup_steps=1, microbench_reps=3, quiet_wait=20.0, max_foreign=1.0),
    "full": dict(seeds=3, warmup_steps=2, microbench_reps=10, quiet_wait=120.0, max_foreign=0.2),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="tiny, smollm2, or any HF id / local path (default: tiny)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps, one seed, every configuration")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per configuration (default 3, quick 1)")
    parser.add_argument("--seed", type=int, default=0, help="first seed; seed i is seed + i")
    parser.add_argument(
        "--extra-seeds-for",
        default="all",
        help="configurations repeated on the seeds after the first (comma list of names or prefixes; 'all')",
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per configuration")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out of timings (default 2, 1)")
    parser.add_argument("--final-window", type=int, default=None, help="last steps averaged for the final reward")
    parser.add_argument("--staleness", default=",".join(map(str, DEFAULT_STALENESS)), help="max_staleness values")
    parser.add_argument(
        "--configs",
        default="all",
        help="comma list of configurations to run, by name or prefix: trl, recompute, loglinear, recompute-s1, "
        "pieces, pieces-loglinear, microbench, ... (default: all)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="per_device_train_batch_size")
    parser.add_argument("--num-generations", type=int, default=None)
    parser.add_argument("--max-completion-length", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--num-prompts", type=int, default=256, help="size of the generated math dataset")
    parser.add_argument("--difficulty", default="easy", help="difficulty of the generated math problems")
    parser.add_argument(
        "--sync-threads",
        type=int,
        default=None,
        help="CPU intra-op threads of the synchronous baseline (default: all cores)",
    )
    parser.add_argument("--generation-threads", type=int, default=1, help="CPU: generation_num_threads")
    parser.add_argument("--training-threads", type=int, default=1, help="CPU: training_num_threads")
    parser.add_argument("--bf16", choices=["auto", "on", "off"], default="auto", help="auto: off on CPU")
    parser.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of the workers on CPU ('default': leave it unset). PASSIVE keeps a multi-thread run "
        "from collapsing when another process holds a core (measured here: 2-thread matmuls 20-40x slower with the "
        "default spinning policy, 1.2x with PASSIVE)",
    )
    parser.add_argument("--microbench-reps", type=int, default=None, help="recompute repetitions (default 10, 3)")
    parser.add_argument(
        "--isolation",
        choices=["process", "shared"],
        default="process",
        help="process: a fresh subprocess per configuration (clean peak RSS); shared: one subprocess runs them all "
        "(peak RSS from VmHWM, reset between configurations; faster start-up, for tests)",
    )
    parser.add_argument("--quiet-wait", type=float, default=None, help="max seconds to wait for a quiet machine")
    parser.add_argument("--quiet-threshold", type=float, default=0.15, help="foreign CPU fraction counted as quiet")
    parser.add_argument("--config-timeout", type=float, default=3600.0, help="seconds per configuration subprocess")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=None,
        help="rerun a configuration (up to --retries times) when other processes used more than this share of the "
        "machine during it (default 0.2; quick: never)",
    )
    parser.add_argument("--retries", type=int, default=1, help="reruns of a configuration disturbed by other load")
    parser.add_argument(
        "--budget-minutes", type=float, default=None, help="no more reruns once the benchmark has run this long"
    )
    parser.add_argument("--profile", default="", help="comma list of configuration names to profile (py-spy)")
    parser.add_argument("--py-spy", default=None, help="py-spy executable (default: from PATH)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="output directory")
    parser.add_argument("--name", default=None, help="file name stem of the outputs (default compare-<model>)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' logs under <out>/logs")
    parser.add_argument(
        "--merge-from",
        default=None,
        help="a previous report JSON of the same settings: its runs that this invocation does not run again are "
        "merged into this report (to resume, or to rerun only the runs another process disturbed)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        return options

    if options.model is None:
        options.model = "tiny"
    preset = MODEL_PRESETS.get(model_key(options.model), MODEL_PRESETS["other"])
    mode = "quick" if options.quick else "full"
    run_defaults = {**RUN_DEFAULTS[mode], "steps": preset["quick" if options.quick else "steps"]}
    for name, value in run_defaults.items():
        if getattr(options, name) is None:  # a value given on the command line always wins
            setattr(options, name, value)
    for name in ("seeds", "steps", "microbench_reps"):
        if getattr(options, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    options.batch_size = options.batch_size or preset["batch_size"]
    options.num_generations = options.num_generations or preset["num_generations"]
    options.max_completion_length = options.max_completion_length or preset["max_completion_length"]
    options.learning_rate = options.learning_rate or preset["learning_rate"]
    options.final_window = options.final_window or max(1, min(5, options.steps // 4))
    options.staleness = sorted({int(s) for s in str(options.staleness).split(",") if s.strip()})
    if options.steps <= options.warmup_steps:
        raise SystemExit(f"--steps ({options.steps}) must be larger than --warmup-steps ({options.warmup_steps})")
    if options.batch_size % options.num_generations:
        raise SystemExit("--batch-size must be a multiple of --num-generations (whole groups per step)")
    if options.name is None:
        options.name = f"compare-{model_key(options.model)}" + ("-quick" if options.quick else "")
    return options


def model_key(model: str) -> str:
    if model == "tiny":
        return "tiny"
    if model.lower() in ("smollm2", "smollm2-135m-instruct", "smollm2-135m"):
        return "smollm2"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model.rstrip("/").split("/")[-1]) or "model"


def _selected(name: str, patterns: str) -> bool:
    if patterns.strip() in ("", "all"):
        return True
    for pattern in (p.strip() for p in patterns.split(",")):
        if pattern and (name == pattern or name.startswith(pattern + "-") or name.startswith(pattern)):
            return True
    return False


def config_names(staleness, single_thread_trl: bool = False) -> list[str]:
    names = ["microbench", "trl"] + (["trl-t1"] if single_thread_trl else [])
    names += ["pieces-loglinear", "pieces-recompute"]
    for d in staleness:  # the two methods side by side at each bound: little drift between the pair compared
        names += [f"{method}-s{d}" for method in METHODS]
    return names


def build_plan(options) -> list[dict]:
    """The runs, in order: every selected configuration on the first seed, then the repeated ones on the others."""
    plan = []
    names = [n for n in config_names(options.staleness, _single_thread_trl(options)) if _selected(n, options.configs)]
    for index in range(options.seeds):
        seed = options.seed + index
        for name in names:
            if name == "microbench" and index > 0:
                continue
            if index > 0 and not _selected(name, options.extra_seeds_for):
                continue
            plan.append(config_for(name, seed, options))
    return plan


def _single_thread_trl(options) -> bool:
    """On CPU with several baseline threads, also run the baseline on one thread; the fastest is the baseline."""
    return options.device == "cpu" and (options.sync_threads or os.cpu_count() or 1) > 1


def config_for(name: str, seed: int, options) -> dict:
    cpu = options.device == "cpu"
    sync_threads = options.sync_threads or os.cpu_count() or 1
    config = {"name": name, "run_id": f"{name}@seed{seed}", "seed": seed}
    if name == "microbench":
        threads = sorted({options.training_threads, sync_threads}) if cpu else [None]
        config.update(kind="microbench", thread_counts=threads, reps=options.microbench_reps)
    elif name in ("trl", "trl-t1"):
        threads = 1 if name == "trl-t1" else sync_threads
        config.update(kind="trl", method=None, max_staleness=0, threads={"process": threads if cpu else None})
    elif name.startswith("pieces-"):
        config.update(
            kind="pieces",
            method=name.split("-", 1)[1],
            max_staleness=0,
            async_generation=False,
            # generation runs in the main thread, so both pieces run on the training thread's thread count
            threads={"process": sync_threads if cpu else None, "training": options.training_threads if cpu else None},
        )
    else:
        method, staleness = name.rsplit("-s", 1)
        config.update(
            kind="a3po",
            method=method,
            max_staleness=int(staleness),
            async_generation=True,
            threads={
                "process": sync_threads if cpu else None,
                "training": options.training_threads if cpu else None,
                "generation": options.generation_threads if cpu else None,
            },
        )
    return config


def common_settings(options) -> dict:
    cpu = options.device == "cpu"
    bf16 = {"on": True, "off": False}.get(options.bf16, not cpu)
    return {
        "model": options.model,
        "model_key": model_key(options.model),
        "device": options.device,
        "bf16": bf16,
        "steps": options.steps,
        "warmup_steps": options.warmup_steps,
        "batch_size": options.batch_size,
        "num_generations": options.num_generations,
        "max_completion_length": options.max_completion_length,
        "learning_rate": options.learning_rate,
        "num_prompts": options.num_prompts,
        "difficulty": options.difficulty,
        "isolation": options.isolation,
        "quiet_wait": options.quiet_wait,
        "quiet_threshold": options.quiet_threshold,
    }


# =====================================================================================================================
# Machine load: /proc/stat, own CPU, waiting for a quiet machine
# =====================================================================================================================


def _proc_stat() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine since boot, or None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0.0
    return (user + nice + system + irq + softirq) / hz, steal / hz


def _own_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class LoadMeter:
    """CPU seconds used by other processes (and stolen by the hypervisor) between start() and stop()."""

    def start(self):
        self._stat, self._own, self._wall = _proc_stat(), _own_cpu(), time.perf_counter()
        return self

    def stop(self) -> dict:
        stat, own, wall = _proc_stat(), _own_cpu(), time.perf_counter()
        seconds = max(wall - self._wall, 1e-9)
        cores = os.cpu_count() or 1
        if stat is None or self._stat is None:
            return {"foreign_cpu_frac": None, "steal_frac": None, "own_cpu_frac": (own - self._own) / seconds / cores}
        busy = stat[0] - self._stat[0]
        foreign = max(0.0, busy - (own - self._own))
        return {
            "foreign_cpu_frac": round(foreign / seconds / cores, 4),
            "steal_frac": round((stat[1] - self._stat[1]) / seconds / cores, 4),
            "own_cpu_frac": round((own - self._own) / seconds / cores, 4),
        }


def wait_for_quiet(max_wait: float, threshold: float, window: float = 2.0) -> dict:
    """Wait until other processes use less than ``threshold`` of the machine over ``window`` s (at most max_wait)."""
    start = time.perf_counter()
    last = None
    while True:
        meter = LoadMeter().start()
        if max_wait <= 0:
            break
        time.sleep(window)
        last = meter.stop()["foreign_cpu_frac"]
        if last is None or last < threshold or time.perf_counter() - start >= max_wait:
            break
    return {"quiet_wait_seconds": round(time.perf_counter() - start, 2), "foreign_cpu_frac_before": last}


# =====================================================================================================================
# Worker: runs configurations (imports torch / transformers / trl lazily)
# =====================================================================================================================


def _env_info() -> dict:
    import torch
    import transformers
    import trl

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "torch_num_threads_default": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "parallel_backend": "OpenMP" if "OpenMP" in torch.__config__.parallel_info() else "other",
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")},
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _load_model_and_tokenizer(common):
    import torch

    if common["model"] == "tiny":
        from tiny import make_model, make_tokenizer

        tokenizer = make_tokenizer()
        model = make_model(tokenizer, seed=0)  # deterministic: the same weights in every configuration
        return model, tokenizer, "tiny (tests/tiny.py: random 2-layer Llama, hidden 32, byte tokenizer)"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = common["model"]
    if model_key(name) == "smollm2":
        from a3po_trl.models import resolve_model_path

        name = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    return model, tokenizer, str(name)


def _dataset(common):
    from a3po_trl.tasks import generate_arithmetic_problems

    kwargs = {"system_prompt": None} if common["model"] == "tiny" else {}  # short prompts for the byte tokenizer
    return generate_arithmetic_problems(common["num_prompts"], common["difficulty"], seed=0, **kwargs)


def _reward_funcs(common):
    from a3po_trl.rewards import correctness_reward, format_reward

    funcs = [correctness_reward, format_reward]
    if common["model"] == "tiny":
        from tiny import digit_reward  # a dense signal, so the random tiny model gets non-zero advantages

        funcs.append(digit_reward)
    return funcs


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb(isolation: str) -> tuple[float, str]:
    if isolation == "shared":
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024, "VmHWM after clear_refs reset (shared process)"
        except OSError:
            pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "ru_maxrss of a fresh subprocess"


def _training_args(config, common, output_dir):
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=common["batch_size"],
        num_generations=common["num_generations"],
        max_completion_length=common["max_completion_length"],
        max_steps=common["steps"],
        learning_rate=common["learning_rate"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        bf16=common["bf16"],  # GRPOConfig defaults to bf16=True, which means slow bf16 autocast on most CPUs
        use_cpu=common["device"] == "cpu",
        seed=config["seed"],
        temperature=1.0,
        beta=0.0,
    )
    if config["kind"] == "trl":
        from trl import GRPOConfig

        return GRPOConfig(**kwargs)
    import torch

    from a3po_trl import AsyncA3POConfig

    generation_device = None
    if common["device"] == "cuda" and torch.cuda.device_count() > 1:
        generation_device = "cuda:1"
    threads = config.get("threads", {})
    return AsyncA3POConfig(
        **kwargs,
        prox_logp_method=config["method"],
        max_staleness=config["max_staleness"],
        async_generation=config["async_generation"],
        generation_device=generation_device,
        generation_num_threads=threads.get("generation"),
        training_num_threads=threads.get("training"),
    )


def _timed_grpo_trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer, unchanged, plus timing of its generation and reward calls (logged per step)."""

        def _generate(self, prompts):
            start = time.perf_counter()
            output = super()._generate(prompts)
            self._sync()
            self._metrics["train" if self.model.training else "eval"]["bench/generation_time"].append(
                time.perf_counter() - start
            )
            return output

        def _calculate_rewards(self, *args, **kwargs):
            start = time.perf_counter()
            output = super()._calculate_rewards(*args, **kwargs)
            self._metrics["train" if self.model.training else "eval"]["bench/reward_time"].append(
                time.perf_counter() - start
            )
            return output

        def _sync(self):
            import torch

            if self.accelerator.device.type == "cuda":
                torch.cuda.synchronize(self.accelerator.device)

    return TimedGRPOTrainer


def _make_trainer(config, common, output_dir, callbacks=()):
    model, tokenizer, model_name = _load_model_and_tokenizer(common)
    args = _training_args(config, common, output_dir)
    kwargs = dict(
        model=model,
        reward_funcs=_reward_funcs(common),
        args=args,
        train_dataset=_dataset(common),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    if config["kind"] == "trl":
        trainer = _timed_grpo_trainer_class()(**kwargs)
    else:
        from a3po_trl import AsyncA3POTrainer

        trainer = AsyncA3POTrainer(**kwargs)
    return trainer, model_name


def _step_timer_callback():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """perf_counter at train begin and at the end of every optimizer step."""

        def __init__(self):
            self.begin = None
            self.step_ends = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self._sync()
            self.step_ends.append(time.perf_counter())

        @staticmethod
        def _sync():
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    return StepTimer()


def _per_step_series(log_history, steps: int) -> dict[str, list]:
    series = {name: [None] * steps for name in LOGGED_METRICS}
    for entry in log_history:
        step = entry.get("step")
        if not step or step > steps or "train_runtime" in entry:
            continue
        for name, key in LOGGED_METRICS.items():
            if key in entry and entry[key] is not None:
                series[name][step - 1] = float(entry[key])
    return series


def run_training_config(config, common) -> dict:
    import gc

    import torch

    cuda = common["device"] == "cuda"
    threads = config.get("threads", {})
    if not cuda and threads.get("process"):
        torch.set_num_threads(threads["process"])
    with tempfile.TemporaryDirectory(prefix="a3po-compare-") as output_dir:
        timer = _step_timer_callback()
        trainer, model_name = _make_trainer(config, common, output_dir, callbacks=[timer])
        if cuda:
            for index in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(index)
        quiet = wait_for_quiet(common["quiet_wait"], common["quiet_threshold"])
        meter = LoadMeter().start()
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        load = meter.stop()
        series = _per_step_series(trainer.state.log_history, common["steps"])
        engine = getattr(trainer, "last_generation_engine", None)
        result = {
            "model_name": model_name,
            "train_seconds": wall,
            "step_end_seconds": [t - timer.begin for t in timer.step_ends],
            "series": series,
            "global_step": trainer.state.global_step,
            "torch_threads_after": torch.get_num_threads(),
            **quiet,
            **load,
            "loadavg_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }
        if engine is not None:
            result["engine"] = {
                "produced": engine.produced,
                "consumed": engine.consumed,
                "num_batches": engine.num_batches,
                "queue_bound": engine.queue.maxsize,
                "max_queue_depth": engine.queue.max_depth_seen,
            }
        if cuda:
            result["cuda_peak_allocated_mb"] = {
                f"cuda:{i}": torch.cuda.max_memory_allocated(i) / 2**20 for i in range(torch.cuda.device_count())
            }
        del trainer, engine
        gc.collect()
    return result


def run_microbench(config, common) -> dict:
    """Median seconds of one loglinear proximal computation vs one recompute forward, on the same (B, T) batch."""
    import statistics as stats

    import torch

    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer, approximate_proximal_logps

    cuda = common["device"] == "cuda"
    model, tokenizer, model_name = _load_model_and_tokenizer(common)
    dataset = _dataset(common)
    with tempfile.TemporaryDirectory(prefix="a3po-compare-") as output_dir:
        args = AsyncA3POConfig(
            output_dir=output_dir,
            per_device_train_batch_size=common["batch_size"],
            num_generations=common["num_generations"],
            max_completion_length=common["max_completion_length"],
            max_steps=1,
            report_to="none",
            save_strategy="no",
            bf16=common["bf16"],
            use_cpu=not cuda,
            prox_logp_method="recompute",
        )
        trainer = AsyncA3POTrainer(
            model=model,
            reward_funcs=_reward_funcs(common),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer.model.train()  # as in training (the recompute forward runs while the model is in train mode)
        device = trainer.accelerator.device
        batch, length = common["batch_size"], common["max_completion_length"]
        prompt = tokenizer.apply_chat_template(
            dataset[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        generator = torch.Generator().manual_seed(0)
        vocab = min(len(tokenizer), trainer.model.config.vocab_size)
        completion = torch.randint(0, vocab, (batch, length), generator=generator)
        input_ids = torch.cat([torch.tensor(prompt).expand(batch, -1), completion], dim=1).to(device)
        attention_mask = torch.ones_like(input_ids)
        behavior = (-torch.rand(batch, length, generator=generator) * 5).to(device)
        current = (-torch.rand(batch, length, generator=generator) * 5).to(device)
        staleness = torch.full((batch,), 2, dtype=torch.long, device=device)  # w = 1/2: a real interpolation

        def sync():
            if cuda:
                torch.cuda.synchronize(device)

        def recompute():
            with torch.no_grad():
                trainer._get_per_token_logps_and_entropies(
                    trainer.model, input_ids, attention_mask, length, batch_size=batch
                )
            sync()

        def loglinear():
            approximate_proximal_logps(behavior, current, staleness)
            sync()

        def median_time(fn, reps, warmup):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return stats.median(times), times

        results = []
        quiet = wait_for_quiet(common["quiet_wait"], common["quiet_threshold"])
        for threads in config["thread_counts"]:
            if threads is not None:
                torch.set_num_threads(threads)
            meter = LoadMeter().start()
            recompute_s, recompute_all = median_time(recompute, config["reps"], warmup=2)
            loglinear_s, _ = median_time(loglinear, max(200, config["reps"]), warmup=20)
            results.append(
                {
                    "threads": threads,
                    "recompute_seconds": recompute_s,
                    "recompute_seconds_all": recompute_all,
                    "loglinear_seconds": loglinear_s,
                    "ratio": recompute_s / loglinear_s if loglinear_s > 0 else None,
                    **meter.stop(),
                }
            )
    return {
        "model_name": model_name,
        "batch_shape": [batch, length],
        "prompt_tokens": len(prompt),
        "sequence_tokens": int(input_ids.size(1)),
        "staleness": 2,
        "by_threads": results,
        **quiet,
    }


def run_worker(spec_path: str, out_path: str) -> None:
    sys.path[:0] = [ROOT, TESTS]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    with open(spec_path) as f:
        spec = json.load(f)
    common = spec["common"]
    results = []
    env = None
    for config in spec["configs"]:
        print(f"[compare worker] {config['run_id']}", flush=True)
        if env is None:
            env = _env_info()
        if common["isolation"] == "shared":
            _reset_peak_rss()
        start = time.perf_counter()
        record = {"config": config, "env": env}
        try:
            if config["kind"] == "microbench":
                record["result"] = run_microbench(config, common)
            else:
                record["result"] = run_training_config(config, common)
        except Exception as error:  # noqa: BLE001 - reported, the other configurations still run
            import traceback

            record["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        rss, method = _peak_rss_mb(common["isolation"])
        record["peak_rss_mb"], record["peak_rss_method"] = round(rss, 1), method
        record["worker_seconds"] = time.perf_counter() - start
        results.append(record)
        with open(out_path, "w") as f:  # after every configuration, so a crash keeps what finished
            json.dump(results, f)


# =====================================================================================================================
# Orchestrator
# =====================================================================================================================


def _find_py_spy(options) -> str | None:
    candidates = [options.py_spy, shutil.which("py-spy"), os.path.join(os.path.dirname(sys.executable), "py-spy")]
    return next((c for c in candidates if c and os.path.exists(c)), None)


def _launch(configs, common, options, log_dir, profile_path=None) -> list[dict]:
    """Run ``configs`` in one fresh worker subprocess; returns its records (an error record per missing one)."""
    with tempfile.TemporaryDirectory(prefix="a3po-compare-spec-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"common": common, "configs": configs}, f)
        command = [sys.executable, os.path.abspath(__file__), "--worker", spec_path, "--worker-out", out_path]
        if profile_path is not None:
            py_spy = _find_py_spy(options)
            if py_spy:
                command = [py_spy, "record", "--threads", "--nonblocking", "--rate", "20", "--format", "raw"]
                command += ["-o", profile_path]
                command += ["--", sys.executable, os.path.abspath(__file__), "--worker", spec_path]
                command += ["--worker-out", out_path]
            else:
                print("[compare] py-spy not found: profiling the main thread with cProfile", flush=True)
                command[1:1] = ["-m", "cProfile", "-o", profile_path + ".pstats"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if options.device == "cpu" and options.omp_wait_policy.lower() != "default":
            env.setdefault("OMP_WAIT_POLICY", options.omp_wait_policy)
        log_name = configs[0]["run_id"] if len(configs) == 1 else "shared"
        log_path = os.path.join(log_dir, re.sub(r"[^A-Za-z0-9_.@-]", "_", log_name) + ".log")
        error = None
        with open(log_path, "w") as log:
            try:
                completed = subprocess.run(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=options.config_timeout, cwd=ROOT
                )
                if completed.returncode != 0:
                    error = f"worker exited with status {completed.returncode}"
            except subprocess.TimeoutExpired:
                error = f"worker timed out after {options.config_timeout} s"
        records = []
        if os.path.exists(out_path):
            with open(out_path) as f:
                records = json.load(f)
    if error or len(records) < len(configs):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        done = {r["config"]["run_id"] for r in records}
        for config in configs:
            if config["run_id"] not in done:
                records.append({"config": config, "error": f"{error or 'no result'}; log tail:\n{tail}"})
    return records


def run_plan(plan, common, options, log_dir) -> list[dict]:
    profile = {p.strip() for p in options.profile.split(",") if p.strip()}
    if options.isolation == "shared":
        print(f"[compare] {len(plan)} runs in one shared worker process", flush=True)
        return _launch(plan, common, options, log_dir)
    records, started = [], time.perf_counter()
    for index, config in enumerate(plan, 1):
        profile_path = None
        if config["name"] in profile and config["seed"] == options.seed:
            profile_path = os.path.join(options.out, f"{options.name}-profile-{config['name']}.txt")
        discarded = []
        for attempt in range(options.retries + 1):
            print(f"[compare] ({index}/{len(plan)}) {config['run_id']} attempt {attempt + 1}", flush=True)
            start = time.perf_counter()
            (record,) = _launch([config], common, options, log_dir, profile_path)
            if profile_path is not None:
                record["profile_file"] = profile_path if os.path.exists(profile_path) else profile_path + ".pstats"
            record["subprocess_seconds"] = time.perf_counter() - start
            print(f"[compare]     {_one_line(record)}", flush=True)
            foreign = _foreign(record)
            over_budget = options.budget_minutes and time.perf_counter() - started > 60 * options.budget_minutes
            if foreign is None or foreign <= options.max_foreign or attempt == options.retries or over_budget:
                break
            print(f"[compare]     other processes used {foreign:.0%} of the machine: running it again", flush=True)
            discarded.append({"foreign_cpu_frac": foreign, "error": record.get("error")})
        record["discarded_attempts"] = discarded
        records.append(record)
        _write_partial(records, options, common)
    return records


def _partial_path(options) -> str:
    return os.path.join(options.out, options.name + ".partial.json")


def _write_partial(records, options, common) -> None:
    """The report so far, after every run: an interrupted benchmark resumes from it with --merge-from."""
    now = datetime.datetime.now().isoformat(timespec="seconds")
    report = build_report(records, options, common, now, now)
    with open(_partial_path(options), "w") as f:
        json.dump(report, f)


def _foreign(record) -> float | None:
    result = record.get("result") or {}
    if "by_threads" in result:
        values = [r.get("foreign_cpu_frac") for r in result["by_threads"] if r.get("foreign_cpu_frac") is not None]
        return max(values) if values else None
    return result.get("foreign_cpu_frac")


def _one_line(record) -> str:
    if "error" in record:
        return "ERROR " + record["error"].splitlines()[0]
    result = record["result"]
    if record["config"]["kind"] == "microbench":
        return " ".join(
            f"threads={r['threads']}: recompute {r['recompute_seconds']:.4f} s, loglinear "
            f"{r['loglinear_seconds'] * 1e6:.1f} us, ratio {r['ratio']:.0f}x"
            for r in result["by_threads"]
        )
    return f"train {result['train_seconds']:.1f} s, foreign cpu {result.get('foreign_cpu_frac')}"


# ---------------------------------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------------------------------


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _std(values):
    values = [v for v in values if v is not None]
    return statistics.stdev(values) if len(values) > 1 else None


def summarize_run(record, common, final_window: int) -> dict:
    """Scalar summary of one training run: medians/means over the steps after warm-up."""
    config, result = record["config"], record["result"]
    warmup = common["warmup_steps"]
    ends = result["step_end_seconds"]
    durations = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
    post = list(range(min(warmup, max(len(durations) - 1, 0)), len(durations)))
    series = result["series"]

    def post_values(name):
        return [series[name][i] for i in post if i < len(series[name]) and series[name][i] is not None]

    summary = {
        "name": config["name"],
        "run_id": config["run_id"],
        "kind": config["kind"],
        "method": config.get("method"),
        "max_staleness": config.get("max_staleness"),
        "seed": config["seed"],
        "threads": config.get("threads"),
        "steps_done": len(durations),
        "step_times": durations,
        "step_time_median": _median([durations[i] for i in post]),
        "step_time_mean": _mean([durations[i] for i in post]),
        "train_seconds": result["train_seconds"],
    }
    for name in LOGGED_METRICS:
        summary[name] = _mean(post_values(name))
    summary["staleness_max"] = max((v for v in series["staleness_max"] if v is not None), default=None)
    summary["importance_weight_max"] = max((v for v in series["importance_weight_max"] if v is not None), default=None)
    if config["kind"] == "trl":
        summary["generation_time"] = summary.pop("trl_generation_time")
        summary["reward_time"] = summary.pop("trl_reward_time")
        summary["staleness_mean"], summary["staleness_max"] = 0.0, 0.0  # on-policy by construction
        tokens = [series["completion_mean_length"][i] for i in post]
        gen = [series["trl_generation_time"][i] for i in post]
        per_step = [t * common["batch_size"] / g for t, g in zip(tokens, gen) if t is not None and g]
        summary["generation_tokens_per_second"] = _mean(per_step)
    else:
        summary.pop("trl_generation_time")
        summary.pop("trl_reward_time")
    tokens = [series["completion_mean_length"][i] for i in post]
    if all(t is not None for t in tokens) and post:
        summary["completion_tokens_per_second"] = sum(tokens) * common["batch_size"] / sum(durations[i] for i in post)
    else:
        summary["completion_tokens_per_second"] = None
    rewards = [r for r in series["reward"] if r is not None]
    summary["reward_per_step"] = series["reward"]
    summary["reward_final"] = _mean(rewards[-final_window:]) if rewards else None
    summary["reward_mean_all_steps"] = _mean(rewards)
    summary["peak_rss_mb"] = record.get("peak_rss_mb")
    summary["peak_rss_method"] = record.get("peak_rss_method")
    summary["cuda_peak_allocated_mb"] = result.get("cuda_peak_allocated_mb")
    for key in ("foreign_cpu_frac", "steal_frac", "own_cpu_frac", "quiet_wait_seconds", "foreign_cpu_frac_before"):
        summary[key] = result.get(key)
    summary["engine"] = result.get("engine")
    if config["kind"] == "pieces":
        waits = [series["trainer_wait_time"][i] for i in post]
        summary["generation_piece"] = _median(waits)
        summary["training_piece"] = _median(
            [durations[i] - w for i, w in zip(post, waits) if w is not None and i < len(durations)]
        )
    return summary


AGGREGATED = (
    "step_time_median",
    "step_time_mean",
    "prox_time",
    "generation_time",
    "behavior_logps_time",
    "reward_time",
    "trainer_wait_time",
    "generator_wait_time",
    "weight_sync_time",
    "completion_tokens_per_second",
    "generation_tokens_per_second",
    "peak_rss_mb",
    "staleness_mean",
    "staleness_max",
    "importance_weight_mean",
    "importance_weight_max",
    "importance_weight_masked_frac",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_region",
    "entropy",
    "completion_mean_length",
    "reward_mean_all_steps",
    "foreign_cpu_frac",
    "generation_piece",
    "training_piece",
)


def aggregate(summaries) -> dict[str, dict]:
    """Per configuration name: the mean over seeds of each scalar, and mean/std/values of the final reward."""
    by_name = defaultdict(list)
    for s in summaries:
        by_name[s["name"]].append(s)
    out = {}
    for name, runs in by_name.items():
        first = runs[0]
        entry = {
            "name": name,
            "kind": first["kind"],
            "method": first["method"],
            "max_staleness": first["max_staleness"],
            "threads": first["threads"],
            "seeds": [r["seed"] for r in runs],
        }
        for key in AGGREGATED:
            values = [r.get(key) for r in runs]
            entry[key] = (
                _mean(values) if key != "staleness_max" else max((v for v in values if v is not None), default=None)
            )
        entry["step_time_median_per_seed"] = [r["step_time_median"] for r in runs]
        finals = [r["reward_final"] for r in runs if r["reward_final"] is not None]
        entry["reward_final_mean"] = _mean(finals)
        entry["reward_final_std"] = _std(finals)
        entry["reward_final_values"] = finals
        out[name] = entry
    return out


def pipeline_analysis(configs: dict, staleness) -> dict:
    """Ideal pipelined step time max(generation, training) from the pieces runs vs the async step times."""
    out = {}
    for method in METHODS:
        pieces = configs.get(f"pieces-{method}")
        if not pieces or pieces.get("generation_piece") is None or pieces.get("training_piece") is None:
            continue
        generation, training = pieces["generation_piece"], pieces["training_piece"]
        ideal = max(generation, training)
        entry = {
            "generation_alone": generation,
            "training_alone": training,
            "sequential": generation + training,
            "sequential_measured": pieces["step_time_median"],
            "ideal_pipelined": ideal,
            "bottleneck": "generation" if generation >= training else "training",
            "achieved": {},
        }
        for d in staleness:
            run = configs.get(f"{method}-s{d}")
            if run and run.get("step_time_median"):
                entry["achieved"][str(d)] = {
                    "step_time_median": run["step_time_median"],
                    "ratio_to_ideal": run["step_time_median"] / ideal,
                    "generation_time_side_by_side": run.get("generation_time"),
                    "slowdown_of_generation_side_by_side": (run["generation_time"] or 0) / generation
                    if run.get("generation_time")
                    else None,
                }
        out[method] = entry
    return out


def evaluate_targets(report) -> list[dict]:
    configs, targets = report["configs"], []
    staleness = report["meta"]["staleness"]
    is_smollm2 = report["meta"]["model_key"] == "smollm2"
    micro = report.get("microbench")
    if micro and micro.get("by_threads"):
        for row in micro["by_threads"]:
            targets.append(
                {
                    "target": f"loglinear >= 1000x cheaper than a recompute forward (threads={row['threads']})",
                    "measured": row["ratio"],
                    "met": row["ratio"] is not None and row["ratio"] >= 1000,
                    "note": None if is_smollm2 else "the target is defined for SmolLM2-135M; this model differs",
                }
            )
    trl = configs.get(report["baseline"]) if report.get("baseline") else None
    for d in staleness:
        loglinear, recompute = configs.get(f"loglinear-s{d}"), configs.get(f"recompute-s{d}")
        if d >= 1 and trl and loglinear and loglinear["step_time_median"]:
            speedup = trl["step_time_median"] / loglinear["step_time_median"]
            targets.append(
                {
                    "target": f"loglinear-s{d} >= 1.5x faster per optimizer step than TRL GRPOTrainer "
                    f"(fastest baseline: {trl['name']})",
                    "measured": speedup,
                    "met": speedup >= 1.5,
                    "note": None if speedup >= 1.5 else f"short by {1.5 / speedup:.2f}x",
                }
            )
        if loglinear and recompute and loglinear["step_time_median"]:
            speedup = recompute["step_time_median"] / loglinear["step_time_median"]
            targets.append(
                {
                    "target": f"loglinear-s{d} faster per step than recompute-s{d}",
                    "measured": speedup,
                    "met": speedup > 1.0,
                    "note": None,
                }
            )
    for method, entry in report.get("pipeline", {}).items():
        for d, achieved in entry["achieved"].items():
            if int(d) >= 1:
                ratio = achieved["ratio_to_ideal"]
                targets.append(
                    {
                        "target": f"{method}-s{d} step time within 15% of the ideal pipelined max(gen, train)",
                        "measured": ratio,
                        "met": ratio <= 1.15,
                        "note": None if ratio <= 1.15 else f"{(ratio - 1) * 100:.0f}% above the ideal",
                    }
                )
    for d in staleness:
        comparison = report["reward_comparison"].get(str(d))
        if comparison:
            targets.append(
                {
                    "target": f"final reward of loglinear-s{d} within run-to-run noise of recompute-s{d}",
                    "measured": comparison["difference"],
                    "met": comparison["within_noise"],
                    "note": comparison["note"],
                }
            )
    return targets


def reward_comparison(configs, staleness) -> dict:
    out = {}
    for d in staleness:
        a, b = configs.get(f"loglinear-s{d}"), configs.get(f"recompute-s{d}")
        if not a or not b or a["reward_final_mean"] is None or b["reward_final_mean"] is None:
            continue
        diff = a["reward_final_mean"] - b["reward_final_mean"]
        na, nb = len(a["reward_final_values"]), len(b["reward_final_values"])
        entry = {
            "loglinear_mean": a["reward_final_mean"],
            "loglinear_std": a["reward_final_std"],
            "recompute_mean": b["reward_final_mean"],
            "recompute_std": b["reward_final_std"],
            "n_seeds": [na, nb],
            "difference": diff,
        }
        if na >= 2 and nb >= 2:
            se = math.sqrt((a["reward_final_std"] ** 2) / na + (b["reward_final_std"] ** 2) / nb)
            entry["standard_error"] = se
            entry["within_noise"] = abs(diff) <= 2 * se if se > 0 else diff == 0
            entry["note"] = f"|difference| {abs(diff):.3f} vs 2 x standard error {2 * se:.3f}"
        else:
            entry["within_noise"] = None
            entry["note"] = "one seed: run-to-run noise unknown (use --seeds >= 2)"
        out[str(d)] = entry
    return out


def machine_info() -> dict:
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "cpu_model": None, "memory_gib": None}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def profile_summary(path: str) -> dict | None:
    """Share of py-spy samples per thread and activity (the generation thread is the one running generation.py)."""
    if not path or not os.path.exists(path) or path.endswith(".pstats"):
        return None
    rules = [  # (label, substrings that must all be in the stack), first match wins
        ("wait: generator waits for staleness bound", ("_wait_for_version",)),
        ("wait: queue full", ("put (a3po_trl/generation.py",)),
        ("wait: trainer waits for samples", ("get (a3po_trl/generation.py",)),
        ("recompute forward", ("_take_scored_batch", "_get_per_token_logps_and_entropies")),
        ("batch intake (move, gather, metrics)", ("_take_scored_batch",)),
        ("weight refresh (generator copy)", ("refresh (a3po_trl/generation.py",)),
        ("weight publish", ("_publish_weights",)),
        ("generate", ("generate (",)),
        ("behavior logps", ("per_token_logps_fused",)),
        ("rewards", ("score_completions",)),
        ("rewards", ("_calculate_rewards",)),
        ("backward", ("backward (",)),
        ("optimizer step", ("optimizer",)),
        ("loss forward", ("compute_loss",)),
    ]
    threads = defaultdict(lambda: defaultdict(int))
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            if "generation.py" in stack and "_run (" in stack:
                thread = "generation thread"
            elif "_inner_training_loop" in stack:
                thread = "training (main) thread"
            else:
                thread = "outside training (imports, model loading, other threads)"
            category = next((label for label, needles in rules if all(n in stack for n in needles)), "other")
            threads[thread][category] += int(count)
    out = {}
    for thread, counts in threads.items():
        total = sum(counts.values())
        out[thread] = {
            "samples": total,
            "seconds_at_20hz": total / 20,
            "share": {k: round(v / total, 3) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])},
        }
    return out


def build_report(records, options, common, started, finished) -> dict:
    summaries, errors, microbench = [], [], None
    env = next((r["env"] for r in records if r.get("env")), {})
    model_name = None
    for record in records:
        if "error" in record:
            errors.append({"run_id": record["config"]["run_id"], "error": record["error"]})
            continue
        model_name = model_name or record["result"].get("model_name")
        if record["config"]["kind"] == "microbench":
            microbench = {**record["result"], "peak_rss_mb": record.get("peak_rss_mb")}
            continue
        summary = summarize_run(record, common, options.final_window)
        if record.get("profile_file"):
            summary["profile_file"] = os.path.relpath(record["profile_file"], options.out)
            summary["profile"] = profile_summary(record["profile_file"])
        summary["discarded_attempts"] = record.get("discarded_attempts", [])
        summary["reused_from"] = record.get("reused_from")
        summaries.append(summary)
    configs = aggregate(summaries)
    cpu = options.device == "cpu"
    report = {
        "meta": {
            "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
            "started": started,
            "finished": finished,
            "machine": machine_info(),
            "software": env,
            "model": options.model,
            "model_key": common["model_key"],
            "model_name": model_name,
            "device": options.device,
            "bf16": common["bf16"],
            "batch": {
                "per_device_train_batch_size": options.batch_size,
                "num_generations": options.num_generations,
                "max_completion_length": options.max_completion_length,
                "prompts_per_step": options.batch_size // options.num_generations,
                "steps_per_generation": 1,
            },
            "steps": options.steps,
            "warmup_steps": options.warmup_steps,
            "final_window": options.final_window,
            "learning_rate": options.learning_rate,
            "seeds": sorted({r["config"]["seed"] for r in records}),
            "extra_seeds_for": options.extra_seeds_for,
            "staleness": options.staleness,
            "threads": {
                "trl": (options.sync_threads or os.cpu_count()) if cpu else None,
                "a3po_training": options.training_threads if cpu else None,
                "a3po_generation": options.generation_threads if cpu else None,
                "pieces": options.training_threads if cpu else None,
            },
            "isolation": options.isolation,
            "omp_wait_policy": env.get("env", {}).get("OMP_WAIT_POLICY"),
            "data": f"a3po_trl.tasks.generate_arithmetic_problems({options.num_prompts}, {options.difficulty!r}, "
            "seed=0)" + (", no system prompt" if options.model == "tiny" else ""),
            "rewards": ["correctness_reward", "format_reward"]
            + (["tiny.digit_reward"] if options.model == "tiny" else []),
            "quick": options.quick,
        },
        "configs": configs,
        "runs": summaries,
        "microbench": microbench,
        "errors": errors,
    }
    report["pipeline"] = pipeline_analysis(configs, options.staleness)
    report["reward_comparison"] = reward_comparison(configs, options.staleness)
    baselines = [c for c in configs.values() if c["kind"] == "trl" and c["step_time_median"]]
    trl = min(baselines, key=lambda c: c["step_time_median"]) if baselines else None
    report["baseline"] = trl["name"] if trl else None
    report["speedup_vs_trl"] = {
        name: trl["step_time_median"] / c["step_time_median"]
        for name, c in configs.items()
        if trl and c["step_time_median"]
    }
    report["targets"] = evaluate_targets(report)
    report["records"] = [{k: v for k, v in r.items() if k != "env"} for r in records]  # raw, for --merge-from
    return report


MERGE_KEYS = ("model", "device", "bf16", "steps", "warmup_steps", "batch", "learning_rate", "staleness", "threads")


def merge_previous(records, plan, options) -> tuple[list[dict], list[str]]:
    """Add the runs of ``options.merge_from`` that this invocation did not run, in plan order."""
    with open(options.merge_from) as f:
        previous = json.load(f)
    ran = {r["config"]["run_id"] for r in records}
    reused = []
    for record in previous.get("records", []):
        if record["config"]["run_id"] not in ran and "error" not in record:
            reused.append({**record, "reused_from": os.path.basename(options.merge_from)})
    order = {name: i for i, name in enumerate(config_names(options.staleness, single_thread_trl=True))}
    merged = sorted(records + reused, key=lambda r: (r["config"]["seed"], order.get(r["config"]["name"], 99)))
    return merged, [previous["meta"]["command"]]


def _check_mergeable(previous_meta: dict, report_meta: dict) -> None:
    different = [k for k in MERGE_KEYS if previous_meta.get(k) != report_meta.get(k)]
    if different:
        raise SystemExit(f"--merge-from: the previous report differs in {different}; rerun with the same settings.")


# ---------------------------------------------------------------------------------------------------------------------
# Markdown and PNG
# ---------------------------------------------------------------------------------------------------------------------


def _fmt(value, digits=2, unit=""):
    if value is None:
        return "–"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (int, float)) and abs(value) >= 1000:
        return f"{value:,.0f}{unit}"
    return f"{value:.{digits}f}{unit}"


def _ordered(configs):
    staleness = sorted({c["max_staleness"] or 0 for c in configs.values()})
    order = {name: i for i, name in enumerate(config_names(staleness, single_thread_trl=True))}
    return sorted(configs.values(), key=lambda c: order.get(c["name"], 99))


def write_markdown(report, path: str) -> None:
    meta, lines = report["meta"], []
    batch = meta["batch"]
    lines += [
        f"# AsyncA3POTrainer vs TRL GRPOTrainer — {meta['model_name'] or meta['model']} on {meta['device']}",
        "",
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['machine']['cpu_model']}, {meta['machine']['cpu_count']} cores, "
        f"{meta['machine']['memory_gib']} GiB; torch {meta['software'].get('torch')}, transformers "
        f"{meta['software'].get('transformers')}, trl {meta['software'].get('trl')}",
        f"- Batch: {batch['per_device_train_batch_size']} completions per step ({batch['prompts_per_step']} "
        f"prompt(s) x {batch['num_generations']} generations), up to {batch['max_completion_length']} completion "
        f"tokens, one optimizer step per generation batch; {meta['steps']} steps per run, first "
        f"{meta['warmup_steps']} left out of timings; lr {meta['learning_rate']}; bf16={meta['bf16']}",
        f"- Threads: TRL {meta['threads']['trl']}; AsyncA3PO training {meta['threads']['a3po_training']} + generation "
        f"{meta['threads']['a3po_generation']}; pieces (generation in the main thread) {meta['threads']['pieces']}; "
        f"OMP_WAIT_POLICY={meta['omp_wait_policy']}",
        f"- Seeds: {meta['seeds']} (repeated configurations: {meta['extra_seeds_for']}); isolation: "
        f"{meta['isolation']}; data: {meta['data']}; rewards: {', '.join(meta['rewards'])}",
        "",
        "## Per configuration (means over seeds of per-run values; times in seconds per optimizer step)",
        "",
        f"`vs TRL`: speedup over the fastest synchronous baseline, `{report['baseline']}` (`trl`: TRL GRPOTrainer on "
        f"{meta['threads']['trl']} threads, `trl-t1`: on one thread).",
        "",
        "| config | s/step median | s/step mean | vs TRL | prox | generation | trainer wait | generator wait | "
        "tok/s | gen tok/s | peak RSS MB | staleness mean/max | IW mean/max/masked | clip low/high | "
        "final reward (mean ± sd, n) | foreign CPU |",
        "|" + "---|" * 16,
    ]
    speedups = report["speedup_vs_trl"]
    for c in _ordered(report["configs"]):
        reward = _fmt(c["reward_final_mean"], 3)
        if c["reward_final_std"] is not None:
            reward += f" ± {c['reward_final_std']:.3f}"
        reward += f" (n={len(c['reward_final_values'])})"
        iw = "–"
        if c["importance_weight_mean"] is not None:
            iw = (
                f"{c['importance_weight_mean']:.3f}/{c['importance_weight_max']:.2f}/"
                f"{c['importance_weight_masked_frac']:.3f}"
            )
        clip = "–"
        if c["clip_ratio_low"] is not None:
            clip = f"{c['clip_ratio_low']:.3f}/{c['clip_ratio_high']:.3f}"
        lines.append(
            f"| {c['name']} | {_fmt(c['step_time_median'])} | {_fmt(c['step_time_mean'])} | "
            f"{_fmt(speedups.get(c['name']), 2, 'x')} | "
            f"{_fmt(c['prox_time'], 4)} | {_fmt(c['generation_time'])} | {_fmt(c['trainer_wait_time'])} | "
            f"{_fmt(c['generator_wait_time'])} | {_fmt(c['completion_tokens_per_second'], 1)} | "
            f"{_fmt(c['generation_tokens_per_second'], 1)} | {_fmt(c['peak_rss_mb'], 0)} | "
            f"{_fmt(c['staleness_mean'])}/{_fmt(c['staleness_max'], 0)} | {iw} | {clip} | {reward} | "
            f"{_fmt(c['foreign_cpu_frac'])} |"
        )
    lines += [
        "",
        "`prox`: a3po/prox_time (recompute: the extra no-grad forward; loglinear: the interpolation). `generation`: "
        "generate() per batch (async/generation_time; TRL: its _generate, timed by the benchmark). `tok/s`: "
        "completion tokens trained per second of wall time; `gen tok/s`: completion tokens per second of "
        "generate(). `foreign CPU`: share of the machine used by other processes during the run.",
        "",
    ]
    if report["pipeline"]:
        lines += [
            "## Pipelining: ideal max(generation, training) vs achieved",
            "",
            "| method | generation alone | training alone | sequential | ideal pipelined | bottleneck | "
            + " | ".join(f"s{d}: step (ratio to ideal)" for d in meta["staleness"])
            + " |",
            "|" + "---|" * (6 + len(meta["staleness"])),
        ]
        for method, entry in report["pipeline"].items():
            cells = []
            for d in meta["staleness"]:
                achieved = entry["achieved"].get(str(d))
                cells.append(
                    f"{achieved['step_time_median']:.2f} ({achieved['ratio_to_ideal']:.2f})" if achieved else "–"
                )
            lines.append(
                f"| {method} | {entry['generation_alone']:.2f} | {entry['training_alone']:.2f} | "
                f"{entry['sequential']:.2f} | {entry['ideal_pipelined']:.2f} | {entry['bottleneck']} | "
                + " | ".join(cells)
                + " |"
            )
        lines += [
            "",
            "Generation alone and training alone come from the `pieces-*` runs (async_generation=False, both in the "
            "main thread on the training thread count): generation = rollout + behavior log-probs + rewards, "
            "training = step time minus that. s0 is synchronous by construction (not a pipelining target).",
            "",
        ]
    micro = report.get("microbench")
    if micro:
        lines += [
            f"## Proximal log-probs micro-benchmark: one (B, T) = {tuple(micro['batch_shape'])} batch, "
            f"{micro['sequence_tokens']} tokens per sequence",
            "",
            "| threads | recompute forward (s) | loglinear (s) | ratio |",
            "|---|---|---|---|",
        ]
        for row in micro["by_threads"]:
            lines.append(
                f"| {row['threads']} | {row['recompute_seconds']:.4f} | {row['loglinear_seconds']:.2e} | "
                f"{row['ratio']:,.0f}x |"
            )
        lines.append("")
    if report["reward_comparison"]:
        lines += ["## Final reward: loglinear vs recompute", ""]
        lines.append("| staleness | loglinear | recompute | diff | within noise |")
        lines.append("|---|---|---|---|---|")
        for d, e in report["reward_comparison"].items():
            lines.append(
                f"| {d} | {_fmt(e['loglinear_mean'], 3)} ± {_fmt(e['loglinear_std'], 3)} (n={e['n_seeds'][0]}) | "
                f"{_fmt(e['recompute_mean'], 3)} ± {_fmt(e['recompute_std'], 3)} (n={e['n_seeds'][1]}) | "
                f"{e['difference']:+.3f} | {e['within_noise']} ({e['note']}) |"
            )
        lines.append("")
    lines += ["## Targets", "", "| target | measured | met | note |", "|---|---|---|---|"]
    for t in report["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {_fmt(t['measured'], 3)} | {met} | {t['note'] or ''} |")
    if report["errors"]:
        lines += ["", "## Errors", ""]
        lines += [f"- {e['run_id']}: `{e['error'].splitlines()[0]}`" for e in report["errors"]]
    profiled = [r for r in report["runs"] if r.get("profile")]
    if profiled:
        lines += ["", "## Profiles (py-spy samples, share per thread)", ""]
        for run in profiled:
            for thread, entry in run["profile"].items():
                top = ", ".join(f"{k} {v:.0%}" for k, v in list(entry["share"].items())[:6])
                lines.append(f"- {run['run_id']} — {thread} ({entry['seconds_at_20hz']:.0f} s busy): {top}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in _ordered(report["configs"]) if c["kind"] in ("trl", "a3po")]
    names = [c["name"] for c in configs]
    colors = {"trl": "tab:gray", "recompute": "tab:orange", "loglinear": "tab:blue"}
    bar_colors = [colors["trl"] if c["kind"] == "trl" else colors[c["method"]] for c in configs]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))

    ax = axes[0][0]
    ax.bar(names, [c["step_time_median"] or 0 for c in configs], color=bar_colors)
    for method, entry in report["pipeline"].items():
        ax.axhline(entry["ideal_pipelined"], color=colors[method], linestyle="--", label=f"ideal pipelined ({method})")
        ax.axhline(entry["sequential"], color=colors[method], linestyle=":", label=f"sequential 1 thread ({method})")
    ax.set_ylabel("median s / optimizer step")
    ax.set_title("Step time")
    ax.tick_params(axis="x", rotation=45)
    if report["pipeline"]:
        ax.legend(fontsize=7)

    ax = axes[0][1]
    parts = [("generation_time", "generation"), ("prox_time", "prox log-probs"), ("trainer_wait_time", "trainer wait")]
    parts += [("generator_wait_time", "generator wait")]
    width = 0.2
    for k, (key, label) in enumerate(parts):
        ax.bar(
            [i + (k - 1.5) * width for i in range(len(configs))],
            [c.get(key) or 0 for c in configs],
            width=width,
            label=label,
        )
    ax.set_xticks(range(len(configs)), names, rotation=45)
    ax.set_ylabel("s / step")
    ax.set_title("Where the time goes (per step)")
    ax.legend(fontsize=7)

    ax = axes[1][0]
    means = [c["reward_final_mean"] or 0 for c in configs]
    errs = [c["reward_final_std"] or 0 for c in configs]
    ax.bar(names, means, yerr=errs, color=bar_colors, capsize=3)
    ax.set_ylabel(f"final reward (last {report['meta']['final_window']} steps)")
    ax.set_title("Final reward (mean ± sd over seeds)")
    ax.tick_params(axis="x", rotation=45)

    ax = axes[1][1]
    micro = report.get("microbench")
    if micro:
        labels = [f"{r['threads']} thr" for r in micro["by_threads"]]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], [r["recompute_seconds"] for r in micro["by_threads"]], 0.4, label="recompute")
        ax.bar([x + 0.2 for x in xs], [r["loglinear_seconds"] for r in micro["by_threads"]], 0.4, label="loglinear")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("seconds per proximal computation")
        ax.set_title(f"Proximal log-probs on a {tuple(micro['batch_shape'])} batch")
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    meta = report["meta"]
    fig.suptitle(f"{meta['model_name'] or meta['model']} on {meta['device']}: TRL GRPOTrainer vs AsyncA3POTrainer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict | None:
    options = parse_args(argv)
    if options.worker:
        run_worker(options.worker, options.worker_out)
        return None
    os.makedirs(options.out, exist_ok=True)
    common = common_settings(options)
    plan = build_plan(options)
    if not plan:
        raise SystemExit(f"--configs {options.configs!r} selects no configuration")
    started = datetime.datetime.now().isoformat(timespec="seconds")
    if options.merge_from:  # fail before running anything; resume: skip the runs the previous report already has
        with open(options.merge_from) as f:
            previous = json.load(f)
        _check_mergeable(previous["meta"], build_report([], options, common, started, started)["meta"])
        done = {r["config"]["run_id"] for r in previous.get("records", []) if "error" not in r}
        plan = [config for config in plan if config["run_id"] not in done]
    print(f"[compare] {len(plan)} runs: model={options.model} device={options.device} steps={options.steps}")
    if options.keep_logs:
        log_dir = os.path.join(options.out, "logs", options.name)
        os.makedirs(log_dir, exist_ok=True)
        records = run_plan(plan, common, options, log_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="a3po-compare-logs-") as log_dir:
            records = run_plan(plan, common, options, log_dir)
    finished = datetime.datetime.now().isoformat(timespec="seconds")
    merged_commands = []
    if options.merge_from:
        records, merged_commands = merge_previous(records, plan, options)
    report = build_report(records, options, common, started, finished)
    if options.merge_from:
        report["meta"]["merged_commands"] = merged_commands
    stem = os.path.join(options.out, options.name)
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    write_markdown(report, stem + ".md")
    write_plot(report, stem + ".png")
    report["files"] = {"json": stem + ".json", "markdown": stem + ".md", "png": stem + ".png"}
    if os.path.exists(_partial_path(options)):
        os.remove(_partial_path(options))
    print(f"[compare] wrote {stem}.json, .md, .png", flush=True)
    for error in report["errors"]:
        print(f"[compare] ERROR in {error['run_id']}: {error['error'][:2000]}", flush=True)
    return report


if __name__ == "__main__":
    main()
