"""What one training run measures: per step (seconds, peak device memory, logged values), the time breakdown of the
two threads from the trainer's timeline, the generator's weights against the trainer's after a weight sync, and
memory against the memory plan."""

from __future__ import annotations

import time
from collections import Counter

import torch
from transformers import TrainerCallback

from a3po_trl.timeline import STEP_SPAN, TRAINING_LANE
from a3po_trl.timeline.plot import layout_timeline

#: Logged values recorded per step: the name in the JSON -> the name the trainer logs.
LOGGED = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "reward": "reward",
    "generator_version": "async/generator_version",
    "behavior_mismatch_mean": "a3po/behavior_mismatch_mean",
    "behavior_mismatch_max": "a3po/behavior_mismatch_max",
    "staleness_mean": "a3po/staleness_mean",
    "staleness_max": "a3po/staleness_max",
    "drift_per_step": "a3po/behavior_drift_per_version_mean",
}


class StepRecorder(TrainerCallback):
    """Per optimizer step: wall seconds since the previous step ended (the first: since training began), peak device
    memory allocated in that interval (generation thread included; None on CPU), and the values in ``LOGGED``;
    printed as each step is logged."""

    def __init__(self, run_name: str, device: str):
        self.run_name, self.device = run_name, device
        self.steps: list[dict] = []
        self._last = None

    def _reset_peak(self):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def on_train_begin(self, args, state, control, **kwargs):
        self._reset_peak()
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the step's kernels are done: its time is its own
        now = time.perf_counter()
        peak = torch.cuda.max_memory_allocated() if self.device == "cuda" else None
        self.steps.append({"step": state.global_step, "seconds": now - self._last, "peak_memory_bytes": peak})
        self._reset_peak()
        self._last = now

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.steps or self.steps[-1]["step"] != state.global_step or "loss" not in (logs or {}):
            return
        step = self.steps[-1]
        step.update({key: logs[name] for key, name in LOGGED.items() if name in logs})
        print(f"  [{self.run_name}] {format_step(step)}", flush=True)


def format_step(step: dict) -> str:
    parts = [f"step {step['step']}", f"{step['seconds']:.2f} s"]
    if step.get("peak_memory_bytes") is not None:
        parts.append(f"peak {step['peak_memory_bytes'] / 2**30:.2f} GiB")
    parts.append(f"loss {step.get('loss', float('nan')):.4g}")
    if "behavior_mismatch_mean" in step:
        parts.append(f"mismatch mean {step['behavior_mismatch_mean']:.2e} max {step['behavior_mismatch_max']:.2e}")
    if "staleness_mean" in step:
        parts.append(f"staleness mean {step['staleness_mean']:.2f} max {step['staleness_max']:.0f}")
    if "drift_per_step" in step:
        parts.append(f"drift/step {step['drift_per_step']:.2e}")
    return ", ".join(parts)


def seconds_per_step(steps: list[dict]) -> float | None:
    """Mean seconds of the steps after the first (all of them when there is one)."""
    seconds = [step["seconds"] for step in steps]
    timed = seconds[1:] or seconds
    return sum(timed) / len(timed) if timed else None


# ---- dtypes and weights ---------------------------------------------------------------------------------------------
def dtype_summary(tensors) -> str:
    """``"bfloat16 494M, float32 8.798M"``-style parameter counts per dtype of an iterable of tensors."""
    counts = Counter()
    for tensor in tensors:
        counts[str(tensor.dtype).removeprefix("torch.")] += tensor.numel()
    return ", ".join(f"{dtype} {count / 1e6:.4g}M" for dtype, count in sorted(counts.items())) or "none"


def generate_backend(trainer):
    """The ``generate`` backend of an AsyncA3POTrainer's last ``train()`` (None for vLLM or before training)."""
    backend = getattr(getattr(trainer, "last_batch_producer", None), "backend", None)
    return backend if hasattr(backend, "module") else None


def generator_dtypes(trainer) -> dict[str, str]:
    """Dtypes of the training weights, the generator's copy and the staging buffers of an AsyncA3POTrainer's
    ``generate`` backend (its ``module`` is the generator's copy, its ``weights.layout`` the staging buffers' shapes
    and dtypes); "not found" where a run has none."""
    backend = getattr(getattr(trainer, "last_batch_producer", None), "backend", None)
    module = getattr(backend, "module", None)
    layout = getattr(getattr(backend, "weights", None), "layout", None)
    staging = Counter()
    for name, shape in layout.shapes.items() if layout is not None else []:
        staging[str(layout.dtypes[name]).removeprefix("torch.")] += shape.numel()
    return {
        "training weights": dtype_summary(trainer.model.parameters()),
        "generator copy": dtype_summary(module.parameters()) if module is not None else "not found",
        "staging buffer": (
            ", ".join(f"{dtype} {count / 1e6:.4g}M" for dtype, count in sorted(staging.items())) or "none"
            if layout is not None
            else "not found"
        ),
    }


