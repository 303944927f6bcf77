"""What one training run measures: per step (seconds, the main thread's CPU seconds, peak device memory allocated and
reserved, logged values), the time breakdown of the two threads from the trainer's timeline over the steady steps,
the generator's weights against the trainer's after a weight sync, and memory against the memory plan."""

from __future__ import annotations

import time
from collections import Counter

import torch
from transformers import TrainerCallback

from a3po_trl.timeline import BATCH_SPAN, GENERATION_LANE, STEP_SPAN, THREAD_CPU_ARG, TRAINING_LANE
from a3po_trl.timeline.plot import WAITS, _busy, _measure

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
    """Per optimizer step: wall seconds since the previous step ended (the first: since training began), the CPU
    seconds of the main thread (the training thread; GRPOTrainer's only one) in that interval (``time.thread_time``:
    the callbacks run in it), peak device memory allocated and reserved by torch's caching allocator in that interval
    (generation thread included; None on CPU), and the values in ``LOGGED``; printed as each step is logged. Also
    the allocator's retries (``num_alloc_retries``: a cudaMalloc that failed, the cache freed and tried again, a
    synchronizing stall) during the run."""

    def __init__(self, run_name: str, device: str):
        self.run_name, self.device = run_name, device
        self.steps: list[dict] = []
        self._last = None
        self._cpu_last = 0.0
        self._retries_at_start = 0

    def _reset_peak(self):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def on_train_begin(self, args, state, control, **kwargs):
        self._reset_peak()
        self._retries_at_start = self._retries() or 0
        self._last, self._cpu_last = time.perf_counter(), time.thread_time()

    def on_step_end(self, args, state, control, **kwargs):
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the step's kernels are done: its time is its own
        now, cpu = time.perf_counter(), time.thread_time()
        cuda = self.device == "cuda"
        self.steps.append(
            {
                "step": state.global_step,
                "seconds": now - self._last,
                "thread_cpu_s": cpu - self._cpu_last,
                "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            }
        )
        self._reset_peak()
        self._last, self._cpu_last = now, cpu

    def _retries(self) -> int | None:
        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.device == "cuda" else None

    def alloc_retries(self) -> int | None:
        """The caching allocator's retries since training began (None on CPU)."""
        retries = self._retries()
        return None if retries is None else retries - self._retries_at_start

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.steps or self.steps[-1]["step"] != state.global_step or "loss" not in (logs or {}):
            return
        step = self.steps[-1]
        step.update({key: logs[name] for key, name in LOGGED.items() if name in logs})
        print(f"  [{self.run_name}] {format_step(step)}", flush=True)


def format_step(step: dict) -> str:
    parts = [f"step {step['step']}", f"{step['seconds']:.2f} s", f"main thread cpu {step['thread_cpu_s']:.2f} s"]
    if step.get("peak_memory_bytes") is not None:
        parts.append(
            f"peak {step['peak_memory_bytes'] / 2**30:.2f} GiB (reserved {step['peak_reserved_bytes'] / 2**30:.2f})"
        )
    parts.append(f"loss {step.get('loss', float('nan')):.4g}")
    if "behavior_mismatch_mean" in step:
        parts.append(f"mismatch mean {step['behavior_mismatch_mean']:.2e} max {step['behavior_mismatch_max']:.2e}")
    if "staleness_mean" in step:
        parts.append(f"staleness mean {step['staleness_mean']:.2f} max {step['staleness_max']:.0f}")
    if "drift_per_step" in step:
        parts.append(f"drift/step {step['drift_per_step']:.2e}")
    return ", ".join(parts)


def steady_steps(recorded: list[int], untimed: tuple[int, ...] = ()) -> list[int]:
    """The steps timed: the recorded ones but the first (it builds the generator and fills the pipeline), the last
    (with max_staleness >= 1 the generator has nothing left to generate during it: the pipeline drains) and
    ``untimed`` (a step profiled with every op recorded); the steps after the first where that leaves none, and all
    of them where there is one."""
    return [step for step in recorded[1:-1] if step not in untimed] or recorded[1:] or recorded


def mean_of(steps: list[dict], key: str, timed: list[int]) -> float | None:
    """Mean of ``key`` over the recorded steps in ``timed``."""
    values = [step[key] for step in steps if step["step"] in timed and step.get(key) is not None]
    return sum(values) / len(values) if values else None


def seconds_per_step(steps: list[dict], timed: list[int]) -> float | None:
    """Mean wall seconds of the ``timed`` steps."""
    return mean_of(steps, "seconds", timed)


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


def device_memory(steps: list[dict], alloc_retries: int | None) -> dict:
    """A run's peak device memory allocated (tensors) and reserved (what torch's caching allocator holds from CUDA:
    what the device must have), over its steps, and the allocator's retries; None on CPU."""
    allocated = [step["peak_memory_bytes"] for step in steps if step.get("peak_memory_bytes") is not None]
    reserved = [step["peak_reserved_bytes"] for step in steps if step.get("peak_reserved_bytes") is not None]
    return {
        "peak_device_bytes": max(allocated) if allocated else None,
        "peak_reserved_bytes": max(reserved) if reserved else None,
        "num_alloc_retries": alloc_retries,
    }


def memory_figures(trainer, steps: list[dict], device: str, alloc_retries: int | None) -> dict:
    """Peak device memory of the run (:func:`device_memory`) and pinned host bytes, against the memory plan's
    prediction (the model's own weights plus what the plan says the generator and training's pending state add;
    activations and the KV cache are not in it). Measured figures are None on CPU."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    backend = getattr(getattr(trainer, "last_batch_producer", None), "backend", None)
    plan = planned_memory(backend) if backend is not None else None
    measured = device_memory(steps, alloc_retries)
    peak = measured["peak_device_bytes"]
    predicted = model_bytes + plan["device"] if plan is not None else None
    pinned = pinned_host_bytes() if device == "cuda" else None
    return {
        "model_bytes": model_bytes,
        "plan_device_bytes": plan["device"] if plan else None,
        "predicted_device_bytes": predicted,
        **measured,
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


def time_breakdown(events: list[dict], timed: list[int]) -> dict | None:
    """Seconds per optimizer step of an AsyncA3POTrainer run, from its timeline (Chrome trace events), over the
    ``timed`` steps (see :func:`steady_steps`), each from the end of the step before it to its own end: each part of
    ``PARTS``, ``training`` (forward/backward, optimizer step, recompute and reference forwards) and ``weight_sync``
    (publication and load), each thread's busy time (its spans minus its waits), the generation thread's CPU seconds
    (``generation_thread_cpu``: each batch span's, shared out over the steps by when the batch was busy) and the step
    as it was. None when no timed step was recorded."""
    spans = [e for e in events if e.get("ph") == "X"]
    training = [e for e in spans if e["cat"] == TRAINING_LANE]
    generation = [e for e in spans if e["cat"] == GENERATION_LANE]
    ends = {e["args"].get("step"): e for e in training if e["name"] == STEP_SPAN}
    windows = []
    for step in timed:
        if step in ends:
            before = ends.get(step - 1)  # the step before: its end (none recorded, a resumed run's first: its start)
            start = before["ts"] + before["dur"] if before is not None else ends[step]["ts"]
            windows.append((start / 1e6, (ends[step]["ts"] + ends[step]["dur"]) / 1e6))
    if not windows:
        return None
    count = len(windows)

    def per_step(intervals) -> float:
        return sum(_measure(intervals, start, end) for start, end in windows) / count

    per = {part: per_step([_seconds(e) for e in spans if e["name"] in names]) for part, names in PARTS.items()}
    per["training"] = sum(
        per[p] for p in ("forward_backward", "optimizer_step", "recompute_forward", "reference_forward")
    )
    per["weight_sync"] = per["weight_load"] + per["publish_weights"]
    per["training_busy"] = per_step(_busy(training))
    per["generation_busy"] = per_step(_busy(generation))
    per["step"] = sum(end - start for start, end in windows) / count
    per["generation_thread_cpu"] = generation_thread_cpu(generation, windows, count)
    per["steps_timed"] = [step for step in timed if step in ends]
    return per


def _seconds(event: dict) -> tuple[float, float]:
    return event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6


def generation_thread_cpu(generation: list[dict], windows: list[tuple[float, float]], count: int) -> float | None:
    """The generation thread's CPU seconds per step in ``windows``: each batch span's (:data:`THREAD_CPU_ARG`, read in
    that thread), shared out over the windows by the batch's busy time in each (its span minus its waits). None when
    no batch span carries it."""
    batches = [e for e in generation if e["name"] == BATCH_SPAN and THREAD_CPU_ARG in e["args"]]
    if not batches:
        return None
    waits = [e for e in generation if e["name"] in WAITS]
    total = 0.0
    for batch in batches:
        start, end = _seconds(batch)
        busy = _busy([batch] + [w for w in waits if start <= w["ts"] / 1e6 < end])
        length = sum(b - a for a, b in busy)
        if length > 0:
            share = sum(_measure(busy, a, b) for a, b in windows) / length
            total += batch["args"][THREAD_CPU_ARG] * share
    return total / count


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

    def breakdown(self, steps: list[dict], timed: list[int]) -> dict | None:
        """Seconds per step over the ``timed`` steps: ``generation`` (one generation batch per optimizer step, the
        ``k``-th batch for step ``k``) and ``training`` (the step's other seconds)."""
        window = [step for step in steps if step["step"] in timed and step["step"] <= len(self.seconds)]
        if not window:
            return None
        generation = sum(self.seconds[step["step"] - 1] for step in window) / len(window)
        seconds = sum(step["seconds"] for step in window) / len(window)
        timed_steps = [step["step"] for step in window]
        return {
            "generation": generation,
            "training": seconds - generation,
            "step": seconds,
            "steps_timed": timed_steps,
        }
