"""One training run of the GPU check: build a fresh model and trainer, train, and measure (see :mod:`.figures` and
:mod:`.bound`)."""

from __future__ import annotations

import gc
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import trl
from peft import LoraConfig
from transformers import PrinterCallback

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer

from . import bound, figures, profiling
from . import model as parts

#: The trainers of a pair: name -> (trainer, max_staleness for AsyncA3POTrainer).
TRAINERS = {"a3po-s1": ("AsyncA3POTrainer", 1), "a3po-s0": ("AsyncA3POTrainer", 0), "grpo": ("GRPOTrainer", None)}

#: Called with every run's record as it is finished (the check process writes its partial result with it, so that a
#: check killed at its timeout keeps the runs it finished).
on_record: Callable[[dict], None] | None = None


@dataclass
class Setup:
    """What a check trains: shared by its runs (built once per check process)."""

    cpu: bool
    steps: int
    tokenizer: object
    config: object
    dataset: object
    trace_path: str | None = None
    """Where the run marked ``trace`` writes its torch.profiler trace (None: no trace)."""

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"


@dataclass
class Run:
    """One run: ``kind`` (a key of ``TRAINERS``) on LoRA or full ``weights`` loaded in ``dtype``, with ``settings``
    replacing the shared ones (GRPOConfig/AsyncA3POConfig fields)."""

    name: str
    kind: str
    weights: str
    dtype: torch.dtype
    settings: dict = field(default_factory=dict)
    peaked: bool = False
    steps: int | None = None
    """Optimizer steps (None: the check's ``--steps``)."""
    trace: bool = False
    """Write the torch.profiler trace of a steady step (every thread's ops, and the device's) to the setup's
    ``trace_path``: the run trains one step more, and the traced step is not timed."""