@torch.no_grad()
def weights_after_sync(trainer) -> dict | None:
    """After ``train()``: load the newest version the trainer published (its weights after the last step) into the
    ``generate`` backend as its generation thread does, and compare every weight the generator copies with the
    trainer's, the trainer's cast to the generator's dtype. When the run published no version after its last step
    (``reproducible_generation`` publishes only the versions a batch is assigned), it is published here through the
    backend's own path. ``identical``: bit for bit (where the dtypes match, the weights themselves; elsewhere the
    trainer's rounded as the staging copy rounds them); ``max_abs_diff``: the largest difference, in the generator's
    dtype. None where the backend is not ``generate``."""
    backend = generate_backend(trainer)
    if backend is None:
        return None
    model = trainer.accelerator.unwrap_model(trainer.model)
    step = trainer.state.global_step
    published_by = "trainer"
    if backend.published_version < step:  # reproducible_generation publishes only versions a batch is assigned
        backend.publish(model, step)  # the trainer's own publication path
        published_by = "check"
    backend.refresh()  # the newest published version, as the generation thread loads it between batches
    training = dict(model.named_parameters())
    own = backend._own  # training-module name -> the generator's own tensor (what each version is loaded into)
    identical, max_diff, dtypes = True, 0.0, Counter()
    for name, generator_weight in own.items():
        trained = training[name].detach().to(generator_weight.device, generator_weight.dtype)
        identical = identical and torch.equal(trained, generator_weight)
        if trained.numel():
            max_diff = max(max_diff, (trained - generator_weight).abs().max().float().item())
        dtypes[f"{str(training[name].dtype).removeprefix('torch.')} -> {str(generator_weight.dtype)[6:]}"] += 1
    return {
        "version": backend.version,
        "published_by": published_by,
        "trainer_step": step,
        "weights": len(own),
        "dtypes": dict(dtypes),
        "identical": identical,
        "max_abs_diff": max_diff,
    }


# ---- memory ---------------------------------------------------------------------------------------------------------
def planned_memory(backend) -> dict | None:
    """What the memory plan predicted for the generator, in bytes: ``{"device": ..., "host": ..., "text": ...}``,
    ``device`` on the generation device (the CPU in a CPU run), ``host`` in host memory beside a GPU (vLLM's pinned
    staging; 0 in a CPU run).

    Read from :class:`~a3po_trl.generation.weights.memory_plan.GeneratorMemoryPlan`: ``device_bytes`` and its
    ``pinned_host_bytes`` (per process), with where it chose to stage the weights."""
    plan = getattr(backend, "memory_plan", None)
    if plan is None:
        return None
    return {
        "device": plan.device_bytes,
        "host": plan.pinned_host_bytes,
        "staging_location": plan.staging_location,
        "text": plan.describe(),
    }


def staged_pinned_bytes(backend) -> int:
    """Page-locked bytes the weight staging holds (registered with ``cudaHostRegister``, one buffer per version, so
    torch's caching host allocator does not see them); 0 when it stages elsewhere."""
    weights = getattr(backend, "weights", None)
    if weights is None or not weights.layout.pin_memory:
        return 0
    return weights.allocated_bytes


