"""The training thread never waits for the device at a micro-step (issue 42, item 1).

A host read of a CUDA tensor (``.item()``, ``.tolist()``, ``float(t)``, ``if t:``, boolean-mask indexing,
``nonzero``) or a ``torch.cuda.synchronize`` stops the training thread until the device has run what was queued
before it, the generation thread's kernels included for a device-wide synchronize. On CPU the same calls are counted:
the micro-step (``compute_loss`` and its backward) makes none, and ``log`` reads every metric of the logging step in
one transfer per device and dtype.
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from helpers import logged, make_trainer
from tiny import make_model
from torch.overrides import TorchFunctionMode

import a3po_trl
from a3po_trl.metrics import deferred
from a3po_trl.metrics.deferred import resolve_metrics
from a3po_trl.runtime.timing import DeferredSeconds, IntervalTimer

#: Tensor methods that read a tensor's value on the host (each waits for the device on CUDA).
_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
_LIBRARIES = tuple(os.path.dirname(module.__file__) + os.sep for module in (torch, sys.modules["transformers"]))


def _boolean_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class _CountingHostReads(TorchFunctionMode):
    """Sees every tensor method call (a torch function mode: patching ``torch.Tensor``'s methods would change its C
    slots for the rest of the process, e.g. ``torch.tensor([tensor(1.5)])`` then fails) and counts the host reads."""

    def __init__(self, counts: Counter, skipped: set[int]):
        super().__init__()
        self.counts, self.skipped = counts, skipped

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS or (name == "__getitem__" and _boolean_index(args[1])):
            caller = sys._getframe(1).f_code.co_filename  # the method's caller: C methods add no frame
            if id(args[0]) not in self.skipped and not caller.startswith(_LIBRARIES):
                self.counts["boolean index" if name == "__getitem__" else name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_reads(host_tensors=()):
    """Count the host reads of tensors made by code outside torch and transformers (the model's own forward is not
    this library's), skipping ``host_tensors`` (tensors that live on the host by design); and every
    ``torch.cuda.synchronize``."""
    counts: Counter = Counter()
    synchronize = torch.cuda.synchronize

    def counting_synchronize(*args, **kwargs):
        counts["torch.cuda.synchronize"] += 1

    torch.cuda.synchronize = counting_synchronize
    try:
        with _CountingHostReads(counts, {id(t) for t in host_tensors}):
            yield counts
    finally:
        torch.cuda.synchronize = synchronize


def _micro_batches(trainer):
    """The micro-batches of the first generation batch, as ``_prepare_inputs`` buffers them."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.state.max_steps = trainer.args.max_steps
    try:
        trainer._prepare_inputs(None)
        return list(trainer._buffered_inputs)
    finally:
        trainer._stop_producer()


@pytest.mark.parametrize(
    "method, overrides",
    [
        ("loglinear", {}),
        ("recompute", {"steps_per_generation": 2, "max_staleness": 1}),  # a recompute forward at the first step
        ("metrics", {"steps_per_generation": 2, "max_staleness": 1}),  # and the approximation error against it
        ("behavior", {"beta": 0.1, "loss_type": "grpo"}),  # with a reference KL, GRPOTrainer's clip metrics
    ],
)
def test_a_micro_step_never_reads_the_device(tokenizer, tmp_path, method, overrides):
    make_model(tokenizer).save_pretrained(tmp_path / "model")  # a path: a reference model loads from it too
    model = str(tmp_path / "model")
    trainer = make_trainer(tokenizer, tmp_path, model=model, prox_logp_method=method, **overrides)
    micro_batches = _micro_batches(trainer)
    tags = [batch[key] for batch in micro_batches for key in ("batch_index", "versions_training_batch")]
    for inputs in micro_batches:
        with counting_host_reads(tags) as counts:
            trainer.compute_loss(trainer.model, inputs).backward()
        assert counts == {}, f"host reads of device tensors in a micro-step of {method}: {dict(counts)}"
    if method in ("recompute", "metrics"):
        assert "recomputed_proximal_logps" in micro_batches[1]  # the recompute forward ran, and was counted
    metrics = trainer._metrics["train"]
    kinds = (torch.Tensor, int, float, DeferredSeconds)
    assert all(isinstance(v, kinds) for values in metrics.values() for v in values)

    # log time: every value read at once, one transfer per device and dtype
    stacks = []
    original_stack = torch.stack
    with counting_host_reads() as counts:
        deferred.torch.stack = lambda tensors, *a, **k: stacks.append(len(tensors)) or original_stack(tensors, *a, **k)
        try:
            resolve_metrics(metrics)
        finally:
            deferred.torch.stack = original_stack
    assert counts == {"tolist": len(stacks)} and len(stacks) == 1, (dict(counts), stacks)
    assert all(isinstance(v, (int, float)) for values in metrics.values() for v in values)
    assert len(metrics["a3po/prox_time"]) == len(micro_batches)
    if method == "behavior":
        assert metrics["a3po/prox_time"] == [0.0] * len(micro_batches) and "kl" in metrics
    else:
        assert all(seconds > 0 for seconds in metrics["a3po/prox_time"][:1])


def test_on_a_gpu_trls_fused_lm_head_waits_once_per_training_forward(tokenizer, tmp_path, monkeypatch):
    """Where Triton runs (CUDA), TRL's fused LM head scores only the labelled positions: ``hidden_states[mask]`` and
    ``labels[mask]``, two boolean-mask indexes whose sizes the host must read, per forward chunk
    (``add_fused_lm_head``'s forward in ``trl/trainer/utils.py``). On CPU that path is off, so the count above is 0;
    switched on here (its compaction only: the chunks still take torch's path), the micro-step makes exactly those
    reads and no other: what a first GPU run will show (docs/GPU.md, "No device wait in the training thread"). Fails
    when TRL changes it, either way."""
    import trl.trainer.utils as trl_utils

    trainer = make_trainer(tokenizer, tmp_path, prox_logp_method="loglinear")
    micro_batches = _micro_batches(trainer)
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    forwards = []
    original_forward = trainer.model.forward
    monkeypatch.setattr(trainer.model, "forward", lambda *a, **k: forwards.append(1) or original_forward(*a, **k))
    inputs = micro_batches[0]
    with counting_host_reads([inputs["batch_index"], inputs["versions_training_batch"]]) as counts:
        trainer.compute_loss(trainer.model, inputs).backward()
    assert forwards and counts == {"boolean index": 2 * len(forwards)}, (dict(counts), len(forwards))


def test_the_logged_metrics_are_floats_and_missing_values_are_not_logged(tokenizer, tmp_path):
    """After ``train()`` the history holds floats; a metric without value at a step (the behavior mismatch needs
    on-policy tokens, which a staleness-0 run always has; the drift per version needs stale ones) is left out."""
    trainer = make_trainer(tokenizer, tmp_path, max_steps=2, max_staleness=0, async_generation=False)
    trainer.train()
    assert len(logged(trainer, "a3po/behavior_mismatch_mean")) == 2
    assert logged(trainer, "a3po/behavior_drift_per_version_mean") == []  # no stale token at staleness 0
    for entry in trainer.state.log_history:
        assert all(not isinstance(value, torch.Tensor) for value in entry.values())
    assert all(seconds > 0 for seconds in logged(trainer, "a3po/prox_time"))


def test_resolve_metrics_reads_each_device_and_dtype_once_and_drops_missing_values():
    metrics = defaultdict(list)
    metrics["a"] += [torch.tensor(1.0), torch.tensor(math.nan), 2.0]
    metrics["b"] += [torch.tensor(math.nan)]  # no value at any micro-step: not logged
    metrics["c"] += [torch.tensor(3, dtype=torch.int64), torch.tensor(2.5, dtype=torch.float64)]
    metrics["d"] += [float("nan")]  # GRPOTrainer's own NaN float: left for its log to skip
    metrics["e"] += [DeferredSeconds(0.25)]
    with counting_host_reads() as counts:
        resolve_metrics(metrics)
    assert counts == {"tolist": 3}  # float32, int64, float64
    assert dict(metrics, d=None) == {"a": [1.0, 2.0], "c": [3, 2.5], "d": None, "e": [0.25]}
    assert math.isnan(metrics["d"][0])


class _FakeEvent:
    """A CUDA event on a machine without CUDA: records when it was recorded, and whether it was waited for."""

    clock = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None
        self.waited = False

    def record(self, stream=None):
        _FakeEvent.clock += 1.0
        self.at = _FakeEvent.clock

    def synchronize(self):
        self.waited = True

    def elapsed_time(self, end):
        assert end.waited, "elapsed_time read before the end event was done"
        return (end.at - self.at) * 1000.0  # milliseconds


def test_interval_timer_records_cuda_events_and_reads_them_only_when_logged(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    timer = IntervalTimer()
    with counting_host_reads() as counts:
        for _ in range(2):
            with timer.time(torch.device("cuda", 0)):
                pass
        taken = timer.take()
    assert counts == {}
    assert isinstance(taken, DeferredSeconds) and not any(end.waited for _, end in taken.events)
    assert taken.seconds() == 2.0  # two intervals of one tick each, read after their end events
    assert timer.take() == 0.0  # started again from zero
    with timer.time(torch.device("cpu")):
        pass
    assert isinstance(timer.take(), float)


_TRAINING_PATH = ("losses.py", "training_batch.py", "builders/", "trainer.py", "metrics/", "proximal/")


def test_no_device_wide_synchronize_in_the_training_path():
    """No ``torch.cuda.synchronize`` and no stream synchronize in the training path's source; an event's
    ``synchronize`` only where a logged time is read (:meth:`DeferredSeconds.seconds`)."""
    root = Path(a3po_trl.__file__).parent
    files = [
        path
        for name in _TRAINING_PATH
        for path in ([root / name] if name.endswith(".py") else (root / name).glob("*.py"))
    ]
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        allowed = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef) and function.name == "seconds"
            for node in ast.walk(function)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "synchronize" and id(node) not in allowed:
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
