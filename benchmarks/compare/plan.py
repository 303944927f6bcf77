"""The configurations compared, their defaults and the plan: which runs, in which order, with which settings.

Model presets give the batch shape and step count; ``RUN_DEFAULTS`` the run length of ``--quick`` and of a full run.
Each configuration is a plain dict (name, run id, seed, kind, method, staleness bound, thread counts) that travels to
the worker subprocess as JSON; ``common_settings`` are those shared by every configuration.
"""

from __future__ import annotations

import os
import re

DEFAULT_STALENESS = (0, 1, 2, 4)
METHODS = ("recompute", "loglinear")

MODEL_PRESETS = {
    # batch shapes chosen for 2 CPU cores: one optimizer step per generation batch, one group per step for smollm2
    "tiny": dict(batch_size=8, num_generations=4, max_completion_length=16, learning_rate=1e-3, steps=24, quick=8),
    "smollm2": dict(batch_size=8, num_generations=8, max_completion_length=32, learning_rate=1e-5, steps=16, quick=4),
    "other": dict(batch_size=8, num_generations=8, max_completion_length=32, learning_rate=1e-5, steps=16, quick=4),
}


#: Run-length defaults of ``--quick`` and of a full run (the number of steps comes from the model's preset).
RUN_DEFAULTS = {
    "quick": dict(seeds=1, warmup_steps=1, microbench_reps=3, quiet_wait=20.0, max_foreign=1.0),
    "full": dict(seeds=3, warmup_steps=2, microbench_reps=10, quiet_wait=120.0, max_foreign=0.2),
}


def resolve_options(options):
    """Fill in what the command line left to the model's preset and the run mode, and check the result."""
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


def config_names(staleness, single_thread_trl: bool = False, thread_variants=(), process: bool = False) -> list[str]:
    """The configurations; each thread variant (``t1g1``: training 1, generation 1; ``t1``) adds a copy of every
    pieces and asynchronous configuration at those counts (``pieces-loglinear-t1``, ``loglinear-s1-t1g1``);
    ``process`` adds each asynchronous configuration with generation in a process of its own (``generation_process``:
    ``loglinear-s1-proc``, ``loglinear-s1-proc-t1g1``)."""
    names = ["microbench", "trl"] + (["trl-t1"] if single_thread_trl else [])
    for method in ("loglinear", "recompute"):
        names += [f"pieces-{method}"] + [f"pieces-{method}-t{_counts(v)[0]}" for v in thread_variants]
    for d in staleness:  # the two methods side by side at each bound: little drift between the pair compared
        for method in METHODS:
            for base in [f"{method}-s{d}"] + ([f"{method}-s{d}-proc"] if process else []):
                names += [base] + [f"{base}-{v}" for v in thread_variants if _counts(v)[1]]
    return list(dict.fromkeys(names))  # t1 and t1g1 both give pieces-loglinear-t1


THREAD_VARIANT = re.compile(r"^t(\d+)(?:g(\d+))?$")


def _counts(variant: str) -> tuple[int, int | None]:
    """``t2g2`` -> (2, 2), ``t1`` -> (1, None); anything else is refused naming the form."""
    match = THREAD_VARIANT.match(variant)
    if not match:
        raise SystemExit(f"--thread-variants: {variant!r} is not t<training>[g<generation>] (e.g. t1g1, t2)")
    return int(match[1]), int(match[2]) if match[2] else None


def split_variant(name: str) -> tuple[str, tuple[int, int | None] | None]:
    """A configuration name and its thread variant, if it has one (``loglinear-s1-t2g2`` -> ``loglinear-s1``)."""
    head, _, tail = name.rpartition("-")
    if (head.startswith("pieces-") or re.search(r"-s\d+(?:-proc)?$", head)) and THREAD_VARIANT.match(tail):
        return head, _counts(tail)
    return name, None


def build_plan(options) -> list[dict]:
    """The runs, in order: every selected configuration on the first seed, then the repeated ones on the others."""
    plan = []
    variants = [v.strip() for v in options.thread_variants.split(",") if v.strip()]
    process = getattr(options, "generation_process", False)
    names = config_names(options.staleness, _single_thread_trl(options), variants, process)
    names = [n for n in names if _selected(n, options.configs)]
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
    name, variant = split_variant(name)
    training_threads, generation_threads = variant or (options.training_threads, options.generation_threads)
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
            threads={
                "process": sync_threads if cpu else None,
                "training": (training_threads or None) if cpu else None,
            },
        )
    else:
        process = name.endswith("-proc")
        method, staleness = name.removesuffix("-proc").rsplit("-s", 1)
        if process:  # generate in a process of its own, coordinated by the generation thread
            config["generation_process"] = True
        config.update(
            kind="a3po",
            method=method,
            max_staleness=int(staleness),
            async_generation=True,
            # every batch from exactly its scheduled version: a comparison at a staleness compares the method, not
            # the scheduler's timing (and a rerun reproduces the run)
            reproducible_generation=True,
            threads={
                "process": sync_threads if cpu else None,
                "training": (training_threads or None) if cpu else None,
                "generation": (generation_threads or None) if cpu else None,
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
    }


def run_settings(options) -> dict:
    """What a run's result depends on besides its configuration and seed: runs kept under other settings are not
    reused (``RunStore.check_settings``)."""
    threads = {"sync": options.sync_threads, "generation": options.generation_threads}
    threads["training"] = options.training_threads
    if options.thread_variants:
        threads["variants"] = options.thread_variants
    return {
        **common_settings(options),
        "threads": threads,
        "omp_wait_policy": options.omp_wait_policy,
        "microbench_reps": options.microbench_reps,
    }
