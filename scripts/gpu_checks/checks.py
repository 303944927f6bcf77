"""The checks of ``scripts/gpu_check.py``: each runs in its own process (see there) and returns its figures, its
runs' records and the requirements it judged (``[sentence, holds]``, see :func:`.verdict.check_failures`)."""

from __future__ import annotations

import os
import platform
import tempfile

import torch

from . import verdict, versions
from .figures import LOGGED
from .model import VOCAB_SIZE, build_model, build_prompts, build_tokenizer, model_config
from .runs import TRAINERS, Run, Setup, run_one

#: Pair checks: name -> (LoRA or full fine-tuning, dtype the model's weights are loaded in); each trains
#: AsyncA3POTrainer at staleness 1 and 0 and stock GRPOTrainer on the same model, data and settings.
PAIRS = {
    "lora-bf16": ("lora", torch.bfloat16),
    "full-bf16": ("full", torch.bfloat16),
    "full-fp32": ("full", torch.float32),
    "lora-fp32": ("lora", torch.float32),
}

#: Largest gradient accumulation the ``balanced`` check picks (each micro-step trains a per-device batch; the
#: generation batch grows with it).
MAX_ACCUMULATION = {"cpu": 4, "cuda": 8}

#: The run whose steady step is traced with torch.profiler (check, run kind): the main case, overlapped.
TRACED_RUN = ("full-bf16", "a3po-s1")
#: Where the traced run writes its trace (set by the check process from ``--trace``; None: no trace).
TRACE_PATH: str | None = None

#: Optimizer steps of the ``peaked`` check's runs: its figure is the mismatch, not the time.
PEAKED_STEPS = 3


def make_setup(cpu: bool, steps: int, size: str | None = None) -> Setup:
    tokenizer = build_tokenizer(VOCAB_SIZE["cpu" if cpu else "gpu"])
    config = model_config(tokenizer, size or ("tiny" if cpu else "full"))
    return Setup(
        cpu=cpu, steps=steps, tokenizer=tokenizer, config=config, dataset=build_prompts(), trace_path=TRACE_PATH
    )


# ---- the checks -----------------------------------------------------------------------------------------------------
def environment(cpu: bool, steps: int) -> dict:
    """The library versions against the windows pyproject.toml declares (first: a version outside its window fails
    the check at once, and the parent skips every other check), the machine; on a GPU plan, that CUDA is there."""
    installed = {}
    for package in ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "vllm"):
        installed[package] = versions.installed_version(package)
    outside = versions.outside_windows()
    if outside:
        for problem in outside:
            print(f"  {problem}", flush=True)
        figures_ = {"versions": installed, "versions_outside_windows": outside}
        return {"environment": figures_, "requirements": [[problem, False] for problem in outside]}
    setup = make_setup(cpu, steps)
    parameters = sum(p.numel() for p in build_model(setup.config, torch.bfloat16, "meta").parameters())
    cuda = torch.cuda.is_available()
    figures_ = {
        "device": "cpu" if cpu else (torch.cuda.get_device_name() if cuda else None),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda and not cpu else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "versions": installed,
        "versions_outside_windows": [],
        "model": "tiny Qwen2 (CPU)" if cpu else "Qwen2.5-0.5B-Instruct architecture, random weights",
        "parameters": parameters,
        "hidden_size": setup.config.hidden_size,
        "num_hidden_layers": setup.config.num_hidden_layers,
        "vocab_size": setup.config.vocab_size,
    }
    print(f"  {figures_}", flush=True)
    requirement = "no CUDA device (torch.cuda.is_available() is False); --cpu runs the CPU plan"
    return {"environment": figures_, "requirements": [[requirement, cpu or cuda]]}