def run_one(run: Run, setup: Setup, output_dir: str | None = None, train_kwargs: dict | None = None) -> dict:
    """Train ``run`` and return what was measured (``error`` set if it crashed: the check's other runs still run).
    ``output_dir``: where the trainer writes (a temporary folder when None); ``train_kwargs``: passed to ``train``."""
    trainer_name, max_staleness = TRAINERS[run.kind]
    steps = run.steps or setup.steps
    trace_path = setup.trace_path if run.trace else None
    steps += 1 if trace_path else 0
    # a steady step: the second to last (the last drains the pipeline); profiled on a GPU for the device's busy time
    profiler = profiling.StepProfiler(steps - 1, cuda=not setup.cpu, trace_path=trace_path)
    untimed = (profiler.step,) if trace_path else ()
    record = {
        "name": run.name,
        "kind": run.kind,
        "trainer": trainer_name,
        "weights": run.weights,
        "model_dtype": str(run.dtype).removeprefix("torch."),
        "mixed_precision": "bf16" if run.settings.get("bf16", True) else "no",
        "planned_steps": steps,
        "max_staleness": run.settings.get("max_staleness", max_staleness),
        "settings": {k: v for k, v in run.settings.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "steps": [],
        "dtypes": {},
        "error": None,
    }
    staleness = f", max_staleness={record['max_staleness']}" if trainer_name == "AsyncA3POTrainer" else ""
    print(
        f"\n== {run.name}: {trainer_name}{staleness}, {run.weights} weights, model loaded in {record['model_dtype']}, "
        f"mixed precision {record['mixed_precision']}{', peaked' if run.peaked else ''}"
        f"{''.join(f', {k}={v}' for k, v in record['settings'].items() if k not in ('bf16', 'max_staleness'))}",
        flush=True,
    )
    recorder = figures.StepRecorder(run.name, setup.device)
    trainer = None
    with tempfile.TemporaryDirectory() as scratch:
        try:
            settings = parts.training_settings(setup.cpu, run.weights, steps, output_dir or scratch)
            if trainer_name == "AsyncA3POTrainer":
                threads = dict(generation_num_threads=1, training_num_threads=1) if setup.cpu else {}
                args = AsyncA3POConfig(**{**settings, "max_staleness": max_staleness, **threads, **run.settings})
                trainer_class = AsyncA3POTrainer
            else:
                args, trainer_class = trl.GRPOConfig(**{**settings, **run.settings}), trl.GRPOTrainer
            peft_config = (
                LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
                if run.weights == "lora"
                else None
            )
            started = time.perf_counter()
            trainer = trainer_class(
                model=parts.build_model(setup.config, run.dtype, setup.device, peaked=run.peaked),
                reward_funcs=[parts.even_digit_reward],  # looked up now: a test may replace it
                args=args,
                train_dataset=setup.dataset,
                processing_class=setup.tokenizer,
                peft_config=peft_config,
            )
            trainer.remove_callback(PrinterCallback)  # StepRecorder prints each step instead of the raw log dicts
            trainer.add_callback(recorder)
            trainer.add_callback(profiler)
            timer = figures.GenerationTimer(trainer) if trainer_name == "GRPOTrainer" else None
            print(f"  built in {time.perf_counter() - started:.1f} s; training {steps} steps", flush=True)
            trainer.train(**(train_kwargs or {}))
            record["final_step"] = trainer.state.global_step
            timed = figures.steady_steps([step["step"] for step in recorder.steps], untimed)
            if trainer_name == "AsyncA3POTrainer":
                measure_a3po(trainer, record, recorder, setup.device, timed)
            else:
                record["time"] = timer.breakdown(recorder.steps, timed)
                record["memory"] = figures.device_memory(recorder.steps, recorder.alloc_retries())
        except Exception as error:  # a crash is a finding: record it and go on with the other runs
            traceback.print_exc()
            record["error"] = f"{type(error).__name__}: {error}"
        finally:
            record["steps"] = recorder.steps
            timed = figures.steady_steps([step["step"] for step in recorder.steps], untimed)
            record["steps_timed"] = timed
            record["seconds_per_step"] = figures.seconds_per_step(recorder.steps, timed)
            record["profile"] = profiler.profile
            measure_bound(record, figures.mean_of(recorder.steps, "thread_cpu_s", timed), not setup.cpu)
            del trainer
            gc.collect()
            if not setup.cpu:
                torch.cuda.empty_cache()
    if on_record is not None:
        on_record(record)
    return record


def measure_bound(record: dict, trainer_cpu: float | None, cuda: bool) -> None:
    """Each thread's CPU seconds per timed step and what bound the step (:func:`.bound.bound_by`), printed."""
    generator_cpu = (
        (record.get("time") or {}).get("generation_thread_cpu") if record["trainer"] != "GRPOTrainer" else None
    )
    device = (record.get("profile") or {}).get("device") or {}
    record["threads"] = {"training_cpu_per_step": trainer_cpu, "generation_cpu_per_step": generator_cpu}
    record["bound"] = bound.bound_by(
        record["seconds_per_step"], trainer_cpu, generator_cpu, device.get("busy_share"), cuda
    )
    shares = ", ".join(f"{key} {value:.2f}" for key, value in record["bound"]["shares"].items() if value is not None)
    print(f"  [{record['name']}] bound by {record['bound']['by']} (share of the step: {shares})", flush=True)


def measure_a3po(trainer, record: dict, recorder, device: str, timed: list[int]) -> None:
    """The figures only AsyncA3POTrainer has: dtypes, memory against the plan, time breakdown over the ``timed``
    steps, weights after a sync, what the generator held; printed as they are measured."""
    name = record["name"]
    producer = trainer.last_batch_producer
    record["dtypes"] = figures.generator_dtypes(trainer)
    for part, summary in record["dtypes"].items():
        print(f"  [{name}] {part}: {summary}", flush=True)
    record["memory"] = figures.memory_figures(trainer, recorder.steps, device, recorder.alloc_retries())
    record["time"] = figures.time_breakdown(trainer.timeline.chrome_trace()["traceEvents"], timed)
    if record["time"]:
        t = record["time"]
        print(
            f"  [{name}] per step over steps {t['steps_timed']}: {t['step']:.3f} s: generation {t['generation']:.3f}, "
            f"training {t['training']:.3f}, weight sync {t['weight_sync']:.3f}, trainer idle {t['trainer_idle']:.3f}, "
            f"generator idle {t['generator_idle']:.3f}; busy: generation thread {t['generation_busy']:.3f}, training "
            f"thread {t['training_busy']:.3f}",
            flush=True,
        )
    backend = producer.backend
    record["staging_sets"] = backend.weights.allocated_sets
    record["kept_versions_at_end"] = backend.kept_versions
    record["batches_produced"] = producer.produced
    record["weights_after_sync"] = figures.weights_after_sync(trainer)
    sync = record["weights_after_sync"]
    if sync is not None:
        print(
            f"  [{name}] weights after sync (version {sync['version']}): identical {sync['identical']}, "
            f"max |diff| {sync['max_abs_diff']:.3g} ({sync['dtypes']})",
            flush=True,
        )
