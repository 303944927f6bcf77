"""The profiled step of a run: ``torch.profiler`` over one steady optimizer step, the device's busy time per stream
from it (:func:`.bound.device_busy`), and the one trace the GPU check keeps."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
import traceback

import torch
from transformers import TrainerCallback

from .bound import device_busy


def experimental_config(all_threads: bool):
    """torch.profiler's options, where this torch has them: ``trace_only`` (``stop`` builds no Python event objects,
    seconds for a step's tens of thousands of kernels: only the exported trace is read) and, with ``all_threads``,
    ``profile_all_threads`` (without it the CPU ops of the profiling thread alone are recorded, not the generation
    thread's)."""
    for options in ({"trace_only": True, "profile_all_threads": all_threads}, {"profile_all_threads": all_threads}):
        try:
            return torch._C._profiler._ExperimentalConfig(**options)
        except (AttributeError, TypeError):  # an older torch: without trace_only, then without either
            continue
    return None


class StepProfiler(TrainerCallback):
    """Profile optimizer step ``step`` with ``torch.profiler`` (both threads' work runs under it): on a GPU the
    device's kernels (``profile["device"]``: :func:`device_busy`, against the step's wall seconds); with
    ``trace_path`` also every thread's ops, the trace written there (``.json.gz``). On CPU without ``trace_path``
    nothing is profiled. A profiler that fails is reported in ``profile["error"]``; the run goes on."""

    def __init__(self, step: int, cuda: bool, trace_path: str | None = None):
        self.step, self.cuda, self.trace_path = step, cuda, trace_path
        self.profile: dict | None = None
        self._profiler = None
        self._started = 0.0

    @property
    def wanted(self) -> bool:
        return self.cuda or self.trace_path is not None

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.wanted or state.global_step + 1 != self.step:
            return
        activities = [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []
        if self.trace_path:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        try:
            config = experimental_config(all_threads=self.trace_path is not None)
            self._profiler = torch.profiler.profile(activities=activities, experimental_config=config)
            self._profiler.start()
            self._started = time.perf_counter()
        except Exception as error:  # noqa: BLE001 - a profiler is a figure, not the run: reported
            self._failed(error)

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is None or state.global_step != self.step:
            return
        profiler, self._profiler = self._profiler, None
        try:
            if self.cuda:
                torch.cuda.current_stream().synchronize()
            wall = time.perf_counter() - self._started
            profiler.stop()
            self.profile = {"step": self.step, "wall_seconds": wall, "trace": None, "error": None}
            if self.trace_path:
                os.makedirs(os.path.dirname(os.path.abspath(self.trace_path)), exist_ok=True)
                profiler.export_chrome_trace(self.trace_path)
                with gzip.open(self.trace_path, "rt") as file:
                    events = json.load(file)["traceEvents"]
                self.profile.update(trace=self.trace_path, trace_bytes=os.path.getsize(self.trace_path))
            else:
                with tempfile.TemporaryDirectory() as folder:
                    path = os.path.join(folder, "step.json")
                    profiler.export_chrome_trace(path)
                    with open(path) as file:
                        events = json.load(file)["traceEvents"]
            if self.cuda:
                busy = device_busy(events)
                busy["busy_share"] = busy["busy_seconds"] / wall if wall > 0 else None
                self.profile["device"] = busy
            print(f"  profiled step {self.step}: {self.describe()}", flush=True)
        except Exception as error:  # noqa: BLE001
            self._failed(error)

    def _failed(self, error: Exception) -> None:
        traceback.print_exc()
        self._profiler = None
        self.profile = {"step": self.step, "error": f"{type(error).__name__}: {error}"}

    def describe(self) -> str:
        profile = self.profile or {}
        parts = [f"{profile.get('wall_seconds', 0.0):.3f} s"]
        device = profile.get("device")
        if device:
            streams = ", ".join(f"stream {s} {seconds:.3f} s" for s, seconds in device["streams"].items())
            parts.append(f"device busy {device['busy_seconds']:.3f} s ({streams})")
        if profile.get("trace"):
            parts.append(f"trace {profile['trace']} ({profile['trace_bytes'] / 2**20:.1f} MiB)")
        return ", ".join(parts)