def pair(name: str, cpu: bool, steps: int) -> dict:
    """AsyncA3POTrainer at staleness 1 and 0 and GRPOTrainer, on LoRA or full weights loaded in bf16 or fp32."""
    weights, dtype = PAIRS[name]
    setup = make_setup(cpu, steps)
    runs = [
        run_one(Run(f"{kind}/{name}", kind, weights, dtype, trace=(name, kind) == TRACED_RUN), setup)
        for kind in TRAINERS
    ]
    return {"runs": runs, **compare(runs)}


def compare(runs: list[dict]) -> dict:
    """Each AsyncA3POTrainer run's seconds per step over GRPOTrainer's on the same work (below 1: faster), and over
    the ideal: ``max(generation, training)`` per step of the synchronous run (``a3po-s0``) on the same work, each
    thread's busy seconds there (at staleness 0 the two threads take turns, so neither slows the other down: the
    asynchronous run's own busy times are inflated by the contention of the overlap)."""
    grpo = next((run["seconds_per_step"] for run in runs if run["trainer"] == "GRPOTrainer"), None)
    synchronous = next((run for run in runs if run["kind"] == "a3po-s0"), None)
    timed = (synchronous or {}).get("time") or {}
    generation, training = timed.get("generation_busy"), timed.get("training_busy")
    ideal = max(generation, training) if generation is not None and training is not None else None
    out = {
        "vs_grpo": {},
        "vs_ideal": {},
        "ideal": {
            "seconds_per_step": ideal,
            "from": synchronous["name"] if synchronous else None,
            "generation_busy": generation,
            "training_busy": training,
        },
    }
    for run in runs:
        if run["trainer"] == "AsyncA3POTrainer":
            out["vs_grpo"][run["name"]] = verdict.ratio(run["seconds_per_step"], grpo)
            out["vs_ideal"][run["name"]] = verdict.ratio(run["seconds_per_step"], ideal)
            print(
                f"  {run['name']}: s/step {fmt(run['seconds_per_step'])}, x{fmt(out['vs_grpo'][run['name']])} "
                f"GRPOTrainer's, x{fmt(out['vs_ideal'][run['name']])} the ideal {fmt(ideal)} s (max(generation, "
                f"training) of {out['ideal']['from']})",
                flush=True,
            )
    return out


def balanced(cpu: bool, steps: int) -> dict:
    """A size where training and generation take about the same time, where the overlap pays most: a short
    synchronous run measures both per step; gradient accumulation ``k`` then multiplies the training work per
    generation batch (generation, bound by its token-by-token decoding on a GPU, grows much less), and
    AsyncA3POTrainer at staleness 1 and 0 (the ideal's) runs against GRPOTrainer at that size."""
    setup = make_setup(cpu, steps)
    calibration = run_one(Run("calibration/full-bf16", "a3po-s0", "full", torch.bfloat16, steps=3), setup)
    timed = calibration.get("time") or {}
    generation, training = timed.get("generation"), timed.get("training")
    limit = MAX_ACCUMULATION[setup.device]
    k = max(1, min(limit, round(generation / training))) if generation and training else 1
    print(f"  calibration: generation {fmt(generation)} s, training {fmt(training)} s per step -> accumulation {k}")
    size = {"gradient_accumulation_steps": k}
    runs = [
        run_one(Run(f"{kind}/balanced-x{k}", kind, "full", torch.bfloat16, settings=size), setup) for kind in TRAINERS
    ]
    after = runs[1].get("time") or {}  # the synchronous run at that size: its threads took turns
    balance = verdict.ratio(after.get("generation"), after.get("training"))
    print(f"  generation/training per step at accumulation {k}: {fmt(balance)}", flush=True)
    return {
        "runs": [calibration, *runs],
        "calibration": {"generation": generation, "training": training},
        "gradient_accumulation_steps": k,
        "generation_over_training": balance,
        **compare(runs),
    }