def pinned_host_bytes() -> dict | None:
    """Pinned host memory held by torch's caching host allocator (rounded to powers of two as it allocates), now and
    at its peak, and the number of allocations; None without CUDA."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):  # an older torch has no stats
        return None
    stats = torch.cuda.host_memory_stats()
    return {
        "current": stats.get("allocated_bytes.current", 0),
        "peak": stats.get("allocated_bytes.peak", 0),
        "allocations": stats.get("num_host_alloc", 0),
    }


def memory_figures(trainer, steps: list[dict], device: str) -> dict:
    """Peak device memory of the run and pinned host bytes, against the memory plan's prediction (the model's own
    weights plus what the plan says the generator and training's pending state add; activations and the KV cache
    are not in it). Measured figures are None on CPU."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    backend = getattr(getattr(trainer, "last_batch_producer", None), "backend", None)
    plan = planned_memory(backend) if backend is not None else None
    peaks = [step["peak_memory_bytes"] for step in steps if step.get("peak_memory_bytes") is not None]
    peak = max(peaks) if peaks else None
    predicted = model_bytes + plan["device"] if plan is not None else None
    pinned = pinned_host_bytes() if device == "cuda" else None
    return {
        "model_bytes": model_bytes,
        "plan_device_bytes": plan["device"] if plan else None,
        "predicted_device_bytes": predicted,
        "peak_device_bytes": peak,
        "peak_over_predicted": peak / predicted if peak is not None and predicted else None,
        "plan_host_bytes": plan["host"] if plan else None,
        "pinned_host_bytes": (
            pinned["peak"] + staged_pinned_bytes(backend) if pinned is not None and backend is not None else None
        ),
        "pinned_host_allocations": pinned["allocations"] if pinned is not None else None,
        "staging_location": plan["staging_location"] if plan else None,
        "plan": plan["text"] if plan else None,
    }


# ---- time -----------------------------------------------------------------------------------------------------------
#: Parts of a step, by what the timeline calls their spans (both lanes).
PARTS = {
    "generation": ("generation", "behavior log-probs"),
    "rewards": ("rewards",),
    "weight_load": ("weight load", "weight load between turns"),
    "publish_weights": ("publish weights",),
    "forward_backward": ("forward/backward",),
    "optimizer_step": ("optimizer step",),
    "recompute_forward": ("recompute forward",),
    "reference_forward": ("reference forward",),
    "trainer_idle": ("wait for batch",),
    "generator_idle": ("wait for staleness bound", "wait for queue room"),
}


def time_breakdown(events: list[dict]) -> dict | None:
    """Seconds per optimizer step of an AsyncA3POTrainer run, from its timeline (Chrome trace events), over the steps
    after the first (the first builds the generator and fills the pipeline): each part of ``PARTS``, ``training``
    (forward/backward, optimizer step, recompute and reference forwards) and ``weight_sync`` (publication and load),
    each thread's busy time (its spans minus its waits), the step as it was, and the ideal
    ``max(generation busy, training busy)`` a perfect overlap would reach. None when no step was recorded."""
    steps = [e for e in events if e.get("ph") == "X" and e["cat"] == TRAINING_LANE and e["name"] == STEP_SPAN]
    if not steps:
        return None
    window = steps[1:] or steps
    start, end = window[0]["ts"] / 1e6, (window[-1]["ts"] + window[-1]["dur"]) / 1e6
    count = len(window)
    totals = dict.fromkeys(PARTS, 0.0)
    for event in events:
        if event.get("ph") != "X":
            continue
        overlap = min((event["ts"] + event["dur"]) / 1e6, end) - max(event["ts"] / 1e6, start)
        for part, names in PARTS.items():
            if event["name"] in names and overlap > 0:
                totals[part] += overlap
    per_step = {part: seconds / count for part, seconds in totals.items()}
    per_step["training"] = sum(
        per_step[p] for p in ("forward_backward", "optimizer_step", "recompute_forward", "reference_forward")
    )
    per_step["weight_sync"] = per_step["weight_load"] + per_step["publish_weights"]
    overlap = layout_timeline(events, last_steps=count).overlap
    per_step["training_busy"] = overlap.training_busy / count
    per_step["generation_busy"] = overlap.generation_busy / count
    per_step["step"] = overlap.actual / count
    per_step["ideal_step"] = max(overlap.training_busy, overlap.generation_busy) / count
    per_step["step_over_ideal"] = overlap.actual / max(overlap.training_busy, overlap.generation_busy, 1e-9)
    per_step["steps_timed"] = count
    return per_step


class GenerationTimer:
    """Seconds stock GRPOTrainer spends producing its batches (``_generate_and_score_completions``: generation,
    rewards, reference log-probs), in the main thread: the rest of its step is training."""

    def __init__(self, trainer):
        self.seconds: list[float] = []
        original = trainer._generate_and_score_completions

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        trainer._generate_and_score_completions = timed

    def breakdown(self, steps: list[dict]) -> dict | None:
        """Seconds per step after the first: ``generation`` and ``training`` (the step's other seconds)."""
        if len(steps) < 1 or not self.seconds:
            return None
        window = steps[1:] or steps
        generation = sum(self.seconds[len(steps) - len(window) :]) / len(window)
        step = sum(s["seconds"] for s in window) / len(window)
        return {"generation": generation, "training": step - generation, "step": step, "steps_timed": len(window)}
