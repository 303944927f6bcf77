"""The worker subprocess's side: one configuration's run and its record.

The record holds the configuration, the software versions, the result and the peak memory; the runner
(:mod:`benchmarks.common.runner`) adds when it ran and the machine's load.
"""

from __future__ import annotations

import functools
import os
import platform
import tempfile
import time

from benchmarks.common import internals
from benchmarks.common.machine import LoadMeter, load_average
from benchmarks.common.provenance import run_settings, thread_roles, trainer_threads

from .metrics import per_step_series
from .microbench import run_microbench
from .trainers import make_trainer, step_timer_callback


@functools.cache
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


def _thread_roles(config, trainer, process: int) -> dict:
    """The intra-op threads of each thread of a run, after ``train()``: GRPOTrainer's process only; the asynchronous
    trainer's as ``train()`` set them (without a generation thread when generation runs in the training thread)."""
    if config["kind"] == "trl":
        return thread_roles(process=process)
    roles = trainer_threads(trainer, process)
    if config["kind"] != "a3po":
        roles["generation"] = None
    return roles


def run_training_config(config, common) -> dict:
    import gc

    import torch

    cuda = common["device"] == "cuda"
    threads = config.get("threads", {})
    if not cuda and threads.get("process"):
        torch.set_num_threads(threads["process"])
    process = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="a3po-compare-") as output_dir:
        timer = step_timer_callback()
        trainer, model_name = make_trainer(config, common, output_dir, callbacks=[timer])
        timer.trainer = trainer
        if cuda:
            for index in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(index)
        meter = LoadMeter(children=True).start()  # a generation process (ended with train()) is the run's own CPU
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        load = meter.stop()
        series = per_step_series(trainer.state.log_history, common["steps"])
        producer = internals.batch_producer(trainer)
        result = {
            "model_name": model_name,
            "train_seconds": wall,
            "step_end_seconds": [t - timer.begin for t in timer.step_ends],
            "step_end_trainer_cpu": timer.trainer_cpu,  # the training thread's CPU seconds since train begin
            "step_end_generator_cpu": timer.generator_cpu,  # the generation thread's since it started (or None)
            "overlap_warning": _overlap_warning(trainer),
            # the intra-op thread counts train() set (the user's, or the library's choice: generation/cpu_threads.py)
            "cpu_threads": vars(trainer.cpu_threads) if hasattr(trainer, "cpu_threads") else None,
            "series": series,
            "global_step": trainer.state.global_step,
            "torch_threads_after": torch.get_num_threads(),
            "provenance": run_settings(_thread_roles(config, trainer, process)),  # run_cell moves it up
            **load,
            "loadavg_end": load_average(),
        }
        if config.get("generation_process"):
            import resource

            # the generation process's peak resident memory (the largest of this worker's ended child processes)
            result["generation_process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if producer is not None:
            result["engine"] = internals.producer_counts(producer)  # the records' key
        if cuda:
            result["cuda_peak_allocated_mb"] = {
                f"cuda:{i}": torch.cuda.max_memory_allocated(i) / 2**20 for i in range(torch.cuda.device_count())
            }
        del trainer, producer
        gc.collect()
    return result


def _overlap_warning(trainer):
    """The window the trainer's overlap monitor reported (``{"steps", "step_seconds", "trainer_cpu",
    "generator_cpu"}``), ``False`` when it reported none, None for a trainer without one (GRPOTrainer)."""
    monitor = getattr(trainer, "overlap_monitor", None)
    if monitor is None:
        return None
    if monitor.warned is None:
        return False
    steps, step_seconds, trainer_cpu, generator_cpu = monitor.warned
    figures = {"step_seconds": step_seconds, "trainer_cpu": trainer_cpu, "generator_cpu": generator_cpu}
    return {"steps": list(steps), **figures}


def run_cell(config, common) -> dict:
    """The record of one configuration's run, in this worker subprocess (after other configurations, with
    ``--isolation shared``: the peak memory is then reset before it)."""
    if common["isolation"] == "shared":
        _reset_peak_rss()
    start = time.perf_counter()
    record = {"config": config, "env": _env_info()}
    if config["kind"] == "microbench":
        record["result"] = run_microbench(config, common)
    else:
        record["result"] = run_training_config(config, common)
        record["provenance"] = record["result"].pop("provenance")  # the runner adds when, where and the load
    rss, method = _peak_rss_mb(common["isolation"])
    record["peak_rss_mb"], record["peak_rss_method"] = round(rss, 1), method
    record["worker_seconds"] = time.perf_counter() - start
    return record