def peaked(cpu: bool, steps: int) -> dict:
    """A confident model (logits scaled to a standard deviation of 6) loaded in fp32, synchronous (staleness 0:
    every token on-policy): with bf16 mixed precision the generator holds bf16 weights while the trainer autocasts
    its fp32 ones, so their log-probs differ by bf16 rounding, visible here; in full precision they agree."""
    setup = make_setup(cpu, steps)
    runs = []
    for precision, bf16 in (("bf16", True), ("fp32", False)):
        name = f"a3po-s0/peaked-{precision}"
        run = Run(name, "a3po-s0", "full", torch.float32, {"bf16": bf16}, peaked=True, steps=PEAKED_STEPS)
        runs.append(run_one(run, setup))
    runs[0]["judge_mismatch"] = False  # the bf16 mismatch is what this check shows, not a fault
    mismatch = {}
    for run, precision in zip(runs, ("bf16", "fp32")):
        means = [s["behavior_mismatch_mean"] for s in run["steps"] if "behavior_mismatch_mean" in s]
        maxima = [s["behavior_mismatch_max"] for s in run["steps"] if "behavior_mismatch_max" in s]
        mismatch[precision] = {"mean": max(means) if means else None, "max": max(maxima) if maxima else None}
    print(f"  generator/trainer mismatch (nats per token, largest step mean and token): {mismatch}", flush=True)
    return {"runs": runs, "mismatch": mismatch}


def reproducible_resume(cpu: bool, steps: int) -> dict:
    """``reproducible_generation`` at staleness 2, four steps with a checkpoint at step 2; then a new trainer resumes
    from that checkpoint to step 4. The resumed steps are compared with the uninterrupted run's (bit for bit on CPU;
    on a GPU kernels may differ run to run, so only reported there)."""
    setup = make_setup(cpu, steps)
    settings = dict(reproducible_generation=True, max_staleness=2, save_strategy="steps", save_steps=2)
    with tempfile.TemporaryDirectory() as output_dir:
        first = run_one(
            Run("a3po-s2/reproducible", "a3po-s1", "full", torch.bfloat16, settings, steps=4),
            setup,
            output_dir=output_dir,
        )
        checkpoint = os.path.join(output_dir, "checkpoint-2")
        resumed = run_one(
            Run("a3po-s2/resumed", "a3po-s1", "full", torch.bfloat16, settings, steps=4),
            setup,
            output_dir=output_dir,
            train_kwargs={"resume_from_checkpoint": checkpoint},
        )
    resumed["resumed_at"] = 2
    logged = {key: [{s["step"]: s.get(key) for s in run["steps"]} for run in (first, resumed)] for key in LOGGED}
    common = [step for step in (3, 4) if step in logged["loss"][0] and step in logged["loss"][1]]
    same = {key: bool(common) and all(a[s] == b[s] for s in common) for key, (a, b) in logged.items()}
    diff = max((abs(logged["loss"][0][s] - logged["loss"][1][s]) for s in common), default=None)
    print(
        f"  resumed at step 2: steps {common} against the uninterrupted run's: rewards identical {same['reward']}, "
        f"losses identical {same['loss']} (max |diff| {fmt(diff)})",
        flush=True,
    )
    requirements = [
        [
            f"a3po-s2/resumed: resumed at step 2 and reached step 4 (final step {resumed.get('final_step')})",
            resumed.get("final_step") == 4 and common == [3, 4],
        ],
        [
            f"a3po-s2/reproducible: held {first.get('staging_sets')} staging sets, more than max_staleness + 2 = 4",
            (first.get("staging_sets") or 0) <= 4,
        ],
        # the same completions (their rewards bit for bit): the resumed batches were generated with the versions the
        # uninterrupted run generated them with, from the same prompts and sampling streams
        ["a3po-s2/resumed: the resumed steps' rewards differ from the uninterrupted run's", same["reward"]],
        [
            "a3po-s2/resumed: the resumed steps' batches were generated by other versions than before the resume",
            same["generator_version"],
        ],
    ]
    warnings = []
    if same["reward"] and not same["loss"]:
        warnings.append(f"a3po-s2/resumed: the same samples, but losses differ by up to {fmt(diff)} after the resume")
    resume = {
        "rewards_identical": same["reward"],
        "generator_versions_identical": same["generator_version"],
        "losses_identical": same["loss"],
        "max_loss_diff": diff,
    }
    return {"runs": [first, resumed], "resume": resume, "requirements": requirements, "warnings": warnings}


def recompute(cpu: bool, steps: int) -> dict:
    """``prox_logp_method="recompute"`` with batches spanning two optimizer steps (``steps_per_generation=2``), where
    the proximal log-probs need a no-grad forward at the batch's second step."""
    setup = make_setup(cpu, steps)
    settings = dict(prox_logp_method="recompute", steps_per_generation=2, gradient_accumulation_steps=1)
    run = run_one(Run("a3po-s1/recompute", "a3po-s1", "full", torch.bfloat16, settings, steps=4), setup)
    seconds = (run.get("time") or {}).get("recompute_forward")
    return {
        "runs": [run],
        "recompute_forward_seconds_per_step": seconds,
        "requirements": [["a3po-s1/recompute: no recompute forward was recorded", bool(seconds)]],
    }


def vllm_colocate(cpu: bool, steps: int) -> dict:
    """Colocated vLLM engine, full weights, bf16 mixed precision (fp32 on CPU, as vLLM's CPU tests), at staleness 0
    (mismatch at every step) and 1 (overlap); its engine's weights are not read back (``weights_after_sync`` null)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    setup = make_setup(cpu, steps, size="tiny-vllm" if cpu else None)
    settings = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, bf16=not cpu)
    if cpu:  # an in-process engine on CPU makes torch.set_num_threads a no-op: OMP_NUM_THREADS sets them instead
        settings.update(generation_num_threads=None, training_num_threads=None)
    dtype = torch.float32 if cpu else torch.bfloat16
    runs = []
    for kind in ("a3po-s0", "a3po-s1"):
        runs.append(run_one(Run(f"{kind}/vllm-colocate", kind, "full", dtype, settings), setup))
        runs[-1]["backend"] = "vllm-colocate"
    return {"runs": runs, **compare(runs)}


def compiled_decode(cpu: bool, steps: int) -> dict:
    """``generate``'s eager decoding against a static cache with a compiled step (CUDA graphs on a GPU, inductor on
    CPU) on this plan's model, in its dtype: per token the calling thread's CPU time and the wall time, and whether
    the greedy tokens and log-probs agree (``benchmarks/compiled_decode.py``, whose CPU measurement dropped that path
    from the generator). Reported, not judged."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks/ is not installed
    from benchmarks.compiled_decode import measure_model

    setup = make_setup(cpu, steps)
    dtype = torch.float32 if cpu else torch.bfloat16
    threads = torch.get_num_threads()
    if cpu:
        torch.set_num_threads(1)  # the ops on the calling thread: its CPU time is theirs
    try:
        with tempfile.TemporaryDirectory(prefix="compiled-decode-") as directory:
            build_model(setup.config, dtype, "cpu").save_pretrained(directory)
            setup.tokenizer.save_pretrained(directory)
            options = SimpleNamespace(device="cpu" if cpu else "cuda", rows=16, new_tokens=16, reps=3, dtype=dtype)
            result = measure_model(directory, options)
    finally:
        torch.set_num_threads(threads)
    result["model"] = "this plan's model (random weights)"
    return {"compiled_decode": result, "requirements": []}


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


#: Every check, in the order they run: name -> (function(cpu, steps) -> result, needs vLLM). A pair's name is its
#: key in ``PAIRS``.
CHECKS = {
    "environment": (environment, False),
    **{name: (lambda cpu, steps, name=name: pair(name, cpu, steps), False) for name in PAIRS},
    "balanced": (balanced, False),
    "peaked": (peaked, False),
    "reproducible-resume": (reproducible_resume, False),
    "recompute": (recompute, False),
    "compiled-decode": (compiled_decode, False),
    "vllm-colocate": (vllm_colocate, True),
}
